/* The SIMD step, gradient pass and memory-only probe: one body, built once per ISA (see meson.build). */
#include <string.h>

#include "optim_impl.h"
#include "simd.h"

/*
 * Bit-exact with optim_scalar.c: the same operations in the same order, no
 * FMA (meson.build passes -ffp-contract=off, else GCC fuses the mul/add
 * intrinsics), IEEE sqrt and div, and the same conversions.  The step is
 * memory-bound by a wide margin, so the extra roundings cost nothing.
 */

#define ZK_NO_PARAM ZK_DTYPE_COUNT

/* Element size as a constant the compiler folds into each specialized loop. */
ZK_INLINE size_t dsize(int dt)
{
	return dt == ZK_DTYPE_F32 ? 4 : dt == ZK_NO_PARAM ? 0 : 2;
}

struct vconsts {
	vf inv_scale, clip, decay, wd, lerp_w, lerp_omw, beta1, omb1, beta2, omb2;
	vf bc2_sqrt, eps, neg_step, one;
	bool l2, lerp_small, bc2_one, scale_one, clip_one;
};

static void vconsts_init(const struct zk_consts *c, struct vconsts *k)
{
	k->inv_scale = vf_set1(c->inv_scale);
	k->clip = vf_set1(c->clip);
	k->decay = vf_set1(c->decay);
	k->wd = vf_set1(c->wd);
	k->lerp_w = vf_set1(c->lerp_w);
	k->lerp_omw = vf_set1(c->lerp_omw);
	k->beta1 = vf_set1(c->beta1);
	k->omb1 = vf_set1(c->omb1);
	k->beta2 = vf_set1(c->beta2);
	k->omb2 = vf_set1(c->omb2);
	k->bc2_sqrt = vf_set1(c->bc2_sqrt);
	k->eps = vf_set1(c->eps);
	k->neg_step = vf_set1(c->neg_step);
	k->one = vf_set1(1.0f);
	k->l2 = c->l2;
	k->lerp_small = c->lerp_small;
	k->bc2_one = c->bc2_one;
	k->scale_one = c->inv_scale == 1.0f;
	k->clip_one = c->clip == 1.0f;
}

ZK_INLINE vf lerp(const struct vconsts *k, vf self, vf end)
{
	if (k->lerp_small)
		return vf_add(self, vf_mul(k->lerp_w, vf_sub(end, self)));
	return vf_sub(end, vf_mul(vf_sub(end, self), k->lerp_omw));
}

/* One vector of elements; see zk_step_scalar for the formulas and their PyTorch origin. */
ZK_INLINE void body(const struct vconsts *k, int optim, int gdt, int pdt, bool nt,
    float *master, float *m, float *v, const void *grad, void *param)
{
	vf g = load_grad(grad, gdt);
	vf p = vf_load(master), mi, vi_, d, u;

	/* x * 1.0f is x (NaN stays NaN): the usual no-scale, no-clip case skips the multiplies. */
	if (!k->scale_one)
		g = vf_mul(g, k->inv_scale);
	if (!k->clip_one)
		g = vf_mul(g, k->clip);

	if (optim == ZK_OPTIM_ADAMW || optim == ZK_OPTIM_ADAM) {
		if (optim == ZK_OPTIM_ADAMW)
			p = vf_mul(p, k->decay);
		else if (k->l2)
			g = vf_add(g, vf_mul(k->wd, p));
		mi = lerp(k, vf_load(m), g);
		vi_ = vf_add(vf_mul(vf_load(v), k->beta2), vf_mul(vf_mul(k->omb2, g), g));
		/*
		 * The divider is the bottleneck of this loop on Zen 4 (two divisions
		 * and a sqrt per element cap one core near the memory limit).  From
		 * step ~17k on (beta2 = 0.999) sqrt(bc2) rounds to 1.0f, and x / 1.0f
		 * is x for every x sqrt can return, so skipping it keeps the bits.
		 */
		d = vf_sqrt(vi_);
		if (!k->bc2_one)
			d = vf_div(d, k->bc2_sqrt);
		d = vf_add(d, k->eps);
		p = vf_add(p, vf_div(vf_mul(k->neg_step, mi), d));
		vf_store(m, mi);
		vf_store(v, vi_);
	} else if (optim == ZK_OPTIM_ADAGRAD) {
		if (k->l2)
			g = vf_add(g, vf_mul(k->wd, p));
		mi = vf_add(vf_load(m), vf_mul(g, g));
		d = vf_add(vf_sqrt(mi), k->eps);
		p = vf_add(p, vf_div(vf_mul(k->neg_step, g), d));
		vf_store(m, mi);
	} else {
		mi = vf_load(m);
		p = vf_mul(p, k->decay);
		d = vf_add(vf_mul(mi, k->beta1), vf_mul(k->omb1, g));
		u = vf_sign(d, k->one);
		p = vf_add(p, vf_mul(k->neg_step, u));
		vf_store(m, vf_add(vf_mul(mi, k->beta2), vf_mul(k->omb2, g)));
	}
	vf_store(master, p);
	store_param(param, pdt, p, nt);
}

/*
 * Fewer than a vector of elements (unaligned head, tail): run the same body
 * on zero-padded copies so the results match the main loop bit for bit.
 */
ZK_INLINE void padded(const struct vconsts *k, int optim, int gdt, int pdt,
    const struct zk_tensor *t, size_t i, size_t cnt, struct zk_undo *u)
{
	float lmaster[ZK_W] = { 0 }, lm[ZK_W] = { 0 }, lv[ZK_W] = { 0 };
	float lg[ZK_W] = { 0 }, lp[ZK_W];
	size_t gs = dsize(gdt), ps = dsize(pdt);

	memcpy(lmaster, t->master + i, cnt * sizeof(float));
	bool adam = optim == ZK_OPTIM_ADAMW || optim == ZK_OPTIM_ADAM;

	memcpy(lm, t->m + i, cnt * sizeof(float));
	if (adam)
		memcpy(lv, t->v + i, cnt * sizeof(float));
	memcpy(lg, (const char *)t->grad + i * gs, cnt * gs);
	if (u != NULL)
		zk_undo_save(u, adam, lmaster, lm, lv, i, cnt);
	body(k, optim, gdt, pdt, false, lmaster, lm, lv, lg, lp);
	memcpy(t->master + i, lmaster, cnt * sizeof(float));
	memcpy(t->m + i, lm, cnt * sizeof(float));
	if (adam)
		memcpy(t->v + i, lv, cnt * sizeof(float));
	if (pdt != ZK_NO_PARAM)
		memcpy((char *)t->param + i * ps, lp, cnt * ps);
}

/*
 * Streaming stores need the param pointer aligned to a whole vector store;
 * returns how many elements to run before it is (SIZE_MAX: never, e.g. an
 * odd address), so the head goes through the padded path.
 */
static size_t nt_head(const void *param, size_t esize)
{
	uintptr_t a = (uintptr_t)param, align = ZK_W * esize;

	if (a % esize)
		return SIZE_MAX;
	return ((align - a % align) % align) / esize;
}

/*
 * Elements [b, b + head) go before the streaming stores line up; *nt says
 * whether the param output can be streamed at all.
 */
ZK_INLINE size_t nt_split(int pdt, char *param, size_t ps, size_t b, size_t e, bool *nt)
{
	size_t head = 0;

	*nt = false;
	if (pdt != ZK_NO_PARAM) {
		head = nt_head(param + b * ps, ps);
		*nt = head != SIZE_MAX;
		if (!*nt)
			head = 0;
	}
	return head > e - b ? e - b : head;
}

_Static_assert(ZK_UNDO_UNIT % ZK_W == 0 && ZK_UNDO_UNIT * sizeof(float) <= ZK_UNDO_M,
    "an undo unit is whole vectors and fits a slot");

ZK_INLINE void run(const struct vconsts *k, int optim, int gdt, int pdt,
    const struct zk_tensor *t, size_t b, size_t e, struct zk_undo *u)
{
	size_t gs = dsize(gdt), ps = dsize(pdt);
	const char *g = t->grad;
	char *param = t->param;
	size_t i = b;
	bool nt, adam = optim == ZK_OPTIM_ADAMW || optim == ZK_OPTIM_ADAM;
	size_t head = nt_split(pdt, param, ps, b, e, &nt);
	if (head) {
		padded(k, optim, gdt, pdt, t, i, head, u);
		i += head;
	}
	/*
	 * The way back's stores come from the lines body loads; a loop of their
	 * own.  A unit is ZK_UNDO_UNIT elements: with a record (and the compiler
	 * barrier after it) every vector the journal cost 5-7% of a pinned fp32
	 * step over none (bench_step, 100 M params, 2 threads), at 32 elements
	 * 1-3%, at 256 10-15% (the copy's loads run ahead of the step's again).
	 */
#define ZK_BODY(NT, j) \
	body(k, optim, gdt, pdt, NT, t->master + (j), t->m + (j), adam ? t->v + (j) : NULL, \
	    g + (j) * gs, pdt != ZK_NO_PARAM ? param + (j) * ps : NULL)
#define ZK_MAIN_LOOP(NT, UNDO) \
	if (UNDO) { \
		for (; i + ZK_UNDO_UNIT <= e; i += ZK_UNDO_UNIT) { \
			zk_undo_save(u, adam, t->master + i, t->m + i, adam ? t->v + i : NULL, i, \
			    ZK_UNDO_UNIT); \
			for (size_t j = i; j < i + ZK_UNDO_UNIT; j += ZK_W) \
				ZK_BODY(NT, j); \
		} \
	} \
	for (; i + ZK_W <= e; i += ZK_W) { \
		if (UNDO) \
			zk_undo_save(u, adam, t->master + i, t->m + i, adam ? t->v + i : NULL, i, ZK_W); \
		ZK_BODY(NT, i); \
	}
	if (nt && u != NULL) {
		ZK_MAIN_LOOP(true, true);
	} else if (nt) {
		ZK_MAIN_LOOP(true, false);
	} else if (u != NULL) {
		ZK_MAIN_LOOP(false, true);
	} else {
		ZK_MAIN_LOOP(false, false);
	}
#undef ZK_MAIN_LOOP
#undef ZK_BODY
	if (i < e)
		padded(k, optim, gdt, pdt, t, i, e - i, u);
	/* Streaming stores are weakly ordered: fence before the pool reports completion. */
	if (nt)
		_mm_sfence();
}

/* One specialized loop per (optimizer, grad dtype, param dtype), so no switch runs per element. */
#define ZK_CASE(O, G, P) case (G) * 4 + (P): run(&k, O, G, P, t, b, e, u); break
#define ZK_CASES_P(O, G) \
	ZK_CASE(O, G, ZK_DTYPE_F32); ZK_CASE(O, G, ZK_DTYPE_BF16); \
	ZK_CASE(O, G, ZK_DTYPE_F16); ZK_CASE(O, G, ZK_NO_PARAM)
#define ZK_CASES(O) \
	ZK_CASES_P(O, ZK_DTYPE_F32); ZK_CASES_P(O, ZK_DTYPE_BF16); ZK_CASES_P(O, ZK_DTYPE_F16)

void ZK_FN(zk_step)(const struct zk_consts *c, enum zk_optim optim, const struct zk_tensor *t,
    size_t b, size_t e, struct zk_undo *u)
{
	int sel = (int)t->grad_dtype * 4 + (t->param ? (int)t->param_dtype : ZK_NO_PARAM);
	struct vconsts k;

	vconsts_init(c, &k);
	switch (optim) {
	case ZK_OPTIM_ADAMW:
		switch (sel) { ZK_CASES(ZK_OPTIM_ADAMW); default: break; }
		break;
	case ZK_OPTIM_ADAM:
		switch (sel) { ZK_CASES(ZK_OPTIM_ADAM); default: break; }
		break;
	case ZK_OPTIM_ADAGRAD:
		switch (sel) { ZK_CASES(ZK_OPTIM_ADAGRAD); default: break; }
		break;
	case ZK_OPTIM_LION:
		switch (sel) { ZK_CASES(ZK_OPTIM_LION); default: break; }
		break;
	default:
		break;
	}
}

/* ZK_GRAD_LANES elements: vector j feeds lanes j*ZK_W .. j*ZK_W+ZK_W-1, in element order. */
ZK_INLINE void grad_block(vd *acc, uint64_t *bad, const char *g, int dt, vf inv_scale)
{
	size_t gs = dsize(dt);

	for (unsigned j = 0; j < ZK_GRAD_LANES / ZK_W; j++) {
		vf x = vf_mul(load_grad(g + j * ZK_W * gs, dt), inv_scale);
		vd lo = vd_from_lo(x), hi = vd_from_hi(x);

		*bad += vf_count_nonfinite(x);
		acc[2 * j] = vd_add(acc[2 * j], vd_mul(lo, lo));
		acc[2 * j + 1] = vd_add(acc[2 * j + 1], vd_mul(hi, hi));
	}
}

ZK_INLINE void grad_run(const char *g, int dt, float inv_scale, size_t b, size_t e,
    struct zk_grad_stats *stats)
{
	vd acc[ZK_GRAD_LANES / ZK_WD];
	double lanes[ZK_GRAD_LANES];
	size_t gs = dsize(dt), i = b;
	vf vinv = vf_set1(inv_scale);
	uint64_t bad = 0;

	for (unsigned j = 0; j < ZK_GRAD_LANES / ZK_WD; j++)
		acc[j] = vd_zero();
	for (; i + ZK_GRAD_LANES <= e; i += ZK_GRAD_LANES)
		grad_block(acc, &bad, g + i * gs, dt, vinv);
	if (i < e) {
		/* Zero padding adds +0 to a lane: exact, so the tail matches the scalar sum. */
		float tail[ZK_GRAD_LANES] = { 0 };

		memcpy(tail, g + i * gs, (e - i) * gs);
		grad_block(acc, &bad, (const char *)tail, dt, vinv);
	}
	for (unsigned j = 0; j < ZK_GRAD_LANES / ZK_WD; j++)
		vd_store(lanes + j * ZK_WD, acc[j]);
	stats->sumsq += zk_fold_lanes(lanes);
	stats->nonfinite += bad;
}

void ZK_FN(zk_grad)(const void *grad, enum zk_dtype dtype, float inv_scale, size_t b, size_t e,
    struct zk_grad_stats *stats)
{
	switch (dtype) {
	case ZK_DTYPE_BF16:
		grad_run(grad, ZK_DTYPE_BF16, inv_scale, b, e, stats);
		break;
	case ZK_DTYPE_F16:
		grad_run(grad, ZK_DTYPE_F16, inv_scale, b, e, stats);
		break;
	default:
		grad_run(grad, ZK_DTYPE_F32, inv_scale, b, e, stats);
		break;
	}
}

/* The step's memory traffic with the arithmetic taken out; see zk_step_memonly. */
ZK_INLINE void mem_body(int gdt, int pdt, bool nt, float *master, float *m, float *v,
    const void *grad, void *param)
{
	vf x = vf_load(master);

	if (gdt == ZK_DTYPE_F32) {
		vf gx = vf_load(grad);

		ZK_OPAQUE_V(gx);
	} else {
		vh gx = vh_load(grad);

		ZK_OPAQUE_V(gx);
	}
	ZK_OPAQUE_V(x);
	vf_store(master, x);
	if (m) {
		vf y = vf_load(m);

		ZK_OPAQUE_V(y);
		vf_store(m, y);
	}
	if (v) {
		vf y = vf_load(v);

		ZK_OPAQUE_V(y);
		vf_store(v, y);
	}
	if (pdt == ZK_DTYPE_F32) {
		if (nt)
			vf_stream(param, x);
		else
			vf_store(param, x);
	} else if (pdt != ZK_NO_PARAM) {
		if (nt)
			vh_stream(param, vh_from_vf(x));
		else
			vh_store(param, vh_from_vf(x));
	}
}

ZK_INLINE void mem_run(int gdt, int pdt, const struct zk_tensor *t, size_t b, size_t e)
{
	size_t gs = dsize(gdt), ps = dsize(pdt);
	const char *g = t->grad;
	char *param = t->param;
	size_t i = b;
	bool nt;
	size_t head = nt_split(pdt, param, ps, b, e, &nt);
	/* Head and tail are a few elements: the scalar probe does them. */
	if (head) {
		zk_memonly_scalar(t, i, i + head);
		i += head;
	}
	for (; i + ZK_W <= e; i += ZK_W)
		mem_body(gdt, pdt, nt, t->master + i, t->m ? t->m + i : NULL, t->v ? t->v + i : NULL,
		    g + i * gs, pdt != ZK_NO_PARAM ? param + i * ps : NULL);
	if (i < e)
		zk_memonly_scalar(t, i, e);
	if (nt)
		_mm_sfence();
}

#define ZK_MCASE(G, P) case (G) * 4 + (P): mem_run(G, P, t, b, e); break
#define ZK_MCASES_P(G) \
	ZK_MCASE(G, ZK_DTYPE_F32); ZK_MCASE(G, ZK_DTYPE_BF16); \
	ZK_MCASE(G, ZK_DTYPE_F16); ZK_MCASE(G, ZK_NO_PARAM)

void ZK_FN(zk_memonly)(const struct zk_tensor *t, size_t b, size_t e)
{
	int sel = (int)t->grad_dtype * 4 + (t->param ? (int)t->param_dtype : ZK_NO_PARAM);

	switch (sel) {
	ZK_MCASES_P(ZK_DTYPE_F32);
	ZK_MCASES_P(ZK_DTYPE_BF16);
	ZK_MCASES_P(ZK_DTYPE_F16);
	default:
		break;
	}
}
