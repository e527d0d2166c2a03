/* libcuda.so.1: initialisation, contexts, call routing, versions, errors, cuGetProcAddress. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

void rgpu_transport_reset_after_fork(void);

static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_init_done;          /* cuInit ran (successfully or not) */
static CUresult g_init_result = CUDA_ERROR_NOT_INITIALIZED;

/* ------------------------------------------------------------------ initialisation */

void rgpu_ctx_reset_after_fork(void);

static void after_fork_child(void) {
    rgpu_transport_reset_after_fork();
    rgpu_ctx_reset_after_fork();
    rgpu_tables_reset();
    rgpu_cls_reset_after_fork();
    rgpu_events_reset_after_fork();
    rgpu_zero_copy_reset_after_fork();
    pthread_mutex_init(&g_init_lock, NULL);
    g_init_done = 0;
    g_init_result = CUDA_ERROR_NOT_INITIALIZED;
}

void rgpu_say_goodbye(void);

/* At exit, after the application's own exit handlers (cudart's teardown releases its primary
 * contexts through this library then): a library destructor runs after every atexit handler
 * registered once the library was loaded. */
static int g_say_bye;
__attribute__((destructor)) static void send_bye(void) {
    if (g_say_bye) rgpu_say_goodbye();
}

CUresult rgpu_check_init(void) {
    if (__atomic_load_n(&g_init_done, __ATOMIC_ACQUIRE)) return g_init_result;
    return CUDA_ERROR_NOT_INITIALIZED;
}

static CUresult do_init(void) {
    pthread_mutex_lock(&g_init_lock);
    if (!g_init_done) {
        static int atfork_registered;
        if (!atfork_registered) {
            pthread_atfork(NULL, NULL, after_fork_child);
            g_say_bye = 1;
            atfork_registered = 1;
        }
        g_init_result = rgpu_connect_all(0, "client");
        __atomic_store_n(&g_init_done, 1, __ATOMIC_RELEASE);
    }
    CUresult r = g_init_result;
    pthread_mutex_unlock(&g_init_lock);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuInit(unsigned int Flags) {
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = do_init();
    if (r != CUDA_SUCCESS) return r;
    /* The worker ran cuInit when it started; this round trip only proves the session works. */
    for (int i = 0; i < rgpu_session_count; i++) {
        rgpu_call c;
        r = rgpu_begin_session(&c, RGPU_OP_cuInit, i);
        if (r != CUDA_SUCCESS) return r;
        rgpu_put_u32(&c, Flags);
        r = rgpu_sync(&c);
        rgpu_end(&c);
        if (r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuDriverGetVersion(int *driverVersion) {
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    /* Valid before cuInit, as with NVIDIA's driver: report what this library implements until
     * a session tells the server's version, and never more than the server's. */
    int v = RGPU_CUDA_VERSION;
    if (rgpu_check_init() == CUDA_SUCCESS) {
        for (int i = 0; i < rgpu_session_count; i++)
            if (rgpu_sessions[i].driver_version > 0 && rgpu_sessions[i].driver_version < v)
                v = rgpu_sessions[i].driver_version;
    }
    *driverVersion = v;
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuDeviceGetCount(int *count) {
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    *count = rgpu_session_count;
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (ordinal < 0 || ordinal >= rgpu_session_count) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev) {
    if (!canAccessPeer) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (dev < 0 || dev >= rgpu_session_count || peerDev < 0 || peerDev >= rgpu_session_count)
        return CUDA_ERROR_INVALID_DEVICE;
    *canAccessPeer = 0; /* each slice is its own machine as far as the client knows */
    return CUDA_SUCCESS;
}

/* Every attribute between two slices is 0: no access, no native atomics, no array access, and
 * rank 0. A device with itself is refused, as the driver does. */
RGPU_EXPORT CUresult CUDAAPI cuDeviceGetP2PAttribute(int *value, CUdevice_P2PAttribute attrib, CUdevice srcDevice,
                                                     CUdevice dstDevice) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (srcDevice < 0 || srcDevice >= rgpu_session_count || dstDevice < 0 || dstDevice >= rgpu_session_count)
        return CUDA_ERROR_INVALID_DEVICE;
    if (srcDevice == dstDevice || (int)attrib < 1 || (int)attrib > 5) return CUDA_ERROR_INVALID_VALUE;
    *value = 0;
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuProfilerStart(void) { return rgpu_check_init(); }
RGPU_EXPORT CUresult CUDAAPI cuProfilerStop(void) { return rgpu_check_init(); }

RGPU_EXPORT CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    *pStr = rgpu_cuda_error_string(error);
    return *pStr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

RGPU_EXPORT CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    *pStr = rgpu_cuda_error_name(error);
    return *pStr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------ contexts
 * The application's CUcontext values point to rgpu_ctx records in this process; each request
 * carries the worker's own handle of the calling thread's current context. */

#define MAX_CTX 1024
#define MAX_STACK 64
static rgpu_ctx *g_ctx[MAX_CTX];
static int g_nctx;
static pthread_mutex_t g_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread rgpu_ctx *t_stack[MAX_STACK];
static __thread int t_depth;

rgpu_ctx *rgpu_ctx_lookup(CUcontext ctx) {
    if (!ctx) return NULL;
    rgpu_ctx *found = NULL;
    pthread_mutex_lock(&g_ctx_lock);
    for (int i = 0; i < g_nctx; i++)
        if (g_ctx[i] == (rgpu_ctx *)ctx) { found = g_ctx[i]; break; }
    pthread_mutex_unlock(&g_ctx_lock);
    if (found && (found->magic != RGPU_CTX_MAGIC || found->destroyed)) return NULL;
    return found;
}

CUcontext rgpu_ctx_for(int session, uint64_t remote) {
    if (!remote) return NULL;
    pthread_mutex_lock(&g_ctx_lock);
    for (int i = 0; i < g_nctx; i++) {
        if (g_ctx[i]->session == session && g_ctx[i]->remote == remote) {
            g_ctx[i]->destroyed = 0;
            pthread_mutex_unlock(&g_ctx_lock);
            return (CUcontext)g_ctx[i];
        }
    }
    rgpu_ctx *c = NULL;
    if (g_nctx < MAX_CTX && (c = calloc(1, sizeof *c))) {
        c->magic = RGPU_CTX_MAGIC;
        c->session = session;
        c->remote = remote;
        g_ctx[g_nctx++] = c;
    }
    pthread_mutex_unlock(&g_ctx_lock);
    return (CUcontext)c;
}

/* A live context of `session` for work the current context cannot route there: the current one if
 * it is that session's, else its primary context, else any. NULL: the application has none. */
rgpu_ctx *rgpu_ctx_of_session(int session) {
    rgpu_ctx *cur = rgpu_ctx_current();
    if (cur && cur->session == session) return cur;
    rgpu_ctx *found = NULL;
    pthread_mutex_lock(&g_ctx_lock);
    for (int i = 0; i < g_nctx; i++) {
        rgpu_ctx *x = g_ctx[i];
        if (x->session != session || x->destroyed || x->magic != RGPU_CTX_MAGIC) continue;
        if (x->primary) { found = x; break; }
        if (!found) found = x;
    }
    pthread_mutex_unlock(&g_ctx_lock);
    return found;
}

void rgpu_ctx_forget(rgpu_ctx *ctx) {
    /* Records are kept (marked destroyed) so that stale handles stay detectable. */
    pthread_mutex_lock(&g_ctx_lock);
    ctx->destroyed = 1;
    pthread_mutex_unlock(&g_ctx_lock);
    for (int i = 0; i < t_depth; i++)
        if (t_stack[i] == ctx) t_stack[i] = NULL;
}

rgpu_ctx *rgpu_ctx_current(void) {
    if (!t_depth) return NULL;
    rgpu_ctx *c = t_stack[t_depth - 1];
    return (c && !c->destroyed) ? c : NULL;
}

int rgpu_ctx_push(rgpu_ctx *ctx) {
    if (t_depth >= MAX_STACK) return -1;
    t_stack[t_depth++] = ctx;
    return 0;
}

rgpu_ctx *rgpu_ctx_pop(void) {
    if (!t_depth) return NULL;
    return t_stack[--t_depth];
}

void rgpu_ctx_set(rgpu_ctx *ctx) {
    if (!ctx) {
        if (t_depth) t_depth--;
        return;
    }
    if (t_depth) t_stack[t_depth - 1] = ctx;
    else t_stack[t_depth++] = ctx;
}

uint64_t rgpu_header_ctx(int session) {
    rgpu_ctx *c = rgpu_ctx_current();
    return (c && c->session == session) ? c->remote : 0;
}

void rgpu_ctx_reset_after_fork(void) {
    pthread_mutex_init(&g_ctx_lock, NULL);
    g_nctx = 0;
    t_depth = 0;
}

RGPU_EXPORT CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx) {
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    *pctx = (CUcontext)rgpu_ctx_current();
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!ctx) {
        rgpu_ctx_set(NULL);
        return CUDA_SUCCESS;
    }
    rgpu_ctx *c = rgpu_ctx_lookup(ctx);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    rgpu_ctx_set(c);
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuCtxPushCurrent_v2(CUcontext ctx) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    rgpu_ctx *c = rgpu_ctx_lookup(ctx);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    return rgpu_ctx_push(c) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuCtxPopCurrent_v2(CUcontext *pctx) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!t_depth) return CUDA_ERROR_INVALID_CONTEXT;
    rgpu_ctx *c = rgpu_ctx_pop();
    if (pctx) *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ routing */

CUresult rgpu_begin(rgpu_call *c, uint16_t op) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    rgpu_ctx *cur = rgpu_ctx_current();
    /* Without a current context the call still goes somewhere, and the worker answers
     * CUDA_ERROR_INVALID_CONTEXT where CUDA would. */
    return rgpu_begin_session(c, op, cur ? cur->session : 0);
}

CUresult rgpu_begin_dev(rgpu_call *c, uint16_t op, CUdevice dev) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (dev < 0 || dev >= rgpu_session_count) return CUDA_ERROR_INVALID_DEVICE;
    return rgpu_begin_session(c, op, dev);
}

CUresult rgpu_begin_ctx(rgpu_call *c, uint16_t op, CUcontext ctx, uint64_t *remote) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    rgpu_ctx *x = ctx ? rgpu_ctx_lookup(ctx) : rgpu_ctx_current();
    if (ctx && !x) return CUDA_ERROR_INVALID_CONTEXT;
    if (remote) *remote = x ? x->remote : 0;
    return rgpu_begin_session(c, op, x ? x->session : 0);
}

CUdevice rgpu_dev_out(rgpu_call *c, int32_t remote) {
    (void)remote; /* a worker serves one GPU: its device 0 is this session's ordinal */
    return c->s ? c->s->index : 0;
}

CUcontext rgpu_ctx_out(rgpu_call *c, uint64_t remote) {
    return rgpu_ctx_for(c->s ? c->s->index : 0, remote);
}

/* Context creation and destruction: the worker's context becomes current on this thread. */
static CUresult ctx_create(uint16_t op, CUcontext *pctx, unsigned int flags, CUdevice dev, int has_params) {
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin_dev(&c, op, dev);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u32(&c, flags);
    rgpu_put_i32(&c, 0);
    rgpu_put_u32(&c, (uint32_t)has_params);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) {
        CUcontext ctx = rgpu_ctx_out(&c, rgpu_get_u64(&c));
        rgpu_end(&c);
        if (!ctx) return CUDA_ERROR_OUT_OF_MEMORY;
        rgpu_ctx_push((rgpu_ctx *)ctx);
        *pctx = ctx;
        if (rgpu_session_count > 1) rgpu_library_context_ready(dev);
        return CUDA_SUCCESS;
    }
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    return ctx_create(RGPU_OP_cuCtxCreate_v2, pctx, flags, dev, 0);
}

RGPU_EXPORT CUresult CUDAAPI cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                            unsigned int flags, CUdevice dev) {
    static int seen;
    if (numParams > 0 && paramsArray)
        return rgpu_unsupported("cuCtxCreate_v3 with execution affinity", &seen, "the slice decides the GPU share");
    return ctx_create(RGPU_OP_cuCtxCreate_v3, pctx, flags, dev, 0);
}

RGPU_EXPORT CUresult CUDAAPI cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags,
                                            CUdevice dev) {
    if (params && (params->numExecAffinityParams > 0 || params->cigParams)) {
        static int seen;
        return rgpu_unsupported("cuCtxCreate_v4 with affinity or CIG parameters", &seen,
                                "the slice decides the GPU share");
    }
    return ctx_create(RGPU_OP_cuCtxCreate_v4, pctx, flags, dev, 0);
}

RGPU_EXPORT CUresult CUDAAPI cuCtxDestroy_v2(CUcontext ctx) {
    rgpu_ctx *x = rgpu_ctx_lookup(ctx);
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!x) return CUDA_ERROR_INVALID_CONTEXT;
    rgpu_cls_context_gone(ctx);
    rgpu_cache_forget_functions();
    rgpu_array_desc_forget(0);
    rgpu_call c;
    r = rgpu_begin_session(&c, RGPU_OP_cuCtxDestroy_v2, x->session);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, x->remote);
    r = rgpu_sync(&c);
    rgpu_end(&c);
    if (r == CUDA_SUCCESS) rgpu_ctx_forget(x);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin_dev(&c, RGPU_OP_cuDevicePrimaryCtxRetain, dev);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_i32(&c, 0);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) {
        *pctx = rgpu_ctx_out(&c, rgpu_get_u64(&c));
        if (!*pctx) r = CUDA_ERROR_OUT_OF_MEMORY;
        else ((rgpu_ctx *)*pctx)->primary = 1;
    }
    rgpu_end(&c);
    rgpu_pstate_forget();
    if (r == CUDA_SUCCESS && rgpu_session_count > 1) rgpu_library_context_ready(dev);
    return r;
}

/* The CUDA 7 names, which cuGetProcAddress still returns to callers asking for an old version
 * (cudart does for cudaDeviceReset); since CUDA 11 they behave as the _v2 calls. */
RGPU_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2(dev); }
RGPU_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxReset(CUdevice dev) { return cuDevicePrimaryCtxReset_v2(dev); }
RGPU_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) {
    return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

void rgpu_before_primary_ctx_reset(CUdevice dev) {
    CUcontext found[MAX_CTX];
    int n = 0;
    pthread_mutex_lock(&g_ctx_lock);
    for (int i = 0; i < g_nctx; i++)
        if (g_ctx[i]->session == dev && g_ctx[i]->primary && !g_ctx[i]->destroyed) found[n++] = (CUcontext)g_ctx[i];
    pthread_mutex_unlock(&g_ctx_lock);
    for (int i = 0; i < n; i++) rgpu_cls_context_gone(found[i]);
}

/* ------------------------------------------------------------------ cuGetProcAddress */

static int cmp_symbol(const void *key, const void *elem) {
    return strcmp((const char *)key, ((const rgpu_symbol *)elem)->name);
}

static void *find_symbol(const char *name) {
    const rgpu_symbol *s = bsearch(name, rgpu_cuda_symbols, rgpu_cuda_symbol_count, sizeof(rgpu_symbol), cmp_symbol);
    return s ? s->fn : NULL;
}

/* The newest version of `symbol` at or below cudaVersion, honouring the per-thread-stream
 * flag, as NVIDIA's driver resolves it; a name the driver has never had gets a stub that
 * logs once and returns CUDA_ERROR_NOT_SUPPORTED (never NULL, never a crash). */
static CUresult get_proc(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                         CUdriverProcAddressQueryResult *status) {
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    int known = 0;
    const char *best = NULL;
    int best_version = -1;
    for (size_t i = 0; i < rgpu_cuda_proc_count; i++) {
        const rgpu_proc *p = &rgpu_cuda_procs[i];
        if (strcmp(p->base, symbol)) continue;
        known = 1;
        size_t sl = strlen(p->symbol);
        int per_thread = sl > 5 && (!strcmp(p->symbol + sl - 5, "_ptds") || !strcmp(p->symbol + sl - 5, "_ptsz"));
        if (per_thread) continue;
        if (p->version <= cudaVersion && p->version > best_version) {
            best = p->symbol;
            best_version = p->version;
        }
    }
    if (known && !best) {
        if (status) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        return CUDA_ERROR_NOT_FOUND;
    }
    if (best) {
        void *fn = NULL;
        if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) {
            char name[160];
            snprintf(name, sizeof name, "%s_ptds", best);
            fn = find_symbol(name);
            if (!fn) {
                snprintf(name, sizeof name, "%s_ptsz", best);
                fn = find_symbol(name);
            }
        }
        if (!fn) fn = find_symbol(best);
        if (!fn) fn = rgpu_dynamic_stub(best);
        *pfn = fn;
        if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    void *fn = find_symbol(symbol);
    *pfn = fn ? fn : rgpu_dynamic_stub(symbol);
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                                 cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus) {
    if (symbol && pfn && strcmp(symbol, "rgpuClientStatsWrite") == 0) {   /* benchmarks' profile snapshots */
        *pfn = (void *)rgpu_client_stats_write;
        if (symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    CUresult r = get_proc(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rgpu_log_level() >= RGPU_LOG_DEBUG)
        rgpu_log(RGPU_LOG_DEBUG, "cuGetProcAddress(%s, %d, %llu) -> %d", symbol ? symbol : "(null)",
                 cudaVersion, (unsigned long long)flags, r);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
