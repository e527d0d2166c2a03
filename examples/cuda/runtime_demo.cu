// A small CUDA-runtime program (cudart static or shared) that rgpu's tests build with nvcc and run
// through rgpu's libcuda.so.1: runtime initialisation (the driver's private export tables),
// device queries, memory, copies, memsets, module registration (lazy loading: cuLibraryLoadData
// with cudart's fatbin wrapper), globals and, with `launch`, kernels on the default stream and on
// a created stream.
//
//   runtime_demo [launch]      prints one line per step, then "RUNTIME OK" or "RUNTIME FAILED"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

__device__ int g_counter;
__constant__ float g_scale = 2.0f;

__global__ void scale_add(const float *a, const float *b, float *c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = g_scale * a[i] + b[i];
    if (i == 0) atomicAdd(&g_counter, 1);
}

struct Pair { double x; int y; };
__global__ void mixed(char c, Pair p, short s, double *out) { *out = c + p.x + p.y + s; }

static int failures;

#define CHECK(call)                                                                          \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                             \
            printf("FAIL %s: %s (%d)\n", #call, cudaGetErrorString(e_), (int)e_);           \
            failures++;                                                                      \
        } else {                                                                             \
            printf("OK %s\n", #call);                                                        \
        }                                                                                    \
    } while (0)

int main(int argc, char **argv) {
    bool launch = argc > 1 && !strcmp(argv[1], "launch");
    setvbuf(stdout, NULL, _IONBF, 0);
    int count = 0, runtime = 0, driver = 0;
    CHECK(cudaRuntimeGetVersion(&runtime));
    CHECK(cudaDriverGetVersion(&driver));
    printf("VERSIONS runtime %d driver %d\n", runtime, driver);
    CHECK(cudaGetDeviceCount(&count));
    printf("DEVICES %d\n", count);
    if (count < 1) {
        printf("RUNTIME FAILED\n");
        return 1;
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("DEVICE %s cc %d.%d mem %zu\n", prop.name, prop.major, prop.minor, prop.totalGlobalMem);
    CHECK(cudaSetDevice(0));
    CHECK(cudaFree(0));

    const int n = 1 << 20;
    size_t bytes = n * sizeof(float);
    float *ha = (float *)malloc(bytes), *hb = (float *)malloc(bytes), *hc = (float *)malloc(bytes);
    for (int i = 0; i < n; i++) { ha[i] = (float)i; hb[i] = 1.0f; }
    float *da = NULL, *db = NULL, *dc = NULL;
    CHECK(cudaMalloc(&da, bytes));
    CHECK(cudaMalloc(&db, bytes));
    CHECK(cudaMalloc(&dc, bytes));
    size_t free_b = 0, total_b = 0;
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    printf("MEMINFO free %zu total %zu\n", free_b, total_b);
    CHECK(cudaMemcpy(da, ha, bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(db, hb, bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(dc, 0x3f, bytes));
    CHECK(cudaMemcpy(hc, dc, bytes, cudaMemcpyDeviceToHost));
    unsigned int word;
    memcpy(&word, hc, 4);
    printf("MEMSET %s\n", word == 0x3f3f3f3fu ? "ok" : "wrong");
    if (word != 0x3f3f3f3fu) failures++;
    CHECK(cudaMemcpy(hc, da, bytes, cudaMemcpyDeviceToHost));
    printf("ROUNDTRIP %s\n", !memcmp(hc, ha, bytes) ? "ok" : "wrong");
    if (memcmp(hc, ha, bytes)) failures++;
    CHECK(cudaMemcpy(dc, da, bytes, cudaMemcpyDeviceToDevice));

    // Module registration: the runtime loads this program's fatbin (lazy loading) and looks the
    // kernel up when asked about it.
    cudaFuncAttributes attr;
    CHECK(cudaFuncGetAttributes(&attr, scale_add));
    printf("FUNC numRegs %d maxThreads %d\n", attr.numRegs, attr.maxThreadsPerBlock);
    int zero = 0;
    CHECK(cudaMemcpyToSymbol(g_counter, &zero, sizeof zero));
    float scale = 0;
    CHECK(cudaMemcpyFromSymbol(&scale, g_scale, sizeof scale));
    printf("SYMBOL g_scale %g\n", scale);
    if (scale != 2.0f) failures++;

    if (launch) {
        scale_add<<<(n + 255) / 256, 256>>>(da, db, dc, n);
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemcpy(hc, dc, bytes, cudaMemcpyDeviceToHost));
        int bad = 0;
        for (int i = 0; i < n; i++) bad += hc[i] != 2.0f * ha[i] + 1.0f;
        printf("KERNEL %s\n", bad ? "wrong" : "ok");
        if (bad) failures++;
        cudaStream_t s;
        CHECK(cudaStreamCreate(&s));
        CHECK(cudaMemsetAsync(dc, 0, bytes, s));
        scale_add<<<(n + 255) / 256, 256, 0, s>>>(da, db, dc, n);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpyAsync(hc, dc, bytes, cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        bad = 0;
        for (int i = 0; i < n; i++) bad += hc[i] != 2.0f * ha[i] + 1.0f;
        printf("STREAM KERNEL %s\n", bad ? "wrong" : "ok");
        if (bad) failures++;
        CHECK(cudaStreamDestroy(s));
        int counter = 0;
        CHECK(cudaMemcpyFromSymbol(&counter, g_counter, sizeof counter));
        printf("COUNTER %d\n", counter);
        if (counter != 2) failures++;
        double *dout, hout = 0;
        CHECK(cudaMalloc(&dout, sizeof(double)));
        Pair p = {1.5, 2};
        mixed<<<1, 1>>>('\x03', p, (short)4, dout);
        CHECK(cudaMemcpy(&hout, dout, sizeof hout, cudaMemcpyDeviceToHost));
        printf("MIXED %g\n", hout);
        if (hout != 10.5) failures++;
        CHECK(cudaFree(dout));
    }
    CHECK(cudaFree(da));
    CHECK(cudaFree(db));
    CHECK(cudaFree(dc));
    CHECK(cudaDeviceReset());
    printf("%s (%d failure(s))\n", failures ? "RUNTIME FAILED" : "RUNTIME OK", failures);
    return failures ? 1 : 0;
}
