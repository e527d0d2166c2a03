/* Data lanes: a striped copy's chunks, one thread per lane, kept between copies (lanes.h says what
 * and why). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "lanes.h"

#define HEADER 24u
#define POLL_SLICE_MS 100

struct rgpu_lanes_staging {
    uint8_t *base;
    uint32_t count;
    uint64_t slot_bytes;
    void **busy;            /* per slot: the event its queued copy recorded; NULL: free */
    uint32_t *fifo;         /* busy slots, oldest first (a ring of count entries) */
    uint32_t head, len;
};

struct rgpu_lanes_ring {
    uint8_t *base;
    uint32_t lanes, slots;
    uint64_t slot_bytes;
    uint32_t *words;                    /* landed, then done: one per lane, 64 bytes apart */
    uint64_t words_device;
    void *streams[RGPU_LANES_MAX];
    void *events[RGPU_LANES_MAX];
    uint64_t planned[RGPU_LANES_MAX];   /* per lane: chunks planned so far (running) */
    uint64_t first[RGPU_LANES_MAX];     /* per lane: the count before the copy last begun */
    int begun;                          /* rgpu_lanes_ring_begin ran and no plan since */
    int abandoned;                      /* the copy's plan failed: its receive stops waiting for the GPU */
};

#define RING_LANDED(l) ((size_t)(l) * 16u)
#define RING_DONE(l) ((size_t)(RGPU_LANES_MAX + (l)) * 16u)

/* A LANE_DATA frame's header: chunk i of copy `seq`, at offset `off`. */
static void lane_header(uint8_t h[HEADER], uint32_t len, uint16_t flags, uint32_t seq, uint64_t i, uint64_t off) {
    uint16_t op = RGPU_OP_LANE_DATA;
    uint32_t aux = (uint32_t)i;
    memcpy(h, &len, 4);
    memcpy(h + 4, &op, 2);
    memcpy(h + 6, &flags, 2);
    memcpy(h + 8, &seq, 4);
    memcpy(h + 12, &aux, 4);
    memcpy(h + 16, &off, 8);
}

/* ------------------------------------------------------------------ one copy's shared state */

typedef struct {
    const int *fds;
    int nfds;
    uint32_t seq;
    uint64_t size, chunk, chunks;
    double stall_s;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int failed;
    char why[512];
    int exited;             /* lane threads done */
    int finished;           /* lane jobs that will not touch this state again */
    /* receive through staging */
    uint8_t *direct;
    rgpu_lanes_gpu *gpu;
    rgpu_lanes_ring *ring;  /* receive through a landing ring (rgpu_lanes_recv_ring) */
    uint32_t *free_slots;   /* a stack */
    uint32_t nfree;
    int want;               /* lane threads waiting for a free slot */
    uint32_t *ready;        /* chunks whole in a slot, not yet queued to the GPU: (slot, chunk) pairs */
    uint32_t nready;
    uint64_t queued;        /* chunks handed to the GPU (or dropped after a driver error) */
    int32_t aborted;        /* the code of the first aborted chunk received (0: none) */
    /* send */
    const uint8_t *src;
    int wake_fd;            /* eventfd: a lane thread ended (-1: nobody watches) */
    /* send from the device through staging: per chunk, its slot and state */
    int32_t *chunk_slot;
    uint8_t *chunk_state;   /* 0 not read yet, 1 whole in its slot, 2 aborted */
    int32_t device_error;
} copy_state;

enum { CHUNK_PENDING = 0, CHUNK_READY = 1, CHUNK_ABORTED = 2 };

typedef struct {
    copy_state *c;
    int lane;
} lane_arg;

static void fail(copy_state *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void fail(copy_state *c, const char *fmt, ...) {
    pthread_mutex_lock(&c->lock);
    if (!c->failed) {
        c->failed = 1;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->why, sizeof c->why, fmt, ap);
        va_end(ap);
        /* Wake every lane thread blocked in the kernel: the session's lanes are over. */
        for (int i = 0; i < c->nfds; i++) shutdown(c->fds[i], SHUT_RDWR);
    }
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
}

static int is_failed(copy_state *c) { return __atomic_load_n(&c->failed, __ATOMIC_ACQUIRE); }

/* Wait until fd is ready for `events`, at most stall_s in all without progress; 0 ready, -1 stalled
 * or failed elsewhere (the caller says which). */
static int wait_ready(copy_state *c, int fd, short events, double *idle) {
    struct pollfd p = {.fd = fd, .events = events};
    for (;;) {
        if (is_failed(c)) return -1;
        int k = poll(&p, 1, POLL_SLICE_MS);
        if (k > 0) return 0;
        if (k < 0 && errno != EINTR) return -1;
        if (k == 0) {
            *idle += POLL_SLICE_MS / 1000.0;
            if (*idle >= c->stall_s) return -1;
        }
    }
}

static int recv_exact(copy_state *c, int lane, uint8_t *p, size_t n, const char *what) {
    double idle = 0;
    while (n) {
        ssize_t k = recv(c->fds[lane], p, n, MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            idle = 0;
            continue;
        }
        if (k == 0) {
            fail(c, "data lane %d closed by the peer during %s", lane, what);
            return -1;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            fail(c, "data lane %d failed during %s: %s", lane, what, strerror(errno));
            return -1;
        }
        if (wait_ready(c, c->fds[lane], POLLIN, &idle)) {
            if (!is_failed(c)) fail(c, "data lane %d sent nothing for %g s during %s", lane, c->stall_s, what);
            return -1;
        }
    }
    return 0;
}

/* A lane thread is done: count it, wake whoever waits (the condition, or the watcher's eventfd). */
static void lane_exit(copy_state *c) {
    pthread_mutex_lock(&c->lock);
    c->exited++;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
    if (c->wake_fd >= 0) {
        uint64_t one = 1;
        ssize_t ignored = write(c->wake_fd, &one, sizeof one);
        (void)ignored;
    }
}

/* ------------------------------------------------------------------ staging */

rgpu_lanes_staging *rgpu_lanes_staging_new(uint8_t *base, uint32_t count, uint64_t slot_bytes) {
    rgpu_lanes_staging *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->busy = calloc(count, sizeof *st->busy);
    st->fifo = calloc(count, sizeof *st->fifo);
    if (!st->busy || !st->fifo) {
        rgpu_lanes_staging_free(st);
        return NULL;
    }
    st->base = base;
    st->count = count;
    st->slot_bytes = slot_bytes;
    return st;
}

void rgpu_lanes_staging_free(rgpu_lanes_staging *st) {
    if (!st) return;
    free(st->busy);
    free(st->fifo);
    free(st);
}

/* Wait for the oldest busy slot; its index. */
static uint32_t retire_oldest(rgpu_lanes_staging *st, int (*event_sync)(void *), int *error) {
    uint32_t slot = st->fifo[st->head];
    st->head = (st->head + 1) % st->count;
    st->len--;
    int r = event_sync(st->busy[slot]);
    if (r && error && !*error) *error = r;
    st->busy[slot] = NULL;
    return slot;
}

int rgpu_lanes_staging_drain(rgpu_lanes_staging *st, int (*event_sync)(void *)) {
    int error = 0;
    while (st && st->len) retire_oldest(st, event_sync, &error);
    return error;
}

/* ------------------------------------------------------------------ receiving */

typedef struct {
    int watch_fd;
    int (*on_readable)(void *);
    void *arg;
} watch_args;

static int watch_middle(copy_state *c, void *arg);

/* ------------------------------------------------------------------ the landing ring (lanes.h) */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Lane `lane`'s chunk number `k` (its running count, from 1) is whole in its slot. */
static void ring_publish(rgpu_lanes_ring *r, int lane, uint64_t k) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* the bytes before the word, whatever stores the kernel used */
    __atomic_store_n(&r->words[RING_LANDED(lane)], (uint32_t)k, __ATOMIC_RELEASE);
}

/* Receive lane `lane`'s chunk `j` of this copy (n bytes) into its slot, once the GPU has copied out
 * what was there; then store `landed`. */
static int ring_receive_chunk(copy_state *c, int lane, uint64_t j, uint64_t n, const char *what) {
    rgpu_lanes_ring *r = c->ring;
    uint64_t k = r->first[lane] + j + 1;
    if (k > r->slots) {   /* the slot held chunk k - slots: wait for its DMA (the GPU counts in order) */
        uint32_t want = (uint32_t)(k - r->slots);
        const uint32_t *done = &r->words[RING_DONE(lane)];
        double since = 0;
        for (unsigned spin = 0; (int32_t)(__atomic_load_n(done, __ATOMIC_ACQUIRE) - want) < 0; spin++) {
            if (is_failed(c)) return -1;
            if (__atomic_load_n(&r->abandoned, __ATOMIC_ACQUIRE)) break;   /* drain: the copy fails anyway */
            if (spin < 256) {
                cpu_relax();
                continue;
            }
            if (!since) since = now_s();
            else if (now_s() - since >= c->stall_s) {
                fail(c, "the GPU copied nothing out of data lane %d's landing for %g s during %s (its context "
                     "failed, or work queued before the copy runs that long)", lane, c->stall_s, what);
                return -1;
            }
            struct timespec pause = {0, 20000};
            nanosleep(&pause, NULL);
        }
    }
    uint8_t *slot = r->base + ((uint64_t)lane * r->slots + (k - 1) % r->slots) * r->slot_bytes;
    if (recv_exact(c, lane, slot, n, what)) return -1;
    ring_publish(r, lane, k);
    return 0;
}

rgpu_lanes_ring *rgpu_lanes_ring_new(uint8_t *base, uint32_t lanes, uint32_t slots, uint64_t slot_bytes,
                                     uint32_t *words, uint64_t words_device, void *const *streams,
                                     void *const *events) {
    if (!base || !words || !lanes || lanes > RGPU_LANES_MAX || slots < 1 || !slot_bytes) return NULL;
    rgpu_lanes_ring *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->base = base;
    r->lanes = lanes;
    r->slots = slots;
    r->slot_bytes = slot_bytes;
    r->words = words;
    r->words_device = words_device;
    memset(words, 0, RGPU_LANES_RING_WORDS_BYTES);
    for (uint32_t l = 0; l < lanes; l++) {
        r->streams[l] = streams[l];
        r->events[l] = events[l];
    }
    return r;
}

void rgpu_lanes_ring_free(rgpu_lanes_ring *r) { free(r); }

void rgpu_lanes_ring_begin(rgpu_lanes_ring *r) {
    if (!r) return;
    memcpy(r->first, r->planned, sizeof r->first);
    __atomic_store_n(&r->abandoned, 0, __ATOMIC_RELEASE);
    r->begun = 1;
}

void rgpu_lanes_ring_abandon(rgpu_lanes_ring *r) {
    if (r) __atomic_store_n(&r->abandoned, 1, __ATOMIC_RELEASE);
}

int rgpu_lanes_ring_plan(rgpu_lanes_ring *r, const rgpu_lanes_ring_driver *d, uint64_t size, uint64_t chunk,
                         uint64_t dst, void *stream, void *order) {
    if (!r || !r->begun || !d || !chunk || chunk > r->slot_bytes || !size) return 1;   /* CUDA_ERROR_INVALID_VALUE */
    r->begun = 0;
    uint64_t chunks = rgpu_lanes_chunks(size, chunk);
    uint32_t used = chunks < r->lanes ? (uint32_t)chunks : r->lanes;
    int e = d->event_record(order, stream);
    for (uint32_t l = 0; l < used && !e; l++) e = d->stream_wait_event(r->streams[l], order, 0);
    for (uint64_t i = 0; i < chunks && !e; i++) {
        uint32_t l = (uint32_t)(i % r->lanes);
        uint64_t k = ++r->planned[l], off = i * chunk;
        uint64_t n = size - off < chunk ? size - off : chunk;
        uint8_t *slot = r->base + ((uint64_t)l * r->slots + (k - 1) % r->slots) * r->slot_bytes;
        e = d->wait_value32(r->streams[l], r->words_device + RING_LANDED(l) * 4, (uint32_t)k, 0 /* GEQ */);
        if (!e) e = d->memcpy_htod(dst + off, slot, n, r->streams[l]);
        if (!e) e = d->write_value32(r->streams[l], r->words_device + RING_DONE(l) * 4, (uint32_t)k, 0);
    }
    for (uint32_t l = 0; l < used && !e; l++) {
        e = d->event_record(r->events[l], r->streams[l]);
        if (!e) e = d->stream_wait_event(stream, r->events[l], 0);
    }
    return e;
}

void rgpu_lanes_ring_release(rgpu_lanes_ring *r) {
    if (!r) return;
    for (uint32_t l = 0; l < r->lanes; l++) ring_publish(r, (int)l, r->planned[l]);
}

static void *recv_lane(void *arg) {
    lane_arg *a = arg;
    copy_state *c = a->c;
    char what[96];
    for (uint64_t i = (uint64_t)a->lane; i < c->chunks && !is_failed(c); i += (uint64_t)c->nfds) {
        uint64_t off = i * c->chunk;
        uint64_t n = c->size - off < c->chunk ? c->size - off : c->chunk;
        uint8_t h[HEADER];
        snprintf(what, sizeof what, "chunk %llu of copy %u", (unsigned long long)i, c->seq);
        if (recv_exact(c, a->lane, h, HEADER, what)) break;
        uint32_t len, seq, aux;
        uint16_t op, flags;
        uint64_t at;
        memcpy(&len, h, 4);
        memcpy(&op, h + 4, 2);
        memcpy(&flags, h + 6, 2);
        memcpy(&seq, h + 8, 4);
        memcpy(&aux, h + 12, 4);
        memcpy(&at, h + 16, 8);
        if (op == RGPU_OP_LANE_DATA && (flags & RGPU_LANE_ABORTED) && len == 4 && seq == c->seq && aux == (uint32_t)i &&
            at == off) {
            int32_t code;
            if (recv_exact(c, a->lane, (uint8_t *)&code, 4, what)) break;
            pthread_mutex_lock(&c->lock);
            if (!c->aborted) c->aborted = code ? code : 999;
            pthread_mutex_unlock(&c->lock);
            if (c->ring) ring_publish(c->ring, a->lane, c->ring->first[a->lane] + (i - (uint64_t)a->lane) / (uint64_t)c->nfds + 1);
            continue;
        }
        if (op != RGPU_OP_LANE_DATA || seq != c->seq || aux != (uint32_t)i || at != off || len != n) {
            fail(c, "data lane %d sent frame op %u seq %u chunk %u offset %llu of %u bytes where chunk %llu of copy "
                 "%u (offset %llu, %llu bytes) was due", a->lane, op, seq, aux, (unsigned long long)at, len,
                 (unsigned long long)i, c->seq, (unsigned long long)off, (unsigned long long)n);
            break;
        }
        if (c->ring) {
            if (ring_receive_chunk(c, a->lane, (i - (uint64_t)a->lane) / (uint64_t)c->nfds, n, what)) break;
            continue;
        }
        if (c->direct) {
            if (recv_exact(c, a->lane, c->direct + off, n, what)) break;
            continue;
        }
        if (!c->gpu) {   /* a copy the worker refused: its bytes are read and dropped, the lanes stay in step */
            uint8_t scratch[16384];
            uint64_t left = n;
            while (left) {
                uint64_t k = left < sizeof scratch ? left : sizeof scratch;
                if (recv_exact(c, a->lane, scratch, k, what)) break;
                left -= k;
            }
            if (left) break;
            continue;
        }
        rgpu_lanes_staging *st = c->gpu->staging;
        pthread_mutex_lock(&c->lock);
        while (!c->nfree && !c->failed) {
            c->want++;
            pthread_cond_broadcast(&c->cond);
            pthread_cond_wait(&c->cond, &c->lock);
            c->want--;
        }
        if (c->failed) {
            pthread_mutex_unlock(&c->lock);
            break;
        }
        uint32_t slot = c->free_slots[--c->nfree];
        pthread_mutex_unlock(&c->lock);
        if (recv_exact(c, a->lane, st->base + (uint64_t)slot * st->slot_bytes, n, what)) break;
        pthread_mutex_lock(&c->lock);
        c->ready[2 * c->nready] = slot;
        c->ready[2 * c->nready + 1] = (uint32_t)i;
        c->nready++;
        pthread_cond_broadcast(&c->cond);
        pthread_mutex_unlock(&c->lock);
    }
    lane_exit(c);
    return NULL;
}

/* The calling thread queues each whole chunk's GPU copy and frees slots for the lane threads. */
static void feed_gpu(copy_state *c) {
    rgpu_lanes_gpu *g = c->gpu;
    rgpu_lanes_staging *st = g->staging;
    uint32_t batch[2 * RGPU_LANES_MAX * 4];
    pthread_mutex_lock(&c->lock);
    for (;;) {
        while (!c->nready && !(c->want && !c->nfree && st->len) && c->exited < c->nfds)
            pthread_cond_wait(&c->cond, &c->lock);
        if (c->nready) {
            uint32_t k = c->nready < sizeof batch / sizeof *batch / 2 ? c->nready : sizeof batch / sizeof *batch / 2;
            memcpy(batch, c->ready + 2 * (c->nready - k), 2 * k * sizeof *batch);
            c->nready -= k;
            pthread_mutex_unlock(&c->lock);
            for (uint32_t j = 0; j < k; j++) {
                uint32_t slot = batch[2 * j], i = batch[2 * j + 1];
                uint64_t off = (uint64_t)i * c->chunk;
                uint64_t n = c->size - off < c->chunk ? c->size - off : c->chunk;
                int r = g->error ? g->error : g->memcpy_htod(g->dst + off, st->base + (uint64_t)slot * st->slot_bytes, n,
                                                             g->stream);
                if (!r && !g->error) r = g->event_record(g->events[slot], g->stream);
                if (r && !g->error) g->error = r;
                pthread_mutex_lock(&c->lock);
                if (r) {
                    /* Nothing tracks a copy the driver refused: the slot is free (a queued copy that
                     * then failed to get its event waits for the stream at the end). */
                    c->free_slots[c->nfree++] = slot;
                } else {
                    st->busy[slot] = g->events[slot];
                    st->fifo[(st->head + st->len) % st->count] = slot;
                    st->len++;
                }
                c->queued++;
                pthread_cond_broadcast(&c->cond);
                pthread_mutex_unlock(&c->lock);
            }
            pthread_mutex_lock(&c->lock);
            continue;
        }
        if (c->want && !c->nfree && st->len) {
            pthread_mutex_unlock(&c->lock);
            int error = 0;
            uint32_t slot = retire_oldest(st, g->event_sync, &error);
            pthread_mutex_lock(&c->lock);
            if (error && !g->error) g->error = error;
            c->free_slots[c->nfree++] = slot;
            pthread_cond_broadcast(&c->cond);
            continue;
        }
        break;   /* every lane thread ended and nothing is left to queue */
    }
    pthread_mutex_unlock(&c->lock);
}

/* ------------------------------------------------------------------ the lane threads
 *
 * A process keeps its lane threads between copies (named "rgpu-lane"): a copy hands each lane's
 * work to an idle one and starts a thread only when none is idle, so a training loop's copies start
 * no threads after its first. Every job handed over has an idle thread of its own (idle >= pending),
 * so a copy's lanes always run at once, side by side, whatever other copies of the process do. A
 * child forked while they exist has none of them: it starts with an empty pool. */

typedef struct lane_job {
    void *(*fn)(void *);
    void *arg;
    struct lane_job *next;
} lane_job;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cond = PTHREAD_COND_INITIALIZER;
static lane_job *pool_head, *pool_tail;
static int pool_idle, pool_pending;
static pthread_once_t pool_fork_once = PTHREAD_ONCE_INIT;

static void pool_after_fork_child(void) {
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_cond, NULL);
    pool_head = pool_tail = NULL;
    pool_idle = pool_pending = 0;
}

static void pool_register_fork(void) { pthread_atfork(NULL, NULL, pool_after_fork_child); }

static void *pool_thread(void *unused) {
    (void)unused;
    pthread_setname_np(pthread_self(), "rgpu-lane");
    pthread_mutex_lock(&pool_lock);
    for (;;) {
        while (!pool_head) pthread_cond_wait(&pool_cond, &pool_lock);
        lane_job *j = pool_head;
        pool_head = j->next;
        if (!pool_head) pool_tail = NULL;
        pool_pending--;
        pool_idle--;
        pthread_mutex_unlock(&pool_lock);
        j->fn(j->arg);   /* j lives in the copy's frame: not touched after this */
        pthread_mutex_lock(&pool_lock);
        pool_idle++;
    }
    return NULL;
}

/* Hand `j` to an idle lane thread, starting one when none is free; errno-style code on failure. */
static int pool_run(lane_job *j) {
    pthread_once(&pool_fork_once, pool_register_fork);
    pthread_mutex_lock(&pool_lock);
    if (pool_idle <= pool_pending) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        sigset_t all, old;
        sigfillset(&all);   /* the application's signals go to its own threads, not to ours */
        pthread_sigmask(SIG_SETMASK, &all, &old);
        int r = pthread_create(&t, &attr, pool_thread, NULL);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
        if (r) {
            pthread_mutex_unlock(&pool_lock);
            return r;
        }
        pool_idle++;
    }
    j->next = NULL;
    if (pool_tail) pool_tail->next = j;
    else pool_head = j;
    pool_tail = j;
    pool_pending++;
    pthread_cond_signal(&pool_cond);
    pthread_mutex_unlock(&pool_lock);
    return 0;
}

typedef struct {
    lane_arg lane;
    lane_job job;
    void *(*fn)(void *);
} lane_task;

/* A lane's work, then the last touch of the copy's state: the copy may return once all are done. */
static void *lane_task_run(void *arg) {
    lane_task *t = arg;
    t->fn(&t->lane);
    copy_state *c = t->lane.c;
    pthread_mutex_lock(&c->lock);
    c->finished++;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

static int run_lanes(copy_state *c, void *(*fn)(void *), int (*middle)(copy_state *, void *), void *arg) {
    lane_task tasks[RGPU_LANES_MAX];
    int started = 0;
    for (int i = 0; i < c->nfds; i++) {
        tasks[i].lane.c = c;
        tasks[i].lane.lane = i;
        tasks[i].fn = fn;
        tasks[i].job.fn = lane_task_run;
        tasks[i].job.arg = &tasks[i];
        int r = pool_run(&tasks[i].job);
        if (r) {
            fail(c, "cannot start a thread for data lane %d: %s", i, strerror(r));
            pthread_mutex_lock(&c->lock);
            c->exited += c->nfds - i;   /* the lanes never started count as ended */
            pthread_cond_broadcast(&c->cond);
            pthread_mutex_unlock(&c->lock);
            break;
        }
        started++;
    }
    int r = middle ? middle(c, arg) : 0;
    pthread_mutex_lock(&c->lock);
    while (c->finished < started) pthread_cond_wait(&c->cond, &c->lock);
    pthread_mutex_unlock(&c->lock);
    return r;
}

static int feed_gpu_middle(copy_state *c, void *arg) {
    (void)arg;
    feed_gpu(c);
    return 0;
}

static int init_state(copy_state *c, const int *fds, int nfds, uint32_t seq, uint64_t size, uint64_t chunk,
                      double stall_s, char *why, size_t whylen) {
    memset(c, 0, sizeof *c);
    if (nfds < 1 || nfds > RGPU_LANES_MAX || !chunk) {
        snprintf(why, whylen, "bad striped copy: %d lanes, chunks of %llu bytes", nfds, (unsigned long long)chunk);
        return -1;
    }
    c->fds = fds;
    c->nfds = nfds;
    c->seq = seq;
    c->size = size;
    c->chunk = chunk;
    c->chunks = rgpu_lanes_chunks(size, chunk);
    c->stall_s = stall_s > 0 ? stall_s : 30.0;
    c->wake_fd = -1;
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->cond, NULL);
    return 0;
}

static int finish(copy_state *c, char *why, size_t whylen) {
    int r = c->failed ? -1 : 0;
    if (r) snprintf(why, whylen, "%s", c->why);
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->cond);
    return r;
}

int rgpu_lanes_recv(const int *fds, int nfds, uint32_t seq, uint64_t size, uint64_t chunk, uint8_t *direct,
                    rgpu_lanes_gpu *gpu, int watch_fd, int (*on_readable)(void *), void *arg, double stall_s,
                    int32_t *aborted, char *why, size_t whylen) {
    copy_state c;
    if (aborted) *aborted = 0;
    if (init_state(&c, fds, nfds, seq, size, chunk, stall_s, why, whylen)) return -1;
    if (!direct && gpu) {
        rgpu_lanes_staging *st = gpu->staging;
        if (!st || st->slot_bytes < chunk || st->count < 1) {
            snprintf(why, whylen, "no staging for chunks of %llu bytes", (unsigned long long)chunk);
            return finish(&c, why, whylen), -1;
        }
        c.free_slots = malloc(st->count * sizeof *c.free_slots);
        c.ready = malloc(2 * (size_t)st->count * sizeof *c.ready);
        if (!c.free_slots || !c.ready) {
            free(c.free_slots);
            free(c.ready);
            snprintf(why, whylen, "out of memory");
            return finish(&c, why, whylen), -1;
        }
        for (uint32_t s = st->count; s-- > 0;)
            if (!st->busy[s]) c.free_slots[c.nfree++] = s;
    }
    c.direct = direct;
    c.gpu = gpu;
    watch_args w = {watch_fd, on_readable, arg};
    int watching = !(gpu && !direct) && watch_fd >= 0 && on_readable;
    if (watching && (c.wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0) watching = 0;
    run_lanes(&c, recv_lane, direct || !gpu ? (watching ? watch_middle : NULL) : feed_gpu_middle, &w);
    if (c.wake_fd >= 0) close(c.wake_fd);
    free(c.free_slots);
    free(c.ready);
    if (aborted) *aborted = c.aborted;
    return finish(&c, why, whylen);
}

int rgpu_lanes_recv_ring(const int *fds, int nfds, uint32_t seq, uint64_t size, uint64_t chunk, rgpu_lanes_ring *r,
                         double stall_s, int32_t *aborted, char *why, size_t whylen) {
    copy_state c;
    if (aborted) *aborted = 0;
    if (init_state(&c, fds, nfds, seq, size, chunk, stall_s, why, whylen)) return -1;
    if (!r || (uint32_t)nfds != r->lanes || chunk > r->slot_bytes) {
        snprintf(why, whylen, "a landing ring of %u lanes and %llu-byte slots for a copy over %d lanes in chunks of "
                 "%llu bytes", r ? r->lanes : 0, r ? (unsigned long long)r->slot_bytes : 0ULL, nfds,
                 (unsigned long long)chunk);
        return finish(&c, why, whylen), -1;
    }
    c.ring = r;
    run_lanes(&c, recv_lane, NULL, NULL);
    if (aborted) *aborted = c.aborted;
    return finish(&c, why, whylen);
}

/* ------------------------------------------------------------------ sending */

static int send_exact(copy_state *c, int lane, struct iovec *iov, int iovcnt, const char *what) {
    double idle = 0;
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)iovcnt};
    while (m.msg_iovlen) {
        ssize_t k = sendmsg(c->fds[lane], &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                fail(c, "data lane %d failed during %s: %s", lane, what, strerror(errno));
                return -1;
            }
            if (wait_ready(c, c->fds[lane], POLLOUT, &idle)) {
                if (!is_failed(c)) fail(c, "data lane %d took nothing for %g s during %s", lane, c->stall_s, what);
                return -1;
            }
            continue;
        }
        idle = 0;
        size_t left = (size_t)k;
        while (m.msg_iovlen && left >= m.msg_iov[0].iov_len) {
            left -= m.msg_iov[0].iov_len;
            m.msg_iov++;
            m.msg_iovlen--;
        }
        if (m.msg_iovlen) {
            m.msg_iov[0].iov_base = (uint8_t *)m.msg_iov[0].iov_base + left;
            m.msg_iov[0].iov_len -= left;
        }
    }
    return 0;
}

static void *send_lane(void *arg) {
    lane_arg *a = arg;
    copy_state *c = a->c;
    char what[96];
    for (uint64_t i = (uint64_t)a->lane; i < c->chunks && !is_failed(c); i += (uint64_t)c->nfds) {
        uint64_t off = i * c->chunk;
        uint64_t n = c->size - off < c->chunk ? c->size - off : c->chunk;
        uint8_t h[HEADER];
        lane_header(h, (uint32_t)n, 0, c->seq, i, off);
        struct iovec iov[2] = {{h, HEADER}, {(void *)(c->src + off), n}};
        snprintf(what, sizeof what, "chunk %llu of copy %u", (unsigned long long)i, c->seq);
        if (send_exact(c, a->lane, iov, 2, what)) break;
    }
    lane_exit(c);
    return NULL;
}

/* The calling thread: serve the session's connection while the lanes send. */
static int watch_middle(copy_state *c, void *arg) {
    watch_args *w = arg;
    for (;;) {
        pthread_mutex_lock(&c->lock);
        int done = c->exited == c->nfds;
        pthread_mutex_unlock(&c->lock);
        if (done) return 0;
        struct pollfd p[2] = {{.fd = c->wake_fd, .events = POLLIN}, {.fd = w->watch_fd, .events = POLLIN}};
        int k = poll(p, w->watch_fd >= 0 && w->on_readable ? 2 : 1, -1);
        if (k < 0 && errno != EINTR) return 0;
        if (p[0].revents) {
            uint64_t v;
            ssize_t ignored = read(c->wake_fd, &v, sizeof v);
            (void)ignored;
        }
        if (k > 0 && w->watch_fd >= 0 && w->on_readable && p[1].revents) {
            if (w->on_readable(w->arg)) {
                fail(c, "the session's connection failed during a striped copy");
                w->watch_fd = -1;
            }
        }
    }
}

int rgpu_lanes_send(const int *fds, int nfds, uint32_t seq, const uint8_t *p, uint64_t size, uint64_t chunk,
                    int watch_fd, int (*on_readable)(void *), void *arg, double stall_s, char *why, size_t whylen) {
    copy_state c;
    if (init_state(&c, fds, nfds, seq, size, chunk, stall_s, why, whylen)) return -1;
    c.src = p;
    c.wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (c.wake_fd < 0) {
        snprintf(why, whylen, "eventfd: %s", strerror(errno));
        return finish(&c, why, whylen), -1;
    }
    watch_args w = {watch_fd, on_readable, arg};
    run_lanes(&c, send_lane, watch_middle, &w);
    close(c.wake_fd);
    return finish(&c, why, whylen);
}

/* ------------------------------------------------------------------ sending from the device */

static int send_abort(copy_state *c, int lane, uint64_t i, int32_t code, const char *what) {
    uint8_t h[HEADER];
    lane_header(h, 4, RGPU_LANE_ABORTED, c->seq, i, i * c->chunk);
    struct iovec iov[2] = {{h, HEADER}, {&code, 4}};
    return send_exact(c, lane, iov, 2, what);
}

static void *send_device_lane(void *arg) {
    lane_arg *a = arg;
    copy_state *c = a->c;
    rgpu_lanes_staging *st = c->gpu->staging;
    char what[96];
    for (uint64_t i = (uint64_t)a->lane; i < c->chunks; i += (uint64_t)c->nfds) {
        pthread_mutex_lock(&c->lock);
        while (c->chunk_state[i] == CHUNK_PENDING && !c->failed) pthread_cond_wait(&c->cond, &c->lock);
        int state = c->chunk_state[i], failed = c->failed;
        int32_t slot = c->chunk_slot[i], code = c->device_error;
        pthread_mutex_unlock(&c->lock);
        if (failed) break;
        snprintf(what, sizeof what, "chunk %llu of copy %u", (unsigned long long)i, c->seq);
        if (state == CHUNK_ABORTED) {
            if (send_abort(c, a->lane, i, code, what)) break;
            continue;
        }
        uint64_t off = i * c->chunk;
        uint64_t n = c->size - off < c->chunk ? c->size - off : c->chunk;
        uint8_t h[HEADER];
        lane_header(h, (uint32_t)n, 0, c->seq, i, off);
        struct iovec iov[2] = {{h, HEADER}, {st->base + (uint64_t)slot * st->slot_bytes, n}};
        int r = send_exact(c, a->lane, iov, 2, what);
        pthread_mutex_lock(&c->lock);
        c->free_slots[c->nfree++] = (uint32_t)slot;
        pthread_cond_broadcast(&c->cond);
        pthread_mutex_unlock(&c->lock);
        if (r) break;
    }
    lane_exit(c);
    return NULL;
}

/* The calling thread: queue chunk copies into free slots, in order, and hand each over once its
 * event says it is whole. */
static int feed_lanes_middle(copy_state *c, void *arg) {
    (void)arg;
    rgpu_lanes_gpu *g = c->gpu;
    rgpu_lanes_staging *st = g->staging;
    uint64_t next = 0, done = 0;   /* chunks queued; chunks handed over (in order) */
    pthread_mutex_lock(&c->lock);
    while (done < c->chunks && !c->failed) {
        if (next < c->chunks && c->nfree && !c->device_error) {
            uint32_t slot = c->free_slots[--c->nfree];
            pthread_mutex_unlock(&c->lock);
            uint64_t off = next * c->chunk;
            uint64_t n = c->size - off < c->chunk ? c->size - off : c->chunk;
            int r = g->memcpy_dtoh(st->base + (uint64_t)slot * st->slot_bytes, g->dst + off, n, g->stream);
            if (!r) r = g->event_record(g->events[slot], g->stream);
            pthread_mutex_lock(&c->lock);
            c->chunk_slot[next] = (int32_t)slot;
            if (r) {
                /* This chunk and every later one go as aborted frames; those queued before are waited for. */
                c->device_error = r;
                c->free_slots[c->nfree++] = slot;
                for (uint64_t j = next; j < c->chunks; j++) c->chunk_state[j] = CHUNK_ABORTED;
                pthread_cond_broadcast(&c->cond);
                next = c->chunks;
            } else {
                next++;
            }
            continue;
        }
        if (done < next && c->chunk_state[done] == CHUNK_PENDING) {
            int32_t slot = c->chunk_slot[done];
            pthread_mutex_unlock(&c->lock);
            int r = g->event_sync(g->events[slot]);
            pthread_mutex_lock(&c->lock);
            if (r && !c->device_error) {
                c->device_error = r;
                for (uint64_t j = done; j < c->chunks; j++)
                    if (c->chunk_state[j] == CHUNK_PENDING || j >= next) c->chunk_state[j] = CHUNK_ABORTED;
                c->free_slots[c->nfree++] = (uint32_t)slot;
                next = c->chunks;
            } else if (!r) {
                c->chunk_state[done] = CHUNK_READY;
            }
            done++;
            pthread_cond_broadcast(&c->cond);
            continue;
        }
        if (done < next || (next == c->chunks && done < c->chunks)) {   /* aborted ones: nothing to wait for */
            done++;
            continue;
        }
        pthread_cond_wait(&c->cond, &c->lock);   /* every slot is on its way out: wait for one back */
    }
    pthread_mutex_unlock(&c->lock);
    return 0;
}

int rgpu_lanes_send_device(const int *fds, int nfds, uint32_t seq, uint64_t size, uint64_t chunk, rgpu_lanes_gpu *gpu,
                           double stall_s, char *why, size_t whylen) {
    copy_state c;
    if (init_state(&c, fds, nfds, seq, size, chunk, stall_s, why, whylen)) return -1;
    rgpu_lanes_staging *st = gpu ? gpu->staging : NULL;
    if (!st || st->slot_bytes < chunk || st->count < 1) {
        snprintf(why, whylen, "no staging for chunks of %llu bytes", (unsigned long long)chunk);
        return finish(&c, why, whylen), -1;
    }
    int error = rgpu_lanes_staging_drain(st, gpu->event_sync);   /* the slots' host-to-device copies first */
    c.gpu = gpu;
    c.free_slots = malloc(st->count * sizeof *c.free_slots);
    c.chunk_slot = calloc(c.chunks ? c.chunks : 1, sizeof *c.chunk_slot);
    c.chunk_state = calloc(c.chunks ? c.chunks : 1, 1);
    if (!c.free_slots || !c.chunk_slot || !c.chunk_state) {
        free(c.free_slots);
        free(c.chunk_slot);
        free(c.chunk_state);
        snprintf(why, whylen, "out of memory");
        return finish(&c, why, whylen), -1;
    }
    for (uint32_t s = st->count; s-- > 0;) c.free_slots[c.nfree++] = s;
    if (error) {   /* an earlier copy's error: this one reads nothing */
        c.device_error = error;
        memset(c.chunk_state, CHUNK_ABORTED, c.chunks);
    }
    run_lanes(&c, send_device_lane, feed_lanes_middle, NULL);
    gpu->error = c.device_error;
    free(c.free_slots);
    free(c.chunk_slot);
    free(c.chunk_state);
    return finish(&c, why, whylen);
}
