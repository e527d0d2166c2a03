"""The native launch loop (librgpu-worker.so), loaded when the dispatcher built it: launches, the
pipelined event operations and 1-D memsets, and the table of the client's events it shares with
ClientEvents."""

from __future__ import annotations

import ctypes
import logging
from typing import Any, NamedTuple

from rgpu.remoting.native.generated import api_gen
from rgpu.remoting.datapath.worker.client_handles import event_attributes
from rgpu.remoting.datapath.worker.spec import SessionSpec

log = logging.getLogger("rgpu.worker")

ADMITTED_SLOTS = 1 << 14   # a power of two
STREAM_SLOTS = 1 << 12     # a power of two: (client handle, driver stream) pairs
# The event operations the C loop runs, in the order of worker_loop.h's RGPU_EV_* (and its arrays).
EVENT_OPS = ("rgpuEventCreate", "cuEventRecord", "cuEventRecordWithFlags", "cuStreamWaitEvent", "cuEventDestroy_v2")
# Those that put work on a stream: the compute limiter gates them as it gates launches.
GPU_WORK_EVENT_OPS = ("cuEventRecord", "cuEventRecordWithFlags", "cuStreamWaitEvent")
# The copy the C loop answers when it is small (worker_copies.c), and how small: what `tensor.item()`
# and other small reads of results ask for; larger ones take the chunked path in Python.
DTOH_OP = "cuMemcpyDtoHAsync_v2"
SMALL_DTOH_MAX = 65536
# The pipelined 1-D memsets the C loop runs, in the order of worker_loop.h's RGPU_MEMSET_* (GPU work).
MEMSET_OPS = ("cuMemsetD8Async", "cuMemsetD16Async", "cuMemsetD32Async")


class EventEntries(NamedTuple):
    """The driver's entry points for the event operations, by exact symbol (0: not there, the
    operation stays in Python)."""
    create: int                 # cuEventCreate
    record: int                 # cuEventRecord
    record_with_flags: int      # cuEventRecordWithFlags
    wait: int                   # cuStreamWaitEvent
    destroy: int                # cuEventDestroy_v2


class _Loop(ctypes.Structure):
    """worker_loop.h's rgpu_loop, field by field (change both together)."""
    _fields_ = [("launch", ctypes.c_void_p), ("event_create", ctypes.c_void_p), ("event_record", ctypes.c_void_p),
                ("event_record_flags", ctypes.c_void_p), ("stream_wait", ctypes.c_void_p),
                ("event_destroy", ctypes.c_void_p), ("admitted", ctypes.c_void_p), ("streams", ctypes.c_void_p),
                ("events", ctypes.c_void_p), ("admitted_mask", ctypes.c_uint32), ("stream_mask", ctypes.c_uint32),
                ("launch_op", ctypes.c_uint32), ("event_ops", ctypes.c_uint32 * len(EVENT_OPS)),
                ("gpu_work_ok", ctypes.c_uint32), ("events_ok", ctypes.c_uint32), ("first_error", ctypes.c_int32),
                ("last_op", ctypes.c_uint32), ("failed_code", ctypes.c_int32), ("first_error_op", ctypes.c_uint32),
                ("failed_handle", ctypes.c_uint64), ("errors", ctypes.c_uint64), ("run_events", ctypes.c_uint64),
                ("launched", ctypes.c_uint64), ("event_counts", ctypes.c_uint64 * len(EVENT_OPS)),
                ("memcpy_dtoh", ctypes.c_void_p), ("stream_capturing", ctypes.c_void_p), ("dtoh_buf", ctypes.c_void_p),
                ("dtoh_max", ctypes.c_uint32), ("sock", ctypes.c_int32), ("dtoh_op", ctypes.c_uint32),
                ("replies_ok", ctypes.c_uint32), ("copy_failed", ctypes.c_int32), ("copy_seq", ctypes.c_uint32),
                ("send_errno", ctypes.c_int32), ("pad2", ctypes.c_uint32),
                ("copies", ctypes.c_uint64), ("sent", ctypes.c_uint64),
                ("launch_ex", ctypes.c_void_p), ("event_attrs", ctypes.c_uint32 * 2), ("launched_ex", ctypes.c_uint64),
                ("memset_d8", ctypes.c_void_p), ("memset_d16", ctypes.c_void_p), ("memset_d32", ctypes.c_void_p),
                ("memset_ops", ctypes.c_uint32 * len(MEMSET_OPS)), ("pad3", ctypes.c_uint32),
                ("memsets", ctypes.c_uint64)]


class NativeEventTable:
    """The client's events -> the driver's, kept in C (worker_events.c) because the C loop creates
    and destroys events itself; ClientEvents reads and writes it through here (one table, one
    truth). Values are the driver's event, or client_handles.EVENT_FAILED | the code its creation
    failed with."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.rgpu_events_new.restype = ctypes.c_void_p
        lib.rgpu_events_free.argtypes = [ctypes.c_void_p]
        lib.rgpu_events_free.restype = None
        lib.rgpu_events_count.argtypes = [ctypes.c_void_p]
        lib.rgpu_events_count.restype = ctypes.c_uint32
        for name in ("rgpu_events_get", "rgpu_events_take"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)]
            fn.restype = ctypes.c_int
        lib.rgpu_events_put.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
        lib.rgpu_events_put.restype = ctypes.c_int
        self.address = lib.rgpu_events_new()
        if not self.address:
            raise MemoryError("rgpu: worker: cannot allocate the native event table")
        self._free = lib.rgpu_events_free
        self._get, self._take, self._put = lib.rgpu_events_get, lib.rgpu_events_take, lib.rgpu_events_put
        self._count = lib.rgpu_events_count
        self._value = ctypes.c_uint64(0)
        self._value_ref = ctypes.byref(self._value)

    def get(self, handle: int) -> int | None:
        return self._value.value if handle and self._get(self.address, handle, self._value_ref) else None

    def take(self, handle: int) -> int | None:
        return self._value.value if handle and self._take(self.address, handle, self._value_ref) else None

    def put(self, handle: int, value: int) -> None:
        if handle and not self._put(self.address, handle, value):
            raise MemoryError("rgpu: worker: the native event table cannot grow")

    def __len__(self) -> int:
        return int(self._count(self.address))

    def __del__(self) -> None:
        address, self.address = getattr(self, "address", 0), 0
        if address:
            self._free(address)


class MemsetEntries(NamedTuple):
    """The driver's entry points for the pipelined 1-D memsets, by exact symbol (not the _ptsz
    variants: the Python path calls these); 0: that width stays in Python."""
    d8: int                     # cuMemsetD8Async
    d16: int                    # cuMemsetD16Async
    d32: int                    # cuMemsetD32Async


class CopyEntries(NamedTuple):
    """The driver's entry points for the small device-to-host copies the C loop answers
    (worker_copies.c), by exact symbol; 0 in either: copies stay in Python."""
    memcpy_dtoh: int            # cuMemcpyDtoHAsync_v2
    stream_capturing: int       # cuStreamIsCapturing


class NativeLaunches:
    """The C loop in librgpu-worker.so that runs a whole run of launch frames, and the plain
    event operations and 1-D memsets among them, straight from the receive buffer with the
    driver's own entry points (remoting/native/src/worker_launch.c). The Python path costs a few
    microseconds per frame, which would cap a launch storm (and cuDNN's RNNs send two event frames
    per launch)."""

    def __init__(self, library: str, launch_entry: int, event_entries: EventEntries | None = None,
                 copy_entries: CopyEntries | None = None, sock: int = -1, launch_ex_entry: int = 0,
                 memset_entries: MemsetEntries | None = None) -> None:
        lib = ctypes.CDLL(library)
        lib.rgpu_loop_size.restype = ctypes.c_size_t
        if lib.rgpu_loop_size() != ctypes.sizeof(_Loop):   # a library of another rgpu version
            raise OSError(f"{library} lays out its loop state in {lib.rgpu_loop_size()} bytes, this worker in "
                          f"{ctypes.sizeof(_Loop)} (rebuild it: python -m rgpu.remoting.native.build)")
        run = lib.rgpu_run
        run.restype = ctypes.c_size_t
        run.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_void_p]
        self._run = run
        # The kernels the worker admitted (their local memory charged): the C loop launches only
        # these, by an open-addressing table of handles kept at most 3/4 full (past that, new
        # kernels launch in Python, still correct).
        self._table = (ctypes.c_uint64 * ADMITTED_SLOTS)()
        self._admitted = 0
        # The client's streams (protocol 8) and the driver's, for the C loop: pairs in an
        # open-addressing table, rebuilt from `_streams` when destroyed handles crowd it; past 3/4
        # full, launches on new streams run in Python (still correct).
        self._stream_table = (ctypes.c_uint64 * (2 * STREAM_SLOTS))()
        self._streams: dict[int, int] = {}
        self._stream_keys = 0
        # The client's events: a table the C loop owns (it creates and destroys events itself).
        self.events = NativeEventTable(lib)
        loop = _Loop()
        loop.launch = launch_entry
        # Launches with attributes (cuBLAS's and cuDNN's Hopper kernels): cuLaunchKernelEx, with the
        # attributes that carry a client event translated through the event table.
        loop.launch_ex = launch_ex_entry or None
        loop.event_attrs[:] = (sorted(event_attributes()) + [0, 0])[:2]
        loop.admitted, loop.admitted_mask = ctypes.addressof(self._table), ADMITTED_SLOTS - 1
        loop.streams, loop.stream_mask = ctypes.addressof(self._stream_table), STREAM_SLOTS - 1
        loop.events = self.events.address
        loop.launch_op = api_gen.OPCODES["cuLaunchKernel"]
        for i, name in enumerate(EVENT_OPS):
            loop.event_ops[i] = api_gen.OPCODES[name]
        if event_entries is not None:
            (loop.event_create, loop.event_record, loop.event_record_flags, loop.stream_wait,
             loop.event_destroy) = (address or None for address in event_entries)
        # Pipelined 1-D memsets (PyTorch zeroes gradients and workspaces so): GPU work, as launches.
        memsets = memset_entries or MemsetEntries(0, 0, 0)
        loop.memset_d8, loop.memset_d16, loop.memset_d32 = (address or None for address in memsets)
        for i, name in enumerate(MEMSET_OPS):
            loop.memset_ops[i] = api_gen.OPCODES[name]
        # Small device-to-host copies (worker_copies.c): their data and reply go out on `sock`.
        self._dtoh_buf = ctypes.create_string_buffer(SMALL_DTOH_MAX)
        loop.sock = sock
        if copy_entries is not None and all(copy_entries) and sock >= 0:
            loop.memcpy_dtoh, loop.stream_capturing = copy_entries
            loop.dtoh_buf, loop.dtoh_max = ctypes.addressof(self._dtoh_buf), SMALL_DTOH_MAX
            loop.dtoh_op = api_gen.OPCODES[DTOH_OP]
        self._loop = loop
        self._loop_ref = ctypes.byref(loop)
        # The operations the C loop may run, and those of them the compute limiter gates.
        entries = event_entries or EventEntries(0, 0, 0, 0, 0)
        memset_ops = [api_gen.OPCODES[name] for name, address in zip(MEMSET_OPS, memsets) if address]
        self.ops = frozenset([loop.launch_op] + [api_gen.OPCODES[name] for name, address in zip(EVENT_OPS, entries)
                                                 if address] + ([loop.dtoh_op] if loop.dtoh_op else []) + memset_ops)
        self.gpu_work_ops = frozenset([loop.launch_op, loop.dtoh_op, *memset_ops]
                                      + [api_gen.OPCODES[n] for n in GPU_WORK_EVENT_OPS]) & self.ops
        self.failed_copy: tuple[int, int] | None = None       # the last run's refused copy (seq, code)
        self.send_error = 0  # the last run's socket error (errno): the session is over
        self.failed_creation: tuple[int, int] | None = None   # the last run's (client handle, code)
        self.errors = 0      # the last run's failed launches and event operations
        self.ran_events = 0  # the last run's event operations
        self.last_op = 0     # the last run's last operation
        self.first_error_op = 0   # the operation of the last run's first error
        self.ran_copies = 0  # the last run's copies answered
        self.ran_memsets = 0  # the last run's memsets

    @property
    def launched(self) -> ctypes.c_uint64:
        """Launches run in C so far (a c_uint64, as before: `.value`)."""
        return ctypes.c_uint64(self._loop.launched)

    @property
    def launched_with_attributes(self) -> int:
        """Launches with attributes run in C so far (also counted in `launched`)."""
        return int(self._loop.launched_ex)

    def event_counts(self) -> dict[str, int]:
        """Event operations run in C so far, by name (RGPU_WORKER_PROFILE's "native_event_ops")."""
        return {name: int(n) for name, n in zip(EVENT_OPS, self._loop.event_counts)}

    def event_ops(self) -> int:
        return int(sum(self._loop.event_counts))

    @property
    def memsets(self) -> int:
        """Pipelined 1-D memsets run in C so far (RGPU_WORKER_PROFILE's "native_memsets")."""
        return int(self._loop.memsets)

    @property
    def copies(self) -> int:
        """Small device-to-host copies answered in C so far."""
        return int(self._loop.copies)

    @property
    def sent(self) -> int:
        """Bytes the C loop sent so far (the copies' data and replies)."""
        return int(self._loop.sent)

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

    def run(self, address: int, available: int, ctx: int, *, gpu_work: bool = True,
            events: bool = True, replies: bool = True) -> tuple[int, int]:
        """(bytes consumed, first error or 0). `gpu_work` False stops before a launch, record,
        wait, memset or copy (the compute limiter's turn is not held); `events` False leaves every
        event frame to Python; `replies` False leaves copies to Python (an error waits to be
        reported, or another thread may send). A creation that failed (it ends the run) is left in
        `failed_creation`, a copy the driver refused (it ends the run, unanswered) in
        `failed_copy`, a socket that failed in `send_error`."""
        loop = self._loop
        loop.gpu_work_ok = gpu_work
        loop.events_ok = events
        loop.replies_ok = replies
        copies_before, memsets_before = loop.copies, loop.memsets
        used = self._run(address, available, ctx, self._loop_ref)
        error, self.errors, self.last_op, self.ran_events = loop.first_error, loop.errors, loop.last_op, loop.run_events
        self.first_error_op = loop.first_error_op
        self.ran_copies = loop.copies - copies_before
        self.ran_memsets = loop.memsets - memsets_before
        self.failed_creation = (loop.failed_handle, loop.failed_code) if loop.failed_code else None
        self.failed_copy = (loop.copy_seq, loop.copy_failed) if loop.copy_failed else None
        self.send_error = loop.send_errno
        loop.first_error = loop.errors = loop.last_op = loop.failed_code = loop.first_error_op = 0
        loop.failed_handle = loop.run_events = 0
        loop.copy_failed = loop.copy_seq = loop.send_errno = 0
        return used, error


def load_native_launches(spec: SessionSpec, backend: Any, sock: int = -1) -> NativeLaunches | None:
    """The native launch loop when the dispatcher built it and the backend launches on a real
    driver; None runs launches in Python (the emulated device, or no C compiler on the node)."""
    entry = getattr(backend, "launch_entry", None)
    if not spec.launch_library or entry is None:
        return None
    events = getattr(backend, "event_entries", None)
    copies = getattr(backend, "copy_entries", None)
    launch_ex = getattr(backend, "launch_ex_entry", None)
    memsets = getattr(backend, "memset_entries", None)
    try:
        return NativeLaunches(spec.launch_library, entry(), events() if events is not None else None,
                              CopyEntries(*copies()) if copies is not None else None, sock,
                              launch_ex() if launch_ex is not None else 0,
                              MemsetEntries(*memsets()) if memsets is not None else None)
    except (OSError, AttributeError) as exc:
        log.warning("native launch loop unavailable (%s); launches run in Python, at a lower rate", exc)
        return None

