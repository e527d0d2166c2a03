"""Reading frames from the session socket into one reusable, driver-addressable buffer."""

from __future__ import annotations

import ctypes
import os
import select
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


# An unfinished frame must keep coming: the worker waits at most FRAME_STALL_S (the dispatcher's
# session_frame_stall_seconds, passed in the session's spec) for PROGRESS_BYTES more of it (or its
# end), counting only the time it waits for the socket. A large frame over a slow link is fine
# (64 KiB in 30 s is 2 KiB/s); a client that sends part of a frame, then nothing or a trickle,
# ends its session instead of holding the frame's memory for ever. A session idle between frames
# has no deadline.
FRAME_STALL_S = 30.0
PROGRESS_BYTES = 64 << 10
NVML_MAX_FRAME = 1 << 20   # NVML sessions send small queries only


class FrameStalled(ConnectionError):
    """A frame's bytes stopped coming (FrameProgress); the session ends."""


class FrameProgress:
    """How long the reader may still wait for the frame starting at stream offset `frame_at`
    (pure: callers pass the offsets, byte counts and seconds waited)."""

    def __init__(self, stall_s: float = FRAME_STALL_S, progress_bytes: int = PROGRESS_BYTES) -> None:
        self.stall_s = stall_s
        self.progress_bytes = progress_bytes
        self.frame_at = -1
        self.waited = 0.0     # seconds waited since the frame began or last made progress
        self.got = 0          # bytes since then

    def allowed(self, frame_at: int) -> float:
        """Seconds the next wait for this frame may last (<= 0: it has stalled)."""
        if frame_at != self.frame_at:
            self.frame_at, self.waited, self.got = frame_at, 0.0, 0
        return self.stall_s - self.waited

    def waited_for(self, seconds: float, got: int) -> None:
        self.waited += seconds
        self.got += got
        if self.got >= self.progress_bytes:
            self.waited, self.got = 0.0, 0


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

    def __init__(self, sock: socket.socket, size: int = 8 << 20, stall_s: float = FRAME_STALL_S) -> None:
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
        self.progress = FrameProgress(stall_s) if stall_s > 0 else None
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)

    def _recv(self, view: memoryview, n: int, frame_at: int = -1) -> int:
        """Bytes into `view`; `frame_at`: the stream offset of the unfinished frame they belong
        to (its wait is bounded by FrameProgress), -1 while waiting for a new frame."""
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
        if frame_at < 0 or self.progress is None:
            return self.sock.recv_into(view, n)
        return self._recv_in_frame(view, n, frame_at, self.progress)

    def _recv_in_frame(self, view: memoryview, n: int, frame_at: int, progress: FrameProgress) -> int:
        """A blocking read of an unfinished frame's bytes, which must come within the frame's
        allowance. poll() rather than a socket timeout: the socket stays blocking for the C loop."""
        allowed = progress.allowed(frame_at)
        t0 = time.monotonic()
        ready = allowed > 0 and self._poll.poll(max(1, int(allowed * 1000)))
        if not ready:
            progress.waited_for(time.monotonic() - t0, 0)
            if progress.allowed(frame_at) > 0:
                return self._recv_in_frame(view, n, frame_at, progress)   # woken early (a signal)
            raise FrameStalled(f"a frame's bytes stopped coming for {progress.stall_s:g} s")
        k = self.sock.recv_into(view, n)
        progress.waited_for(time.monotonic() - t0, k)
        return k

    def _fill(self, need: int, in_frame: bool = False) -> None:
        if self.end - self.start >= need:
            return
        if self.start + need > self.size:
            n = self.end - self.start
            self.view[0:n] = self.view[self.start:self.end]
            self.origin += self.start
            self.start, self.end = 0, n
        # Bytes of the frame already here: the wait is for the rest of it, which must keep coming.
        frame_at = self.origin + self.start if (self.end > self.start or in_frame) else -1
        while self.end - self.start < need:
            k = self._recv(self.view[self.end:], self.size - self.end, frame_at)
            if frame_at < 0:
                frame_at = self.origin + self.start
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
            self._fill(length, in_frame=length > 0)
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
        frame_at = self.origin + self.start
        while got < length:
            k = self._recv(bview[got:], length - got, frame_at)
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
        frame_at = self.origin
        while left:
            k = self._recv(self.view, min(left, self.size), frame_at)
            if k == 0:
                raise EOFError
            left -= k
            self.received += k
        self.start = self.end = 0
