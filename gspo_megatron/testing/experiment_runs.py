"""What the experiment scripts (examples/experiments/) share: one ``gspo-megatron train`` run in a subprocess
and the metrics it logged."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence


def train_run(config: Path, run_dir: Path, overrides: list[str], env: dict, cwd: Path,
              init_from: Path | None = None) -> float:
    """One ``gspo-megatron train --resume-or-start`` run of ``config`` (a run cut short continues from its
    newest checkpoint, or starts again where it has none); returns its wall time in seconds. A failure raises,
    with the end of its stderr."""
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(config), "--run-dir", str(run_dir),
           "--resume-or-start", *overrides]
    if init_from is not None:
        cmd += ["--init-from", str(init_from)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def read_metrics(run_dir: Path, keys: Sequence[str]) -> dict:
    """{"steps": [...], key: [value per logged step (None where absent)]} from RUN_DIR/metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"steps": [r["step"] for r in records], **{k: [r.get(k) for r in records] for k in keys}}


def write_json(path: Path, data: dict) -> None:
    """``data`` to ``path`` through a temporary file renamed at the end (a results file is never half written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def replace_block(doc: Path, begin: str, end: str, block: str) -> None:
    """Replace the one ``begin`` ... ``end`` block of the page ``doc`` (markers included) by ``block``, through a
    temporary file renamed at the end: the docs' generated numbers come only from a results file."""
    text = doc.read_text()
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"{doc}: needs exactly one {begin} ... {end} block to replace")
    head, rest = text.split(begin)
    tmp = doc.with_name(doc.name + f".tmp.{os.getpid()}")
    tmp.write_text(head + block + rest.split(end, 1)[1])
    os.replace(tmp, doc)


def publish_block(block: str, doc: Path | None, begin: str, end: str) -> None:
    """An experiment report's generated block: printed, and put in place of the page ``doc``'s block (``None``:
    printed only)."""
    if doc is not None:
        replace_block(doc, begin, end, block)
    print(block)


def config_term(config_path: Path, name: str):
    """(the config's one term named ``name``, the policy's tokenizer, train and eval prompt datasets): what a
    script making a scoring model for that config reads (examples/make_demo_*.py)."""
    from gspo_megatron.data.dataset import load_prompt_datasets
    from gspo_megatron.trainer.components import load_tokenizer
    from gspo_megatron.trainer.config import load_config

    config = load_config(config_path)
    (term,) = [t for t in config.rewards.terms if t.name == name]
    tokenizer = load_tokenizer(config.model)
    return (term, tokenizer, *load_prompt_datasets(config.data, tokenizer))


def experiment_parser(description: str, scales: Sequence[str], out: Path, results: Path, figures: Path, doc: Path):
    """The ``run`` / ``report`` command line every experiment script has: ``run --scale --out --results
    [--seeds]`` and ``report --results --figures --doc`` (``--doc -``: print the block only). A script adds its
    own options to the returned parser's ``run`` sub-parser (``parser.run``)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    parser.run = sub.add_parser("run")
    parser.run.add_argument("--scale", choices=sorted(scales), default="full")
    parser.run.add_argument("--out", type=Path, default=out)
    parser.run.add_argument("--results", type=Path, default=results)
    parser.run.add_argument("--seeds", type=int, default=None)
    report = sub.add_parser("report")
    report.add_argument("--results", type=Path, default=results)
    report.add_argument("--figures", type=Path, default=figures)
    report.add_argument("--doc", type=lambda v: None if v == "-" else Path(v), default=doc,
                        help="the page whose generated block to rewrite ('-': print it only)")
    return parser


def load_script(path: Path):
    """A script that is not part of a package (examples/*.py), imported as a module by its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_model_folder(model, tokenizer, result: dict, out: Path, texts: Sequence[str]) -> None:
    """``model``, ``tokenizer`` and ``training.json`` (``result``) into the Hugging Face folder ``out``: written
    beside it and renamed at the end, after checking that the folder's tokenizer, loaded as a scoring term loads
    it (``AutoTokenizer``), gives the ids of ``texts`` that ``tokenizer`` gave in training. transformers 5 may
    load another class than the one saved (it replaces the tokenizer of a ``qwen2`` folder by
    ``Qwen2Tokenizer``, which splits the demo tokenizer's text differently): a model scored on other ids than
    it learned from would score noise."""
    import shutil

    import transformers

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp)
    for text in texts:
        if loaded(text)["input_ids"] != tokenizer(text)["input_ids"]:
            raise SystemExit(f"{out}: the saved folder's tokenizer ({type(loaded).__name__}) splits {text!r} into "
                             f"{loaded(text)['input_ids']}, not the {tokenizer(text)['input_ids']} the model learned")
    (tmp / "training.json").write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
