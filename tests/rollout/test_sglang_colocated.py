"""Colocated memory: a Trainer step with tensor (CUDA IPC-style) sync against the HTTP stand-in
(tests/rollout/sglang_standin.py, NOT SGLang; on CPU the payloads are shared-memory handles). The stand-in
refuses /generate while memory is released and updates outside begin/end_weight_update, like SGLang."""
from pathlib import Path

from gspo_megatron.megatron.spawn import run_distributed

from tests.rollout.sglang_standin import StandinServer, StandinState

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"


def colocated_worker(rank, world_size, run_dir: str, url: str, release: bool) -> list:
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer

    overrides = ["sft.steps=0", "train.steps=1", "logging.console=false", "logging.tensorboard=false",
                 "train.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
                 "train.minibatches_per_step=1", "eval.every_steps=0", "rollout.engine=sglang",
                 f"rollout.sglang.urls=[{url}]", "rollout.sglang.weight_sync=tensor",
                 f"rollout.sglang.release_memory={str(release).lower()}", "rollout.sglang.backoff_s=0.01"]
    trainer = Trainer(load_config(DEMO, overrides), run_dir)
    try:
        for _ in range(2):
            trainer.train_step()
            trainer.step += 1
    finally:
        trainer.close()
    return []


def _events(srv) -> list[str]:
    out = []
    for path, body in srv.state.requests:
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            out.append(f"{path}:{','.join(sorted((body or {}).get('tags') or ['all']))}")
        elif path in ("/generate", "/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor"):
            if not out or out[-1] != path:  # several posts in a row count once
                out.append(path)
    return out


def test_servers_release_memory_while_the_trainer_updates(tmp_path):
    with StandinServer(StandinState(vocab=32)) as srv:
        run_distributed(colocated_worker, 1, (str(tmp_path / "run"), srv.url, True), timeout_s=600)
        events = _events(srv)
    sync = ["/resume_memory_occupation:weights", "/begin_weight_update", "/update_weights_from_tensor",
            "/end_weight_update", "/resume_memory_occupation:cuda_graph,kv_cache"]
    step = ["/generate", "/release_memory_occupation:all", *sync]
    # the Trainer's first sync (nothing released yet: nothing to resume), then two steps
    assert events == sync[1:-1] + step + step, events
    assert not srv.state.released and not srv.state.session_open


def test_release_can_be_switched_off(tmp_path):
    with StandinServer(StandinState(vocab=32)) as srv:
        run_distributed(colocated_worker, 1, (str(tmp_path / "run"), srv.url, False), timeout_s=600)
        assert not [e for e in _events(srv) if "memory" in e]
