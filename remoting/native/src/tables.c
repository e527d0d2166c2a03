/* Client-side tables: device allocations, page-locked host ranges, kernel parameter layouts.
 * Small sorted arrays and an open hash, each under one mutex: these are consulted per copy or
 * per launch, far less often than the network is. */
#include <stdlib.h>
#include <string.h>

#include "rgpu_client.h"

typedef struct range { uint64_t base, size; int session; unsigned int flags; int owned; } range;
typedef struct range_table { range *items; size_t n, cap; } range_table;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static range_table g_dev, g_host;

static size_t lower_bound(const range_table *t, uint64_t base) {
    size_t lo = 0, hi = t->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (t->items[mid].base < base) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static void table_add(range_table *t, range r) {
    size_t i = lower_bound(t, r.base);
    if (i < t->n && t->items[i].base == r.base) {
        t->items[i] = r;
        return;
    }
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 256;
        range *ni = realloc(t->items, cap * sizeof(range));
        if (!ni) return;
        t->items = ni;
        t->cap = cap;
    }
    memmove(&t->items[i + 1], &t->items[i], (t->n - i) * sizeof(range));
    t->items[i] = r;
    t->n++;
}

static int table_remove(range_table *t, uint64_t base, range *out) {
    size_t i = lower_bound(t, base);
    if (i >= t->n || t->items[i].base != base) return 0;
    if (out) *out = t->items[i];
    memmove(&t->items[i], &t->items[i + 1], (t->n - i - 1) * sizeof(range));
    t->n--;
    return 1;
}

static const range *table_find(const range_table *t, uint64_t ptr) {
    size_t i = lower_bound(t, ptr + 1);
    if (i == 0) return NULL;
    const range *r = &t->items[i - 1];
    return (ptr >= r->base && ptr < r->base + (r->size ? r->size : 1)) ? r : NULL;
}

/* flags of a device range: an allocation made by cuMemAlloc* (its pointer attributes are fixed
 * for its life and may be kept in the client: cuda_cache.c) */
#define DEV_PLAIN_ALLOCATION 1u

void rgpu_dev_range_add(int session, uint64_t base, uint64_t size) {
    rgpu_pattr_forget(base);
    pthread_mutex_lock(&g_lock);
    table_add(&g_dev, (range){base, size, session, 0, 0});
    pthread_mutex_unlock(&g_lock);
}

void rgpu_dev_alloc_add(int session, uint64_t base, uint64_t size) {
    rgpu_pattr_forget(base);
    pthread_mutex_lock(&g_lock);
    table_add(&g_dev, (range){base, size, session, DEV_PLAIN_ALLOCATION, 0});
    pthread_mutex_unlock(&g_lock);
}

void rgpu_dev_range_remove(int session, uint64_t base) {
    (void)session;
    pthread_mutex_lock(&g_lock);
    table_remove(&g_dev, base, NULL);
    pthread_mutex_unlock(&g_lock);
    rgpu_pattr_forget(base);
}

int rgpu_dev_alloc_find(uint64_t ptr, uint64_t *base) {
    pthread_mutex_lock(&g_lock);
    const range *r = table_find(&g_dev, ptr);
    int plain = r && (r->flags & DEV_PLAIN_ALLOCATION);
    if (plain) *base = r->base;
    pthread_mutex_unlock(&g_lock);
    return plain;
}

int rgpu_dev_range_find(uint64_t ptr, int *session, uint64_t *base, uint64_t *size) {
    pthread_mutex_lock(&g_lock);
    const range *r = table_find(&g_dev, ptr);
    if (r) {
        if (session) *session = r->session;
        if (base) *base = r->base;
        if (size) *size = r->size;
    }
    pthread_mutex_unlock(&g_lock);
    return r != NULL;
}

/* The span every page-locked range ever lay in: a launch's arguments are checked against the
 * ranges only where a word falls inside it (two comparisons per word otherwise). */
static uint64_t g_host_lo = UINT64_MAX, g_host_hi;

void rgpu_host_range_add(void *base, size_t size, unsigned int flags, int owned) {
    pthread_mutex_lock(&g_lock);
    table_add(&g_host, (range){(uint64_t)(uintptr_t)base, size, -1, flags, owned});
    uint64_t lo = (uint64_t)(uintptr_t)base, hi = lo + size;
    if (lo < __atomic_load_n(&g_host_lo, __ATOMIC_RELAXED)) __atomic_store_n(&g_host_lo, lo, __ATOMIC_RELEASE);
    if (hi > __atomic_load_n(&g_host_hi, __ATOMIC_RELAXED)) __atomic_store_n(&g_host_hi, hi, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_lock);
}

long rgpu_args_host_pointer(const void *args, size_t n, uint64_t *value) {
    uint64_t lo = __atomic_load_n(&g_host_lo, __ATOMIC_ACQUIRE), hi = __atomic_load_n(&g_host_hi, __ATOMIC_ACQUIRE);
    if (lo >= hi) return -1;
    for (size_t off = 0; off + 8 <= n; off += 8) {
        uint64_t v;
        memcpy(&v, (const uint8_t *)args + off, 8);
        if (v < lo || v >= hi || !rgpu_host_range_find((const void *)(uintptr_t)v, NULL, NULL, NULL)) continue;
        *value = v;
        return (long)off;
    }
    return -1;
}

int rgpu_host_range_remove(void *base, int *owned, size_t *size) {
    range r;
    pthread_mutex_lock(&g_lock);
    int ok = table_remove(&g_host, (uint64_t)(uintptr_t)base, &r);
    pthread_mutex_unlock(&g_lock);
    if (ok) {
        if (owned) *owned = r.owned;
        if (size) *size = (size_t)r.size;
    }
    return ok;
}

int rgpu_host_range_find(const void *ptr, void **base, size_t *size, unsigned int *flags) {
    pthread_mutex_lock(&g_lock);
    const range *r = table_find(&g_host, (uint64_t)(uintptr_t)ptr);
    if (r) {
        if (base) *base = (void *)(uintptr_t)r->base;
        if (size) *size = (size_t)r->size;
        if (flags) *flags = r->flags;
    }
    pthread_mutex_unlock(&g_lock);
    return r != NULL;
}

/* ------------------------------------------------------------------ parameter layouts
 * Records are allocated once and never freed, and their arrays are replaced rather than
 * rewritten, so a launch may keep using a record it looked up without holding the lock. */

static rgpu_fn **g_fns;
static size_t g_fcap, g_fn;

static size_t fn_hash(int session, uint64_t handle, size_t cap) {
    uint64_t h = handle * 0x9E3779B97F4A7C15ull ^ (uint64_t)session * 0xC2B2AE3D27D4EB4Full;
    return (size_t)(h >> 17) & (cap - 1);
}

static rgpu_fn **fn_slot(int session, uint64_t handle) {
    if (!g_fcap) return NULL;
    for (size_t i = fn_hash(session, handle, g_fcap);; i = (i + 1) & (g_fcap - 1)) {
        rgpu_fn **e = &g_fns[i];
        if (!*e) return e;
        if ((*e)->session == session && (*e)->handle == handle) return e;
    }
}

static int fn_grow(void) {
    size_t cap = g_fcap ? g_fcap * 2 : 1024;
    rgpu_fn **old = g_fns;
    size_t oldcap = g_fcap;
    rgpu_fn **nf = calloc(cap, sizeof(rgpu_fn *));
    if (!nf) return -1;
    g_fns = nf;
    g_fcap = cap;
    for (size_t i = 0; i < oldcap; i++)
        if (old[i]) *fn_slot(old[i]->session, old[i]->handle) = old[i];
    free(old);
    return 0;
}

rgpu_fn *rgpu_fn_find(int session, uint64_t handle) {
    pthread_mutex_lock(&g_lock);
    rgpu_fn **e = fn_slot(session, handle);
    rgpu_fn *fn = (e && *e && (*e)->valid) ? *e : NULL;
    pthread_mutex_unlock(&g_lock);
    return fn;
}

rgpu_fn *rgpu_fn_add(int session, uint64_t handle, const char *name, uint32_t nparams,
                     const uint32_t *offsets, const uint32_t *sizes) {
    uint32_t *o = calloc(nparams ? nparams : 1, sizeof(uint32_t));
    uint32_t *sz = calloc(nparams ? nparams : 1, sizeof(uint32_t));
    char *nm = strdup(name ? name : "");
    if (!o || !sz || !nm) {
        free(o);
        free(sz);
        free(nm);
        return NULL;
    }
    uint32_t argsize = 0;
    for (uint32_t i = 0; i < nparams; i++) {
        o[i] = offsets[i];
        sz[i] = sizes[i];
        if (o[i] + sz[i] > argsize) argsize = o[i] + sz[i];
    }
    pthread_mutex_lock(&g_lock);
    if ((g_fn + 1) * 2 > g_fcap && fn_grow()) {
        pthread_mutex_unlock(&g_lock);
        return NULL;
    }
    rgpu_fn **e = fn_slot(session, handle);
    if (!*e) {
        *e = calloc(1, sizeof(rgpu_fn));
        if (!*e) {
            pthread_mutex_unlock(&g_lock);
            return NULL;
        }
        (*e)->session = session;
        (*e)->handle = handle;
        g_fn++;
    }
    rgpu_fn *fn = *e;
    fn->name = nm;
    fn->offsets = o;
    fn->sizes = sz;
    fn->argsize = argsize;
    fn->nparams = nparams;
    fn->module = 0;
    fn->valid = 1;
    fn->looked_up = 0;
    pthread_mutex_unlock(&g_lock);
    return fn;
}

rgpu_fn *rgpu_fn_find_name(int session, uint64_t module, const char *name) {
    rgpu_fn *found = NULL;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_fcap; i++) {
        rgpu_fn *f = g_fns[i];
        if (f && f->valid && f->looked_up && f->session == session && f->module == module && !strcmp(f->name, name)) {
            found = f;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

void rgpu_fn_set_module(rgpu_fn *fn, uint64_t module) {
    pthread_mutex_lock(&g_lock);
    fn->module = module;
    pthread_mutex_unlock(&g_lock);
}

void rgpu_fn_set_looked_up(rgpu_fn *fn) {
    pthread_mutex_lock(&g_lock);
    fn->looked_up = 1;
    pthread_mutex_unlock(&g_lock);
}

size_t rgpu_fn_list_module(int session, uint64_t module, rgpu_fn **out, size_t cap) {
    size_t n = 0;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_fcap; i++) {
        rgpu_fn *f = g_fns[i];
        if (f && f->valid && f->session == session && f->module == module) {
            if (n < cap) out[n] = f;
            n++;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return n;
}

void rgpu_fn_forget_module(int session, uint64_t module) {
    /* The worker may reuse these handle values for another module's functions: the next
     * launch through one of them fetches its layout again. */
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_fcap; i++) {
        rgpu_fn *f = g_fns[i];
        if (f && f->session == session && f->module == module) f->valid = 0;
    }
    pthread_mutex_unlock(&g_lock);
}

void rgpu_tables_reset(void) {
    pthread_mutex_init(&g_lock, NULL);
    g_dev.n = 0;
    g_host.n = 0;
    g_fns = NULL; /* the parent's records stay allocated in the child: harmless */
    g_fcap = g_fn = 0;
}
