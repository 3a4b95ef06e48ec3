"""How every command reports an error: one line ``gspo-megatron COMMAND: error: ...`` and an exit status.
Exit status 2: bad input (our own error types and OS errors, which name the file, key or field); 1: an
unexpected error (the line names the exception type and the file holding its traceback); 130: interrupted.
``GSPO_DEBUG=1`` (``--debug`` on the command line) prints the full traceback instead.

At the bottom of the package so that every command line (``cli``, ``conversion/cli``) can use it.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Callable

EXIT_CRASH, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130
DEBUG_ENV = "GSPO_DEBUG"  # set from --debug, so torchrun's ranks inherit it


def cli_command(path_env: str | None = None, cwd: str | None = None) -> str:
    """How to type ``gspo-megatron`` so that a printed command runs as printed, in a new shell too.

    ``gspo-megatron`` when that name on PATH (``path_env``, default $PATH) is this interpreter's own script;
    else the script beside ``sys.executable`` (a venv that is not activated: ``.venv/bin/gspo-megatron``,
    relative to ``cwd`` when inside it); else, not installed as a script, ``python -m gspo_megatron.cli``
    with this interpreter."""
    cwd = cwd or os.getcwd()
    bin_dir = os.path.dirname(sys.executable)  # not resolved: a venv's python is a link to the base one
    script = os.path.join(bin_dir, "gspo-megatron")
    on_path = shutil.which("gspo-megatron", path=os.environ.get("PATH", "") if path_env is None else path_env)
    if on_path and os.path.exists(script) and os.path.samefile(on_path, script):
        return "gspo-megatron"

    def shown(path: str) -> str:
        rel = os.path.relpath(path, cwd)
        if rel.startswith(".."):
            return path
        return rel if os.sep in rel else f".{os.sep}{rel}"  # a bare name would be looked up on PATH

    if os.access(script, os.X_OK):
        return shown(script)
    return f"{shown(sys.executable)} -m gspo_megatron.cli"


def quiet_known_warnings() -> None:
    """Megatron warns at import about every optional CUDA library it does not find (apex, Transformer
    Engine); on CPU that is expected and drowns the training output. Other warnings stay visible.
    Installed by every command line and by every rank ``megatron/spawn.py`` starts (a spawned process
    does not inherit the parent's filters)."""
    warnings.filterwarnings("ignore", message=r".*(Apex|apex|Transformer Engine).*not installed.*")
    warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
    # Megatron's torch_dist checkpoints go through torch's ShardedTensor and the old DCP entry points, and its
    # optimizer and expert dispatch through the old collective names: deprecations that are Megatron's to act
    # on, not the user's
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*deprecating ShardedTensor.*")
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`(load|save)_state_dict` is deprecated.*")
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated.*")


def is_bad_input(err: BaseException) -> bool:
    """Our own error types (each names the file, key or field) and OS errors on the user's paths; the rest
    are crashes. An OS error is on a path when it names one (``filename``) or is our own message naming it
    (no errno); a broken pipe or a failed system call without a path is a crash, not bad input."""
    own = isinstance(err, ValueError) and type(err).__module__.startswith("gspo_megatron")
    on_a_path = isinstance(err, OSError) and (err.filename is not None or err.errno is None)
    return own or on_a_path


def _save_traceback(command: str, text: str) -> Path:
    folder = Path(tempfile.gettempdir()) / "gspo-megatron-errors"
    folder.mkdir(exist_ok=True)
    path = folder / f"{command}-{os.getpid()}.log"
    path.write_text(text)
    return path


def run_reporting_errors(command: str, fn: Callable[[], int]) -> int:
    """``fn()``, with any error reported in one line (see the module docstring) instead of a traceback."""
    try:
        return fn()
    except KeyboardInterrupt:
        print(f"gspo-megatron {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001 - the one place every error is reported, then the exit status
        text = traceback.format_exc()
        rank = os.environ.get("RANK")
        prefix = f"gspo-megatron {command}" + (f" (rank {rank})" if rank not in (None, "0") else "")
        if os.environ.get(DEBUG_ENV) == "1":
            sys.stderr.write(text)
        if is_bad_input(err):
            print(f"{prefix}: error: {err}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        hint = ("" if os.environ.get(DEBUG_ENV) == "1"
                else f" (traceback: {_save_traceback(command, text)}; --debug prints it)")
        print(f"{prefix}: error: {type(err).__name__}: {err}{hint}", file=sys.stderr, flush=True)
        return EXIT_CRASH
