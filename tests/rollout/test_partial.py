"""Partial rollouts (rollout/partial.py): segments, their behaviour log-probs and ages, the GSPO loss over a
response written by several weight versions, the transformers engine continuing from token ids under new
weights, the pool's checkpoint round trip, and the config's rules."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from gspo_megatron.algorithms import LossNormalisers, packed_batch
from gspo_megatron.algorithms.config import LossConfig
from gspo_megatron.algorithms.losses import gspo_loss
from gspo_megatron.rollout.base import Sample, SamplingParams
from gspo_megatron.rollout.partial import (InFlightResponse, PartialRollouts, Segment, behaviour_logprobs,
                                           continuation_lengths, steps_in_flight, token_ages, token_versions)

SEGMENTS = [Segment((4, 9, 2), (-0.5, -1.25, -0.75), version=3),
            Segment((7, 7), (-2.0, -0.125), version=4),
            Segment((1,), (-0.25,), version=5)]


def test_segments_give_each_token_its_own_behaviour_logprob_version_and_age():
    assert behaviour_logprobs(SEGMENTS).tolist() == [-0.5, -1.25, -0.75, -2.0, -0.125, -0.25]
    assert token_versions(SEGMENTS).tolist() == [3, 3, 3, 4, 4, 5]
    assert token_ages(SEGMENTS, 5).tolist() == [2, 2, 2, 1, 1, 0]
    with pytest.raises(ValueError, match="newer than the training version 4"):
        token_ages(SEGMENTS, 4)
    with pytest.raises(ValueError, match="2 token_ids but 1 logprobs"):
        Segment((1, 2), (-0.1,), version=0)


def test_a_response_grows_by_segments_and_ends_at_a_stop_or_the_limit():
    r = InFlightResponse(uid=0)
    r.extend(Sample(0, [4, 9, 2], [-0.5, -1.25, -0.75], "length"), version=3, max_new_tokens=8)
    assert r.finish_reason is None and len(r) == 3  # the budget ran out: in flight
    r.extend(Sample(0, [7, 7, 1], [-2.0, -0.125, -0.25], "length"), version=4, max_new_tokens=8)
    r.extend(Sample(0, [5, 6, 8], [-1.0, -1.0, -1.0], "stop"), version=5, max_new_tokens=8)
    # the stop token lay beyond the limit: cut at 8 tokens, finished by length
    assert r.finish_reason == "length" and r.token_ids == [4, 9, 2, 7, 7, 1, 5, 6]
    assert [s.version for s in r.segments] == [3, 4, 5]
    with pytest.raises(ValueError, match="extended after it finished"):
        r.extend(Sample(0, [1], [-1.0], "stop"), version=6, max_new_tokens=8)
    s = InFlightResponse(uid=1)
    s.extend(Sample(0, [4, 0], [-0.5, -0.1], "stop"), version=0, max_new_tokens=8)
    assert s.finish_reason == "stop"
    with pytest.raises(ValueError, match="unfinished responses are not trained"):
        InFlightResponse(uid=2).to_sample(0)


def test_a_partial_response_loss_equals_the_closed_form_of_its_segments_behaviour_logprobs():
    """GSPO Eq. 7 over a response of three weight versions: log s = (1/|y|) sum_m sum_{t in S_m}
    (log pi_theta - log pi_{v_m}), through the trainer's own path (Sample -> TrainSequence -> loss with
    pi_old = the engine's log-probs, rollout.logprobs_from: engine)."""
    from gspo_megatron.trainer.loop import _training_sequences

    second = [Segment((3, 3, 8), (-0.3, -0.9, -1.1), version=4), Segment((2, 0), (-0.6, -0.2), version=5)]
    responses = []
    for k, segments in enumerate((SEGMENTS, second)):
        r = InFlightResponse(uid=k, segments=list(segments), finish_reason="stop")
        responses.append(r.to_sample(0))
    prompt = SimpleNamespace(prompt_ids=[11, 12])
    advantages = torch.tensor([[1.0, -0.5]])
    from gspo_megatron.trainer.schedule.base import RolloutGroup

    seqs = _training_sequences([RolloutGroup(prompt, responses, [1.0, 0.0], [True, False])], advantages,
                               with_routing=False)
    old = torch.cat([q.rollout_logprobs for q in seqs])
    current = torch.tensor([-0.49, -1.2, -0.76, -1.9, -0.13, -0.26, -0.31, -0.88, -1.05, -0.61, -0.18],
                           requires_grad=True)
    cfg = LossConfig(algorithm="gspo", clip_low=0.2, clip_high=0.27)
    batch = packed_batch(current, old, cu_seqlens=torch.tensor([0, 6, 11]), advantages=advantages[0])
    loss, _ = gspo_loss(batch, LossNormalisers(num_seqs=2.0, num_tokens=11.0), cfg)

    expected = 0.0
    start = 0
    for segments, a in zip((SEGMENTS, second), (1.0, -0.5)):
        n = sum(len(s.token_ids) for s in segments)
        log_ratio = 0.0
        for s in segments:  # each segment against the log-probs of the version that sampled it
            for lp in s.logprobs:
                log_ratio += float(current[start]) - lp
                start += 1
        ratio = math.exp(log_ratio / n)
        expected += min(ratio * a, min(max(ratio, 0.8), 1.27) * a)
    assert float(loss) == pytest.approx(-expected / 2, rel=1e-6)


def _tiny_engine():
    from gspo_megatron.rollout.hf_engine import HFRolloutEngine
    from tests.rollout.test_hf_engine import teacher_forced_logits, tiny_config

    return HFRolloutEngine(tiny_config("qwen3_moe"), init_seed=0), teacher_forced_logits


def _perturb(model, seed: int) -> None:
    """New weights (a stand-in for a weight sync): every parameter moved by a seeded amount."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def test_the_transformers_engine_continues_unfinished_responses_under_new_weights():
    """Three steps of budget 3 on max_new_tokens 8: a step stops every response at 3 new tokens, the next
    continues it from its token ids under the next weights. Every segment's log-probs are the teacher-forced
    log-probs of the weights of its version, so each token keeps the behaviour policy that drew it; and (R3)
    every segment's routed experts are the ones its own version's weights choose at the positions that
    produced its tokens, stitched after the prompt's prefill record into one replay record per response."""
    from tests.rollout.test_hf_engine import teacher_forced_routes

    eng, teacher_forced = _tiny_engine()
    stop = list(range(0, 96, 19))
    prompts = [SimpleNamespace(index=i, prompt_ids=p) for i, p in enumerate([[5, 17, 3], [40, 41, 42, 43], [9]])]
    pool = PartialRollouts(samples_per_prompt=2, budget=3, max_new_tokens=8, max_staleness=2)
    models, trained = {}, []
    for step in range(4):
        models[step] = {k: v.clone() for k, v in eng.model.state_dict().items()}
        if step < 2:
            pool.add(prompts[step:step + 2] if step == 0 else prompts[2:], first_slot=2 * step, step=step)
        params = SamplingParams(max_new_tokens=8, seed=100 + step, stop_token_ids=stop, prompt_offset=2 * step,
                                return_routed_experts=True)
        pool.generate_round(eng.generate, params, version=step, round_index=0)
        for g in pool.groups:
            for r in g.responses:
                assert r.finish_reason is not None or len(r) % 3 == 0
        finished, _, oldest = pool.take_finished(version=step)
        assert oldest <= 2
        trained += [(g, step) for g in finished]
        _perturb(eng.model, seed=step)
    assert not pool.groups and len(trained) == 3
    spans = [len({s.version for s in r.segments}) for g, _ in trained for r in g.responses]
    assert max(spans) == 3  # some response was written by three weight versions
    current = {k: v.clone() for k, v in eng.model.state_dict().items()}
    stitched_differs = False
    for g, _ in trained:
        for r in g.responses:
            assert r.finish_reason == "stop" or len(r) == 8
            prompt = list(g.prompt.prompt_ids)
            context = list(prompt)
            for s in r.segments:
                eng.model.load_state_dict(models[s.version])
                logits = teacher_forced(eng.model, context, list(s.token_ids))
                expected = logits.log_softmax(-1).gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
                torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=2e-5, rtol=0)
                routes = teacher_forced_routes(eng, context, list(s.token_ids)).to(torch.int32)
                assert torch.equal(s.routed_experts.sort(-1).values, routes.sort(-1).values)
                context += list(s.token_ids)
            sample = r.to_sample(g.slot)
            whole = sample.all_routed_experts()
            assert whole.shape[0] == len(prompt) - 1 + len(r)  # every fed position, prompt then response
            eng.model.load_state_dict(models[r.segments[0].version])
            first = teacher_forced_routes(eng, prompt, list(r.segments[0].token_ids), whole=True).to(torch.int32)
            assert torch.equal(whole[:len(prompt) - 1].sort(-1).values, first[:len(prompt) - 1].sort(-1).values)
            if len(r.segments) > 1:  # the last weights would route the earlier segments otherwise, somewhere
                eng.model.load_state_dict(models[r.segments[-1].version])
                last = teacher_forced_routes(eng, prompt, r.token_ids, whole=True).to(torch.int32)
                stitched_differs |= not torch.equal(whole.sort(-1).values, last.sort(-1).values)
    assert stitched_differs  # so the per-segment records are not what one version's forward gives
    eng.model.load_state_dict(current)


def test_the_pool_round_trips_through_json_exactly():
    eng, _ = _tiny_engine()
    prompts = [SimpleNamespace(index=i, prompt_ids=p) for i, p in enumerate([[5, 17, 3], [40, 41, 42, 43]])]
    pool = PartialRollouts(samples_per_prompt=3, budget=2, max_new_tokens=6, max_staleness=2)
    pool.add(prompts, first_slot=0, step=0)
    pool.generate_round(eng.generate, SamplingParams(max_new_tokens=6, seed=3), version=0, round_index=0)
    state = json.loads(json.dumps(pool.state_dict()))
    again = PartialRollouts(samples_per_prompt=3, budget=2, max_new_tokens=6, max_staleness=2)
    again.load_state_dict(state, prompts)
    assert [(g.prompt.index, g.slot, g.started, g.responses) for g in again.groups] == \
           [(g.prompt.index, g.slot, g.started, g.responses) for g in pool.groups]
    with pytest.raises(ValueError, match="samples_per_prompt=2"):
        PartialRollouts(samples_per_prompt=2, budget=2, max_new_tokens=6, max_staleness=2).load_state_dict(state, prompts)


def test_bounds():
    assert steps_in_flight(8, 4) == 2 and steps_in_flight(8, 3) == 3 and steps_in_flight(8, 8) == 1
    assert continuation_lengths(8, 3) == [3, 2] and continuation_lengths(8, 4) == [4]


def test_config_fields_and_unsupported_combinations_are_refused_by_name():
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.typed_config import ConfigError
    from tests.runs import DEMO

    on = ["rollout.partial=true", "rollout.partial_token_budget=4", "rollout.logprobs_from=engine"]
    cfg = load_config(DEMO, on)
    assert cfg.rollout.partial and cfg.rollout.partial_token_budget == 4
    with pytest.raises(ConfigError, match=r"^rollout\.partial_token_budget: must be in 1\.\.rollout\.max_new_tokens"):
        load_config(DEMO, ["rollout.partial=true", "rollout.logprobs_from=engine"])
    with pytest.raises(ConfigError, match=r"^rollout\.partial_token_budget: 2 lets a response run over 4 steps.*"
                                          r"at least 4 or train\.max_staleness to 3"):
        load_config(DEMO, [*on, "rollout.partial_token_budget=2"])
    load_config(DEMO, [*on, "rollout.partial_token_budget=2", "train.max_staleness=3"])
    with pytest.raises(ConfigError, match=r"^rollout\.logprobs_from: with rollout\.partial"):
        load_config(DEMO, on[:2])
    load_config(DEMO, [*on[:2], "loss.tis_mode=sequence"])  # recompute, corrected by TIS towards the behaviour
    # overlap mode: each round is generated one update behind the step that takes it, so one more update old
    with pytest.raises(ConfigError, match=r"^rollout\.partial_token_budget: 4 lets a response run over 2 steps, so "
                                          r"its first tokens would be 2 updates old \(overlap mode: one more\), beyond "
                                          r"train\.max_staleness=1: raise the budget to at least 8 or train\.max_staleness to 2$"):
        load_config(DEMO, [*on, "train.rollout_mode=overlap", "train.max_staleness=1"])
    assert load_config(DEMO, [*on, "train.rollout_mode=overlap", "train.max_staleness=2"]).train.max_staleness == 2
    # dynamic sampling and R3 compose with partial rollouts (trainer/schedule/partial.py, rollout/partial.py)
    assert load_config(DEMO, [*on, "rollout.filter_groups=zero_variance"]).rollout.filter_groups == "zero_variance"
    assert load_config(DEMO, [*on, "train.routing_replay=r3"]).train.routing_replay == "r3"


def test_a_partial_checkpoint_refuses_another_group_size_on_resume():
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.resume import resume_changes
    from gspo_megatron.typed_config import ConfigError, to_dict
    from tests.runs import DEMO

    on = ["rollout.partial=true", "rollout.partial_token_budget=4", "rollout.logprobs_from=engine"]
    saved = to_dict(load_config(DEMO, on))
    with pytest.raises(ConfigError, match=r"^rollout\.samples_per_prompt: cannot change on resume \(8 in the "
                                          r"checkpoint, 4 now\).*partial responses in flight"):
        resume_changes(saved, to_dict(load_config(DEMO, [*on, "rollout.samples_per_prompt=4"])))
    # without partial rollouts (sync mode) the group size may change
    assert resume_changes(to_dict(load_config(DEMO, [])), to_dict(load_config(DEMO, ["rollout.samples_per_prompt=4"])))
