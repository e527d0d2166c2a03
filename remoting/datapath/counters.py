"""A session's traffic counters, shared from its worker process with the dispatcher through a
small memory-mapped file (`<counters dir>/<worker pid>.counters`): the worker publishes its
counts every PUBLISH_INTERVAL_S and when the session ends; the dispatcher reads them for its
metrics and, once the worker exited, adds the final counts to its totals and removes the file.

Layout: little-endian uint64 per field of FIELDS, in that order.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path

FIELDS = ("received_bytes", "sent_bytes", "calls", "errors")
_LAYOUT = struct.Struct("<" + "Q" * len(FIELDS))
PUBLISH_INTERVAL_S = 0.5


def counters_path(folder: str | os.PathLike[str], pid: int) -> Path:
    return Path(folder) / f"{pid}.counters"


class CounterFile:
    """The worker's side: a fixed-size file it overwrites in place."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _LAYOUT.size)
            self._map: mmap.mmap | None = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)

    def publish(self, values: tuple[int, ...]) -> None:
        if self._map is not None:
            _LAYOUT.pack_into(self._map, 0, *values)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def read_counters(path: Path) -> dict[str, int] | None:
    """The counts in a counters file; None when it is missing or short (a worker starting up)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _LAYOUT.size:
        return None
    return dict(zip(FIELDS, _LAYOUT.unpack_from(data)))


class Publisher:
    """Publishes `read()` to a counters file every PUBLISH_INTERVAL_S on a thread of its own (the
    serving loop only bumps integers), and once more at stop()."""

    def __init__(self, path: Path, read: Callable[[], tuple[int, ...]],
                 interval: float = PUBLISH_INTERVAL_S) -> None:
        self._file = CounterFile(path)
        self._read = read
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rgpu-counters", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._file.publish(self._read())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._file.publish(self._read())
        self._file.close()
