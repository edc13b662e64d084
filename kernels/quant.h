/* Compressed optimizer state: bf16 and 8-bit moments with an fp32 master, and the fused step over them. */
#ifndef ZK_QUANT_H
#define ZK_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "optim.h"

/*
 * State formats.  FP32 is struct zk_tensor and zk_step (optim.h), the
 * reference; the others keep master in fp32 and shrink m and v:
 *
 * ZK_STATE_BF16 ("bf16-moments"): m[i], v[i] are bf16 (uint16_t), written
 *   with round-to-nearest-even (zk_f32_to_bf16).  20 B/param moved per step
 *   with bf16 grad and param (fp32 state: 28).
 *
 * ZK_STATE_Q8 ("q8-moments"): blocks of ZK_Q8_BLOCK elements; per block two
 *   fp32 scales, per element one byte of m and one of v.  16.06 B/param
 *   moved per step with bf16 grad and param.
 *
 *   m: byte = sign << 7 | c, c in 0..127 an "offset E4M3" magnitude:
 *        Fm(c) = float with bits (c << 20) + (112 << 23), i.e. 2^(e-15) (1 + f/8)
 *                for c = e << 3 | f; Fm(0) = 2^-15
 *        u = sm * RCP_M, c0 = 2^-15 * u,  |m| = fma(Fm(c), u, -c0)
 *        VMAX_M = Fm(127) - 2^-15 = 1.875 - 2^-15, RCP_M = 1 / VMAX_M rounded to fp32
 *      (a negative m is fma(-Fm(c), u, c0), exactly the negation).
 *      sm = the block's max |m|.  16 binades at 3 mantissa bits, then a
 *      linear bottom (steps of 2^-18 sm/VMAX_M) down to an exact zero.
 *   v: byte = c in 0..255, an "offset E4M4" code of r = sqrt(v):
 *        Fv(c) = float with bits (c << 19) + (112 << 23);  Fv(0) = 2^-15
 *        u = sr * RCP_V, c0 = 2^-15 * u,  r = fma(Fv(c), u, -c0),  v = r * r
 *        VMAX_V = Fv(255) - 2^-15 = 1.9375 - 2^-15, RCP_V = 1 / VMAX_V rounded to fp32
 *      sr = the block's max sqrt(v).  The step needs sqrt(v) anyway, and in
 *      the square-root domain 16 binades of r are 32 of v at 4 mantissa bits.
 *
 *   All operations above are fp32 operations (fma: one rounding) in the
 *   order written.  Encoding x (|m| or r) in a block of scale s:
 *   q = VMAX / s (0 when that is not finite: s = 0, inf, NaN or subnormal),
 *   z = fma(|x|, q, 2^-15), then z's fp32 bits rounded to nearest at bit 20
 *   (m) or 19 (v), ties away from zero (add 2^19 or 2^18 to the bits,
 *   truncate), less the 112 << 23 offset; the low 7 (m) or 8 (v) bits are
 *   the code.  Each is one fp32 or integer operation, so the code is the
 *   nearest one to |x| q, found without a table or a search; decoding is a
 *   shift, an integer add and an fma.  No clamp is needed: a block's maximum
 *   codes to the top code, and a NaN or infinite element makes the block's
 *   scale NaN or inf, whose every code decodes to NaN (inf - inf).
 *   All-zero bytes and scales decode to zero state.
 *
 *   Why 256-element blocks: one outlier costs resolution only in its own 256
 *   elements (Dettmers et al. use 2048 on a GPU), the two fp32 scales add
 *   0.03 B/param, and the block's new m and r (2 KiB) stay in L1 between the
 *   step and the encode.  Slices and chunks of a tensor must start on a block
 *   boundary (4 Mi-element engine units and the pool's slices do).
 *
 * bf16-moments' step is the fp32 step (zk_step_scalar) on the decoded
 * moments, except that it multiplies by 1/sqrt(1 - beta2^step) (rounded
 * once from double) where PyTorch divides by its square root: one division
 * fewer per element.  q8-moments' step is the same with every multiply-add
 * fused (the decode and encode make the 8-bit step compute-bound, and one
 * rounding per fma is no worse than two):
 *   g' = g * inv_scale * clip;  Adam with L2: g' = fma(wd, p, g')
 *   m' = fma(1 - beta1, g' - m, m)  (beta1 <= 0.5: fma(m - g', beta1, g'))
 *   v' = fma(r * r, beta2, (1 - beta2) * g' * g');  r' = sqrt(v')
 *   u = (-lr / bc1) * m' / fma(r', 1 / sqrt(bc2), eps)
 *   p' = AdamW: fma(p, 1 - lr * wd, u);  Adam: p + u
 * The parameter update uses the new moments before they are rounded for
 * storage (as bitsandbytes' 8-bit optimizers do).
 *
 * ZK_STATE_BF16_Q8 ("bf16-master+q8"): m and v as q8-moments, master in
 *   bf16 (uint16_t, through master_bf16): 12.06 B/param moved per step with
 *   bf16 grad and param.  The step is q8-moments' on the widened master; the
 *   new master is rounded to bf16 stochastically, and param (any dtype) is
 *   that bf16 value.  Stochastic, not Kahan-compensated: a bf16 compensation
 *   term would bring master back to 4 bytes, the bytes this format exists to
 *   save; rounding up with probability equal to the remainder keeps updates
 *   far below a bf16 ulp (lr 1e-4 on weights near 1: ulp 2^-7) from being
 *   lost, unbiased, at 2 bytes.  The random bits are a hash of the step and
 *   the element's index, so every variant and any split give the same bits
 *   (32-bit unsigned arithmetic):
 *     mix(x) = x ^= x >> 16, x *= 0x7feb352d, x ^= x >> 15, x *= 0x846ca68b,
 *              x ^= x >> 16
 *     S = mix(mix(lo32(step) + 0x9e3779b9) + hi32(step))
 *     j = base + i (the element's index in the whole tensor: struct zk_qtensor)
 *     K = mix(hi32(j) + S)  (one per block: blocks never straddle 2^32)
 *     h = (lo32(j) ^ K) * 0x7feb352d, h ^= h >> 15, h *= 0x846ca68b, R = h >> 16
 *     bf16 = (bits(p') + R) >> 16
 *   p' is an arithmetic result, so a NaN is quiet and stays a NaN; the
 *   largest finite floats may round up to inf, as the next bf16 is.
 * SIMD variants give the scalar reference's bits.  AdamW and Adam only.
 */
enum zk_state_format {
	ZK_STATE_FP32 = 0,	/* "fp32": struct zk_tensor / zk_step */
	ZK_STATE_BF16 = 1,	/* "bf16-moments" */
	ZK_STATE_Q8 = 2,	/* "q8-moments" */
	ZK_STATE_BF16_Q8 = 3,	/* "bf16-master+q8" */
	ZK_STATE_COUNT
};

#define ZK_Q8_BLOCK 256

/*
 * One tensor (or a block-aligned piece of one) in a compressed format.
 * master: float[n], or uint16_t[n] bf16 through master_bf16 (BF16_Q8).
 * m/v: uint16_t[n] (BF16) or uint8_t[n] (Q8, BF16_Q8).  m_scale/v_scale:
 * Q8 and BF16_Q8, float[zk_state_blocks(format, n)], block j covering
 * elements [256j, 256j + 256); NULL for BF16.  base: the index of element 0
 * in the whole tensor, which seeds BF16_Q8's rounding (0 for a whole tensor;
 * zk_qtensor_slice keeps it, so a piece stepped on its own gets the bits it
 * would get in the whole).  Other fields as in struct zk_tensor.
 */
struct zk_qtensor {
	enum zk_state_format format;
	union {
		float *master;
		uint16_t *master_bf16;
	};
	void *m;
	void *v;
	float *m_scale;
	float *v_scale;
	const void *grad;
	enum zk_dtype grad_dtype;
	void *param;
	enum zk_dtype param_dtype;
	size_t n;
	size_t base;
};

const char *zk_state_format_name(enum zk_state_format f);
/* "fp32", "bf16-moments", "q8-moments", "bf16-master+q8" (also "bf16", "q8", "bf16-q8"). */
int zk_state_format_parse(const char *name, enum zk_state_format *ret);
/* "\"fp32\", \"bf16-moments\", ...": every format's name, for messages; cut at len. */
void zk_state_format_list(char *buf, size_t len);

/*
 * The arrays' sizes, inline: the one definition for the kernels, the engine and the
 * checkpoint files' readers and writers (client/ckpt_index.c), which do not link the
 * kernels.
 */
/* Bytes of one moment array (m or v) of n elements: 4n, 2n or n. */
static inline size_t zk_state_moment_bytes(enum zk_state_format f, size_t n)
{
	switch (f) {
	case ZK_STATE_FP32:
		return 4 * n;
	case ZK_STATE_BF16:
		return 2 * n;
	case ZK_STATE_Q8:
	case ZK_STATE_BF16_Q8:
		return n;
	case ZK_STATE_COUNT:
		break;
	}
	return 0;
}

/* Bytes of the master array of n elements: 2n for BF16_Q8, else 4n. */
static inline size_t zk_state_master_bytes(enum zk_state_format f, size_t n)
{
	return f == ZK_STATE_BF16_Q8 ? 2 * n : 4 * n;
}

/* Scales per moment array: ceil(n / ZK_Q8_BLOCK) for Q8 and BF16_Q8, else 0. */
static inline size_t zk_state_blocks(enum zk_state_format f, size_t n)
{
	return f == ZK_STATE_Q8 || f == ZK_STATE_BF16_Q8 ? (n + ZK_Q8_BLOCK - 1) / ZK_Q8_BLOCK : 0;
}

/* Optimizer state bytes per element set, all of master, m, v and scales. */
static inline size_t zk_state_bytes(enum zk_state_format f, size_t n)
{
	return zk_state_master_bytes(f, n) + 2 * zk_state_moment_bytes(f, n) +
	    2 * sizeof(float) * zk_state_blocks(f, n);
}

/*
 * Elements [off, off + len) of t as a tensor of its own (what the engine
 * does to a view for a pinned slice, an NVMe chunk or a pool slice).
 * -EINVAL unless off is a multiple of ZK_Q8_BLOCK (Q8, BF16_Q8) and the
 * range fits.
 */
int zk_qtensor_slice(const struct zk_qtensor *t, size_t off, size_t len,
    struct zk_qtensor *ret);

/*
 * Fused dequantize -> step -> requantize over [begin, end) of t.  For Q8
 * and BF16_Q8, begin must be a multiple of ZK_Q8_BLOCK and end a multiple of it or t->n.
 * Any such split gives the same bits.  -EINVAL on bad arguments or a
 * misaligned range, -ENOTSUP for an optimizer other than AdamW/Adam or an
 * ISA the CPU lacks.
 */
int zk_qstep(enum zk_isa isa, const struct zk_hparams *hp, const struct zk_qtensor *t,
    size_t begin, size_t end);

/*
 * zk_qstep keeping a way back in u (optim.h's struct zk_undo; NULL: none):
 * the units are vectors for bf16-moments and whole q8 blocks (codes and
 * scales) for the 8-bit formats.  The same bits as zk_qstep.
 */
int zk_qstep_undo(enum zk_isa isa, const struct zk_hparams *hp, const struct zk_qtensor *t,
    size_t begin, size_t end, struct zk_undo *u);
/* Puts back into t the unit record names, from u's ring.  -EINVAL: the record does not fit t. */
int zk_qundo_restore(const struct zk_qtensor *t, const struct zk_undo *u, uint64_t record);

/* The bytes zk_qstep moves over [begin, end), without the arithmetic (benchmarks). */
int zk_qstep_memonly(enum zk_isa isa, const struct zk_qtensor *t, size_t begin, size_t end);

/*
 * Conversions between fp32 moments and t's format over the whole of t
 * (checkpoint conversion, initial state from a client's fp32 arrays, tests).
 * Scalar; encode writes m, v and the scales, decode reads them.
 */
int zk_qstate_encode(const struct zk_qtensor *t, const float *m, const float *v);
int zk_qstate_decode(const struct zk_qtensor *t, float *m, float *v);

/*
 * The master array the same way: fp32 in and out for every format but
 * BF16_Q8, whose master encode rounds to nearest even (a conversion, not a
 * step: no stochastic rounding) and decode widens exactly.
 */
int zk_qstate_master_encode(const struct zk_qtensor *t, const float *master);
int zk_qstate_master_decode(const struct zk_qtensor *t, float *master);

#endif
