"""The wire protocol: handshake encoding, version checks in both directions, server status."""

from __future__ import annotations

import socket
import struct
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from rgpu.remoting.datapath import protocol
from rgpu.remoting.native import build

from rgpu.errors import AuthError, Unavailable
from tests.remoting.client_helpers import py_client
from tests.remoting.conftest import PY, Server, run_client
from tests.remoting.door_helpers import NOT_RETRIED, Door
from tests.remoting.lanes_helpers import LANE_ENV, LANES, THRESHOLD, _striped


def test_hello_and_welcome_round_trip() -> None:
    frame = protocol.encode_hello("rgpu1.abc.def", flags=protocol.HELLO_NVML, info={"pid": 7})
    header = protocol.HEADER.unpack(frame[:protocol.HEADER_SIZE])
    assert header[1] == protocol.OP_HELLO and header[0] == len(frame) - protocol.HEADER_SIZE
    hello = protocol.decode_hello(frame[protocol.HEADER_SIZE:])
    assert (hello.version, hello.flags, hello.token, hello.info) == (protocol.PROTOCOL_VERSION, 2, "rgpu1.abc.def", {"pid": 7})
    w = protocol.encode_welcome(driver_version=13000, memory_limit_bytes=5, compute_percent=50, flags=1, description="d")
    assert protocol.decode_welcome(w[protocol.HEADER_SIZE:]) == protocol.Welcome(protocol.PROTOCOL_VERSION, 13000, 5, 50, 1, "d")
    assert protocol.decode_hello_version(b"RGPU" + struct.pack("<I", 99) + b"garbage") == 99
    with pytest.raises(ValueError):
        protocol.decode_hello_version(b"HTTP/1.1 ")


def test_server_refuses_a_client_of_another_version(emulated: Server) -> None:
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.handshake(emulated.address, emulated.token(), version=protocol.PROTOCOL_VERSION + 1)
    text = str(info.value)
    assert text == (f"rgpu: session: protocol version mismatch (client speaks {protocol.PROTOCOL_VERSION + 1}, "
                    f"server speaks {protocol.PROTOCOL_VERSION}; install the same rgpu version on the CPU and GPU nodes)")


def loopback_server(answer: Callable[[socket.socket], None]) -> tuple[socket.socket, str]:
    """A server on a loopback port that runs `answer` on each connection it accepts, then closes it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                answer(conn)

    threading.Thread(target=serve, daemon=True).start()
    return sock, f"127.0.0.1:{sock.getsockname()[1]}"


def fake_server(version: int) -> tuple[socket.socket, str]:
    """A server of another protocol version: answers any HELLO with its own WELCOME."""
    def answer(conn: socket.socket) -> None:
        protocol.recv_frame(conn)
        conn.sendall(protocol.encode_welcome(driver_version=13000, memory_limit_bytes=1, compute_percent=1,
                                             flags=0, description="future", version=version))
    return loopback_server(answer)


def test_client_library_refuses_a_server_of_another_version(native_libs: build.Libraries) -> None:
    sock, address = fake_server(protocol.PROTOCOL_VERSION + 1)
    try:
        done = run_client(native_libs, f"{address},rgpu1.x.y", [PY, "-c", textwrap.dedent("""
            import ctypes
            print("INIT", ctypes.CDLL("libcuda.so.1").cuInit(0))
            """)])
    finally:
        sock.close()
    assert "INIT 46" in done.stdout
    assert (f"protocol version mismatch with {address} (client speaks {protocol.PROTOCOL_VERSION}, server speaks "
            f"{protocol.PROTOCOL_VERSION + 1}; install the same rgpu version on the CPU and GPU nodes)") in done.stderr


def test_python_client_refuses_a_server_of_another_version() -> None:
    sock, address = fake_server(protocol.PROTOCOL_VERSION + 3)
    try:
        with pytest.raises(protocol.ProtocolError, match="server speaks"):
            protocol.probe(address, "rgpu1.x.y")
    finally:
        sock.close()


def door_server(refusals: int, retry: bool = True) -> tuple[socket.socket, str, list[int]]:
    """A server whose front door refuses the first `refusals` connections unread (REFUSE_RETRY when
    `retry`), then welcomes; the list counts the connections it took."""
    taken: list[int] = []

    def answer(conn: socket.socket) -> None:
        taken.append(1)
        if len(taken) <= refusals:
            conn.sendall(protocol.encode_refuse("rgpu: session: the 16 handshake slots of 127.0.0.1 were "
                                                "taken (retry)", retry=retry))
            return
        protocol.recv_frame(conn)
        conn.sendall(protocol.encode_welcome(driver_version=1, memory_limit_bytes=1, compute_percent=1,
                                             flags=0, description="ready"))
    sock, address = loopback_server(answer)
    return sock, address, taken


@pytest.mark.parametrize("refusals,retry,opened", [
    (len(protocol.DOOR_RETRY_PAUSES_S), True, True),        # each retry's connection made way but the last
    (len(protocol.DOOR_RETRY_PAUSES_S) + 1, True, False),   # every one did: DoorFull, in the dispatcher's words
    (1, False, False),                                     # a refusal of the HELLO itself is not retried
])
def test_a_hello_the_front_door_closed_unread_goes_again(refusals: int, retry: bool, opened: bool) -> None:
    sock, address, taken = door_server(refusals, retry)
    try:
        if opened:
            assert protocol.probe(address, "rgpu1.x.y").description == "ready"
        else:
            with pytest.raises(Unavailable, match="handshake slots of 127.0.0.1 were taken") as info:
                protocol.probe(address, "rgpu1.x.y")
            assert isinstance(info.value, protocol.DoorFull) == retry
    finally:
        sock.close()
    assert len(taken) == (refusals + opened if retry else 1)


@pytest.mark.parametrize("refusals", [1, len(protocol.DOOR_RETRY_PAUSES_S)])
def test_the_client_library_opens_a_session_again_when_the_front_door_closed_its_hello_unread(
        native_libs: build.Libraries, lane_copies: Path, emulated: Server, tmp_path: Path, refusals: int) -> None:
    """A HELLO the front door closed unread (REFUSE_RETRY) goes again, with new lanes under a new key
    (the refused try's lanes may still wait at the dispatcher for a session with theirs); each try
    dials the session's connection after its lanes, so it does not sit idle while they open."""
    sizes = [THRESHOLD + 1, 5_000_007]
    with Door(emulated.address, refusals) as door:
        done = run_client(native_libs, f"{door.address},{emulated.token()}", [str(lane_copies), *map(str, sizes)],
                          timeout=120, RGPU_CLIENT_STATS=str(tmp_path / "p"), **LANE_ENV)
        arrivals = list(door.arrivals)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    assert f"transport tcp, {LANES} data lanes)" in done.stderr, done.stderr
    assert _striped(tmp_path / "p") == (4 * len(sizes),) * 2   # the lanes carried them (pageable, pinned; 2 offsets)
    assert [kind for kind, _ in arrivals] == (["lane"] * LANES + ["session"]) * (refusals + 1), arrivals
    keys = [key for _, key in arrivals]
    tries = [keys[i:i + LANES + 1] for i in range(0, len(keys), LANES + 1)]
    # One key within a try (its lanes' and its session's), another at each try.
    assert all(len(set(one)) == 1 for one in tries) and len({one[0] for one in tries}) == refusals + 1, tries
    said = [line for line in done.stderr.splitlines() if " again in " in line]
    assert all("handshake slots of 127.0.0.1 were taken" in line for line in said), said
    # The pauses protocol.handshake makes (the client says each in its line at RGPU_LOG=info).
    assert [line.split(" again in ")[1].split(" ms")[0] for line in said] == \
        [f"{pause * 1000:.0f}" for pause in protocol.DOOR_RETRY_PAUSES_S[:refusals]], said
    assert "[server" not in done.stderr, done.stderr   # the refusals were not printed as errors


@pytest.mark.parametrize("refusals,retry", [
    (len(protocol.DOOR_RETRY_PAUSES_S) + 1, True),   # every try made way: the last refusal is printed
    (1, False),                                      # a refusal of the HELLO itself is not retried
])
def test_the_client_library_gives_up_after_two_retries_or_at_a_refusal_of_its_hello(
        native_libs: build.Libraries, emulated: Server, refusals: int, retry: bool) -> None:
    with Door(emulated.address, refusals, retry) as door:
        done = py_client(native_libs, f"{door.address},{emulated.token()}", """
            import os
            before = len(os.listdir("/proc/self/fd"))
            r = lib.cuInit(0)
            print("INIT", r, "FDS LEFT", len(os.listdir("/proc/self/fd")) - before)
            """, timeout=60, **LANE_ENV)
        arrivals = [kind for kind, _ in door.arrivals]
    assert "INIT 46 FDS LEFT 0" in done.stdout, done.stdout + done.stderr   # no session, its lanes closed too
    assert arrivals == (["lane"] * LANES + ["session"]) * refusals, arrivals
    refused = [line for line in done.stderr.splitlines() if line.endswith(f"[server {door.address}, device 0]")]
    expected = "handshake slots of 127.0.0.1 were taken" if retry else NOT_RETRIED
    assert len(refused) == 1 and expected in refused[0], done.stderr


def test_the_client_library_gives_up_on_a_server_that_never_answers_its_hello(native_libs: build.Libraries) -> None:
    # A server that accepts and reads the HELLO, then says nothing (not a dispatcher, or a stuck one):
    # the application's cuInit fails with one line instead of waiting for ever.
    def silent(conn: socket.socket) -> None:
        protocol.recv_frame(conn)
        conn.recv(1)   # until the client goes
    sock, address = loopback_server(silent)
    try:
        done = py_client(native_libs, f"{address},token", "print('INIT', lib.cuInit(0))", timeout=60,
                         RGPU_LANES="1", RGPU_TRANSPORT="tcp", RGPU_HANDSHAKE_TIMEOUT_S="1")
    finally:
        sock.close()
    assert "INIT 46" in done.stdout, done.stdout + done.stderr
    said = [line for line in done.stderr.splitlines() if "did not answer the HELLO" in line]
    assert len(said) == 1 and "within 1 s" in said[0] and "RGPU_HANDSHAKE_TIMEOUT_S" in said[0], done.stderr


def test_probe_checks_the_token_and_starts_no_worker(emulated: Server) -> None:
    welcome = protocol.probe(emulated.address, emulated.token(memory_limit=3 << 30, compute_percent=25))
    assert (welcome.memory_limit_bytes, welcome.compute_percent) == (3 << 30, 25)
    assert emulated.server.status()["sessions"] == []
    with pytest.raises(AuthError, match="issued for GPU GPU-0000"):
        from rgpu.model import GpuInfo
        other = GpuInfo("GPU-00000000-0000-0000-0000-000000000000", 5, "X", 1, 1, "9.0")
        protocol.probe(emulated.address, emulated.token(gpu=other))


def test_garbage_on_the_port_is_dropped(emulated: Server) -> None:
    with socket.create_connection(tuple(protocol.split_address(emulated.address)), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64)
        s.settimeout(5)
        try:
            (_, op, _, _, _, _), payload = protocol.recv_frame(s, 1 << 20)   # a one-line refusal, then closed
            assert op == protocol.OP_REFUSE
            assert "malformed HELLO" in protocol.decode_refuse(payload)[1]
            assert s.recv(100) == b""
        except ConnectionError:
            pass  # closed with our bytes unread: also a close
    assert emulated.server.status()["sessions"] == []


def test_status_reports_enforcement_and_sessions(emulated: Server) -> None:
    status = emulated.server.status()
    assert status["compute_enforcement"] == "time-slicing"
    assert "emulated backend" in status["mps"]["reason"]
    assert status["protocol_version"] == protocol.PROTOCOL_VERSION
    assert status["backend"] == "emulated"
    assert status["sessions"] == []
