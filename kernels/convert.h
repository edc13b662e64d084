/* fp32 <-> bf16/fp16, one definition for the CPU kernels and the CUDA kernels alike. */
#ifndef ZK_CONVERT_H
#define ZK_CONVERT_H

#include <stdint.h>

/*
 * The GPU must produce the daemon's bytes exactly, NaN payloads included
 * (__float2bfloat16_rn and __float2half_rn canonicalise NaNs), so the CUDA
 * code compiles these same functions for the device.
 */
#ifdef __CUDACC__
#define ZK_HD static inline __host__ __device__
#else
#define ZK_HD static inline
#endif

/*
 * Scalar conversions, inline so the reference kernel does not pay a call per
 * element.  NaN handling matches what F16C (vcvtph2ps/vcvtps2ph) does, so the
 * scalar reference and the SIMD variants agree bit for bit; the tests check
 * these against the hardware over every half value.
 */
ZK_HD float zk__bits_f32(uint32_t u)
{
#ifdef __CUDA_ARCH__
	return __uint_as_float(u);
#else
	float f;

	__builtin_memcpy(&f, &u, sizeof(f));
	return f;
#endif
}

ZK_HD uint32_t zk__f32_bits(float f)
{
#ifdef __CUDA_ARCH__
	return __float_as_uint(f);
#else
	uint32_t u;

	__builtin_memcpy(&u, &f, sizeof(u));
	return u;
#endif
}

ZK_HD float zk__bf16_to_f32(uint16_t h)
{
	return zk__bits_f32((uint32_t)h << 16);
}

ZK_HD uint16_t zk__f32_to_bf16(float f)
{
	uint32_t u = zk__f32_bits(f);

	/* Setting the quiet bit keeps a NaN whose payload sits in the low 16 bits a NaN. */
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x0040u);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (uint16_t)(u >> 16);
}

ZK_HD float zk__f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;

	if (e == 0x1f)
		return zk__bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0));
	if (e)
		return zk__bits_f32(sign | ((e + 112) << 23) | (m << 13));
	/* Zero or subnormal: m * 2^-24 is exact in float. */
	return zk__bits_f32(sign | zk__f32_bits((float)m * 0x1p-24f));
}

ZK_HD uint16_t zk__f32_to_f16(float f)
{
	uint32_t u = zk__f32_bits(f);
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
	if (e < 102)		/* below 2^-25: rounds to zero, incl. f32 subnormals */
		return sign;
	uint32_t m = (a & 0x7fffffu) | 0x800000u;
	uint32_t sh = 126 - e;	/* 14..24: value = m * 2^-sh half-subnormal units */
	uint32_t q = m >> sh, rem = m & ((1u << sh) - 1), half = 1u << (sh - 1);

	if (rem > half || (rem == half && (q & 1u)))
		q++;
	return (uint16_t)(sign | q);
}

#endif
