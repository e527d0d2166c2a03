"""Data lanes (protocol 12, issue 25 item 2): large host<->device copies striped over several TCP
connections of one session, against the emulated worker (and the real-GPU backend chained to it).
Copies of many sizes arrive byte for byte; lanes are opened at the handshake and each must prove it
belongs to its session; a lane cut mid-copy fails that copy and the session goes on; RGPU_LANES=1
and a worker without lanes keep the one connection."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import struct
import subprocess
import threading
from pathlib import Path

import pytest
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.worker.lanes import Lanes
from rgpu.remoting.dispatcher.lanes import LaneBook, parse_lane_offer, parse_lane_request
from rgpu.remoting.native import build

from .client_helpers import py_client
from .conftest import EMULATED_GPU, Server, driver_api_program, run_client, serving
from .lanes_helpers import (CHUNK, HERE, LANES, LANE_ENV, MiB, OP, SIZES, STRIPED, THRESHOLD, _striped, _sync,
                           send_striped)


def test_copies_of_every_size_arrive_whole_over_data_lanes(lane_copies: Path, native_libs: build.Libraries,
                                                           tmp_path: Path) -> None:
    with serving("emulated", [EMULATED_GPU]) as s:
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(lane_copies), *map(str, SIZES)],
                          timeout=300, RGPU_CLIENT_STATS=str(tmp_path / "p"), **LANE_ENV)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    assert f"transport tcp, {LANES} data lanes)" in done.stderr, done.stderr
    assert _striped(tmp_path / "p") == (STRIPED, STRIPED)


def test_lanes_1_keeps_the_one_connection(lane_copies: Path, native_libs: build.Libraries, tmp_path: Path) -> None:
    with serving("emulated", [EMULATED_GPU]) as s:
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(lane_copies), *map(str, SIZES)],
                          timeout=300, RGPU_CLIENT_STATS=str(tmp_path / "p"), **(LANE_ENV | {"RGPU_LANES": "1"}))
        sessions = s.server.status()
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    assert "; transport tcp)" in done.stderr, done.stderr
    assert _striped(tmp_path / "p") == (0, 0)
    assert sessions["refused"] == 0


def test_a_worker_that_cannot_drive_lanes_gives_none_and_copies_stay_on_one_connection(
        lane_copies: Path, native_libs: build.Libraries, tmp_path: Path) -> None:
    with serving("emulated", [EMULATED_GPU]) as s:
        s.server.ucx_library = s.server.launch_library = ""   # no librgpu-worker.so on this GPU node
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(lane_copies), str(3 * MiB + 1)],
                          timeout=300, RGPU_CLIENT_STATS=str(tmp_path / "p"), **LANE_ENV)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    assert f"copies stay on one connection (asked for {LANES} data lanes, the GPU server took 0" in done.stderr
    assert _striped(tmp_path / "p") == (0, 0)


def test_a_forked_child_copies_over_lanes_of_its_own(native_libs: build.Libraries, tmp_path: Path) -> None:
    # The parent's lane threads are kept between copies; a child forked after them has none of them.
    program = driver_api_program(native_libs, HERE / "lane_fork.c", tmp_path / "lane_fork")
    with serving("emulated", [EMULATED_GPU]) as s:
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(program), str(4 * MiB + 3)],
                          timeout=120, RGPU_CLIENT_STATS=str(tmp_path / "p"), **LANE_ENV)
    assert done.returncode == 0 and done.stdout.split() == ["CHILD", "OK", "OK"], done.stdout + done.stderr
    assert done.stderr.count(f"transport tcp, {LANES} data lanes)") == 2, done.stderr   # the parent's and the child's


def _receive_buffer(port: int, pid: int) -> int:
    """SO_RCVBUF as the kernel holds it (skmem rb) of process `pid`'s TCP socket on local `port`."""
    out = subprocess.run(["ss", "-tmpnH", "state", "established", f"sport = :{port}"], capture_output=True,
                         text=True, check=True).stdout
    for block in out.replace("\n\t", " ").splitlines():
        if f"pid={pid}," in block and "skmem:(" in block:
            return int(block.split(",rb")[1].split(",")[0])
    raise AssertionError(f"no socket of pid {pid} on port {port}: {out}")


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_the_dispatchers_socket_buffer_setting_reaches_its_workers() -> None:
    from .conftest import start_server
    server, address = start_server("emulated", [EMULATED_GPU], socket_buffer_bytes=96 << 10)
    try:
        sock, _ = protocol.handshake(address, Server(server, address, [EMULATED_GPU]).token())
        with sock:
            (worker,) = [s["pid"] for s in server.status()["sessions"]]
            # Linux keeps twice the size asked for (for its own bookkeeping); the default is 4 MiB.
            assert _receive_buffer(int(address.rsplit(":", 1)[1]), worker) == 2 * (96 << 10)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def lane_failure(native_libs: build.Libraries, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_api_program(native_libs, HERE / "lane_failure.c", tmp_path_factory.mktemp("fail") / "lane_failure")


def _cut_copy(native_libs: build.Libraries, lane_cut: Path, lane_failure: Path, mode: str,
              **cut: str) -> subprocess.CompletedProcess[str]:
    """lane_failure.c's `mode` against an emulated GPU, with lane_cut.c breaking the lane `cut` names."""
    with serving("emulated", [EMULATED_GPU]) as s:
        return run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(lane_failure), mode],
                          timeout=300, LD_PRELOAD=str(lane_cut), **cut, **LANE_ENV)


def test_a_lane_cut_mid_copy_fails_that_copy_and_the_session_goes_on(native_libs: build.Libraries, lane_cut: Path,
                                                                     lane_failure: Path) -> None:
    # The 5th chunk's send breaks: 4 chunks of the 16 MiB copy went, 252 did not.
    done = _cut_copy(native_libs, lane_cut, lane_failure, "htod", RGPU_TEST_CUT_SENDMSG="5")
    lines = done.stdout.split()
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr
    assert done.stdout.startswith("COPY 999\nSYNC 999\n"), done.stdout   # CUDA_ERROR_UNKNOWN, each end once
    assert "a host-to-device copy of 16777216 bytes to GPU server" in done.stderr, done.stderr
    assert "the session goes on, its later copies on its one connection" in done.stderr
    # The worker's side, reported by the synchronisation: what failed and that the session goes on.
    assert "rgpu: worker: a host-to-device copy of 16777216 bytes over 3 data lanes failed (data lane" in done.stderr
    assert "lost the session" not in done.stderr
    assert lines.count("OK") == 1


def test_a_copy_from_page_locked_memory_returns_before_its_lanes_finish_and_a_cut_answers_the_sync(
        native_libs: build.Libraries, lane_cut: Path, lane_failure: Path) -> None:
    """cuMemcpyHtoDAsync from page-locked memory returns once its lanes were given the bytes, as
    NVIDIA's does (the program queues its next work meanwhile; an input-fed ResNet-18's 38.5 MB batch
    held its launching thread for 2.5 ms a step, before): so a lane cut under it is an asynchronous
    error, answered by the next synchronisation, and the session goes on."""
    done = _cut_copy(native_libs, lane_cut, lane_failure, "htod-async", RGPU_TEST_CUT_SENDMSG="5")
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr
    assert done.stdout.startswith("COPY 0\nSYNC 999\n"), done.stdout
    assert "a host-to-device copy of 16777216 bytes to GPU server" in done.stderr, done.stderr
    assert "reported at the next synchronising call" in done.stderr, done.stderr
    assert "lost the session" not in done.stderr


def test_page_locked_memory_freed_or_copied_again_right_after_an_asynchronous_copy_arrives_whole(
        native_libs: build.Libraries, lane_cut: Path) -> None:
    """The copy's lanes still read the memory after cuMemcpyHtoDAsync returned: freeing it (which
    NVIDIA's cuMemFreeHost may do at once) and starting the next striped copy wait for them first."""
    with serving("emulated", [EMULATED_GPU]) as s:
        done = py_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), """
            setup()
            n = 24 << 20
            r, dev = alloc(2 * n)
            expect = bytes((i * 13 + (i >> 12)) & 0xFF for i in range(256)) * (n // 256)
            a, b = ctypes.c_void_p(), ctypes.c_void_p()
            check("cuMemAllocHost_v2", ctypes.byref(a), ctypes.c_size_t(n))
            check("cuMemAllocHost_v2", ctypes.byref(b), ctypes.c_size_t(n))
            ctypes.memmove(a, expect, n)
            ctypes.memmove(b, expect[::-1], n)
            check("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(dev), a, ctypes.c_size_t(n), None)
            check("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(dev + n), b, ctypes.c_size_t(n), None)   # waits for a's lanes
            check("cuMemFreeHost", a)                                                                # waits for b's
            ctypes.memset(b, 0, n)   # b's copy is over: its lanes finished before the free returned
            out = ctypes.create_string_buffer(2 * n)
            check("cuMemcpyDtoH_v2", out, ctypes.c_uint64(dev), ctypes.c_size_t(2 * n))
            print("FIRST", out.raw[:n] == expect, "SECOND", out.raw[n:] == expect[::-1])
            """, timeout=120, LD_PRELOAD=str(lane_cut), RGPU_TEST_SLOW_SENDMSG_US="20000", **LANE_ENV)
    assert "FIRST True SECOND True" in done.stdout, done.stdout + done.stderr


def test_a_lane_cut_while_a_copy_comes_back_fails_that_copy_and_the_session_goes_on(
        native_libs: build.Libraries, lane_cut: Path, lane_failure: Path) -> None:
    # A receive of the device-to-host copy breaks (the host-to-device copy before it is whole).
    done = _cut_copy(native_libs, lane_cut, lane_failure, "dtoh", RGPU_TEST_CUT_RECV="40")
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr
    # The copy fails at once; the worker, told success before it sent, has nothing to report later.
    assert done.stdout.startswith("COPY 999\nSYNC 0\n"), done.stdout
    assert "a device-to-host copy of 16777216 bytes from GPU server" in done.stderr, done.stderr
    assert "lost the session" not in done.stderr


# ---- the handshake: lanes must prove they belong to their session --------------------------------

def _refusal(lane: socket.socket) -> str:
    lane.settimeout(10)
    (_, op, *_), payload = protocol.recv_frame(lane)
    assert op == protocol.OP_REFUSE
    text = protocol.decode_refuse(payload)[1]
    assert lane.recv(1) == b""   # and closed
    return text


def test_forged_lanes_are_refused_and_the_session_keeps_its_own(emulated: Server) -> None:
    token, other = emulated.token(), emulated.token()
    key = os.urandom(protocol.LANE_KEY_BYTES)
    refusals: list[str] = []
    lanes: list[socket.socket] = []

    def lanes_then_forgeries() -> None:
        lanes.append(protocol.open_lane(emulated.address, token, key, 0))
        for forged_token, index in ((other, 1),    # another slice's token
                                    (token, 0),    # lane 0 again
                                    (token, 2)):   # beyond the 2 asked for
            with protocol.open_lane(emulated.address, forged_token, key, index) as forged:
                refusals.append(_refusal(forged))
        lanes.append(protocol.open_lane(emulated.address, token, key, 1))

    emulated.server._lanes.wait_s = 2.0   # how long a lane waits for its session (and a session for its lanes)
    sock, welcome = protocol.handshake(emulated.address, token, info_extra={"lanes": 2, "lane_key": key.hex()},
                                       after_hello=lanes_then_forgeries)
    with sock:
        assert welcome.lanes == 2
        # Another key: no session is opening with it (refused once the wait is over).
        with protocol.open_lane(emulated.address, token, os.urandom(protocol.LANE_KEY_BYTES), 1) as forged:
            refusals.append(_refusal(forged))
        # The session's own key, once its lanes are taken: too late.
        with protocol.open_lane(emulated.address, token, key, 1) as late:
            refusals.append(_refusal(late))
        assert len(refusals) == 5
        assert all("a data lane that belongs to no session being opened" in r for r in refusals), refusals
        # A lane's token is checked as a session's: a bad signature is refused before any key is looked at.
        with protocol.open_lane(emulated.address, token[:-4] + "AAAA", key, 1) as bad:
            assert "token" in _refusal(bad)
    for lane in lanes:
        lane.close()


def test_a_session_whose_lanes_do_not_all_come_gets_none(emulated: Server) -> None:
    emulated.server._lanes.wait_s = 0.5
    token = emulated.token()
    key = os.urandom(protocol.LANE_KEY_BYTES)
    lanes: list[socket.socket] = []
    sock, welcome = protocol.handshake(emulated.address, token, info_extra={"lanes": 3, "lane_key": key.hex()},
                                       after_hello=lambda: lanes.extend(protocol.open_lane(emulated.address, token, key, i)
                                                                        for i in range(2)))
    with sock:
        assert welcome.lanes == 0
        for lane in lanes:
            lane.settimeout(10)
            assert lane.recv(1) == b""   # closed by the dispatcher, unanswered
            lane.close()


def test_lane_requests_and_offers_are_parsed_strictly() -> None:
    key = "ab" * protocol.LANE_KEY_BYTES
    assert parse_lane_request({"lanes": 4, "lane_key": key}) == (4, bytes.fromhex(key))
    for bad in ({"lanes": 1, "lane_key": key}, {"lanes": 17, "lane_key": key}, {"lanes": True, "lane_key": key},
                {"lanes": 4, "lane_key": key[:-2]}, {"lanes": 4, "lane_key": "zz" * 32}, {"lanes": 4}):
        assert parse_lane_request(bad) is None, bad
    assert parse_lane_offer({"lane": 3, "lane_key": key}) == (bytes.fromhex(key), 3)
    assert parse_lane_offer({"lane": -1, "lane_key": key}) is None
    assert parse_lane_offer({"lane": "1", "lane_key": key}) is None


def test_a_lane_book_hands_each_lane_to_its_own_session_only() -> None:
    book = LaneBook(wait_s=2.0)
    key = os.urandom(32)
    got: list[tuple[list, list]] = []
    waiter = threading.Thread(target=lambda: got.append(book.collect(key, "token-a", 2)))
    waiter.start()
    assert book.offer(key, "token-a", 1, "lane1")      # may come before lane 0
    assert not book.offer(key, "token-b", 0, "forged")  # same key, another token
    assert not book.offer(key, "token-a", 1, "again")   # index taken
    assert book.offer(key, "token-a", 0, "lane0")
    waiter.join()
    assert got == [(["lane0", "lane1"], [])]
    assert not LaneBook(wait_s=0.1).offer(key, "token-a", 0, "late")   # no session waits for it


# ---- the real-GPU path's C side: pinned staging slots, with a driver double ------------------------

MEMCPY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
RECORD_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
SYNC_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class StagedDriver:
    """cuMemcpyHtoDAsync_v2, cuEventRecord and cuEventSynchronize for lanes.c: a copy lands in
    `device` at once (as if the DMA ran), and remembers which slot event must be waited for before
    its slot is written again; `fail_at` makes the copy of that device offset fail."""

    def __init__(self, size: int, fail_at: int = -1) -> None:
        self.device = bytearray(size)
        self.fail_at = fail_at
        self.copies = self.records = self.syncs = 0

        def memcpy(dst, src, n, stream):  # type: ignore[no-untyped-def]
            if dst == self.fail_at:
                return 1
            self.copies += 1
            self.device[dst:dst + n] = ctypes.string_at(src, n)
            return 0

        def record(event, stream):  # type: ignore[no-untyped-def]
            self.records += 1
            return 0

        def sync(event):  # type: ignore[no-untyped-def]
            self.syncs += 1
            return 0
        self.callbacks = (MEMCPY_FN(memcpy), RECORD_FN(record), SYNC_FN(sync))

    def entry(self, i: int) -> int:
        return int(ctypes.cast(self.callbacks[i], ctypes.c_void_p).value or 0)


@pytest.mark.parametrize("slots", [1, 2, 8])
def test_staged_chunks_reach_the_device_whole_through_few_slots(native_libs: build.Libraries, slots: int) -> None:
    pairs = [socket.socketpair() for _ in range(4)]
    lanes = Lanes(str(native_libs.libworker), [a for a, _ in pairs], stall_s=10)
    size, chunk = 3 * MiB + 4097, 64 << 10
    data = os.urandom(size)
    driver = StagedDriver(size)
    pinned = ctypes.create_string_buffer(slots * chunk)
    staging = lanes.staging_new(ctypes.addressof(pinned), slots, chunk)
    events = (ctypes.c_void_p * slots)(*range(1, slots + 1))
    try:
        for seq in (7, 8):   # twice: the second copy finds the first one's slots still busy
            senders = send_striped([b for _, b in pairs], seq, data, chunk)
            gpu = lanes.gpu_copy(memcpy_htod=driver.entry(0), event_record=driver.entry(1), event_sync=driver.entry(2),
                                 stream=0, dst=0, events=ctypes.addressof(events), staging=staging)
            lanes.receive(seq, size, chunk, 0, gpu)
            for t in senders:
                t.join()
            assert gpu.error == 0
            assert bytes(driver.device) == data
            driver.device[:] = bytes(size)
        chunks = (size + chunk - 1) // chunk
        assert driver.copies == driver.records == 2 * chunks
        assert driver.syncs >= 2 * chunks - slots   # a slot is written again only after its copy's event
        assert lanes.staging_drain(staging, driver.entry(2)) == 0
        assert driver.syncs == 2 * chunks
    finally:
        lanes.staging_free(staging)
        lanes.close()
        for _, b in pairs:
            b.close()


def _lane_threads() -> set[int]:
    """This process's threads named rgpu-lane (lanes.c's), by thread id."""
    out = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "rgpu-lane":
                out.add(int(task.name))
        except OSError:
            pass
    return out


def test_copies_after_the_first_start_no_lane_threads(native_libs: build.Libraries) -> None:
    pairs = [socket.socketpair() for _ in range(4)]
    lanes = Lanes(str(native_libs.libworker), [a for a, _ in pairs], stall_s=10)
    size, chunk = 1 * MiB + 17, 64 << 10
    seen = []
    try:
        for seq in range(1, 6):
            data = os.urandom(size)
            into = ctypes.create_string_buffer(size)
            senders = send_striped([b for _, b in pairs], seq, data, chunk)
            lanes.receive(seq, size, chunk, ctypes.addressof(into), None)
            for t in senders:
                t.join()
            assert into.raw == data
            seen.append(_lane_threads())
    finally:
        lanes.close()
        for _, b in pairs:
            b.close()
    # The first copy started one thread per lane; every later copy ran on the same ones.
    assert len(seen[0]) >= 4, seen
    assert all(s == seen[0] for s in seen), seen


def test_a_refused_chunk_fails_the_copy_but_every_chunk_is_read(native_libs: build.Libraries) -> None:
    pairs = [socket.socketpair() for _ in range(2)]
    lanes = Lanes(str(native_libs.libworker), [a for a, _ in pairs], stall_s=10)
    size, chunk = 2 * MiB, 64 << 10
    driver = StagedDriver(size, fail_at=5 * chunk)
    pinned = ctypes.create_string_buffer(4 * chunk)
    staging = lanes.staging_new(ctypes.addressof(pinned), 4, chunk)
    events = (ctypes.c_void_p * 4)(1, 2, 3, 4)
    try:
        for seq in (1, 2):   # the lanes stay in step: the next copy is read whole
            senders = send_striped([b for _, b in pairs], seq, os.urandom(size), chunk)
            gpu = lanes.gpu_copy(memcpy_htod=driver.entry(0), event_record=driver.entry(1), event_sync=driver.entry(2),
                                 stream=0, dst=0, events=ctypes.addressof(events), staging=staging)
            lanes.receive(seq, size, chunk, 0, gpu)
            for t in senders:
                t.join()
            assert gpu.error == 1
        assert lanes.open
    finally:
        lanes.staging_free(staging)
        lanes.close()


DTOH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)


class DeviceSource(StagedDriver):
    """StagedDriver plus cuMemcpyDtoHAsync_v2 from `device` (whose copy at `fail_at` fails)."""

    def __init__(self, data: bytes, fail_at: int = -1) -> None:
        super().__init__(len(data), fail_at)
        self.device[:] = data

        def dtoh(dst, src, n, stream):  # type: ignore[no-untyped-def]
            if src == self.fail_at:
                return 700
            self.copies += 1
            ctypes.memmove(dst, bytes(self.device[src:src + n]), n)
            return 0
        self.callbacks = (*self.callbacks, DTOH_FN(dtoh))


@pytest.mark.parametrize("fail_at_chunk", [-1, 9], ids=["whole", "refused-part-way"])
def test_device_chunks_leave_through_few_slots_and_arrive_whole_or_aborted(native_libs: build.Libraries,
                                                                           fail_at_chunk: int) -> None:
    pairs = [socket.socketpair() for _ in range(3)]
    worker = Lanes(str(native_libs.libworker), [a for a, _ in pairs], stall_s=10)
    client = Lanes(str(native_libs.libworker), [b for _, b in pairs], stall_s=10)
    size, chunk, slots = 2 * MiB + 12345, 64 << 10, 2
    data = os.urandom(size)
    driver = DeviceSource(data, fail_at=fail_at_chunk * chunk if fail_at_chunk >= 0 else -1)
    pinned = ctypes.create_string_buffer(slots * chunk)
    staging = worker.staging_new(ctypes.addressof(pinned), slots, chunk)
    events = (ctypes.c_void_p * slots)(1, 2)
    target = ctypes.create_string_buffer(size)
    got: list[int] = []
    receiver = threading.Thread(target=lambda: got.append(client.receive(5, size, chunk, ctypes.addressof(target))))
    receiver.start()
    try:
        gpu = worker.gpu_copy(memcpy_htod=driver.entry(0), event_record=driver.entry(1), event_sync=driver.entry(2),
                              stream=0, dst=0, events=ctypes.addressof(events), staging=staging,
                              memcpy_dtoh=driver.entry(3))
        assert worker.send(5, size, chunk, 0, gpu) == ""
        receiver.join()
        if fail_at_chunk < 0:
            assert gpu.error == 0 and got == [0] and target.raw == data
        else:   # the chunks before it arrived; it and every later one say the driver's code
            assert gpu.error == 700 and got == [700]
            assert target.raw[:fail_at_chunk * chunk] == data[:fail_at_chunk * chunk]
        assert worker.open and client.open
    finally:
        worker.staging_free(staging)
        worker.close()
        client.close()


def test_a_chunk_out_of_place_ends_the_lanes_with_what_was_due(native_libs: build.Libraries) -> None:
    pairs = [socket.socketpair() for _ in range(2)]
    lanes = Lanes(str(native_libs.libworker), [a for a, _ in pairs], stall_s=10)
    size, chunk = 1 * MiB, 64 << 10
    target = ctypes.create_string_buffer(size)
    senders = send_striped([b for _, b in pairs], 3, os.urandom(size), chunk, bad_chunk=4)
    with pytest.raises(Exception) as caught:
        lanes.receive(3, size, chunk, ctypes.addressof(target))
    for t in senders:
        t.join()
    assert "chunk 5 offset 262144" in str(caught.value) and "where chunk 4 of copy 3" in str(caught.value)
    assert not lanes.open and "the copy did not complete" in str(caught.value)


# ---- the real-GPU backend (backends/cuda.py) over rgpu's own driver, chained to an emulated worker ---

def test_striped_copies_through_the_cuda_backend_arrive_whole(lane_copies: Path, native_libs: build.Libraries,
                                                              chained: Server, tmp_path: Path) -> None:  # noqa: F811
    sizes = [THRESHOLD - 1, THRESHOLD + LANES * CHUNK + 1, 9 * MiB + 3]
    done = run_client(native_libs, chained.slices(chained.token(memory_limit=1 << 30)),
                      [str(lane_copies), *map(str, sizes)], timeout=300, RGPU_CLIENT_STATS=str(tmp_path / "p"),
                      **LANE_ENV)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    assert f"{LANES} data lanes)" in done.stderr
    assert _striped(tmp_path / "p") == (2 * 2 * 2, 2 * 2 * 2)


def test_struct_layouts_match_lanes_h() -> None:
    from rgpu.remoting.datapath.worker.lanes import GpuCopy
    assert ctypes.sizeof(GpuCopy) == 8 * 7 + 8 + 8
    assert struct.calcsize("<QQQQ") == protocol.LANES_COPY.size


# ---- hostile or refused striped copy frames, from a hand-made client ------------------------------


def _receive_striped(lanes: list[socket.socket], seq: int, size: int, chunk: int) -> bytes:
    out = bytearray(size)
    for i in range((size + chunk - 1) // chunk):
        (length, op, flags, got_seq, aux, at), body = protocol.recv_frame(lanes[i % len(lanes)])
        assert (op, flags, got_seq, aux, at) == (protocol.OP_LANE_DATA, 0, seq, i, i * chunk)
        out[at:at + length] = body
    return bytes(out)


def test_refused_striped_copies_keep_the_lanes_in_step_and_hostile_ones_end_them(emulated: Server) -> None:
    sock, welcome, lanes = protocol.handshake_with_lanes(emulated.address, emulated.token(memory_limit=1 << 30), 2)
    chunk, size = 64 << 10, 1 * MiB + 5
    sync = OP["cuCtxSynchronize"]
    with sock:
        assert welcome.lanes == 2 and len(lanes) == 2
        code, body = _sync(sock, OP["cuDevicePrimaryCtxRetain"], struct.pack("<i", 0), 1)
        (ctx,) = struct.unpack_from("<Q", body, 4)
        code, body = _sync(sock, OP["cuMemAlloc_v2"], struct.pack("<QQQQI", 4 << 20, 0, 0, 0, 0), 2, ctx)
        assert code == 0, body
        (dev,) = struct.unpack_from("<Q", body, 4)
        data = os.urandom(size)
        htod, dtoh = OP["rgpuMemcpyHtoDLanes"], OP["rgpuMemcpyDtoHLanes"]
        # Refused by the worker (a stream it never made; a range beyond the allocation): its bytes are
        # read and dropped, the error waits for the next synchronisation, and the lanes stay in step.
        for seq, (address, stream) in enumerate(((dev, 0x7D00_0000_0000_0042), (dev + (4 << 20) - 8, 0)), start=3):
            sock.sendall(protocol.pack_frame(htod, protocol.LANES_COPY.pack(address, stream, size, chunk), seq=seq,
                                             ctx=ctx))
            for t in send_striped(lanes, seq, data, chunk):
                t.join()
            code, body = _sync(sock, sync, b"", seq + 10, ctx)
            assert code != 0, body
        # A good one, there and back.
        sock.sendall(protocol.pack_frame(htod, protocol.LANES_COPY.pack(dev, 0, size, chunk), seq=20, ctx=ctx))
        for t in send_striped(lanes, 20, data, chunk):
            t.join()
        code, body = _sync(sock, dtoh, protocol.LANES_COPY.pack(dev, 0, size, chunk), 21, ctx)
        assert code == 0, body
        assert _receive_striped(lanes, 21, size, chunk) == data
        # Refused back (beyond the slice): the REPLY says so and nothing comes on the lanes.
        code, body = _sync(sock, dtoh, protocol.LANES_COPY.pack(dev, 0, 2 << 30, chunk), 22, ctx)
        assert code == 1 and b"more than the slice's" in body, body
        code, body = _sync(sock, dtoh, protocol.LANES_COPY.pack(dev, 0, size, chunk), 23, ctx)
        assert code == 0 and _receive_striped(lanes, 23, size, chunk) == data
        # A chunk size outside the protocol's bounds cannot be kept in step: the lanes end, clearly.
        code, body = _sync(sock, dtoh, protocol.LANES_COPY.pack(dev, 0, size, 100), 24, ctx)
        assert code == 1 and b"in chunks of 100 bytes" in body, body
        code, body = _sync(sock, dtoh, protocol.LANES_COPY.pack(dev, 0, size, chunk), 25, ctx)
        assert code == 999 and b"whose data lanes ended" in body, body
        code, body = _sync(sock, OP["rgpuSessionInfo"], b"", 26)
        assert code == 0   # the session goes on
    for lane in lanes:
        lane.close()


def test_a_striped_copy_frame_on_a_session_without_lanes_is_an_error_not_a_crash(emulated: Server) -> None:
    sock, welcome = protocol.handshake(emulated.address, emulated.token())
    with sock:
        assert welcome.lanes == 0
        code, body = _sync(sock, OP["rgpuMemcpyDtoHLanes"], protocol.LANES_COPY.pack(0x1000, 0, 8 << 20, 1 << 20), 1)
        assert code == 1 and b"rgpuMemcpyDtoHLanes on a session that has no data lanes" in body, body
        sock.sendall(protocol.pack_frame(OP["rgpuMemcpyHtoDLanes"], protocol.LANES_COPY.pack(0x1000, 0, 8 << 20, 1 << 20),
                                         seq=2))
        code, body = _sync(sock, OP["rgpuSessionInfo"], b"", 3)
        assert code == 1 and b"rgpuMemcpyHtoDLanes on a session that has no data lanes" in body, body
        code, body = _sync(sock, OP["rgpuSessionInfo"], b"", 4)
        assert code == 0


@pytest.mark.integration
def test_a_lane_that_stops_mid_copy_ends_the_lanes_after_the_stall_and_the_session_goes_on() -> None:
    from rgpu.remoting.dispatcher.admission import SessionCaps
    with serving("emulated", [EMULATED_GPU], SessionCaps(frame_stall_s=1.0)) as s:
        sock, welcome, lanes = protocol.handshake_with_lanes(s.address, s.token(memory_limit=1 << 30), 2)
        chunk, size = 64 << 10, 1 * MiB
        with sock:
            assert welcome.lanes == 2
            code, body = _sync(sock, OP["cuDevicePrimaryCtxRetain"], struct.pack("<i", 0), 1)
            (ctx,) = struct.unpack_from("<Q", body, 4)
            code, body = _sync(sock, OP["cuMemAlloc_v2"], struct.pack("<QQQQI", 4 << 20, 0, 0, 0, 0), 2, ctx)
            (dev,) = struct.unpack_from("<Q", body, 4)
            sock.sendall(protocol.pack_frame(OP["rgpuMemcpyHtoDLanes"], protocol.LANES_COPY.pack(dev, 0, size, chunk),
                                             seq=3, ctx=ctx))
            # Chunk 0 on lane 0 and half of chunk 1 on lane 1, then nothing.
            lanes[0].sendall(protocol.HEADER.pack(chunk, protocol.OP_LANE_DATA, 0, 3, 0, 0) + bytes(chunk))
            lanes[1].sendall(protocol.HEADER.pack(chunk, protocol.OP_LANE_DATA, 0, 3, 1, chunk) + bytes(chunk // 2))
            code, body = _sync(sock, OP["cuCtxSynchronize"], b"", 4, ctx)
            assert code == 999 and b"sent nothing for 1 s during chunk" in body, body
            for lane in lanes:   # the worker closed its ends
                lane.settimeout(10)
                assert lane.recv(1) == b""
            # The session goes on: a copy on its one connection, and back.
            data = os.urandom(4096)
            sock.sendall(protocol.pack_frame(OP["cuMemcpyHtoDAsync_v2"], struct.pack("<QQQ", dev, 0, len(data)) + data,
                                             seq=5, ctx=ctx))
            sock.sendall(protocol.pack_frame(OP["cuMemcpyDtoHAsync_v2"], struct.pack("<QQQ", dev, 0, len(data)), seq=6,
                                             ctx=ctx))
            back = b""
            while True:
                header, payload = protocol.recv_frame(sock)
                if header[1] == protocol.OP_DATA:
                    back += payload
                elif header[1] == protocol.OP_REPLY:
                    assert struct.unpack_from("<i", payload)[0] == 0
                    break
            assert back == data
        for lane in lanes:
            lane.close()
