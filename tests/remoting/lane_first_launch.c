/* What a cudart program does after its first large cudaMemcpy: the copy (pageable, synchronous, on the
 * legacy stream, striped over the data lanes), then the first launch of a kernel, whose code the driver
 * loads only now (lazy loading; loading may synchronise the context), then a synchronisation and the
 * result back. argv[1]: "library" (cudart's way: cuLibraryLoadData before the copies, the CUkernel
 * launched as a function after them) or "module" (cuModuleLoadData before, cuModuleGetFunction after);
 * argv[2]: a PTX file with vecadd(a, b, c, n); argv[3]: each input's size in MiB. Prints OK, or what
 * failed. Four of NVIDIA's cuda-samples with this shape hung when the worker received such a copy on
 * a thread of its own (RGPU_LANES_BACKGROUND=1). */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call) do { CUresult r_ = (call); if (r_) { printf("FAILED %s: %d\n", #call, (int)r_); return 1; } } while (0)

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = calloc(1, (size_t)n + 1);
    if (text && fread(text, 1, (size_t)n, f) != (size_t)n) { free(text); text = NULL; }
    fclose(f);
    return text;
}

int main(int argc, char **argv) {
    if (argc < 4) { printf("usage: lane_first_launch library|module PTX MIB\n"); return 2; }
    int library = !strcmp(argv[1], "library");
    char *ptx = read_file(argv[2]);
    if (!ptx) { printf("FAILED reading %s\n", argv[2]); return 1; }
    int n = (int)(((size_t)atoi(argv[3]) << 20) / sizeof(float));
    size_t bytes = (size_t)n * sizeof(float);
    CUdevice d;
    CUcontext ctx;
    CUlibrary lib = NULL;
    CUmodule mod = NULL;
    CUkernel kernel;
    CUfunction fn;
    CUdeviceptr da, db, dc;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&d, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, d));
    CHECK(cuCtxSetCurrent(ctx));
    if (library) CHECK(cuLibraryLoadData(&lib, ptx, NULL, NULL, 0, NULL, NULL, 0));
    else CHECK(cuModuleLoadData(&mod, ptx));
    float *a = malloc(bytes), *b = malloc(bytes), *c = malloc(bytes);
    if (!a || !b || !c) { printf("FAILED malloc\n"); return 1; }
    for (int i = 0; i < n; i++) { a[i] = (float)(i % 1000); b[i] = (float)(2 * (i % 777)); }
    CHECK(cuMemAlloc(&da, bytes));
    CHECK(cuMemAlloc(&db, bytes));
    CHECK(cuMemAlloc(&dc, bytes));
    CHECK(cuMemcpyHtoD(da, a, bytes));
    CHECK(cuMemcpyHtoD(db, b, bytes));
    if (library) {
        CHECK(cuLibraryGetKernel(&kernel, lib, "vecadd"));
        fn = (CUfunction)kernel;
    } else {
        CHECK(cuModuleGetFunction(&fn, mod, "vecadd"));
    }
    void *args[] = {&da, &db, &dc, &n};
    CHECK(cuLaunchKernel(fn, (unsigned)((n + 255) / 256), 1, 1, 256, 1, 1, 0, NULL, args, NULL));
    CHECK(cuCtxSynchronize());
    CHECK(cuMemcpyDtoH(c, dc, bytes));
    for (int i = 0; i < n; i++)
        if (c[i] != a[i] + b[i]) { printf("MISMATCH at %d: %g, not %g\n", i, c[i], a[i] + b[i]); return 1; }
    printf("OK\n");
    return 0;
}
