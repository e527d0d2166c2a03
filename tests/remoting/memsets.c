/* Pipelined 1-D memsets of each width (cuMemsetD8Async, cuMemsetD16Async, cuMemsetD32Async), as
 * PyTorch zeroes gradients and workspaces with them. argv[1]: rounds. The buffer is first filled
 * with 0xEE on the NULL stream; then each round sets the first half of its own slot in each of
 * three regions (one per width) on a created stream, to a value of its own, so a memset lost, run
 * twice, run with the wrong value, count or width shows in the bytes read back. Prints each check
 * (driver_checks.h), then RESULT OK or MISMATCH; exits with the failures. */
#include <stdint.h>
#include <string.h>

#include "driver_checks.h"

#define SLOT 64u   /* bytes per round and region; each round sets the first half */

static uint8_t d8_value(int i) { return (uint8_t)(0x11 + i); }
static uint16_t d16_value(int i) { return (uint16_t)(0xA500 + i); }
static uint32_t d32_value(int i) { return 0xC0DE0000u + (uint32_t)i; }

int main(int argc, char **argv) {
    if (argc < 2) { printf("usage: memsets ROUNDS\n"); return 2; }
    int rounds = atoi(argv[1]);
    size_t region = (size_t)rounds * SLOT, total = 3 * region;
    CUstream stream;
    CUdeviceptr buf;
    primary_context();
    CHECK("cuStreamCreate", cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CHECK("cuMemAlloc", cuMemAlloc(&buf, total));
    CHECK("cuMemsetD8Async NULL stream", cuMemsetD8Async(buf, 0xEE, total, NULL));
    CHECK("cuCtxSynchronize", cuCtxSynchronize());
    int first = 1;
    for (int i = 0; i < rounds; i++) {
        CUdeviceptr at = buf + (CUdeviceptr)i * SLOT;
        CUresult r8 = cuMemsetD8Async(at, d8_value(i), SLOT / 2, stream);
        CUresult r16 = cuMemsetD16Async(at + region, d16_value(i), SLOT / 4, stream);
        CUresult r32 = cuMemsetD32Async(at + 2 * region, d32_value(i), SLOT / 8, stream);
        if (first || r8 || r16 || r32) {
            CHECK("cuMemsetD8Async", r8);
            CHECK("cuMemsetD16Async", r16);
            CHECK("cuMemsetD32Async", r32);
            first = 0;
        }
    }
    CHECK("cuStreamSynchronize", cuStreamSynchronize(stream));
    uint8_t *host = malloc(total);
    CHECK("cuMemcpyDtoH", cuMemcpyDtoH(host, buf, total));
    for (int i = 0; i < rounds; i++) {
        uint8_t want[3][SLOT];
        uint16_t v16 = d16_value(i);
        uint32_t v32 = d32_value(i);
        memset(want, 0xEE, sizeof want);
        memset(want[0], d8_value(i), SLOT / 2);
        for (unsigned k = 0; k < SLOT / 2; k += 2) memcpy(want[1] + k, &v16, 2);
        for (unsigned k = 0; k < SLOT / 2; k += 4) memcpy(want[2] + k, &v32, 4);
        for (int w = 0; w < 3; w++)
            if (memcmp(host + (size_t)w * region + (size_t)i * SLOT, want[w], SLOT)) {
                printf("FAIL MISMATCH in round %d, region %d (D%d)\n", i, w, 8 << w);
                return failures + 1;
            }
    }
    printf("RESULT OK\n");
    return failures;
}
