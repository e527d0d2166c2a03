/* rgpu client library internals: sessions, calls, contexts and the client-side tables.
 *
 * One session (one TCP connection, one worker process on the GPU node) serves one slice, and
 * slice i is CUDA device ordinal i. A call locks its session, appends a frame to the session's
 * send buffer and either returns at once (async calls: launches, memsets, host-to-device
 * copies, event records) or flushes and waits for the reply (sync calls). Replies come in
 * request order because only sync calls get one and the lock is held until it arrives.
 */
#ifndef RGPU_CLIENT_H
#define RGPU_CLIENT_H

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "rgpu_cuda.h"
#include "rgpu_ops.h"

#define RGPU_EXPORT __attribute__((visibility("default")))
#define RGPU_MAX_SESSIONS 64
#define RGPU_HEADER_SIZE 24
#define RGPU_CHUNK_BYTES (1u << 20)
/* Copies of at least this many bytes go on UCX where the session has it (RGPU_UCX_MIN_BYTES overrides). */
#define RGPU_UCX_MIN_BYTES (1u << 20)
/* Protocol 15: a UCX copy's bytes go as messages of this size (the last one shorter), chunk i tagged
 * seq | i << 32 (remoting/datapath/protocol.py's UCX_CHUNK_BYTES): the worker moves each over PCIe
 * while the next one arrives. */
#define RGPU_UCX_CHUNK_BYTES (4u << 20)

/* Data lanes (protocol 12, lanes.h): RGPU_LANES connections carry a large copy's bytes (1: the
 * session's own; default 8), for copies of at least RGPU_LANE_MIN_BYTES, in chunks of
 * RGPU_LANE_CHUNK_BYTES. */
#define RGPU_MAX_LANES 16
#define RGPU_DEFAULT_LANES 8   /* measured on an H200: 256 MiB copies 15-21 GB/s on 8 lanes, 3-4 GB/s on one connection */
#define RGPU_LANE_MIN_BYTES (8u << 20)
#define RGPU_LANE_CHUNK_BYTES (2u << 20)
#define RGPU_LANE_KEY_BYTES 32
/* SO_SNDBUF/SO_RCVBUF of every data-path socket (RGPU_SOCKET_BUFFER_BYTES; 0: the kernel's autotuning). */
#define RGPU_SOCKET_BUFFER_BYTES (4u << 20)

/* Control opcodes (remoting/protocol.py). */
enum { RGPU_OP_HELLO = 1, RGPU_OP_WELCOME = 2, RGPU_OP_REFUSE = 3, RGPU_OP_REPLY = 4,
       RGPU_OP_DATA = 5, RGPU_OP_BYE = 6, RGPU_OP_HOST_CALL = 10, RGPU_OP_HOST_DONE = 11,
       RGPU_OP_NOTICE = 12 /* unasked: the session's GPU context is gone (tombstone.py) */ };
enum { RGPU_HOST_DONE_RAN = 0, RGPU_HOST_DONE_UNKNOWN_ID = 1 };
enum { RGPU_HELLO_PROBE = 1, RGPU_HELLO_NVML = 2, RGPU_HELLO_LANE = 8 };
enum { RGPU_REPLY_HAS_MESSAGE = 1 };
/* REFUSE_RETRY: the front door closed the connection before reading its HELLO; no session started. */
enum { RGPU_REFUSE_RETRY = 1 };
enum { RGPU_WELCOME_EMULATED = 1 };

enum { RGPU_LOG_ERROR = 0, RGPU_LOG_WARN = 1, RGPU_LOG_INFO = 2, RGPU_LOG_DEBUG = 3 };

typedef struct rgpu_session {
    int index;                 /* the CUDA device ordinal this slice appears as */
    int fd;
    int dead;                  /* the connection broke: every call fails */
    int closed;                /* the process said goodbye at exit: calls fail quietly */
    pthread_mutex_t lock;
    char server[256];
    char token[4200];
    uint32_t seq;
    uint8_t *sbuf;             /* frames not yet sent */
    size_t slen, scap;
    uint8_t *rbuf;             /* the last reply's payload */
    size_t rcap;
    int messages_shown;
    int flush_armed;           /* the flusher has been woken for what is buffered */
    int attr_sets_unconfirmed; /* pipelined attribute sets sent since the last reply (func_attrs.c) */
    uint64_t last_send_ns;     /* CLOCK_MONOTONIC of the last send(2) of buffered frames */
    /* From the WELCOME frame. */
    uint32_t version;
    int32_t driver_version;
    uint64_t memory_limit;
    uint32_t compute_percent;
    uint32_t welcome_flags;
    char description[256];
    /* UCX underneath (protocol 10, ucx_link.h): set when both ends negotiated it in the handshake;
     * copies of at least RGPU_UCX_MIN_BYTES then carry their bytes on it. */
    struct rgpu_ucx *ucx;
    /* Data lanes (protocol 12): opened beside fd at the handshake, kept when WELCOME took them all. */
    int lanes[RGPU_MAX_LANES];
    int nlanes;
    int striping;              /* lane threads use the lanes now: a failing session leaves them open */
    struct rgpu_pending_send *pending;   /* a page-locked copy's bytes the lanes still send (transport.c) */
    uint8_t lane_key[RGPU_LANE_KEY_BYTES];
} rgpu_session;

typedef struct rgpu_call {
    rgpu_session *s;
    size_t frame_start;        /* offset of this call's header in s->sbuf */
    uint16_t op;
    const uint8_t *rp;         /* reply outputs */
    size_t rlen, roff;
    uint8_t *sink;             /* where DATA frames of the reply go (device-to-host copies) */
    size_t sink_cap, sink_got;
} rgpu_call;

/* Client-side context object: CUcontext values the application sees point to one of these. */
typedef struct rgpu_ctx {
    uint32_t magic;
    int session;
    uint64_t remote;           /* the worker's CUcontext */
    int destroyed;
    int primary;               /* a device's primary context (cuDevicePrimaryCtxRetain) */
} rgpu_ctx;
#define RGPU_CTX_MAGIC 0x52435458u

/* Library state: sessions and initialisation (client.c). */
extern rgpu_session rgpu_sessions[RGPU_MAX_SESSIONS];
extern int rgpu_session_count;
CUresult rgpu_check_init(void);
CUresult rgpu_connect_all(int flags, const char *component);
int rgpu_log_level(void);
void rgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
CUresult rgpu_unsupported(const char *name, int *seen, const char *why);

/* Calls. */
CUresult rgpu_begin(rgpu_call *c, uint16_t op);
CUresult rgpu_begin_session(rgpu_call *c, uint16_t op, int session);
void rgpu_abort(rgpu_call *c);   /* drop a call begun but not sent (refused in the client) */
CUresult rgpu_begin_dev(rgpu_call *c, uint16_t op, CUdevice dev);
CUresult rgpu_begin_ctx(rgpu_call *c, uint16_t op, CUcontext ctx, uint64_t *remote);
void rgpu_put(rgpu_call *c, const void *p, size_t n);
void rgpu_retarget(rgpu_call *c, uint16_t op);   /* a call begun as one operation, sent as another */
CUresult rgpu_put_bulk(rgpu_call *c, const void *p, size_t n); /* ends the frame; streams p */
/* UCX (transport.c): whether this call's session carries copies of n bytes on UCX; the bytes of a
 * frame sent that way (ends the frame, returns once p may be reused); a device-to-host copy's
 * receive, posted before rgpu_sync and finished after it (result: rgpu_sync's). */
int rgpu_ucx_carries(const rgpu_call *c, size_t n);
CUresult rgpu_ucx_put_bulk(rgpu_call *c, const void *p, size_t n);
CUresult rgpu_ucx_expect(rgpu_call *c, void *dst, size_t n, void **req);
CUresult rgpu_ucx_finish(rgpu_call *c, void *req, size_t n, CUresult result);
/* Data lanes (transport.c): whether this call's session stripes a copy of n bytes over its lanes;
 * the chunk size; the bytes of a frame sent that way (ends the frame, returns once p may be reused;
 * a lane that fails ends the session's lanes and fails this copy). */
int rgpu_lanes_carry(const rgpu_call *c, size_t n);
uint64_t rgpu_lane_chunk_bytes(void);
CUresult rgpu_lanes_put_bulk(rgpu_call *c, const void *p, size_t n);
/* The same for page-locked memory of an asynchronous copy: returns once the lanes began (CUDA's
 * contract: the program reuses the memory only after the stream says the copy is done); a failure
 * answers the session's next synchronous call. Memory about to be freed waits for its copies first. */
CUresult rgpu_lanes_put_bulk_async(rgpu_call *c, const void *p, size_t n);
void rgpu_lanes_sends_finish(void);
int rgpu_hostfn_any(void);   /* host_nodes.c: host functions registered (their calls need the connection served) */
/* A device-to-host copy's bytes from the lanes, straight into dst, after its REPLY said they follow. */
CUresult rgpu_lanes_get_bulk(rgpu_call *c, void *dst, size_t n, uint64_t chunk);
CUresult rgpu_sync(rgpu_call *c);
/* Call profile: module image bytes sent (0 for a load served by the GPU node's image cache). */
void rgpu_stats_image(uint64_t bytes_sent, int cache_hit);
void rgpu_stats_image_hash(uint64_t bytes, uint64_t ns);   /* client-side SHA-256 of module images */
void rgpu_client_stats_write(const char *suffix);   /* cuGetProcAddress("rgpuClientStatsWrite") */
/* The SHA-256 of a module image, remembered across processes for images in library files;
 * returns 1 where it hashed the bytes, 0 where a record gave the digest. */
int rgpu_image_digest(const void *image, size_t size, uint8_t digest[32]);
CUresult rgpu_async(rgpu_call *c);                             /* ends the call */
CUresult rgpu_async_now(rgpu_call *c);                         /* ends the call and sends it at once */
void rgpu_end(rgpu_call *c);
void rgpu_get(rgpu_call *c, void *p, size_t n);
size_t rgpu_remaining(const rgpu_call *c);
CUdevice rgpu_dev_out(rgpu_call *c, int32_t remote);
CUcontext rgpu_ctx_out(rgpu_call *c, uint64_t remote);

static inline void rgpu_put_u8(rgpu_call *c, uint8_t v) { rgpu_put(c, &v, 1); }
static inline void rgpu_put_u16(rgpu_call *c, uint16_t v) { rgpu_put(c, &v, 2); }
static inline void rgpu_put_u32(rgpu_call *c, uint32_t v) { rgpu_put(c, &v, 4); }
static inline void rgpu_put_i32(rgpu_call *c, int32_t v) { rgpu_put(c, &v, 4); }
static inline void rgpu_put_u64(rgpu_call *c, uint64_t v) { rgpu_put(c, &v, 8); }
static inline void rgpu_put_f32(rgpu_call *c, float v) { rgpu_put(c, &v, 4); }
static inline void rgpu_put_str(rgpu_call *c, const char *s) {
    uint32_t n = s ? (uint32_t)__builtin_strlen(s) : 0;
    rgpu_put_u32(c, n);
    if (n) rgpu_put(c, s, n);
}
static inline void rgpu_put_blob(rgpu_call *c, const void *p, uint64_t n) {
    rgpu_put_u64(c, n);
    if (n) rgpu_put(c, p, (size_t)n);
}
static inline uint8_t rgpu_get_u8(rgpu_call *c) { uint8_t v = 0; rgpu_get(c, &v, 1); return v; }
static inline uint16_t rgpu_get_u16(rgpu_call *c) { uint16_t v = 0; rgpu_get(c, &v, 2); return v; }
static inline uint32_t rgpu_get_u32(rgpu_call *c) { uint32_t v = 0; rgpu_get(c, &v, 4); return v; }
static inline int32_t rgpu_get_i32(rgpu_call *c) { int32_t v = 0; rgpu_get(c, &v, 4); return v; }
static inline uint64_t rgpu_get_u64(rgpu_call *c) { uint64_t v = 0; rgpu_get(c, &v, 8); return v; }
static inline float rgpu_get_f32(rgpu_call *c) { float v = 0; rgpu_get(c, &v, 4); return v; }

/* Contexts (client.c). */
rgpu_ctx *rgpu_ctx_lookup(CUcontext ctx);                  /* NULL if not a live rgpu context */
rgpu_ctx *rgpu_ctx_current(void);
rgpu_ctx *rgpu_ctx_of_session(int session);       /* NULL if the application has none there */
/* 2D and 3D copies with CUDA arrays, and every 3D copy (cuda_array.c). */
CUresult rgpu_copy_nd(const CUDA_MEMCPY3D *p, int kind, CUstream stream);
CUresult rgpu_copy_2d_nd(const CUDA_MEMCPY2D *p, int unaligned, CUstream stream);
int rgpu_array_desc_get(CUarray array, CUDA_ARRAY3D_DESCRIPTOR *out);
void rgpu_array_desc_put(int session, CUarray array, const CUDA_ARRAY3D_DESCRIPTOR *desc);
void rgpu_array_desc_forget(uint64_t handle);
void rgpu_array_level_put(CUarray level, CUmipmappedArray mipmap);
int rgpu_dtod_between_slices(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream, CUresult *r);
CUcontext rgpu_ctx_for(int session, uint64_t remote);      /* find or create */
void rgpu_ctx_forget(rgpu_ctx *ctx);
int rgpu_ctx_push(rgpu_ctx *ctx);
rgpu_ctx *rgpu_ctx_pop(void);
void rgpu_ctx_set(rgpu_ctx *ctx);

/* cudart's context-local storage (cuda_export.c): destructors run when a context goes. */
void rgpu_cls_context_gone(CUcontext ctx);
void rgpu_cls_reset_after_fork(void);
void rgpu_before_primary_ctx_reset(CUdevice dev);

/* Stream capture (cuda_graph.c): begun minus ended captures; while none can be under way the
 * capture status is answered here, exactly, without a round trip. */
void rgpu_capture_begun(CUresult r);
void rgpu_capture_ended(CUresult r);
int rgpu_capture_possible(void);
/* Host nodes (host_nodes.c): the application's host functions, by the ids the worker's host nodes
 * name. A HOST_CALL frame read by any waiting call runs one (transport.c), on the reading thread,
 * with its session locked: a CUDA call from inside returns CUDA_ERROR_NOT_PERMITTED, as CUDA
 * forbids them there. */
enum { RGPU_HOSTFN_FUNC = 0, RGPU_HOSTFN_STREAM_CALLBACK = 1 };
uint64_t rgpu_hostfn_register(int kind, void *fn, void *user, CUstream stream);
int rgpu_hostfn_lookup(uint64_t id, int *kind, void **fn, void **user);
/* Runs function `id` around the HOST_CALL payload `in` (host-copy regions: their device-to-host
 * data goes into this process's memory first); `*out` (malloc'd) is HOST_DONE's payload: every
 * region's data after the call. 0 ran, -1 unknown id. */
int rgpu_run_host_call(int session, uint64_t id, int32_t status, const uint8_t *in, size_t inlen, uint8_t **out,
                       size_t *outlen);
void *rgpu_hostcopy_host(uint64_t buffer, size_t size); /* this process's memory behind a copy node's buffer */
extern __thread int rgpu_in_host_fn;
CUresult rgpu_graph_add_node(uint32_t kind, CUgraphNode *phNode, CUgraph hGraph, const CUgraphNode *deps, size_t ndeps,
                             const void *payload, size_t plen, uint64_t *aux);
CUresult rgpu_event_in_graph(CUevent event);   /* an event a graph node records: always asked for */
CUresult rgpu_graph_add_kernel(CUgraphNode *phNode, CUgraph hGraph, const CUgraphNode *deps, size_t ndeps,
                               CUfunction func, CUkernel kern, const unsigned int dims[7], void **params, void **extra);
/* Client-side answers to repeated queries (cuda_cache.c). */
int rgpu_cached_ctx_device(CUcontext ctx, CUdevice *device);
int rgpu_kattr_get(CUkernel k, int attrib, CUdevice dev, int *out);
void rgpu_kattr_put(CUkernel k, int attrib, CUdevice dev, int value);
void rgpu_kattr_changed(CUkernel k, int attrib, CUdevice dev, int value);
void rgpu_fattr_changed(CUfunction f);
int rgpu_fattr_get(CUfunction f, int attrib, int *out);
void rgpu_fattr_put(CUfunction f, int attrib, int value);
/* Pipelined attribute sets (func_attrs.c): the kept answers take the value at once. */
void rgpu_fattr_set(CUfunction f, int attrib, int value);
void rgpu_kattr_set(CUkernel k, int attrib, CUdevice dev, int value);
void rgpu_attr_sets_refused(void);
int rgpu_func_set_attribute_here(CUfunction f, int attrib, int value, CUresult *result);
int rgpu_kernel_set_attribute_here(CUkernel k, int attrib, int value, CUdevice dev, CUresult *result);
int rgpu_occ_smem_get(CUfunction f, int blocks, int block_size, size_t *out);
void rgpu_occ_smem_put(CUfunction f, int blocks, int block_size, size_t value);
int rgpu_occ_potential_get(CUfunction f, size_t smem, int limit, unsigned int flags, int *min_grid, int *block);
void rgpu_occ_potential_put(CUfunction f, size_t smem, int limit, unsigned int flags, int min_grid, int block);
enum { RGPU_STREAMQ_FLAGS, RGPU_STREAMQ_PRIORITY, RGPU_STREAMQ_CTX, RGPU_STREAMQ_DEVICE, RGPU_STREAMQ_ID };
int rgpu_stream_query_get(CUstream s, int what, uint64_t *out);
void rgpu_stream_query_put(CUstream s, int what, uint64_t value);
void rgpu_stream_forget(CUstream s);
enum { RGPU_CTXQ_API_VERSION, RGPU_CTXQ_ID, RGPU_CTXQ_FLAGS, RGPU_CTXQ_CACHE_CONFIG, RGPU_CTXQ_SHARED_CONFIG,
       RGPU_CTXQ_PRIORITY_RANGE };
int rgpu_ctx_query_get(CUcontext ctx, int what, uint64_t *out);
void rgpu_ctx_query_put(CUcontext ctx, int what, uint64_t value);
void rgpu_ctx_query_forget(void);
/* Function nodes of private table 6e163fbe (module_nodes.c) and the worker's nodes they stand for. */
void rgpu_fn_private_put(void *node, uint64_t remote);
CUfunction rgpu_fn_remote(CUfunction f);
const void *rgpu_module_nodes_table(void);
/* Events by slice (cuda_cache.c): a stream waiting for another slice's event. */
void rgpu_event_session_put(CUevent event, int session);
void rgpu_event_session_forget(CUevent event);
int rgpu_event_elsewhere(CUevent event, CUresult *result);
/* Events made by the client (cuda_events.c): handles at once, creation and destruction
 * pipelined, completion known without asking where a finished synchronisation covered it. */
#define RGPU_EVENT_WHOLE_CONTEXT ((CUstream)(uintptr_t)~(uintptr_t)0)   /* cuCtxRecordEvent's "stream" */
CUresult rgpu_event_check(CUevent event);
CUresult rgpu_event_destroying(CUevent event);
CUresult rgpu_begin_event(rgpu_call *c, uint16_t op, CUevent event);
CUresult rgpu_stream_destroying(CUstream stream);
CUresult rgpu_begin_stream(rgpu_call *c, uint16_t op, CUstream stream);
uint64_t rgpu_event_clock(void);
void rgpu_event_recorded(CUevent event, CUstream stream);
int rgpu_event_known(CUevent event, uint64_t *seq, CUresult *result);
void rgpu_event_completed(CUevent event, uint64_t seq);
void rgpu_stream_synced(CUstream stream, int session, uint64_t seq);
/* Streams and contexts a finished synchronisation (or a device-to-host copy) left idle
 * (idle_streams.c): `frame` is the recording call's frame number. */
void rgpu_idle_stream_put(CUstream stream, int session, uint32_t frame);
void rgpu_idle_ctx_put(CUcontext ctx, uint32_t frame);
int rgpu_idle_stream(CUstream stream);
int rgpu_idle_ctx(CUcontext ctx);
void rgpu_ctx_synced(CUcontext ctx, uint64_t seq);
void rgpu_events_reset_after_fork(void);
/* Finished synchronisations by (stream, slice) or context: the clock each began at (cuda_cache.c). */
uint64_t rgpu_synced_get(uint64_t k1, uint64_t k2);
void rgpu_synced_put(uint64_t k1, uint64_t k2, uint64_t seq);
/* Managed memory emulated in the client (managed.c). */
int rgpu_managed_any(void);
int rgpu_managed_unpinned_any(void);
void rgpu_managed_before_call(uint16_t op);
void rgpu_managed_sync_point(void);
int rgpu_managed_find(CUdeviceptr p);
int rgpu_managed_range(CUdeviceptr p, CUdeviceptr *user, size_t *size);   /* cuMemAllocManaged's, not pinned */
int rgpu_managed_routes(const void *host);
CUresult rgpu_managed_free(CUdeviceptr user);
void rgpu_managed_hand(CUdeviceptr p);            /* a copy's side */
void rgpu_managed_hand_numbered(CUdeviceptr p);   /* a launch's argument, a memset's target (zero_copy.c) */
void rgpu_managed_hand_args(const void *args, size_t n);
void rgpu_managed_handed_on(CUstream stream);     /* after a launch's frame is queued */
void rgpu_managed_sync_begins(void);              /* a synchronous call begins (transport.c) */
void rgpu_managed_covers(int whole_context, CUstream stream, uint64_t seq);   /* what it covered */
uint64_t rgpu_event_clock_tick(void);             /* the event clock's next number (cuda_events.c) */
int rgpu_managed_adopt(CUdeviceptr user, size_t size, size_t mapped);
int rgpu_managed_forget(CUdeviceptr user);
/* Page-locked memory a GPU kernel uses directly (zero_copy.c). */
void *rgpu_zero_copy_alloc(size_t bytesize, unsigned int flags);
int rgpu_zero_copy_free(void *p, CUresult *result);
int rgpu_zero_copy_flags(const void *p, unsigned int *flags);
int rgpu_copy_device_session(uint64_t ptr);
CUresult rgpu_zero_copy_promote(uint64_t ptr, int *found, const char *why);
CUresult rgpu_zero_copy_target(CUdeviceptr ptr);
int rgpu_zero_copy_shared(const void *p, size_t n, int session, uint64_t *region, uint64_t *offset);
void rgpu_zero_copy_reset_after_fork(void);
/* Same-host page-locked memory read in place (shared_pinned.c, protocol 15). */
size_t rgpu_shared_min_bytes(void);
void *rgpu_shared_pinned_map(int session, void *at, size_t mapped, uint64_t *region, int *memfd);
CUresult rgpu_shared_pinned_unshare(int session, uint64_t region);
void rgpu_shared_pinned_privatize(void *base, size_t mapped, int memfd);
void rgpu_shared_pinned_reset_after_fork(void);
int rgpu_kfunc_get(CUkernel k, CUfunction *out);
void rgpu_kfunc_put(CUkernel k, CUfunction f);
void rgpu_cache_forget_functions(void);
int rgpu_dattr_get(int attrib, CUdevice dev, int *out);
void rgpu_dattr_put(int attrib, CUdevice dev, int value);
int rgpu_pstate_get(CUdevice dev, unsigned int *flags, int *active);
void rgpu_pstate_put(CUdevice dev, unsigned int flags, int active);
void rgpu_pstate_forget(void);
int rgpu_limit_get(int limit, size_t *out);
void rgpu_limit_put(int limit, size_t value);
int rgpu_occ_get(CUfunction f, int block, size_t smem, unsigned int flags, int *out);
void rgpu_occ_put(CUfunction f, int block, size_t smem, unsigned int flags, int value);
void rgpu_hostcopy_clone(void *from, void *to);
int rgpu_stream_capturing(CUstream stream);
CUresult rgpu_capture_host_copy(CUstream stream, int to_host, CUdeviceptr dev, void *host, size_t n);
void rgpu_hostcopy_forget(void *owner);
CUresult rgpu_hostcopy_before_launch(CUgraphExec exec);
CUresult rgpu_hostcopy_after_launch(CUgraphExec exec, CUstream stream);
CUresult rgpu_kernel_args(CUfunction f, void **params, void **extra, uint8_t **out, size_t *size);

/* Allocation tables (tables.c): device ranges route unified copies and pointer queries;
 * host ranges hold the client's page-locked memory. */
void rgpu_dev_range_add(int session, uint64_t base, uint64_t size);
void rgpu_dev_range_remove(int session, uint64_t base);
void rgpu_dev_alloc_add(int session, uint64_t base, uint64_t size);   /* cuMemAlloc*: a plain allocation */
int rgpu_dev_alloc_find(uint64_t ptr, uint64_t *base);                 /* the plain allocation holding ptr */
/* Pointer attributes of plain allocations, kept per (allocation, attribute) (cuda_cache.c). */
int rgpu_pattr_get(uint64_t base, uint64_t ptr, int attr, void *data);
void rgpu_pattr_put(uint64_t base, uint64_t ptr, int attr, const void *data, uint32_t n);
void rgpu_pattr_forget(uint64_t base);
void rgpu_pattr_forget_all(void);
int rgpu_dev_range_find(uint64_t ptr, int *session, uint64_t *base, uint64_t *size);
void rgpu_host_range_add(void *base, size_t size, unsigned int flags, int owned);
int rgpu_host_range_remove(void *base, int *owned, size_t *size);
int rgpu_host_range_find(const void *ptr, void **base, size_t *size, unsigned int *flags);
/* The offset of the first 8-byte word of a kernel's packed arguments that points into this
 * process's page-locked memory (zero-copy: no GPU across the network can read it), or -1. */
long rgpu_args_host_pointer(const void *args, size_t n, uint64_t *value);

/* Kernel parameter layouts, cached per function (tables.c). */
typedef struct rgpu_fn {
    int session;
    uint64_t handle;
    char *name;
    uint32_t nparams;
    uint32_t argsize;          /* bytes of the packed parameter buffer */
    uint32_t *offsets;
    uint32_t *sizes;
    uint64_t module;           /* the module whose load reported it (0: unknown) */
    int valid;
    int looked_up;             /* returned by the worker's cuModuleGetFunction (launchable) */
} rgpu_fn;
rgpu_fn *rgpu_fn_find(int session, uint64_t handle);
rgpu_fn *rgpu_fn_add(int session, uint64_t handle, const char *name, uint32_t nparams,
                     const uint32_t *offsets, const uint32_t *sizes);
rgpu_fn *rgpu_fn_find_name(int session, uint64_t module, const char *name);
void rgpu_fn_set_module(rgpu_fn *fn, uint64_t module);
void rgpu_fn_set_looked_up(rgpu_fn *fn);
void rgpu_fn_forget_module(int session, uint64_t module);
/* The functions (kernels) a module's or library's load reported on a session: how many; the first
 * `cap` go to out. */
size_t rgpu_fn_list_module(int session, uint64_t module, rgpu_fn **out, size_t cap);

/* Libraries on every slice (library_mirror.c). A CUlibrary and its CUkernels serve every device;
 * the application holds the values of the slice that first loaded it, translated per slice. */
void rgpu_library_loaded(int origin, uint64_t library, const void *image, size_t size, unsigned int nopts,
                         CUlibraryOption *opts, void **vals);
CUresult rgpu_library_load_on(int session, const void *image, size_t size, unsigned int nopts, CUlibraryOption *opts,
                              void **vals, uint64_t *library);
void rgpu_library_context_ready(int session);   /* a context on that slice now exists */
CUresult rgpu_library_unload(uint64_t library);
CUresult rgpu_library_unload_on(int session, uint64_t library);
uint64_t rgpu_handle_in(int session, uint64_t handle);
uint64_t rgpu_handle_out(int session, uint64_t handle);
void rgpu_tables_reset(void);

/* Symbol tables (generated). */
typedef struct rgpu_symbol { const char *name; void *fn; } rgpu_symbol;
typedef struct rgpu_proc { const char *base; int version; const char *symbol; } rgpu_proc;
extern const rgpu_symbol rgpu_cuda_symbols[];
extern const size_t rgpu_cuda_symbol_count;
extern const rgpu_proc rgpu_cuda_procs[];
extern const size_t rgpu_cuda_proc_count;
const char *rgpu_cuda_error_name(CUresult r);
const char *rgpu_cuda_error_string(CUresult r);
void *rgpu_dynamic_stub(const char *name);

#endif
