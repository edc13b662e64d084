/* The compressed-state step and its memory-only probe: one body, built once per ISA (see meson.build). */
#include <string.h>

#include "quant_impl.h"
#include "simd.h"

/*
 * Bit-exact with zk_qstep_scalar (optim_q8.c): the fp32 step's operations in
 * its order, the codecs of quant_impl.h as integer and float vector ops, no
 * FMA.  q8 runs a block in two passes: the step, leaving the block's new m
 * and sqrt(v) in L1 buffers while master and param stream through; then the
 * encode, once the block's maxima are known.
 */

#define ZK_NO_PARAM ZK_DTYPE_COUNT

#if ZK_VEC_BITS == 512
ZK_INLINE vi vi_load_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
ZK_INLINE void vi_store_u8(uint8_t *p, vi x) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(x)); }
ZK_INLINE vi vi_set1(uint32_t x) { return _mm512_set1_epi32((int)x); }
ZK_INLINE vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
ZK_INLINE vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
ZK_INLINE vi vi_minu(vi a, vi b) { return _mm512_min_epu32(a, b); }
ZK_INLINE vi vi_maxs(vi a, vi b) { return _mm512_max_epi32(a, b); }
ZK_INLINE vi vi_maxu(vi a, vi b) { return _mm512_max_epu32(a, b); }
/* a | (b & c) in one vpternlogd */
ZK_INLINE vi vi_or_and(vi a, vi b, vi c) { return _mm512_ternarylogic_epi32(a, b, c, 0xf8); }
ZK_INLINE vi vi_zero(void) { return _mm512_setzero_si512(); }
ZK_INLINE vi vi_loadu(const uint32_t *p) { return _mm512_loadu_si512(p); }
ZK_INLINE vf vf_cast(vi x) { return _mm512_castsi512_ps(x); }
#define vi_srli(x, n) _mm512_srli_epi32((x), (n))
#define vi_slli(x, n) _mm512_slli_epi32((x), (n))
typedef __m128i vb;		/* ZK_W bytes */
ZK_INLINE vb vb_load(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
ZK_INLINE void vb_store(uint8_t *p, vb x) { _mm_storeu_si128((__m128i *)p, x); }
#else
ZK_INLINE vi vi_load_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
ZK_INLINE void vi_store_u8(uint8_t *p, vi x)
{
	__m128i w = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));

	_mm_storel_epi64((__m128i *)p, _mm_packus_epi16(w, w));
}
ZK_INLINE vi vi_set1(uint32_t x) { return _mm256_set1_epi32((int)x); }
ZK_INLINE vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
ZK_INLINE vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
ZK_INLINE vi vi_minu(vi a, vi b) { return _mm256_min_epu32(a, b); }
ZK_INLINE vi vi_maxs(vi a, vi b) { return _mm256_max_epi32(a, b); }
ZK_INLINE vi vi_maxu(vi a, vi b) { return _mm256_max_epu32(a, b); }
ZK_INLINE vi vi_or_and(vi a, vi b, vi c) { return _mm256_or_si256(a, _mm256_and_si256(b, c)); }
ZK_INLINE vi vi_zero(void) { return _mm256_setzero_si256(); }
ZK_INLINE vi vi_loadu(const uint32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
ZK_INLINE vf vf_cast(vi x) { return _mm256_castsi256_ps(x); }
#define vi_srli(x, n) _mm256_srli_epi32((x), (n))
#define vi_slli(x, n) _mm256_slli_epi32((x), (n))
typedef __m128i vb;		/* ZK_W bytes in the low half */
ZK_INLINE vb vb_load(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)p); }
ZK_INLINE void vb_store(uint8_t *p, vb x) { _mm_storel_epi64((__m128i *)p, x); }
#endif

ZK_INLINE size_t dsize(int dt)
{
	return dt == ZK_DTYPE_F32 ? 4 : dt == ZK_NO_PARAM ? 0 : 2;
}

struct qconsts {
	vf inv_scale, clip, decay, wd, lerp_w, lerp_omw, beta2, omb2, inv_bc2, eps, neg_step;
	vf offset;
	vi bias, absmask, m7f, sign80;
	bool l2, lerp_small, bc2_one, scale_one, clip_one;
};

static void qconsts_init(const struct zk_qconsts *qc, struct qconsts *k)
{
	const struct zk_consts *c = &qc->c;

	k->inv_scale = vf_set1(c->inv_scale);
	k->clip = vf_set1(c->clip);
	k->decay = vf_set1(c->decay);
	k->wd = vf_set1(c->wd);
	k->lerp_w = vf_set1(c->lerp_w);
	k->lerp_omw = vf_set1(c->lerp_omw);
	k->beta2 = vf_set1(c->beta2);
	k->omb2 = vf_set1(c->omb2);
	k->inv_bc2 = vf_set1(qc->inv_bc2_sqrt);
	k->eps = vf_set1(c->eps);
	k->neg_step = vf_set1(c->neg_step);
	k->offset = vf_set1(ZK_Q8_OFFSET);
	k->bias = vi_set1(ZK_Q8_BIAS);
	k->absmask = vi_set1(0x7fffffffu);
	k->m7f = vi_set1(0x7fu << 20);
	k->sign80 = vi_set1(0x80000000u);
	k->l2 = c->l2;
	k->lerp_small = c->lerp_small;
	k->bc2_one = qc->inv_bc2_sqrt == 1.0f;
	k->scale_one = c->inv_scale == 1.0f;
	k->clip_one = c->clip == 1.0f;
}

/* New m and sqrt(v) (and v, for bf16-moments) of one vector. */
struct moments {
	vf mi, vi, r;
};

/*
 * The fp32 AdamW/Adam step of one vector from decoded moments; master and
 * param written.  `common` (a constant in each specialized loop) is the
 * usual case: no loss scale, no clipping, 1 - beta1 < 0.5.  It keeps three
 * constants out of the loop, which then fits its registers.
 */
ZK_INLINE struct moments adam(const struct qconsts *k, bool common, int optim, int gdt,
    int pdt, bool nt, float *master, const void *grad, void *param, vf mo, vf vo)
{
	vf g = load_grad(grad, gdt), p = vf_load(master), d;
	struct moments o;

	if (!common && !k->scale_one)
		g = vf_mul(g, k->inv_scale);
	if (!common && !k->clip_one)
		g = vf_mul(g, k->clip);
	if (optim == ZK_OPTIM_ADAMW)
		p = vf_mul(p, k->decay);
	else if (k->l2)
		g = vf_add(g, vf_mul(k->wd, p));
	if (common || k->lerp_small)
		o.mi = vf_add(mo, vf_mul(k->lerp_w, vf_sub(g, mo)));
	else
		o.mi = vf_sub(g, vf_mul(vf_sub(g, mo), k->lerp_omw));
	o.vi = vf_add(vf_mul(vo, k->beta2), vf_mul(vf_mul(k->omb2, g), g));
	o.r = vf_sqrt(o.vi);
	d = o.r;
	if (!k->bc2_one)
		d = vf_mul(d, k->inv_bc2);
	d = vf_add(d, k->eps);
	p = vf_add(p, vf_div(vf_mul(k->neg_step, o.mi), d));
	vf_store(master, p);
	store_param(param, pdt, p, nt);
	return o;
}

/* ---- bf16-moments ---- */

ZK_INLINE void bf16_body(const struct qconsts *k, bool common, int optim, int gdt, int pdt,
    bool nt, float *master, uint16_t *m, uint16_t *v, const void *grad, void *param)
{
	struct moments o = adam(k, common, optim, gdt, pdt, nt, master, grad, param,
	    vf_from_bf16(vh_load(m)), vf_from_bf16(vh_load(v)));

	vh_store(m, vf_to_bf16(o.mi));
	vh_store(v, vf_to_bf16(o.vi));
}

/* Whole vectors from b on; the last few elements on zero-padded copies, like optim_simd.c. */
ZK_INLINE void bf16_run(const struct qconsts *k, bool common, int optim, int gdt, int pdt,
    bool nt, const struct zk_qtensor *t, size_t b, size_t e)
{
	size_t gs = dsize(gdt), ps = dsize(pdt), i = b;
	uint16_t *m = t->m, *v = t->v;
	const char *g = t->grad;
	char *param = t->param;

	for (; i + ZK_W <= e; i += ZK_W)
		bf16_body(k, common, optim, gdt, pdt, nt, t->master + i, m + i, v + i, g + i * gs,
		    pdt != ZK_NO_PARAM ? param + i * ps : NULL);
	if (i < e) {
		float lmaster[ZK_W] = { 0 }, lg[ZK_W] = { 0 }, lp[ZK_W];
		uint16_t lm[ZK_W] = { 0 }, lv[ZK_W] = { 0 };
		size_t cnt = e - i;

		memcpy(lmaster, t->master + i, cnt * 4);
		memcpy(lm, m + i, cnt * 2);
		memcpy(lv, v + i, cnt * 2);
		memcpy(lg, g + i * gs, cnt * gs);
		bf16_body(k, common, optim, gdt, pdt, false, lmaster, lm, lv, lg, lp);
		memcpy(t->master + i, lmaster, cnt * 4);
		memcpy(m + i, lm, cnt * 2);
		memcpy(v + i, lv, cnt * 2);
		if (pdt != ZK_NO_PARAM)
			memcpy(param + i * ps, lp, cnt * ps);
	}
}

/* ---- q8-moments ---- */

ZK_INLINE vf dec_m(const struct qconsts *k, vi c, vf um)
{
	/* The magnitude bits (20-26) and the bias (27-29) do not overlap: an or does the add. */
	vf a = vf_sub(vf_cast(vi_or_and(k->bias, vi_slli(c, 20), k->m7f)), k->offset);

	a = vf_mul(a, um);
	return vf_cast(vi_or_and(vf_bits(a), vi_slli(c, 24), k->sign80));
}

ZK_INLINE vf dec_r(const struct qconsts *k, vi c, vf ur)
{
	return vf_mul(vf_sub(vf_cast(vi_add(vi_slli(c, 19), k->bias)), k->offset), ur);
}

/* zk__q8_code on a vector: round z's bits at bit sh and unbias in one add, clamp. */
ZK_INLINE vi code(const struct qconsts *k, vf y, unsigned sh, uint32_t cmax)
{
	vi b = vf_bits(vf_add(y, k->offset));

	return vi_minu(vi_srli(vi_add(b, vi_set1((1u << (sh - 1)) - ZK_Q8_BIAS)), sh), vi_set1(cmax));
}

/* One vector of pass 1: decode, step; the caller keeps the new m and r and their maxima. */
ZK_INLINE struct moments q8_step(const struct qconsts *k, bool common, int optim, int gdt,
    int pdt, bool nt, float *master, const uint8_t *m, const uint8_t *v, const void *grad,
    void *param, vf um, vf ur)
{
	vf ro = dec_r(k, vi_load_u8(v), ur);

	return adam(k, common, optim, gdt, pdt, nt, master, grad, param,
	    dec_m(k, vi_load_u8(m), um), vf_mul(ro, ro));
}

ZK_INLINE uint32_t hmax(vi x)
{
#if ZK_VEC_BITS == 512
	return _mm512_reduce_max_epu32(x);
#else
	__m128i h = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));

	h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4e));
	h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xb1));
	return (uint32_t)_mm_cvtsi128_si32(h);
#endif
}

/* Pass 2 for one vector: new m and r from the buffers into codes. */
ZK_INLINE void q8_encode1(const struct qconsts *k, const float *bm, const float *br,
    uint8_t *m, uint8_t *v, vf qm, vf qr)
{
	vi x = vf_bits(vf_load(bm));
	vi cm = code(k, vf_mul(vf_cast(vi_and(x, k->absmask)), qm), 20, 127);

	vi_store_u8(m, vi_or_and(cm, vi_srli(x, 24), vi_set1(0x80)));
	vi_store_u8(v, code(k, vf_mul(vf_load(br), qr), 19, 255));
}

ZK_INLINE void q8_encode(const struct qconsts *k, const float *bm, const float *br,
    uint8_t *m, uint8_t *v, size_t nvec, vf qm, vf qr)
{
	for (size_t j = 0; j < nvec * ZK_W; j += ZK_W)
		q8_encode1(k, bm + j, br + j, m + j, v + j, qm, qr);
}

/*
 * Block by block: pass 1 steps the block, keeping its new m and sqrt(v) in
 * L1 buffers and their maxima in registers; pass 2 encodes them with the
 * block's new scales.
 */
ZK_INLINE void q8_run(const struct qconsts *k, bool common, int optim, int gdt, int pdt,
    bool nt, const struct zk_qtensor *t, size_t b, size_t e)
{
	size_t gs = dsize(gdt), ps = dsize(pdt);
	const char *g = t->grad;
	char *param = t->param;
	float bm[ZK_Q8_BLOCK], br[ZK_Q8_BLOCK];

	for (size_t blk = b; blk < e; blk += ZK_Q8_BLOCK) {
		size_t kb = blk / ZK_Q8_BLOCK, len = e - blk < ZK_Q8_BLOCK ? e - blk : ZK_Q8_BLOCK;
		uint8_t *m = (uint8_t *)t->m + blk, *v = (uint8_t *)t->v + blk;
		vf um = vf_set1(zk__q8_decode_mul(ZK_Q8_RCP_VMAX_M, t->m_scale[kb]));
		vf ur = vf_set1(zk__q8_decode_mul(ZK_Q8_RCP_VMAX_V, t->v_scale[kb]));
		vi mx_m = vi_zero(), mx_r = vi_zero();
		size_t j = 0;
		float sm, sr;
		vf qm, qr;

		for (; j + ZK_W <= len; j += ZK_W) {
			struct moments o = q8_step(k, common, optim, gdt, pdt, nt, t->master + blk + j,
			    m + j, v + j, g + (blk + j) * gs,
			    pdt != ZK_NO_PARAM ? param + (blk + j) * ps : NULL, um, ur);

			vf_store(bm + j, o.mi);
			vf_store(br + j, o.r);
			mx_m = vi_maxs(mx_m, vi_and(vf_bits(o.mi), k->absmask));
			mx_r = vi_maxu(mx_r, vf_bits(o.r));
		}
		if (j < len) {
			/* The tensor's last few elements: padded copies, the padding kept out of the maxima. */
			float lmaster[ZK_W] = { 0 }, lg[ZK_W] = { 0 }, lp[ZK_W];
			uint8_t lm[ZK_W] = { 0 }, lv[ZK_W] = { 0 };
			uint32_t mask[ZK_W] = { 0 };
			size_t cnt = len - j;
			struct moments o;
			vi lanes;

			memset(mask, 0xff, cnt * sizeof(uint32_t));
			lanes = vi_loadu(mask);
			memcpy(lmaster, t->master + blk + j, cnt * 4);
			memcpy(lm, m + j, cnt);
			memcpy(lv, v + j, cnt);
			memcpy(lg, g + (blk + j) * gs, cnt * gs);
			o = q8_step(k, common, optim, gdt, pdt, false, lmaster, lm, lv, lg, lp, um, ur);
			vf_store(bm + j, o.mi);
			vf_store(br + j, o.r);
			mx_m = vi_maxs(mx_m, vi_and(vi_and(vf_bits(o.mi), k->absmask), lanes));
			mx_r = vi_maxu(mx_r, vi_and(vf_bits(o.r), lanes));
			memcpy(t->master + blk + j, lmaster, cnt * 4);
			if (pdt != ZK_NO_PARAM)
				memcpy(param + (blk + j) * ps, lp, cnt * ps);
		}
		sm = zk__bits_f32(hmax(mx_m));
		sr = zk__bits_f32(hmax(mx_r));
		t->m_scale[kb] = sm;
		t->v_scale[kb] = sr;
		qm = vf_set1(zk__q8_encode_mul(ZK_Q8_VMAX_M, sm));
		qr = vf_set1(zk__q8_encode_mul(ZK_Q8_VMAX_V, sr));
		if (len == ZK_Q8_BLOCK) {
			q8_encode(k, bm, br, m, v, ZK_Q8_BLOCK / ZK_W, qm, qr);
		} else {
			uint8_t cm[ZK_Q8_BLOCK], cv[ZK_Q8_BLOCK];

			q8_encode(k, bm, br, cm, cv, (len + ZK_W - 1) / ZK_W, qm, qr);
			memcpy(m, cm, len);
			memcpy(v, cv, len);
		}
	}
}

/* Streaming stores when the range's param starts on a whole vector store (every later vector then does). */
static bool nt_ok(const void *param, size_t esize)
{
	return esize && (uintptr_t)param % (ZK_W * esize) == 0;
}

ZK_INLINE void qrun(const struct qconsts *kp, int optim, int gdt, int pdt,
    const struct zk_qtensor *t, size_t b, size_t e)
{
	/*
	 * A copy whose address never leaves these inlined functions: vector types
	 * may alias anything, so through kp every store would force the flags and
	 * constants to be read again inside the loops.
	 */
	const struct qconsts kk = *kp, *k = &kk;
	bool nt = pdt != ZK_NO_PARAM && nt_ok((char *)t->param + b * dsize(pdt), dsize(pdt));

	bool common = k->scale_one && k->clip_one && k->lerp_small;

#define ZK_RUN(FN) do { \
		if (common && nt) FN(k, true, optim, gdt, pdt, true, t, b, e); \
		else if (common) FN(k, true, optim, gdt, pdt, false, t, b, e); \
		else if (nt) FN(k, false, optim, gdt, pdt, true, t, b, e); \
		else FN(k, false, optim, gdt, pdt, false, t, b, e); \
	} while (0)
	if (t->format == ZK_STATE_BF16)
		ZK_RUN(bf16_run);
	else
		ZK_RUN(q8_run);
#undef ZK_RUN
	/* Streaming stores are weakly ordered: fence before the pool reports completion. */
	if (nt)
		_mm_sfence();
}

/*
 * One function per (optimizer, grad dtype, param dtype): each loop gets a
 * register allocation of its own (as one function, they spilled the block
 * maxima to the stack).
 */
#define ZK_DEF(O, G, P) \
	static __attribute__((noinline)) void run_##O##_##G##_##P(const struct qconsts *k, \
	    const struct zk_qtensor *t, size_t b, size_t e) \
	{ \
		qrun(k, O, G, P, t, b, e); \
	}
#define ZK_DEFS_P(O, G) \
	ZK_DEF(O, G, ZK_DTYPE_F32) ZK_DEF(O, G, ZK_DTYPE_BF16) \
	ZK_DEF(O, G, ZK_DTYPE_F16) ZK_DEF(O, G, ZK_NO_PARAM)
#define ZK_DEFS(O) \
	ZK_DEFS_P(O, ZK_DTYPE_F32) ZK_DEFS_P(O, ZK_DTYPE_BF16) ZK_DEFS_P(O, ZK_DTYPE_F16)
ZK_DEFS(ZK_OPTIM_ADAMW)
ZK_DEFS(ZK_OPTIM_ADAM)

#define ZK_CASE(O, G, P) case (G) * 4 + (P): run_##O##_##G##_##P(&k, t, b, e); break
#define ZK_CASES_P(O, G) \
	ZK_CASE(O, G, ZK_DTYPE_F32); ZK_CASE(O, G, ZK_DTYPE_BF16); \
	ZK_CASE(O, G, ZK_DTYPE_F16); ZK_CASE(O, G, ZK_NO_PARAM)
#define ZK_CASES(O) \
	ZK_CASES_P(O, ZK_DTYPE_F32); ZK_CASES_P(O, ZK_DTYPE_BF16); ZK_CASES_P(O, ZK_DTYPE_F16)

void ZK_FN(zk_qstep)(const struct zk_qconsts *c, enum zk_optim optim, const struct zk_qtensor *t,
    size_t b, size_t e)
{
	int sel = (int)t->grad_dtype * 4 + (t->param ? (int)t->param_dtype : ZK_NO_PARAM);
	struct qconsts k;

	qconsts_init(c, &k);
	if (optim == ZK_OPTIM_ADAMW) {
		switch (sel) { ZK_CASES(ZK_OPTIM_ADAMW); default: break; }
	} else {
		switch (sel) { ZK_CASES(ZK_OPTIM_ADAM); default: break; }
	}
}

/* ---- memory-only probe: the same loads and stores, no arithmetic ---- */

ZK_INLINE void qmem_body(int gdt, int pdt, int ms, bool nt, float *master, uint8_t *m,
    uint8_t *v, const void *grad, void *param)
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
	if (ms == 2) {
		vh a = vh_load((uint16_t *)m), c = vh_load((uint16_t *)v);

		ZK_OPAQUE_V(a);
		ZK_OPAQUE_V(c);
		vh_store((uint16_t *)m, a);
		vh_store((uint16_t *)v, c);
	} else {
		vb a = vb_load(m), c = vb_load(v);

		ZK_OPAQUE_V(a);
		ZK_OPAQUE_V(c);
		vb_store(m, a);
		vb_store(v, c);
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

ZK_INLINE void qmem_run(int gdt, int pdt, int ms, const struct zk_qtensor *t, size_t b, size_t e)
{
	size_t gs = dsize(gdt), ps = dsize(pdt), i = b;
	const char *g = t->grad;
	char *param = t->param, *m = t->m, *v = t->v;
	bool nt = pdt != ZK_NO_PARAM && nt_ok(param + b * ps, ps);

	for (; i + ZK_W <= e; i += ZK_W) {
		if (ms == 1 && i % ZK_Q8_BLOCK == 0) {
			size_t kb = i / ZK_Q8_BLOCK;
			float sm = t->m_scale[kb], sr = t->v_scale[kb];

			__asm__ volatile("" : "+x"(sm), "+x"(sr));
			t->m_scale[kb] = sm;
			t->v_scale[kb] = sr;
		}
		qmem_body(gdt, pdt, ms, nt, t->master + i, (uint8_t *)m + i * ms,
		    (uint8_t *)v + i * ms, g + i * gs, pdt != ZK_NO_PARAM ? param + i * ps : NULL);
	}
	if (i < e)
		zk_qmemonly_scalar(t, i, e);
	if (nt)
		_mm_sfence();
}

#define ZK_MCASE(G, P) case (G) * 4 + (P): \
	if (t->format == ZK_STATE_Q8) qmem_run(G, P, 1, t, b, e); else qmem_run(G, P, 2, t, b, e); \
	break
#define ZK_MCASES_P(G) \
	ZK_MCASE(G, ZK_DTYPE_F32); ZK_MCASE(G, ZK_DTYPE_BF16); \
	ZK_MCASE(G, ZK_DTYPE_F16); ZK_MCASE(G, ZK_NO_PARAM)

void ZK_FN(zk_qmemonly)(const struct zk_qtensor *t, size_t b, size_t e)
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
