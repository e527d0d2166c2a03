/* Answers kept in the client for queries that libraries repeat thousands of times per training
 * step (measured with trace mode on PyTorch: cuCtxGetDevice, cuKernelGetAttribute,
 * cuDevicePrimaryCtxGetState, cuKernelGetFunction, cuDeviceGetAttribute), each a round trip
 * otherwise. Each cache holds only values that nothing but this process can change, and every call
 * that could change one empties it: exact answers, no round trip. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

/* Tables grow (doubling) instead of being emptied when full: cuBLASLt and cuDNN ask several
 * attributes of thousands of kernels, and an emptied table made every one a round trip again. */
#define FIRST_SLOTS 4096u
#define MAX_SLOTS (1u << 20)

typedef struct {
    uint64_t k1, k2, k3, value;
    int used;
} entry;

typedef struct {
    entry *e;
    uint32_t size, count;
} table;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static table g_kattr, g_kfunc, g_dattr, g_pstate;

static uint64_t hash(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t h = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^ c * 0x94D049BB133111EBull;
    return h ^ (h >> 31);
}

static int get(table *t, uint64_t a, uint64_t b, uint64_t c, uint64_t *value) {
    pthread_mutex_lock(&g_lock);
    int found = 0;
    if (t->size) {
        for (uint64_t i = hash(a, b, c) % t->size, n = 0; n < t->size && t->e[i].used; i = (i + 1) % t->size, n++) {
            if (t->e[i].k1 == a && t->e[i].k2 == b && t->e[i].k3 == c) {
                *value = t->e[i].value;
                found = 1;
                break;
            }
        }
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* Place an entry known to be absent (the lock is held; there is room). */
static void place(table *t, entry x) {
    uint64_t i = hash(x.k1, x.k2, x.k3) % t->size;
    while (t->e[i].used) i = (i + 1) % t->size;
    t->e[i] = x;
    t->count++;
}

/* Rebuild t at `size` slots, without the entries whose first key is drop_k1 when dropping (the
 * lock is held). Returns -1
 * when memory runs out; t is then emptied, which only costs round trips. */
static int rebuild(table *t, uint32_t size, uint64_t drop_k1, int dropping) {
    entry *old = t->e;
    uint32_t old_size = t->size;
    t->e = calloc(size, sizeof *t->e);
    t->count = 0;
    if (!t->e) {
        t->size = 0;
        free(old);
        return -1;
    }
    t->size = size;
    for (uint32_t i = 0; i < old_size; i++)
        if (old[i].used && !(dropping && old[i].k1 == drop_k1)) place(t, old[i]);
    free(old);
    return 0;
}

static void put(table *t, uint64_t a, uint64_t b, uint64_t c, uint64_t value) {
    pthread_mutex_lock(&g_lock);
    if (t->count + 1 > t->size / 4 * 3) {
        uint32_t size = t->size ? t->size * 2 : FIRST_SLOTS;
        if (size > MAX_SLOTS) {   /* a bound on memory: start over */
            free(t->e);
            t->e = NULL;
            t->size = t->count = 0;
            size = FIRST_SLOTS;
        }
        if (rebuild(t, size, 0, 0)) {
            pthread_mutex_unlock(&g_lock);
            return;
        }
    }
    uint64_t i = hash(a, b, c) % t->size;
    while (t->e[i].used && !(t->e[i].k1 == a && t->e[i].k2 == b && t->e[i].k3 == c)) i = (i + 1) % t->size;
    if (!t->e[i].used) t->count++;
    t->e[i] = (entry){a, b, c, value, 1};
    pthread_mutex_unlock(&g_lock);
}

/* Drop every entry whose first key is k1 (linear probing: the others are placed again). */
static void forget_first_key(table *t, uint64_t k1) {
    pthread_mutex_lock(&g_lock);
    int hit = 0;
    for (uint32_t i = 0; i < t->size && !hit; i++) hit = t->e[i].used && t->e[i].k1 == k1;
    if (hit) rebuild(t, t->size, k1, 1);
    pthread_mutex_unlock(&g_lock);
}

static void clear(table *t) {
    pthread_mutex_lock(&g_lock);
    if (t->count) {
        memset(t->e, 0, (size_t)t->size * sizeof *t->e);
        t->count = 0;
    }
    pthread_mutex_unlock(&g_lock);
}

/* cuCtxGetDevice: a context's device is its slice's ordinal, fixed for the context's life. */
int rgpu_cached_ctx_device(CUcontext ctx, CUdevice *device) {
    rgpu_ctx *x = ctx ? rgpu_ctx_lookup(ctx) : rgpu_ctx_current();
    if (!x || x->destroyed) return 0;
    *device = x->session;
    return 1;
}

/* cuKernelGetAttribute / cuKernelGetFunction: forgotten when any function or kernel attribute
 * is set, a module or library unloaded, or a context destroyed or reset. */
int rgpu_kattr_get(CUkernel k, int attrib, CUdevice dev, int *out) {
    uint64_t v;
    if (!get(&g_kattr, (uint64_t)(uintptr_t)k, (uint64_t)attrib, (uint64_t)dev, &v)) return 0;
    *out = (int)v;
    return 1;
}
void rgpu_kattr_put(CUkernel k, int attrib, CUdevice dev, int value) {
    put(&g_kattr, (uint64_t)(uintptr_t)k, (uint64_t)attrib, (uint64_t)dev, (uint64_t)(uint32_t)value);
}

static uint64_t current_remote(void) {
    rgpu_ctx *x = rgpu_ctx_current();
    return x ? x->remote + ((uint64_t)x->session << 56) : 0;
}
int rgpu_kfunc_get(CUkernel k, CUfunction *out) {
    uint64_t v, ctx = current_remote();
    if (!ctx || !get(&g_kfunc, (uint64_t)(uintptr_t)k, ctx, 0, &v)) return 0;
    *out = (CUfunction)(uintptr_t)v;
    return 1;
}
void rgpu_kfunc_put(CUkernel k, CUfunction f) {
    uint64_t ctx = current_remote();
    if (ctx) put(&g_kfunc, (uint64_t)(uintptr_t)k, ctx, 0, (uint64_t)(uintptr_t)f);
}
void rgpu_cache_forget_occupancy(void);
void rgpu_limit_forget(void);

/* cuKernelSetAttribute changed one kernel: only its answers go (with the occupancy answers, which
 * are keyed by function). Forgetting everything here made libraries that set attributes on
 * several kernels in turn miss every cache on every call (measured: ~200 round trips per GPT-2
 * training step). */
void rgpu_kattr_changed(CUkernel k, int attrib, CUdevice dev, int value) {
    forget_first_key(&g_kattr, (uint64_t)(uintptr_t)k);
    rgpu_cache_forget_occupancy();
    rgpu_kattr_put(k, attrib, dev, value);
}

/* cuFuncSetAttribute: the kernels this function was obtained from (through cuKernelGetFunction)
 * lose their answers; a function the cache does not know may be any kernel's: forget them all. */
void rgpu_fattr_changed(CUfunction f) {
    uint64_t kernels[16];
    int n = 0, unknown = 1;
    pthread_mutex_lock(&g_lock);
    for (uint32_t i = 0; i < g_kfunc.size; i++)
        if (g_kfunc.e[i].used && g_kfunc.e[i].value == (uint64_t)(uintptr_t)f) {
            unknown = 0;
            if (n < 16) kernels[n++] = g_kfunc.e[i].k1;
            else unknown = 1;
        }
    pthread_mutex_unlock(&g_lock);
    if (unknown) clear(&g_kattr);
    else for (int i = 0; i < n; i++) forget_first_key(&g_kattr, kernels[i]);
    rgpu_cache_forget_occupancy();
}

void rgpu_cache_forget_functions(void) {
    rgpu_limit_forget();
    clear(&g_kattr);
    clear(&g_kfunc);
    rgpu_cache_forget_occupancy();
}

/* cuDeviceGetAttribute: a device's attributes do not change. */
int rgpu_dattr_get(int attrib, CUdevice dev, int *out) {
    uint64_t v;
    if (!get(&g_dattr, (uint64_t)attrib, (uint64_t)dev, 0, &v)) return 0;
    *out = (int)v;
    return 1;
}
void rgpu_dattr_put(int attrib, CUdevice dev, int value) {
    put(&g_dattr, (uint64_t)attrib, (uint64_t)dev, 0, (uint64_t)(uint32_t)value);
}

/* cuDevicePrimaryCtxGetState: changed only by this process's retain, release, reset, set-flags. */
int rgpu_pstate_get(CUdevice dev, unsigned int *flags, int *active) {
    uint64_t v;
    if (!get(&g_pstate, (uint64_t)dev, 0, 0, &v)) return 0;
    *flags = (unsigned int)(v & 0xFFFFFFFFu);
    *active = (int)(v >> 32);
    return 1;
}
void rgpu_pstate_put(CUdevice dev, unsigned int flags, int active) {
    put(&g_pstate, (uint64_t)dev, 0, 0, (uint64_t)flags | ((uint64_t)(uint32_t)active << 32));
}
void rgpu_pstate_forget(void) { clear(&g_pstate); }

/* cuOccupancyMaxActiveBlocksPerMultiprocessor(WithFlags): fixed for a function, block size,
 * dynamic shared memory and flags until a function attribute changes (forgotten with them). */
static table g_occ;
int rgpu_occ_get(CUfunction f, int block, size_t smem, unsigned int flags, int *out) {
    uint64_t v;
    if (!get(&g_occ, (uint64_t)(uintptr_t)f, (uint64_t)(uint32_t)block | ((uint64_t)flags << 32), smem, &v)) return 0;
    *out = (int)v;
    return 1;
}
void rgpu_occ_put(CUfunction f, int block, size_t smem, unsigned int flags, int value) {
    put(&g_occ, (uint64_t)(uintptr_t)f, (uint64_t)(uint32_t)block | ((uint64_t)flags << 32), smem, (uint64_t)(uint32_t)value);
}
void rgpu_cache_forget_occupancy(void) { clear(&g_occ); }

/* cuCtxGetLimit, per context: changed only by cuCtxSetLimit, except the stack size, which the
 * driver raises by itself for kernels that need more (never cached). */
static table g_limit;
int rgpu_limit_get(int limit, size_t *out) {
    uint64_t v, ctx = current_remote();
    if (limit == 0 || !ctx || !get(&g_limit, ctx, (uint64_t)limit, 0, &v)) return 0;
    *out = (size_t)v;
    return 1;
}
void rgpu_limit_put(int limit, size_t value) {
    uint64_t ctx = current_remote();
    if (limit != 0 && ctx) put(&g_limit, ctx, (uint64_t)limit, 0, value);
}
void rgpu_limit_forget(void) { clear(&g_limit); }

/* Function nodes made in this process for the worker's (module_nodes.c): node -> worker's node.
 * While there are none, translating a function costs one atomic load. */
static table g_private_fn;
static int g_private_fns;
void rgpu_fn_private_put(void *node, uint64_t remote) {
    put(&g_private_fn, (uint64_t)(uintptr_t)node, 0, 0, remote);
    __atomic_store_n(&g_private_fns, 1, __ATOMIC_RELEASE);
}
CUfunction rgpu_fn_remote(CUfunction f) {
    uint64_t v;
    if (__atomic_load_n(&g_private_fns, __ATOMIC_ACQUIRE) && get(&g_private_fn, (uint64_t)(uintptr_t)f, 0, 0, &v))
        return (CUfunction)(uintptr_t)v;
    if (rgpu_session_count < 2) return f;
    /* A library's kernel (launched as a function, as the runtime does): the current slice's copy
     * (library_mirror.c). */
    rgpu_ctx *cur = rgpu_ctx_current();
    return (CUfunction)(uintptr_t)rgpu_handle_in(cur ? cur->session : 0, (uint64_t)(uintptr_t)f);
}

/* Which slice each event lives on (events are the workers' handles), so that a stream of one slice
 * can wait for an event of another: the worker cannot see the other's event, so the wait happens
 * here, by synchronising the event in its own slice first (stronger ordering, same results).
 * A handle value seen on two slices is ambiguous and left to the worker. */
static table g_event_session;
#define EVENT_AMBIGUOUS 0xFFFFu
void rgpu_event_session_put(CUevent event, int session) {
    if (rgpu_session_count < 2) return;   /* one slice: every event is the current one's */
    uint64_t v;
    if (get(&g_event_session, (uint64_t)(uintptr_t)event, 0, 0, &v) && v != (uint64_t)session + 1)
        session = EVENT_AMBIGUOUS - 1;
    put(&g_event_session, (uint64_t)(uintptr_t)event, 0, 0, (uint64_t)session + 1);
}
void rgpu_event_session_forget(CUevent event) {
    if (rgpu_session_count < 2) return;
    forget_first_key(&g_event_session, (uint64_t)(uintptr_t)event);
}
int rgpu_event_elsewhere(CUevent event, CUresult *result) {
    uint64_t v;
    if (rgpu_session_count < 2) return 0;   /* PyTorch waits on events often: no lock for one slice */
    rgpu_ctx *cur = rgpu_ctx_current();
    if (!cur || !get(&g_event_session, (uint64_t)(uintptr_t)event, 0, 0, &v) || v == EVENT_AMBIGUOUS ||
        (int)(v - 1) == cur->session)
        return 0;
    rgpu_ctx *there = rgpu_ctx_of_session((int)(v - 1));
    if (!there) return 0;
    CUresult r = cuCtxPushCurrent_v2((CUcontext)there);
    if (r == CUDA_SUCCESS) {
        r = cuEventSynchronize(event);
        cuCtxPopCurrent_v2(NULL);
    }
    *result = r;
    return 1;
}
