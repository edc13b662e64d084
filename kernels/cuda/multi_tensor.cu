/* Multi-tensor GPU kernels: unscale + inf/NaN count + squared norm of gradients, flatten/unflatten. */
#include <errno.h>

#include "convert.cuh"
#include "zk_cuda.h"

/*
 * A list of tensors travels as a kernel argument (no device-side table to
 * allocate and copy first, so a call is one launch and never synchronises).
 * 48 tensors x 24 bytes stays well inside the 4 KiB parameter limit of every
 * architecture we build for; longer lists take several launches.
 */
#define MT_MAX 48
#define MT_THREADS 256
/* Blocks per launch, spread over the tensors of the launch; each loops over its slice. */
#define MT_BLOCKS 2048

struct mt_list {
	void *ptr[MT_MAX];
	uint64_t numel[MT_MAX];
	uint64_t offset[MT_MAX];	/* flatten/unflatten: where the tensor starts in flat */
	int n;
};

__global__ void unscale_norm_kernel(struct mt_list l, enum zk_dtype dt, float inv_scale,
    bool write_back, struct zkc_grad_stats *stats)
{
	__shared__ double ssum[MT_THREADS / 32];
	__shared__ unsigned long long sbad[MT_THREADS / 32];
	/* blockIdx.y picks the tensor; blockIdx.x and the loop stride over its elements. */
	int t = blockIdx.y;
	void *g = l.ptr[t];
	uint64_t n = l.numel[t], stride = (uint64_t)gridDim.x * blockDim.x;
	double acc = 0;
	unsigned long long bad = 0;

	for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
		float v = __fmul_rn(zkc_load(g, dt, i), inv_scale);

		bad += (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
		acc += (double)v * (double)v;
		if (write_back)
			zkc_store(g, dt, i, v);
	}
	for (int off = 16; off > 0; off >>= 1) {
		acc += __shfl_down_sync(0xffffffffu, acc, off);
		bad += __shfl_down_sync(0xffffffffu, bad, off);
	}
	if ((threadIdx.x & 31) == 0) {
		ssum[threadIdx.x / 32] = acc;
		sbad[threadIdx.x / 32] = bad;
	}
	__syncthreads();
	if (threadIdx.x == 0) {
		acc = 0;
		bad = 0;
		for (int w = 0; w < MT_THREADS / 32; w++) {
			acc += ssum[w];
			bad += sbad[w];
		}
		/* One atomic per block: the sum's order varies run to run, the bits may too. */
		if (acc != 0 || isnan(acc))
			atomicAdd(&stats->sumsq, acc);
		if (bad)
			atomicAdd(&stats->nonfinite, bad);
	}
}

template <typename T>
__global__ void flatten_kernel(struct mt_list l, T *flat, bool to_flat)
{
	int t = blockIdx.y;
	T *p = (T *)l.ptr[t];
	T *f = flat + l.offset[t];
	uint64_t n = l.numel[t], stride = (uint64_t)gridDim.x * blockDim.x;

	for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
		if (to_flat)
			f[i] = p[i];
		else
			p[i] = f[i];
	}
}

/* Blocks along x for a launch of `count` tensors whose largest has `most` elements. */
static unsigned grid_x(int count, uint64_t most)
{
	uint64_t want = (most + MT_THREADS - 1) / MT_THREADS;
	uint64_t cap = MT_BLOCKS / (uint64_t)count;

	if (cap == 0)
		cap = 1;
	if (want > cap)
		want = cap;
	return (unsigned)(want ? want : 1);
}

/*
 * Up to MT_MAX non-empty tensors from *done on into l, each with its start
 * in the flat buffer (*offset advances past them); returns the largest numel.
 * Empty tensors take no slot: a block of them would only add zeros.
 */
static uint64_t fill_list(struct mt_list *l, void *const *ptrs, const uint64_t *numel,
    size_t n, size_t *done, uint64_t *offset)
{
	uint64_t most = 0;

	for (; *done < n && l->n < MT_MAX; (*done)++) {
		if (numel[*done] == 0)
			continue;
		l->ptr[l->n] = ptrs[*done];
		l->numel[l->n] = numel[*done];
		l->offset[l->n] = *offset;
		*offset += numel[*done];
		most = numel[*done] > most ? numel[*done] : most;
		l->n++;
	}
	return most;
}

int zkc_unscale_norm(void *const *grads, const uint64_t *numel, size_t n, enum zk_dtype dtype,
    float inv_scale, bool write_back, struct zkc_grad_stats *stats, cudaStream_t stream)
{
	if (dtype != ZK_DTYPE_F32 && dtype != ZK_DTYPE_BF16 && dtype != ZK_DTYPE_F16)
		return -EINVAL;
	if (stats == NULL || (n > 0 && (grads == NULL || numel == NULL)))
		return -EINVAL;
	for (size_t i = 0; i < n; i++)
		if (numel[i] > 0 && grads[i] == NULL)
			return -EINVAL;
	uint64_t offset = 0;

	for (size_t done = 0; done < n;) {
		struct mt_list l = {};
		uint64_t most = fill_list(&l, grads, numel, n, &done, &offset);

		if (l.n == 0)
			break;
		unscale_norm_kernel<<<dim3(grid_x(l.n, most), (unsigned)l.n), MT_THREADS, 0,
		    stream>>>(l, dtype, inv_scale, write_back, stats);
		cudaError_t err = cudaGetLastError();
		if (err != cudaSuccess)
			return zkc_errno(err);
	}
	return 0;
}

static int flatten_common(void *flat, void *const *ptrs, const uint64_t *numel, size_t n,
    size_t elem_size, bool to_flat, cudaStream_t stream)
{
	uint64_t offset = 0;

	if (elem_size != 2 && elem_size != 4)
		return -EINVAL;
	if (n > 0 && (flat == NULL || ptrs == NULL || numel == NULL))
		return -EINVAL;
	for (size_t i = 0; i < n; i++)
		if (numel[i] > 0 && ptrs[i] == NULL)
			return -EINVAL;
	for (size_t done = 0; done < n;) {
		struct mt_list l = {};
		uint64_t most = fill_list(&l, ptrs, numel, n, &done, &offset);

		if (l.n == 0)
			break;
		dim3 grid(grid_x(l.n, most), (unsigned)l.n);
		if (elem_size == 2)
			flatten_kernel<uint16_t><<<grid, MT_THREADS, 0, stream>>>(l,
			    (uint16_t *)flat, to_flat);
		else
			flatten_kernel<uint32_t><<<grid, MT_THREADS, 0, stream>>>(l,
			    (uint32_t *)flat, to_flat);
		cudaError_t err = cudaGetLastError();
		if (err != cudaSuccess)
			return zkc_errno(err);
	}
	return 0;
}

int zkc_flatten(void *flat, const void *const *srcs, const uint64_t *numel, size_t n,
    size_t elem_size, cudaStream_t stream)
{
	/* The kernel only reads through these when flattening. */
	return flatten_common(flat, (void *const *)srcs, numel, n, elem_size, true, stream);
}

int zkc_unflatten(const void *flat, void *const *dsts, const uint64_t *numel, size_t n,
    size_t elem_size, cudaStream_t stream)
{
	/* Only read when unflattening. */
	return flatten_common((void *)flat, dsts, numel, n, elem_size, false, stream);
}
