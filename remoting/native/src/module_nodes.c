/* The driver's private table 6e163fbe-b958-444d-835c-e182aff1991e, which cuFFT asks for: slot 7
 * walks a module's function nodes and hands each to a callback. cuFFT loads the kernels it builds
 * for a plan as modules and takes their functions this way, not by name.
 *
 * The walk runs on the worker, against the real driver (rgpuModuleNodes). Each node the worker's
 * driver reports becomes a node object here, in this process, because cuFFT reads fields of the
 * node itself: the fields the Lupine project found cuFFT to read (at 0x0, 0x8 (the owner), 0x10,
 * 0x18, 0x28 and 0x370) are copied from the real node, the rest is zero. Such a node is also a
 * CUfunction to cuFFT: every call that sends a function sends the worker's node instead
 * (rgpu_fn_remote, cuda_cache.c). The other slots are answered NOT_SUPPORTED with one warning. */
#include <stdlib.h>
#include <string.h>

#include "rgpu_client.h"

#define NODE_SLOTS 64
#define NODE_BYTES 0x500
#define MAX_NODES 64

typedef struct node_stub { int slot; int seen; } node_stub;

static CUresult CUDAAPI nodes_unknown(node_stub *info) {
    if (!__atomic_exchange_n(&info->seen, 1, __ATOMIC_RELAXED))
        rgpu_log(RGPU_LOG_WARN, "a library called slot %d of the driver's private table 6e163fbe, which rgpu does not "
                 "implement (it returns CUDA_ERROR_NOT_SUPPORTED; please report it with the output of "
                 "`python -m rgpu.remoting.native.trace -- <app>` run on a GPU node)", info->slot);
    return CUDA_ERROR_NOT_SUPPORTED;
}

#define NODE_STUB(n)                                                                     \
    static node_stub nodes_info_##n = {n, 0};                                            \
    static CUresult CUDAAPI nodes_slot_##n(void) { return nodes_unknown(&nodes_info_##n); }

NODE_STUB(1)
NODE_STUB(2)
NODE_STUB(3)
NODE_STUB(4)
NODE_STUB(5)
NODE_STUB(6)
NODE_STUB(7)
NODE_STUB(8)
NODE_STUB(9)
NODE_STUB(10)
NODE_STUB(11)
NODE_STUB(12)
NODE_STUB(13)
NODE_STUB(14)
NODE_STUB(15)
NODE_STUB(16)
NODE_STUB(17)
NODE_STUB(18)
NODE_STUB(19)
NODE_STUB(20)
NODE_STUB(21)
NODE_STUB(22)
NODE_STUB(23)
NODE_STUB(24)
NODE_STUB(25)
NODE_STUB(26)
NODE_STUB(27)
NODE_STUB(28)
NODE_STUB(29)
NODE_STUB(30)
NODE_STUB(31)
NODE_STUB(32)
NODE_STUB(33)
NODE_STUB(34)
NODE_STUB(35)
NODE_STUB(36)
NODE_STUB(37)
NODE_STUB(38)
NODE_STUB(39)
NODE_STUB(40)
NODE_STUB(41)
NODE_STUB(42)
NODE_STUB(43)
NODE_STUB(44)
NODE_STUB(45)
NODE_STUB(46)
NODE_STUB(47)
NODE_STUB(48)
NODE_STUB(49)
NODE_STUB(50)
NODE_STUB(51)
NODE_STUB(52)
NODE_STUB(53)
NODE_STUB(54)
NODE_STUB(55)
NODE_STUB(56)
NODE_STUB(57)
NODE_STUB(58)
NODE_STUB(59)
NODE_STUB(60)
NODE_STUB(61)
NODE_STUB(62)
NODE_STUB(63)

typedef void (*node_callback)(void *opaque, void *node, uint64_t owner);

/* Slot 7: (context, module, callback, opaque, ...) -> how many nodes were handed to callback. */
static uint64_t CUDAAPI module_nodes(uint64_t ctx, uint64_t module, uint64_t callback, uint64_t opaque, uint64_t a4,
                                     uint64_t a5) {
    (void)a4;
    (void)a5;
    rgpu_call c;
    uint64_t ctx_remote = 0;
    if (rgpu_begin_ctx(&c, RGPU_OP_rgpuModuleNodes, (CUcontext)(uintptr_t)ctx, &ctx_remote) != CUDA_SUCCESS) return 0;
    rgpu_put_u64(&c, ctx_remote);
    rgpu_put_u64(&c, module);
    CUresult r = rgpu_sync(&c);
    uint32_t count = r == CUDA_SUCCESS ? rgpu_get_u32(&c) : 0;
    struct { uint64_t node, owner, f0, f10, f18, f28; uint32_t f370, pad; } got[MAX_NODES];
    if (count > MAX_NODES) count = MAX_NODES;
    for (uint32_t i = 0; i < count; i++) rgpu_get(&c, &got[i], sizeof got[i]);
    rgpu_end(&c);
    uint64_t handed = 0;
    for (uint32_t i = 0; i < count; i++) {
        uint8_t *node = calloc(1, NODE_BYTES);   /* lives as long as the process: cuFFT keeps it */
        if (!node) break;
        memcpy(node + 0x0, &got[i].f0, 8);
        memcpy(node + 0x8, &got[i].owner, 8);
        memcpy(node + 0x10, &got[i].f10, 8);
        memcpy(node + 0x18, &got[i].f18, 8);
        memcpy(node + 0x28, &got[i].f28, 8);
        memcpy(node + 0x370, &got[i].f370, 4);
        rgpu_fn_private_put(node, got[i].node);
        if (callback) ((node_callback)(uintptr_t)callback)((void *)(uintptr_t)opaque, node, got[i].owner);
        handed++;
    }
    return handed;
}

static const void *g_nodes[NODE_SLOTS] = {
    (void *)(NODE_SLOTS * sizeof(void *)),
    (void *)nodes_slot_1,
    (void *)nodes_slot_2,
    (void *)nodes_slot_3,
    (void *)nodes_slot_4,
    (void *)nodes_slot_5,
    (void *)nodes_slot_6,
    (void *)nodes_slot_7,
    (void *)nodes_slot_8,
    (void *)nodes_slot_9,
    (void *)nodes_slot_10,
    (void *)nodes_slot_11,
    (void *)nodes_slot_12,
    (void *)nodes_slot_13,
    (void *)nodes_slot_14,
    (void *)nodes_slot_15,
    (void *)nodes_slot_16,
    (void *)nodes_slot_17,
    (void *)nodes_slot_18,
    (void *)nodes_slot_19,
    (void *)nodes_slot_20,
    (void *)nodes_slot_21,
    (void *)nodes_slot_22,
    (void *)nodes_slot_23,
    (void *)nodes_slot_24,
    (void *)nodes_slot_25,
    (void *)nodes_slot_26,
    (void *)nodes_slot_27,
    (void *)nodes_slot_28,
    (void *)nodes_slot_29,
    (void *)nodes_slot_30,
    (void *)nodes_slot_31,
    (void *)nodes_slot_32,
    (void *)nodes_slot_33,
    (void *)nodes_slot_34,
    (void *)nodes_slot_35,
    (void *)nodes_slot_36,
    (void *)nodes_slot_37,
    (void *)nodes_slot_38,
    (void *)nodes_slot_39,
    (void *)nodes_slot_40,
    (void *)nodes_slot_41,
    (void *)nodes_slot_42,
    (void *)nodes_slot_43,
    (void *)nodes_slot_44,
    (void *)nodes_slot_45,
    (void *)nodes_slot_46,
    (void *)nodes_slot_47,
    (void *)nodes_slot_48,
    (void *)nodes_slot_49,
    (void *)nodes_slot_50,
    (void *)nodes_slot_51,
    (void *)nodes_slot_52,
    (void *)nodes_slot_53,
    (void *)nodes_slot_54,
    (void *)nodes_slot_55,
    (void *)nodes_slot_56,
    (void *)nodes_slot_57,
    (void *)nodes_slot_58,
    (void *)nodes_slot_59,
    (void *)nodes_slot_60,
    (void *)nodes_slot_61,
    (void *)nodes_slot_62,
    (void *)nodes_slot_63,
};
static pthread_once_t g_nodes_once = PTHREAD_ONCE_INIT;
static int g_nodes_ready;

/* The table as the worker's driver sizes it (slot 0 is its byte size); NULL when the worker's
 * driver has no such table or has fewer than 8 slots. */
static void make_table(void) {
    rgpu_call c;
    static const uint8_t uuid[16] = {0x6e, 0x16, 0x3f, 0xbe, 0xb9, 0x58, 0x44, 0x4d,
                                     0x83, 0x5c, 0xe1, 0x82, 0xaf, 0xf1, 0x99, 0x1e};
    if (rgpu_begin(&c, RGPU_OP_rgpuPrivateTableSize) != CUDA_SUCCESS) return;
    rgpu_put(&c, uuid, sizeof uuid);
    CUresult r = rgpu_sync(&c);
    uint64_t bytes = r == CUDA_SUCCESS ? rgpu_get_u64(&c) : 0;
    rgpu_end(&c);
    if (bytes <= 7 * sizeof(void *)) return;
    if (bytes > sizeof g_nodes) bytes = sizeof g_nodes;
    g_nodes[0] = (void *)(uintptr_t)(bytes / sizeof(void *) * sizeof(void *));
    g_nodes[7] = (void *)module_nodes;
    g_nodes_ready = 1;
}

const void *rgpu_module_nodes_table(void) {
    if (rgpu_check_init() != CUDA_SUCCESS) return NULL;   /* asked before cuInit: not found */
    pthread_once(&g_nodes_once, make_table);
    return g_nodes_ready ? g_nodes : NULL;
}
