/* The worker's launch fast path (server side, librgpu-worker.so).
 *
 * A session's launches arrive as long runs of small frames (remoting/protocol.py documents the
 * layout). Decoding each one in Python and calling the driver through ctypes costs several
 * microseconds per launch, which caps a remote launch storm well below the native rate; this
 * loop runs a whole run of plain launches from the worker's receive buffer in one call, so a
 * launch costs the driver's own time plus a few nanoseconds of parsing.
 *
 * It handles only the common case and hands everything else back to the Python worker, which
 * stays the reference implementation: it stops, without consuming, at the first frame that is
 * not a plain cuLaunchKernel in the current context (other op, other context, cooperative or
 * attributed launch, malformed or oversized parameters) or that is not complete in the buffer.
 * The worker thread has already made the session's context current.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define HEADER_SIZE 24u   /* u32 len, u16 op, u16 flags, u32 seq, u32 aux, u64 ctx */
#define LAUNCH_SIZE 64u   /* u64 f, u64 stream, u32 grid[3], block[3], shmem, coop, nattrs, argsize, pad[2] */
#define MAX_PARAM_BYTES 32768u

/* CU_LAUNCH_PARAM_BUFFER_POINTER / _SIZE / _END, as in cuda.h. */
#define PARAM_BUFFER_POINTER ((void *)(uintptr_t)1)
#define PARAM_BUFFER_SIZE ((void *)(uintptr_t)2)
#define PARAM_END ((void *)(uintptr_t)0)

typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                         unsigned bz, unsigned shmem, void *stream, void **params, void **extra);

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
static int real_stream(const uint64_t *table, uint32_t mask, uint64_t s, uint64_t *out) {
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

/* Runs the plain launches of admitted kernels at the start of buf[0, avail). Returns the bytes
 * consumed (whole frames only); *launched counts them, and the first launch error is stored in
 * *first_error unless it already holds one (errors surface at the client's next synchronising
 * call). A kernel the worker has not admitted yet, or a stream it does not know, stops the run: the
 * worker launches it itself (or says why not). */
__attribute__((visibility("default")))
size_t rgpu_run_launches(const uint8_t *buf, size_t avail, uint64_t ctx, uint32_t launch_op,
                         launch_fn launch, int32_t *first_error, uint64_t *launched,
                         const uint64_t *table, uint32_t mask, const uint64_t *streams, uint32_t stream_mask) {
    static __thread uint64_t aligned[MAX_PARAM_BYTES / 8];
    size_t used = 0;
    uint64_t count = 0;
    while (avail - used >= HEADER_SIZE) {
        const uint8_t *h = buf + used;
        uint32_t len = u32_at(h);
        if (u16_at(h + 4) != launch_op || u64_at(h + 16) != ctx) break;
        if (len < LAUNCH_SIZE || avail - used - HEADER_SIZE < len) break;
        const uint8_t *p = h + HEADER_SIZE;
        uint32_t coop = u32_at(p + 44), nattrs = u32_at(p + 48), argsize = u32_at(p + 52);
        if (coop || nattrs || argsize > MAX_PARAM_BYTES || argsize > len - LAUNCH_SIZE) break;
        if (!admitted(table, mask, u64_at(p))) break;
        uint64_t stream;
        if (!real_stream(streams, stream_mask, u64_at(p + 8), &stream)) break;
        const uint8_t *args = p + LAUNCH_SIZE;
        if ((uintptr_t)args & 7) {  /* the driver reads 8-byte parameters in place */
            memcpy(aligned, args, argsize);
            args = (const uint8_t *)aligned;
        }
        size_t size = argsize;
        void *extra[5] = {PARAM_BUFFER_POINTER, (void *)args, PARAM_BUFFER_SIZE, &size, PARAM_END};
        int r = launch((void *)(uintptr_t)u64_at(p), u32_at(p + 16), u32_at(p + 20), u32_at(p + 24),
                       u32_at(p + 28), u32_at(p + 32), u32_at(p + 36), u32_at(p + 40),
                       (void *)(uintptr_t)stream, NULL, extra);
        if (r && !*first_error) *first_error = r;
        used += HEADER_SIZE + len;
        count++;
    }
    *launched += count;
    return used;
}
