/* libcuda.so.1: CUDA arrays, mipmapped arrays, texture and surface objects, and the 2D and 3D
 * copies whose sides are arrays (and every 3D copy).
 *
 * Arrays and objects live on the worker; their handles are the worker's values, held here as
 * they are, and the descriptors that name them (CUDA_RESOURCE_DESC) travel byte for byte. The
 * worker counts each array against the slice. A copy with a host side travels in pieces of whole
 * rows (or planes): this process's data in the request (rgpuMemcpyArray, pipelined like a
 * host-to-device copy) or in DATA frames before the reply (rgpuMemcpyArrayToHost); copies between
 * device memory and arrays run on the worker whole. */
#include <stdlib.h>
#include <string.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

_Static_assert(sizeof(CUDA_ARRAY_DESCRIPTOR) == 24, "CUDA_ARRAY_DESCRIPTOR layout");
_Static_assert(sizeof(CUDA_ARRAY3D_DESCRIPTOR) == 40, "CUDA_ARRAY3D_DESCRIPTOR layout");
_Static_assert(sizeof(CUDA_ARRAY_MEMORY_REQUIREMENTS) == 32, "CUDA_ARRAY_MEMORY_REQUIREMENTS layout");
_Static_assert(sizeof(CUDA_ARRAY_SPARSE_PROPERTIES) == 48, "CUDA_ARRAY_SPARSE_PROPERTIES layout");
_Static_assert(sizeof(CUDA_RESOURCE_DESC) == 144, "CUDA_RESOURCE_DESC layout");
_Static_assert(sizeof(CUDA_TEXTURE_DESC) == 104, "CUDA_TEXTURE_DESC layout");
_Static_assert(sizeof(CUDA_RESOURCE_VIEW_DESC) == 112, "CUDA_RESOURCE_VIEW_DESC layout");
_Static_assert(sizeof(CUDA_MEMCPY3D) == 200, "CUDA_MEMCPY3D layout");

/* Kinds of rgpuMemcpyArray / rgpuMemcpyArrayToHost: the driver call the worker makes. */
enum { COPY_2D = 0, COPY_2D_UNALIGNED = 1, COPY_3D = 2 };
#define READ_PIECE_BYTES (4u << 20)
#define CU_ERROR_STREAM_CAPTURE_UNSUPPORTED 900

/* ------------------------------------------------------------------ descriptors, cached
 * The CUDA runtime asks for an array's descriptor (cuArray3DGetDescriptor_v2) twice before every
 * copy with an array and four times per texture object: a round trip each. A descriptor never
 * changes while its array lives, so the worker's answer is kept here per (slice, handle) and
 * forgotten when the array (any array, for mipmapped arrays and context resets) goes. */
#define DESC_CACHE 256

static struct { int session; uint64_t handle; CUDA_ARRAY3D_DESCRIPTOR desc; } g_desc[DESC_CACHE];
static int g_desc_used;
static pthread_mutex_t g_desc_lock = PTHREAD_MUTEX_INITIALIZER;

static int current_session(void) {
    rgpu_ctx *cur = rgpu_ctx_current();
    return cur ? cur->session : -1;
}

int rgpu_array_desc_get(CUarray array, CUDA_ARRAY3D_DESCRIPTOR *out) {
    int s = current_session(), found = 0;
    if (s < 0 || !out) return 0;
    pthread_mutex_lock(&g_desc_lock);
    for (int i = 0; i < g_desc_used && !found; i++)
        if (g_desc[i].session == s && g_desc[i].handle == (uint64_t)(uintptr_t)array) {
            *out = g_desc[i].desc;
            found = 1;
        }
    pthread_mutex_unlock(&g_desc_lock);
    return found;
}

void rgpu_array_desc_put(int session, CUarray array, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    pthread_mutex_lock(&g_desc_lock);
    int i = 0;
    while (i < g_desc_used && !(g_desc[i].session == session && g_desc[i].handle == (uint64_t)(uintptr_t)array)) i++;
    if (i == g_desc_used) {
        if (g_desc_used == DESC_CACHE) i = (int)((uintptr_t)array / 64 % DESC_CACHE);   /* full: replace one */
        else g_desc_used++;
    }
    g_desc[i].session = session;
    g_desc[i].handle = (uint64_t)(uintptr_t)array;
    g_desc[i].desc = *desc;
    pthread_mutex_unlock(&g_desc_lock);
}

/* handle 0: every array's */
void rgpu_array_desc_forget(uint64_t handle) {
    pthread_mutex_lock(&g_desc_lock);
    for (int i = 0; i < g_desc_used;)
        if (!handle || g_desc[i].handle == handle) g_desc[i] = g_desc[--g_desc_used];
        else i++;
    pthread_mutex_unlock(&g_desc_lock);
}

/* The levels handed out for each mipmapped array (cuMipmappedArrayGetLevel), whose descriptors go
 * with it; when more are out than this holds, destroying any mipmapped array forgets every one. */
static struct { uint64_t level, mipmap; } g_levels[DESC_CACHE];
static int g_levels_used, g_levels_lost;

void rgpu_array_level_put(CUarray level, CUmipmappedArray mipmap) {
    pthread_mutex_lock(&g_desc_lock);
    int known = 0;
    for (int i = 0; i < g_levels_used && !known; i++) known = g_levels[i].level == (uint64_t)(uintptr_t)level;
    if (!known && g_levels_used == DESC_CACHE) g_levels_lost = 1;
    else if (!known) {
        g_levels[g_levels_used].level = (uint64_t)(uintptr_t)level;
        g_levels[g_levels_used++].mipmap = (uint64_t)(uintptr_t)mipmap;
    }
    pthread_mutex_unlock(&g_desc_lock);
}

static void forget_levels(uint64_t mipmap) {
    pthread_mutex_lock(&g_desc_lock);
    int all = g_levels_lost;
    uint64_t gone[DESC_CACHE];
    int n = 0;
    for (int i = 0; i < g_levels_used;)
        if (g_levels[i].mipmap == mipmap) {
            gone[n++] = g_levels[i].level;
            g_levels[i] = g_levels[--g_levels_used];
        } else {
            i++;
        }
    pthread_mutex_unlock(&g_desc_lock);
    if (all) rgpu_array_desc_forget(0);
    for (int i = 0; i < n; i++) rgpu_array_desc_forget(gone[i]);
}

/* ------------------------------------------------------------------ arrays */

static CUresult create_common(uint16_t op, uint64_t *out, const void *desc, size_t size, uint32_t levels) {
    if (!out || !desc) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, op);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u32(&c, levels);
    rgpu_put_u32(&c, 0);
    rgpu_put(&c, desc, size);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) *out = rgpu_get_u64(&c);
    rgpu_end(&c);
    return r;
}

static CUresult destroy_common(uint16_t op, uint64_t handle) {
    rgpu_call c;
    CUresult r = rgpu_begin(&c, op);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, handle);
    r = rgpu_sync(&c);
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray) {
    uint64_t h = 0;
    CUresult r = create_common(RGPU_OP_cuArrayCreate_v2, pHandle ? &h : NULL, pAllocateArray,
                               sizeof *pAllocateArray, 0);
    if (r == CUDA_SUCCESS) *pHandle = (CUarray)(uintptr_t)h;
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray) {
    uint64_t h = 0;
    CUresult r = create_common(RGPU_OP_cuArray3DCreate_v2, pHandle ? &h : NULL, pAllocateArray,
                               sizeof *pAllocateArray, 0);
    if (r == CUDA_SUCCESS) *pHandle = (CUarray)(uintptr_t)h;
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuArrayDestroy(CUarray hArray) {
    rgpu_array_desc_forget((uint64_t)(uintptr_t)hArray);
    return destroy_common(RGPU_OP_cuArrayDestroy, (uint64_t)(uintptr_t)hArray);
}

RGPU_EXPORT CUresult CUDAAPI cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                                    unsigned int numMipmapLevels) {
    uint64_t h = 0;
    CUresult r = create_common(RGPU_OP_cuMipmappedArrayCreate, pHandle ? &h : NULL, pMipmappedArrayDesc,
                               sizeof *pMipmappedArrayDesc, numMipmapLevels);
    if (r == CUDA_SUCCESS) *pHandle = (CUmipmappedArray)(uintptr_t)h;
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray) {
    forget_levels((uint64_t)(uintptr_t)hMipmappedArray);
    return destroy_common(RGPU_OP_cuMipmappedArrayDestroy, (uint64_t)(uintptr_t)hMipmappedArray);
}

/* ------------------------------------------------------------------ texture objects */

RGPU_EXPORT CUresult CUDAAPI cuTexObjectCreate(CUtexObject *pTexObject, const CUDA_RESOURCE_DESC *pResDesc,
                                               const CUDA_TEXTURE_DESC *pTexDesc,
                                               const CUDA_RESOURCE_VIEW_DESC *pResViewDesc) {
    if (!pTexObject || !pResDesc || !pTexDesc) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_cuTexObjectCreate);
    if (r != CUDA_SUCCESS) return r;
    CUDA_RESOURCE_VIEW_DESC none;
    memset(&none, 0, sizeof none);
    rgpu_put(&c, pResDesc, sizeof *pResDesc);
    rgpu_put(&c, pTexDesc, sizeof *pTexDesc);
    rgpu_put_u32(&c, pResViewDesc != NULL);
    rgpu_put_u32(&c, 0);
    rgpu_put(&c, pResViewDesc ? pResViewDesc : &none, sizeof none);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) *pTexObject = rgpu_get_u64(&c);
    rgpu_end(&c);
    return r;
}

/* ------------------------------------------------------------------ 2D and 3D copies */

enum { SIDE_BAD = -1, SIDE_HOST = 0, SIDE_DEVICE = 1, SIDE_ARRAY = 2 };

/* The slice of the device memory p is in, -1 for this process's memory (zero_copy.c). */
static int device_session(CUdeviceptr p) { return rgpu_copy_device_session(p); }

/* What one side of a copy is here: this process's memory, the worker's device memory or an array. */
static int side_of(CUmemorytype type, CUdeviceptr device) {
    switch (type) {
    case CU_MEMORYTYPE_HOST: return SIDE_HOST;
    case CU_MEMORYTYPE_DEVICE: return SIDE_DEVICE;
    case CU_MEMORYTYPE_ARRAY: return SIDE_ARRAY;
    case CU_MEMORYTYPE_UNIFIED: return device_session(device) >= 0 ? SIDE_DEVICE : SIDE_HOST;
    default: return SIDE_BAD;
    }
}

typedef struct piece_job {
    const CUDA_MEMCPY3D *p;    /* the application's copy, memory types resolved */
    int kind, src_host;        /* src_host: this process's data goes (else it comes back) */
    int session;
    CUstream stream;
    const uint8_t *src;        /* the host side's base address */
    uint8_t *dst;
    uint8_t *tmp;              /* a piece read back, before it is spread over the host's rows */
} piece_job;

static size_t host_offset(size_t x, size_t y, size_t z, size_t pitch, size_t height) {
    return x + y * pitch + z * pitch * height;
}

static CUresult begin_copy(rgpu_call *c, uint16_t op, int session) {
    return session >= 0 ? rgpu_begin_session(c, op, session) : rgpu_begin(c, op);
}

/* One sub-box (x, y, z) of width w bytes, h rows, d planes: the host side becomes the data in
 * this request or its reply, packed (pitch w, height h). */
static CUresult do_piece(piece_job *j, size_t x, size_t y, size_t z, size_t w, size_t h, size_t d) {
    const CUDA_MEMCPY3D *p = j->p;
    CUDA_MEMCPY3D m = *p;
    m.WidthInBytes = w;
    m.Height = h;
    m.Depth = d;
    m.srcHost = NULL;
    m.dstHost = NULL;
    if (j->src_host) {
        m.srcXInBytes = m.srcY = m.srcZ = 0;
        m.srcPitch = w;
        m.srcHeight = h;
        m.dstXInBytes += x; m.dstY += y; m.dstZ += z;
    } else {
        m.dstXInBytes = m.dstY = m.dstZ = 0;
        m.dstPitch = w;
        m.dstHeight = h;
        m.srcXInBytes += x; m.srcY += y; m.srcZ += z;
    }
    rgpu_call c;
    CUresult r = begin_copy(&c, j->src_host ? RGPU_OP_rgpuMemcpyArray : RGPU_OP_rgpuMemcpyArrayToHost, j->session);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u32(&c, (uint32_t)j->kind);
    rgpu_put_u32(&c, 0);
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)j->stream);
    rgpu_put(&c, &m, sizeof m);
    size_t n = w * h * d;
    if (j->src_host) {
        rgpu_put_u64(&c, n);
        for (size_t k = 0; k < d; k++)
            for (size_t row = 0; row < h; row++)
                rgpu_put(&c, j->src + host_offset(p->srcXInBytes + x, p->srcY + y + row, p->srcZ + z + k, p->srcPitch,
                                                  p->srcHeight), w);
        return rgpu_async(&c);
    }
    c.sink = j->tmp;
    c.sink_cap = n;
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS && c.sink_got != n) r = CUDA_ERROR_UNKNOWN;
    rgpu_end(&c);
    if (r != CUDA_SUCCESS) return r;
    for (size_t k = 0; k < d; k++)
        for (size_t row = 0; row < h; row++)
            memcpy(j->dst + host_offset(p->dstXInBytes + x, p->dstY + y + row, p->dstZ + z + k, p->dstPitch, p->dstHeight),
                   j->tmp + (k * h + row) * w, w);
    return CUDA_SUCCESS;
}

/* Whole planes, else whole rows, else parts of a row: pieces of at most `chunk` bytes. Element
 * sizes are powers of two up to 16, so a split row stays on element boundaries. */
static CUresult for_pieces(piece_job *j, size_t W, size_t H, size_t D, size_t chunk) {
    CUresult r = CUDA_SUCCESS;
    if (W * H <= chunk) {
        size_t dz = chunk / (W * H);
        for (size_t z = 0; z < D && r == CUDA_SUCCESS; z += dz)
            r = do_piece(j, 0, 0, z, W, H, D - z < dz ? D - z : dz);
    } else if (W <= chunk) {
        size_t dy = chunk / W;
        for (size_t z = 0; z < D; z++)
            for (size_t y = 0; y < H && r == CUDA_SUCCESS; y += dy)
                r = do_piece(j, 0, y, z, W, H - y < dy ? H - y : dy, 1);
    } else {
        for (size_t z = 0; z < D; z++)
            for (size_t y = 0; y < H; y++)
                for (size_t x = 0; x < W && r == CUDA_SUCCESS; x += chunk)
                    r = do_piece(j, x, y, z, W - x < chunk ? W - x : chunk, 1, 1);
    }
    return r;
}

/* A 2D or 3D copy in CUDA_MEMCPY3D form (2D: Depth 1, no Z, no LOD). */
CUresult rgpu_copy_nd(const CUDA_MEMCPY3D *pCopy, int kind, CUstream stream) {
    if (!pCopy) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    CUDA_MEMCPY3D p = *pCopy;
    int src = side_of(p.srcMemoryType, p.srcDevice), dst = side_of(p.dstMemoryType, p.dstDevice);
    if (src == SIDE_BAD || dst == SIDE_BAD) return CUDA_ERROR_INVALID_VALUE;
    /* A unified pointer is this process's memory or the worker's device memory, as it was allocated. */
    if (p.srcMemoryType == CU_MEMORYTYPE_UNIFIED) {
        p.srcMemoryType = src == SIDE_HOST ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
        if (src == SIDE_HOST) p.srcHost = (const void *)(uintptr_t)p.srcDevice;
    }
    if (p.dstMemoryType == CU_MEMORYTYPE_UNIFIED) {
        p.dstMemoryType = dst == SIDE_HOST ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
        if (dst == SIDE_HOST) p.dstHost = (void *)(uintptr_t)p.dstDevice;
    }
    size_t W = p.WidthInBytes, H = p.Height, D = kind == COPY_3D ? p.Depth : 1;
    if (kind != COPY_3D) {
        p.Depth = 1;
        p.srcZ = p.dstZ = p.srcLOD = p.dstLOD = 0;
        p.srcHeight = p.dstHeight = 0;
    }
    if (!W || !H || !D) return CUDA_SUCCESS;
    if (src == SIDE_HOST && dst == SIDE_HOST) {
        const uint8_t *s = p.srcHost;
        uint8_t *d = p.dstHost;
        if (!s || !d) return CUDA_ERROR_INVALID_VALUE;
        for (size_t z = 0; z < D; z++)
            for (size_t y = 0; y < H; y++)
                memmove(d + host_offset(p.dstXInBytes, p.dstY + y, p.dstZ + z, p.dstPitch, p.dstHeight),
                        s + host_offset(p.srcXInBytes, p.srcY + y, p.srcZ + z, p.srcPitch, p.srcHeight), W);
        return CUDA_SUCCESS;
    }
    int session = dst == SIDE_DEVICE ? device_session(p.dstDevice) : src == SIDE_DEVICE ? device_session(p.srcDevice) : -1;
    if (src != SIDE_HOST && dst != SIDE_HOST) {
        rgpu_call c;
        r = begin_copy(&c, RGPU_OP_rgpuMemcpyArray, session);
        if (r != CUDA_SUCCESS) return r;
        rgpu_put_u32(&c, (uint32_t)kind);
        rgpu_put_u32(&c, 0);
        rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
        rgpu_put(&c, &p, sizeof p);
        rgpu_put_u64(&c, 0);
        return rgpu_async(&c);
    }
    if ((src == SIDE_HOST && !p.srcHost) || (dst == SIDE_HOST && !p.dstHost)) return CUDA_ERROR_INVALID_VALUE;
    if (rgpu_stream_capturing(stream)) {
        rgpu_log(RGPU_LOG_WARN, "rgpu: a 2D/3D copy between this process's memory and a CUDA array or device memory "
                 "on a capturing stream is not remoted yet (it returns CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)");
        return CU_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    piece_job j = {.p = &p, .kind = kind, .src_host = src == SIDE_HOST, .session = session, .stream = stream,
                   .src = p.srcHost, .dst = p.dstHost, .tmp = NULL};
    if (j.src_host) return for_pieces(&j, W, H, D, RGPU_CHUNK_BYTES);
    size_t total = W * H * D;
    j.tmp = malloc(total < READ_PIECE_BYTES ? total : READ_PIECE_BYTES);
    if (!j.tmp) return CUDA_ERROR_OUT_OF_MEMORY;
    r = for_pieces(&j, W, H, D, READ_PIECE_BYTES);
    free(j.tmp);
    return r;
}

/* The CUDA_MEMCPY2D fields in CUDA_MEMCPY3D form. */
CUresult rgpu_copy_2d_nd(const CUDA_MEMCPY2D *q, int unaligned, CUstream stream) {
    if (!q) return CUDA_ERROR_INVALID_VALUE;
    CUDA_MEMCPY3D m;
    memset(&m, 0, sizeof m);
    m.srcXInBytes = q->srcXInBytes; m.srcY = q->srcY; m.srcMemoryType = q->srcMemoryType; m.srcHost = q->srcHost;
    m.srcDevice = q->srcDevice; m.srcArray = q->srcArray; m.srcPitch = q->srcPitch;
    m.dstXInBytes = q->dstXInBytes; m.dstY = q->dstY; m.dstMemoryType = q->dstMemoryType; m.dstHost = q->dstHost;
    m.dstDevice = q->dstDevice; m.dstArray = q->dstArray; m.dstPitch = q->dstPitch;
    m.WidthInBytes = q->WidthInBytes; m.Height = q->Height; m.Depth = 1;
    return rgpu_copy_nd(&m, unaligned ? COPY_2D_UNALIGNED : COPY_2D, stream);
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpy3D_v2(const CUDA_MEMCPY3D *pCopy) { return rgpu_copy_nd(pCopy, COPY_3D, NULL); }

RGPU_EXPORT CUresult CUDAAPI cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *pCopy, CUstream hStream) {
    return rgpu_copy_nd(pCopy, COPY_3D, hStream);
}

/* The 1D-array copies: one row of a 2D copy, at a byte offset into the array. */
static CUresult copy_1d(int src_type, const void *src_host, CUdeviceptr src_dev, CUarray src_array, size_t src_off,
                        int dst_type, void *dst_host, CUdeviceptr dst_dev, CUarray dst_array, size_t dst_off,
                        size_t n, CUstream stream) {
    CUDA_MEMCPY3D m;
    memset(&m, 0, sizeof m);
    m.srcMemoryType = src_type; m.srcHost = src_host; m.srcDevice = src_dev; m.srcArray = src_array;
    m.dstMemoryType = dst_type; m.dstHost = dst_host; m.dstDevice = dst_dev; m.dstArray = dst_array;
    if (src_type == CU_MEMORYTYPE_ARRAY) m.srcXInBytes = src_off;
    if (dst_type == CU_MEMORYTYPE_ARRAY) m.dstXInBytes = dst_off;
    m.srcPitch = m.dstPitch = n;
    m.WidthInBytes = n;
    m.Height = 1;
    m.Depth = 1;
    return rgpu_copy_nd(&m, COPY_2D, stream);
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyHtoA_v2(CUarray dstArray, size_t dstOffset, const void *srcHost, size_t ByteCount) {
    return copy_1d(CU_MEMORYTYPE_HOST, srcHost, 0, NULL, 0, CU_MEMORYTYPE_ARRAY, NULL, 0, dstArray, dstOffset, ByteCount, NULL);
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyHtoAAsync_v2(CUarray dstArray, size_t dstOffset, const void *srcHost, size_t ByteCount,
                                                  CUstream hStream) {
    return copy_1d(CU_MEMORYTYPE_HOST, srcHost, 0, NULL, 0, CU_MEMORYTYPE_ARRAY, NULL, 0, dstArray, dstOffset, ByteCount,
                   hStream);
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyAtoH_v2(void *dstHost, CUarray srcArray, size_t srcOffset, size_t ByteCount) {
    return copy_1d(CU_MEMORYTYPE_ARRAY, NULL, 0, srcArray, srcOffset, CU_MEMORYTYPE_HOST, dstHost, 0, NULL, 0, ByteCount, NULL);
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyAtoHAsync_v2(void *dstHost, CUarray srcArray, size_t srcOffset, size_t ByteCount,
                                                  CUstream hStream) {
    return copy_1d(CU_MEMORYTYPE_ARRAY, NULL, 0, srcArray, srcOffset, CU_MEMORYTYPE_HOST, dstHost, 0, NULL, 0, ByteCount,
                   hStream);
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyDtoA_v2(CUarray dstArray, size_t dstOffset, CUdeviceptr srcDevice, size_t ByteCount) {
    return copy_1d(CU_MEMORYTYPE_DEVICE, NULL, srcDevice, NULL, 0, CU_MEMORYTYPE_ARRAY, NULL, 0, dstArray, dstOffset,
                   ByteCount, NULL);
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyAtoD_v2(CUdeviceptr dstDevice, CUarray srcArray, size_t srcOffset, size_t ByteCount) {
    return copy_1d(CU_MEMORYTYPE_ARRAY, NULL, 0, srcArray, srcOffset, CU_MEMORYTYPE_DEVICE, NULL, dstDevice, NULL, 0,
                   ByteCount, NULL);
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyAtoA_v2(CUarray dstArray, size_t dstOffset, CUarray srcArray, size_t srcOffset,
                                             size_t ByteCount) {
    return copy_1d(CU_MEMORYTYPE_ARRAY, NULL, 0, srcArray, srcOffset, CU_MEMORYTYPE_ARRAY, NULL, 0, dstArray, dstOffset,
                   ByteCount, NULL);
}
