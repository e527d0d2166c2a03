/* The bridge between rgpu's libnccl.so.2 and libcuda.so.1 in one process: libcuda's calls and
 * sessions, handed out as a private export table (cuGetExportTable with RGPU_NCCL_BRIDGE_UUID), so
 * an NCCL collective is a frame in the same session as the launches around it and libcuda exports
 * nothing beyond the driver's own names. Both libraries are built from one source tree (build.py),
 * so the struct and rgpu_call have one layout; `size` and `version` guard against a mixed folder. */
#ifndef RGPU_NCCL_BRIDGE_H
#define RGPU_NCCL_BRIDGE_H

#include "rgpu_client.h"

#define RGPU_NCCL_BRIDGE_VERSION 1
/* "rgpu-nccl-bridge" */
#define RGPU_NCCL_BRIDGE_UUID {0x72, 0x67, 0x70, 0x75, 0x2d, 0x6e, 0x63, 0x63, 0x6c, 0x2d, 0x62, 0x72, 0x69, 0x64, 0x67, 0x65}

typedef struct rgpu_nccl_bridge {
    size_t size;
    int version;
    int protocol;                                       /* RGPU_PROTOCOL_VERSION of libcuda's build */
    CUresult (*current_session)(int *session);          /* the calling thread's slice (after cuInit) */
    int (*session_count)(void);
    CUresult (*begin_session)(rgpu_call *c, uint16_t op, int session);
    void (*put)(rgpu_call *c, const void *p, size_t n);
    CUresult (*async_now)(rgpu_call *c);                /* sent at once: peers' workers wait for it */
    CUresult (*sync)(rgpu_call *c);
    void (*get)(rgpu_call *c, void *p, size_t n);
    void (*end)(rgpu_call *c);
    void (*abort_)(rgpu_call *c);
    int (*log_level)(void);
    void (*log_line)(int level, const char *line);
} rgpu_nccl_bridge;

#endif
