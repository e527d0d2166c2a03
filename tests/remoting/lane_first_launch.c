/* What a cudart program does after its first large cudaMemcpy: the copy (pageable, synchronous, on the
 * legacy stream, striped over the data lanes), then the first launch of a kernel, whose code the driver
 * loads only now (lazy loading; loading may synchronise the context), then a synchronisation and the
 * result back. argv[1]: "library" (cudart's way: cuLibraryLoadData before the copies, the CUkernel
 * launched as a function after them) or "module" (cuModuleLoadData before, cuModuleGetFunction after);
 * argv[2]: a PTX file with vecadd(a, b, c, n); argv[3]: each input's size in MiB. Prints each check
 * (driver_checks.h), then RESULT OK or MISMATCH; exits with the count of failures. Four of NVIDIA's
 * cuda-samples with this shape hung when the worker's receiving thread queued the copy's DMAs. */
#include <string.h>

#include "driver_checks.h"

int main(int argc, char **argv) {
    if (argc < 4) { printf("usage: lane_first_launch library|module PTX MIB\n"); return 2; }
    int library = !strcmp(argv[1], "library");
    char *ptx = read_file(argv[2]);
    if (!ptx) { printf("FAIL reading %s\n", argv[2]); return 1; }
    int n = (int)(((size_t)atoi(argv[3]) << 20) / sizeof(float));
    size_t bytes = (size_t)n * sizeof(float);
    CUlibrary lib = NULL;
    CUmodule mod = NULL;
    CUkernel kernel = NULL;
    CUfunction fn = NULL;
    CUdeviceptr da = 0, db = 0, dc = 0;
    primary_context();
    if (library) CHECK("cuLibraryLoadData", cuLibraryLoadData(&lib, ptx, NULL, NULL, 0, NULL, NULL, 0));
    else CHECK("cuModuleLoadData", cuModuleLoadData(&mod, ptx));
    float *a = malloc(bytes), *b = malloc(bytes), *c = malloc(bytes);
    if (!a || !b || !c) { printf("FAIL malloc\n"); return 1; }
    for (int i = 0; i < n; i++) { a[i] = (float)(i % 1000); b[i] = (float)(2 * (i % 777)); }
    QUIET(cuMemAlloc(&da, bytes));
    QUIET(cuMemAlloc(&db, bytes));
    QUIET(cuMemAlloc(&dc, bytes));
    CHECK("cuMemcpyHtoD a", cuMemcpyHtoD(da, a, bytes));
    CHECK("cuMemcpyHtoD b", cuMemcpyHtoD(db, b, bytes));
    if (library) {
        CHECK("cuLibraryGetKernel", cuLibraryGetKernel(&kernel, lib, "vecadd"));
        fn = (CUfunction)kernel;
    } else {
        CHECK("cuModuleGetFunction", cuModuleGetFunction(&fn, mod, "vecadd"));
    }
    void *args[] = {&da, &db, &dc, &n};
    CHECK("cuLaunchKernel", cuLaunchKernel(fn, (unsigned)((n + 255) / 256), 1, 1, 256, 1, 1, 0, NULL, args, NULL));
    CHECK("cuCtxSynchronize", cuCtxSynchronize());
    CHECK("cuMemcpyDtoH", cuMemcpyDtoH(c, dc, bytes));
    for (int i = 0; i < n; i++)
        if (c[i] != a[i] + b[i]) {
            printf("FAIL MISMATCH at %d: %g, not %g\n", i, c[i], a[i] + b[i]);
            return failures + 1;
        }
    printf("RESULT OK\n");
    return failures;
}
