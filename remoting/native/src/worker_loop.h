/* The worker's C loop (librgpu-worker.so): what worker_launch.c and worker_events.c share, and the
 * state the Python worker hands the loop (remoting/datapath/worker/native_loop.py mirrors
 * `rgpu_loop` field by field as a ctypes Structure: change both together). */
#ifndef RGPU_WORKER_LOOP_H
#define RGPU_WORKER_LOOP_H

#include <stddef.h>
#include <stdint.h>

#define RGPU_EXPORT __attribute__((visibility("default")))

/* The client's event handles -> the driver's events: an open-addressing table (linear probing,
 * deletion by backward shift, so no tombstones pile up while cuDNN creates and destroys ~170
 * events per step) of (handle, value) pairs, key 0 empty. The C loop and the Python worker
 * (client_handles.py, through ctypes) both read and write this one table. A value is the driver's
 * event, or RGPU_EVENT_FAILED | the CUresult its creation failed with. */
#define RGPU_EVENT_FAILED (1ull << 63)

typedef struct rgpu_events {
    uint64_t *slots;   /* 2 * (mask + 1) words */
    uint32_t mask;
    uint32_t count;
} rgpu_events;

RGPU_EXPORT int rgpu_events_reserve(rgpu_events *t, uint32_t more);   /* 0: out of memory (unchanged) */
RGPU_EXPORT int rgpu_events_get(const rgpu_events *t, uint64_t handle, uint64_t *value);
RGPU_EXPORT int rgpu_events_put(rgpu_events *t, uint64_t handle, uint64_t value);
RGPU_EXPORT int rgpu_events_take(rgpu_events *t, uint64_t handle, uint64_t *value);

/* The driver's entry points, by exact symbol (backends/cuda.py hands their addresses over). */
typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                         unsigned bz, unsigned shmem, void *stream, void **params, void **extra);
typedef int (*launch_ex_fn)(const void *config, void *f, void **params, void **extra);   /* cuLaunchKernelEx */
typedef int (*event_create_fn)(void **event, unsigned flags);              /* cuEventCreate */
typedef int (*event_record_fn)(void *event, void *stream);                  /* cuEventRecord */
typedef int (*event_record_flags_fn)(void *event, void *stream, unsigned flags);   /* cuEventRecordWithFlags */
typedef int (*stream_wait_fn)(void *stream, void *event, unsigned flags);   /* cuStreamWaitEvent */
typedef int (*event_destroy_fn)(void *event);                               /* cuEventDestroy_v2 */
typedef int (*memcpy_dtoh_fn)(void *dst, uint64_t src, size_t n, void *stream);   /* cuMemcpyDtoHAsync_v2 */
typedef int (*stream_capturing_fn)(void *stream, int *status);              /* cuStreamIsCapturing */
typedef int (*memset_d8_fn)(uint64_t dst, unsigned char value, size_t n, void *stream);    /* cuMemsetD8Async */
typedef int (*memset_d16_fn)(uint64_t dst, unsigned short value, size_t n, void *stream);  /* cuMemsetD16Async */
typedef int (*memset_d32_fn)(uint64_t dst, unsigned int value, size_t n, void *stream);    /* cuMemsetD32Async */


/* The event operations the loop runs, in the order of rgpu_loop's op and count arrays. */
enum { RGPU_EV_CREATE, RGPU_EV_RECORD, RGPU_EV_RECORD_FLAGS, RGPU_EV_WAIT, RGPU_EV_DESTROY, RGPU_EV_KINDS };

/* The memsets the loop runs, by the width of their value (rgpu_loop's memset_ops). */
enum { RGPU_MEMSET_D8, RGPU_MEMSET_D16, RGPU_MEMSET_D32, RGPU_MEMSET_KINDS };

typedef struct rgpu_loop {
    /* Set by the worker. */
    launch_fn launch;
    event_create_fn event_create;         /* any of these NULL: that operation stays in Python */
    event_record_fn event_record;
    event_record_flags_fn event_record_flags;
    stream_wait_fn stream_wait;
    event_destroy_fn event_destroy;
    const uint64_t *admitted;             /* kernels whose local memory the worker charged */
    const uint64_t *streams;              /* (client stream, driver stream) pairs */
    rgpu_events *events;
    uint32_t admitted_mask, stream_mask;
    uint32_t launch_op;
    uint32_t event_ops[RGPU_EV_KINDS];    /* opcodes (api_gen.OPCODES) */
    uint32_t gpu_work_ok;                 /* 0: stop before a launch, record, wait or memset (no limiter turn held) */
    uint32_t events_ok;                   /* 0: stop at every event frame (a host node is waiting, a fault) */
    /* What the runs did: the worker reads these and clears the per-run ones. */
    int32_t first_error;                  /* per run: the first error of a launch, record, wait, destroy or memset */
    uint32_t last_op;                     /* per run: the last frame's operation */
    int32_t failed_code;                  /* per run: a creation that failed (it ends the run) */
    uint32_t first_error_op;              /* per run: the operation of first_error */
    uint64_t failed_handle;
    uint64_t errors;                      /* per run: launches, records, waits, destructions and memsets that failed */
    uint64_t run_events;                  /* per run: event operations run */
    uint64_t launched;                    /* in all */
    uint64_t event_counts[RGPU_EV_KINDS]; /* in all */
    /* Small device-to-host copies, answered from C (worker_copies.c). Set by the worker: */
    memcpy_dtoh_fn memcpy_dtoh;           /* NULL: copies stay in Python */
    stream_capturing_fn stream_capturing; /* NULL: copies stay in Python */
    uint8_t *dtoh_buf;                    /* dtoh_max bytes: the largest copy the loop answers (what
                                           * `tensor.item()` and other small reads ask for; larger
                                           * ones take the worker's chunked path) */
    uint32_t dtoh_max;
    int32_t sock;                         /* the session's socket, for the copy's data and reply */
    uint32_t dtoh_op;
    uint32_t replies_ok;                  /* 0: stop at a copy (an error waits to be reported first, or a
                                           * host node may be sending on the socket) */
    /* What the runs did: */
    int32_t copy_failed;                  /* per run: a copy the driver refused (it ends the run; the worker replies) */
    uint32_t copy_seq;                    /* its frame's sequence number */
    int32_t send_errno;                   /* per run: the socket failed (the session is over) */
    uint32_t pad2;
    uint64_t copies;                      /* in all: copies answered */
    uint64_t sent;                        /* in all: bytes sent */
    /* Launches with attributes (cuLaunchKernelEx: cluster dimensions, programmatic serialisation,
     * ...; cuBLAS and cuDNN launch most of their Hopper kernels so). Set by the worker: */
    launch_ex_fn launch_ex;               /* NULL: attributed launches stay in Python */
    uint32_t event_attrs[2];              /* attribute ids whose value starts with a client event
                                           * (programmatic, completion): translated, or left to Python */
    uint64_t launched_ex;                 /* in all: attributed launches (also counted in `launched`) */
    /* Pipelined 1-D memsets (cuMemsetD8Async, cuMemsetD16Async, cuMemsetD32Async: PyTorch zeroes
     * gradients and workspaces so, ~22 per ResNet-18 training step). Set by the worker: */
    memset_d8_fn memset_d8;               /* any of these NULL: that width stays in Python */
    memset_d16_fn memset_d16;
    memset_d32_fn memset_d32;
    uint32_t memset_ops[RGPU_MEMSET_KINDS];   /* opcodes (api_gen.OPCODES), D8, D16, D32 */
    uint32_t pad3;
    uint64_t memsets;                     /* in all: memsets run (failed ones too, as launches) */
} rgpu_loop;

/* The driver's stream for the client's handle s, from the worker's (handle, stream) table
 * (worker_launch.c); 0 when it is not there. */
int rgpu_real_stream(const uint64_t *table, uint32_t mask, uint64_t s, uint64_t *out);

/* One small device-to-host copy (payload p, len bytes, the frame's seq): copied, its data and
 * reply sent. 0: left to the worker (worker_copies.c). */
int rgpu_small_dtoh(rgpu_loop *L, const uint8_t *p, uint32_t len, uint32_t seq);

#endif
