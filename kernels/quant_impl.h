/* Internal to kernels/: the compressed step's constants and the per-ISA entry points (the scalar 8-bit codecs are q8.h). */
#ifndef ZK_QUANT_IMPL_H
#define ZK_QUANT_IMPL_H

#include <math.h>
#include <stdint.h>

#include "optim_impl.h"
#include "q8.h"
#include "quant.h"

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
