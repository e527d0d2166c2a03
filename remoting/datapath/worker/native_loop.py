"""The native launch loop (librgpu-worker.so), loaded when the dispatcher built it."""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from rgpu.remoting.datapath.worker.spec import SessionSpec

log = logging.getLogger("rgpu.worker")

ADMITTED_SLOTS = 1 << 14   # a power of two
STREAM_SLOTS = 1 << 12     # a power of two: (client handle, driver stream) pairs


class NativeLaunches:
    """The C loop in librgpu-worker.so that runs a whole run of plain launch frames straight from
    the receive buffer with the driver's cuLaunchKernel (remoting/native/src/worker_launch.c).
    The Python path costs a few microseconds per launch, which would cap a launch storm."""

    def __init__(self, library: str, launch_entry: int) -> None:
        lib = ctypes.CDLL(library)
        run = lib.rgpu_run_launches
        run.restype = ctypes.c_size_t
        run.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p,
                        ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                        ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32]
        self._run = run
        # The kernels the worker admitted (their local memory charged): the C loop launches only
        # these, by an open-addressing table of handles kept at most 3/4 full (past that, new
        # kernels launch in Python, still correct).
        self._table = (ctypes.c_uint64 * ADMITTED_SLOTS)()
        self._table_address = ctypes.addressof(self._table)
        self._admitted = 0
        # The client's streams (protocol 8) and the driver's, for the C loop: pairs in an
        # open-addressing table, rebuilt from `_streams` when destroyed handles crowd it; past 3/4
        # full, launches on new streams run in Python (still correct).
        self._stream_table = (ctypes.c_uint64 * (2 * STREAM_SLOTS))()
        self._stream_table_address = ctypes.addressof(self._stream_table)
        self._streams: dict[int, int] = {}
        self._stream_keys = 0
        self._entry = launch_entry
        self.error = ctypes.c_int32(0)
        self.launched = ctypes.c_uint64(0)
        self._error_ref = ctypes.byref(self.error)
        self._launched_ref = ctypes.byref(self.launched)

    def admit(self, f: int) -> None:
        """Let the C loop launch kernel f."""
        if not f or self._admitted >= ADMITTED_SLOTS * 3 // 4:
            return
        mask = ADMITTED_SLOTS - 1
        i = (f >> 4) & mask
        while self._table[i] not in (0, f):
            i = (i + 1) & mask
        if self._table[i] == 0:
            self._table[i] = f
            self._admitted += 1

    def set_stream(self, handle: int, real: int) -> None:
        """The client's stream `handle` is the driver's `real` (0: destroyed)."""
        if real:
            self._streams[handle] = real
        else:
            self._streams.pop(handle, None)
        if self._stream_keys >= STREAM_SLOTS * 3 // 4:
            ctypes.memset(self._stream_table, 0, ctypes.sizeof(self._stream_table))
            self._stream_keys = 0
            for h, r in list(self._streams.items())[:STREAM_SLOTS * 3 // 4 - 1]:
                self._place(h, r)
            return
        self._place(handle, real)

    def _place(self, handle: int, real: int) -> None:
        mask = STREAM_SLOTS - 1
        i = ((handle ^ (handle >> 29)) & 0xFFFFFFFF) & mask
        table = self._stream_table
        while table[2 * i] not in (0, handle):
            i = (i + 1) & mask
        if table[2 * i] == 0:
            if not real:
                return   # never placed: nothing to mark
            self._stream_keys += 1
            table[2 * i] = handle
        table[2 * i + 1] = real

    def run(self, address: int, available: int, ctx: int, launch_op: int) -> tuple[int, int]:
        """(bytes consumed, first launch error or 0)."""
        used = self._run(address, available, ctx, launch_op, self._entry, self._error_ref, self._launched_ref,
                         self._table_address, ADMITTED_SLOTS - 1, self._stream_table_address, STREAM_SLOTS - 1)
        error = self.error.value
        if error:
            self.error.value = 0
        return used, error


def load_native_launches(spec: SessionSpec, backend: Any) -> NativeLaunches | None:
    """The native launch loop when the dispatcher built it and the backend launches on a real
    driver; None runs launches in Python (the emulated device, or no C compiler on the node)."""
    entry = getattr(backend, "launch_entry", None)
    if not spec.launch_library or entry is None:
        return None
    try:
        return NativeLaunches(spec.launch_library, entry())
    except (OSError, AttributeError) as exc:
        log.warning("native launch loop unavailable (%s); launches run in Python, at a lower rate", exc)
        return None

