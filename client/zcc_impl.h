/* Internal to libzclient_cuda: the per-thread error message and CUDA/NCCL result mapping. */
#ifndef ZCC_IMPL_H
#define ZCC_IMPL_H

#include "zclient_cuda.h"

/* Sets this thread's message and returns err (a negative errno). */
int zcc__fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* 0 for success; otherwise the message says "what: <name>: <text>" and -errno comes back. */
int zcc__cuda(cudaError_t e, const char *what);
int zcc__nccl(ncclResult_t res, ncclComm_t comm, const char *what);
/* Element size of a zc_dtype, 0 for an unknown one. */
size_t zcc__dtype_size(enum zc_dtype dtype);

#endif
