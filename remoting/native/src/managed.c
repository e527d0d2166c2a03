/* Managed memory (cuMemAllocManaged), emulated in the client: one address that both the host and
 * the GPU use, without the GPU's page faults reaching across the network.
 *
 * Each managed allocation is device memory on the worker whose pages are also mapped here, in
 * this process, at the same address. rgpu reports CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS
 * as 0, so by CUDA's rules the host touches managed memory only while the GPU is idle, and the
 * two copies are kept coherent at the points where ownership changes hands:
 *   - the host's copy goes to the GPU before the first work the GPU is given after the host may
 *     have written it (a launch, a copy, a memset, a graph launch, a stream memory operation);
 *   - the GPU's copy comes back after every call that tells the program the GPU has finished
 *     (context, stream and event synchronisation and successful queries, blocking copies).
 * Between those points nothing moves, so a loop of "launch, synchronise, read" costs one copy
 * each way per iteration. While the GPU owns an allocation its host pages are inaccessible: a
 * program that breaks the rules (host access while kernels may run) stops with SIGSEGV and one
 * line saying why, as it would on a GPU without concurrent managed access, never with stale data.
 *
 * Each allocation takes its own whole host pages: the device allocation is over-sized by two pages
 * and the address handed out is its first page boundary. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

typedef struct managed_region {
    CUdeviceptr user;    /* the address the program sees, on both sides */
    CUdeviceptr real;    /* the worker's allocation holding it */
    size_t size;         /* bytes asked for */
    size_t mapped;       /* host bytes mapped at user (whole pages) */
    int gpu_owned;       /* 1: the GPU has the current copy; the host pages are inaccessible */
    int pinned;          /* page-locked memory the GPU uses directly (zero_copy.c): no allocation of its own here */
    int handed;          /* pinned: a call since its bytes last came back hands it to the GPU (rgpu_managed_hand) */
    uint8_t *snapshot;   /* pinned: the bytes last sent to the GPU (what the GPU changed differs from them) */
    /* pinned, while the GPU owns it: the work handed it, numbered on the event clock once its frame
     * was queued (cuda_events.c), first and last, and their stream. Unknown (uses_unknown) when work
     * that is not numbered used it (a copy, a graph); use_thread: a launch or memset of that thread
     * will number its use once queued. */
    uint64_t first_use, last_use;
    uint64_t use_stream;
    int uses_streams;             /* 2: more than one stream */
    int uses_unknown;
    const void *use_thread;
} managed_region;

/* What the synchronisation this thread just finished covers (cuda_events.c tells, after its reply):
 * the work queued before `seq` on `stream`, or on every stream of the context. Cleared when a
 * synchronous call begins, so a synchronisation point that was not told finds none. */
enum { COVERS_NONE = 0, COVERS_STREAM = 1, COVERS_CONTEXT = 2 };
typedef struct sync_cover {
    int kind;
    uint64_t stream;
    uint64_t seq;
} sync_cover;
static __thread sync_cover t_cover;
static __thread char t_thread_token;   /* its address tells this thread's pending hands apart */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static managed_region *g_regions;
static size_t g_count, g_cap;
/* Fast paths, read without the lock on every call: both stay 0 without managed memory. */
static int g_any_host_owned, g_any_gpu_owned;
static __thread int t_moving;   /* this thread is copying for coherence: its own calls do not recurse */

static size_t page_size(void) {
    static size_t page;
    if (!page) page = (size_t)sysconf(_SC_PAGESIZE);
    return page;
}

/* The fast-path flags from the regions' owners (the lock is held). */
static void recount_owners_locked(void) {
    int host = 0, gpu = 0;
    for (size_t i = 0; i < g_count; i++) {
        host |= !g_regions[i].gpu_owned && (!g_regions[i].pinned || g_regions[i].handed);
        gpu |= g_regions[i].gpu_owned;
    }
    __atomic_store_n(&g_any_host_owned, host, __ATOMIC_RELEASE);
    __atomic_store_n(&g_any_gpu_owned, gpu, __ATOMIC_RELEASE);
}

/* Page-locked memory stays the host's while the GPU uses it (the program may fill one buffer of a
 * page-locked pool while a kernel writes another: XLA does), so its bytes are merged, not handed
 * over: the host's go to the GPU (and are kept) with work that is handed the memory (a kernel's
 * argument, a memset's target: rgpu_managed_hand), and at the next synchronisation the GPU's copy
 * comes back where it differs from what was sent, that is, where the GPU wrote. Work that is not
 * handed it moves none of its bytes: a pool of page-locked staging buffers (PyTorch's pinned
 * DataLoader: 64 MiB blocks) once promoted by one kernel argument must not cross the network at
 * every launch and synchronisation after it (that made a pinned-loader ResNet-18 run 4.6x slower
 * on an H200, 2026-11-28). A kernel reaching page-locked memory only through a pointer stored in
 * device memory is not seen (nor was it before promotion existed). */
static CUresult pinned_to_gpu(const managed_region *m) {
    memcpy(m->snapshot, (const void *)(uintptr_t)m->user, m->size);
    return cuMemcpyHtoD_v2(m->user, m->snapshot, m->size);
}

/* `stream`: read there (it waits for nothing else); NULL: behind all the GPU's work. */
static CUresult pinned_from_gpu(const managed_region *m, CUstream stream) {
    uint8_t *gpu = malloc(m->size);
    if (!gpu) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = stream ? cuMemcpyDtoHAsync_v2(gpu, m->user, m->size, stream) : cuMemcpyDtoH_v2(gpu, m->user, m->size);
    if (r == CUDA_SUCCESS) {
        uint8_t *host = (uint8_t *)(uintptr_t)m->user;
        for (size_t at = 0; at < m->size; at += 64) {
            size_t k = m->size - at < 64 ? m->size - at : 64;
            if (!memcmp(gpu + at, m->snapshot + at, k)) continue;   /* the GPU left these alone */
            for (size_t i = at; i < at + k; i++)
                if (gpu[i] != m->snapshot[i]) host[i] = gpu[i];
        }
    }
    free(gpu);
    return r;
}

/* How page-locked memory the GPU owns comes back at a synchronisation (`cover`: what it covers).
 * The work that was handed it is finished when its launch was numbered before the point the
 * synchronisation covers, on that stream, on the legacy stream (which waits for the others) or on
 * the whole context: then its bytes are final and are read on a stream of their own, which waits
 * for nothing queued since (a loader's next step must not drain the GPU for a label batch handed
 * last step). Work numbered after that point was queued after it and cannot be what the program
 * waited for: the region stays the GPU's until a synchronisation covers it. Anything else (work
 * that is not numbered, work not yet numbered, another stream) comes back as it always did,
 * behind all the GPU's work. */
enum { BACK_SKIP = 0, BACK_QUIET = 1, BACK_BEHIND_ALL = 2 };
static int is_legacy_stream(uint64_t stream) { return stream == 0 || stream == 1; }   /* NULL, CU_STREAM_LEGACY */

static int how_back(const managed_region *m, const sync_cover *cover) {
    if (!m->pinned || cover->kind == COVERS_NONE || m->uses_unknown || m->use_thread || !m->first_use)
        return BACK_BEHIND_ALL;
    if (m->first_use > cover->seq) return BACK_SKIP;
    if (m->last_use <= cover->seq &&
        (cover->kind == COVERS_CONTEXT || is_legacy_stream(cover->stream) ||
         (m->uses_streams == 1 && cover->stream == m->use_stream)))
        return BACK_QUIET;
    return BACK_BEHIND_ALL;
}

/* Work about to use a region the GPU owns already (lock held): numbered by `numbered`'s thread
 * once queued, or unknown. */
static void used_again_locked(managed_region *m, int numbered) {
    if (numbered) m->use_thread = &t_thread_token;
    else m->uses_unknown = 1;
}

/* A stream of the current context that waits for no other (CU_STREAM_NON_BLOCKING), for reading
 * finished page-locked regions back; NULL where there is none (the legacy path is taken). One for
 * the process, made again when the current context is another or the stream failed. */
static pthread_mutex_t g_quiet_lock = PTHREAD_MUTEX_INITIALIZER;
static CUstream g_quiet_stream;
static CUcontext g_quiet_ctx;

static CUstream quiet_stream(void) {
    CUcontext cur = NULL;
    if (cuCtxGetCurrent(&cur) != CUDA_SUCCESS || !cur) return NULL;
    pthread_mutex_lock(&g_quiet_lock);
    if (!g_quiet_stream || g_quiet_ctx != cur) {
        CUstream made = NULL;
        g_quiet_stream = cuStreamCreate(&made, 1 /* CU_STREAM_NON_BLOCKING */) == CUDA_SUCCESS ? made : NULL;
        g_quiet_ctx = g_quiet_stream ? cur : NULL;
    }
    CUstream stream = g_quiet_stream;
    pthread_mutex_unlock(&g_quiet_lock);
    return stream;
}

static void forget_quiet_stream(void) {
    pthread_mutex_lock(&g_quiet_lock);
    g_quiet_stream = NULL;
    g_quiet_ctx = NULL;
    pthread_mutex_unlock(&g_quiet_lock);
}

/* Hand every region owned by the other side over to `to_gpu`'s side (back to the host: as far as
 * `cover` allows, how_back above). The regions change owner under the lock; the copies (calls
 * themselves) run without it. While the GPU owns a managed region its host pages are inaccessible,
 * so a host access at the wrong time stops the program with a clear line (handler below) instead of
 * reading stale data or losing a write. `numbered`: the work being handed them numbers them once its
 * frame is queued (a launch or memset: rgpu_managed_handed_on). */
static void hand_over(int to_gpu, int every_pinned, const sync_cover *cover, int numbered) {
    pthread_mutex_lock(&g_lock);
    managed_region *moving = g_count ? malloc(g_count * sizeof *moving) : NULL;
    int *quiet = g_count ? calloc(g_count, sizeof *quiet) : NULL;
    size_t n = 0;
    for (size_t i = 0; moving && quiet && i < g_count; i++) {
        if (to_gpu && every_pinned && g_regions[i].gpu_owned && g_regions[i].pinned)
            g_regions[i].uses_unknown = 1;   /* a graph or 2D copy may use it again: read back behind all */
        if (g_regions[i].gpu_owned == to_gpu) continue;
        if (to_gpu && g_regions[i].pinned && !g_regions[i].handed && !every_pinned) continue;   /* not this work's */
        if (!to_gpu) {
            int how = how_back(&g_regions[i], cover);
            if (how == BACK_SKIP) continue;
            quiet[n] = how == BACK_QUIET;
        }
        g_regions[i].handed = 0;
        g_regions[i].first_use = g_regions[i].last_use = g_regions[i].use_stream = 0;
        g_regions[i].uses_streams = 0;
        g_regions[i].uses_unknown = to_gpu && !numbered;
        g_regions[i].use_thread = to_gpu && numbered ? &t_thread_token : NULL;
        if (!to_gpu && !g_regions[i].pinned)
            mprotect((void *)(uintptr_t)g_regions[i].user, g_regions[i].mapped, PROT_READ | PROT_WRITE);
        g_regions[i].gpu_owned = to_gpu;
        moving[n++] = g_regions[i];
    }
    recount_owners_locked();
    pthread_mutex_unlock(&g_lock);
    if (!moving || !quiet) {
        free(moving);
        free(quiet);
        return;
    }
    t_moving = 1;
    for (size_t i = 0; i < n; i++) {
        void *host = (void *)(uintptr_t)moving[i].user;
        CUresult r;
        if (moving[i].pinned && !to_gpu) {
            CUstream stream = quiet[i] ? quiet_stream() : NULL;
            r = pinned_from_gpu(&moving[i], stream);
            if (r != CUDA_SUCCESS && stream) {
                forget_quiet_stream();
                r = pinned_from_gpu(&moving[i], NULL);
            }
        } else if (moving[i].pinned) {
            r = pinned_to_gpu(&moving[i]);
        } else {
            r = to_gpu ? cuMemcpyHtoD_v2(moving[i].user, host, moving[i].size)
                       : cuMemcpyDtoH_v2(host, moving[i].user, moving[i].size);
            if (to_gpu) mprotect(host, moving[i].mapped, PROT_NONE);
        }
        if (r != CUDA_SUCCESS) {
            static int seen;
            if (!__atomic_exchange_n(&seen, 1, __ATOMIC_RELAXED))
                rgpu_log(RGPU_LOG_ERROR, "managed memory at 0x%llx could not be copied %s (CUDA error %d); the host "
                         "and the GPU may now see different data there", (unsigned long long)moving[i].user,
                         to_gpu ? "to the GPU" : "back from the GPU", r);
        }
    }
    t_moving = 0;
    free(moving);
    free(quiet);
}

/* Calls that give the GPU work touching memory: the host's turn ends with the first of them. */
static int gives_work(uint16_t op) {
    switch (op) {
    case RGPU_OP_cuLaunchKernel: case RGPU_OP_cuGraphLaunch:
    case RGPU_OP_cuMemcpyDtoDAsync_v2: case RGPU_OP_cuMemcpyDtoD_v2: case RGPU_OP_cuMemcpyDtoHAsync_v2:
    case RGPU_OP_cuMemcpyHtoDAsync_v2: case RGPU_OP_rgpuMemcpy2DDevice: case RGPU_OP_rgpuCaptureHostCopy:
    case RGPU_OP_rgpuGraphHostRefresh:
    case RGPU_OP_cuMemsetD8_v2: case RGPU_OP_cuMemsetD16_v2: case RGPU_OP_cuMemsetD32_v2:
    case RGPU_OP_cuMemsetD8Async: case RGPU_OP_cuMemsetD16Async: case RGPU_OP_cuMemsetD32Async:
    case RGPU_OP_cuMemsetD2D8_v2: case RGPU_OP_cuMemsetD2D16_v2: case RGPU_OP_cuMemsetD2D32_v2:
    case RGPU_OP_cuMemsetD2D8Async: case RGPU_OP_cuMemsetD2D16Async: case RGPU_OP_cuMemsetD2D32Async:
    case RGPU_OP_cuStreamWriteValue32_v2: case RGPU_OP_cuStreamWriteValue64_v2:
    case RGPU_OP_cuStreamWaitValue32_v2: case RGPU_OP_cuStreamWaitValue64_v2:
        return 1;
    default:
        return 0;
    }
}

/* Work that numbers the page-locked regions it is handed once its frame is queued
 * (rgpu_managed_handed_on): launches (cuda_module.c) and memsets (their generated stubs). */
static int numbered_work(uint16_t op) {
    switch (op) {
    case RGPU_OP_cuLaunchKernel:
    case RGPU_OP_cuMemsetD8_v2: case RGPU_OP_cuMemsetD16_v2: case RGPU_OP_cuMemsetD32_v2:
    case RGPU_OP_cuMemsetD8Async: case RGPU_OP_cuMemsetD16Async: case RGPU_OP_cuMemsetD32Async:
    case RGPU_OP_cuMemsetD2D8_v2: case RGPU_OP_cuMemsetD2D16_v2: case RGPU_OP_cuMemsetD2D32_v2:
    case RGPU_OP_cuMemsetD2D8Async: case RGPU_OP_cuMemsetD2D16Async: case RGPU_OP_cuMemsetD2D32Async:
        return 1;
    default:
        return 0;
    }
}

void rgpu_managed_before_call(uint16_t op) {
    if (t_moving || !gives_work(op)) return;
    /* A graph's kernel nodes were handed their page-locked memory when the graph was built, and
     * 2D/3D copies, captured host copies and stream memory operations name addresses this file does
     * not see: every page-locked region goes with those. */
    int graph = __atomic_load_n(&g_count, __ATOMIC_ACQUIRE) &&
                (op == RGPU_OP_cuGraphLaunch || op == RGPU_OP_rgpuMemcpy2DDevice || op == RGPU_OP_rgpuCaptureHostCopy ||
                 op == RGPU_OP_rgpuGraphHostRefresh || op == RGPU_OP_cuStreamWriteValue32_v2 ||
                 op == RGPU_OP_cuStreamWriteValue64_v2 || op == RGPU_OP_cuStreamWaitValue32_v2 ||
                 op == RGPU_OP_cuStreamWaitValue64_v2);
    if (__builtin_expect(!__atomic_load_n(&g_any_host_owned, __ATOMIC_ACQUIRE), 1) && !graph) return;
    hand_over(1, graph, NULL, numbered_work(op));
}

/* A launch's frame is queued: the page-locked regions it was handed (this thread's, not yet
 * numbered) get the next number of the event clock, and its stream. A synchronisation that began
 * after this covers them. */
void rgpu_managed_handed_on(CUstream stream) {
    if (!__atomic_load_n(&g_any_gpu_owned, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&g_lock);
    uint64_t seq = 0;
    for (size_t i = 0; i < g_count; i++) {
        managed_region *m = &g_regions[i];
        if (m->use_thread != &t_thread_token) continue;
        if (!seq) seq = rgpu_event_clock_tick();
        if (!m->first_use) m->first_use = seq;
        m->last_use = seq;
        if (!m->uses_streams) m->uses_streams = 1;
        else if (m->use_stream != (uint64_t)(uintptr_t)stream) m->uses_streams = 2;
        m->use_stream = (uint64_t)(uintptr_t)stream;
        m->use_thread = NULL;
    }
    pthread_mutex_unlock(&g_lock);
}

void rgpu_managed_sync_begins(void) { t_cover.kind = COVERS_NONE; }

void rgpu_managed_covers(int whole_context, CUstream stream, uint64_t seq) {
    t_cover = (sync_cover){whole_context ? COVERS_CONTEXT : COVERS_STREAM, (uint64_t)(uintptr_t)stream, seq};
}

void rgpu_managed_sync_point(void) {
    sync_cover cover = t_cover;
    t_cover.kind = COVERS_NONE;
    if (__builtin_expect(!__atomic_load_n(&g_any_gpu_owned, __ATOMIC_ACQUIRE), 1) || t_moving) return;
    hand_over(0, 0, &cover, 0);
}

static managed_region *find_locked(CUdeviceptr p) {
    for (size_t i = 0; i < g_count; i++)
        if (p >= g_regions[i].user && p < g_regions[i].user + g_regions[i].size) return &g_regions[i];
    return NULL;
}

/* Appends a region (the lock is held). 0: out of memory. */
static int append_locked(managed_region region) {
    if (g_count == g_cap) {
        size_t cap = g_cap ? g_cap * 2 : 16;
        managed_region *grown = realloc(g_regions, cap * sizeof *grown);
        if (!grown) return 0;
        g_regions = grown;
        g_cap = cap;
    }
    g_regions[g_count] = region;
    __atomic_store_n(&g_count, g_count + 1, __ATOMIC_RELEASE);
    /* The host owns a new region: its bytes go to the GPU with the next work the GPU is given. */
    __atomic_store_n(&g_any_host_owned, 1, __ATOMIC_RELEASE);
    return 1;
}

/* Takes out the region that starts at `user` and is (pinned) or is not (managed) page-locked
 * memory, into *gone. 0: no such region. */
static int take_out(CUdeviceptr user, int pinned, managed_region *gone) {
    pthread_mutex_lock(&g_lock);
    managed_region *m = find_locked(user);
    int found = m && m->user == user && m->pinned == pinned;
    if (found) {
        *gone = *m;
        *m = g_regions[g_count - 1];
        __atomic_store_n(&g_count, g_count - 1, __ATOMIC_RELEASE);
        recount_owners_locked();
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* A host pointer of a copy that is really managed memory (not while this library hands it over):
 * the copy is the GPU's, device to device. Page-locked memory's host bytes are the program's own
 * (pinned_to_gpu above): its copies read and write them, as any page-locked memory's. */
int rgpu_managed_routes(const void *host) {
    if (t_moving || !__atomic_load_n(&g_count, __ATOMIC_ACQUIRE)) return 0;
    pthread_mutex_lock(&g_lock);
    managed_region *m = find_locked((CUdeviceptr)(uintptr_t)host);
    int routes = m && !m->pinned;
    pthread_mutex_unlock(&g_lock);
    return routes;
}

/* Work about to be sent hands the GPU the page-locked region holding p (a copy's side; with
 * `numbered`, a kernel's argument or a memset's target): its bytes go with that work. No-op for
 * other memory. */
static void hand(CUdeviceptr p, int numbered);

void rgpu_managed_hand(CUdeviceptr p) { hand(p, 0); }
void rgpu_managed_hand_numbered(CUdeviceptr p) { hand(p, 1); }

static void hand(CUdeviceptr p, int numbered) {
    if (t_moving || !__atomic_load_n(&g_count, __ATOMIC_ACQUIRE)) return;   /* not this file's own copies */
    pthread_mutex_lock(&g_lock);
    managed_region *m = find_locked(p);
    if (m && m->pinned && !m->gpu_owned) {
        m->handed = 1;
        __atomic_store_n(&g_any_host_owned, 1, __ATOMIC_RELEASE);
    } else if (m && m->pinned) {
        used_again_locked(m, numbered);   /* a copy's use is never numbered: read back behind all */
    }
    pthread_mutex_unlock(&g_lock);
}

/* A launch's packed arguments: every page-locked region backed on the GPU whose address one of its
 * 8-byte words holds goes with the launch (such regions left the host ranges the refusal scan reads
 * when they were backed, so that scan does not see them again). */
void rgpu_managed_hand_args(const void *args, size_t n) {
    if (t_moving || !__atomic_load_n(&g_count, __ATOMIC_ACQUIRE) || n < 8) return;
    pthread_mutex_lock(&g_lock);
    uint64_t lo = UINT64_MAX, hi = 0;
    for (size_t i = 0; i < g_count; i++)
        if (g_regions[i].pinned) {
            if (g_regions[i].user < lo) lo = g_regions[i].user;
            if (g_regions[i].user + g_regions[i].size > hi) hi = g_regions[i].user + g_regions[i].size;
        }
    int any = 0;
    for (size_t off = 0; lo < hi && off + 8 <= n; off += 8) {
        uint64_t v;
        memcpy(&v, (const uint8_t *)args + off, 8);
        if (v < lo || v >= hi) continue;
        managed_region *m = find_locked(v);
        if (m && m->pinned && !m->gpu_owned) m->handed = any = 1;
        else if (m && m->pinned) used_again_locked(m, 1);
    }
    if (any) __atomic_store_n(&g_any_host_owned, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_lock);
}

int rgpu_managed_any(void) { return __atomic_load_n(&g_count, __ATOMIC_ACQUIRE) != 0; }

/* Managed memory of cuMemAllocManaged (not page-locked memory backed on the GPU). An event the
 * client knows complete needs no synchronisation point for page-locked regions: the one that made
 * it known (covering its record) brought back every region used before the record. */
int rgpu_managed_unpinned_any(void) {
    if (!__atomic_load_n(&g_count, __ATOMIC_ACQUIRE)) return 0;
    pthread_mutex_lock(&g_lock);
    int any = 0;
    for (size_t i = 0; i < g_count && !any; i++) any = !g_regions[i].pinned;
    pthread_mutex_unlock(&g_lock);
    return any;
}

int rgpu_managed_find(CUdeviceptr p) {
    if (!__atomic_load_n(&g_count, __ATOMIC_ACQUIRE)) return 0;
    pthread_mutex_lock(&g_lock);
    int found = find_locked(p) != NULL;
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* The cuMemAllocManaged allocation p lies in (its address and size as the program asked): 0 when
 * p is in none (page-locked memory the GPU was handed is not managed memory). */
int rgpu_managed_range(CUdeviceptr p, CUdeviceptr *user, size_t *size) {
    if (!__atomic_load_n(&g_count, __ATOMIC_ACQUIRE)) return 0;
    pthread_mutex_lock(&g_lock);
    const managed_region *r = find_locked(p);
    int found = r && !r->pinned;
    if (found) {
        *user = r->user;
        *size = r->size;
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* A host access to managed memory the GPU owns: say so in one line and die of the signal, as the
 * same program would on a GPU without concurrent managed access. Other faults go to the handler
 * that was there before. (No locks here: the region table is read as it stands.) */
static struct sigaction g_previous;

static void on_segv(int sig, siginfo_t *info, void *uctx) {
    uintptr_t at = (uintptr_t)info->si_addr;
    size_t n = __atomic_load_n(&g_count, __ATOMIC_ACQUIRE);
    for (size_t i = 0; g_regions && i < n; i++) {
        if (!g_regions[i].pinned && at >= g_regions[i].user && at < g_regions[i].user + g_regions[i].mapped) {
            static const char line[] =
                "rgpu: client: the host touched managed memory while the GPU may be using it; rgpu provides managed "
                "memory without concurrent access (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is 0): synchronise "
                "(cudaDeviceSynchronize, cudaStreamSynchronize) before the host reads or writes it\n";
            ssize_t ignored = write(2, line, sizeof line - 1);
            (void)ignored;
            signal(SIGSEGV, SIG_DFL);
            raise(SIGSEGV);
            return;
        }
    }
    if (g_previous.sa_flags & SA_SIGINFO) {
        if (g_previous.sa_sigaction) g_previous.sa_sigaction(sig, info, uctx);
        return;
    }
    if (g_previous.sa_handler == SIG_IGN) return;
    if (g_previous.sa_handler == SIG_DFL || !g_previous.sa_handler) {
        signal(SIGSEGV, SIG_DFL);   /* the access repeats and the default action ends the process */
        return;
    }
    g_previous.sa_handler(sig);
}

static void install_handler(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous);
}

RGPU_EXPORT CUresult CUDAAPI cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    if (!dptr || !bytesize || (flags != 1 && flags != 2)) return CUDA_ERROR_INVALID_VALUE; /* GLOBAL or HOST */
    size_t page = page_size();
    if (bytesize > SIZE_MAX - 2 * page) return CUDA_ERROR_OUT_OF_MEMORY;
    CUdeviceptr real = 0;
    CUresult r = cuMemAlloc_v2(&real, bytesize + 2 * page);
    if (r != CUDA_SUCCESS) return r;
    CUdeviceptr user = (real + page - 1) / page * page;
    size_t mapped = (bytesize + page - 1) / page * page;
    void *host = mmap((void *)(uintptr_t)user, mapped, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (host != (void *)(uintptr_t)user) {
        if (host != MAP_FAILED) munmap(host, mapped);
        cuMemFree_v2(real);
        static int seen;
        if (!__atomic_exchange_n(&seen, 1, __ATOMIC_RELAXED))
            rgpu_log(RGPU_LOG_ERROR, "cuMemAllocManaged: the GPU's address 0x%llx is already in use in this process, "
                     "so rgpu cannot mirror managed memory there (it returns CUDA_ERROR_NOT_SUPPORTED; use "
                     "cudaMalloc and explicit copies)", (unsigned long long)user);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    pthread_mutex_lock(&g_lock);
    int added = append_locked((managed_region){.user = user, .real = real, .size = bytesize, .mapped = mapped});   /* zeros, host-owned */
    pthread_mutex_unlock(&g_lock);
    if (!added) {
        munmap(host, mapped);
        cuMemFree_v2(real);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, install_handler);
    *dptr = user;
    return CUDA_SUCCESS;
}

/* Adds a region whose host pages and worker mapping zero_copy.c made, at the same address: its bytes
 * go to the GPU with the next work the GPU is given, and are merged back at synchronisation (never
 * protected: the host may use the rest of it meanwhile). 0: out of memory. */
int rgpu_managed_adopt(CUdeviceptr user, size_t size, size_t mapped) {
    uint8_t *snapshot = malloc(size ? size : 1);
    if (!snapshot) return 0;
    pthread_mutex_lock(&g_lock);
    int added = append_locked((managed_region){.user = user, .size = size, .mapped = mapped, .pinned = 1, .handed = 1,
                                               .snapshot = snapshot});   /* handed now */
    pthread_mutex_unlock(&g_lock);
    if (!added) free(snapshot);
    return added;
}

/* Takes an adopted region out (its memory is zero_copy.c's to free). 0: no such region. */
int rgpu_managed_forget(CUdeviceptr user) {
    managed_region gone;
    if (!take_out(user, 1, &gone)) return 0;
    free(gone.snapshot);
    return 1;
}

/* cuMemFree of a managed address: the host mirror goes, then the worker's allocation. */
CUresult rgpu_managed_free(CUdeviceptr user) {
    managed_region gone;
    if (!take_out(user, 0, &gone)) return CUDA_ERROR_INVALID_VALUE;
    munmap((void *)(uintptr_t)gone.user, gone.mapped);
    return cuMemFree_v2(gone.real);
}

static CUresult check_range(CUdeviceptr p, size_t count) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&g_lock);
    managed_region *m = find_locked(p);
    int ok = m && count <= m->user + m->size - p;
    pthread_mutex_unlock(&g_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

#define DEVICE_CPU (-1)          /* CU_DEVICE_CPU */
#define LOCATION_DEVICE 1        /* CU_MEM_LOCATION_TYPE_DEVICE; 2-4 are the host and its NUMA nodes */
#define LOCATION_HOST_NUMA_CURRENT 4

/* A processor a prefetch or an advice may name: the host, or one of this process's slices. */
static int valid_processor(CUdevice device) {
    return device == DEVICE_CPU || (device >= 0 && device < rgpu_session_count);
}

static int valid_location(CUmemLocation location) {
    if (location.type == LOCATION_DEVICE) return location.id >= 0 && location.id < rgpu_session_count;
    return location.type > LOCATION_DEVICE && location.type <= LOCATION_HOST_NUMA_CURRENT;
}

/* The driver's checks of an advice: one of CUmem_advise's six, and a processor where it names one
 * (read-mostly ignores it). */
static CUresult check_advice(CUdeviceptr p, size_t count, int advice, int processor_ok) {
    CUresult r = check_range(p, count);
    if (r != CUDA_SUCCESS) return r;
    if (advice < 1 || advice > 6) return CUDA_ERROR_INVALID_VALUE;
    return advice <= 2 || processor_ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

/* Prefetches and advice change where pages live on a real GPU, never what they hold: with the
 * copies above there is nothing to move early, so they are checked as the driver checks them and
 * done. */
RGPU_EXPORT CUresult CUDAAPI cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream) {
    (void)hStream;
    CUresult r = check_range(devPtr, count);
    return r != CUDA_SUCCESS || valid_processor(dstDevice) ? r : CUDA_ERROR_INVALID_DEVICE;
}

RGPU_EXPORT CUresult CUDAAPI cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                                   unsigned int flags, CUstream hStream) {
    (void)flags;
    (void)hStream;
    CUresult r = check_range(devPtr, count);
    return r != CUDA_SUCCESS || valid_location(location) ? r : CUDA_ERROR_INVALID_DEVICE;
}

RGPU_EXPORT CUresult CUDAAPI cuMemAdvise(CUdeviceptr devPtr, size_t count, int advice, CUdevice device) {
    return check_advice(devPtr, count, advice, valid_processor(device));
}

RGPU_EXPORT CUresult CUDAAPI cuMemAdvise_v2(CUdeviceptr devPtr, size_t count, int advice, CUmemLocation location) {
    return check_advice(devPtr, count, advice, valid_location(location));
}

/* Attaching a range to one stream narrows when the host may touch it on a real GPU; here every
 * range follows the whole GPU, which is the stricter rule the program already keeps. */
RGPU_EXPORT CUresult CUDAAPI cuStreamAttachMemAsync(CUstream hStream, CUdeviceptr dptr, size_t length, unsigned int flags) {
    (void)hStream;
    (void)flags;
    return check_range(dptr, length ? length : 1);
}
