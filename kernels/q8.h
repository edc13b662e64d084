/*
 * The scalar 8-bit moment codec (quant.h has the definition), header only like convert.h:
 * one definition for the kernels and for what reads saved q8 state outside them (the
 * client's checkpoint decode), so that both give the same bits.
 */
#ifndef ZK_Q8_H
#define ZK_Q8_H

#include <math.h>
#include <stdint.h>

#include "convert.h"
#include "quant.h"

#define ZK_Q8_OFFSET 0x1p-15f			/* Fm(0) = Fv(0) */
#define ZK_Q8_BIAS (112u << 23)			/* exponent rebias 127 - 15 */
#define ZK_Q8_VMAX_M (1.875f - 0x1p-15f)	/* Fm(127) - 2^-15 */
#define ZK_Q8_VMAX_V (1.9375f - 0x1p-15f)	/* Fv(255) - 2^-15 */

/* Block multipliers, computed the same way by every variant. */
static inline float zk__q8_encode_mul(float vmax, float s)
{
	float q = vmax / s;

	/* s = 0, inf, NaN, or so small the quotient overflows: encode zeros. */
	return q <= 0x1.fffffep127f ? q : 0.0f;
}

/* A multiply by the rounded reciprocal, not a division: it heads each block's dependency chain. */
#define ZK_Q8_RCP_VMAX_M ((float)(1.0 / (1.875 - 0x1p-15)))
#define ZK_Q8_RCP_VMAX_V ((float)(1.0 / (1.9375 - 0x1p-15)))

static inline float zk__q8_decode_mul(float rcp_vmax, float s)
{
	return s * rcp_vmax;
}

/*
 * Offset-float code of y >= 0 with `mant` mantissa bits in a block of
 * multiplier q: z = fma(y, q, 2^-15), one rounding, then z's bits rounded to
 * `mant` mantissa bits, ties away from zero (half an ulp added to the bits,
 * then truncated; a carry moves to the next binade as it should), and the
 * exponent bias taken off in the same add.  z >= 2^-15, so the add cannot
 * wrap for a number.  Not clamped: a finite y of its block's maximum lands at
 * most on the top code (fma(max, VMAX / max, 2^-15) stays below the next
 * binade's first rounding point), and a NaN or infinite y makes the block's
 * scale non-finite, and every code of such a block decodes to NaN, so the
 * caller keeps only the low bits (7 for m, 8 for v) whatever they are.
 */
static inline uint32_t zk__q8_code(float y, float q, unsigned mant)
{
	uint32_t b = zk__f32_bits(fmaf(y, q, ZK_Q8_OFFSET));
	unsigned sh = 23 - mant;

	return (b + ((1u << (sh - 1)) - ZK_Q8_BIAS)) >> sh;
}

/* Fm(c) or Fv(c): the float with bits (c << (23 - mant)) + bias. */
static inline float zk__q8_grid(uint32_t c, unsigned mant)
{
	return zk__bits_f32((c << (23 - mant)) + ZK_Q8_BIAS);
}

static inline uint8_t zk__q8_encode_m(float x, float q)
{
	uint32_t sign = (zk__f32_bits(x) >> 24) & 0x80u;

	return (uint8_t)(sign | (zk__q8_code(zk__bits_f32(zk__f32_bits(x) & 0x7fffffffu), q, 3) & 0x7fu));
}

/*
 * Decoding: value = fma(Fm(c), u, -c0) with c0 = 2^-15 * u (the block's
 * constant, exact but for underflow), one rounding, so code 0 is an exact
 * zero and an infinite or NaN scale gives NaN for every code (inf - inf).
 * m's sign goes onto Fm(c) and -c0 both: fma(-F, u, c0) is exactly the
 * negation, and the same operands in every variant give the same bits.
 */
static inline float zk__q8_decode_m(uint8_t c, float u, float c0)
{
	uint32_t s = (uint32_t)(c & 0x80u) << 24;
	float t = zk__bits_f32(zk__f32_bits(zk__q8_grid(c & 0x7fu, 3)) | s);

	return fmaf(t, u, zk__bits_f32((zk__f32_bits(c0) | 0x80000000u) ^ s));
}

static inline uint8_t zk__q8_encode_r(float r, float q)
{
	return (uint8_t)zk__q8_code(r, q, 4);
}

static inline float zk__q8_decode_r(uint8_t c, float u, float c0)
{
	return fmaf(zk__q8_grid(c, 4), u, -c0);
}

/*
 * One element of q8 moments decoded: m and v from their codes and their block's scales
 * (element i of a tensor is in block i / ZK_Q8_BLOCK), as zk_qstate_decode does.
 */
static inline void zk_q8_decode(uint8_t m_code, uint8_t v_code, float m_scale, float v_scale,
    float *m, float *v)
{
	float um = zk__q8_decode_mul(ZK_Q8_RCP_VMAX_M, m_scale);
	float ur = zk__q8_decode_mul(ZK_Q8_RCP_VMAX_V, v_scale);
	float rr = zk__q8_decode_r(v_code, ur, ZK_Q8_OFFSET * ur);

	*m = zk__q8_decode_m(m_code, um, ZK_Q8_OFFSET * um);
	*v = rr * rr;
}

#endif
