/* libnccl.so.2: NCCL's entry points that rgpu answers in the client (nccl.spec's `local` lines),
 * communicators, group calls, and the calls the generated stubs make, carried by libcuda.so.1's
 * sessions through its private bridge table (nccl_bridge.c). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rgpu_nccl_bridge.h"
#include "rgpu_nccl_client.h"

static const rgpu_nccl_bridge *g_bridge;
static pthread_once_t g_bridge_once = PTHREAD_ONCE_INIT;
static char g_bridge_problem[400];
static __thread char tl_last_error[600];

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tl_last_error, sizeof tl_last_error, fmt, ap);
    va_end(ap);
    if (g_bridge) {
        g_bridge->log_line(RGPU_LOG_ERROR, tl_last_error);
    } else {
        char line[700];
        int n = snprintf(line, sizeof line, "rgpu: nccl: %s\n", tl_last_error);
        ssize_t ignored = write(2, line, (size_t)n);
        (void)ignored;
    }
}

static void *g_libcuda;   /* rgpu's libcuda.so.1, once find_bridge found its table */

static void find_bridge(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    typedef CUresult (*get_table_fn)(const void **, const CUuuid *);
    get_table_fn get_table = cuda ? (get_table_fn)dlsym(cuda, "cuGetExportTable") : NULL;
    static const CUuuid id = {RGPU_NCCL_BRIDGE_UUID};
    const void *table = NULL;
    if (!get_table || get_table(&table, &id) != CUDA_SUCCESS || !table) {
        snprintf(g_bridge_problem, sizeof g_bridge_problem,
                 "libcuda.so.1 in this process is not rgpu's (%s); rgpu's libnccl.so.2 carries NCCL calls to the "
                 "slices' GPU servers through rgpu's libcuda: run the program through flexrun",
                 cuda ? "it has no rgpu bridge table" : dlerror());
        return;
    }
    const rgpu_nccl_bridge *b = table;
    if (b->size != sizeof *b || b->version != RGPU_NCCL_BRIDGE_VERSION || b->protocol != RGPU_PROTOCOL_VERSION) {
        snprintf(g_bridge_problem, sizeof g_bridge_problem,
                 "rgpu's libcuda.so.1 and libnccl.so.2 in this process come from different rgpu builds (protocol %d "
                 "and %d); put one build's folder first on LD_LIBRARY_PATH (flexrun does)", b->protocol,
                 RGPU_PROTOCOL_VERSION);
        return;
    }
    g_bridge = b;
    g_libcuda = cuda;
}

static const rgpu_nccl_bridge *bridge(void) {
    pthread_once(&g_bridge_once, find_bridge);
    if (!g_bridge) say("%s", g_bridge_problem);
    return g_bridge;
}

/* ------------------------------------------------------------------ the calls of generated stubs */

CUresult rgpu_begin_session(rgpu_call *c, uint16_t op, int session) {
    memset(c, 0, sizeof *c);
    const rgpu_nccl_bridge *b = bridge();
    if (!b) return CUDA_ERROR_NOT_INITIALIZED;
    int ignored;
    CUresult r = b->current_session(&ignored);   /* cuInit: the sessions exist */
    if (r != CUDA_SUCCESS) return r;
    if (session < 0 || session >= b->session_count()) return CUDA_ERROR_INVALID_DEVICE;
    return b->begin_session(c, op, session);
}
void rgpu_put(rgpu_call *c, const void *p, size_t n) { g_bridge->put(c, p, n); }
CUresult rgpu_async(rgpu_call *c) { return g_bridge->async_now(c); }
CUresult rgpu_sync(rgpu_call *c) { return g_bridge->sync(c); }
void rgpu_get(rgpu_call *c, void *p, size_t n) { g_bridge->get(c, p, n); }
void rgpu_end(rgpu_call *c) { g_bridge->end(c); }
void rgpu_abort(rgpu_call *c) { g_bridge->abort_(c); }

static int comm_ok(ncclComm_t comm) { return comm && comm->magic == RGPU_NCCL_COMM_MAGIC; }

/* Group calls: the depth is the calling thread's; a slice's worker opens NCCL's group before the
 * group's first operation on that slice (so its sends and receives are matched as NCCL requires) and
 * closes it at the outermost ncclGroupEnd. Communicators joined inside a group wait for their peers
 * there too (ncclCommInitAll's way, and NCCL's for several devices in one thread). */
static __thread int tl_group_depth;
static __thread uint64_t tl_group_slices;   /* bit i: slice i has an open group */
static __thread ncclComm_t tl_pending[RGPU_MAX_SESSIONS];
static __thread int tl_pending_n;

CUresult rgpu_nccl_begin_comm(rgpu_call *c, uint16_t op, ncclComm_t comm) {
    if (!comm_ok(comm)) {
        memset(c, 0, sizeof *c);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    uint64_t bit = 1ull << (comm->session & 63);
    int collective = op >= RGPU_OP_ncclAllReduce && op <= RGPU_OP_ncclAlltoAll;   /* nccl.spec's last section */
    if (tl_group_depth > 0 && collective && !(tl_group_slices & bit)) {
        ncclResult_t r = rgpuNcclGroupStart(comm->session);
        if (r != ncclSuccess) {
            memset(c, 0, sizeof *c);
            return CUDA_ERROR_DEVICE_UNAVAILABLE;
        }
        tl_group_slices |= bit;
    }
    return rgpu_begin_session(c, op, comm->session);
}

CUresult rgpu_nccl_begin_current(rgpu_call *c, uint16_t op) {
    const rgpu_nccl_bridge *b = bridge();
    if (!b) return CUDA_ERROR_NOT_INITIALIZED;
    int session;
    CUresult r = b->current_session(&session);
    return r == CUDA_SUCCESS ? rgpu_begin_session(c, op, session) : r;
}

uint64_t rgpu_nccl_remote(ncclComm_t comm) { return comm->remote; }

ncclResult_t rgpu_nccl_not_sent(const char *call, CUresult r) {
    if (r == CUDA_ERROR_INVALID_HANDLE) return rgpu_nccl_invalid(call, "the communicator is not one this process "
                                                                       "made, or was destroyed");
    if (r == CUDA_ERROR_NOT_INITIALIZED && !g_bridge) return ncclSystemError;   /* said by bridge() */
    say("%s: not sent to the GPU server (CUDA error %d: the slice's session is not usable; earlier lines say why)",
        call, (int)r);
    return ncclUnhandledCudaError;
}

/* The worker answers NCCL's own codes; any other is a CUDA error of earlier pipelined work (its
 * line is already on stderr) that this call reports. */
ncclResult_t rgpu_nccl_reply(CUresult r) {
    return (int)r >= 0 && (int)r < ncclNumResults ? (ncclResult_t)r : ncclUnhandledCudaError;
}

ncclResult_t rgpu_nccl_invalid(const char *call, const char *why) {
    say("%s: invalid argument (%s)", call, why);
    return ncclInvalidArgument;
}

ncclResult_t rgpu_nccl_unsupported(const char *call, int *seen) {
    if (!__atomic_exchange_n(seen, 1, __ATOMIC_RELAXED))
        say("%s is not supported by rgpu's NCCL yet (rgpu remotes communicators from ncclGetUniqueId, their "
            "splits and shrinks, groups, all-reduce, broadcast, reduce, all-gather, reduce-scatter, all-to-all, send and receive, "
            "PreMulSum operators, ncclMemAlloc and ncclMemFree)", call);
    else
        snprintf(tl_last_error, sizeof tl_last_error, "%s is not supported by rgpu's NCCL yet", call);
    return ncclInvalidUsage;
}

/* ------------------------------------------------------------------ answered here */

/* ncclMemAlloc / ncclMemFree: device memory of the calling thread's slice, from rgpu's libcuda in this
 * process (counted against the slice as any allocation). NVIDIA's NCCL allocates with cuMem* so that
 * a buffer can be registered for NVLS and zero-copy transports; rgpu does not remote registration
 * (ncclCommRegister), and NCCL's collectives take any device memory, so plain device memory is what
 * the buffer is. As NCCL (through cudaMalloc), size 0 gives NULL, and the current device's primary
 * context is made current when the thread has none. */
typedef CUresult (*ctx_get_fn)(CUcontext *);
typedef CUresult (*ctx_set_fn)(CUcontext);
typedef CUresult (*primary_fn)(CUcontext *, CUdevice);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);

static struct {
    ctx_get_fn ctx_get;
    ctx_set_fn ctx_set;
    primary_fn primary;
    alloc_fn alloc;
    free_fn release;
} g_cu;
static pthread_once_t g_cu_once = PTHREAD_ONCE_INIT;

static void find_memory_calls(void) {
    void *cuda = g_libcuda;
    g_cu.ctx_get = (ctx_get_fn)dlsym(cuda, "cuCtxGetCurrent");
    g_cu.ctx_set = (ctx_set_fn)dlsym(cuda, "cuCtxSetCurrent");
    g_cu.primary = (primary_fn)dlsym(cuda, "cuDevicePrimaryCtxRetain");
    g_cu.alloc = (alloc_fn)dlsym(cuda, "cuMemAlloc_v2");
    g_cu.release = (free_fn)dlsym(cuda, "cuMemFree_v2");
}

static int memory_calls(const char *call) {
    if (!bridge()) return 0;   /* rgpu's libcuda is not this process's: bridge() said why */
    pthread_once(&g_cu_once, find_memory_calls);
    if (g_cu.ctx_get && g_cu.ctx_set && g_cu.primary && g_cu.alloc && g_cu.release) return 1;
    say("%s: rgpu's libcuda.so.1 lacks the driver's memory calls (cuCtxGetCurrent, cuCtxSetCurrent, "
        "cuDevicePrimaryCtxRetain, cuMemAlloc_v2, cuMemFree_v2)", call);
    return 0;
}

RGPU_EXPORT ncclResult_t ncclMemAlloc(void **ptr, size_t size) {
    if (!ptr) return rgpu_nccl_invalid("ncclMemAlloc", "ptr is NULL");
    *ptr = NULL;
    if (size == 0) return ncclSuccess;
    if (!memory_calls("ncclMemAlloc")) return ncclSystemError;
    CUcontext ctx = NULL;
    CUresult r = g_cu.ctx_get(&ctx);
    if (r == CUDA_SUCCESS && !ctx) {
        int session = 0;
        if (g_bridge->current_session(&session) != CUDA_SUCCESS || session < 0) session = 0;
        r = g_cu.primary(&ctx, session);
        if (r == CUDA_SUCCESS) r = g_cu.ctx_set(ctx);
    }
    CUdeviceptr dptr = 0;
    if (r == CUDA_SUCCESS) r = g_cu.alloc(&dptr, size);
    if (r != CUDA_SUCCESS) {
        say("ncclMemAlloc: %zu bytes of device memory: CUDA error %d%s", size, (int)r,
            r == CUDA_ERROR_OUT_OF_MEMORY ? " (out of memory: the slice's memory limit or the GPU's)" : "");
        return ncclUnhandledCudaError;
    }
    *ptr = (void *)(uintptr_t)dptr;
    return ncclSuccess;
}

RGPU_EXPORT ncclResult_t ncclMemFree(void *ptr) {
    if (!ptr) return ncclSuccess;
    if (!memory_calls("ncclMemFree")) return ncclSystemError;
    CUresult r = g_cu.release((CUdeviceptr)(uintptr_t)ptr);
    if (r != CUDA_SUCCESS) {
        say("ncclMemFree: %p: CUDA error %d (not memory ncclMemAlloc gave, or freed already)", ptr, (int)r);
        return ncclUnhandledCudaError;
    }
    return ncclSuccess;
}

RGPU_EXPORT ncclResult_t ncclGetVersion(int *version) {
    if (!version) return rgpu_nccl_invalid("ncclGetVersion", "version is NULL");
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

RGPU_EXPORT const char *ncclGetErrorString(ncclResult_t result) {
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

RGPU_EXPORT const char *ncclGetLastError(ncclComm_t comm) { return tl_last_error; }

RGPU_EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
    if (!uniqueId) return rgpu_nccl_invalid("ncclGetUniqueId", "uniqueId is NULL");
    const rgpu_nccl_bridge *b = bridge();
    if (!b) return ncclSystemError;
    int session;
    CUresult r = b->current_session(&session);
    if (r != CUDA_SUCCESS) return rgpu_nccl_not_sent("ncclGetUniqueId", r);
    return rgpuNcclGetUniqueId(uniqueId, session);
}

/* Waits for the worker's communicator; a split's rank and size are learnt here. A rank that split
 * with NCCL_SPLIT_NOCOLOR has no communicator: NULL goes to the caller's pointer and it is freed. */
static ncclResult_t wait_ready(ncclComm_t comm) {
    int rank = comm->rank, nranks = comm->nranks;
    ncclResult_t r = rgpuNcclCommReady(comm, &rank, &nranks);
    comm->ready = r == ncclSuccess;
    if (r != ncclSuccess) return r;
    comm->rank = rank;
    comm->nranks = nranks;
    if (nranks == 0) {
        if (comm->out) *comm->out = NULL;
        rgpuNcclCommDestroy(comm, 0);
        comm->magic = 0;
        free(comm);
    }
    return ncclSuccess;
}

/* config->blocking (NCCL_CONFIG_UNDEF_INT: NCCL_COMM_BLOCKING, else blocking). */
static int config_blocking(const ncclConfig_t *config, int inherited) {
    if (config && config->blocking != NCCL_CONFIG_UNDEF_INT) return config->blocking != 0;
    if (config || inherited < 0) {
        const char *env = getenv("NCCL_COMM_BLOCKING");
        return !(env && !strcmp(env, "0"));
    }
    return inherited;
}

/* A communicator started on the worker: wait for it now, at the group's end, or (non-blocking) when
 * ncclCommGetAsyncError asks. */
static ncclResult_t started(ncclComm_t comm) {
    if (tl_group_depth > 0 && tl_pending_n < RGPU_MAX_SESSIONS) {
        tl_pending[tl_pending_n++] = comm;
        return ncclSuccess;
    }
    if (!comm->blocking) return ncclInProgress;
    return wait_ready(comm);
}

/* nId > 0: ncclCommInitRankScalable's ids (`id` points at the first of nId), else one id. */
static ncclResult_t join_ids(ncclComm_t *out, int session, int nranks, const ncclUniqueId *id, int nId, int rank,
                             int blocking) {
    if (!out) return rgpu_nccl_invalid("ncclCommInitRank", "comm is NULL");
    if (nranks < 1 || rank < 0 || rank >= nranks) return rgpu_nccl_invalid("ncclCommInitRank", "rank or nranks out of range");
    ncclComm_t comm = calloc(1, sizeof *comm);
    if (!comm) return ncclSystemError;
    unsigned long long remote = 0;
    ncclResult_t r = nId > 0 ? rgpuNcclCommJoinScalable(&remote, id, nId, nranks, rank, session)
                             : rgpuNcclCommJoin(&remote, id, nranks, rank, session);
    if (r != ncclSuccess) {
        free(comm);
        return r;
    }
    *comm = (struct ncclComm){.magic = RGPU_NCCL_COMM_MAGIC, .session = session, .remote = remote, .rank = rank,
                              .nranks = nranks, .blocking = blocking};
    *out = comm;
    return started(comm);
}

static ncclResult_t join(ncclComm_t *out, int session, int nranks, const ncclUniqueId *id, int rank, int blocking) {
    return join_ids(out, session, nranks, id, 0, rank, blocking);
}

static ncclResult_t init_rank(ncclComm_t *comm, int nranks, const ncclUniqueId *id, int nId, int rank, int blocking) {
    const rgpu_nccl_bridge *b = bridge();
    if (!b) return ncclSystemError;
    int session;
    CUresult r = b->current_session(&session);
    if (r != CUDA_SUCCESS) return rgpu_nccl_not_sent("ncclCommInitRank", r);
    return join_ids(comm, session, nranks, id, nId, rank, blocking);
}

RGPU_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    return init_rank(comm, nranks, &commId, 0, rank, config_blocking(NULL, -1));
}

/* Every rank passes the same nId ids (each from ncclGetUniqueId); the worker's NCCL spreads the ranks'
 * bootstrap over their roots (real NCCL), or forms the mesh through the first (emulated). */
RGPU_EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
                                                  ncclUniqueId *commIds, ncclConfig_t *config) {
    if (nId < 1 || !commIds) return rgpu_nccl_invalid("ncclCommInitRankScalable", "nId must be at least 1 and commIds not NULL");
    return init_rank(newcomm, nranks, commIds, nId, myrank, config_blocking(config, -1));
}

/* Of the config only `blocking` applies (the rest tunes NCCL's kernels and network; the worker's NCCL
 * uses its defaults). Non-blocking: the join starts and ncclInProgress answers at once, as NCCL's. */
RGPU_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                                ncclConfig_t *config) {
    return init_rank(comm, nranks, &commId, 0, rank, config_blocking(config, -1));
}

/* Collective over the parent's ranks: each worker exchanges (color, key) over the parent and forms
 * the new communicator in the background; the new one's rank and size come at rgpuNcclCommReady. */
RGPU_EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
    if (!comm_ok(comm) || !newcomm) return rgpu_nccl_invalid("ncclCommSplit", "not a communicator, or newcomm is NULL");
    if (color < 0 && color != NCCL_SPLIT_NOCOLOR) return rgpu_nccl_invalid("ncclCommSplit", "color must be >= 0 or NCCL_SPLIT_NOCOLOR");
    ncclComm_t child = calloc(1, sizeof *child);
    if (!child) return ncclSystemError;
    unsigned long long remote = 0;
    ncclResult_t r = rgpuNcclCommSplit(&remote, comm, color, key);
    if (r != ncclSuccess) {
        free(child);
        return r;
    }
    *child = (struct ncclComm){.magic = RGPU_NCCL_COMM_MAGIC, .session = comm->session, .remote = remote,
                               .rank = -1, .nranks = -1, .out = newcomm,
                               /* no color: waited for (here or at the group's end), then NULL */
                               .blocking = color == NCCL_SPLIT_NOCOLOR || config_blocking(config, comm->blocking)};
    *newcomm = child;
    return started(child);
}

/* The ranks that stay call it (the excluded ones do not): the workers form the new communicator in the
 * background, ranks in the parent's order; its rank and size come at rgpuNcclCommReady, as a split's. */
RGPU_EXPORT ncclResult_t ncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount, ncclComm_t *newcomm,
                                        ncclConfig_t *config, int shrinkFlags) {
    if (!comm_ok(comm) || !newcomm) return rgpu_nccl_invalid("ncclCommShrink", "not a communicator, or newcomm is NULL");
    if (excludeRanksCount < 0 || (excludeRanksCount > 0 && !excludeRanksList))
        return rgpu_nccl_invalid("ncclCommShrink", "excludeRanksCount is negative, or excludeRanksList is NULL");
    if (shrinkFlags & ~NCCL_SHRINK_ABORT) return rgpu_nccl_invalid("ncclCommShrink", "unknown shrinkFlags");
    for (int i = 0; i < excludeRanksCount; i++)
        if (excludeRanksList[i] == comm->rank)
            return rgpu_nccl_invalid("ncclCommShrink", "this rank is in excludeRanksList (excluded ranks do not call it)");
    ncclComm_t child = calloc(1, sizeof *child);
    if (!child) return ncclSystemError;
    unsigned long long remote = 0;
    ncclResult_t r = rgpuNcclCommShrink(&remote, comm, excludeRanksList, excludeRanksCount, shrinkFlags);
    if (r != ncclSuccess) {
        free(child);
        return r;
    }
    *child = (struct ncclComm){.magic = RGPU_NCCL_COMM_MAGIC, .session = comm->session, .remote = remote,
                               .rank = -1, .nranks = -1, .blocking = config_blocking(config, comm->blocking)};
    *newcomm = child;
    return started(child);
}

RGPU_EXPORT ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
                                                  ncclScalarResidence_t residence, ncclComm_t comm) {
    static const int sizes[ncclNumTypes] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    if (!op || !scalar) return rgpu_nccl_invalid("ncclRedOpCreatePreMulSum", "op or scalar is NULL");
    if ((int)datatype < 0 || datatype >= ncclNumTypes) return rgpu_nccl_invalid("ncclRedOpCreatePreMulSum", "unknown datatype");
    unsigned long long value = 0;   /* host-immediate: the scalar's bytes, read now; on the device: its address */
    if (residence == ncclScalarHostImmediate) memcpy(&value, scalar, (size_t)sizes[datatype]);
    else value = (unsigned long long)(uintptr_t)scalar;
    int made = 0;
    ncclResult_t r = rgpuNcclRedOpCreatePreMulSum(&made, value, datatype, (int)residence, comm);
    if (r == ncclSuccess) *op = (ncclRedOp_t)made;
    return r;
}

RGPU_EXPORT ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
    if (!comms || ndev < 1) return rgpu_nccl_invalid("ncclCommInitAll", "comms is NULL or ndev < 1");
    const rgpu_nccl_bridge *b = bridge();
    if (!b) return ncclSystemError;
    int ignored;
    CUresult cr = b->current_session(&ignored);
    if (cr != CUDA_SUCCESS) return rgpu_nccl_not_sent("ncclCommInitAll", cr);
    for (int i = 0; i < ndev; i++) {
        int dev = devlist ? devlist[i] : i;
        if (dev < 0 || dev >= b->session_count()) return rgpu_nccl_invalid("ncclCommInitAll", "a device of devlist is not a slice of this job");
    }
    ncclUniqueId id;
    ncclResult_t r = rgpuNcclGetUniqueId(&id, devlist ? devlist[0] : 0);
    if (r != ncclSuccess) return r;
    ncclGroupStart();
    for (int i = 0; i < ndev && r == ncclSuccess; i++) r = join(&comms[i], devlist ? devlist[i] : i, ndev, &id, i, 1);
    ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
}

RGPU_EXPORT ncclResult_t ncclGroupStart(void) {
    tl_group_depth++;
    return ncclSuccess;
}

RGPU_EXPORT ncclResult_t ncclGroupEnd(void) {
    if (tl_group_depth <= 0) return rgpu_nccl_invalid("ncclGroupEnd", "no ncclGroupStart before it");
    if (--tl_group_depth > 0) return ncclSuccess;
    ncclResult_t first = ncclSuccess;
    for (int i = 0; i < 64; i++) {
        if (!(tl_group_slices & (1ull << i))) continue;
        ncclResult_t r = rgpuNcclGroupEnd(i);
        if (first == ncclSuccess) first = r;
    }
    tl_group_slices = 0;
    for (int i = 0; i < tl_pending_n; i++) {
        ncclComm_t comm = tl_pending[i];
        ncclResult_t r = comm->blocking ? wait_ready(comm) : ncclInProgress;   /* non-blocking: ncclCommGetAsyncError */
        if (first == ncclSuccess) first = r;
    }
    tl_pending_n = 0;
    return first;
}

static ncclResult_t finish(ncclComm_t comm, int abort) {
    if (!comm) return ncclSuccess;   /* as NCCL: destroying NULL does nothing */
    if (!comm_ok(comm)) return rgpu_nccl_invalid(abort ? "ncclCommAbort" : "ncclCommDestroy", "not a communicator");
    ncclResult_t r = rgpuNcclCommDestroy(comm, abort);
    comm->magic = 0;
    free(comm);
    return abort ? ncclSuccess : r;
}

RGPU_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) { return finish(comm, 0); }
RGPU_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) { return finish(comm, 1); }

RGPU_EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    if (!comm_ok(comm) || !asyncError) return rgpu_nccl_invalid("ncclCommGetAsyncError", "not a communicator, or asyncError is NULL");
    int value = 0;
    ncclResult_t r = rgpuNcclCommGetAsyncError(comm, &value);
    if (r == ncclUnhandledCudaError)   /* an earlier pipelined call's error answered this call: ask again */
        r = rgpuNcclCommGetAsyncError(comm, &value);
    if (r == ncclSuccess && value == ncclSuccess && !comm->ready)
        r = wait_ready(comm);   /* formed: learn its rank and size (answers at once; never NOCOLOR's, which blocks) */
    *asyncError = (ncclResult_t)value;
    return r;
}

RGPU_EXPORT ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    if (!comm_ok(comm) || !count) return rgpu_nccl_invalid("ncclCommCount", "not a communicator, or count is NULL");
    *count = comm->nranks;
    return ncclSuccess;
}

RGPU_EXPORT ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
    if (!comm_ok(comm) || !device) return rgpu_nccl_invalid("ncclCommCuDevice", "not a communicator, or device is NULL");
    *device = comm->session;
    return ncclSuccess;
}

RGPU_EXPORT ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    if (!comm_ok(comm) || !rank) return rgpu_nccl_invalid("ncclCommUserRank", "not a communicator, or rank is NULL");
    *rank = comm->rank;
    return ncclSuccess;
}

RGPU_EXPORT ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                                   cudaStream_t stream) {
    return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}
