/* A plain CUDA driver-API program: vector add from PTX (or cubin/fatbin), and a tour of the
 * calls a driver-API application makes. It knows nothing about rgpu; run it under flexrun.
 *
 *   gcc -I/usr/local/cuda/include driver_api_demo.c -o driver_api_demo -lcuda
 *   flexrun -- ./driver_api_demo vecadd.ptx [expect-launch|expect-refused] [slice-bytes]
 *
 * Prints "OK <check>" or "FAIL <check> ..." per step and exits with the number of failures.
 * With expect-refused (an emulated GPU server), launches must fail with an error at the next
 * synchronising call and the program goes on. */
#include <cuda.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int failures;

#define CHECK(name, call)                                                                       \
    do {                                                                                        \
        CUresult r_ = (call);                                                                   \
        if (r_ == CUDA_SUCCESS) printf("OK %s\n", name);                                        \
        else {                                                                                  \
            const char *s_ = "?";                                                               \
            cuGetErrorName(r_, &s_);                                                            \
            printf("FAIL %s: %s (%d)\n", name, s_, (int)r_);                                    \
            failures++;                                                                         \
        }                                                                                       \
    } while (0)

#define EXPECT(name, cond)                                                                      \
    do {                                                                                        \
        if (cond) printf("OK %s\n", name);                                                      \
        else { printf("FAIL %s\n", name); failures++; }                                         \
    } while (0)

static char *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (fread(b, 1, (size_t)n, f) != (size_t)n) { fclose(f); free(b); return NULL; }
    fclose(f);
    b[n] = 0;
    *size = (size_t)n;
    return b;
}

/* The process must never map NVIDIA's driver nor open /dev/nvidia*: report what it did. */
static void report_maps(void) {
    FILE *f = fopen("/proc/self/maps", "r");
    char line[1024];
    while (f && fgets(line, sizeof line, f)) {
        if (strstr(line, "libcuda") || strstr(line, "libnvidia")) {
            char *path = strchr(line, '/');
            if (path) printf("MAP %s", path);
        }
    }
    if (f) fclose(f);
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char p[300], target[512];
        snprintf(p, sizeof p, "/proc/self/fd/%s", e->d_name);
        ssize_t k = readlink(p, target, sizeof target - 1);
        if (k > 0) {
            target[k] = 0;
            if (strstr(target, "/dev/nvidia")) printf("OPEN %s\n", target);
        }
    }
    if (d) closedir(d);
}

int main(int argc, char **argv) {
    const char *image_path = argc > 1 ? argv[1] : "vecadd.ptx";
    int expect_launch = argc > 2 ? strcmp(argv[2], "expect-refused") != 0 : 1;
    size_t slice = argc > 3 ? strtoull(argv[3], NULL, 10) : 0;

    CHECK("cuInit", cuInit(0));
    int version = 0, count = 0;
    CHECK("cuDriverGetVersion", cuDriverGetVersion(&version));
    CHECK("cuDeviceGetCount", cuDeviceGetCount(&count));
    EXPECT("one or more devices", count >= 1);
    CUdevice dev;
    CHECK("cuDeviceGet", cuDeviceGet(&dev, 0));
    char name[256] = "";
    CHECK("cuDeviceGetName", cuDeviceGetName(name, sizeof name, dev));
    int major = 0, minor = 0, sms = 0;
    CHECK("cuDeviceGetAttribute major", cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    CHECK("cuDeviceGetAttribute minor", cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
    CHECK("cuDeviceGetAttribute SMs", cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    printf("INFO device 0: %s, compute %d.%d, %d SMs, driver %d, %d device(s)\n", name, major, minor, sms, version, count);
    CUuuid uuid;
    CHECK("cuDeviceGetUuid", cuDeviceGetUuid(&uuid, dev));
    size_t total_mem = 0;
    CHECK("cuDeviceTotalMem", cuDeviceTotalMem(&total_mem, dev));
    if (slice) EXPECT("cuDeviceTotalMem is the slice", total_mem == slice);

    CUcontext ctx = NULL, cur = NULL;
    CHECK("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK("cuCtxSetCurrent", cuCtxSetCurrent(ctx));
    CHECK("cuCtxGetCurrent", cuCtxGetCurrent(&cur));
    EXPECT("current context is the primary one", cur == ctx);
    CUdevice cdev = -1;
    CHECK("cuCtxGetDevice", cuCtxGetDevice(&cdev));
    EXPECT("context device is 0", cdev == 0);

    size_t free_b = 0, total_b = 0;
    CHECK("cuMemGetInfo", cuMemGetInfo(&free_b, &total_b));
    printf("INFO memory: %zu free of %zu\n", free_b, total_b);
    if (slice) EXPECT("cuMemGetInfo total is the slice", total_b == slice);

    const int n = 1 << 20;
    size_t bytes = n * sizeof(float);
    float *ha = malloc(bytes), *hb = malloc(bytes), *hc = malloc(bytes);
    for (int i = 0; i < n; i++) { ha[i] = (float)i; hb[i] = 2.0f * i; hc[i] = -1.0f; }
    CUdeviceptr da = 0, db = 0, dc = 0;
    CHECK("cuMemAlloc a", cuMemAlloc(&da, bytes));
    CHECK("cuMemAlloc b", cuMemAlloc(&db, bytes));
    CHECK("cuMemAlloc c", cuMemAlloc(&dc, bytes));
    CHECK("cuMemcpyHtoD a", cuMemcpyHtoD(da, ha, bytes));
    CHECK("cuMemcpyHtoD b", cuMemcpyHtoD(db, hb, bytes));
    CHECK("cuMemcpyDtoH a", cuMemcpyDtoH(hc, da, bytes));
    EXPECT("host-to-device-to-host round trip", memcmp(ha, hc, bytes) == 0);
    CHECK("cuMemcpyDtoD", cuMemcpyDtoD(dc, db, bytes));
    CHECK("cuMemcpyDtoH c", cuMemcpyDtoH(hc, dc, bytes));
    EXPECT("device-to-device copy", memcmp(hb, hc, bytes) == 0);
    CHECK("cuMemsetD32", cuMemsetD32(dc, 0x3f800000u, n));
    CHECK("cuMemcpyDtoH memset", cuMemcpyDtoH(hc, dc, bytes));
    EXPECT("memset wrote 1.0f", hc[0] == 1.0f && hc[n - 1] == 1.0f);

    CUstream stream;
    CUevent e0, e1;
    CHECK("cuStreamCreate", cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CHECK("cuEventCreate 0", cuEventCreate(&e0, CU_EVENT_DEFAULT));
    CHECK("cuEventCreate 1", cuEventCreate(&e1, CU_EVENT_DEFAULT));
    CHECK("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync(dc, ha, bytes, stream));
    CHECK("cuEventRecord", cuEventRecord(e0, stream));
    CHECK("cuMemcpyDtoHAsync", cuMemcpyDtoHAsync(hc, dc, bytes, stream));
    CHECK("cuEventRecord", cuEventRecord(e1, stream));
    CHECK("cuStreamSynchronize", cuStreamSynchronize(stream));
    EXPECT("async round trip", memcmp(ha, hc, bytes) == 0);
    float ms = -1;
    CHECK("cuEventElapsedTime", cuEventElapsedTime(&ms, e0, e1));

    void *pinned = NULL;
    CHECK("cuMemAllocHost", cuMemAllocHost(&pinned, 4096));
    unsigned int mtype = 0;
    CHECK("cuPointerGetAttribute host", cuPointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)pinned));
    EXPECT("pinned memory is host memory", mtype == CU_MEMORYTYPE_HOST);
    CHECK("cuPointerGetAttribute device", cuPointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, da));
    EXPECT("allocation is device memory", mtype == CU_MEMORYTYPE_DEVICE);
    CHECK("cuMemFreeHost", cuMemFreeHost(pinned));

    /* Modules: PTX text, cubin or fatbin; the size comes from the image's header. */
    size_t image_size = 0;
    char *image = read_file(image_path, &image_size);
    EXPECT("read the module image", image != NULL);
    CUmodule mod = NULL;
    CUfunction fn = NULL;
    char info_log[4096] = "", error_log[4096] = "";
    CUjit_option opts[] = {CU_JIT_INFO_LOG_BUFFER, CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES, CU_JIT_ERROR_LOG_BUFFER,
                           CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void *vals[] = {info_log, (void *)(uintptr_t)sizeof info_log, error_log, (void *)(uintptr_t)sizeof error_log};
    CHECK("cuModuleLoadDataEx", cuModuleLoadDataEx(&mod, image, 4, opts, vals));
    printf("INFO jit info log: %s\n", info_log);
    CHECK("cuModuleGetFunction", cuModuleGetFunction(&fn, mod, "vecadd"));
    CUfunction missing = NULL;
    EXPECT("unknown kernel is CUDA_ERROR_NOT_FOUND", cuModuleGetFunction(&missing, mod, "nope") == CUDA_ERROR_NOT_FOUND);
    int regs = -1;
    CHECK("cuFuncGetAttribute", cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, fn));

    CHECK("cuMemcpyHtoD a (again)", cuMemcpyHtoD(da, ha, bytes));
    CHECK("cuMemsetD8 c", cuMemsetD8(dc, 0, bytes));
    int nn = n;
    void *args[] = {&da, &db, &dc, &nn};
    CUresult lr = cuLaunchKernel(fn, (n + 255) / 256, 1, 1, 256, 1, 1, 0, stream, args, NULL);
    EXPECT("cuLaunchKernel returns at once without error", lr == CUDA_SUCCESS);
    CUresult sr = cuStreamSynchronize(stream);
    if (expect_launch) {
        CHECK("cuStreamSynchronize after launch", sr);
        CHECK("cuMemcpyDtoH result", cuMemcpyDtoH(hc, dc, bytes));
        int bad = 0;
        for (int i = 0; i < n; i++) if (hc[i] != ha[i] + hb[i]) bad++;
        EXPECT("vector add result", bad == 0);
        /* A batch of launches that do not wait, then one synchronisation. */
        for (int k = 0; k < 1000; k++) cuLaunchKernel(fn, (n + 255) / 256, 1, 1, 256, 1, 1, 0, stream, args, NULL);
        CHECK("cuStreamSynchronize after 1000 launches", cuStreamSynchronize(stream));
    } else {
        EXPECT("refused launch surfaces at the next sync call", sr == CUDA_ERROR_NOT_SUPPORTED);
        CHECK("the application goes on after the refused launch", cuStreamSynchronize(stream));
    }

    /* Beyond the slice: out of memory, and the application can go on. */
    if (slice) {
        CUdeviceptr big = 0;
        CUresult r = cuMemAlloc(&big, slice + (64u << 20));
        EXPECT("allocation beyond the slice is CUDA_ERROR_OUT_OF_MEMORY", r == CUDA_ERROR_OUT_OF_MEMORY);
        CUdeviceptr small = 0;
        CHECK("a small allocation still works", cuMemAlloc(&small, 1 << 20));
        CHECK("cuMemFree small", cuMemFree(small));
    }

    CHECK("cuModuleUnload", cuModuleUnload(mod));
    CHECK("cuMemFree a", cuMemFree(da));
    CHECK("cuMemFree b", cuMemFree(db));
    CHECK("cuMemFree c", cuMemFree(dc));
    CHECK("cuEventDestroy", cuEventDestroy(e0));
    CHECK("cuEventDestroy", cuEventDestroy(e1));
    CHECK("cuStreamDestroy", cuStreamDestroy(stream));
    CHECK("cuCtxSynchronize", cuCtxSynchronize());
    CHECK("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease(dev));

    /* An entry point rgpu does not remote: present, and it says so instead of crashing. */
    CUgraphNode node = NULL;
    EXPECT("unremoted entry point returns CUDA_ERROR_NOT_SUPPORTED",
           cuGraphAddExternalSemaphoresSignalNode(&node, NULL, NULL, 0, NULL) == CUDA_ERROR_NOT_SUPPORTED);
    void *pfn = NULL;
    CUdriverProcAddressQueryResult qr;
    CHECK("cuGetProcAddress cuMemAlloc", cuGetProcAddress("cuMemAlloc", &pfn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &qr));
    EXPECT("cuGetProcAddress gives cuMemAlloc_v2", pfn == (void *)cuMemAlloc_v2);
    CHECK("cuGetProcAddress unknown name", cuGetProcAddress("cuNoSuchFunction", &pfn, 13000, 0, &qr));
    EXPECT("unknown names get a stub, never NULL", pfn != NULL);

    report_maps();
    printf("DONE %d failure(s)\n", failures);
    free(ha);
    free(hb);
    free(hc);
    free(image);
    return failures;
}
