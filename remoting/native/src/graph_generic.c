/* The generic node API (cuGraphAddNode, cuGraphAddNode_v2) and capture into an existing graph
 * (cuStreamBeginCaptureToGraph), which JAX/XLA build their graphs with.
 *
 * A generic node is built as the cuGraphAdd*Node call of its type builds it (cuda_graph.c,
 * host_nodes.c), so each type carries exactly what that call carries. Types rgpu does not build
 * are refused with one line naming what was asked: never a node that would run differently from
 * the application's request. Edge data (programmatic and launch-order ports, which XLA uses) go
 * to the worker's driver as they are (rgpuGraphAddEdges, protocol 13): a node with such
 * dependencies is added without them, then joined to them; if the driver refuses the edges, the
 * worker removes the node again, so the graph is as CUDA would have left it. Capture into a graph
 * after dependencies with edge data is still refused. */
#include <stddef.h>
#include <string.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

enum { NODE_EVENT_RECORD = 9, NODE_EVENT_WAIT = 10 };   /* rgpuGraphAddNode's kinds (cuda_graph.c's NODE_*) */

enum {
    TYPE_KERNEL = 0, TYPE_MEMCPY = 1, TYPE_MEMSET = 2, TYPE_HOST = 3, TYPE_GRAPH = 4, TYPE_EMPTY = 5,
    TYPE_WAIT_EVENT = 6, TYPE_EVENT_RECORD = 7, TYPE_MEM_ALLOC = 10, TYPE_MEM_FREE = 11,
};

static const char *const TYPE_NAMES[] = {
    "kernel", "memcpy", "memset", "host", "child graph", "empty", "event wait", "event record",
    "external semaphore signal", "external semaphore wait", "memory allocation", "memory free", "batch memory operation",
    "conditional",
};

/* Edge data all zero is the default edge (full completion, full dependency): the same as none. */
static int default_edges(const CUgraphEdgeData *edges, size_t n) {
    static const CUgraphEdgeData zero;
    for (size_t i = 0; edges && i < n; i++)
        if (memcmp(&edges[i], &zero, sizeof zero)) return 0;
    return 1;
}

static CUresult refuse_edges(const char *call) {
    rgpu_log(1, "%s: dependencies with edge data are not remoted yet (programmatic and launch-order ports; "
             "pass NULL or all-zero edge data for full dependencies)", call);
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* Event nodes: the event is this process's handle (the worker maps it, cuda_events.c); one that a
 * node records is always asked about afterwards, since only the worker knows when the graph ran. */
static CUresult add_event_node(uint32_t kind, CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *deps,
                               size_t ndeps, CUevent event) {
    if (!event) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_event_check(event);
    if (r != CUDA_SUCCESS) return r;
    if (kind == NODE_EVENT_RECORD) rgpu_event_in_graph(event);
    uint64_t e = (uint64_t)(uintptr_t)event;
    return rgpu_graph_add_node(kind, phGraphNode, hGraph, deps, ndeps, &e, 8, NULL);
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddEventRecordNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                                       const CUgraphNode *dependencies, size_t numDependencies,
                                                       CUevent event) {
    return add_event_node(NODE_EVENT_RECORD, phGraphNode, hGraph, dependencies, numDependencies, event);
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddEventWaitNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                                     const CUgraphNode *dependencies, size_t numDependencies,
                                                     CUevent event) {
    return add_event_node(NODE_EVENT_WAIT, phGraphNode, hGraph, dependencies, numDependencies, event);
}

static CUresult add_generic(const char *call, CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *deps,
                            size_t ndeps, CUgraphNodeParams *p) {
    if (!phGraphNode || !hGraph || !p || (ndeps && !deps)) return CUDA_ERROR_INVALID_VALUE;
    if (p->reserved0[0] || p->reserved0[1] || p->reserved0[2] || p->reserved2) return CUDA_ERROR_INVALID_VALUE;
    switch (p->type) {
    case TYPE_EMPTY:
        return cuGraphAddEmptyNode(phGraphNode, hGraph, deps, ndeps);
    case TYPE_KERNEL: {
        const CUDA_KERNEL_NODE_PARAMS_v2 *k = &p->u.kernel;
        unsigned int dims[7] = {k->gridDimX, k->gridDimY, k->gridDimZ, k->blockDimX, k->blockDimY, k->blockDimZ,
                                k->sharedMemBytes};
        if (!k->func && !k->kern) return CUDA_ERROR_INVALID_VALUE;
        return rgpu_graph_add_kernel(phGraphNode, hGraph, deps, ndeps, k->func, k->kern, dims, k->kernelParams,
                                     k->extra);
    }
    case TYPE_MEMCPY:
        if (p->u.memcpy.flags || p->u.memcpy.reserved) return CUDA_ERROR_INVALID_VALUE;
        return cuGraphAddMemcpyNode(phGraphNode, hGraph, deps, ndeps, &p->u.memcpy.copyParams, p->u.memcpy.copyCtx);
    case TYPE_MEMSET:
        return cuGraphAddMemsetNode(phGraphNode, hGraph, deps, ndeps, &p->u.memset.params, p->u.memset.ctx);
    case TYPE_HOST:
        return cuGraphAddHostNode(phGraphNode, hGraph, deps, ndeps, &p->u.host);
    case TYPE_GRAPH:
        if (p->u.graph.ownership != 0 /* CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE */) {
            rgpu_log(1, "%s: a child graph node that takes ownership of its graph is not remoted yet (ownership %d; "
                     "use CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE)", call, p->u.graph.ownership);
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        return cuGraphAddChildGraphNode(phGraphNode, hGraph, deps, ndeps, p->u.graph.graph);
    case TYPE_EVENT_RECORD:
        return cuGraphAddEventRecordNode(phGraphNode, hGraph, deps, ndeps, p->u.event.event);
    case TYPE_WAIT_EVENT:
        return cuGraphAddEventWaitNode(phGraphNode, hGraph, deps, ndeps, p->u.event.event);
    case TYPE_MEM_ALLOC:
        return cuGraphAddMemAllocNode(phGraphNode, hGraph, deps, ndeps, &p->u.alloc);
    case TYPE_MEM_FREE:
        return cuGraphAddMemFreeNode(phGraphNode, hGraph, deps, ndeps, p->u.free.dptr);
    default:
        break;
    }
    int known = p->type >= 0 && p->type < (int)(sizeof TYPE_NAMES / sizeof *TYPE_NAMES);
    rgpu_log(1, "%s: %s nodes (type %d) are not remoted yet (rgpu builds empty, kernel, memcpy, memset, host, child "
             "graph, event record and wait, memory allocation and memory free nodes)", call, known ? TYPE_NAMES[p->type] : "unknown", p->type);
    return CUDA_ERROR_NOT_SUPPORTED;
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                            size_t numDependencies, CUgraphNodeParams *nodeParams) {
    return add_generic("cuGraphAddNode", phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
}

enum { EDGES_DROP_NEW_NODE = 1 };   /* rgpuGraphAddEdges' flag: `to` was just added; remove it if the edges fail */

/* {u64 graph, u32 flags, u32 0, u64 n, n x u64 from, n x u64 to, n x CUgraphEdgeData (zero: the default)} */
static CUresult add_edges(CUgraph hGraph, const CUgraphNode *from, const CUgraphNode *to, size_t to_count,
                          const CUgraphEdgeData *edges, size_t n, uint32_t flags) {
    static const CUgraphEdgeData zero;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_rgpuGraphAddEdges);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)hGraph);
    rgpu_put_u32(&c, flags);
    rgpu_put_u32(&c, 0);
    rgpu_put_u64(&c, n);
    for (size_t i = 0; i < n; i++) rgpu_put_u64(&c, (uint64_t)(uintptr_t)from[i]);
    for (size_t i = 0; i < n; i++) rgpu_put_u64(&c, (uint64_t)(uintptr_t)to[to_count == 1 ? 0 : i]);
    for (size_t i = 0; i < n; i++) rgpu_put(&c, edges ? &edges[i] : &zero, sizeof zero);
    r = rgpu_sync(&c);
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
                                               const CUgraphNode *dependencies, const CUgraphEdgeData *dependencyData,
                                               size_t numDependencies, CUgraphNodeParams *nodeParams) {
    if (default_edges(dependencyData, numDependencies))
        return add_generic("cuGraphAddNode_v2", phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
    if (!dependencies) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = add_generic("cuGraphAddNode_v2", phGraphNode, hGraph, NULL, 0, nodeParams);
    if (r != CUDA_SUCCESS) return r;
    r = add_edges(hGraph, dependencies, phGraphNode, 1, dependencyData, numDependencies, EDGES_DROP_NEW_NODE);
    if (r != CUDA_SUCCESS) *phGraphNode = NULL;
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddDependencies_v2(CUgraph hGraph, const CUgraphNode *from, const CUgraphNode *to,
                                                       const CUgraphEdgeData *edgeData, size_t numDependencies) {
    if (!hGraph || (numDependencies && (!from || !to))) return CUDA_ERROR_INVALID_VALUE;
    if (!numDependencies) return CUDA_SUCCESS;
    return add_edges(hGraph, from, to, numDependencies, edgeData, numDependencies, 0);
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddDependencies(CUgraph hGraph, const CUgraphNode *from, const CUgraphNode *to,
                                                    size_t numDependencies) {
    return cuGraphAddDependencies_v2(hGraph, from, to, NULL, numDependencies);
}

/* {u64 stream, u64 graph, i32 mode, u32 0, u64 n, n x u64 dependency}: the worker's driver
 * captures into the graph, the stream's first work depending on the given nodes. */
RGPU_EXPORT CUresult CUDAAPI cuStreamBeginCaptureToGraph(CUstream hStream, CUgraph hGraph,
                                                         const CUgraphNode *dependencies,
                                                         const CUgraphEdgeData *dependencyData,
                                                         size_t numDependencies, CUstreamCaptureMode mode) {
    if (!hGraph || (numDependencies && !dependencies)) return CUDA_ERROR_INVALID_VALUE;
    if (!default_edges(dependencyData, numDependencies)) return refuse_edges("cuStreamBeginCaptureToGraph");
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_cuStreamBeginCaptureToGraph);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)hStream);
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)hGraph);
    rgpu_put_u32(&c, (uint32_t)mode);
    rgpu_put_u32(&c, 0);
    rgpu_put_u64(&c, numDependencies);
    for (size_t i = 0; i < numDependencies; i++) rgpu_put_u64(&c, (uint64_t)(uintptr_t)dependencies[i]);
    r = rgpu_sync(&c);
    rgpu_capture_begun(r);
    rgpu_end(&c);
    return r;
}

_Static_assert(sizeof(CUgraphEdgeData) == 8, "CUgraphEdgeData layout");
_Static_assert(sizeof(CUgraphNodeParams) == 256, "CUgraphNodeParams layout");
_Static_assert(offsetof(CUgraphNodeParams, u) == 16, "CUgraphNodeParams layout");
_Static_assert(sizeof(((CUgraphNodeParams *)0)->u.memcpy) == 216, "CUDA_MEMCPY_NODE_PARAMS layout");
_Static_assert(sizeof(((CUgraphNodeParams *)0)->u.memset) == 48, "CUDA_MEMSET_NODE_PARAMS_v2 layout");
_Static_assert(sizeof(((CUgraphNodeParams *)0)->u.graph) == 16, "CUDA_CHILD_GRAPH_NODE_PARAMS layout");
