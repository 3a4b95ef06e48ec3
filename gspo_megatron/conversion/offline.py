"""Offline conversion: a Hugging Face folder <-> a Megatron torch_dist checkpoint, streaming both ways.

``hf_to_megatron`` writes one layout-free checkpoint (what a single process would save): Megatron loads
it at any TP/PP/EP that divides the model, so the ``--tp/--pp/--ep`` flags only validate divisibility.
``megatron_to_hf`` reads any torch_dist checkpoint of the model (converted, or saved by training at any
layout) and writes size-capped safetensors shards whose headers are planned up front.

Neither direction loads tensors where it can avoid it: each transform is a permutation of rows, so a
converted tensor is a list of byte ranges of the source files, copied in the kernel
(``byte_ranges``; DCP's records are built and located by ``torch_records``). Only what is not a row
permutation of stored bytes is loaded, in 64 MiB batches: a cast (``--dtype``), or chunks that split a
tensor's columns (e.g. a row-parallel layer saved at TP > 1). Memory therefore stays near the 64 MiB
batch; outputs appear under their final name only when complete (temporary sibling folder, renamed at
the end).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from gspo_megatron.conversion import dcp_io
from gspo_megatron.conversion.byte_ranges import canonical_pieces, hf_pieces
from gspo_megatron.conversion.errors import ConversionError, name_list, read_json
from gspo_megatron.conversion.safetensors_io import (INDEX_NAME, SINGLE_NAME, BackgroundWriteback, HFCheckpoint,
                                                     check_declared_dtype,
                                                     SafetensorsWriter, TensorSpec, plan_shards, write_index)
from gspo_megatron.conversion import fp8
from gspo_megatron.conversion.release_formats import ReleaseView, exported_as_fp8, fp8_quantization_config
from gspo_megatron.conversion.tables import Entry, expand, left_out, validate_layout
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.megatron.sharding import stored_layer_keying
from gspo_megatron.models import registry
from gspo_megatron.processes import pid_running

MODEL_CONFIG_NAME = "model_config.json"
HF_FILES_DIR = "hf"  # inside a converted Megatron checkpoint: the HF config/tokenizer files it came with
MTP_DIR = "mtp"  # inside a converted Megatron checkpoint: the multi-token-prediction layers, kept aside
READ_BATCH_BYTES = 64 * 2**20  # canonical tensors read per DCP pass (bounds memory)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
DTYPE_FLAGS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write failing for want of room
# ModelConfig fields a config.json does not describe (Megatron settings kept in the checkpoint's own config)
MEGATRON_ONLY_FIELDS = ("make_vocab_size_divisible_by",)


# ---- output folders and progress ----------------------------------------------------------------

def check_output(out: Path, overwrite: bool, inputs: tuple[Path, ...]) -> None:
    """``out`` may be replaced (``--overwrite``) only when that cannot touch an input: it must neither be,
    contain, nor lie inside an input folder."""
    target = out.resolve()
    for source in inputs:
        src = source.resolve()
        if target == src:
            raise ConversionError(f"{out}: the output folder is an input folder")
        if target in src.parents:
            raise ConversionError(f"{out}: the output folder contains the input {source}; choose an --out outside it")
        if src in target.parents:
            raise ConversionError(f"{out}: the output folder is inside the input {source}; choose an --out outside it")
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConversionError(f"{out}: output folder is not empty (pass --overwrite to replace it)")


@contextlib.contextmanager
def atomic_output(out: Path, overwrite: bool, inputs: tuple[Path, ...]) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces ``out``, on failure it is removed."""
    check_output(out, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(out)}{socket.gethostname()}-{os.getpid()}-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
    except OSError as err:
        shutil.rmtree(tmp)
        if err.filename is None and err.errno in _OUT_OF_SPACE:  # the kernel's error names no file
            raise OSError(f"{out}: {os.strerror(err.errno).lower()} ({errno.errorcode[err.errno]}) while writing the "
                          f"conversion output (its staging folder {tmp.name} was removed)") from err
        raise
    except BaseException:
        shutil.rmtree(tmp)
        raise
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def _staging_prefix(out: Path) -> str:
    return f".{out.name}.incomplete-"


def remove_stale_staging(out: Path) -> list[Path]:
    """Delete the staging folders of ``out`` left by conversions that were killed: named
    ``.<out>.incomplete-<host>-<pid>-*`` with this host and a pid that no longer runs. Returns them."""
    host, removed = socket.gethostname(), []
    for folder in out.parent.glob(_staging_prefix(out) + "*"):
        owner = folder.name[len(_staging_prefix(out)):].rsplit("-", 2)
        if len(owner) != 3 or owner[0] != host or not owner[1].isdigit() or pid_running(int(owner[1])):
            continue
        shutil.rmtree(folder)
        removed.append(folder)
    return removed


def progress_bar(total_bytes: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                mininterval=0.5, dynamic_ncols=True)


def copy_hf_side_files(source: Path, dest: Path) -> list[str]:
    """Copy config, generation config, tokenizer and other non-weight files; returns their names."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and path.name != INDEX_NAME:
            shutil.copyfile(path, dest / path.name)
            copied.append(path.name)
    return copied


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Conversion is copies and I/O: one torch thread. OpenMP workers only contend for the cores; on a
    busy 2-core machine a bf16 ``torch.cat`` of 1.5 MB took 10 ms with 2 threads and 0.15 ms with 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# ---- shared checks -------------------------------------------------------------------------------

def _check_table_matches_model(entries: list[Entry], layout: dcp_io.CheckpointLayout, config: ModelConfig) -> None:
    """Every Megatron parameter is produced by exactly one table entry, and nothing else is."""
    names = [e.megatron for e in entries]
    repeated = {n for n in names if names.count(n) > 1} if len(set(names)) != len(names) else set()
    missing, extra = set(layout.chunks) - set(names), set(names) - set(layout.chunks)
    if repeated or missing or extra:
        raise ConversionError(f"conversion table for {config.architecture} does not match Megatron's parameters: "
                              f"not produced: [{name_list(missing)}]; not parameters: [{name_list(extra)}]; "
                              f"produced twice: [{name_list(repeated)}]")
    hf_names = [h for e in entries for h in e.hf]
    if len(set(hf_names)) != len(hf_names):
        raise ConversionError(f"conversion table for {config.architecture} consumes an HF tensor twice")


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")
_HF_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def check_counts_present(hf: ReleaseView, config: ModelConfig, hf_config: dict, where: Path) -> None:
    """The layer and expert counts of config.json against the tensor names present (``layers.N.``,
    ``experts.N.``; MTP layers left out): a count the weights do not have is refused before anything is
    allocated for it (the table, the layout and the model are built per layer and per expert)."""
    names = [name for name in hf.tensors if not left_out(config, name)]
    layers = {int(m.group(1)) for name in names if (m := _LAYER.search(name))}
    if layers and config.num_layers != max(layers) + 1:
        raise ConversionError(f"{where}: num_hidden_layers={config.num_layers} but the weights hold "
                              f"{max(layers) + 1} layers (layers.0 .. layers.{max(layers)})")
    experts = {int(m.group(1)) for name in names if (m := _EXPERT.search(name))}
    if experts and config.num_experts != max(experts) + 1:
        key = next((k for k in _HF_EXPERT_KEYS if k in hf_config), "num_experts")
        raise ConversionError(f"{where}: {key}={config.num_experts} but the weights hold {max(experts) + 1} "
                              f"experts per layer (experts.0 .. experts.{max(experts)})")


_MEGATRON_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")
_MEGATRON_STACKED = re.compile(r"(?:^|\.)decoder\.layers\.[a-z_]")
_MEGATRON_ROUTER = re.compile(r"(?:^|\.)decoder\.layers\.(?:\d+\.)?mlp\.router\.weight$")


def check_checkpoint_counts(keys: dict[str, tuple[tuple[int, ...], torch.dtype]], config: ModelConfig,
                            where: Path) -> None:
    """The model config's layer and expert counts against a Megatron checkpoint's tensors (``keys``: name ->
    (global shape, dtype)): layers from ``decoder.layers.N.`` keys or the leading dimension of stacked ones,
    experts from the router's rows. The export twin of ``check_counts_present``: a count the checkpoint does
    not hold is refused before anything is built per layer or per expert."""
    per_layer = {int(m.group(1)) for key in keys if (m := _MEGATRON_LAYER.search(key))}
    stacked = {shape[0] for key, (shape, _) in keys.items() if _MEGATRON_STACKED.search(key)}
    layers = max(per_layer) + 1 if per_layer else max(stacked, default=None)
    if layers is not None and config.num_layers != layers:
        raise ConversionError(f"{where}: the model config's num_layers={config.num_layers} but the checkpoint holds "
                              f"{layers} layers")
    experts = {shape[-2] for key, (shape, _) in keys.items() if _MEGATRON_ROUTER.search(key)}
    if experts and {config.num_experts} != experts:
        raise ConversionError(f"{where}: the model config's num_experts={config.num_experts} but the checkpoint's "
                              f"routers score {sorted(experts)} experts")


def _hf_specs(entry: Entry, chunk: dcp_io.Chunk, dtype: torch.dtype) -> list[TensorSpec]:
    shapes = entry.transform.hf_shapes(chunk.shape)
    return [TensorSpec(name, tuple(shape), dtype) for name, shape in zip(entry.hf, shapes)]


# ---- HF -> Megatron ------------------------------------------------------------------------------

def _check_hf_tensors(hf: ReleaseView, entries: list[Entry], layout: dcp_io.CheckpointLayout,
                      config: ModelConfig) -> dict[str, torch.dtype]:
    """Names, shapes and dtypes of the HF tensors against the table; returns each entry's dtype."""
    expected = {h for e in entries for h in e.hf}
    present = {name for name in hf.tensors if not left_out(config, name)}
    if expected - present:
        raise ConversionError(f"{hf.directory}: tensors the {config.architecture} config needs are missing: "
                              f"{name_list(expected - present)}")
    if present - expected:
        hint = " (config.json says tie_word_embeddings=true)" if "lm_head.weight" in present - expected else ""
        raise ConversionError(f"{hf.directory}: unexpected tensors, not consumed by the {config.architecture} "
                              f"table for this config.json{hint}: {name_list(present - expected)}")
    dtypes: dict[str, torch.dtype] = {}
    key_dtype: dict[str, tuple[torch.dtype, str]] = {}
    for entry in entries:
        chunk = layout.chunks[entry.megatron]
        for name, shape in zip(entry.hf, entry.transform.hf_shapes(chunk.shape)):
            stored = hf.tensors[name]
            if stored.spec.shape != tuple(shape):
                raise ConversionError(f"{stored.path}: {name}: shape {list(stored.spec.shape)} does not match "
                                      f"config.json (expected {list(shape)})")
        kinds = {hf.tensors[name].spec.dtype for name in entry.hf}
        if len(kinds) > 1:
            raise ConversionError(f"{hf.directory}: {', '.join(entry.hf)}: mixed dtypes {sorted(map(str, kinds))} "
                                  f"cannot be fused into {entry.megatron}")
        dtype = kinds.pop()
        first = key_dtype.setdefault(chunk.key, (dtype, entry.hf[0]))
        if first[0] != dtype:
            raise ConversionError(f"{hf.directory}: {entry.hf[0]} is {dtype} but {first[1]} is {first[0]}; "
                                  f"both go into {chunk.key}, which has one dtype")
        dtypes[entry.megatron] = dtype
    return dtypes


def hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                   expert_parallel: int = 1, overwrite: bool = False, progress: bool = True,
                   make_vocab_size_divisible_by: int | None = None) -> Path:
    """Convert a Hugging Face folder into a torch_dist checkpoint loadable at any dividing layout.

    The output holds Megatron's files plus ``model_config.json`` (the ModelConfig derived from
    config.json), ``gspo_meta.json`` (read by ``megatron/checkpoint.read_meta``) and ``hf/`` (config,
    generation config and tokenizer files, the default template for the way back).
    """
    with one_intra_op_thread():
        return _hf_to_megatron(Path(hf_dir), Path(out_dir), tensor_parallel, pipeline_parallel, expert_parallel,
                               overwrite, progress, make_vocab_size_divisible_by)


def _hf_to_megatron(hf_dir: Path, out: Path, tensor_parallel: int, pipeline_parallel: int, expert_parallel: int,
                    overwrite: bool, progress: bool, make_vocab_size_divisible_by: int | None) -> Path:
    config = ModelConfig.from_hf_dir(hf_dir)
    if make_vocab_size_divisible_by is not None:
        config = dataclasses.replace(config, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
        config.validate("hf_to_megatron")
    validate_layout(config, tensor_parallel, pipeline_parallel, expert_parallel, source=str(hf_dir / "config.json"))
    check_output(out, overwrite, (hf_dir,))
    with HFCheckpoint(hf_dir) as stored:
        hf_config = read_json(hf_dir / "config.json")
        hf = ReleaseView(stored, config, hf_config)
        # from the headers alone, before the table, the layout or any model is built at the config's sizes
        check_counts_present(hf, config, hf_config, hf_dir / "config.json")
        entries = expand(config)
        padded_vocab = config.padded_vocab_size(tensor_parallel)
        with dcp_io.single_process_megatron():
            layout = dcp_io.checkpoint_layout(config, padded_vocab)
        _check_table_matches_model(entries, layout, config)
        dtypes = _check_hf_tensors(hf, entries, layout, config)
        check_declared_dtype(hf)
        mtp = [name for name in hf.tensors if left_out(config, name)]
        # read each source file front to back
        ordered = sorted(entries, key=lambda e: hf.location(e.hf[0]))
        planned = [_planned_chunk(hf, e, layout.chunks[e.megatron], dtypes[e.megatron]) for e in ordered]
        total = sum(hf.tensors[h].spec.nbytes for h in hf.tensors)
        with atomic_output(out, overwrite, (hf_dir,)) as tmp:
            with progress_bar(total, "hf -> megatron", progress) as bar:
                dcp_io.write_checkpoint(tmp, planned, layout.objects, bar.update)
                if mtp:
                    _keep_mtp_aside(hf, mtp, tmp / MTP_DIR, bar.update)
            _write_json(tmp / MODEL_CONFIG_NAME, dataclasses.asdict(config))
            _write_json(tmp / "gspo_meta.json", {"model_config": dataclasses.asdict(config), "kind": "hf-to-megatron",
                                                 "source": str(hf_dir.resolve()), "source_formats": hf.formats,
                                                 "mtp_tensors": len(mtp),
                                                 **dcp_io.vocab_padding_meta(config, tensor_parallel)})
            copy_hf_side_files(hf_dir, tmp / HF_FILES_DIR)
            if hf.index is not None:  # the shard assignment, reused on the way back
                shutil.copyfile(hf_dir / INDEX_NAME, tmp / HF_FILES_DIR / INDEX_NAME)
    return out


def _keep_mtp_aside(hf: ReleaseView, names: list[str], folder: Path, on_write) -> None:
    """The multi-token-prediction layers as they were (dequantized, per expert), in one safetensors file:
    Megatron's model does not hold them (docs/conversion.md), ``megatron_to_hf`` puts them back."""
    folder.mkdir()
    names = sorted(names, key=hf.location)
    with BackgroundWriteback() as writeback:
        writer = SafetensorsWriter(folder / SINGLE_NAME, [hf.tensors[n].spec for n in names], writeback=writeback)
        try:
            for name in names:
                writer.copy(name, [hf.piece(name)])
                on_write(hf.tensors[name].spec.nbytes)
        except BaseException:
            writer.abort()
            raise
        writer.close()


def _mtp_source(megatron_dir: Path, template: Path | None, config: ModelConfig) -> Path | None:
    """Where the MTP layers of an export come from: the checkpoint's own ``mtp/`` (a converted one), else
    the template when it holds weights (the original HF folder, for a checkpoint saved by training)."""
    if (megatron_dir / MTP_DIR).is_dir():
        return megatron_dir / MTP_DIR
    if template is not None and any(template.glob("*.safetensors")) and registry.FAMILIES[config.architecture].mtp_layers:
        return template
    return None


def _planned_chunk(hf: ReleaseView, entry: Entry, chunk: dcp_io.Chunk, dtype: torch.dtype) -> dcp_io.PlannedChunk:
    """The chunk's bytes as byte ranges of the HF files (what ``to_megatron`` would compute, as rows)."""
    pieces = canonical_pieces(entry.transform.row_blocks(chunk.shape), chunk.shape, dtype.itemsize,
                              [hf.piece(name) for name in entry.hf], chunk.padding_rows)
    return dcp_io.PlannedChunk(chunk, dtype, pieces, entry.megatron)


# ---- Megatron -> HF ------------------------------------------------------------------------------

def _config_from_checkpoint(directory: Path) -> ModelConfig | None:
    """model_config.json (written by hf_to_megatron), else gspo_meta.json's model_config, else the model
    of the training config a training checkpoint's gspo_meta.json holds (model.config or model.hf_dir),
    else None."""
    from gspo_megatron.typed_config import build

    own, meta = directory / MODEL_CONFIG_NAME, directory / "gspo_meta.json"
    if own.is_file():
        return build(ModelConfig, read_json(own), str(own))
    if meta.is_file():
        data = read_json(meta)
        if "model_config" in data:
            return build(ModelConfig, data["model_config"], f"{meta}: model_config")
        model = data.get("config", {}).get("model", {})
        if model.get("config") is not None:
            return build(ModelConfig, model["config"], f"{meta}: config.model.config")
        if model.get("hf_dir") is not None and (Path(model["hf_dir"]) / "config.json").is_file():
            return ModelConfig.from_hf_dir(model["hf_dir"])
    return None  # a run's model.hf_dir that is gone: the template must say (template_source)


def _training_model_section(directory: Path) -> dict:
    """The model section of the training config a training checkpoint's gspo_meta.json holds ({} if none)."""
    meta = directory / "gspo_meta.json"
    if not meta.is_file():
        return {}
    return read_json(meta).get("config", {}).get("model", {}) or {}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def _has_tokenizer(folder: Path | None) -> bool:
    return folder is not None and any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model",
                                                                             "vocab.json"))


def missing_tokenizer_note(hf_dir: Path) -> str | None:
    """What a converted checkpoint of ``hf_dir`` will need when that folder has no tokenizer: its ``hf/``
    folder then holds none, and the export refuses without one (``megatron_to_hf``); said at conversion time,
    when the tokenizer's folder is still known."""
    if _has_tokenizer(hf_dir):
        return None
    return (f"note: {hf_dir} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json): exporting this "
            "checkpoint (convert megatron-to-hf) will need --hf-template with a folder that has one, or "
            "--weights-only; training from it, model.tokenizer_dir")


def template_source(megatron_dir: Path, hf_template: Path | None) -> tuple[Path | None, str]:
    """The folder whose config / generation config / tokenizer files an export copies, and where it came from:
    ``--hf-template``, else the checkpoint's own ``hf/`` folder (a converted checkpoint), else the run's
    ``model.hf_dir`` (a training checkpoint of a run started from a Hugging Face folder), else none (the
    checkpoint's model config). A run's model.hf_dir that is gone is refused: the checkpoint holds only weights."""
    if hf_template is not None:
        return hf_template, f"--hf-template {hf_template}"
    own = megatron_dir / HF_FILES_DIR
    if (own / "config.json").is_file():
        return own, f"the checkpoint's {HF_FILES_DIR}/ folder {own}"
    run_hf_dir = _training_model_section(megatron_dir).get("hf_dir")
    if run_hf_dir is None:
        return None, "the checkpoint's model config"
    if not (Path(run_hf_dir) / "config.json").is_file():
        raise ConversionError(f"{megatron_dir}: the run's model.hf_dir {run_hf_dir} is gone (no config.json): the "
                              f"checkpoint holds the weights only; pass --hf-template with the model's Hugging Face "
                              f"folder (config and tokenizer files)")
    return Path(run_hf_dir), f"the run's model.hf_dir {run_hf_dir}"


def tokenizer_source(megatron_dir: Path, template: Path | None, origin: str) -> tuple[Path | None, str]:
    """Where the exported folder's tokenizer comes from, and why: the template (``origin``: where it came
    from, ``template_source``), else the run's ``model.tokenizer_dir``, else the repository's demo tokenizer
    for a run with an inline ``model.config`` (what the trainer used)."""
    # the folder data.tokenizer.demo_tokenizer_path() names (data is a layer above conversion)
    demo_tokenizer = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
    if _has_tokenizer(template):
        return template, origin
    model = _training_model_section(megatron_dir)
    if model.get("tokenizer_dir") is not None:
        folder = Path(model["tokenizer_dir"])
        return (folder if _has_tokenizer(folder) else None), f"the run's model.tokenizer_dir {folder}"
    if model.get("config") is not None:
        return demo_tokenizer, "the repository's demo tokenizer (the run's model.config has no tokenizer_dir)"
    return None, "no template, no model.tokenizer_dir"


def export_config(megatron_dir: Path, hf_template: Path | None) -> tuple[ModelConfig, Path | None]:
    """The model config of a Megatron checkpoint and the template folder for the non-weight files.

    Sources: the checkpoint's model_config.json (or gspo_meta.json's model_config) and the template's
    config.json (``--hf-template``, else the checkpoint's own ``hf/`` folder). When both exist they must
    describe the same model; a difference is an error naming the fields.
    """
    template = hf_template if hf_template is not None else (
        megatron_dir / HF_FILES_DIR if (megatron_dir / HF_FILES_DIR / "config.json").is_file() else None)
    run_hf_dir = _training_model_section(megatron_dir).get("hf_dir")
    if template is None and run_hf_dir is not None and (Path(run_hf_dir) / "config.json").is_file():
        template = Path(run_hf_dir)  # a training checkpoint of a run that started from a Hugging Face folder
    ours = _config_from_checkpoint(megatron_dir)
    theirs = ModelConfig.from_hf_dir(template) if template is not None else None
    if ours is None and theirs is None:
        raise ConversionError(f"{megatron_dir}: no {MODEL_CONFIG_NAME} (or gspo_meta.json model_config) and no "
                              f"--hf-template: the model config is unknown")
    if ours is not None and theirs is not None:
        diff = [f.name for f in dataclasses.fields(ModelConfig) if getattr(ours, f.name) != getattr(theirs, f.name)
                and f.name not in MEGATRON_ONLY_FIELDS]
        if diff:
            detail = ", ".join(f"{n}: {getattr(ours, n)!r} vs {getattr(theirs, n)!r}" for n in diff)
            raise ConversionError(f"{template / 'config.json'} does not describe the model in {megatron_dir} "
                                  f"({detail})")
    return (ours or theirs), template


def _special_token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """eos / pad / bos ids of a tokenizer folder (the ids generation needs to stop and to pad)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id}
    if ids["pad_token_id"] is None:
        ids["pad_token_id"] = ids["eos_token_id"]
    return {k: int(v) for k, v in ids.items() if v is not None}


def _write_hf_config(template: Path | None, config: ModelConfig, dest: Path, dtype: torch.dtype | None,
                     stored_dtype: torch.dtype, tokenizer: Path | None = None,
                     fp8_block: tuple[int, int] | None = None) -> None:
    """The template's files (config.json re-dtyped when casting or when the template was FP8), else a
    config.json and a generation_config.json made from the model config with the tokenizer's eos / pad / bos
    ids; ``tokenizer``: the folder whose tokenizer files are copied when the template has none."""
    if tokenizer is not None and tokenizer != template:
        dest.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copyfile(tokenizer / name, dest / name)
    if template is not None:
        copy_hf_side_files(template, dest)
        data = read_json(dest / "config.json")
        quantized = data.pop("quantization_config", None) is not None  # what is written is dequantized
        if dtype is None and not quantized and fp8_block is None:
            return
    else:
        import transformers

        data = config.to_hf_dict()
        special = _special_token_ids(tokenizer) if tokenizer is not None else {}
        data.update(special)
        generation = transformers.GenerationConfig.from_model_config(config.to_hf_config())
        for key, value in special.items():
            setattr(generation, key, value)
        generation.save_pretrained(dest)
    key = "torch_dtype" if "torch_dtype" in data and "dtype" not in data else "dtype"
    data[key] = str(dtype or stored_dtype).removeprefix("torch.")
    if fp8_block is not None:
        data["quantization_config"] = fp8_quantization_config(fp8_block)
    _write_json(dest / "config.json", data)


def megatron_to_hf(megatron_dir: str | Path, out_dir: str | Path, hf_template: str | Path | None = None,
                   max_shard_bytes: int | None = None, dtype: torch.dtype | None = None,
                   overwrite: bool = False, progress: bool = True, read_batch_bytes: int = READ_BATCH_BYTES,
                   weights_only: bool = False, fp8_block: tuple[int, int] | None = None) -> Path:
    """Convert a torch_dist checkpoint (any layout it was saved at) into a Hugging Face folder.

    The folder is complete (config, generation config with eos / pad ids, tokenizer): the files come from
    ``hf_template``, else the checkpoint's hf/ folder, else the training run's ``model.hf_dir`` /
    ``model.tokenizer_dir`` (or the demo tokenizer), and the source is printed. Without a tokenizer it is
    refused, unless ``weights_only`` (config, generation config and weights only).

    Without ``max_shard_bytes`` the template's shard assignment is reused when its index names the same
    tensors (so a round trip reproduces the index), else shards are capped at 5 GB; with it, shards are
    capped at ``max_shard_bytes``. The vocabulary is unpadded; ``dtype`` (default: as stored) casts.
    ``fp8_block``: write the projection weights as block-scaled FP8 in blocks of this shape, as the
    DeepSeek-V3 release does (``release_formats.exported_as_fp8``), for FP8 rollout servers.
    """
    with one_intra_op_thread():
        return _megatron_to_hf(Path(megatron_dir), Path(out_dir), Path(hf_template) if hf_template else None,
                               max_shard_bytes, dtype, overwrite, progress, read_batch_bytes, weights_only,
                               fp8_block)


def _megatron_to_hf(megatron_dir: Path, out: Path, template: Path | None, max_shard_bytes: int | None,
                    dtype: torch.dtype | None, overwrite: bool, progress: bool, read_batch_bytes: int,
                    weights_only: bool, fp8_block: tuple[int, int] | None) -> Path:
    template, origin = template_source(megatron_dir, template)
    config, _ = export_config(megatron_dir, template)
    inputs = (megatron_dir,) + ((template,) if template else ())
    check_output(out, overwrite, inputs)
    with dcp_io.CheckpointReader(megatron_dir) as probe:  # per-layer or stacked keys, as it was saved
        keys = probe.tensor_keys()
    per_layer = stored_layer_keying(keys)
    # from the checkpoint's metadata alone, before the table or the layout is built at the config's sizes
    check_checkpoint_counts(keys, config, megatron_dir)
    entries = expand(config)
    with dcp_io.single_process_megatron():
        layout = dcp_io.checkpoint_layout(config, per_layer=per_layer)
    _check_table_matches_model(entries, layout, config)
    mtp_dir = _mtp_source(megatron_dir, template, config)
    with dcp_io.CheckpointReader(megatron_dir) as reader, contextlib.ExitStack() as stack:
        mtp_view, mtp = None, []
        if mtp_dir is not None:
            mtp_stored = stack.enter_context(HFCheckpoint(mtp_dir))
            mtp_config = mtp_dir / "config.json"
            mtp_view = ReleaseView(mtp_stored, config, read_json(mtp_config) if mtp_config.is_file() else None)
            mtp = sorted((n for n in mtp_view.tensors if left_out(config, n)), key=mtp_view.location)
        requests = {r.name: r for r in dcp_io.requests_for(layout, reader, config.vocab_size)}
        tokenizer, why = tokenizer_source(megatron_dir, template, origin)
        if tokenizer is None and not weights_only:
            raise ConversionError(f"{megatron_dir}: no tokenizer to export ({why}): pass --hf-template with the "
                                  f"model's Hugging Face folder (config and tokenizer files), or --weights-only for "
                                  f"a folder without a tokenizer")
        print(f"side files (config, generation config, tokenizer) from {origin}"
              + (f"; tokenizer from {why}" if tokenizer is not None and tokenizer != template else ""), flush=True)
        items = reader.plan(list(requests.values()))
        specs = [spec for e in entries
                 for spec in _hf_specs(e, layout.chunks[e.megatron], dtype or requests[e.megatron].dtype)]
        specs += [dataclasses.replace(mtp_view.tensors[n].spec, dtype=dtype or mtp_view.tensors[n].spec.dtype)
                  for n in mtp]
        output = FP8Output(fp8_block, dtype)
        specs = output.specs(specs)
        template_index = None
        if max_shard_bytes is None and template is not None and (template / INDEX_NAME).is_file():
            template_index = read_json(template / INDEX_NAME)
        plan = plan_shards(specs, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES, template_index)
        by_name = {e.megatron: e for e in entries}
        # read the checkpoint's data files front to back
        order = sorted(requests.values(), key=lambda r: reader.location(items[r.name][0]))
        with atomic_output(out, overwrite, inputs) as tmp:
            with progress_bar(sum(s.nbytes for s in specs), "megatron -> hf", progress) as bar, \
                    _ShardWriters(tmp, plan, bar.update) as shards:
                loaded = []
                for request in order:
                    entry = by_name[request.name]
                    copied = dtype in (None, request.dtype) and not any(output.quantized(n, None) for n in entry.hf)
                    segments = reader.segments(request, items[request.name]) if copied else None
                    if segments is None:
                        loaded.append(request)
                        continue
                    blocks = entry.transform.row_blocks(request.shape)
                    for name, pieces in zip(entry.hf, hf_pieces(blocks, request.shape, request.dtype.itemsize,
                                                                 len(entry.hf), segments)):
                        shards.copy(name, pieces)
                for batch in _batches(loaded, read_batch_bytes):
                    tensors = reader.read(batch, items)
                    for request in batch:
                        entry = by_name[request.name]
                        for name, tensor in zip(entry.hf, entry.transform.to_hf(tensors.pop(request.name))):
                            output.write(shards, name, tensor)
                for name in mtp:  # put back as they were kept (or cast, or quantized)
                    if dtype in (None, mtp_view.tensors[name].spec.dtype) and not output.quantized(name, None):
                        shards.copy(name, [mtp_view.piece(name)])
                    else:
                        output.write(shards, name, mtp_view.read(name))
            if plan.index is not None:
                write_index(tmp, plan.index)
            _write_hf_config(template, config, tmp, dtype, next(iter(requests.values())).dtype,
                             None if weights_only else tokenizer, fp8_block)
    return out


class FP8Output:
    """What the export writes for each HF tensor: as it is (cast to ``dtype`` if given), or, with
    ``block``, the projection weights as block-scaled FP8 plus their ``_scale_inv`` (``fp8.quantize``)."""

    def __init__(self, block: tuple[int, int] | None, dtype: torch.dtype | None):
        self.block, self.dtype = block, dtype
        self._shapes: dict[str, tuple[int, ...]] = {}

    def quantized(self, name: str, shape: tuple[int, ...] | None) -> bool:
        shape = self._shapes.get(name) if shape is None else shape
        return self.block is not None and shape is not None and exported_as_fp8(name, shape)

    def specs(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        out = []
        for spec in specs:
            self._shapes[spec.name] = spec.shape
            if not self.quantized(spec.name, spec.shape):
                out.append(spec)
                continue
            out += [TensorSpec(spec.name, spec.shape, fp8.FP8),
                    TensorSpec(spec.name + fp8.SCALE_SUFFIX, fp8.scale_shape(spec.shape, self.block), torch.float32)]
        return out

    def write(self, shards: "_ShardWriters", name: str, tensor: torch.Tensor) -> None:
        if not self.quantized(name, tuple(tensor.shape)):
            shards.write(name, tensor.to(self.dtype) if self.dtype is not None else tensor)
            return
        q, scale = fp8.quantize(tensor, self.block)
        shards.write(name, q)
        shards.write(name + fp8.SCALE_SUFFIX, scale)


class _ShardWriters:
    """The planned shards' writers: tensors go to their shard; the disk writes of a shard start on the
    writeback thread as it fills and when it is whole, and every shard is checked and fsynced at the end
    (by then little is left to write). On failure the files are released without syncing (the folder is
    being discarded)."""

    def __init__(self, directory: Path, plan, on_write):
        self._file_of = {s.name: file for file, group in plan.files.items() for s in group}
        self._writeback = BackgroundWriteback()
        self._writers = {file: SafetensorsWriter(directory / file, group, writeback=self._writeback)
                         for file, group in plan.files.items()}
        self._on_write = on_write

    def write(self, name: str, tensor: torch.Tensor) -> None:
        writer = self._writers[self._file_of[name]]
        writer.write(name, tensor)
        self._done(writer, tensor.numel() * tensor.element_size())

    def copy(self, name: str, pieces) -> None:
        writer = self._writers[self._file_of[name]]
        writer.copy(name, pieces)
        self._done(writer, sum(p.nbytes for p in pieces))

    def _done(self, writer: SafetensorsWriter, nbytes: int) -> None:
        if writer.complete:
            self._writeback.kick(writer.fileno())
        self._on_write(nbytes)

    def __enter__(self) -> "_ShardWriters":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        failing = exc_type is not None
        try:
            for writer in self._writers.values():
                if writer.closed:
                    continue
                if failing:
                    writer.abort()
                else:
                    writer.close()
        except BaseException:
            failing = True
            raise
        finally:
            self._writeback.close(raise_error=not failing)


def _batches(requests: list[dcp_io.Request], batch_bytes: int) -> Iterator[list[dcp_io.Request]]:
    batch, size = [], 0
    for r in requests:
        nbytes = r.dtype.itemsize
        for s in r.sizes:
            nbytes *= s
        if batch and size + nbytes > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(r)
        size += nbytes
    if batch:
        yield batch
