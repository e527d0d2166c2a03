/* What a training step asks the driver without needing the GPU, in a loop (issue 24): event
 * create/record/query/destroy, function attributes, occupancy, pointer attributes, stream queries
 * and asynchronous memsets. Run through rgpu against a worker, the loop must make no round trip per
 * iteration (the test compares RGPU_CLIENT_STATS profiles of runs with different iteration counts),
 * and every answer must equal the one the worker gave first.
 *
 *   clientside_loop vecadd.ptx loop N      the loop, N iterations
 *   clientside_loop vecadd.ptx destroyed   a destroyed event used again
 *   clientside_loop vecadd.ptx no-room     events the worker cannot create (RGPU_EMULATED_MAX_EVENTS=2)
 *   clientside_loop vecadd.ptx realloc     pointer attributes of allocations that come and go
 *
 * Prints "OK <check>" or "FAIL <check> ..." and exits with the number of failures. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver_checks.h"

#define NFATTR 10
#define NPATTR 6
static const CUpointer_attribute pattrs[NPATTR] = {
    CU_POINTER_ATTRIBUTE_CONTEXT, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};

typedef struct answers {
    int fattr[NFATTR];
    int blocks, blocks_flags, min_grid, block_size;
    size_t smem;
    unsigned long long p[NPATTR], plural[NPATTR];
    unsigned int stream_flags;
    int stream_priority;
    unsigned int ctx_flags, api_version;
    unsigned long long ctx_id;
    int least, greatest;
    CUfunc_cache cache_config;
} answers;

/* One iteration's questions; `offset` moves the queried pointer inside the allocation. */
static void ask(CUfunction fn, CUdeviceptr buf, size_t offset, CUstream stream, answers *a) {
    for (int i = 0; i < NFATTR; i++) QUIET(cuFuncGetAttribute(&a->fattr[i], (CUfunction_attribute)i, fn));
    QUIET(cuOccupancyMaxActiveBlocksPerMultiprocessor(&a->blocks, fn, 256, 0));
    QUIET(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&a->blocks_flags, fn, 128, 1024, 0));
    QUIET(cuOccupancyAvailableDynamicSMemPerBlock(&a->smem, fn, 4, 256));
    QUIET(cuOccupancyMaxPotentialBlockSize(&a->min_grid, &a->block_size, fn, NULL, 0, 0));
    for (int i = 0; i < NPATTR; i++) {
        a->p[i] = 0;
        QUIET(cuPointerGetAttribute(&a->p[i], pattrs[i], buf + offset));
    }
    void *data[NPATTR];
    for (int i = 0; i < NPATTR; i++) {
        a->plural[i] = 0;
        data[i] = &a->plural[i];
    }
    QUIET(cuPointerGetAttributes(NPATTR, (CUpointer_attribute *)pattrs, data, buf + offset));
    QUIET(cuStreamGetFlags(stream, &a->stream_flags));
    QUIET(cuStreamGetPriority(stream, &a->stream_priority));
    QUIET(cuCtxGetFlags(&a->ctx_flags));
    QUIET(cuCtxGetApiVersion(NULL, &a->api_version));
    QUIET(cuCtxGetId(NULL, &a->ctx_id));
    QUIET(cuCtxGetStreamPriorityRange(&a->least, &a->greatest));
    QUIET(cuCtxGetCacheConfig(&a->cache_config));
}

static void compare(const answers *a, const answers *first, CUdeviceptr buf, size_t offset) {
    for (int i = 0; i < NFATTR; i++) SAME("cuFuncGetAttribute", a->fattr[i], first->fattr[i]);
    SAME("occupancy", a->blocks, first->blocks);
    SAME("occupancy with flags", a->blocks_flags, first->blocks_flags);
    SAME("available dynamic shared memory", a->smem, first->smem);
    SAME("potential block size", a->block_size, first->block_size);
    SAME("potential grid", a->min_grid, first->min_grid);
    for (int i = 0; i < NPATTR; i++) {
        /* the device pointer is the queried one; every other answer is the allocation's */
        unsigned long long want = pattrs[i] == CU_POINTER_ATTRIBUTE_DEVICE_POINTER ? buf + offset : first->p[i];
        SAME("cuPointerGetAttribute", a->p[i], want);
        SAME("cuPointerGetAttributes", a->plural[i], want);
    }
    SAME("stream flags", a->stream_flags, first->stream_flags);
    SAME("stream priority", a->stream_priority, first->stream_priority);
    SAME("context flags", a->ctx_flags, first->ctx_flags);
    SAME("context API version", a->api_version, first->api_version);
    SAME("context id", a->ctx_id, first->ctx_id);
    SAME("least stream priority", a->least, first->least);
    SAME("greatest stream priority", a->greatest, first->greatest);
    SAME("cache config", a->cache_config, first->cache_config);
}

static int loop(CUfunction fn, CUdeviceptr buf, size_t words, int n) {
    CUstream stream;
    CHECK("cuStreamCreateWithPriority", cuStreamCreateWithPriority(&stream, CU_STREAM_NON_BLOCKING, -1));
    /* Warm-up: the first answers travel (one round trip each), and an event recorded before a
     * synchronisation is complete from then on. */
    answers first, now;
    ask(fn, buf, 0, stream, &first);
    CUevent done;
    CHECK("cuEventCreate", cuEventCreate(&done, CU_EVENT_DISABLE_TIMING));
    CHECK("cuEventRecord", cuEventRecord(done, stream));
    CHECK("cuStreamSynchronize", cuStreamSynchronize(stream));
    CHECK("first answers", first.fattr[0] > 0 && first.blocks > 0 && first.p[1] == CU_MEMORYTYPE_DEVICE
                           ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN);
    printf("FIRST maxthreads %d blocks %d smem %zu block %d type %llu size %llu\n", first.fattr[0], first.blocks,
           first.smem, first.block_size, first.p[1], first.p[4]);

    for (int i = 0; i < n; i++) {
        CUevent e;
        QUIET(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
        QUIET(cuEventQuery(e));                         /* never recorded: complete */
        QUIET(cuEventRecord(e, stream));
        QUIET(cuStreamWaitEvent(NULL, e, 0));
        QUIET(cuEventQuery(done));                      /* covered by the synchronisation above */
        QUIET(cuEventSynchronize(done));
        QUIET(cuEventDestroy_v2(e));
        ask(fn, buf, (size_t)(i % 64) * 4, stream, &now);
        compare(&now, &first, buf, (size_t)(i % 64) * 4);
        QUIET(cuMemsetD32Async(buf, (unsigned int)i, words, stream));
        QUIET(cuMemsetD8Async(buf + words * 4, (unsigned char)i, 16, stream));
        CUstream side;                                  /* a stream made, used and destroyed */
        QUIET(cuStreamCreate(&side, CU_STREAM_NON_BLOCKING));
        QUIET(cuStreamWaitEvent(side, done, 0));
        QUIET(cuMemsetD8Async(buf + words * 4 + 16, (unsigned char)i, 16, side));
        QUIET(cuStreamDestroy_v2(side));
    }
    CHECK("cuStreamSynchronize after the loop", cuStreamSynchronize(stream));
    unsigned int *host = malloc(words * 4);
    CHECK("cuMemcpyDtoH", cuMemcpyDtoH(host, buf, words * 4));
    int exact = 1;
    for (size_t i = 0; i < words; i++) exact &= host[i] == (unsigned int)(n - 1);
    CHECK("the last memset's value everywhere", exact ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN);
    free(host);
    /* A re-recorded event is not known complete: this query travels. */
    CHECK("cuEventRecord again", cuEventRecord(done, stream));
    CHECK("cuEventQuery after a new record", cuEventQuery(done));
    /* A copy to this process on the stream (as tensor.item() does) completes what was recorded there
     * before it: the queries after it are local. */
    unsigned int word = 0;
    CHECK("cuEventRecord before a copy", cuEventRecord(done, stream));
    CHECK("cuMemcpyDtoHAsync", cuMemcpyDtoHAsync(&word, buf, 4, stream));
    CHECK("cuEventQuery after the copy", cuEventQuery(done));
    CHECK("cuEventSynchronize after the copy", cuEventSynchronize(done));
    CHECK("cuEventDestroy_v2", cuEventDestroy_v2(done));
    CHECK("cuStreamDestroy_v2", cuStreamDestroy_v2(stream));
    /* What the application sets is what it reads next (the kept answers are forgotten). */
    unsigned int flags = 0;
    CHECK("cuCtxSetFlags", cuCtxSetFlags(CU_CTX_SCHED_BLOCKING_SYNC));
    CHECK("cuCtxGetFlags", cuCtxGetFlags(&flags));
    /* The scheduling bits are what was set; NVIDIA's driver reports other bits of the context too
     * (an H100's primary context: CU_CTX_LMEM_RESIZE_TO_MAX and more). */
    CHECK("the flags just set", (flags & CU_CTX_SCHED_MASK) == CU_CTX_SCHED_BLOCKING_SYNC ? CUDA_SUCCESS
                                                                                      : CUDA_ERROR_UNKNOWN);
    int value = 0;
    CHECK("cuFuncSetAttribute", cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 65536));
    CHECK("cuFuncGetAttribute", cuFuncGetAttribute(&value, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, fn));
    CHECK("the attribute just set", value == 65536 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN);
    return 0;
}

static void destroyed(void) {
    CUevent e, f;
    CHECK("cuEventCreate", cuEventCreate(&e, 0));
    CHECK("cuEventRecord", cuEventRecord(e, NULL));
    CHECK("cuEventDestroy_v2", cuEventDestroy_v2(e));
    WANT("cuEventRecord of a destroyed event", CUDA_ERROR_INVALID_HANDLE, cuEventRecord(e, NULL));
    WANT("cuEventQuery of a destroyed event", CUDA_ERROR_INVALID_HANDLE, cuEventQuery(e));
    WANT("cuEventSynchronize of a destroyed event", CUDA_ERROR_INVALID_HANDLE, cuEventSynchronize(e));
    WANT("cuStreamWaitEvent on a destroyed event", CUDA_ERROR_INVALID_HANDLE, cuStreamWaitEvent(NULL, e, 0));
    WANT("cuEventDestroy_v2 twice", CUDA_ERROR_INVALID_HANDLE, cuEventDestroy_v2(e));
    WANT("cuEventCreate with bad flags", CUDA_ERROR_INVALID_VALUE, cuEventCreate(&f, 0x4));
    /* the slot is reused by a new event: the old handle still is not it */
    CHECK("cuEventCreate reusing the slot", cuEventCreate(&f, 0));
    WANT("the old handle", CUDA_ERROR_INVALID_HANDLE, cuEventRecord(e, NULL));
    printf("HANDLES %s\n", e != f ? "differ" : "equal");
    CHECK("cuCtxSynchronize: nothing failed on the worker", cuCtxSynchronize());
    /* Streams: a destroyed stream's destruction is refused at once; work queued on it (pipelined)
     * fails the next synchronising call, which names the call; the session goes on. */
    CUstream s;
    CHECK("cuStreamCreate", cuStreamCreate(&s, 0));
    CHECK("cuStreamDestroy_v2", cuStreamDestroy_v2(s));
    WANT("cuStreamDestroy_v2 twice", CUDA_ERROR_INVALID_HANDLE, cuStreamDestroy_v2(s));
    WANT("cuStreamCreate with bad flags", CUDA_ERROR_INVALID_VALUE, cuStreamCreate(&s, 0x10));
    CUdeviceptr p;
    CHECK("cuMemAlloc", cuMemAlloc(&p, 64));
    CHECK("cuMemsetD8Async on the destroyed stream (pipelined)", cuMemsetD8Async(p, 1, 64, s));
    WANT("cuCtxSynchronize reports it", CUDA_ERROR_INVALID_HANDLE, cuCtxSynchronize());
    WANT("cuStreamSynchronize of the destroyed stream", CUDA_ERROR_INVALID_HANDLE, cuStreamSynchronize(s));
    CHECK("cuCtxSynchronize: the session goes on", cuCtxSynchronize());
    int priority = 1;
    CHECK("cuStreamCreateWithPriority", cuStreamCreateWithPriority(&s, 0, -3));
    CHECK("cuStreamGetPriority", cuStreamGetPriority(s, &priority));
    printf("PRIORITY %d\n", priority);
    CHECK("cuStreamDestroy_v2", cuStreamDestroy_v2(s));
    float ms = -1;
    CUevent g;
    CHECK("cuEventCreate timed", cuEventCreate(&g, 0));
    CHECK("cuEventRecord start", cuEventRecord(f, NULL));
    CHECK("cuEventRecord end", cuEventRecord(g, NULL));
    CHECK("cuEventSynchronize end", cuEventSynchronize(g));
    CHECK("cuEventElapsedTime", cuEventElapsedTime(&ms, f, g));
    printf("ELAPSED %s\n", ms >= 0 ? "ok" : "negative");
}

/* Kept pointer attributes follow the allocations: a new allocation (perhaps at a freed one's
 * address) is asked about afresh. */
static void realloc_attrs(void) {
    for (size_t size = 4096; size <= 4 * 4096; size *= 2) {
        CUdeviceptr p;
        unsigned long long range = 0, start = 0;
        CHECK("cuMemAlloc", cuMemAlloc(&p, size));
        CHECK("RANGE_SIZE", cuPointerGetAttribute(&range, CU_POINTER_ATTRIBUTE_RANGE_SIZE, p + 8));
        CHECK("RANGE_START_ADDR", cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p + 8));
        CHECK("RANGE_SIZE again", cuPointerGetAttribute(&range, CU_POINTER_ATTRIBUTE_RANGE_SIZE, p + 16));
        CHECK("the allocation's own range", range == size && start == p ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN);
        CHECK("cuMemFree", cuMemFree(p));
    }
}

static void no_room(void) {
    CUevent e[3];
    for (int i = 0; i < 3; i++) CHECK("cuEventCreate (the handle comes at once)", cuEventCreate(&e[i], 0));
    CHECK("cuEventRecord of the event the worker could not create (pipelined)", cuEventRecord(e[2], NULL));
    WANT("cuCtxSynchronize reports the failed creation", CUDA_ERROR_OUT_OF_MEMORY, cuCtxSynchronize());
    WANT("cuEventQuery of that event", CUDA_ERROR_INVALID_HANDLE, cuEventQuery(e[2]));
    CHECK("cuEventDestroy_v2 of a created one", cuEventDestroy_v2(e[0]));
    CUevent again;
    CHECK("cuEventCreate once there is room", cuEventCreate(&again, 0));
    CHECK("cuEventRecord", cuEventRecord(again, NULL));
    CHECK("cuEventSynchronize", cuEventSynchronize(again));
    CHECK("cuCtxSynchronize: the session goes on", cuCtxSynchronize());
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s image.ptx loop N | destroyed | no-room\n", argv[0]);
        return 2;
    }
    CUmodule mod;
    CUfunction fn;
    primary_context();
    char *image = read_file(argv[1]);
    CHECK("cuModuleLoadData", image ? cuModuleLoadData(&mod, image) : CUDA_ERROR_FILE_NOT_FOUND);
    CHECK("cuModuleGetFunction", cuModuleGetFunction(&fn, mod, "vecadd"));
    size_t words = 1024;
    CUdeviceptr buf;
    CHECK("cuMemAlloc", cuMemAlloc(&buf, words * 4 + 64));
    if (!strcmp(argv[2], "loop") && argc > 3) loop(fn, buf, words, atoi(argv[3]));
    else if (!strcmp(argv[2], "destroyed")) destroyed();
    else if (!strcmp(argv[2], "no-room")) no_room();
    else if (!strcmp(argv[2], "realloc")) realloc_attrs();
    else return 2;
    printf("DONE %d failure(s)\n", failures);
    return failures;
}
