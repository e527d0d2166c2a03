/* Small synchronous calls as a driver-API program makes them, timed per call (issue 24):
 *   idle   cuStreamSynchronize on an idle stream
 *   item   what `tensor.item()` does: a launch, a 4-byte device-to-host copy on the stream, a
 *          stream synchronize
 * Prints one JSON line with the median and p99 of each, in microseconds. No rgpu in it: run it
 * against NVIDIA's libcuda.so.1 and through rgpu's (benchmarks/sync_latency.py does both).
 *
 *   sync_latency PTX [iterations] */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define OK(call)                                                                              \
    do {                                                                                      \
        CUresult r_ = (call);                                                                 \
        if (r_ != CUDA_SUCCESS) {                                                             \
            const char *s_ = "?";                                                             \
            cuGetErrorName(r_, &s_);                                                          \
            fprintf(stderr, "sync_latency: %s failed: %s\n", #call, s_);                      \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void summary(const char *name, double *t, int n, const char *sep) {
    qsort(t, (size_t)n, sizeof *t, by_value);
    printf("\"%s_us_median\": %.2f, \"%s_us_p99\": %.2f%s", name, t[n / 2], name, t[(int)(n * 0.99)], sep);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: sync_latency PTX [iterations]\n");
        return 2;
    }
    int n = argc > 2 ? atoi(argv[2]) : 5000;
    FILE *f = fopen(argv[1], "rb");
    if (!f) {
        fprintf(stderr, "sync_latency: cannot open %s\n", argv[1]);
        return 2;
    }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *ptx = calloc(1, (size_t)size + 1);
    if (fread(ptx, 1, (size_t)size, f) != (size_t)size) return 2;
    fclose(f);

    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction empty;
    CUstream stream;
    CUdeviceptr buf;
    OK(cuInit(0));
    OK(cuDeviceGet(&dev, 0));
    OK(cuDevicePrimaryCtxRetain(&ctx, dev));
    OK(cuCtxSetCurrent(ctx));
    OK(cuModuleLoadData(&mod, ptx));
    OK(cuModuleGetFunction(&empty, mod, "empty"));
    OK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    OK(cuMemAlloc(&buf, 4));
    OK(cuMemsetD32(buf, 7, 1));
    OK(cuCtxSynchronize());

    double *t = calloc((size_t)n, sizeof *t);
    int warm = n / 10;
    for (int i = 0; i < n + warm; i++) {
        double t0 = now_us();
        OK(cuStreamSynchronize(stream));
        if (i >= warm) t[i - warm] = now_us() - t0;
    }
    printf("{");
    summary("idle_sync", t, n, ", ");
    unsigned int value = 0;
    for (int i = 0; i < n + warm; i++) {
        double t0 = now_us();
        OK(cuLaunchKernel(empty, 1, 1, 1, 32, 1, 1, 0, stream, NULL, NULL));
        OK(cuMemcpyDtoHAsync(&value, buf, 4, stream));
        OK(cuStreamSynchronize(stream));
        if (i >= warm) t[i - warm] = now_us() - t0;
    }
    if (value != 7) {
        fprintf(stderr, "sync_latency: read %u, expected 7\n", value);
        return 1;
    }
    summary("item", t, n, "");
    printf("}\n");
    return 0;
}
