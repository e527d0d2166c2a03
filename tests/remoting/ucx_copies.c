/* Host<->device copies of several sizes, synchronous and on a stream, each checked byte for byte
 * (test_ucx_emulated.py runs it with UCX on, off and forced to one transport). Prints OK. */
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

int main(void) {
    CUdevice d;
    CUcontext ctx;
    CUstream st;
    CK(cuInit(0));
    CK(cuDeviceGet(&d, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, d));
    CK(cuCtxSetCurrent(ctx));
    CK(cuStreamCreate(&st, 0));
    /* Below, at and above the 1 MiB threshold, odd sizes, and 128 MiB. */
    const size_t sizes[] = {1, 4097, (1u << 20) - 1, 1u << 20, (1u << 20) + 3, 5u * 1000 * 1000 + 7, 128u << 20};
    for (int i = 0; i < (int)(sizeof sizes / sizeof *sizes); i++) {
        size_t n = sizes[i];
        unsigned char *a = malloc(n), *b = malloc(n);
        for (size_t j = 0; j < n; j++) a[j] = (unsigned char)(j * 131 + (j >> 12) + i);
        CUdeviceptr p;
        CK(cuMemAlloc(&p, n));
        if (i % 2) {
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
            printf("MISMATCH at size %zu\n", n);
            return 1;
        }
        /* Part of the buffer: an offset into the allocation, back into the middle of the host copy. */
        if (n > 64) {
            CK(cuMemcpyHtoD(p + 7, a + 1, n - 64));
            CK(cuMemcpyDtoH(b + 3, p + 7, n - 64));
            if (memcmp(a + 1, b + 3, n - 64)) {
                printf("MISMATCH at offset copy of size %zu\n", n - 64);
                return 1;
            }
        }
        CK(cuMemFree(p));
        free(a);
        free(b);
    }
    printf("OK\n");
    return 0;
}
