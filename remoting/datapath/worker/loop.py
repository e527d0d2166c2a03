"""The worker's serving loop: the dispatch table, the launch fast paths, deferred errors."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from rgpu.log_limit import LogLimit, held_note
from rgpu.remoting.native.generated import api_gen
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.backends.base import (INVALID_VALUE, NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT,
                                                  NVML_ERROR_NOT_SUPPORTED, OUT_OF_MEMORY, SUCCESS, UNKNOWN,
                                                  CudaError, SliceMemory)
from rgpu.remoting.datapath.worker.client_handles import ClientEvents, ClientStreams, error_name
from rgpu.remoting.datapath.worker.codecs import HEADER, I32, LAUNCH, launch_shape, lp
from rgpu.remoting.datapath.worker.faults import STICKY_ERRORS, SessionFaulted, default_message, wait_verdict, write_report
from rgpu.remoting.datapath.worker.frames import NVML_MAX_FRAME, FrameReader, FrameStalled, FrameTooLarge
from rgpu.remoting.datapath.worker.handlers import Handlers
from rgpu.remoting.datapath.worker.hostcalls import HostCalls
from rgpu.remoting.datapath.worker.limiter import ComputeLimiter
from rgpu.remoting.datapath.worker.native_loop import load_native_launches
from rgpu.remoting.datapath.worker.image_cache import ImageCache
from rgpu.remoting.datapath.worker.local_memory import ContextReserves
from rgpu.remoting.datapath.worker.module_footprint import ImageFootprints, parse_capability
from rgpu.remoting.datapath.worker.spec import SessionSpec
from rgpu.remoting.datapath.usage import SessionStats

log = logging.getLogger("rgpu.worker")


def late_error(code: int, call: str) -> str:
    """The line for an error of pipelined work, which the client learns at its next synchronising
    call: it names the call that failed, as the application's own call is not the one at fault."""
    return (f"rgpu: worker: {call} failed with {error_name(code)}; reported at this later call, as CUDA "
            "reports errors of asynchronous work")


OP = api_gen.OPCODES
# Calls that wait for a reply but put work on the GPU (the limiter gates them like launches).
GPU_WORK_OPS = frozenset(OP[name] for name in ("cuMemcpyDtoHAsync_v2", "rgpuMemcpyDtoHLanes", "rgpuMemcpyDtoHShared",
                                               "rgpuMemcpyHtoDSharedWait", "cuMemcpyDtoD_v2", "cuGraphLaunch",
                                               "cuMemsetD8_v2", "cuMemsetD32_v2", "rgpuMemcpyArrayToHost") if name in OP)
# Pipelined calls that put no work on the GPU (client-made handles, attribute sets): the limiter lets
# them through.
NO_WORK_ASYNC_OPS = frozenset(OP[name] for name in ("rgpuEventCreate", "cuEventDestroy_v2", "rgpuStreamCreate",
                                                    "cuStreamDestroy_v2", "rgpuSetAttribute"))


def malformed(op: int, length: int) -> tuple[int, str]:
    """The answer to a request too short for its operation's layout: (error code, one line)."""
    name = api_gen.OPS.get(op, str(op))
    code = NVML_ERROR_INVALID_ARGUMENT if name.startswith("nvml") else INVALID_VALUE
    return code, (f"rgpu: worker: malformed {name} request ({length} bytes do not fit its layout; the client is "
                  "another rgpu build, or not rgpu's: use one rgpu version on both sides)")


class Worker(Handlers):
    def __init__(self, sock: socket.socket, backend: Any, spec: SessionSpec, memory: SliceMemory | None,
                 stats: SessionStats | None = None) -> None:
        self.sock = sock
        self.stats = stats
        self.backend = backend
        self.spec = spec
        self.memory = memory
        self.reader = FrameReader(sock, stall_s=spec.frame_stall_s)
        if spec.mode == "nvml":
            self.reader.max_frame = min(self.reader.max_frame, NVML_MAX_FRAME)
        # Host nodes send from the driver's threads: every frame goes out whole under this lock.
        self.send_lock = threading.Lock()
        self.hostcalls = HostCalls(sock, self.reader, self.send_lock, backend)
        backend.host_calls = self.hostcalls
        self.current_ctx: int | None = None
        self.vmm_refs: dict[int, int] = {}
        self.graph_allocs: dict[int, int] = {}   # graph memory address -> its accounting key
        self.pool_allocs: dict[int, int] = {}    # live stream-ordered allocations -> their size
        self.pool_live = 0                        # their sum
        self.reserves: ContextReserves | None = None   # stack and heap charges (local_memory.py)
        self.admitted: set[int] = set()           # kernels whose local memory is charged
        self.deferred: tuple[int, str] | None = None
        self.handlers: dict[int, tuple[Callable[[memoryview, int, int], tuple[int, bytes] | None], bool]] = {}
        self.messages = 0
        # Traffic counters (published by session.py): calls and errors seen by the Python path;
        # the native launch loop counts its own launches.
        self.calls = 0
        self.errors = 0
        self.sent = 0
        self.log_limit = LogLimit()   # lines a client's frames cause: once a minute per kind and operation
        self.ucx: Any = None          # the session's UCX link (worker/ucx.py), set by session.py
        self.ucx_received = 0         # bytes of host-to-device copies that came on UCX
        self.lanes: Any = None        # the session's data lanes (worker/lanes.py), set by session.py
        self.native_launches = load_native_launches(spec, backend, sock.fileno())
        # The client's event handles -> the driver's (client_handles.py; the generated handlers
        # find the table on the backend). With the C loop, which creates and destroys events
        # itself, the table is the C loop's.
        self.client_events = ClientEvents(self.native_launches.events if self.native_launches is not None else None)
        backend.client_events = self.client_events
        self.client_streams = ClientStreams()
        backend.client_streams = self.client_streams
        # NCCL's peers reach this worker where its client did (backends/nccl_emulated.py, nccl_cuda.py)
        backend.nccl_host = sock.getsockname()[0] if sock.family == socket.AF_INET else "127.0.0.1"
        if self.native_launches is not None:   # the C loop translates the client's streams too
            self.client_streams.on_change = self.native_launches.set_stream
        self.image_cache = ImageCache(spec.image_cache_dir, spec.client.get("uid"), spec.image_cache_bytes)
        self.footprints = ImageFootprints(parse_capability(spec.compute_capability), store=self.image_cache)
        # op -> [calls, handler ns], only with RGPU_WORKER_PROFILE (the C loop's runs: key -1)
        self.profile: dict[int, list[int]] | None = {} if os.environ.get("RGPU_WORKER_PROFILE") else None
        self.load_steps: dict[str, list[int]] | None = {} if self.profile is not None else None
        # Launches the fast paths left to the generic handler, by why (profile only).
        self.generic_launches: dict[str, int] = {}
        # A sticky fault ends the session (faults.py; on an MPS GPU, every session of the GPU);
        # `idle` is true while the loop waits for a new frame, the one moment the dispatcher's
        # signal may interrupt it.
        self.fault: SessionFaulted | None = None
        self.idle = False
        self.last_op = 0
        self.limiter = self._make_limiter()
        self._build_table()
        register = getattr(backend, "register_host_buffer", None)
        if register is not None:
            register(self.reader.base, self.reader.size)

    def _make_limiter(self) -> ComputeLimiter | None:
        """rgpu's own compute limiter, for CUDA sessions on GPUs shared `isolated` (limiter.py)."""
        spec = self.spec
        if spec.sharing != "isolated" or spec.mode != "cuda" or not spec.gpu_dir:
            return None
        fence = getattr(self.backend, "fence", None)

        def wait_for_own_work() -> None:
            with self.hostcalls.lending():   # the GPU may wait for a host node, which waits for the client
                code = fence() if fence is not None else 0
            if code:
                self._defer(code, "")   # an error of the application's work: its next sync call gets it
        log.info("compute limiter on: %d%% of the GPU%s", spec.compute_percent,
                 ", lending idle shares" if spec.compute_lending else "")
        return ComputeLimiter(spec.limits, spec.gpu_dir, spec.compute_lending, wait_for_own_work)

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
            "cuCtxSetLimit": (self.h_set_limit, False),
            "cuMemPoolSetAttribute": (self.h_pool_attribute(True), False),
            "cuMemPoolGetAttribute": (self.h_pool_attribute(False), False),
            "cuMemcpyHtoDAsync_v2": (self.h_htod, True),
            "cuMemcpyDtoHAsync_v2": (self.h_dtoh, False),
            "rgpuMemcpyHtoDUcx": (self.h_htod_ucx, True),
            "rgpuMemcpyDtoHUcx": (self.h_dtoh_ucx, False),
            "rgpuMemcpyHtoDLanes": (self.h_htod_lanes, True),
            "rgpuMemcpyDtoHLanes": (self.h_dtoh_lanes, False),
            "rgpuHostShare": (self.h_host_share, False),
            "rgpuHostUnshare": (self.h_host_unshare, False),
            "rgpuMemcpyHtoDShared": (self.h_htod_shared(False), True),
            "rgpuMemcpyHtoDSharedWait": (self.h_htod_shared(True), False),
            "rgpuMemcpyDtoHShared": (self.h_dtoh_shared, False),
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
            "rgpuEventCreate": (self.h_event_create, True),
            "rgpuStreamCreate": (self.h_stream_create, True),
            "rgpuParamInfo": (self.h_param_info, False),
            "rgpuSetAttribute": (self.h_set_attribute, True),
            "rgpuTensorMap": (self.h_tensor_map, False),
            "rgpuOccupancyMaxPotentialBlockSize": (self.h_potential_block_size, False),
            "cuOccupancyMaxActiveClusters": (self.h_max_active_clusters, False),
            "rgpuSessionInfo": (self.h_session_info, False),
            "rgpuPrivateTableSize": (self.h_private_table_size, False),
            "rgpuModuleNodes": (self.h_module_nodes, False),
            "rgpuStreamCaptureInfo": (self.h_capture_info, False),
            "cuGraphGetNodes": (self.h_graph_nodes, False),
            "cuGraphGetRootNodes": (self.h_graph_roots, False),
            "cuStreamBeginCaptureToGraph": (self.h_capture_to_graph, False),
            "cuGraphExecChildGraphNodeSetParams": (self.h_exec_child_set, False),
            "rgpuGraphAddNode": (self.h_graph_add_node, False),
            "rgpuGraphAddEdges": (self.h_graph_add_edges, False),
            "rgpuGraphKernelNodeSetParams": (self.h_kernel_node_set, False),
            "rgpuCaptureHostFunc": (self.h_capture_host_func, False),
            "rgpuGraphHostNode": (self.h_host_node, False),
            "rgpuGraphHostRefresh": (self.h_graph_host_refresh, True),
            "rgpuGraphHostReadback": (self.h_graph_host_readback, False),
            "rgpuCaptureHostCopy": (self.h_capture_host_copy, False),
            "cuMemCreate": (self.h_mem_create, False),
            "cuMemRelease": (self.h_mem_release, False),
            "cuMemRetainAllocationHandle": (self.h_mem_retain, False),
            "cuMemSetAccess": (self.h_mem_set_access, False),
            "cuArrayCreate_v2": (self.h_array_create("2d"), False),
            "cuArray3DCreate_v2": (self.h_array_create("3d"), False),
            "cuMipmappedArrayCreate": (self.h_array_create("mipmapped"), False),
            "cuArrayDestroy": (self.h_array_destroy("array"), False),
            "cuMipmappedArrayDestroy": (self.h_array_destroy("mipmapped"), False),
            "cuTexObjectCreate": (self.h_tex_object_create, False),
            "rgpuMemcpyArray": (self.h_memcpy_array, True),
            "rgpuMemcpyArrayToHost": (self.h_memcpy_array_to_host, False),
        }
        for name, entry in manual.items():
            self.handlers[OP[name]] = entry
        for name in api_gen.MANUAL_OPS:
            if OP[name] not in self.handlers:
                self.handlers[OP[name]] = (self._unsupported(name), False)
        if self.spec.mode == "nvml":
            # A management session has no CUDA context, and its backend no CUDA calls: each CUDA
            # operation is answered at once (none is deferred to a synchronize) with one line.
            for name, opcode in OP.items():
                if not name.startswith("nvml"):
                    self.handlers[opcode] = (self._not_in_nvml(name), False)

    def _generated(self, gen: Callable[[Any, memoryview, int], tuple[int, bytes]]) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        backend = self.backend

        if not log.isEnabledFor(logging.DEBUG):
            def run(payload: memoryview, address: int, seq: int) -> tuple[int, bytes]:
                return gen(backend, payload, 0)
            return run

        def run_logged(payload: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            # RGPU_WORKER_LOG_LEVEL=debug: a call the driver refuses is logged with its arguments
            # as the client sent them (the client learns only the code, and for pipelined calls late).
            result = gen(backend, payload, 0)
            if result[0] != SUCCESS:
                log.debug("%s refused with %d; its arguments: %s", getattr(gen, "__name__", "?").removeprefix("_h_"),
                          result[0], bytes(payload[:96]).hex())
            return result
        return run_logged

    def _unsupported(self, name: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        code = NVML_ERROR_NOT_SUPPORTED if name.startswith("nvml") else NOT_SUPPORTED
        what = "the emulated device" if getattr(self.backend, "emulated", False) else "this worker"

        # NVML applications probe freely and NVML_ERROR_NOT_SUPPORTED is routine: no message.
        message = "" if name.startswith("nvml") else f"rgpu: worker: {name} is not supported by {what}"

        def run(payload: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            raise CudaError(code, message)
        return run

    def _not_in_nvml(self, name: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        message = (f"rgpu: worker: {name} is not served in an NVML session (a management session has no CUDA "
                   "context; CUDA calls need a CUDA session of the slice)")

        def run(payload: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            raise CudaError(NOT_SUPPORTED, message)
        return run

    # ------------------------------------------------------------------ serving

    def serve(self) -> str:
        """Serve until the client leaves; returns why the session ended."""
        started = time.perf_counter_ns()
        hostcalls = self.hostcalls
        hostcalls.loop_thread = threading.get_ident()
        hostcalls.reader_lock.acquire()   # the loop reads; it lends the reader while a handler runs
        try:
            return self._serve()
        except FrameStalled as exc:
            return (f"rgpu: worker: {exc} (the client sent part of a request and then too little of the rest; "
                    "a slow or broken network, or a client that is not rgpu's; see session_frame_stall_seconds)")
        except (EOFError, ConnectionError, OSError):
            return "client disconnected"
        finally:
            hostcalls.close()   # a host node waiting for the client gives up: the session is over
            hostcalls.reader_lock.release()
            if self.profile is not None:
                self._write_profile(time.perf_counter_ns() - started)

    def _write_profile(self, wall_ns: int) -> None:
        """RGPU_WORKER_PROFILE=DIR: where this session's time went, per operation (a developer's
        and operator's tool next to the client's RGPU_CLIENT_STATS; off by default)."""
        ops = {("native launch batches" if op == -1 else api_gen.OPS.get(op, str(op))): {"calls": n, "handler_ns": ns} for op, (n, ns) in (self.profile or {}).items()}
        native = self.native_launches
        report = {"wall_ns": wall_ns, "native_launches": native.launched.value if native else 0,
                  # event operations the C loop ran (their time is in "native launch batches")
                  "native_event_ops": native.event_counts() if native else {},
                  "native_small_dtoh": native.copies if native else 0,
                  # pipelined 1-D memsets the C loop ran (cuMemsetD8/D16/D32Async)
                  "native_memsets": native.memsets if native else 0,
                  "generic_launches": self.generic_launches,
                  # striped host-to-device copies received through the landing ring (backends/cuda_copies.py)
                  "lane_ring_copies": getattr(self.backend, "lane_ring_copies", 0),
                  "ops": ops, "load_steps": {k: {"calls": n, "ns": ns, "bytes": b} for k, (n, ns, b) in (self.load_steps or {}).items()},
                  "load_function_tables_ns": getattr(self.backend, "enumerate_ns", 0)}
        try:
            path = os.path.join(os.environ["RGPU_WORKER_PROFILE"], f"worker-{os.getpid()}.json")
            with open(path + ".tmp", "w", encoding="utf-8") as out:
                json.dump(report, out, indent=1)
            os.replace(path + ".tmp", path)   # whole or not at all, for whoever is waiting for it
        except OSError as exc:
            log.warning("cannot write the worker profile: %s", exc)

    def _serve(self) -> str:
        handlers = self.handlers
        reader = self.reader
        view = reader.view
        unpack_header = HEADER.unpack_from
        unpack_launch = LAUNCH.unpack_from
        launch_op = OP["cuLaunchKernel"]
        # Launches are the one operation whose rate matters: a backend may take them straight
        # from the receive buffer (launch_fast), skipping the generic dispatch.
        launch_fast = getattr(self.backend, "launch_fast", None)
        native = self.native_launches
        cuda_mode = self.spec.mode == "cuda"
        stats, memory, profile = self.stats, self.memory, self.profile
        clock = time.perf_counter_ns
        sticky = getattr(self.backend, "sticky_error", None)   # the emulated GPU's fault domain
        limiter = self.limiter
        hostcalls = self.hostcalls
        live_streams = self.client_streams.live
        native_ops = native.ops if native is not None else frozenset()   # what the C loop may run
        native_work_ops = native.gpu_work_ops if native is not None else frozenset()
        while True:
            if self.fault is not None:
                raise self.fault
            if self.lane_receive_live:   # a striped copy received in the background: collect it once over
                self.settle_lane_receive(wait=False)
            if limiter is not None:
                limiter.after_op()
            if reader.end - reader.start < protocol.HEADER_SIZE:
                if limiter is not None and reader.end == reader.start and not reader.spill:
                    limiter.before_wait(self.sock)
                self.idle = reader.end == reader.start
                try:
                    if self.idle and self.fault is not None:
                        raise self.fault
                    reader._fill(protocol.HEADER_SIZE)
                finally:
                    self.idle = False
            length, op, _flags, _seq, _aux, ctx = unpack_header(view, reader.start)
            if limiter is not None and (op == launch_op or (op in native_work_ops and ctx == self.current_ctx)):
                limiter.before_submit()
            if op in native_ops and ctx == self.current_ctx:
                assert native is not None       # native_ops is empty without it
                # Every complete launch, event operation and memset in the buffer, in one call; what
                # it leaves (a partial frame, a cooperative launch, an unknown handle, another op)
                # takes the paths below.
                t0 = clock()
                # The Python path lends the reader while a host node waits, and the emulated GPU's
                # fault domain answers every call: those event frames stay in Python.
                events_ok = not hostcalls.active and not (sticky is not None and cuda_mode and sticky())
                # A copy's reply must carry a waiting error, and leaves only while nothing else may send.
                # (Nor while a striped copy is received in the background: its failure must answer
                # a copy the GPU ordered after it, which only the Python path checks.)
                replies_ok = events_ok and self.deferred is None and not self.lane_receive_live
                used, code = native.run(reader.base + reader.start, reader.end - reader.start, ctx,
                                        gpu_work=limiter is None or limiter.holding_since is not None,
                                        events=events_ok, replies=replies_ok)
                if profile is not None:
                    entry_ = profile.setdefault(-1, [0, 0])
                    entry_[0] += 1
                    entry_[1] += clock() - t0
                if native.send_error:
                    return "client disconnected"
                ran = native.ran_events + native.ran_copies + native.ran_memsets
                if stats is not None and ran:   # as the Python path accounts each one
                    stats.account(t0, memory.high_water if memory is not None else 0, ran)
                self.errors += native.errors
                if code and self.deferred is None:
                    self.deferred = (code, late_error(code, api_gen.OPS.get(native.first_error_op, "a launch")))
                if native.failed_creation is not None:   # it ended the run, its frame consumed
                    handle, failed = native.failed_creation
                    exc = self.client_events.creation_error(handle, failed)
                    self._defer(exc.code, exc.message)
                if native.failed_copy is not None:   # it ended the run, its frame consumed
                    seq, failed = native.failed_copy
                    self.calls += 1
                    self._reply(seq, failed, b"", "")
                if used:
                    self.last_op = native.last_op
                    reader.start += used
                    continue
                if length + 64 <= reader.size and reader.end - reader.start < protocol.HEADER_SIZE + length:
                    reader._fill(protocol.HEADER_SIZE + length)  # cut by a receive: complete it, retry
                    continue
            if (op == launch_op and launch_fast is not None and ctx == self.current_ctx and length + 64 <= reader.size
                    and length >= LAUNCH.size):   # shorter: the generic path refuses it
                if reader.end - reader.start < protocol.HEADER_SIZE + length:
                    reader._fill(protocol.HEADER_SIZE + length)
                at = reader.start + protocol.HEADER_SIZE
                f, stream, gx, gy, gz, bx, by, bz, shmem, coop, nattrs, argsize, _, _ = unpack_launch(view, at)
                # the client's stream -> the driver's (an unknown one takes the generic path, which says so)
                real_stream = stream if stream <= 2 else live_streams.get(stream)
                # Arguments beyond the frame: the generic path refuses them (INVALID_VALUE).
                if not coop and not nattrs and real_stream is not None and argsize <= length - LAUNCH.size:
                    reader.start = at + length
                    self.calls += 1
                    if f not in self.admitted:
                        try:
                            self._admit(f)
                        except CudaError as exc:   # its local memory does not fit the slice: not launched
                            log.warning("%s", exc.message)
                            self._defer(exc.code, exc.message)
                            continue
                    code = launch_fast(f, gx, gy, gz, bx, by, bz, shmem, real_stream, reader.base + at + LAUNCH.size,
                                       argsize)
                    if code:
                        self._defer(code, "")
                    continue
            try:
                op, _flags, seq, _aux, ctx, payload, address = reader.next()
            except FrameTooLarge as exc:
                log.warning("%s", exc.message)
                entry = handlers.get(exc.op)
                if entry is not None and entry[1]:
                    self._defer(OUT_OF_MEMORY, exc.message)
                else:
                    self._reply(exc.seq, OUT_OF_MEMORY, b"", exc.message)
                continue
            if op == protocol.OP_BYE:
                return "client said goodbye"
            if op == protocol.OP_HOST_DONE:
                hostcalls.done(seq, _aux, bytes(payload))
                continue
            self.calls += 1
            entry = handlers.get(op)
            if entry is None:
                if op < 32:
                    return f"unexpected control frame {op}"
                self._reply(seq, NOT_SUPPORTED, b"", f"rgpu: worker: unknown operation {op} (client and server "
                            "builds differ; install the same rgpu version on both)")
                continue
            handler, is_async = entry
            self.last_op = op
            if sticky is not None and cuda_mode and (code := sticky()):
                if is_async:
                    self._defer(code, "")
                else:
                    self._reply(seq, code, b"", "")
                continue
            if profile is not None and op == launch_op:
                shape = "other context" if ctx != self.current_ctx else launch_shape(payload)
                self.generic_launches[shape] = self.generic_launches.get(shape, 0) + 1
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
            if limiter is not None and ((is_async and op not in NO_WORK_ASYNC_OPS) or op in GPU_WORK_OPS):
                limiter.before_submit()
            if not is_async and self.deferred is not None:
                code, message = self.deferred
                self.deferred = None
                self._reply(seq, code, b"", message)
                continue
            started = clock()
            if stats is not None:
                stats.call_started_ns = started
            try:
                result = handler(payload, address, seq) if not hostcalls.active else self._lending(handler, payload, address, seq)
            except CudaError as exc:
                if is_async:
                    self._defer(exc.code, exc.message)
                else:
                    self._reply(seq, exc.code, b"", exc.message)
                continue
            except (BrokenPipeError, ConnectionError):
                return "client disconnected"
            except struct.error:   # a request shorter than its operation's layout: the client's fault
                code, message = malformed(op, len(payload))
                held = self.log_limit.allow("malformed")   # one line a minute, whatever the operations
                if held is not None:
                    log.warning("%s%s", message, held_note(held))
                if is_async:
                    self._defer(code, message)
                else:
                    self._reply(seq, code, b"", message)
                continue
            except Exception as exc:  # noqa: BLE001 - a bug here must not kill every later call of the session
                name = api_gen.OPS.get(op, str(op))
                held = self.log_limit.allow(("internal", op))   # the client chooses how often this runs
                if held is not None:
                    log.error("internal error in %s: %s%s\n%s", name, exc, held_note(held), traceback.format_exc())
                message = f"rgpu: worker: internal error in {name} ({exc!r}; please report it with the dispatcher's log)"
                if is_async:
                    self._defer(UNKNOWN, message)
                else:
                    self._reply(seq, UNKNOWN, b"", message)
                continue
            finally:
                if stats is not None:
                    stats.account(started, memory.high_water if memory is not None else 0)
                if profile is not None:
                    entry_ = profile.setdefault(op, [0, 0])
                    entry_[0] += 1
                    entry_[1] += clock() - started
                if reader.big is not None:   # a frame bigger than the receive buffer: give it back now
                    reader.big = None
                    payload = None  # type: ignore[assignment]
            if is_async:
                if result is not None and result[0] != SUCCESS:
                    self._defer(result[0], "")
            elif result is not None:
                if self.lane_receive_live:
                    # A copy received in the background may have failed while this ran: the reply
                    # says so rather than what this call saw of the memory it was to fill.
                    self.settle_lane_receive(wait=False)
                    if self.deferred is not None:
                        code, message = self.deferred
                        self.deferred = None
                        self._reply(seq, code, b"", message)
                        continue
                self._reply(seq, result[0], result[1], "")

    def _lending(self, handler: Callable[[memoryview, int, int], tuple[int, bytes] | None], payload: memoryview,
                 address: int, seq: int) -> tuple[int, bytes] | None:
        """Run a handler with the reader lent out: a host node waiting for the client may read
        its HOST_DONE while the handler blocks (worker/hostcalls.py)."""
        with self.hostcalls.lending():
            return handler(payload, address, seq)

    def counters(self) -> tuple[int, int, int, int]:
        """(received bytes, sent bytes, calls, errors): datapath/counters.py's FIELDS."""
        loop = self.native_launches
        native = loop.launched.value + loop.event_ops() + loop.copies + loop.memsets if loop is not None else 0
        sent = self.sent + self.hostcalls.sent + (loop.sent if loop is not None else 0) + \
            (self.lanes.sent if self.lanes is not None else 0)
        lanes = self.lanes.received if self.lanes is not None else 0
        return self.reader.received + self.ucx_received + lanes, sent, self.calls + native, self.errors

    def _defer(self, code: int, message: str) -> None:
        self.errors += 1
        if self.deferred is None:
            self.deferred = (code, message or late_error(code, api_gen.OPS.get(self.last_op, f"operation {self.last_op}")))

    def _sticky_fault(self, result: int) -> str:
        """Report a sticky fault to the dispatcher and return its verdict (the line the application gets)."""
        spec = self.spec
        gpu = f"GPU {spec.gpu_index} ({spec.gpu_name}, {spec.gpu_uuid}) of {spec.server}"
        message = default_message(result, gpu)
        try:
            write_report(spec.faults_dir, os.getpid(), {
                "pid": os.getpid(), "gpu_uuid": spec.gpu_uuid, "code": result, "unix": time.time(),
                "job_key": spec.job_key, "slice_number": spec.slice_number,
                "last_op": api_gen.OPS.get(self.last_op, str(self.last_op))})
            message = wait_verdict(spec.faults_dir, os.getpid()) or message
        except OSError as exc:
            log.warning("cannot report the GPU fault to the dispatcher: %s", exc)
        log.error("%s", message)
        self.fault = SessionFaulted(result, message)
        return message

    def _reply(self, seq: int, result: int, payload: bytes, message: str) -> None:
        flags = 0
        if result != SUCCESS:
            self.errors += 1
            if result in STICKY_ERRORS and self.spec.faults_dir and self.spec.mode == "cuda":
                # The verdict (ours, or the one the dispatcher signalled) always reaches the application.
                message = self._sticky_fault(result) if self.fault is None else self.fault.message
                self.messages = 0
        body = I32.pack(result)
        if message and self.messages < 32:
            self.messages += 1
            flags = protocol.REPLY_HAS_MESSAGE
            body += lp(message.encode())
        body += payload
        frame = HEADER.pack(len(body), protocol.OP_REPLY, flags, seq, 0, 0) + body
        self.sent += len(frame)
        with self.send_lock:
            self.sock.sendall(frame)
