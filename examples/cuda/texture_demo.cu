// CUDA arrays, texture and surface objects through the CUDA runtime: rgpu's tests build it with nvcc
// and run it through rgpu's libcuda.so.1 (memory paths on the emulated GPU; with `launch`, kernels
// that sample textures and write a surface on a real GPU, compared with a local run).
//
//   texture_demo [launch]      one line per step, then "TEXTURE OK" or "TEXTURE FAILED"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#pragma GCC diagnostic ignored "-Wdeprecated-declarations"   // cudaMemcpyToArray/FromArray: still used

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

#define EXPECT(name, cond)                                                                   \
    do {                                                                                     \
        if (cond) printf("SAME %s\n", name);                                                 \
        else { printf("DIFFERENT %s\n", name); failures++; }                                 \
    } while (0)

// Point-sampled reads of a 2D texture at texel centres (element read mode): the texels themselves.
__global__ void sample2d(cudaTextureObject_t tex, float *out, int w, int h) {
    int x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y;
    if (x < w && y < h) out[y * w + x] = tex2D<float>(tex, x + 0.5f, y + 0.5f);
}

// Linear interpolation halfway between texels (a filtered read: the texture unit's arithmetic).
__global__ void sample2d_linear(cudaTextureObject_t tex, float *out, int w, int h) {
    int x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y;
    if (x < w && y < h) out[y * w + x] = tex2D<float>(tex, x + 1.0f, y + 0.75f);
}

__global__ void fetch1d(cudaTextureObject_t tex, float *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = tex1Dfetch<float>(tex, i) * 2.0f;
}

__global__ void write_surface(cudaSurfaceObject_t surf, int w, int h) {
    int x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y;
    if (x < w && y < h) surf2Dwrite(make_uchar4(x, y, x ^ y, 255), surf, x * sizeof(uchar4), y);
}

static double checksum(const float *p, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += p[i] * (1.0 + (i % 7));
    return s;
}

int main(int argc, char **argv) {
    bool launch = argc > 1 && !strcmp(argv[1], "launch");
    setvbuf(stdout, NULL, _IONBF, 0);
    CHECK(cudaSetDevice(0));
    const int W = 37, H = 19, PITCH = 200;   // an odd width; the host rows are 200 bytes apart
    float *host = (float *)calloc(PITCH / 4 * H, 4), *back = (float *)calloc(W * H, 4), *out = (float *)calloc(W * H, 4);
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) host[y * (PITCH / 4) + x] = (float)(y * 100 + x) * 0.25f;

    // 2D array: host -> array -> host, and array -> pitched device memory -> host
    cudaChannelFormatDesc fdesc = cudaCreateChannelDesc<float>();
    cudaArray_t arr = NULL;
    CHECK(cudaMallocArray(&arr, &fdesc, W, H));
    CHECK(cudaMemcpy2DToArray(arr, 0, 0, host, PITCH, W * sizeof(float), H, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy2DFromArray(back, W * sizeof(float), arr, 0, 0, W * sizeof(float), H, cudaMemcpyDeviceToHost));
    bool same = true;
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) same = same && back[y * W + x] == host[y * (PITCH / 4) + x];
    EXPECT("array round trip", same);
    float *pitched = NULL;
    size_t dpitch = 0;
    CHECK(cudaMallocPitch((void **)&pitched, &dpitch, W * sizeof(float), H));
    CHECK(cudaMemcpy2DFromArray(pitched, dpitch, arr, 0, 0, W * sizeof(float), H, cudaMemcpyDeviceToDevice));
    memset(back, 0, W * H * 4);
    CHECK(cudaMemcpy2D(back, W * sizeof(float), pitched, dpitch, W * sizeof(float), H, cudaMemcpyDeviceToHost));
    same = true;
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) same = same && back[y * W + x] == host[y * (PITCH / 4) + x];
    EXPECT("array to pitched memory", same);
    cudaArray_t arr2 = NULL;
    CHECK(cudaMallocArray(&arr2, &fdesc, W, H));
    CHECK(cudaMemcpy2DArrayToArray(arr2, 0, 0, arr, 0, 0, W * sizeof(float), H, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpy2DToArrayAsync(arr2, 4, 1, host, PITCH, 8, 2, cudaMemcpyHostToDevice, 0));
    CHECK(cudaStreamSynchronize(0));

    // the deprecated linear copies (a span of whole and partial rows), still in CUDA 13's runtime
    float span[50], span_back[50];
    for (int i = 0; i < 50; i++) span[i] = 1000.0f + i;
    CHECK(cudaMemcpyToArray(arr2, 8, 3, span, sizeof span, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpyFromArray(span_back, arr2, 8, 3, sizeof span_back, cudaMemcpyDeviceToHost));
    EXPECT("linear span through an array", !memcmp(span, span_back, sizeof span));

    // a mipmapped array: level 1 written and read back, a texture object on the whole
    cudaMipmappedArray_t mip = NULL;
    CHECK(cudaMallocMipmappedArray(&mip, &fdesc, make_cudaExtent(32, 16, 0), 3));
    cudaArray_t level1 = NULL;
    CHECK(cudaGetMipmappedArrayLevel(&level1, mip, 1));
    CHECK(cudaMemcpy2DToArray(level1, 0, 0, host, PITCH, 16 * sizeof(float), 8, cudaMemcpyHostToDevice));
    memset(back, 0, W * H * 4);
    CHECK(cudaMemcpy2DFromArray(back, 16 * sizeof(float), level1, 0, 0, 16 * sizeof(float), 8, cudaMemcpyDeviceToHost));
    same = true;
    for (int y = 0; y < 8; y++)
        for (int x = 0; x < 16; x++) same = same && back[y * 16 + x] == host[y * (PITCH / 4) + x];
    EXPECT("mipmap level round trip", same);
    cudaResourceDesc rm = {};
    rm.resType = cudaResourceTypeMipmappedArray;
    rm.res.mipmap.mipmap = mip;
    cudaTextureDesc tdm = {};
    tdm.filterMode = cudaFilterModePoint;
    tdm.normalizedCoords = 1;
    tdm.maxMipmapLevelClamp = 2;
    cudaTextureObject_t tex_mip = 0;
    CHECK(cudaCreateTextureObject(&tex_mip, &rm, &tdm, NULL));
    CHECK(cudaDestroyTextureObject(tex_mip));
    CHECK(cudaFreeMipmappedArray(mip));

    cudaChannelFormatDesc got;
    cudaExtent extent;
    unsigned int flags = 0;
    CHECK(cudaArrayGetInfo(&got, &extent, &flags, arr));
    printf("ARRAYINFO %d %d %d %d kind %d extent %zu %zu %zu flags %u\n", got.x, got.y, got.z, got.w, (int)got.f,
           extent.width, extent.height, extent.depth, flags);

    // 3D array through cudaMemcpy3D, both ways
    cudaArray_t vol = NULL;
    cudaExtent vext = make_cudaExtent(13, 7, 5);
    cudaChannelFormatDesc u2 = cudaCreateChannelDesc<ushort2>();
    CHECK(cudaMalloc3DArray(&vol, &u2, vext));
    unsigned short *vin = (unsigned short *)malloc(13 * 7 * 5 * 4), *vout = (unsigned short *)calloc(13 * 7 * 5, 4);
    for (int i = 0; i < 13 * 7 * 5 * 2; i++) vin[i] = (unsigned short)(i * 3 + 1);
    cudaMemcpy3DParms p3 = {};
    p3.srcPtr = make_cudaPitchedPtr(vin, 13 * 4, 13, 7);
    p3.dstArray = vol;
    p3.extent = vext;
    p3.kind = cudaMemcpyHostToDevice;
    CHECK(cudaMemcpy3D(&p3));
    cudaMemcpy3DParms q3 = {};
    q3.srcArray = vol;
    q3.dstPtr = make_cudaPitchedPtr(vout, 13 * 4, 13, 7);
    q3.extent = vext;
    q3.kind = cudaMemcpyDeviceToHost;
    CHECK(cudaMemcpy3D(&q3));
    EXPECT("3D array round trip", !memcmp(vin, vout, 13 * 7 * 5 * 4));

    // texture objects on the array, on linear memory and on pitched memory
    cudaResourceDesc res = {};
    res.resType = cudaResourceTypeArray;
    res.res.array.array = arr;
    cudaTextureDesc td = {};
    td.addressMode[0] = td.addressMode[1] = cudaAddressModeClamp;
    td.filterMode = cudaFilterModePoint;
    td.readMode = cudaReadModeElementType;
    cudaTextureObject_t tex = 0, tex_linear_filter = 0, tex_lin = 0, tex_pitch = 0;
    CHECK(cudaCreateTextureObject(&tex, &res, &td, NULL));
    cudaTextureDesc tdl = td;
    tdl.filterMode = cudaFilterModeLinear;
    CHECK(cudaCreateTextureObject(&tex_linear_filter, &res, &tdl, NULL));
    float *lin = NULL;
    CHECK(cudaMalloc((void **)&lin, W * H * sizeof(float)));
    CHECK(cudaMemcpy(lin, back, W * H * sizeof(float), cudaMemcpyHostToDevice));
    cudaResourceDesc rl = {};
    rl.resType = cudaResourceTypeLinear;
    rl.res.linear.devPtr = lin;
    rl.res.linear.desc = fdesc;
    rl.res.linear.sizeInBytes = W * H * sizeof(float);
    CHECK(cudaCreateTextureObject(&tex_lin, &rl, &td, NULL));
    cudaResourceDesc rp = {};
    rp.resType = cudaResourceTypePitch2D;
    rp.res.pitch2D.devPtr = pitched;
    rp.res.pitch2D.desc = fdesc;
    rp.res.pitch2D.width = W;
    rp.res.pitch2D.height = H;
    rp.res.pitch2D.pitchInBytes = dpitch;
    CHECK(cudaCreateTextureObject(&tex_pitch, &rp, &td, NULL));
    cudaResourceDesc rback = {};
    CHECK(cudaGetTextureObjectResourceDesc(&rback, tex));
    EXPECT("texture resource read back", rback.resType == cudaResourceTypeArray && rback.res.array.array == arr);
    cudaTextureDesc tback = {};
    CHECK(cudaGetTextureObjectTextureDesc(&tback, tex_linear_filter));
    EXPECT("texture descriptor read back", tback.filterMode == cudaFilterModeLinear &&
                                           tback.addressMode[0] == cudaAddressModeClamp);

    // a surface on an array made for load/store
    cudaChannelFormatDesc c4 = cudaCreateChannelDesc<uchar4>();
    cudaArray_t sarr = NULL;
    CHECK(cudaMallocArray(&sarr, &c4, 64, 16, cudaArraySurfaceLoadStore));
    cudaResourceDesc rs = {};
    rs.resType = cudaResourceTypeArray;
    rs.res.array.array = sarr;
    cudaSurfaceObject_t surf = 0;
    CHECK(cudaCreateSurfaceObject(&surf, &rs));

    if (launch) {
        float *dout = NULL;
        CHECK(cudaMalloc((void **)&dout, W * H * sizeof(float)));
        dim3 grid((W + 31) / 32, H);
        sample2d<<<grid, 32>>>(tex, dout, W, H);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpy(out, dout, W * H * sizeof(float), cudaMemcpyDeviceToHost));
        same = true;
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) same = same && out[y * W + x] == host[y * (PITCH / 4) + x];
        EXPECT("tex2D on the array", same);
        sample2d_linear<<<grid, 32>>>(tex_linear_filter, dout, W, H);
        CHECK(cudaMemcpy(out, dout, W * H * sizeof(float), cudaMemcpyDeviceToHost));
        printf("LINEAR FILTER checksum %.6f\n", checksum(out, W * H));
        sample2d<<<grid, 32>>>(tex_pitch, dout, W, H);
        CHECK(cudaMemcpy(out, dout, W * H * sizeof(float), cudaMemcpyDeviceToHost));
        same = true;   /* the pitched memory holds the array's texels (back was reused since) */
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) same = same && out[y * W + x] == host[y * (PITCH / 4) + x];
        EXPECT("tex2D on pitched memory", same);
        fetch1d<<<(W * H + 127) / 128, 128>>>(tex_lin, dout, W * H);
        CHECK(cudaMemcpy(out, dout, W * H * sizeof(float), cudaMemcpyDeviceToHost));
        same = true;
        for (int i = 0; i < W * H; i++) same = same && out[i] == back[i] * 2.0f;
        EXPECT("tex1Dfetch on linear memory", same);
        write_surface<<<dim3(2, 16), 32>>>(surf, 64, 16);
        CHECK(cudaGetLastError());
        unsigned char *pix = (unsigned char *)calloc(64 * 16, 4);
        CHECK(cudaMemcpy2DFromArray(pix, 64 * 4, sarr, 0, 0, 64 * 4, 16, cudaMemcpyDeviceToHost));
        same = true;
        for (int y = 0; y < 16; y++)
            for (int x = 0; x < 64; x++) {
                unsigned char *q = pix + (y * 64 + x) * 4;
                same = same && q[0] == x && q[1] == y && q[2] == (x ^ y) && q[3] == 255;
            }
        EXPECT("surf2Dwrite", same);
        CHECK(cudaFree(dout));
    }

    CHECK(cudaDestroySurfaceObject(surf));
    CHECK(cudaDestroyTextureObject(tex));
    CHECK(cudaDestroyTextureObject(tex_linear_filter));
    CHECK(cudaDestroyTextureObject(tex_lin));
    CHECK(cudaDestroyTextureObject(tex_pitch));
    CHECK(cudaFreeArray(arr));
    CHECK(cudaFreeArray(arr2));
    CHECK(cudaFreeArray(vol));
    CHECK(cudaFreeArray(sarr));
    CHECK(cudaFree(lin));
    CHECK(cudaFree(pitched));
    if (failures) printf("TEXTURE FAILED (%d)\n", failures);
    else printf("TEXTURE OK\n");
    return failures ? 1 : 0;
}
