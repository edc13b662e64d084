/* GPU kernels for the client side: casts, multi-tensor unscale + inf/NaN check + norm, flatten. */
#ifndef ZK_CUDA_H
#define ZK_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Every function enqueues work on `stream` and returns without waiting: 0, or
 * a negative errno when the arguments are bad or the launch failed (a fault
 * inside a kernel shows up later, at the next synchronisation).  Pointers are
 * device pointers unless said otherwise; arrays of pointers and sizes are host
 * arrays, read before the call returns.
 *
 * Conversions agree bit for bit with the CPU reference (zk_f32_to_bf16,
 * zk_f32_to_f16 and back, NaN payloads included), so a tensor cast on the GPU
 * equals the same tensor cast by zoffloadd.
 */

/* Statistics the unscale pass accumulates; device memory, zeroed by the caller. */
struct zkc_grad_stats {
	double sumsq;			/* sum of squares of the unscaled gradients */
	unsigned long long nonfinite;	/* elements that are inf or NaN after unscaling */
};

/* Maps a CUDA error to a negative errno (0 for cudaSuccess). */
int zkc_errno(cudaError_t err);

/* dst[i] = src[i] converted from `from` to `to`, n elements; src == dst only when sizes match. */
int zkc_cast(const void *src, enum zk_dtype from, void *dst, enum zk_dtype to, uint64_t n,
    cudaStream_t stream);

/*
 * For each of n tensors of one dtype: g = g * inv_scale (as zk_grad_check
 * computes it: the float product), counted into stats->nonfinite when inf or
 * NaN, its square added (in double) into stats->sumsq; with write_back the
 * unscaled value is stored back in place.  Any n: long lists take several
 * launches.  Matches zk_grad_check up to the order of the double additions.
 */
int zkc_unscale_norm(void *const *grads, const uint64_t *numel, size_t n, enum zk_dtype dtype,
    float inv_scale, bool write_back, struct zkc_grad_stats *stats, cudaStream_t stream);

/*
 * flatten: the n tensors (elem_size bytes per element: 2 or 4) one after the
 * other into flat, in list order, no gaps; unflatten: the way back.  The flat
 * buffer holds at least the sum of numel elements.
 */
int zkc_flatten(void *flat, const void *const *srcs, const uint64_t *numel, size_t n,
    size_t elem_size, cudaStream_t stream);
int zkc_unflatten(const void *flat, void *const *dsts, const uint64_t *numel, size_t n,
    size_t elem_size, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
