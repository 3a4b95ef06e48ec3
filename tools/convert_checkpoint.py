#!/usr/bin/env python
"""Thin script over `gspo-megatron convert`: hf-to-megatron | megatron-to-hf | check (docs/conversion.md)."""
import sys

from gspo_megatron.conversion.cli import main

if __name__ == "__main__":  # dist_checkpointing and the check's spawned ranks re-import this file
    sys.exit(main())
