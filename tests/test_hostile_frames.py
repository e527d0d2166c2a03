"""Malformed frames on a real session (issue 26, MED 8): a request shorter than its operation's
layout is answered with CUDA_ERROR_INVALID_VALUE and one line, not a traceback, and 120 KB of
such frames leave the dispatcher's log a few lines longer, not megabytes. Real rgpu-poold and
rgpu-dispatcher (emulated GPUs) on loopback."""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.backends.base import INVALID_VALUE, NOT_SUPPORTED, UNKNOWN
from rgpu.remoting.native.generated import api_gen
from tests.daemons import EXAMPLES, RgpuCluster
from tests.dispatcher_helpers import wait_state

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def served_session(root: Path, flags: int = 0) -> Iterator[tuple[RgpuCluster, socket.socket]]:
    """A real pool and dispatcher (emulated GPUs), and one session of a half-GPU lease on it."""
    cluster = RgpuCluster(root / "cluster")
    cluster.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5)
    try:
        cluster.start_pool()
        daemon, port = cluster.start_dispatcher(EXAMPLES / "inventory-a.toml")
        address = f"127.0.0.1:{port}"
        wait_state(cluster, address, "up")
        with cluster.client() as client:
            token = client.allocate("job-hostile", "alice", 1, percent=50).slices[0].token
        sock, _welcome = protocol.handshake(address, token, flags=flags)
        try:
            yield cluster, sock
        finally:
            sock.close()
    finally:
        cluster.stop_all()


@pytest.fixture
def session(tmp_path: Path) -> Iterator[tuple[RgpuCluster, socket.socket]]:
    with served_session(tmp_path) as served:
        yield served


def call(sock: object, name: str, payload: bytes, seq: int, ctx: int = 0) -> tuple[int, bytes]:
    sock.sendall(protocol.pack_frame(api_gen.OPCODES[name], payload, seq=seq, ctx=ctx))   # type: ignore[attr-defined]
    (_, op, _, _, _, _), reply = protocol.recv_frame(sock)   # type: ignore[arg-type]
    assert op == protocol.OP_REPLY
    return struct.unpack_from("<i", reply)[0], bytes(reply[4:])


def test_short_requests_are_invalid_values_and_log_little(session) -> None:  # type: ignore[no-untyped-def]
    cluster, sock = session
    sock.settimeout(10)
    dispatcher = cluster.daemons[-1]
    assert call(sock, "cuInit", struct.pack("<I", 0), 1)[0] == 0
    (code, out) = call(sock, "cuDevicePrimaryCtxRetain", struct.pack("<i", 0), 2)
    assert code == 0
    (ctx,) = struct.unpack("<Q", out[:8])
    log_before = len(dispatcher.log())
    marker = api_gen.OPCODES["cuCtxSynchronize"]
    sent, seq, answers = 0, 10, []
    while sent < 120_000:
        for name, op in sorted(api_gen.OPCODES.items()):
            # Every operation, 3 bytes long (shorter than any layout), then a synchronize: an
            # operation that answers does so first, one that does not has its error deferred to it.
            seq += 2
            frame = protocol.pack_frame(op, b"\x01\x02\x03", seq=seq, ctx=ctx)
            sock.sendall(frame + protocol.pack_frame(marker, b"", seq=seq + 1, ctx=ctx))
            sent += len(frame)
            while True:
                (_, reply_op, _, reply_seq, _, _), reply = protocol.recv_frame(sock)
                assert reply_op == protocol.OP_REPLY
                answers.append((name, struct.unpack_from("<i", reply)[0], bytes(reply[4:])))
                if reply_seq == seq + 1:
                    break
    internal = sorted({name for name, code, _ in answers if code == UNKNOWN})
    assert internal == [], [a for a in answers if a[1] == UNKNOWN][:5]
    refused = [text for _name, code, text in answers if code == INVALID_VALUE]
    said = [text for text in refused if b"malformed" in text]   # the worker says a message once, then the code
    assert len(refused) > 1000 and said and all(b"\n" not in text for text in said), answers[:5]
    grown = dispatcher.log()[log_before:]
    assert len(grown) < 20_000 and "Traceback" not in grown, grown[:3000]
    assert "more like it" in grown or grown.count("malformed") <= 2, grown[:3000]
    assert call(sock, "cuCtxSynchronize", b"", seq + 2, ctx)[0] == 0    # the session still serves


def test_a_launch_whose_arguments_overrun_its_frame_is_refused(session) -> None:  # type: ignore[no-untyped-def]
    _cluster, sock = session
    assert call(sock, "cuInit", struct.pack("<I", 0), 1)[0] == 0
    (ctx,) = struct.unpack("<Q", call(sock, "cuDevicePrimaryCtxRetain", struct.pack("<i", 0), 2)[1][:8])
    # f, stream, grid, block, shmem, coop, nattrs, argsize (1 GiB: far beyond the frame), pad
    launch = struct.pack("<QQIIIIIIIIIIII", 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1 << 30, 0, 0)
    sock.sendall(protocol.pack_frame(api_gen.OPCODES["cuLaunchKernel"], launch, seq=3, ctx=ctx))   # type: ignore[attr-defined]
    code, message = call(sock, "cuCtxSynchronize", b"", 4, ctx)        # the launch's error comes here
    assert code == INVALID_VALUE, (code, message)
    assert call(sock, "cuCtxSynchronize", b"", 5, ctx)[0] == 0


def test_cuda_calls_in_an_nvml_session_are_not_supported_in_one_line(tmp_path: Path) -> None:
    """An NVML (management) session has no CUDA context: every CUDA operation, well-formed or not,
    is answered CUDA_ERROR_NOT_SUPPORTED with one line, never an internal error or a traceback."""
    with served_session(tmp_path, protocol.HELLO_NVML) as (cluster, sock):
        sock.settimeout(10)
        answers = {}
        seq = 0
        for name, op in sorted(api_gen.OPCODES.items()):
            if name.startswith("nvml"):
                continue
            for payload in (b"", b"\x00" * 64):
                seq += 1
                answers[(name, len(payload))] = call(sock, name, payload, seq)
        wrong = {key: (code, text[:120]) for key, (code, text) in answers.items() if code != NOT_SUPPORTED}
        assert wrong == {}, list(wrong.items())[:5]
        texts = {text for _code, text in answers.values() if text}
        assert texts and all(b"\n" not in t and b"NVML session" in t for t in texts), list(texts)[:3]
        code, memory = call(sock, "nvmlDeviceGetMemoryInfo", struct.pack("<Q", 0), seq + 1)
        assert code == 0 and len(memory) == 24                                # the session still serves NVML
        log = cluster.daemons[-1].log()
        assert "Traceback" not in log and "internal error" not in log


def test_2d_memset_and_copy_past_the_allocation_are_invalid_values(session) -> None:  # type: ignore[no-untyped-def]
    """2^62 rows at pitch 0 stayed inside a 1 MiB allocation row by row, so the emulated device
    looped for ever and the worker stopped answering; now the whole extent is checked first."""
    cluster, sock = session
    sock.settimeout(10)   # a hung worker fails the test here
    assert call(sock, "cuInit", struct.pack("<I", 0), 1)[0] == 0
    code, out = call(sock, "cuDevicePrimaryCtxRetain", struct.pack("<i", 0), 2)
    (ctx,) = struct.unpack("<Q", out[:8])
    code, out = call(sock, "cuMemAlloc_v2", struct.pack("<QQQQI", 1 << 20, 0, 0, 0, 0), 4, ctx)
    assert code == 0
    (ptr,) = struct.unpack("<Q", out[:8])
    rows = 1 << 62
    requests = [("cuMemsetD2D8_v2", struct.pack("<QQBQQ", ptr, pitch, 7, width, rows))
                for pitch, width in ((0, 16), (1, 1), (64, 64), (16, 64))]
    requests.append(("rgpuMemcpy2DDevice", struct.pack("<7Q", ptr, 0, ptr + 4096, 0, 16, rows, 0)))
    for seq, (name, payload) in enumerate(requests, start=10):
        # Both are asynchronous: the error comes with the next synchronize.
        sock.sendall(protocol.pack_frame(api_gen.OPCODES[name], payload, seq=2 * seq, ctx=ctx))
        code, text = call(sock, "cuCtxSynchronize", b"", 2 * seq + 1, ctx)
        assert code == INVALID_VALUE, (name, payload.hex(), code, text)
    # In bounds still works, and the session goes on.
    sock.sendall(protocol.pack_frame(api_gen.OPCODES["cuMemsetD2D8_v2"], struct.pack("<QQBQQ", ptr, 64, 7, 64, 16),
                                     seq=100, ctx=ctx))
    assert call(sock, "cuCtxSynchronize", b"", 101, ctx)[0] == 0
