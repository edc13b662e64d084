/* Test-only stand-in: what a .cu file needs to compile as host C++ (force-included, after cu2cc.py). */
#ifndef ZS_KERNEL_H
#define ZS_KERNEL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_runtime_api.h"

/*
 * cu2cc.py rewrites every `kernel<<<grid, block, shmem, stream>>>(args)` into
 * `zs::make_launcher(coop, kernel, grid, block, shmem, stream)(args)`: the
 * arguments are copied at the call, as CUDA copies them, and the launch is
 * queued on the stream like any other work.  When it runs, every thread of
 * every block calls the kernel; blocks are spread over a few host threads.
 * A kernel whose body uses __syncthreads or a warp shuffle (coop) runs each
 * block's threads as fibers on one host thread, switched at those barriers;
 * any other kernel runs its threads one after the other.
 */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
/* One copy per block: a block's fibers share a host thread. */
#define __shared__ static thread_local

struct zs_dim {
	unsigned x, y, z;
};

struct dim3 {
	unsigned x, y, z;
	constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

extern "C" {
/* The running thread's indices, set by the executor before each thread runs. */
struct zs_tls {
	struct zs_dim thread_idx, block_idx, block_dim, grid_dim;
};
extern __thread struct zs_tls zs_tls;

cudaError_t zs_launch(struct zs_dim grid, struct zs_dim block, size_t shmem, cudaStream_t stream,
    int coop, void (*thread_fn)(void *ctx), void *ctx, void (*drop)(void *ctx));
void zs_syncthreads(void);
uint64_t zs_shfl_down(unsigned mask, uint64_t bits, unsigned delta);
}

#define threadIdx (zs_tls.thread_idx)
#define blockIdx (zs_tls.block_idx)
#define blockDim (zs_tls.block_dim)
#define gridDim (zs_tls.grid_dim)

/* Round-to-nearest intrinsics: plain IEEE operations (built with -ffp-contract=off). */
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }

static inline unsigned __float_as_uint(float f)
{
	unsigned u;

	memcpy(&u, &f, sizeof(u));
	return u;
}

static inline float __uint_as_float(unsigned u)
{
	float f;

	memcpy(&f, &u, sizeof(f));
	return f;
}

static inline void __syncthreads(void) { zs_syncthreads(); }

template <class T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta)
{
	static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle type");
	uint64_t bits = 0;

	memcpy(&bits, &v, sizeof(v));
	bits = zs_shfl_down(mask, bits, delta);
	memcpy(&v, &bits, sizeof(v));
	return v;
}

/* Blocks run in parallel on the host: atomics are real atomics. */
static inline double atomicAdd(double *p, double v)
{
	double old, sum;

	__atomic_load(p, &old, __ATOMIC_RELAXED);
	do
		sum = old + v;
	while (!__atomic_compare_exchange(p, &old, &sum, true, __ATOMIC_RELAXED,
	    __ATOMIC_RELAXED));
	return old;
}

static inline float atomicAdd(float *p, float v)
{
	float old, sum;

	__atomic_load(p, &old, __ATOMIC_RELAXED);
	do
		sum = old + v;
	while (!__atomic_compare_exchange(p, &old, &sum, true, __ATOMIC_RELAXED,
	    __ATOMIC_RELAXED));
	return old;
}

static inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v)
{
	return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

static inline unsigned atomicAdd(unsigned *p, unsigned v)
{
	return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

static inline int atomicAdd(int *p, int v)
{
	return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

namespace zs {

static inline zs_dim to_dim(dim3 d)
{
	return zs_dim{ d.x, d.y, d.z };
}

template <class... P>
struct launcher {
	void (*kernel)(P...);
	dim3 grid, block;
	size_t shmem;
	cudaStream_t stream;
	int coop;

	template <class... A>
	void operator()(A &&...args) const
	{
		struct ctx {
			void (*kernel)(P...);
			std::tuple<std::decay_t<P>...> args;
		};
		ctx *c = new ctx{ kernel, std::tuple<std::decay_t<P>...>(
		    static_cast<std::decay_t<P>>(std::forward<A>(args))...) };

		(void)zs_launch(to_dim(grid), to_dim(block), shmem, stream, coop,
		    [](void *p) {
			    ctx *x = static_cast<ctx *>(p);
			    std::apply(x->kernel, x->args);
		    },
		    c, [](void *p) { delete static_cast<ctx *>(p); });
	}
};

template <class... P>
static inline launcher<P...> make_launcher(int coop, void (*kernel)(P...), dim3 grid, dim3 block,
    size_t shmem = 0, cudaStream_t stream = 0)
{
	return launcher<P...>{ kernel, grid, block, shmem, stream, coop };
}

}

#endif
