/* Function and kernel attribute sets as PyTorch, cuDNN and flash-attention make them (issue 24):
 * the maximum dynamic shared memory set to a new value before each launch that uses that much.
 * Through rgpu the sets travel pipelined, checked in the client; the program checks the answers
 * and what each launch got. Its kernel is real PTX (the emulated GPU runs it by name): it stores
 * the launch's dynamic shared memory size at the end of that memory, reads it back and writes it
 * to its output.
 *
 *   attr_loop loop N      N iterations of set + launch (function and library kernel), results checked
 *   attr_loop invalid     values CUDA refuses at once; a launch beyond the value set fails later
 *   attr_loop other       attributes the client does not check (cluster, unknown): the driver answers
 *   attr_loop refused     a value the worker refuses (RGPU_EMULATED_REFUSE_SHARED_ABOVE=60000)
 *   attr_loop slices      two devices that differ: occupancy and limits answered per device
 *
 * Prints "OK <check>" or "FAIL <check> ..." and exits with the number of failures. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver_checks.h"

static const char PTX[] =
    ".version 7.0\n"
    ".target sm_80\n"
    ".address_size 64\n"
    ".extern .shared .align 16 .b8 dyn[];\n"
    ".visible .entry rgpu_emulated_shared_probe(.param .u64 out)\n"
    "{\n"
    "    .reg .b32 %r<6>;\n"
    "    .reg .b64 %rd<3>;\n"
    "    ld.param.u64 %rd1, [out];\n"
    "    cvta.to.global.u64 %rd2, %rd1;\n"
    "    mov.u32 %r1, %dynamic_smem_size;\n"
    "    mov.u32 %r2, dyn;\n"
    "    add.u32 %r3, %r2, %r1;\n"
    "    sub.u32 %r3, %r3, 4;\n"
    "    st.shared.u32 [%r3], %r1;\n"
    "    bar.sync 0;\n"
    "    ld.shared.u32 %r4, [%r3];\n"
    "    st.global.u32 [%rd2], %r4;\n"
    "    ret;\n"
    "}\n";

enum { MAX_DYN = CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CARVEOUT = CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT };

static CUresult launch(CUfunction f, unsigned int shmem, CUdeviceptr out) {
    void *params[] = {&out};
    return cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, shmem, NULL, params, NULL);
}

/* A value that changes from launch to launch, as PyTorch's do, within every current GPU's limit. */
static int value_at(int i) { return 50000 + (i % 7) * 16000; }

static void loop(CUfunction fn, CUkernel k, CUdevice dev, int n) {
    CUdeviceptr out;
    CHECK("cuMemAlloc", cuMemAlloc(&out, (size_t)n * 2 * 4 + 4));
    CHECK("cuMemsetD32", cuMemsetD32(out, 0, (size_t)n * 2));
    CHECK("cuCtxSynchronize before the loop", cuCtxSynchronize());
    for (int i = 0; i < n; i++) {
        int v = value_at(i), got = 0;
        QUIET(cuFuncSetAttribute(fn, MAX_DYN, v));
        QUIET(cuFuncGetAttribute(&got, MAX_DYN, fn));
        SAME("cuFuncGetAttribute after the set", got, v);
        QUIET(launch(fn, (unsigned int)v, out + (size_t)i * 8));
        int w = value_at(i + 3);
        QUIET(cuKernelSetAttribute(MAX_DYN, w, k, dev));
        QUIET(cuKernelGetAttribute(&got, MAX_DYN, k, dev));
        SAME("cuKernelGetAttribute after the set", got, w);
        QUIET(launch((CUfunction)k, (unsigned int)w, out + (size_t)i * 8 + 4));
        QUIET(cuFuncSetAttribute(fn, CARVEOUT, i % 101));
    }
    CHECK("cuCtxSynchronize after the loop", cuCtxSynchronize());
    unsigned int *host = calloc((size_t)n * 2, 4);
    CHECK("cuMemcpyDtoH", cuMemcpyDtoH(host, out, (size_t)n * 2 * 4));
    int exact = 1;
    for (int i = 0; i < n; i++) {
        if (host[2 * i] != (unsigned int)value_at(i) || host[2 * i + 1] != (unsigned int)value_at(i + 3)) {
            printf("FAIL launch %d got %u and %u bytes, wanted %d and %d\n", i, host[2 * i], host[2 * i + 1],
                   value_at(i), value_at(i + 3));
            exact = 0;
        }
    }
    CHECK("every launch got the shared memory set before it", exact ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN);
    free(host);
    cuMemFree(out);
}

static void invalid(CUfunction fn, CUkernel k, CUdevice dev) {
    int optin = 0, static_size = -1, before = 0, after = 0;
    CHECK("optin", cuDeviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev));
    CHECK("static shared size", cuFuncGetAttribute(&static_size, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn));
    CHECK("a value at the limit", cuFuncSetAttribute(fn, MAX_DYN, optin - static_size));
    CHECK("cuFuncGetAttribute", cuFuncGetAttribute(&before, MAX_DYN, fn));
    WANT("one byte beyond the opt-in limit", CUDA_ERROR_INVALID_VALUE, cuFuncSetAttribute(fn, MAX_DYN, optin - static_size + 1));
    WANT("a negative size", CUDA_ERROR_INVALID_VALUE, cuFuncSetAttribute(fn, MAX_DYN, -1));
    WANT("a kernel beyond the opt-in limit", CUDA_ERROR_INVALID_VALUE, cuKernelSetAttribute(MAX_DYN, optin + 1, k, dev));
    WANT("a carveout of 101", CUDA_ERROR_INVALID_VALUE, cuFuncSetAttribute(fn, CARVEOUT, 101));
    WANT("a carveout of -2", CUDA_ERROR_INVALID_VALUE, cuFuncSetAttribute(fn, CARVEOUT, -2));
    WANT("read-only MAX_THREADS_PER_BLOCK", CUDA_ERROR_INVALID_VALUE,
         cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 128));
    WANT("read-only NUM_REGS of a kernel", CUDA_ERROR_INVALID_VALUE, cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_NUM_REGS, 8, k, dev));
    CHECK("cuFuncGetAttribute after the refusals", cuFuncGetAttribute(&after, MAX_DYN, fn));
    SAME("the value is the last one set", after, before);
    CHECK("the default carveout (-1)", cuFuncSetAttribute(fn, CARVEOUT, -1));
    CHECK("cuCtxSynchronize: nothing failed on the worker", cuCtxSynchronize());
    /* A launch beyond the value set fails as the driver fails it (pipelined: at the next sync). */
    CUdeviceptr out;
    CHECK("cuMemAlloc", cuMemAlloc(&out, 4));
    CHECK("a small maximum", cuFuncSetAttribute(fn, MAX_DYN, 1024));
    CUresult r = launch(fn, 2048, out);
    if (r == CUDA_SUCCESS) r = cuCtxSynchronize();
    WANT("a launch with more dynamic shared memory than set", CUDA_ERROR_INVALID_VALUE, r);
    CHECK("cuCtxSynchronize: the session goes on", cuCtxSynchronize());
    cuMemFree(out);
}

static void other(CUfunction fn) {
    int width = -1;
    CHECK("REQUIRED_CLUSTER_WIDTH 2", cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH, 2));
    CHECK("cuFuncGetAttribute", cuFuncGetAttribute(&width, CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH, fn));
    SAME("the cluster width set", width, 2);
    WANT("REQUIRED_CLUSTER_WIDTH 9 (not portable)", CUDA_ERROR_INVALID_VALUE,
         cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH, 9));
    WANT("an unknown attribute", CUDA_ERROR_INVALID_VALUE, cuFuncSetAttribute(fn, (CUfunction_attribute)99, 1));
}

static void refused(CUfunction fn) {
    int got = 0;
    CHECK("a value the worker takes", cuFuncSetAttribute(fn, MAX_DYN, 50000));
    CHECK("cuCtxSynchronize", cuCtxSynchronize());
    CHECK("a value only the worker refuses (pipelined)", cuFuncSetAttribute(fn, MAX_DYN, 70000));
    CHECK("cuFuncGetAttribute", cuFuncGetAttribute(&got, MAX_DYN, fn));
    SAME("the value set answers at once", got, 70000);
    WANT("the next synchronising call reports the refusal", CUDA_ERROR_INVALID_VALUE, cuCtxSynchronize());
    CHECK("cuFuncGetAttribute after the refusal", cuFuncGetAttribute(&got, MAX_DYN, fn));
    SAME("the worker's value answers", got, 50000);
    CHECK("cuCtxSynchronize: the session goes on", cuCtxSynchronize());
}

/* Two devices whose limits differ: each context's answers are its own device's. */
static void slices(void) {
    CUcontext ctx[2];
    CUfunction fn[2];
    size_t smem[2][2];
    int grid[2][2], block[2], optin[2];
    for (int d = 0; d < 2; d++) {
        CUmodule mod;
        CHECK("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&ctx[d], d));
        CHECK("cuCtxSetCurrent", cuCtxSetCurrent(ctx[d]));
        CHECK("cuModuleLoadData", cuModuleLoadData(&mod, PTX));
        CHECK("cuModuleGetFunction", cuModuleGetFunction(&fn[d], mod, "rgpu_emulated_shared_probe"));
        CHECK("optin", cuDeviceGetAttribute(&optin[d], CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, d));
    }
    for (int round = 0; round < 2; round++)
        for (int d = 0; d < 2; d++) {
            CHECK("cuCtxSetCurrent", cuCtxSetCurrent(ctx[d]));
            CHECK("cuOccupancyAvailableDynamicSMemPerBlock", cuOccupancyAvailableDynamicSMemPerBlock(&smem[d][round], fn[d], 1, 32));
            CHECK("cuOccupancyMaxPotentialBlockSize", cuOccupancyMaxPotentialBlockSize(&grid[d][round], &block[d], fn[d], NULL, 0, 0));
        }
    for (int d = 0; d < 2; d++) {
        SAME("the second answer", smem[d][1], smem[d][0]);
        SAME("the second grid", grid[d][1], grid[d][0]);
        CHECK("cuCtxSetCurrent", cuCtxSetCurrent(ctx[d]));
        CUresult r = cuFuncSetAttribute(fn[d], MAX_DYN, 200000);
        printf("SLICE %d optin %d smem %zu grid %d set200000 %s\n", d, optin[d], smem[d][0], grid[d][0], name_of(r));
    }
    CHECK("cuCtxSynchronize", cuCtxSynchronize());
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s loop N | invalid | other | refused | slices\n", argv[0]);
        return 2;
    }
    CUmodule mod;
    CUlibrary lib;
    CUfunction fn;
    CUkernel k;
    if (!strcmp(argv[1], "slices")) {
        CHECK("cuInit", cuInit(0));
        slices();
        printf("DONE %d failure(s)\n", failures);
        return failures;
    }
    CUdevice dev = primary_context();
    CHECK("cuModuleLoadData", cuModuleLoadData(&mod, PTX));
    CHECK("cuModuleGetFunction", cuModuleGetFunction(&fn, mod, "rgpu_emulated_shared_probe"));
    CHECK("cuLibraryLoadData", cuLibraryLoadData(&lib, PTX, NULL, NULL, 0, NULL, NULL, 0));
    CHECK("cuLibraryGetKernel", cuLibraryGetKernel(&k, lib, "rgpu_emulated_shared_probe"));
    if (!strcmp(argv[1], "loop") && argc > 2) loop(fn, k, dev, atoi(argv[2]));
    else if (!strcmp(argv[1], "invalid")) invalid(fn, k, dev);
    else if (!strcmp(argv[1], "other")) other(fn);
    else if (!strcmp(argv[1], "refused")) refused(fn);
    else return 2;
    printf("DONE %d failure(s)\n", failures);
    return failures;
}
