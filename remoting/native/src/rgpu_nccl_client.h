/* libnccl.so.2 internals: communicators as client objects, and the calls the generated stubs
 * (generated/nccl_gen.c) make, carried by libcuda.so.1's sessions (rgpu_nccl_bridge.h). */
#ifndef RGPU_NCCL_CLIENT_H
#define RGPU_NCCL_CLIENT_H

#include "rgpu_client.h"
#include "rgpu_nccl.h"

#define RGPU_NCCL_COMM_MAGIC 0x6e63636cu   /* "nccl" */

struct ncclComm {
    uint32_t magic;
    int session;        /* the slice (CUDA device ordinal) whose worker holds the communicator */
    uint64_t remote;    /* the worker's communicator */
    int rank, nranks;
    int ready;          /* rgpuNcclCommReady answered ncclSuccess */
    int blocking;       /* 0: ncclCommInitRankConfig/ncclCommSplit answered ncclInProgress (config->blocking = 0) */
    ncclComm_t *out;    /* a split's caller's pointer: NULL is written there when the rank has no color */
};

CUresult rgpu_nccl_begin_comm(rgpu_call *c, uint16_t op, ncclComm_t comm);
CUresult rgpu_nccl_begin_current(rgpu_call *c, uint16_t op);
uint64_t rgpu_nccl_remote(ncclComm_t comm);
ncclResult_t rgpu_nccl_not_sent(const char *call, CUresult r);
ncclResult_t rgpu_nccl_reply(CUresult r);
ncclResult_t rgpu_nccl_invalid(const char *call, const char *why);
ncclResult_t rgpu_nccl_unsupported(const char *call, int *seen);

/* The generated communicator operations (nccl.spec). */
ncclResult_t rgpuNcclGetUniqueId(ncclUniqueId *uniqueId, CUdevice dev);
ncclResult_t rgpuNcclCommJoin(unsigned long long *remote, const ncclUniqueId *commId, int nranks, int rank, CUdevice dev);
ncclResult_t rgpuNcclCommReady(ncclComm_t comm, int *rank, int *nranks);
ncclResult_t rgpuNcclCommSplit(unsigned long long *remote, ncclComm_t comm, int color, int key);
ncclResult_t rgpuNcclCommShrink(unsigned long long *remote, ncclComm_t comm, const int *excludeRanks, int count, int flags);
ncclResult_t rgpuNcclCommJoinScalable(unsigned long long *remote, const ncclUniqueId *commIds, int nId, int nranks, int rank,
                                      CUdevice dev);
ncclResult_t rgpuNcclRedOpCreatePreMulSum(int *op, unsigned long long scalar, ncclDataType_t datatype, int residence,
                                          ncclComm_t comm);
ncclResult_t rgpuNcclCommDestroy(ncclComm_t comm, int abort);
ncclResult_t rgpuNcclCommGetAsyncError(ncclComm_t comm, int *asyncError);
ncclResult_t rgpuNcclGroupStart(CUdevice dev);
ncclResult_t rgpuNcclGroupEnd(CUdevice dev);

#endif
