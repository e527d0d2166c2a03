/* One rank of benchmarks/nccl_allreduce.py: an all-reduce (float32 sum) of MIB MiB, timed over ITERS
 * runs after 3 warm-up runs. Built against rgpu's rgpu_nccl.h (NCCL's ABI) and linked to libcuda.so.1
 * and libnccl.so.2, so the library path decides whether it runs through rgpu or on local GPUs.
 *
 *   nccl_allreduce RANK NRANKS IDFILE MIB ITERS     prints {"ms": mean per all-reduce, "busbw_gbs": ...} */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "rgpu_nccl.h"

#define CU(x) do { CUresult r_ = (x); if (r_) { fprintf(stderr, "%s -> CUDA %d\n", #x, (int)r_); exit(2); } } while (0)
#define NC(x) do { ncclResult_t r_ = (x); if (r_) { fprintf(stderr, "%s -> NCCL %d\n", #x, (int)r_); exit(3); } } while (0)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 6) { fprintf(stderr, "usage: nccl_allreduce RANK NRANKS IDFILE MIB ITERS\n"); return 1; }
    int rank = atoi(argv[1]), nranks = atoi(argv[2]), iters = atoi(argv[5]);
    size_t bytes = (size_t)atol(argv[4]) << 20, count = bytes / 4;
    CUdevice dev;
    CUcontext ctx;
    CUstream stream;
    CUdeviceptr buf;
    CU(cuInit(0)); CU(cuDeviceGet(&dev, 0)); CU(cuDevicePrimaryCtxRetain(&ctx, dev)); CU(cuCtxSetCurrent(ctx));
    CU(cuStreamCreate(&stream, 1));
    CU(cuMemAlloc(&buf, bytes));
    CU(cuMemsetD32(buf, 0x3f800000u, count));   /* 1.0f */
    ncclUniqueId id;
    if (rank == 0) {
        NC(ncclGetUniqueId(&id));
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", argv[3]);
        FILE *f = fopen(tmp, "wb");
        fwrite(&id, 1, sizeof id, f);
        fclose(f);
        rename(tmp, argv[3]);
    } else {
        FILE *f;
        while (!(f = fopen(argv[3], "rb"))) usleep(10000);
        if (fread(&id, 1, sizeof id, f) != sizeof id) return 4;
        fclose(f);
    }
    ncclComm_t comm;
    NC(ncclCommInitRank(&comm, nranks, id, rank));
    for (int i = 0; i < 3; i++) NC(ncclAllReduce((void *)(uintptr_t)buf, (void *)(uintptr_t)buf, count, ncclFloat32, ncclSum, comm, (cudaStream_t)stream));
    CU(cuStreamSynchronize(stream));
    double t0 = now();
    for (int i = 0; i < iters; i++) NC(ncclAllReduce((void *)(uintptr_t)buf, (void *)(uintptr_t)buf, count, ncclFloat32, ncclSum, comm, (cudaStream_t)stream));
    CU(cuStreamSynchronize(stream));
    double s = (now() - t0) / iters;
    printf("{\"ms\": %.4f, \"busbw_gbs\": %.3f}\n", s * 1e3, 2.0 * (nranks - 1) / nranks * (double)bytes / s / 1e9);
    NC(ncclCommDestroy(comm));
    return 0;
}
