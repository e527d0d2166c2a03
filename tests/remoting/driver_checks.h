/* Checks shared by the C driver-API test programs (clientside_loop.c, attr_loop.c): each check
 * prints "OK <name>" or "FAIL <name> ..." and counts failures; the program exits with the count. */
#ifndef RGPU_TEST_DRIVER_CHECKS_H
#define RGPU_TEST_DRIVER_CHECKS_H
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

static int failures;

static const char *name_of(CUresult r) {
    const char *s = "?";
    cuGetErrorName(r, &s);
    return s;
}

#define WANT(name, want, call)                                                                   \
    do {                                                                                         \
        CUresult r_ = (call);                                                                    \
        if (r_ == (want)) printf("OK %s\n", name);                                               \
        else {                                                                                   \
            printf("FAIL %s: %s (%d), wanted %s\n", name, name_of(r_), (int)r_, name_of(want));  \
            failures++;                                                                          \
        }                                                                                        \
    } while (0)
#define CHECK(name, call) WANT(name, CUDA_SUCCESS, call)
#define QUIET(call)                                                                              \
    do {                                                                                         \
        CUresult r_ = (call);                                                                    \
        if (r_ != CUDA_SUCCESS) {                                                                \
            printf("FAIL %s line %d: %s\n", #call, __LINE__, name_of(r_));                      \
            failures++;                                                                          \
        }                                                                                        \
    } while (0)
#define SAME(what, a, b)                                                                         \
    do {                                                                                         \
        if ((a) != (b)) {                                                                        \
            printf("FAIL %s: %lld, first answer %lld\n", what, (long long)(a), (long long)(b));   \
            failures++;                                                                          \
        }                                                                                        \
    } while (0)

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (fread(b, 1, (size_t)n, f) != (size_t)n) { fclose(f); free(b); return NULL; }
    fclose(f);
    b[n] = 0;
    return b;
}

/* cuInit, then device 0's primary context made current; returns the device. */
static inline CUdevice primary_context(void) {
    CUdevice dev = 0;
    CUcontext ctx;
    CHECK("cuInit", cuInit(0));
    CHECK("cuDeviceGet", cuDeviceGet(&dev, 0));
    CHECK("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK("cuCtxSetCurrent", cuCtxSetCurrent(ctx));
    return dev;
}

#endif
