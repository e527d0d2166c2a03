"""The dispatcher's session port under attack, against a real rgpu-poold and rgpu-dispatcher on
loopback: a slowloris of many connections trickling bytes (with a lowered open-file limit), one
source holding many connections, and short or garbled HELLOs. Loopback's whole 127/8 reaches the
dispatcher, so the attacker's connections come from 127.0.0.2.. and the legitimate client's
from 127.0.0.1."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rgpu.errors import RgpuError
from rgpu.remoting.datapath import protocol
from tests.daemons import EXAMPLES, RgpuCluster, wait_for
from tests.dispatcher_helpers import wait_state
from tests.front_door_helpers import Slowloris
from tests.remoting.conftest import preload_shim

INVENTORY = EXAMPLES / "inventory-a.toml"
HELLO_LATE = Path(__file__).parent / "remoting" / "hello_late.c"
DEADLINE = 3.0
NOFILE = 256

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RgpuCluster]:
    c = RgpuCluster(tmp_path / "cluster")
    c.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5,
                   session_hello_deadline_seconds=DEADLINE, session_handshakes_per_address=16)
    try:
        yield c
    finally:
        c.stop_all()


def _up(cluster: RgpuCluster, nofile: int | None = None) -> tuple[object, str, str]:
    cluster.start_pool()
    daemon, port = cluster.start_dispatcher(INVENTORY, nofile=nofile)
    address = f"127.0.0.1:{port}"
    wait_state(cluster, address, "up")
    with cluster.client() as client:
        token = client.allocate("job-door", "alice", 1, percent=50).slices[0].token
    return daemon, address, token


def test_legitimate_sessions_are_served_through_a_slowloris(cluster: RgpuCluster) -> None:
    daemon, address, token = _up(cluster, nofile=NOFILE)
    port = int(address.rsplit(":", 1)[1])
    timings: list[float] = []
    with Slowloris(port, count=300, sources=40) as attack:
        # The attack runs past one deadline before the probes (pacing, not a measure: most of its
        # connections are evicted for newcomers long before their deadline).
        time.sleep(DEADLINE + 1.5)
        for _ in range(10):
            t0 = time.monotonic()
            welcome = protocol.probe(address, token, timeout=10)
            timings.append(time.monotonic() - t0)
            assert "slice ready" in welcome.description
            time.sleep(0.2)
        held = attack.held()
        lifetimes, bytes_sent = sorted(attack.lifetimes), list(attack.bytes_sent)
    # Trickling a byte every 0.5 s keeps no connection: each is closed, evicted for a newcomer or
    # at its deadline, before its 24-byte header is complete (at most about 7 bytes in the 3 s
    # deadline, fewer on a loaded host); held until then, it would live 12 s. The deadline's own
    # rule (from the accept, never reset by a byte) is the next test's.
    assert bytes_sent and max(bytes_sent) < protocol.HEADER_SIZE, sorted(bytes_sent)[-5:]
    log = daemon.log()
    assert "Too many open files" not in log and "accept failed" not in log, log[-2000:]
    print(f"\nslowloris: {attack.opened} attack connections opened from 40 addresses, {held} open at the "
          f"end, longest lived {lifetimes[-1]:.2f} s (deadline {DEADLINE:g} s) after at most {max(bytes_sent)} bytes; legitimate probes under attack "
          f"(RLIMIT_NOFILE {NOFILE}): {len(timings)}/10 served, median {sorted(timings)[5] * 1000:.1f} ms, "
          f"max {max(timings) * 1000:.1f} ms")
    # Every probe above was served (typically in milliseconds; a SYN the kernel drops while the
    # attacker keeps the listen backlog full is retried after 1 s, then 3 s): how long is a figure.


def test_the_hello_deadline_counts_from_the_accept_not_the_last_byte(cluster: RgpuCluster) -> None:
    _daemon, address, _token = _up(cluster)
    port = int(address.rsplit(":", 1)[1])
    with Slowloris(port, count=5, sources=1, every=0.3) as attack:
        wait_for(lambda: len(attack.lifetimes) >= 5, timeout=60, what="the dispatcher to close the 5 connections")
        lifetimes = list(attack.lifetimes)
        refusals = list(attack.refusals)
    print(f"\nHELLO deadline {DEADLINE:g} s: trickled connections closed after "
          f"{', '.join(f'{t:.2f}' for t in lifetimes[:5])} s")
    # Not before the deadline; closed while still trickling, with the deadline's refusal (had each
    # byte reset the deadline, they would live on until their header, then be refused for its size).
    assert all(t > DEADLINE - 0.2 for t in lifetimes[:5]), lifetimes
    assert refusals and all(r.startswith("rgpu: session: no HELLO within 3 s of connecting") and "\n" not in r
                            for r in refusals), refusals


def test_one_source_address_holds_at_most_its_share(cluster: RgpuCluster) -> None:
    _daemon, address, token = _up(cluster)
    port = int(address.rsplit(":", 1)[1])
    socks = []
    for _ in range(40):
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.connect(("127.0.0.1", port))
        s.sendall(b"\x40")
        socks.append(s)
    time.sleep(1.0)
    ended = [_ended_by_server(s) for s in socks]
    for s in socks:
        s.close()
    assert ended.count(None) == 16
    # Each of the others was told why, and that it may retry (REFUSE_RETRY).
    assert all(text and "handshake slots of 127.0.0.2 were taken" in text for text in ended if text is not None), ended
    protocol.probe(address, token, timeout=5)   # 127.0.0.1 is not held back by 127.0.0.2


def _ended_by_server(s: socket.socket) -> str | None:
    """None while the dispatcher holds the connection open; once it has closed it, the text of the
    REFUSE it sent first ("" without one)."""
    s.setblocking(False)
    got = b""
    while True:
        try:
            chunk = s.recv(4096)
        except BlockingIOError:
            return None
        except OSError:
            chunk = b""
        if not chunk:
            break
        got += chunk
    header = protocol.HEADER.unpack(got[:protocol.HEADER_SIZE]) if len(got) >= protocol.HEADER_SIZE else None
    if header is None or header[1] != protocol.OP_REFUSE or not header[2] & protocol.REFUSE_RETRY:
        return ""
    return protocol.decode_refuse(got[protocol.HEADER_SIZE:])[1]


def _refusal_for(address: str, data: bytes) -> str:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        (_, op, _, _, _, _), payload = protocol.recv_frame(s, 1 << 20)
    assert op == protocol.OP_REFUSE
    return protocol.decode_refuse(payload)[1]


@pytest.mark.parametrize("payload", [
    protocol.MAGIC + struct.pack("<I", protocol.PROTOCOL_VERSION),              # version only: short
    protocol.MAGIC + struct.pack("<II", protocol.PROTOCOL_VERSION, 0) + b"\x01",  # truncated token length
    protocol.MAGIC + struct.pack("<III", protocol.PROTOCOL_VERSION, 0, 1 << 30),  # token longer than the frame
    b"junk",
])
def test_short_or_garbled_hello_gets_one_line(cluster: RgpuCluster, payload: bytes) -> None:
    daemon, address, _token = _up(cluster)
    text = _refusal_for(address, protocol.pack_frame(protocol.OP_HELLO, payload))
    assert text.startswith("rgpu: session: ") and "\n" not in text and len(text) < 300, text
    assert "malformed HELLO" in text or "not an rgpu HELLO" in text, text
    assert "struct.error" not in daemon.log() and "Traceback" not in daemon.log()


def test_a_frame_other_than_hello_and_a_huge_frame_are_refused_in_one_line(cluster: RgpuCluster) -> None:
    _daemon, address, _token = _up(cluster)
    assert "expected HELLO" in _refusal_for(address, protocol.pack_frame(7, b"x"))
    huge = protocol.HEADER.pack(1 << 30, protocol.OP_HELLO, 0, 0, 0, 0)
    assert "larger than allowed" in _refusal_for(address, huge)


class Neighbour(Slowloris):
    """A user on the same CPU node: its connections come from 127.0.0.1, like the legitimate
    client's (every=inf: they send nothing)."""

    def _source_address(self, n: int) -> str:
        return "127.0.0.1"


@pytest.mark.parametrize("trickle,sessions", [(False, 30), (True, 15)])
def test_a_neighbours_idle_connections_do_not_lock_out_its_node(cluster: RgpuCluster, trickle: bool,
                                                                sessions: int) -> None:
    """Issue 26, MED 6: 20 connections from the same address as the legitimate client, held idle
    (or trickling) and reopened as the dispatcher closes them, past the 16 slots of one address."""
    _daemon, address, token = _up(cluster)
    port = int(address.rsplit(":", 1)[1])
    opened, failures = 0, []
    with Neighbour(port, count=20, sources=1, every=0.5 if trickle else float("inf")) as neighbour:
        time.sleep(DEADLINE + 1.0)        # the first wave has been closed at its deadline and reopened
        for _ in range(sessions):
            try:
                sock, _welcome = protocol.handshake(address, token, timeout=10)
            except RgpuError as exc:
                failures.append(str(exc))
                continue
            opened += 1
            sock.close()
        reopened = neighbour.closed_by_server
    print(f"\nneighbour on 127.0.0.1 ({'trickling' if trickle else 'idle'}, 20 held, {reopened} reopened): "
          f"{opened} of {sessions} sessions from 127.0.0.1 opened")
    assert opened == sessions, failures[:3]
    assert reopened >= 4, reopened       # the neighbour did hold the address's slots


def test_a_client_late_with_its_hello_retries_when_it_made_way(cluster: RgpuCluster,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A client descheduled between its connect and its HELLO (a loaded node: CI's 2 cores) looks idle
    until the HELLO comes; beside a neighbour reconnecting as fast as it is closed, 16 newer
    connections from its address arrive first and it makes way (CI saw 1 session of 30 fail so).
    The door says so (REFUSE_RETRY) and protocol.handshake connects again."""
    _daemon, address, token = _up(cluster)
    port = int(address.rsplit(":", 1)[1])
    late = [False]
    made_way: list[str] = []
    client_info, handshake_once = protocol.client_info, protocol._handshake_once

    def late_info() -> dict:
        if late[0]:   # the first attempt only: the stall passes
            late[0] = False
            time.sleep(0.05)
        return client_info()

    def recorded_once(*args: object, **kwargs: object) -> tuple[socket.socket, protocol.Welcome]:
        try:
            return handshake_once(*args, **kwargs)   # type: ignore[arg-type]
        except protocol.DoorFull as exc:
            made_way.append(str(exc))
            raise

    monkeypatch.setattr(protocol, "client_info", late_info)
    monkeypatch.setattr(protocol, "_handshake_once", recorded_once)
    with Neighbour(port, count=20, sources=1, every=float("inf")) as neighbour:
        time.sleep(DEADLINE + 1.0)
        for _ in range(5):
            late[0] = True
            sock, _welcome = protocol.handshake(address, token, timeout=10)
            sock.close()
        reopened = neighbour.closed_by_server
    print(f"\nneighbour reopened {reopened}; {len(made_way)} of 5 late HELLOs made way, each then retried and served")
    # 50 ms is some 50-200 of the neighbour's reconnects: the late HELLOs did make way (before the
    # fix, each such one ended its handshake with "connection closed by peer").
    assert made_way, reopened
    assert all("handshake slots of 127.0.0.1 were taken" in text and "retry" in text for text in made_way), made_way


@pytest.fixture(scope="module")
def late_client(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """rgpu's client libraries built from this checkout, and tests/remoting/hello_late.c to preload."""
    from rgpu.remoting.native import build

    folder = tmp_path_factory.mktemp("native")
    libs = build.build(folder / "lib")
    return libs.folder, preload_shim(HELLO_LATE, folder / "hello_late.so")


def test_the_client_library_late_with_its_hello_retries_when_it_made_way(cluster: RgpuCluster,
                                                                         late_client: tuple[Path, Path]) -> None:
    """The previous test's, for rgpu's libcuda (transport.c): its session connection, dialled after
    its data lanes just before its HELLO, makes way while the HELLO is held back 50 ms (hello_late.c
    preloaded), and the session opens at the next try."""
    folder, shim = late_client
    _daemon, address, token = _up(cluster)
    port = int(address.rsplit(":", 1)[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")} | {
        "LD_LIBRARY_PATH": str(folder), "LD_PRELOAD": str(shim), "RGPU_SLICES": f"{address},{token}",
        "RGPU_LOG": "info", "RGPU_TRANSPORT": "tcp", "RGPU_TEST_HELLO_LATE_MS": "50"}
    program = 'import ctypes; print("INIT", ctypes.CDLL("libcuda.so.1").cuInit(0))'
    with Neighbour(port, count=20, sources=1, every=float("inf")) as neighbour:
        time.sleep(DEADLINE + 1.0)
        runs = [subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60,
                               check=False) for _ in range(3)]
        reopened = neighbour.closed_by_server
    made_way = [line for done in runs for line in done.stderr.splitlines() if "again in 50 ms" in line]
    print(f"\nneighbour reopened {reopened}; {len(made_way)} of 3 late HELLOs of the C client made way, "
          "each then retried and served")
    assert all("INIT 0" in done.stdout for done in runs), [done.stdout + done.stderr for done in runs]
    assert made_way, reopened
    assert all("handshake slots of 127.0.0.1 were taken" in line for line in made_way), made_way
