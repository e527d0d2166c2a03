"""Driver-API programs for the graph calls JAX/XLA make (issue 24, item 7): root nodes, child
graph nodes and their executable-graph updates, the generic cuGraphAddNode(_v2), and capture into
an existing graph. Each program prints what it saw; `expect_*` checks it against what CUDA
documents. Run through rgpu against the emulated worker (test_graph_api_emulated.py) and against a
real GPU (test_gpu_graph_api.py), so the same expectations hold for both."""

from __future__ import annotations

from pathlib import Path

VECADD_PTX = Path(__file__).resolve().parents[2] / "examples" / "cuda" / "vecadd.ptx"

PRELUDE = """
import ctypes, struct
from ctypes import byref, c_size_t, c_uint64, c_void_p
V = c_void_p
ctx = setup()
s = V()
check("cuStreamCreate", byref(s), 1)

class MEMSET(ctypes.Structure):
    _fields_ = [("dst", c_uint64), ("pitch", c_size_t), ("value", ctypes.c_uint), ("elementSize", ctypes.c_uint),
                ("width", c_size_t), ("height", c_size_t)]

def deps_of(deps):
    return (V * max(len(deps), 1))(*deps) if deps else None

def memset_node(graph, deps, dst, value, words):
    node = V()
    p = MEMSET(dst, 0, value, 4, words, 1)
    check("cuGraphAddMemsetNode", byref(node), graph, deps_of(deps), len(deps), byref(p), ctx)
    return node.value

def new_graph():
    g = V()
    check("cuGraphCreate", byref(g), 0)
    return g

def node_list(name, graph, cap=None):
    n = c_size_t(0)
    if cap is None:
        check(name, graph, None, byref(n))
        return n.value, []
    arr = (V * cap)(*([0xdead] * cap))
    n.value = cap
    check(name, graph, arr, byref(n))
    return n.value, [v or 0 for v in arr]

def words(ptr, count):
    out = (ctypes.c_uint32 * count)()
    check("cuMemcpyDtoH_v2", out, c_uint64(ptr), 4 * count)
    return list(out)

def launch(graph):
    exe = V()
    check("cuGraphInstantiateWithFlags", byref(exe), graph, ctypes.c_ulonglong(0))
    check("cuGraphLaunch", exe, s)
    check("cuStreamSynchronize", s)
    return exe

r, a = alloc(4096)
check("cuMemsetD8_v2", c_uint64(a), 0, 4096)
"""

ROOTS_AND_CHILDREN = PRELUDE + """
# Root nodes: A and B have no dependencies; C waits for both; D for C.
g = new_graph()
A = memset_node(g, [], a, 1, 16)
B = memset_node(g, [], a + 64, 2, 16)
C = V()
check("cuGraphAddEmptyNode", byref(C), g, deps_of([A, B]), 2)
D = memset_node(g, [C.value], a + 128, 3, 16)
print("NODES", node_list("cuGraphGetNodes", g)[0])
count, _ = node_list("cuGraphGetRootNodes", g)
got, roots = node_list("cuGraphGetRootNodes", g, 4)
print("ROOTS", count, got, sorted(roots[:2]) == sorted([A, B]), roots[2:] == [0, 0])
got1, roots1 = node_list("cuGraphGetRootNodes", g, 1)
print("ROOTS1", got1, roots1[0] in (A, B))
print("EMPTYGRAPH", node_list("cuGraphGetRootNodes", new_graph())[0])
n = c_size_t(0)
print("ERR_NULL_COUNT", call("cuGraphGetRootNodes", g, None, None))
print("ERR_NULL_GRAPH", call("cuGraphGetRootNodes", None, None, byref(n)))

# A child graph node runs the child's nodes when the parent is launched; the child is cloned
# into the node, so nodes added to the child afterwards do not run.
child = new_graph()
X = memset_node(child, [], a + 256, 0xAAAA, 16)
memset_node(child, [X], a + 320, 0xBBBB, 16)
parent = new_graph()
M = memset_node(parent, [], a, 7, 16)
K = V()
check("cuGraphAddChildGraphNode", byref(K), parent, deps_of([M]), 1, child)
memset_node(parent, [K.value], a + 384, 9, 16)
memset_node(child, [], a + 448, 0x7777, 16)           # after the clone: not part of the node
kind = ctypes.c_int(-1)
check("cuGraphNodeGetType", K, byref(kind))
print("CHILDTYPE", kind.value)
owned = V()
check("cuGraphChildGraphNodeGetGraph", K, byref(owned))
print("OWNED", node_list("cuGraphGetNodes", owned)[0])
print("PARENT", node_list("cuGraphGetNodes", parent)[0], node_list("cuGraphGetRootNodes", parent)[0])
exe = launch(parent)
print("RUN", words(a, 1)[0], hex(words(a + 256, 1)[0]), hex(words(a + 320, 1)[0]), words(a + 384, 1)[0],
      words(a + 448, 1)[0])

# The executable graph's child node takes another child graph of the same topology.
other = new_graph()
Y = memset_node(other, [], a + 256, 0xCCCC, 16)
memset_node(other, [Y], a + 320, 0xDDDD, 16)
check("cuGraphExecChildGraphNodeSetParams", exe, K, other)
check("cuGraphLaunch", exe, s)
check("cuStreamSynchronize", s)
print("UPDATED", hex(words(a + 256, 1)[0]), hex(words(a + 320, 1)[0]))
print("ERR_NOT_CHILD", call("cuGraphExecChildGraphNodeSetParams", exe, c_void_p(M), other))
print("ERR_NULL_CHILD", call("cuGraphExecChildGraphNodeSetParams", exe, K, None))
bad = V()
print("ERR_ADD_NULL_CHILD", call("cuGraphAddChildGraphNode", byref(bad), parent, None, c_size_t(0), None))
check("cuGraphExecDestroy", exe)
print("DONE")
"""


def expect_roots_and_children(out: str) -> None:
    assert "NODES 4" in out, out
    assert "ROOTS 2 2 True True" in out
    assert "ROOTS1 1 True" in out
    assert "EMPTYGRAPH 0" in out
    assert "ERR_NULL_COUNT 1" in out            # CUDA_ERROR_INVALID_VALUE
    assert "ERR_NULL_GRAPH 1" in out
    assert "CHILDTYPE 4" in out                 # CU_GRAPH_NODE_TYPE_GRAPH
    assert "OWNED 2" in out
    assert "PARENT 3 1" in out
    assert "RUN 7 0xaaaa 0xbbbb 9 0" in out
    assert "UPDATED 0xcccc 0xdddd" in out
    assert "ERR_NOT_CHILD 1" in out
    assert "ERR_NULL_CHILD 1" in out
    assert "ERR_ADD_NULL_CHILD 1" in out
    assert "DONE" in out


GENERIC_NODES = PRELUDE + f"VECADD_PTX = {str(VECADD_PTX)!r}\n" + """
# CUgraphNodeParams (CUDA 12.2+): 256 bytes, the type at 0, the type's parameters at 16.
def params(kind, layout="", *values):
    p = ctypes.create_string_buffer(256)
    struct.pack_into("<i", p, 0, kind)
    if layout:
        struct.pack_into("<" + layout, p, 16, *values)
    return p

def add(graph, deps, p, edges=None, v1=False):
    node = V()
    if v1:
        r = call("cuGraphAddNode", byref(node), graph, deps_of(deps), c_size_t(len(deps)), p)
    else:
        r = call("cuGraphAddNode_v2", byref(node), graph, deps_of(deps), edges, c_size_t(len(deps)), p)
    return r, node.value

def node_type(node):
    t = ctypes.c_int(-1)
    check("cuGraphNodeGetType", c_void_p(node), byref(t))
    return t.value

r2, b = alloc(4096)
check("cuMemsetD8_v2", c_uint64(b), 0, 4096)
calls = []
HOSTFN = ctypes.CFUNCTYPE(None, c_void_p)
hostfn = HOSTFN(lambda data: calls.append(data))
child = new_graph()
memset_node(child, [], a + 512, 0x5151, 16)

g = new_graph()
results = {}
results["memset"] = add(g, [], params(2, "QQIIQQQ", a, 0, 0x1234, 4, 64, 1, ctx.value or 0))
results["empty"] = add(g, [results["memset"][1]], params(5))
memcpy = MEMCPY3D(srcMemoryType=2, srcDevice=a, dstMemoryType=2, dstDevice=b, WidthInBytes=256, Height=1, Depth=1)
p = params(1, "iiQ", 0, 0, ctx.value or 0)
ctypes.memmove(ctypes.addressof(p) + 32, ctypes.addressof(memcpy), ctypes.sizeof(memcpy))
zero_edge = (c_uint64 * 1)(0)
results["memcpy"] = add(g, [results["empty"][1]], p, edges=zero_edge)
results["host"] = add(g, [results["memcpy"][1]], params(3, "QQ", ctypes.cast(hostfn, c_void_p).value, 77))
results["graph"] = add(g, [results["memcpy"][1]], params(4, "Qi", child.value, 0))
results["v1empty"] = add(g, [], params(5), v1=True)
for name, (code, node) in results.items():
    print("ADDED", name, code, node_type(node) if code == 0 else None)
print("ROOTS", node_list("cuGraphGetRootNodes", g)[0])
launch(g)
print("RUN", hex(words(a, 1)[0]), hex(words(b, 1)[0]), hex(words(b + 252, 1)[0]), hex(words(a + 512, 1)[0]),
      calls)

# A memory allocation node writes the address it reserved back into the parameters.
ga = new_graph()
pool = struct.pack("<iiii", 1, 0, 1, 0) + bytes(72)          # pinned, on device 0
p = ctypes.create_string_buffer(256)
struct.pack_into("<i", p, 0, 10)
p[16:16 + 88] = pool
struct.pack_into("<QQQQ", p, 16 + 88, 0, 0, 1 << 20, 0)
code, alloc_node = add(ga, [], p)
dptr = struct.unpack_from("<Q", p, 16 + 112)[0]
print("ALLOCNODE", code, node_type(alloc_node) if code == 0 else None, dptr != 0)
code, _ = add(ga, [alloc_node], params(11, "Q", dptr))
print("FREENODE", code)
launch(ga)

# A kernel node (CUDA_KERNEL_NODE_PARAMS_v3 at 16): its arguments packed as a launch packs them.
mod, fn = V(), V()
check("cuModuleLoad", byref(mod), VECADD_PTX.encode())
check("cuModuleGetFunction", byref(fn), mod, b"vecadd")
args = [c_uint64(a), c_uint64(b), c_uint64(b), ctypes.c_int(64)]
argv = (V * 4)(*[ctypes.cast(byref(x), V) for x in args])
gk = new_graph()
p = params(0, "Q7I4xQQQQ", fn.value, 1, 1, 1, 64, 1, 1, 0, ctypes.addressof(argv), 0, 0, 0)
code, kn = add(gk, [], p)
print("KERNELNODE", code, node_type(kn) if code == 0 else None)

# Edge data (XLA's programmatic dependencies between kernels) go to the driver as they are.
PROGRAMMATIC = (c_uint64 * 1)(0x10001)    # from_port CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, type PROGRAMMATIC
code, kn2 = add(gk, [kn], p, edges=PROGRAMMATIC)
print("PROGRAMMATIC_EDGE", code, node_list("cuGraphGetNodes", gk)[0], node_list("cuGraphGetRootNodes", gk)[0])
code, kn3 = add(gk, [], p)
print("ADD_DEPENDENCIES", call("cuGraphAddDependencies_v2", gk, deps_of([kn2]), deps_of([kn3]), PROGRAMMATIC,
                               c_size_t(1)), node_list("cuGraphGetRootNodes", gk)[0])
print("ADD_DEPENDENCIES_V1", call("cuGraphAddDependencies", gk, deps_of([kn]), deps_of([kn3]), c_size_t(1)),
      call("cuGraphAddDependencies", gk, deps_of([kn]), deps_of([kn3]), c_size_t(1)))   # the second: it exists
print("DESTROY_NODE", call("cuGraphDestroyNode", c_void_p(kn3)), node_list("cuGraphGetNodes", gk)[0],
      node_list("cuGraphGetRootNodes", gk)[0])

# Event wait and record nodes name the application's events; a recorded one is then known recorded.
e1, e2 = V(), V()
check("cuEventCreate", byref(e1), 0)
check("cuEventCreate", byref(e2), 0)
ge = new_graph()
code_w, wn = add(ge, [], params(6, "Q", e1.value))
code_r, rn = add(ge, [wn], params(7, "Q", e2.value))
print("EVENTNODES", code_w, node_type(wn), code_r, node_type(rn))
check("cuEventRecord", e1, s)
check("cuStreamSynchronize", s)                                   # e1 complete: only e2 is in question
ms = ctypes.c_float()
print("BEFORE", call("cuEventElapsedTime", byref(ms), e1, e2))     # e2 never recorded yet
launch(ge)
print("AFTER", call("cuEventElapsedTime", byref(ms), e1, e2), ms.value >= 0, call("cuEventQuery", e2))
print("ERR_EVENT_NULL", add(ge, [], params(7, "Q", 0))[0])

# What rgpu does not carry is refused, never built differently.
# A programmatic port between empty nodes is refused by the driver, and the node is not added.
print("ERR_PORT", add(g, [results["empty"][1]], params(5), edges=(c_uint64 * 1)(1))[0], node_list("cuGraphGetNodes", g)[0])
print("ERR_SEMAPHORE", add(g, [], params(8))[0])
print("ERR_CONDITIONAL", add(g, [], params(13))[0])
p = params(5)
struct.pack_into("<i", p, 4, 1)
print("ERR_RESERVED", add(g, [], p)[0])
print("ERR_NULL", call("cuGraphAddNode_v2", byref(V()), g, None, None, c_size_t(0), None))
print("ERR_FOREIGN_DEP", add(g, [memset_node(child, [], a + 576, 1, 4)], params(5))[0])
print("DONE")
"""


def expect_generic_nodes(out: str, err: str) -> None:
    assert "ADDED memset 0 2" in out, out + err
    assert "ADDED empty 0 5" in out
    assert "ADDED memcpy 0 1" in out
    assert "ADDED host 0 3" in out
    assert "ADDED graph 0 4" in out
    assert "ADDED v1empty 0 5" in out
    assert "ROOTS 2" in out
    assert "RUN 0x1234 0x1234 0x1234 0x5151 [77]" in out
    assert "ALLOCNODE 0 10 True" in out
    assert "FREENODE 0" in out
    assert "KERNELNODE 0 0" in out
    assert "PROGRAMMATIC_EDGE 0 2 1" in out
    assert "ADD_DEPENDENCIES 0 1" in out
    assert "ADD_DEPENDENCIES_V1 0 1" in out     # CUDA_ERROR_INVALID_VALUE: the edge exists
    assert "DESTROY_NODE 0 2 1" in out
    assert "ERR_PORT 1 6" in out                # CUDA_ERROR_INVALID_VALUE; the graph keeps its 6 nodes
    assert "EVENTNODES 0 6 0 7" in out           # CU_GRAPH_NODE_TYPE_WAIT_EVENT, _EVENT_RECORD
    assert "BEFORE 400" in out                  # CUDA_ERROR_INVALID_HANDLE: not recorded yet
    assert "AFTER 0 True 0" in out
    assert "ERR_EVENT_NULL 1" in out
    assert "ERR_SEMAPHORE 801" in out
    assert "ERR_CONDITIONAL 801" in out
    assert "ERR_RESERVED 1" in out
    assert "ERR_NULL 1" in out
    assert "ERR_FOREIGN_DEP 1" in out
    assert "DONE" in out


def expect_generic_refusals_said_why(err: str) -> None:
    """rgpu's own lines (only through rgpu: NVIDIA's driver builds these nodes)."""
    assert "rgpu: client: cuGraphAddNode_v2: external semaphore signal nodes (type 8) are not remoted yet" in err
    assert "rgpu: client: cuGraphAddNode_v2: conditional nodes (type 13) are not remoted yet" in err


CAPTURE_TO_GRAPH = PRELUDE + """
r2, b = alloc(4096)
check("cuMemsetD8_v2", c_uint64(b), 0, 4096)
g = new_graph()
A = memset_node(g, [], a, 1, 64)
B = memset_node(g, [], a + 1024, 2, 16)
check("cuStreamBeginCaptureToGraph", s, g, deps_of([A]), None, c_size_t(1), 2)   # relaxed mode
status, cid, seen, deps, n = ctypes.c_int(), c_uint64(), V(), V(), c_size_t()
check("cuStreamGetCaptureInfo_v2", s, byref(status), byref(cid), byref(seen), byref(deps), byref(n))
first = ctypes.cast(deps, ctypes.POINTER(V))[0] if n.value else None
print("DURING", status.value, seen.value == g.value, n.value, first == A)
check("cuMemsetD32Async", c_uint64(a), 3, 16, s)                 # after A: overwrites its first words
check("cuMemcpyDtoDAsync_v2", c_uint64(b), c_uint64(a), 256, s)
out = V()
check("cuStreamEndCapture", s, byref(out))
print("SAMEGRAPH", out.value == g.value)
count, roots = node_list("cuGraphGetRootNodes", g, 4)
print("NODES", node_list("cuGraphGetNodes", g)[0], "ROOTS", count, sorted(roots[:2]) == sorted([A, B]))
launch(g)
print("RUN", words(a, 1)[0], words(a + 60, 2), words(b, 1)[0], words(b + 252, 1)[0], words(a + 1024, 1)[0])

# Errors CUDA documents for a bad graph, and edge data rgpu does not carry.
print("ERR_NULL_GRAPH", call("cuStreamBeginCaptureToGraph", s, None, None, None, c_size_t(0), 2))
elsewhere = new_graph()
foreign = memset_node(elsewhere, [], a + 3072, 4, 4)
print("ERR_FOREIGN_DEP", call("cuStreamBeginCaptureToGraph", s, g, deps_of([foreign]), None, c_size_t(1), 2))
edge = (c_uint64 * 1)(1)
print("ERR_PORT", call("cuStreamBeginCaptureToGraph", s, g, deps_of([A]), edge, c_size_t(1), 2))
st = ctypes.c_int(9)
check("cuStreamIsCapturing", s, byref(st))
print("NOTCAPTURING", st.value)
# A second capture into the same graph, after the captured copy's node: appends again.
check("cuStreamBeginCaptureToGraph", s, g, None, None, c_size_t(0), 2)
check("cuMemsetD32Async", c_uint64(a + 2048), 5, 4, s)
check("cuStreamEndCapture", s, byref(out))
print("AGAIN", node_list("cuGraphGetNodes", g)[0], node_list("cuGraphGetRootNodes", g)[0])
print("DONE")
"""


def expect_capture_to_graph(out: str) -> None:
    assert "DURING 1 True 1 True" in out, out
    assert "SAMEGRAPH True" in out
    assert "NODES 4 ROOTS 2 True" in out
    assert "RUN 3 [3, 1] 3 1 2" in out
    assert "ERR_NULL_GRAPH 1" in out
    assert "ERR_FOREIGN_DEP 1" in out           # a dependency that is not a node of the graph
    assert "NOTCAPTURING 0" in out
    assert "AGAIN 5 3" in out                   # no dependencies given: a new root
    assert "DONE" in out


def expect_capture_refusal_said_why(out: str, err: str) -> None:
    assert "ERR_PORT 801" in out, out
    assert "rgpu: client: cuStreamBeginCaptureToGraph: dependencies with edge data are not remoted" in err, err
