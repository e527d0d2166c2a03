/* libcuda.so.1: memory. Device allocations are the worker's (it counts them against the slice);
 * page-locked host memory is this process's own; copies stream in chunks. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

/* ------------------------------------------------------------------ device allocations */

static CUresult alloc_common(uint16_t op, CUdeviceptr *dptr, size_t bytes, uint64_t a, uint64_t b,
                             size_t *pitch_out, size_t height, unsigned int elem) {
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, op);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, bytes);
    rgpu_put_u64(&c, a);
    rgpu_put_u64(&c, b);
    rgpu_put_u64(&c, height);
    rgpu_put_u32(&c, elem);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) {
        uint64_t ptr = rgpu_get_u64(&c);
        uint64_t pitch = rgpu_get_u64(&c);
        *dptr = ptr;
        if (pitch_out) *pitch_out = pitch;
        rgpu_dev_alloc_add(c.s->index, ptr, pitch_out ? pitch * height : bytes);
    }
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    return alloc_common(RGPU_OP_cuMemAlloc_v2, dptr, bytesize, 0, 0, NULL, 0, 0);
}

RGPU_EXPORT CUresult CUDAAPI cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                                size_t Height, unsigned int ElementSizeBytes) {
    if (!pPitch) return CUDA_ERROR_INVALID_VALUE;
    return alloc_common(RGPU_OP_cuMemAllocPitch_v2, dptr, WidthInBytes, 0, 0, pPitch, Height, ElementSizeBytes);
}

RGPU_EXPORT CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    /* Sync on the wire: the application needs the address now. The GPU-side ordering is
     * still the stream's. */
    return alloc_common(RGPU_OP_cuMemAllocAsync, dptr, bytesize, (uint64_t)(uintptr_t)hStream, 0, NULL, 0, 0);
}

RGPU_EXPORT CUresult CUDAAPI cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                     CUstream hStream) {
    return alloc_common(RGPU_OP_cuMemAllocFromPoolAsync, dptr, bytesize, (uint64_t)(uintptr_t)hStream,
                        (uint64_t)(uintptr_t)pool, NULL, 0, 0);
}

static CUresult free_common(uint16_t op, CUdeviceptr dptr, CUstream stream) {
    rgpu_call c;
    int session = -1;
    CUresult r;
    if (rgpu_dev_range_find(dptr, &session, NULL, NULL)) r = rgpu_check_init() ?: rgpu_begin_session(&c, op, session);
    else r = rgpu_begin(&c, op);
    if (r != CUDA_SUCCESS) return r;
    int s = c.s->index;
    rgpu_put_u64(&c, dptr);
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
    r = rgpu_sync(&c);
    rgpu_end(&c);
    if (r == CUDA_SUCCESS) rgpu_dev_range_remove(s, dptr);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr) {
    if (!dptr) return rgpu_check_init();
    if (rgpu_managed_find(dptr)) return rgpu_managed_free(dptr);
    return free_common(RGPU_OP_cuMemFree_v2, dptr, NULL);
}

RGPU_EXPORT CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    return free_common(RGPU_OP_cuMemFreeAsync, dptr, hStream);
}

RGPU_EXPORT CUresult CUDAAPI cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_cuMemGetInfo_v2);
    if (r != CUDA_SUCCESS) return r;
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) {
        *free_bytes = (size_t)rgpu_get_u64(&c);
        *total = (size_t)rgpu_get_u64(&c);
    }
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin_dev(&c, RGPU_OP_cuDeviceTotalMem_v2, dev);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_i32(&c, 0);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) *bytes = (size_t)rgpu_get_u64(&c);
    rgpu_end(&c);
    return r;
}

static CUresult pool_attribute(uint16_t op, CUmemoryPool pool, CUmemPool_attribute attr, void *value, int set) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    /* Reuse policies (1-3) are ints; thresholds and counters (4-8) are cuuint64_t. */
    size_t size = attr >= 1 && attr <= 3 ? 4 : 8;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, op);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)pool);
    rgpu_put_i32(&c, attr);
    uint64_t v = 0;
    if (set) memcpy(&v, value, size);
    rgpu_put_u64(&c, v);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS && !set) {
        v = rgpu_get_u64(&c);
        memcpy(value, &v, size);
    }
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    return pool_attribute(RGPU_OP_cuMemPoolSetAttribute, pool, attr, value, 1);
}

RGPU_EXPORT CUresult CUDAAPI cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    return pool_attribute(RGPU_OP_cuMemPoolGetAttribute, pool, attr, value, 0);
}

/* rgpu creates no memory pool (cuMemPoolCreate is not remoted), so a device's current pool is its
 * default pool for good: making it current again is what CuPy's MemoryAsyncPool does when it starts
 * (cudaDeviceSetMemPool of cudaDeviceGetMemPool's pool), and changes nothing. */
RGPU_EXPORT CUresult CUDAAPI cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    CUmemoryPool current = NULL;
    CUresult r = cuDeviceGetMemPool(&current, dev);
    if (r != CUDA_SUCCESS) return r;
    if (pool == current) return CUDA_SUCCESS;
    rgpu_log(1, "rgpu: cuDeviceSetMemPool: pool %p is not device %d's current pool; rgpu serves only each "
             "device's default pool (cuMemPoolCreate is not remoted yet)", (void *)pool, (int)dev);
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* ------------------------------------------------------------------ page-locked host memory
 * The GPU is across the network, so no GPU can map this memory: it is memory of this process,
 * remembered so that pointer queries and cuMemFreeHost behave as CUDA's do, and placed where the
 * worker can back it with device memory at the same address should a kernel or memset be handed it
 * (zero_copy.c). */

static CUresult host_alloc(void **pp, size_t bytesize, unsigned int flags) {
    if (!pp) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!rgpu_ctx_current()) return CUDA_ERROR_INVALID_CONTEXT;
    if (bytesize == 0) bytesize = 1;
    void *p = rgpu_zero_copy_alloc(bytesize, flags);
    if (p) {
        rgpu_host_range_add(p, bytesize, flags, 0);   /* zero_copy.c frees it */
    } else {
        /* Its own pages from mmap, never the heap: a launch is refused when an 8-byte word of its
         * arguments falls in page-locked memory, and heap addresses below 4 GiB (a non-PIE Python's)
         * match ordinary integers there (two ints, a size): a PyTorch ResNet-18's reduce kernel was
         * refused so with RGPU_ZERO_COPY=0 on an H200 (2026-11-28). */
        p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
        rgpu_host_range_add(p, bytesize, flags, 1);
    }
    *pp = p;
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuMemAllocHost_v2(void **pp, size_t bytesize) { return host_alloc(pp, bytesize, 0); }

RGPU_EXPORT CUresult CUDAAPI cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    return host_alloc(pp, bytesize, Flags);
}

RGPU_EXPORT CUresult CUDAAPI cuMemFreeHost(void *p) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    rgpu_lanes_sends_finish();   /* a copy from it may still be on its way */
    if (rgpu_zero_copy_free(p, &r)) return r;
    int owned = 0;
    size_t size = 0;
    if (!rgpu_host_range_remove(p, &owned, &size)) return CUDA_ERROR_INVALID_VALUE;
    if (owned) munmap(p, size);
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!p || !bytesize) return CUDA_ERROR_INVALID_VALUE;
    if (rgpu_host_range_find(p, NULL, NULL, NULL)) return 712; /* CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED */
    rgpu_host_range_add(p, bytesize, Flags, 0);
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuMemHostUnregister(void *p) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    rgpu_lanes_sends_finish();   /* a copy from it may still be on its way */
    int owned = 0;
    if (!rgpu_host_range_remove(p, &owned, NULL)) return 713; /* CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED */
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuMemHostGetFlags(unsigned int *pFlags, void *p) {
    if (!pFlags) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    unsigned int flags;
    if (!rgpu_host_range_find(p, NULL, NULL, &flags) && !rgpu_zero_copy_flags(p, &flags)) return CUDA_ERROR_INVALID_VALUE;
    *pFlags = flags;
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
    /* Zero-copy memory allocated as mapped (CU_MEMHOSTALLOC_DEVICEMAP, zero_copy.c) is the GPU's at
     * the same address, once backed there: the backing waits for the GPU's first real use of it (a
     * launch argument or a memset's target), not for this question. PyTorch's pinned-memory
     * allocator asks for its unmapped allocations on every run and does without the answer, so
     * those keep no GPU address here (a kernel handed them directly still gets them backed): a
     * debug line only, and a program that needs it gets its one clear line where it breaks. */
    static int seen;
    if (!pdptr || Flags) return CUDA_ERROR_INVALID_VALUE;
    unsigned int flags;
    if (p && rgpu_zero_copy_flags(p, &flags) == 2 && (flags & 0x02)) {   /* CU_MEMHOSTALLOC_DEVICEMAP, placed */
        *pdptr = (CUdeviceptr)(uintptr_t)p;
        return CUDA_SUCCESS;
    }
    if (!__atomic_exchange_n(&seen, 1, __ATOMIC_RELAXED))
        rgpu_log(RGPU_LOG_DEBUG, "cuMemHostGetDevicePointer_v2 is not remoted (a remote GPU cannot map this "
                 "host's memory; it returns CUDA_ERROR_NOT_SUPPORTED)");
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* ------------------------------------------------------------------ copies */

/* A copy between the device and page-locked memory the worker maps too (same host, protocol 15,
 * shared_pinned.c): the frame names the region and offset, the worker reads or writes the pages in
 * place. 0: not such memory, nothing added to the call. */
static int shared_copy(rgpu_call *c, uint16_t op, CUdeviceptr dev, const void *host, size_t n, CUstream stream) {
    uint64_t region = 0, offset = 0;
    if (!rgpu_zero_copy_shared(host, n, c->s->index, &region, &offset)) return 0;
    rgpu_retarget(c, op);
    rgpu_put_u64(c, dev);
    rgpu_put_u64(c, (uint64_t)(uintptr_t)stream);
    rgpu_put_u64(c, region);
    rgpu_put_u64(c, offset);
    rgpu_put_u64(c, n);
    return 1;
}

/* [p, p + n) lies in one page-locked allocation of this process. */
static int page_locked(const void *p, size_t n) {
    void *base = NULL;
    size_t size = 0;
    return rgpu_host_range_find(p, &base, &size, NULL) && (const uint8_t *)p + n <= (const uint8_t *)base + size;
}

/* wait: return only once the source may be reused (cuMemcpyHtoD's contract; an async copy from
 * page-locked memory may return before, as CUDA's does). Bytes sent on the wire are read by then. */
static CUresult htod(CUdeviceptr dst, const void *src, size_t n, CUstream stream, int session, int wait) {
    if (n && !src) return CUDA_ERROR_INVALID_VALUE;
    rgpu_managed_hand(dst);   /* page-locked memory backed on the GPU as the target: its bytes go first */
    if (rgpu_stream_capturing(stream)) return rgpu_capture_host_copy(stream, 0, dst, (void *)src, n);
    const uint8_t *p = src;
    size_t done = 0;
    do {
        size_t k = n - done < RGPU_CHUNK_BYTES ? n - done : RGPU_CHUNK_BYTES;
        rgpu_call c;
        CUresult r = session >= 0 ? rgpu_begin_session(&c, RGPU_OP_cuMemcpyHtoDAsync_v2, session)
                                  : rgpu_begin(&c, RGPU_OP_cuMemcpyHtoDAsync_v2);
        if (r != CUDA_SUCCESS) return r;
        if (!done && shared_copy(&c, wait ? RGPU_OP_rgpuMemcpyHtoDSharedWait : RGPU_OP_rgpuMemcpyHtoDShared, dst, src, n,
                                 stream)) {
            if (!wait) return rgpu_async(&c);
            r = rgpu_sync(&c);
            rgpu_end(&c);
            return r;
        }
        if (!done && !rgpu_ucx_carries(&c, n) && rgpu_lanes_carry(&c, n)) {
            /* Protocol 12: the bytes follow striped over the session's data lanes, behind the control
             * frame on the session's connection (which keeps the copy in order with the work around it). */
            rgpu_retarget(&c, RGPU_OP_rgpuMemcpyHtoDLanes);
            rgpu_put_u64(&c, dst);
            rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
            rgpu_put_u64(&c, n);
            rgpu_put_u64(&c, rgpu_lane_chunk_bytes());
            /* From page-locked memory, asynchronously: returns once the lanes began, as CUDA's does. */
            r = !wait && page_locked(src, n) ? rgpu_lanes_put_bulk_async(&c, src, n) : rgpu_lanes_put_bulk(&c, src, n);
            if (r == CUDA_SUCCESS) r = rgpu_async(&c);
            else rgpu_end(&c);
            return r;
        }
        if (!done && rgpu_ucx_carries(&c, n)) {
            /* A session with UCX carries a large copy's bytes there, in one message, behind its
             * control frame on TCP (which keeps the copy in order with the launches around it). */
            rgpu_retarget(&c, RGPU_OP_rgpuMemcpyHtoDUcx);
            rgpu_put_u64(&c, dst);
            rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
            rgpu_put_u64(&c, n);
            r = rgpu_ucx_put_bulk(&c, src, n);
            if (r == CUDA_SUCCESS) r = rgpu_async(&c);
            else rgpu_end(&c);
            return r;
        }
        rgpu_put_u64(&c, dst + done);
        rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
        rgpu_put_u64(&c, k);
        r = rgpu_put_bulk(&c, p + done, k);
        if (r == CUDA_SUCCESS) r = rgpu_async(&c);
        else rgpu_end(&c);
        if (r != CUDA_SUCCESS) return r;
        done += k;
    } while (done < n);
    return CUDA_SUCCESS;
}

static CUresult dtoh(void *dst, CUdeviceptr src, size_t n, CUstream stream, int session) {
    if (n && !dst) return CUDA_ERROR_INVALID_VALUE;
    rgpu_managed_hand(src);
    if (rgpu_stream_capturing(stream)) return rgpu_capture_host_copy(stream, 1, src, dst, n);
    uint64_t clock = rgpu_event_clock();
    rgpu_call c;
    CUresult r = session >= 0 ? rgpu_begin_session(&c, RGPU_OP_cuMemcpyDtoHAsync_v2, session)
                              : rgpu_begin(&c, RGPU_OP_cuMemcpyDtoHAsync_v2);
    if (r != CUDA_SUCCESS) return r;
    if (shared_copy(&c, RGPU_OP_rgpuMemcpyDtoHShared, src, dst, n, stream)) {
        r = rgpu_sync(&c);   /* the worker wrote the bytes in place before its reply */
        if (r == CUDA_SUCCESS) c.sink_got = n;
    } else {
    rgpu_put_u64(&c, src);
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
    rgpu_put_u64(&c, n);
    if (!rgpu_ucx_carries(&c, n) && rgpu_lanes_carry(&c, n)) {
        /* Protocol 12: the REPLY first (an error: nothing follows), then the bytes striped over the
         * session's data lanes, received straight into dst. */
        uint64_t chunk = rgpu_lane_chunk_bytes();
        rgpu_retarget(&c, RGPU_OP_rgpuMemcpyDtoHLanes);
        rgpu_put_u64(&c, chunk);
        r = rgpu_sync(&c);
        if (r == CUDA_SUCCESS) r = rgpu_lanes_get_bulk(&c, dst, n, chunk);
        if (r == CUDA_SUCCESS) c.sink_got = n;
    } else if (rgpu_ucx_carries(&c, n)) {   /* the bytes come back on UCX: a receive straight into dst */
        void *ucx_req = NULL;
        rgpu_retarget(&c, RGPU_OP_rgpuMemcpyDtoHUcx);
        r = rgpu_ucx_expect(&c, dst, n, &ucx_req);
        if (r != CUDA_SUCCESS) {
            rgpu_abort(&c);
            return r;
        }
        r = rgpu_ucx_finish(&c, ucx_req, n, rgpu_sync(&c));
        c.sink_got = n;
    } else {
        c.sink = dst;
        c.sink_cap = n;
        r = rgpu_sync(&c);
    }
    }
    if (r == CUDA_SUCCESS && c.sink_got != n) r = CUDA_ERROR_UNKNOWN;
    /* The data came after the copy ran on its stream, so after everything queued there before it:
     * events recorded there are complete (a completion that rides back on the reply; cuda_events.c). */
    if (r == CUDA_SUCCESS) {
        rgpu_stream_synced(stream, c.s->index, clock);
        rgpu_idle_stream_put(stream, c.s->index, c.s->seq);   /* idle_streams.c */
    }
    rgpu_end(&c);
    return r;
}

static CUresult unified(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream);

static int session_of(CUdeviceptr p) {
    int s = -1;
    return rgpu_dev_range_find(p, &s, NULL, NULL) ? s : -1;
}

/* For a unified address: as session_of, but -1 (this process's memory) for page-locked memory the
 * GPU was never handed, whose range the worker reserved with no memory behind it (zero_copy.c). */
static int unified_session_of(CUdeviceptr p) { return rgpu_copy_device_session(p); }

RGPU_EXPORT CUresult CUDAAPI cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    /* CUDA returns once the source may be reused; the bytes are on the wire by then. */
    CUresult r = rgpu_managed_routes(srcHost) ? unified(dstDevice, (CUdeviceptr)(uintptr_t)srcHost, ByteCount, NULL)
                                              : htod(dstDevice, srcHost, ByteCount, NULL, session_of(dstDevice), 1);
    if (r == CUDA_SUCCESS) rgpu_managed_sync_point();
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                                  CUstream hStream) {
    if (rgpu_managed_routes(srcHost)) return unified(dstDevice, (CUdeviceptr)(uintptr_t)srcHost, ByteCount, hStream);
    return htod(dstDevice, srcHost, ByteCount, hStream, session_of(dstDevice), 0);
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    CUresult r = rgpu_managed_routes(dstHost) ? unified((CUdeviceptr)(uintptr_t)dstHost, srcDevice, ByteCount, NULL)
                                              : dtoh(dstHost, srcDevice, ByteCount, NULL, session_of(srcDevice));
    if (r == CUDA_SUCCESS) rgpu_managed_sync_point();
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                                  CUstream hStream) {
    if (rgpu_managed_routes(dstHost)) return unified((CUdeviceptr)(uintptr_t)dstHost, srcDevice, ByteCount, hStream);
    /* Waits for the data: the bytes must land in this process's memory. */
    return dtoh(dstHost, srcDevice, ByteCount, hStream, session_of(srcDevice));
}

/* A copy between two slices (they may sit on different servers): through this process's memory,
 * in chunks, each read from the source in that slice's context (waiting for its earlier work, as a
 * copy to host does) and queued to the destination in its own. `stream` is used on the side whose
 * context it belongs to (the current one); the other side uses its context's legacy stream. */
#define PEER_CHUNK (8u << 20)

static CUresult copy_between_slices(CUdeviceptr dst, rgpu_ctx *dctx, CUdeviceptr src, rgpu_ctx *sctx, size_t n,
                                    CUstream stream) {
    if (!dctx || !sctx) return CUDA_ERROR_INVALID_CONTEXT;
    rgpu_ctx *cur = rgpu_ctx_current();
    CUstream sstream = cur && cur->session == sctx->session ? stream : NULL;
    CUstream dstream = cur && cur->session == dctx->session ? stream : NULL;
    uint8_t *buf = n ? malloc(n < PEER_CHUNK ? n : PEER_CHUNK) : NULL;
    if (n && !buf) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = CUDA_SUCCESS;
    for (size_t off = 0; off < n && r == CUDA_SUCCESS; off += PEER_CHUNK) {
        size_t k = n - off < PEER_CHUNK ? n - off : PEER_CHUNK;
        r = cuCtxPushCurrent_v2((CUcontext)sctx);
        if (r != CUDA_SUCCESS) break;
        r = dtoh(buf, src + off, k, sstream, sctx->session);
        cuCtxPopCurrent_v2(NULL);
        if (r != CUDA_SUCCESS) break;
        r = cuCtxPushCurrent_v2((CUcontext)dctx);
        if (r != CUDA_SUCCESS) break;
        r = htod(dst + off, buf, k, dstream, dctx->session, 1);
        cuCtxPopCurrent_v2(NULL);
    }
    free(buf);
    return r;
}

/* A device-to-device copy whose two sides sit in different slices (the runtime's cudaMemcpy
 * DeviceToDevice between devices, as PyTorch copies a tensor from cuda:0 to cuda:1): neither worker
 * knows the other's pointer, so it goes through this process. 1 (and *r) when handled here; 0 leaves
 * the copy to the pipelined path of its own slice. */
int rgpu_dtod_between_slices(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream, CUresult *r) {
    if (rgpu_session_count < 2) return 0;
    int ds = session_of(dst), ss = session_of(src);
    if (ds < 0 || ss < 0 || ds == ss) return 0;
    *r = copy_between_slices(dst, rgpu_ctx_of_session(ds), src, rgpu_ctx_of_session(ss), n, stream);
    return 1;
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                         CUcontext srcContext, size_t ByteCount) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    return copy_between_slices(dstDevice, rgpu_ctx_lookup(dstContext), srcDevice, rgpu_ctx_lookup(srcContext),
                               ByteCount, NULL);
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                              CUcontext srcContext, size_t ByteCount, CUstream hStream) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    return copy_between_slices(dstDevice, rgpu_ctx_lookup(dstContext), srcDevice, rgpu_ctx_lookup(srcContext),
                               ByteCount, hStream);
}

static CUresult unified(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    rgpu_managed_hand(dst);
    rgpu_managed_hand(src);
    int ds = unified_session_of(dst), ss = unified_session_of(src);
    if (ds >= 0 && ss >= 0) {
        if (ds != ss)
            return copy_between_slices(dst, rgpu_ctx_of_session(ds), src, rgpu_ctx_of_session(ss), n, stream);
        rgpu_call c;
        r = rgpu_begin_session(&c, RGPU_OP_cuMemcpyDtoDAsync_v2, ds);
        if (r != CUDA_SUCCESS) return r;
        rgpu_put_u64(&c, dst);
        rgpu_put_u64(&c, src);
        rgpu_put_u64(&c, n);
        rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
        return rgpu_async(&c);
    }
    if (ds >= 0) return htod(dst, (const void *)(uintptr_t)src, n, stream, ds, 1);
    if (ss >= 0) return dtoh((void *)(uintptr_t)dst, src, n, stream, ss);
    /* Neither side is a known device allocation (e.g. a module global): let the worker copy
     * device to device; host to host needs no GPU at all. */
    if (rgpu_host_range_find((void *)(uintptr_t)dst, NULL, NULL, NULL) &&
        rgpu_host_range_find((void *)(uintptr_t)src, NULL, NULL, NULL)) {
        memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
        return CUDA_SUCCESS;
    }
    rgpu_call c;
    r = rgpu_begin(&c, RGPU_OP_cuMemcpyDtoDAsync_v2);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, dst);
    rgpu_put_u64(&c, src);
    rgpu_put_u64(&c, n);
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
    return rgpu_async(&c);
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
    CUresult r = unified(dst, src, ByteCount, NULL);
    /* Blocking: the program may read what landed in managed memory as soon as it returns. */
    if (r == CUDA_SUCCESS) rgpu_managed_sync_point();
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream) {
    return unified(dst, src, ByteCount, hStream);
}

/* 2D copies: host rows travel as one contiguous block per direction; device-to-device goes
 * to the worker whole; copies with a CUDA array side go through cuda_array.c. */
static CUresult copy2d(const CUDA_MEMCPY2D *p, int unaligned, CUstream stream) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    int src_host = p->srcMemoryType == CU_MEMORYTYPE_HOST ||
                   (p->srcMemoryType == CU_MEMORYTYPE_UNIFIED && unified_session_of(p->srcDevice) < 0);
    int dst_host = p->dstMemoryType == CU_MEMORYTYPE_HOST ||
                   (p->dstMemoryType == CU_MEMORYTYPE_UNIFIED && unified_session_of(p->dstDevice) < 0);
    if (p->srcMemoryType == CU_MEMORYTYPE_ARRAY || p->dstMemoryType == CU_MEMORYTYPE_ARRAY)
        return rgpu_copy_2d_nd(p, unaligned, stream);   /* cuda_array.c */
    const uint8_t *sh = p->srcMemoryType == CU_MEMORYTYPE_HOST ? p->srcHost : (const void *)(uintptr_t)p->srcDevice;
    uint8_t *dh = p->dstMemoryType == CU_MEMORYTYPE_HOST ? p->dstHost : (void *)(uintptr_t)p->dstDevice;
    CUdeviceptr sd = p->srcDevice, dd = p->dstDevice;
    size_t w = p->WidthInBytes, h = p->Height;
    if (src_host && dst_host) {
        for (size_t y = 0; y < h; y++)
            memmove(dh + (p->dstY + y) * p->dstPitch + p->dstXInBytes, sh + (p->srcY + y) * p->srcPitch + p->srcXInBytes, w);
        return CUDA_SUCCESS;
    }
    if (src_host) {
        for (size_t y = 0; y < h && r == CUDA_SUCCESS; y++)
            r = htod(dd + (p->dstY + y) * p->dstPitch + p->dstXInBytes, sh + (p->srcY + y) * p->srcPitch + p->srcXInBytes,
                     w, stream, session_of(dd), 1);
        return r;
    }
    if (dst_host) {
        /* One request per row would cost a round trip each: fetch the rows' span at once. */
        size_t span = (h ? (h - 1) * p->srcPitch : 0) + w;
        uint8_t *tmp = malloc(span ? span : 1);
        if (!tmp) return CUDA_ERROR_OUT_OF_MEMORY;
        r = dtoh(tmp, sd + p->srcY * p->srcPitch + p->srcXInBytes, span, stream, session_of(sd));
        if (r == CUDA_SUCCESS)
            for (size_t y = 0; y < h; y++) memcpy(dh + (p->dstY + y) * p->dstPitch + p->dstXInBytes, tmp + y * p->srcPitch, w);
        free(tmp);
        return r;
    }
    rgpu_call c;
    int s = session_of(dd);
    r = s >= 0 ? rgpu_begin_session(&c, RGPU_OP_rgpuMemcpy2DDevice, s) : rgpu_begin(&c, RGPU_OP_rgpuMemcpy2DDevice);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, dd + p->dstY * p->dstPitch + p->dstXInBytes);
    rgpu_put_u64(&c, p->dstPitch);
    rgpu_put_u64(&c, sd + p->srcY * p->srcPitch + p->srcXInBytes);
    rgpu_put_u64(&c, p->srcPitch);
    rgpu_put_u64(&c, w);
    rgpu_put_u64(&c, h);
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
    return rgpu_async(&c);
}

RGPU_EXPORT CUresult CUDAAPI cuMemcpy2D_v2(const CUDA_MEMCPY2D *pCopy) { return copy2d(pCopy, 0, NULL); }
RGPU_EXPORT CUresult CUDAAPI cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D *pCopy) { return copy2d(pCopy, 1, NULL); }
RGPU_EXPORT CUresult CUDAAPI cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *pCopy, CUstream hStream) {
    return copy2d(pCopy, 0, hStream);
}

/* ------------------------------------------------------------------ pointer attributes */

static int local_pointer_attribute(CUpointer_attribute attr, CUdeviceptr ptr, void *data) {
    void *base;
    size_t size;
    unsigned int flags;
    if (!rgpu_host_range_find((void *)(uintptr_t)ptr, &base, &size, &flags)) return -1;
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = CU_MEMORYTYPE_HOST; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER: *(void **)data = (void *)(uintptr_t)ptr; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = (CUcontext)rgpu_ctx_current(); return CUDA_SUCCESS;
    /* The driver's yes/no attributes are ints: the runtime and libraries (CCCL, XLA) read four
     * bytes, so one byte left three of their stack's (cudaPointerGetAttributes called page-locked
     * memory managed at random). */
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(unsigned int *)data = 0; return CUDA_SUCCESS;
    /* Page-locked here, but not mapped for the GPU: it is on another machine. Saying 1 made the
     * runtime hand kernels this host address (UnifiedMemoryPerf's zero-copy mode: ILLEGAL_ADDRESS). */
    case CU_POINTER_ATTRIBUTE_MAPPED: *(unsigned int *)data = 0; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(void **)data = base; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = size; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: {
        rgpu_ctx *cur = rgpu_ctx_current();
        *(int *)data = cur ? cur->session : 0;
        return CUDA_SUCCESS;
    }
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

/* Managed memory (managed.c) is device memory on the worker at the program's address: the
 * worker's driver calls it unmanaged and names the over-sized allocation behind it. These
 * attributes are the client's to answer (-1: ask the worker). */
static int managed_pointer_attribute(CUpointer_attribute attr, CUdeviceptr ptr, void *data) {
    CUdeviceptr user;
    size_t size;
    if (!rgpu_managed_range(ptr, &user, &size)) return -1;
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(unsigned int *)data = 1; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER: *(void **)data = (void *)(uintptr_t)ptr; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = user; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = size; return CUDA_SUCCESS;
    default: return -1;
    }
}

/* Copy one attribute's bytes as the worker's driver wrote them, translating handles; an answer
 * about a plain allocation (base != 0) is kept for the next question (cuda_cache.c). */
static void store_attribute(rgpu_call *c, CUpointer_attribute attr, void *data, uint64_t base, CUdeviceptr ptr) {
    uint32_t n = rgpu_get_u32(c);
    uint8_t raw[64] = {0};
    rgpu_get(c, raw, n < sizeof raw ? n : sizeof raw);
    if (n > sizeof raw) c->roff += n - sizeof raw;
    uint8_t out[64] = {0};
    uint32_t wrote = n < sizeof raw ? n : (uint32_t)sizeof raw;
    if (n == 0) {   /* cuPointerGetAttributes: this one attribute failed on the worker (zero-filled) */
        if (data) memset(data, 0, 8);
        return;
    }
    if (attr == CU_POINTER_ATTRIBUTE_CONTEXT) {
        uint64_t remote;
        memcpy(&remote, raw, 8);
        CUcontext ctx = rgpu_ctx_out(c, remote);
        memcpy(out, &ctx, sizeof ctx);
        wrote = sizeof ctx;
    } else if (attr == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) {
        int32_t v;
        memcpy(&v, raw, 4);
        int ordinal = v < 0 ? v : c->s->index;
        memcpy(out, &ordinal, sizeof ordinal);
        wrote = sizeof ordinal;
    } else {
        memcpy(out, raw, wrote);
    }
    if (data && wrote) memcpy(data, out, wrote);
    if (base && wrote) rgpu_pattr_put(base, ptr, attr, out, wrote);
}

RGPU_EXPORT CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    int local = local_pointer_attribute(attribute, ptr, data);
    if (local >= 0) return local;
    local = managed_pointer_attribute(attribute, ptr, data);
    if (local >= 0) return local;
    uint64_t base = 0;
    if (rgpu_dev_alloc_find(ptr, &base) && rgpu_pattr_get(base, ptr, attribute, data)) return CUDA_SUCCESS;
    rgpu_call c;
    int s = session_of(ptr);
    r = s >= 0 ? rgpu_begin_session(&c, RGPU_OP_cuPointerGetAttribute, s) : rgpu_begin(&c, RGPU_OP_cuPointerGetAttribute);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_i32(&c, attribute);
    rgpu_put_u64(&c, ptr);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) store_attribute(&c, attribute, data, base, ptr);
    rgpu_end(&c);
    return r;
}

/* ptr is memory of this process that no table here knows (not page-locked, not a device range, not
 * managed): a plain host address, whose page is mapped here. The worker would be asked about an
 * address of another process. */
static int plain_host_memory(CUdeviceptr ptr) {
    if (rgpu_dev_range_find(ptr, NULL, NULL, NULL) || rgpu_managed_find(ptr)) return 0;
    long page = sysconf(_SC_PAGESIZE);
    unsigned char resident;
    return page > 0 && mincore((void *)(uintptr_t)(ptr & ~(uint64_t)(page - 1)), 1, &resident) == 0;
}

static CUresult pointer_attributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                   CUdeviceptr ptr);

RGPU_EXPORT CUresult CUDAAPI cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes,
                                                    void **data, CUdeviceptr ptr) {
    if (!attributes || !data || numAttributes == 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    r = pointer_attributes(numAttributes, attributes, data, ptr);
    for (unsigned int i = 0; r == CUDA_SUCCESS && i < numAttributes; i++)
        if (data[i]) managed_pointer_attribute(attributes[i], ptr, data[i]);
    return r;
}

static CUresult pointer_attributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                   CUdeviceptr ptr) {
    CUresult r;
    if (rgpu_host_range_find((void *)(uintptr_t)ptr, NULL, NULL, NULL)) {
        for (unsigned int i = 0; i < numAttributes; i++)
            if (data[i] && local_pointer_attribute(attributes[i], ptr, data[i]) != CUDA_SUCCESS)
                memset(data[i], 0, 4);
        return CUDA_SUCCESS;
    }
    /* Pageable memory (PyTorch's DataLoader asks is_pinned of every batch it receives): CUDA answers
     * the plural query with default (zero) values and success, as the worker did, here without the
     * round trip (0.7-1 ms each on an H200, 2026-11-28). */
    if (plain_host_memory(ptr)) {
        for (unsigned int i = 0; i < numAttributes; i++)
            if (data[i]) memset(data[i], 0, 8);
        return CUDA_SUCCESS;
    }
    uint64_t base = 0;
    if (rgpu_dev_alloc_find(ptr, &base)) {
        unsigned int known = 0;
        while (known < numAttributes && rgpu_pattr_get(base, ptr, attributes[known], NULL)) known++;
        if (known == numAttributes) {
            for (unsigned int i = 0; i < numAttributes; i++)
                if (data[i]) rgpu_pattr_get(base, ptr, attributes[i], data[i]);
            return CUDA_SUCCESS;
        }
    }
    rgpu_call c;
    int s = session_of(ptr);
    r = s >= 0 ? rgpu_begin_session(&c, RGPU_OP_cuPointerGetAttributes, s) : rgpu_begin(&c, RGPU_OP_cuPointerGetAttributes);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u32(&c, numAttributes);
    for (unsigned int i = 0; i < numAttributes; i++) rgpu_put_i32(&c, attributes[i]);
    rgpu_put_u64(&c, ptr);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS)
        for (unsigned int i = 0; i < numAttributes; i++) store_attribute(&c, attributes[i], data[i], base, ptr);
    rgpu_end(&c);
    return r;
}
