/* UCX underneath the data path (issue 25): one UCP context, worker and endpoint per session, loaded
 * at run time (dlopen), so neither the client library nor the worker depends on UCX to load or to
 * build. Copies' bytes travel as UCP tag messages; their control frames stay on the session's TCP
 * stream, which keeps them in order with launches. Shared by libcuda.so.1 (hidden symbols) and
 * librgpu-worker.so (driven from Python through ctypes, once per copy). */
#ifndef RGPU_UCX_LINK_H
#define RGPU_UCX_LINK_H

#include <stddef.h>
#include <stdint.h>

#ifndef RGPU_UCX_API
#define RGPU_UCX_API __attribute__((visibility("hidden")))
#endif

typedef struct rgpu_ucx rgpu_ucx;

/* Load libucp (from `folder` when not NULL/empty: folder/libucp.so.0 or folder/libucp.so, nothing
 * else; otherwise the system's libucp.so.0) and open a context and a worker. `threads`: 1 when
 * several threads may call (one at a time). NULL, with `why` filled, when UCX is not usable. */
RGPU_UCX_API rgpu_ucx *rgpu_ucx_open(const char *folder, int threads, char *why, size_t whylen);
/* This worker's address, to send to the peer. */
RGPU_UCX_API size_t rgpu_ucx_address(rgpu_ucx *u, const void **address);
/* The endpoint to the peer's worker. 0 or -1 with `why`. */
RGPU_UCX_API int rgpu_ucx_connect(rgpu_ucx *u, const void *peer, size_t len, char *why, size_t whylen);
/* The UCX transports of the endpoint's lanes, "transport/device" each, comma-separated (e.g.
 * "posix/memory, cma/memory", "tcp/eth0", "rc_mlx5/mlx5_0:1"): what carries the copies. Its length;
 * 0 ("") before rgpu_ucx_connect or where the loaded UCX cannot say. */
RGPU_UCX_API size_t rgpu_ucx_describe(rgpu_ucx *u, char *out, size_t outlen);
/* Start sending (recv 0) or receiving (recv 1) n bytes tagged `tag`. 0: started, *req is the
 * request to wait for (NULL: already done); -1 with `why`. */
RGPU_UCX_API int rgpu_ucx_post(rgpu_ucx *u, int recv, uint64_t tag, void *p, size_t n, void **req, char *why,
                               size_t whylen);
/* Progress until `req` completes. A receive must have brought exactly `want` bytes. Gives up
 * (cancels) when nothing progressed for idle_s seconds, and, when fd >= 0, when that socket
 * ends (the peer is gone). 0 or -1 with `why`; with RGPU_UCX_YIELD_READABLE in `flags`, 1 when fd
 * has bytes to read first (the request still runs: read, then wait again). */
#define RGPU_UCX_YIELD_READABLE 1
RGPU_UCX_API int rgpu_ucx_wait(rgpu_ucx *u, void *req, int recv, size_t want, double idle_s, int fd, int flags,
                               char *why, size_t whylen);
/* Cancel a posted request (recv 1: a receive, 0: a send) and release it. A receive is waited for
 * until UCX has cancelled it; a send, which UCX cannot cancel, ends by its endpoint's forced close
 * (the link sends no more) or is left to UCX. */
RGPU_UCX_API void rgpu_ucx_cancel(rgpu_ucx *u, void *req, int recv);
RGPU_UCX_API void rgpu_ucx_close(rgpu_ucx *u);

#endif
