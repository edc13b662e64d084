/* Internal to the CUDA stand-in: what the NCCL half and the kernel executor share with the runtime. */
#ifndef ZS_STANDIN_IMPL_H
#define ZS_STANDIN_IMPL_H

#include <stdbool.h>
#include <stddef.h>

#include "cuda_runtime_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reports misuse on stderr and aborts: the test that caused it fails loudly. */
void zs__die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
/* true when [p, p + len) lies inside one live device allocation. */
bool zs__is_device_range(const void *p, size_t len);
/* The current device of this thread, and a stream's (NULL: the legacy stream of the current). */
int zs__current_device(void);
int zs__stream_device(cudaStream_t s);
/* Runs all queued work of every stream: cudaDeviceSynchronize for all devices. */
void zs__run_all(void);

#ifdef __cplusplus
}
#endif

#endif
