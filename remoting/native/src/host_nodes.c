/* Host nodes: the application's host functions run in this process, in graph order.
 *
 * The graph lives on the worker. Its host node (from cuGraphAddHostNode, or cuLaunchHostFunc on
 * a capturing stream) calls a function of the worker's that sends a HOST_CALL frame naming an id
 * from this process's table below and waits for the HOST_DONE answer, so the node's dependents
 * start only once the function returned here. Whichever thread of this process next reads from
 * that session (every synchronising call reads: cuStreamSynchronize, cuCtxSynchronize,
 * cuEventSynchronize, blocking copies, queries) runs the function (transport.c) and answers.
 * If the application makes no further call, the graph waits, as a real host node waits for a busy
 * host thread; if the process exits, the worker's node gives up when the connection ends.
 *
 * A function runs on the reading thread with its session locked: CUDA calls from inside return
 * CUDA_ERROR_NOT_PERMITTED (CUDA forbids them in host functions), and a function that waits for
 * another thread's CUDA call on the same device would wait forever.
 *
 * Ids are never reused and never freed: graphs, their clones and executable graphs copy host
 * nodes freely, and an id must stay valid for each. Registering the same function, data (and
 * stream) again returns the same id, so recapturing in a loop does not grow the table. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

#define NODE_HOST 7

typedef struct {
    int kind;
    void *fn;
    void *user;
    CUstream stream;
} hostfn;

static hostfn *g_fns;
static size_t g_count, g_cap;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

int rgpu_hostfn_any(void) { return __atomic_load_n(&g_count, __ATOMIC_ACQUIRE) != 0; }

uint64_t rgpu_hostfn_register(int kind, void *fn, void *user, CUstream stream) {
    uint64_t id = 0;
    pthread_mutex_lock(&g_lock);
    for (size_t i = g_count; i-- > 0;) {
        hostfn *h = &g_fns[i];
        if (h->kind == kind && h->fn == fn && h->user == user && h->stream == stream) {
            id = i + 1;
            break;
        }
    }
    if (!id) {
        if (g_count == g_cap) {
            size_t cap = g_cap ? 2 * g_cap : 64;
            hostfn *n = realloc(g_fns, cap * sizeof *n);
            if (n) {
                g_fns = n;
                g_cap = cap;
            }
        }
        if (g_count < g_cap) {
            g_fns[g_count] = (hostfn){kind, fn, user, stream};
            id = ++g_count;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return id; /* 0: out of memory */
}

int rgpu_hostfn_lookup(uint64_t id, int *kind, void **fn, void **user) {
    int found = 0;
    pthread_mutex_lock(&g_lock);
    if (id >= 1 && id <= g_count) {
        hostfn *h = &g_fns[id - 1];
        if (kind) *kind = h->kind;
        if (fn) *fn = h->fn;
        if (user) *user = h->user;
        found = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* HOST_CALL's payload: u32 count, u32 0, {u64 buffer, u64 size, u32 to_host, u32 0} each, then the
 * device-to-host regions' data in that order. Regions this process does not know (no copy node
 * record holds that buffer at that size) are skipped both ways. */
typedef struct {
    uint64_t buffer, size;
    uint32_t to_host, pad;
} region;

int rgpu_run_host_call(int session, uint64_t id, int32_t status, const uint8_t *in, size_t inlen, uint8_t **out,
                       size_t *outlen) {
    (void)session;
    *out = NULL;
    *outlen = 0;
    hostfn h;
    pthread_mutex_lock(&g_lock);
    int found = id >= 1 && id <= g_count;
    if (found) h = g_fns[id - 1];
    pthread_mutex_unlock(&g_lock);
    if (!found) return -1;
    uint32_t n = 0;
    if (inlen >= 8) memcpy(&n, in, 4);
    if ((uint64_t)n * sizeof(region) > inlen - 8 || inlen < 8) n = 0;
    const uint8_t *data = in ? in + 8 + (size_t)n * sizeof(region) : NULL;
    const uint8_t *end = in ? in + inlen : NULL;
    size_t back = 0;
    for (uint32_t i = 0; i < n; i++) {
        region r;
        memcpy(&r, in + 8 + (size_t)i * sizeof r, sizeof r);
        void *host = rgpu_hostcopy_host(r.buffer, (size_t)r.size);
        if (r.to_host) {
            if (r.size > (uint64_t)(end - data)) break; /* truncated: take no more */
            if (host) memcpy(host, data, (size_t)r.size);
            data += r.size;
        }
        if (host) back += 16 + (size_t)r.size;
    }
    if (h.kind == RGPU_HOSTFN_STREAM_CALLBACK)
        ((CUstreamCallback)h.fn)(h.stream, (CUresult)status, h.user);
    else
        ((CUhostFn)h.fn)(h.user);
    uint8_t *o = back ? malloc(back) : NULL;
    if (o) {
        size_t at = 0;
        for (uint32_t i = 0; i < n; i++) {
            region r;
            memcpy(&r, in + 8 + (size_t)i * sizeof r, sizeof r);
            void *host = rgpu_hostcopy_host(r.buffer, (size_t)r.size);
            if (!host || at + 16 + r.size > back) continue;
            memcpy(o + at, &r.buffer, 8);
            memcpy(o + at + 8, &r.size, 8);
            memcpy(o + at + 16, host, (size_t)r.size);
            at += 16 + (size_t)r.size;
        }
        *out = o;
        *outlen = at;
    }
    return 0;
}

/* ------------------------------------------------------------------ host functions in capture */

/* A capturing stream (active or invalidated): the worker's driver records the host node, or
 * answers as it does for that stream. */
static int capturing(CUstream stream) {
    if (!rgpu_capture_possible()) return 0;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    return cuStreamIsCapturing(stream, &st) == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

static CUresult capture_host_func(CUstream stream, int kind, void *fn, void *user) {
    uint64_t id = rgpu_hostfn_register(kind, fn, user, stream);
    if (!id) return CUDA_ERROR_OUT_OF_MEMORY;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_rgpuCaptureHostFunc);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
    rgpu_put_u32(&c, (uint32_t)kind);
    rgpu_put_u32(&c, 0);
    rgpu_put_u64(&c, id);
    r = rgpu_sync(&c);
    rgpu_end(&c);
    return r;
}

/* Outside a capture a host function must still run in this process: wait for the stream's
 * earlier work, then call it on the calling thread. Correct in order, though the caller waits. */
RGPU_EXPORT CUresult CUDAAPI cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) {
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    if (rgpu_in_host_fn) return CUDA_ERROR_NOT_PERMITTED;
    if (capturing(hStream)) return capture_host_func(hStream, RGPU_HOSTFN_FUNC, (void *)fn, userData);
    CUresult r = cuStreamSynchronize(hStream);
    if (r == CUDA_SUCCESS) fn(userData);
    return r;
}

/* On a capturing stream the worker's driver answers (NVIDIA's refuses stream callbacks there). */
RGPU_EXPORT CUresult CUDAAPI cuStreamAddCallback(CUstream hStream, CUstreamCallback callback, void *userData,
                                                 unsigned int flags) {
    if (!callback || flags) return CUDA_ERROR_INVALID_VALUE;
    if (rgpu_in_host_fn) return CUDA_ERROR_NOT_PERMITTED;
    if (capturing(hStream))
        return capture_host_func(hStream, RGPU_HOSTFN_STREAM_CALLBACK, (void *)callback, userData);
    CUresult r = cuStreamSynchronize(hStream);
    if (r == CUDA_ERROR_NOT_INITIALIZED || r == CUDA_ERROR_INVALID_HANDLE) return r;
    callback(hStream, r, userData);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ host nodes built by hand */

RGPU_EXPORT CUresult CUDAAPI cuGraphAddHostNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                                const CUgraphNode *dependencies, size_t numDependencies,
                                                const CUDA_HOST_NODE_PARAMS *nodeParams) {
    if (!nodeParams || !nodeParams->fn) return CUDA_ERROR_INVALID_VALUE;
    uint64_t id = rgpu_hostfn_register(RGPU_HOSTFN_FUNC, (void *)nodeParams->fn, nodeParams->userData, NULL);
    if (!id) return CUDA_ERROR_OUT_OF_MEMORY;
    return rgpu_graph_add_node(NODE_HOST, phGraphNode, hGraph, dependencies, numDependencies, &id, 8, NULL);
}

/* {u64 exec, u64 node, u64 id, u32 set, u32 0} -> u64 the node's id */
static CUresult host_node(CUgraphExec exec, CUgraphNode node, uint64_t set_id, uint64_t *id_out) {
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_rgpuGraphHostNode);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)exec);
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)node);
    rgpu_put_u64(&c, set_id);
    rgpu_put_u32(&c, set_id != 0);
    rgpu_put_u32(&c, 0);
    r = rgpu_sync(&c);
    uint64_t id = r == CUDA_SUCCESS ? rgpu_get_u64(&c) : 0;
    rgpu_end(&c);
    if (id_out) *id_out = id;
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuGraphHostNodeGetParams(CUgraphNode hNode, CUDA_HOST_NODE_PARAMS *nodeParams) {
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    uint64_t id = 0;
    CUresult r = host_node(NULL, hNode, 0, &id);
    if (r != CUDA_SUCCESS) return r;
    void *fn = NULL, *user = NULL;
    if (!rgpu_hostfn_lookup(id, NULL, &fn, &user)) return CUDA_ERROR_INVALID_VALUE;
    nodeParams->fn = (CUhostFn)fn;
    nodeParams->userData = user;
    return CUDA_SUCCESS;
}

static CUresult host_node_set(CUgraphExec exec, CUgraphNode node, const CUDA_HOST_NODE_PARAMS *params) {
    if (!params || !params->fn) return CUDA_ERROR_INVALID_VALUE;
    uint64_t id = rgpu_hostfn_register(RGPU_HOSTFN_FUNC, (void *)params->fn, params->userData, NULL);
    if (!id) return CUDA_ERROR_OUT_OF_MEMORY;
    return host_node(exec, node, id, NULL);
}

RGPU_EXPORT CUresult CUDAAPI cuGraphHostNodeSetParams(CUgraphNode hNode, const CUDA_HOST_NODE_PARAMS *nodeParams) {
    return host_node_set(NULL, hNode, nodeParams);
}

RGPU_EXPORT CUresult CUDAAPI cuGraphExecHostNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                          const CUDA_HOST_NODE_PARAMS *nodeParams) {
    if (!hGraphExec) return CUDA_ERROR_INVALID_VALUE;
    return host_node_set(hGraphExec, hNode, nodeParams);
}

_Static_assert(sizeof(CUDA_HOST_NODE_PARAMS) == 16, "CUDA_HOST_NODE_PARAMS layout");
