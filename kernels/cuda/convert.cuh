/* Device-side loads and stores in any dtype, on the CPU reference's conversions (convert.h). */
#ifndef ZK_CUDA_CONVERT_CUH
#define ZK_CUDA_CONVERT_CUH

#include <stdint.h>

#include "convert.h"
#include "optim.h"

__device__ __forceinline__ float zkc_load(const void *p, enum zk_dtype dt, uint64_t i)
{
	switch (dt) {
	case ZK_DTYPE_BF16:
		return zk__bf16_to_f32(((const uint16_t *)p)[i]);
	case ZK_DTYPE_F16:
		return zk__f16_to_f32(((const uint16_t *)p)[i]);
	default:
		return ((const float *)p)[i];
	}
}

__device__ __forceinline__ void zkc_store(void *p, enum zk_dtype dt, uint64_t i, float v)
{
	switch (dt) {
	case ZK_DTYPE_BF16:
		((uint16_t *)p)[i] = zk__f32_to_bf16(v);
		break;
	case ZK_DTYPE_F16:
		((uint16_t *)p)[i] = zk__f32_to_f16(v);
		break;
	default:
		((float *)p)[i] = v;
		break;
	}
}

#endif
