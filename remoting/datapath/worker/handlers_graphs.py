"""The worker's stream-capture and CUDA graph handlers."""

from __future__ import annotations

import struct
from collections.abc import Callable

from rgpu.remoting.datapath.backends.base import INVALID_VALUE, SUCCESS, CudaError
from rgpu.remoting.datapath.worker.codecs import U64
from rgpu.remoting.datapath.worker.handlers_launches import LaunchHandlers


class GraphHandlers(LaunchHandlers):
    """Capture and graphs (kernel nodes are admitted as launches are)."""

    # ------------------------------------------------------------------ capture and graphs

    def h_capture_info(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        stream, what = struct.unpack_from("<QI", p, 0)
        stream = self.client_streams.real(stream, "cuStreamGetCaptureInfo")
        status, cid, graph, deps, edges = self.backend.capture_info(stream, what)
        out = [struct.pack("<iIQQQ", status, 0, cid, graph, len(deps))]
        out.extend(U64.pack(d) for d in deps)
        if what == 2:
            out.extend(U64.pack(e) for e in edges)
        return SUCCESS, b"".join(out)

    @staticmethod
    def _node_list(p: memoryview, lister: Callable[[int, int, bool], tuple[int, list[int]]]) -> tuple[int, bytes]:
        graph, cap, want = struct.unpack_from("<QQI", p, 0)
        total, nodes = lister(graph, cap, bool(want))
        return SUCCESS, struct.pack("<QQ", total, len(nodes)) + b"".join(U64.pack(n) for n in nodes)

    def h_graph_nodes(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        return self._node_list(p, self.backend.graph_nodes)

    def h_graph_roots(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """cuGraphGetRootNodes, answered as cuGraphGetNodes is (protocol 11)."""
        return self._node_list(p, self.backend.graph_roots)

    def h_capture_to_graph(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """cuStreamBeginCaptureToGraph: the stream's capture appends to an existing graph, after
        the given nodes (protocol 11)."""
        stream, graph, mode, _, ndeps = struct.unpack_from("<QQiIQ", p, 0)
        stream = self.client_streams.real(stream, "cuStreamBeginCaptureToGraph")
        if 32 + 8 * ndeps > len(p):
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated cuStreamBeginCaptureToGraph request")
        deps = list(struct.unpack_from(f"<{ndeps}Q", p, 32))
        self.backend.capture_to_graph(stream, graph, deps, mode)
        return SUCCESS, b""

    def h_exec_child_set(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """cuGraphExecChildGraphNodeSetParams (protocol 11)."""
        exe, node, child = struct.unpack_from("<QQQ", p, 0)
        self.backend.exec_child_set(exe, node, child)
        return SUCCESS, b""

    def h_graph_add_node(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        graph, kind, _, ndeps = struct.unpack_from("<QIIQ", p, 0)
        off = 24
        deps = list(struct.unpack_from(f"<{ndeps}Q", p, off))
        off += 8 * ndeps
        (plen,) = U64.unpack_from(p, off)
        payload = bytes(p[off + 8:off + 8 + plen])
        size = 0
        if kind == 7:   # a host node: from now on the loop lends its reader while handlers run
            self.hostcalls.active = True
        if kind == 1 and plen >= 8:   # a kernel node (cuda_graph.c's NODE_KERNEL): its kernel's local memory, as at a launch
            self._admit(U64.unpack_from(payload, 0)[0])
        if kind in (9, 10):   # an event record or wait node: the client's event, mapped to the driver's
            name = "cuGraphAddEventRecordNode" if kind == 9 else "cuGraphAddEventWaitNode"
            payload = U64.pack(self.client_events.real(U64.unpack_from(payload, 0)[0], name))
        if kind == 4:   # a graph memory allocation: counted against the slice while its node exists
            (size,) = U64.unpack_from(payload, 88)
            assert self.memory is not None
            self.memory.check(size, "graph memory allocation node")
        try:
            node, aux = self.backend.graph_add_node(kind, graph, deps, payload)
        except BaseException:
            if self.memory is not None:
                self.memory.cancel()
            raise
        if kind == 4 and self.memory is not None:
            self.memory.add(-(node + (1 << 62)), size)
            self.graph_allocs[aux] = -(node + (1 << 62))
        elif kind == 5 and self.memory is not None:
            key = self.graph_allocs.pop(struct.unpack_from("<Q", payload, 0)[0], None)
            if key is not None:
                self.memory.remove(key)
        return SUCCESS, struct.pack("<QQ", node, aux)

    def h_graph_add_edges(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """cuGraphAddDependencies(_v2), and cuGraphAddNode_v2's edge data (graph_generic.c): the
        edges go to the driver as they are; flag 1 removes the just-added `to` node if they fail."""
        graph, flags, _, n = struct.unpack_from("<QIIQ", p, 0)
        if len(p) != 24 + 24 * n:
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated graph dependencies")
        froms = list(struct.unpack_from(f"<{n}Q", p, 24))
        tos = list(struct.unpack_from(f"<{n}Q", p, 24 + 8 * n))
        edges = bytes(p[24 + 16 * n:24 + 24 * n])
        self.backend.graph_add_edges(graph, froms, tos, edges, drop_new_node=bool(flags & 1))
        return SUCCESS, b""

    def h_graph_host_refresh(self, p: memoryview, address: int, seq: int) -> None:
        buffer, size = struct.unpack_from("<QQ", p, 0)
        data = p[16:16 + size]
        if len(data) != size:
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated graph host-copy data")
        self.backend.graph_host_write(buffer, data)

    def h_graph_host_readback(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        stream, n = struct.unpack_from("<QQ", p, 0)
        stream = self.client_streams.real(stream, "cuGraphLaunch")
        pairs = [struct.unpack_from("<QQ", p, 16 + 16 * i) for i in range(n)]
        return SUCCESS, self.backend.graph_host_read(stream, pairs)

    def h_capture_host_copy(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        stream, to_host, _, dev, size = struct.unpack_from("<QIIQQ", p, 0)
        stream = self.client_streams.real(stream, "a copy on a capturing stream")
        data = b"" if to_host else bytes(p[32:32 + size])
        if len(data) != (0 if to_host else size):
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated captured host copy")
        buffer, graph = self.backend.capture_host_copy(stream, bool(to_host), dev, size, data)
        return SUCCESS, struct.pack("<QQ", buffer, graph)

    def h_capture_host_func(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """cuLaunchHostFunc (kind 0) or cuStreamAddCallback (kind 1) on a capturing stream: a host
        node that runs the client's function `fn_id` (an id of the client's table, never an address)."""
        stream, kind, _, fn_id = struct.unpack_from("<QIIQ", p, 0)
        stream = self.client_streams.real(stream, "cuLaunchHostFunc")
        if kind not in (0, 1):
            raise CudaError(INVALID_VALUE, f"rgpu: worker: unknown captured host function kind {kind} (client and "
                                           "server builds differ; install the same rgpu version on both)")
        self.hostcalls.active = True
        self.backend.capture_host_func(stream, kind, fn_id)
        return SUCCESS, b""

    def h_host_node(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """A host node's function id: read (set=0), or set on the graph's node or, with an
        executable graph, on its instance."""
        exe, node, fn_id, set_it, _ = struct.unpack_from("<QQQII", p, 0)
        return SUCCESS, U64.pack(self.backend.host_node_params(exe, node, fn_id if set_it else None))

    def h_kernel_node_set(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        exe, node, plen = struct.unpack_from("<QQQ", p, 0)
        if plen >= 8:
            self._admit(U64.unpack_from(p, 24)[0])
        self.backend.kernel_node_set(exe, node, bytes(p[24:24 + plen]))
        return SUCCESS, b""
