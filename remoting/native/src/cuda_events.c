/* Events and streams made by the client (protocol 8).
 *
 * cuDNN's RNN path creates and destroys ~180 events per batch and PyTorch's caching host allocator
 * polls cuEventQuery once per pinned block it reuses: as round trips these cost an LSTM epoch
 * about 158,000 waits. Here an event is the client's handle from the start: cuEventCreate hands it
 * out at once and its creation travels pipelined with launches (rgpuEventCreate, async); the
 * worker maps the handle to its driver's event (remoting/datapath/worker/client_handles.py).
 * cuEventDestroy_v2 is pipelined too. An error the worker meets later (an event it could not
 * create) answers the next synchronising call, as CUDA reports asynchronous errors, with a line
 * naming cuEventCreate. A handle this process never made, or destroyed, is refused at once with
 * CUDA_ERROR_INVALID_HANDLE.
 *
 * The client also knows when an event is complete without asking: one never recorded is; one
 * whose last record was covered by a finished synchronisation (its own cuEventSynchronize or a
 * successful cuEventQuery, cuStreamSynchronize or a successful cuStreamQuery of the stream it was
 * recorded on, a device-to-host copy on that stream (its data arrives after the stream's earlier
 * work: the completion rides back on a reply the client waits for anyway), cuCtxSynchronize of its
 * context) stays complete until it is recorded again. Those
 * queries cost nothing. Records are numbered by one clock; a synchronisation remembers the clock
 * it began at, and covers the records numbered up to it (their frames went out before its own).
 * An event recorded while a stream capture may be under way is never answered here again: a
 * graph launched later may record it without the client seeing it. Nor are events answered here
 * while managed memory of cuMemAllocManaged exists (managed.c hands the GPU's copy over at each real
 * synchronisation); page-locked memory backed on the GPU does not stop them (managed.c says why).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

/* A handle: tag | generation (24 bits) | slot index + 1 (32 bits). The generation tells a
 * destroyed handle from the live one that reuses its slot; freed slots are reused oldest first. */
#define EV_TAG 0x7e00000000000000ull
#define ST_TAG 0x7d00000000000000ull
#define EV_TAG_MASK 0xff00000000000000ull
#define EV_GEN_MASK 0xffffffu

typedef struct ev_slot {
    uint32_t gen;
    int live;
    int session;
    int uncertain;          /* recorded while a capture may have been under way */
    uint64_t record_seq;    /* clock of the last record (0: never recorded) */
    uint64_t done_seq;      /* the last record known complete, by its own query or synchronisation */
    uint64_t stream;        /* the last record's stream (RGPU_EVENT_WHOLE_CONTEXT: cuCtxRecordEvent) */
    uint64_t ctx;           /* the client context current at the last record */
    uint32_t next_free;     /* index + 1 of the next free slot (0: none) */
} ev_slot;

/* Events and streams each have a table of slots (streams use only gen, live and session). */
typedef struct handle_table {
    uint64_t tag;
    ev_slot *slots;
    uint32_t n, cap, free_head, free_tail;
} handle_table;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static handle_table g_events = {EV_TAG, NULL, 0, 0, 0, 0};
static handle_table g_streams = {ST_TAG, NULL, 0, 0, 0, 0};
static uint64_t g_clock;

/* cuEventDestroy_v2 frees the slot before its frame is routed: the slice it goes to is kept here. */
static __thread uint64_t tl_dying_handle;
static __thread int tl_dying_session;

static uint64_t handle_of(const handle_table *t, uint32_t index, uint32_t gen) {
    return t->tag | ((uint64_t)(gen & EV_GEN_MASK) << 32) | (uint64_t)(index + 1);
}

/* The live slot of a handle (the lock is held), or NULL. */
static ev_slot *slot_in(handle_table *t, uint64_t h) {
    if ((h & EV_TAG_MASK) != t->tag) return NULL;
    uint32_t index = (uint32_t)(h & 0xffffffffu);
    if (index == 0 || index > t->n) return NULL;
    ev_slot *e = &t->slots[index - 1];
    return e->live && e->gen == ((h >> 32) & EV_GEN_MASK) ? e : NULL;
}
static ev_slot *slot_of(CUevent event) { return slot_in(&g_events, (uint64_t)(uintptr_t)event); }

static int take_slot(handle_table *t, uint32_t *index) {
    if (t->free_head) {
        *index = t->free_head - 1;
        t->free_head = t->slots[*index].next_free;
        if (!t->free_head) t->free_tail = 0;
        return 0;
    }
    if (t->n == t->cap) {
        uint32_t cap = t->cap ? t->cap * 2 : 1024;
        ev_slot *n = realloc(t->slots, (size_t)cap * sizeof *n);
        if (!n) return -1;
        t->slots = n;
        t->cap = cap;
    }
    *index = t->n;
    t->slots[t->n++].gen = 0;
    return 0;
}

static void free_slot(handle_table *t, uint32_t index) {
    ev_slot *e = &t->slots[index];
    e->live = 0;
    e->gen = (e->gen + 1) & EV_GEN_MASK;
    e->next_free = 0;
    if (t->free_tail) t->slots[t->free_tail - 1].next_free = index + 1;
    else t->free_head = index + 1;
    t->free_tail = index + 1;
}

/* A new live slot for the current context's slice; 0 when out of memory. */
static uint64_t new_handle(handle_table *t, int session, uint32_t *index) {
    pthread_mutex_lock(&g_lock);
    if (take_slot(t, index)) {
        pthread_mutex_unlock(&g_lock);
        return 0;
    }
    ev_slot *e = &t->slots[*index];
    uint32_t gen = e->gen;
    *e = (ev_slot){.gen = gen, .live = 1, .session = session};
    uint64_t handle = handle_of(t, *index, gen);
    pthread_mutex_unlock(&g_lock);
    return handle;
}

static void drop_handle(handle_table *t, uint32_t index) {
    pthread_mutex_lock(&g_lock);
    free_slot(t, index);
    pthread_mutex_unlock(&g_lock);
}

/* Synchronisations that finished: the clock each began at, per (stream, slice) and per context. */
#define CTX_KEY 0x10000000000ull
static uint64_t synced_upto(uint64_t stream, int session, uint64_t ctx, int whole_context_only) {
    uint64_t a = whole_context_only ? 0 : rgpu_synced_get(stream, (uint64_t)session + 1);
    uint64_t b = rgpu_synced_get(ctx, CTX_KEY);
    return a > b ? a : b;
}

RGPU_EXPORT CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    if (!phEvent) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    /* CU_EVENT_BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS; an interprocess event must not time */
    if ((Flags & ~0x7u) || ((Flags & 0x4u) && !(Flags & 0x2u))) return CUDA_ERROR_INVALID_VALUE;
    rgpu_ctx *cur = rgpu_ctx_current();
    if (!cur || cur->destroyed) return CUDA_ERROR_INVALID_CONTEXT;
    uint32_t index;
    uint64_t handle = new_handle(&g_events, cur->session, &index);
    if (!handle) return CUDA_ERROR_OUT_OF_MEMORY;
    rgpu_call c;
    r = rgpu_begin_session(&c, RGPU_OP_rgpuEventCreate, cur->session);
    if (r == CUDA_SUCCESS) {
        rgpu_put_u64(&c, handle);
        rgpu_put_u32(&c, Flags);
        r = rgpu_async(&c);
    }
    if (r != CUDA_SUCCESS) {
        drop_handle(&g_events, index);
        return r;
    }
    rgpu_event_session_put((CUevent)(uintptr_t)handle, cur->session);
    *phEvent = (CUevent)(uintptr_t)handle;
    return CUDA_SUCCESS;
}

/* Streams: the handle at once, rgpuStreamCreate pipelined. The driver clamps the priority to the
 * device's range: cuStreamGetPriority asks the worker (once: cuda_cache.c keeps it). */
static CUresult stream_create(CUstream *phStream, unsigned int flags, int priority) {
    if (!phStream) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (flags & ~0x1u) return CUDA_ERROR_INVALID_VALUE;   /* CU_STREAM_DEFAULT or CU_STREAM_NON_BLOCKING */
    rgpu_ctx *cur = rgpu_ctx_current();
    if (!cur || cur->destroyed) return CUDA_ERROR_INVALID_CONTEXT;
    uint32_t index;
    uint64_t handle = new_handle(&g_streams, cur->session, &index);
    if (!handle) return CUDA_ERROR_OUT_OF_MEMORY;
    rgpu_call c;
    r = rgpu_begin_session(&c, RGPU_OP_rgpuStreamCreate, cur->session);
    if (r == CUDA_SUCCESS) {
        rgpu_put_u64(&c, handle);
        rgpu_put_u32(&c, flags);
        rgpu_put_i32(&c, priority);
        r = rgpu_async(&c);
    }
    if (r != CUDA_SUCCESS) {
        drop_handle(&g_streams, index);
        return r;
    }
    *phStream = (CUstream)(uintptr_t)handle;
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    return stream_create(phStream, Flags, 0);
}

RGPU_EXPORT CUresult CUDAAPI cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
    return stream_create(phStream, flags, priority);
}

/* cuStreamDestroy_v2: a stream this process made and has not destroyed goes (pipelined, to its
 * slice); anything else is refused at once. */
static __thread uint64_t tl_dying_stream;
static __thread int tl_dying_stream_session;
CUresult rgpu_stream_destroying(CUstream stream) {
    pthread_mutex_lock(&g_lock);
    ev_slot *e = slot_in(&g_streams, (uint64_t)(uintptr_t)stream);
    if (e) {
        tl_dying_stream = (uint64_t)(uintptr_t)stream;
        tl_dying_stream_session = e->session;
        free_slot(&g_streams, (uint32_t)(e - g_streams.slots));
    }
    pthread_mutex_unlock(&g_lock);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult rgpu_begin_stream(rgpu_call *c, uint16_t op, CUstream stream) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (tl_dying_stream && tl_dying_stream == (uint64_t)(uintptr_t)stream) {
        tl_dying_stream = 0;
        return rgpu_begin_session(c, op, tl_dying_stream_session);
    }
    return rgpu_begin(c, op);
}

/* A handle the application may use: one this process made and has not destroyed. */
CUresult rgpu_event_check(CUevent event) {
    pthread_mutex_lock(&g_lock);
    int ok = slot_of(event) != NULL;
    pthread_mutex_unlock(&g_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult rgpu_event_destroying(CUevent event) {
    pthread_mutex_lock(&g_lock);
    ev_slot *e = slot_of(event);
    if (e) {
        tl_dying_handle = (uint64_t)(uintptr_t)event;
        tl_dying_session = e->session;
        free_slot(&g_events, (uint32_t)(e - g_events.slots));
    }
    pthread_mutex_unlock(&g_lock);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult rgpu_begin_event(rgpu_call *c, uint16_t op, CUevent event) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    int session = -1;
    if (tl_dying_handle && tl_dying_handle == (uint64_t)(uintptr_t)event) {
        session = tl_dying_session;
        tl_dying_handle = 0;
    } else {
        pthread_mutex_lock(&g_lock);
        ev_slot *e = slot_of(event);
        if (e) session = e->session;
        pthread_mutex_unlock(&g_lock);
    }
    return session >= 0 ? rgpu_begin_session(c, op, session) : rgpu_begin(c, op);
}

uint64_t rgpu_event_clock(void) { return __atomic_load_n(&g_clock, __ATOMIC_ACQUIRE); }
uint64_t rgpu_event_clock_tick(void) { return __atomic_add_fetch(&g_clock, 1, __ATOMIC_ACQ_REL); }

/* After a record's frame was queued: it is numbered after every frame before it. */
void rgpu_event_recorded(CUevent event, CUstream stream) {
    uint64_t seq = __atomic_add_fetch(&g_clock, 1, __ATOMIC_ACQ_REL);
    int capture = rgpu_capture_possible();
    rgpu_ctx *cur = rgpu_ctx_current();
    pthread_mutex_lock(&g_lock);
    ev_slot *e = slot_of(event);
    if (e) {
        e->record_seq = seq;
        e->stream = (uint64_t)(uintptr_t)stream;
        e->ctx = (uint64_t)(uintptr_t)cur;
        if (capture) e->uncertain = 1;
    }
    pthread_mutex_unlock(&g_lock);
}

/* An event an event record node of a graph records: whenever the graph runs, unknown here, so its
 * queries always go to the worker. INVALID_HANDLE for a handle this process does not hold. */
CUresult rgpu_event_in_graph(CUevent event) {
    pthread_mutex_lock(&g_lock);
    ev_slot *e = slot_of(event);
    if (e) e->uncertain = 1;
    pthread_mutex_unlock(&g_lock);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* cuEventQuery / cuEventSynchronize: 1 when answered here (*result: SUCCESS for an event known
 * complete, INVALID_HANDLE for one this process does not hold); 0 when the worker must answer,
 * with *seq the record the answer will be about. */
int rgpu_event_known(CUevent event, uint64_t *seq, CUresult *result) {
    pthread_mutex_lock(&g_lock);
    ev_slot *e = slot_of(event);
    int known = 0;
    if (!e) {
        *result = CUDA_ERROR_INVALID_HANDLE;
        known = 1;
    } else {
        *seq = e->record_seq;
        if (!e->uncertain && !rgpu_managed_unpinned_any() &&
            (e->record_seq == 0 || e->done_seq >= e->record_seq ||
             synced_upto(e->stream, e->session, e->ctx, e->stream == (uint64_t)RGPU_EVENT_WHOLE_CONTEXT) >= e->record_seq)) {
            *result = CUDA_SUCCESS;
            known = 1;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return known;
}

/* Each also tells managed.c what the synchronisation covered (the work queued before record or
 * clock `seq`), for the page-locked memory the GPU was handed. */
void rgpu_event_completed(CUevent event, uint64_t seq) {
    pthread_mutex_lock(&g_lock);
    ev_slot *e = slot_of(event);
    if (e && seq > e->done_seq) e->done_seq = seq;
    uint64_t stream = e ? e->stream : 0;
    int recorded = e && seq;
    pthread_mutex_unlock(&g_lock);
    if (recorded)
        rgpu_managed_covers(stream == (uint64_t)RGPU_EVENT_WHOLE_CONTEXT, (CUstream)(uintptr_t)stream, seq);
}

void rgpu_stream_synced(CUstream stream, int session, uint64_t seq) {
    rgpu_synced_put((uint64_t)(uintptr_t)stream, (uint64_t)session + 1, seq);
    rgpu_managed_covers(0, stream, seq);
}

void rgpu_ctx_synced(CUcontext ctx, uint64_t seq) {
    rgpu_ctx *x = ctx ? rgpu_ctx_lookup(ctx) : rgpu_ctx_current();
    if (x) rgpu_synced_put((uint64_t)(uintptr_t)x, CTX_KEY, seq);
    rgpu_managed_covers(1, NULL, seq);
}

/* After fork() the child has no sessions: its events and streams are gone with them. */
void rgpu_events_reset_after_fork(void) {
    pthread_mutex_init(&g_lock, NULL);
    for (uint32_t i = 0; i < g_events.n; i++)
        if (g_events.slots[i].live) free_slot(&g_events, i);
    for (uint32_t i = 0; i < g_streams.n; i++)
        if (g_streams.slots[i].live) free_slot(&g_streams, i);
}
