/* Internal to kernels/: per-step constants and the per-ISA entry points behind zk_step. */
#ifndef ZK_OPTIM_IMPL_H
#define ZK_OPTIM_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "convert.h"
#include "optim.h"

/*
 * Gradient-check lanes.  Squares are summed in double: the square of a float
 * is exact in double (48 significant bits), so only the additions round, and
 * at 2^-53 each a 2^28-element shard loses nothing a float norm would notice;
 * float accumulation would need compensation to say the same.  Every variant
 * (scalar included) adds element i of a range into lane i % ZK_GRAD_LANES and
 * folds the lanes in one fixed tree, so the norm is bit-identical across ISAs,
 * not only across thread counts.  32 lanes = four zmm or eight ymm double
 * accumulators: enough independent adds to hide the add latency.
 */
#define ZK_GRAD_LANES 32

/*
 * Per-step constants, computed once in double (as PyTorch computes them in
 * Python) and rounded to float, which is what PyTorch's float kernels see.
 */
struct zk_consts {
	float inv_scale;	/* (float)(1 / grad_scale), as GradScaler.unscale_ */
	float clip;		/* (float)clip_coef */
	float decay;		/* AdamW, Lion: 1 - lr*wd */
	float wd;		/* Adam, Adagrad: L2 coefficient folded into g */
	bool l2;		/* PyTorch skips g += wd*p when wd == 0 */
	bool lerp_small;	/* |w| < 0.5 picks PyTorch's lerp branch */
	float lerp_w;		/* 1 - beta1 */
	float lerp_omw;		/* 1 - lerp_w, in float as PyTorch's lerp does */
	float beta1;		/* Lion */
	float omb1;		/* Lion: 1 - beta1 */
	float beta2;
	float omb2;		/* 1 - beta2 */
	float bc2_sqrt;		/* sqrt(1 - beta2^step), 1 without bias correction */
	bool bc2_one;		/* bc2_sqrt == 1: the division is the identity and is skipped */
	float eps;
	float neg_step;		/* -lr/bc1 (Adam), -clr (Adagrad), -lr (Lion) */
};

int zk_consts_init(const struct zk_hparams *hp, struct zk_consts *c);

/* [begin, end) already validated by zk_step; u NULL: no way back kept. */
typedef void zk_step_fn(const struct zk_consts *c, enum zk_optim optim,
    const struct zk_tensor *t, size_t begin, size_t end, struct zk_undo *u);
typedef void zk_grad_fn(const void *grad, enum zk_dtype dtype, float inv_scale,
    size_t begin, size_t end, struct zk_grad_stats *stats);
typedef void zk_memonly_fn(const struct zk_tensor *t, size_t begin, size_t end);

zk_step_fn zk_step_scalar, zk_step_avx2, zk_step_avx512;
zk_grad_fn zk_grad_scalar, zk_grad_avx2, zk_grad_avx512;
zk_memonly_fn zk_memonly_scalar, zk_memonly_avx2, zk_memonly_avx512;

/*
 * The way back for one unit of count elements at i (zk_undo): its old
 * values into the current slot, then the record, and only then may the
 * caller store the new values (the compiler keeps that order; the CPU
 * does for a process that dies, which sees its own stores in order).
 */
static inline void zk_undo_save(struct zk_undo *u, bool adam, const float *master,
    const float *m, const float *v, size_t i, size_t count)
{
	char *slot = (char *)u->ring + (size_t)u->slot * ZK_UNDO_SLOT;

	__builtin_memcpy(slot, master, count * sizeof(float));
	__builtin_memcpy(slot + ZK_UNDO_M, m, count * sizeof(float));
	if (adam)
		__builtin_memcpy(slot + ZK_UNDO_V, v, count * sizeof(float));
	__atomic_store_n(u->record, zk_undo_pack(i, count, u->slot), __ATOMIC_RELAXED);
	__atomic_signal_fence(__ATOMIC_SEQ_CST);
	u->slot ^= 1;
}

/* Shared fold of the lane sums so every variant rounds the same way. */
static inline double zk_fold_lanes(double *acc)
{
	for (unsigned s = ZK_GRAD_LANES / 2; s; s >>= 1)
		for (unsigned j = 0; j < s; j++)
			acc[j] += acc[j + s];
	return acc[0];
}

/* Element i of a gradient or parameter array in its dtype, for the scalar bodies. */
static inline float zk_load_grad(const void *grad, enum zk_dtype dt, size_t i)
{
	switch (dt) {
	case ZK_DTYPE_BF16:
		return zk__bf16_to_f32(((const uint16_t *)grad)[i]);
	case ZK_DTYPE_F16:
		return zk__f16_to_f32(((const uint16_t *)grad)[i]);
	default:
		return ((const float *)grad)[i];
	}
}

static inline void zk_store_param(void *param, enum zk_dtype dt, size_t i, float p)
{
	switch (dt) {
	case ZK_DTYPE_BF16:
		((uint16_t *)param)[i] = zk__f32_to_bf16(p);
		break;
	case ZK_DTYPE_F16:
		((uint16_t *)param)[i] = zk__f32_to_f16(p);
		break;
	default:
		((float *)param)[i] = p;
		break;
	}
}

#endif
