"""`flexrun local` (issue 25 item 4): an application under a slice of this node's own GPU, through
the same-host path; which of the pool's servers are on this node; the one line when a copy path is
not the same-host one."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from rgpu.remoting.client import flexrun
from rgpu.remoting.client.local import is_local, local_servers
from rgpu.remoting.native import build

from tests.remoting.conftest import EXAMPLES, PY

HERE = Path(__file__).parent
NODE = {"gpu-a.example": ["10.0.0.5"], "gpu-b.example": ["10.0.0.6"], "localhost": ["127.0.0.1", "::1"],
        "both.example": ["10.0.0.6", "10.0.0.5"]}
OWNED = {"10.0.0.5", "127.0.0.1", "::1"}


def _resolve(host: str) -> list[str]:
    return NODE.get(host, [host] if host[0].isdigit() or ":" in host else [])


def test_a_server_is_local_when_its_host_names_an_address_of_this_node() -> None:
    def here(a: str) -> bool:
        return is_local(a, _resolve, OWNED.__contains__)

    assert here("gpu-a.example:55001") and here("localhost:55001") and here("[::1]:55001") and here("both.example:1")
    assert not here("gpu-b.example:55001") and not here("nowhere.example:55001") and not here("10.0.0.7:55001")
    assert not here("no port") and not here("")
    addresses = ["gpu-b.example:55001", "gpu-a.example:55001", "10.0.0.5:55002"]
    assert local_servers(addresses, ["up", "up", "drained"], _resolve, OWNED.__contains__) == ["gpu-a.example:55001"]


def test_the_real_checks_know_loopback_and_refuse_a_documentation_address() -> None:
    assert is_local("127.0.0.1:55001") and is_local("localhost:55001")
    assert not is_local("192.0.2.1:55001")   # TEST-NET-1: never an address of this node


def test_flexrun_local_parses_as_a_mode() -> None:
    args = flexrun.parse_args(["local", "-p", "0.5", "--", "python", "train.py", "local"])
    assert args.local and args.num_gpus == 1 and args.size.fraction == 0.5
    assert args.command == ["python", "train.py", "local"]
    assert flexrun.parse_args(["local", "-n", "2", "-m", "8G", "app"]).num_gpus == 2
    assert flexrun.parse_args(["--", "local"]).command == ["local"] and not flexrun.parse_args(["--", "local"]).local


@pytest.mark.parametrize("argv, message", [
    (["local", "-f", "a.conf", "app"], "rgpu: flexrun: flexrun local cannot be used with -f"),
    (["local", "-l", "h:1", "app"], "rgpu: flexrun: flexrun local cannot be used with -l"),
    (["local", "-n", "0", "app"], "rgpu: flexrun: -n 0 asks for no GPU"),
    (["local"], "rgpu: flexrun: no application given"),
])
def test_flexrun_local_usage_errors_are_one_line(argv: list[str], message: str) -> None:
    result = CliRunner().invoke(flexrun.cli, flexrun.local_argv(argv))
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr


def test_the_same_host_mark_and_rgpu_toml_lane_keys_reach_the_application(tmp_path: Path) -> None:
    env = flexrun.build_env([flexrun.Slice("h:1", "t")], tmp_path, {"RGPU_LANES": "2"},
                            settings_env={"RGPU_LANES": "4", "RGPU_LANE_CHUNK_BYTES": "1048576"}, same_host=True)
    assert (env["RGPU_LANES"], env["RGPU_LANE_CHUNK_BYTES"], env["RGPU_SAME_HOST"]) == ("2", "1048576", "1")
    assert "RGPU_SAME_HOST" not in flexrun.build_env([flexrun.Slice("h:1", "t")], tmp_path, {})


# An application that copies 4 MiB to its slice and back (the same-host path carries copies of 1 MiB and more).
COPY_APP = textwrap.dedent(f"""
    import sys; sys.path.insert(0, {str(HERE)!r})
    from ctcuda import *
    setup()
    n = 4 << 20
    src = (ctypes.c_ubyte * n)(*([7] * n)); back = (ctypes.c_ubyte * n)()
    d = ctypes.c_uint64(); check("cuMemAlloc_v2", ctypes.byref(d), ctypes.c_size_t(n))
    check("cuMemcpyHtoD_v2", d, src, ctypes.c_size_t(n)); check("cuMemcpyDtoH_v2", back, d, ctypes.c_size_t(n))
    print("TOTAL", mem_info()[1], "WHOLE", bytes(back) == bytes(src))
    """)


def _cluster_run(native_libs: build.Libraries, tmp_path: Path, argv: list[str], dispatcher_env: dict[str, str],
                 client_env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], list]:
    pytest.importorskip("rgpu.remoting.pool.daemon")
    from tests.daemons import RgpuCluster, wait_for
    cluster = RgpuCluster(tmp_path / "cluster")
    try:
        cluster.start_pool()
        # Elsewhere: a dispatcher the pool lists at an address that is not this node's (192.0.2.1,
        # TEST-NET-1); here: inventory-a's on loopback. Without `local` the pool may place on either.
        cluster.start_dispatcher(EXAMPLES.parent / "inventory-a.toml", None, env=cluster.env(**dispatcher_env))
        cluster.start_dispatcher(EXAMPLES.parent / "inventory-b.toml", None, "--advertise", "192.0.2.1")
        with cluster.client() as client:
            wait_for(lambda: len(client.list_servers().servers) == 2, what="both dispatchers to register")
        env = cluster.env(RGPU_NATIVE_DIR=str(native_libs.folder), **client_env)
        done = subprocess.run([PY, "-m", "rgpu.remoting.client.flexrun", *argv, "--", PY, "-c", COPY_APP], env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        with cluster.client() as client:
            left = list(client.list_leases())
        return done, left
    finally:
        cluster.stop_all()


@pytest.mark.integration
def test_flexrun_local_runs_the_application_on_this_nodes_gpu_through_the_same_host_path(
        native_libs: build.Libraries, tmp_path: Path) -> None:
    done, left = _cluster_run(native_libs, tmp_path, ["local", "-p", "0.5"], {}, {"RGPU_LOG": "info"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TOTAL 42949672960 WHOLE True" in done.stdout, done.stdout   # half of inventory-a's 80 GB H100
    assert "127.0.0.1:" in done.stderr and "; transport ucx: " in done.stderr, done.stderr
    assert left == []   # released at exit


@pytest.mark.integration
def test_flexrun_local_says_in_one_line_when_copies_do_not_take_the_same_host_path(
        native_libs: build.Libraries, tmp_path: Path) -> None:
    done, left = _cluster_run(native_libs, tmp_path, ["local"], {"RGPU_TRANSPORT": "tcp"}, {})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WHOLE True" in done.stdout, done.stdout
    lines = [line for line in done.stderr.splitlines() if "not the same-host path" in line]
    assert len(lines) == 1 and "go over TCP, not UCX (not the same-host path) (the GPU server did not take UCX" in lines[0], \
        done.stderr
    assert left == []
