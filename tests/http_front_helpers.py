"""Trickling requests and counting a daemon's open files and threads, for the HTTP front tests and
benchmarks/http_flood.py."""

from __future__ import annotations

import http.client
from pathlib import Path


TRICKLE = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"   # never a whole head


def get(port: int, path: str = "/", timeout: float = 5.0, source: str = "127.0.0.1") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def answers(port: int, path: str) -> int:
    try:
        return get(port, path, timeout=2.0)[0]
    except OSError:
        return 0


def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def open_files_of(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))
