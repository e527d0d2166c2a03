/* Synchronisations the client answers itself: a stream or context that a finished
 * synchronisation left idle, with nothing sent to its slice since, is idle still.
 *
 * Every call a slice's session begins takes the next frame number (transport.c, under the
 * session's lock). A successful cuStreamSynchronize or cuCtxSynchronize, and a device-to-host copy
 * (its data arrives after everything queued on its stream before it ran), record the frame number
 * they went out as, and are quiet frames: they leave nothing queued. A later cuStreamSynchronize /
 * cuCtxSynchronize finds its stream or context recorded within the run of quiet frames that ends
 * with the slice's last frame: no work and no other call went out since, so there is nothing to
 * wait for and no error to collect (every earlier asynchronous error answered a synchronisation,
 * and these succeeded). That is an idle `torch.cuda.synchronize()`, and the synchronize after `.item()`'s
 * copy, at no round trip.
 *
 * A copy on the legacy stream (NULL or CU_STREAM_LEGACY: the client maps the per-thread API's NULL
 * to CU_STREAM_PER_THREAD) ran after every blocking stream's earlier work, as PyTorch's `.item()`
 * on its default stream does. Not answered here: the per-thread default stream (one handle, a
 * stream per thread); anything while a stream capture may be under way (the driver refuses it) or
 * while managed memory exists (managed.c hands the GPU's copy over at each real synchronisation). */
#define _GNU_SOURCE
#include <poll.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

#define IDLE_STREAM_KEY 0x20000000000ull   /* rgpu_synced_* second keys: + session */
#define IDLE_CTX_KEY 0x30000000000ull

/* Per slice, the last run of consecutive quiet frames (synchronisations and device-to-host copies
 * that succeeded: each left nothing queued behind it), as frame number + 1 (0: none). A stream
 * known idle at a frame of the run is idle at its end, and the run's end being the slice's last
 * frame means nothing else went out since. Written under the session's lock (in the calls' after
 * hooks), read without it: a call another thread begins meanwhile is not ordered before this one. */
static uint64_t g_quiet_from[RGPU_MAX_SESSIONS], g_quiet_to[RGPU_MAX_SESSIONS];

static int answerable(void) { return !rgpu_capture_possible() && !rgpu_managed_any(); }

/* Nothing arrived from the worker and the connection stands: a worker that ended (a fault of
 * another tenant under MPS ends every session of the GPU) closes it, and the next call must meet
 * that, not an answer from here. One poll(2), about a microsecond. */
static int connection_quiet(int session) {
    rgpu_session *s = &rgpu_sessions[session];
    if (s->dead || s->closed || s->fd < 0) return 0;
    struct pollfd p = {.fd = s->fd, .events = POLLIN | POLLRDHUP};
    return poll(&p, 1, 0) == 0;
}

static uint64_t frames_of(int session) {
    return (uint64_t)__atomic_load_n(&rgpu_sessions[session].seq, __ATOMIC_ACQUIRE) + 1;
}

static int special(CUstream stream) { return (uintptr_t)stream <= 2; }   /* NULL, legacy, per-thread */

static void quiet(int session, uint32_t frame) {
    uint64_t f = (uint64_t)frame + 1;
    if (__atomic_load_n(&g_quiet_to[session], __ATOMIC_RELAXED) + 1 != f)
        __atomic_store_n(&g_quiet_from[session], f, __ATOMIC_RELAXED);
    __atomic_store_n(&g_quiet_to[session], f, __ATOMIC_RELEASE);
}

/* The first frame of the quiet run that ends with the slice's last frame; 0 if the last frame was
 * not quiet (work, or any other call, went out after the last synchronisation). */
static uint64_t quiet_since(int session) {
    uint64_t to = __atomic_load_n(&g_quiet_to[session], __ATOMIC_ACQUIRE);
    if (!to || to != frames_of(session) || !connection_quiet(session)) return 0;
    return __atomic_load_n(&g_quiet_from[session], __ATOMIC_RELAXED);
}

void rgpu_idle_stream_put(CUstream stream, int session, uint32_t frame) {
    if (session < 0 || session >= rgpu_session_count) return;
    quiet(session, frame);
    if ((uintptr_t)stream == 2) return;
    rgpu_synced_put((uint64_t)(uintptr_t)stream, IDLE_STREAM_KEY + (uint64_t)session, (uint64_t)frame + 1);
}

void rgpu_idle_ctx_put(CUcontext ctx, uint32_t frame) {
    rgpu_ctx *x = ctx ? rgpu_ctx_lookup(ctx) : rgpu_ctx_current();
    if (!x || x->session < 0 || x->session >= rgpu_session_count) return;
    quiet(x->session, frame);
    rgpu_synced_put((uint64_t)(uintptr_t)x, IDLE_CTX_KEY + (uint64_t)x->session, (uint64_t)frame + 1);
}

int rgpu_idle_ctx(CUcontext ctx) {
    rgpu_ctx *x = ctx ? rgpu_ctx_lookup(ctx) : rgpu_ctx_current();
    if (!x || x->destroyed || x->session < 0 || x->session >= rgpu_session_count || !answerable()) return 0;
    uint64_t since = quiet_since(x->session);
    return since && rgpu_synced_get((uint64_t)(uintptr_t)x, IDLE_CTX_KEY + (uint64_t)x->session) >= since;
}

/* The stream is routed like the generated call: to the current context's slice. */
int rgpu_idle_stream(CUstream stream) {
    if ((uintptr_t)stream == 2 || !answerable()) return 0;
    rgpu_ctx *x = rgpu_ctx_current();
    if (!x || x->destroyed || x->session < 0 || x->session >= rgpu_session_count) return 0;
    uint64_t since = quiet_since(x->session);
    if (!since) return 0;
    if (rgpu_synced_get((uint64_t)(uintptr_t)stream, IDLE_STREAM_KEY + (uint64_t)x->session) >= since) return 1;
    return special(stream) && rgpu_idle_ctx(NULL);   /* the context's synchronisation covers its NULL stream */
}
