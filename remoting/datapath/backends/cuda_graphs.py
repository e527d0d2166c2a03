"""The real-GPU backend's stream capture and CUDA graphs: node lists, nodes (kernel, memory, host
function, child graph, event), host-copy nodes through pinned buffers of the worker's."""

from __future__ import annotations

import ctypes
import struct
from typing import Any

from rgpu.remoting.datapath.backends.base import INVALID_VALUE, SUCCESS, CudaError
from rgpu.remoting.datapath.backends.cuda_driver import (c_void_p, c_int, c_size_t, c_uint64, byref, P,
                                                         MEMHOSTALLOC_PORTABLE, CUDA_MEMCPY3D, CUDA_HOST_NODE_PARAMS,
                                                         CUDA_KERNEL_NODE_PARAMS_v2)
from rgpu.remoting.datapath.backends.cuda_device import CudaDevice


class CudaGraphs(CudaDevice):
    """Capture and graphs."""

    def capture_info(self, stream: int, what: int) -> tuple[int, int, int, list[int], list[int]]:
        status = c_int()
        if what == 0:
            r = self.f["cuStreamIsCapturing"](stream or None, byref(status))
            if r != SUCCESS:
                raise CudaError(r)
            return status.value, 0, 0, [], []
        cid, graph, deps, edges, n = c_uint64(), c_void_p(), c_void_p(), c_void_p(), c_size_t()
        r = self.f["cuStreamGetCaptureInfo_v3"](stream or None, byref(status), byref(cid), byref(graph), byref(deps),
                                                byref(edges) if what == 2 else None, byref(n))
        if r != SUCCESS:
            raise CudaError(r)
        count = n.value if status.value else 0
        dep_list = list((c_uint64 * count).from_address(deps.value)) if count and deps.value else [0] * count
        edge_list = list((c_uint64 * count).from_address(edges.value)) if count and edges.value else [0] * count
        return status.value, cid.value, graph.value or 0, dep_list, edge_list

    def _node_list(self, fn: Any, graph: int, cap: int, want: bool) -> tuple[int, list[int]]:
        n = c_size_t(cap)
        if not want:
            r = fn(graph, None, byref(n))
            if r != SUCCESS:
                raise CudaError(r)
            return n.value, []
        arr = (c_void_p * max(cap, 1))()
        r = fn(graph, arr, byref(n))
        if r != SUCCESS:
            raise CudaError(r)
        return n.value, [v or 0 for v in arr[:min(cap, n.value)]]

    def graph_nodes(self, graph: int, cap: int, want: bool) -> tuple[int, list[int]]:
        return self._node_list(self.f["cuGraphGetNodes"], graph, cap, want)

    def graph_roots(self, graph: int, cap: int, want: bool) -> tuple[int, list[int]]:
        fn = self._late_fn("cuGraphGetRootNodes", [c_void_p, c_void_p, P(c_size_t)])
        return self._node_list(fn, graph, cap, want)

    def capture_to_graph(self, stream: int, graph: int, deps: list[int], mode: int) -> None:
        """cuStreamBeginCaptureToGraph with default edges (the client refuses others)."""
        d = (c_void_p * max(len(deps), 1))(*deps)
        fn = self._late_fn("cuStreamBeginCaptureToGraph", [c_void_p, c_void_p, c_void_p, c_void_p, c_size_t, c_int])
        r = fn(stream or None, graph or None, d if deps else None, None, len(deps), mode)
        if r != SUCCESS:
            raise CudaError(r)
        self._captures += 1

    def graph_add_edges(self, graph: int, froms: list[int], tos: list[int], edges: bytes, drop_new_node: bool) -> None:
        """cuGraphAddDependencies_v2 with the application's edge data (8 bytes an edge); with
        `drop_new_node`, the node `tos[0]` was just added for these edges and goes if they fail."""
        n = len(froms)
        f, t = (c_void_p * max(n, 1))(*froms), (c_void_p * max(n, 1))(*tos)
        data = ctypes.create_string_buffer(edges, max(len(edges), 1))
        fn = self._late_fn("cuGraphAddDependencies_v2", [c_void_p, c_void_p, c_void_p, c_void_p, c_size_t])
        r = fn(graph or None, f, t, data, n)
        if r != SUCCESS:
            if drop_new_node and tos:
                self._late_fn("cuGraphDestroyNode", [c_void_p])(tos[0] or None)
            raise CudaError(r)

    def exec_child_set(self, exe: int, node: int, child: int) -> None:
        fn = self._late_fn("cuGraphExecChildGraphNodeSetParams", [c_void_p, c_void_p, c_void_p])
        r = fn(exe or None, node or None, child or None)
        if r != SUCCESS:
            raise CudaError(r)

    def _kernel_params(self, payload: bytes) -> tuple[CUDA_KERNEL_NODE_PARAMS_v2, list[Any]]:
        """The packed node parameters as the driver's struct; the arguments go as one buffer."""
        (f,) = struct.unpack_from("<Q", payload, 0)
        is_kernel, gx, gy, gz, bx, by, bz, shmem, argsize, _ = struct.unpack_from("<10I", payload, 8)
        args = ctypes.create_string_buffer(payload[48:48 + argsize], max(argsize, 1))
        size = c_size_t(argsize)
        extra = (c_void_p * 5)(1, ctypes.addressof(args), 2, ctypes.addressof(size), 0)
        k = CUDA_KERNEL_NODE_PARAMS_v2(func=None if is_kernel else f, gridDimX=gx, gridDimY=gy, gridDimZ=gz,
                                       blockDimX=bx, blockDimY=by, blockDimZ=bz, sharedMemBytes=shmem,
                                       kernelParams=None, extra=ctypes.addressof(extra),
                                       kern=f if is_kernel else None, ctx=None)
        return k, [args, size, extra]   # alive until the driver has copied them

    def graph_add_node(self, kind: int, graph: int, deps: list[int], payload: bytes) -> tuple[int, int]:
        node = c_void_p()
        d = (c_void_p * max(len(deps), 1))(*deps)
        head = (byref(node), graph, d if deps else None, len(deps))
        aux = 0
        if kind == 0:
            self._check("cuGraphAddEmptyNode", *head)
        elif kind == 1:
            k, _keep = self._kernel_params(payload)
            self._check("cuGraphAddKernelNode_v2", *head, byref(k))
        elif kind in (2, 3):
            size = 40 if kind == 2 else 200
            params = ctypes.create_string_buffer(payload[:size], size)
            (ctx,) = struct.unpack_from("<Q", payload, size)
            self._check("cuGraphAddMemsetNode" if kind == 2 else "cuGraphAddMemcpyNode", *head, params, ctx or None)
        elif kind == 4:
            bytesize, n = struct.unpack_from("<QQ", payload, 88)
            descs = ctypes.create_string_buffer(payload[104:104 + 12 * n], max(12 * n, 1))
            pool = bytearray(payload[:88])
            if struct.unpack_from("<i", pool, 8)[0] == 1:   # the pool's location: the worker's device 0
                struct.pack_into("<i", pool, 12, 0)
            for i in range(n):
                if struct.unpack_from("<i", descs, 12 * i)[0] == 1:
                    struct.pack_into("<i", descs, 12 * i + 4, 0)
            params = ctypes.create_string_buffer(bytes(pool) + struct.pack("<QQQQ", ctypes.addressof(descs) if n else 0,
                                                                            n, bytesize, 0), 120)
            self._check("cuGraphAddMemAllocNode", *head, params)
            (aux,) = struct.unpack_from("<Q", params.raw, 112)
        elif kind == 5:
            (dptr,) = struct.unpack_from("<Q", payload, 0)
            self._check("cuGraphAddMemFreeNode", *head, dptr)
        elif kind == 7:   # a host node: the driver calls our trampoline with the client's function id
            (fn_id,) = struct.unpack_from("<Q", payload, 0)
            host_params = CUDA_HOST_NODE_PARAMS(self._host_fn_address, self._host_token(fn_id, self._regions(graph)))
            self._check("cuGraphAddHostNode", *head, byref(host_params))
        elif kind == 8:   # a child graph: the driver clones it into the node
            (child,) = struct.unpack_from("<Q", payload, 0)
            fn = self._late_fn("cuGraphAddChildGraphNode", [P(c_void_p), c_void_p, c_void_p, c_size_t, c_void_p])
            r = fn(*head, child or None)
            if r != SUCCESS:
                raise CudaError(r)
        elif kind in (9, 10):   # an event record or wait node (the worker's event)
            (event,) = struct.unpack_from("<Q", payload, 0)
            name = "cuGraphAddEventRecordNode" if kind == 9 else "cuGraphAddEventWaitNode"
            r = self._late_fn(name, [P(c_void_p), c_void_p, c_void_p, c_size_t, c_void_p])(*head, event or None)
            if r != SUCCESS:
                raise CudaError(r)
        elif kind == 6:   # a 1D copy with a host side: through a pinned buffer of this worker's
            to_host, _, dev, size, ctx = struct.unpack_from("<IIQQQ", payload, 0)
            aux = self._graph_host_buffer(size)
            self._regions(graph).append((aux, size, bool(to_host)))
            m = CUDA_MEMCPY3D(WidthInBytes=size, Height=1, Depth=1)
            if to_host:
                m.srcMemoryType, m.srcDevice, m.dstMemoryType, m.dstHost = 2, dev, 1, aux
            else:
                m.srcMemoryType, m.srcHost, m.dstMemoryType, m.dstDevice = 1, aux, 2, dev
            self._check("cuGraphAddMemcpyNode", *head, byref(m), ctx or None)
        else:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: unknown graph node kind {kind}")
        return node.value or 0, aux

    def _regions(self, graph: int) -> list[tuple[int, int, bool]]:
        return self._graph_regions.setdefault(graph, [])

    def _host_token(self, fn_id: int, regions: list[tuple[int, int, bool]]) -> int:
        token = len(self._host_tokens) + 1
        self._host_tokens[token] = (fn_id, regions)
        return token

    def capture_host_func(self, stream: int, kind: int, fn_id: int) -> None:
        """cuLaunchHostFunc (kind 0) or cuStreamAddCallback (kind 1) on a capturing stream; the
        driver decides (it refuses a stream callback in capture)."""
        _, _, graph, _, _ = self.capture_info(stream, 1)
        token = self._host_token(fn_id, self._regions(graph))
        if kind == 0:
            self._check("cuLaunchHostFunc", stream or None, self._host_fn_address, token)
        else:
            self._check("cuStreamAddCallback", stream or None, self._stream_callback_address, token, 0)

    def _node_token(self, node: int) -> tuple[int, list[tuple[int, int, bool]]]:
        params = CUDA_HOST_NODE_PARAMS()
        self._check("cuGraphHostNodeGetParams", node, byref(params))
        if params.fn != self._host_fn_address:
            return 0, []
        return self._host_tokens.get(params.userData or 0, (0, []))

    def host_node_params(self, exe: int, node: int, fn_id: int | None) -> int:
        """A host node's function id; with `fn_id`, set it first (on `exe`'s instance if given)."""
        try:
            old_fn, regions = self._node_token(node)
        except CudaError:
            if fn_id is None or not exe:
                raise
            old_fn, regions = 0, []   # the graph is gone; its executable graph still holds the node
        if fn_id is None:
            return old_fn
        params = CUDA_HOST_NODE_PARAMS(self._host_fn_address, self._host_token(fn_id, regions))
        if exe:
            self._check("cuGraphExecHostNodeSetParams", exe, node, byref(params))
        else:
            self._check("cuGraphHostNodeSetParams", node, byref(params))
        return fn_id

    def capture_host_copy(self, stream: int, to_host: bool, dev: int, size: int, data: bytes) -> tuple[int, int]:
        """A copy with a host side on a capturing stream: captured through a pinned buffer of this
        worker's (its data now, refreshed before each launch, read back after)."""
        address = self._graph_host_buffer(size)
        if to_host:
            self._check("cuMemcpyDtoHAsync_v2", address, dev, size, stream or None)
        else:
            ctypes.memmove(address, data, size)
            self._check("cuMemcpyHtoDAsync_v2", dev, address, size, stream or None)
        _, _, graph, _, _ = self.capture_info(stream, 1)
        self._regions(graph).append((address, size, to_host))
        return address, graph

    def _graph_host_buffer(self, size: int) -> int:
        """A pinned buffer for a graph's copy node; allocated in relaxed capture mode, since an
        application's capture in global mode forbids allocations on other threads' behalf."""
        code, mode = self.cuThreadExchangeStreamCaptureMode(2)   # CU_STREAM_CAPTURE_MODE_RELAXED
        if code != SUCCESS:
            raise CudaError(code)
        buf = c_void_p()
        try:
            self._with_primary(lambda: self._check("cuMemHostAlloc", byref(buf), max(size, 1), MEMHOSTALLOC_PORTABLE))
        finally:
            self.cuThreadExchangeStreamCaptureMode(mode)
        self._graph_host[buf.value or 0] = size
        return buf.value or 0

    def _graph_buffer(self, buffer: int, size: int) -> None:
        if self._graph_host.get(buffer, -1) < size:
            raise CudaError(INVALID_VALUE, "rgpu: worker: unknown graph host-copy buffer")

    def graph_host_write(self, buffer: int, data: memoryview) -> None:
        """The data of a host-to-device copy node, once no launch still reads its buffer."""
        self._graph_buffer(buffer, len(data))
        self._check("cuCtxSynchronize")
        ctypes.memmove(buffer, (ctypes.c_char * len(data)).from_buffer_copy(data), len(data))

    def graph_host_peek(self, buffer: int, size: int) -> bytes:
        """A copy node's pinned buffer as it is now (a host node's call, while the graph runs)."""
        self._graph_buffer(buffer, size)
        return ctypes.string_at(buffer, size)

    def graph_host_poke(self, buffer: int, data: bytes) -> None:
        self._graph_buffer(buffer, len(data))
        ctypes.memmove(buffer, data, len(data))

    def graph_host_read(self, stream: int, pairs: list[tuple[int, int]]) -> bytes:
        for buffer, size in pairs:
            self._graph_buffer(buffer, size)
        self._check("cuStreamSynchronize", stream or None)
        return b"".join(ctypes.string_at(buffer, size) for buffer, size in pairs)

    def kernel_node_set(self, exe: int, node: int, payload: bytes) -> None:
        k, _keep = self._kernel_params(payload)
        if exe:
            self._check("cuGraphExecKernelNodeSetParams_v2", exe, node, byref(k))
        else:
            self._check("cuGraphKernelNodeSetParams_v2", node, byref(k))
