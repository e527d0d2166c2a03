// Module images with large variables, for tests/remoting/test_module_footprint.py (rebuild with
// ./build.sh; the tests read the committed outputs, so CI needs no nvcc).
__device__ char big[1 << 30];                  // zero-initialised: no room in the file
__device__ int inited[1024] = {1, 2, 3};       // initialised: 4 KiB in the file
__constant__ float table[256];                 // constant bank: 1 KiB
__managed__ int shared_with_host[4096];        // managed: 16 KiB
extern "C" __global__ void touch(int i) {
    big[i] = 1;
    inited[i % 1024] += table[i % 256];
    shared_with_host[i % 4096] = i;
}
