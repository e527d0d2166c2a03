/* Host-to-device then device-to-host copies of the sizes given (bytes), from pageable (malloc) and
 * pinned (cuMemAllocHost) buffers, synchronous and on a stream, at an odd offset too; each checked
 * byte for byte (test_lanes_emulated.py runs it with data lanes on and off). Prints OK. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x)                                                                              \
    do {                                                                                   \
        CUresult r_ = (x);                                                                 \
        if (r_) {                                                                          \
            const char *m = "?";                                                           \
            cuGetErrorName(r_, &m);                                                        \
            printf("FAIL %s = %d %s (line %d)\n", #x, (int)r_, m, __LINE__);               \
            return 1;                                                                      \
        }                                                                                  \
    } while (0)

static void fill(unsigned char *a, size_t n, int salt) {
    for (size_t j = 0; j < n; j++) a[j] = (unsigned char)(j * 131 + (j >> 12) + salt);
}

int main(int argc, char **argv) {
    CUdevice d;
    CUcontext ctx;
    CUstream st;
    CK(cuInit(0));
    CK(cuDeviceGet(&d, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, d));
    CK(cuCtxSetCurrent(ctx));
    CK(cuStreamCreate(&st, 0));
    for (int i = 1; i < argc; i++) {
        size_t n = strtoull(argv[i], NULL, 10);
        for (int pinned = 0; pinned < 2; pinned++) {
            unsigned char *a, *b;
            if (pinned) {
                CK(cuMemAllocHost((void **)&a, n + 16));
                CK(cuMemAllocHost((void **)&b, n + 16));
            } else {
                a = malloc(n + 16);
                b = malloc(n + 16);
            }
            fill(a, n + 16, i + pinned);
            CUdeviceptr p;
            CK(cuMemAlloc(&p, n + 16));
            if ((i + pinned) % 2) {
                CK(cuMemcpyHtoDAsync(p, a, n, st));
                memset(b, 0, n);
                CK(cuMemcpyDtoHAsync(b, p, n, st));
                CK(cuStreamSynchronize(st));
            } else {
                CK(cuMemcpyHtoD(p, a, n));
                memset(b, 0, n);
                CK(cuMemcpyDtoH(b, p, n));
            }
            if (memcmp(a, b, n)) {
                printf("MISMATCH at size %zu (%s)\n", n, pinned ? "pinned" : "pageable");
                return 1;
            }
            /* An odd offset into the allocation, from an odd offset of the host buffer. */
            CK(cuMemcpyHtoD(p + 7, a + 3, n));
            memset(b, 0, n + 16);
            CK(cuMemcpyDtoH(b + 5, p + 7, n));
            if (memcmp(a + 3, b + 5, n)) {
                printf("MISMATCH at offset copy of size %zu (%s)\n", n, pinned ? "pinned" : "pageable");
                return 1;
            }
            CK(cuMemFree(p));
            if (pinned) {
                CK(cuMemFreeHost(a));
                CK(cuMemFreeHost(b));
            } else {
                free(a);
                free(b);
            }
        }
    }
    CK(cuCtxSynchronize());
    printf("OK\n");
    return 0;
}
