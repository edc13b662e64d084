/* Test-only stand-in: cuda_runtime.h is the runtime API here (kernels come from zs_kernel.h). */
#ifndef ZS_CUDA_RUNTIME_H
#define ZS_CUDA_RUNTIME_H

#include "cuda_runtime_api.h"

#endif
