/* Internal to kernels/: the scalar 8-bit codecs (quant.h has the definition) and the per-ISA entry points. */
#ifndef ZK_QUANT_IMPL_H
#define ZK_QUANT_IMPL_H

#include <math.h>
#include <stdint.h>

#include "optim_impl.h"
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
 * Order-independent max of |x| (NaN above inf), as integers: the same in
 * every variant.  The step's sqrt(v) is never -0 (v is a sum of +0 or more),
 * so its maximum is taken on the raw bits, one operation fewer.
 */
static inline uint32_t zk__absbits(float x)
{
	return zk__f32_bits(x) & 0x7fffffffu;
}

/*
 * The fp32 step's constants plus 1/sqrt(1 - beta2^step), computed in double
 * and rounded once: the compressed formats multiply by it where the fp32
 * step divides by sqrt(bc2) as PyTorch does.  That leaves one division and
 * one square root per element, which is what keeps these steps off the
 * divider's limit; the 1-ulp difference is far below what the 8- and 16-bit
 * moments round away.
 */
struct zk_qconsts {
	struct zk_consts c;
	float inv_bc2_sqrt;
	uint32_t sr_key;	/* bf16-master+q8: S of quant.h, from the step */
};

/* bf16-master+q8's stochastic rounding (quant.h): the hash, its keys, the rounding. */
static inline uint32_t zk__mix32(uint32_t x)
{
	x ^= x >> 16;
	x *= 0x7feb352du;
	x ^= x >> 15;
	x *= 0x846ca68bu;
	x ^= x >> 16;
	return x;
}

static inline uint32_t zk__sr_key(uint64_t step)
{
	return zk__mix32(zk__mix32((uint32_t)step + 0x9e3779b9u) + (uint32_t)(step >> 32));
}

/* mix(hi32(j) + S): the same for every element of a block (blocks never straddle 2^32). */
static inline uint32_t zk__sr_block_key(uint32_t key, uint64_t j)
{
	return zk__mix32((uint32_t)(j >> 32) + key);
}

/* R of element j, 16 random bits: two multiply-xorshift rounds, the top half kept. */
static inline uint32_t zk__sr_bits(uint32_t block_key, uint64_t j)
{
	uint32_t h = ((uint32_t)j ^ block_key) * 0x7feb352du;

	h = (h ^ (h >> 15)) * 0x846ca68bu;
	return h >> 16;
}

/* p is an arithmetic result: a NaN has its quiet bit, which the add cannot clear. */
static inline uint16_t zk__sr_bf16(float p, uint32_t r)
{
	return (uint16_t)((zk__f32_bits(p) + r) >> 16);
}

/* Ranges were validated by zk_qstep; optim is AdamW or Adam; u NULL: no way back kept. */
typedef void zk_qstep_fn(const struct zk_qconsts *qc, enum zk_optim optim,
    const struct zk_qtensor *t, size_t begin, size_t end, struct zk_undo *u);

/*
 * The way back for one unit of a compressed state (zk_undo_save's, at the
 * state's own sizes: mb and ms bytes an element of master and of each
 * moment; scales: the unit is the q8 block at i, whose scales go too).
 */
static inline void zk_qundo_save(struct zk_undo *u, const struct zk_qtensor *t, size_t i,
    size_t count, size_t mb, size_t ms, bool scales)
{
	char *slot = (char *)u->ring + (size_t)u->slot * ZK_UNDO_SLOT;

	__builtin_memcpy(slot, (const char *)t->master + i * mb, count * mb);
	__builtin_memcpy(slot + ZK_UNDO_M, (const char *)t->m + i * ms, count * ms);
	__builtin_memcpy(slot + ZK_UNDO_V, (const char *)t->v + i * ms, count * ms);
	if (scales) {
		__builtin_memcpy(slot + ZK_UNDO_SCALES, &t->m_scale[i / ZK_Q8_BLOCK], sizeof(float));
		__builtin_memcpy(slot + ZK_UNDO_SCALES + sizeof(float), &t->v_scale[i / ZK_Q8_BLOCK],
		    sizeof(float));
	}
	__atomic_store_n(u->record, zk_undo_pack(i, count, u->slot), __ATOMIC_RELAXED);
	__atomic_signal_fence(__ATOMIC_SEQ_CST);
	u->slot ^= 1;
}
typedef void zk_qmemonly_fn(const struct zk_qtensor *t, size_t begin, size_t end);

zk_qstep_fn zk_qstep_scalar, zk_qstep_avx2, zk_qstep_avx512, zk_qstep_avx512bf16;

/*
 * Set (tests only) to run AVX-512 requests on the baseline AVX-512 body
 * even where the CPU has AVX512_BF16, so both stay under test.
 */
extern bool zk__q8_no_avx512bf16;
zk_qmemonly_fn zk_qmemonly_scalar, zk_qmemonly_avx2, zk_qmemonly_avx512;

#endif
