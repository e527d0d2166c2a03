/* Stream capture, graphs and virtual memory management: the parts the generator cannot write.
 *
 * The captured graph, its nodes and every executable graph live on the server; the client holds
 * their handles. Launches, memsets and device copies on a capturing stream travel as always
 * (pipelined) and the server's driver records them. Capture status is asked before nearly every
 * launch by CuPy and PyTorch, so it is answered here while no capture can be under way (no
 * cuStreamBeginCapture succeeded that no cuStreamEndCapture ended): exact, since a stream only
 * starts capturing through cuStreamBeginCapture. Otherwise the server's driver answers. */
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

RGPU_EXPORT CUresult CUDAAPI cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes) {
    if (!numNodes) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_cuGraphGetNodes);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)hGraph);
    rgpu_put_u64(&c, nodes ? (uint64_t)*numNodes : 0);
    rgpu_put_u32(&c, nodes != NULL);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) {
        uint64_t total = rgpu_get_u64(&c), m = rgpu_get_u64(&c);
        for (uint64_t i = 0; i < m; i++) {
            CUgraphNode n = (CUgraphNode)(uintptr_t)rgpu_get_u64(&c);
            if (nodes && i < *numNodes) nodes[i] = n;
        }
        *numNodes = (size_t)total;
    }
    rgpu_end(&c);
    return r;
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
