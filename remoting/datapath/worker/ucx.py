"""The worker's end of UCX (issue 25): librgpu-worker.so's ucx_link.c through ctypes, one call per
copy (the C side progresses UCX until the copy completes; no Python runs per chunk)."""

from __future__ import annotations

import ctypes
import os

from rgpu.remoting.datapath.backends.base import INVALID_VALUE, CudaError

WHY_BYTES = 1024


class UcxUnavailable(Exception):
    """UCX cannot be used for this session; the message says why."""


class UcxBroken(Exception):
    """A UCX transfer did not complete; the message is UCX's (or the link's) why."""


class UcxLink:
    def __init__(self, library: str, folder: str | None = None) -> None:
        if not library:
            raise UcxUnavailable("the dispatcher found no librgpu-worker.so to drive UCX with (no C compiler?)")
        try:
            lib = ctypes.CDLL(library)
            lib.rgpu_ucx_open.restype = ctypes.c_void_p
        except (OSError, AttributeError) as exc:
            raise UcxUnavailable(f"cannot load UCX support from {library} ({exc})") from None
        lib.rgpu_ucx_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        lib.rgpu_ucx_address.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        lib.rgpu_ucx_address.restype = ctypes.c_size_t
        lib.rgpu_ucx_connect.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                         ctypes.c_size_t]
        lib.rgpu_ucx_post.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                                      ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
        lib.rgpu_ucx_wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_double,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        lib.rgpu_ucx_describe.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.rgpu_ucx_describe.restype = ctypes.c_size_t
        lib.rgpu_ucx_cancel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        lib.rgpu_ucx_cancel.restype = None
        lib.rgpu_ucx_close.argtypes = [ctypes.c_void_p]
        lib.rgpu_ucx_close.restype = None
        self._lib = lib
        self._why = ctypes.create_string_buffer(WHY_BYTES)
        folder = os.environ.get("RGPU_UCX_LIB", "") if folder is None else folder
        # Single-threaded: handlers run on the worker's main thread (with a host node waiting, it is
        # the reader that is lent to another thread, loop.py's _lending), which opened this link.
        self._handle = lib.rgpu_ucx_open(folder.encode() or None, 0, self._why, WHY_BYTES)
        if not self._handle:
            raise UcxUnavailable(self._why.value.decode(errors="replace"))
        self.idle_s = float(os.environ.get("RGPU_UCX_IDLE_S") or 60.0)

    @property
    def address(self) -> bytes:
        p = ctypes.c_void_p()
        n = self._lib.rgpu_ucx_address(self._handle, ctypes.byref(p))
        return ctypes.string_at(p.value or 0, n) if n else b""

    def connect(self, peer: bytes) -> None:
        if self._lib.rgpu_ucx_connect(self._handle, peer, len(peer), self._why, WHY_BYTES):
            raise UcxUnavailable(self._why.value.decode(errors="replace"))

    def carriers(self) -> str:
        """UCX's transports on the endpoint's lanes ("posix/memory, cma/memory", "tcp/eth0"); "" before
        connect() or where the loaded UCX cannot say."""
        out = ctypes.create_string_buffer(256)
        self._lib.rgpu_ucx_describe(self._handle, out, len(out))
        return out.value.decode(errors="replace")

    def post(self, recv: bool, tag: int, address: int, n: int) -> int:
        """Start receiving (recv) or sending n bytes at `address`, tagged `tag`; the request for
        `wait` (0: done already). UcxBroken when UCX refuses."""
        req = ctypes.c_void_p()
        if self._lib.rgpu_ucx_post(self._handle, int(recv), tag, address, n, ctypes.byref(req), self._why, WHY_BYTES):
            raise UcxBroken(self._why.value.decode(errors="replace"))
        return req.value or 0

    def wait(self, req: int, recv: bool, n: int, fd: int) -> None:
        """Progress until `req` completes (a receive: with exactly n bytes). UcxBroken when nothing
        moved for idle_s, the socket `fd` ended (the peer left), or the transfer failed."""
        if req and self._lib.rgpu_ucx_wait(self._handle, req, int(recv), n, self.idle_s, fd, 0, self._why, WHY_BYTES):
            raise UcxBroken(self._why.value.decode(errors="replace"))

    def cancel(self, req: int, recv: bool) -> None:
        """Cancel a posted request and release it (one that will not be waited for): a receive once
        UCX has cancelled it; a send, which UCX cannot cancel, by closing the link's endpoint."""
        if req:
            self._lib.rgpu_ucx_cancel(self._handle, req, int(recv))

    @staticmethod
    def _copy_failed(what: str, exc: UcxBroken) -> CudaError:
        return CudaError(INVALID_VALUE, f"rgpu: worker: {what} ({exc}; the client's copy did not arrive whole: "
                                        "check its log, rerun)")

    def recv(self, tag: int, address: int, n: int, fd: int) -> None:
        """n bytes tagged `tag` into memory at `address` (blocks until they are there)."""
        try:
            req = self.post(True, tag, address, n)
        except UcxBroken as exc:
            raise self._copy_failed("cannot receive a host-to-device copy over UCX", exc) from None
        try:
            self.wait(req, True, n, fd)
        except UcxBroken as exc:
            raise self._copy_failed("a host-to-device copy over UCX failed", exc) from None

    def post_send(self, tag: int, address: int, n: int) -> int:
        """Start sending; the request (0: done) for `finish_send`."""
        try:
            return self.post(False, tag, address, n)
        except UcxBroken as exc:
            raise self._copy_failed("cannot send a device-to-host copy over UCX", exc) from None

    def finish_send(self, req: int, n: int, fd: int) -> str:
        """Wait for a send; "" when done, else why it failed (the reply has gone already)."""
        try:
            self.wait(req, False, n, fd)
        except UcxBroken as exc:
            return str(exc)
        return ""

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle:
            self._lib.rgpu_ucx_close(handle)
