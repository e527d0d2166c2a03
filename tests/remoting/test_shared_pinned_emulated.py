"""Same-host page-locked memory read in place (issue 25, protocol 15), against the emulated worker.

On the worker's host, cuMemAllocHost/cuMemHostAlloc memory is a memfd the client passes to its worker
over a Unix socket (SCM_RIGHTS): copies from and to it carry (region, offset, length), and the
worker reads and writes the application's pages (remoting/native/src/shared_pinned.c,
remoting/datapath/worker/shared_pinned.py). These tests check that the bytes are right and none
cross the session's socket, that regions go with cuMemFreeHost and with the client, that a hostile
client gets one line and the session goes on, and that fork() leaves the child its own pages."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.worker.shared_pinned import MESSAGE, SHARE, SHARED_COPY
from rgpu.remoting.native import build
from rgpu.remoting.native.generated import api_gen

from .conftest import EMULATED_GPU, Server, client_env, serving
from .conftest import PY
from .client_helpers import HERE, py_client
from .lanes_helpers import _sync
from .shared_pinned_helpers import COPIES, _ops

OP = api_gen.OPCODES
MiB = 1 << 20


def test_same_host_page_locked_copies_are_read_in_place_with_no_bytes_on_the_socket(
        native_libs: build.Libraries, tmp_path: Path) -> None:
    with serving("emulated", [EMULATED_GPU]) as s:
        done = py_client(native_libs, s.slices(s.token()), COPIES, RGPU_CLIENT_STATS=str(tmp_path / "p"),
                         RGPU_LANES="1")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SYNC True" in done.stdout and "ASYNC True" in done.stdout, done.stdout + done.stderr
        deadline = time.monotonic() + 10
        while s.server.observe()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.05)
        traffic = s.server.observe()["traffic"][EMULATED_GPU.uuid]
    ops = _ops(tmp_path / "p")
    assert ops.get("rgpuMemcpyHtoDSharedWait") == 1 and ops.get("rgpuMemcpyHtoDShared") == 1, ops
    assert ops.get("rgpuMemcpyDtoHShared") == 2, ops
    assert not {"cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "rgpuMemcpyHtoDUcx", "rgpuMemcpyDtoHUcx"} & set(ops), ops
    # 22 MiB copied; the session's socket carried frames only.
    assert traffic["received_bytes"] < 64 << 10 and traffic["sent_bytes"] < 64 << 10, traffic


def test_with_sharing_off_on_either_side_copies_cross_the_socket_and_stay_right(
        native_libs: build.Libraries, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done = None
    with serving("emulated", [EMULATED_GPU]) as s:
        done = py_client(native_libs, s.slices(s.token()), COPIES, RGPU_CLIENT_STATS=str(tmp_path / "a"),
                         RGPU_SHARED_PINNED="0")
    assert "SYNC True" in done.stdout and "ASYNC True" in done.stdout, done.stdout + done.stderr
    assert not any("Shared" in op for op in _ops(tmp_path / "a")), _ops(tmp_path / "a")
    monkeypatch.setenv("RGPU_SHARED_PINNED", "0")   # the dispatcher's environment, which its workers inherit
    with serving("emulated", [EMULATED_GPU]) as s:
        done = py_client(native_libs, s.slices(s.token()), COPIES, RGPU_CLIENT_STATS=str(tmp_path / "b"),
                         RGPU_SAME_HOST="1")
    assert "SYNC True" in done.stdout and "ASYNC True" in done.stdout, done.stdout + done.stderr
    ops = _ops(tmp_path / "b")
    assert ops.get("rgpuHostShare") == 1 and not any("Memcpy" in op and "Shared" in op for op in ops), ops
    # The same-host path was expected: one line says why copies cross the socket.
    lines = [ln for ln in done.stderr.splitlines() if "page-locked memory" in ln]
    assert len(lines) == 1 and "the worker does not offer it: RGPU_SHARED_PINNED=0 there" in lines[0], done.stderr


def _worker_maps(pid: int) -> int:
    """How many mappings of the client's page-locked memory the worker process has."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return maps.count("rgpu-pinned")


def test_regions_go_with_cuMemFreeHost_and_with_a_client_that_dies(native_libs: build.Libraries,
                                                                  emulated: Server) -> None:
    program = textwrap.dedent("""
        import sys; sys.path.insert(0, %r)
        from ctcuda import *
        import ctypes, os
        setup()
        a, b = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuMemAllocHost_v2", ctypes.byref(a), ctypes.c_size_t(4 << 20))
        check("cuMemAllocHost_v2", ctypes.byref(b), ctypes.c_size_t(2 << 20))
        r, dev = alloc(4 << 20)
        check("cuMemcpyHtoD_v2", ctypes.c_uint64(dev), a, ctypes.c_size_t(4 << 20))
        print("TWO", flush=True)
        sys.stdin.readline()
        check("cuMemFreeHost", a)
        print("ONE", flush=True)
        sys.stdin.readline()
        os.kill(os.getpid(), 9)
    """) % str(HERE)
    client = subprocess.Popen([PY, "-c", program], env=client_env(native_libs, emulated.slices(emulated.token())),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None and client.stdin is not None
        assert client.stdout.readline().strip() == "TWO"
        (session,) = emulated.wait_sessions(1)
        worker = session["pid"]
        assert _worker_maps(worker) == 2
        client.stdin.write("\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "ONE"
        assert _worker_maps(worker) == 1
        client.stdin.write("\n")
        client.stdin.flush()
        assert client.wait(30) == -9
        deadline = time.monotonic() + 30
        while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{worker}").exists(), "the worker outlived its dead client with its memory mapped"
    finally:
        client.kill()
        client.wait()


def test_after_fork_the_child_has_its_own_pages_and_the_parent_goes_on(native_libs: build.Libraries,
                                                                       emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token()), """
        import os
        setup()
        n = 1 << 20
        host = ctypes.c_void_p()
        check("cuMemAllocHost_v2", ctypes.byref(host), ctypes.c_size_t(n))
        ctypes.memset(host, ord("A"), n)
        pid = os.fork()
        if pid == 0:   # the child: sees the parent's bytes, writes its own, which the parent never sees
            ok = ctypes.string_at(host.value, 4) == b"AAAA"
            ctypes.memset(host, ord("B"), n)
            os._exit(0 if ok and ctypes.string_at(host.value, 4) == b"BBBB" else 3)
        _, status = os.waitpid(pid, 0)
        print("CHILD", os.waitstatus_to_exitcode(status))
        print("PARENT", ctypes.string_at(host.value, n) == b"A" * n)
        r, dev = alloc(n)
        check("cuMemcpyHtoD_v2", ctypes.c_uint64(dev), host, ctypes.c_size_t(n))
        ctypes.memset(host, 0, n)
        check("cuMemcpyDtoH_v2", host, ctypes.c_uint64(dev), ctypes.c_size_t(n))
        print("COPIES", ctypes.string_at(host.value, n) == b"A" * n)
        check("cuMemFreeHost", host)
        """)
    assert "CHILD 0" in done.stdout and "PARENT True" in done.stdout and "COPIES True" in done.stdout, \
        done.stdout + done.stderr


# ---- a hostile client, by hand ---------------------------------------------------------------------

def _memfd(size: int, seal: bool = True) -> int:
    import fcntl
    fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def test_a_hostile_client_gets_one_line_per_fault_and_the_worker_goes_on(emulated: Server) -> None:
    sock, _ = protocol.handshake(emulated.address, emulated.token())
    with sock:
        code, body = _sync(sock, OP["cuDevicePrimaryCtxRetain"], struct.pack("<i", 0), 1)
        (ctx,) = struct.unpack_from("<Q", body, 4)
        code, body = _sync(sock, OP["cuMemAlloc_v2"], struct.pack("<QQQQI", 4 * MiB, 0, 0, 0, 0), 2, ctx)
        (dev,) = struct.unpack_from("<Q", body, 4)
        copy = OP["rgpuMemcpyHtoDSharedWait"]
        # A region that was never shared.
        code, body = _sync(sock, copy, SHARED_COPY.pack(dev, 0, 7, 0, MiB), 3, ctx)
        assert code == 1 and b"region 7 is not one this session shares" in body, body
        # The socket, then a real region.
        code, body = _sync(sock, OP["rgpuHostShare"], SHARE.pack(0, 0), 4, ctx)
        assert code == 0
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.connect(b"\0" + body[4:])
        fd = _memfd(2 * MiB)
        os.pwrite(fd, b"\x5a" * MiB, 0)
        socket.send_fds(unix, [MESSAGE.pack(2 * MiB, 99)], [fd])
        code, body = _sync(sock, OP["rgpuHostShare"], SHARE.pack(2 * MiB, 99), 5, ctx)
        assert code == 0, body
        (region,) = struct.unpack_from("<Q", body, 4)
        # Offset and length beyond it, and an offset that wraps.
        code, body = _sync(sock, copy, SHARED_COPY.pack(dev, 0, region, MiB, MiB + 1), 6, ctx)
        assert code == 1 and b"outside region" in body, body
        code, body = _sync(sock, copy, SHARED_COPY.pack(dev, 0, region, (1 << 64) - 1, 2), 7, ctx)
        assert code == 1 and b"outside region" in body, body
        # A regular file, an unsealed memfd, a size that is not the file's, no descriptor at all.
        with tempfile.TemporaryFile() as f:
            f.truncate(MiB)
            socket.send_fds(unix, [MESSAGE.pack(MiB, 1)], [f.fileno()])
            code, body = _sync(sock, OP["rgpuHostShare"], SHARE.pack(MiB, 1), 8, ctx)
        assert code == 1 and b"refused the file passed (a file that cannot be sealed (not a memfd)" in body, body
        loose = _memfd(MiB, seal=False)
        socket.send_fds(unix, [MESSAGE.pack(MiB, 2)], [loose])
        code, body = _sync(sock, OP["rgpuHostShare"], SHARE.pack(MiB, 2), 9, ctx)
        assert code == 1 and b"refused the file passed" in body, body
        socket.send_fds(unix, [MESSAGE.pack(4 * MiB, 3)], [fd])
        code, body = _sync(sock, OP["rgpuHostShare"], SHARE.pack(4 * MiB, 3), 10, ctx)
        assert code == 1 and b"not the 4194304 announced" in body, body
        unix.sendall(MESSAGE.pack(MiB, 4))
        code, body = _sync(sock, OP["rgpuHostShare"], SHARE.pack(MiB, 4), 11, ctx)
        assert code == 1 and b"16 bytes and 0 file descriptors" in body, body
        # The session goes on: the real region still copies, and comes back.
        code, body = _sync(sock, copy, SHARED_COPY.pack(dev, 0, region, 0, MiB), 12, ctx)
        assert code == 0, body
        os.pwrite(fd, b"\0" * MiB, 0)
        code, body = _sync(sock, OP["rgpuMemcpyDtoHShared"], SHARED_COPY.pack(dev, 0, region, MiB, MiB), 13, ctx)
        assert code == 0 and os.pread(fd, MiB, MiB) == b"\x5a" * MiB, body
        code, _ = _sync(sock, OP["rgpuHostUnshare"], struct.pack("<Q", region), 14, ctx)
        assert code == 0
        code, body = _sync(sock, OP["rgpuMemcpyDtoHShared"], SHARED_COPY.pack(dev, 0, region, 0, 8), 15, ctx)
        assert code == 1 and b"is not one this session shares" in body, body
        os.close(fd)
        os.close(loose)
        unix.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_a_process_of_another_uid_cannot_share_memory_into_a_session(emulated: Server) -> None:
    """Abstract socket names are listed in /proc/net/unix, so another tenant of the GPU node may find
    the session's socket and connect: it is refused (its memfd never mapped), and the session's own
    client, connecting after it, still shares."""
    sock, _ = protocol.handshake(emulated.address, emulated.token())
    with sock:
        code, body = _sync(sock, OP["cuDevicePrimaryCtxRetain"], struct.pack("<i", 0), 1)
        (ctx,) = struct.unpack_from("<Q", body, 4)
        code, body = _sync(sock, OP["rgpuHostShare"], SHARE.pack(0, 0), 2, ctx)
        assert code == 0
        name = b"\0" + body[4:]
        intruder = textwrap.dedent(f"""
            import os, socket, struct
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect({name!r})
            fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, 1 << 20)
            socket.send_fds(s, [struct.pack("<QQ", 1 << 20, 5)], [fd])
            print("SENT", flush=True)
            input()
        """)

        def intrude() -> subprocess.Popen[str]:
            other = subprocess.Popen(["/usr/bin/python3", "-c", intruder], user=65534, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
            assert other.stdout is not None and other.stdout.readline().strip() == "SENT"
            return other

        other = intrude()
        try:   # only the intruder came
            code, body = _sync(sock, OP["rgpuHostShare"], SHARE.pack(MiB, 5), 3, ctx)
            assert code == 1 and b"only processes of uid 65534, not the session's (0), connected" in body, body
        finally:
            other.kill()
            other.wait()
        other = intrude()
        try:   # the intruder first, then the session's own process
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.connect(name)
            fd = _memfd(MiB)
            socket.send_fds(unix, [MESSAGE.pack(MiB, 6)], [fd])
            code, body = _sync(sock, OP["rgpuHostShare"], SHARE.pack(MiB, 6), 4, ctx)
            assert code == 0, body
            os.close(fd)
            unix.close()
        finally:
            other.kill()
            other.wait()
        code, _ = _sync(sock, OP["rgpuSessionInfo"], b"", 5)
        assert code == 0   # the session goes on


def test_through_the_cuda_backend_a_shared_copy_is_one_dma_from_the_registered_pages(
        native_libs: build.Libraries, chained: Server, tmp_path: Path) -> None:  # noqa: F811
    """backends/cuda.py over rgpu's own driver, chained to an emulated worker: the worker registers the
    client's pages (cuMemHostRegister) and copies straight from and into them (cuMemcpy*Async)."""
    done = py_client(native_libs, chained.slices(chained.token()), COPIES, RGPU_CLIENT_STATS=str(tmp_path / "p"))
    assert "SYNC True" in done.stdout and "ASYNC True" in done.stdout, done.stdout + done.stderr
    ops = _ops(tmp_path / "p")
    assert ops.get("rgpuMemcpyHtoDSharedWait") == 1 and ops.get("rgpuMemcpyDtoHShared") == 2, ops
    assert ops.get("rgpuHostUnshare") == 1, ops
