/* The scalar reference: the definition of a correct step, one element at a time, in PyTorch's op order. */
#include <math.h>
#include <string.h>

#include "optim_impl.h"

/*
 * Built with -ffp-contract=off (meson.build): every multiply and add rounds
 * on its own, as in PyTorch's float kernels, and the SIMD variants repeat
 * exactly these operations in this order, so they agree bit for bit.
 */

/* torch.lerp: self + w*(end-self) for |w| < 0.5, else end - (end-self)*(1-w). */
static inline float lerp(const struct zk_consts *c, float self, float end)
{
	if (c->lerp_small)
		return self + c->lerp_w * (end - self);
	return end - (end - self) * c->lerp_omw;
}

void zk_step_scalar(const struct zk_consts *c, enum zk_optim optim, const struct zk_tensor *t,
    size_t begin, size_t end, struct zk_undo *undo)
{
	float *master = t->master, *m = t->m, *v = t->v;
	bool adam = optim == ZK_OPTIM_ADAMW || optim == ZK_OPTIM_ADAM;

	for (size_t i = begin; i < end; i++) {
		float g = zk_load_grad(t->grad, t->grad_dtype, i) * c->inv_scale * c->clip;
		float p = master[i], mi, vi, d, u;

		if (undo != NULL)
			zk_undo_save(undo, adam, master + i, m + i, adam ? v + i : NULL, i, 1);

		switch (optim) {
		case ZK_OPTIM_ADAMW:
		case ZK_OPTIM_ADAM:
			if (optim == ZK_OPTIM_ADAMW)
				p = p * c->decay;
			else if (c->l2)
				g = g + c->wd * p;
			mi = lerp(c, m[i], g);
			vi = v[i] * c->beta2 + c->omb2 * g * g;
			d = sqrtf(vi) / c->bc2_sqrt + c->eps;
			p = p + c->neg_step * mi / d;
			m[i] = mi;
			v[i] = vi;
			break;
		case ZK_OPTIM_ADAGRAD:
			if (c->l2)
				g = g + c->wd * p;
			mi = m[i] + g * g;
			d = sqrtf(mi) + c->eps;
			p = p + c->neg_step * g / d;
			m[i] = mi;
			break;
		case ZK_OPTIM_LION:
			p = p * c->decay;
			d = m[i] * c->beta1 + c->omb1 * g;
			u = (float)((d > 0) - (d < 0));
			p = p + c->neg_step * u;
			m[i] = m[i] * c->beta2 + c->omb2 * g;
			break;
		default:
			break;
		}
		master[i] = p;
		if (t->param)
			zk_store_param(t->param, t->param_dtype, i, p);
	}
}

void zk_grad_scalar(const void *grad, enum zk_dtype dtype, float inv_scale, size_t begin,
    size_t end, struct zk_grad_stats *stats)
{
	double acc[ZK_GRAD_LANES] = { 0 };
	uint64_t bad = 0;

	for (size_t i = begin; i < end; i++) {
		float g = zk_load_grad(grad, dtype, i) * inv_scale;

		bad += (zk__f32_bits(g) & 0x7f800000u) == 0x7f800000u;
		acc[(i - begin) % ZK_GRAD_LANES] += (double)g * (double)g;
	}
	stats->sumsq += zk_fold_lanes(acc);
	stats->nonfinite += bad;
}

/* Opaque to the optimizer, so the load/store pairs below are not folded away. */
#define ZK_OPAQUE(x, how) __asm__ volatile("" : how(x))

void zk_memonly_scalar(const struct zk_tensor *t, size_t begin, size_t end)
{
	float *master = t->master, *m = t->m, *v = t->v;
	size_t gs = zk_dtype_size(t->grad_dtype), ps = zk_dtype_size(t->param_dtype);
	const unsigned char *g = t->grad;
	unsigned char *param = t->param;

	for (size_t i = begin; i < end; i++) {
		float x = master[i];
		uint32_t gx = 0;

		memcpy(&gx, g + i * gs, gs);
		ZK_OPAQUE(x, "+x");
		ZK_OPAQUE(gx, "+r");
		master[i] = x;
		if (m) {
			float y = m[i];

			ZK_OPAQUE(y, "+x");
			m[i] = y;
		}
		if (v) {
			float y = v[i];

			ZK_OPAQUE(y, "+x");
			v[i] = y;
		}
		if (param)
			memcpy(param + i * ps, &gx, ps);
	}
}
