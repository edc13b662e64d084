/* Device-side fp32 <-> bf16/fp16 conversions, bit-identical ports of the CPU reference's. */
#ifndef ZK_CUDA_CONVERT_CUH
#define ZK_CUDA_CONVERT_CUH

#include <stdint.h>

#include "optim.h"

/*
 * Not __float2bfloat16_rn / __float2half_rn: those turn every NaN into one
 * canonical NaN, while kernels/optim_impl.h keeps the payload (as F16C does).
 * Copying its integer recipes keeps the GPU and the daemon byte-identical.
 */
__device__ __forceinline__ float zkc_bf16_to_f32(uint16_t h)
{
	return __uint_as_float((uint32_t)h << 16);
}

__device__ __forceinline__ uint16_t zkc_f32_to_bf16(float f)
{
	uint32_t u = __float_as_uint(f);

	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x0040u);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (uint16_t)(u >> 16);
}

__device__ __forceinline__ float zkc_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;

	if (e == 0x1f)
		return __uint_as_float(sign | 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0));
	if (e)
		return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
	/* Zero or subnormal: m * 2^-24 is exact in float. */
	return __uint_as_float(sign | __float_as_uint(__fmul_rn((float)m, 0x1p-24f)));
}

__device__ __forceinline__ uint16_t zkc_f32_to_f16(float f)
{
	uint32_t u = __float_as_uint(f);
	uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
	uint32_t a = u & 0x7fffffffu;

	if (a > 0x7f800000u)
		return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
	if (a >= 0x477ff000u)	/* >= 65520 rounds to inf */
		return (uint16_t)(sign | 0x7c00u);
	if (a >= 0x38800000u) {	/* normal half: rebias the exponent, round the mantissa */
		uint32_t r = a - 0x38000000u;

		r += 0xfffu + ((r >> 13) & 1u);
		return (uint16_t)(sign | (r >> 13));
	}
	uint32_t e = a >> 23;
	if (e < 102)		/* below 2^-25: rounds to zero, f32 subnormals included */
		return sign;
	uint32_t m = (a & 0x7fffffu) | 0x800000u;
	uint32_t sh = 126 - e;
	uint32_t q = m >> sh, rem = m & ((1u << sh) - 1), half = 1u << (sh - 1);

	if (rem > half || (rem == half && (q & 1u)))
		q++;
	return (uint16_t)(sign | q);
}

__device__ __forceinline__ float zkc_load(const void *p, enum zk_dtype dt, uint64_t i)
{
	switch (dt) {
	case ZK_DTYPE_BF16:
		return zkc_bf16_to_f32(((const uint16_t *)p)[i]);
	case ZK_DTYPE_F16:
		return zkc_f16_to_f32(((const uint16_t *)p)[i]);
	default:
		return ((const float *)p)[i];
	}
}

__device__ __forceinline__ void zkc_store(void *p, enum zk_dtype dt, uint64_t i, float v)
{
	switch (dt) {
	case ZK_DTYPE_BF16:
		((uint16_t *)p)[i] = zkc_f32_to_bf16(v);
		break;
	case ZK_DTYPE_F16:
		((uint16_t *)p)[i] = zkc_f32_to_f16(v);
		break;
	default:
		((float *)p)[i] = v;
		break;
	}
}

#endif
