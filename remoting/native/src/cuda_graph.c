/* Stream capture, graphs and virtual memory management: the parts the generator cannot write.
 *
 * The captured graph, its nodes and every executable graph live on the server; the client holds
 * their handles. Launches, memsets and device copies on a capturing stream travel as always
 * (pipelined) and the server's driver records them. Capture status is asked before nearly every
 * launch by CuPy and PyTorch, so it is answered here while no capture can be under way (no
 * cuStreamBeginCapture succeeded that no cuStreamEndCapture ended): exact, since a stream only
 * starts capturing through cuStreamBeginCapture. Otherwise the server's driver answers.
 * Host nodes, whose functions run in this process: host_nodes.c. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

#define CUDA_ERROR_STREAM_CAPTURE_INVALIDATED 901

static int g_captures;

void rgpu_capture_begun(CUresult r) {
    if (r == CUDA_SUCCESS) __atomic_add_fetch(&g_captures, 1, __ATOMIC_SEQ_CST);
}

/* Only an end that certainly ended a capture lowers the count: an overcount costs round trips,
 * never a wrong answer. */
void rgpu_capture_ended(CUresult r) {
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_STREAM_CAPTURE_INVALIDATED) return;
    int n = __atomic_load_n(&g_captures, __ATOMIC_SEQ_CST);
    while (n > 0 && !__atomic_compare_exchange_n(&g_captures, &n, n - 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
}

int rgpu_capture_possible(void) { return __atomic_load_n(&g_captures, __ATOMIC_SEQ_CST) > 0; }

/* The driver hands out its own arrays of dependencies, valid until the thread's next call. */
static __thread CUgraphNode *t_deps;
static __thread uint64_t *t_edges;
static __thread size_t t_cap;

enum { INFO_STATUS = 0, INFO_FULL = 1, INFO_EDGES = 2 };

static CUresult capture_info(CUstream hStream, unsigned int what, CUstreamCaptureStatus *status, cuuint64_t *id,
                             void **graph, void **deps, void **edges, size_t *ndeps) {
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!rgpu_capture_possible()) {
        *status = CU_STREAM_CAPTURE_STATUS_NONE;
        if (id) *id = 0;
        if (graph) *graph = NULL;
        if (deps) *deps = NULL;
        if (edges) *edges = NULL;
        if (ndeps) *ndeps = 0;
        return CUDA_SUCCESS;
    }
    rgpu_call c;
    r = rgpu_begin(&c, RGPU_OP_rgpuStreamCaptureInfo);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)hStream);
    rgpu_put_u32(&c, what);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) {
        *status = (CUstreamCaptureStatus)rgpu_get_i32(&c);
        (void)rgpu_get_u32(&c);
        uint64_t cid = rgpu_get_u64(&c), g = rgpu_get_u64(&c), n = rgpu_get_u64(&c);
        if (n > t_cap) {
            size_t cap = n < 16 ? 16 : (size_t)n;
            CUgraphNode *nd = realloc(t_deps, cap * sizeof *nd);
            uint64_t *ne = nd ? realloc(t_edges, cap * sizeof *ne) : NULL;
            if (nd) t_deps = nd;
            if (ne) t_edges = ne;
            if (!nd || !ne) {
                rgpu_end(&c);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            t_cap = cap;
        }
        for (uint64_t i = 0; i < n; i++) t_deps[i] = (CUgraphNode)(uintptr_t)rgpu_get_u64(&c);
        if (what == INFO_EDGES)
            for (uint64_t i = 0; i < n; i++) t_edges[i] = rgpu_get_u64(&c);
        if (id) *id = cid;
        if (graph) *graph = (void *)(uintptr_t)g;
        if (deps) *deps = n ? (void *)t_deps : NULL;
        if (edges) *edges = n ? (void *)t_edges : NULL;
        if (ndeps) *ndeps = (size_t)n;
    }
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
    return capture_info(hStream, INFO_STATUS, captureStatus, NULL, NULL, NULL, NULL, NULL);
}

RGPU_EXPORT CUresult CUDAAPI cuStreamGetCaptureInfo(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                                    cuuint64_t *id_out) {
    return capture_info(hStream, INFO_FULL, captureStatus_out, id_out, NULL, NULL, NULL, NULL);
}

RGPU_EXPORT CUresult CUDAAPI cuStreamGetCaptureInfo_v2(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                                       cuuint64_t *id_out, void **graph_out, void **dependencies_out,
                                                       size_t *numDependencies_out) {
    return capture_info(hStream, INFO_FULL, captureStatus_out, id_out, graph_out, dependencies_out, NULL,
                        numDependencies_out);
}

RGPU_EXPORT CUresult CUDAAPI cuStreamGetCaptureInfo_v3(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                                       cuuint64_t *id_out, void **graph_out, void **dependencies_out,
                                                       void **edgeData_out, size_t *numDependencies_out) {
    return capture_info(hStream, edgeData_out ? INFO_EDGES : INFO_FULL, captureStatus_out, id_out, graph_out,
                        dependencies_out, edgeData_out, numDependencies_out);
}

RGPU_EXPORT CUresult CUDAAPI cuStreamBeginCapture(CUstream hStream) {
    return cuStreamBeginCapture_v2(hStream, 0 /* CU_STREAM_CAPTURE_MODE_GLOBAL */);
}

/* ------------------------------------------------------------------ graphs */

/* cuGraphGetNodes and cuGraphGetRootNodes: the count, or up to *num handles (the rest of the
 * caller's array NULL, as CUDA documents) and the number the worker's driver gave. */
static CUresult node_list(uint16_t op, CUgraph hGraph, CUgraphNode *nodes, size_t *num) {
    if (!num) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, op);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)hGraph);
    rgpu_put_u64(&c, nodes ? (uint64_t)*num : 0);
    rgpu_put_u32(&c, nodes != NULL);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) {
        uint64_t total = rgpu_get_u64(&c), m = rgpu_get_u64(&c);
        for (uint64_t i = 0; i < m; i++) {
            CUgraphNode n = (CUgraphNode)(uintptr_t)rgpu_get_u64(&c);
            if (nodes && i < *num) nodes[i] = n;
        }
        if (nodes)
            for (size_t i = (size_t)m; i < *num; i++) nodes[i] = NULL;
        *num = (size_t)total;
    }
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes) {
    return node_list(RGPU_OP_cuGraphGetNodes, hGraph, nodes, numNodes);
}

RGPU_EXPORT CUresult CUDAAPI cuGraphGetRootNodes(CUgraph hGraph, CUgraphNode *rootNodes, size_t *numRootNodes) {
    return node_list(RGPU_OP_cuGraphGetRootNodes, hGraph, rootNodes, numRootNodes);
}

RGPU_EXPORT CUresult CUDAAPI cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                          CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams) {
    if (!phGraphExec || !instantiateParams) return CUDA_ERROR_INVALID_VALUE;
    const cuuint64_t upload = 2; /* CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD */
    CUresult r = cuGraphInstantiateWithFlags(phGraphExec, hGraph, instantiateParams->flags & ~upload);
    if (r == CUDA_SUCCESS && (instantiateParams->flags & upload))
        r = cuGraphUpload(*phGraphExec, instantiateParams->hUploadStream);
    instantiateParams->hErrNode_out = NULL;
    instantiateParams->result_out = r == CUDA_SUCCESS ? 0 : 1; /* CUDA_GRAPH_INSTANTIATE_SUCCESS / _ERROR */
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                                char *logBuffer, size_t bufferSize) {
    if (phErrorNode) *phErrorNode = NULL;
    if (logBuffer && bufferSize) logBuffer[0] = 0;
    return cuGraphInstantiateWithFlags(phGraphExec, hGraph, 0);
}

RGPU_EXPORT CUresult CUDAAPI cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                                   char *logBuffer, size_t bufferSize) {
    return cuGraphInstantiate(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

RGPU_EXPORT CUresult CUDAAPI cuGraphExecUpdate(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphNode *hErrorNode_out,
                                               CUgraphExecUpdateResult *updateResult_out) {
    if (!hErrorNode_out || !updateResult_out) return CUDA_ERROR_INVALID_VALUE;
    CUgraphExecUpdateResultInfo info;
    memset(&info, 0, sizeof info);
    CUresult r = cuGraphExecUpdate_v2(hGraphExec, hGraph, &info);
    *hErrorNode_out = info.errorNode;
    *updateResult_out = info.result;
    return r;
}

/* ------------------------------------------------------------------ virtual memory management
 * The worker counts each physical allocation against the slice from cuMemCreate to the release
 * of its last handle. */

RGPU_EXPORT CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                         const CUmemAllocationProp *prop, unsigned long long flags) {
    if (!handle || !prop) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_cuMemCreate);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, size);
    rgpu_put_u64(&c, flags);
    rgpu_put(&c, prop, sizeof *prop);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) *handle = rgpu_get_u64(&c);
    rgpu_end(&c);
    return r;
}

static CUresult handle_op(uint16_t op, uint64_t value, CUmemGenericAllocationHandle *out) {
    rgpu_call c;
    CUresult r = rgpu_begin(&c, op);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, value);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS && out) *out = rgpu_get_u64(&c);
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
    return handle_op(RGPU_OP_cuMemRelease, handle, NULL);
}

RGPU_EXPORT CUresult CUDAAPI cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    return handle_op(RGPU_OP_cuMemRetainAllocationHandle, (uint64_t)(uintptr_t)addr, handle);
}

RGPU_EXPORT CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    if (!desc || !count || count > 64) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_cuMemSetAccess);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, ptr);
    rgpu_put_u64(&c, size);
    rgpu_put_u64(&c, count);
    rgpu_put(&c, desc, count * sizeof *desc);
    r = rgpu_sync(&c);
    rgpu_end(&c);
    return r;
}

/* ------------------------------------------------------------------ graph nodes built by hand
 * One operation adds every kind of node: the graph, the dependencies and the node's parameters
 * packed (kernel arguments as a launch packs them). Copy nodes that touch this process's memory
 * would read or write it when the graph runs on the server: refused, naming the call. */

enum { NODE_EMPTY = 0, NODE_KERNEL = 1, NODE_MEMSET = 2, NODE_MEMCPY = 3, NODE_MEM_ALLOC = 4, NODE_MEM_FREE = 5,
       NODE_MEMCPY_HOST = 6, NODE_CHILD = 8 }; /* NODE_HOST = 7: host_nodes.c */

#define add_node rgpu_graph_add_node
CUresult rgpu_graph_add_node(uint32_t kind, CUgraphNode *phNode, CUgraph hGraph, const CUgraphNode *deps, size_t ndeps,
                         const void *payload, size_t plen, uint64_t *aux) {
    if (!phNode || (ndeps && !deps)) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_rgpuGraphAddNode);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)hGraph);
    rgpu_put_u32(&c, kind);
    rgpu_put_u32(&c, 0);
    rgpu_put_u64(&c, ndeps);
    for (size_t i = 0; i < ndeps; i++) rgpu_put_u64(&c, (uint64_t)(uintptr_t)deps[i]);
    rgpu_put_u64(&c, plen);
    if (plen) rgpu_put(&c, payload, plen);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) {
        *phNode = (CUgraphNode)(uintptr_t)rgpu_get_u64(&c);
        uint64_t a = rgpu_get_u64(&c);
        if (aux) *aux = a;
    }
    rgpu_end(&c);
    return r;
}

/* {u64 function, u32 is_kernel, grid[3], block[3], shmem, u32 argsize, u32 0} + arguments */
static CUresult kernel_payload(CUfunction func, CUkernel kern, const unsigned int dims[7], void **params,
                               void **extra, uint8_t **out, size_t *len) {
    CUfunction f = func ? func : (CUfunction)kern;
    uint8_t *args = NULL;
    size_t argsize = 0;
    CUresult r = rgpu_kernel_args(f, params, extra, &args, &argsize);
    if (r != CUDA_SUCCESS) return r;
    size_t head = 8 + 4 * 10;
    uint8_t *p = malloc(head + argsize);
    if (!p) {
        free(args);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t h = (uint64_t)(uintptr_t)rgpu_fn_remote(f);
    uint32_t w[10] = {func ? 0u : 1u, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], (uint32_t)argsize, 0};
    memcpy(p, &h, 8);
    memcpy(p + 8, w, sizeof w);
    memcpy(p + head, args, argsize);
    free(args);
    *out = p;
    *len = head + argsize;
    return CUDA_SUCCESS;
}

CUresult rgpu_graph_add_kernel(CUgraphNode *phNode, CUgraph hGraph, const CUgraphNode *deps, size_t ndeps,
                               CUfunction func, CUkernel kern, const unsigned int dims[7], void **params, void **extra) {
    uint8_t *p = NULL;
    size_t len = 0;
    CUresult r = kernel_payload(func, kern, dims, params, extra, &p, &len);
    if (r != CUDA_SUCCESS) return r;
    r = add_node(NODE_KERNEL, phNode, hGraph, deps, ndeps, p, len, NULL);
    free(p);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                                  const CUgraphNode *dependencies, size_t numDependencies,
                                                  const CUDA_KERNEL_NODE_PARAMS *nodeParams) {
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    const CUDA_KERNEL_NODE_PARAMS *k = nodeParams;
    unsigned int dims[7] = {k->gridDimX, k->gridDimY, k->gridDimZ, k->blockDimX, k->blockDimY, k->blockDimZ,
                            k->sharedMemBytes};
    return rgpu_graph_add_kernel(phGraphNode, hGraph, dependencies, numDependencies, k->func, NULL, dims, k->kernelParams,
                      k->extra);
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
                                                     const CUgraphNode *dependencies, size_t numDependencies,
                                                     const CUDA_KERNEL_NODE_PARAMS_v2 *nodeParams) {
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    const CUDA_KERNEL_NODE_PARAMS_v2 *k = nodeParams;
    unsigned int dims[7] = {k->gridDimX, k->gridDimY, k->gridDimZ, k->blockDimX, k->blockDimY, k->blockDimZ,
                            k->sharedMemBytes};
    return rgpu_graph_add_kernel(phGraphNode, hGraph, dependencies, numDependencies, k->func, k->kern, dims, k->kernelParams,
                      k->extra);
}

static CUresult kernel_set(CUgraphExec exec, CUgraphNode node, CUfunction func, CUkernel kern,
                           const unsigned int dims[7], void **params, void **extra) {
    uint8_t *p = NULL;
    size_t len = 0;
    CUresult r = kernel_payload(func, kern, dims, params, extra, &p, &len);
    if (r != CUDA_SUCCESS) return r;
    rgpu_call c;
    r = rgpu_begin(&c, RGPU_OP_rgpuGraphKernelNodeSetParams);
    if (r == CUDA_SUCCESS) {
        rgpu_put_u64(&c, (uint64_t)(uintptr_t)exec);
        rgpu_put_u64(&c, (uint64_t)(uintptr_t)node);
        rgpu_put_u64(&c, len);
        rgpu_put(&c, p, len);
        r = rgpu_sync(&c);
        rgpu_end(&c);
    }
    free(p);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuGraphExecKernelNodeSetParams_v2(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                               const CUDA_KERNEL_NODE_PARAMS_v2 *nodeParams) {
    if (!nodeParams || !hGraphExec) return CUDA_ERROR_INVALID_VALUE;
    const CUDA_KERNEL_NODE_PARAMS_v2 *k = nodeParams;
    unsigned int dims[7] = {k->gridDimX, k->gridDimY, k->gridDimZ, k->blockDimX, k->blockDimY, k->blockDimZ,
                            k->sharedMemBytes};
    return kernel_set(hGraphExec, hNode, k->func, k->kern, dims, k->kernelParams, k->extra);
}

RGPU_EXPORT CUresult CUDAAPI cuGraphKernelNodeSetParams_v2(CUgraphNode hNode, const CUDA_KERNEL_NODE_PARAMS_v2 *nodeParams) {
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    const CUDA_KERNEL_NODE_PARAMS_v2 *k = nodeParams;
    unsigned int dims[7] = {k->gridDimX, k->gridDimY, k->gridDimZ, k->blockDimX, k->blockDimY, k->blockDimZ,
                            k->sharedMemBytes};
    return kernel_set(NULL, hNode, k->func, k->kern, dims, k->kernelParams, k->extra);
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddEmptyNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                                 const CUgraphNode *dependencies, size_t numDependencies) {
    return add_node(NODE_EMPTY, phGraphNode, hGraph, dependencies, numDependencies, NULL, 0, NULL);
}

static uint64_t remote_ctx(CUcontext ctx) {
    rgpu_ctx *x = ctx ? rgpu_ctx_lookup(ctx) : rgpu_ctx_current();
    return x ? x->remote : 0;
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddMemsetNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                                  const CUgraphNode *dependencies, size_t numDependencies,
                                                  const CUDA_MEMSET_NODE_PARAMS *memsetParams, CUcontext ctx) {
    if (!memsetParams) return CUDA_ERROR_INVALID_VALUE;
    uint8_t p[sizeof(CUDA_MEMSET_NODE_PARAMS) + 8];
    memcpy(p, memsetParams, sizeof *memsetParams);
    uint64_t rc = remote_ctx(ctx);
    memcpy(p + sizeof *memsetParams, &rc, 8);
    return add_node(NODE_MEMSET, phGraphNode, hGraph, dependencies, numDependencies, p, sizeof p, NULL);
}

/* Where one side of a copy node lies: 1 device, 0 this process's memory, -1 not expressible. */
/* Page-locked memory the GPU was never handed is this process's bytes, though its range is the
 * worker's (zero_copy.c): a node naming it copies from or to the host. */
static int device_side(CUmemorytype type, CUdeviceptr dev, const void *host) {
    if (type == CU_MEMORYTYPE_DEVICE) return 1;
    if (type == CU_MEMORYTYPE_UNIFIED) return rgpu_copy_device_session(dev) >= 0;
    if (type == CU_MEMORYTYPE_HOST) return rgpu_copy_device_session((uint64_t)(uintptr_t)host) >= 0;
    return -1;
}

/* Copy nodes with one side in this process's memory (1D): the node copies from or to a pinned
 * buffer of the server's; before each launch of an executable graph holding one, the host data
 * goes to its buffer, and after the launch, once the stream has finished, the buffers of
 * device-to-host nodes come back into this process's memory. Their records follow the graph
 * through clones, instantiation and updates. */
typedef struct hostcopy {
    void *owner;           /* CUgraph or CUgraphExec */
    uint64_t buffer;       /* the server's buffer */
    void *host;
    size_t size;
    int to_host;
    struct hostcopy *next;
} hostcopy;

static hostcopy *g_copies;
static pthread_mutex_t g_copies_lock = PTHREAD_MUTEX_INITIALIZER;

static void hostcopy_add(void *owner, uint64_t buffer, void *host, size_t size, int to_host) {
    hostcopy *h = malloc(sizeof *h);
    if (!h) return;
    *h = (hostcopy){owner, buffer, host, size, to_host, NULL};
    pthread_mutex_lock(&g_copies_lock);
    h->next = g_copies;
    g_copies = h;
    pthread_mutex_unlock(&g_copies_lock);
}

void rgpu_hostcopy_clone(void *from, void *to) {
    pthread_mutex_lock(&g_copies_lock);
    hostcopy *list = g_copies;
    pthread_mutex_unlock(&g_copies_lock);
    for (hostcopy *h = list; h; h = h->next)
        if (h->owner == from) hostcopy_add(to, h->buffer, h->host, h->size, h->to_host);
}

void *rgpu_hostcopy_host(uint64_t buffer, size_t size) {
    void *host = NULL;
    pthread_mutex_lock(&g_copies_lock);
    for (hostcopy *h = g_copies; h && !host; h = h->next)
        if (h->buffer == buffer && h->size == size) host = h->host;
    pthread_mutex_unlock(&g_copies_lock);
    return host;
}

void rgpu_hostcopy_forget(void *owner) {
    pthread_mutex_lock(&g_copies_lock);
    for (hostcopy **p = &g_copies; *p;) {
        if ((*p)->owner == owner) {
            hostcopy *gone = *p;
            *p = gone->next;
            free(gone);
        } else {
            p = &(*p)->next;
        }
    }
    pthread_mutex_unlock(&g_copies_lock);
}

CUresult rgpu_hostcopy_before_launch(CUgraphExec exec) {
    pthread_mutex_lock(&g_copies_lock);
    hostcopy *list = g_copies;
    pthread_mutex_unlock(&g_copies_lock);
    for (hostcopy *h = list; h; h = h->next) {
        if (h->owner != (void *)exec || h->to_host) continue;
        rgpu_call c;
        CUresult r = rgpu_begin(&c, RGPU_OP_rgpuGraphHostRefresh);
        if (r != CUDA_SUCCESS) return r;
        rgpu_put_u64(&c, h->buffer);
        rgpu_put_u64(&c, h->size);
        rgpu_put(&c, h->host, h->size);
        r = rgpu_async(&c);
        if (r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
}

CUresult rgpu_hostcopy_after_launch(CUgraphExec exec, CUstream stream) {
    pthread_mutex_lock(&g_copies_lock);
    hostcopy *list = g_copies;
    pthread_mutex_unlock(&g_copies_lock);
    size_t n = 0;
    for (hostcopy *h = list; h; h = h->next) n += h->owner == (void *)exec && h->to_host;
    if (!n) return CUDA_SUCCESS;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_rgpuGraphHostReadback);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
    rgpu_put_u64(&c, n);
    for (hostcopy *h = list; h; h = h->next)
        if (h->owner == (void *)exec && h->to_host) {
            rgpu_put_u64(&c, h->buffer);
            rgpu_put_u64(&c, h->size);
        }
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) {
        for (hostcopy *h = list; h; h = h->next)
            if (h->owner == (void *)exec && h->to_host) rgpu_get(&c, h->host, h->size);
    }
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddMemcpyNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                                  const CUgraphNode *dependencies, size_t numDependencies,
                                                  const CUDA_MEMCPY3D *copyParams, CUcontext ctx) {
    if (!copyParams) return CUDA_ERROR_INVALID_VALUE;
    CUDA_MEMCPY3D m = *copyParams;
    int src = device_side(m.srcMemoryType, m.srcDevice, m.srcHost);
    int dst = device_side(m.dstMemoryType, m.dstDevice, m.dstHost);
    uint64_t rc = remote_ctx(ctx);
    if (src == 1 && dst == 1) {
        if (m.srcMemoryType == CU_MEMORYTYPE_HOST) m.srcDevice = (CUdeviceptr)(uintptr_t)m.srcHost;
        if (m.dstMemoryType == CU_MEMORYTYPE_HOST) m.dstDevice = (CUdeviceptr)(uintptr_t)m.dstHost;
        m.srcMemoryType = m.dstMemoryType = CU_MEMORYTYPE_DEVICE;
        m.srcHost = NULL;
        m.dstHost = NULL;
        uint8_t p[sizeof(CUDA_MEMCPY3D) + 8];
        memcpy(p, &m, sizeof m);
        memcpy(p + sizeof m, &rc, 8);
        return add_node(NODE_MEMCPY, phGraphNode, hGraph, dependencies, numDependencies, p, sizeof p, NULL);
    }
    if ((m.srcMemoryType == CU_MEMORYTYPE_ARRAY && dst == 1) || (m.dstMemoryType == CU_MEMORYTYPE_ARRAY && src == 1) ||
        (m.srcMemoryType == CU_MEMORYTYPE_ARRAY && m.dstMemoryType == CU_MEMORYTYPE_ARRAY)) {
        /* Between device memory and CUDA arrays: array handles and device pointers are the worker's. */
        if (m.srcMemoryType != CU_MEMORYTYPE_ARRAY) m.srcMemoryType = CU_MEMORYTYPE_DEVICE;
        if (m.dstMemoryType != CU_MEMORYTYPE_ARRAY) m.dstMemoryType = CU_MEMORYTYPE_DEVICE;
        m.srcHost = NULL;
        m.dstHost = NULL;
        uint8_t p[sizeof(CUDA_MEMCPY3D) + 8];
        memcpy(p, &m, sizeof m);
        memcpy(p + sizeof m, &rc, 8);
        return add_node(NODE_MEMCPY, phGraphNode, hGraph, dependencies, numDependencies, p, sizeof p, NULL);
    }
    int one_d = m.Height <= 1 && m.Depth <= 1 && !m.srcY && !m.srcZ && !m.dstY && !m.dstZ && !m.srcLOD && !m.dstLOD;
    if (src < 0 || dst < 0 || src == dst || !one_d || !m.WidthInBytes) {
        rgpu_log(1, "rgpu: cuGraphAddMemcpyNode: this copy node (host-to-host, or 2D/3D or CUDA arrays with a host "
                 "side) is not remoted yet; device-to-device, device-array and 1D host copy nodes are");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    int to_host = dst == 0;
    uint64_t dev = to_host ? (m.srcMemoryType == CU_MEMORYTYPE_HOST ? (uint64_t)(uintptr_t)m.srcHost : m.srcDevice) + m.srcXInBytes
                           : (m.dstMemoryType == CU_MEMORYTYPE_HOST ? (uint64_t)(uintptr_t)m.dstHost : m.dstDevice) + m.dstXInBytes;
    uint8_t *host = to_host ? (uint8_t *)(m.dstMemoryType == CU_MEMORYTYPE_HOST ? m.dstHost : (void *)(uintptr_t)m.dstDevice) + m.dstXInBytes
                            : (uint8_t *)(m.srcMemoryType == CU_MEMORYTYPE_HOST ? (void *)m.srcHost : (void *)(uintptr_t)m.srcDevice) + m.srcXInBytes;
    size_t size = m.WidthInBytes;
    /* {u32 to_host, u32 0, u64 device address, u64 size, u64 context} */
    uint8_t p[32];
    uint32_t head[2] = {(uint32_t)to_host, 0};
    uint64_t rest[3] = {dev, size, rc};
    memcpy(p, head, 8);
    memcpy(p + 8, rest, 24);
    uint64_t buffer = 0;
    CUresult r = add_node(NODE_MEMCPY_HOST, phGraphNode, hGraph, dependencies, numDependencies, p, sizeof p, &buffer);
    if (r == CUDA_SUCCESS) hostcopy_add(hGraph, buffer, host, size, to_host);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                                    const CUgraphNode *dependencies, size_t numDependencies,
                                                    CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams) {
    if (!nodeParams || (nodeParams->accessDescCount && !nodeParams->accessDescs) || nodeParams->accessDescCount > 64)
        return CUDA_ERROR_INVALID_VALUE;
    size_t n = nodeParams->accessDescCount, len = sizeof(CUmemPoolProps) + 16 + n * sizeof(CUmemAccessDesc);
    uint8_t *p = malloc(len);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t head[2] = {nodeParams->bytesize, n};
    memcpy(p, &nodeParams->poolProps, sizeof(CUmemPoolProps));
    memcpy(p + sizeof(CUmemPoolProps), head, 16);
    if (n) memcpy(p + sizeof(CUmemPoolProps) + 16, nodeParams->accessDescs, n * sizeof(CUmemAccessDesc));
    uint64_t dptr = 0;
    CUresult r = add_node(NODE_MEM_ALLOC, phGraphNode, hGraph, dependencies, numDependencies, p, len, &dptr);
    free(p);
    if (r == CUDA_SUCCESS) {
        nodeParams->dptr = dptr;
        rgpu_ctx *cur = rgpu_ctx_current();
        rgpu_dev_range_add(cur ? cur->session : 0, dptr, nodeParams->bytesize);
    }
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                                   const CUgraphNode *dependencies, size_t numDependencies,
                                                   CUdeviceptr dptr) {
    return add_node(NODE_MEM_FREE, phGraphNode, hGraph, dependencies, numDependencies, &dptr, 8, NULL);
}

/* The worker's driver clones the child graph into the node, as CUDA does; the child's copy nodes
 * with a host side come along (their records now also belong to the parent). {u64 child} */
RGPU_EXPORT CUresult CUDAAPI cuGraphAddChildGraphNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                                      const CUgraphNode *dependencies, size_t numDependencies,
                                                      CUgraph childGraph) {
    if (!childGraph) return CUDA_ERROR_INVALID_VALUE;
    uint64_t child = (uint64_t)(uintptr_t)childGraph;
    CUresult r = add_node(NODE_CHILD, phGraphNode, hGraph, dependencies, numDependencies, &child, 8, NULL);
    if (r == CUDA_SUCCESS) rgpu_hostcopy_clone(childGraph, hGraph);
    return r;
}

/* The executable graph's copy of a child node takes another child graph's parameters. The
 * records of host-side copy nodes are per executable graph, not per node: a child graph holding
 * one cannot be swapped in faithfully, so it is refused. */
RGPU_EXPORT CUresult CUDAAPI cuGraphExecChildGraphNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                                CUgraph childGraph) {
    if (!hGraphExec || !hNode || !childGraph) return CUDA_ERROR_INVALID_VALUE;
    int host_side = 0;
    pthread_mutex_lock(&g_copies_lock);
    for (hostcopy *h = g_copies; h && !host_side; h = h->next) host_side = h->owner == (void *)childGraph;
    pthread_mutex_unlock(&g_copies_lock);
    if (host_side) {
        rgpu_log(1, "cuGraphExecChildGraphNodeSetParams: a child graph with copy nodes from or to this process's "
                 "memory cannot be swapped into an executable graph yet (instantiate the parent graph again, or copy "
                 "device to device in the child)");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_cuGraphExecChildGraphNodeSetParams);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)hGraphExec);
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)hNode);
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)childGraph);
    r = rgpu_sync(&c);
    rgpu_end(&c);
    return r;
}

_Static_assert(sizeof(CUDA_MEMCPY3D) == 200, "CUDA_MEMCPY3D layout");
_Static_assert(sizeof(CUDA_MEMSET_NODE_PARAMS) == 40, "CUDA_MEMSET_NODE_PARAMS layout");
_Static_assert(sizeof(CUDA_MEM_ALLOC_NODE_PARAMS) == 120, "CUDA_MEM_ALLOC_NODE_PARAMS layout");
_Static_assert(sizeof(CUDA_KERNEL_NODE_PARAMS_v2) == 72, "CUDA_KERNEL_NODE_PARAMS_v2 layout");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");

/* ------------------------------------------------------------------ host copies in stream capture
 * A copy between this process's memory and the device on a capturing stream becomes a copy
 * node through a pinned worker buffer, recorded against the capture's graph: refreshed before
 * and read back after each launch, as those added with cuGraphAddMemcpyNode. */

int rgpu_stream_capturing(CUstream stream) {
    if (!rgpu_capture_possible()) return 0;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    return cuStreamIsCapturing(stream, &st) == CUDA_SUCCESS && st == 1 /* ACTIVE */;
}

CUresult rgpu_capture_host_copy(CUstream stream, int to_host, CUdeviceptr dev, void *host, size_t n) {
    if (n && !host) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_rgpuCaptureHostCopy);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
    rgpu_put_u32(&c, (uint32_t)to_host);
    rgpu_put_u32(&c, 0);
    rgpu_put_u64(&c, dev);
    rgpu_put_u64(&c, n);
    if (!to_host && n) {
        r = rgpu_put_bulk(&c, host, n);
        if (r != CUDA_SUCCESS) {
            rgpu_end(&c);
            return r;
        }
    }
    r = rgpu_sync(&c);
    uint64_t buffer = 0, graph = 0;
    if (r == CUDA_SUCCESS) {
        buffer = rgpu_get_u64(&c);
        graph = rgpu_get_u64(&c);
    }
    rgpu_end(&c);
    if (r == CUDA_SUCCESS) hostcopy_add((void *)(uintptr_t)graph, buffer, host, n, to_host);
    return r;
}
