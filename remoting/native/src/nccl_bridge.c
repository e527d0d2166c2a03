/* libcuda.so.1: the private table rgpu's libnccl.so.2 calls through (rgpu_nccl_bridge.h). */
#include "cuda_protos.h"
#include "rgpu_nccl_bridge.h"

/* cuInit once: after that it is a round trip to device 0's worker, which may be running a
 * collective that waits for this very call's slice. */
static CUresult current_session(int *session) {
    CUresult r = rgpu_check_init();
    if (r == CUDA_ERROR_NOT_INITIALIZED) r = cuInit(0);
    if (r != CUDA_SUCCESS) return r;
    rgpu_ctx *cur = rgpu_ctx_current();
    *session = cur ? cur->session : 0;   /* no current context: device 0, as cudart's default device */
    return CUDA_SUCCESS;
}

static int session_count(void) { return rgpu_session_count; }

static void log_line(int level, const char *line) { rgpu_log(level, "%s", line); }

const rgpu_nccl_bridge rgpu_nccl_bridge_table = {
    .size = sizeof(rgpu_nccl_bridge), .version = RGPU_NCCL_BRIDGE_VERSION, .protocol = RGPU_PROTOCOL_VERSION,
    .current_session = current_session, .session_count = session_count, .begin_session = rgpu_begin_session,
    .put = rgpu_put, .async_now = rgpu_async_now, .sync = rgpu_sync, .get = rgpu_get, .end = rgpu_end, .abort_ = rgpu_abort,
    .log_level = rgpu_log_level, .log_line = log_line,
};
