"""UCX underneath host<->device copies (issue 25), against the emulated worker: copies of many sizes
over UCX shared memory and UCX TCP, the fallbacks to TCP and the one line each says, and hostile
UCX copy frames. Needs UCX (libucp.so.0: Debian's libucx0, which .ci/debian-packages.txt installs
through libucx-dev); skipped with that reason where it is absent."""

from __future__ import annotations

import ctypes
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.worker.ucx import UcxLink
from rgpu.remoting.native import build

from tests.daemons import wait_for

from .conftest import EMULATED_GPU, Server, run_client, serving
from .ucx_helpers import OP, UCX_COPIES, _have_ucx, _ucx_ops


pytestmark = pytest.mark.skipif(not _have_ucx(), reason="UCX is not installed (no libucp.so.0: apt-get install "
                                "libucx-dev, as scripts/test.sh does from .ci/debian-packages.txt)")


UCX_SIZES = [1 << 20, (1 << 20) + 3, 5_000_007, 128 << 20, 5_000_007 - 64, (128 << 20) - 64]
assert len(UCX_SIZES) == UCX_COPIES[0]


@pytest.mark.parametrize("tls", ["posix,cma,self", "tcp"], ids=["shared-memory", "tcp"])
def test_copies_of_every_size_arrive_whole_over_ucx(copies: Path, native_libs: build.Libraries, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
                                                     tls: str) -> None:
    monkeypatch.setenv("UCX_TLS", tls)   # both ends: the client's environment and the worker's
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")   # TCP on loopback only, not also this host's other addresses
    with serving("emulated", [EMULATED_GPU]) as s:
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(copies)], timeout=300,
                          RGPU_LOG="info", RGPU_CLIENT_STATS=str(tmp_path / "p"))
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    # The client's device line and the worker's session line name the UCX transports that carry the copies.
    carriers = r"[^)]*\bposix/memory\b[^)]*" if tls.startswith("posix") else r"tcp/lo"   # tcp: loopback alone
    assert re.search(rf"; transport ucx: {carriers}\)", done.stderr), done.stderr
    worker_log = capfd.readouterr().err    # the worker's log: the stderr it shares with this test
    assert re.search(rf"session open: .* transport ucx \({carriers}\)", worker_log), worker_log
    assert "not UCX" not in done.stderr
    assert _ucx_ops(tmp_path / "p") == UCX_COPIES


def test_a_client_that_cannot_load_ucx_copies_over_tcp_and_says_why_once(copies: Path, native_libs: build.Libraries,
                                                                         tmp_path: Path) -> None:
    empty = tmp_path / "no-ucx"
    empty.mkdir()
    with serving("emulated", [EMULATED_GPU]) as s:
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(copies)], timeout=300,
                          RGPU_LOG="info", RGPU_UCX_LIB=str(empty), RGPU_CLIENT_STATS=str(tmp_path / "p"))
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "not UCX" in ln]
    assert len(lines) == 1, done.stderr
    assert f"go over TCP, not UCX (RGPU_UCX_LIB={empty} has no loadable libucp.so.0 or libucp.so" in lines[0]
    assert "; transport tcp, 8 data lanes)" in done.stderr   # UCX absent: TCP carries the large copies, on 8 lanes
    assert _ucx_ops(tmp_path / "p") == (0, 0)


def test_transport_tcp_on_the_client_offers_no_ucx(copies: Path, native_libs: build.Libraries, tmp_path: Path) -> None:
    with serving("emulated", [EMULATED_GPU]) as s:
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(copies)], timeout=300,
                          RGPU_LOG="info", RGPU_TRANSPORT="tcp", RGPU_CLIENT_STATS=str(tmp_path / "p"))
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    assert "; transport tcp, 8 data lanes)" in done.stderr and "not UCX" not in done.stderr   # asked for: nothing to explain
    assert _ucx_ops(tmp_path / "p") == (0, 0)


def test_transport_tcp_on_the_gpu_node_makes_an_offering_client_fall_back(copies: Path, native_libs: build.Libraries,
                                                                          tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGPU_TRANSPORT", "tcp")   # the dispatcher's (client_env drops RGPU_* for the client)
    with serving("emulated", [EMULATED_GPU]) as s:
        assert s.server.transport == "tcp"
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(copies)], timeout=300,
                          RGPU_LOG="info", RGPU_CLIENT_STATS=str(tmp_path / "p"))
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "not UCX" in ln]
    assert len(lines) == 1 and "the GPU server did not take UCX" in lines[0], done.stderr
    assert _ucx_ops(tmp_path / "p") == (0, 0)


def test_transport_ucx_without_ucx_fails_at_init_with_the_reason(copies: Path, native_libs: build.Libraries,
                                                                 tmp_path: Path) -> None:
    with serving("emulated", [EMULATED_GPU]) as s:
        done = run_client(native_libs, s.slices(s.token()), [str(copies)], RGPU_TRANSPORT="ucx",
                          RGPU_UCX_LIB=str(tmp_path))
    assert done.returncode == 1 and "FAIL cuInit(0) = 46" in done.stdout, done.stdout + done.stderr
    assert "RGPU_TRANSPORT=ucx, but this process cannot use UCX for device 0 (RGPU_UCX_LIB=" in done.stderr
    assert "or set RGPU_TRANSPORT=auto to fall back to TCP" in done.stderr


def test_an_unknown_transport_setting_is_refused(copies: Path, native_libs: build.Libraries) -> None:
    with serving("emulated", [EMULATED_GPU]) as s:
        done = run_client(native_libs, s.slices(s.token()), [str(copies)], RGPU_TRANSPORT="rdma")
    assert done.returncode == 1
    assert "RGPU_TRANSPORT=rdma is not a transport (want auto, ucx or tcp; unset it for auto)" in done.stderr


# ---- hostile or mismatched UCX copy frames, from a hand-made client --------------------------------

def _sync(sock: object, op: int, payload: bytes, seq: int, ctx: int = 0) -> tuple[int, bytes]:
    sock.sendall(protocol.pack_frame(op, payload, seq=seq, ctx=ctx))   # type: ignore[attr-defined]
    while True:
        header, body = protocol.recv_frame(sock)   # type: ignore[arg-type]
        if header[1] == protocol.OP_REPLY:
            assert header[3] == seq
            return struct.unpack_from("<i", body)[0], body


def test_a_ucx_copy_frame_on_a_tcp_session_is_an_error_not_a_crash(emulated: Server) -> None:
    sock, welcome = protocol.handshake(emulated.address, emulated.token())
    with sock:
        assert welcome.ucx_address == b""   # offered nothing, given nothing
        code, body = _sync(sock, OP["rgpuMemcpyDtoHUcx"], protocol.UCX_COPY.pack(0x1000, 0, 1 << 20), 1)
        assert code == 1 and b"rgpuMemcpyDtoHUcx on a session that did not negotiate UCX" in body, body
        code, _ = _sync(sock, OP["rgpuSessionInfo"], b"", 2)
        assert code == 0   # the session goes on


@pytest.fixture
def ucx_session(native_libs: build.Libraries, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[object, UcxLink, int, int]]:
    """A hand-made client that offers UCX (the worker's own ucx_link.c, as a client), with a context
    and 64 MiB of device memory: (socket, its UCX link, the device address)."""
    monkeypatch.setenv("RGPU_UCX_IDLE_S", "2")   # the worker's wait for bytes that never come
    link = UcxLink(str(native_libs.libworker), "")
    with serving("emulated", [EMULATED_GPU]) as s:
        sock, welcome = protocol.handshake(s.address, s.token(memory_limit=1 << 30), ucx_address=link.address)
        with sock:
            assert welcome.ucx_address, "the worker took no UCX"
            link.connect(welcome.ucx_address)
            code, body = _sync(sock, OP["cuDevicePrimaryCtxRetain"], struct.pack("<i", 0), 1)
            assert code == 0
            (ctx,) = struct.unpack_from("<Q", body, 4)
            code, body = _sync(sock, OP["cuMemAlloc_v2"], struct.pack("<QQQQI", 64 << 20, 0, 0, 0, 0), 2, ctx)
            assert code == 0, body
            (dev,) = struct.unpack_from("<Q", body, 4)
            yield sock, link, ctx, dev
    link.close()


def _send(link: UcxLink, tag: int, data: bytes) -> None:
    buf = ctypes.create_string_buffer(data, len(data))
    req = link.post_send(tag, ctypes.addressof(buf), len(data))
    assert link.finish_send(req, len(data), -1) == ""


def test_hostile_ucx_copy_frames_get_clear_errors_and_the_session_goes_on(ucx_session: tuple) -> None:
    sock, link, ctx, dev = ucx_session
    sync = OP["cuCtxSynchronize"]
    # Truncated: 8 bytes where 24 are due.
    code, body = _sync(sock, OP["rgpuMemcpyDtoHUcx"], struct.pack("<Q", dev), 3, ctx)
    assert code == 1 and b"truncated rgpuMemcpyDtoHUcx frame (8 bytes, want 24" in body, body
    # A size beyond the slice.
    code, body = _sync(sock, OP["rgpuMemcpyDtoHUcx"], protocol.UCX_COPY.pack(dev, 0, 1 << 40), 4, ctx)
    assert code == 1 and b"rgpuMemcpyDtoHUcx of 1099511627776 bytes (want 1 byte up to the slice's 1.0 GiB)" in body
    # Fewer bytes than announced: the copy fails at the next synchronising call, and says why.
    sock.sendall(protocol.pack_frame(OP["rgpuMemcpyHtoDUcx"], protocol.UCX_COPY.pack(dev, 0, 4 << 20), seq=5, ctx=ctx))
    _send(link, 5, b"x" * (1 << 20))
    code, body = _sync(sock, sync, b"", 6, ctx)
    assert code == 1 and b"UCX receive brought 1048576 bytes where 4194304 were announced" in body, body
    # More than announced.
    sock.sendall(protocol.pack_frame(OP["rgpuMemcpyHtoDUcx"], protocol.UCX_COPY.pack(dev, 0, 1 << 20), seq=7, ctx=ctx))
    _send(link, 7, b"y" * (2 << 20))
    code, body = _sync(sock, sync, b"", 8, ctx)
    assert code == 1 and b"a host-to-device copy over UCX failed" in body and b"truncated" in body.lower(), body
    # Announced, never sent: the worker gives up after RGPU_UCX_IDLE_S.
    sock.sendall(protocol.pack_frame(OP["rgpuMemcpyHtoDUcx"], protocol.UCX_COPY.pack(dev, 0, 1 << 20), seq=9, ctx=ctx))
    code, body = _sync(sock, sync, b"", 10, ctx)
    assert code == 1 and b"made no progress for 2 s (the peer never sent them; cancelled)" in body, body
    # An address outside any allocation: refused, and its bytes taken off the wire.
    sock.sendall(protocol.pack_frame(OP["rgpuMemcpyHtoDUcx"], protocol.UCX_COPY.pack(8, 0, 1 << 20), seq=11, ctx=ctx))
    _send(link, 11, b"z" * (1 << 20))
    code, body = _sync(sock, sync, b"", 12, ctx)
    assert code == 1, body
    # After all that, a good copy still lands.
    sock.sendall(protocol.pack_frame(OP["rgpuMemcpyHtoDUcx"], protocol.UCX_COPY.pack(dev, 0, 1 << 20), seq=13, ctx=ctx))
    _send(link, 13, bytes(range(256)) * 4096)
    code, body = _sync(sock, sync, b"", 14, ctx)
    assert code == 0, body
    # Asked for, never taken (the client posts no receive): the worker's send gives up after
    # RGPU_UCX_IDLE_S (2 s) and, its reply being gone, ends the session. It spun for ever before: UCX
    # does not cancel a send, so the worker now closes its endpoint by force, and gives up the copy's
    # other 15 chunks at once (each waited out the 2 s, 32 s in all, past this timeout).
    code, body = _sync(sock, OP["rgpuMemcpyDtoHUcx"], protocol.UCX_COPY.pack(dev, 0, 64 << 20), 15, ctx)
    assert code == 0, body
    sock.settimeout(25)
    assert sock.recv(1) == b""      # the session ended (its line: test_net_perf's stalled probes check it)


# ---- the path a real GPU takes (no device memory the worker can address): through a host buffer ----

class _HostOnlyBackend:
    """A backend like the CUDA one as the UCX handlers see it: no device_window, so bytes go through
    the worker's staging buffer to htod, and come from dtoh_chunks (in pieces, as its pinned ring's)."""

    def __init__(self, size: int) -> None:
        self.device = bytearray(size)
        self.htod_calls: list[tuple[int, int, int]] = []

    def htod(self, dst: int, stream: int, data: memoryview, address: int) -> None:
        assert bytes(data) == ctypes.string_at(address, len(data))   # the address names the same bytes
        self.htod_calls.append((dst, stream, len(data)))
        self.device[dst:dst + len(data)] = data

    def dtoh_chunks(self, src: int, stream: int, size: int, chunk: int) -> Iterator[memoryview]:
        for at in range(0, size, 1000):   # pieces of another size than the copy's
            yield memoryview(self.device)[src + at:src + min(size, at + 1000)]


class _Streams:
    def real(self, handle: int, call: str) -> int:
        return handle


def test_the_staging_path_a_real_gpu_takes_carries_bytes_both_ways(native_libs: build.Libraries) -> None:
    """Handlers.h_htod_ucx / h_dtoh_ucx with a host-only backend, against a second UCX worker in this
    process (small, eager messages: neither side waits for the other to progress). The CUDA backend's
    own htod/dtoh_chunks under it are not run here (no GPU)."""
    import socket
    import types

    from rgpu.remoting.datapath.worker.handlers import Handlers

    worker_link = UcxLink(str(native_libs.libworker), "")
    client_link = UcxLink(str(native_libs.libworker), "")
    worker_link.connect(client_link.address)
    client_link.connect(worker_link.address)
    a, b = socket.socketpair()
    replies: list[tuple[int, int]] = []
    fake = types.SimpleNamespace(ucx=worker_link, sock=a, backend=_HostOnlyBackend(8192), client_streams=_Streams(),
                                 spec=types.SimpleNamespace(memory_limit=1 << 20), sent=0,
                                 _reply=lambda seq, result, payload, message: replies.append((seq, result)))
    fake._ucx_staging = types.MethodType(Handlers._ucx_staging, fake)
    fake._ucx_pinned = types.MethodType(Handlers._ucx_pinned, fake)
    fake._ucx_copy = types.MethodType(Handlers._ucx_copy, fake)
    try:
        data = bytes(range(256)) * 12 + b"odd"   # 3075 bytes
        _send(client_link, 41, data)
        Handlers.h_htod_ucx(fake, memoryview(protocol.UCX_COPY.pack(100, 7, len(data))), 0, 41)   # type: ignore[arg-type]
        assert fake.backend.htod_calls == [(100, 7, len(data))]
        assert bytes(fake.backend.device[100:100 + len(data)]) == data
        back = ctypes.create_string_buffer(len(data))
        req = ctypes.c_void_p()
        assert client_link._lib.rgpu_ucx_post(client_link._handle, 1, 42, ctypes.addressof(back), len(data),
                                              ctypes.byref(req), client_link._why, 1024) == 0
        assert Handlers.h_dtoh_ucx(fake, memoryview(protocol.UCX_COPY.pack(100, 7, len(data))), 0, 42) is None   # type: ignore[arg-type]
        assert replies == [(42, 0)]   # the reply went before the bytes were taken
        assert client_link._lib.rgpu_ucx_wait(client_link._handle, req, 1, len(data), 5.0, -1, 0, client_link._why,
                                              1024) == 0, client_link._why.value
        assert back.raw == data
    finally:
        a.close()
        b.close()
        worker_link.close()
        client_link.close()


def test_through_the_cuda_backend_a_ucx_copy_is_one_dma_from_pinned_memory(
        copies: Path, native_libs: build.Libraries, emulated: Server, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real-GPU backend (its worker's "driver" is rgpu's client library, chained to an emulated
    worker: test_cuda_backend_chained.py) takes a UCX copy into its pinned buffer and queues a DMA
    from there for each chunk the moment it is in (protocol 15), and device to host one DMA per chunk
    into it, each sent once there: the chained driver sees one copy per chunk (those of at least
    1 MiB on its own UCX), not the staging ring's pieces. Byte for byte, every size."""
    from .conftest import start_server
    from .conftest import chain_to
    chain_to(native_libs, emulated, monkeypatch)
    monkeypatch.setenv("RGPU_TRANSPORT", "ucx")            # the GPU node takes UCX (auto keeps TCP on a real GPU)
    monkeypatch.setenv("RGPU_CLIENT_STATS", str(tmp_path / "inner"))   # the worker's calls to its "driver"
    # Its pinned buffer on the chained driver: counted as copies, not read in place by the inner worker (protocol 15)
    monkeypatch.setenv("RGPU_SHARED_PINNED", "0")
    server, address = start_server("cuda", [EMULATED_GPU])
    try:
        chained = Server(server, address, [EMULATED_GPU])
        done = run_client(native_libs, chained.slices(chained.token(memory_limit=1 << 30)), [str(copies)], timeout=300,
                          RGPU_TRANSPORT="ucx", RGPU_LOG="info", UCX_TLS="posix,self")
        # The worker writes its "driver's" call profile as it exits after the client's goodbye;
        # stopping the server first could end it before that (a loaded CI machine saw no profile).
        if done.returncode == 0:
            wait_for(lambda: bool(list(tmp_path.glob("inner.*"))), 60, "the chained worker's call profile")
    finally:
        server.stop()
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr
    assert "; transport ucx: posix/memory" in done.stderr, done.stderr
    chunks = sum(1 for n in UCX_SIZES for _, _, k in protocol.ucx_chunks(n) if k >= 1 << 20)
    assert _ucx_ops(tmp_path / "inner") == (chunks, chunks)


def test_a_ucx_copy_travels_in_chunks_each_tagged_with_its_index(ucx_session: tuple) -> None:
    """Protocol 15: a UCX copy's bytes are messages of UCX_CHUNK_BYTES, chunk i tagged seq | i << 32,
    both ways (the worker moves each chunk over PCIe while the next one travels)."""
    sock, link, ctx, _ = ucx_session
    size = 2 * protocol.UCX_CHUNK_BYTES + 12345
    code, body = _sync(sock, OP["cuMemAlloc_v2"], struct.pack("<QQQQI", size, 0, 0, 0, 0), 20, ctx)
    assert code == 0, body
    (dev,) = struct.unpack_from("<Q", body, 4)
    data = bytes(range(251)) * (size // 251 + 1)
    sock.sendall(protocol.pack_frame(OP["rgpuMemcpyHtoDUcx"], protocol.UCX_COPY.pack(dev, 0, size), seq=21, ctx=ctx))
    chunks = protocol.ucx_chunks(size)
    assert [n for _, _, n in chunks] == [protocol.UCX_CHUNK_BYTES, protocol.UCX_CHUNK_BYTES, 12345]
    for i, at, n in chunks:
        _send(link, protocol.ucx_tag(21, i), data[at:at + n])
    code, body = _sync(sock, OP["cuCtxSynchronize"], b"", 22, ctx)
    assert code == 0, body
    sock.sendall(protocol.pack_frame(OP["rgpuMemcpyDtoHUcx"], protocol.UCX_COPY.pack(dev, 0, size), seq=23, ctx=ctx))
    header, body = protocol.recv_frame(sock)
    assert header[1] == protocol.OP_REPLY and struct.unpack_from("<i", body)[0] == 0, body
    back = ctypes.create_string_buffer(size)
    for i, at, n in chunks:
        link.recv(protocol.ucx_tag(23, i), ctypes.addressof(back) + at, n, -1)
    assert back.raw == data[:size]
