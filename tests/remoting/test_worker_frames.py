"""The worker's frame reader (worker/frames.py): its short poll before it sleeps in recv."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.worker import frames


@pytest.mark.parametrize(("value", "cpus", "want_us"), [("", 16, 50), ("", 2, 0), ("0", 16, 0), ("120", 2, 120),
                                                        ("999999", 16, 10_000), ("-5", 16, 0), ("fast", 16, 50)])
def test_the_poll_budget_follows_the_setting_and_the_cpus_the_worker_may_use(
        monkeypatch: pytest.MonkeyPatch, value: str, cpus: int, want_us: int) -> None:
    monkeypatch.setenv("RGPU_WORKER_SPIN_US", value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert frames.worker_spin_ns() == want_us * 1000


@pytest.mark.parametrize("spin_us", ["0", "200"])
def test_frames_arriving_before_during_and_after_the_poll_are_read_whole(monkeypatch: pytest.MonkeyPatch,
                                                                        spin_us: str) -> None:
    monkeypatch.setenv("RGPU_WORKER_SPIN_US", spin_us)
    client, server = socket.socketpair()
    with client, server:
        reader = frames.FrameReader(server, size=1 << 16)
        sent = [protocol.pack_frame(40 + i, os.urandom(100 * i), seq=i) for i in range(1, 6)]

        def send() -> None:
            client.sendall(sent[0])
            for delay, frame in zip((0.0001, 0.002, 0.05, 0.2), sent[1:]):
                time.sleep(delay)
                client.sendall(frame[:10])   # split across the poll and the sleep
                time.sleep(delay / 2)
                client.sendall(frame[10:])
        writer = threading.Thread(target=send)
        writer.start()
        got = []
        for _ in sent:
            op, _flags, seq, _aux, _ctx, payload, _address = reader.next()
            got.append(protocol.pack_frame(op, bytes(payload), seq=seq))
        writer.join()
        assert got == sent
        client.close()
        with pytest.raises(EOFError):
            reader.next()
