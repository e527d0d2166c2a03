// Kernels whose local memory makes the driver reserve memory for every resident thread, for
// tests/remoting/test_gpu.py (rebuild with ./build.sh).
extern "C" __global__ void big_local(int *out, int n) {   // 16 KiB of local memory per thread
    volatile char buf[16384];
    for (int i = 0; i < n; i++) buf[(i * 97) % 16384] = i;
    if (out) out[threadIdx.x] = buf[n % 16384];
}
extern "C" __global__ void heap_user(int n) { char *p = (char *)malloc(n); if (p) { p[0] = 1; free(p); } }
extern "C" __global__ void trivial(int *out) { if (out) out[0] = 1; }
