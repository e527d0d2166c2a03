/* Sessions and calls: the framed protocol over TCP (remoting/protocol.py documents it).
 * Shared by libcuda.so.1 and libnvidia-ml.so.1; each library opens its own sessions. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "rgpu_client.h"
#include "rgpu_frame.h"
#include "ucx_link.h"
#include "lanes.h"
#include <sys/random.h>
#include <execinfo.h>
#include <sys/syscall.h>

rgpu_session rgpu_sessions[RGPU_MAX_SESSIONS];
int rgpu_session_count;

static int g_log_level = -1;
static const char *g_component = "client";
#define ASYNC_FLUSH_BYTES (256u * 1024u)
/* Pipelined frames wait at most this long in the send buffer (the flusher's delay), and are sent
 * at once when nothing was sent for this long: after a synchronising call the GPU's queue is
 * empty, and the first launches must not wait for the flusher while the GPU idles. */
#define ASYNC_DELAY_NS (100u * 1000u)
#define MAX_MESSAGES_SHOWN 8

int rgpu_log_level(void) {
    if (g_log_level < 0) {
        const char *v = getenv("RGPU_LOG");
        g_log_level = RGPU_LOG_WARN;
        if (v) {
            if (!strcmp(v, "error") || !strcmp(v, "quiet")) g_log_level = RGPU_LOG_ERROR;
            else if (!strcmp(v, "info")) g_log_level = RGPU_LOG_INFO;
            else if (!strcmp(v, "debug")) g_log_level = RGPU_LOG_DEBUG;
        }
    }
    return g_log_level;
}

/* libcuda's CUDA error log (error_log.c): warnings and errors go there too, whatever RGPU_LOG says,
 * for applications that read it. Weak: libnvidia-ml shares this file and has no such log. */
void rgpu_error_log_add(int level, const char *message, size_t n) __attribute__((weak));

void rgpu_log(int level, const char *fmt, ...) {
    int shown = level <= rgpu_log_level(), kept = level <= RGPU_LOG_WARN && rgpu_error_log_add;
    if (!shown && !kept) return;
    char line[1200];
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(line, sizeof line, "rgpu: %s: ", g_component);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    size_t len = strlen(line);
    if (kept) rgpu_error_log_add(level, line, len);
    if (!shown) return;
    if (len + 1 < sizeof line) { line[len++] = '\n'; line[len] = 0; }
    /* One write(2): lines from several threads do not interleave. */
    ssize_t ignored = write(2, line, len);
    (void)ignored;
}

CUresult rgpu_unsupported(const char *name, int *seen, const char *why) {
    if (!__atomic_exchange_n(seen, 1, __ATOMIC_RELAXED))
        rgpu_log(RGPU_LOG_WARN, "%s is not remoted (%s; it returns CUDA_ERROR_NOT_SUPPORTED)", name,
                 why && *why ? why : "not in rgpu's API spec yet");
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* ------------------------------------------------------------------ call profile
 * RGPU_CLIENT_STATS=PATH: count every remoted call per operation, and the time each
 * synchronous one waited for its reply; written to PATH.<pid> at exit. This is how a user
 * (or we) finds the round trips an application pays for; `python -m
 * rgpu.remoting.native.client_stats PATH.<pid>` prints it with the operations' names. */

#define STATS_OPS 2048
static int g_stats_on = -1;
static uint64_t g_sync_calls[STATS_OPS], g_sync_wait_ns[STATS_OPS], g_async_calls[STATS_OPS];
static uint64_t g_sends;
static uint64_t g_image_bytes, g_image_loads, g_image_hits, g_image_hashed, g_image_hash_ns;

static int stats_on(void) {
    if (g_stats_on < 0) {
        const char *v = getenv("RGPU_CLIENT_STATS");
        g_stats_on = v && *v;
    }
    return g_stats_on;
}

void rgpu_stats_image(uint64_t bytes_sent, int cache_hit) {
    if (!stats_on()) return;
    __atomic_add_fetch(&g_image_loads, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&g_image_bytes, bytes_sent, __ATOMIC_RELAXED);
    if (cache_hit) __atomic_add_fetch(&g_image_hits, 1, __ATOMIC_RELAXED);
}

void rgpu_stats_image_hash(uint64_t bytes, uint64_t ns) {
    if (!stats_on()) return;
    __atomic_add_fetch(&g_image_hashed, bytes, __ATOMIC_RELAXED);
    __atomic_add_fetch(&g_image_hash_ns, ns, __ATOMIC_RELAXED);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void stats_write(const char *suffix) {
    char path[4096];
    if (suffix && *suffix)
        snprintf(path, sizeof path, "%s.%d.%s", getenv("RGPU_CLIENT_STATS"), (int)getpid(), suffix);
    else
        snprintf(path, sizeof path, "%s.%d", getenv("RGPU_CLIENT_STATS"), (int)getpid());
    /* Written beside it under a hidden name, then renamed: a reader waiting for PATH.<pid> (a
     * benchmark, a test) never reads half of it. */
    char tmp[4200];
    const char *slash = strrchr(path, '/');
    int dir = slash ? (int)(slash - path + 1) : 0;
    snprintf(tmp, sizeof tmp, "%.*s.rgpu-stats.%d.tmp", dir, path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "# rgpu client call profile: op sync_calls sync_wait_ns async_calls (sends %llu)\n",
            (unsigned long long)__atomic_load_n(&g_sends, __ATOMIC_RELAXED));
    fprintf(f, "# module images: loads %llu cache_hits %llu bytes_sent %llu bytes_hashed %llu hash_ns %llu\n",
            (unsigned long long)__atomic_load_n(&g_image_loads, __ATOMIC_RELAXED),
            (unsigned long long)__atomic_load_n(&g_image_hits, __ATOMIC_RELAXED),
            (unsigned long long)__atomic_load_n(&g_image_bytes, __ATOMIC_RELAXED),
            (unsigned long long)__atomic_load_n(&g_image_hashed, __ATOMIC_RELAXED),
            (unsigned long long)__atomic_load_n(&g_image_hash_ns, __ATOMIC_RELAXED));
    for (int op = 0; op < STATS_OPS; op++) {
        uint64_t sync = __atomic_load_n(&g_sync_calls[op], __ATOMIC_RELAXED);
        uint64_t async = __atomic_load_n(&g_async_calls[op], __ATOMIC_RELAXED);
        if (sync || async)
            fprintf(f, "%d %llu %llu %llu\n", op, (unsigned long long)sync,
                    (unsigned long long)__atomic_load_n(&g_sync_wait_ns[op], __ATOMIC_RELAXED),
                    (unsigned long long)async);
    }
    if (fclose(f) != 0 || rename(tmp, path) != 0) unlink(tmp);
}

__attribute__((destructor)) static void stats_report(void) {
    if (g_stats_on == 1) stats_write(NULL);
}

/* The profile so far, into PATH.<pid>.<suffix>, while the application runs: a benchmark takes
 * one at the start and one at the end of its steady state and subtracts them, which gives the
 * round trips of the steady state alone (`client_stats --between A B`). The library exports
 * driver symbols only: a program finds this one as cuGetProcAddress("rgpuClientStatsWrite"). */
void rgpu_client_stats_write(const char *suffix) {
    if (stats_on()) stats_write(suffix ? suffix : "snapshot");
}

/* ------------------------------------------------------------------ raw socket I/O */

static int send_all(int fd, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n) {
        ssize_t k = send(fd, b, n, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

static int recv_all(int fd, void *p, size_t n) {
    uint8_t *b = p;
    while (n) {
        ssize_t k = recv(fd, b, n, 0);
        if (k == 0) { errno = ECONNRESET; return -1; }
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

static int recv_discard(int fd, size_t n) {
    uint8_t tmp[4096];
    while (n) {
        size_t k = n < sizeof tmp ? n : sizeof tmp;
        if (recv_all(fd, tmp, k)) return -1;
        n -= k;
    }
    return 0;
}

static void close_lanes(rgpu_session *s) {
    for (int i = 0; i < s->nlanes; i++)
        if (s->lanes[i] >= 0) close(s->lanes[i]);
    s->nlanes = 0;
}

static void session_fail(rgpu_session *s, const char *why) {
    if (s->dead) return;
    s->dead = 1;
    if (s->fd >= 0) { close(s->fd); s->fd = -1; }
    if (!s->striping) close_lanes(s);   /* else the striped copy closes them once its threads are done */
    rgpu_log(RGPU_LOG_ERROR,
             "lost the session with GPU server %s (device %d: %s; the worker serving this slice ended, "
             "so its memory and kernels are gone; calls now return CUDA_ERROR_DEVICE_UNAVAILABLE; "
             "check the dispatcher's log on that server and rerun the application)",
             s->server, s->index, why);
}

static int reserve(rgpu_session *s, size_t more) {
    if (s->slen + more <= s->scap) return 0;
    size_t cap = s->scap ? s->scap : 65536;
    while (cap < s->slen + more) cap *= 2;
    uint8_t *nb = realloc(s->sbuf, cap);
    if (!nb) return -1;
    s->sbuf = nb;
    s->scap = cap;
    return 0;
}

static int flush_locked(rgpu_session *s) {
    s->flush_armed = 0;
    if (s->dead) return -1;
    if (s->slen && g_stats_on == 1) __atomic_add_fetch(&g_sends, 1, __ATOMIC_RELAXED);
    if (s->slen) s->last_send_ns = now_ns();
    if (s->slen && send_all(s->fd, s->sbuf, s->slen)) {
        session_fail(s, strerror(errno));
        s->slen = 0;
        return -1;
    }
    s->slen = 0;
    return 0;
}

/* ------------------------------------------------------------------ background flusher
 * Async frames wait in the send buffer so that many launches share one send(2); a small
 * thread sends whatever is left after a millisecond, so work never waits for the next sync. */

static pthread_mutex_t g_flush_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_flush_cond = PTHREAD_COND_INITIALIZER;
static int g_flush_pending;
static int g_flusher_started;

static void *flusher_main(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&g_flush_lock);
        while (!g_flush_pending) pthread_cond_wait(&g_flush_cond, &g_flush_lock);
        g_flush_pending = 0;
        pthread_mutex_unlock(&g_flush_lock);
        struct timespec ts = {0, ASYNC_DELAY_NS};
        nanosleep(&ts, NULL);
        for (int i = 0; i < rgpu_session_count; i++) {
            rgpu_session *s = &rgpu_sessions[i];
            if (!s->slen && !s->flush_armed) continue;
            pthread_mutex_lock(&s->lock);
            flush_locked(s);
            pthread_mutex_unlock(&s->lock);
        }
    }
    return NULL;
}

static void wake_flusher(void) {
    pthread_mutex_lock(&g_flush_lock);
    if (!g_flusher_started) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, flusher_main, NULL) == 0) g_flusher_started = 1;
        pthread_attr_destroy(&attr);
    }
    g_flush_pending = 1;
    pthread_cond_signal(&g_flush_cond);
    pthread_mutex_unlock(&g_flush_lock);
}

/* ------------------------------------------------------------------ frames */


/* The worker makes this context current before running the call (0: none). The CUDA
 * library overrides it; NVML sessions have no contexts. */
__attribute__((weak)) uint64_t rgpu_header_ctx(int session) {
    (void)session;
    return 0;
}

/* Before any call reaches a worker (libcuda overrides it: managed.c brings the GPU's copy of
 * managed memory up to date; it must run before the session's lock is taken). */
__attribute__((weak)) void rgpu_managed_before_call(uint16_t op) { (void)op; }
__attribute__((weak)) void rgpu_managed_sync_begins(void) {}
__attribute__((weak)) int rgpu_hostfn_any(void) { return 0; }   /* libnvidia-ml.so.1 has no host functions */

/* The CUDA library overrides it (cuda_cache.c): a pipelined attribute set may have been refused. */
__attribute__((weak)) void rgpu_attr_sets_refused(void) {}

/* Set while this thread runs a host node's function (host_nodes.c): CUDA forbids calls from one,
 * and this thread holds the session the function's HOST_CALL came on. */
__thread int rgpu_in_host_fn;

/* The CUDA library overrides it (host_nodes.c); NVML sessions have no host nodes. */
__attribute__((weak)) int rgpu_run_host_call(int session, uint64_t id, int32_t status, const uint8_t *in,
                                             size_t inlen, uint8_t **out, size_t *outlen) {
    (void)session, (void)id, (void)status, (void)in, (void)inlen;
    *out = NULL;
    *outlen = 0;
    return -1;
}

CUresult rgpu_begin_session(rgpu_call *c, uint16_t op, int session) {
    if (rgpu_in_host_fn) {
        memset(c, 0, sizeof *c);
        return CUDA_ERROR_NOT_PERMITTED;
    }
    rgpu_managed_before_call(op);
    memset(c, 0, sizeof *c);
    if (session < 0 || session >= rgpu_session_count) return CUDA_ERROR_INVALID_DEVICE;
    rgpu_session *s = &rgpu_sessions[session];
    pthread_mutex_lock(&s->lock);
    if (s->closed || s->dead) {
        pthread_mutex_unlock(&s->lock);
        return s->closed ? CUDA_ERROR_DEINITIALIZED : CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    if (reserve(s, RGPU_HEADER_SIZE + 256)) {
        pthread_mutex_unlock(&s->lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    c->s = s;
    c->op = op;
    c->frame_start = s->slen;
    rgpu_put_header(s->sbuf + s->slen, 0, op, 0, ++s->seq, 0, rgpu_header_ctx(session));
    s->slen += RGPU_HEADER_SIZE;
    return CUDA_SUCCESS;
}

void rgpu_retarget(rgpu_call *c, uint16_t op) {
    c->op = op;
    memcpy(c->s->sbuf + c->frame_start + 4, &op, 2);
}

void rgpu_put(rgpu_call *c, const void *p, size_t n) {
    rgpu_session *s = c->s;
    if (reserve(s, n)) {
        session_fail(s, "out of memory while building a request");
        return;
    }
    memcpy(s->sbuf + s->slen, p, n);
    s->slen += n;
}

/* Payloads are padded to a multiple of 8 bytes, so every frame starts 8-aligned in the
 * worker's receive buffer and a launch's parameter block can be handed to the driver in place. */
static size_t pad_of(size_t n) { return (8 - n % 8) % 8; }

static void patch_length(rgpu_call *c, size_t extra) {
    rgpu_session *s = c->s;
    size_t payload = s->slen - c->frame_start - RGPU_HEADER_SIZE;
    if (!extra) {
        size_t pad = pad_of(payload);
        if (pad && reserve(s, pad) == 0) {
            memset(s->sbuf + s->slen, 0, pad);
            s->slen += pad;
            payload += pad;
        }
    } else {
        payload += extra + pad_of(payload + extra);
    }
    uint32_t len = (uint32_t)payload;
    memcpy(s->sbuf + c->frame_start, &len, 4);
}

CUresult rgpu_put_bulk(rgpu_call *c, const void *p, size_t n) {
    rgpu_session *s = c->s;
    size_t pad = pad_of(s->slen - c->frame_start - RGPU_HEADER_SIZE + n);
    patch_length(c, n);
    if (flush_locked(s)) return CUDA_ERROR_DEVICE_UNAVAILABLE;
    static const uint8_t zeros[8];
    if ((n && send_all(s->fd, p, n)) || (pad && send_all(s->fd, zeros, pad))) {
        session_fail(s, strerror(errno));
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    c->frame_start = (size_t)-1; /* already complete */
    return CUDA_SUCCESS;
}

CUresult rgpu_async(rgpu_call *c) {
    rgpu_session *s = c->s;
    CUresult r = CUDA_SUCCESS;
    if (c->frame_start != (size_t)-1) patch_length(c, 0);
    if (stats_on()) __atomic_add_fetch(&g_async_calls[c->op % STATS_OPS], 1, __ATOMIC_RELAXED);
    if (s->dead) r = CUDA_ERROR_DEVICE_UNAVAILABLE;
    else if (s->slen >= ASYNC_FLUSH_BYTES || now_ns() - s->last_send_ns > ASYNC_DELAY_NS)
        r = flush_locked(s) ? CUDA_ERROR_DEVICE_UNAVAILABLE : CUDA_SUCCESS;
    /* Wake the flusher once per batch, not per call: a launch storm costs no futex calls. */
    int wake = s->slen > 0 && !s->flush_armed;
    if (wake) s->flush_armed = 1;
    pthread_mutex_unlock(&s->lock);
    c->s = NULL;
    if (wake) wake_flusher();
    return r;
}

/* A pipelined call that other processes wait for (an NCCL collective: its peers' workers block until
 * this one's worker runs it): sent now, not when the flusher next runs. */
CUresult rgpu_async_now(rgpu_call *c) {
    rgpu_session *s = c->s;
    if (c->frame_start != (size_t)-1) patch_length(c, 0);
    if (stats_on()) __atomic_add_fetch(&g_async_calls[c->op % STATS_OPS], 1, __ATOMIC_RELAXED);
    CUresult r = s->dead || flush_locked(s) ? CUDA_ERROR_DEVICE_UNAVAILABLE : CUDA_SUCCESS;
    pthread_mutex_unlock(&s->lock);
    c->s = NULL;
    return r;
}

static void show_message(rgpu_session *s, const char *msg, size_t n) {
    if (rgpu_error_log_add) rgpu_error_log_add(RGPU_LOG_ERROR, msg, n);   /* the worker explains a refusal */
    if (s->messages_shown >= MAX_MESSAGES_SHOWN) return;
    s->messages_shown++;
    char line[1024];
    if (n >= sizeof line) n = sizeof line - 1;
    memcpy(line, msg, n);
    line[n] = 0;
    /* The worker's messages already carry the "rgpu: <component>:" prefix. */
    if (rgpu_log_level() >= RGPU_LOG_WARN) {
        char out[1100];
        int k = snprintf(out, sizeof out, "%s%s\n", line,
                         s->messages_shown == MAX_MESSAGES_SHOWN ? " [further messages suppressed]" : "");
        ssize_t ignored = write(2, out, (size_t)k);
        (void)ignored;
    }
}

static CUresult sync_wait(rgpu_call *c, rgpu_session *s, uint32_t want_seq);
static void finish_pending_send(rgpu_session *s);
static int pending_send_finished(const rgpu_session *s);

/* RGPU_SYNC_BACKTRACE=OP: where an application's round trips of one operation come from (the
 * numbers are remoting/native/generated/rgpu_ops.h's). The 1st, 51st, ... 451st synchronous call of
 * OP prints its thread and native backtrace to stderr: the library of the caller (libtorch_cuda,
 * libcudnn, ...) and, where it exports them, its functions. */
static void sync_backtrace(uint16_t op) {
    static int wanted = -2;
    static unsigned seen;
    if (wanted == -2) {
        const char *v = getenv("RGPU_SYNC_BACKTRACE");
        wanted = v && *v ? atoi(v) : -1;
    }
    if (wanted < 0 || op != (uint16_t)wanted) return;
    unsigned n = __atomic_add_fetch(&seen, 1, __ATOMIC_RELAXED);
    if (n % 50 != 1 || n > 500) return;
    void *frames[32];
    int depth = backtrace(frames, 32);
    fprintf(stderr, "rgpu: synchronous call %u of operation %d, thread %ld:\n", n, op, (long)syscall(SYS_gettid));
    backtrace_symbols_fd(frames, depth, 2);
}

CUresult rgpu_sync(rgpu_call *c) {
    rgpu_session *s = c->s;
    if (c->frame_start != (size_t)-1) patch_length(c, 0);
    uint32_t want_seq = s->seq; /* the lock is held since rgpu_begin numbered this call */
    uint64_t started = stats_on() ? now_ns() : 0;
    rgpu_managed_sync_begins();   /* what this call covers is told after its reply (managed.c) */
    sync_backtrace(c->op);
    CUresult r = sync_wait(c, s, want_seq);
    /* A background copy whose thread is done is collected here; one still sending is left to it:
     * the worker receives it on a thread of its own and answers calls meanwhile (an event query
     * of the application's other thread). Its failure is the worker's to report: every byte that
     * did not arrive fails the worker's receive, whose error answers the first synchronising call
     * after it (one report, whichever side saw the lane fail first). */
    if (s->pending && r != CUDA_ERROR_DEVICE_UNAVAILABLE && pending_send_finished(s)) finish_pending_send(s);
    /* The first reply after pipelined attribute sets: a failure may be one of them refused. */
    if (s->attr_sets_unconfirmed) {
        s->attr_sets_unconfirmed = 0;
        if (r != CUDA_SUCCESS) rgpu_attr_sets_refused();
    }
    if (started) {
        __atomic_add_fetch(&g_sync_calls[c->op % STATS_OPS], 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&g_sync_wait_ns[c->op % STATS_OPS], now_ns() - started, __ATOMIC_RELAXED);
    }
    return r;
}

/* A host node of the worker's graph waits for this process to run its function (protocol 5):
 * run it here, on the thread that read the frame, then answer HOST_DONE. The worker's node holds
 * the graph until then. An id this process never registered is refused, never called: the frame
 * names a table entry, not an address. The send buffer is empty (flushed before any read, and
 * the session stays locked), so the answer goes straight out. */
static int host_call(rgpu_session *s, uint32_t seq, uint64_t id, int32_t status, uint32_t len) {
    uint8_t *in = len ? malloc(len) : NULL;
    if (len && (!in || recv_all(s->fd, in, len))) {
        free(in);
        session_fail(s, in ? strerror(errno) : "out of memory for a host function's data");
        return -1;
    }
    uint8_t *out = NULL;
    size_t outlen = 0;
    rgpu_in_host_fn++;
    int ran = rgpu_run_host_call(s->index, id, status, in, len, &out, &outlen);
    rgpu_in_host_fn--;
    free(in);
    if (ran < 0)
        rgpu_log(RGPU_LOG_ERROR, "GPU server %s asked to run host function %llu, which this process never "
                 "registered (refused; the graph goes on without it; check that client and server run the same "
                 "rgpu version)", s->server, (unsigned long long)id);
    uint8_t h[RGPU_HEADER_SIZE];
    rgpu_put_header(h, (uint32_t)outlen, RGPU_OP_HOST_DONE, 0, seq,
               ran < 0 ? RGPU_HOST_DONE_UNKNOWN_ID : RGPU_HOST_DONE_RAN, 0);
    int failed = send_all(s->fd, h, sizeof h) || (outlen && send_all(s->fd, out, outlen));
    free(out);
    if (failed) {
        session_fail(s, strerror(errno));
        return -1;
    }
    return 0;
}

/* How long a synchronous call polls for its reply before it sleeps in recv (RGPU_REPLY_SPIN_US;
 * 0: never poll). A small call's reply (`tensor.item()`, a query) comes back within tens of
 * microseconds, and waking a thread that slept for it costs several more on loopback or a fast
 * network; the application's thread is waiting for the reply anyway, as CUDA's own
 * synchronisation spins before it yields. By default 50 us where the process may use 4 CPUs or
 * more (on fewer, a polling client takes the CPU that a worker on the same host needs). */
static long reply_spin_ns(void) {
    static long ns = -1;
    if (ns < 0) {
        const char *v = getenv("RGPU_REPLY_SPIN_US");
        cpu_set_t cpus;
        long fallback = sched_getaffinity(0, sizeof cpus, &cpus) == 0 && CPU_COUNT(&cpus) >= 4 ? 50 : 0;
        long us = v && *v ? strtol(v, NULL, 10) : fallback;
        ns = us < 0 ? 0 : us > 10000 ? 10000000 : us * 1000;
    }
    return ns;
}

static void spin_for_reply(int fd) {
    long budget = reply_spin_ns();
    if (!budget) return;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    do {
        if (poll(&p, 1, 0) != 0) return;   /* readable, or an error recv will report */
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < budget);
}

static CUresult sync_wait(rgpu_call *c, rgpu_session *s, uint32_t want_seq) {
    if (flush_locked(s)) return CUDA_ERROR_DEVICE_UNAVAILABLE;
    for (;;) {
        uint8_t h[RGPU_HEADER_SIZE];
        spin_for_reply(s->fd);
        if (recv_all(s->fd, h, sizeof h)) {
            session_fail(s, errno == ECONNRESET ? "connection closed by the server" : strerror(errno));
            return CUDA_ERROR_DEVICE_UNAVAILABLE;
        }
        uint32_t len, seq;
        uint16_t op, flags;
        memcpy(&len, h, 4);
        memcpy(&op, h + 4, 2);
        memcpy(&flags, h + 6, 2);
        memcpy(&seq, h + 8, 4);
        if (op == RGPU_OP_DATA) {
            size_t room = c->sink_cap - c->sink_got;
            size_t take = len < room ? len : room;
            if (take && recv_all(s->fd, c->sink + c->sink_got, take)) {
                session_fail(s, strerror(errno));
                return CUDA_ERROR_DEVICE_UNAVAILABLE;
            }
            c->sink_got += take;
            if (len > take && recv_discard(s->fd, len - take)) {
                session_fail(s, strerror(errno));
                return CUDA_ERROR_DEVICE_UNAVAILABLE;
            }
            continue;
        }
        if (op == RGPU_OP_NOTICE) {   /* the reply that follows carries what it says */
            if (len && recv_discard(s->fd, len)) {
                session_fail(s, strerror(errno));
                return CUDA_ERROR_DEVICE_UNAVAILABLE;
            }
            continue;
        }
        if (op == RGPU_OP_HOST_CALL) {
            uint32_t aux;
            uint64_t id;
            memcpy(&aux, h + 12, 4);
            memcpy(&id, h + 16, 8);
            if (host_call(s, seq, id, (int32_t)aux, len)) {
                if (!s->dead) session_fail(s, strerror(errno));
                return CUDA_ERROR_DEVICE_UNAVAILABLE;
            }
            continue;
        }
        if (op != RGPU_OP_REPLY || seq != want_seq || len < 4) {
            char why[160];
            snprintf(why, sizeof why, "protocol error: frame op %u seq %u while waiting for the reply to %u",
                     op, seq, want_seq);
            session_fail(s, why);
            return CUDA_ERROR_DEVICE_UNAVAILABLE;
        }
        if (len > s->rcap) {
            uint8_t *nb = realloc(s->rbuf, len);
            if (!nb) { session_fail(s, "out of memory for a reply"); return CUDA_ERROR_DEVICE_UNAVAILABLE; }
            s->rbuf = nb;
            s->rcap = len;
        }
        if (recv_all(s->fd, s->rbuf, len)) {
            session_fail(s, strerror(errno));
            return CUDA_ERROR_DEVICE_UNAVAILABLE;
        }
        int32_t result;
        memcpy(&result, s->rbuf, 4);
        size_t off = 4;
        if ((flags & RGPU_REPLY_HAS_MESSAGE) && len >= 8) {
            uint32_t mlen;
            memcpy(&mlen, s->rbuf + 4, 4);
            if (8 + (size_t)mlen <= len) {
                show_message(s, (const char *)s->rbuf + 8, mlen);
                off = 8 + mlen;
            }
        }
        c->rp = s->rbuf + off;
        c->rlen = len - off;
        c->roff = 0;
        return result;
    }
}

void rgpu_end(rgpu_call *c) {
    if (!c->s) return;
    pthread_mutex_unlock(&c->s->lock);
    c->s = NULL;
}

void rgpu_abort(rgpu_call *c) {
    rgpu_session *s = c->s;
    if (!s) return;
    /* Not sent yet (nothing flushes a frame before rgpu_async/rgpu_sync): take it back whole. */
    if (c->frame_start != (size_t)-1 && c->frame_start <= s->slen) {
        s->slen = c->frame_start;
        s->seq--;
    }
    rgpu_end(c);
}

void rgpu_get(rgpu_call *c, void *p, size_t n) {
    size_t avail = c->rlen > c->roff ? c->rlen - c->roff : 0;
    size_t take = n < avail ? n : avail;
    if (take) memcpy(p, c->rp + c->roff, take);
    if (take < n) memset((uint8_t *)p + take, 0, n - take);
    c->roff += n;
}

size_t rgpu_remaining(const rgpu_call *c) { return c->rlen > c->roff ? c->rlen - c->roff : 0; }

/* ------------------------------------------------------------------ connecting */

/* A size setting in bytes from the environment: `fallback` when unset or not a number, clamped to
 * [lo, hi]. */
static uint64_t env_bytes(const char *name, uint64_t fallback, uint64_t lo, uint64_t hi) {
    const char *v = getenv(name);
    char *end = NULL;
    unsigned long long n = v && *v ? strtoull(v, &end, 10) : 0;
    if (!v || !*v || !end || *end) {
        if (v && *v) rgpu_log(RGPU_LOG_WARN, "%s=%s is not a number of bytes (using %llu)", name, v,
                              (unsigned long long)fallback);
        return fallback;
    }
    return n < lo ? lo : n > hi ? hi : n;
}

/* SO_SNDBUF/SO_RCVBUF of each data-path socket (RGPU_SOCKET_BUFFER_BYTES; 0: leave them to the
 * kernel). Striped copies want each lane's buffer to cover its share of the link's bandwidth-delay
 * product; Linux caps an explicit size at net.core.rmem_max/wmem_max. */
static int socket_buffer_bytes(void) {
    static int bytes = -1;
    if (bytes < 0) bytes = (int)env_bytes("RGPU_SOCKET_BUFFER_BYTES", RGPU_SOCKET_BUFFER_BYTES, 0, 1u << 30);
    return bytes;
}

/* connect(2), giving up after timeout_ms (< 0: as long as the kernel tries). */
static int connect_within(int fd, const struct sockaddr *addr, socklen_t len, int timeout_ms) {
    if (timeout_ms < 0) return connect(fd, addr, len);
    int fl = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    int r = connect(fd, addr, len);
    if (r && errno == EINPROGRESS) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int k = poll(&p, 1, timeout_ms);
        int err = 0;
        socklen_t el = sizeof err;
        if (k == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) == 0 && !err) r = 0;
        else errno = k == 0 ? ETIMEDOUT : err ? err : errno;
    }
    int saved = errno;
    fcntl(fd, F_SETFL, fl);
    errno = saved;
    return r;
}

static int dial_within(const char *server, int timeout_ms, char *why, size_t whylen);

static int dial(const char *server, char *why, size_t whylen) { return dial_within(server, -1, why, whylen); }

static int dial_within(const char *server, int timeout_ms, char *why, size_t whylen) {
    char host[256];
    const char *colon = strrchr(server, ':');
    if (!colon || colon == server) {
        snprintf(why, whylen, "bad server address %s (want host:port)", server);
        return -1;
    }
    size_t hl = (size_t)(colon - server);
    if (hl >= sizeof host) hl = sizeof host - 1;
    memcpy(host, server, hl);
    host[hl] = 0;
    if (host[0] == '[' && hl >= 2 && host[hl - 1] == ']') {
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = 0;
    }
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(host, colon + 1, &hints, &res);
    if (rc) {
        snprintf(why, whylen, "cannot resolve %s: %s", host, gai_strerror(rc));
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (connect_within(fd, a->ai_addr, a->ai_addrlen, timeout_ms) == 0) break;
        snprintf(why, whylen, "cannot connect: %s", strerror(errno));
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        int big = socket_buffer_bytes();
        if (big > 0) {   /* 0: the kernel sizes them (autotuning, up to net.ipv4.tcp_rmem/tcp_wmem's max) */
            setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
            setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
        }
    }
    return fd;
}

/* RGPU_SLICES="host:port,token;host:port,token" (flexrun sets it): slice i is device i. */
static int parse_slices(const char *text) {
    rgpu_session_count = 0;
    const char *p = text;
    while (p && *p && rgpu_session_count < RGPU_MAX_SESSIONS) {
        const char *end = strchr(p, ';');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        const char *comma = memchr(p, ',', n);
        if (n && comma) {
            rgpu_session *s = &rgpu_sessions[rgpu_session_count];
            size_t sl = (size_t)(comma - p), tl = n - sl - 1;
            if (sl >= sizeof s->server || tl >= sizeof s->token) return -1;
            memset(s, 0, sizeof *s);
            memcpy(s->server, p, sl);
            memcpy(s->token, comma + 1, tl);
            s->index = rgpu_session_count;
            s->fd = -1;
            pthread_mutex_init(&s->lock, NULL);
            rgpu_session_count++;
        } else if (n) {
            return -1;
        }
        p = end ? end + 1 : NULL;
    }
    return rgpu_session_count > 0 ? 0 : -1;
}

static void hex_into(char *out, const uint8_t *p, size_t n) {
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = hex[p[i] >> 4];
        out[2 * i + 1] = hex[p[i] & 15];
    }
}

/* A HELLO frame: the token and `info` (JSON), flags. */
static void hello_bytes(const char *token, int flags, const char *info, size_t ilen_, uint8_t **out, size_t *outlen) {
    uint32_t tl = (uint32_t)strlen(token), ilen = (uint32_t)ilen_;
    uint32_t version = RGPU_PROTOCOL_VERSION, fl = (uint32_t)flags;
    size_t plen = 4 + 4 + 4 + 4 + tl + 4 + ilen;
    uint8_t *f = malloc(RGPU_HEADER_SIZE + plen);
    rgpu_put_header(f, (uint32_t)plen, RGPU_OP_HELLO, 0, 0, 0, 0);
    uint8_t *b = f + RGPU_HEADER_SIZE;
    memcpy(b, "RGPU", 4);
    memcpy(b + 4, &version, 4);
    memcpy(b + 8, &fl, 4);
    memcpy(b + 12, &tl, 4);
    memcpy(b + 16, token, tl);
    memcpy(b + 16 + tl, &ilen, 4);
    memcpy(b + 20 + tl, info, ilen);
    *out = f;
    *outlen = RGPU_HEADER_SIZE + plen;
}

/* How many connections carry a large copy's bytes (RGPU_LANES; 1: the session's own). */
static int lanes_setting(void) {
    static int lanes = -1;
    if (lanes < 0) lanes = (int)env_bytes("RGPU_LANES", RGPU_DEFAULT_LANES, 1, RGPU_MAX_LANES);
    return lanes;
}

static void hello_frame(rgpu_session *s, int flags, int lanes, uint8_t **out, size_t *outlen) {
    char prog[256] = "";
    ssize_t k = readlink("/proc/self/exe", prog, sizeof prog - 1);
    if (k > 0) prog[k] = 0;
    for (char *q = prog; *q; q++)
        if (*q == '"' || *q == '\\' || (unsigned char)*q < 0x20) *q = '?';
    /* Protocol 10: "ucx" carries this session's UCX worker address (hex) when it offers UCX. */
    const void *address = NULL;
    size_t alen = s->ucx ? rgpu_ucx_address(s->ucx, &address) : 0;
    size_t cap = 640 + 2 * alen;
    char *info = malloc(cap);
    int il = snprintf(info, cap, "{\"pid\":%d,\"uid\":%d,\"program\":\"%s\"", (int)getpid(), (int)getuid(), prog);
    if (alen) {
        static const char hex[] = "0123456789abcdef";
        il += snprintf(info + il, cap - (size_t)il, ",\"ucx\":\"");
        for (size_t i = 0; i < alen; i++) {
            info[il++] = hex[((const uint8_t *)address)[i] >> 4];
            info[il++] = hex[((const uint8_t *)address)[i] & 15];
        }
        info[il++] = '"';
    }
    /* Protocol 12: the data lanes this session opens, and the key each of them proves itself with. */
    if (lanes > 1) {
        il += snprintf(info + il, cap - (size_t)il, ",\"lanes\":%d,\"lane_key\":\"", lanes);
        hex_into(info + il, s->lane_key, sizeof s->lane_key);
        il += 2 * (int)sizeof s->lane_key;
        info[il++] = '"';
    }
    info[il++] = '}';
    hello_bytes(s->token, flags, info, (size_t)il, out, outlen);
    free(info);
}

/* Open the session's data lanes (before its HELLO goes out): each a connection whose HELLO carries
 * the session's token and lane key. 0 when all of them are open; else -1 and `why` says which lane
 * failed (the caller closes the ones that opened: a session has all its lanes or none). */
#define LANE_CONNECT_MS 2000

static int open_lanes(rgpu_session *s, int lanes, char *why, size_t whylen) {
    char cause[512];
    for (int i = 0; i < lanes; i++) {
        /* A server that does not accept at once (not a dispatcher, or a stuck one) costs 2 s, not
         * the kernel's minutes of retries. */
        int fd = dial_within(s->server, LANE_CONNECT_MS, cause, sizeof cause);
        if (fd < 0) {
            snprintf(why, whylen, "cannot open data lane %d to GPU server %s (%s)", i, s->server, cause);
            return -1;
        }
        s->lanes[s->nlanes++] = fd;
        char info[160];
        int il = snprintf(info, sizeof info, "{\"lane\":%d,\"lane_key\":\"", i);
        hex_into(info + il, s->lane_key, sizeof s->lane_key);
        il += 2 * (int)sizeof s->lane_key;
        info[il++] = '"';
        info[il++] = '}';
        uint8_t *f;
        size_t fl;
        hello_bytes(s->token, RGPU_HELLO_LANE, info, (size_t)il, &f, &fl);
        int failed = send_all(fd, f, fl);
        free(f);
        if (failed) {
            snprintf(why, whylen, "cannot send to data lane %d of GPU server %s (%s)", i, s->server, strerror(errno));
            return -1;
        }
    }
    return 0;
}

/* How long a HELLO waits for its answer (RGPU_HANDSHAKE_TIMEOUT_S, default 120 s: the worker
 * starts, initialises CUDA and waits up to 3 s for the lanes first): a server that accepts and never
 * answers (not a dispatcher, or a stuck one) must not hang the application. */
static int handshake_timeout_s(void) {
    const char *v = getenv("RGPU_HANDSHAKE_TIMEOUT_S");
    int t = v && *v ? atoi(v) : 0;
    return t > 0 ? t : 120;
}

static void set_recv_timeout(int fd, int seconds) {
    struct timeval tv = {seconds, 0};
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

/* The worker's UCX address from WELCOME (after the description; none: the server chose TCP).
 * retry_in_ms > 0: the session connects again after that pause if the dispatcher's front door closed
 * this connection before reading its HELLO (a REFUSE flagged REFUSE_RETRY): then *door_closed is set
 * and the refusal is only logged at RGPU_LOG=info; otherwise (and on the last try) it is printed. */
static CUresult read_welcome(rgpu_session *s, int retry_in_ms, int *door_closed, uint8_t **ucx_peer, size_t *ucx_len,
                             uint32_t *lanes) {
    *door_closed = 0;
    uint8_t h[RGPU_HEADER_SIZE];
    int timeout_s = handshake_timeout_s();
    set_recv_timeout(s->fd, timeout_s);
    int failed = recv_all(s->fd, h, sizeof h), timed_out = failed && (errno == EAGAIN || errno == EWOULDBLOCK);
    if (timed_out) {
        rgpu_log(RGPU_LOG_ERROR, "GPU server %s did not answer the HELLO of device %d within %d s (is that port "
                 "an rgpu dispatcher, and is it overloaded? its log says; RGPU_HANDSHAKE_TIMEOUT_S sets the wait)",
                 s->server, s->index, timeout_s);
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    if (failed) {
        rgpu_log(RGPU_LOG_ERROR, "GPU server %s closed the connection during the handshake "
                 "(is that port an rgpu dispatcher? check its log)", s->server);
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    uint32_t len;
    uint16_t op, frame_flags;
    memcpy(&len, h, 4);
    memcpy(&op, h + 4, 2);
    memcpy(&frame_flags, h + 6, 2);
    *ucx_peer = NULL;
    *ucx_len = 0;
    if (len > (1u << 20) || (op != RGPU_OP_WELCOME && op != RGPU_OP_REFUSE)) {
        rgpu_log(RGPU_LOG_ERROR, "GPU server %s sent frame %u during the handshake (is that port an "
                 "rgpu dispatcher?; check the adaptor.conf server address)", s->server, op);
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    uint8_t *b = malloc(len + 1);
    failed = !b || recv_all(s->fd, b, len);
    set_recv_timeout(s->fd, 0);   /* the session's own reads wait as long as its calls take */
    if (failed) {
        free(b);
        rgpu_log(RGPU_LOG_ERROR, "GPU server %s closed the connection during the handshake", s->server);
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    b[len] = 0;
    uint32_t version = 0;
    if (len >= 4) memcpy(&version, b, 4);
    CUresult r = CUDA_SUCCESS;
    if (op == RGPU_OP_REFUSE) {
        if (version != RGPU_PROTOCOL_VERSION) {
            rgpu_log(RGPU_LOG_ERROR, "protocol version mismatch with %s (client speaks %u, server speaks %u; "
                     "install the same rgpu version on the CPU and GPU nodes)", s->server,
                     RGPU_PROTOCOL_VERSION, version);
        } else {
            uint32_t ml = 0;
            if (len >= 8) memcpy(&ml, b + 4, 4);
            if (8 + (size_t)ml > len) ml = len > 8 ? len - 8 : 0;
            char msg[1024];
            size_t n = ml < sizeof msg - 1 ? ml : sizeof msg - 1;
            memcpy(msg, b + 8, n);
            msg[n] = 0;
            if ((frame_flags & RGPU_REFUSE_RETRY) && retry_in_ms > 0) {
                *door_closed = 1;
                rgpu_log(RGPU_LOG_INFO, "device %d: connecting to GPU server %s again in %d ms (its front door "
                         "closed the connection before reading the HELLO: %s)", s->index, s->server, retry_in_ms, msg);
            } else {
                char line[1200];
                int k = snprintf(line, sizeof line, "%s [server %s, device %d]\n", msg, s->server, s->index);
                if (k >= (int)sizeof line) k = (int)sizeof line - 1;   /* cut short: its newline is lost */
                ssize_t ignored = write(2, line, (size_t)k);
                (void)ignored;
            }
        }
        r = CUDA_ERROR_DEVICE_UNAVAILABLE;
    } else if (len < 28) {
        rgpu_log(RGPU_LOG_ERROR, "GPU server %s sent a short WELCOME", s->server);
        r = CUDA_ERROR_DEVICE_UNAVAILABLE;
    } else {
        memcpy(&s->version, b, 4);
        memcpy(&s->driver_version, b + 4, 4);
        memcpy(&s->memory_limit, b + 8, 8);
        memcpy(&s->compute_percent, b + 16, 4);
        memcpy(&s->welcome_flags, b + 20, 4);
        uint32_t dl;
        memcpy(&dl, b + 24, 4);
        if (28 + (size_t)dl <= len) {
            size_t n = dl < sizeof s->description - 1 ? dl : sizeof s->description - 1;
            memcpy(s->description, b + 28, n);
            s->description[n] = 0;
            size_t at = 28 + (size_t)dl;
            uint32_t ul = 0;
            if (at + 4 <= len) memcpy(&ul, b + at, 4);
            if (ul && at + 4 + (size_t)ul <= len && (*ucx_peer = malloc(ul))) {
                memcpy(*ucx_peer, b + at + 4, ul);
                *ucx_len = ul;
            }
            at += 4 + (size_t)ul;
            if (at + 4 <= len) memcpy(lanes, b + at, 4);   /* protocol 12: the lanes the worker took */
        }
        if (s->version != RGPU_PROTOCOL_VERSION) {
            rgpu_log(RGPU_LOG_ERROR, "protocol version mismatch with %s (client speaks %u, server speaks %u; "
                     "install the same rgpu version on the CPU and GPU nodes)", s->server,
                     RGPU_PROTOCOL_VERSION, s->version);
            r = CUDA_ERROR_DEVICE_UNAVAILABLE;
        }
    }
    free(b);
    return r;
}

/* One frame the worker sent unasked (no reply is due: the session is locked, nothing synchronous
 * outstanding): a host function's HOST_CALL, or a NOTICE. 0, or -1 with the session failed. */
static int serve_unasked(rgpu_session *s, const char *during) {
    uint8_t h[RGPU_HEADER_SIZE];
    if (recv_all(s->fd, h, sizeof h)) {
        session_fail(s, errno == ECONNRESET ? "connection closed by the server" : strerror(errno));
        return -1;
    }
    uint32_t len, seq, aux;
    uint16_t op;
    uint64_t id;
    memcpy(&len, h, 4);
    memcpy(&op, h + 4, 2);
    memcpy(&seq, h + 8, 4);
    memcpy(&aux, h + 12, 4);
    memcpy(&id, h + 16, 8);
    if (op == RGPU_OP_HOST_CALL) {
        if (host_call(s, seq, id, (int32_t)aux, len)) {
            if (!s->dead) session_fail(s, strerror(errno));
            return -1;
        }
        return 0;
    }
    if (op == RGPU_OP_NOTICE) {
        if (len && recv_discard(s->fd, len)) {
            session_fail(s, strerror(errno));
            return -1;
        }
        return 0;
    }
    char why[160];
    snprintf(why, sizeof why, "protocol error: frame op %u seq %u %s", op, seq, during);
    session_fail(s, why);
    return -1;
}

/* ------------------------------------------------------------------ transport (UCX or TCP)
 * RGPU_TRANSPORT=auto|ucx|tcp (flexrun passes the slice environment): auto carries copies on UCX
 * when both ends have it, ucx insists on it (a session without it fails), tcp never offers it. */

enum { TRANSPORT_AUTO, TRANSPORT_UCX, TRANSPORT_TCP, TRANSPORT_BAD };

static int transport_setting(void) {
    const char *v = getenv("RGPU_TRANSPORT");
    if (!v || !*v || !strcmp(v, "auto")) return TRANSPORT_AUTO;
    if (!strcmp(v, "ucx")) return TRANSPORT_UCX;
    if (!strcmp(v, "tcp")) return TRANSPORT_TCP;
    return TRANSPORT_BAD;
}

static size_t g_ucx_min = 0;

static size_t ucx_min_bytes(void) {
    if (!g_ucx_min) {
        const char *v = getenv("RGPU_UCX_MIN_BYTES");
        char *end = NULL;
        unsigned long long n = v && *v ? strtoull(v, &end, 10) : 0;
        g_ucx_min = (end && !*end && n) ? (size_t)n : RGPU_UCX_MIN_BYTES;
    }
    return g_ucx_min;
}

/* The one line a fallback to TCP gets (per process: a job of 8 slices says it once). An application
 * that expects the same-host path (RGPU_SAME_HOST=1: `flexrun local` sets it) sees it at the default
 * log level; others at RGPU_LOG=info. */
static void say_tcp_once(int level, const char *server, const char *why) {
    static int said;
    const char *same_host = getenv("RGPU_SAME_HOST");
    int expected = same_host && !strcmp(same_host, "1");
    if (expected && level > RGPU_LOG_WARN) level = RGPU_LOG_WARN;
    if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
        rgpu_log(level, "copies to %s go over TCP, not UCX%s (%s)", server,
                 expected ? " (not the same-host path)" : "", why);
}

int rgpu_ucx_carries(const rgpu_call *c, size_t n) {
    return c->s && c->s->ucx && n >= ucx_min_bytes();
}

static double ucx_idle_s(void) {
    const char *v = getenv("RGPU_UCX_IDLE_S");
    double d = v && *v ? atof(v) : 0;
    return d > 0 ? d : 60.0;
}

static uint64_t ucx_tag(uint32_t seq, size_t i) { return (uint64_t)seq | (uint64_t)i << 32; }
static size_t ucx_chunk_count(size_t n) { return n ? (n + RGPU_UCX_CHUNK_BYTES - 1) / RGPU_UCX_CHUNK_BYTES : 1; }
static size_t ucx_chunk_len(size_t n, size_t i) {
    size_t at = i * (size_t)RGPU_UCX_CHUNK_BYTES;
    return n - at < RGPU_UCX_CHUNK_BYTES ? n - at : RGPU_UCX_CHUNK_BYTES;
}

/* A UCX copy's requests, one per chunk (protocol 15). */
typedef struct ucx_chunks {
    size_t count;
    void *req[];
} ucx_chunks;

CUresult rgpu_ucx_put_bulk(rgpu_call *c, const void *p, size_t n) {
    rgpu_session *s = c->s;
    patch_length(c, 0);
    c->frame_start = (size_t)-1;   /* complete: its bytes follow on UCX, chunk i tagged seq | i << 32 */
    if (flush_locked(s)) return CUDA_ERROR_DEVICE_UNAVAILABLE;
    char why[512];
    size_t count = ucx_chunk_count(n);
    ucx_chunks *chunks = calloc(1, sizeof *chunks + count * sizeof(void *));
    if (!chunks) {
        session_fail(s, "out of memory for a UCX copy's requests");
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    int w = 0;
    for (size_t i = 0; i < count && !w; i++)   /* all posted: UCX moves them while the worker takes each */
        w = rgpu_ucx_post(s->ucx, 0, ucx_tag(s->seq, i), (uint8_t *)p + i * (size_t)RGPU_UCX_CHUNK_BYTES,
                          ucx_chunk_len(n, i), &chunks->req[i], why, sizeof why);
    /* The worker may be waiting for this process first (a graph's host function queued before
     * the copy): serve what it sends while the bytes wait to be taken. */
    for (size_t i = 0; i < count && !w; i++) {
        while ((w = rgpu_ucx_wait(s->ucx, chunks->req[i], 0, ucx_chunk_len(n, i), ucx_idle_s(), s->fd,
                                  RGPU_UCX_YIELD_READABLE, why, sizeof why)) == 1) {
            if (serve_unasked(s, "while a copy's bytes went over UCX")) {
                free(chunks);
                return CUDA_ERROR_DEVICE_UNAVAILABLE;
            }
        }
    }
    free(chunks);
    if (w) {
        char line[600];
        snprintf(line, sizeof line, "a host-to-device copy over UCX failed: %s", why);
        session_fail(s, line);
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    return CUDA_SUCCESS;
}

CUresult rgpu_ucx_expect(rgpu_call *c, void *dst, size_t n, void **req) {
    char why[512];
    size_t count = ucx_chunk_count(n);
    ucx_chunks *chunks = calloc(1, sizeof *chunks + count * sizeof(void *));
    if (!chunks) return CUDA_ERROR_OUT_OF_MEMORY;
    for (size_t i = 0; i < count; i++) {
        if (rgpu_ucx_post(c->s->ucx, 1, ucx_tag(c->s->seq, i), (uint8_t *)dst + i * (size_t)RGPU_UCX_CHUNK_BYTES,
                          ucx_chunk_len(n, i), &chunks->req[i], why, sizeof why)) {
            rgpu_log(RGPU_LOG_ERROR, "GPU server %s: cannot post a UCX receive (%s)", c->s->server, why);
            for (size_t k = 0; k < i; k++)
                if (chunks->req[k]) rgpu_ucx_cancel(c->s->ucx, chunks->req[k], 1);
            free(chunks);
            return CUDA_ERROR_UNKNOWN;
        }
        chunks->count = i + 1;
    }
    *req = chunks;
    return CUDA_SUCCESS;
}

CUresult rgpu_ucx_finish(rgpu_call *c, void *req, size_t n, CUresult result) {
    rgpu_session *s = c->s;
    ucx_chunks *chunks = req;
    if (!chunks) return result;
    if (result != CUDA_SUCCESS || s->dead) {   /* the worker sent nothing: take the receives back */
        if (!s->dead)
            for (size_t i = 0; i < chunks->count; i++)
                if (chunks->req[i]) rgpu_ucx_cancel(s->ucx, chunks->req[i], 1);
        free(chunks);
        return result;
    }
    char why[512];
    for (size_t i = 0; i < chunks->count; i++) {
        if (rgpu_ucx_wait(s->ucx, chunks->req[i], 1, ucx_chunk_len(n, i), ucx_idle_s(), s->fd, 0, why, sizeof why)) {
            free(chunks);
            char line[600];
            snprintf(line, sizeof line, "a device-to-host copy over UCX failed: %s", why);
            session_fail(s, line);
            return CUDA_ERROR_DEVICE_UNAVAILABLE;
        }
    }
    free(chunks);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ data lanes (protocol 12) */

int rgpu_lanes_carry(const rgpu_call *c, size_t n) {
    static uint64_t min_bytes;
    if (!min_bytes) min_bytes = env_bytes("RGPU_LANE_MIN_BYTES", RGPU_LANE_MIN_BYTES, 1, UINT64_MAX);
    if (c->s && c->s->pending) finish_pending_send(c->s);   /* one copy at a time; a failed one closed them */
    return c->s && c->s->nlanes > 1 && n >= min_bytes;
}

uint64_t rgpu_lane_chunk_bytes(void) {
    static uint64_t chunk;
    /* The worker's staging slots are this size: within the protocol's bounds (64 KiB to 64 MiB). */
    if (!chunk) chunk = env_bytes("RGPU_LANE_CHUNK_BYTES", RGPU_LANE_CHUNK_BYTES, 64u << 10, 64u << 20);
    return chunk;
}

static int serve_while_striping(void *arg) {
    return serve_unasked((rgpu_session *)arg, "while a copy's bytes went over its data lanes");
}

/* ------------------------------------------------------------------ page-locked copies in the background
 * A host-to-device copy from page-locked memory returns as soon as its lanes are given the bytes,
 * as NVIDIA's cuMemcpyHtoDAsync does: the program keeps queueing work while a thread of the
 * session sends (a worker on a real GPU receives it on a thread of its own and answers the calls
 * that follow meanwhile; other workers read them after the copy). The session's next striped copy,
 * and every call that frees page-locked memory, wait for it first. A failure leaves bytes the
 * worker never receives: the worker's error answers the session's next synchronising call after
 * it (the client only logs its side). Not while host functions
 * exist: the worker may wait for one before it reads the lanes, and only a waiting caller serves
 * the connection. */
typedef struct rgpu_pending_send {
    rgpu_session *s;
    const uint8_t *p;
    size_t n;
    uint32_t seq;
    pthread_t thread;
    int result;
    int finished;   /* set by its thread as it ends (atomic) */
    char why[512];
} rgpu_pending_send;

static void *pending_send_main(void *arg) {
    rgpu_pending_send *ps = arg;
    rgpu_session *s = ps->s;
    ps->result = rgpu_lanes_send(s->lanes, s->nlanes, ps->seq, ps->p, ps->n, rgpu_lane_chunk_bytes(), -1, NULL, NULL,
                                 ucx_idle_s(), ps->why, sizeof ps->why);
    __atomic_store_n(&ps->finished, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void lanes_put_failed(rgpu_session *s, size_t n, const char *why, const char *when) {
    rgpu_log(RGPU_LOG_ERROR, "a host-to-device copy of %zu bytes to GPU server %s failed: %s (the copy did not "
             "complete: CUDA_ERROR_UNKNOWN%s; the session goes on, its later copies on its one connection)", n,
             s->server, why, when);
    close_lanes(s);
}

static int pending_send_finished(const rgpu_session *s) {
    return __atomic_load_n(&s->pending->finished, __ATOMIC_ACQUIRE);
}

/* The session's background copy is over (its lock held). A failure closes the lanes (later copies
 * go on the connection: rgpu_lanes_carry finishes it before it decides); the worker reports it. */
static void finish_pending_send(rgpu_session *s) {
    rgpu_pending_send *ps = s->pending;
    if (!ps) return;
    pthread_join(ps->thread, NULL);
    s->pending = NULL;
    s->striping = 0;
    if (s->dead) close_lanes(s);
    else if (ps->result) {
        lanes_put_failed(s, ps->n, ps->why, ", reported at the next synchronising call");
    }
    free(ps);
}

void rgpu_lanes_sends_finish(void) {
    for (int i = 0; i < rgpu_session_count; i++) {
        rgpu_session *s = &rgpu_sessions[i];
        if (!__atomic_load_n(&s->pending, __ATOMIC_ACQUIRE)) continue;
        pthread_mutex_lock(&s->lock);
        finish_pending_send(s);
        pthread_mutex_unlock(&s->lock);
    }
}

CUresult rgpu_lanes_put_bulk_async(rgpu_call *c, const void *p, size_t n) {
    rgpu_session *s = c->s;
    if (rgpu_hostfn_any()) return rgpu_lanes_put_bulk(c, p, n);
    finish_pending_send(s);   /* already done by rgpu_lanes_carry: the lanes carry one copy at a time */
    rgpu_pending_send *ps = calloc(1, sizeof *ps);
    if (!ps) return rgpu_lanes_put_bulk(c, p, n);
    patch_length(c, 0);
    c->frame_start = (size_t)-1;   /* complete: its bytes follow on the lanes */
    if (flush_locked(s)) {
        free(ps);
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    *ps = (rgpu_pending_send){.s = s, .p = p, .n = n, .seq = s->seq};
    s->striping = 1;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    sigset_t all, old;
    sigfillset(&all);   /* the application's signals go to its own threads */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int started = pthread_create(&ps->thread, &attr, pending_send_main, ps) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (!started) {   /* send it here, as a synchronous copy does */
        pending_send_main(ps);
        s->striping = 0;
        int failed = ps->result;
        if (failed) lanes_put_failed(s, n, ps->why, "");
        free(ps);
        return failed ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS;
    }
    s->pending = ps;
    return CUDA_SUCCESS;
}

CUresult rgpu_lanes_put_bulk(rgpu_call *c, const void *p, size_t n) {
    rgpu_session *s = c->s;
    finish_pending_send(s);   /* already done by rgpu_lanes_carry */
    patch_length(c, 0);
    c->frame_start = (size_t)-1;   /* complete: its bytes follow on the lanes */
    if (flush_locked(s)) return CUDA_ERROR_DEVICE_UNAVAILABLE;
    char why[512];
    /* The worker may be waiting for this process first (a graph's host function queued before the
     * copy): the calling thread serves the session's connection while the lanes send. */
    s->striping = 1;
    int r = rgpu_lanes_send(s->lanes, s->nlanes, s->seq, p, n, rgpu_lane_chunk_bytes(), s->fd, serve_while_striping, s,
                            ucx_idle_s(), why, sizeof why);
    s->striping = 0;
    if (s->dead) {
        close_lanes(s);
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    if (r == 0) return CUDA_SUCCESS;
    lanes_put_failed(s, n, why, "");
    return CUDA_ERROR_UNKNOWN;
}

CUresult rgpu_lanes_get_bulk(rgpu_call *c, void *dst, size_t n, uint64_t chunk) {
    rgpu_session *s = c->s;
    finish_pending_send(s);   /* already done by rgpu_lanes_carry */
    char why[512];
    int32_t aborted = 0;
    /* Only unasked frames (a host node's HOST_CALL, a NOTICE) may come on the session's connection
     * meanwhile: the calling thread serves them while the lane threads receive. */
    s->striping = 1;
    int r = rgpu_lanes_recv(s->lanes, s->nlanes, s->seq, n, chunk, dst, NULL, s->fd, serve_while_striping, s,
                            ucx_idle_s(), &aborted, why, sizeof why);
    s->striping = 0;
    if (s->dead) {
        close_lanes(s);
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    if (r == 0) return (CUresult)aborted;   /* the driver's refusal of part of the copy, or 0 */
    rgpu_log(RGPU_LOG_ERROR, "a device-to-host copy of %zu bytes from GPU server %s failed: %s (the copy did not "
             "complete: CUDA_ERROR_UNKNOWN; the session goes on, its later copies on its one connection)", n,
             s->server, why);
    close_lanes(s);
    return CUDA_ERROR_UNKNOWN;
}

/* ------------------------------------------------------------------ opening sessions */

/* The session's UCX worker, opened before its HELLO offers it (none with RGPU_TRANSPORT=tcp, or
 * where UCX cannot load and the transport is auto). Kept across the handshake's tries: a HELLO the
 * front door closed unread reached no worker. */
static CUresult open_ucx(rgpu_session *s, int transport) {
    if (transport == TRANSPORT_TCP) return CUDA_SUCCESS;
    char why[512] = "unknown error";
    s->ucx = rgpu_ucx_open(getenv("RGPU_UCX_LIB"), 1, why, sizeof why);
    if (!s->ucx && transport == TRANSPORT_UCX) {
        rgpu_log(RGPU_LOG_ERROR, "RGPU_TRANSPORT=ucx, but this process cannot use UCX for device %d (%s; "
                 "or set RGPU_TRANSPORT=auto to fall back to TCP)", s->index, why);
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    if (!s->ucx) say_tcp_once(RGPU_LOG_INFO, s->server, why);
    return CUDA_SUCCESS;
}

static void close_connections(rgpu_session *s) {
    close_lanes(s);
    if (s->fd >= 0) close(s->fd);
    s->fd = -1;
}

/* One try at the session's handshake, up to its HELLO: its data lanes first, then its own connection.
 * The lanes go first: the session asks for them only once all of them are open, so a lane that
 * cannot connect never keeps the dispatcher waiting for it (it drops the ones that came). The
 * session's connection is dialled last, just before its HELLO goes: until the HELLO arrives it looks
 * idle to the dispatcher's front door, which at an address's cap closes such a connection for a
 * newer one. CUDA_SUCCESS with the HELLO sent; else one line said why and nothing is left open. */
static CUresult send_hello(rgpu_session *s, int flags) {
    int lanes = (flags & RGPU_HELLO_NVML) ? 1 : lanes_setting();
    /* A new key at each try: an earlier try's lanes may still wait at the dispatcher for their session. */
    if (lanes > 1 && getrandom(s->lane_key, sizeof s->lane_key, 0) != (ssize_t)sizeof s->lane_key) lanes = 1;
    char lane_why[1024] = "";
    if (lanes > 1 && open_lanes(s, lanes, lane_why, sizeof lane_why)) {
        close_lanes(s);
        lanes = 1;
    }
    char why[512] = "unknown error";
    s->fd = dial(s->server, why, sizeof why);
    if (s->fd < 0) {
        rgpu_log(RGPU_LOG_ERROR, "cannot reach GPU server %s for device %d (%s; check that "
                 "rgpu-dispatcher runs there and the port is open)", s->server, s->index, why);
        close_lanes(s);
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    uint8_t *f;
    size_t fl;
    hello_frame(s, flags, lanes, &f, &fl);
    int failed = send_all(s->fd, f, fl);
    free(f);
    if (failed) {
        rgpu_log(RGPU_LOG_ERROR, "cannot send to GPU server %s (%s)", s->server, strerror(errno));
        close_connections(s);
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    /* Said only now: a server that cannot be reached at all gets the one line above. */
    if (lane_why[0]) rgpu_log(RGPU_LOG_WARN, "%s; its copies stay on one connection", lane_why);
    return CUDA_SUCCESS;
}

/* The session's WELCOME, its HELLO sent. A HELLO the dispatcher's front door closed unread
 * (REFUSE_RETRY: its handshake slots were full, e.g. of a neighbour's idle connections, while this
 * process was descheduled between its connect and its HELLO) goes again, lanes and all, on new
 * connections after each of these pauses (protocol.DOOR_RETRY_PAUSES_S); the last refusal is
 * printed. No session started at a refused try, so none starts twice. */
static const int door_retry_pauses_ms[] = {50, 250};

static CUresult await_welcome(rgpu_session *s, int flags, uint8_t **peer, size_t *peer_len, uint32_t *took) {
    size_t retries = sizeof door_retry_pauses_ms / sizeof *door_retry_pauses_ms;
    for (size_t i = 0;; i++) {
        int pause_ms = i < retries ? door_retry_pauses_ms[i] : 0, door_closed;
        CUresult r = read_welcome(s, pause_ms, &door_closed, peer, peer_len, took);
        if (!door_closed) return r;
        close_connections(s);
        struct timespec pause = {pause_ms / 1000, (long)(pause_ms % 1000) * 1000000L};
        while (nanosleep(&pause, &pause) && errno == EINTR) {}
        r = send_hello(s, flags);
        if (r != CUDA_SUCCESS) return r;
    }
}

/* A session that could not be opened: every call on it fails. */
static void abandon_session(rgpu_session *s) {
    if (s->ucx) rgpu_ucx_close(s->ucx);
    s->ucx = NULL;
    close_connections(s);
    s->dead = 1;
}

/* Connect every slice: all HELLOs go out first, so the workers start in parallel. */
CUresult rgpu_connect_all(int flags, const char *component) {
    g_component = component;
    int transport = (flags & RGPU_HELLO_NVML) ? TRANSPORT_TCP : transport_setting();
    if (transport == TRANSPORT_BAD) {
        rgpu_log(RGPU_LOG_ERROR, "RGPU_TRANSPORT=%s is not a transport (want auto, ucx or tcp; unset it for auto)",
                 getenv("RGPU_TRANSPORT"));
        return CUDA_ERROR_NO_DEVICE;
    }
    const char *slices = getenv("RGPU_SLICES");
    if (!slices || !*slices) {
        rgpu_log(RGPU_LOG_ERROR, "no GPU slices for this process (RGPU_SLICES is not set; run the "
                 "application under flexrun, e.g. `flexrun -- app`)");
        return CUDA_ERROR_NO_DEVICE;
    }
    if (parse_slices(slices)) {
        rgpu_log(RGPU_LOG_ERROR, "cannot parse RGPU_SLICES (want host:port,token;...; "
                 "let flexrun set it)");
        rgpu_session_count = 0;
        return CUDA_ERROR_NO_DEVICE;
    }
    CUresult result = CUDA_SUCCESS;
    for (int i = 0; i < rgpu_session_count; i++) {
        rgpu_session *s = &rgpu_sessions[i];
        CUresult r = open_ucx(s, transport);
        if (r == CUDA_SUCCESS) r = send_hello(s, flags);
        if (r != CUDA_SUCCESS) {
            abandon_session(s);
            result = r;
        }
    }
    for (int i = 0; i < rgpu_session_count; i++) {
        rgpu_session *s = &rgpu_sessions[i];
        if (s->dead) continue;
        uint8_t *peer = NULL;
        size_t peer_len = 0;
        uint32_t took = 0;
        CUresult r = await_welcome(s, flags, &peer, &peer_len, &took);
        if (r == CUDA_SUCCESS && s->nlanes && took != (uint32_t)s->nlanes) {
            /* An older dispatcher, lanes that did not all arrive, or a worker that cannot drive them. */
            rgpu_log(RGPU_LOG_INFO, "device %d: copies stay on one connection (asked for %d data lanes, the GPU "
                     "server took %u; its log says why)", i, s->nlanes, took);
            close_lanes(s);
        }
        if (r == CUDA_SUCCESS && s->ucx) {
            char ywhy[512] = "";
            if (!peer)
                snprintf(ywhy, sizeof ywhy, "the GPU server did not take UCX: its transport setting is tcp or its "
                         "worker cannot load UCX; its log says which");
            else if (rgpu_ucx_connect(s->ucx, peer, peer_len, ywhy, sizeof ywhy) == 0)
                ywhy[0] = 0;
            if (ywhy[0]) {
                rgpu_ucx_close(s->ucx);
                s->ucx = NULL;
                if (transport == TRANSPORT_UCX) {
                    rgpu_log(RGPU_LOG_ERROR, "RGPU_TRANSPORT=ucx, but device %d cannot use UCX (%s; or set "
                             "RGPU_TRANSPORT=auto to fall back to TCP)", i, ywhy);
                    r = CUDA_ERROR_DEVICE_UNAVAILABLE;
                } else {
                    say_tcp_once(RGPU_LOG_INFO, s->server, ywhy);
                }
            }
        }
        free(peer);
        if (r != CUDA_SUCCESS) {
            abandon_session(s);
            result = r;
        } else {
            if (s->ucx) close_lanes(s);   /* UCX carries the large copies: the lanes would stay idle */
            char lanes[48] = "", names[240] = "", carriers[256] = "";
            if (s->nlanes) snprintf(lanes, sizeof lanes, ", %d data lanes", s->nlanes);
            /* Which of UCX's transports carry the copies (shared memory, TCP, InfiniBand...); asked
             * of UCX only when the line is shown. */
            if (s->ucx && rgpu_log_level() >= RGPU_LOG_INFO && rgpu_ucx_describe(s->ucx, names, sizeof names))
                snprintf(carriers, sizeof carriers, ": %s", names);
            rgpu_log(RGPU_LOG_INFO, "device %d: %s (%s; transport %s%s%s)", i, s->server, s->description,
                     s->ucx ? "ucx" : "tcp", carriers, lanes);
        }
    }
    return result;
}

/* After fork() the child must not share the parent's connections: it starts afresh and
 * may call cuInit again to open sessions of its own. */
void rgpu_transport_reset_after_fork(void) {
    for (int i = 0; i < rgpu_session_count; i++) {
        rgpu_session *s = &rgpu_sessions[i];
        if (s->fd >= 0) close(s->fd);
        s->fd = -1;
        close_lanes(s);
        s->pending = NULL;   /* the parent's thread sends it: the child only forgets it */
        s->striping = 0;
        s->dead = 1;
        s->ucx = NULL;   /* the parent's UCX worker stays the parent's: the child only forgets it */
        pthread_mutex_init(&s->lock, NULL);
        s->slen = 0;
    }
    rgpu_session_count = 0;
    g_flusher_started = 0;
    g_flush_pending = 0;
    pthread_mutex_init(&g_flush_lock, NULL);
    pthread_cond_init(&g_flush_cond, NULL);
}

/* At exit: send what is buffered and a BYE, so the worker can tell an orderly end from a
 * crash. A session whose lock another thread holds (blocked in a call) is left alone. */
void rgpu_say_goodbye(void) {
    for (int i = 0; i < rgpu_session_count; i++) {
        rgpu_session *s = &rgpu_sessions[i];
        if (pthread_mutex_trylock(&s->lock)) continue;
        finish_pending_send(s);   /* a background copy's bytes go before the goodbye */
        if (!s->dead && reserve(s, RGPU_HEADER_SIZE) == 0) {
            rgpu_put_header(s->sbuf + s->slen, 0, RGPU_OP_BYE, 0, ++s->seq, 0, 0);
            s->slen += RGPU_HEADER_SIZE;
            flush_locked(s);
        }
        /* Calls after this (from other libraries' exit handlers) fail quietly, as NVIDIA's
         * driver answers during shutdown. */
        s->closed = 1;
        pthread_mutex_unlock(&s->lock);
    }
}
