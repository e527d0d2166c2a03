"""The landing ring of striped host-to-device copies (lanes.h, rgpu_lanes_ring_*): lanes.c's receiving
threads fill each lane's few page-locked slots while the GPU copies out of them, with no driver call
on those threads. Real sockets carry the chunks; a FAKE GPU (CI machines have none) runs the work the
plan queued per stream, in order, as a GPU's stream would: a wait for a word holds its stream, a DMA
copies host bytes, a write stores a word. The real path runs in tests/remoting/test_gpu_lanes.py."""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import Any

import pytest
from rgpu.remoting.datapath.backends.base import CudaError
from rgpu.remoting.datapath.worker.lanes import Lanes
from rgpu.remoting.native import build

from .lanes_helpers import MiB, send_striped

WAIT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
MEMCPY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
RECORD_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
WAIT_EVENT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)

APP_STREAM, ORDER = 0x5100, 0x7100
CHUNK = 64 << 10


def _streams(n: int) -> list[int]:
    return [0x6000 + 0x10 * lane for lane in range(n)]


def _events(n: int) -> list[int]:
    return [0x7000 + 0x10 * lane for lane in range(n)]


class FakeGpu:
    """FAKE GPU: the plan's five driver entry points queue work per stream (recording the calling
    thread); `start` runs the queues on a thread of its own, each stream in order. `dma_delay_s`
    slows each DMA (a GPU behind the network); `fail_dma_at`: the DMA to that device offset is refused;
    `queue_limit`: at most that many operations wait in all queues together, more wait for the GPU to
    run some (a driver's push buffer, which blocks the thread that queues)."""

    def __init__(self, dma_delay_s: float = 0.0, fail_dma_at: int = -1, queue_limit: int = 0) -> None:
        self.queues: dict[int, deque[tuple[Any, ...]]] = defaultdict(deque)
        self.lock = threading.Lock()
        self.callers: set[str] = set()
        self.recorded: dict[int, int] = defaultdict(int)   # event -> records queued
        self.reached: dict[int, int] = defaultdict(int)    # event -> records run
        self.dma_delay_s, self.fail_dma_at = dma_delay_s, fail_dma_at
        self.dmas = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

        def queue(stream: int | None, *op: Any) -> int:
            self.callers.add(threading.current_thread().name)
            while True:
                with self.lock:
                    if not queue_limit or sum(map(len, self.queues.values())) < queue_limit:
                        self.queues[stream or 0].append(op)
                        return 0
                time.sleep(0.0002)

        def memcpy(dst: int, src: int, n: int, stream: int | None) -> int:
            return 1 if dst == self.fail_dma_at else queue(stream, "dma", dst, src, n)

        def record(event: int, stream: int | None) -> int:
            with self.lock:
                self.recorded[event] += 1
                gen = self.recorded[event]
            return queue(stream, "record", event, gen)

        def wait_event(stream: int | None, event: int, flags: int) -> int:
            return queue(stream, "wait_event", event, self.recorded[event])

        self.callbacks = (WAIT_FN(lambda s, addr, value, flags: queue(s, "wait", addr, value)),
                          WAIT_FN(lambda s, addr, value, flags: queue(s, "write", addr, value)),
                          MEMCPY_FN(memcpy), RECORD_FN(record), WAIT_EVENT_FN(wait_event))

    def entries(self) -> list[int]:
        return [int(ctypes.cast(c, ctypes.c_void_p).value or 0) for c in self.callbacks]

    def _step(self) -> bool:
        progress = False
        with self.lock:
            streams = list(self.queues.items())
        for _, q in streams:
            while q:
                op = q[0]
                if op[0] == "wait":   # CU_STREAM_WAIT_VALUE_GEQ: a cyclic comparison
                    if (ctypes.c_uint32.from_address(op[1]).value - op[2]) & 0xFFFFFFFF >= 0x80000000:
                        break
                elif op[0] == "wait_event":
                    if self.reached[op[1]] < op[2]:
                        break
                elif op[0] == "dma":
                    time.sleep(self.dma_delay_s)
                    ctypes.memmove(op[1], op[2], op[3])
                    self.dmas += 1
                elif op[0] == "write":
                    ctypes.c_uint32.from_address(op[1]).value = op[2]
                elif op[0] == "record":
                    self.reached[op[1]] = max(self.reached[op[1]], op[2])
                with self.lock:
                    q.popleft()
                progress = True
        return progress

    def start(self) -> None:
        def run() -> None:
            while not self._stop.is_set():
                if not self._step():
                    time.sleep(0.0002)
        self._thread = threading.Thread(target=run, name="fake-gpu", daemon=True)
        self._thread.start()

    def idle(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if not any(self.queues.values()):
                    return True
            time.sleep(0.001)
        return False

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class Ring:
    """A ring over `lanes` socket pairs (the worker's ends in `lanes`), its memory and its fake GPU."""

    def __init__(self, libs: build.Libraries, lanes: int, slots: int, gpu: FakeGpu, stall_s: float = 10) -> None:
        self.pairs = [socket.socketpair() for _ in range(lanes)]
        self.lanes = Lanes(str(libs.libworker), [a for a, _ in self.pairs], stall_s=stall_s)
        self.slots_memory = ctypes.create_string_buffer(lanes * slots * CHUNK)
        self.words = ctypes.create_string_buffer(Lanes.RING_WORDS_BYTES)
        words = ctypes.addressof(self.words)   # the fake GPU addresses host memory as the host does
        self.handle = self.lanes.ring_new(ctypes.addressof(self.slots_memory), slots, CHUNK, words, words,
                                          _streams(lanes), _events(lanes))
        self.gpu = gpu
        self.driver = Lanes.ring_driver(*gpu.entries())

    def word(self, which: str, lane: int) -> int:
        index = lane if which == "landed" else 16 + lane
        return ctypes.c_uint32.from_address(ctypes.addressof(self.words) + 64 * index).value

    def senders(self, seq: int, data: bytes, **kw: Any) -> list[threading.Thread]:
        return send_striped([b for _, b in self.pairs], seq, data, CHUNK, **kw)

    def close(self) -> None:
        self.gpu.stop()
        self.lanes.ring_free(self.handle)
        self.lanes.close()
        for _, b in self.pairs:
            b.close()


@pytest.fixture
def ring_of(native_libs: build.Libraries) -> Iterator[Any]:
    made: list[Ring] = []

    def make(lanes: int = 3, slots: int = 2, gpu: FakeGpu | None = None, stall_s: float = 10) -> Ring:
        made.append(Ring(native_libs, lanes, slots, gpu or FakeGpu(), stall_s))
        return made[-1]
    yield make
    for r in made:
        r.close()


def test_copies_land_whole_through_two_slots_a_lane_while_the_gpu_lags(ring_of: Any) -> None:
    r = ring_of(gpu=FakeGpu(dma_delay_s=0.0005))
    r.gpu.start()
    size = 3 * MiB + 4097   # 49 chunks: each lane's two slots are filled 8 times over
    device = ctypes.create_string_buffer(size)
    for seq in (7, 8):      # twice: the running counts carry on from the first copy
        data = os.urandom(size)
        senders = r.senders(seq, data)
        r.lanes.ring_begin(r.handle)
        assert r.lanes.ring_plan(r.handle, r.driver, size, CHUNK, ctypes.addressof(device), APP_STREAM, ORDER) == 0
        assert r.lanes.receive_ring(seq, size, CHUNK, r.handle) == 0
        r.lanes.ring_release(r.handle)
        for t in senders:
            t.join()
        assert r.gpu.idle()
        assert device.raw == data   # a slot written again before its DMA ran would show here
    chunks = -(-size // CHUNK)
    assert r.gpu.dmas == 2 * chunks
    assert [r.word("landed", lane) for lane in range(3)] == [r.word("done", lane) for lane in range(3)] == \
        [2 * len(range(lane, chunks, 3)) for lane in range(3)]
    # Only the plan (this thread) called the driver: the lane threads stored words and nothing else.
    assert r.gpu.callers == {"MainThread"}


def test_a_plan_longer_than_the_drivers_queue_ends_once_the_copy_is_received_meanwhile(ring_of: Any) -> None:
    # A driver queue of 12 operations: the plan of 49 chunks (3 operations each) waits for the GPU,
    # which waits for the bytes. The worker starts the receive first (cuda_copies.py _ring_receive);
    # here the plan starts first and is seen waiting, then the receive lets both end.
    r = ring_of(gpu=FakeGpu(queue_limit=12))
    r.gpu.start()
    size = 3 * MiB + 4097
    device = ctypes.create_string_buffer(size)
    data = os.urandom(size)
    senders = r.senders(4, data)
    r.lanes.ring_begin(r.handle)
    planned: list[int] = []
    plan = threading.Thread(target=lambda: planned.append(
        r.lanes.ring_plan(r.handle, r.driver, size, CHUNK, ctypes.addressof(device), APP_STREAM, ORDER)))
    plan.start()
    plan.join(0.5)
    assert plan.is_alive()   # the queue is full of waits for bytes nobody receives yet
    assert r.lanes.receive_ring(4, size, CHUNK, r.handle) == 0
    plan.join(10)
    assert planned == [0]
    r.lanes.ring_release(r.handle)
    for t in senders:
        t.join()
    assert r.gpu.idle()
    assert device.raw == data


def test_the_applications_stream_waits_for_every_lane_and_the_lanes_for_it(ring_of: Any) -> None:
    r = ring_of(lanes=4)
    device = ctypes.create_string_buffer(2 * CHUNK)   # two chunks: two of the four lanes carry it
    r.lanes.ring_begin(r.handle)
    assert r.lanes.ring_plan(r.handle, r.driver, 2 * CHUNK, CHUNK, ctypes.addressof(device), APP_STREAM, ORDER) == 0
    app = list(r.gpu.queues[APP_STREAM])
    assert app == [("record", ORDER, 1), ("wait_event", _events(4)[0], 1), ("wait_event", _events(4)[1], 1)]
    for lane, stream in enumerate(_streams(4)[:2]):
        ops = [op[0] for op in r.gpu.queues[stream]]
        assert ops == ["wait_event", "wait", "dma", "write", "record"], (lane, ops)
    assert not r.gpu.queues[_streams(4)[2]]
    r.lanes.ring_release(r.handle)   # nothing was sent: release, and the fake GPU drains
    r.gpu.start()
    assert r.gpu.idle()


def test_a_chunk_the_sender_aborts_is_reported_and_its_dma_does_not_wait_for_ever(ring_of: Any) -> None:
    r = ring_of(gpu=FakeGpu())
    r.gpu.start()
    size = 20 * CHUNK
    device = ctypes.create_string_buffer(size)
    data = os.urandom(size)
    senders = r.senders(3, data, aborted={4: 700})
    r.lanes.ring_begin(r.handle)
    assert r.lanes.ring_plan(r.handle, r.driver, size, CHUNK, ctypes.addressof(device), APP_STREAM, ORDER) == 0
    assert r.lanes.receive_ring(3, size, CHUNK, r.handle) == 700
    r.lanes.ring_release(r.handle)
    for t in senders:
        t.join()
    assert r.gpu.idle()
    assert device.raw[:4 * CHUNK] == data[:4 * CHUNK] and device.raw[5 * CHUNK:] == data[5 * CHUNK:]


def test_a_lane_out_of_step_fails_the_copy_and_the_release_lets_every_queued_dma_run(ring_of: Any) -> None:
    r = ring_of(gpu=FakeGpu())
    r.gpu.start()
    size = 30 * CHUNK
    device = ctypes.create_string_buffer(size)
    senders = r.senders(5, os.urandom(size), bad_chunk=13)
    r.lanes.ring_begin(r.handle)
    assert r.lanes.ring_plan(r.handle, r.driver, size, CHUNK, ctypes.addressof(device), APP_STREAM, ORDER) == 0
    with pytest.raises(CudaError, match=r"over 3 data lanes failed \(data lane 1 sent frame .* where chunk 13 of copy 5"):
        r.lanes.receive_ring(5, size, CHUNK, r.handle)
    r.lanes.ring_release(r.handle)
    for t in senders:
        t.join()
    assert r.gpu.idle()   # every lane stream went on: nothing waits for a word that will not come
    assert r.gpu.dmas == 30
    assert not r.lanes.open


def test_a_gpu_that_copies_nothing_out_fails_the_copy_after_the_stall_time(ring_of: Any) -> None:
    r = ring_of(stall_s=0.5)   # the fake GPU never starts: a context that failed, a kernel that never ends
    size = 12 * CHUNK           # 4 chunks a lane, 2 slots: the third waits for the first one's DMA
    device = ctypes.create_string_buffer(size)
    senders = r.senders(9, os.urandom(size))
    r.lanes.ring_begin(r.handle)
    assert r.lanes.ring_plan(r.handle, r.driver, size, CHUNK, ctypes.addressof(device), APP_STREAM, ORDER) == 0
    started = time.monotonic()
    with pytest.raises(CudaError, match="the GPU copied nothing out of data lane [0-2]'s landing for 0.5 s"):
        r.lanes.receive_ring(9, size, CHUNK, r.handle)
    assert time.monotonic() - started < 5
    r.lanes.ring_release(r.handle)
    for t in senders:
        t.join(10)
        assert not t.is_alive()


def test_a_plan_the_driver_refuses_part_way_returns_its_error(ring_of: Any) -> None:
    r = ring_of(gpu=FakeGpu(fail_dma_at=-2))
    device = ctypes.create_string_buffer(8 * CHUNK)
    r.gpu.fail_dma_at = ctypes.addressof(device) + 5 * CHUNK
    r.lanes.ring_begin(r.handle)
    assert r.lanes.ring_plan(r.handle, r.driver, 8 * CHUNK, CHUNK, ctypes.addressof(device), APP_STREAM, ORDER) == 1
    r.lanes.ring_release(r.handle)   # what was queued finishes
    r.gpu.start()
    assert r.gpu.idle()
    assert r.gpu.dmas == 5


def test_a_plan_refused_while_its_copy_is_received_takes_every_byte_and_lets_queued_work_end(ring_of: Any) -> None:
    r = ring_of(gpu=FakeGpu(queue_limit=12))
    r.gpu.start()
    size = 30 * CHUNK
    device = ctypes.create_string_buffer(size)
    r.gpu.fail_dma_at = ctypes.addressof(device) + 17 * CHUNK
    senders = r.senders(6, os.urandom(size))
    r.lanes.ring_begin(r.handle)
    received: list[int] = []
    receive = threading.Thread(target=lambda: received.append(r.lanes.receive_ring(6, size, CHUNK, r.handle)))
    receive.start()
    assert r.lanes.ring_plan(r.handle, r.driver, size, CHUNK, ctypes.addressof(device), APP_STREAM, ORDER) == 1
    r.lanes.ring_abandon(r.handle)   # chunks past the refused one are never copied out: stop waiting for them
    receive.join(10)
    assert received == [0] and r.lanes.open   # every byte taken: the lanes are in step for the next copy
    r.lanes.ring_release(r.handle)
    for t in senders:
        t.join()
    assert r.gpu.idle()
    assert r.gpu.dmas == 17


def test_a_plan_without_a_begun_copy_is_refused(ring_of: Any) -> None:
    r = ring_of()
    device = ctypes.create_string_buffer(2 * CHUNK)
    r.lanes.ring_begin(r.handle)
    assert r.lanes.ring_plan(r.handle, r.driver, CHUNK, CHUNK, ctypes.addressof(device), APP_STREAM, ORDER) == 0
    assert r.lanes.ring_plan(r.handle, r.driver, CHUNK, CHUNK, ctypes.addressof(device), APP_STREAM, ORDER) == 1
    r.lanes.ring_release(r.handle)
    r.gpu.start()
    assert r.gpu.idle()


def test_a_chunk_larger_than_the_rings_slots_is_refused(ring_of: Any) -> None:
    r = ring_of()
    device = ctypes.create_string_buffer(4 * CHUNK)
    r.lanes.ring_begin(r.handle)
    assert r.lanes.ring_plan(r.handle, r.driver, 4 * CHUNK, 2 * CHUNK, ctypes.addressof(device), APP_STREAM, ORDER) == 1
    assert not any(r.gpu.queues.values())
