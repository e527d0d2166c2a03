"""Generate the repetitive halves of the data path from the reviewed API specs.

    python -m rgpu.remoting.native.generate          # rewrite the generated files
    python -m rgpu.remoting.native.generate --check  # exit 1 if any is stale (CI, tests)

From spec/cuda.spec (+ cuda_exports.txt, cuda_procs.txt, cuda_enums.txt), spec/nvml.spec and spec/nccl.spec:
  generated/rgpu_ops.h, generated/cuda_gen.c, generated/nvml_gen.c   client stubs and tables
  generated/nccl_gen.c                                                 libnccl.so.2's remoted entry points
  generated/api_gen.py                                                 server handlers, ctypes calls
The outputs are committed, so building the client needs only a C compiler; a test fails when
they no longer match the specs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2
from rgpu.remoting.native.apispec import (
    SPEC_DIR,
    Function,
    Param,
    Spec,
    parse_spec,
    read_enums,
    read_exports,
    read_procs,
)

HERE = Path(__file__).parent
GENERATED = HERE / "generated"
TEMPLATES = HERE / "templates"
PY_OUT = GENERATED / "api_gen.py"
NVML_FIRST_OPCODE = 1024
NCCL_FIRST_OPCODE = 1536
DYNAMIC_STUBS = 64


# ---------------------------------------------------------------------------------- C side

@dataclass
class CParamPlan:
    """What the generated client stub does with one parameter."""

    p: Param
    put: str = ""        # C statement(s) sending it
    check: str = ""      # C condition that makes the call invalid (before any I/O)
    get: str = ""        # C statement(s) reading it from the reply


# Handles of libraries and their kernels: one value for every device in CUDA, one per slice in rgpu.
MIRRORED_HANDLES = ("CUlibrary", "CUkernel")


def _c_scalar_put(p: Param, expr: str) -> str:
    w = p.known_wire
    assert w is not None
    if w.kind == "dev":
        return "rgpu_put_i32(&c, 0);  /* the worker's GPU is its device 0 */"
    if w.kind == "ctx":
        return f"rgpu_put_u64(&c, {p.name}_remote);"
    if w.kind == "handle" and p.ctype == "CUfunction":   # a node of private table 6e163fbe: the worker's
        return f"rgpu_put_u64(&c, (uint64_t)(uintptr_t)rgpu_fn_remote({expr}));"
    if w.kind == "handle" and p.ctype in MIRRORED_HANDLES:   # the slice's copy of a library (library_mirror.c)
        return f"rgpu_put_u64(&c, rgpu_handle_in(c.s->index, (uint64_t)(uintptr_t){expr}));"
    if w.kind == "handle":
        return f"rgpu_put_u64(&c, (uint64_t)(uintptr_t){expr});"
    if w.kind == "nvmldev":
        return "rgpu_put_u32(&c, 0);"
    if w.kind == "ncclcomm":   # the worker's communicator behind the client's (src/nccl_client.c)
        return f"rgpu_put_u64(&c, rgpu_nccl_remote({expr}));"
    if w.kind == "devptr":     # a device buffer: the slice's address
        return f"rgpu_put_u64(&c, (uint64_t)(uintptr_t){expr});"
    size = {"i": 4, "I": 4, "B": 1, "H": 2, "Q": 8, "f": 4}[w.fmt]
    ctype = {"i": "int32_t", "I": "uint32_t", "B": "uint8_t", "H": "uint16_t", "Q": "uint64_t", "f": "float"}[w.fmt]
    return f"{{ {ctype} v_ = ({ctype}){expr}; rgpu_put(&c, &v_, {size}); }}"


def _c_scalar_get(p: Param, target: str) -> str:
    """Read one output value into *target (target is an lvalue of the param's C type)."""
    w = p.known_wire
    assert w is not None
    if w.kind == "dev":
        return f"{target} = rgpu_dev_out(&c, rgpu_get_i32(&c));"
    if w.kind == "ctx":
        return f"{target} = rgpu_ctx_out(&c, rgpu_get_u64(&c));"
    if w.kind == "handle" and p.ctype in MIRRORED_HANDLES:
        return f"{target} = ({p.ctype})(uintptr_t)rgpu_handle_out(c.s->index, rgpu_get_u64(&c));"
    if w.kind == "handle":
        return f"{target} = ({p.ctype})(uintptr_t)rgpu_get_u64(&c);"
    if w.kind == "nvmldev":
        return f"{target} = rgpu_nvml_device_out(&c, rgpu_get_u32(&c));"
    if w.kind == "bytes":
        return f"rgpu_get(&c, &{target}, sizeof({target}));"
    ctype = {"i": "int32_t", "I": "uint32_t", "B": "uint8_t", "H": "uint16_t", "Q": "uint64_t", "f": "float"}[w.fmt]
    return f"{{ {ctype} v_; rgpu_get(&c, &v_, sizeof v_); {target} = ({p.ctype})v_; }}"


def plan_c(f: Function) -> list[CParamPlan]:
    plans = []
    for p in f.params:
        plan = CParamPlan(p)
        if p.direction == "inout" and p.known_wire.kind == "bytes":
            # Structs travel both ways (NVML's versioned structs): raw bytes out and back.
            plan.check = f"{p.name} == NULL"
            plan.put = f"rgpu_put(&c, {p.name}, sizeof *{p.name});"
            plan.get = f"rgpu_get(&c, {p.name}, sizeof *{p.name});"
        elif p.direction == "inout":
            # A scalar both ways (cuThreadExchangeStreamCaptureMode's mode).
            plan.check = f"{p.name} == NULL"
            plan.put = _c_scalar_put(p, f"*{p.name}")
            plan.get = _c_scalar_get(p, f"*{p.name}")
        elif p.direction == "in" and p.known_wire.kind == "devptr":
            plan.put = _c_scalar_put(p, p.name)
        elif p.direction == "in" and p.pointer and p.const and p.known_wire.kind == "bytes" and not p.is_string:
            # A struct read by the call (CUmemAllocationProp): its bytes travel.
            plan.check = f"{p.name} == NULL"
            plan.put = f"rgpu_put(&c, {p.name}, sizeof *{p.name});"
        elif p.direction == "in" and p.length:
            # An array the call reads (nccl.spec: ids, rank lists): its element count, then its elements
            # as the C layout has them (every wire type here is fixed-size, little-endian on both ends).
            n = p.length
            plan.check = f"({n}) < 0 || (({n}) > 0 && {p.name} == NULL)"
            plan.put = (f"{{ uint32_t n_ = (uint32_t)({n}); rgpu_put_u32(&c, n_); "
                        f"if (n_) rgpu_put(&c, {p.name}, (size_t)n_ * sizeof *{p.name}); }}")
        elif p.direction == "in":
            if p.is_string:
                plan.put = f"rgpu_put_str(&c, {p.name});"
                plan.check = f"{p.name} == NULL"
            elif p.pointer and p.const:
                plan.check = f"{p.name} == NULL"
                plan.put = _c_scalar_put(p, f"*{p.name}")
            else:
                plan.put = _c_scalar_put(p, p.name)
        else:
            optional = p.direction == "out?"
            if p.length:
                n = p.length
                plan.check = f"{p.name} == NULL || (long long)({n}) <= 0"
                if p.ctype == "char":
                    plan.get = (f"{{ uint32_t n_ = rgpu_get_u32(&c); size_t cap_ = (size_t)({n}); "
                                f"rgpu_get(&c, {p.name}, n_ < cap_ ? n_ : cap_); "
                                f"if (n_ > cap_) c.roff += n_ - cap_; }}")
                else:
                    plan.get = (f"{{ uint32_t n_ = rgpu_get_u32(&c); for (uint32_t i_ = 0; i_ < n_; i_++) {{ "
                                f"{p.ctype} e_; {_c_scalar_get(p, 'e_')} "
                                f"if (i_ < (uint32_t)({n})) {p.name}[i_] = e_; }} }}")
            else:
                if not optional:
                    plan.check = f"{p.name} == NULL"
                tmp = f"{p.name}_v"
                read = _c_scalar_get(p, tmp)
                plan.get = (f"{{ {p.ctype} {tmp}; memset(&{tmp}, 0, sizeof {tmp}); {read} "
                            f"if ({p.name}) *{p.name} = {tmp}; }}")
        plans.append(plan)
    return plans


# Calls whose only handle is an event go to the event's slice (src/cuda_events.c).
EVENT_ROUTED = {"cuEventQuery": "hEvent", "cuEventSynchronize": "hEvent", "cuEventDestroy_v2": "hEvent",
                "cuEventElapsedTime": "hStart", "cuEventElapsedTime_v2": "hStart"}


def c_route(f: Function) -> str:
    r = f.route
    op = f"RGPU_OP_{f.name}"
    if r is None and f.name == "cuStreamDestroy_v2":
        return f"rgpu_begin_stream(&c, {op}, hStream)"
    if r is None and f.name in EVENT_ROUTED:
        # the slice that holds the event (client-made handles know theirs), whatever is current
        return f"rgpu_begin_event(&c, {op}, {EVENT_ROUTED[f.name]})"
    if r is None:
        return f"rgpu_begin(&c, {op})"
    if r.known_wire.kind == "dev":
        return f"rgpu_begin_dev(&c, {op}, {r.name})"
    if r.known_wire.kind == "ctx":
        return f"rgpu_begin_ctx(&c, {op}, {r.name}, &{r.name}_remote)"
    if r.known_wire.kind == "nvmldev":
        return f"rgpu_nvml_begin_dev(&c, {op}, {r.name})"
    if r.known_wire.kind == "ncclcomm":
        return f"rgpu_nccl_begin_comm(&c, {op}, {r.name})"
    raise AssertionError(r)


# ---------------------------------------------------------------------------------- Python side

def _py_name(name: str) -> str:
    return name + "_" if name in ("len", "type", "id", "format", "free", "bytes") else name


@dataclass
class PyPlan:
    f: Function
    decode: list[str]       # statements reading the inputs from (buf, off)
    args: list[str]         # backend call arguments
    encode: list[str]       # statements building the reply bytes from `res`
    ctypes_pre: list[str]   # ctypes driver call: output holders
    ctypes_args: list[str]
    ctypes_ret: str
    argtypes: list[str]


def plan_py(f: Function) -> PyPlan:
    decode: list[str] = []
    args: list[str] = []
    group: list[tuple[str, str]] = []

    def flush() -> None:
        if not group:
            return
        fmt = "<" + "".join(g[1] for g in group)
        names = ", ".join(g[0] for g in group) + ("," if len(group) == 1 else "")
        decode.append(f"{names} = _struct({fmt!r}).unpack_from(buf, off); off += {_size(fmt)}")
        group.clear()

    for p in f.inputs:
        n = _py_name(p.name)
        args.append(n)
        if p.is_string:
            flush()
            decode.append(f"{n}, off = _take_str(buf, off)")
        elif p.length:
            flush()
            decode.append(f"{n}, off = _take_array(buf, off, {p.known_wire.fmt!r})")
        else:
            group.append((n, p.known_wire.fmt))
    flush()
    # Events and streams are the client's handles (protocol 8): the worker's tables give the driver's.
    for p in f.inputs:
        if p.ctype in ("CUevent", "CUstream", "cudaStream_t") and not p.pointer:
            n = _py_name(p.name)
            kind = "event" if p.ctype == "CUevent" else "stream"
            take = ", True" if f.name in ("cuEventDestroy_v2", "cuStreamDestroy_v2") else ""
            decode.append(f"{n} = _{kind}_in(api, {n}, {f.name!r}{take})")

    encode: list[str] = []
    outs = f.outputs
    parts = []
    for i, p in enumerate(outs, 1):
        if p.length:
            if p.ctype == "char":
                parts.append(f"_lp(res[{i}])")
            else:
                parts.append(f"_array({p.known_wire.fmt!r}, res[{i}])")
        else:
            parts.append(f"_struct('<{p.known_wire.fmt}').pack(res[{i}])")
    encode.append(" + ".join(parts) if parts else 'b""')

    pre: list[str] = []
    cargs: list[str] = []
    argtypes: list[str] = []
    rets: list[str] = []
    for p in f.params:
        n = _py_name(p.name)
        w = p.known_wire
        if p.direction == "in":
            if p.is_string:
                cargs.append(f"{n}.encode()")
                argtypes.append("ctypes.c_char_p")
            elif w is not None and w.kind == "nvmldev":
                cargs.append("self.nvml_device")
                argtypes.append("ctypes.c_void_p")
            elif w is not None and w.kind == "devptr":
                cargs.append(n)
                argtypes.append("ctypes.c_void_p")
            elif p.pointer and p.const and w.kind == "bytes":
                pre.append(f"{n}_in = ({w.ctypes}).from_buffer_copy({n})")
                cargs.append(f"ctypes.byref({n}_in)")
                argtypes.append("ctypes.c_void_p")
            elif p.pointer and p.const:
                pre.append(f"{n}_in = {w.ctypes}({n})")
                cargs.append(f"ctypes.byref({n}_in)")
                argtypes.append("ctypes.c_void_p")
            else:
                cargs.append(n)
                argtypes.append(w.ctypes)
        elif p.direction == "inout" and w.kind != "bytes":
            holder = f"{n}_out"
            pre.append(f"{holder} = {w.ctypes}({n})")
            cargs.append(f"ctypes.byref({holder})")
            rets.append(f"{holder}.value")
            argtypes.append("ctypes.c_void_p")
        elif p.direction == "inout":
            holder = f"{n}_out"
            pre.append(f"{holder} = ({w.ctypes}).from_buffer_copy({n})")
            cargs.append(f"ctypes.byref({holder})")
            rets.append(f"bytes({holder})")
            argtypes.append("ctypes.c_void_p")
        else:
            holder = f"{n}_out"
            if p.length:
                ln = _py_name(p.length) if not p.length.isdigit() else p.length
                if p.ctype == "char":
                    pre.append(f"{holder} = ctypes.create_string_buffer(max(int({ln}), 0))")
                    rets.append(f"{holder}.raw")
                else:
                    pre.append(f"{holder} = ({w.ctypes} * max(int({ln}), 0))()")
                    rets.append(f"[v or 0 for v in {holder}]")
                cargs.append(holder)
            else:
                pre.append(f"{holder} = ({w.ctypes})()")
                cargs.append(f"ctypes.byref({holder})")
                if w.kind == "bytes":
                    rets.append(f"bytes({holder})")
                else:
                    rets.append(f"{holder}.value or 0")
            argtypes.append("ctypes.c_void_p")
    ret = "(r" + "".join(f", {x}" for x in rets) + ")" if rets else "(r,)"
    return PyPlan(f, decode, args, encode, pre, cargs, ret, argtypes)


def _size(fmt: str) -> int:
    import struct
    return struct.calcsize(fmt)


# ---------------------------------------------------------------------------------- errors

def error_message(name: str) -> str:
    """A short description from the error's name: CUDA_ERROR_OUT_OF_MEMORY -> 'out of memory'."""
    if name == "CUDA_SUCCESS":
        return "no error"
    text = name.removeprefix("CUDA_ERROR_").lower().replace("_", " ")
    return text


# ---------------------------------------------------------------------------------- driver

@dataclass
class Outputs:
    files: dict[Path, str]


# Hand-written client code that a generated stub runs before it sends its request.
# Hand-written client code that a generated sync stub runs after the reply (`r` is the result,
# `c.s->index` the session): rgpu's own bookkeeping of what the call changed.
AFTER_HOOKS = {
    # page-locked memory a memset was handed: numbered, with its stream, once the frame is queued
    # (managed.c: a synchronisation that covers it reads it back without waiting for later work)
    **{f"cuMemset{kind}{suffix}": f"if (r == CUDA_SUCCESS) rgpu_managed_handed_on({stream})"
       for kind in ("D8", "D16", "D32", "D2D8", "D2D16", "D2D32") for suffix, stream in (("_v2", "NULL"), ("Async", "hStream"))},
    # capture status is answered locally while no capture can be under way
    "cuStreamBeginCapture_v2": "rgpu_capture_begun(r)",
    "cuStreamEndCapture": "rgpu_capture_ended(r)",
    # reserved address ranges are device memory for the copy paths and routing
    "cuMemAddressReserve": "if (r == CUDA_SUCCESS) rgpu_dev_range_add(c.s->index, (uint64_t)*ptr, size)",
    "cuMemAddressFree": "if (r == CUDA_SUCCESS) rgpu_dev_range_remove(c.s->index, (uint64_t)ptr)",
    # kept pointer attributes (cuda_cache.c): the one settable attribute changes
    "cuPointerSetAttribute": "rgpu_pattr_forget_all()",
    # client-side caches (cuda_cache.c): filled by the answers, emptied by whatever may change them
    "cuKernelGetAttribute": "if (r == CUDA_SUCCESS) rgpu_kattr_put(kernel, attrib, dev, *pi)",
    "cuKernelGetFunction": "if (r == CUDA_SUCCESS) rgpu_kfunc_put(kernel, *pFunc)",
    "cuDeviceGetAttribute": "if (r == CUDA_SUCCESS) rgpu_dattr_put(attrib, dev, *pi)",
    "cuDevicePrimaryCtxGetState": "if (r == CUDA_SUCCESS) rgpu_pstate_put(dev, *flags, *active)",
    "cuKernelSetAttribute": "if (r == CUDA_SUCCESS) rgpu_kattr_changed(kernel, attrib, dev, val); else rgpu_cache_forget_functions()",
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": "if (r == CUDA_SUCCESS) rgpu_occ_put(func, blockSize, dynamicSMemSize, 0, *numBlocks)",
    "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags": "if (r == CUDA_SUCCESS) rgpu_occ_put(func, blockSize, dynamicSMemSize, flags, *numBlocks)",
    "cuFuncSetAttribute": "rgpu_fattr_changed(hfunc); if (r == CUDA_SUCCESS) rgpu_fattr_put(hfunc, attrib, value)",
    "cuFuncGetAttribute": "if (r == CUDA_SUCCESS) rgpu_fattr_put(hfunc, attrib, *pi)",
    "cuOccupancyAvailableDynamicSMemPerBlock": "if (r == CUDA_SUCCESS) rgpu_occ_smem_put(func, numBlocks, blockSize, *dynamicSmemSize)",
    **{name: f"if (r == CUDA_SUCCESS) rgpu_stream_query_put(hStream, {what}, (uint64_t)(uintptr_t)*{out})"
       for name, what, out in (("cuStreamGetFlags", "RGPU_STREAMQ_FLAGS", "flags"),
                               ("cuStreamGetPriority", "RGPU_STREAMQ_PRIORITY", "priority"),
                               ("cuStreamGetCtx", "RGPU_STREAMQ_CTX", "pctx"),
                               ("cuStreamGetDevice", "RGPU_STREAMQ_DEVICE", "device"),
                               ("cuStreamGetId", "RGPU_STREAMQ_ID", "streamId"))},
    "cuStreamDestroy_v2": "rgpu_stream_forget(hStream)",
    **{name: f"if (r == CUDA_SUCCESS) rgpu_ctx_query_put({ctx}, {what}, (uint64_t)*{out})"
       for name, ctx, what, out in (("cuCtxGetApiVersion", "ctx", "RGPU_CTXQ_API_VERSION", "version"),
                                    ("cuCtxGetId", "ctx", "RGPU_CTXQ_ID", "ctxId"),
                                    ("cuCtxGetFlags", "NULL", "RGPU_CTXQ_FLAGS", "flags"),
                                    ("cuCtxGetCacheConfig", "NULL", "RGPU_CTXQ_CACHE_CONFIG", "pconfig"),
                                    ("cuCtxGetSharedMemConfig", "NULL", "RGPU_CTXQ_SHARED_CONFIG", "pConfig"))},
    "cuCtxGetStreamPriorityRange": ("if (r == CUDA_SUCCESS && leastPriority && greatestPriority) "
                                    "rgpu_ctx_query_put(NULL, RGPU_CTXQ_PRIORITY_RANGE, "
                                    "(uint64_t)(uint32_t)*leastPriority | (uint64_t)(uint32_t)*greatestPriority << 32)"),
    "cuKernelSetCacheConfig": "rgpu_cache_forget_functions()",
    "cuFuncSetCacheConfig": "rgpu_cache_forget_functions()",
    "cuDevicePrimaryCtxRelease_v2": "rgpu_pstate_forget()",
    "cuDevicePrimaryCtxReset_v2": "rgpu_pstate_forget(); rgpu_cache_forget_functions(); rgpu_array_desc_forget(0)",
    # array descriptors never change while the array lives (cuda_array.c)
    "cuArray3DGetDescriptor_v2": "if (r == CUDA_SUCCESS) rgpu_array_desc_put(c.s->index, hArray, pArrayDescriptor)",
    "cuMipmappedArrayGetLevel": "if (r == CUDA_SUCCESS) rgpu_array_level_put(*pLevelArray, hMipmappedArray)",
    "cuDevicePrimaryCtxSetFlags_v2": "rgpu_pstate_forget(); rgpu_ctx_query_forget()",
    "cuCtxSetFlags": "rgpu_pstate_forget(); rgpu_ctx_query_forget()",
    "cuCtxSetCacheConfig": "rgpu_cache_forget_functions()",
    "cuCtxSetSharedMemConfig": "rgpu_cache_forget_functions()",
    "cuFuncSetSharedMemConfig": "rgpu_cache_forget_functions()",
    "cuCtxSetLimit": "rgpu_cache_forget_functions()",
    "cuCtxGetLimit": "if (r == CUDA_SUCCESS) rgpu_limit_put(limit, *pvalue)",
    # client-made events (cuda_events.c): what the client knows of their completion
    "cuEventDestroy_v2": "rgpu_event_session_forget(hEvent)",
    "cuEventRecord": "if (r == CUDA_SUCCESS) rgpu_event_recorded(hEvent, hStream)",
    "cuEventRecordWithFlags": "if (r == CUDA_SUCCESS) rgpu_event_recorded(hEvent, hStream)",
    "cuCtxRecordEvent": "if (r == CUDA_SUCCESS) rgpu_event_recorded(hEvent, RGPU_EVENT_WHOLE_CONTEXT)",
    "cuEventQuery": "if (r == CUDA_SUCCESS) rgpu_event_completed(hEvent, ev_seq_)",
    "cuEventSynchronize": "if (r == CUDA_SUCCESS) rgpu_event_completed(hEvent, ev_seq_)",
    "cuStreamSynchronize": ("if (r == CUDA_SUCCESS) { rgpu_stream_synced(hStream, c.s->index, sync_seq_); "
                            "rgpu_idle_stream_put(hStream, c.s->index, c.s->seq); }"),
    "cuStreamQuery": "if (r == CUDA_SUCCESS) rgpu_stream_synced(hStream, c.s->index, sync_seq_)",
    "cuCtxSynchronize": "if (r == CUDA_SUCCESS) { rgpu_ctx_synced(NULL, sync_seq_); rgpu_idle_ctx_put(NULL, c.s->seq); }",
    "cuCtxSynchronize_v2": "if (r == CUDA_SUCCESS) { rgpu_ctx_synced(ctx, sync_seq_); rgpu_idle_ctx_put(ctx, c.s->seq); }",
    # copy nodes with a host side (cuda_graph.c): their records follow the graph
    "cuGraphClone": "if (r == CUDA_SUCCESS) rgpu_hostcopy_clone(originalGraph, *phGraphClone)",
    "cuGraphDestroy": "if (r == CUDA_SUCCESS) rgpu_hostcopy_forget(hGraph)",
    "cuGraphInstantiateWithFlags": "if (r == CUDA_SUCCESS) rgpu_hostcopy_clone(hGraph, *phGraphExec)",
    "cuGraphExecDestroy": "if (r == CUDA_SUCCESS) rgpu_hostcopy_forget(hGraphExec)",
    "cuGraphLaunch": "if (r == CUDA_SUCCESS) r = rgpu_hostcopy_after_launch(hGraphExec, hStream)",
    # the driver fills the result even when the update fails
    "cuGraphExecUpdate_v2": ("if (r != CUDA_SUCCESS) { memset(resultInfo, 0, sizeof *resultInfo); resultInfo->result = 1; } "
                             "else { rgpu_hostcopy_forget(hGraphExec); rgpu_hostcopy_clone(hGraph, hGraphExec); }"),
}

# After the call has ended (its session unlocked), so a hook may make calls of its own.
END_HOOKS = {
    # managed memory (managed.c): the host's view is brought up to date at every point where the
    # program may read it (the GPU has finished)
    **{name: "if (r == CUDA_SUCCESS) rgpu_managed_sync_point()" for name in (
        "cuCtxSynchronize", "cuCtxSynchronize_v2", "cuStreamSynchronize", "cuEventSynchronize", "cuStreamQuery",
        "cuEventQuery")},
}

BEFORE_HOOKS = {
    # host-memory sides of copy nodes: the data this process holds now goes first
    "cuGraphLaunch": "{ CUresult r_ = rgpu_hostcopy_before_launch(hGraphExec); if (r_ != CUDA_SUCCESS) return r_; }",
    # answered from the client's caches when they hold the answer (cuda_cache.c)
    "cuCtxGetDevice": "if (rgpu_cached_ctx_device(NULL, device)) return CUDA_SUCCESS",
    "cuCtxGetDevice_v2": "if (rgpu_cached_ctx_device(ctx, device)) return CUDA_SUCCESS",
    "cuKernelGetAttribute": "if (rgpu_kattr_get(kernel, attrib, dev, pi)) return CUDA_SUCCESS",
    "cuKernelGetFunction": "if (rgpu_kfunc_get(kernel, pFunc)) return CUDA_SUCCESS",
    # the attributes the client can check travel pipelined, or fail at once (func_attrs.c); setting
    # another to the value it has changes nothing (as for kernels, below)
    "cuFuncSetAttribute": ("{ CUresult r_; int v_; if (rgpu_func_set_attribute_here(hfunc, attrib, value, &r_)) return r_; "
                           "if (rgpu_fattr_get(hfunc, attrib, &v_) && v_ == value) return CUDA_SUCCESS; }"),
    "cuDeviceGetAttribute": "if (rgpu_dattr_get(attrib, dev, pi)) return CUDA_SUCCESS",
    # a memset of page-locked memory: backed by device memory at its address first (zero_copy.c)
    **{f"cuMemset{kind}{suffix}": "{ CUresult r_ = rgpu_zero_copy_target(dstDevice); if (r_ != CUDA_SUCCESS) return r_; }"
       for kind in ("D8", "D16", "D32", "D2D8", "D2D16", "D2D32") for suffix in ("_v2", "Async")},
    "cuDevicePrimaryCtxGetState": "if (rgpu_pstate_get(dev, flags, active)) return CUDA_SUCCESS",
    "cuCtxGetLimit": "if (rgpu_limit_get(limit, pvalue)) return CUDA_SUCCESS",
    "cuArray3DGetDescriptor_v2": "if (rgpu_array_desc_get(hArray, pArrayDescriptor)) return CUDA_SUCCESS",
    "cuStreamWaitEvent": ("{ CUresult r_ = rgpu_event_check(hEvent); if (r_ != CUDA_SUCCESS) return r_; "
                          "if (rgpu_event_elsewhere(hEvent, &r_)) return r_; }"),
    # client-made events (cuda_events.c): a handle the client does not know is refused at once; a
    # query whose answer the client knows (never recorded, or covered by a finished
    # synchronisation) costs nothing; a destruction forgets the handle before it travels
    **{name: f"{{ CUresult r_ = rgpu_event_check({ev}); if (r_ != CUDA_SUCCESS) return r_; }}"
       for name, ev in (("cuEventRecord", "hEvent"), ("cuEventRecordWithFlags", "hEvent"),
                        ("cuCtxRecordEvent", "hEvent"), ("cuCtxWaitEvent", "hEvent"))},
    **{name: ("{ CUresult r_ = rgpu_event_check(hStart); if (r_ == CUDA_SUCCESS) r_ = rgpu_event_check(hEnd); "
              "if (r_ != CUDA_SUCCESS) return r_; }") for name in ("cuEventElapsedTime", "cuEventElapsedTime_v2")},
    **{name: "uint64_t ev_seq_ = 0; { CUresult r_; if (rgpu_event_known(hEvent, &ev_seq_, &r_)) return r_; }"
       for name in ("cuEventQuery", "cuEventSynchronize")},
    "cuEventDestroy_v2": "{ CUresult r_ = rgpu_event_destroying(hEvent); if (r_ != CUDA_SUCCESS) return r_; }",
    "cuStreamDestroy_v2": "{ CUresult r_ = rgpu_stream_destroying(hStream); if (r_ != CUDA_SUCCESS) return r_; }",
    # context queries the client already holds the answer to (cuda_cache.c)
    **{name: f"{{ uint64_t v_; if (rgpu_ctx_query_get({ctx}, {what}, &v_)) {{ *{out} = ({ctype})v_; return CUDA_SUCCESS; }} }}"
       for name, ctx, what, out, ctype in (
           ("cuCtxGetApiVersion", "ctx", "RGPU_CTXQ_API_VERSION", "version", "unsigned int"),
           ("cuCtxGetId", "ctx", "RGPU_CTXQ_ID", "ctxId", "unsigned long long"),
           ("cuCtxGetFlags", "NULL", "RGPU_CTXQ_FLAGS", "flags", "unsigned int"),
           ("cuCtxGetCacheConfig", "NULL", "RGPU_CTXQ_CACHE_CONFIG", "pconfig", "CUfunc_cache"),
           ("cuCtxGetSharedMemConfig", "NULL", "RGPU_CTXQ_SHARED_CONFIG", "pConfig", "CUsharedconfig"))},
    "cuCtxGetStreamPriorityRange": ("{ uint64_t v_; if (rgpu_ctx_query_get(NULL, RGPU_CTXQ_PRIORITY_RANGE, &v_)) { "
                                    "if (leastPriority) *leastPriority = (int)(uint32_t)v_; "
                                    "if (greatestPriority) *greatestPriority = (int)(uint32_t)(v_ >> 32); "
                                    "return CUDA_SUCCESS; } }"),
    **{name: "uint64_t sync_seq_ = rgpu_event_clock()" for name in (
        "cuStreamSynchronize", "cuStreamQuery", "cuCtxSynchronize", "cuCtxSynchronize_v2")},
    # a stream or context a finished synchronisation left idle, nothing sent since (idle_streams.c)
    "cuStreamSynchronize": "if (rgpu_idle_stream(hStream)) return CUDA_SUCCESS; uint64_t sync_seq_ = rgpu_event_clock()",
    "cuCtxSynchronize": "if (rgpu_idle_ctx(NULL)) return CUDA_SUCCESS; uint64_t sync_seq_ = rgpu_event_clock()",
    "cuCtxSynchronize_v2": "if (rgpu_idle_ctx(ctx)) return CUDA_SUCCESS; uint64_t sync_seq_ = rgpu_event_clock()",
    # a device-to-device copy between two slices (cudaMemcpy DeviceToDevice from cuda:0 to cuda:1)
    # (page-locked memory backed on the GPU, either side: its bytes go with the copy, managed.c)
    "cuMemcpyDtoD_v2": "{ CUresult r_; rgpu_managed_hand(dstDevice); rgpu_managed_hand(srcDevice); if (rgpu_dtod_between_slices(dstDevice, srcDevice, ByteCount, NULL, &r_)) return r_; }",
    "cuMemcpyDtoDAsync_v2": ("{ CUresult r_; rgpu_managed_hand(dstDevice); rgpu_managed_hand(srcDevice); if (rgpu_dtod_between_slices(dstDevice, srcDevice, ByteCount, hStream, &r_)) "
                             "return r_; }"),
    # as cuFuncSetAttribute (cuBLAS and PyTorch set the dynamic shared memory before each launch)
    "cuKernelSetAttribute": ("{ CUresult r_; int v_; if (rgpu_kernel_set_attribute_here(kernel, attrib, val, dev, &r_)) "
                             "return r_; if (rgpu_kattr_get(kernel, attrib, dev, &v_) && v_ == val) return CUDA_SUCCESS; }"),
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": "if (rgpu_occ_get(func, blockSize, dynamicSMemSize, 0, numBlocks)) return CUDA_SUCCESS",
    "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags": "if (rgpu_occ_get(func, blockSize, dynamicSMemSize, flags, numBlocks)) return CUDA_SUCCESS",
    "cuOccupancyAvailableDynamicSMemPerBlock": "if (rgpu_occ_smem_get(func, numBlocks, blockSize, dynamicSmemSize)) return CUDA_SUCCESS",
    "cuFuncGetAttribute": "if (rgpu_fattr_get(hfunc, attrib, pi)) return CUDA_SUCCESS",
    **{name: f"{{ uint64_t v_; if (rgpu_stream_query_get(hStream, {what}, &v_)) {{ *{out} = ({ctype})(uintptr_t)v_; return CUDA_SUCCESS; }} }}"
       for name, what, out, ctype in (("cuStreamGetFlags", "RGPU_STREAMQ_FLAGS", "flags", "unsigned int"),
                                      ("cuStreamGetPriority", "RGPU_STREAMQ_PRIORITY", "priority", "int"),
                                      ("cuStreamGetCtx", "RGPU_STREAMQ_CTX", "pctx", "CUcontext"),
                                      ("cuStreamGetDevice", "RGPU_STREAMQ_DEVICE", "device", "CUdevice"),
                                      ("cuStreamGetId", "RGPU_STREAMQ_ID", "streamId", "unsigned long long"))},
    # cudart's context-local storage: destructors run while the primary context still exists.
    "cuDevicePrimaryCtxReset_v2": "rgpu_before_primary_ctx_reset(dev)",
}


def render_all() -> Outputs:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["cstr"] = lambda s: s.replace("\\", "\\\\").replace('"', '\\"')
    cuda = parse_spec(SPEC_DIR / "cuda.spec")
    nvml = parse_spec(SPEC_DIR / "nvml.spec", first_opcode=NVML_FIRST_OPCODE)
    nccl = parse_spec(SPEC_DIR / "nccl.spec", first_opcode=NCCL_FIRST_OPCODE)
    exports = read_exports(SPEC_DIR / "cuda_exports.txt")
    procs = read_procs(SPEC_DIR / "cuda_procs.txt")
    enums = read_enums(SPEC_DIR / "cuda_enums.txt")
    nvml_exports = read_exports(SPEC_DIR / "nvml_exports.txt")
    validate(cuda, exports, nvml, nvml_exports)
    validate_nccl(cuda, nccl)

    export_set = set(exports)
    listed = {f.name for f in cuda.functions}
    generated_cuda = [f for f in cuda.functions if f.mode in ("sync", "async", "unsupported")]
    per_thread = []
    for f in cuda.functions:
        if f.mode == "unsupported":
            continue
        for suffix in ("_ptds", "_ptsz"):
            if f.name + suffix in export_set:
                per_thread.append((f, f.name + suffix))
    implemented = listed | {name for _, name in per_thread}
    default_stubs = [name for name in exports if name not in implemented]
    symbols = sorted(n for n in (implemented | set(default_stubs))
                     if n in export_set)
    errors = sorted(enums["CUresult"].items(), key=lambda kv: kv[1])

    nvml_listed = {f.name for f in nvml.functions}
    nvml_defaults = [n for n in nvml_exports if n not in nvml_listed]

    ctx = {
        "cuda": cuda, "nvml": nvml, "plan_c": plan_c, "c_route": c_route, "generated_cuda": generated_cuda,
        "per_thread": per_thread, "default_stubs": default_stubs, "symbols": symbols, "procs": procs,
        "errors": [(n, v, error_message(n)) for n, v in errors], "dynamic_stubs": DYNAMIC_STUBS,
        "before_hooks": BEFORE_HOOKS, "after_hooks": AFTER_HOOKS, "end_hooks": END_HOOKS,
        "nvml_generated": [f for f in nvml.functions if f.mode in ("sync", "async", "unsupported")],
        "nvml_defaults": nvml_defaults, "nvml_symbols": sorted(nvml_listed | set(nvml_defaults)),
        "plan_py": plan_py, "wire_cuda": [f for f in cuda.wire_functions],
        "wire_nvml": [f for f in nvml.wire_functions], "py_name": _py_name,
        "nccl": nccl, "wire_nccl": [f for f in nccl.wire_functions],
        "nccl_generated": [f for f in nccl.functions if f.mode in ("sync", "async")],
    }
    files = {
        GENERATED / "rgpu_ops.h": env.get_template("rgpu_ops.h.j2").render(**ctx),
        GENERATED / "cuda_gen.c": env.get_template("cuda_gen.c.j2").render(**ctx),
        GENERATED / "cuda_protos.h": env.get_template("cuda_protos.h.j2").render(**ctx),
        GENERATED / "nvml_protos.h": env.get_template("nvml_protos.h.j2").render(**ctx),
        GENERATED / "nvml_gen.c": env.get_template("nvml_gen.c.j2").render(**ctx),
        GENERATED / "nccl_gen.c": env.get_template("nccl_gen.c.j2").render(**ctx),
        PY_OUT: env.get_template("api_gen.py.j2").render(**ctx),
    }
    return Outputs(files)


def validate(cuda: Spec, exports: list[str], nvml: Spec, nvml_exports: list[str]) -> None:
    export_set = set(exports)
    for f in cuda.functions:
        if not f.name.startswith("rgpu") and f.name not in export_set:
            raise SystemExit(f"rgpu: generate: {f.name} (cuda.spec line {f.line}) is not a driver export "
                             "(check the name, or refresh cuda_exports.txt)")
    nvml_set = set(nvml_exports)
    for f in nvml.functions:
        if not f.name.startswith("rgpu") and f.name not in nvml_set:
            raise SystemExit(f"rgpu: generate: {f.name} (nvml.spec line {f.line}) is not in nvml_exports.txt")
    if cuda.protocol_version != nvml.protocol_version:
        raise SystemExit("rgpu: generate: cuda.spec and nvml.spec name different protocol versions")
    from rgpu.remoting.datapath.protocol import PROTOCOL_VERSION
    if cuda.protocol_version != PROTOCOL_VERSION:
        raise SystemExit(f"rgpu: generate: cuda.spec says protocol_version {cuda.protocol_version} but "
                         f"protocol.py says {PROTOCOL_VERSION}; make them equal")


def validate_nccl(cuda: Spec, nccl: Spec) -> None:
    """nccl.spec names only NCCL's entry points and rgpu's own operations, at the protocol version of cuda.spec."""
    for f in nccl.functions:
        if not f.name.startswith(("nccl", "rgpuNccl")):
            raise SystemExit(f"rgpu: generate: {f.name} (nccl.spec line {f.line}) is neither an NCCL entry point nor "
                             "an rgpuNccl operation")
    if nccl.protocol_version != cuda.protocol_version:
        raise SystemExit("rgpu: generate: cuda.spec and nccl.spec name different protocol versions")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stale outputs")
    args = parser.parse_args(argv)
    out = render_all()
    stale = []
    for path, text in out.files.items():
        old = path.read_text() if path.exists() else None
        if old != text:
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    if args.check and stale:
        for path in stale:
            print(f"rgpu: generate: {path} is stale (run `python -m rgpu.remoting.native.generate` "
                  "and commit the result)", file=sys.stderr)
        return 1
    if not args.check:
        print(f"generated {len(out.files)} files ({len(stale)} changed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
