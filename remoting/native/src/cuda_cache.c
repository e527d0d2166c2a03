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
static table g_kattr, g_kfunc, g_dattr, g_pstate, g_fattr, g_stream;
static void forget_streams(void);
static void forget_occupancy_of(uint64_t f);

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

/* Which entries a rebuild drops: those whose keys selected by `mask` (bit 0: k1, bit 1: k2) equal
 * the pattern's; mask 0 drops none. */
enum { MATCH_K1 = 1, MATCH_K2 = 2 };
static int dropped(const entry *e, const entry *pattern, int mask) {
    return mask && (!(mask & MATCH_K1) || e->k1 == pattern->k1) && (!(mask & MATCH_K2) || e->k2 == pattern->k2);
}

/* Rebuild t at `size` slots, without the entries the pattern drops (the lock is held). Returns -1
 * when memory runs out; t is then emptied, which only costs round trips. */
static int rebuild(table *t, uint32_t size, entry pattern, int mask) {
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
        if (old[i].used && !dropped(&old[i], &pattern, mask)) place(t, old[i]);
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
        if (rebuild(t, size, (entry){0}, 0)) {
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

/* Drop every entry the pattern matches (linear probing: the others are placed again). */
static void forget_matching(table *t, uint64_t k1, uint64_t k2, int mask) {
    entry pattern = {.k1 = k1, .k2 = k2};
    pthread_mutex_lock(&g_lock);
    int hit = 0;
    if (!t->count) {
        pthread_mutex_unlock(&g_lock);
        return;
    }
    for (uint32_t i = 0; i < t->size && !hit; i++) hit = t->e[i].used && dropped(&t->e[i], &pattern, mask);
    if (hit) rebuild(t, t->size, pattern, mask);
    pthread_mutex_unlock(&g_lock);
}
static void forget_first_key(table *t, uint64_t k1) { forget_matching(t, k1, 0, MATCH_K1); }

/* Drop one entry without a scan (a set runs this before each launch): the entries after it in its
 * probe run move back where their own probe would find them. */
static void forget_key(table *t, uint64_t a, uint64_t b, uint64_t c) {
    pthread_mutex_lock(&g_lock);
    uint32_t i = t->count ? (uint32_t)(hash(a, b, c) % t->size) : 0;
    for (uint32_t n = 0; t->count && n < t->size && t->e[i].used; i = (i + 1) % t->size, n++) {
        if (t->e[i].k1 != a || t->e[i].k2 != b || t->e[i].k3 != c) continue;
        t->e[i].used = 0;
        t->count--;
        for (uint32_t j = (i + 1) % t->size; t->e[j].used; j = (j + 1) % t->size) {
            uint32_t home = (uint32_t)(hash(t->e[j].k1, t->e[j].k2, t->e[j].k3) % t->size);
            /* j stays where its home lies cyclically in (i, j] */
            if (i <= j ? (i < home && home <= j) : (i < home || home <= j)) continue;
            t->e[i] = t->e[j];
            t->e[j].used = 0;
            i = j;
        }
        break;
    }
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
static void forget_kernel_functions(CUkernel k);
void rgpu_kattr_changed(CUkernel k, int attrib, CUdevice dev, int value) {
    forget_first_key(&g_kattr, (uint64_t)(uintptr_t)k);
    forget_kernel_functions(k);
    rgpu_cache_forget_occupancy();
    rgpu_kattr_put(k, attrib, dev, value);
}

/* cuFuncSetAttribute: the kernels this function was obtained from (through cuKernelGetFunction)
 * lose their answers; a function the cache does not know may be any kernel's: forget them all. */
/* The functions a kernel was turned into (cuKernelGetFunction) lose their cached attributes; a
 * CUkernel may also be used as a CUfunction directly (CUDA 12). */
static void forget_kernel_functions(CUkernel k) {
    uint64_t fns[16];
    int n = 0, overflow = 0;
    pthread_mutex_lock(&g_lock);
    for (uint32_t i = 0; i < g_kfunc.size; i++)
        if (g_kfunc.e[i].used && g_kfunc.e[i].k1 == (uint64_t)(uintptr_t)k) {
            if (n < 16) fns[n++] = g_kfunc.e[i].value;
            else overflow = 1;
        }
    pthread_mutex_unlock(&g_lock);
    if (overflow) {
        clear(&g_fattr);
        return;
    }
    forget_first_key(&g_fattr, (uint64_t)(uintptr_t)k);
    for (int i = 0; i < n; i++) forget_first_key(&g_fattr, fns[i]);
}

void rgpu_fattr_changed(CUfunction f) {
    forget_first_key(&g_fattr, (uint64_t)(uintptr_t)f);
    forget_kernel_functions((CUkernel)f);   /* a CUkernel set through cuFuncSetAttribute */
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


/* A set that travelled pipelined (func_attrs.c) changed one attribute only: its kept answers go for
 * the handle and the kernels and functions related to it through cuKernelGetFunction (a CUkernel
 * may also be used as a CUfunction), with their occupancy answers, and the value set answers from
 * now on. The other attributes (the static sizes the next set is checked against) stay. */
#define RELATED_MAX 16
static int related_handles(uint64_t h, uint64_t *out) {
    int n = 0;
    out[n++] = h;
    pthread_mutex_lock(&g_lock);
    for (uint32_t i = 0; i < g_kfunc.size && n >= 0; i++) {
        const entry *e = &g_kfunc.e[i];
        uint64_t other = !e->used ? 0 : e->k1 == h ? e->value : e->value == h ? e->k1 : 0;
        if (!other) continue;
        if (n == RELATED_MAX) n = -1;
        else out[n++] = other;
    }
    pthread_mutex_unlock(&g_lock);
    return n;
}
static void attribute_set(uint64_t h, int attrib, int is_function) {
    uint64_t related[RELATED_MAX];
    int n = related_handles(h, related);
    if (n < 0) {
        forget_matching(&g_fattr, 0, (uint64_t)attrib, MATCH_K2);
        forget_matching(&g_kattr, 0, (uint64_t)attrib, MATCH_K2);
        rgpu_cache_forget_occupancy();
        return;
    }
    /* third keys: the slice (functions; 0 with one) and the device (kernels), both below the count */
    int slices = rgpu_session_count < 2 ? 1 : rgpu_session_count;
    for (int i = 0; i < n; i++) {
        for (int s = 0; s < slices; s++) {
            forget_key(&g_fattr, related[i], (uint64_t)attrib, (uint64_t)s);
            forget_key(&g_kattr, related[i], (uint64_t)attrib, (uint64_t)s);
        }
        forget_occupancy_of(related[i]);
    }
    /* a function the cache knows no kernel of may still be one's (as rgpu_fattr_changed says) */
    if (is_function && n == 1) forget_matching(&g_kattr, 0, (uint64_t)attrib, MATCH_K2);
}
void rgpu_fattr_set(CUfunction f, int attrib, int value) {
    attribute_set((uint64_t)(uintptr_t)f, attrib, 1);
    rgpu_fattr_put(f, attrib, value);
}
void rgpu_kattr_set(CUkernel k, int attrib, CUdevice dev, int value) {
    attribute_set((uint64_t)(uintptr_t)k, attrib, 0);
    rgpu_kattr_put(k, attrib, dev, value);
}
/* The worker refused a pipelined set (its error answered a later call): the values kept for it
 * are not the driver's. */
void rgpu_attr_sets_refused(void) {
    clear(&g_kattr);
    clear(&g_fattr);
    rgpu_cache_forget_occupancy();
}

void rgpu_cache_forget_functions(void) {
    rgpu_limit_forget();
    clear(&g_kattr);
    clear(&g_kfunc);
    clear(&g_fattr);
    forget_streams();
    rgpu_pattr_forget_all();
    rgpu_ctx_query_forget();
    rgpu_cache_forget_occupancy();
}

/* cuFuncGetAttribute (cuDNN's RNN path asks ~180 times per batch): a function's attributes are
 * fixed after load except those the application sets itself. Cached per (function, attribute)
 * on the first answer; cuFuncSetAttribute forgets that function's answers (and the occupancy
 * answers), cuKernelSetAttribute those of the kernel's functions, a cache-config, shared-memory
 * or limit change, an unload or a context's end all of them. */
/* A library's kernel used as a function serves every slice (library_mirror.c): keyed by slice too. */
static uint64_t current_session(void) {
    if (rgpu_session_count < 2) return 0;
    rgpu_ctx *cur = rgpu_ctx_current();
    return cur ? (uint64_t)cur->session : 0;
}
int rgpu_fattr_get(CUfunction f, int attrib, int *out) {
    uint64_t v;
    if (!get(&g_fattr, (uint64_t)(uintptr_t)f, (uint64_t)attrib, current_session(), &v)) return 0;
    *out = (int)v;
    return 1;
}
void rgpu_fattr_put(CUfunction f, int attrib, int value) {
    put(&g_fattr, (uint64_t)(uintptr_t)f, (uint64_t)attrib, current_session(), (uint64_t)(uint32_t)value);
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
 * dynamic shared memory and flags until a function attribute changes (forgotten with them).
 * Keyed by slice as well: two workers hand out the same handle values for the same loads, and a
 * library's kernel used as a function serves every slice, while their devices may differ. */
static table g_occ, g_occ_fns;   /* g_occ_fns: the functions any occupancy table holds answers of */
static uint64_t occ_key(CUfunction f, uint64_t session) { return (uint64_t)(uintptr_t)f + (session << 56); }
static uint64_t occ_fn_key(CUfunction f) {
    uint64_t k = occ_key(f, current_session());
    put(&g_occ_fns, k, 0, 0, 1);
    return k;
}
int rgpu_occ_get(CUfunction f, int block, size_t smem, unsigned int flags, int *out) {
    uint64_t v;
    if (!get(&g_occ, occ_key(f, current_session()), (uint64_t)(uint32_t)block | ((uint64_t)flags << 32), smem, &v))
        return 0;
    *out = (int)v;
    return 1;
}
void rgpu_occ_put(CUfunction f, int block, size_t smem, unsigned int flags, int value) {
    put(&g_occ, occ_fn_key(f), (uint64_t)(uint32_t)block | ((uint64_t)flags << 32), smem,
        (uint64_t)(uint32_t)value);
}
/* cuOccupancyAvailableDynamicSMemPerBlock and the callback-free cuOccupancyMaxPotentialBlockSize:
 * fixed for their arguments until a function attribute changes (forgotten with the above). */
static table g_occ_smem, g_occ_potential;
int rgpu_occ_smem_get(CUfunction f, int blocks, int block_size, size_t *out) {
    uint64_t v;
    if (!get(&g_occ_smem, occ_key(f, current_session()), (uint64_t)(uint32_t)blocks | ((uint64_t)(uint32_t)block_size << 32),
             0, &v))
        return 0;
    *out = (size_t)v;
    return 1;
}
void rgpu_occ_smem_put(CUfunction f, int blocks, int block_size, size_t value) {
    put(&g_occ_smem, occ_fn_key(f), (uint64_t)(uint32_t)blocks | ((uint64_t)(uint32_t)block_size << 32),
        0, value);
}
int rgpu_occ_potential_get(CUfunction f, size_t smem, int limit, unsigned int flags, int *min_grid, int *block) {
    uint64_t v;
    if (!get(&g_occ_potential, occ_key(f, current_session()), smem, (uint64_t)(uint32_t)limit | ((uint64_t)flags << 32),
             &v))
        return 0;
    *min_grid = (int)(uint32_t)v;
    *block = (int)(v >> 32);
    return 1;
}
void rgpu_occ_potential_put(CUfunction f, size_t smem, int limit, unsigned int flags, int min_grid, int block) {
    put(&g_occ_potential, occ_fn_key(f), smem, (uint64_t)(uint32_t)limit | ((uint64_t)flags << 32),
        (uint64_t)(uint32_t)min_grid | ((uint64_t)(uint32_t)block << 32));
}
void rgpu_cache_forget_occupancy(void) {
    clear(&g_occ);
    clear(&g_occ_smem);
    clear(&g_occ_potential);
    clear(&g_occ_fns);
}
/* One function's occupancy answers, on every slice. */
static void forget_occupancy_of(uint64_t f) {
    int sessions = rgpu_session_count < 2 ? 1 : rgpu_session_count;
    for (int s = 0; s < sessions; s++) {
        uint64_t k = occ_key((CUfunction)(uintptr_t)f, (uint64_t)s), v;
        if (!get(&g_occ_fns, k, 0, 0, &v)) continue;   /* the usual case: no scan */
        forget_key(&g_occ_fns, k, 0, 0);
        forget_first_key(&g_occ, k);
        forget_first_key(&g_occ_smem, k);
        forget_first_key(&g_occ_potential, k);
    }
}

/* Pointer attributes of plain allocations (cuMemAlloc*; not VMM ranges or graph memory, whose
 * mappings change): fixed from the allocation until its free, except SYNC_MEMOPS, which only
 * cuPointerSetAttribute changes (it forgets them all). The bytes the application got are kept,
 * with their count; the device pointer as its distance from the queried pointer. Attributes
 * whose answer depends on more than the allocation (host pointer, P2P tokens, access flags,
 * mappings) always travel. */
static table g_pattr;
static int pattr_cacheable(int attr) {
    switch (attr) {
    case 1: case 2: case 3: case 6: case 7: case 8: case 9: case 10: case 11: case 12: case 13: case 14: case 15:
    case 17: case 20:
        return 1;
    default:
        return 0;
    }
}
int rgpu_pattr_get(uint64_t base, uint64_t ptr, int attr, void *data) {
    uint64_t v, n;
    if (!pattr_cacheable(attr) || !get(&g_pattr, base, (uint64_t)attr, 0, &v) || !get(&g_pattr, base, (uint64_t)attr, 1, &n))
        return 0;
    if (attr == 3) v += ptr;
    if (data) memcpy(data, &v, (size_t)n);
    return 1;
}
void rgpu_pattr_put(uint64_t base, uint64_t ptr, int attr, const void *data, uint32_t n) {
    uint64_t v = 0;
    if (!pattr_cacheable(attr) || n > 8 || !data) return;
    memcpy(&v, data, n);
    if (attr == 3) v -= ptr;
    put(&g_pattr, base, (uint64_t)attr, 1, n);
    put(&g_pattr, base, (uint64_t)attr, 0, v);
}
void rgpu_pattr_forget(uint64_t base) {
    if (__atomic_load_n(&g_pattr.count, __ATOMIC_RELAXED)) forget_first_key(&g_pattr, base);
}
void rgpu_pattr_forget_all(void) { clear(&g_pattr); }

/* Synchronisations that finished (cuda_events.c): per (stream, slice) or context, the event
 * clock at which the latest began. Only ever raised. */
static table g_synced;
uint64_t rgpu_synced_get(uint64_t k1, uint64_t k2) {
    uint64_t v;
    return get(&g_synced, k1, k2, 0, &v) ? v : 0;
}
void rgpu_synced_put(uint64_t k1, uint64_t k2, uint64_t seq) {
    uint64_t v;
    if (!get(&g_synced, k1, k2, 0, &v) || v < seq) put(&g_synced, k1, k2, 0, seq);
}

/* Context queries (cuCtxGetApiVersion, GetId, GetFlags, GetCacheConfig, GetSharedMemConfig,
 * GetStreamPriorityRange): per client context (NULL: the current one), changed only by this
 * process's own set calls, which empty the table, as a context's end does. */
static table g_ctxq;
int rgpu_ctx_query_get(CUcontext ctx, int what, uint64_t *out) {
    rgpu_ctx *x = ctx ? rgpu_ctx_lookup(ctx) : rgpu_ctx_current();
    if (!x || x->destroyed) return 0;
    return get(&g_ctxq, (uint64_t)(uintptr_t)x, (uint64_t)what, 0, out);
}
void rgpu_ctx_query_put(CUcontext ctx, int what, uint64_t value) {
    rgpu_ctx *x = ctx ? rgpu_ctx_lookup(ctx) : rgpu_ctx_current();
    if (x && !x->destroyed) put(&g_ctxq, (uint64_t)(uintptr_t)x, (uint64_t)what, 0, value);
}
void rgpu_ctx_query_forget(void) { clear(&g_ctxq); }

/* Stream queries (cuStreamGetFlags, GetPriority, GetCtx, GetDevice, GetId): fixed for a stream's
 * life. Keyed by (stream, slice, query); the special streams (NULL, legacy, per-thread) are never
 * cached (their answers follow the current context). Forgotten when the stream is destroyed, and
 * with the function caches when a context goes. */
int rgpu_stream_query_get(CUstream s, int what, uint64_t *out) {
    rgpu_ctx *cur = rgpu_ctx_current();
    if ((uintptr_t)s <= 2 || !cur) return 0;
    return get(&g_stream, (uint64_t)(uintptr_t)s, (uint64_t)cur->session, (uint64_t)what, out);
}
void rgpu_stream_query_put(CUstream s, int what, uint64_t value) {
    rgpu_ctx *cur = rgpu_ctx_current();
    if ((uintptr_t)s <= 2 || !cur) return;
    put(&g_stream, (uint64_t)(uintptr_t)s, (uint64_t)cur->session, (uint64_t)what, value);
}
void rgpu_stream_forget(CUstream s) { forget_first_key(&g_stream, (uint64_t)(uintptr_t)s); }
static void forget_streams(void) { clear(&g_stream); }

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
