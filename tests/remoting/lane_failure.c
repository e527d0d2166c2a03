/* A striped copy whose data lane breaks (lane_cut.c cuts it): the copy fails, the next synchronising
 * call reports the worker's side of it, and the session goes on: later copies arrive whole. argv[1]:
 * htod (the cut copy goes to the device), htod-async (the same from page-locked memory with
 * cuMemcpyHtoDAsync: it returns at once, its failure answers the synchronisation) or dtoh (it comes
 * back). Prints COPY <code>, SYNC <code>, then OK. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    int dtoh = argc > 1 && !strcmp(argv[1], "dtoh");
    int async = argc > 1 && !strcmp(argv[1], "htod-async");
    CUdevice d;
    CUcontext ctx;
    size_t n = 16u << 20;
    if (cuInit(0) || cuDeviceGet(&d, 0) || cuDevicePrimaryCtxRetain(&ctx, d) || cuCtxSetCurrent(ctx)) return 2;
    unsigned char *a = NULL, *b = malloc(n);
    if (async ? cuMemAllocHost((void **)&a, n) != CUDA_SUCCESS : !(a = malloc(n))) return 2;
    for (size_t j = 0; j < n; j++) a[j] = (unsigned char)(j * 7 + (j >> 16));
    CUdeviceptr p;
    if (cuMemAlloc(&p, n)) return 2;
    if (dtoh && cuMemcpyHtoD(p, a, n)) return 3;
    printf("COPY %d\n", (int)(dtoh ? cuMemcpyDtoH(b, p, n) : async ? cuMemcpyHtoDAsync(p, a, n, NULL) : cuMemcpyHtoD(p, a, n)));
    printf("SYNC %d\n", (int)cuCtxSynchronize());
    for (int k = 0; k < 2; k++) {
        a[k] ^= 0x5a;
        memset(b, 0, n);
        CUresult r1 = cuMemcpyHtoD(p, a, n), r2 = cuMemcpyDtoH(b, p, n), r3 = cuCtxSynchronize();
        if (r1 || r2 || r3 || memcmp(a, b, n)) {
            printf("AFTER %d %d %d %s\n", (int)r1, (int)r2, (int)r3, memcmp(a, b, n) ? "MISMATCH" : "same");
            return 1;
        }
    }
    printf("OK\n");
    return 0;
}
