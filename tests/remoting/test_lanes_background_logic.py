"""The real-GPU backend's background receive of striped copies (RGPU_LANES_BACKGROUND=1), its logic
tested without a GPU: a FAKE driver (Python functions recording each call and the thread that made
it) stands in for libcuda, which CI machines lack, and a fake lanes object writes the copy's bytes.
The real path runs in tests/remoting/test_gpu_lanes.py on a GPU machine.

What must hold: the receiving thread makes no driver call (a driver call there waits behind a loop
call that synchronises the context, which waits for the copy: four cuda-samples hung so); the GPU's
work is queued by the loop in stream order; the word the side stream waits for is stored after the
bytes land, and also when the lanes fail; a landing is written again only once its DMA has run."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import pytest
from rgpu.remoting.datapath.backends.base import SUCCESS, UNKNOWN, CudaError
from rgpu.remoting.datapath.backends.cuda_copies import CudaCopies

NOT_READY = 600
PRIMARY = 0x7000
APP_STREAM = 0x5100


def _out(arg: Any) -> Any:
    """The ctypes object behind a byref() argument."""
    return arg._obj


class FakeDriver:
    """FAKE libcuda: records (name, thread name, args); page-locked allocations are real memory."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[Any, ...]]] = []
        self.buffers: list[Any] = []
        self.busy_events: set[int] = set()      # events cuEventQuery answers NOT_READY for
        self.busy_streams: set[int] = {APP_STREAM}   # streams cuStreamQuery answers NOT_READY for
        self.refuse: set[str] = set()
        self._next = 0x100

    def handle(self) -> int:
        self._next += 0x10
        return self._next

    def fn(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append((name, threading.current_thread().name, args))
            if name in self.refuse:
                return 1
            if name == "cuMemHostAlloc":
                buf = ctypes.create_string_buffer(args[1])
                self.buffers.append(buf)
                _out(args[0]).value = ctypes.addressof(buf)
            elif name == "cuMemHostGetDevicePointer_v2":
                _out(args[0]).value = _out(args[1]).value if hasattr(args[1], "_obj") else (args[1].value or 0)
            elif name in ("cuEventCreate", "cuStreamCreateWithPriority"):
                _out(args[0]).value = self.handle()
            elif name == "cuStreamQuery":
                return NOT_READY if args[0] in self.busy_streams else SUCCESS
            elif name == "cuEventQuery":
                event = args[0].value if isinstance(args[0], ctypes.c_void_p) else args[0]
                return NOT_READY if event in self.busy_events else SUCCESS
            return SUCCESS
        return call

    def names(self, thread: str | None = None) -> list[str]:
        return [n for n, t, _ in self.calls if thread is None or t == thread]


class FakeLanes:
    """FAKE lanes: `receive` writes the copy's bytes to the address (or fails), from whatever thread."""

    def __init__(self, payload: bytes, fail: bool = False) -> None:
        self.payload, self.fail = payload, fail
        self.threads: list[str] = []
        self.release = threading.Event()
        self.release.set()

    def receive(self, seq: int, size: int, chunk: int, address: int, gpu: Any = None) -> int:
        self.threads.append(threading.current_thread().name)
        self.release.wait(10)
        if self.fail:
            raise CudaError(UNKNOWN, "rgpu: worker: a host-to-device copy over 3 data lanes failed (test)")
        assert address and gpu is None
        ctypes.memmove(address, self.payload, size)
        return 0


def backend(driver: FakeDriver) -> CudaCopies:
    b = CudaCopies.__new__(CudaCopies)
    names = ["cuStreamCreateWithPriority", "cuMemHostAlloc", "cuMemFreeHost", "cuEventCreate", "cuEventRecord",
             "cuEventQuery", "cuEventSynchronize", "cuStreamSynchronize", "cuMemcpyHtoDAsync_v2",
             "cuMemHostGetDevicePointer_v2", "cuStreamDestroy_v2", "cuEventDestroy_v2"]
    b.f = {n: driver.fn(n) for n in names}
    b._fn_cuStreamWaitValue32_v2 = driver.fn("cuStreamWaitValue32_v2")   # type: ignore[attr-defined]
    b._fn_cuStreamWriteValue32_v2 = driver.fn("cuStreamWriteValue32_v2")   # type: ignore[attr-defined]
    b._fn_cuStreamWaitEvent = driver.fn("cuStreamWaitEvent")   # type: ignore[attr-defined]
    b._fn_cuStreamQuery = driver.fn("cuStreamQuery")   # type: ignore[attr-defined]
    b._entry = lambda name: 0x1000 + len(name)   # type: ignore[method-assign]  # the ring's entry points: FakeLanes ignores them
    b._late_fn = lambda name, argtypes: b.f[name]   # type: ignore[method-assign]
    b.primary = ctypes.c_void_p(PRIMARY)
    b._current = PRIMARY
    b._captures = 0
    b._lane_receive = None
    b._lane_receive_unreported = None
    b._lane_sides = {}
    b._lane_landings = []
    b._lane_ring = None
    b._lane_ring_refused = False
    b.lane_ring_copies = 0
    return b


@pytest.fixture(autouse=True)
def _asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGPU_LANES_BACKGROUND", "1")


def _word(b: CudaCopies) -> int:
    side = b._lane_sides[PRIMARY]
    return ctypes.c_uint32.from_address(side.word).value


def test_the_receiving_thread_makes_no_driver_call_and_stores_the_word_after_the_bytes() -> None:
    driver, lanes = FakeDriver(), FakeLanes(b"\x5a" * 4096)
    b = backend(driver)
    lanes.release.clear()
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 1024, 7, lanes) is True
    queued = driver.names()
    # In stream order, queued by the loop: the side stream after the application's work, waiting
    # for the word, then the DMA from the landing, whose event the application's stream waits for.
    tail = queued[queued.index("cuStreamSynchronize") + 1:]   # after the side stream's one-time probe
    assert tail[:2] == ["cuMemHostAlloc", "cuEventCreate"]     # the landing
    assert tail[2:] == ["cuEventRecord", "cuStreamWaitEvent", "cuStreamWaitValue32_v2", "cuMemcpyHtoDAsync_v2",
                        "cuEventRecord", "cuStreamWaitEvent"]
    assert _word(b) == 0          # the bytes have not landed: the side stream still waits
    lanes.release.set()
    live, error = b.lane_receive_settle(wait=True)
    assert (live, error) == (False, None)
    assert _word(b) == 1
    landing = b._lane_landings[0]
    assert ctypes.string_at(landing.address, 4096) == b"\x5a" * 4096
    assert lanes.threads == ["rgpu-lane-receive"]
    assert driver.names("rgpu-lane-receive") == []


def test_a_failed_receive_still_releases_the_side_stream_and_answers_the_next_synchronisation() -> None:
    driver, lanes = FakeDriver(), FakeLanes(b"", fail=True)
    b = backend(driver)
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 1024, 7, lanes) is True
    live, error = b.lane_receive_settle(wait=True)
    assert not live and error is not None and "data lanes failed" in (error.message or "")
    assert _word(b) == 1
    assert driver.names("rgpu-lane-receive") == []


def test_a_landing_is_reused_only_once_its_dma_ran_and_two_busy_ones_leave_the_copy_to_the_loop() -> None:
    driver = FakeDriver()
    b = backend(driver)
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 1024, 1, FakeLanes(b"\x01" * 4096))
    b.lane_receive_settle(wait=True)
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 1024, 2, FakeLanes(b"\x01" * 4096))
    b.lane_receive_settle(wait=True)
    assert len(b._lane_landings) == 1           # its DMA ran: the one landing served again
    driver.busy_events = {b._lane_landings[0].event.value}
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 1024, 2, FakeLanes(b"\x01" * 4096))
    b.lane_receive_settle(wait=True)
    assert len(b._lane_landings) == 2           # the first still busy: a second one
    driver.busy_events = {landing.event.value for landing in b._lane_landings}
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 1024, 3, FakeLanes(b"\x02" * 4096)) is False
    driver.busy_events = {b._lane_landings[0].event.value}
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 1024, 3, FakeLanes(b"\x03" * 4096)) is True
    b.lane_receive_settle(wait=True)
    assert ctypes.string_at(b._lane_landings[1].address, 4096) == b"\x03" * 4096
    assert _word(b) == 4


def test_a_larger_copy_replaces_an_idle_landing_that_is_too_small() -> None:
    driver = FakeDriver()
    b = backend(driver)
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 1024, 1, FakeLanes(b"\x01" * 4096))
    b.lane_receive_settle(wait=True)
    small = b._lane_landings[0].address
    big = 3 << 20
    assert b.htod_lanes_background(0xD000, APP_STREAM, big, 1 << 20, 2, FakeLanes(b"\x07" * big))
    b.lane_receive_settle(wait=True)
    assert [landing.size for landing in b._lane_landings] == [3 << 20]
    assert ("cuMemFreeHost", "MainThread", (small,)) in driver.calls


def test_a_dma_the_driver_refuses_releases_the_word_and_leaves_the_copy_to_the_loop() -> None:
    driver = FakeDriver()
    b = backend(driver)
    driver.refuse = {"cuMemcpyHtoDAsync_v2"}
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 1024, 1, FakeLanes(b"\x01" * 4096)) is False
    assert _word(b) == 1                                   # the side stream does not wait for ever
    assert driver.names()[-1] == "cuStreamSynchronize"     # and ran before the loop's receive queues again
    assert b._lane_receive is None


@pytest.mark.parametrize("why", ["not asked", "another context", "too large", "capture"])
def test_the_loop_receives_the_copy_when_the_background_cannot_take_it(monkeypatch: pytest.MonkeyPatch,
                                                                        why: str) -> None:
    driver = FakeDriver()
    b = backend(driver)
    size = 4096
    if why == "not asked":
        monkeypatch.setenv("RGPU_LANES_BACKGROUND", "0")
    elif why == "another context":
        b._current = PRIMARY + 0x100
    elif why == "too large":
        size = (256 << 20) + 1
    else:
        b._captures = 1
    assert b.htod_lanes_background(0xD000, APP_STREAM, size, 1024, 1, FakeLanes(b"")) is False
    assert "cuStreamWaitValue32_v2" not in driver.names() and b._lane_receive is None


# ---- the landing ring, for a copy onto a stream with nothing queued (lanes.h; its C side: test_lane_ring.py) ----

class FakeRingLanes(FakeLanes):
    """FAKE lanes with a landing ring: records each ring call and the thread that made it."""

    RING_WORDS_BYTES = 2048
    count = 3

    def __init__(self, payload: bytes = b"", fail: bool = False, plan_error: int = 0) -> None:
        super().__init__(payload, fail)
        self.plan_error = plan_error
        self.ring_calls: list[tuple[str, str]] = []

    def _note(self, name: str) -> None:
        self.ring_calls.append((name, threading.current_thread().name))

    def ring_new(self, base: int, slots: int, slot_bytes: int, words: int, words_device: int, streams: list[int],
                 events: list[int]) -> int:
        self._note("ring_new")
        assert base and words and len(streams) == len(events) == self.count
        return 0xABC

    @staticmethod
    def ring_driver(*entries: int) -> tuple[int, ...]:
        return entries

    def ring_begin(self, ring: int) -> None:
        self._note("ring_begin")

    def ring_plan(self, ring: int, driver: Any, size: int, chunk: int, dst: int, stream: int, order: int) -> int:
        deadline = time.monotonic() + 5   # a long plan waits for the GPU, which waits for the bytes
        while ("receive_ring", "rgpu-lane-receive") not in self.ring_calls and time.monotonic() < deadline:
            time.sleep(0.001)
        self._note("ring_plan")
        return self.plan_error

    def ring_abandon(self, ring: int) -> None:
        self._note("ring_abandon")

    def receive_ring(self, seq: int, size: int, chunk: int, ring: int) -> int:
        self._note("receive_ring")
        self.release.wait(10)
        if self.fail:
            raise CudaError(UNKNOWN, "rgpu: worker: a host-to-device copy over 3 data lanes failed (test)")
        return 0

    def ring_release(self, ring: int) -> None:
        self._note("ring_release")

    def ring_free(self, ring: int) -> None:
        self._note("ring_free")


def test_a_copy_onto_an_idle_stream_goes_through_the_ring_and_its_thread_calls_no_driver() -> None:
    driver, lanes = FakeDriver(), FakeRingLanes()
    driver.busy_streams = set()
    b = backend(driver)
    lanes.release.clear()
    assert b.htod_lanes_background(0xD000, APP_STREAM, 300 << 20, 2 << 20, 7, lanes) is True   # 50 chunks a lane
    # The thread receives before the plan is queued, and releases the ring once both have ended.
    assert lanes.ring_calls == [("ring_new", "MainThread"), ("ring_begin", "MainThread"),
                                ("receive_ring", "rgpu-lane-receive"), ("ring_plan", "MainThread")]
    assert b._lane_landings == [] and b.lane_ring_copies == 1
    lanes.release.set()
    assert b.lane_receive_settle(wait=True) == (False, None)
    assert lanes.ring_calls[4:] == [("ring_release", "rgpu-lane-receive")]
    assert driver.names("rgpu-lane-receive") == []
    # The next copy reuses the ring; the primary context's end drops it: streams waited for and destroyed.
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 2 << 20, 8, lanes) is True
    b.lane_receive_settle(wait=True)
    assert [c for c, _ in lanes.ring_calls].count("ring_new") == 1
    b._drop_lane_landings()
    assert lanes.ring_calls[-2:] == [("ring_release", "MainThread"), ("ring_free", "MainThread")]
    assert driver.names().count("cuStreamDestroy_v2") == 3 and b._lane_ring is None
    assert driver.names().count("cuEventDestroy_v2") == 4   # each lane's and the order's


def test_a_failed_ring_receive_is_reported_before_the_ring_lets_the_application_stream_go_on() -> None:
    driver, lanes = FakeDriver(), FakeRingLanes(fail=True)
    driver.busy_streams = set()
    b = backend(driver)
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 2 << 20, 7, lanes) is True
    live, error = b.lane_receive_settle(wait=True)
    assert not live and error is not None and "data lanes failed" in (error.message or "")
    assert lanes.ring_calls[-1] == ("ring_release", "rgpu-lane-receive")


def test_a_plan_the_driver_refuses_fails_its_copy_and_drops_the_ring_for_good() -> None:
    driver, lanes = FakeDriver(), FakeRingLanes(b"\x07" * 4096, plan_error=700)
    driver.busy_streams = set()
    b = backend(driver)
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 1024, 7, lanes) is True
    live, error = b.lane_receive_settle(wait=True)
    assert not live and error is not None and error.code == 700   # the bytes were taken: the copy fails
    assert [c for c, _ in lanes.ring_calls] == ["ring_new", "ring_begin", "receive_ring", "ring_plan", "ring_abandon",
                                                "ring_release", "ring_release", "ring_free"]
    assert b._lane_ring is None and b._lane_ring_refused and b._lane_landings == []
    lanes.plan_error = 0
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 1024, 8, lanes) is True
    assert b.lane_receive_settle(wait=True) == (False, None)
    assert "ring_new" not in [c for c, _ in lanes.ring_calls[8:]]   # no ring again: the landing takes it
    assert ctypes.string_at(b._lane_landings[0].address, 4096) == b"\x07" * 4096


@pytest.mark.parametrize("why", ["work queued", "RGPU_LANE_RING_SLOTS=0"])
def test_a_copy_behind_queued_work_or_with_the_ring_off_lands_whole(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    driver, lanes = FakeDriver(), FakeRingLanes(b"\x03" * 4096)
    if why != "work queued":
        driver.busy_streams = set()
    if why == "RGPU_LANE_RING_SLOTS=0":
        monkeypatch.setenv("RGPU_LANE_RING_SLOTS", "0")
    b = backend(driver)
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 1024, 7, lanes) is True
    b.lane_receive_settle(wait=True)
    assert lanes.ring_calls == [] and len(b._lane_landings) == 1


@pytest.mark.parametrize(("text", "slots"), [("", 2), ("0", 0), ("1", 2), ("4", 4), ("99", 16), ("x", 2)])
def test_ring_slots_come_from_the_environment_within_bounds(monkeypatch: pytest.MonkeyPatch, text: str,
                                                            slots: int) -> None:
    from rgpu.remoting.datapath.backends.cuda_copies import lane_ring_slots
    monkeypatch.setenv("RGPU_LANE_RING_SLOTS", text)
    assert lane_ring_slots() == slots


# --- the page-locked memory a client's chunk size makes the worker hold (its chunk is up to 64 MiB) ---

def test_chunks_larger_than_the_rings_slots_land_whole_and_smaller_ones_still_take_the_ring() -> None:
    driver, lanes = FakeDriver(), FakeRingLanes(b"\x05" * (16 << 20))
    driver.busy_streams = set()
    b = backend(driver)
    assert b.htod_lanes_background(0xD000, APP_STREAM, 16 << 20, 8 << 20, 7, lanes) is True   # 8 MiB chunks
    assert b.lane_receive_settle(wait=True) == (False, None)
    assert lanes.ring_calls == [] and len(b._lane_landings) == 1 and not b._lane_ring_refused
    assert ctypes.string_at(b._lane_landings[0].address, 16 << 20) == b"\x05" * (16 << 20)
    pinned = [args[1] for name, _, args in driver.calls if name == "cuMemHostAlloc" and args[1] >= 1 << 20]
    assert pinned == [16 << 20]   # the landing alone (and its side's word), no ring of 3 lanes x 2 x 8 MiB
    assert b.htod_lanes_background(0xD000, APP_STREAM, 4096, 4 << 20, 8, lanes) is True   # 4 MiB chunks: the ring
    assert b.lane_receive_settle(wait=True) == (False, None)
    assert [c for c, _ in lanes.ring_calls][:1] == ["ring_new"]
    assert (3 * 2 * (4 << 20)) in [args[1] for name, _, args in driver.calls if name == "cuMemHostAlloc"]


@pytest.mark.parametrize(("configured", "chunk", "slots"), [
    (16, 2 << 20, 16), (16, 64 << 10, 16), (16, 8 << 20, 4), (16, 64 << 20, 2), (64, 2 << 20, 64),
    (64, 16 << 20, 8), (2, 64 << 20, 2), (16, 3 << 20, 10)])
def test_the_staging_holds_what_its_configured_slots_hold_at_the_default_chunk(configured: int, chunk: int,
                                                                                slots: int) -> None:
    from rgpu.remoting.datapath.backends.cuda_driver import staging_slots
    assert staging_slots(configured, chunk) == slots


class FakeStagingLanes:
    """FAKE lanes for the staging of striped copies: records what staging_new was given."""

    def __init__(self) -> None:
        self.staging: list[tuple[int, int]] = []

    def staging_new(self, base: int, count: int, slot_bytes: int) -> int:
        assert base
        self.staging.append((count, slot_bytes))
        return 0xBEEF

    def gpu_copy(self, **fields: Any) -> dict[str, Any]:
        return fields


def test_a_clients_64_mib_chunks_get_two_staging_slots_not_sixteen() -> None:
    driver, lanes = FakeDriver(), FakeStagingLanes()
    b = backend(driver)
    b._lane_slots, b._lane_staging, b._lanes, b._lane_chunk, b._lane_base, b._lane_events = 16, 0, None, 0, 0, {}
    b._with_primary = lambda fn: fn()   # type: ignore[method-assign]
    b._new_event = lambda: ctypes.c_void_p(driver.handle())   # type: ignore[method-assign]
    b._lane_copy(lanes, 16 << 20, 0xD000, APP_STREAM)
    assert lanes.staging == [(2, 16 << 20)]
    assert [args[1] for name, _, args in driver.calls if name == "cuMemHostAlloc"] == [32 << 20]   # not 256 MiB
