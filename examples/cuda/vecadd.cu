// Kernels for rgpu's examples and tests. Build the images with build_images.sh (nvcc).
extern "C" __global__ void vecadd(const float *a, const float *b, float *c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}

// A compute-bound loop: each thread iterates an FMA chain; `iters` sets the work per launch.
extern "C" __global__ void spin(float *out, int iters) {
    float x = threadIdx.x * 1e-3f, y = 1.0001f;
    for (int i = 0; i < iters; i++) {
        x = fmaf(x, y, 1e-7f);
        y = fmaf(y, 0.9999f, 1e-7f);
    }
    if (x == 12345.0f) out[0] = x + y;  // keeps the loop alive, never taken
}

// Mixed parameter sizes and alignment, to test the client's packing.
struct Pair { double a; int b; };
extern "C" __global__ void mixed(char c, Pair p, short s, double *out) {
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = c + p.a + p.b + s;
}

extern "C" __global__ void empty() {}
