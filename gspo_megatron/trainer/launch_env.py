"""Where this process sits in the job: rank, world size, node and rendezvous address, from the environment.

Three launchers are recognised, in this order (the first whose variables are present wins):

1. ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
   ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``. This also covers torchrun started by ``srun``
   (one launcher per node): the Slurm variables are then those of the launcher, not of the workers.
2. ``slurm``: tasks started directly by ``srun`` (``SLURM_PROCID`` is set). The rank comes from
   ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``/``SLURM_NODEID``, the tasks on this node from
   ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``) or ``SLURM_NTASKS_PER_NODE``, the master from the first host of
   ``SLURM_NODELIST`` or ``SLURM_JOB_NODELIST`` (compressed: ``node[01-04,07],gpu-a[1-2]``) and the port
   from ``SLURM_JOB_ID``. ``MASTER_ADDR`` / ``MASTER_PORT``, when set, override the derived address/port.
3. ``single``: none of the above; one process, ``MASTER_PORT`` 0 unless set (the OS picks a free port,
   valid for a world of one).

Inside an ``srun`` step Slurm rewrites ``SLURM_NTASKS``, ``SLURM_NODELIST`` and ``SLURM_TASKS_PER_NODE``
to the step's own values (measured on Slurm 22.05), which is why those are read rather than the
``SLURM_JOB_*`` ones. The batch script itself also has ``SLURM_PROCID=0`` but no ``SLURM_STEP_ID``: a
trainer started there in a multi-task job would wait forever for its peers, so that is an error.

Everything here is pure (a mapping in, values out) so it is tested without a cluster; the
``python -m gspo_megatron.trainer.launch_env`` entry point prints the result for sbatch scripts, and
``... launch_env sglang-python --config CONFIG [overrides]`` the interpreter that starts SGLang servers
(``rollout.sglang.launch.python``: one setting for servers the trainer launches and those an sbatch script's
``start_sglang_node.sh`` starts).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

Launcher = Literal["single", "torchrun", "slurm"]

# Derived rendezvous ports lie in [PORT_BASE, PORT_BASE + PORT_SPAN): above the well-known and common
# service ports, below Linux's ephemeral range (32768-60999) so a client socket never holds it.
PORT_BASE = 15000
PORT_SPAN = 10000

_TORCHRUN_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LaunchEnvError(ValueError):
    """An environment variable that describes the launch is missing or malformed (the message names it)."""


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job. Ranks are 0-based; node_rank indexes the job's node list."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    launcher: Launcher


def _int(environ: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = environ[name]
    if not re.fullmatch(r"\s*\d+\s*", raw):
        raise LaunchEnvError(f"{name}={raw!r}: expected a non-negative integer")
    value = int(raw)
    if value < minimum:
        raise LaunchEnvError(f"{name}={raw!r}: must be >= {minimum}")
    return value


def _port(environ: Mapping[str, str], name: str, minimum: int) -> int:
    value = _int(environ, name, minimum)
    if value > 65535:
        raise LaunchEnvError(f"{name}={environ[name]!r}: a TCP port is at most 65535")
    return value


def _expand_bracket(body: str, hostlist: str) -> list[str]:
    """``"01-03,07"`` -> ``["01", "02", "03", "07"]``; zero padding follows the lower bound's width."""
    out: list[str] = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None:
            raise LaunchEnvError(f"host list {hostlist!r}: bad range {part!r} in [{body}]")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise LaunchEnvError(f"host list {hostlist!r}: range {part!r} runs backwards")
        out.extend(str(i).zfill(len(lo_text)) for i in range(lo, hi + 1))
    return out


def _expand_item(item: str, hostlist: str) -> list[str]:
    """One comma-free item, ``"rack[1-2]-n[1,3]"``: the product of its literal and bracket segments."""
    segments: list[list[str]] = []
    pos = 0
    for m in re.finditer(r"\[([^\[\]]*)\]", item):
        segments.append([item[pos : m.start()]])
        segments.append(_expand_bracket(m.group(1), hostlist))
        pos = m.end()
    segments.append([item[pos:]])
    if any("[" in literal or "]" in literal for (literal,) in segments[::2]):
        raise LaunchEnvError(f"host list {hostlist!r}: unbalanced brackets in {item!r}")
    return ["".join(parts) for parts in itertools.product(*segments)]


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order, duplicates kept.

    ``"node[01-04,07],gpu-a[1-2]"`` -> ``node01 node02 node03 node04 node07 gpu-a1 gpu-a2``;
    ``"a[1-2]b[3-4]"`` -> ``a1b3 a1b4 a2b3 a2b4`` (like ``scontrol show hostnames``). Items are separated
    by commas or white space outside brackets; empty items are skipped. Raises ``LaunchEnvError``.
    """
    items: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in hostlist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchEnvError(f"host list {hostlist!r}: ']' without '['")
        if depth == 0 and (ch == "," or ch.isspace()):
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise LaunchEnvError(f"host list {hostlist!r}: '[' without ']'")
    items.append("".join(current))
    hosts = [host for item in items if item for host in _expand_item(item, hostlist)]
    if not hosts:
        raise LaunchEnvError(f"host list {hostlist!r}: names no host")
    return hosts


def expand_tasks_per_node(spec: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]``: tasks on each node of the step, in node-list order."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise LaunchEnvError(f"{name}={spec!r}: bad element {part!r} (expected N or N(xM))")
        repeat = int(m.group(2) or 1)
        if repeat < 1:
            raise LaunchEnvError(f"{name}={spec!r}: repeat count in {part!r} must be >= 1")
        counts.extend([int(m.group(1))] * repeat)
    return counts


def derived_port(job_id: int) -> int:
    """A rendezvous port every task of a job agrees on without talking: a function of the job id alone."""
    return PORT_BASE + job_id % PORT_SPAN


def slurm_rendezvous(environ: Mapping[str, str]) -> tuple[str, int]:
    """(first host of the step's or job's node list, port) for a Slurm job; MASTER_ADDR/PORT override.

    This is also the torchrun ``--rdzv-endpoint`` in the multi-node sbatch example, computed in the
    batch script (whose SLURM_NODELIST is the job's) with ``python -m gspo_megatron.trainer.launch_env
    rendezvous``.
    """
    if "MASTER_ADDR" in environ:
        addr = _master_addr(environ)
    else:
        addr = _hosts(environ, _nodelist_variable(environ))[0]
    if "MASTER_PORT" in environ:
        port = _port(environ, "MASTER_PORT", 1)
    elif "SLURM_JOB_ID" in environ:
        port = derived_port(_int(environ, "SLURM_JOB_ID"))
    else:
        raise LaunchEnvError("SLURM_JOB_ID is not set (and no MASTER_PORT): cannot derive a rendezvous port")
    return addr, port


def _master_addr(environ: Mapping[str, str]) -> str:
    addr = environ["MASTER_ADDR"].strip()
    if not addr:
        raise LaunchEnvError("MASTER_ADDR is set but empty")
    return addr


def _nodelist_variable(environ: Mapping[str, str]) -> str:
    """The step's node list inside an srun step (SLURM_NODELIST), else the job's."""
    for name in ("SLURM_NODELIST", "SLURM_JOB_NODELIST"):
        if name in environ:
            return name
    raise LaunchEnvError("neither SLURM_NODELIST nor SLURM_JOB_NODELIST is set")


def _hosts(environ: Mapping[str, str], name: str) -> list[str]:
    try:
        return expand_hostlist(environ[name])
    except LaunchEnvError as err:
        raise LaunchEnvError(f"{name}: {err}") from None


def _check_below(index: int, size: int, message: str) -> None:
    if index >= size:
        raise LaunchEnvError(message)


def _from_torchrun(environ: Mapping[str, str]) -> LaunchEnv:
    missing = [v for v in _TORCHRUN_REQUIRED if v not in environ]
    if missing:
        raise LaunchEnvError(
            f"RANK or WORLD_SIZE is set but {', '.join(missing)} is not (a torchrun launch sets all)"
        )
    rank = _int(environ, "RANK")
    world_size = _int(environ, "WORLD_SIZE", 1)
    _check_below(rank, world_size, f"RANK={rank} is not below WORLD_SIZE={world_size}")
    has_local = ("LOCAL_RANK" in environ, "LOCAL_WORLD_SIZE" in environ)
    if has_local == (True, True):
        local_rank = _int(environ, "LOCAL_RANK")
        local_world_size = _int(environ, "LOCAL_WORLD_SIZE", 1)
        _check_below(local_rank, local_world_size,
                     f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}")
    elif has_local == (False, False):
        # Hand-set RANK/WORLD_SIZE without the local pair (tests, mp.spawn): all ranks on one node.
        local_rank, local_world_size = rank, world_size
    else:
        raise LaunchEnvError("LOCAL_RANK and LOCAL_WORLD_SIZE must be set together (torchrun sets both)")
    if world_size % local_world_size:
        raise LaunchEnvError(
            f"WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={local_world_size}"
        )
    if "GROUP_WORLD_SIZE" in environ:
        num_nodes = _int(environ, "GROUP_WORLD_SIZE", 1)
    else:
        num_nodes = world_size // local_world_size
    node_rank = _int(environ, "GROUP_RANK") if "GROUP_RANK" in environ else rank // local_world_size
    _check_below(node_rank, num_nodes,
                 f"GROUP_RANK={node_rank} is not below the {num_nodes} nodes (GROUP_WORLD_SIZE)")
    return LaunchEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=_master_addr(environ),
        master_port=_port(environ, "MASTER_PORT", 1),
        launcher="torchrun",
    )


def _from_slurm(environ: Mapping[str, str]) -> LaunchEnv:
    for name in ("SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID"):
        if name not in environ:
            raise LaunchEnvError(f"SLURM_PROCID is set but {name} is not")
    rank = _int(environ, "SLURM_PROCID")
    world_size = _int(environ, "SLURM_NTASKS", 1)
    _check_below(rank, world_size, f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world_size}")
    if world_size > 1 and "SLURM_STEP_ID" not in environ:
        raise LaunchEnvError(
            f"SLURM_STEP_ID is not set: this is the batch script of a job with SLURM_NTASKS={world_size}; "
            "start the tasks with `srun` (or torchrun under srun)"
        )
    if "SLURM_TASKS_PER_NODE" in environ:
        per_node_var = "SLURM_TASKS_PER_NODE"
        per_node = expand_tasks_per_node(environ[per_node_var], per_node_var)
    elif "SLURM_NTASKS_PER_NODE" in environ:
        per_node_var = "SLURM_NTASKS_PER_NODE"
        per_node = None
    else:
        raise LaunchEnvError("neither SLURM_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE is set")
    list_var = _nodelist_variable(environ)
    hosts = _hosts(environ, list_var)
    if per_node is None:
        per_node = [_int(environ, per_node_var, 1)] * len(hosts)
    if len(per_node) != len(hosts):
        raise LaunchEnvError(
            f"{per_node_var}={environ[per_node_var]!r} gives {len(per_node)} nodes but "
            f"{list_var}={environ[list_var]!r} names {len(hosts)}"
        )
    if sum(per_node) != world_size:
        raise LaunchEnvError(
            f"{per_node_var}={environ[per_node_var]!r} adds up to {sum(per_node)} tasks, "
            f"SLURM_NTASKS={world_size}"
        )
    node_rank = _int(environ, "SLURM_NODEID")
    _check_below(node_rank, len(hosts),
                 f"SLURM_NODEID={node_rank} is not below the {len(hosts)} hosts of {list_var}")
    local_rank = _int(environ, "SLURM_LOCALID")
    local_world_size = per_node[node_rank]
    _check_below(
        local_rank,
        local_world_size,
        f"SLURM_LOCALID={local_rank} is not below the {local_world_size} tasks {per_node_var} gives node {node_rank}",
    )
    addr, port = slurm_rendezvous(environ)
    return LaunchEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=len(hosts),
        master_addr=addr,
        master_port=port,
        launcher="slurm",
    )


def _single(environ: Mapping[str, str]) -> LaunchEnv:
    addr = _master_addr(environ) if "MASTER_ADDR" in environ else "127.0.0.1"
    port = _port(environ, "MASTER_PORT", 0) if "MASTER_PORT" in environ else 0
    return LaunchEnv(0, 1, 0, 1, 0, 1, addr, port, "single")


def resolve_launch(environ: Mapping[str, str]) -> LaunchEnv:
    """The launch this process belongs to: torchrun variables first, then Slurm's, else a single process.

    Pure: pass ``os.environ`` (or any mapping). Raises ``LaunchEnvError`` naming the malformed variable.
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if "SLURM_PROCID" in environ:
        return _from_slurm(environ)
    return _single(environ)


def export_for_torch(launch: LaunchEnv, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables ``torch.distributed.init_process_group(init_method="env://")`` reads (plus the local
    ones Megatron and CUDA device selection use, and ``gloo_socket_ifname``), for ``os.environ.update``.

    A variable already in ``environ`` with a different value is an error naming it: two launchers
    disagreeing about the rank is never something to paper over.
    """
    wanted = {
        "MASTER_ADDR": launch.master_addr,
        "MASTER_PORT": str(launch.master_port),
        "RANK": str(launch.rank),
        "WORLD_SIZE": str(launch.world_size),
        "LOCAL_RANK": str(launch.local_rank),
        "LOCAL_WORLD_SIZE": str(launch.local_world_size),
        "GROUP_RANK": str(launch.node_rank),
        "GROUP_WORLD_SIZE": str(launch.num_nodes),
    }
    for name, value in wanted.items():
        if name in environ and environ[name].strip() != value:
            raise LaunchEnvError(f"{name}={environ[name]!r} in the environment, but the launch says {value!r}")
    return {**wanted, **gloo_socket_ifname(environ)}


# NCCL_SOCKET_IFNAME's forms that name interfaces exactly: a comma-separated list without NCCL's "^" (exclude)
# or "=" (exact match) prefix
_PLAIN_IFNAMES = re.compile(r"[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*")


def gloo_socket_ifname(environ: Mapping[str, str]) -> dict[str, str]:
    """``{"GLOO_SOCKET_IFNAME": ...}`` taken from ``NCCL_SOCKET_IFNAME`` when only the latter is set, else {}.

    The trainer's gloo collectives (the CPU side of checkpoints and of the data-parallel gathers) pick their
    interface from the host name unless ``GLOO_SOCKET_IFNAME`` names one; on nodes with several networks
    that can be one the other nodes cannot reach, while NCCL (told by the site's ``NCCL_SOCKET_IFNAME``) works.
    Gloo takes exact interface names only, so NCCL's ``^``-exclude and ``=``-exact forms are not copied
    (set GLOO_SOCKET_IFNAME yourself then)."""
    nccl = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    if "GLOO_SOCKET_IFNAME" in environ or not _PLAIN_IFNAMES.fullmatch(nccl):
        return {}
    return {"GLOO_SOCKET_IFNAME": nccl}


def sglang_python(data: Mapping, default: str) -> str:
    """The interpreter that starts SGLang servers: ``rollout.sglang.launch.python`` of the config mapping
    ``data`` (YAML with overrides applied, not validated: an sbatch script's config names ``urls``, and the
    ``launch`` section may hold only ``python``), ``~`` expanded as the trainer's own launch expands it
    (rollout/sglang_engine.py), else ``default`` (the trainer's interpreter)."""
    launch = (((data.get("rollout") or {}).get("sglang") or {}).get("launch") or {})
    python = launch.get("python") or ""
    return os.path.expanduser(python) if python else default


def _sglang_python_command(argv: list[str]) -> int:
    """``sglang-python --config CONFIG [dotted.key=value ...]``: print ``sglang_python`` of that config."""
    import yaml

    from gspo_megatron.trainer.config import apply_overrides

    if len(argv) < 2 or argv[0] != "--config":
        print("usage: python -m gspo_megatron.trainer.launch_env sglang-python --config CONFIG [dotted.key=value ...]",
              file=sys.stderr)
        return 2
    data = apply_overrides(yaml.safe_load(Path(argv[1]).read_text()) or {}, argv[2:])
    print(sglang_python(data, sys.executable))
    return 0


def _main(argv: list[str]) -> int:
    if argv[:1] == ["sglang-python"]:
        return _sglang_python_command(argv[1:])
    usage = "usage: python -m gspo_megatron.trainer.launch_env {show|rendezvous|sglang-python --config CONFIG ...}"
    if len(argv) != 1 or argv[0] not in ("show", "rendezvous"):
        print(usage, file=sys.stderr)
        return 2
    if argv[0] == "show":
        print(json.dumps(dataclasses.asdict(resolve_launch(os.environ)), sort_keys=True))
    else:
        host, port = slurm_rendezvous(os.environ)
        print(f"{host}:{port}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
