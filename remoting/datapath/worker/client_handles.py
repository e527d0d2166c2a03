"""Handles the client made: events and streams (protocol 8).

`cuEventCreate` and `cuEventDestroy_v2` cost the application no round trip: the client library
hands out its own handle at once and the creation travels pipelined (`rgpuEventCreate`, async),
like a launch. The worker creates the real event when the frame arrives and keeps the client's
handle -> the driver's handle here; every operation that names an event translates it (the
generated handlers through `real`, which api_gen.py finds as the backend's `client_events`, and
launch attributes through `launch_attrs`). Streams work the same way (`rgpuStreamCreate`,
`ClientStreams`); the NULL, legacy and per-thread streams pass unchanged, and the C launch loop
reads the pairs from a table the worker keeps beside the dict (native_loop.py).

A creation that fails is an asynchronous error: it answers the client's next synchronising call
with a line naming `cuEventCreate`, and each later use of that handle fails with
CUDA_ERROR_INVALID_HANDLE naming the failed creation (the client cannot know, the handle was
already the application's). The failed handle's entry stays until the application destroys it.

The worker's C loop (worker_launch.c) runs plain event creations, records, waits and destructions
itself, so with it the event table is the C loop's (worker_events.c) and ClientEvents reads and
writes that one through ctypes (native_loop.NativeEventTable): one table, whichever side ran the
frame.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import lru_cache
from typing import Protocol

from rgpu.remoting.datapath.backends.base import INVALID_HANDLE, CudaError, enums

# The CUlaunchAttributeID names whose value is a CUevent (at the start of the value union); their
# numbers come from cuda.h's enums (cuda_enums.txt). 4 is CLUSTER_DIMENSION: cuBLAS launches with
# clusters of (1, 7) and (1, 8), which read as a u64 look like event handles.
_EVENT_ATTRIBUTE_NAMES = ("CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_EVENT", "CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT")


@lru_cache(maxsize=1)
def event_attributes() -> frozenset[int]:
    ids = enums().get("CUlaunchAttributeID", {})
    return frozenset(ids[name] for name in _EVENT_ATTRIBUTE_NAMES)
_ATTR_ID = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def error_name(code: int) -> str:
    for name, value in enums().get("CUresult", {}).items():
        if value == code:
            return name
    return f"CUDA error {code}"


# A value in an event table that is not the driver's event: FAILED | the code the creation failed with.
EVENT_FAILED = 1 << 63


class EventTable(Protocol):
    """Where the client's event handles and their values live: a dict here, or the C loop's own
    table (native_loop.NativeEventTable), since the C loop creates and destroys events itself."""

    def get(self, handle: int) -> int | None: ...
    def take(self, handle: int) -> int | None: ...
    def put(self, handle: int, value: int) -> None: ...


class DictEventTable:
    def __init__(self) -> None:
        self.values: dict[int, int] = {}

    def get(self, handle: int) -> int | None:
        return self.values.get(handle)

    def take(self, handle: int) -> int | None:
        return self.values.pop(handle, None)

    def put(self, handle: int, value: int) -> None:
        self.values[handle] = value


class ClientEvents:
    """The client's event handles and the driver's events they stand for, for one session. One
    table holds both the live handles and those whose creation failed (with its code): the C loop
    reads and writes the same one when the worker runs it (native_loop.py)."""

    def __init__(self, table: EventTable | None = None) -> None:
        self.table: EventTable = table if table is not None else DictEventTable()

    def created(self, handle: int, real: int) -> None:
        self.table.put(handle, real)

    def creation_failed(self, handle: int, code: int) -> CudaError:
        self.table.put(handle, EVENT_FAILED | (code & 0xFFFFFFFF))
        return self.creation_error(handle, code)

    @staticmethod
    def creation_error(handle: int, code: int) -> CudaError:
        return CudaError(code, f"rgpu: worker: cuEventCreate (event 0x{handle:x}) failed on the GPU server with "
                               f"{error_name(code)}; the application's calls after it were pipelined and this is "
                               "the first synchronising one (free GPU resources, or create fewer events)")

    def real(self, handle: int, call: str, take: bool = False) -> int:
        """The driver's event for a client handle (NULL stays NULL: the driver refuses it)."""
        if not handle:
            return 0
        value = self.table.take(handle) if take else self.table.get(handle)
        if value is not None and not value & EVENT_FAILED:
            return value
        if value is not None:
            code = value & 0xFFFFFFFF
            code = code - (1 << 32) if code & 0x80000000 else code
            raise CudaError(INVALID_HANDLE, f"rgpu: worker: {call}: event 0x{handle:x} does not exist (its "
                                            f"cuEventCreate failed with {error_name(code)})")
        raise CudaError(INVALID_HANDLE, f"rgpu: worker: {call}: event 0x{handle:x} does not exist (destroyed, or "
                                        "made by another process or slice)")

    def launch_attrs(self, attrs: bytes, size: int) -> bytes:
        """Launch attributes with their events translated (programmatic and completion events)."""
        out: bytearray | None = None
        with_events = event_attributes()
        for off in range(0, len(attrs) - size + 1, size):
            (attr_id,) = _ATTR_ID.unpack_from(attrs, off)
            if attr_id in with_events:
                if out is None:
                    out = bytearray(attrs)
                (handle,) = _U64.unpack_from(attrs, off + 8)
                _U64.pack_into(out, off + 8, self.real(handle, "cuLaunchKernelEx"))
        return bytes(out) if out is not None else attrs



# CU_STREAM_LEGACY and CU_STREAM_PER_THREAD (and NULL): the same values on every side.
SPECIAL_STREAMS = (0, 1, 2)


class ClientStreams:
    """The client's stream handles and the driver's streams they stand for, for one session.
    `on_change(handle, real)` (real 0: gone) mirrors the pairs into the C launch loop's table."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.failed: dict[int, int] = {}
        self.on_change: Callable[[int, int], None] | None = None

    def created(self, handle: int, real: int) -> None:
        self.failed.pop(handle, None)
        self.live[handle] = real
        if self.on_change is not None:
            self.on_change(handle, real)

    def creation_failed(self, handle: int, code: int) -> CudaError:
        self.failed[handle] = code
        if len(self.failed) > 4096:
            for old in list(self.failed)[:2048]:
                del self.failed[old]
        return CudaError(code, f"rgpu: worker: cuStreamCreate (stream 0x{handle:x}) failed on the GPU server with "
                               f"{error_name(code)}; the application's calls after it were pipelined and this is "
                               "the first synchronising one")

    def real(self, handle: int, call: str, take: bool = False) -> int:
        if handle in SPECIAL_STREAMS:
            return handle
        real = self.live.pop(handle, None) if take else self.live.get(handle)
        if real is not None:
            if take and self.on_change is not None:
                self.on_change(handle, 0)
            return real
        code = self.failed.pop(handle, None) if take else self.failed.get(handle)
        if code is not None:
            raise CudaError(INVALID_HANDLE, f"rgpu: worker: {call}: stream 0x{handle:x} does not exist (its "
                                            f"cuStreamCreate failed with {error_name(code)})")
        raise CudaError(INVALID_HANDLE, f"rgpu: worker: {call}: stream 0x{handle:x} does not exist (destroyed, or "
                                        "made by another process or slice)")
