"""Reading frames from the session socket into one reusable, driver-addressable buffer."""

from __future__ import annotations

import ctypes
import os
import socket
import time

from rgpu.remoting.datapath import protocol
from rgpu.units import format_bytes, parse_size

_HEADER = protocol.HEADER

# The largest frame a worker takes into memory (a module image, a captured host copy's data);
# bigger ones are read through the receive buffer, discarded and answered with an error. Copies
# never need it: they travel in 1 MiB chunks. `RGPU_WORKER_MAX_FRAME` in the dispatcher's
# environment (a size such as 512MiB) overrides it.
WORKER_MAX_FRAME = 256 << 20


def worker_max_frame() -> int:
    text = os.environ.get("RGPU_WORKER_MAX_FRAME", "").strip()
    if not text:
        return WORKER_MAX_FRAME
    return min(parse_size(text, "RGPU_WORKER_MAX_FRAME", component="worker"), protocol.MAX_FRAME)


# How long the worker polls its socket before it sleeps in recv, in microseconds
# (`RGPU_WORKER_SPIN_US` in the dispatcher's environment; 0: never poll). The next frame of a
# busy session (the copy after a launch, the next step's first call) often arrives within tens of
# microseconds, and a thread woken from recv pays several more on loopback or a fast network:
# the `tensor.item()` pattern waits for that twice per call. An idle session costs one such poll.
# Only where the worker may use SPIN_MIN_CPUS or more CPUs: on fewer, a polling worker takes the
# CPU its own client (or another session) needs, and every call gets slower.
WORKER_SPIN_US = 50
SPIN_MIN_CPUS = 4


def worker_spin_ns() -> int:
    text = os.environ.get("RGPU_WORKER_SPIN_US", "").strip()
    try:
        us = int(text) if text else (WORKER_SPIN_US if len(os.sched_getaffinity(0)) >= SPIN_MIN_CPUS else 0)
    except ValueError:
        us = WORKER_SPIN_US
    return max(0, min(us, 10_000)) * 1000


class FrameTooLarge(Exception):
    """A frame above the worker's maximum, read and discarded; its operation gets this error."""

    def __init__(self, op: int, seq: int, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes")
        self.op, self.seq, self.length = op, seq, length
        self.message = (f"rgpu: worker: a request of {format_bytes(length)} refused (a worker takes frames of at "
                        f"most {format_bytes(limit)} into memory; split the data, e.g. load a smaller module "
                        f"image, or raise RGPU_WORKER_MAX_FRAME on the dispatcher)")


class FrameReader:
    """Reads frames into one reusable buffer; payload views stay valid until the next read.

    The buffer is a ctypes array so backends can hand its addresses to the driver (the CUDA
    backend pins it, so host-to-device copies go straight from the socket buffer by DMA). A frame
    larger than the buffer and at most `max_frame` gets an array of its own (`big`), which the
    serving loop drops as soon as its operation returns.
    """

    def __init__(self, sock: socket.socket, size: int = 8 << 20) -> None:
        self.sock = sock
        self.size = size
        self.cbuf = (ctypes.c_char * size)()
        self.base = ctypes.addressof(self.cbuf)
        self.view = memoryview(self.cbuf).cast("B")
        self.start = 0
        self.end = 0
        self.big: ctypes.Array | None = None
        self.received = 0   # bytes read from the socket (the session's traffic counters)
        self.max_frame = worker_max_frame()
        # Bytes a waiting host node read while this buffer was full (worker/hostcalls.py): they
        # come before anything still in the socket.
        self.spill = bytearray()
        # The stream offset of the buffer's first byte (a waiting host node scans each frame once).
        self.origin = 0
        self.spin_ns = worker_spin_ns()

    def _recv(self, view: memoryview, n: int) -> int:
        if self.spill:
            k = min(n, len(self.spill))
            view[:k] = self.spill[:k]
            del self.spill[:k]
            return k
        if self.spin_ns:
            clock = time.perf_counter_ns
            deadline = 0
            while True:
                try:
                    return self.sock.recv_into(view, n, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    now = clock()
                    if not deadline:
                        deadline = now + self.spin_ns
                    elif now >= deadline:
                        break
        return self.sock.recv_into(view, n)

    def _fill(self, need: int) -> None:
        if self.end - self.start >= need:
            return
        if self.start + need > self.size:
            n = self.end - self.start
            self.view[0:n] = self.view[self.start:self.end]
            self.origin += self.start
            self.start, self.end = 0, n
        while self.end - self.start < need:
            k = self._recv(self.view[self.end:], self.size - self.end)
            if k == 0:
                raise EOFError
            self.end += k
            self.received += k

    def next(self) -> tuple[int, int, int, int, int, memoryview, int]:
        """(op, flags, seq, aux, ctx, payload, payload_address)."""
        self.big = None
        self._fill(protocol.HEADER_SIZE)
        length, op, flags, seq, aux, ctx = _HEADER.unpack_from(self.view, self.start)
        self.start += protocol.HEADER_SIZE
        if length > self.max_frame:
            self._discard(length)
            raise FrameTooLarge(op, seq, length, self.max_frame)
        if length + 64 <= self.size:
            self._fill(length)
            payload = self.view[self.start:self.start + length]
            address = self.base + self.start
            self.start += length
            return op, flags, seq, aux, ctx, payload, address
        # Larger than the buffer (a big module image): read it into its own array.
        big = (ctypes.c_char * length)()
        bview = memoryview(big).cast("B")
        have = min(self.end - self.start, length)
        bview[0:have] = self.view[self.start:self.start + have]
        self.start += have
        self.origin += length - have   # bytes of the stream that never pass through the buffer
        got = have
        while got < length:
            k = self._recv(bview[got:], length - got)
            if k == 0:
                raise EOFError
            got += k
            self.received += k
        self.big = big
        return op, flags, seq, aux, ctx, bview, ctypes.addressof(big)


    def _discard(self, length: int) -> None:
        """Read a refused frame's payload through the receive buffer, keeping none of it."""
        have = min(self.end - self.start, length)
        self.start += have
        left = length - have
        self.origin += self.end + left
        while left:
            k = self._recv(self.view, min(left, self.size))
            if k == 0:
                raise EOFError
            left -= k
            self.received += k
        self.start = self.end = 0
