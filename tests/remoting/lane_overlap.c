/* An asynchronous host-to-device copy from page-locked memory over data lanes behaves as on a local
 * GPU (issue 25 item 3): cuMemcpyHtoDAsync returns at once, and while its bytes still travel the
 * session answers other calls (a query of the copy's stream says CUDA_ERROR_NOT_READY, an event of
 * another stream is answered); work queued after it on its stream runs after it, and a stream that
 * waits for an event recorded after it sees its bytes. argv[1]: the copy's size in MiB. Prints
 * QUERY <code of cuStreamQuery just after the copy>, EVENT <code of the other stream's event>, the
 * microseconds each took, then OK (or what differed). */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

#define CHECK(call) do { CUresult r_ = (call); if (r_) { printf("FAILED %s: %d\n", #call, (int)r_); return 1; } } while (0)

int main(int argc, char **argv) {
    size_t n = (size_t)(argc > 1 ? atoi(argv[1]) : 256) << 20;
    CUdevice d;
    CUcontext ctx;
    CUstream s, other;
    CUevent done_other, after_copy;
    CUdeviceptr p;
    unsigned char *a, *b;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&d, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, d));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&other, CU_STREAM_NON_BLOCKING));
    CHECK(cuEventCreate(&done_other, CU_EVENT_DISABLE_TIMING));
    CHECK(cuEventCreate(&after_copy, CU_EVENT_DISABLE_TIMING));
    CHECK(cuMemAllocHost((void **)&a, n));
    CHECK(cuMemAllocHost((void **)&b, n));
    CHECK(cuMemAlloc(&p, n));
    for (int round = 0; round < 3; round++) {
        for (size_t j = 0; j < n; j += 4096) a[j] = (unsigned char)(j / 4096 * 7 + round);
        a[0] = (unsigned char)(0x40 + round);
        memset(b, 0, n);
        CHECK(cuMemsetD8Async(p + n - 1, 0, 1, other));   /* some work on the other stream, done below */
        CHECK(cuEventRecord(done_other, other));
        CHECK(cuStreamSynchronize(other));
        CHECK(cuMemcpyHtoDAsync(p, a, n, s));
        double t0 = now_us();
        CUresult query = cuStreamQuery(s);
        double t1 = now_us();
        CUresult event = cuEventQuery(done_other);
        double t2 = now_us();
        /* queued after the copy on its stream: must land on top of the copy's first byte */
        CHECK(cuMemsetD8Async(p + 1, 0x11, 1, s));
        CHECK(cuEventRecord(after_copy, s));
        CHECK(cuStreamWaitEvent(other, after_copy, 0));
        CHECK(cuMemcpyDtoHAsync(b, p, n, other));
        CHECK(cuStreamSynchronize(other));
        printf("QUERY %d %.0f us\nEVENT %d %.0f us\n", (int)query, t1 - t0, (int)event, t2 - t1);
        if (b[1] != 0x11) { printf("ORDER lost: byte 1 is %#x, not the memset's 0x11\n", b[1]); return 1; }
        b[1] = a[1];
        if (memcmp(a, b, n)) { printf("MISMATCH in round %d\n", round); return 1; }
        CHECK(cuStreamQuery(s));
    }
    printf("OK\n");
    return 0;
}
