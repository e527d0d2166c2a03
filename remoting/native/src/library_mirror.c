/* Libraries on every slice.
 *
 * In CUDA a CUlibrary and its CUkernels are context-independent: one handle serves every device
 * (the runtime loads each fatbin once, as a library, and launches its kernels on whichever device
 * is current). Through rgpu each device is a slice served by its own worker, which knows only what
 * was loaded there. So with several slices a library is loaded on every slice when the application
 * loads it; the application keeps the handles of the slice it loaded it on (its origin), and each
 * handle is translated on its way to another slice (rgpu_handle_in) and back (rgpu_handle_out).
 * Kernels are matched by name between the loads. With one slice nothing here runs.
 *
 * A slice with no context yet gets the library when its first context appears (the runtime loads
 * every fatbin at start-up, before the application ever picks device 1).
 *
 * Cost: each library's image crosses the wire once per slice (lazy loading on the worker keeps the
 * GPU side cheap). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

/* (handle, slice) -> handle: IN maps the application's value to a slice's, OUT maps a slice's
 * value back. Open addressing, grown by doubling; never emptied (an entry lost would misroute). */
enum { IN = 0, OUT = 1 };

typedef struct {
    uint64_t handle, value;
    uint32_t key2; /* slice | direction << 16, + 1 (0: empty) */
} slot;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static slot *g_slots;
static size_t g_size, g_count;

static size_t slot_of(uint64_t handle, uint32_t key2, size_t size) {
    uint64_t h = handle * 0x9E3779B97F4A7C15ull ^ (uint64_t)key2 * 0xBF58476D1CE4E5B9ull;
    return (size_t)((h ^ (h >> 29)) % size);
}

static uint32_t key2_of(int session, int direction) { return ((uint32_t)session | (uint32_t)direction << 16) + 1; }

static int grow(void) {
    size_t size = g_size ? g_size * 2 : 4096;
    slot *s = calloc(size, sizeof *s);
    if (!s) return -1;
    for (size_t i = 0; i < g_size; i++) {
        if (!g_slots[i].key2) continue;
        size_t j = slot_of(g_slots[i].handle, g_slots[i].key2, size);
        while (s[j].key2) j = (j + 1) % size;
        s[j] = g_slots[i];
    }
    free(g_slots);
    g_slots = s;
    g_size = size;
    return 0;
}

static void map_put(uint64_t handle, int session, int direction, uint64_t value) {
    uint32_t key2 = key2_of(session, direction);
    pthread_mutex_lock(&g_lock);
    if ((g_count + 1) * 4 > g_size * 3 && grow()) {
        pthread_mutex_unlock(&g_lock);
        rgpu_log(1, "out of memory while recording a library's handles on slice %d", session);
        return;
    }
    size_t i = slot_of(handle, key2, g_size);
    while (g_slots[i].key2 && !(g_slots[i].handle == handle && g_slots[i].key2 == key2)) i = (i + 1) % g_size;
    if (!g_slots[i].key2) g_count++;
    g_slots[i] = (slot){handle, value, key2};
    pthread_mutex_unlock(&g_lock);
}

static int map_get(uint64_t handle, int session, int direction, uint64_t *value) {
    uint32_t key2 = key2_of(session, direction);
    int found = 0;
    pthread_mutex_lock(&g_lock);
    if (g_size) {
        for (size_t i = slot_of(handle, key2, g_size), n = 0; n < g_size && g_slots[i].key2; i = (i + 1) % g_size, n++) {
            if (g_slots[i].handle == handle && g_slots[i].key2 == key2) {
                *value = g_slots[i].value;
                found = 1;
                break;
            }
        }
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* An entry is never removed (a removal would break the probe chains); an unloaded library's maps
 * to 0, so its handles pass through untranslated and the worker answers INVALID_HANDLE. */

uint64_t rgpu_handle_in(int session, uint64_t handle) {
    uint64_t v;
    if (rgpu_session_count < 2 || !handle || !map_get(handle, session, IN, &v) || !v) return handle;
    return v;
}

uint64_t rgpu_handle_out(int session, uint64_t handle) {
    uint64_t v;
    if (rgpu_session_count < 2 || !handle || !map_get(handle, session, OUT, &v) || !v) return handle;
    return v;
}

static void pair(uint64_t app_value, int session, uint64_t slice_value) {
    map_put(app_value, session, IN, slice_value);
    map_put(slice_value, session, OUT, app_value);
}

static int by_name(const void *a, const void *b) {
    return strcmp((*(rgpu_fn *const *)a)->name, (*(rgpu_fn *const *)b)->name);
}

/* The kernels each load reported, matched by name (sorted: a library may hold thousands). */
static void pair_kernels(int origin, uint64_t library, int session, uint64_t mirror) {
    size_t n = rgpu_fn_list_module(origin, library, NULL, 0), m = rgpu_fn_list_module(session, mirror, NULL, 0);
    rgpu_fn **mine = calloc(n ? n : 1, sizeof *mine), **theirs = calloc(m ? m : 1, sizeof *theirs);
    if (!mine || !theirs) {
        free(mine);
        free(theirs);
        rgpu_log(1, "out of memory while matching a library's kernels on device %d", session);
        return;
    }
    n = rgpu_fn_list_module(origin, library, mine, n);
    m = rgpu_fn_list_module(session, mirror, theirs, m);
    qsort(mine, n, sizeof *mine, by_name);
    qsort(theirs, m, sizeof *theirs, by_name);
    for (size_t i = 0, j = 0; i < n && j < m;) {
        int c = strcmp(mine[i]->name, theirs[j]->name);
        if (c == 0) pair(mine[i++]->handle, session, theirs[j++]->handle);
        else if (c < 0) i++;
        else j++;
    }
    free(mine);
    free(theirs);
}

/* Every library loaded while there are several slices, until unloaded: where it is loaded, and its
 * image, kept for a slice whose first context comes later (the runtime loads every fatbin at
 * start-up, before the application picks device 1). An image inside a loaded shared object (the
 * runtime's fatbins) is kept by address; any other is copied. */
#define MAX_LIB_OPTIONS 16

typedef struct {
    int origin, unloaded;
    uint64_t handle;
    const void *image;
    void *owned;
    size_t size;
    unsigned int nopts;
    CUlibraryOption opts[MAX_LIB_OPTIONS];
    void *vals[MAX_LIB_OPTIONS];
    uint64_t mirrored;   /* bit s: tried on slice s (loaded, or the failure logged) */
} lib_rec;

static pthread_mutex_t g_rec_lock = PTHREAD_MUTEX_INITIALIZER;
static lib_rec *g_recs;
static size_t g_nrecs, g_rec_cap;

/* On slice s, with one of its contexts current (the worker loads in the context the call names). */
static void mirror_one(lib_rec *rec, int s) {
    rgpu_ctx *ctx = rgpu_ctx_of_session(s);
    if (!ctx) return;   /* no context there yet: rgpu_library_context_ready loads it later */
    rec->mirrored |= 1ull << s;
    uint64_t mirror = 0;
    CUresult r = cuCtxPushCurrent_v2((CUcontext)ctx);
    if (r == CUDA_SUCCESS) {
        r = rgpu_library_load_on(s, rec->image, rec->size, rec->nopts, rec->opts, rec->vals, &mirror);
        cuCtxPopCurrent_v2(NULL);
    }
    if (r != CUDA_SUCCESS) {
        /* The application goes on; a use of this library on device s fails there, naming the call. */
        rgpu_log(1, "loading a library on device %d failed (CUDA error %d); its kernels will not run "
                    "on that device", s, (int)r);
        return;
    }
    pair(rec->handle, s, mirror);
    pair_kernels(rec->origin, rec->handle, s, mirror);
}

static int in_loaded_object(const void *p) {
    Dl_info info;
    return dladdr(p, &info) != 0 && info.dli_fbase != NULL;
}

void rgpu_library_loaded(int origin, uint64_t library, const void *image, size_t size, unsigned int nopts,
                         CUlibraryOption *opts, void **vals) {
    pthread_mutex_lock(&g_rec_lock);
    if (g_nrecs == g_rec_cap) {
        size_t cap = g_rec_cap ? g_rec_cap * 2 : 256;
        lib_rec *grown = realloc(g_recs, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&g_rec_lock);
            rgpu_log(1, "out of memory while recording a library: it runs on device %d only", origin);
            return;
        }
        g_recs = grown;
        g_rec_cap = cap;
    }
    lib_rec *rec = &g_recs[g_nrecs];
    memset(rec, 0, sizeof *rec);
    rec->origin = origin;
    rec->handle = library;
    rec->size = size;
    rec->image = image;
    if (!in_loaded_object(image)) {
        rec->owned = malloc(size ? size : 1);
        if (!rec->owned) {
            pthread_mutex_unlock(&g_rec_lock);
            rgpu_log(1, "out of memory while recording a library: it runs on device %d only", origin);
            return;
        }
        memcpy(rec->owned, image, size);
        rec->image = rec->owned;
    }
    for (unsigned int i = 0; opts && vals && i < nopts && rec->nopts < MAX_LIB_OPTIONS; i++) {
        rec->opts[rec->nopts] = opts[i];
        rec->vals[rec->nopts++] = vals[i];
    }
    rec->mirrored = 1ull << origin;
    g_nrecs++;
    pair(library, origin, library);
    for (int s = 0; s < rgpu_session_count; s++)
        if (!(rec->mirrored >> s & 1)) mirror_one(rec, s);
    pthread_mutex_unlock(&g_rec_lock);
}

void rgpu_library_context_ready(int session) {
    if (rgpu_session_count < 2 || session < 0 || session >= rgpu_session_count) return;
    pthread_mutex_lock(&g_rec_lock);
    for (size_t i = 0; i < g_nrecs; i++)
        if (!g_recs[i].unloaded && !(g_recs[i].mirrored >> session & 1)) mirror_one(&g_recs[i], session);
    pthread_mutex_unlock(&g_rec_lock);
}

CUresult rgpu_library_unload(uint64_t library) {
    CUresult first = CUDA_SUCCESS;
    int found = 0;
    pthread_mutex_lock(&g_rec_lock);
    for (size_t i = 0; i < g_nrecs; i++) {
        if (g_recs[i].handle != library || g_recs[i].unloaded) continue;
        g_recs[i].unloaded = 1;
        free(g_recs[i].owned);
        g_recs[i].owned = NULL;
    }
    pthread_mutex_unlock(&g_rec_lock);
    for (int s = 0; s < rgpu_session_count; s++) {
        uint64_t there;
        if (!map_get(library, s, IN, &there) || !there) continue;
        found = 1;
        CUresult r = rgpu_library_unload_on(s, there);
        if (r != CUDA_SUCCESS && first == CUDA_SUCCESS) first = r;
        map_put(library, s, IN, 0);
        map_put(there, s, OUT, 0);
    }
    /* Not one recorded here (loaded while there was one slice, or unknown): the current slice's
     * worker answers, as with one slice. */
    return found ? first : rgpu_library_unload_on(-1, library);
}
