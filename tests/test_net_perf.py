"""rgpu-admin net-perf against a real pool and a real dispatcher (emulated backend) on loopback:
a probe slice is leased, its token opens a perf session on the data port, and it is released."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from rgpu.errors import AuthError
from rgpu.remoting.datapath import perf
from tests.daemons import RgpuCluster, one_dispatcher_cluster, wait_for
from tests.admin_helpers import admin, run_admin
from tests.remoting.ucx_helpers import _have_ucx


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RgpuCluster]:
    with one_dispatcher_cluster(tmp_path) as c:
        yield c


def test_net_perf_measures_each_dispatcher_and_releases_its_probe(cluster: RgpuCluster) -> None:
    run = admin(cluster, "net-perf", "--pings", "20", "--size", "4M", "--json")
    rows = json.loads(run.stdout)
    assert len(rows) == 1 and rows[0]["ok"], rows
    assert run.stderr == ""        # no progress bar where stderr is not a terminal
    row = rows[0]
    assert row["server"].startswith("127.0.0.1:")
    assert 0 < row["rtt_min_us"] <= row["rtt_p50_us"] <= row["rtt_p99_us"]
    assert row["upload_bytes_per_s"] > 0 and row["download_bytes_per_s"] > 0
    with cluster.client() as client:
        assert client.list_leases() == []        # the probe slice was released
        assert [r.account for r in client.usage().rows] == ["net-perf"]
    table = admin(cluster, "net-perf", "--pings", "5", "--size", "1M").stdout
    assert "RTT P50 us" in table and "/s" in table and "ERROR" in table
    assert "perf session from" in cluster.daemons[-1].log()


def test_perf_session_needs_a_valid_token(cluster: RgpuCluster) -> None:
    with cluster.client() as client:
        server = client.list_servers().servers[0].address
    with pytest.raises(AuthError, match="token"):
        perf.measure(server, "not-a-token", pings=1, bulk_bytes=1)


def test_net_perf_of_an_unknown_server_fails_with_a_fix(cluster: RgpuCluster) -> None:
    run = admin(cluster, "net-perf", "--server", "nosuchhost", ok=False)
    assert run.returncode != 0 and "no dispatcher to measure" in run.stderr and "rgpu-admin health" in run.stderr
    too_big = admin(cluster, "net-perf", "--size", "2G", ok=False)
    assert too_big.returncode != 0 and "--size 2G is more than a perf session moves" in too_big.stderr, too_big
    with cluster.client() as client:
        assert client.list_leases() == []         # refused before any probe was leased


def test_summarise_and_percentile() -> None:
    r = perf.summarise("h:1", 0.002, [3e-6, 1e-6, 2e-6], (10 << 20, 0.5), (0, 0.0))
    assert (r.rtt_min_us, r.rtt_p50_us, r.connect_ms) == (pytest.approx(1), pytest.approx(2), pytest.approx(2))
    assert r.upload_bytes_per_s == pytest.approx(20 << 20) and r.download_bytes_per_s == 0
    assert perf.percentile([5.0, 1.0, 9.0, 3.0], 100) == 9.0


# --- UCX (issue 25): the bulk over UCX too, and the transports it took ---------------------------

needs_ucx = pytest.mark.skipif(not _have_ucx(), reason="UCX is not installed (no libucp.so.0: apt-get install "
                               "libucx-dev, as scripts/test.sh does from .ci/debian-packages.txt)")


@needs_ucx
def test_net_perf_measures_ucx_beside_tcp_and_names_ucxs_transports(cluster: RgpuCluster) -> None:
    (row,) = json.loads(admin(cluster, "net-perf", "--pings", "5", "--size", "9M", "--json").stdout)
    assert row["ok"] and row["ucx_why_not"] == "", row
    assert row["ucx"]["upload_bytes_per_s"] > 0 and row["ucx"]["download_bytes_per_s"] > 0
    assert "/" in row["ucx"]["transports"], row       # "posix/memory, cma/memory" here, "tcp/lo" under UCX_TLS=tcp
    table = admin(cluster, "net-perf", "--pings", "5", "--size", "1M", "--transport", "ucx").stdout
    transports = [line.split()[1] for line in table.splitlines()[2:]]
    assert transports == ["tcp", "ucx"] and f"ucx ({row['ucx']['transports']})" in table, table
    # The dispatcher never loads UCX itself: each such session had its helper, and says what it took.
    said = f"transport ucx ({row['ucx']['transports']})"
    wait_for(lambda: cluster.daemons[-1].log().count(said) == 2, what="both sessions' lines")
    with cluster.client() as client:
        assert client.list_leases() == []


@needs_ucx
def test_net_perf_over_tcp_only_offers_no_ucx(cluster: RgpuCluster) -> None:
    (row,) = json.loads(admin(cluster, "net-perf", "--pings", "2", "--size", "1M", "--transport", "tcp",
                              "--json").stdout)
    assert row["ok"] and row["ucx"] is None and row["ucx_why_not"] == "", row
    assert "transport ucx" not in cluster.daemons[-1].log()


@pytest.fixture
def tcp_cluster(tmp_path: Path) -> Iterator[RgpuCluster]:
    with one_dispatcher_cluster(tmp_path, transport="tcp") as c:
        yield c


@needs_ucx
@pytest.mark.integration
def test_a_dispatcher_set_to_tcp_is_measured_over_tcp_and_says_why_not_ucx(tcp_cluster: RgpuCluster) -> None:
    (row,) = json.loads(admin(tcp_cluster, "net-perf", "--pings", "2", "--size", "1M", "--json").stdout)
    assert row["ok"] and row["ucx"] is None and row["upload_bytes_per_s"] > 0
    assert "the dispatcher's transport setting is tcp" in row["ucx_why_not"], row
    table = admin(tcp_cluster, "net-perf", "--pings", "2", "--size", "1M").stdout
    assert "not measured: the dispatcher took no UCX: the dispatcher's transport setting is tcp" in table, table
    asked = admin(tcp_cluster, "net-perf", "--pings", "2", "--size", "1M", "--transport", "ucx", ok=False)
    assert asked.returncode == 7, asked
    assert "not measured over UCX" in asked.stdout and "could not be measured" in asked.stderr


def test_a_node_without_ucx_measures_tcp_and_says_why(cluster: RgpuCluster, tmp_path: Path) -> None:
    env = {k: v for k, v in cluster.env().items() if k.startswith("RGPU_")} | {"RGPU_UCX_LIB": str(tmp_path)}
    (row,) = json.loads(run_admin(["net-perf", "--pings", "2", "--size", "1M", "--json"], env).stdout)
    assert row["ok"] and row["ucx"] is None and row["upload_bytes_per_s"] > 0
    assert row["ucx_why_not"].startswith("this node cannot use UCX"), row
    asked = run_admin(["net-perf", "--pings", "2", "--size", "1M", "--transport", "ucx"], env)
    assert asked.returncode == 7 and "this node cannot use UCX" in asked.stdout, asked
    with cluster.client() as client:
        assert client.list_leases() == []


def _announce_and_stop(cluster: RgpuCluster, job: str, op: int, then_leave: bool) -> None:
    """A UCX probe that announces 1 GiB over UCX and moves none of it; it leaves at once, or keeps
    its connection open until the dispatcher's helper has ended."""
    from rgpu.remoting.datapath import protocol
    from rgpu.remoting.datapath.worker.ucx import UcxLink
    from rgpu.remoting.native.build import ensure_built

    with cluster.client() as client:
        lease = client.allocate(job, "alice", 1, memory_bytes=1 << 20)
        link = UcxLink(str(ensure_built().libworker), "")
        try:
            sock, welcome = protocol.handshake(lease.slices[0].server, lease.slices[0].token,
                                               flags=protocol.HELLO_PERF, ucx_address=link.address)
            with sock:
                assert welcome.ucx_address and "; ucx: " in welcome.description, welcome
                link.connect(welcome.ucx_address)
                sock.sendall(protocol.pack_frame(op, perf._U64.pack(1 << 30), seq=1))
                if not then_leave:
                    wait_for(lambda: f"(job {job}) moved 0 bytes" in cluster.daemons[-1].log(), what="the helper's end")
        finally:
            link.close()
        wait_for(lambda: f"(job {job}) moved 0 bytes; transport ucx" in cluster.daemons[-1].log(), what="the helper's end")
        client.release(job)


@needs_ucx
def test_a_ucx_probe_that_leaves_mid_transfer_ends_its_helper_and_the_next_probe_works(cluster: RgpuCluster) -> None:
    from rgpu.remoting.datapath import protocol

    _announce_and_stop(cluster, "job-leaver", protocol.OP_UCX_SINK, then_leave=True)
    assert "a transfer over UCX failed: the peer closed the session" in cluster.daemons[-1].log()
    (row,) = json.loads(admin(cluster, "net-perf", "--pings", "2", "--size", "1M", "--json").stdout)
    assert row["ok"] and row["ucx"] is not None, row


@needs_ucx
@pytest.mark.integration
@pytest.mark.parametrize("direction", ["upload", "download"])
def test_a_ucx_probe_that_stalls_ends_after_the_perf_idle_time(tmp_path: Path, direction: str) -> None:
    """A client that announces a UCX transfer and then neither sends nor receives, connection open:
    its helper gives up after session_perf_idle_seconds, as a stalled TCP probe does (UCX's own
    RGPU_UCX_IDLE_S is 60 s)."""
    from rgpu.remoting.datapath import protocol

    op = protocol.OP_UCX_SINK if direction == "upload" else protocol.OP_UCX_SOURCE
    with one_dispatcher_cluster(tmp_path, session_perf_idle_seconds=1) as cluster:
        _announce_and_stop(cluster, "job-staller", op, then_leave=False)
        assert "made no progress for 1 s" in cluster.daemons[-1].log()


def test_table_rows_of_a_dispatcher_measured_both_ways_or_not_at_all() -> None:
    from rgpu.remoting.admin import netperf
    both = netperf.perf_row("h:1", perf.PerfResult("h:1", 1.0, 30, 35, 40, 1 << 30, 1 << 30,
                                                    ucx=perf.UcxResult("tcp/lo", 90.0, 2 << 30, 3 << 30)))
    assert [r[:2] for r in netperf.table_rows(both)] == [["h:1", "tcp"], ["h:1", "ucx (tcp/lo)"]]
    assert netperf.table_rows(both)[1][5:7] == ["2.0 GiB/s", "3.0 GiB/s"]
    refused = netperf.perf_row("h:1", perf.PerfResult("h:1", 1.0, 30, 35, 40, 1, 1, ucx_why_not="no"),
                               ucx_required=True)
    assert not refused["ok"] and netperf.table_rows(refused)[1][-1] == "not measured over UCX: no"
    assert netperf.table_rows(netperf.perf_row("h:1", None, "down")) == [["h:1", "-", "-", "-", "-", "-", "-", "down"]]


@needs_ucx
def test_a_garbage_ucx_address_aborts_only_its_helper_and_the_dispatcher_serves_on(cluster: RgpuCluster) -> None:
    import random

    from rgpu.errors import RgpuError
    from rgpu.remoting.datapath import protocol

    garbage = random.Random(0).randbytes(64)      # UCX asserts on its version field and aborts
    with cluster.client() as client:
        lease = client.allocate("job-garbage", "alice", 1, memory_bytes=1 << 20)
        with pytest.raises((RgpuError, OSError)):
            sock, _ = protocol.handshake(lease.slices[0].server, lease.slices[0].token, flags=protocol.HELLO_PERF,
                                         ucx_address=garbage)
            sock.close()
        client.release("job-garbage")
    dispatcher = cluster.daemons[-1]
    wait_for(lambda: "the UCX helper was killed by signal 6" in dispatcher.log(), what="the helper's end logged")
    assert dispatcher.alive
    (row,) = json.loads(admin(cluster, "net-perf", "--pings", "2", "--size", "1M", "--json").stdout)
    assert row["ok"] and row["ucx"] is not None, row


@needs_ucx
@pytest.mark.integration
def test_a_probe_of_a_gpu_node_whose_sessions_keep_tcp_says_so() -> None:
    """Under transport = auto a real GPU's sessions copy over TCP (transport.worker_choice) while the
    probe measures UCX: the helper's WELCOME says so and the table's UCX row notes it."""
    import socket
    import threading

    from rgpu.remoting.admin import netperf
    from rgpu.remoting.datapath import perf_ucx, protocol
    from rgpu.remoting.datapath.transport import worker_choice
    from rgpu.remoting.datapath.worker.ucx import UcxLink
    from rgpu.remoting.native.build import ensure_built

    library = str(ensure_built().libworker)
    why = worker_choice("auto", True, "cuda", "cuda").why
    client_link = UcxLink(library, "")
    ours, helpers = socket.socketpair()
    outcome: list[dict] = []
    helper = threading.Thread(target=lambda: outcome.append(perf_ucx.serve(helpers, {
        "ucx_library": library, "ucx_peer": client_link.address.hex(), "sessions_keep_tcp": why})))
    helper.start()
    try:
        _, payload = protocol.recv_frame(ours)
        welcome = protocol.decode_welcome(payload)
        ours.sendall(protocol.pack_frame(protocol.OP_BYE))
        helper.join(timeout=30)
    finally:
        ours.close()
        client_link.close()
    assert welcome.ucx_address and welcome.flags & protocol.WELCOME_PERF
    assert welcome.description.endswith(f"; sessions keep tcp: {why}"), welcome.description
    assert outcome and outcome[0]["transports"] and outcome[0]["why_not"] == "", outcome
    row = netperf.perf_row("h:1", perf.PerfResult("h:1", 1.0, 30, 35, 40, 1, 1, ucx=perf.UcxResult(
        outcome[0]["transports"], 90.0, 2, 3, sessions_keep_tcp=perf.sessions_keep_tcp(welcome))))
    assert netperf.table_rows(row)[1][-1] == f"note: its sessions keep TCP ({why})"
    assert perf_ucx.description("", "no library", "") == "perf session; no ucx: no library"
