"""Shared helpers for the reward tests."""
from __future__ import annotations

import os

from gspo_megatron.rewards.sandbox import SandboxConfig

# Tight limits so hostile programs are cut short quickly; still roomy enough for a Python start-up.
FAST_SANDBOX = dict(case_timeout_s=1.5, cpu_time_s=1, memory_mb=256, max_output_bytes=65536, max_processes=8,
                    workdir_size_mb=8, max_file_mb=2)


def fast_sandbox(**overrides) -> SandboxConfig:
    cfg = SandboxConfig(**{**FAST_SANDBOX, **overrides})
    cfg.validate("sandbox")
    return cfg


def sandbox_uid_processes(cfg: SandboxConfig) -> list[tuple[int, int]]:
    """(pid, uid) of every live process running under a sandbox uid: must be empty between runs."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue  # exited while we listed /proc
        uid = int(status.split("\nUid:")[1].split()[0])
        if cfg.uid_base <= uid < cfg.uid_base + 2**27:
            found.append((int(entry), uid))
    return found


def code_block(source: str) -> str:
    return f"Here is my solution.\n```python\n{source}\n```\n"
