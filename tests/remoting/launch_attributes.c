/* cuLaunchKernelEx with the attributes cuBLAS and cuDNN put on their Hopper kernels: a cluster
 * dimension with programmatic stream serialisation, and a launch-completion event another stream
 * waits for. argv[1]: a PTX file with vecadd(a, b, c, n); argv[2]: launches of each kind. Each
 * round adds into c through a fresh input, so a launch lost or run twice shows in the result.
 * Prints each check (driver_checks.h), then RESULT OK or MISMATCH; exits with the failures. */
#include <string.h>

#include "driver_checks.h"

static CUlaunchAttribute attr(CUlaunchAttributeID id) {
    CUlaunchAttribute a;
    memset(&a, 0, sizeof a);
    a.id = id;
    return a;
}

int main(int argc, char **argv) {
    if (argc < 3) { printf("usage: launch_attributes PTX ROUNDS\n"); return 2; }
    char *ptx = read_file(argv[1]);
    if (!ptx) { printf("FAIL reading %s\n", argv[1]); return 1; }
    int rounds = atoi(argv[2]), n = 1 << 16;
    size_t bytes = (size_t)n * sizeof(float);
    CUmodule mod;
    CUfunction fn;
    CUstream stream, waiter;
    CUevent done;
    CUdeviceptr one, acc;
    primary_context();
    CHECK("cuModuleLoadData", cuModuleLoadData(&mod, ptx));
    CHECK("cuModuleGetFunction", cuModuleGetFunction(&fn, mod, "vecadd"));
    CHECK("cuStreamCreate", cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CHECK("cuStreamCreate waiter", cuStreamCreate(&waiter, CU_STREAM_NON_BLOCKING));
    CHECK("cuEventCreate", cuEventCreate(&done, CU_EVENT_DISABLE_TIMING));
    QUIET(cuMemAlloc(&one, bytes));
    QUIET(cuMemAlloc(&acc, bytes));
    QUIET(cuMemsetD32(one, 0x3f800000u, (size_t)n));   /* 1.0f */
    QUIET(cuMemsetD32(acc, 0, (size_t)n));

    CUlaunchAttribute cluster[2] = {attr(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION),
                                    attr(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)};
    cluster[0].value.clusterDim.x = 2;
    cluster[0].value.clusterDim.y = 1;
    cluster[0].value.clusterDim.z = 1;
    /* 0: the attribute as cuBLAS sends it, without letting a launch start before the previous one
     * ends (vecadd does not wait for its predecessor's writes with griddepcontrol.wait). */
    cluster[1].value.programmaticStreamSerializationAllowed = 0;
    CUlaunchAttribute completion = attr(CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT);
    completion.value.launchCompletionEvent.event = done;
    completion.value.launchCompletionEvent.flags = 0;

    CUlaunchConfig config;
    memset(&config, 0, sizeof config);
    config.gridDimX = (unsigned)(n / 256);   /* even: whole clusters of 2 */
    config.gridDimY = config.gridDimZ = 1;
    config.blockDimX = 256;
    config.blockDimY = config.blockDimZ = 1;
    config.hStream = stream;
    void *args[] = {&acc, &one, &acc, &n};   /* acc += 1 */
    int first_cluster = 1, first_completion = 1;
    for (int i = 0; i < rounds; i++) {
        config.attrs = cluster;
        config.numAttrs = 2;
        CUresult r = cuLaunchKernelEx(&config, fn, args, NULL);
        if (first_cluster || r) { CHECK("cuLaunchKernelEx cluster + serialisation", r); first_cluster = 0; }
        config.attrs = &completion;
        config.numAttrs = 1;
        r = cuLaunchKernelEx(&config, fn, args, NULL);
        if (first_completion || r) { CHECK("cuLaunchKernelEx completion event", r); first_completion = 0; }
    }
    CHECK("cuStreamWaitEvent", cuStreamWaitEvent(waiter, done, 0));
    CHECK("cuStreamSynchronize waiter", cuStreamSynchronize(waiter));
    CHECK("cuStreamSynchronize", cuStreamSynchronize(stream));
    float *host = malloc(bytes);
    CHECK("cuMemcpyDtoH", cuMemcpyDtoH(host, acc, bytes));
    for (int i = 0; i < n; i++)
        if (host[i] != (float)(2 * rounds)) {
            printf("FAIL MISMATCH at %d: %g, not %d\n", i, host[i], 2 * rounds);
            return failures + 1;
        }
    printf("RESULT OK\n");
    return failures;
}
