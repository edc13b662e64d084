/* Test-only stand-in for NCCL: the collectives zoffload uses, across the processes of one test. */
#ifndef ZS_NCCL_H
#define ZS_NCCL_H

#include <stddef.h>

#include "cuda_runtime_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Ranks are processes (or threads) of one machine meeting in a shared memory
 * segment that ncclGetUniqueId creates and names in the id.  Collectives are
 * queued on the stream like any other work and run, in stream order, when a
 * synchronisation reaches them; each then waits for every rank's matching
 * call, and the stand-in aborts when the ranks disagree on the operation,
 * count, datatype or reduction (real NCCL would hang or corrupt).
 */
typedef enum {
	ncclSuccess = 0,
	ncclUnhandledCudaError = 1,
	ncclSystemError = 2,
	ncclInternalError = 3,
	ncclInvalidArgument = 4,
	ncclInvalidUsage = 5,
	ncclRemoteError = 6,
	ncclInProgress = 7,
} ncclResult_t;

typedef enum {
	ncclInt8 = 0, ncclChar = 0,
	ncclUint8 = 1,
	ncclInt32 = 2, ncclInt = 2,
	ncclUint32 = 3,
	ncclInt64 = 4,
	ncclUint64 = 5,
	ncclFloat16 = 6, ncclHalf = 6,
	ncclFloat32 = 7, ncclFloat = 7,
	ncclFloat64 = 8, ncclDouble = 8,
	ncclBfloat16 = 9,
	ncclNumTypes = 10,
} ncclDataType_t;

typedef enum {
	ncclSum = 0,
	ncclProd = 1,
	ncclMax = 2,
	ncclMin = 3,
	ncclAvg = 4,
	ncclNumOps = 5,
} ncclRedOp_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
	char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef struct ncclComm *ncclComm_t;

const char *ncclGetErrorString(ncclResult_t result);
const char *ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank);
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
    ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
    ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
    ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
