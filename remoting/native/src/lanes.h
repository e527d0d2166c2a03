/* Data lanes (protocol 12, remoting/datapath/protocol.py): a large copy's bytes striped over
 * several TCP connections of one session, chunk i on lane i % lanes as a LANE_DATA frame (seq: the
 * copy's, aux: i, ctx: the chunk's offset). One thread per lane moves its chunks (threads kept
 * between copies, named rgpu-lane); no Python runs
 * per chunk. Built into libcuda.so.1 (hidden: the client sends) and librgpu-worker.so (exported:
 * the worker's Python, worker/lanes.py, receives one copy per call). */
#ifndef RGPU_LANES_H
#define RGPU_LANES_H

#include <stddef.h>
#include <stdint.h>

#ifndef RGPU_LANES_API
#define RGPU_LANES_API __attribute__((visibility("hidden")))
#endif

#define RGPU_LANES_MAX 16
#define RGPU_OP_LANE_DATA 13u

/* Pinned staging for host-to-device copies on a real GPU: `count` slots of `slot_bytes` each at
 * `base` (the worker's pinned memory). A chunk lands in a free slot; the GPU copy from it is queued
 * as soon as it is whole, and the slot is free again once the event recorded after that copy has
 * completed: the network fills one slot while PCIe drains another. Slots stay busy across copies
 * (the copies are asynchronous); the oldest busy slot is waited for only when none is free. */
typedef struct rgpu_lanes_staging rgpu_lanes_staging;
RGPU_LANES_API rgpu_lanes_staging *rgpu_lanes_staging_new(uint8_t *base, uint32_t count, uint64_t slot_bytes);
/* Wait for every slot's copy (before a context or the staging memory goes); `event_sync` is the
 * driver's cuEventSynchronize. Returns the first error, or 0. */
RGPU_LANES_API int rgpu_lanes_staging_drain(rgpu_lanes_staging *st, int (*event_sync)(void *));
RGPU_LANES_API void rgpu_lanes_staging_free(rgpu_lanes_staging *st);

/* The GPU side of one host-to-device copy through staging: the driver's entry points, the
 * destination, the stream and one event per slot (of the stream's context). */
typedef struct rgpu_lanes_gpu {
    int (*memcpy_htod)(uint64_t dst, const void *src, size_t n, void *stream);   /* cuMemcpyHtoDAsync_v2 */
    int (*event_record)(void *event, void *stream);                               /* cuEventRecord */
    int (*event_sync)(void *event);                                               /* cuEventSynchronize */
    void *stream;
    uint64_t dst;               /* the device address: the copy's destination, or its source (to host) */
    void **events;              /* the staging's count events */
    rgpu_lanes_staging *staging;
    int32_t error;              /* out: the first code the driver returned (the copy is incomplete) */
    uint32_t pad;
    int (*memcpy_dtoh)(void *dst, uint64_t src, size_t n, void *stream);         /* cuMemcpyDtoHAsync_v2 */
} rgpu_lanes_gpu;

/* A LANE_DATA frame with this flag carries no data but an i32 CUresult: the sender could not read
 * that chunk (a device-to-host copy the driver refused part way); every later chunk says so too. */
#define RGPU_LANE_ABORTED 1u

/* Receive a striped copy of `size` bytes in chunks of `chunk`: straight into `direct` when it is
 * not NULL, else through `gpu`'s staging into device memory; with neither, the bytes are read and
 * dropped (a copy the worker refused: the lanes stay in step). Every chunk is read off its lane even
 * after a driver error (the lanes stay in step; gpu->error says the copy failed). A lane that ends,
 * sends a frame that is not the chunk due, or stops for `stall_s` seconds fails the copy: -1 with
 * `why`, and every lane is shut down (the session's lanes are over). 0: every chunk arrived, whole or
 * aborted by the sender (then `*aborted` is its code). `watch_fd`/`on_readable`: as rgpu_lanes_send. */
RGPU_LANES_API int rgpu_lanes_recv(const int *fds, int nfds, uint32_t seq, uint64_t size, uint64_t chunk,
                                   uint8_t *direct, rgpu_lanes_gpu *gpu, int watch_fd, int (*on_readable)(void *),
                                   void *arg, double stall_s, int32_t *aborted, char *why, size_t whylen);

/* Send a striped copy: `size` bytes at `p` in chunks of `chunk`. While the lanes send, the calling
 * thread watches `watch_fd` (the session's connection; -1: none) and calls `on_readable(arg)` when
 * it has something to read (the worker may need this process first: a graph's host node); a
 * non-zero return from it fails the copy. 0, or -1 with `why` (every lane is shut down). */
RGPU_LANES_API int rgpu_lanes_send(const int *fds, int nfds, uint32_t seq, const uint8_t *p, uint64_t size,
                                   uint64_t chunk, int watch_fd, int (*on_readable)(void *), void *arg,
                                   double stall_s, char *why, size_t whylen);
/* Send a striped device-to-host copy from `gpu->dst` (the device address) through its staging: the
 * calling thread queues each chunk's copy into a free slot, waits for it in order and hands it to
 * its lane's thread; the staging's host-to-device copies are waited for first. A chunk the driver
 * refuses, and every later one, goes as an aborted frame (gpu->error is the code); -1 only for a
 * lane failure. */
RGPU_LANES_API int rgpu_lanes_send_device(const int *fds, int nfds, uint32_t seq, uint64_t size, uint64_t chunk,
                                          rgpu_lanes_gpu *gpu, double stall_s, char *why, size_t whylen);

/* A landing ring for host-to-device copies a thread receives while the worker's loop serves the
 * session (backends/cuda_copies.py): `slots` slots of `slot_bytes` per lane (lane l's slot s at
 * base + (l * slots + s) * slot_bytes, page-locked) and two words per lane in page-locked memory the
 * GPU maps: `landed`, the running count of chunks whole in the lane's slots (the lane's thread stores
 * it), and `done`, the running count the GPU has copied out of them (the lane's stream writes it).
 * The loop begins a copy (rgpu_lanes_ring_begin), starts the thread that receives it, then queues
 * all of its GPU work (rgpu_lanes_ring_plan): on each lane's stream, per chunk, a wait for `landed`,
 * the DMA from the chunk's slot, a write of `done`. The thread runs while the plan is queued: a plan
 * longer than the driver's queue makes the loop wait for the GPU, which waits for the bytes (a copy
 * of 342 chunks a lane hung an H100 when the thread started after the plan).
 * The receiving threads make no driver call: they wait for `done` before filling a slot again and
 * store `landed` once a chunk is whole (a driver call there could wait behind the loop's, which
 * waits for the copy: the session-14 hang). The ring's bytes stay in the CPU's cache between the
 * socket and the DMA, where a landing as large as the copy goes through memory at each end. */
typedef struct rgpu_lanes_ring rgpu_lanes_ring;

/* The driver's entry points a ring's plan queues work with (the worker's real libcuda). */
typedef struct rgpu_lanes_ring_driver {
    int (*wait_value32)(void *stream, uint64_t addr, uint32_t value, unsigned flags);    /* cuStreamWaitValue32_v2 */
    int (*write_value32)(void *stream, uint64_t addr, uint32_t value, unsigned flags);   /* cuStreamWriteValue32_v2 */
    int (*memcpy_htod)(uint64_t dst, const void *src, size_t n, void *stream);           /* cuMemcpyHtoDAsync_v2 */
    int (*event_record)(void *event, void *stream);                                      /* cuEventRecord */
    int (*stream_wait_event)(void *stream, void *event, unsigned flags);                 /* cuStreamWaitEvent */
} rgpu_lanes_ring_driver;

/* The word of lane l in a ring's words (64 bytes apart): landed at RING_LANDED(l), done at RING_DONE(l). */
#define RGPU_LANES_RING_WORDS_BYTES (2u * RGPU_LANES_MAX * 64u)
/* `words`: RGPU_LANES_RING_WORDS_BYTES of page-locked memory (zeroed here), `words_device` the same
 * as the GPU addresses it; `streams` and `events`: one per lane (the events mark each lane's DMAs
 * for the application's stream). NULL for bad arguments or no memory. */
RGPU_LANES_API rgpu_lanes_ring *rgpu_lanes_ring_new(uint8_t *base, uint32_t lanes, uint32_t slots, uint64_t slot_bytes,
                                                    uint32_t *words, uint64_t words_device, void *const *streams,
                                                    void *const *events);
RGPU_LANES_API void rgpu_lanes_ring_free(rgpu_lanes_ring *r);
/* Begin a copy: what rgpu_lanes_recv_ring and the next rgpu_lanes_ring_plan count from. */
RGPU_LANES_API void rgpu_lanes_ring_begin(rgpu_lanes_ring *r);
/* Queue the begun copy of `size` bytes in chunks of `chunk` to `dst`, after the work queued on
 * `stream` so far (`order`: an event of its context), and make `stream` wait for it. 0, or the
 * driver's first error (1 for a copy not begun): part of the plan may be queued, so the caller
 * abandons the copy, releases the ring once the receive has ended, waits for its streams and uses
 * it no more. */
RGPU_LANES_API int rgpu_lanes_ring_plan(rgpu_lanes_ring *r, const rgpu_lanes_ring_driver *d, uint64_t size,
                                        uint64_t chunk, uint64_t dst, void *stream, void *order);
/* Store every lane's `landed` as planned, so the lanes' streams wait for nothing more (after the
 * receive, whatever became of it: a failed copy's DMAs then copy stale bytes, and the copy's error
 * is reported). */
RGPU_LANES_API void rgpu_lanes_ring_release(rgpu_lanes_ring *r);
/* The begun copy's plan failed: its receive takes the bytes without waiting for the GPU (which may
 * never copy them out), so the lanes stay in step; the caller reports the plan's error. */
RGPU_LANES_API void rgpu_lanes_ring_abandon(rgpu_lanes_ring *r);
/* Receive the copy last begun on `r` (as rgpu_lanes_recv; the ring's lanes are nfds). A lane that
 * finds its slot still unread by the GPU after `stall_s` fails the copy. The caller releases the ring
 * once both this and the plan have ended, whatever the result (after it has recorded a failure, so
 * that whoever sees the application's stream go on sees the failure too). */
RGPU_LANES_API int rgpu_lanes_recv_ring(const int *fds, int nfds, uint32_t seq, uint64_t size, uint64_t chunk,
                                        rgpu_lanes_ring *r, double stall_s, int32_t *aborted, char *why, size_t whylen);

/* The chunk count of a striped copy. */
static inline uint64_t rgpu_lanes_chunks(uint64_t size, uint64_t chunk) { return (size + chunk - 1) / chunk; }

#endif
