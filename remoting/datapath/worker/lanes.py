"""The worker's data lanes (protocol 12, issue 25): extra TCP connections of one session over which a
large copy's bytes travel striped (host to device: they come; device to host: they leave, after the
copy's REPLY). librgpu-worker.so's lanes.c receives a whole copy
per call, one thread per lane, straight into the device's memory (the emulated device) or into
pinned staging slots whose GPU copies it queues as each chunk lands (a real GPU: backends/cuda.py
hands it the driver's entry points); no Python runs per chunk.

A lane that fails ends all of the session's lanes: the copy fails with a message and later copies
travel on the session's own connection (the client stops using its lanes when one fails, and a
striped copy sent after the worker closed them is refused, so both ends agree)."""

from __future__ import annotations

import ctypes
import os
import socket

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.backends.base import INVALID_VALUE, UNKNOWN, CudaError

WHY_BYTES = 1024
# SO_SNDBUF/SO_RCVBUF of the worker's data-path sockets (RGPU_SOCKET_BUFFER_BYTES in the dispatcher's
# environment; 0: the kernel's autotuning). Each lane's buffer should cover its share of the link's
# bandwidth-delay product; Linux caps an explicit size at net.core.rmem_max/wmem_max.
SOCKET_BUFFER_BYTES = 4 << 20


class LanesUnavailable(Exception):
    """The worker cannot drive data lanes; the message says why."""


def socket_buffer_bytes() -> int:
    text = os.environ.get("RGPU_SOCKET_BUFFER_BYTES", "").strip()
    try:
        return max(0, min(int(text), 1 << 30)) if text else SOCKET_BUFFER_BYTES
    except ValueError:
        return SOCKET_BUFFER_BYTES


def size_socket_buffers(sock: socket.socket, size: int) -> None:
    if size <= 0:
        return
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, size)
        except OSError:
            pass


class GpuCopy(ctypes.Structure):
    """lanes.h's rgpu_lanes_gpu, field by field (change both together)."""
    _fields_ = [("memcpy_htod", ctypes.c_void_p), ("event_record", ctypes.c_void_p), ("event_sync", ctypes.c_void_p),
                ("stream", ctypes.c_void_p), ("dst", ctypes.c_uint64), ("events", ctypes.c_void_p),
                ("staging", ctypes.c_void_p), ("error", ctypes.c_int32), ("pad", ctypes.c_uint32),
                ("memcpy_dtoh", ctypes.c_void_p)]


class RingDriver(ctypes.Structure):
    """lanes.h's rgpu_lanes_ring_driver: the entry points a landing ring's plan queues work with."""
    _fields_ = [("wait_value32", ctypes.c_void_p), ("write_value32", ctypes.c_void_p), ("memcpy_htod", ctypes.c_void_p),
                ("event_record", ctypes.c_void_p), ("stream_wait_event", ctypes.c_void_p)]


# lanes.h's RGPU_LANES_RING_WORDS_BYTES: a landing ring's words (landed and done, one per lane).
RING_WORDS_BYTES = 2 * 16 * 64


class Lanes:
    RING_WORDS_BYTES = RING_WORDS_BYTES
    def __init__(self, library: str, socks: list[socket.socket], stall_s: float) -> None:
        if not library:
            raise LanesUnavailable("the dispatcher found no librgpu-worker.so to drive them with (no C compiler?)")
        try:
            lib = ctypes.CDLL(library)
            recv = lib.rgpu_lanes_recv
        except (OSError, AttributeError) as exc:
            raise LanesUnavailable(f"cannot load data lane support from {library} ({exc})") from None
        recv.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_double, ctypes.POINTER(ctypes.c_int32), ctypes.c_char_p, ctypes.c_size_t]
        recv.restype = ctypes.c_int
        send = lib.rgpu_lanes_send
        send.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64,
                         ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double,
                         ctypes.c_char_p, ctypes.c_size_t]
        send.restype = ctypes.c_int
        send_device = lib.rgpu_lanes_send_device
        send_device.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64,
                                ctypes.c_uint64, ctypes.c_void_p, ctypes.c_double, ctypes.c_char_p, ctypes.c_size_t]
        send_device.restype = ctypes.c_int
        self._send, self._send_device = send, send_device
        self._aborted = ctypes.c_int32(0)
        lib.rgpu_lanes_staging_new.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64]
        lib.rgpu_lanes_staging_new.restype = ctypes.c_void_p
        lib.rgpu_lanes_staging_drain.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.rgpu_lanes_staging_drain.restype = ctypes.c_int
        lib.rgpu_lanes_staging_free.argtypes = [ctypes.c_void_p]
        lib.rgpu_lanes_staging_free.restype = None
        lib.rgpu_lanes_ring_new.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64,
                                            ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p]
        lib.rgpu_lanes_ring_new.restype = ctypes.c_void_p
        lib.rgpu_lanes_ring_free.argtypes = [ctypes.c_void_p]
        lib.rgpu_lanes_ring_free.restype = None
        lib.rgpu_lanes_ring_plan.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64,
                                             ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p]
        lib.rgpu_lanes_ring_plan.restype = ctypes.c_int
        for name in ("rgpu_lanes_ring_release", "rgpu_lanes_ring_begin", "rgpu_lanes_ring_abandon"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = None
        lib.rgpu_lanes_recv_ring.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64,
                                             ctypes.c_uint64, ctypes.c_void_p, ctypes.c_double,
                                             ctypes.POINTER(ctypes.c_int32), ctypes.c_char_p, ctypes.c_size_t]
        lib.rgpu_lanes_recv_ring.restype = ctypes.c_int
        self.lib = lib
        self._recv = recv
        self.socks = socks
        self.count = len(socks)
        self._fds = (ctypes.c_int * len(socks))(*[s.fileno() for s in socks])
        self.stall_s = stall_s if stall_s > 0 else 30.0
        self._why = ctypes.create_string_buffer(WHY_BYTES)
        self.failed = ""       # why the lanes ended ("" while they serve)
        self.received = 0      # bytes that came on them
        self.sent = 0          # bytes that left on them

    @property
    def open(self) -> bool:
        return not self.failed and self.count > 0

    def check(self, size: int, chunk: int) -> None:
        """A striped copy's frame is one these lanes can take; else a CudaError (the lanes end: a
        client that sent this cannot be kept in step)."""
        if not self.open:
            raise CudaError(UNKNOWN, "rgpu: worker: a striped host-to-device copy on a session whose data lanes "
                                     f"ended ({self.failed or 'it has none'}; the client's later copies use its "
                                     "one connection)")
        if not protocol.MIN_LANE_CHUNK <= chunk <= protocol.MAX_LANE_CHUNK or size <= 0:
            self.close(f"a striped copy of {size} bytes in chunks of {chunk} bytes")
            raise CudaError(INVALID_VALUE, f"rgpu: worker: a striped copy of {size} bytes in chunks of {chunk} "
                                           f"bytes (chunks are {protocol.MIN_LANE_CHUNK} to {protocol.MAX_LANE_CHUNK} "
                                           "bytes; install the same rgpu version on both sides)")

    def receive(self, seq: int, size: int, chunk: int, address: int, gpu: GpuCopy | None = None) -> int:
        """One striped copy: into memory at `address` (0 with `gpu`: through its staging; 0 without:
        read and dropped). A lane failure closes every lane and raises a CudaError saying so; the
        code of chunks the sender aborted, or 0."""
        r = self._recv(self._fds, self.count, seq & 0xFFFFFFFF, size, chunk, address or None,
                       ctypes.byref(gpu) if gpu is not None else None, -1, None, None, self.stall_s,
                       ctypes.byref(self._aborted), self._why, WHY_BYTES)
        if r:
            why, count = self._why.value.decode(errors="replace"), self.count
            self.close(why)
            raise CudaError(UNKNOWN, f"rgpu: worker: a host-to-device copy of {size} bytes over {count} data "
                                     f"lanes failed ({why}); the copy did not complete; the session goes on, its "
                                     "later copies on its one connection")
        self.received += size
        return int(self._aborted.value)

    def receive_ring(self, seq: int, size: int, chunk: int, ring: int) -> int:
        """The copy last begun on landing ring `ring` (ring_begin), as `receive`; the caller releases the
        ring once this and the plan have ended, whatever happens. Makes no driver call: a thread other
        than the loop's runs it."""
        aborted = ctypes.c_int32(0)   # its own: the loop may receive another copy meanwhile
        why = ctypes.create_string_buffer(WHY_BYTES)
        r = self.lib.rgpu_lanes_recv_ring(self._fds, self.count, seq & 0xFFFFFFFF, size, chunk, ring, self.stall_s,
                                          ctypes.byref(aborted), why, WHY_BYTES)
        if r:
            text, count = why.value.decode(errors="replace"), self.count
            self.close(text)
            raise CudaError(UNKNOWN, f"rgpu: worker: a host-to-device copy of {size} bytes over {count} data "
                                     f"lanes failed ({text}); the copy did not complete; the session goes on, its "
                                     "later copies on its one connection")
        self.received += size
        return int(aborted.value)

    def send(self, seq: int, size: int, chunk: int, address: int = 0, gpu: GpuCopy | None = None) -> str:
        """One striped device-to-host copy, after its REPLY went out: from memory at `address`, or from
        the device through `gpu`'s staging (a chunk the driver refuses goes as an aborted frame, and
        gpu.error says so). "" when every chunk left, else why the lanes failed (they are closed)."""
        if gpu is not None:
            r = self._send_device(self._fds, self.count, seq & 0xFFFFFFFF, size, chunk, ctypes.byref(gpu),
                                  self.stall_s, self._why, WHY_BYTES)
        else:
            r = self._send(self._fds, self.count, seq & 0xFFFFFFFF, address, size, chunk, -1, None, None,
                           self.stall_s, self._why, WHY_BYTES)
        if r:
            why = self._why.value.decode(errors="replace")
            self.close(why)
            return why
        self.sent += size
        return ""

    # ---- pinned staging for a real GPU (lanes.h; backends/cuda.py owns the memory and the events) ----

    def staging_new(self, base: int, slots: int, slot_bytes: int) -> int:
        handle = self.lib.rgpu_lanes_staging_new(base, slots, slot_bytes)
        if not handle:
            raise MemoryError("rgpu: worker: cannot allocate the data lanes' staging table")
        return int(handle)

    def staging_drain(self, handle: int, event_sync: int) -> int:
        """Wait for every slot's queued copy; the first error, or 0."""
        return int(self.lib.rgpu_lanes_staging_drain(handle, event_sync)) if handle else 0

    def staging_free(self, handle: int) -> None:
        if handle:
            self.lib.rgpu_lanes_staging_free(handle)

    def ring_new(self, base: int, slots: int, slot_bytes: int, words: int, words_device: int,
                 streams: list[int], events: list[int]) -> int:
        """A landing ring over these lanes (lanes.h): `slots` slots of `slot_bytes` per lane at `base`."""
        n = self.count
        handle = self.lib.rgpu_lanes_ring_new(base, n, slots, slot_bytes, words, words_device,
                                              (ctypes.c_void_p * n)(*streams), (ctypes.c_void_p * n)(*events))
        if not handle:
            raise MemoryError("rgpu: worker: cannot allocate the data lanes' landing ring")
        return int(handle)

    def ring_begin(self, ring: int) -> None:
        """Begin a copy on the ring: its receive (receive_ring) may start before its plan is queued."""
        self.lib.rgpu_lanes_ring_begin(ring)

    def ring_plan(self, ring: int, driver: RingDriver, size: int, chunk: int, dst: int, stream: int, order: int) -> int:
        """Queue the begun copy's GPU work on the ring's streams (lanes.h); 0 or the driver's error."""
        return int(self.lib.rgpu_lanes_ring_plan(ring, ctypes.byref(driver), size, chunk, dst, stream or None, order))

    @staticmethod
    def ring_driver(wait_value32: int, write_value32: int, memcpy_htod: int, event_record: int,
                    stream_wait_event: int) -> RingDriver:
        return RingDriver(wait_value32, write_value32, memcpy_htod, event_record, stream_wait_event)

    def ring_release(self, ring: int) -> None:
        self.lib.rgpu_lanes_ring_release(ring)

    def ring_abandon(self, ring: int) -> None:
        """The begun copy's plan failed: its receive takes the bytes without waiting for the GPU."""
        self.lib.rgpu_lanes_ring_abandon(ring)

    def ring_free(self, ring: int) -> None:
        self.lib.rgpu_lanes_ring_free(ring)

    @staticmethod
    def gpu_copy(*, memcpy_htod: int, event_record: int, event_sync: int, stream: int, dst: int, events: int,
                 staging: int, memcpy_dtoh: int = 0) -> GpuCopy:
        """`dst`: the device address (the destination to the device, the source to the host)."""
        return GpuCopy(memcpy_htod=memcpy_htod, event_record=event_record, event_sync=event_sync,
                       stream=stream or None, dst=dst, events=events, staging=staging, memcpy_dtoh=memcpy_dtoh)

    def close(self, why: str = "the session ended") -> None:
        if not self.failed:
            self.failed = why
        for sock in self.socks:
            try:
                sock.close()
            except OSError:
                pass
        self.socks = []
        self.count = 0
