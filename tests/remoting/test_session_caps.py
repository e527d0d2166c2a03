"""One lease token cannot make a GPU node hold unbounded workers, threads or memory (issue 26,
HIGH 3), against a real session server on loopback with the emulated backend: caps on live
sessions of every kind per slice and per dispatcher, a rate limit on opens, a deadline on an
unfinished frame's progress in the worker, and perf sessions bounded in number and idle time."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from rgpu.errors import RgpuError
from rgpu.remoting.datapath import protocol
from rgpu.remoting.dispatcher.admission import SessionCaps, SessionLedger, TokenBucket
from rgpu.remoting.datapath.worker.frames import FrameProgress
from tests.daemons import wait_for
from tests.remoting.conftest import EMULATED_GPU, EMULATED_GPU_2, Server, serving

UNKNOWN_OP = 60000    # answered NOT_SUPPORTED by any worker: a request that needs nothing of the GPU


@pytest.fixture
def small_caps() -> Iterator[Server]:
    caps = SessionCaps(cuda_per_slice=2, nvml_per_slice=3, perf_per_slice=2, perf_max=3, sessions_max=6,
                       opens_burst=40, opens_per_second=5.0, frame_stall_s=1.0, perf_idle_s=1.0)
    with serving("emulated", [EMULATED_GPU, EMULATED_GPU_2], caps) as server:
        yield server


def _open(server: Server, token: str, flags: int = 0) -> socket.socket | str:
    """An open session's socket, or the refusal's text."""
    try:
        sock, _welcome = protocol.handshake(server.address, token, flags=flags, timeout=20)
    except RgpuError as exc:
        return str(exc)
    return sock


def _timed_open(server: Server, token: str) -> float:
    """Seconds a CUDA session takes to open (it is closed at once)."""
    t0 = time.monotonic()
    s = _open(server, token)
    took = time.monotonic() - t0
    assert isinstance(s, socket.socket), s
    s.close()
    return took


def _workers(server: Server) -> int:
    return len(server.server.status()["sessions"])


# ------------------------------------------------------------------ pure parts

def test_the_token_bucket_gives_a_burst_then_its_rate() -> None:
    bucket = TokenBucket(3.0, 2.0)
    assert [bucket.take(10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(10.0) == pytest.approx(0.5)
    assert bucket.take(10.5) == 0.0
    assert bucket.full(12.0)


def test_the_ledger_counts_kinds_per_slice_and_in_all() -> None:
    ledger = SessionLedger(SessionCaps(cuda_per_slice=1, nvml_per_slice=1, sessions_max=3))
    a, b, c = ("job-a", 0, "GPU-1"), ("job-b", 0, "GPU-1"), ("job-c", 0, "GPU-1")
    first = ledger.admit(a, "cuda", 0.0)
    assert not isinstance(first, str)
    assert "session_cuda_per_slice = 1" in str(ledger.admit(a, "cuda", 0.0))
    assert not isinstance(ledger.admit(a, "nvml", 0.0), str)
    assert not isinstance(ledger.admit(b, "cuda", 0.0), str)
    refusal = ledger.admit(c, "cuda", 0.0)
    assert isinstance(refusal, str) and "sessions_max = 3" in refusal and "\n" not in refusal
    ledger.release(first)
    assert not isinstance(ledger.admit(c, "cuda", 0.0), str)


def test_frame_progress_counts_waiting_and_resets_per_frame_and_per_64_kib() -> None:
    p = FrameProgress(stall_s=1.0, progress_bytes=100)
    assert p.allowed(0) == 1.0
    p.waited_for(0.6, 10)
    assert p.allowed(0) == pytest.approx(0.4)
    p.waited_for(0.3, 95)            # 105 bytes since the frame began: progress, the clock restarts
    assert p.allowed(0) == 1.0
    p.waited_for(0.9, 1)
    assert p.allowed(500) == 1.0     # another frame
    p.waited_for(1.0, 0)
    assert p.allowed(500) <= 0


@pytest.mark.parametrize("key,value", [("sessions_max", 0), ("session_opens_per_second", float("nan")),
                                       ("session_frame_stall_seconds", -1.0)])
def test_a_cap_that_is_not_a_positive_number_is_refused_at_start(key: str, value: float) -> None:
    from rgpu.config import Settings
    from rgpu.errors import ConfigError
    from rgpu.remoting.dispatcher.daemon import start_data_path
    with socket.socket() as sock, pytest.raises(ConfigError) as info:
        start_data_path(sock, "127.0.0.1:1", (EMULATED_GPU,), b"s" * 32, (1, 1), "emulated",
                        Settings(**{key: value}))
    text = str(info.value)
    assert text.startswith("rgpu: dispatcher: ") and key in text and "\n" not in text, text


# ------------------------------------------------------------------ on the session server

integration = pytest.mark.integration

@integration
@pytest.mark.parametrize("kind,flags,cap", [("NVML", protocol.HELLO_NVML, 3), ("CUDA", 0, 2)])
def test_one_token_holds_at_most_its_sessions_of_each_kind(small_caps: Server, kind: str, flags: int,
                                                           cap: int) -> None:
    token = small_caps.token()
    results = [_open(small_caps, token, flags) for _ in range(cap + 3)]
    opened = [r for r in results if isinstance(r, socket.socket)]
    refusals = [r for r in results if isinstance(r, str)]
    try:
        assert len(opened) == cap, refusals
        assert len(refusals) == 3
        for text in refusals:
            assert text.startswith("rgpu: session: ") and "\n" not in text, text
            assert f"already holds {cap} {kind} sessions" in text and f"per_slice = {cap}" in text, text
        assert _workers(small_caps) == cap
        # Another slice is not held back, and the dispatcher says what it refused.
        other = _open(small_caps, small_caps.token(), flags)
        assert isinstance(other, socket.socket), other
        other.close()
        assert small_caps.server.status()["caps"]["refused"]["slice"] == 3
    finally:
        for s in opened:
            s.close()


@integration
def test_the_dispatcher_caps_its_sessions_in_all_and_gives_slots_back(small_caps: Server) -> None:
    held = []
    for _ in range(3):   # 3 slices x 2 sessions = sessions_max
        token = small_caps.token()
        held += [_open(small_caps, token, protocol.HELLO_NVML) for _ in range(2)]
    assert all(isinstance(s, socket.socket) for s in held), held
    refused = _open(small_caps, small_caps.token(), protocol.HELLO_NVML)
    assert isinstance(refused, str) and "sessions_max = 6" in refused, refused
    for s in held[:2]:
        s.close()                      # two sessions end: their slots come back once reaped
    deadline = time.monotonic() + 10
    while _workers(small_caps) > 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    again = _open(small_caps, small_caps.token(), protocol.HELLO_NVML)
    assert isinstance(again, socket.socket), again
    for s in [*held[2:], again]:
        s.close()                      # type: ignore[union-attr]


@integration
def test_a_loop_of_opens_is_refused_by_rate_and_a_bystander_still_opens() -> None:
    caps = SessionCaps(opens_burst=5, opens_per_second=2.0)
    with serving("emulated", [EMULATED_GPU], caps) as server:
        token, bystander = server.token(), server.token()
        answers = []
        for _ in range(20):
            try:
                protocol.probe(server.address, token, timeout=10)
                answers.append("ok")
            except RgpuError as exc:
                answers.append(str(exc))
        ok = answers.count("ok")
        assert 5 <= ok <= 8, answers          # the burst, and what refilled while the loop ran
        refusals = [a for a in answers if a != "ok"]
        assert all("opens sessions faster than this GPU server allows" in a and "retry in" in a
                   and "\n" not in a for a in refusals), refusals
        t0 = time.monotonic()
        protocol.probe(server.address, bystander, timeout=10)
        assert time.monotonic() - t0 < 2.0


def _stalled_frame(server: Server, token: str, length: int, send: int) -> socket.socket:
    sock = _open(server, token)
    assert isinstance(sock, socket.socket), sock
    sock.sendall(protocol.HEADER.pack(length, UNKNOWN_OP, 0, 1, 0, 0) + bytes(send))
    return sock


def _ended_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closes `sock`, or None if it holds it past `seconds`."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass
    return time.monotonic() - t0


@integration
def test_a_frame_whose_bytes_stop_coming_ends_its_session(small_caps: Server) -> None:
    token = small_caps.token()
    big = _stalled_frame(small_caps, token, 200 << 20, 4 << 20)     # a large frame, left unfinished
    small = _stalled_frame(small_caps, token, 1000, 10)               # a small one, likewise
    try:
        for sock in (big, small):
            took = _ended_within(sock, 10.0)
            assert took is not None and took < 5.0, took
    finally:
        big.close()
        small.close()


@integration
def test_a_trickle_does_not_count_as_progress_but_a_slow_steady_frame_does(small_caps: Server) -> None:
    token = small_caps.token()
    trickle = _stalled_frame(small_caps, token, 1 << 20, 100)
    ended: list[float | None] = []

    def drip() -> None:
        try:
            for _ in range(40):
                trickle.sendall(b"\0")
                time.sleep(0.1)
        except OSError:
            pass
    t = threading.Thread(target=drip, daemon=True)
    t.start()
    ended.append(_ended_within(trickle, 8.0))
    t.join()
    trickle.close()
    assert ended[0] is not None and ended[0] < 6.0, ended
    # 12 MiB (more than the worker's 8 MiB buffer) at 1 MiB every 0.4 s: several times the stall
    # deadline in all, yet it keeps coming, so it is served.
    steady = _open(small_caps, token)
    assert isinstance(steady, socket.socket), steady
    try:
        steady.sendall(protocol.HEADER.pack(12 << 20, UNKNOWN_OP, 0, 7, 0, 0))
        for _ in range(12):
            time.sleep(0.4)
            steady.sendall(bytes(1 << 20))
        steady.settimeout(20)
        (_, op, _, seq, _, _), payload = protocol.recv_frame(steady, 1 << 20)
        assert op == protocol.OP_REPLY and seq == 7, (op, seq)
    finally:
        steady.close()


@integration
def test_perf_sessions_are_capped_and_end_when_idle(small_caps: Server) -> None:
    threads_before = threading.active_count()
    token = small_caps.token()
    mine = [_open(small_caps, token, protocol.HELLO_PERF) for _ in range(20)]
    opened = [s for s in mine if isinstance(s, socket.socket)]
    assert len(opened) == 2, [s for s in mine if isinstance(s, str)][:3]
    assert any(isinstance(s, str) and "session_perf_per_slice = 2" in s for s in mine)
    other = _open(small_caps, small_caps.token(), protocol.HELLO_PERF)
    third = _open(small_caps, small_caps.token(), protocol.HELLO_PERF)
    assert isinstance(other, socket.socket), other
    assert isinstance(third, str) and "session_perf_max = 3" in third, third
    assert threading.active_count() - threads_before <= 3 + 2   # the perf sessions' threads, some slack
    for sock in [*opened, other]:
        took = _ended_within(sock, 10.0)     # they send nothing: perf_idle_s (1 s) ends them
        assert took is not None and took < 4.0, took
        sock.close()
    deadline = time.monotonic() + 5
    while small_caps.server.status()["caps"]["perf_live"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert small_caps.server.status()["caps"]["perf_live"] == 0


@integration
def test_the_probes_of_issue_26_measured(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26's numbers again, with the default caps: 60 NVML sessions and 100 stalled perf
    sessions from one token, and a bystander opening sessions while that token opens and closes
    sessions in a loop (four threads)."""
    with serving("emulated", [EMULATED_GPU]) as server:
        token = server.token()
        threads0 = threading.active_count()
        nvml = [_open(server, token, protocol.HELLO_NVML) for _ in range(60)]
        nvml_open = [s for s in nvml if isinstance(s, socket.socket)]
        workers = _workers(server)
        perf = [_open(server, token, protocol.HELLO_PERF) for _ in range(100)]
        perf_open = [s for s in perf if isinstance(s, socket.socket)]
        threads = threading.active_count() - threads0
        for s in nvml_open + perf_open:
            s.close()
        assert len(nvml_open) == SessionCaps().nvml_per_slice and workers == len(nvml_open)
        assert len(perf_open) == SessionCaps().perf_per_slice and threads <= 4
        deadline = time.monotonic() + 15
        while _workers(server) and time.monotonic() < deadline:
            time.sleep(0.1)

        stop = threading.Event()
        loops = {"opened": 0, "refused": 0}

        def churn() -> None:
            while not stop.is_set():
                s = _open(server, token, protocol.HELLO_NVML)
                if isinstance(s, socket.socket):
                    loops["opened"] += 1
                    s.close()
                else:
                    loops["refused"] += 1
        bystander = server.token()
        quiet = [_timed_open(server, bystander) for _ in range(3)]
        attackers = [threading.Thread(target=churn, daemon=True) for _ in range(4)]
        for attacker in attackers:
            attacker.start()
        wait_for(lambda: loops["opened"] + loops["refused"] >= 8, timeout=60, what="the open/close loop to run")
        loaded = [_timed_open(server, bystander) for _ in range(5)]     # each opens (asserted there)
        stop.set()
        for attacker in attackers:
            attacker.join(timeout=30)
        # The looping slice is held to its rate of opens (probes count, and start no worker) while
        # the bystander, from the same address, still opens: the cap is the slice's, not the host's.
        caps, probes, refusal = SessionCaps(), 0, ""
        while not refusal and probes < 10 * caps.opens_burst:
            probes += 1
            try:
                protocol.probe(server.address, token, timeout=20)
            except RgpuError as exc:
                refusal = str(exc)
        assert "opens sessions faster than this GPU server allows" in refusal, (probes, refusal)
        after_refusal = _timed_open(server, bystander)
    with capsys.disabled():
        print(f"\nissue 26 probes ({os.cpu_count()} CPUs): 60 NVML opens -> {len(nvml_open)} workers; 100 perf opens "
              f"-> {len(perf_open)} served, +{threads} threads; open/close loop: {loops['opened']} opened, "
              f"{loops['refused']} refused; bystander's CUDA open {max(quiet):.2f} s quiet, "
              f"median {sorted(loaded)[2]:.2f} s / max {max(loaded):.2f} s under the loop, "
              f"{after_refusal:.2f} s while the looping slice is refused ({probes} probes to its refusal)")
