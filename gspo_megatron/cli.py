"""`gspo-megatron` command line: train, demo, convert, eval, plot, smoke."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="gspo-megatron", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("smoke", help="tiny MoE forward/backward at EP=2 on two processes vs one process")
    sub.add_parser("convert", help="checkpoint conversion (see `gspo-megatron convert -h`)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "smoke":
        from gspo_megatron import smoke

        smoke.run()
        return 0
    if args.command == "convert":
        from gspo_megatron.conversion import cli as convert_cli

        return convert_cli.main(rest)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
