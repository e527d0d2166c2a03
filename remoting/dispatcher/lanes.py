"""Data lanes (protocol 12): pairing the extra connections a client opens for a session with that
session, before its worker starts.

A client that wants its large copies striped sends, in the session's HELLO, how many lanes it opens
and a random lane key; each lane then connects to the same port and sends a HELLO_LANE with the
same token and key. Each lane is verified like a session (version, token: signature, expiry, this
dispatcher, a live lease) by its own handshake thread, then offered here; the session's handshake
thread collects its lanes and starts the worker with all of them. A lane is taken only by the
session whose token and key it carries; one that matches none within the wait is refused by its
thread. All or nothing: a session whose lanes do not all arrive in time gets none (its copies stay
on its one connection) and the lanes that came are closed.
"""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rgpu.remoting.datapath import protocol

LANE_WAIT_S = 3.0   # how long a session waits for its lanes, and a lane for its session


def parse_lane_request(info: dict) -> tuple[int, bytes] | None:
    """(lanes, key) a session's HELLO asks for; None when it asks for none or asks badly."""
    count, key = info.get("lanes"), info.get("lane_key")
    if not isinstance(count, int) or isinstance(count, bool) or not 2 <= count <= protocol.MAX_LANES:
        return None
    return (count, key_bytes) if (key_bytes := _key(key)) else None


def parse_lane_offer(info: dict) -> tuple[bytes, int] | None:
    """(key, index) a lane's HELLO carries; None when malformed."""
    index = info.get("lane")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < protocol.MAX_LANES:
        return None
    return (key_bytes, index) if (key_bytes := _key(info.get("lane_key"))) else None


def _key(text: Any) -> bytes:
    if not isinstance(text, str) or len(text) != 2 * protocol.LANE_KEY_BYTES:
        return b""
    try:
        return bytes.fromhex(text)
    except ValueError:
        return b""


@dataclass
class _Waiting:
    token: str
    count: int
    lanes: dict[int, Any] = field(default_factory=dict)


class LaneBook:
    """Sessions waiting for their lanes, by lane key. Thread-safe; lanes are opaque objects."""

    def __init__(self, wait_s: float = LANE_WAIT_S) -> None:
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._waiting: dict[bytes, _Waiting] = {}

    def collect(self, key: bytes, token: str, count: int) -> tuple[list[Any], list[Any]]:
        """Wait for the session's `count` lanes: (lanes in index order, []) when all came in time,
        else ([], the ones that came, for the caller to close)."""
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            if key in self._waiting:   # another session with this key: not this one's lanes
                return [], []
            entry = self._waiting[key] = _Waiting(token, count)
            self._cond.notify_all()
            while len(entry.lanes) < count and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            del self._waiting[key]
            self._cond.notify_all()
        if len(entry.lanes) == count:
            return [entry.lanes[i] for i in range(count)], []
        return [], list(entry.lanes.values())

    def offer(self, key: bytes, token: str, index: int, lane: Any) -> bool:
        """Hand a verified lane to the session it names (waiting up to wait_s for that session's
        handshake to get here); False when it belongs to none: wrong key, another token, an index
        out of range or taken."""
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while (entry := self._waiting.get(key)) is None and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if entry is None or not hmac.compare_digest(entry.token.encode(), token.encode()):
                return False
            if index >= entry.count or index in entry.lanes:
                return False
            entry.lanes[index] = lane
            self._cond.notify_all()
            return True
