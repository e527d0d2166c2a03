"""The emulated GPU's streams and events."""

from __future__ import annotations

import time

from rgpu.remoting.datapath.backends.base import (
    INVALID_HANDLE,
    INVALID_VALUE,
    OUT_OF_MEMORY,
    SUCCESS,
    CudaError,
)
from rgpu.remoting.datapath.backends.emulated_device import EmulatedDevice


class EmulatedStreams(EmulatedDevice):
    """Streams (flags and priorities) and events (timestamps)."""

    # ------------------------------------------------------------------ streams and events

    def cuStreamCreate(self, flags: int) -> tuple[int, int]:
        self._need_ctx()
        h = self.handles.new()
        self.streams[h] = (flags, 0)
        return (SUCCESS, h)

    def cuStreamCreateWithPriority(self, flags: int, priority: int) -> tuple[int, int]:
        self._need_ctx()
        h = self.handles.new()
        self.streams[h] = (flags, priority)
        return (SUCCESS, h)

    def stream_create(self, flags: int, priority: int) -> int:
        """rgpuStreamCreate: the stream behind a client's handle (worker/client_handles.py)."""
        if flags & ~0x1:
            raise CudaError(INVALID_VALUE)
        r, h = self.cuStreamCreateWithPriority(flags, priority)
        if r != SUCCESS:
            raise CudaError(r)
        return h

    def _stream_ok(self, s: int) -> bool:
        return s in (0, 1, 2) or s in self.streams

    def cuStreamDestroy_v2(self, s: int) -> tuple[int]:
        return (SUCCESS,) if self.streams.pop(s, None) is not None else (INVALID_HANDLE,)

    def cuStreamSynchronize(self, s: int) -> tuple[int]:
        self._need_ctx()
        self._wait_for_kernels()
        return (SUCCESS,) if self._stream_ok(s) else (INVALID_HANDLE,)

    cuStreamQuery = cuStreamSynchronize

    def cuStreamWaitEvent(self, s: int, e: int, flags: int) -> tuple[int]:
        return (SUCCESS,) if self._stream_ok(s) and e in self.events else (INVALID_HANDLE,)

    def cuStreamGetPriority(self, s: int) -> tuple[int, int]:
        return (SUCCESS, self.streams.get(s, (0, 0))[1]) if self._stream_ok(s) else (INVALID_HANDLE, 0)

    def cuStreamGetFlags(self, s: int) -> tuple[int, int]:
        return (SUCCESS, self.streams.get(s, (0, 0))[0]) if self._stream_ok(s) else (INVALID_HANDLE, 0)

    def cuStreamGetCtx(self, s: int) -> tuple[int, int]:
        return (SUCCESS, self.current) if self._stream_ok(s) else (INVALID_HANDLE, 0)

    def cuStreamGetId(self, s: int) -> tuple[int, int]:
        return (SUCCESS, s & 0xFFFFFF) if self._stream_ok(s) else (INVALID_HANDLE, 0)

    def cuStreamGetDevice(self, s: int) -> tuple[int, int]:
        return (SUCCESS, 0) if self._stream_ok(s) else (INVALID_HANDLE, 0)

    def cuEventCreate(self, flags: int) -> tuple[int, int]:
        self._need_ctx()
        if flags & ~0x7 or (flags & 0x4 and not flags & 0x2):   # INTERPROCESS needs DISABLE_TIMING
            return (INVALID_VALUE, 0)
        if self.max_events and len(self.events) >= self.max_events:
            return (OUT_OF_MEMORY, 0)
        h = self.handles.new()
        self.events[h] = None
        return (SUCCESS, h)

    def event_create(self, flags: int) -> int:
        """rgpuEventCreate: the event behind a client's handle (worker/client_handles.py)."""
        r, h = self.cuEventCreate(flags)
        if r != SUCCESS:
            raise CudaError(r)
        return h

    def cuEventRecord(self, e: int, s: int) -> tuple[int]:
        if e not in self.events or not self._stream_ok(s):
            return (INVALID_HANDLE,)
        self.events[e] = time.perf_counter()
        return (SUCCESS,)

    def cuEventRecordWithFlags(self, e: int, s: int, flags: int) -> tuple[int]:
        return self.cuEventRecord(e, s)

    def cuEventQuery(self, e: int) -> tuple[int]:
        return (SUCCESS,) if e in self.events else (INVALID_HANDLE,)

    cuEventSynchronize = cuEventQuery

    def cuEventDestroy_v2(self, e: int) -> tuple[int]:
        return (SUCCESS,) if self.events.pop(e, 0) != 0 else (INVALID_HANDLE,)

    def cuEventElapsedTime(self, start: int, end: int) -> tuple[int, float]:
        a, b = self.events.get(start), self.events.get(end)
        if a is None or b is None:
            return (INVALID_HANDLE, 0.0)
        return (SUCCESS, (b - a) * 1000.0)

    cuEventElapsedTime_v2 = cuEventElapsedTime
