"""`gspo-megatron convert hf-to-megatron | megatron-to-hf | check` (see docs/conversion.md).

Exit status: 0 success; 2 bad input (one line naming the file, key or field); 3 ``check`` ran and found
logits further apart than ``--atol``; 1 an unexpected error (a crash: one line, the traceback with
``--debug``, see ``gspo-megatron --help``).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

EXIT_OK, EXIT_CHECK_FAILED = 0, 3  # bad input (2) and crashes (1): gspo_megatron.cli

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_bytes(text: str) -> int:
    """'5GB' -> 5e9, '512MiB' -> 512 * 2**20, '1000' -> 1000."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 512MiB, 1000000)")
    unit = (match.group(2) or "").upper().removesuffix("B")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_block(text: str) -> tuple[int, int]:
    """'128x128' -> (128, 128): the FP8 block shape of --fp8-block."""
    rows, sep, cols = text.lower().partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
        raise argparse.ArgumentTypeError(f"not a block shape: {text!r} (e.g. 128x128)")
    return int(rows), int(cols)


def _layout_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gspo-megatron convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("hf-to-megatron", help="Hugging Face folder -> Megatron torch_dist checkpoint")
    p.add_argument("--hf-dir", required=True, help="Hugging Face model folder (config.json, safetensors, tokenizer)")
    p.add_argument("--out", required=True, help="output folder of the Megatron torch_dist checkpoint")
    _layout_flags(p)
    p.epilog = ("The checkpoint is layout-free (what one process would save) and loads at any TP/PP/EP that "
                "divides the model; --tp/--pp/--ep check that the layout you plan to use divides it, and the "
                "vocabulary is padded for --tp.")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None, metavar="N",
                   help="pad the vocabulary to a multiple of N x TP, as Megatron-LM (default 128)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("megatron-to-hf", help="Megatron torch_dist checkpoint -> Hugging Face folder")
    p.add_argument("--megatron-dir", required=True,
                   help="a converted checkpoint or a training one (RUN_DIR/checkpoints/step_NNNNNN)")
    p.add_argument("--out", required=True, help="output Hugging Face folder")
    p.add_argument("--hf-template", default=None,
                   help="folder whose config/tokenizer files are copied (default: the checkpoint's hf/ folder, "
                        "else the training run's model.hf_dir / model.tokenizer_dir, else the demo tokenizer)")
    p.add_argument("--weights-only", action="store_true",
                   help="write config, generation config and weights even when no tokenizer can be found")
    p.add_argument("--max-shard-bytes", type=parse_bytes, default=None,
                   help="cap per safetensors file, e.g. 5GB (default: the template's sharding, else 5GB)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="cast (default: as stored)")
    p.add_argument("--fp8-block", type=parse_block, default=None, metavar="ROWSxCOLS",
                   help="write the projection weights as block-scaled FP8 (e.g. 128x128, as DeepSeek-V3's release)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("check", help="compare transformers and Megatron logits on the same tokens")
    p.add_argument("--hf-dir", required=True, help="Hugging Face model folder (run by transformers)")
    p.add_argument("--megatron-dir", required=True, help="Megatron checkpoint of the same model (run by Megatron-Core)")
    _layout_flags(p)
    p.add_argument("--atol", type=float, default=None, help="largest allowed |logit difference| (default 1e-4)")
    p.add_argument("--seq-len", type=int, default=16, help="length of the random token sequence compared")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a conversion command; an error is reported in one line (gspo_megatron.reporting.run_reporting_errors)
    as EXIT_BAD_INPUT or EXIT_CRASH."""
    from gspo_megatron.reporting import run_reporting_errors

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return run_reporting_errors("convert", lambda: _run(args))


INPUT_FOLDERS = ("hf_dir", "megatron_dir", "hf_template")  # the flags naming folders a command reads


def check_input_folders(args: argparse.Namespace) -> None:
    """Each input folder flag names an existing folder: checked before torch and Megatron-Core are imported
    (seconds), so a mistyped path is refused at once, by its flag."""
    from pathlib import Path

    from gspo_megatron.conversion.errors import ConversionError

    for name in INPUT_FOLDERS:
        value = getattr(args, name, None)
        if value is not None and not Path(value).is_dir():
            flag = "--" + name.replace("_", "-")
            raise ConversionError(f"{flag} {value}: {'not a folder' if Path(value).exists() else 'no such folder'}")


def _run(args: argparse.Namespace) -> int:
    check_input_folders(args)
    from gspo_megatron.conversion import offline

    if args.command == "hf-to-megatron":
        out = offline.hf_to_megatron(args.hf_dir, args.out, args.tp, args.pp, args.ep, overwrite=args.overwrite,
                                     progress=not args.no_progress,
                                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        print(f"wrote {out}")
        note = offline.missing_tokenizer_note(Path(args.hf_dir))
        if note is not None:
            print(note)
        return 0
    if args.command == "megatron-to-hf":
        out = offline.megatron_to_hf(args.megatron_dir, args.out, args.hf_template, args.max_shard_bytes,
                                     offline.DTYPE_FLAGS[args.dtype] if args.dtype else None,
                                     overwrite=args.overwrite, progress=not args.no_progress,
                                     weights_only=args.weights_only, fp8_block=args.fp8_block)
        print(f"wrote {out}")
        return 0
    from gspo_megatron.conversion import check

    atol = check.DEFAULT_ATOL if args.atol is None else args.atol
    diff = check.run_check(args.hf_dir, args.megatron_dir, args.tp, args.pp, args.ep, args.seq_len, args.seed)
    verdict = "ok" if diff <= atol else "MISMATCH"
    print(f"max |logits_megatron - logits_hf| = {diff:.3e} at tp={args.tp} pp={args.pp} ep={args.ep} "
          f"(atol {atol:.1e}): {verdict}")
    return EXIT_OK if diff <= atol else EXIT_CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())
