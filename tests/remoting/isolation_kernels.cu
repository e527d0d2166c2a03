// Kernels for tests/remoting/test_gpu_isolation.py, built with nvcc at test time (-cubin).
#include <stdint.h>

// A wild write: an address no allocation holds. The context dies with CUDA_ERROR_ILLEGAL_ADDRESS
// (under MPS, every client of the GPU does).
extern "C" __global__ void wild_write(uint64_t address) {
    *(volatile int *)address = 42;
}

// y = a * x + y, the victim's verified work.
extern "C" __global__ void axpy(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

// Compute-bound work for the share measurements: dependent FMAs, no memory traffic but one store.
extern "C" __global__ void burn(float *out, int iters) {
    float a = threadIdx.x * 1e-3f, b = 1.0001f, c = 0.9999f, d = blockIdx.x * 1e-3f;
    for (int i = 0; i < iters; i++) {
        a = fmaf(a, b, c);
        d = fmaf(d, c, b);
    }
    if (a + d == 12345.0f) out[0] = a + d;   // never true: keeps the loop
}

// Never finishes: waits for a flag nobody sets.
extern "C" __global__ void spin_forever(volatile int *flag) {
    while (*flag == 0) {
    }
}
