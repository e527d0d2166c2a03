"""The worker: one process per session on the GPU node, owning that session's GPU state.

The session server (sessions.py) accepts a connection, checks the lease token and both protocol
versions, then starts `python -m rgpu.remoting.worker --fd N` with the connected socket
inherited as fd N and the session's facts in $RGPU_WORKER_SESSION (JSON). The worker opens the
backend (a CUDA context on the slice's GPU, or the emulated device), answers WELCOME (or REFUSE
with the reason), and serves frames until the client says BYE or disconnects. Everything the
session held dies with the process, and a crash ends only this session: the client sees its
connection close and reports that clearly.

Requests are served in order on one thread. Async operations (launches, memsets, host-to-device
copies, event records) get no reply; the first error among them is kept and returned by the
next sync call instead of running that call, so errors surface at the next synchronising call.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rgpu.remoting import api_gen, protocol
from rgpu.remoting.backends.base import (
    INVALID_VALUE,
    NOT_SUPPORTED,
    NVML_ERROR_NOT_SUPPORTED,
    SUCCESS,
    UNKNOWN,
    CudaError,
    FnInfo,
    LoadResult,
    SliceMemory,
    human_bytes,
)

log = logging.getLogger("rgpu.worker")

OP = api_gen.OPCODES
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_HEADER = protocol.HEADER
_LAUNCH = struct.Struct("<QQ12I")      # f, stream, grid[3], block[3], shmem, coop, nattrs, argsize, pad, pad
_COPY = struct.Struct("<QQQ")          # address, stream, size
_ALLOC = struct.Struct("<QQQQI")       # size, a, b, height, elem
_LAUNCH_ATTR_SIZE = 72


@dataclass(frozen=True)
class SessionSpec:
    """What the session server tells the worker about its session (from the verified token)."""

    mode: str                 # "cuda" or "nvml"
    backend: str              # "cuda" or "emulated"
    gpu_uuid: str
    gpu_index: int
    gpu_name: str
    gpu_total_memory: int
    compute_capability: str
    memory_limit: int
    compute_percent: int
    job_key: str
    slice_number: int
    usage_dir: str            # this slice's usage files (one per CUDA session)
    server: str
    compute_enforcement: str  # "mps" or "time-slicing"
    client: dict[str, Any]
    launch_library: str = ""  # librgpu-worker.so (the native launch loop); "" runs launches in Python

    @classmethod
    def from_json(cls, text: str) -> SessionSpec:
        data = json.loads(text)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class NativeLaunches:
    """The C loop in librgpu-worker.so that runs a whole run of plain launch frames straight from
    the receive buffer with the driver's cuLaunchKernel (remoting/native/src/worker_launch.c).
    The Python path costs a few microseconds per launch, which would cap a launch storm."""

    def __init__(self, library: str, launch_entry: int) -> None:
        lib = ctypes.CDLL(library)
        run = lib.rgpu_run_launches
        run.restype = ctypes.c_size_t
        run.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p,
                        ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_uint64)]
        self._run = run
        self._entry = launch_entry
        self.error = ctypes.c_int32(0)
        self.launched = ctypes.c_uint64(0)
        self._error_ref = ctypes.byref(self.error)
        self._launched_ref = ctypes.byref(self.launched)

    def run(self, address: int, available: int, ctx: int, launch_op: int) -> tuple[int, int]:
        """(bytes consumed, first launch error or 0)."""
        used = self._run(address, available, ctx, launch_op, self._entry, self._error_ref, self._launched_ref)
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


class FrameReader:
    """Reads frames into one reusable buffer; payload views stay valid until the next read.

    The buffer is a ctypes array so backends can hand its addresses to the driver (the CUDA
    backend pins it, so host-to-device copies go straight from the socket buffer by DMA).
    """

    def __init__(self, sock: socket.socket, size: int = 8 << 20) -> None:
        self.sock = sock
        self.size = size
        self.cbuf = (ctypes.c_char * size)()
        self.base = ctypes.addressof(self.cbuf)
        self.view = memoryview(self.cbuf).cast("B")
        self.start = 0
        self.end = 0
        self.big: ctypes.Array | None = None

    def _fill(self, need: int) -> None:
        if self.end - self.start >= need:
            return
        if self.start + need > self.size:
            n = self.end - self.start
            self.view[0:n] = self.view[self.start:self.end]
            self.start, self.end = 0, n
        while self.end - self.start < need:
            k = self.sock.recv_into(self.view[self.end:], self.size - self.end)
            if k == 0:
                raise EOFError
            self.end += k

    def next(self) -> tuple[int, int, int, int, int, memoryview, int]:
        """(op, flags, seq, aux, ctx, payload, payload_address)."""
        self._fill(protocol.HEADER_SIZE)
        length, op, flags, seq, aux, ctx = _HEADER.unpack_from(self.view, self.start)
        self.start += protocol.HEADER_SIZE
        if length > protocol.MAX_FRAME:
            raise ValueError(f"frame of {length} bytes")
        if length + 64 <= self.size:
            self._fill(length)
            payload = self.view[self.start:self.start + length]
            address = self.base + self.start
            self.start += length
            return op, flags, seq, aux, ctx, payload, address
        # Larger than the buffer (a big module image): read it into its own array.
        big = (ctypes.c_char * length)()
        bview = memoryview(big).cast("B")
        have = min(self.end - self.start, length)
        bview[0:have] = self.view[self.start:self.start + have]
        self.start += have
        got = have
        while got < length:
            k = self.sock.recv_into(bview[got:], length - got)
            if k == 0:
                raise EOFError
            got += k
        self.big = big
        return op, flags, seq, aux, ctx, bview, ctypes.addressof(big)


def _lp(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _take_str(buf: memoryview, off: int) -> tuple[str, int]:
    (n,) = _U32.unpack_from(buf, off)
    off += 4
    return bytes(buf[off:off + n]).decode("utf-8", "replace"), off + n


def _fn_bytes(fn: FnInfo) -> bytes:
    name = fn.name.encode()
    out = [_U64.pack(fn.handle), _U32.pack(len(name)), name, _U32.pack(len(fn.params))]
    out.extend(struct.pack("<II", o, s) for o, s in fn.params)
    return b"".join(out)


def _fn_without_handle(fn: FnInfo) -> bytes:
    return _fn_bytes(fn)[8:]


def _options(buf: memoryview, off: int) -> tuple[list[tuple[int, int]], int]:
    (n,) = _U32.unpack_from(buf, off)
    off += 4
    out = []
    for _ in range(n):
        opt, value = struct.unpack_from("<iQ", buf, off)
        off += 12
        out.append((opt, value))
    return out, off


class Worker:
    def __init__(self, sock: socket.socket, backend: Any, spec: SessionSpec, memory: SliceMemory | None) -> None:
        self.sock = sock
        self.backend = backend
        self.spec = spec
        self.memory = memory
        self.reader = FrameReader(sock)
        self.current_ctx: int | None = None
        self.deferred: tuple[int, str] | None = None
        self.handlers: dict[int, tuple[Callable[[memoryview, int, int], tuple[int, bytes] | None], bool]] = {}
        self.messages = 0
        self.native_launches = load_native_launches(spec, backend)
        self._build_table()
        register = getattr(backend, "register_host_buffer", None)
        if register is not None:
            register(self.reader.base, self.reader.size)

    # ------------------------------------------------------------------ dispatch table

    def _build_table(self) -> None:
        for opcode, (name, gen) in api_gen.GENERATED_HANDLERS.items():
            is_async = opcode in api_gen.ASYNC_OPS
            if getattr(self.backend, name, None) is None:
                self.handlers[opcode] = (self._unsupported(name), is_async)
            else:
                self.handlers[opcode] = (self._generated(gen), is_async)
        manual: dict[str, tuple[Callable[[memoryview, int, int], tuple[int, bytes] | None], bool]] = {
            "cuInit": (self.h_init, False),
            "cuDeviceTotalMem_v2": (self.h_total_mem, False),
            "cuDevicePrimaryCtxRetain": (self.h_primary_retain, False),
            "cuCtxCreate_v2": (self.h_ctx_create, False),
            "cuCtxCreate_v3": (self.h_ctx_create, False),
            "cuCtxCreate_v4": (self.h_ctx_create, False),
            "cuCtxDestroy_v2": (self.h_ctx_destroy, False),
            "cuMemAlloc_v2": (self.h_alloc("plain"), False),
            "cuMemAllocPitch_v2": (self.h_alloc("pitch"), False),
            "cuMemAllocAsync": (self.h_alloc("async"), False),
            "cuMemAllocFromPoolAsync": (self.h_alloc("pool"), False),
            "cuMemFree_v2": (self.h_free(False), False),
            "cuMemFreeAsync": (self.h_free(True), False),
            "cuMemGetInfo_v2": (self.h_mem_info, False),
            "cuMemPoolSetAttribute": (self.h_pool_attribute(True), False),
            "cuMemPoolGetAttribute": (self.h_pool_attribute(False), False),
            "cuMemcpyHtoDAsync_v2": (self.h_htod, True),
            "cuMemcpyDtoHAsync_v2": (self.h_dtoh, False),
            "rgpuMemcpy2DDevice": (self.h_dtod_2d, True),
            "cuPointerGetAttribute": (self.h_pointer_attribute, False),
            "cuPointerGetAttributes": (self.h_pointer_attributes, False),
            "cuModuleLoadDataEx": (self.h_load("module"), False),
            "cuLibraryLoadData": (self.h_load("library"), False),
            "cuModuleGetFunction": (self.h_get_function, False),
            "cuModuleUnload": (self.h_unload("module"), False),
            "cuLibraryUnload": (self.h_unload("library"), False),
            "cuLinkCreate_v2": (self.h_link_create, False),
            "cuLinkAddData_v2": (self.h_link_add, False),
            "cuLinkComplete": (self.h_link_complete, False),
            "cuLinkDestroy": (self.h_link_destroy, False),
            "cuLaunchKernel": (self.h_launch, True),
            "rgpuParamInfo": (self.h_param_info, False),
            "rgpuOccupancyMaxPotentialBlockSize": (self.h_potential_block_size, False),
            "rgpuSessionInfo": (self.h_session_info, False),
        }
        for name, entry in manual.items():
            self.handlers[OP[name]] = entry
        for name in api_gen.MANUAL_OPS:
            if OP[name] not in self.handlers:
                self.handlers[OP[name]] = (self._unsupported(name), False)

    def _generated(self, gen: Callable[[Any, memoryview, int], tuple[int, bytes]]) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        backend = self.backend

        def run(payload: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            return gen(backend, payload, 0)
        return run

    def _unsupported(self, name: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        code = NVML_ERROR_NOT_SUPPORTED if name.startswith("nvml") else NOT_SUPPORTED
        what = "the emulated device" if getattr(self.backend, "emulated", False) else "this worker"

        # NVML applications probe freely and NVML_ERROR_NOT_SUPPORTED is routine: no message.
        message = "" if name.startswith("nvml") else f"rgpu: worker: {name} is not supported by {what}"

        def run(payload: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            raise CudaError(code, message)
        return run

    # ------------------------------------------------------------------ serving

    def serve(self) -> str:
        """Serve until the client leaves; returns why the session ended."""
        try:
            return self._serve()
        except (EOFError, ConnectionError, OSError):
            return "client disconnected"

    def _serve(self) -> str:
        handlers = self.handlers
        reader = self.reader
        view = reader.view
        unpack_header = _HEADER.unpack_from
        unpack_launch = _LAUNCH.unpack_from
        launch_op = OP["cuLaunchKernel"]
        # Launches are the one operation whose rate matters: a backend may take them straight
        # from the receive buffer (launch_fast), skipping the generic dispatch.
        launch_fast = getattr(self.backend, "launch_fast", None)
        native = self.native_launches
        cuda_mode = self.spec.mode == "cuda"
        while True:
            if reader.end - reader.start < protocol.HEADER_SIZE:
                reader._fill(protocol.HEADER_SIZE)
            length, op, _flags, _seq, _aux, ctx = unpack_header(view, reader.start)
            if op == launch_op and native is not None and ctx == self.current_ctx:
                # Every complete plain launch in the buffer, in one call; what it leaves (a
                # partial frame, a cooperative launch, another op) takes the paths below.
                used, code = native.run(reader.base + reader.start, reader.end - reader.start, ctx, launch_op)
                if code and self.deferred is None:
                    self.deferred = (code, "")
                if used:
                    reader.start += used
                    continue
                if length + 64 <= reader.size and reader.end - reader.start < protocol.HEADER_SIZE + length:
                    reader._fill(protocol.HEADER_SIZE + length)  # cut by a receive: complete it, retry
                    continue
            if op == launch_op and launch_fast is not None and ctx == self.current_ctx and length + 64 <= reader.size:
                if reader.end - reader.start < protocol.HEADER_SIZE + length:
                    reader._fill(protocol.HEADER_SIZE + length)
                at = reader.start + protocol.HEADER_SIZE
                f, stream, gx, gy, gz, bx, by, bz, shmem, coop, nattrs, argsize, _, _ = unpack_launch(view, at)
                if not coop and not nattrs:
                    reader.start = at + length
                    code = launch_fast(f, gx, gy, gz, bx, by, bz, shmem, stream, reader.base + at + _LAUNCH.size, argsize)
                    if code and self.deferred is None:
                        self.deferred = (code, "")
                    continue
            op, _flags, seq, _aux, ctx, payload, address = reader.next()
            if op == protocol.OP_BYE:
                return "client said goodbye"
            entry = handlers.get(op)
            if entry is None:
                if op < 32:
                    return f"unexpected control frame {op}"
                self._reply(seq, NOT_SUPPORTED, b"", f"rgpu: worker: unknown operation {op} (client and server "
                            "builds differ; install the same rgpu version on both)")
                continue
            handler, is_async = entry
            if cuda_mode and ctx != self.current_ctx:
                try:
                    self.backend.set_context(ctx)
                    self.current_ctx = ctx
                except CudaError as exc:
                    if is_async:
                        self._defer(exc.code, exc.message)
                    else:
                        self._reply(seq, exc.code, b"", exc.message)
                    continue
            if not is_async and self.deferred is not None:
                code, message = self.deferred
                self.deferred = None
                self._reply(seq, code, b"", message)
                continue
            try:
                result = handler(payload, address, seq)
            except CudaError as exc:
                if is_async:
                    self._defer(exc.code, exc.message)
                else:
                    self._reply(seq, exc.code, b"", exc.message)
                continue
            except (BrokenPipeError, ConnectionError):
                return "client disconnected"
            except Exception as exc:  # noqa: BLE001 - a bug here must not kill every later call of the session
                name = api_gen.OPS.get(op, str(op))
                log.error("internal error in %s: %s\n%s", name, exc, traceback.format_exc())
                message = f"rgpu: worker: internal error in {name} ({exc!r}; please report it with the dispatcher's log)"
                if is_async:
                    self._defer(UNKNOWN, message)
                else:
                    self._reply(seq, UNKNOWN, b"", message)
                continue
            if is_async:
                if result is not None and result[0] != SUCCESS:
                    self._defer(result[0], "")
            elif result is not None:
                self._reply(seq, result[0], result[1], "")

    def _defer(self, code: int, message: str) -> None:
        if self.deferred is None:
            self.deferred = (code, message)

    def _reply(self, seq: int, result: int, payload: bytes, message: str) -> None:
        flags = 0
        body = _I32.pack(result)
        if message and self.messages < 32:
            self.messages += 1
            flags = protocol.REPLY_HAS_MESSAGE
            body += _lp(message.encode())
        body += payload
        self.sock.sendall(_HEADER.pack(len(body), protocol.OP_REPLY, flags, seq, 0, 0) + body)

    # ------------------------------------------------------------------ contexts

    def h_init(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        return SUCCESS, b""

    def h_total_mem(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        total = self.backend.total_mem()
        limit = self.memory.limit if self.memory else total
        return SUCCESS, _U64.pack(min(total, limit))

    def h_primary_retain(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        ctx = self.backend.primary_ctx_retain()
        return SUCCESS, _U64.pack(ctx)

    def h_ctx_create(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        flags, _dev, _has_params = struct.unpack_from("<IiI", p, 0)
        ctx = self.backend.ctx_create(flags)
        self.current_ctx = ctx  # a new context is current on the creating thread
        return SUCCESS, _U64.pack(ctx)

    def h_ctx_destroy(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (ctx,) = _U64.unpack_from(p, 0)
        self.backend.ctx_destroy(ctx)
        self.current_ctx = None  # whatever the driver made current now, set it again next time
        return SUCCESS, b""

    # ------------------------------------------------------------------ memory

    def h_alloc(self, kind: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            size, a, b, height, elem = _ALLOC.unpack_from(p, 0)
            counted = size * max(height, 1) if kind == "pitch" else size
            assert self.memory is not None
            self.memory.check(counted)
            ptr, pitch = self.backend.mem_alloc(kind, size, a, b, height, elem)
            if kind == "pitch":
                counted = pitch * height
            self.memory.add(ptr, counted)
            return SUCCESS, struct.pack("<QQ", ptr, pitch)
        return run

    def h_free(self, is_async: bool) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            ptr, stream = struct.unpack_from("<QQ", p, 0)
            self.backend.mem_free(ptr, stream, is_async)
            if self.memory is not None:
                self.memory.remove(ptr)
            return SUCCESS, b""
        return run

    def h_mem_info(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        gpu_free, gpu_total = self.backend.mem_info()
        assert self.memory is not None
        total = min(self.memory.limit, gpu_total)
        free = min(self.memory.free_bytes(), gpu_free)
        return SUCCESS, struct.pack("<QQ", free, total)

    def h_pool_attribute(self, set_it: bool) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            pool, attr, value = struct.unpack_from("<QiQ", p, 0)
            out = self.backend.mem_pool_attribute(pool, attr, value, set_it)
            return SUCCESS, _U64.pack(out)
        return run

    def h_htod(self, p: memoryview, address: int, seq: int) -> None:
        dst, stream, size = _COPY.unpack_from(p, 0)
        data = p[24:24 + size]
        if len(data) != size:
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated host-to-device copy")
        self.backend.htod(dst, stream, data, address + 24)

    def h_dtoh(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        src, stream, size = _COPY.unpack_from(p, 0)
        for chunk in self.backend.dtoh_chunks(src, stream, size, protocol.CHUNK_BYTES):
            self.sock.sendmsg([_HEADER.pack(len(chunk), protocol.OP_DATA, 0, 0, 0, 0), chunk])
        return SUCCESS, b""

    def h_dtod_2d(self, p: memoryview, address: int, seq: int) -> None:
        dst, dpitch, src, spitch, width, height, stream = struct.unpack_from("<7Q", p, 0)
        self.backend.dtod_2d(dst, dpitch, src, spitch, width, height, stream)

    def h_pointer_attribute(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        attr, ptr = struct.unpack_from("<iQ", p, 0)
        return SUCCESS, _lp(self.backend.pointer_attribute(attr, ptr))

    def h_pointer_attributes(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (n,) = _U32.unpack_from(p, 0)
        attrs = struct.unpack_from(f"<{n}i", p, 4)
        (ptr,) = _U64.unpack_from(p, 4 + 4 * n)
        out = []
        for attr in attrs:
            try:
                out.append(_lp(self.backend.pointer_attribute(attr, ptr)))
            except CudaError:
                out.append(_lp(b"\0" * 8))  # cuPointerGetAttributes fills, rather than fails
        return SUCCESS, b"".join(out)

    # ------------------------------------------------------------------ modules

    def _load_reply(self, res: LoadResult, with_functions: bool) -> bytes:
        parts = [_U64.pack(res.handle), _U32.pack(len(res.option_values))]
        parts.extend(_U64.pack(v & 0xFFFFFFFFFFFFFFFF) for v in res.option_values)
        parts += [_lp(res.info_log), _lp(res.error_log)]
        if with_functions:
            parts.append(_U32.pack(len(res.functions)))
            parts.extend(_fn_bytes(fn) for fn in res.functions)
        return b"".join(parts)

    def h_load(self, kind: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            options, off = _options(p, 0)
            lib_options, off = _options(p, off)
            (size,) = _U64.unpack_from(p, off)
            off += 8
            image = bytes(p[off:off + size])
            res = self.backend.load(kind, image, options, lib_options)
            code = getattr(res, "code", SUCCESS)
            return code, self._load_reply(res, code == SUCCESS)
        return run

    def h_get_function(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (module,) = _U64.unpack_from(p, 0)
        name, _ = _take_str(p, 8)
        return SUCCESS, _fn_bytes(self.backend.get_function(module, name))

    def h_param_info(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (handle,) = _U64.unpack_from(p, 0)
        return SUCCESS, _fn_without_handle(self.backend.param_info(handle))

    def h_unload(self, kind: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            (handle,) = _U64.unpack_from(p, 0)
            self.backend.unload(kind, handle)
            return SUCCESS, b""
        return run

    def h_link_create(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        options, _ = _options(p, 0)
        return SUCCESS, _U64.pack(self.backend.link_create(options))

    def h_link_add(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        state, kind = struct.unpack_from("<Qi", p, 0)
        name, off = _take_str(p, 12)
        options, off = _options(p, off)
        (size,) = _U64.unpack_from(p, off)
        off += 8
        code, info, error = self.backend.link_add(state, kind, name, options, bytes(p[off:off + size]))
        return code, _lp(info) + _lp(error)

    def h_link_complete(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (state,) = _U64.unpack_from(p, 0)
        code, info, error, cubin = self.backend.link_complete(state)
        body = _lp(info) + _lp(error)
        if code == SUCCESS:
            body += _U64.pack(len(cubin)) + cubin
        return code, body

    def h_link_destroy(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (state,) = _U64.unpack_from(p, 0)
        self.backend.link_destroy(state)
        return SUCCESS, b""

    # ------------------------------------------------------------------ launches

    def h_launch(self, p: memoryview, address: int, seq: int) -> None:
        f, stream, gx, gy, gz, bx, by, bz, shmem, coop, nattrs, argsize, _, _ = _LAUNCH.unpack_from(p, 0)
        off = _LAUNCH.size
        attrs = bytes(p[off:off + nattrs * _LAUNCH_ATTR_SIZE]) if nattrs else b""
        off += nattrs * _LAUNCH_ATTR_SIZE
        self.backend.launch(f, stream, (gx, gy, gz), (bx, by, bz), shmem, bool(coop), attrs,
                            p[off:off + argsize], address + off)

    def h_potential_block_size(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        f, smem, limit, flags = struct.unpack_from("<QQiI", p, 0)
        min_grid, block = self.backend.max_potential_block_size(f, smem, limit, flags)
        return SUCCESS, struct.pack("<ii", min_grid, block)

    def h_session_info(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        info = {"memory_limit": self.memory.limit if self.memory else 0,
                "memory_used": self.memory.used if self.memory else 0,
                "compute_percent": self.spec.compute_percent,
                "compute_enforcement": self.spec.compute_enforcement,
                "backend": self.spec.backend, "gpu": self.spec.gpu_name, "pid": os.getpid(),
                "launch_path": "native" if self.native_launches is not None else "python",
                "native_launches": self.native_launches.launched.value if self.native_launches else 0}
        return SUCCESS, _lp(json.dumps(info).encode())


def _make_backend(spec: SessionSpec) -> Any:
    if spec.backend == "emulated":
        from rgpu.remoting.backends.emulated import EmulatedBackend, EmulatedNvml
        if spec.mode == "nvml":
            return EmulatedNvml(spec)
        return EmulatedBackend(spec)
    if spec.backend == "cuda":
        if spec.mode == "nvml":
            from rgpu.remoting.backends.nvml import RealNvml
            return RealNvml(spec)
        from rgpu.remoting.backends.cuda import CudaBackend
        return CudaBackend(spec)
    raise CudaError(NOT_SUPPORTED, f"rgpu: worker: unknown backend {spec.backend!r}")


def run_session(sock: socket.socket, spec: SessionSpec) -> int:
    started = time.monotonic()
    memory: SliceMemory | None = None
    try:
        backend = _make_backend(spec)
        if spec.mode == "cuda":
            memory = SliceMemory(spec.memory_limit, Path(spec.usage_dir) / f"{os.getpid()}.used")
    except CudaError as exc:
        log.error("session for job %s slice %d refused: %s", spec.job_key, spec.slice_number, exc.message)
        sock.sendall(protocol.encode_refuse(exc.message))
        return 1
    except Exception as exc:  # noqa: BLE001 - any failure to open the GPU is reported to the client
        message = (f"rgpu: worker: cannot open {spec.gpu_name} ({spec.gpu_uuid}) for the session "
                   f"({exc}; check the GPU node with `nvidia-smi` and the dispatcher's log)")
        log.error("%s\n%s", message, traceback.format_exc())
        sock.sendall(protocol.encode_refuse(message))
        return 1
    description = (f"{spec.gpu_name} slice of {human_bytes(spec.memory_limit)}, {spec.compute_percent}% compute "
                   f"({spec.compute_enforcement}{', emulated' if getattr(backend, 'emulated', False) else ''})")
    sock.sendall(protocol.encode_welcome(
        driver_version=getattr(backend, "driver_version", 13000), memory_limit_bytes=spec.memory_limit,
        compute_percent=spec.compute_percent, flags=protocol.WELCOME_EMULATED if getattr(backend, "emulated", False) else 0,
        description=description))
    log.info("session open: job %s slice %d, %s mode, client %s", spec.job_key, spec.slice_number, spec.mode, spec.client)
    worker = Worker(sock, backend, spec, memory)
    try:
        why = worker.serve()
    finally:
        try:
            backend.close()
        except Exception as exc:  # noqa: BLE001 - the session is over either way
            log.warning("closing the backend failed: %s", exc)
        if memory is not None:
            memory.close()
    log.info("session closed after %.1f s: %s", time.monotonic() - started, why)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rgpu session worker (started by the dispatcher)")
    parser.add_argument("--fd", type=int, required=True, help="the accepted session socket, inherited")
    args = parser.parse_args(argv)
    spec = SessionSpec.from_json(os.environ["RGPU_WORKER_SESSION"])
    logging.basicConfig(level=os.environ.get("RGPU_WORKER_LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s rgpu-worker[{os.getpid()}] job={spec.job_key} slice={spec.slice_number} "
                               "%(levelname)s %(message)s")
    sock = socket.socket(fileno=args.fd)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    except OSError:
        pass
    return run_session(sock, spec)


if __name__ == "__main__":
    sys.exit(main())
