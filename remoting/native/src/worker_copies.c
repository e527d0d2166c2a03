/* The worker's C loop, small device-to-host copies (server side, librgpu-worker.so).
 *
 * `tensor.item()`, a loss printed every step, a flag read back by a solver: a launch, a copy of a
 * few bytes to the host, a synchronize. The client's copy is synchronous (it waits for the bytes),
 * so each costs one round trip; in Python the worker's decoding, ctypes calls and three sends
 * doubled it. Here the copy goes to the driver and its data and reply leave in one sendmsg.
 *
 * The copy lands in the loop's own pageable buffer: CUDA returns from a device-to-host copy to
 * pageable memory only once the copy has completed, after the work queued before it on the
 * stream, which is the ordering the client's synchronous copy asks for. A copy on a capturing
 * stream, larger than the loop's buffer or on a stream the loop does not know is left to the
 * worker, which says why; so is every copy while an error waits to be reported (the worker's
 * reply must carry it) or a host node may be writing to the socket. A copy the driver refuses
 * consumes its frame and ends the run: the worker replies with the code, as its own path does.
 */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "rgpu_frame.h"
#include "worker_loop.h"

#define HEADER_SIZE RGPU_FRAME_HEADER_SIZE
#define COPY_SIZE 24u   /* u64 device address, u64 stream, u64 size */
#define OP_REPLY 4u
#define OP_DATA 5u

/* All of iov[0, n) on sock, whether the socket blocks or not (Python's socket timeouts make it
 * non-blocking underneath). 0, or the errno that ended the session. */
static int send_all(int sock, struct iovec *iov, int n) {
    while (n > 0) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t sent = sendmsg(sock, &m, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                struct pollfd p = {.fd = sock, .events = POLLOUT};
                if (poll(&p, 1, -1) < 0 && errno != EINTR) return errno;
                continue;
            }
            return errno;
        }
        while (n > 0 && (size_t)sent >= iov->iov_len) {
            sent -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + sent;
            iov->iov_len -= (size_t)sent;
        }
    }
    return 0;
}

int rgpu_small_dtoh(rgpu_loop *L, const uint8_t *p, uint32_t len, uint32_t seq) {
    if (!L->memcpy_dtoh || !L->stream_capturing || !L->dtoh_buf || L->sock < 0 || !L->replies_ok ||
        !L->gpu_work_ok || L->first_error || len < COPY_SIZE)
        return 0;
    uint64_t src, client_stream, size, stream;
    memcpy(&src, p, 8);
    memcpy(&client_stream, p + 8, 8);
    memcpy(&size, p + 16, 8);
    if (size == 0 || size > L->dtoh_max || !rgpu_real_stream(L->streams, L->stream_mask, client_stream, &stream)) return 0;
    int capturing = 0;
    if (L->stream_capturing((void *)(uintptr_t)stream, &capturing) || capturing) return 0;
    int result = L->memcpy_dtoh(L->dtoh_buf, src, (size_t)size, (void *)(uintptr_t)stream);
    if (result) {
        L->copy_failed = result;
        L->copy_seq = seq;
        return 1;
    }
    uint8_t data_header[HEADER_SIZE], reply[HEADER_SIZE + 4];
    int32_t ok = 0;
    rgpu_put_header(data_header, (uint32_t)size, OP_DATA, 0, 0, 0, 0);
    rgpu_put_header(reply, 4, OP_REPLY, 0, seq, 0, 0);
    memcpy(reply + HEADER_SIZE, &ok, 4);
    struct iovec iov[3] = {{data_header, HEADER_SIZE}, {L->dtoh_buf, (size_t)size}, {reply, sizeof reply}};
    L->send_errno = send_all(L->sock, iov, 3);
    if (!L->send_errno) L->sent += 2 * HEADER_SIZE + size + 4;
    L->copies++;
    return 1;
}
