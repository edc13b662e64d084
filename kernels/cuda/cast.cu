/* Casts between fp32, bf16 and fp16 on the GPU, and the CUDA error to errno map. */
#include <errno.h>

#include "convert.cuh"
#include "zk_cuda.h"

int zkc_errno(cudaError_t err)
{
	switch (err) {
	case cudaSuccess:
		return 0;
	case cudaErrorMemoryAllocation:
		return -ENOMEM;
	case cudaErrorInvalidValue:
	case cudaErrorInvalidDevicePointer:
	case cudaErrorInvalidResourceHandle:
	case cudaErrorInvalidConfiguration:
	case cudaErrorInvalidPitchValue:
	case cudaErrorInvalidMemcpyDirection:
		return -EINVAL;
	case cudaErrorNoDevice:
	case cudaErrorInvalidDevice:
	case cudaErrorInsufficientDriver:
	case cudaErrorInitializationError:
	case cudaErrorDevicesUnavailable:
		return -ENODEV;
	case cudaErrorNoKernelImageForDevice:
	case cudaErrorNotSupported:
		return -ENOTSUP;
	case cudaErrorHostMemoryAlreadyRegistered:
		return -EEXIST;
	case cudaErrorHostMemoryNotRegistered:
		return -ENOENT;
	case cudaErrorNotReady:
		return -EAGAIN;
	case cudaErrorLaunchTimeout:
		return -ETIMEDOUT;
	case cudaErrorNotPermitted:
		return -EPERM;
	default:
		return -EIO;
	}
}

static bool dtype_ok(enum zk_dtype dt)
{
	return dt == ZK_DTYPE_F32 || dt == ZK_DTYPE_BF16 || dt == ZK_DTYPE_F16;
}

static size_t dtype_bytes(enum zk_dtype dt)
{
	return dt == ZK_DTYPE_F32 ? 4 : 2;
}

__global__ void cast_kernel(const void *src, enum zk_dtype from, void *dst, enum zk_dtype to,
    uint64_t n)
{
	uint64_t stride = (uint64_t)gridDim.x * blockDim.x;

	for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
		zkc_store(dst, to, i, zkc_load(src, from, i));
}

int zkc_cast(const void *src, enum zk_dtype from, void *dst, enum zk_dtype to, uint64_t n,
    cudaStream_t stream)
{
	/* Enough blocks to fill any current GPU several times over; the loop covers the rest. */
	const uint64_t threads = 256, max_blocks = 8192;
	uint64_t blocks = (n + threads - 1) / threads;

	if (!dtype_ok(from) || !dtype_ok(to) || (n > 0 && (src == NULL || dst == NULL)))
		return -EINVAL;
	if (n == 0)
		return 0;
	/* In place only between same-size types: otherwise later threads read overwritten data. */
	if (src == dst && dtype_bytes(from) != dtype_bytes(to))
		return -EINVAL;
	if (from == to && src == dst)
		return 0;
	if (from == to)
		return zkc_errno(cudaMemcpyAsync(dst, src, n * dtype_bytes(from),
		    cudaMemcpyDeviceToDevice, stream));
	cast_kernel<<<(unsigned)(blocks < max_blocks ? blocks : max_blocks), (unsigned)threads, 0,
	    stream>>>(src, from, dst, to, n);
	return zkc_errno(cudaGetLastError());
}
