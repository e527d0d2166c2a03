/* libcuda.so.1: modules, libraries, the linker, kernel launches, occupancy, host callbacks. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

#include "rgpu_client.h"
#include "rgpu_sha256.h"
#include "cuda_protos.h"

/* ------------------------------------------------------------------ image sizes
 * cuModuleLoadData has no size argument: read it from the image's own header. */

#define FATBIN_MAGIC 0xBA55ED50u
#define FATBIN_WRAPPER_MAGIC 0x466243B1u

typedef struct { int magic; int version; const unsigned long long *data; void *filename_or_fatbins; } fatbin_wrapper;

/* An image larger than this is refused before its bytes are read (no worker takes a frame this
 * large; a damaged header would otherwise have the client hash and send whatever memory follows). */
#define IMAGE_MAX_BYTES ((uint64_t)4 << 30)

/* Whether [p, p + n) is mapped: an image's size comes from its own header, which may be damaged,
 * and reading past the mapping it is in would end the application with SIGSEGV. */
static int mapped(const void *p, size_t n) {
    static long page;
    if (!page) page = sysconf(_SC_PAGESIZE);
    uintptr_t at = (uintptr_t)p & ~(uintptr_t)(page - 1), end = (uintptr_t)p + n;
    unsigned char vec[4096];
    while (at < end) {
        size_t len = end - at < sizeof vec * (size_t)page ? end - at : sizeof vec * (size_t)page;
        if (mincore((void *)at, len, vec) != 0) return 0;
        at += len;
    }
    return 1;
}

static size_t elf_size(const uint8_t *b) {
    if (!mapped(b, 0x40) || b[4] != 2) return 0; /* ELFCLASS64 only: CUDA cubins are 64-bit */
    uint64_t phoff, shoff;
    uint16_t phentsize, phnum, shentsize, shnum;
    memcpy(&phoff, b + 0x20, 8);
    memcpy(&shoff, b + 0x28, 8);
    memcpy(&phentsize, b + 0x36, 2);
    memcpy(&phnum, b + 0x38, 2);
    memcpy(&shentsize, b + 0x3A, 2);
    memcpy(&shnum, b + 0x3C, 2);
    size_t end = 0x40;
    if ((shnum && (shentsize < 0x28 || shoff > IMAGE_MAX_BYTES || !mapped(b + shoff, (size_t)shentsize * shnum))) ||
        (phnum && (phentsize < 0x28 || phoff > IMAGE_MAX_BYTES || !mapped(b + phoff, (size_t)phentsize * phnum))))
        return 0;   /* its tables lie outside the memory it is in */
    if (shoff + (uint64_t)shentsize * shnum > end) end = shoff + (uint64_t)shentsize * shnum;
    if (phoff + (uint64_t)phentsize * phnum > end) end = phoff + (uint64_t)phentsize * phnum;
    for (uint16_t i = 0; i < shnum; i++) {
        const uint8_t *sh = b + shoff + (uint64_t)i * shentsize;
        uint32_t type;
        uint64_t off, size;
        memcpy(&type, sh + 4, 4);
        memcpy(&off, sh + 0x18, 8);
        memcpy(&size, sh + 0x20, 8);
        if (type != 8 /* SHT_NOBITS */ && off + size > end) end = off + size;
    }
    for (uint16_t i = 0; i < phnum; i++) {
        const uint8_t *ph = b + phoff + (uint64_t)i * phentsize;
        uint64_t off, filesz;
        memcpy(&off, ph + 0x08, 8);
        memcpy(&filesz, ph + 0x20, 8);
        if (off + filesz > end) end = off + filesz;
    }
    return end;
}

/* One fatbin container: a 16-byte header (magic, version, header size, body size) and its
 * entries, sized by its header. This is what cudart registers for each translation unit and what
 * a load sends. A library's .nv_fatbin section holds thousands of containers back to back, one per
 * unit, so the bytes after a container are other units' code: rgpu sent every container up to the
 * end of the section, quadratic bytes at a PyTorch process's first start, and loads past the
 * worker's frame bound were refused (benchmarks/first_start.py). */
size_t rgpu_fatbin_size(const void *image) {
    const uint8_t *b = image;
    uint16_t header;
    uint64_t body;
    memcpy(&header, b + 6, 2);
    memcpy(&body, b + 8, 8);
    return header < 16 || body > ((uint64_t)1 << 40) ? 0 : header + body;
}

/* Returns the bytes to send (unwrapping cudart's fatbin wrapper) and their size; 0 for an image
 * whose header sizes it past the memory it lies in (said in one line). */
static const void *image_bytes_unchecked(const void *image, size_t *size);

static const void *image_bytes(const void *image, size_t *size) {
    const void *bytes = image_bytes_unchecked(image, size);
    if (!*size)
        rgpu_log(RGPU_LOG_ERROR, "a module image's header does not give its size (a damaged or truncated fatbin or "
                 "cubin): not loaded (CUDA_ERROR_INVALID_IMAGE)");
    else if (*size > IMAGE_MAX_BYTES || !mapped(bytes, *size)) {
        rgpu_log(RGPU_LOG_ERROR, "a module image's header gives it %zu bytes, past the memory it lies in (a damaged or "
                 "truncated image): not loaded (CUDA_ERROR_INVALID_IMAGE)", *size);
        *size = 0;
    }
    return bytes;
}

static const void *image_bytes_unchecked(const void *image, size_t *size) {
    const uint8_t *b = image;
    uint32_t magic;
    memcpy(&magic, b, 4);
    if (magic == FATBIN_WRAPPER_MAGIC) {
        const fatbin_wrapper *w = image;
        if (!w->data) { *size = 0; return image; }
        return image_bytes_unchecked(w->data, size);
    }
    if (magic == FATBIN_MAGIC) {
        *size = rgpu_fatbin_size(image);
        return image;
    }
    if (magic == 0x464c457fu) {
        *size = elf_size(b);
        return image;
    }
    *size = strlen((const char *)image) + 1; /* PTX text, NUL included as the driver expects */
    return image;
}

/* ------------------------------------------------------------------ JIT options */

typedef struct jit_plan {
    unsigned int n;          /* options sent */
    unsigned int idx[64];    /* their index in the caller's arrays */
} jit_plan;

static int jit_pointer_option(int opt) {
    return opt == CU_JIT_GLOBAL_SYMBOL_NAMES || opt == CU_JIT_GLOBAL_SYMBOL_ADDRESSES ||
           opt == CU_JIT_GLOBAL_SYMBOL_COUNT || opt == CU_JIT_REFERENCED_KERNEL_NAMES ||
           opt == CU_JIT_REFERENCED_KERNEL_COUNT || opt == CU_JIT_REFERENCED_VARIABLE_NAMES ||
           opt == CU_JIT_REFERENCED_VARIABLE_COUNT;
}

static void put_jit_options(rgpu_call *c, jit_plan *plan, unsigned int n, const CUjit_option *opts, void **vals) {
    plan->n = 0;
    for (unsigned int i = 0; i < n && opts && vals && plan->n < 64; i++) {
        if (jit_pointer_option(opts[i])) {
            static int seen;
            rgpu_unsupported("JIT options naming host symbols", &seen, "the option is ignored");
            continue;
        }
        plan->idx[plan->n++] = i;
    }
    rgpu_put_u32(c, plan->n);
    for (unsigned int k = 0; k < plan->n; k++) {
        unsigned int i = plan->idx[k];
        int opt = opts[i];
        uint64_t v = (opt == CU_JIT_INFO_LOG_BUFFER || opt == CU_JIT_ERROR_LOG_BUFFER) ? 0 : (uint64_t)(uintptr_t)vals[i];
        rgpu_put_i32(c, opt);
        rgpu_put_u64(c, v);
    }
}

static void copy_log(char *dst, size_t cap, const uint8_t *src, uint32_t n) {
    if (!dst || !cap) return;
    size_t k = n < cap - 1 ? n : cap - 1;
    memcpy(dst, src, k);
    dst[k] = 0;
}

/* Read back option values (sizes used, wall time) and the logs into the caller's buffers. */
static void get_jit_results(rgpu_call *c, const jit_plan *plan, const CUjit_option *opts, void **vals) {
    uint32_t n = rgpu_get_u32(c);
    for (uint32_t k = 0; k < n; k++) {
        uint64_t v = rgpu_get_u64(c);
        if (k >= plan->n) continue;
        unsigned int i = plan->idx[k];
        int opt = opts[i];
        if (opt == CU_JIT_WALL_TIME) {
            float f;
            uint32_t bits = (uint32_t)v;
            memcpy(&f, &bits, 4);
            memcpy(&vals[i], &f, sizeof f);
        } else if (opt == CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES || opt == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES ||
                   opt == CU_JIT_THREADS_PER_BLOCK) {
            vals[i] = (void *)(uintptr_t)v;
        }
    }
    for (int which = 0; which < 2; which++) {
        uint32_t len = rgpu_get_u32(c);
        const uint8_t *text = c->rp + c->roff;
        if (c->roff + len > c->rlen) len = 0;
        for (unsigned int k = 0; k < plan->n; k++) {
            unsigned int i = plan->idx[k];
            int want = which == 0 ? CU_JIT_INFO_LOG_BUFFER : CU_JIT_ERROR_LOG_BUFFER;
            int want_size = which == 0 ? CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES : CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES;
            if (opts[i] != want) continue;
            size_t cap = 0;
            for (unsigned int m = 0; m < plan->n; m++)
                if (opts[plan->idx[m]] == want_size) cap = (size_t)(uintptr_t)vals[plan->idx[m]] + 1;
            copy_log(vals[i], cap ? cap : 1, text, len);
        }
        c->roff += len;
    }
}

static rgpu_fn *read_one_function(rgpu_call *c, uint64_t handle, uint64_t module);

/* Function tables follow every load: handle, name and parameter layout of each function. */
static void read_functions(rgpu_call *c, uint64_t module) {
    uint32_t n = rgpu_get_u32(c);
    for (uint32_t i = 0; i < n && rgpu_remaining(c) >= 16; i++) read_one_function(c, rgpu_get_u64(c), module);
}

/* Images at least this large are named by their SHA-256 first: the GPU node's image cache may
 * have them (worker/image_cache.py), and then no byte of the image crosses the wire. */
#define IMAGE_HASH_MIN (64u * 1024u)
enum { IMAGE_BYTES = 0, IMAGE_BY_HASH = 1, IMAGE_BYTES_TO_CACHE = 2, IMAGE_WANT_TABLE = 0x80 };

/* One load call. how: IMAGE_BYTES (the image follows), IMAGE_BY_HASH (only its SHA-256: the
 * worker answers success with an empty body when its cache lacks it, "send the bytes"), or
 * IMAGE_BYTES_TO_CACHE (the image follows, and the worker caches it under the SHA-256). */
static CUresult load_once(uint16_t op, int session, uint64_t *out, int *where, int how, const uint8_t digest[32],
                          int *need_bytes, const void *image, size_t size, unsigned int nopts, CUjit_option *opts,
                          void **vals, unsigned int nlib, CUlibraryOption *libopts, void **libvals) {
    rgpu_call c;
    CUresult r = session < 0 ? rgpu_begin(&c, op) : rgpu_begin_session(&c, op, session);
    if (r != CUDA_SUCCESS) return r;
    if (where) *where = c.s->index;
    jit_plan plan;
    put_jit_options(&c, &plan, nopts, opts, vals);
    /* Options whose values are this process's host pointers stay here: the host table of
     * universal functions means nothing on the GPU node, and the worker's copy of the image is
     * not preserved, whatever the application promises for its own. */
    unsigned int nsend = 0;
    for (unsigned int i = 0; libopts && libvals && i < nlib; i++)
        if (libopts[i] != CU_LIBRARY_HOST_UNIVERSAL_FUNCTION_AND_DATA_TABLE && libopts[i] != CU_LIBRARY_BINARY_IS_PRESERVED)
            nsend++;
    rgpu_put_u32(&c, nsend);
    for (unsigned int i = 0; libopts && libvals && i < nlib; i++) {
        if (libopts[i] == CU_LIBRARY_HOST_UNIVERSAL_FUNCTION_AND_DATA_TABLE || libopts[i] == CU_LIBRARY_BINARY_IS_PRESERVED)
            continue;
        rgpu_put_i32(&c, libopts[i]);
        rgpu_put_u64(&c, (uint64_t)(uintptr_t)libvals[i]);
    }
    rgpu_put_u64(&c, size);
    /* A library's function table is asked for only where library_mirror.c matches kernels
     * between slices: with one slice the client asks per kernel it launches (rgpuParamInfo). */
    int want_table = op != RGPU_OP_cuLibraryLoadData || rgpu_session_count > 1;
    rgpu_put_u8(&c, (uint8_t)(how | (want_table ? IMAGE_WANT_TABLE : 0)));
    static const uint8_t no_digest[32];
    rgpu_put(&c, how == IMAGE_BYTES ? no_digest : digest, 32);
    if (how != IMAGE_BY_HASH) {
        r = rgpu_put_bulk(&c, image, size);
        if (r != CUDA_SUCCESS) {
            rgpu_end(&c);
            return r;
        }
    }
    r = rgpu_sync(&c);
    if (how == IMAGE_BY_HASH && r == CUDA_SUCCESS && rgpu_remaining(&c) == 0) {
        *need_bytes = 1;
        rgpu_end(&c);
        return r;
    }
    if (how != IMAGE_BY_HASH) rgpu_stats_image(size, 0);
    else rgpu_stats_image(0, 1);
    /* Logs come back on failure too: that is when the application reads them. */
    if (rgpu_remaining(&c) >= 8) {
        uint64_t handle = rgpu_get_u64(&c);
        get_jit_results(&c, &plan, opts, vals);
        if (r == CUDA_SUCCESS) {
            *out = handle;
            read_functions(&c, handle);
        }
    }
    rgpu_end(&c);
    return r;
}

/* session -1: the current context's slice. *where (if given) says which slice loaded it. */
static CUresult load_image(uint16_t op, int session, uint64_t *out, int *where, const void *image, size_t size,
                           unsigned int nopts, CUjit_option *opts, void **vals, unsigned int nlib,
                           CUlibraryOption *libopts, void **libvals) {
    if (size < IMAGE_HASH_MIN)
        return load_once(op, session, out, where, IMAGE_BYTES, NULL, NULL, image, size, nopts, opts, vals, nlib,
                         libopts, libvals);
    uint8_t digest[32];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int hashed = rgpu_image_digest(image, size, digest);   /* remembered for images in library files (digest_memo.c) */
    clock_gettime(CLOCK_MONOTONIC, &t1);
    rgpu_stats_image_hash(hashed ? size : 0,
                          (uint64_t)(t1.tv_sec - t0.tv_sec) * 1000000000u + (uint64_t)(t1.tv_nsec - t0.tv_nsec));
    int need_bytes = 0;
    CUresult r = load_once(op, session, out, where, IMAGE_BY_HASH, digest, &need_bytes, image, size, nopts, opts,
                           vals, nlib, libopts, libvals);
    if (r != CUDA_SUCCESS || !need_bytes) return r;
    return load_once(op, session, out, where, IMAGE_BYTES_TO_CACHE, digest, NULL, image, size, nopts, opts, vals,
                     nlib, libopts, libvals);
}

RGPU_EXPORT CUresult CUDAAPI cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                                CUjit_option *options, void **optionValues) {
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    size_t size;
    const void *bytes = image_bytes(image, &size);
    if (!size) return CUDA_ERROR_INVALID_IMAGE;
    uint64_t h = 0;
    CUresult r = load_image(RGPU_OP_cuModuleLoadDataEx, -1, &h, NULL, bytes, size, numOptions, options, optionValues, 0,
                            NULL, NULL);
    if (r == CUDA_SUCCESS) *module = (CUmodule)(uintptr_t)h;
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
    return cuModuleLoadDataEx(module, image, 0, NULL, NULL);
}

RGPU_EXPORT CUresult CUDAAPI cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    return cuModuleLoadDataEx(module, fatCubin, 0, NULL, NULL);
}

static void *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) {
        b[n] = 0; /* PTX files need their terminating NUL */
        *size = (size_t)n + 1;
    }
    return b;
}

RGPU_EXPORT CUresult CUDAAPI cuModuleLoad(CUmodule *module, const char *fname) {
    if (!module || !fname) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    size_t size;
    void *data = read_file(fname, &size); /* the file is on this node, not the GPU server */
    if (!data) return CUDA_ERROR_FILE_NOT_FOUND;
    r = cuModuleLoadDataEx(module, data, 0, NULL, NULL);
    free(data);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                               void **jitOptionsValues, unsigned int numJitOptions,
                                               CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                               unsigned int numLibraryOptions) {
    if (!library || !code) return CUDA_ERROR_INVALID_VALUE;
    size_t size;
    const void *bytes = image_bytes(code, &size);
    if (!size) return CUDA_ERROR_INVALID_IMAGE;
    uint64_t h = 0;
    int origin = 0;
    CUresult r = load_image(RGPU_OP_cuLibraryLoadData, -1, &h, &origin, bytes, size, numJitOptions, jitOptions,
                            jitOptionsValues, numLibraryOptions, libraryOptions, libraryOptionValues);
    if (r != CUDA_SUCCESS) return r;
    /* A library serves every device: with several slices it is loaded on each now, while its
     * image is certainly still there (library_mirror.c). */
    if (rgpu_session_count > 1)
        rgpu_library_loaded(origin, h, bytes, size, numLibraryOptions, libraryOptions, libraryOptionValues);
    *library = (CUlibrary)(uintptr_t)h;
    return r;
}

CUresult rgpu_library_load_on(int session, const void *image, size_t size, unsigned int nopts, CUlibraryOption *opts,
                              void **vals, uint64_t *library) {
    return load_image(RGPU_OP_cuLibraryLoadData, session, library, NULL, image, size, 0, NULL, NULL, nopts, opts, vals);
}

RGPU_EXPORT CUresult CUDAAPI cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                                   void **jitOptionsValues, unsigned int numJitOptions,
                                                   CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                                   unsigned int numLibraryOptions) {
    if (!library || !fileName) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    size_t size;
    void *data = read_file(fileName, &size);
    if (!data) return CUDA_ERROR_FILE_NOT_FOUND;
    r = cuLibraryLoadData(library, data, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                          libraryOptionValues, numLibraryOptions);
    free(data);
    return r;
}

/* ------------------------------------------------------------------ function lookups */

static rgpu_fn *read_one_function(rgpu_call *c, uint64_t handle, uint64_t module) {
    uint32_t nl = rgpu_get_u32(c);
    char name[512];
    size_t k = nl < sizeof name - 1 ? nl : sizeof name - 1;
    rgpu_get(c, name, k);
    name[k] = 0;
    if (nl > k) c->roff += nl - k;
    uint32_t np = rgpu_get_u32(c);
    uint32_t *offs = calloc(np ? np : 1, 4), *sizes = calloc(np ? np : 1, 4);
    for (uint32_t j = 0; j < np; j++) {
        offs[j] = rgpu_get_u32(c);
        sizes[j] = rgpu_get_u32(c);
    }
    rgpu_fn *fn = rgpu_fn_add(c->s->index, handle, name, np, offs, sizes);
    if (fn && module) rgpu_fn_set_module(fn, module);
    free(offs);
    free(sizes);
    return fn;
}

static int current_session(void) {
    rgpu_ctx *cur = rgpu_ctx_current();
    return cur ? cur->session : 0;
}

/* The parameter layout of a function or kernel handle: cached, else asked once. */
static CUresult function_info(uint64_t handle, rgpu_fn **out) {
    handle = (uint64_t)(uintptr_t)rgpu_fn_remote((CUfunction)(uintptr_t)handle);
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    int session = current_session();
    rgpu_fn *fn = rgpu_fn_find(session, handle);
    if (!fn) {
        rgpu_call c;
        r = rgpu_begin_session(&c, RGPU_OP_rgpuParamInfo, session);
        if (r != CUDA_SUCCESS) return r;
        rgpu_put_u64(&c, handle);
        r = rgpu_sync(&c);
        if (r == CUDA_SUCCESS) fn = read_one_function(&c, handle, 0);
        rgpu_end(&c);
        if (r != CUDA_SUCCESS) return r;
        if (!fn) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = fn;
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    int session = current_session();
    /* Only a handle the worker's cuModuleGetFunction returned: with lazy loading the handles a
     * module load enumerates (cuModuleEnumerateFunctions) are not loaded, and a launch through
     * one fails with CUDA_ERROR_INVALID_HANDLE. One round trip per name, then cached. */
    rgpu_fn *fn = rgpu_fn_find_name(session, (uint64_t)(uintptr_t)hmod, name);
    if (fn) {
        *hfunc = (CUfunction)(uintptr_t)fn->handle;
        return CUDA_SUCCESS;
    }
    rgpu_call c;
    r = rgpu_begin_session(&c, RGPU_OP_cuModuleGetFunction, session);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)hmod);
    rgpu_put_str(&c, name);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) {
        uint64_t handle = rgpu_get_u64(&c);
        rgpu_fn *fn = read_one_function(&c, handle, (uint64_t)(uintptr_t)hmod);
        if (fn) rgpu_fn_set_looked_up(fn);
        *hfunc = (CUfunction)(uintptr_t)handle;
    }
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuFuncGetName(const char **name, CUfunction hfunc) {
    if (!name || !hfunc) return CUDA_ERROR_INVALID_VALUE;
    rgpu_fn *fn;
    CUresult r = function_info((uint64_t)(uintptr_t)hfunc, &fn);
    if (r == CUDA_SUCCESS) *name = fn->name;
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuKernelGetName(const char **name, CUkernel hfunc) {
    return cuFuncGetName(name, (CUfunction)hfunc);
}

RGPU_EXPORT CUresult CUDAAPI cuFuncGetParamInfo(CUfunction func, size_t paramIndex, size_t *paramOffset,
                                                size_t *paramSize) {
    if (!func) return CUDA_ERROR_INVALID_VALUE;
    rgpu_fn *fn;
    CUresult r = function_info((uint64_t)(uintptr_t)func, &fn);
    if (r != CUDA_SUCCESS) return r;
    if (paramIndex >= fn->nparams) return CUDA_ERROR_INVALID_VALUE;
    if (paramOffset) *paramOffset = fn->offsets[paramIndex];
    if (paramSize) *paramSize = fn->sizes[paramIndex];
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuKernelGetParamInfo(CUkernel kernel, size_t paramIndex, size_t *paramOffset,
                                                  size_t *paramSize) {
    return cuFuncGetParamInfo((CUfunction)kernel, paramIndex, paramOffset, paramSize);
}

/* ------------------------------------------------------------------ the linker */

typedef struct rgpu_link {
    uint32_t magic;
    int session;
    uint64_t remote;
    char *info, *error;          /* the caller's log buffers from cuLinkCreate */
    size_t info_cap, error_cap;
    void *cubin;
} rgpu_link;
#define RGPU_LINK_MAGIC 0x4c494e4bu

static void link_logs(rgpu_call *c, rgpu_link *l) {
    for (int which = 0; which < 2; which++) {
        uint32_t len = rgpu_get_u32(c);
        if (c->roff + len > c->rlen) len = 0;
        const uint8_t *text = c->rp + c->roff;
        if (which == 0) copy_log(l->info, l->info_cap, text, len);
        else copy_log(l->error, l->error_cap, text, len);
        c->roff += len;
    }
}

RGPU_EXPORT CUresult CUDAAPI cuLinkCreate_v2(unsigned int numOptions, CUjit_option *options, void **optionValues,
                                             CUlinkState *stateOut) {
    if (!stateOut) return CUDA_ERROR_INVALID_VALUE;
    rgpu_link *l = calloc(1, sizeof *l);
    if (!l) return CUDA_ERROR_OUT_OF_MEMORY;
    l->magic = RGPU_LINK_MAGIC;
    for (unsigned int i = 0; i < numOptions && options && optionValues; i++) {
        if (options[i] == CU_JIT_INFO_LOG_BUFFER) l->info = optionValues[i];
        if (options[i] == CU_JIT_ERROR_LOG_BUFFER) l->error = optionValues[i];
        if (options[i] == CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES) l->info_cap = (size_t)(uintptr_t)optionValues[i];
        if (options[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES) l->error_cap = (size_t)(uintptr_t)optionValues[i];
    }
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_cuLinkCreate_v2);
    if (r != CUDA_SUCCESS) {
        free(l);
        return r;
    }
    jit_plan plan;
    put_jit_options(&c, &plan, numOptions, options, optionValues);
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) {
        l->remote = rgpu_get_u64(&c);
        l->session = c.s->index;
        *stateOut = (CUlinkState)l;
    } else {
        free(l);
    }
    rgpu_end(&c);
    return r;
}

static rgpu_link *link_of(CUlinkState state) {
    rgpu_link *l = (rgpu_link *)state;
    return (l && l->magic == RGPU_LINK_MAGIC) ? l : NULL;
}

static CUresult link_add(rgpu_link *l, CUjitInputType type, const void *data, size_t size, const char *name,
                         unsigned int numOptions, CUjit_option *options, void **optionValues) {
    rgpu_call c;
    CUresult r = rgpu_begin_session(&c, RGPU_OP_cuLinkAddData_v2, l->session);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, l->remote);
    rgpu_put_i32(&c, type);
    rgpu_put_str(&c, name ? name : "");
    jit_plan plan;
    put_jit_options(&c, &plan, numOptions, options, optionValues);
    rgpu_put_u64(&c, size);
    r = rgpu_put_bulk(&c, data, size);
    if (r != CUDA_SUCCESS) {
        rgpu_end(&c);
        return r;
    }
    r = rgpu_sync(&c);
    if (rgpu_remaining(&c) >= 8) link_logs(&c, l);
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuLinkAddData_v2(CUlinkState state, CUjitInputType type, void *data, size_t size,
                                              const char *name, unsigned int numOptions, CUjit_option *options,
                                              void **optionValues) {
    rgpu_link *l = link_of(state);
    if (!l || !data) return CUDA_ERROR_INVALID_VALUE;
    if (type == CU_JIT_INPUT_PTX && size == 0) size = strlen(data) + 1;
    return link_add(l, type, data, size, name, numOptions, options, optionValues);
}

RGPU_EXPORT CUresult CUDAAPI cuLinkAddFile_v2(CUlinkState state, CUjitInputType type, const char *path,
                                              unsigned int numOptions, CUjit_option *options, void **optionValues) {
    rgpu_link *l = link_of(state);
    if (!l || !path) return CUDA_ERROR_INVALID_VALUE;
    size_t size;
    void *data = read_file(path, &size); /* the file is on this node */
    if (!data) return CUDA_ERROR_FILE_NOT_FOUND;
    if (type != CU_JIT_INPUT_PTX) size -= 1; /* read_file added a NUL for text */
    CUresult r = link_add(l, type, data, size, path, numOptions, options, optionValues);
    free(data);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuLinkComplete(CUlinkState state, void **cubinOut, size_t *sizeOut) {
    rgpu_link *l = link_of(state);
    if (!l || !cubinOut || !sizeOut) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin_session(&c, RGPU_OP_cuLinkComplete, l->session);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, l->remote);
    r = rgpu_sync(&c);
    if (rgpu_remaining(&c) >= 8) link_logs(&c, l);
    if (r == CUDA_SUCCESS) {
        uint64_t n = rgpu_get_u64(&c);
        if (n > rgpu_remaining(&c)) {
            r = CUDA_ERROR_UNKNOWN;
        } else {
            free(l->cubin);
            l->cubin = malloc(n ? n : 1); /* valid until cuLinkDestroy, as with CUDA */
            if (!l->cubin) r = CUDA_ERROR_OUT_OF_MEMORY;
            else {
                rgpu_get(&c, l->cubin, n);
                *cubinOut = l->cubin;
                *sizeOut = n;
            }
        }
    }
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuLinkDestroy(CUlinkState state) {
    rgpu_link *l = link_of(state);
    if (!l) return CUDA_ERROR_INVALID_HANDLE;
    rgpu_call c;
    CUresult r = rgpu_begin_session(&c, RGPU_OP_cuLinkDestroy, l->session);
    if (r == CUDA_SUCCESS) {
        rgpu_put_u64(&c, l->remote);
        r = rgpu_sync(&c);
        rgpu_end(&c);
    }
    l->magic = 0;
    free(l->cubin);
    free(l);
    return r;
}

/* ------------------------------------------------------------------ launches
 * Parameters are packed here with the layout the worker's driver reported, so the worker
 * launches with one buffer (CU_LAUNCH_PARAM_BUFFER_POINTER) and never looks inside it. */

/* Where a launch's arguments come from: the caller's packed `extra` buffer (buf, argsize), or
 * kernelParams packed with the function's cached layout (fn). */
typedef struct launch_args { const void *buf; size_t argsize; rgpu_fn *fn; } launch_args;

static CUresult resolve_args(CUfunction f, void **params, void **extra, launch_args *a) {
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    if (params && extra) {
        rgpu_log(RGPU_LOG_DEBUG, "a launch refused: both kernelParams and extra given");
        return CUDA_ERROR_INVALID_VALUE;
    }
    a->buf = NULL;
    a->argsize = 0;
    a->fn = NULL;
    if (extra) {
        for (size_t i = 0; extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
            if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) a->buf = extra[i + 1];
            else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE) a->argsize = *(size_t *)extra[i + 1];
            else {
                rgpu_log(RGPU_LOG_DEBUG, "a launch refused: unknown key %p in extra",
                         extra[i]);
                return CUDA_ERROR_INVALID_VALUE;
            }
        }
        return CUDA_SUCCESS;
    }
    CUresult r = function_info((uint64_t)(uintptr_t)f, &a->fn);
    if (r != CUDA_SUCCESS) {
        rgpu_log(RGPU_LOG_DEBUG, "a launch refused: the parameter layout of function %p: error %d",
                 (void *)f, (int)r);
        return r;
    }
    if (a->fn->nparams && !params) {
        rgpu_log(RGPU_LOG_DEBUG, "a launch of %s refused: no kernelParams for %u parameters",
                 a->fn->name ? a->fn->name : "?", a->fn->nparams);
        return CUDA_ERROR_INVALID_VALUE;
    }
    a->argsize = a->fn->argsize;
    return CUDA_SUCCESS;
}

/* Fill out[0..argsize) (zeroed by the caller) with the arguments. */
static void pack_args(const launch_args *a, void **params, uint8_t *out) {
    if (a->buf) {
        memcpy(out, a->buf, a->argsize);
        return;
    }
    for (uint32_t i = 0; a->fn && i < a->fn->nparams; i++) memcpy(out + a->fn->offsets[i], params[i], a->fn->sizes[i]);
}

/* A kernel handed a pointer into this process's page-locked memory reads or writes host memory
 * through UVA (zero-copy, or a flag the host sets while the kernel spins). Memory from
 * cuMemHostAlloc/cuMemAllocHost lies where the worker can back it with device memory at the same
 * address (zero_copy.c): it is backed now, and its bytes move at the launch and the next
 * synchronisation. Other page-locked memory (cudaHostRegister) would fault on the GPU node (under
 * MPS ending every session on that GPU): the launch is refused before it leaves, naming the
 * argument. */
static CUresult host_pointers_for_gpu(const char *call, const char *kernel, const void *args, size_t n) {
    rgpu_managed_hand_args(args, n);   /* memory backed by an earlier launch: its bytes go with this one */
    for (;;) {
        uint64_t value = 0;
        long off = rgpu_args_host_pointer(args, n, &value);
        if (off < 0) return CUDA_SUCCESS;
        int found = 0;
        char why[320];
        snprintf(why, sizeof why, "kernel %.200s was handed it, argument byte %ld", kernel ? kernel : "?", off);
        CUresult r = rgpu_zero_copy_promote(value, &found, why);
        if (found && r != CUDA_SUCCESS) return r;
        if (found) continue;   /* backed: no longer plain host memory */
        rgpu_log(1, "%s: kernel %.200s's argument at byte %ld is a pointer into page-locked host memory "
                    "(0x%llx; rgpu places cudaHostAlloc's memory where the GPU can use it unless RGPU_ZERO_COPY=0, never cudaHostRegister's); "
                    "a GPU across the network cannot read this process's memory there: copy the data to device memory",
                 call, kernel ? kernel : "?", off, (unsigned long long)value);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
}

static CUresult launch(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                       unsigned int by, unsigned int bz, unsigned int shmem, CUstream stream, void **params,
                       void **extra, const CUlaunchAttribute *attrs, unsigned int nattrs, int cooperative) {
    f = rgpu_fn_remote(f);
    launch_args a;
    CUresult r = resolve_args(f, params, extra, &a);
    if (r != CUDA_SUCCESS) return r;
    /* The arguments are packed (and page-locked memory among them backed on the GPU) before the
     * call begins: backing it makes calls of its own. */
    uint8_t packed[4096];  /* the common case: no allocation on the launch path */
    uint8_t *heap = NULL;
    const void *args = a.buf;
    if (!args && a.argsize) {
        uint8_t *p = a.argsize <= sizeof packed ? packed : (heap = malloc(a.argsize));
        if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
        memset(p, 0, a.argsize);
        pack_args(&a, params, p);
        args = p;
    }
    if (a.argsize) r = host_pointers_for_gpu("cuLaunchKernel", a.fn ? a.fn->name : NULL, args, a.argsize);
    rgpu_call c;
    if (r == CUDA_SUCCESS) r = rgpu_begin(&c, RGPU_OP_cuLaunchKernel);
    if (r != CUDA_SUCCESS) {
        free(heap);
        return r;
    }
    uint32_t head[12] = {gx, gy, gz, bx, by, bz, shmem, (uint32_t)cooperative, nattrs, (uint32_t)a.argsize, 0, 0};
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)f);
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)stream);
    rgpu_put(&c, head, sizeof head);
    if (nattrs) rgpu_put(&c, attrs, nattrs * sizeof(CUlaunchAttribute));
    if (a.argsize) rgpu_put(&c, args, a.argsize);
    free(heap);
    r = rgpu_async(&c);
    if (r == CUDA_SUCCESS) rgpu_managed_handed_on(stream);   /* page-locked memory handed to it: numbered now */
    return r;
}

/* A kernel's arguments packed as a launch packs them (graph kernel nodes): a malloc'd buffer. */
CUresult rgpu_kernel_args(CUfunction f, void **params, void **extra, uint8_t **out, size_t *size) {
    launch_args a;
    CUresult r = resolve_args(f, params, extra, &a);
    if (r != CUDA_SUCCESS) return r;
    uint8_t *p = calloc(1, a.argsize ? a.argsize : 1);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    pack_args(&a, params, p);
    r = host_pointers_for_gpu("a graph's kernel node", a.fn ? a.fn->name : NULL, p, a.argsize);
    if (r != CUDA_SUCCESS) {
        free(p);
        return r;
    }
    *out = p;
    *size = a.argsize;
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                            unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                            unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                            void **kernelParams, void **extra) {
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                  kernelParams, extra, NULL, 0, 0);
}

RGPU_EXPORT CUresult CUDAAPI cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                       unsigned int gridDimZ, unsigned int blockDimX,
                                                       unsigned int blockDimY, unsigned int blockDimZ,
                                                       unsigned int sharedMemBytes, CUstream hStream,
                                                       void **kernelParams) {
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                  kernelParams, NULL, NULL, 0, 1);
}

RGPU_EXPORT CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                              void **extra) {
    if (!config) return CUDA_ERROR_INVALID_VALUE;
    if (config->numAttrs && !config->attrs) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                  config->blockDimZ, config->sharedMemBytes, config->hStream, kernelParams, extra, config->attrs,
                  config->numAttrs, 0);
}

/* ------------------------------------------------------------------ occupancy */

static CUresult potential_block_size(int *minGridSize, int *blockSize, CUfunction func, CUoccupancyB2DSize cb,
                                     size_t dynamicSMemSize, int blockSizeLimit, unsigned int flags) {
    if (!minGridSize || !blockSize) return CUDA_ERROR_INVALID_VALUE;
    if (!cb) {
        if (rgpu_occ_potential_get(func, dynamicSMemSize, blockSizeLimit, flags, minGridSize, blockSize))
            return CUDA_SUCCESS;
        rgpu_call c;
        CUresult r = rgpu_begin(&c, RGPU_OP_rgpuOccupancyMaxPotentialBlockSize);
        if (r != CUDA_SUCCESS) return r;
        rgpu_put_u64(&c, (uint64_t)(uintptr_t)rgpu_fn_remote(func));
        rgpu_put_u64(&c, dynamicSMemSize);
        rgpu_put_i32(&c, blockSizeLimit);
        rgpu_put_u32(&c, flags);
        r = rgpu_sync(&c);
        if (r == CUDA_SUCCESS) {
            *minGridSize = rgpu_get_i32(&c);
            *blockSize = rgpu_get_i32(&c);
            rgpu_occ_potential_put(func, dynamicSMemSize, blockSizeLimit, flags, *minGridSize, *blockSize);
        }
        rgpu_end(&c);
        return r;
    }
    /* The callback lives in this process: search the block sizes here, asking the worker
     * for the occupancy of each candidate. */
    int max_threads = 0, sms = 0;
    CUresult r = cuFuncGetAttribute(&max_threads, 0 /* MAX_THREADS_PER_BLOCK */, func);
    if (r != CUDA_SUCCESS) return r;
    rgpu_ctx *cur = rgpu_ctx_current();
    r = cuDeviceGetAttribute(&sms, 16 /* MULTIPROCESSOR_COUNT */, cur ? cur->session : 0);
    if (r != CUDA_SUCCESS) return r;
    int limit = blockSizeLimit > 0 && blockSizeLimit < max_threads ? blockSizeLimit : max_threads;
    int best_bs = 0, best_occ = -1, best_blocks = 0;
    for (int bs = limit - limit % 32; bs > 0; bs -= 32) {
        int blocks = 0;
        r = cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&blocks, func, bs, cb(bs), flags);
        if (r != CUDA_SUCCESS) return r;
        if (blocks * bs > best_occ) {
            best_occ = blocks * bs;
            best_bs = bs;
            best_blocks = blocks;
        }
    }
    *blockSize = best_bs;
    *minGridSize = best_blocks * sms;
    return CUDA_SUCCESS;
}

/* The launch configuration and its attributes (cluster dimensions) travel as launches carry them. */
RGPU_EXPORT CUresult CUDAAPI cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func, const CUlaunchConfig *config) {
    if (!numClusters || !config || (config->numAttrs && !config->attrs)) return CUDA_ERROR_INVALID_VALUE;
    rgpu_call c;
    CUresult r = rgpu_begin(&c, RGPU_OP_cuOccupancyMaxActiveClusters);
    if (r != CUDA_SUCCESS) return r;
    uint32_t head[8] = {config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                        config->blockDimZ, config->sharedMemBytes, config->numAttrs};
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)rgpu_fn_remote(func));
    rgpu_put_u64(&c, (uint64_t)(uintptr_t)config->hStream);
    rgpu_put(&c, head, sizeof head);
    if (config->numAttrs) rgpu_put(&c, config->attrs, config->numAttrs * sizeof(CUlaunchAttribute));
    r = rgpu_sync(&c);
    if (r == CUDA_SUCCESS) *numClusters = rgpu_get_i32(&c);
    rgpu_end(&c);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction func,
                                                              CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                              size_t dynamicSMemSize, int blockSizeLimit) {
    return potential_block_size(minGridSize, blockSize, func, blockSizeToDynamicSMemSize, dynamicSMemSize,
                                blockSizeLimit, 0);
}

RGPU_EXPORT CUresult CUDAAPI cuOccupancyMaxPotentialBlockSizeWithFlags(int *minGridSize, int *blockSize,
                                                                       CUfunction func,
                                                                       CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                                       size_t dynamicSMemSize, int blockSizeLimit,
                                                                       unsigned int flags) {
    return potential_block_size(minGridSize, blockSize, func, blockSizeToDynamicSMemSize, dynamicSMemSize,
                                blockSizeLimit, flags);
}

/* ------------------------------------------------------------------ misc
 * Host callbacks (cuLaunchHostFunc, cuStreamAddCallback) and host nodes: host_nodes.c. */

RGPU_EXPORT CUresult CUDAAPI cuModuleGetLoadingMode(CUmoduleLoadingMode *mode) {
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    *mode = CU_MODULE_LAZY_LOADING;
    return CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId) {
    if (!dev || !pciBusId) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = rgpu_check_init();
    if (r != CUDA_SUCCESS) return r;
    for (int i = 0; i < rgpu_session_count; i++) {
        char id[64];
        if (cuDeviceGetPCIBusId(id, sizeof id, i) == CUDA_SUCCESS && !strcasecmp(id, pciBusId)) {
            *dev = i;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

static CUresult unload(uint16_t op, int session_or_current, uint64_t handle) {
    rgpu_call c;
    CUresult r = session_or_current < 0 ? rgpu_begin(&c, op) : rgpu_begin_session(&c, op, session_or_current);
    if (r != CUDA_SUCCESS) return r;
    int session = c.s->index;
    rgpu_put_u64(&c, handle);
    r = rgpu_sync(&c);
    rgpu_end(&c);
    if (r == CUDA_SUCCESS) rgpu_fn_forget_module(session, handle);
    rgpu_cache_forget_functions();
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuModuleUnload(CUmodule hmod) {
    return unload(RGPU_OP_cuModuleUnload, -1, (uint64_t)(uintptr_t)hmod);
}

RGPU_EXPORT CUresult CUDAAPI cuLibraryUnload(CUlibrary library) {
    if (rgpu_session_count > 1) return rgpu_library_unload((uint64_t)(uintptr_t)library);
    return unload(RGPU_OP_cuLibraryUnload, -1, (uint64_t)(uintptr_t)library);
}

CUresult rgpu_library_unload_on(int session, uint64_t library) {
    return unload(RGPU_OP_cuLibraryUnload, session, library);
}
