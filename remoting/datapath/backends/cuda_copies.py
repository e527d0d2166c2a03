"""The real-GPU backend's copies: the pinned staging ring and device-to-host buffers, the UCX copies'
pinned buffer, the client's shared page-locked memory, striped copies over data lanes."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rgpu.remoting.datapath.backends.base import SUCCESS, UNKNOWN, CudaError
from rgpu.remoting.datapath.backends.cuda_driver import (c_void_p, c_uint, c_uint64, byref, STAGING_RING_BYTES,
                                                         STAGING_CHUNK, DTOH_CHUNK, UCX_PINNED_MAX_BYTES,
                                                         MEMHOSTALLOC_PORTABLE, MEMHOSTALLOC_DEVICEMAP,
                                                         MEMHOSTREGISTER_PORTABLE, STREAM_NON_BLOCKING,
                                                         STREAM_WAIT_VALUE_GEQ, CUDA_MEMCPY2D, staging_slots)
from rgpu.remoting.datapath.backends.cuda_device import CudaDevice


@dataclass
class LaneSide:
    """A context's side of striped copies received in the background: the stream their DMAs go on,
    the event that orders it after the application's stream, and a page-locked word that stream
    waits for (cuStreamWaitValue32) until the receiving thread stores the copy's ticket in it."""

    stream: int
    order: Any
    word: int          # its host address
    word_device: int   # the same word as the GPU addresses it
    ticket: int = 0
    refused: bool = False   # the driver refused to wait on it once: copies are received in the loop


@dataclass
class LaneLanding:
    """Page-locked memory a striped copy received in the background lands in whole, and the event
    its DMA to the device records: it is written again only once that event has completed."""

    address: int
    size: int
    event: Any
    used: bool = False


@dataclass
class LaneRing:
    """The primary context's landing ring for striped copies received in the background (lanes.h):
    its C table, the lanes it serves, its page-locked slots and words, and per lane a stream the
    chunks' DMAs go on and the event that marks them for the application's stream."""

    lanes: Any
    handle: int
    base: int
    words: int
    slot_bytes: int
    streams: list[int]
    events: list[Any]
    order: Any
    driver: Any   # worker/lanes.py's RingDriver


class LaneReceive:
    """One striped host-to-device copy a thread of the worker receives (threading: `done` is set, with
    `error` filled in, before the application's stream may go on)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: CudaError | None = None
        self.thread: threading.Thread | None = None

    def join(self) -> CudaError | None:
        if self.thread is not None:
            self.thread.join()
        return self.error


# The largest striped copy received in the background behind queued work: it lands whole in
# page-locked memory first.
LANDING_MAX_BYTES = 256 << 20
# Slots per lane of the landing ring a copy onto an idle stream goes through: two keep a lane
# receiving into one while the GPU copies out of the other, and the ring small enough for the CPU's
# cache (8 lanes of 2 MiB chunks: 32 MiB).
LANE_RING_SLOTS = 2
# The largest chunk the landing ring takes (a larger one lands whole): slots beyond the CPU's cache
# gain nothing, and the chunk size is the client's choice: 64 MiB chunks over 16 lanes had the
# worker ask for a 2 GiB ring. With this bound a client makes it pin 16 x slots x 4 MiB at most.
LANE_RING_MAX_CHUNK_BYTES = 4 << 20


def lane_ring_slots() -> int:
    """Slots per lane of the landing ring (RGPU_LANE_RING_SLOTS, from the dispatcher's environment): 2
    by default, 2 to 16; 0: no ring (every background copy lands whole)."""
    text = os.environ.get("RGPU_LANE_RING_SLOTS", "").strip()
    if not text.isdigit():
        return LANE_RING_SLOTS
    return 0 if int(text) == 0 else max(2, min(int(text), 16))


def lanes_background_asked() -> bool:
    """The background receive, unless RGPU_LANES_BACKGROUND=0 (read by the workers, from the
    dispatcher's environment)."""
    return os.environ.get("RGPU_LANES_BACKGROUND", "1").strip() != "0"


class CudaCopies(CudaDevice):
    """Copies between the client's bytes and the GPU."""

    # ------------------------------------------------------------------ staging buffers

    def _make_staging(self) -> None:
        def make() -> None:
            self._ring_base = self._host_alloc(STAGING_RING_BYTES)
            for _ in range(2):
                self._dtoh.append(self._host_alloc(DTOH_CHUNK))
        self._with_primary(make)
        self._ring.clear()

    def _drop_staging(self) -> None:
        self._wait_busy()
        self._ucx_wait()
        for address in ([self._ring_base] if self._ring_base else []) + self._dtoh + \
                ([self._ucx_base] if self._ucx_base else []):
            self._call("cuMemFreeHost", address)
        self._ring_base, self._dtoh = 0, []
        self._ucx_base = self._ucx_bytes = 0

    # ------------------------------------------------------------------ UCX copies' pinned buffer

    def _ucx_wait(self) -> None:
        """Wait for the DMA queued from the UCX buffer (its bytes may then be overwritten)."""
        if self._ucx_pending is not None:
            _, event = self._ucx_pending
            self._ucx_pending = None
            self._call("cuEventSynchronize", event)

    def ucx_buffer(self, n: int) -> int:
        """Pinned memory for a UCX copy of n bytes to land in or leave from, free to write (the
        previous copy's DMA from it has finished); 0 when n is beyond UCX_PINNED_MAX_BYTES."""
        limit = int(os.environ.get("RGPU_UCX_PINNED_MAX_BYTES") or UCX_PINNED_MAX_BYTES)
        if n > limit:
            return 0
        self._ucx_wait()
        if self._ucx_bytes < n:
            if self._ucx_base:
                self._call("cuMemFreeHost", self._ucx_base)
                self._ucx_base = self._ucx_bytes = 0
            size = max(n, 16 << 20)

            def make() -> None:
                self._ucx_base, self._ucx_bytes = self._host_alloc(size), size
            self._with_primary(make)
        return self._ucx_base

    def htod_ucx(self, dst: int, stream: int, n: int, offset: int = 0) -> None:
        """Queue the DMA of n bytes at `offset` of the UCX buffer to dst (a UCX copy's chunk, the
        moment it is in); the buffer stays busy until the last one queued has run (the next UCX copy
        waits for it, not this one)."""
        self._refuse_capture(stream, "cuMemcpyHtoDAsync")
        event = self._ucx_events.get(self._current)
        if event is None:   # one per context, as the ring's (it goes with its context)
            event = self._ucx_events[self._current] = self._new_event()
        r = self._call("cuMemcpyHtoDAsync_v2", dst, self._ucx_base + offset, n, stream or None)
        if r == SUCCESS:
            r = self._call("cuEventRecord", event, stream or None)
        if r != SUCCESS:
            # Nothing tracks this copy's DMA: wait for the stream before the buffer is reused.
            self._call("cuStreamSynchronize", stream or None)
            raise CudaError(r)
        self._ucx_pending = (self._current, event)

    def dtoh_ucx_chunks(self, src: int, stream: int, n: int, chunk: int) -> Iterator[tuple[int, int]]:
        """Queue n bytes at src into the UCX buffer as DMAs of `chunk` bytes, each followed by an
        event; yield (offset, length) of each chunk once it is there (the first may be sent while
        the others are still copied down)."""
        self._refuse_capture(stream, "cuMemcpyDtoHAsync")
        events = self._ucx_chunk_events.setdefault(self._current, [])
        spans = [(at, min(chunk, n - at)) for at in range(0, n, chunk)]
        while len(events) < len(spans):
            events.append(self._new_event())
        queued = 0
        try:
            for (at, k), event in zip(spans, events):
                self._check("cuMemcpyDtoHAsync_v2", self._ucx_base + at, src + at, k, stream or None)
                self._check("cuEventRecord", event, stream or None)
                queued += 1
            for (at, k), event in zip(spans, events):
                self._check("cuEventSynchronize", event)
                yield at, k
        finally:
            if queued:   # the buffer is free again only once every DMA into it has run
                self._call("cuEventSynchronize", events[queued - 1])

    # ------------------------------------------------------------------ the client's shared page-locked memory
    # Same host (protocol 15, worker/shared_pinned.py): the client's cuMemHostAlloc pages, mapped here
    # from its memfd, page-locked once; a copy is then one DMA from or into the application's pages.

    def host_register(self, address: int, size: int) -> None:
        self._with_primary(lambda: self._check("cuMemHostRegister_v2", address, size, MEMHOSTREGISTER_PORTABLE))

    def host_unregister(self, address: int) -> None:
        """As cuMemFreeHost: the device's work finishes first (a DMA may still read the pages)."""
        self._call("cuCtxSynchronize")   # the session's current context; the primary one below

        def unregister() -> None:
            self._call("cuCtxSynchronize")
            self._check("cuMemHostUnregister", address)
        self._with_primary(unregister)

    def htod_host(self, dst: int, stream: int, address: int, n: int, wait: bool) -> None:
        """One DMA from registered host memory; `wait`: return once it has read the pages."""
        self._refuse_capture(stream, "cuMemcpyHtoDAsync")
        self._check("cuMemcpyHtoDAsync_v2", dst, address, n, stream or None)
        if wait:
            self._check("cuStreamSynchronize", stream or None)

    def dtoh_host(self, src: int, stream: int, address: int, n: int) -> None:
        """One DMA into registered host memory, in stream order, waited for."""
        self._refuse_capture(stream, "cuMemcpyDtoHAsync")
        self._check("cuMemcpyDtoHAsync_v2", address, src, n, stream or None)
        self._check("cuStreamSynchronize", stream or None)

    def _context_events(self) -> tuple[list[Any], list[Any]]:
        """The current context's events: free ones for ring copies (made as needed), and two for
        device-to-host chunks (made on its first copy)."""
        events = self._events.get(self._current)
        if events is None:
            events = ([], [self._new_event(), self._new_event()])
            self._events[self._current] = events
        return events

    def _new_event(self) -> Any:
        e = c_void_p()
        self._check("cuEventCreate", byref(e), 2)  # CU_EVENT_DISABLE_TIMING
        return e

    def _retire_oldest(self) -> None:
        """Wait until the GPU has read the oldest staged copy; its event goes back to its context."""
        ctx, event = self._ring.oldest()
        self._call("cuEventSynchronize", event)
        self._ring.retire_oldest()
        free = self._events.get(ctx)
        if free is not None:
            free[0].append(event)

    def _wait_busy(self) -> None:
        """Wait for every staged copy (the ring is first in, first out: all of them)."""
        while len(self._ring):
            self._retire_oldest()

    def _forget_events(self, ctx: int) -> None:
        """Before a context goes: its copies finish, its events go with it."""
        if self._ucx_pending is not None and self._ucx_pending[0] == ctx:
            self._ucx_wait()
        self._ucx_events.pop(ctx, None)
        self._ucx_chunk_events.pop(ctx, None)
        if ctx in self._events:
            if any(owner == ctx for owner, _ in self._ring.tags()):
                self._wait_busy()
            del self._events[ctx]

    def _stage(self, n: int) -> tuple[int, Any]:
        """(address, event) of n pinned bytes for one copy, waiting for the GPU only when the
        ring is full; the caller records the event after queueing the copy."""
        if not self._ring_base:
            self._make_staging()
        free = self._context_events()[0]
        event = free.pop() if free else self._new_event()
        while (offset := self._ring.take(n, (self._current, event))) is None:
            self._retire_oldest()
        return self._ring_base + offset, event

    # ------------------------------------------------------------------ copies

    def htod(self, dst: int, stream: int, data: memoryview, address: int) -> None:
        """Copy through the pinned ring: the socket buffer is reused at once, the DMA is async."""
        self._refuse_capture(stream, "cuMemcpyHtoDAsync")
        n = len(data)
        if n > STAGING_CHUNK:
            for off in range(0, n, STAGING_CHUNK):
                part = data[off:off + STAGING_CHUNK]
                self.htod(dst + off, stream, part, address + off)
            return
        staging, event = self._stage(n)
        ctypes.memmove(staging, address, n)
        r = self._call("cuMemcpyHtoDAsync_v2", dst, staging, n, stream or None)
        if r == SUCCESS:
            r = self._call("cuEventRecord", event, stream or None)
        if r != SUCCESS:
            # Nothing tracks this copy's DMA: wait for the stream before its bytes are reused.
            self._call("cuStreamSynchronize", stream or None)
            raise CudaError(r)

    def htod_lanes(self, dst: int, stream: int, size: int, chunk: int, seq: int, lanes: Any) -> None:
        """A striped copy (worker/lanes.py): lanes.c receives each chunk into a pinned slot and queues
        its copy to `dst` on `stream` as it lands; the slots stay busy until their events complete."""
        self._lane_receive_join()
        try:
            self._refuse_capture(stream, "cuMemcpyHtoDAsync")
            gpu = self._lane_copy(lanes, chunk, dst, stream)
        except CudaError:
            lanes.receive(seq, size, chunk, 0)   # the client sends the bytes whatever the answer: drop them
            raise
        lanes.receive(seq, size, chunk, 0, gpu)
        if gpu.error:
            raise CudaError(gpu.error)

    # ---- striped copies received in the background: the loop serves the session meanwhile ----

    def htod_lanes_background(self, dst: int, stream: int, size: int, chunk: int, seq: int, lanes: Any) -> bool:
        """Start a striped host-to-device copy that a thread of the worker receives while the loop serves
        the session's next frames (an event query of the application's other thread need not wait
        for the bytes), as the driver's own cuMemcpyHtoDAsync returns at once. False where this
        cannot be (a capture may be under way, the driver refuses stream memory operations, a
        context other than the primary; behind queued work, more than LANDING_MAX_BYTES or both
        landings busy) or is not asked for (RGPU_LANES_BACKGROUND=0): the caller receives it in the loop.

        Onto a stream with nothing queued, a copy goes through the landing ring (_ring_receive): each
        chunk's DMA runs as soon as the chunk is whole, from slots the CPU's cache holds. Otherwise it
        lands whole in a landing, so that the lanes never wait for the GPU; then
        everything the GPU does is queued here, by the loop: on the context's side stream, after the
        work queued on `stream` so far, a wait for the word, then one DMA from the landing to `dst`
        and the landing's event, which `stream` waits for. The thread only receives the bytes into
        the landing and then stores the copy's ticket in the word: it makes no driver call. (The
        first design queued each chunk's DMA from the thread: a call of the loop that makes the
        driver synchronise the context, such as loading a kernel on its first launch under lazy
        loading, then waited for the copy while the thread's driver calls waited for it. Four of
        NVIDIA's cuda-samples hung so on an H100; docs/benchmarks.md, session 14.)"""
        self._lane_receive_join()
        if self._captures or not lanes_background_asked() or self._current != (self.primary.value or 0):
            return False
        idle = self._fn_cuStreamQuery(stream or None) == SUCCESS   # type: ignore[attr-defined]
        if not idle and size > LANDING_MAX_BYTES:
            return False
        try:
            side = self._lane_side()
            if side.refused:
                return False
            if idle and self._ring_receive(dst, stream, size, chunk, seq, lanes):
                return True
            landing = None if size > LANDING_MAX_BYTES else self._idle_landing(size)
        except CudaError:
            return False
        if landing is None:
            return False
        wait_event = self._fn_cuStreamWaitEvent   # type: ignore[attr-defined]
        ticket = (side.ticket + 1) & 0xFFFFFFFF
        if (self._call("cuEventRecord", side.order, stream or None) != SUCCESS
                or wait_event(side.stream, side.order, 0) != SUCCESS):
            return False
        if self._fn_cuStreamWaitValue32_v2(side.stream, side.word_device, ticket,  # type: ignore[attr-defined]
                                           STREAM_WAIT_VALUE_GEQ) != SUCCESS:
            side.refused = True
            return False
        side.ticket = ticket
        landing.used = True
        if (self._call("cuMemcpyHtoDAsync_v2", dst, landing.address, size, side.stream) != SUCCESS
                or self._call("cuEventRecord", landing.event, side.stream) != SUCCESS
                or wait_event(stream or None, landing.event, 0) != SUCCESS):
            # The side stream waits for the word: release it, and let whatever was queued run before
            # the loop's receive queues the copy again (htod_lanes meets the error and drops the bytes).
            ctypes.c_uint32.from_address(side.word).value = ticket
            self._call("cuStreamSynchronize", side.stream)
            return False
        def release() -> None:
            ctypes.c_uint32.from_address(side.word).value = ticket

        self._start_lane_receive(lambda: lanes.receive(seq, size, chunk, landing.address), release)   # bytes only
        return True

    def _start_lane_receive(self, receive_bytes: Callable[[], object], release: Callable[[], None]) -> None:
        """A thread runs `receive_bytes` (it must make no driver call), records its failure, then
        `release`s the GPU's wait for the bytes: the error first, so that a frame that sees the
        application's stream go on sees it too."""
        receive = LaneReceive()

        def run() -> None:
            try:
                receive_bytes()
            except CudaError as exc:
                receive.error = exc
            except Exception as exc:  # noqa: BLE001 - the application's stream must not wait forever
                receive.error = CudaError(UNKNOWN, f"rgpu: worker: internal error receiving a striped copy ({exc!r}; "
                                                   "please report it with the dispatcher's log)")
            finally:
                receive.done.set()
                release()

        receive.thread = threading.Thread(target=run, name="rgpu-lane-receive", daemon=True)
        self._lane_receive = receive
        receive.thread.start()

    def _ring_receive(self, dst: int, stream: int, size: int, chunk: int, seq: int, lanes: Any) -> bool:
        """Start the thread that receives the copy's bytes into the landing ring's slots (lanes.h), then
        queue its GPU work; False where there is no ring (RGPU_LANE_RING_SLOTS=0, one that failed
        before, no memory). A plan the driver refuses fails the copy (reported as a failed receive is)
        and ends the ring."""
        ring = self._lane_ring_for(lanes, chunk)
        if ring is None:
            return False
        # The thread receives while the plan is queued: a plan longer than the driver's queue makes this
        # call wait for the GPU, which waits for the bytes (342 chunks a lane hung an H100 when the
        # thread started after the plan). It releases the ring once both have ended.
        planned = threading.Event()

        def release() -> None:
            planned.wait()
            lanes.ring_release(ring.handle)

        lanes.ring_begin(ring.handle)
        self._start_lane_receive(lambda: lanes.receive_ring(seq, size, chunk, ring.handle),   # bytes and words only
                                 release)
        result = UNKNOWN
        try:
            result = lanes.ring_plan(ring.handle, ring.driver, size, chunk, dst, stream, ring.order.value)
        finally:
            if result != SUCCESS:
                lanes.ring_abandon(ring.handle)   # the bytes are taken and dropped: the lanes stay in step
            planned.set()
        self.lane_ring_copies += 1
        if result != SUCCESS:
            # Part of the plan may be queued: once released its streams finish; the copy fails, no ring again.
            self._drop_lane_ring(refuse=True)
            if self._lane_receive_unreported is None:
                self._lane_receive_unreported = CudaError(result, (
                    f"rgpu: worker: the driver refused to queue a host-to-device copy of {size} bytes through "
                    f"the data lanes' landing ring (CUDA error {result}); the copy did not complete; later "
                    "copies land whole"))
        return True

    def _lane_ring_for(self, lanes: Any, chunk: int) -> LaneRing | None:
        """The primary context's landing ring for `lanes` and chunks of `chunk` bytes, made on first use;
        None for chunks larger than LANE_RING_MAX_CHUNK_BYTES (the copy lands whole)."""
        if chunk > LANE_RING_MAX_CHUNK_BYTES:
            return None
        ring = self._lane_ring
        if ring is not None and (ring.lanes is not lanes or chunk > ring.slot_bytes):
            self._drop_lane_ring()
            ring = None
        slots = lane_ring_slots()
        if ring is not None or not slots or self._lane_ring_refused or not lanes.count:
            return ring
        entries = [self._entry(name) for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2",
                                                  "cuMemcpyHtoDAsync_v2", "cuEventRecord", "cuStreamWaitEvent")]
        if not all(entries):
            self._lane_ring_refused = True
            return None
        made: dict[str, Any] = {"streams": []}
        try:
            n = lanes.count
            made["base"] = self._host_alloc(n * slots * chunk)
            made["words"] = self._host_alloc(lanes.RING_WORDS_BYTES, MEMHOSTALLOC_PORTABLE | MEMHOSTALLOC_DEVICEMAP)
            words_device = c_uint64()
            get_device_pointer = self._late_fn("cuMemHostGetDevicePointer_v2",
                                               [ctypes.POINTER(c_uint64), c_void_p, c_uint])
            if (r := get_device_pointer(byref(words_device), c_void_p(made["words"]), 0)) != SUCCESS:
                raise CudaError(r)
            events = []
            for _ in range(n):
                stream_made = c_void_p()
                self._check("cuStreamCreateWithPriority", byref(stream_made), STREAM_NON_BLOCKING, 0)
                made["streams"].append(stream_made.value or 0)
                events.append(self._new_event())
            order = self._new_event()
            handle = lanes.ring_new(made["base"], slots, chunk, made["words"], words_device.value, made["streams"],
                                    [e.value for e in events])
        except (CudaError, MemoryError):
            self._free_ring_parts(made)
            self._lane_ring_refused = True
            return None
        self._lane_ring = LaneRing(lanes, handle, made["base"], made["words"], chunk, made["streams"], events,
                                   order, lanes.ring_driver(*entries))
        return self._lane_ring

    def _host_alloc(self, size: int, flags: int = MEMHOSTALLOC_PORTABLE) -> int:
        """`size` bytes of page-locked memory (portable: every context may copy through it)."""
        p = c_void_p()
        self._check("cuMemHostAlloc", byref(p), size, flags)
        return p.value or 0

    def _free_ring_parts(self, made: dict[str, Any]) -> None:
        """A ring's streams (once their work ran) and page-locked memory."""
        destroy = self._late_fn("cuStreamDestroy_v2", [c_void_p])
        for stream in made.get("streams", []):
            self._call("cuStreamSynchronize", c_void_p(stream))
            destroy(c_void_p(stream))
        for key in ("base", "words"):
            if made.get(key):
                self._call("cuMemFreeHost", c_void_p(made[key]))

    def _drop_lane_ring(self, refuse: bool = False) -> None:
        """The ring's DMAs finish, its streams and memory go (before the primary context goes, or for a
        ring of other lanes or larger chunks); `refuse`: its plan failed, no ring again."""
        self._lane_receive_join()
        ring, self._lane_ring = self._lane_ring, None
        self._lane_ring_refused = self._lane_ring_refused or refuse
        if ring is None:
            return
        ring.lanes.ring_release(ring.handle)
        self._free_ring_parts({"streams": ring.streams, "base": ring.base, "words": ring.words})
        destroy_event = self._late_fn("cuEventDestroy_v2", [c_void_p])
        for event in [*ring.events, ring.order]:   # a ring of other lanes may follow in this context
            destroy_event(event)
        ring.lanes.ring_free(ring.handle)

    def _idle_landing(self, size: int) -> LaneLanding | None:
        """A landing of at least `size` bytes whose last DMA has run (two at most, so a copy may land
        while the previous one's DMA still waits behind the application's work), or None."""
        for landing in list(self._lane_landings):
            if landing.used and self._call("cuEventQuery", landing.event) != SUCCESS:
                continue
            if landing.size >= size:
                return landing
            self._lane_landings.remove(landing)   # idle and too small: make room for a larger one
            self._call("cuMemFreeHost", landing.address)
        if len(self._lane_landings) >= 2:
            return None
        rounded = -(-size // (1 << 20)) << 20
        landing = LaneLanding(self._host_alloc(rounded), rounded, self._new_event())
        self._lane_landings.append(landing)
        return landing

    def _drop_lane_landings(self) -> None:
        """Before the primary context goes (or is reset): the landings' and the ring's DMAs finish, their
        memory goes."""
        self._lane_receive_join()
        self._drop_lane_ring()
        for landing in self._lane_landings:
            if landing.used:
                self._call("cuEventSynchronize", landing.event)
            self._call("cuMemFreeHost", landing.address)
        self._lane_landings.clear()

    def _lane_side(self) -> LaneSide:
        side = self._lane_sides.get(self._current)
        if side is None:
            stream, word, word_device = c_void_p(), c_void_p(), c_uint64()
            self._check("cuStreamCreateWithPriority", byref(stream), STREAM_NON_BLOCKING, 0)
            self._check("cuMemHostAlloc", byref(word), 64, MEMHOSTALLOC_PORTABLE | MEMHOSTALLOC_DEVICEMAP)
            get_device_pointer = self._late_fn("cuMemHostGetDevicePointer_v2",
                                               [ctypes.POINTER(c_uint64), c_void_p, c_uint])
            if (r := get_device_pointer(byref(word_device), word, 0)) != SUCCESS:
                self._call("cuMemFreeHost", word)
                raise CudaError(r)
            ctypes.c_uint32.from_address(word.value or 0).value = 0
            side = LaneSide(stream.value or 0, self._new_event(), word.value or 0, word_device.value)
            # Once per context: a wait that is already met and a write, then a synchronisation: a
            # driver that refuses stream memory operations, at once or (a driver that forwards
            # calls, as rgpu's own does) at the synchronisation, leaves copies to the loop.
            side.refused = (self._fn_cuStreamWaitValue32_v2(side.stream, side.word_device, 0,  # type: ignore[attr-defined]
                                                            STREAM_WAIT_VALUE_GEQ) != SUCCESS
                            or self._fn_cuStreamWriteValue32_v2(side.stream, side.word_device, 0, 0) != SUCCESS  # type: ignore[attr-defined]
                            or self._call("cuStreamSynchronize", side.stream) != SUCCESS)
            self._lane_sides[self._current] = side
        return side

    def _lane_receive_join(self) -> None:
        receive, self._lane_receive = self._lane_receive, None
        if receive is not None and (error := receive.join()) is not None and self._lane_receive_unreported is None:
            self._lane_receive_unreported = error

    def lane_receive_settle(self, wait: bool) -> tuple[bool, CudaError | None]:
        """(whether a copy is still received in the background, the error of one that ended and was
        not reported yet); `wait`: wait for it first."""
        receive = self._lane_receive
        if receive is not None and (wait or receive.done.is_set()):
            self._lane_receive_join()
        error, self._lane_receive_unreported = self._lane_receive_unreported, None
        return self._lane_receive is not None, error

    def dtoh_lanes(self, src: int, stream: int, size: int, chunk: int, lanes: Any) -> Any:
        """The staging of a striped device-to-host copy, for lanes.send (lanes.c queues each chunk's copy
        into a free slot and sends it once its event completes); a CudaError before anything is sent."""
        self._lane_receive_join()
        self._refuse_capture(stream, "cuMemcpyDtoHAsync")
        return self._lane_copy(lanes, chunk, src, stream)

    def _lane_copy(self, lanes: Any, chunk: int, dst: int, stream: int) -> Any:
        if self._lane_staging and (chunk > self._lane_chunk or lanes is not self._lanes):
            self._drop_lane_staging()
        if not self._lane_staging:
            slots = staging_slots(self._lane_slots, chunk)   # events: self._lane_slots, at least as many
            self._lane_base = self._with_primary(lambda: self._host_alloc(slots * chunk))
            self._lanes, self._lane_chunk = lanes, chunk
            self._lane_staging = lanes.staging_new(self._lane_base, slots, chunk)
        events = self._lane_events.get(self._current)
        if events is None:
            events = (c_void_p * self._lane_slots)(*[self._new_event().value for _ in range(self._lane_slots)])
            self._lane_events[self._current] = events
        return lanes.gpu_copy(memcpy_htod=self._entry("cuMemcpyHtoDAsync_v2"), event_record=self._entry("cuEventRecord"),
                              event_sync=self._entry("cuEventSynchronize"), stream=stream, dst=dst,
                              events=ctypes.addressof(events), staging=self._lane_staging,
                              memcpy_dtoh=self._entry("cuMemcpyDtoHAsync_v2"))

    def _drop_lane_staging(self) -> None:
        self._lane_receive_join()
        if self._lane_staging:
            self._lanes.staging_drain(self._lane_staging, self._entry("cuEventSynchronize"))
            self._lanes.staging_free(self._lane_staging)
            self._call("cuMemFreeHost", self._lane_base)
        self._lane_staging, self._lane_base, self._lane_chunk = 0, 0, 0

    def _forget_lane_events(self, ctx: int) -> None:
        """Before a context goes: the slots' copies finish (their events may be its own)."""
        self._lane_receive_join()
        if ctx == (self.primary.value or 0):
            self._drop_lane_landings()
        self._lane_sides.pop(ctx, None)   # its stream, event and word go with the context
        if self._lane_events.pop(ctx, None) is not None and self._lane_staging:
            self._lanes.staging_drain(self._lane_staging, self._entry("cuEventSynchronize"))

    def dtoh_chunks(self, src: int, stream: int, size: int, chunk: int) -> Iterator[memoryview]:
        """Device-to-host through two pinned buffers: copy chunk i+1 while chunk i is sent."""
        self._refuse_capture(stream, "cuMemcpyDtoHAsync")
        if not self._dtoh:
            self._make_staging()
        events = self._context_events()[1]
        chunk = DTOH_CHUNK
        offsets = list(range(0, size, chunk)) or [0]

        def issue(i: int) -> None:
            off = offsets[i]
            n = min(chunk, size - off)
            address, event = self._dtoh[i % 2], events[i % 2]
            if n:
                self._check("cuMemcpyDtoHAsync_v2", address, src + off, n, stream or None)
            self._check("cuEventRecord", event, stream or None)

        issue(0)
        for i, off in enumerate(offsets):
            if i + 1 < len(offsets):
                issue(i + 1)
            address, event = self._dtoh[i % 2], events[i % 2]
            self._check("cuEventSynchronize", event)
            n = min(chunk, size - off)
            if n:
                yield memoryview((ctypes.c_char * n).from_address(address)).cast("B")

    def dtod_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
        p = CUDA_MEMCPY2D(srcMemoryType=2, srcDevice=src, srcPitch=spitch, dstMemoryType=2, dstDevice=dst,
                          dstPitch=dpitch, WidthInBytes=width, Height=height)
        self._check("cuMemcpy2DAsync_v2", byref(p), stream or None)
