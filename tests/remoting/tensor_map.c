/* Tensor maps through rgpu (cuTensorMapEncodeTiled, EncodeIm2col, EncodeIm2colWide, ReplaceAddress):
 * the worker's driver encodes, the 128 bytes come back.
 *
 *   tensor_map encode    identical encodes give identical bytes, others differ; re-addressing and back
 *   tensor_map hostile   what CUDA refuses: in the client (rank, NULL arrays, alignment) or the driver
 *
 * Prints "OK <check>" or "FAIL <check> ..." and exits with the number of failures. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver_checks.h"

#define ROWS 256
#define COLS 256

static const cuuint64_t dims[2] = {COLS, ROWS};
static const cuuint64_t strides[1] = {COLS * 4};
static const cuuint32_t box[2] = {64, 32}, box_other[2] = {32, 32}, ones[5] = {1, 1, 1, 1, 1};

static CUresult tiled(CUtensorMap *map, cuuint32_t rank, CUdeviceptr at, const cuuint64_t *d, const cuuint64_t *s,
                      const cuuint32_t *b, const cuuint32_t *e) {
    return cuTensorMapEncodeTiled(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, rank, (void *)at, d, s, b, e,
                                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                  CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

static void encode(CUdeviceptr buf) {
    CUtensorMap a, b, c, d;
    CHECK("cuTensorMapEncodeTiled", tiled(&a, 2, buf, dims, strides, box, ones));
    CHECK("the same encode again", tiled(&b, 2, buf, dims, strides, box, ones));
    CHECK("identical encodes give identical bytes", memcmp(&a, &b, sizeof a) ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS);
    CHECK("another box", tiled(&c, 2, buf, dims, strides, box_other, ones));
    CHECK("another box gives other bytes", memcmp(&a, &c, sizeof a) ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN);
    d = a;
    CHECK("cuTensorMapReplaceAddress", cuTensorMapReplaceAddress(&d, (void *)(buf + ROWS * COLS * 2)));
    CHECK("a new address gives other bytes", memcmp(&a, &d, sizeof a) ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN);
    CHECK("cuTensorMapReplaceAddress back", cuTensorMapReplaceAddress(&d, (void *)buf));
    CHECK("back at the first address: the first bytes", memcmp(&a, &d, sizeof a) ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS);
    const unsigned char *raw = (const unsigned char *)&a;
    printf("MAP ");
    for (int i = 0; i < 16; i++) printf("%02x", raw[i]);
    printf("\n");
}

static void hostile(CUdeviceptr buf) {
    CUtensorMap map;
    _Alignas(64) unsigned char space[sizeof(CUtensorMap) + 64];
    WANT("rank 0", CUDA_ERROR_INVALID_VALUE, tiled(&map, 0, buf, dims, strides, box, ones));
    WANT("rank 6", CUDA_ERROR_INVALID_VALUE, tiled(&map, 6, buf, dims, strides, box, ones));
    WANT("rank 2^32-1", CUDA_ERROR_INVALID_VALUE, tiled(&map, 0xFFFFFFFFu, buf, dims, strides, box, ones));
    WANT("no map", CUDA_ERROR_INVALID_VALUE, tiled(NULL, 2, buf, dims, strides, box, ones));
    WANT("a map not 64-byte aligned", CUDA_ERROR_INVALID_VALUE,
         tiled((CUtensorMap *)(space + 8), 2, buf, dims, strides, box, ones));
    WANT("no dimensions", CUDA_ERROR_INVALID_VALUE, tiled(&map, 2, buf, NULL, strides, box, ones));
    WANT("no strides at rank 2", CUDA_ERROR_INVALID_VALUE, tiled(&map, 2, buf, dims, NULL, box, ones));
    WANT("no box", CUDA_ERROR_INVALID_VALUE, tiled(&map, 2, buf, dims, strides, NULL, ones));
    WANT("no element strides", CUDA_ERROR_INVALID_VALUE, tiled(&map, 2, buf, dims, strides, box, NULL));
    WANT("cuTensorMapReplaceAddress of no map", CUDA_ERROR_INVALID_VALUE, cuTensorMapReplaceAddress(NULL, (void *)buf));
    /* what the driver checks */
    static const cuuint32_t big_box[2] = {512, 32};
    static const cuuint64_t odd_strides[1] = {COLS * 4 + 4};
    WANT("a box of 512", CUDA_ERROR_INVALID_VALUE, tiled(&map, 2, buf, dims, strides, big_box, ones));
    WANT("a stride not a multiple of 16", CUDA_ERROR_INVALID_VALUE, tiled(&map, 2, buf, dims, odd_strides, box, ones));
    WANT("an address not 16-byte aligned", CUDA_ERROR_INVALID_VALUE, tiled(&map, 2, buf + 4, dims, strides, box, ones));
    CHECK("rank 1 needs no strides", tiled(&map, 1, buf, dims, NULL, box, ones));
    /* im2col: an NHWC half tensor, 3x3 windows */
    static const cuuint64_t nhwc[4] = {64, 16, 16, 2};
    static const cuuint64_t nhwc_strides[3] = {64 * 2, 16 * 64 * 2, 16 * 16 * 64 * 2};
    static const int lower[2] = {-1, -1}, upper[2] = {-1, -1};
    CHECK("cuTensorMapEncodeIm2col",
          cuTensorMapEncodeIm2col(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, (void *)buf, nhwc, nhwc_strides, lower, upper,
                                  64, 128, ones, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                  CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    WANT("im2col at rank 2", CUDA_ERROR_INVALID_VALUE,
         cuTensorMapEncodeIm2col(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, (void *)buf, nhwc, nhwc_strides, lower, upper,
                                 64, 128, ones, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                 CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    WANT("im2col without corners", CUDA_ERROR_INVALID_VALUE,
         cuTensorMapEncodeIm2col(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, (void *)buf, nhwc, nhwc_strides, NULL, upper,
                                 64, 128, ones, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                 CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    CHECK("cuTensorMapEncodeIm2colWide",
          cuTensorMapEncodeIm2colWide(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, (void *)buf, nhwc, nhwc_strides, -1, -1,
                                      64, 128, ones, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_IM2COL_WIDE_MODE_W,
                                      CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s encode | hostile\n", argv[0]);
        return 2;
    }
    CUdeviceptr buf;
    primary_context();
    CHECK("cuMemAlloc", cuMemAlloc(&buf, ROWS * COLS * 4 * 2));
    if (!strcmp(argv[1], "encode")) encode(buf);
    else if (!strcmp(argv[1], "hostile")) hostile(buf);
    else return 2;
    printf("DONE %d failure(s)\n", failures);
    return failures;
}
