/* NCCL through rgpu: the collectives of one rank (one process, one slice), or of every slice of one
 * process (ncclCommInitAll), on device buffers; results go to a file that the test compares with
 * numpy. Built with cc against NVIDIA's cuda.h and rgpu's rgpu_nccl.h, linked to rgpu's libcuda.so.1
 * and libnccl.so.2.
 *
 *   nccl_ranks rank RANK NRANKS IDFILE COUNT OUT    one rank; rank 0 writes the unique id to IDFILE
 *   nccl_ranks all NDEV COUNT OUT                   every slice of this process (OUT.0, OUT.1, ...); then
 *                                                   every communicator split in one group by d % 2 and
 *                                                   an all-reduce sum on each half (float32, COUNT, appended)
 *   nccl_ranks die RANK NRANKS IDFILE GOFILE        an all-reduce, "READY", then (after GOFILE appears)
 *                                                   another all-reduce and a synchronize
 *   nccl_ranks more RANK NRANKS IDFILE COUNT OUT    what PyTorch's ProcessGroupNCCL adds (see more() below)
 *   nccl_ranks scale RANK NRANKS IDFILE COUNT OUT   ncclCommInitRankScalable and ncclCommShrink (see scale() below)
 *   nccl_ranks badshrink RANK NRANKS IDFILE         ncclCommShrink excluding the caller, then rank 5: prints
 *                                                   "self R1 outside R2" (their results), then destroys
 *
 * Inputs: rank r's element i is (r + 1) * (i % 7 + 1) (float32), or r * 1000 + i (int32, int64).
 * OUT holds, in order: all-reduce sum (float32, COUNT), all-reduce max (int32, COUNT), broadcast
 * from the last rank (float32, COUNT), reduce sum to rank 0 (int64, COUNT; rank 0's only), all-gather
 * (float32, NRANKS*COUNT), reduce-scatter sum (float32, COUNT), ring send/recv from rank r-1 (int32,
 * COUNT), in-place all-reduce avg (float64, COUNT).
 * Each device's primary context, as the CUDA runtime (and so PyTorch) uses: with contexts made by
 * cuCtxCreate, every collective failed on two H200s with NCCL's 'Cuda failure 400 invalid resource
 * handle' at its enqueue (2026-11-28), while benchmarks/nccl_allreduce.c on primary contexts ran;
 * presumably NCCL's threads bind its resources to the primary context (cudaSetDevice). */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rgpu_nccl.h"

#define CU(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { fprintf(stderr, "%s:%d %s -> CUDA %d\n", __FILE__, __LINE__, #x, r_); exit(2); } } while (0)
#define NC(x) do { ncclResult_t r_ = (x); if (r_ != ncclSuccess) { fprintf(stderr, "%s:%d %s -> NCCL %d (%s)\n", __FILE__, __LINE__, #x, r_, ncclGetErrorString(r_)); exit(3); } } while (0)
#define MAXDEV 8

typedef struct rank_bufs {
    CUcontext ctx;
    CUstream stream;
    CUdeviceptr f_in, f_out, i_in, i_out, l_in, l_out, gather, scatter_in, d_io;
} rank_bufs;

static void fill(int rank, int nranks, size_t count, rank_bufs *b) {
    float *f = malloc(count * sizeof *f * nranks);
    int32_t *i32 = malloc(count * sizeof *i32);
    int64_t *i64 = malloc(count * sizeof *i64);
    double *d = malloc(count * sizeof *d);
    for (size_t i = 0; i < count; i++) {
        f[i] = (float)((rank + 1) * (int)(i % 7 + 1));
        i32[i] = rank * 1000 + (int32_t)i;
        i64[i] = (int64_t)rank * 1000 + (int64_t)i;
        d[i] = (double)((rank + 1) * (int)(i % 5 + 1));
    }
    CU(cuMemcpyHtoD(b->f_in, f, count * sizeof *f));
    CU(cuMemcpyHtoD(b->i_in, i32, count * sizeof *i32));
    CU(cuMemcpyHtoD(b->l_in, i64, count * sizeof *i64));
    CU(cuMemcpyHtoD(b->d_io, d, count * sizeof *d));
    for (size_t i = 0; i < count * nranks; i++) f[i] = (float)((rank + 1) * (int)(i % 11 + 1));
    CU(cuMemcpyHtoD(b->scatter_in, f, count * nranks * sizeof *f));
    free(f); free(i32); free(i64); free(d);
}

static void alloc_bufs(int nranks, size_t count, rank_bufs *b) {
    CU(cuStreamCreate(&b->stream, 0));
    CU(cuMemAlloc(&b->f_in, count * 4)); CU(cuMemAlloc(&b->f_out, count * 4));
    CU(cuMemAlloc(&b->i_in, count * 4)); CU(cuMemAlloc(&b->i_out, count * 4));
    CU(cuMemAlloc(&b->l_in, count * 8)); CU(cuMemAlloc(&b->l_out, count * 8));
    CU(cuMemAlloc(&b->gather, count * 4 * nranks)); CU(cuMemAlloc(&b->scatter_in, count * 4 * nranks));
    CU(cuMemAlloc(&b->d_io, count * 8));
}

/* Device `ordinal`'s primary context current, this rank's buffers allocated and filled. */
static void open_rank(int rank, int nranks, size_t count, int ordinal, rank_bufs *b) {
    CUdevice dev;
    CU(cuInit(0)); CU(cuDeviceGet(&dev, ordinal)); CU(cuDevicePrimaryCtxRetain(&b->ctx, dev)); CU(cuCtxSetCurrent(b->ctx));
    alloc_bufs(nranks, count, b);
    fill(rank, nranks, count, b);
}

/* Every collective of one rank, queued on its stream (inside a group when several ranks share the thread). */
static void collectives(ncclComm_t comm, int rank, int nranks, size_t count, rank_bufs *b, int step) {
    cudaStream_t s = (cudaStream_t)b->stream;
    void *fi = (void *)(uintptr_t)b->f_in, *fo = (void *)(uintptr_t)b->f_out;
    switch (step) {
    case 0: NC(ncclAllReduce(fi, fo, count, ncclFloat32, ncclSum, comm, s)); break;
    case 1: NC(ncclAllReduce((void *)(uintptr_t)b->i_in, (void *)(uintptr_t)b->i_out, count, ncclInt32, ncclMax, comm, s)); break;
    case 2: NC(ncclBroadcast(fi, fo, count, ncclFloat32, nranks - 1, comm, s)); break;
    case 3: NC(ncclReduce((void *)(uintptr_t)b->l_in, (void *)(uintptr_t)b->l_out, count, ncclInt64, ncclSum, 0, comm, s)); break;
    case 4: NC(ncclAllGather(fi, (void *)(uintptr_t)b->gather, count, ncclFloat32, comm, s)); break;
    case 5: NC(ncclReduceScatter((void *)(uintptr_t)b->scatter_in, fo, count, ncclFloat32, ncclSum, comm, s)); break;
    case 6: NC(ncclSend((void *)(uintptr_t)b->i_in, count, ncclInt32, (rank + 1) % nranks, comm, s));
            NC(ncclRecv((void *)(uintptr_t)b->i_out, count, ncclInt32, (rank + nranks - 1) % nranks, comm, s)); break;
    case 7: NC(ncclAllReduce((void *)(uintptr_t)b->d_io, (void *)(uintptr_t)b->d_io, count, ncclFloat64, ncclAvg, comm, s)); break;
    }
}

static void save(FILE *out, CUdeviceptr p, size_t n) {
    void *h = malloc(n);
    CU(cuMemcpyDtoH(h, p, n));
    fwrite(h, 1, n, out);
    free(h);
}

/* What step `step` left, appended to OUT (the device buffer it wrote). */
static void save_step(FILE *out, int rank, int nranks, size_t count, rank_bufs *b, int step) {
    CU(cuStreamSynchronize(b->stream));
    switch (step) {
    case 0: case 2: case 5: save(out, b->f_out, count * 4); break;
    case 1: case 6: save(out, b->i_out, count * 4); break;
    case 3: if (rank == 0) save(out, b->l_out, count * 8); break;
    case 4: save(out, b->gather, count * 4 * nranks); break;
    case 7: save(out, b->d_io, count * 8); break;
    }
}

static void write_id(const char *path, const ncclUniqueId *id) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    fwrite(id, 1, sizeof *id, f);
    fclose(f);
    rename(tmp, path);
}

static void read_id(const char *path, ncclUniqueId *id) {
    FILE *f;
    while (!(f = fopen(path, "rb"))) usleep(10000);
    if (fread(id, 1, sizeof *id, f) != sizeof *id) { fprintf(stderr, "short id file\n"); exit(4); }
    fclose(f);
}

/* Rank 0 makes the unique id and writes it to IDFILE; the others read it from there. */
static ncclUniqueId shared_id(int rank, const char *idfile) {
    ncclUniqueId id;
    if (rank == 0) {
        NC(ncclGetUniqueId(&id));
        write_id(idfile, &id);
    } else {
        read_id(idfile, &id);
    }
    return id;
}

static ncclComm_t init_rank(int rank, int nranks, const char *idfile, int ordinal) {
    ncclUniqueId id = shared_id(rank, idfile);
    ncclComm_t comm;
    NC(ncclCommInitRank(&comm, nranks, id, rank));
    int n = -1, r = -1, dev = -1;
    NC(ncclCommCount(comm, &n)); NC(ncclCommUserRank(comm, &r)); NC(ncclCommCuDevice(comm, &dev));
    if (n != nranks || r != rank || dev != ordinal) { fprintf(stderr, "comm says %d ranks, rank %d, device %d\n", n, r, dev); exit(5); }
    return comm;
}

/* Device LOCAL_RANK where it is set (every rank sees every slice and picks its own, as PyTorch under
 * torchrun), else device 0 (each rank sees only its own slice). */
static int one_rank(int rank, int nranks, const char *idfile, size_t count, const char *outpath) {
    int ordinal = getenv("LOCAL_RANK") ? atoi(getenv("LOCAL_RANK")) : 0;
    rank_bufs b;
    open_rank(rank, nranks, count, ordinal, &b);
    ncclComm_t comm = init_rank(rank, nranks, idfile, ordinal);
    FILE *out = fopen(outpath, "wb");
    for (int step = 0; step < 8; step++) {
        if (step == 6) NC(ncclGroupStart());
        collectives(comm, rank, nranks, count, &b, step);
        if (step == 6) NC(ncclGroupEnd());
        save_step(out, rank, nranks, count, &b, step);
    }
    fclose(out);
    ncclResult_t async_error = ncclInternalError;
    NC(ncclCommGetAsyncError(comm, &async_error));
    if (async_error != ncclSuccess) { fprintf(stderr, "async error %d\n", async_error); return 6; }
    NC(ncclCommDestroy(comm));
    printf("OK\n");
    return 0;
}

static int all_in_one(int ndev, size_t count, const char *outprefix) {
    rank_bufs b[MAXDEV];
    ncclComm_t comms[MAXDEV];
    CU(cuInit(0));
    for (int d = 0; d < ndev; d++) {
        CUdevice dev;
        CU(cuDeviceGet(&dev, d)); CU(cuDevicePrimaryCtxRetain(&b[d].ctx, dev)); CU(cuCtxSetCurrent(b[d].ctx));
        alloc_bufs(ndev, count, &b[d]);
        fill(d, ndev, count, &b[d]);
    }
    NC(ncclCommInitAll(comms, ndev, NULL));
    FILE *out[MAXDEV];
    for (int d = 0; d < ndev; d++) {
        char path[4096];
        snprintf(path, sizeof path, "%s.%d", outprefix, d);
        out[d] = fopen(path, "wb");
        int dev = -1;
        NC(ncclCommCuDevice(comms[d], &dev));
        if (dev != d) { fprintf(stderr, "comm %d is on device %d\n", d, dev); return 5; }
    }
    for (int step = 0; step < 8; step++) {
        NC(ncclGroupStart());
        for (int d = 0; d < ndev; d++) {
            CU(cuCtxSetCurrent(b[d].ctx));
            collectives(comms[d], d, ndev, count, &b[d], step);
        }
        NC(ncclGroupEnd());
        for (int d = 0; d < ndev; d++) {
            CU(cuCtxSetCurrent(b[d].ctx));
            save_step(out[d], d, ndev, count, &b[d], step);
        }
    }
    /* Split every slice's communicator in one group (by color d % 2, key d), then all-reduce on the halves. */
    ncclComm_t subs[MAXDEV];
    NC(ncclGroupStart());
    for (int d = 0; d < ndev; d++) NC(ncclCommSplit(comms[d], d % 2, d, &subs[d], NULL));
    NC(ncclGroupEnd());
    NC(ncclGroupStart());
    for (int d = 0; d < ndev; d++) {
        int n = -1, me = -1;
        NC(ncclCommCount(subs[d], &n)); NC(ncclCommUserRank(subs[d], &me));
        if (n != (ndev + 1 - d % 2) / 2 || me != d / 2) { fprintf(stderr, "split %d: rank %d of %d\n", d, me, n); return 5; }
        CU(cuCtxSetCurrent(b[d].ctx));
        NC(ncclAllReduce((void *)(uintptr_t)b[d].f_in, (void *)(uintptr_t)b[d].f_out, count, ncclFloat32, ncclSum, subs[d],
                         (cudaStream_t)b[d].stream));
    }
    NC(ncclGroupEnd());
    for (int d = 0; d < ndev; d++) {
        CU(cuCtxSetCurrent(b[d].ctx));
        CU(cuStreamSynchronize(b[d].stream));
        save(out[d], b[d].f_out, count * 4);
        fclose(out[d]);
        NC(ncclCommDestroy(subs[d]));
        NC(ncclCommDestroy(comms[d]));
    }
    printf("OK\n");
    return 0;
}

static int die(int rank, int nranks, const char *idfile, const char *gofile) {
    size_t count = 1024;
    rank_bufs b;
    open_rank(rank, nranks, count, 0, &b);
    ncclComm_t comm = init_rank(rank, nranks, idfile, 0);
    collectives(comm, rank, nranks, count, &b, 0);
    CU(cuStreamSynchronize(b.stream));
    printf("READY\n");
    fflush(stdout);
    while (access(gofile, F_OK) != 0) usleep(10000);
    ncclResult_t nr = ncclAllReduce((void *)(uintptr_t)b.f_in, (void *)(uintptr_t)b.f_out, count, ncclFloat32, ncclSum, comm,
                                    (cudaStream_t)b.stream);
    CUresult cr = nr == ncclSuccess ? cuStreamSynchronize(b.stream) : CUDA_SUCCESS;
    ncclResult_t async_error = ncclSuccess;
    ncclResult_t gr = ncclCommGetAsyncError(comm, &async_error);
    printf("allreduce %d synchronize %d async_error %d (get %d)\n", (int)nr, (int)cr, (int)async_error, (int)gr);
    ncclCommAbort(comm);
    return cr != CUDA_SUCCESS || nr != ncclSuccess ? 7 : 0;
}

/* A config with blocking = 0 and every other field unset. */
static ncclConfig_t nonblocking_config(void) {
    ncclConfig_t cfg = {sizeof cfg, 0xcafebeef, NCCL_VERSION_CODE, 0, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,
                        NCCL_CONFIG_UNDEF_INT, NULL, NCCL_CONFIG_UNDEF_INT};
    return cfg;
}

/* What a non-blocking call `r` started on `comm`, polled with ncclCommGetAsyncError until it formed. */
static void wait_formed(ncclComm_t comm, ncclResult_t r) {
    if (r != ncclSuccess && r != ncclInProgress) NC(r);
    ncclResult_t state = r;
    while (state == ncclInProgress) {
        NC(ncclCommGetAsyncError(comm, &state));
        if (state == ncclInProgress) usleep(1000);
    }
    NC(state);
}

/* A non-blocking communicator (ncclCommInitRankConfig, blocking = 0, polled with ncclCommGetAsyncError),
 * then, in OUT: all-reduce with a PreMulSum of 0.5 held by the host (float32, COUNT), with a PreMulSum of
 * 0.25 in device memory (float64, COUNT), all-to-all (float32, NRANKS*COUNT), all-reduce sum over a split
 * by color rank % 2 and key NRANKS - rank (float32, COUNT; a blocking config), all-reduce max over a split
 * where rank 0 has no color (int32, COUNT; not rank 0's; no config: non-blocking as its parent). Prints "split I of N" (the first split's rank and size), then "OK".
 * Every communicator is finalized, then destroyed. */
static int more(int rank, int nranks, const char *idfile, size_t count, const char *outpath) {
    rank_bufs b;
    open_rank(rank, nranks, count, 0, &b);
    ncclUniqueId id = shared_id(rank, idfile);
    ncclConfig_t cfg = nonblocking_config();
    ncclComm_t comm;
    ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, id, rank, &cfg);
    wait_formed(comm, r == ncclSuccess ? ncclInProgress : r);
    ncclResult_t state;
    int n = -1, me = -1;
    NC(ncclCommCount(comm, &n)); NC(ncclCommUserRank(comm, &me));
    if (n != nranks || me != rank) { fprintf(stderr, "non-blocking comm says %d ranks, rank %d\n", n, me); return 5; }
    cudaStream_t s = (cudaStream_t)b.stream;
    FILE *out = fopen(outpath, "wb");

    ncclRedOp_t half, quarter;
    float h = 0.5f;
    double q = 0.25;
    CUdeviceptr qdev;
    CU(cuMemAlloc(&qdev, sizeof q)); CU(cuMemcpyHtoD(qdev, &q, sizeof q));
    NC(ncclRedOpCreatePreMulSum(&half, &h, ncclFloat32, ncclScalarHostImmediate, comm));
    h = 8.0f;   /* host-immediate: read at creation, not at use */
    NC(ncclRedOpCreatePreMulSum(&quarter, (void *)(uintptr_t)qdev, ncclFloat64, ncclScalarDevice, comm));
    NC(ncclAllReduce((void *)(uintptr_t)b.f_in, (void *)(uintptr_t)b.f_out, count, ncclFloat32, half, comm, s));
    CU(cuStreamSynchronize(b.stream)); save(out, b.f_out, count * 4);
    NC(ncclAllReduce((void *)(uintptr_t)b.d_io, (void *)(uintptr_t)b.d_io, count, ncclFloat64, quarter, comm, s));
    CU(cuStreamSynchronize(b.stream)); save(out, b.d_io, count * 8);
    NC(ncclRedOpDestroy(half, comm)); NC(ncclRedOpDestroy(quarter, comm));

    NC(ncclAlltoAll((void *)(uintptr_t)b.scatter_in, (void *)(uintptr_t)b.gather, count, ncclFloat32, comm, s));
    CU(cuStreamSynchronize(b.stream)); save(out, b.gather, count * 4 * nranks);

    ncclComm_t sub = NULL, most = NULL;
    ncclConfig_t blocking = cfg;
    blocking.blocking = 1;
    NC(ncclCommSplit(comm, rank % 2, nranks - rank, &sub, &blocking));
    NC(ncclCommCount(sub, &n)); NC(ncclCommUserRank(sub, &me));
    printf("split %d of %d\n", me, n);
    NC(ncclAllReduce((void *)(uintptr_t)b.f_in, (void *)(uintptr_t)b.f_out, count, ncclFloat32, ncclSum, sub, s));
    CU(cuStreamSynchronize(b.stream)); save(out, b.f_out, count * 4);

    r = ncclCommSplit(comm, rank == 0 ? NCCL_SPLIT_NOCOLOR : 7, rank, &most, NULL);   /* non-blocking, as its parent */
    if (r != ncclSuccess && r != ncclInProgress) NC(r);
    for (state = r; most && state == ncclInProgress; usleep(1000)) NC(ncclCommGetAsyncError(most, &state));
    NC(state);
    if ((most == NULL) != (rank == 0)) { fprintf(stderr, "rank %d: no-color split gave %p\n", rank, (void *)most); return 5; }
    if (most) {
        NC(ncclAllReduce((void *)(uintptr_t)b.i_in, (void *)(uintptr_t)b.i_out, count, ncclInt32, ncclMax, most, s));
        CU(cuStreamSynchronize(b.stream)); save(out, b.i_out, count * 4);
        NC(ncclCommFinalize(most)); NC(ncclCommDestroy(most));
    }
    fclose(out);
    NC(ncclCommFinalize(sub)); NC(ncclCommDestroy(sub));
    NC(ncclCommFinalize(comm)); NC(ncclCommDestroy(comm));
    printf("OK\n");
    return 0;
}

/* ncclCommInitRankScalable with two ids (rank 0 makes IDFILE.0, the last rank IDFILE.1; every rank reads
 * both), then in OUT: all-reduce sum over it (float32, COUNT); all but rank 0 then call ncclCommShrink
 * excluding rank 0 (blocking) and all-reduce max over the shrunk one (int32, COUNT; not rank 0's), and
 * print "shrink I of N"; ranks 2.. of 4 shrink that one again, excluding its rank 0, with blocking = 0
 * (polled), and all-reduce sum (float32, COUNT), printing "again I of N". Rank 0 destroys its
 * communicator once rank 1 wrote IDFILE.done. Prints "OK". */
static int scale(int rank, int nranks, const char *idfile, size_t count, const char *outpath) {
    rank_bufs b;
    open_rank(rank, nranks, count, 0, &b);
    char path[4096], done[4096];
    ncclUniqueId ids[2];
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s.%d", idfile, i);
        if (rank == (i == 0 ? 0 : nranks - 1)) {
            NC(ncclGetUniqueId(&ids[i]));
            write_id(path, &ids[i]);
        } else {
            read_id(path, &ids[i]);
        }
    }
    snprintf(done, sizeof done, "%s.done", idfile);
    ncclComm_t comm;
    NC(ncclCommInitRankScalable(&comm, nranks, rank, 2, ids, NULL));
    int n = -1, me = -1;
    NC(ncclCommCount(comm, &n)); NC(ncclCommUserRank(comm, &me));
    if (n != nranks || me != rank) { fprintf(stderr, "scalable comm says %d ranks, rank %d\n", n, me); return 5; }
    cudaStream_t s = (cudaStream_t)b.stream;
    FILE *out = fopen(outpath, "wb");
    NC(ncclAllReduce((void *)(uintptr_t)b.f_in, (void *)(uintptr_t)b.f_out, count, ncclFloat32, ncclSum, comm, s));
    CU(cuStreamSynchronize(b.stream)); save(out, b.f_out, count * 4);
    if (rank == 0) {
        fclose(out);
        while (access(done, F_OK) != 0) usleep(10000);
        NC(ncclCommDestroy(comm));
        printf("OK\n");
        return 0;
    }
    int gone = 0;
    ncclComm_t small = NULL, smaller = NULL;
    NC(ncclCommShrink(comm, &gone, 1, &small, NULL, NCCL_SHRINK_DEFAULT));
    NC(ncclCommCount(small, &n)); NC(ncclCommUserRank(small, &me));
    printf("shrink %d of %d\n", me, n);
    NC(ncclAllReduce((void *)(uintptr_t)b.i_in, (void *)(uintptr_t)b.i_out, count, ncclInt32, ncclMax, small, s));
    CU(cuStreamSynchronize(b.stream)); save(out, b.i_out, count * 4);
    if (rank >= 2) {
        ncclConfig_t cfg = nonblocking_config();
        ncclResult_t r = ncclCommShrink(small, &gone, 1, &smaller, &cfg, NCCL_SHRINK_DEFAULT);
        wait_formed(smaller, r);
        NC(ncclCommCount(smaller, &n)); NC(ncclCommUserRank(smaller, &me));
        printf("again %d of %d\n", me, n);
        NC(ncclAllReduce((void *)(uintptr_t)b.f_in, (void *)(uintptr_t)b.f_out, count, ncclFloat32, ncclSum, smaller, s));
        CU(cuStreamSynchronize(b.stream)); save(out, b.f_out, count * 4);
        NC(ncclCommDestroy(smaller));
    }
    fclose(out);
    NC(ncclCommDestroy(small));
    if (rank == 1) write_id(done, &ids[0]);
    NC(ncclCommDestroy(comm));
    printf("OK\n");
    return 0;
}

static int badshrink(int rank, int nranks, const char *idfile) {
    CUdevice dev;
    CUcontext ctx;
    CU(cuInit(0)); CU(cuDeviceGet(&dev, 0)); CU(cuDevicePrimaryCtxRetain(&ctx, dev)); CU(cuCtxSetCurrent(ctx));
    ncclComm_t comm = init_rank(rank, nranks, idfile, 0), got = NULL;
    int outside = 5;
    ncclResult_t self = ncclCommShrink(comm, &rank, 1, &got, NULL, NCCL_SHRINK_DEFAULT);
    ncclResult_t far = ncclCommShrink(comm, &outside, 1, &got, NULL, NCCL_SHRINK_DEFAULT);
    printf("self %d outside %d\n", (int)self, (int)far);
    NC(ncclCommDestroy(comm));
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 7 && !strcmp(argv[1], "rank"))
        return one_rank(atoi(argv[2]), atoi(argv[3]), argv[4], (size_t)atol(argv[5]), argv[6]);
    if (argc == 5 && !strcmp(argv[1], "all")) return all_in_one(atoi(argv[2]), (size_t)atol(argv[3]), argv[4]);
    if (argc == 6 && !strcmp(argv[1], "die")) return die(atoi(argv[2]), atoi(argv[3]), argv[4], argv[5]);
    if (argc == 7 && !strcmp(argv[1], "more"))
        return more(atoi(argv[2]), atoi(argv[3]), argv[4], (size_t)atol(argv[5]), argv[6]);
    if (argc == 5 && !strcmp(argv[1], "badshrink")) return badshrink(atoi(argv[2]), atoi(argv[3]), argv[4]);
    if (argc == 7 && !strcmp(argv[1], "scale"))
        return scale(atoi(argv[2]), atoi(argv[3]), argv[4], (size_t)atol(argv[5]), argv[6]);
    fprintf(stderr, "usage: see the comment at the top of %s\n", __FILE__);
    return 1;
}
