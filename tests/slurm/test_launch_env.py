"""resolve_launch / export_for_torch / the host-list parser on hand-written environments (no cluster)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gspo_megatron.trainer.launch_env import (PORT_BASE, PORT_SPAN, LaunchEnv, LaunchEnvError, derived_port,
                                              expand_hostlist, expand_tasks_per_node, export_for_torch,
                                              resolve_launch)
from tests.slurm.cluster import REPO_ROOT


@pytest.mark.parametrize("hostlist, hosts", [
    ("localhost", ["localhost"]),
    ("node[01-04,07],gpu-a[1-2]", ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[008-10]", ["n008", "n009", "n010"]),
    ("n[1-02]", ["n1", "n2"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("n[01-02]-ib", ["n01-ib", "n02-ib"]),
    ("h1.example.com,h2", ["h1.example.com", "h2"]),
    ("a,,b", ["a", "b"]),
    (" a, b ", ["a", "b"]),
    ("a b", ["a", "b"]),
    ("n[1-2],n[1-2]", ["n1", "n2", "n1", "n2"]),
    ("gpu[0]", ["gpu0"]),
    ("dgx-h100-[001-003,010]", ["dgx-h100-001", "dgx-h100-002", "dgx-h100-003", "dgx-h100-010"]),
])
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist, message", [
    ("n[1-2", "'[' without ']'"),
    ("n1-2]", "']' without '['"),
    ("n[3-1]", "runs backwards"),
    ("n[a-b]", "bad range 'a-b'"),
    ("n[]", "bad range ''"),
    ("n[1-]", "bad range '1-'"),
    ("n[1-3:2]", "bad range '1-3:2'"),
    ("a[b[1]]", "unbalanced"),
    ("", "names no host"),
    (",,", "names no host"),
])
def test_expand_hostlist_rejects(hostlist: str, message: str) -> None:
    with pytest.raises(LaunchEnvError) as err:
        expand_hostlist(hostlist)
    assert str(err.value).startswith(f"host list {hostlist!r}: ")
    assert message in str(err.value)


@given(prefix=st.from_regex(r"[a-z][a-z0-9-]{0,6}", fullmatch=True), lo=st.integers(0, 500),
       count=st.integers(1, 40), width=st.integers(1, 4))
def test_expand_hostlist_range_property(prefix: str, lo: int, count: int, width: int) -> None:
    hi = lo + count - 1
    lo_text = str(lo).zfill(width)
    hosts = expand_hostlist(f"{prefix}[{lo_text}-{hi}]")
    assert len(hosts) == count
    assert [int(h[len(prefix):]) for h in hosts] == list(range(lo, hi + 1))
    assert all(len(h) - len(prefix) >= len(lo_text) for h in hosts)


@given(st.lists(st.from_regex(r"[a-z][a-z0-9.-]{0,10}", fullmatch=True), min_size=1, max_size=8))
def test_expand_hostlist_plain_names_round_trip(names: list[str]) -> None:
    assert expand_hostlist(",".join(names)) == names


@pytest.mark.parametrize("spec, counts", [
    ("8", [8]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4]), ("1,2,3", [1, 2, 3]), ("8(x16)", [8] * 16),
])
def test_expand_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["", "2x3", "2(3)", "2(x0)", "a", "2(x3)1", "-1"])
def test_expand_tasks_per_node_rejects(spec: str) -> None:
    with pytest.raises(LaunchEnvError, match="SLURM_TASKS_PER_NODE="):
        expand_tasks_per_node(spec)


def test_single_process_defaults() -> None:
    assert resolve_launch({}) == LaunchEnv(0, 1, 0, 1, 0, 1, "127.0.0.1", 0, "single")
    assert resolve_launch({"PATH": "/bin", "MASTER_PORT": "1234"}).master_port == 1234
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR is set but empty"):
        resolve_launch({"MASTER_ADDR": ""})


TORCHRUN = {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node01", "MASTER_PORT": "29400"}


def test_torchrun() -> None:
    assert resolve_launch(TORCHRUN) == LaunchEnv(9, 16, 1, 8, 1, 2, "node01", 29400, "torchrun")


def test_torchrun_wins_over_slurm() -> None:
    """torchrun started by srun: the Slurm variables describe the launcher (one task per node)."""
    env = {**TORCHRUN, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
           "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NODELIST": "node[01-02]", "SLURM_JOB_ID": "5",
           "SLURM_STEP_ID": "0"}
    assert resolve_launch(env).launcher == "torchrun"
    assert resolve_launch(env).rank == 9


def test_hand_set_rank_without_local_pair_means_one_node() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert resolve_launch(env) == LaunchEnv(1, 2, 1, 2, 0, 1, "127.0.0.1", 29500, "torchrun")


@pytest.mark.parametrize("change, message", [
    ({"MASTER_ADDR": None}, "MASTER_ADDR is not"),
    ({"MASTER_PORT": None}, "MASTER_PORT is not"),
    ({"RANK": "16"}, "RANK=16 is not below WORLD_SIZE=16"),
    ({"RANK": "-1"}, "RANK='-1'"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0': must be >= 1"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"LOCAL_RANK": "8"}, "LOCAL_RANK=8 is not below LOCAL_WORLD_SIZE=8"),
    ({"LOCAL_WORLD_SIZE": None}, "LOCAL_RANK and LOCAL_WORLD_SIZE must be set together"),
    ({"LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "0"}, "WORLD_SIZE=16 is not a multiple of LOCAL_WORLD_SIZE=3"),
    ({"GROUP_RANK": "2"}, "GROUP_RANK=2 is not below"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000': a TCP port is at most 65535"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT='0': must be >= 1"),
    ({"MASTER_ADDR": " "}, "MASTER_ADDR is set but empty"),
])
def test_torchrun_errors_name_the_variable(change: dict, message: str) -> None:
    env = {k: v for k, v in {**TORCHRUN, **change}.items() if v is not None}
    with pytest.raises(LaunchEnvError) as err:
        resolve_launch(env)
    assert message in str(err.value)


def slurm_env(**overrides: str | None) -> dict[str, str]:
    """Task 5 of `srun` in a 3-node job with 2 tasks per node, as Slurm 22.05 sets it inside a step."""
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_NODELIST": "gpu[07-09]", "SLURM_JOB_NODELIST": "gpu[07-09]",
           "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0"}
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


def test_slurm() -> None:
    assert resolve_launch(slurm_env()) == LaunchEnv(5, 6, 1, 2, 2, 3, "gpu07", derived_port(123456), "slurm")


def test_slurm_uneven_nodes() -> None:
    env = slurm_env(SLURM_NTASKS="7", SLURM_TASKS_PER_NODE="3,2(x2)", SLURM_PROCID="2", SLURM_LOCALID="2",
                    SLURM_NODEID="0")
    launch = resolve_launch(env)
    assert (launch.rank, launch.local_rank, launch.local_world_size, launch.node_rank) == (2, 2, 3, 0)
    last = resolve_launch(env | {"SLURM_PROCID": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2"})
    assert (last.local_world_size, last.node_rank, last.num_nodes) == (2, 2, 3)


def test_slurm_ntasks_per_node_when_tasks_per_node_missing() -> None:
    launch = resolve_launch(slurm_env(SLURM_TASKS_PER_NODE=None, SLURM_NTASKS_PER_NODE="2"))
    assert launch.local_world_size == 2


def test_slurm_job_nodelist_when_step_list_missing() -> None:
    launch = resolve_launch(slurm_env(SLURM_NODELIST=None, SLURM_JOB_NODELIST="a[2-4]"))
    assert launch.master_addr == "a2"


def test_slurm_master_overrides() -> None:
    launch = resolve_launch(slurm_env(MASTER_ADDR="10.0.0.7", MASTER_PORT="23456"))
    assert (launch.master_addr, launch.master_port) == ("10.0.0.7", 23456)


def test_slurm_single_task_in_the_batch_script() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_TASKS_PER_NODE": "1", "SLURM_NODELIST": "localhost", "SLURM_JOB_ID": "3"}
    assert resolve_launch(env) == LaunchEnv(0, 1, 0, 1, 0, 1, "localhost", derived_port(3), "slurm")


@pytest.mark.parametrize("overrides, message", [
    ({"SLURM_STEP_ID": None}, "SLURM_STEP_ID is not set: this is the batch script of a job with SLURM_NTASKS=6"),
    ({"SLURM_NTASKS": None}, "SLURM_PROCID is set but SLURM_NTASKS is not"),
    ({"SLURM_LOCALID": None}, "SLURM_PROCID is set but SLURM_LOCALID is not"),
    ({"SLURM_PROCID": "6"}, "SLURM_PROCID=6 is not below SLURM_NTASKS=6"),
    ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x'"),
    ({"SLURM_TASKS_PER_NODE": "2(x2)"},
     "SLURM_TASKS_PER_NODE='2(x2)' gives 2 nodes but SLURM_NODELIST='gpu[07-09]' names 3"),
    ({"SLURM_TASKS_PER_NODE": "2(x2),1"}, "adds up to 5 tasks, SLURM_NTASKS=6"),
    ({"SLURM_TASKS_PER_NODE": "2[x3]"}, "SLURM_TASKS_PER_NODE='2[x3]': bad element"),
    ({"SLURM_TASKS_PER_NODE": None}, "neither SLURM_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE"),
    ({"SLURM_NODELIST": "gpu[07-09", "SLURM_JOB_NODELIST": None}, "SLURM_NODELIST: host list 'gpu[07-09'"),
    ({"SLURM_NODELIST": None, "SLURM_JOB_NODELIST": None}, "neither SLURM_NODELIST nor SLURM_JOB_NODELIST"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR is set but empty"),
    ({"SLURM_NODEID": "3"}, "SLURM_NODEID=3 is not below the 3 hosts of SLURM_NODELIST"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 is not below the 2 tasks SLURM_TASKS_PER_NODE gives node 2"),
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID is not set (and no MASTER_PORT)"),
    ({"SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID='12a'"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999'"),
])
def test_slurm_errors_name_the_variable(overrides: dict, message: str) -> None:
    with pytest.raises(LaunchEnvError) as err:
        resolve_launch(slurm_env(**overrides))
    assert message in str(err.value)


def test_derived_port_range_and_determinism() -> None:
    ports = {derived_port(job) for job in range(0, 3 * PORT_SPAN, 7)}
    assert min(ports) >= PORT_BASE and max(ports) < PORT_BASE + PORT_SPAN < 32768
    assert derived_port(123456) == derived_port(123456)
    assert derived_port(1) != derived_port(2)


def test_export_for_torch() -> None:
    launch = resolve_launch(slurm_env())
    exported = export_for_torch(launch, slurm_env())
    assert exported == {"MASTER_ADDR": "gpu07", "MASTER_PORT": str(derived_port(123456)), "RANK": "5",
                        "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2",
                        "GROUP_WORLD_SIZE": "3"}
    # Round trip: the exported variables alone describe the same process (as torchrun's would).
    assert dataclasses.replace(resolve_launch(exported), launcher="slurm") == launch
    assert export_for_torch(resolve_launch(TORCHRUN), TORCHRUN) == TORCHRUN


def test_gloo_takes_the_nccl_interface() -> None:
    """Multi-node gloo (checkpoints, data-parallel gathers) needs GLOO_SOCKET_IFNAME as NCCL needs its own."""
    launch = resolve_launch(slurm_env())
    exported = export_for_torch(launch, {**slurm_env(), "NCCL_SOCKET_IFNAME": "ib0,ib1"})
    assert exported["GLOO_SOCKET_IFNAME"] == "ib0,ib1"
    # a site's own GLOO_SOCKET_IFNAME stays; NCCL's exclude / exact-match forms are not gloo names
    assert "GLOO_SOCKET_IFNAME" not in export_for_torch(launch, {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth0"})
    for nccl in ("^docker,lo", "=ib0", ""):
        assert "GLOO_SOCKET_IFNAME" not in export_for_torch(launch, {"NCCL_SOCKET_IFNAME": nccl})


def test_export_for_torch_refuses_a_conflicting_environment() -> None:
    launch = resolve_launch(slurm_env())
    with pytest.raises(LaunchEnvError, match=r"RANK='0' in the environment, but the launch says '5'"):
        export_for_torch(launch, {"RANK": "0"})


def test_cli_show_and_rendezvous() -> None:
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO_ROOT), **slurm_env()}
    run = lambda *args: subprocess.run([sys.executable, "-m", "gspo_megatron.trainer.launch_env", *args],
                                       env=env, capture_output=True, text=True)
    shown = run("show")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == dataclasses.asdict(resolve_launch(slurm_env()))
    rendezvous = run("rendezvous")
    assert rendezvous.stdout.strip() == f"gpu07:{derived_port(123456)}"
    assert run("nonsense").returncode == 2
