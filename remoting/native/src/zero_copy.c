/* Page-locked host memory that a GPU kernel uses directly (zero-copy), with the GPU across the network.
 *
 * With unified addressing, memory from cuMemHostAlloc/cuMemAllocHost is also the GPU's, at the same
 * address: a kernel may read and write it, and cuMemset* may fill it. XLA's autotuner does both (it
 * zeroes a page-locked word, and its redzone kernel counts mismatches into it); so do NVIDIA's
 * zero-copy samples. Here the GPU is on another machine, so each such allocation is placed where the
 * worker can put device memory at the very same address:
 *   - at allocation, the worker reserves a range of its GPU's address space (cuMemAddressReserve:
 *     an address, no memory), and this process maps the allocation's pages at that address;
 *   - the first time the GPU is handed the allocation (a launch argument, a memset's target, a
 *     device pointer asked of it), the worker backs the range with device memory (cuMemCreate,
 *     cuMemMap, cuMemSetAccess) and the allocation becomes managed memory (managed.c): its bytes
 *     go to the GPU before the GPU's next work and come back at the next synchronisation.
 * An allocation the GPU never touches directly (the staging buffers of copies, nearly all of them)
 * costs one round trip when it is made and one when it is freed, and no device memory. With
 * RGPU_ZERO_COPY=0, or where the worker's address is taken in this process, the allocation is plain
 * memory, and a kernel or memset handed it is refused with one line.
 * On the worker's own host the pages are a memfd's the worker maps too (shared_pinned.c): copies
 * from and to the allocation then carry no bytes, the worker reads and writes them in place. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

typedef struct zc_alloc {
    uint64_t base;        /* the program's address, the worker's reserved range too */
    size_t size;          /* bytes asked for */
    size_t mapped;        /* host bytes mapped (whole pages) */
    size_t reserved;      /* the worker's range (whole granules); 0: shared pages at an address of ours */
    unsigned int flags;   /* cuMemHostAlloc's */
    int device;           /* the slice whose worker holds the range */
    int promoted;         /* 1: device memory is mapped there and managed.c moves the bytes */
    CUmemGenericAllocationHandle handle;
    uint64_t region;      /* the worker's id of these pages, shared with it (shared_pinned.c); 0: not shared */
    int memfd;            /* their memfd while shared (kept for a forked child's private mapping); -1 */
} zc_alloc;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
/* cuda.h's values (rgpu_cuda.h carries the layouts only). */
enum { MEM_ALLOCATION_TYPE_PINNED = 1, MEM_LOCATION_TYPE_DEVICE = 1, MEM_ALLOC_GRANULARITY_MINIMUM = 0,
       MEM_ACCESS_FLAGS_PROT_READWRITE = 3 };

static zc_alloc *g_allocs;
static size_t g_count, g_cap;

/* On unless RGPU_ZERO_COPY=0: verified on an H200 for a kernel and memsets writing page-locked memory
 * the host reads after synchronising, and with JAX, whose jit'ed training steps need it (XLA's
 * autotuner) and whose losses then equal a local run's (2026-11-28). Applications that never hand
 * page-locked memory to the GPU pay one round trip per allocation and per free. */
static int enabled(void) {
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("RGPU_ZERO_COPY");
        on = !(v && (!strcmp(v, "0") || !strcmp(v, "off") || !strcmp(v, "no")));
    }
    return on;
}

static size_t round_up(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }

static CUmemAllocationProp device_prop(int device) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    return prop;
}

/* The worker's mapping granule for `device`, asked once (0: unknown, zero-copy off). */
static size_t granule(int device) {
    static size_t cached[RGPU_MAX_SESSIONS];
    if (device < 0 || device >= RGPU_MAX_SESSIONS) return 0;
    if (!cached[device]) {
        CUmemAllocationProp prop = device_prop(device);
        size_t g = 0;
        if (cuMemGetAllocationGranularity(&g, &prop, MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || !g ||
            (g & (g - 1)))
            return 0;
        cached[device] = g;
    }
    return cached[device];
}

static zc_alloc *find_locked(uint64_t p) {
    for (size_t i = 0; i < g_count; i++)
        if (p >= g_allocs[i].base && p < g_allocs[i].base + g_allocs[i].size) return &g_allocs[i];
    return NULL;
}

/* Where the worker's driver reserves ranges of 32 MiB and more when not asked: low addresses
 * (0x302000000 on an H200, 2026-11-28), whose 64-bit value a kernel's parameters hold as two small
 * 32-bit integers side by side (a 3 beside an element count of 51 million): a cuDNN kernel's
 * parameters matched one of PyTorch's 64 MiB pinned loader blocks, which was then backed on the
 * GPU and moved whole at every step (0.38x local). Asked for here instead (the driver takes the
 * hint for large ranges; it puts small ones high by itself): addresses whose upper half, 0x5a5b,
 * is a denormal as a float or double and an unlikely neighbour as an integer. */
#define ZC_HINT_BASE 0x5a5b00000000ull
static uint64_t g_next_hint = ZC_HINT_BASE;

/* The worker's address for an allocation of `bytesize`, mapped here (shared with the worker where it
 * can be, shared_pinned.c): the host address, or NULL (*reserved 0) where it cannot be placed so. */
static void *place(int device, size_t bytesize, size_t mapped, size_t *reserved, uint64_t *region, int *memfd) {
    size_t g = granule(device);
    *reserved = 0;
    if (!enabled() || !g || bytesize > SIZE_MAX - g) return NULL;
    size_t want = round_up(bytesize, g);
    CUdeviceptr at = 0;
    uint64_t hint = __atomic_fetch_add(&g_next_hint, want + g, __ATOMIC_RELAXED);
    if (cuMemAddressReserve(&at, want, g, hint, 0) != CUDA_SUCCESS || !at) return NULL;
    void *host = rgpu_shared_pinned_map(device, (void *)(uintptr_t)at, mapped, region, memfd);
    if (!host)
        host = mmap((void *)(uintptr_t)at, mapped, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (host != (void *)(uintptr_t)at) {
        if (host != MAP_FAILED) munmap(host, mapped);
        cuMemAddressFree(at, want);
        static int seen;
        if (!__atomic_exchange_n(&seen, 1, __ATOMIC_RELAXED))
            rgpu_log(RGPU_LOG_DEBUG, "page-locked memory: the GPU's address 0x%llx is in use in this process; "
                     "this allocation is plain memory, which a kernel cannot be handed", (unsigned long long)at);
        return NULL;
    }
    *reserved = want;
    return host;
}

/* An allocation at an address the worker reserved; else, on the worker's host, pages shared with it
 * at any address (which a kernel cannot be handed, as plain memory); else NULL (the caller makes
 * plain memory). */
void *rgpu_zero_copy_alloc(size_t bytesize, unsigned int flags) {
    rgpu_ctx *cur = rgpu_ctx_current();
    if (!cur) return NULL;
    int device = cur->session;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (bytesize > SIZE_MAX - page) return NULL;
    size_t mapped = round_up(bytesize, page), reserved = 0;
    uint64_t region = 0;
    int memfd = -1;
    void *host = place(device, bytesize, mapped, &reserved, &region, &memfd);
    if (!host) host = rgpu_shared_pinned_map(device, NULL, mapped, &region, &memfd);
    if (!host) return NULL;
    pthread_mutex_lock(&g_lock);
    if (g_count == g_cap) {
        size_t cap = g_cap ? g_cap * 2 : 16;
        zc_alloc *grown = realloc(g_allocs, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&g_lock);
            if (region) {
                rgpu_shared_pinned_unshare(device, region);
                close(memfd);
            }
            munmap(host, mapped);
            if (reserved) cuMemAddressFree((CUdeviceptr)(uintptr_t)host, reserved);
            return NULL;
        }
        g_allocs = grown;
        g_cap = cap;
    }
    g_allocs[g_count++] = (zc_alloc){(uint64_t)(uintptr_t)host, bytesize, mapped, reserved, flags, device, 0, 0,
                                     region, memfd};
    pthread_mutex_unlock(&g_lock);
    return host;
}

/* cuMemFreeHost of a zero-copy allocation: 0 when p is not one (*result untouched). */
int rgpu_zero_copy_free(void *p, CUresult *result) {
    pthread_mutex_lock(&g_lock);
    zc_alloc *z = find_locked((uint64_t)(uintptr_t)p);
    if (!z || z->base != (uint64_t)(uintptr_t)p) {
        pthread_mutex_unlock(&g_lock);
        return 0;
    }
    zc_alloc gone = *z;
    *z = g_allocs[--g_count];
    pthread_mutex_unlock(&g_lock);
    CUresult r = CUDA_SUCCESS;
    if (gone.region) {   /* the worker lets go of the pages first */
        r = rgpu_shared_pinned_unshare(gone.device, gone.region);
        close(gone.memfd);
    }
    if (gone.promoted) {
        rgpu_managed_forget(gone.base);
        CUresult unmapped = cuMemUnmap(gone.base, gone.reserved);
        if (r == CUDA_SUCCESS) r = unmapped;
        CUresult released = cuMemRelease(gone.handle);
        if (r == CUDA_SUCCESS) r = released;
    } else {
        int owned = 0;
        rgpu_host_range_remove(p, &owned, NULL);
    }
    if (gone.reserved) {
        CUresult freed = cuMemAddressFree(gone.base, gone.reserved);
        if (r == CUDA_SUCCESS) r = freed;
    }
    munmap(p, gone.mapped);
    *result = r;
    return 1;
}

/* Whether [p, p+n) lies in one allocation shared with `session`'s worker and not backed on the GPU
 * (managed.c moves those): its region and the offset of p in it. */
int rgpu_zero_copy_shared(const void *p, size_t n, int session, uint64_t *region, uint64_t *offset) {
    if (!__atomic_load_n(&g_count, __ATOMIC_ACQUIRE) || n < rgpu_shared_min_bytes()) return 0;
    uint64_t at = (uint64_t)(uintptr_t)p;
    pthread_mutex_lock(&g_lock);
    zc_alloc *z = find_locked(at);
    int ok = z && z->region && !z->promoted && z->device == session && n <= z->base + z->mapped - at;
    if (ok) {
        *region = z->region;
        *offset = at - z->base;
    }
    pthread_mutex_unlock(&g_lock);
    return ok;
}

/* After fork() the child's sessions are gone: shared pages become its own (shared_pinned.c). */
void rgpu_zero_copy_reset_after_fork(void) {
    pthread_mutex_init(&g_lock, NULL);
    for (size_t i = 0; i < g_count; i++) {
        zc_alloc *z = &g_allocs[i];
        if (!z->region) continue;
        rgpu_shared_pinned_privatize((void *)(uintptr_t)z->base, z->mapped, z->memfd);
        z->region = 0;
        z->memfd = -1;
    }
    rgpu_shared_pinned_reset_after_fork();
}

/* 1: p is in an allocation of this table (*flags: its cuMemHostAlloc flags); 2: one at an address
 * of the worker's, which a kernel may be handed. */
int rgpu_zero_copy_flags(const void *p, unsigned int *flags) {
    pthread_mutex_lock(&g_lock);
    zc_alloc *z = find_locked((uint64_t)(uintptr_t)p);
    if (z) *flags = z->flags;
    int found = z ? (z->reserved ? 2 : 1) : 0;
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* 1 when ptr lies in an allocation placed at an address the worker reserved but not yet backed there:
 * the range is in this process's table of device ranges (cuMemAddressReserve put it there), yet a
 * copy naming it must copy this process's bytes; on the worker it is an address with no memory. */
static int unbacked(uint64_t ptr) {
    if (!__atomic_load_n(&g_count, __ATOMIC_ACQUIRE)) return 0;
    pthread_mutex_lock(&g_lock);
    zc_alloc *z = find_locked(ptr);
    int found = z && z->reserved && !z->promoted;
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* The slice whose device memory holds a unified (or host-typed) address of a copy, -1 for this
 * process's memory, page-locked memory the GPU was never handed included. */
int rgpu_copy_device_session(uint64_t ptr) {
    int s = -1;
    return rgpu_dev_range_find(ptr, &s, NULL, NULL) && !unbacked(ptr) ? s : -1;
}

/* Backs the zero-copy allocation holding ptr with device memory at its own address, once.
 * *found: 0 when ptr is in no zero-copy allocation (nothing done). */
CUresult rgpu_zero_copy_promote(uint64_t ptr, int *found, const char *why) {
    *found = 0;
    if (!__atomic_load_n(&g_count, __ATOMIC_ACQUIRE)) return CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    zc_alloc *z = find_locked(ptr);
    if (!z || !z->reserved) {   /* not at an address of the worker's: plain memory to a kernel */
        pthread_mutex_unlock(&g_lock);
        return CUDA_SUCCESS;
    }
    *found = 1;
    if (z->promoted) {
        pthread_mutex_unlock(&g_lock);
        rgpu_managed_hand_numbered(ptr);   /* its bytes go with the launch or memset being handed it */
        return CUDA_SUCCESS;
    }
    zc_alloc a = *z;
    /* Held across the calls: two threads must not map one range twice (promotions are rare). */
    CUmemAllocationProp prop = device_prop(a.device);
    CUmemGenericAllocationHandle handle = 0;
    CUresult r = cuMemCreate(&handle, a.reserved, &prop, 0);
    if (r == CUDA_SUCCESS) {
        r = cuMemMap(a.base, a.reserved, 0, handle, 0);
        if (r != CUDA_SUCCESS) cuMemRelease(handle);
    }
    if (r == CUDA_SUCCESS) {
        CUmemAccessDesc access;
        memset(&access, 0, sizeof access);
        access.location = prop.location;
        access.flags = MEM_ACCESS_FLAGS_PROT_READWRITE;
        r = cuMemSetAccess(a.base, a.reserved, &access, 1);
        if (r != CUDA_SUCCESS) {
            cuMemUnmap(a.base, a.reserved);
            cuMemRelease(handle);
        }
    }
    if (r == CUDA_SUCCESS && !rgpu_managed_adopt(a.base, a.size, a.mapped)) {
        cuMemUnmap(a.base, a.reserved);
        cuMemRelease(handle);
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r == CUDA_SUCCESS) {
        z->promoted = 1;
        z->handle = handle;
        int owned = 0;
        rgpu_host_range_remove((void *)(uintptr_t)a.base, &owned, NULL);   /* managed.c routes it now */
    }
    pthread_mutex_unlock(&g_lock);
    if (r == CUDA_SUCCESS)
        rgpu_log(RGPU_LOG_INFO, "page-locked memory at 0x%llx (%zu bytes) is now backed on the GPU (%s): its bytes "
                 "move at launches and synchronisations", (unsigned long long)a.base, a.size, why);
    if (r != CUDA_SUCCESS)
        rgpu_log(RGPU_LOG_ERROR, "page-locked memory at 0x%llx (%zu bytes) could not be given to the "
                 "GPU (CUDA error %d: the slice's memory holds its copy there)", (unsigned long long)a.base, a.size,
                 (int)r);
    return r;
}

/* A call that hands the GPU `ptr` as device memory (a memset's target): a zero-copy allocation is
 * backed first. Anything else goes as it is (a device pointer, or page-locked memory the worker's
 * driver will refuse: its error names the memset at the next synchronising call). Page-locked
 * memory is not refused here by its address alone: a device pointer of the worker may have the
 * value of an address of this process. */
CUresult rgpu_zero_copy_target(CUdeviceptr ptr) {
    int found = 0;
    return rgpu_zero_copy_promote(ptr, &found, "a memset's target");
}
