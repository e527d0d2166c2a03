"""The emulated GPU's stream capture and CUDA graphs: nodes added by capture or by hand, edges,
host and child graph nodes, executable graphs (run in the order their nodes were added)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from rgpu.remoting.datapath.backends.arrays import ARRAY, parse_copy
from rgpu.remoting.datapath.backends.base import (
    INVALID_HANDLE,
    INVALID_VALUE,
    NOT_SUPPORTED,
    SUCCESS,
    CudaError,
)
from rgpu.remoting.datapath.backends.emulated_arrays import EmulatedArrays
from rgpu.remoting.datapath.backends.emulated_device import NODE_TYPE_HOST, NODE_TYPE_MEMCPY
from rgpu.remoting.datapath.backends.emulated_memory import EmulatedMemory
from rgpu.remoting.datapath.backends.emulated_modules import _LAUNCH_REFUSED
from rgpu.remoting.datapath.backends.emulated_objects import _ChildNode, _HostNode, _instance
from rgpu.remoting.datapath.backends.emulated_streams import EmulatedStreams


# CUgraphNodeType of the node kinds rgpuGraphAddNode builds (cuda_graph.c's NODE_*).
_NODE_TYPES = {0: 5, 1: 0, 2: 2, 3: 1, 4: 10, 5: 11, 6: 1, 7: 3, 8: 4, 9: 7, 10: 6}


class EmulatedGraphs(EmulatedMemory, EmulatedArrays, EmulatedStreams):
    """Capture, graphs and executable graphs."""

    def graph_add_edges(self, graph: int, froms: list[int], tos: list[int], edges: bytes, drop_new_node: bool) -> None:
        """cuGraphAddDependencies_v2. The emulated device runs a graph's nodes in the order they were
        added, so an edge may only point to a later node; every port and type then means "after",
        a valid schedule of a programmatic edge too."""
        known = self.graph_deps.get(graph)
        try:
            if known is None or graph not in self.graphs:
                raise CudaError(INVALID_VALUE)
            order = list(known)
            pairs = list(zip(froms, tos))
            for i, (a, b) in enumerate(pairs):
                edge = edges[8 * i:8 * i + 8]
                if a not in known or b not in known or a == b or a in known[b] or pairs.index((a, b)) != i:
                    raise CudaError(INVALID_VALUE)   # CUDA: unknown node, self-edge or an edge that exists
                if edge[2] > 1 or edge[0] > 2 or edge[1] != 0 or any(edge[3:]):
                    raise CudaError(INVALID_VALUE)   # an edge type or port CUDA does not define
                if any(edge) and (self.node_types.get(a) != 0 or self.node_types.get(b) != 0):
                    raise CudaError(INVALID_VALUE)   # CUDA: ports and programmatic edges join kernel nodes only
                if order.index(a) > order.index(b):
                    raise CudaError(NOT_SUPPORTED, "rgpu: worker: the emulated GPU runs a graph's nodes in the order "
                                                   "they were added; an edge to an earlier node is not emulated")
        except CudaError:
            if drop_new_node and tos:
                self.cuGraphDestroyNode(tos[0])
            raise
        for a, b in zip(froms, tos):
            known[b] = known[b] + (a,)

    def cuStreamBeginCapture_v2(self, stream: int, mode: int) -> tuple[int]:
        if stream in self.capturing:
            return (401,)   # CUDA_ERROR_ILLEGAL_STATE
        if stream and not self._stream_ok(stream):
            return (INVALID_HANDLE,)
        graph = self.handles.new()
        self.graphs[graph] = []
        self.graph_deps[graph] = {}
        self.capture_seq += 1
        self.capturing[stream] = (self.capture_seq, graph)
        self.capture_tail[stream] = []
        return (SUCCESS,)

    def capture_to_graph(self, stream: int, graph: int, deps: list[int], mode: int) -> None:
        """cuStreamBeginCaptureToGraph: the capture appends to `graph`, after `deps`."""
        if stream in self.capturing:
            raise CudaError(401)   # CUDA_ERROR_ILLEGAL_STATE
        if stream and not self._stream_ok(stream):
            raise CudaError(INVALID_HANDLE)
        known = self.graph_deps.get(graph)
        if graph not in self.graphs or known is None or any(d not in known for d in deps):
            raise CudaError(INVALID_VALUE)
        self.capture_seq += 1
        self.capturing[stream] = (self.capture_seq, graph)
        self.capture_tail[stream] = list(deps)

    def cuStreamEndCapture(self, stream: int) -> tuple[int, int]:
        if stream not in self.capturing:
            return (401, 0)
        _, graph = self.capturing.pop(stream)
        self.capture_tail.pop(stream, None)
        return (SUCCESS, graph)

    def cuThreadExchangeStreamCaptureMode(self, mode: int) -> tuple[int, int]:
        old, self.capture_mode = self.capture_mode, mode
        return (SUCCESS, old)

    def capture_info(self, stream: int, what: int) -> tuple[int, int, int, list[int], list[int]]:
        if stream in self.capturing:
            cid, graph = self.capturing[stream]
            tail = self.capture_tail.get(stream, [])
            return 1, cid, graph, list(tail), [0] * len(tail)
        return 0, 0, 0, [], []

    def cuGraphCreate(self, flags: int) -> tuple[int, int]:
        graph = self.handles.new()
        self.graphs[graph] = []
        self.graph_deps[graph] = {}
        return (SUCCESS, graph)

    def cuGraphDestroy(self, graph: int) -> tuple[int]:
        self.graph_deps.pop(graph, None)
        return (SUCCESS,) if self.graphs.pop(graph, None) is not None else (INVALID_VALUE,)

    def cuGraphClone(self, graph: int) -> tuple[int, int]:
        """The clone keeps the original's node handles (the emulated device's shortcut; CUDA makes
        new ones, found with cuGraphNodeFindInClone, which rgpu does not remote)."""
        if graph not in self.graphs:
            return (INVALID_VALUE, 0)
        clone = self.handles.new()
        self.graphs[clone] = _instance(self.graphs[graph])
        self.graph_deps[clone] = dict(self.graph_deps.get(graph, {}))
        return (SUCCESS, clone)

    def graph_nodes(self, graph: int, cap: int, want: bool) -> tuple[int, list[int]]:
        return self._listed(graph, list(self.graph_deps.get(graph, {})), cap, want)

    def graph_roots(self, graph: int, cap: int, want: bool) -> tuple[int, list[int]]:
        """The nodes without dependencies, in the order they were added."""
        return self._listed(graph, [n for n, d in self.graph_deps.get(graph, {}).items() if not d], cap, want)

    def _listed(self, graph: int, nodes: list[int], cap: int, want: bool) -> tuple[int, list[int]]:
        """cuGraphGetNodes' and cuGraphGetRootNodes' answer: the count, or up to `cap` nodes and
        how many were given."""
        if graph not in self.graphs:
            raise CudaError(INVALID_VALUE)
        if not want:
            return len(nodes), []
        return min(cap, len(nodes)), nodes[:cap]

    def graph_add_node(self, kind: int, graph: int, deps: list[int], payload: bytes) -> tuple[int, int]:
        """Nodes built by hand run in the order they were added (a valid order of a chain)."""
        if graph not in self.graphs:
            raise CudaError(INVALID_VALUE)
        known = self.graph_deps.setdefault(graph, {})
        if len(set(deps)) != len(deps) or any(d not in known for d in deps):
            raise CudaError(INVALID_VALUE)   # CUDA: a dependency that is not a node of this graph
        op: Any = None
        node = aux = 0
        if kind == 1:
            name = self.functions.get(struct.unpack_from("<Q", payload, 0)[0], (0, None))[1]
            if name is None:
                raise CudaError(INVALID_HANDLE)

            def refuse() -> tuple[int]:
                raise CudaError(NOT_SUPPORTED, _LAUNCH_REFUSED)
            op = refuse
        elif kind == 2:
            dst, pitch, value, elem, width, height = struct.unpack_from("<QQIIQQ", payload, 0)
            pattern = struct.pack({1: "<B", 2: "<H", 4: "<I"}[elem], value & ((1 << (8 * elem)) - 1))
            op = lambda: self._memset2d(dst, pitch, pattern, width, height)  # noqa: E731
        elif kind == 3 and ARRAY in struct.unpack_from("<i", payload, 32) + struct.unpack_from("<i", payload, 120):
            desc = bytes(payload[:200])
            sides = parse_copy(desc)
            if any(side.kind == ARRAY and side.array not in self.arrays for side in (sides.src, sides.dst)):
                raise CudaError(INVALID_HANDLE)   # when the node is added, as the driver refuses it

            def copy_3d() -> tuple[int]:
                self._copy_nd(2, desc, None, None)
                return (SUCCESS,)
            op = copy_3d
        elif kind == 3:
            src_x, dst_x, width = (struct.unpack_from("<Q", payload, o)[0] for o in (0, 88, 176))
            src, dst = struct.unpack_from("<Q", payload, 48)[0], struct.unpack_from("<Q", payload, 136)[0]
            op = lambda: self.cuMemcpyDtoD_v2(dst + dst_x, src + src_x, width)  # noqa: E731
        elif kind == 4:
            (size,) = struct.unpack_from("<Q", payload, 88)
            aux, _ = self.mem_alloc("plain", size, 0, 0, 0, 0)
        elif kind == 5:
            ptr = struct.unpack_from("<Q", payload, 0)[0]

            def free() -> tuple[int]:
                self.mem_free(ptr, 0, True)
                return (SUCCESS,)
            op = free
        elif kind == 7:
            node = self.handles.new()
            op = self.host_nodes[node] = _HostNode(self, node, struct.unpack_from("<Q", payload, 0)[0],
                                                   self.graph_regions.setdefault(graph, []))
        elif kind in (9, 10):   # event record and wait nodes (the emulated device runs in order: a wait has nothing to do)
            (event,) = struct.unpack_from("<Q", payload, 0)
            if event not in self.events:
                raise CudaError(INVALID_HANDLE)
            if kind == 9:
                op = lambda: self.cuEventRecord(event, 0)  # noqa: E731
        elif kind == 8:   # a child graph, cloned into the node as CUDA clones it
            (child,) = struct.unpack_from("<Q", payload, 0)
            code, owned = self.cuGraphClone(child)
            if code != SUCCESS:
                raise CudaError(code)
            self.graph_regions.setdefault(graph, []).extend(self.graph_regions.get(child, []))
            node = self.handles.new()
            op = self.child_nodes[node] = _ChildNode(node, owned, self.graphs[owned])
        elif kind == 6:
            to_host, _, dev, size, _ctx = struct.unpack_from("<IIQQQ", payload, 0)
            aux = self.handles.new()
            buf = self.graph_host[aux] = bytearray(size)
            self.graph_regions.setdefault(graph, []).append((aux, size, bool(to_host)))
            op = self._host_copy(dev, size, buf, bool(to_host))
        elif kind != 0:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: unknown graph node kind {kind}")
        return self._node(graph, op, deps, _NODE_TYPES[kind], node), aux

    def cuGraphDestroyNode(self, node: int) -> tuple[int]:
        """The node and every edge to or from it leave its graph."""
        for graph, known in self.graph_deps.items():
            if node in known:
                del known[node]
                for other, deps in known.items():
                    if node in deps:
                        known[other] = tuple(d for d in deps if d != node)
                op = self.node_ops.pop(node, None)
                if op is not None and op in self.graphs.get(graph, []):
                    self.graphs[graph].remove(op)
                self.node_types.pop(node, None)
                return (SUCCESS,)
        return (INVALID_VALUE,)

    def cuGraphNodeGetType(self, node: int) -> tuple[int, int]:
        return (SUCCESS, self.node_types[node]) if node in self.node_types else (INVALID_VALUE, 0)

    def capture_host_func(self, stream: int, kind: int, fn_id: int) -> None:
        """cuLaunchHostFunc on a capturing stream: a host node. cuStreamAddCallback is refused
        there, as NVIDIA's driver refuses it (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)."""
        if stream not in self.capturing:
            raise CudaError(INVALID_VALUE, "rgpu: worker: a captured host function on a stream that is not capturing")
        if kind != 0:
            raise CudaError(900)
        node = self.handles.new()
        graph = self.capturing[stream][1]
        host = self.host_nodes[node] = _HostNode(self, node, fn_id, self.graph_regions.setdefault(graph, []))
        self._captured(stream, host, NODE_TYPE_HOST, node)

    def host_node_params(self, exe: int, node: int, fn_id: int | None) -> int:
        """A host node's function id; with `fn_id`, set it first (on the executable graph's
        instance of the node when `exe` is given)."""
        if exe:
            found = [op for op in self.execs.get(exe, []) if isinstance(op, _HostNode) and op.node == node]
            host = found[0] if found else None
        else:
            host = self.host_nodes.get(node)
        if host is None:
            raise CudaError(INVALID_VALUE)
        if fn_id is not None:
            host.fn_id = fn_id
        return host.fn_id

    def capture_host_copy(self, stream: int, to_host: bool, dev: int, size: int, data: bytes) -> tuple[int, int]:
        if stream not in self.capturing:
            raise CudaError(INVALID_VALUE)
        graph = self.capturing[stream][1]
        buffer = self.handles.new()
        buf = self.graph_host[buffer] = bytearray(data if not to_host else bytes(size))
        self.graph_regions.setdefault(graph, []).append((buffer, size, to_host))
        self._captured(stream, self._host_copy(dev, size, buf, to_host), NODE_TYPE_MEMCPY)
        return buffer, graph

    def _host_copy(self, dev: int, size: int, buf: bytearray, to_host: bool) -> Callable[[], tuple[int]]:
        """A copy node with a host side: its bytes wait in `buf` (the graph's host-copy buffer, which
        the client fills before and reads after a launch)."""
        def copy() -> tuple[int]:
            dbuf, off = self._locate(dev, size)
            if to_host:
                buf[:] = dbuf[off:off + size]
            else:
                dbuf[off:off + size] = buf
            return (SUCCESS,)
        return copy

    def graph_host_write(self, buffer: int, data: memoryview) -> None:
        if len(self.graph_host.get(buffer, b"")) < len(data):
            raise CudaError(INVALID_VALUE)
        self.graph_host[buffer][:len(data)] = data

    def graph_host_peek(self, buffer: int, size: int) -> bytes:
        """A copy node's buffer as it is now (a host node's call, while the graph runs)."""
        return bytes(self.graph_host.get(buffer, b"")[:size])

    def graph_host_poke(self, buffer: int, data: bytes) -> None:
        if len(self.graph_host.get(buffer, b"")) >= len(data):
            self.graph_host[buffer][:len(data)] = data

    def graph_host_read(self, stream: int, pairs: list[tuple[int, int]]) -> bytes:
        if any(len(self.graph_host.get(b, b"")) < n for b, n in pairs):
            raise CudaError(INVALID_VALUE)
        return b"".join(bytes(self.graph_host[b][:n]) for b, n in pairs)

    def cuGraphChildGraphNodeGetGraph(self, node: int) -> tuple[int, int]:
        child = self.child_nodes.get(node)
        return (SUCCESS, child.graph) if child is not None else (INVALID_VALUE, 0)

    def exec_child_set(self, exe: int, node: int, child: int) -> None:
        """cuGraphExecChildGraphNodeSetParams: the executable graph's instance of the node runs a
        copy of `child` from now on; CUDA requires the same topology (checked here as the same
        node count and types, in insertion order)."""
        found = [op for op in self.execs.get(exe, []) if isinstance(op, _ChildNode) and op.node == node]
        if not found or child not in self.graphs:
            raise CudaError(INVALID_VALUE)
        old = self.graph_deps.get(found[0].graph, {})
        new = self.graph_deps.get(child, {})
        if [self.node_types.get(n) for n in old] != [self.node_types.get(n) for n in new]:
            raise CudaError(INVALID_VALUE)
        found[0].ops = _instance(self.graphs[child])

    def kernel_node_set(self, exe: int, node: int, payload: bytes) -> None:
        if exe and exe not in self.execs:
            raise CudaError(INVALID_VALUE)

    def cuGraphInstantiateWithFlags(self, graph: int, flags: int) -> tuple[int, int]:
        if graph not in self.graphs:
            return (INVALID_VALUE, 0)
        exe = self.handles.new()
        self.execs[exe] = _instance(self.graphs[graph])
        return (SUCCESS, exe)

    def cuGraphLaunch(self, exe: int, stream: int) -> tuple[int]:
        if exe not in self.execs:
            return (INVALID_VALUE,)
        for op in self.execs[exe]:
            r = op()[0]
            if r != SUCCESS:
                return (r,)
        return (SUCCESS,)

    def cuGraphUpload(self, exe: int, stream: int) -> tuple[int]:
        return (SUCCESS,) if exe in self.execs else (INVALID_VALUE,)

    def cuGraphExecDestroy(self, exe: int) -> tuple[int]:
        return (SUCCESS,) if self.execs.pop(exe, None) is not None else (INVALID_VALUE,)

    def cuGraphExecUpdate_v2(self, exe: int, graph: int) -> tuple[int, bytes]:
        if exe not in self.execs or graph not in self.graphs:
            return (INVALID_VALUE, b"")
        if len(self.execs[exe]) != len(self.graphs[graph]):
            return (910, b"")   # CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE
        self.execs[exe] = _instance(self.graphs[graph])
        return (SUCCESS, bytes(24))
