"""rgpu-admin health --deep over SSH against a real sshd on loopback (generated host and user
keys), with a real pool and an emulated dispatcher; and the pure checks on captured output."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rgpu.remoting.admin import deepcheck as dc
from tests.daemons import RgpuCluster, one_dispatcher_cluster
from tests.sshd import Sshd, start_sshd
from tests.admin_helpers import run_admin


@pytest.fixture
def sshd(tmp_path: Path):  # type: ignore[no-untyped-def]
    server = start_sshd(tmp_path / "sshd")
    yield server
    server.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RgpuCluster]:
    with one_dispatcher_cluster(tmp_path / "rgpu") as c:
        yield c


def deep(cluster: RgpuCluster, sshd: Sshd, *args: str, **config: str):  # type: ignore[no-untyped-def]
    env = {k: v for k, v in cluster.env().items() if k.startswith("RGPU_")}
    env.update({"RGPU_SSH_PORT": str(sshd.port), "RGPU_SSH_USER": sshd.user, "RGPU_SSH_KEY_FILE": str(sshd.key_file),
                "RGPU_SSH_KNOWN_HOSTS_FILE": str(sshd.known_hosts), "RGPU_HEALTH_CLIENT_NODES": "127.0.0.1",
                "RGPU_HEALTH_REMOTE_PYTHON": sys.executable, "RGPU_STATE": str(cluster.state)})
    env.update({f"RGPU_{k.upper()}": v for k, v in config.items()})
    return run_admin(["health", "--deep", *args], env)


def by_check(checks: list[dict]) -> dict[str, dict]:
    return {c["check"]: c for c in checks}


@pytest.mark.integration
def test_deep_health_over_real_sshd(cluster: RgpuCluster, sshd: Sshd) -> None:
    run = deep(cluster, sshd, "--json")
    report = json.loads(run.stdout)
    checks = by_check(report["checks"])
    assert report["servers"][0]["server"].startswith("127.0.0.1:")
    assert checks["ssh"]["status"] == "ok" and "client" in checks["ssh"]["detail"] and "pool" in checks["ssh"]["detail"]
    assert checks["driver"]["status"] == "ok" and "no driver" in checks["driver"]["detail"]
    assert checks["limiter"]["status"] == "ok" and "static inventory" in checks["limiter"]["detail"]
    assert checks["rgpu"]["status"] == "ok" and "client libraries in" in checks["rgpu"]["detail"]
    assert checks["clock"]["status"] == "ok" and "the pool's host 127.0.0.1" in checks["clock"]["detail"]
    rtt = [c for c in report["checks"] if c["check"].startswith("rtt ")]
    assert len(rtt) == 1 and rtt[0]["status"] in ("ok", "warn") and "TCP connect" in rtt[0]["detail"]
    assert {c["status"] for c in report["checks"] if c["check"] == "disk"} == {"ok"}
    assert run.returncode == 0, (run.stdout, run.stderr)

    table = deep(cluster, sshd).stdout
    assert "HOST" in table and "CHECK" in table and "no driver" in table


@pytest.mark.integration
def test_deep_health_failures_say_how_to_fix(cluster: RgpuCluster, sshd: Sshd, tmp_path: Path) -> None:
    with socket.socket() as s:   # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    run = deep(cluster, sshd, "--json", health_client_nodes=f"127.0.0.1,127.0.0.2:{closed}",
               health_remote_python="/nonexistent/python3")
    assert run.returncode != 0
    assert "deep check(s) failed" in run.stderr and "127.0.0.2: ssh" in run.stderr
    checks = json.loads(run.stdout)["checks"]
    unreachable = next(c for c in checks if c["host"] == "127.0.0.2")
    assert unreachable["status"] == "fail" and "sshd" in unreachable["fix"]
    rgpu = next(c for c in checks if c["host"] == "127.0.0.1" and c["check"] == "rgpu")
    assert rgpu["status"] == "fail" and "cannot import rgpu" in rgpu["detail"] and "pip install rgpu" in rgpu["fix"]

    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    run = deep(cluster, sshd, "--json", ssh_known_hosts_file=str(empty))
    ssh = by_check(json.loads(run.stdout)["checks"])["ssh"]
    assert run.returncode != 0 and ssh["status"] == "fail" and "ssh-keyscan" in ssh["fix"]


# ------------------------------------------------------------------ the pure checks

H200 = ("0, GPU-aaaa, NVIDIA H200, 580.159.04, 1980, 1980, Enabled, 0, 0x0000000000000000\n"
        "1, GPU-bbbb, NVIDIA H200, 580.159.04, 1200, 1980, Enabled, 2, 0x0000000000000040\n")


def report(driver: str = H200, rc: int = 0, extra: str = "") -> str:
    return (f"@@section driver\n{driver}@@rc {rc}\n@@section mps\n@@section xid\n{extra}"
            "@@section disk\n/var/lib/rgpu\t/dev/vda 264212084 25063772 81327140 24% /\n"
            "/tmp/my dir\t/dev/vdb 1000000 999000 1000 99% /scratch space\n"
            "@@section rgpu\nversion 0.1.0\nlibraries /root/.cache/rgpu/native/x\n@@rc 0\n"
            "@@section rtt\n10.0.0.5:55001 ms 0.210\n10.0.0.6:55001 error [Errno 111] Connection refused\n@@rc 0\n")


def test_gpu_host_findings_from_captured_output() -> None:
    plan = dc.HostPlan("gpu1", frozenset({"dispatcher", "client"}), ("/var/lib/rgpu", "/tmp/my dir"))
    found = {(f.check, f.status): f for f in dc.evaluate(plan, report(extra="[ 12.3] NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.\n"), enforcement="time-slicing", pool_version="0.1.0")}
    assert "driver 580.159.04, 2 GPU(s)" in found[("driver", "ok")].detail
    assert "hardware thermal" in found[("clocks gpu1", "warn")].detail
    assert ("clocks gpu0", "ok") in found and ("ecc gpu0", "ok") in found
    assert "rgpu-admin drain gpu1" in found[("ecc gpu1", "fail")].fix
    assert "79, GPU has fallen off the bus" in found[("xid", "warn")].detail
    assert "time-sliced" in found[("limiter", "warn")].detail
    disk_fail = found[("disk", "fail")]
    assert "/tmp/my dir" in disk_fail.detail and "/scratch space" in disk_fail.fix
    assert found[("rtt 10.0.0.5:55001", "ok")].detail == "TCP connect 0.21 ms"
    assert "RGPU_SERVER_PORT_MIN" in found[("rtt 10.0.0.6:55001", "fail")].fix


def test_no_driver_is_fine_on_a_cpu_host_and_fails_on_a_gpu_host() -> None:
    text = report(driver="", rc=127)
    cpu = dc.evaluate(dc.HostPlan("cpu1", frozenset({"client"}), ()), text)
    assert [(f.status, f.detail) for f in cpu if f.check == "driver"] == [("ok", "no driver (CPU host; none needed)")]
    gpu = dc.evaluate(dc.HostPlan("gpu1", frozenset({"dispatcher"}), ()), text)
    driver = next(f for f in gpu if f.check == "driver")
    assert driver.status == "fail" and "install the NVIDIA driver" in driver.fix


def test_clock_skew_and_offsets() -> None:
    offset, uncertainty = dc.clock_offset(1000.5, 1000.0, 1000.2)
    assert offset == pytest.approx(0.4) and uncertainty == pytest.approx(0.1)
    assert dc.check_skew("h", 0.3, 0.01, "pool").status == "ok"
    assert dc.check_skew("h", 5.0, 0.01, "pool").status == "warn"
    bad = dc.check_skew("h", -120.0, 0.01, "pool")
    assert bad.status == "fail" and "chrony" in bad.fix


def test_script_quotes_hostile_folders() -> None:
    script = dc.build_script(dc.HostPlan("h", frozenset({"pool"}), ("/tmp/a'; rm -rf /",), python="/opt/my py/python3"))
    assert "'/tmp/a'\"'\"'; rm -rf /'" in script and "'/opt/my py/python3'" in script
    assert " build" not in script.split("@@section rgpu")[1].split("\n")[1].rsplit("'", 1)[1]


def test_hosts_are_planned_once_with_their_roles() -> None:
    from rgpu.config import load_settings
    from rgpu.proto import rgpu_pb2 as pb
    from rgpu.remoting.admin.deep_health import plan_hosts
    from rgpu.remoting.admin.hosts import parse_node_list, split_node

    assert parse_node_list("c1, c2\nc3 c1") == ["c1", "c2", "c3"]
    assert split_node("c1", 22) == ("c1", 22) and split_node("c1:2222", 22) == ("c1", 2222)
    settings = load_settings(env={"RGPU_POOL": "gpu1:50001", "RGPU_STATE": "/var/lib/rgpu/pool.db"})
    servers = [pb.Server(address="gpu1:55001", static_inventory=False, compute_enforcement="mps"),
               pb.Server(address="gpu1:55002", static_inventory=True), pb.Server(address="gpu2:55001")]
    jobs = {j.plan.host: j for j in plan_hosts(settings, servers, ["cpu1", "cpu2:2222"])}
    assert set(jobs) == {"gpu1", "gpu2", "cpu1", "cpu2"}
    assert jobs["gpu1"].plan.roles == {"pool", "dispatcher"} and not jobs["gpu1"].static_inventory
    assert jobs["gpu1"].plan.dirs == ("/var/lib/rgpu", "/tmp") and jobs["gpu1"].enforcement == "mps"
    assert jobs["cpu1"].plan.dispatchers == ("gpu1:55001", "gpu1:55002", "gpu2:55001")
    assert jobs["cpu2"].target.port == 2222 and jobs["gpu2"].target.port == 22
    assert [j.plan.host for j in plan_hosts(settings, servers, ["cpu1"], only=["cpu1"])] == ["cpu1"]
