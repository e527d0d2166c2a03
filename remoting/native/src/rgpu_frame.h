/* The framed protocol's 24-byte header (remoting/datapath/protocol.py documents it), shared by the
 * client library (transport.c) and the worker's C loop (worker_copies.c). */
#ifndef RGPU_FRAME_H
#define RGPU_FRAME_H

#include <stdint.h>
#include <string.h>

#define RGPU_FRAME_HEADER_SIZE 24u   /* u32 len, u16 op, u16 flags, u32 seq, u32 aux, u64 ctx */

static inline void rgpu_put_header(uint8_t *h, uint32_t len, uint16_t op, uint16_t flags, uint32_t seq,
                                   uint32_t aux, uint64_t ctx) {
    memcpy(h, &len, 4);
    memcpy(h + 4, &op, 2);
    memcpy(h + 6, &flags, 2);
    memcpy(h + 8, &seq, 4);
    memcpy(h + 12, &aux, 4);
    memcpy(h + 16, &ctx, 8);
}

#endif
