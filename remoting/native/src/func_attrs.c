/* cuFuncSetAttribute and cuKernelSetAttribute without a round trip (issue 24). PyTorch, cuDNN and
 * flash-attention set a kernel's maximum dynamic shared memory before its launches, with values
 * that change from launch to launch: 48 round trips per GPT-2 training step on an H100. The
 * attributes whose checks need only facts the client keeps (the device's opt-in shared memory, the
 * kernel's static shared memory) are checked here as the driver checks them, so a bad value gets
 * CUDA's error at once and nothing is sent; a good one travels pipelined (rgpuSetAttribute), ahead
 * of the launches that follow it, and the kept answers take it at once. Attributes the client
 * cannot check (cluster sizes, scheduling policy, numbers this library does not know) travel
 * synchronously as before. A value the worker's driver refuses all the same answers the next
 * synchronising call of that slice, as the errors of other pipelined calls do. */
#include "rgpu_client.h"
#include "cuda_protos.h"

enum {
    ATTR_SHARED_SIZE_BYTES = 1,          /* CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: static, per kernel */
    ATTR_MAX_DYNAMIC_SHARED = 8,         /* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES */
    ATTR_CARVEOUT = 9,                   /* CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT */
    DEV_MAX_SHARED_PER_BLOCK_OPTIN = 97, /* CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
};

/* 1 when the client answers the set itself (attrib is one it checks), 0 when the driver must. */
static int checked_here(int attrib) { return attrib >= 0 && attrib <= ATTR_CARVEOUT; }

/* The driver's checks: the attributes below MAX_DYNAMIC_SHARED are read-only; the dynamic shared
 * memory and the kernel's static shared memory together fit the device's opt-in limit; the carveout
 * is a percentage or -1 (CU_SHAREDMEM_CARVEOUT_DEFAULT). */
static CUresult check(int attrib, int value, int static_shared, int optin) {
    if (attrib == ATTR_MAX_DYNAMIC_SHARED)
        return value >= 0 && (long long)value + static_shared <= optin ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (attrib == ATTR_CARVEOUT) return value >= -1 && value <= 100 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    return CUDA_ERROR_INVALID_VALUE;
}

/* The set, pipelined: u32 attrib, i32 value, u64 handle (the worker's), u32 is_kernel. */
static CUresult send_set(rgpu_call *c, int attrib, int value, uint64_t handle, int is_kernel) {
    rgpu_put_i32(c, attrib);
    rgpu_put_i32(c, value);
    rgpu_put_u64(c, handle);
    rgpu_put_u32(c, (uint32_t)is_kernel);
    c->s->attr_sets_unconfirmed = 1;
    return rgpu_async(c);
}

int rgpu_func_set_attribute_here(CUfunction f, int attrib, int value, CUresult *result) {
    rgpu_ctx *cur = rgpu_ctx_current();
    if (!checked_here(attrib) || !cur || cur->destroyed) return 0;
    int static_shared = 0, optin = 0, known;
    /* also checks the handle (kept after the first answer) */
    CUresult r = cuFuncGetAttribute(&static_shared, ATTR_SHARED_SIZE_BYTES, f);
    if (r == CUDA_SUCCESS && attrib == ATTR_MAX_DYNAMIC_SHARED)
        r = cuDeviceGetAttribute(&optin, DEV_MAX_SHARED_PER_BLOCK_OPTIN, cur->session);
    if (r == CUDA_SUCCESS) r = check(attrib, value, static_shared, optin);
    if (r != CUDA_SUCCESS || (rgpu_fattr_get(f, attrib, &known) && known == value)) {
        *result = r;
        return 1;
    }
    rgpu_call c;
    r = rgpu_begin(&c, RGPU_OP_rgpuSetAttribute);
    if (r == CUDA_SUCCESS) r = send_set(&c, attrib, value, (uint64_t)(uintptr_t)rgpu_fn_remote(f), 0);
    if (r == CUDA_SUCCESS) rgpu_fattr_set(f, attrib, value);
    *result = r;
    return 1;
}

int rgpu_kernel_set_attribute_here(CUkernel k, int attrib, int value, CUdevice dev, CUresult *result) {
    if (!checked_here(attrib)) return 0;
    int static_shared = 0, optin = 0, known;
    CUresult r = cuKernelGetAttribute(&static_shared, ATTR_SHARED_SIZE_BYTES, k, dev);
    if (r == CUDA_SUCCESS && attrib == ATTR_MAX_DYNAMIC_SHARED)
        r = cuDeviceGetAttribute(&optin, DEV_MAX_SHARED_PER_BLOCK_OPTIN, dev);
    if (r == CUDA_SUCCESS) r = check(attrib, value, static_shared, optin);
    if (r != CUDA_SUCCESS || (rgpu_kattr_get(k, attrib, dev, &known) && known == value)) {
        *result = r;
        return 1;
    }
    rgpu_call c;
    r = rgpu_begin_dev(&c, RGPU_OP_rgpuSetAttribute, dev);
    if (r == CUDA_SUCCESS) r = send_set(&c, attrib, value, rgpu_handle_in(c.s->index, (uint64_t)(uintptr_t)k), 1);
    if (r == CUDA_SUCCESS) rgpu_kattr_set(k, attrib, dev, value);
    *result = r;
    return 1;
}
