"""The pool's recent events for the dashboard: what rgpu-poold logs at INFO and above (leases
granted, released and reclaimed, servers registered, down, back, drained, refused calls), kept
in a bounded ring in memory. The log stays the record; this is a window on it."""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

MAX_EVENTS = 200
_PREFIX = "rgpu-poold: "


@dataclass(frozen=True)
class Event:
    unix: float
    level: str        # info | warning | error
    message: str


class EventLog(logging.Handler):
    def __init__(self, capacity: int = MAX_EVENTS) -> None:
        super().__init__(level=logging.INFO)
        self._events: deque[Event] = deque(maxlen=capacity)
        self._ring_lock = threading.Lock()
        self._logger: logging.Logger | None = None

    @classmethod
    def attach(cls, logger: logging.Logger, capacity: int = MAX_EVENTS) -> "EventLog":
        handler = cls(capacity)
        handler._logger = logger
        logger.addHandler(handler)
        return handler

    def detach(self) -> None:
        if self._logger is not None:
            self._logger.removeHandler(self)
            self._logger = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed log call must not break the pool
            return
        message = message.removeprefix(_PREFIX).splitlines()[0] if message else ""
        with self._ring_lock:
            self._events.append(Event(record.created, record.levelname.lower(), message))

    def recent(self, limit: int = 50) -> list[Event]:
        """The newest `limit` events, newest first."""
        with self._ring_lock:
            return list(reversed(self._events))[:limit]
