/* A striped copy, then fork(): the child opens its own sessions (cuInit again) and copies striped
 * too, on lane threads of its own (the parent's are not in the child); then the parent copies
 * again on its kept ones. Each copy checked byte for byte; prints CHILD OK and OK
 * (test_lanes_emulated.py runs it with data lanes on). */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define CK(x)                                                                 \
    do {                                                                      \
        CUresult r_ = (x);                                                    \
        if (r_) {                                                             \
            printf("FAIL %s = %d (line %d)\n", #x, (int)r_, __LINE__);        \
            fflush(stdout);                                                   \
            return 1;                                                         \
        }                                                                     \
    } while (0)

static int round_trip(size_t n, int salt) {
    CUdevice d;
    CUcontext ctx;
    CK(cuDeviceGet(&d, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, d));
    CK(cuCtxSetCurrent(ctx));
    unsigned char *a = malloc(n), *b = calloc(1, n);
    for (size_t j = 0; j < n; j++) a[j] = (unsigned char)(j * 7 + salt);
    CUdeviceptr p;
    CK(cuMemAlloc(&p, n));
    CK(cuMemcpyHtoD(p, a, n));
    CK(cuMemcpyDtoH(b, p, n));
    CK(cuMemFree(p));
    int same = !memcmp(a, b, n);
    free(a);
    free(b);
    if (!same) printf("MISMATCH (salt %d)\n", salt);
    return !same;
}

int main(int argc, char **argv) {
    size_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : (4u << 20);
    CK(cuInit(0));
    if (round_trip(n, 1)) return 1;
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        CK(cuInit(0));
        if (round_trip(n, 2)) _exit(1);
        printf("CHILD OK\n");
        fflush(stdout);
        _exit(0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status)) {
        printf("CHILD FAILED %d\n", status);
        return 1;
    }
    if (round_trip(n, 3)) return 1;
    printf("OK\n");
    return 0;
}
