/* The worker's fast path (server side, librgpu-worker.so): launches, event operations, memsets.
 *
 * A session's launches arrive as long runs of small frames (remoting/protocol.py documents the
 * layout). Decoding each one in Python and calling the driver through ctypes costs several
 * microseconds per launch, which caps a remote launch storm well below the native rate; this
 * loop runs a whole run of launches (plain, or with attributes through cuLaunchKernelEx) from the
 * worker's receive buffer in one call, so a launch costs the driver's own time plus a few
 * nanoseconds of parsing. cuDNN's RNNs put about two pipelined event operations beside every
 * launch (rgpuEventCreate, cuEventRecord, cuStreamWaitEvent, cuEventDestroy_v2: ~730 per LSTM
 * step), so the loop runs those too, with the client's events translated through the table in
 * worker_events.c. PyTorch zeroes gradients and workspaces with pipelined 1-D memsets
 * (cuMemsetD8Async, cuMemsetD16Async, cuMemsetD32Async: ~22 per ResNet-18 step, 10-15 us each
 * through Python, and each one ended the loop's run), so the loop runs those as well.
 *
 * Small device-to-host copies (`tensor.item()`) are answered here too (worker_copies.c).
 *
 * It handles only the common case and hands everything else back to the Python worker, which
 * stays the reference implementation: it stops, without consuming, at the first frame that is
 * not one of those in the current context (other op, other context, cooperative launch, a launch
 * whose attributes name an event the loop does not know or number more than 16, malformed or
 * oversized parameters, a frame shorter than its operation, a kernel not admitted yet, a stream
 * or event it does not know, an operation whose driver entry point the worker did not hand over,
 * GPU work while the compute limiter's turn is not held) or that is not complete in the buffer;
 * the Python worker then runs that frame, or says why not. A creation that fails consumes its
 * frame and ends the run: the worker words its error. The worker thread has already made the
 * session's context current.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "worker_loop.h"

#define HEADER_SIZE 24u   /* u32 len, u16 op, u16 flags, u32 seq, u32 aux, u64 ctx */
#define LAUNCH_SIZE 64u   /* u64 f, u64 stream, u32 grid[3], block[3], shmem, coop, nattrs, argsize, pad[2] */
#define MAX_PARAM_BYTES 32768u
#define LAUNCH_ATTR_SIZE 72u  /* CUlaunchAttribute: u32 id, pad, a 64-byte value */
#define MAX_LAUNCH_ATTRS 16u  /* more: the worker's path (the driver knows fewer than this many kinds) */

/* CU_LAUNCH_PARAM_BUFFER_POINTER / _SIZE / _END, as in cuda.h. */
#define PARAM_BUFFER_POINTER ((void *)(uintptr_t)1)
#define PARAM_BUFFER_SIZE ((void *)(uintptr_t)2)
#define PARAM_END ((void *)(uintptr_t)0)

static uint32_t u32_at(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint16_t u16_at(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint64_t u64_at(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* Whether the worker admitted kernel f (charged the local memory it needs to the slice): an open-
 * addressing table of handles the worker fills (native_loop.py), mask + 1 slots, 0 empty. */
static int admitted(const uint64_t *table, uint32_t mask, uint64_t f) {
    for (uint32_t i = (uint32_t)(f >> 4) & mask, n = 0; n <= mask; i = (i + 1) & mask, n++) {
        if (table[i] == f) return 1;
        if (table[i] == 0) return 0;
    }
    return 0;
}

/* The driver's stream for the client's handle (protocol 8: streams are the client's handles): an
 * open-addressing table of (handle, stream) pairs the worker fills (native_loop.py), mask + 1
 * pairs, key 0 empty, stream 0 a destroyed handle. NULL, legacy and per-thread pass as they are.
 * 0 when the handle is not there: the run stops and the worker says why. */
int rgpu_real_stream(const uint64_t *table, uint32_t mask, uint64_t s, uint64_t *out) {
    if (s <= 2) {
        *out = s;
        return 1;
    }
    for (uint32_t i = (uint32_t)(s ^ (s >> 29)) & mask, n = 0; n <= mask; i = (i + 1) & mask, n++) {
        if (table[2 * i] == s) {
            *out = table[2 * i + 1];
            return *out != 0;
        }
        if (table[2 * i] == 0) return 0;
    }
    return 0;
}

/* The driver's event for a client handle: only a live one (not unknown, destroyed, or a failed
 * creation: the worker words those errors). */
static int real_event(const rgpu_events *t, uint64_t e, uint64_t *out) {
    return rgpu_events_get(t, e, out) && *out != 0 && !(*out & RGPU_EVENT_FAILED);
}

static int event_kind(const rgpu_loop *L, uint32_t op) {
    for (int k = 0; k < RGPU_EV_KINDS; k++)
        if (L->event_ops[k] == op) return k;
    return -1;
}

/* CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out (the loop includes no CUDA header). */
typedef struct {
    unsigned grid[3], block[3], shmem;
    void *stream;
    void *attrs;
    unsigned nattrs;
} launch_config;

/* A launch's attributes, copied aligned with their client events translated to the driver's;
 * 0: one names an event the loop does not know (the worker words that error). */
static int launch_attrs(const rgpu_loop *L, const uint8_t *src, uint32_t n, uint64_t *out) {
    memcpy(out, src, (size_t)n * LAUNCH_ATTR_SIZE);
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *a = (uint8_t *)out + (size_t)i * LAUNCH_ATTR_SIZE;
        uint32_t id = u32_at(a);
        if (!id || (id != L->event_attrs[0] && id != L->event_attrs[1])) continue;
        uint64_t handle = u64_at(a + 8), event = 0;
        if (handle && !real_event(L->events, handle, &event)) return 0;
        memcpy(a + 8, &event, 8);   /* NULL stays NULL: the driver refuses it, as in Python */
    }
    return 1;
}

/* One launch at p (len payload bytes), plain or with attributes; 0: left to the worker. */
static int launch_one(rgpu_loop *L, const uint8_t *p, uint32_t len, int *result) {
    static __thread uint64_t aligned[MAX_PARAM_BYTES / 8];
    static __thread uint64_t attrs[MAX_LAUNCH_ATTRS * LAUNCH_ATTR_SIZE / 8];
    if (len < LAUNCH_SIZE || !L->gpu_work_ok) return 0;
    uint32_t coop = u32_at(p + 44), nattrs = u32_at(p + 48), argsize = u32_at(p + 52);
    if (coop || argsize > MAX_PARAM_BYTES) return 0;
    if (nattrs && (!L->launch_ex || nattrs > MAX_LAUNCH_ATTRS)) return 0;
    uint32_t attr_bytes = nattrs * LAUNCH_ATTR_SIZE;
    if ((uint64_t)argsize + attr_bytes > len - LAUNCH_SIZE) return 0;
    if (!admitted(L->admitted, L->admitted_mask, u64_at(p))) return 0;
    uint64_t stream;
    if (!rgpu_real_stream(L->streams, L->stream_mask, u64_at(p + 8), &stream)) return 0;
    if (nattrs && !launch_attrs(L, p + LAUNCH_SIZE, nattrs, attrs)) return 0;
    const uint8_t *args = p + LAUNCH_SIZE + attr_bytes;
    if ((uintptr_t)args & 7) {  /* the driver reads 8-byte parameters in place */
        memcpy(aligned, args, argsize);
        args = (const uint8_t *)aligned;
    }
    size_t size = argsize;
    void *extra[5] = {PARAM_BUFFER_POINTER, (void *)args, PARAM_BUFFER_SIZE, &size, PARAM_END};
    void *f = (void *)(uintptr_t)u64_at(p);
    if (nattrs) {
        launch_config config = {{u32_at(p + 16), u32_at(p + 20), u32_at(p + 24)},
                                {u32_at(p + 28), u32_at(p + 32), u32_at(p + 36)}, u32_at(p + 40),
                                (void *)(uintptr_t)stream, attrs, nattrs};
        *result = L->launch_ex(&config, f, NULL, extra);
        L->launched_ex++;
    } else {
        *result = L->launch(f, u32_at(p + 16), u32_at(p + 20), u32_at(p + 24), u32_at(p + 28), u32_at(p + 32),
                            u32_at(p + 36), u32_at(p + 40), (void *)(uintptr_t)stream, NULL, extra);
    }
    L->launched++;
    return 1;
}

/* One event operation at p, with the payloads of the generated handlers (api_gen.py):
 * rgpuEventCreate <QI handle, flags>, cuEventRecord <QQ event, stream>, cuEventRecordWithFlags
 * <QQI event, stream, flags>, cuStreamWaitEvent <QQI stream, event, flags>, cuEventDestroy_v2
 * <Q event>. 0: left to the worker. */
static int event_one(rgpu_loop *L, int kind, const uint8_t *p, uint32_t len, int *result) {
    static const uint32_t need[RGPU_EV_KINDS] = {12, 16, 20, 20, 8};
    uint64_t event, stream;
    if (len < need[kind]) return 0;
    switch (kind) {
    case RGPU_EV_CREATE: {
        uint64_t handle = u64_at(p);
        if (!L->event_create || !handle || !rgpu_events_reserve(L->events, 1)) return 0;
        void *created = NULL;
        *result = L->event_create(&created, u32_at(p + 8));
        if (*result) {   /* ends the run: the worker words the error (it names cuEventCreate) */
            rgpu_events_put(L->events, handle, RGPU_EVENT_FAILED | (uint32_t)*result);
            L->failed_handle = handle;
            L->failed_code = *result;
            *result = 0;
        } else {
            rgpu_events_put(L->events, handle, (uint64_t)(uintptr_t)created);
        }
        break;
    }
    case RGPU_EV_RECORD:
    case RGPU_EV_RECORD_FLAGS:
        if (!L->gpu_work_ok || (kind == RGPU_EV_RECORD ? !L->event_record : !L->event_record_flags)) return 0;
        if (!real_event(L->events, u64_at(p), &event) || !rgpu_real_stream(L->streams, L->stream_mask, u64_at(p + 8), &stream))
            return 0;
        *result = kind == RGPU_EV_RECORD
                      ? L->event_record((void *)(uintptr_t)event, (void *)(uintptr_t)stream)
                      : L->event_record_flags((void *)(uintptr_t)event, (void *)(uintptr_t)stream, u32_at(p + 16));
        break;
    case RGPU_EV_WAIT:
        if (!L->gpu_work_ok || !L->stream_wait) return 0;
        if (!rgpu_real_stream(L->streams, L->stream_mask, u64_at(p), &stream) || !real_event(L->events, u64_at(p + 8), &event))
            return 0;
        *result = L->stream_wait((void *)(uintptr_t)stream, (void *)(uintptr_t)event, u32_at(p + 16));
        break;
    case RGPU_EV_DESTROY:
        if (!L->event_destroy || !real_event(L->events, u64_at(p), &event)) return 0;
        rgpu_events_take(L->events, u64_at(p), &event);   /* gone whatever the driver says, as in Python */
        *result = L->event_destroy((void *)(uintptr_t)event);
        break;
    default:
        return 0;
    }
    L->event_counts[kind]++;
    L->run_events++;
    return 1;
}

static int memset_kind(const rgpu_loop *L, uint32_t op) {
    for (int k = 0; k < RGPU_MEMSET_KINDS; k++)
        if (L->memset_ops[k] == op) return k;
    return -1;
}

/* One pipelined 1-D memset at p, with the payloads of the generated handlers (api_gen.py):
 * cuMemsetD8Async <QBQQ>, cuMemsetD16Async <QHQQ>, cuMemsetD32Async <QIQQ> (dst, value, count,
 * stream). The Python handler checks no bounds (the driver does), nor does this. 0: left to the
 * worker. */
static int memset_one(rgpu_loop *L, int kind, const uint8_t *p, uint32_t len, int *result) {
    uint32_t width = 1u << kind;   /* of the value: 1, 2 or 4 bytes */
    uint64_t stream;
    if (len < 24u + width || !L->gpu_work_ok) return 0;
    if (!rgpu_real_stream(L->streams, L->stream_mask, u64_at(p + 16 + width), &stream)) return 0;
    uint64_t dst = u64_at(p), n = u64_at(p + 8 + width);
    void *s = (void *)(uintptr_t)stream;
    switch (kind) {
    case RGPU_MEMSET_D8:
        if (!L->memset_d8) return 0;
        *result = L->memset_d8(dst, p[8], (size_t)n, s);
        break;
    case RGPU_MEMSET_D16:
        if (!L->memset_d16) return 0;
        *result = L->memset_d16(dst, u16_at(p + 8), (size_t)n, s);
        break;
    case RGPU_MEMSET_D32:
        if (!L->memset_d32) return 0;
        *result = L->memset_d32(dst, u32_at(p + 8), (size_t)n, s);
        break;
    default:
        return 0;
    }
    L->memsets++;
    return 1;
}

/* The worker checks its ctypes mirror of rgpu_loop against this before the first run. */
RGPU_EXPORT size_t rgpu_loop_size(void) { return sizeof(rgpu_loop); }

/* Runs the launches of admitted kernels, the plain event operations and the memsets at the start
 * of buf[0, avail). Returns the bytes consumed (whole frames only). Per run, in *L: the first error
 * (errors surface at the client's next synchronising call), the number of errors, the last
 * operation, and a failed creation (which ends the run). */
RGPU_EXPORT size_t rgpu_run(const uint8_t *buf, size_t avail, uint64_t ctx, rgpu_loop *L) {
    size_t used = 0;
    while (avail - used >= HEADER_SIZE) {
        const uint8_t *h = buf + used;
        uint32_t len = u32_at(h), op = u16_at(h + 4);
        if (u64_at(h + 16) != ctx || avail - used - HEADER_SIZE < len) break;
        const uint8_t *p = h + HEADER_SIZE;
        int result = 0, kind;
        if (op == L->launch_op) {
            if (!launch_one(L, p, len, &result)) break;
        } else if ((kind = event_kind(L, op)) >= 0 && L->events_ok) {
            if (!event_one(L, kind, p, len, &result)) break;
        } else if (op && (kind = memset_kind(L, op)) >= 0) {
            if (!memset_one(L, kind, p, len, &result)) break;
        } else if (op == L->dtoh_op && L->dtoh_op) {
            if (!rgpu_small_dtoh(L, p, len, u32_at(h + 8))) break;
        } else {
            break;
        }
        if (result) {
            L->errors++;
            if (!L->first_error) {
                L->first_error = result;
                L->first_error_op = op;
            }
        }
        used += HEADER_SIZE + len;
        L->last_op = op;
        if (L->failed_code || L->copy_failed || L->send_errno) break;
    }
    return used;
}
