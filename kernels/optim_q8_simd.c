/* The compressed-state step and its memory-only probe: one body, built once per ISA (see meson.build). */
#include <string.h>

#include "quant_impl.h"
#include "simd.h"

/*
 * Bit-exact with zk_qstep_scalar (optim_q8.c): the same operations in the
 * same order (bf16-moments: the fp32 step's, no FMA; q8-moments: fused as
 * quant.h writes them, the codecs of quant_impl.h as integer and float
 * vector ops; explicit fma intrinsics, which -ffp-contract=off leaves
 * alone).  q8 runs a block in two passes: the step, leaving the block's new m
 * and sqrt(v) in L1 buffers while master and param stream through; then the
 * encode, once the block's maxima are known.
 */

#define ZK_NO_PARAM ZK_DTYPE_COUNT

/*
 * Software prefetch, ZK_PF_AHEAD elements ahead, one call per ZK_PF_EVERY
 * elements (whole lines of every stream).  The step alone is near the
 * memory-only limit only if the loads are in flight while the core works
 * on the decode and encode; the hardware prefetchers alone left one core
 * at 0.80-0.88 of its limit (q8-moments), with them 0.95-1.0.  Prefetches
 * past the end of an array are harmless (they never fault), and the
 * addresses are formed as integers so no pointer leaves its object.
 */
#define ZK_PF_AHEAD 1024
#define ZK_PF_EVERY 64

ZK_INLINE void prefetch_line(const void *p, size_t off)
{
	_mm_prefetch((const char *)((uintptr_t)p + off), _MM_HINT_T0);
}

ZK_INLINE void prefetch_ahead(const void *master, size_t mb, const void *m, const void *v,
    const void *g, size_t gs, size_t ms)
{
	for (size_t b = 0; b < ZK_PF_EVERY * mb; b += 64)
		prefetch_line(master, ZK_PF_AHEAD * mb + b);
	for (size_t b = 0; b < ZK_PF_EVERY * gs; b += 64)
		prefetch_line(g, ZK_PF_AHEAD * gs + b);
	for (size_t b = 0; b < ZK_PF_EVERY * ms; b += 64) {
		prefetch_line(m, ZK_PF_AHEAD * ms + b);
		prefetch_line(v, ZK_PF_AHEAD * ms + b);
	}
}

/* The AVX512_BF16 build (meson.build) names its entry zk_qstep_avx512bf16. */
#ifdef ZK_Q8_BF16
#define ZK_QFN(name) name##_avx512bf16
#else
#define ZK_QFN(name) ZK_FN(name)
#endif

/*
 * bf16 rounding of the stores: vcvtneps2bf16 rounds to nearest even and
 * quiets NaNs as zk__f32_to_bf16 does, but takes subnormal inputs as zero;
 * a vector holding one (rare: |x| < 2^-126) goes the integer way.
 */
#ifdef ZK_Q8_BF16
ZK_INLINE vh q_bf16(vf x)
{
	vh r = (vh)_mm512_cvtneps_pbh(x);

	if (__builtin_expect(_mm512_fpclass_ps_mask(x, 0x20) != 0, 0))
		r = vf_to_bf16(x);
	return r;
}
#else
#define q_bf16 vf_to_bf16
#endif
ZK_INLINE void q_store_param(void *p, int dt, vf x, bool nt)
{
	if (dt == ZK_DTYPE_BF16) {
		if (nt)
			vh_stream(p, q_bf16(x));
		else
			vh_store(p, q_bf16(x));
	} else {
		store_param(p, dt, x, nt);
	}
}

#if ZK_VEC_BITS == 512
ZK_INLINE vi vi_load_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
ZK_INLINE void vi_store_u8(uint8_t *p, vi x) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(x)); }
ZK_INLINE vi vi_set1(uint32_t x) { return _mm512_set1_epi32((int)x); }
ZK_INLINE vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
ZK_INLINE vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
ZK_INLINE vi vi_maxs(vi a, vi b) { return _mm512_max_epi32(a, b); }
ZK_INLINE vi vi_maxu(vi a, vi b) { return _mm512_max_epu32(a, b); }
/* a | (b & c) in one vpternlogd */
ZK_INLINE vi vi_or_and(vi a, vi b, vi c) { return _mm512_ternarylogic_epi32(a, b, c, 0xf8); }
ZK_INLINE vi vi_zero(void) { return _mm512_setzero_si512(); }
ZK_INLINE vi vi_loadu(const uint32_t *p) { return _mm512_loadu_si512(p); }
ZK_INLINE vf vf_cast(vi x) { return _mm512_castsi512_ps(x); }
ZK_INLINE vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
ZK_INLINE vi vi_xor(vi a, vi b) { return _mm512_xor_si512(a, b); }
ZK_INLINE vi vi_mullo(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
ZK_INLINE vi vi_iota(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
/* Lanes below 2^16 to 16 bits. */
ZK_INLINE vh vi_pack16(vi r) { return _mm512_cvtepi32_epi16(r); }
/* Sign-extended bytes: the sign of m lands on bit 31 after the shift by 24. */
ZK_INLINE vi vi_load_s8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
/* (a & ~mask) | (b & mask) in one vpternlogd */
ZK_INLINE vi vi_blend_bits(vi a, vi b, vi mask) { return _mm512_ternarylogic_epi32(mask, b, a, 0xca); }
/* a ^ (b & c) in one vpternlogd */
ZK_INLINE vi vi_xor_and(vi a, vi b, vi c) { return _mm512_ternarylogic_epi32(a, b, c, 0x78); }
#define vi_srli(x, n) _mm512_srli_epi32((x), (n))
#define vi_slli(x, n) _mm512_slli_epi32((x), (n))
#else
ZK_INLINE vi vi_load_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
/* The low byte of each lane, as vpmovdb keeps it (codes are not clamped: quant_impl.h). */
ZK_INLINE void vi_store_u8(uint8_t *p, vi x)
{
	const __m256i lo8 = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
	    0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
	__m256i b = _mm256_shuffle_epi8(x, lo8);

	_mm_storel_epi64((__m128i *)p, _mm_unpacklo_epi32(_mm256_castsi256_si128(b),
	    _mm256_extracti128_si256(b, 1)));
}
ZK_INLINE vi vi_set1(uint32_t x) { return _mm256_set1_epi32((int)x); }
ZK_INLINE vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
ZK_INLINE vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
ZK_INLINE vi vi_maxs(vi a, vi b) { return _mm256_max_epi32(a, b); }
ZK_INLINE vi vi_maxu(vi a, vi b) { return _mm256_max_epu32(a, b); }
ZK_INLINE vi vi_or_and(vi a, vi b, vi c) { return _mm256_or_si256(a, _mm256_and_si256(b, c)); }
ZK_INLINE vi vi_zero(void) { return _mm256_setzero_si256(); }
ZK_INLINE vi vi_loadu(const uint32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
ZK_INLINE vf vf_cast(vi x) { return _mm256_castsi256_ps(x); }
ZK_INLINE vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
ZK_INLINE vi vi_xor(vi a, vi b) { return _mm256_xor_si256(a, b); }
ZK_INLINE vi vi_mullo(vi a, vi b) { return _mm256_mullo_epi32(a, b); }
ZK_INLINE vi vi_iota(void) { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
ZK_INLINE vh vi_pack16(vi r)
{
	r = _mm256_packus_epi32(r, r);
	return _mm256_castsi256_si128(_mm256_permute4x64_epi64(r, 0x08));
}
ZK_INLINE vi vi_load_s8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
ZK_INLINE vi vi_blend_bits(vi a, vi b, vi mask)
{
	return _mm256_or_si256(_mm256_andnot_si256(mask, a), _mm256_and_si256(b, mask));
}
ZK_INLINE vi vi_xor_and(vi a, vi b, vi c) { return _mm256_xor_si256(a, _mm256_and_si256(b, c)); }
#define vi_srli(x, n) _mm256_srli_epi32((x), (n))
#define vi_slli(x, n) _mm256_slli_epi32((x), (n))
#endif

ZK_INLINE size_t dsize(int dt)
{
	return dt == ZK_DTYPE_F32 ? 4 : dt == ZK_NO_PARAM ? 0 : 2;
}

struct qconsts {
	vf inv_scale, clip, decay, wd, lerp_w, lerp_omw, beta2, omb2, inv_bc2, eps, neg_step;
	vf offset;
	vi bias, absmask, m87f, sign80, lo80, km, kv;
	uint32_t sr_key;
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
	k->m87f = vi_set1(0x87f00000u);
	k->lo80 = vi_set1(0x80);
	k->km = vi_set1((1u << 19) - ZK_Q8_BIAS);
	k->kv = vi_set1((1u << 18) - ZK_Q8_BIAS);
	k->sign80 = vi_set1(0x80000000u);
	k->sr_key = qc->sr_key;
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
	q_store_param(param, pdt, p, nt);
	return o;
}

/* ---- bf16-moments ---- */

ZK_INLINE void bf16_body(const struct qconsts *k, bool common, int optim, int gdt, int pdt,
    bool nt, float *master, uint16_t *m, uint16_t *v, const void *grad, void *param)
{
	struct moments o = adam(k, common, optim, gdt, pdt, nt, master, grad, param,
	    vf_from_bf16(vh_load(m)), vf_from_bf16(vh_load(v)));

	vh_store(m, q_bf16(o.mi));
	vh_store(v, q_bf16(o.vi));
}

/* Whole vectors from b on; the last few elements on zero-padded copies, like optim_simd.c. */
ZK_INLINE void bf16_run(const struct qconsts *k, bool common, int optim, int gdt, int pdt,
    bool nt, const struct zk_qtensor *t, size_t b, size_t e, struct zk_undo *u)
{
	size_t gs = dsize(gdt), ps = dsize(pdt), i = b;
	uint16_t *m = t->m, *v = t->v;
	const char *g = t->grad;
	char *param = t->param;

	for (; i + ZK_W <= e; i += ZK_W) {
		if (i % ZK_PF_EVERY == 0)
			prefetch_ahead(t->master + i, 4, m + i, v + i, g + i * gs, gs, 2);
		if (u != NULL)
			zk_qundo_save(u, t, i, ZK_W, 4, 2, false);
		bf16_body(k, common, optim, gdt, pdt, nt, t->master + i, m + i, v + i, g + i * gs,
		    pdt != ZK_NO_PARAM ? param + i * ps : NULL);
	}
	if (i < e) {
		float lmaster[ZK_W] = { 0 }, lg[ZK_W] = { 0 }, lp[ZK_W];
		uint16_t lm[ZK_W] = { 0 }, lv[ZK_W] = { 0 };
		size_t cnt = e - i;

		memcpy(lmaster, t->master + i, cnt * 4);
		memcpy(lm, m + i, cnt * 2);
		memcpy(lv, v + i, cnt * 2);
		memcpy(lg, g + i * gs, cnt * gs);
		if (u != NULL)
			zk_qundo_save(u, t, i, cnt, 4, 2, false);
		bf16_body(k, common, optim, gdt, pdt, false, lmaster, lm, lv, lg, lp);
		memcpy(t->master + i, lmaster, cnt * 4);
		memcpy(m + i, lm, cnt * 2);
		memcpy(v + i, lv, cnt * 2);
		if (pdt != ZK_NO_PARAM)
			memcpy(param + i * ps, lp, cnt * ps);
	}
}

/* ---- q8-moments ---- */

/*
 * The step of the 8-bit formats (adam_elem_q8 in optim_q8.c): the fp32
 * step's formulas with the multiply-adds fused.  Returns the new master
 * value (not stored); the new m and sqrt(v) come back in *mi and *r.
 */
ZK_INLINE vf adam_q8(const struct qconsts *k, bool common, int optim, vf g, vf p, vf mo, vf ro,
    vf *mi, vf *r)
{
	vf vi_;

	if (!common && !k->scale_one)
		g = vf_mul(g, k->inv_scale);
	if (!common && !k->clip_one)
		g = vf_mul(g, k->clip);
	if (optim == ZK_OPTIM_ADAM && k->l2)
		g = vf_fma(k->wd, p, g);
	if (common || k->lerp_small)
		*mi = vf_fma(k->lerp_w, vf_sub(g, mo), mo);
	else
		*mi = vf_fma(vf_sub(mo, g), k->lerp_omw, g);
	vi_ = vf_fma(vf_mul(ro, ro), k->beta2, vf_mul(vf_mul(k->omb2, g), g));
	*r = vf_sqrt(vi_);
	/* fma(r, 1, eps) is r + eps: the late-training shortcut keeps the bits. */
	g = k->bc2_one ? vf_add(*r, k->eps) : vf_fma(*r, k->inv_bc2, k->eps);
	g = vf_div(vf_mul(k->neg_step, *mi), g);
	return optim == ZK_OPTIM_ADAMW ? vf_fma(p, k->decay, g) : vf_add(p, g);
}

/* A block's decode constants as quant_impl.h has them: u and c0 (m's with the sign bit set). */
struct qblk {
	vf um, ur, cr_neg;
	vi cm_signed;
};

ZK_INLINE struct qblk qblk_init(float sm, float sr)
{
	float um = zk__q8_decode_mul(ZK_Q8_RCP_VMAX_M, sm), ur = zk__q8_decode_mul(ZK_Q8_RCP_VMAX_V, sr);
	struct qblk q;

	q.um = vf_set1(um);
	q.ur = vf_set1(ur);
	q.cr_neg = vf_set1(-(ZK_Q8_OFFSET * ur));
	q.cm_signed = vi_set1(zk__f32_bits(ZK_Q8_OFFSET * um) | 0x80000000u);
	return q;
}

/*
 * zk__q8_decode_m: sign-extended, the byte shifted by 20 has the sign on
 * bit 31 and the magnitude on bits 20-26; one ternlog keeps those and puts
 * in the exponent bias, another gives -c0 the opposite sign.
 */
ZK_INLINE vf dec_m(const struct qconsts *k, const struct qblk *q, const uint8_t *p)
{
	vi t = vi_or_and(k->bias, vi_slli(vi_load_s8(p), 20), k->m87f);

	return vf_fma(vf_cast(t), q->um, vf_cast(vi_xor_and(q->cm_signed, t, k->sign80)));
}

ZK_INLINE vf dec_r(const struct qconsts *k, const struct qblk *q, const uint8_t *p)
{
	return vf_fma(vf_cast(vi_add(vi_slli(vi_load_u8(p), 19), k->bias)), q->ur, q->cr_neg);
}

/* zk__sr_bf16 with zk__sr_bits(hk, j) for the lanes' indices lo32(j) in idx. */
ZK_INLINE vh sr_bf16(vf p, vi hk, vi idx)
{
	vi h = vi_mullo(vi_xor(idx, hk), vi_set1(0x7feb352du));

	h = vi_mullo(vi_xor(h, vi_srli(h, 15)), vi_set1(0x846ca68bu));
	return vi_pack16(vi_srli(vi_add(vf_bits(p), vi_srli(h, 16)), 16));
}

/*
 * One vector of pass 1: decode, step, master and param written; new m and r
 * returned.  bm16 (bf16-master+q8): master is bf16, rounded stochastically,
 * and param is the stored master's value.
 */
ZK_INLINE void q8_step(const struct qconsts *k, const struct qblk *q, bool common, int optim,
    int gdt, int pdt, bool nt, bool bm16, void *master, const uint8_t *m, const uint8_t *v,
    const void *grad, void *param, vi hk, vi idx, vf *mi, vf *r)
{
	vf p = bm16 ? vf_from_bf16(vh_load(master)) : vf_load(master);

	p = adam_q8(k, common, optim, load_grad(grad, gdt), p, dec_m(k, q, m), dec_r(k, q, v), mi, r);
	if (!bm16) {
		vf_store(master, p);
		q_store_param(param, pdt, p, nt);
		return;
	}
	vh h = sr_bf16(p, hk, idx);

	vh_store(master, h);
	if (pdt == ZK_DTYPE_BF16) {
		if (nt)
			vh_stream(param, h);
		else
			vh_store(param, h);
	} else {
		store_param(param, pdt, vf_from_bf16(h), nt);
	}
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

/* Pass 2 for one vector: zk__q8_encode_m and _r, the low byte of each lane kept. */
ZK_INLINE void q8_encode1(const struct qconsts *k, const float *bm, const float *br,
    uint8_t *m, uint8_t *v, vf qm, vf qr)
{
	vi x = vf_bits(vf_load(bm));
	vi cm = vi_srli(vi_add(vf_bits(vf_fma(vf_cast(vi_and(x, k->absmask)), qm, k->offset)), k->km), 20);
	vi cv = vi_srli(vi_add(vf_bits(vf_fma(vf_load(br), qr, k->offset)), k->kv), 19);

	vi_store_u8(m, vi_blend_bits(cm, vi_srli(x, 24), k->lo80));
	vi_store_u8(v, cv);
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
    bool nt, bool bm16, const struct zk_qtensor *t, size_t b, size_t e, struct zk_undo *u)
{
	size_t gs = dsize(gdt), ps = dsize(pdt), mb = bm16 ? 2 : 4;
	const char *g = t->grad;
	char *param = t->param, *master = (char *)t->master;
	float bm[ZK_Q8_BLOCK], br[ZK_Q8_BLOCK];

	for (size_t blk = b; blk < e; blk += ZK_Q8_BLOCK) {
		size_t kb = blk / ZK_Q8_BLOCK, len = e - blk < ZK_Q8_BLOCK ? e - blk : ZK_Q8_BLOCK;
		uint8_t *m = (uint8_t *)t->m + blk, *v = (uint8_t *)t->v + blk;
		struct qblk q = qblk_init(t->m_scale[kb], t->v_scale[kb]);
		vi mx_m = vi_zero(), mx_r = vi_zero(), hk = vi_zero(), idx = vi_zero();
		size_t j = 0;
		float sm, sr;
		vf qm, qr, mi, r;

		/*
		 * The block's codes, scales and master as they were, before pass 1
		 * stores any (just prefetched: from L1).  A whole block's sizes are
		 * constants, so the copy is inlined vector moves; a call here would
		 * spill the loop's vector registers (measured 1.7x the step).
		 */
		if (u != NULL && len == ZK_Q8_BLOCK)
			zk_qundo_save(u, t, blk, ZK_Q8_BLOCK, mb, 1, true);
		else if (u != NULL)
			zk_qundo_save(u, t, blk, len, mb, 1, true);
		if (bm16) {
			hk = vi_set1(zk__sr_block_key(k->sr_key, t->base + blk));
			idx = vi_add(vi_set1((uint32_t)(t->base + blk)), vi_iota());
		}
		for (; j + ZK_W <= len; j += ZK_W) {
			if (j % ZK_PF_EVERY == 0)
				prefetch_ahead(master + (blk + j) * mb, mb, m + j, v + j, g + (blk + j) * gs, gs, 1);
			q8_step(k, &q, common, optim, gdt, pdt, nt, bm16, master + (blk + j) * mb, m + j,
			    v + j, g + (blk + j) * gs, pdt != ZK_NO_PARAM ? param + (blk + j) * ps : NULL,
			    hk, idx, &mi, &r);
			if (bm16)
				idx = vi_add(idx, vi_set1(ZK_W));
			vf_store(bm + j, mi);
			vf_store(br + j, r);
			mx_m = vi_maxs(mx_m, vi_and(vf_bits(mi), k->absmask));
			mx_r = vi_maxu(mx_r, vf_bits(r));
		}
		if (j < len) {
			/* The tensor's last few elements: padded copies, the padding kept out of the maxima. */
			float lmaster[ZK_W] = { 0 }, lg[ZK_W] = { 0 }, lp[ZK_W];
			uint8_t lm[ZK_W] = { 0 }, lv[ZK_W] = { 0 };
			uint32_t mask[ZK_W] = { 0 };
			size_t cnt = len - j;
			vi lanes;

			memset(mask, 0xff, cnt * sizeof(uint32_t));
			lanes = vi_loadu(mask);
			memcpy(lmaster, master + (blk + j) * mb, cnt * mb);
			memcpy(lm, m + j, cnt);
			memcpy(lv, v + j, cnt);
			memcpy(lg, g + (blk + j) * gs, cnt * gs);
			q8_step(k, &q, common, optim, gdt, pdt, false, bm16, lmaster, lm, lv, lg, lp, hk,
			    idx, &mi, &r);
			vf_store(bm + j, mi);
			vf_store(br + j, r);
			mx_m = vi_maxs(mx_m, vi_and(vi_and(vf_bits(mi), k->absmask), lanes));
			mx_r = vi_maxu(mx_r, vi_and(vf_bits(r), lanes));
			memcpy(master + (blk + j) * mb, lmaster, cnt * mb);
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
    const struct zk_qtensor *t, size_t b, size_t e, struct zk_undo *u)
{
	/*
	 * A copy whose address never leaves these inlined functions: vector types
	 * may alias anything, so through kp every store would force the flags and
	 * constants to be read again inside the loops.
	 */
	const struct qconsts kk = *kp, *k = &kk;
	bool nt = pdt != ZK_NO_PARAM && nt_ok((char *)t->param + b * dsize(pdt), dsize(pdt));

	bool common = k->scale_one && k->clip_one && k->lerp_small;

#define ZK_RUN(FN, ...) do { \
		if (common && nt) FN(k, true, optim, gdt, pdt, true, __VA_ARGS__ t, b, e, u); \
		else if (common) FN(k, true, optim, gdt, pdt, false, __VA_ARGS__ t, b, e, u); \
		else if (nt) FN(k, false, optim, gdt, pdt, true, __VA_ARGS__ t, b, e, u); \
		else FN(k, false, optim, gdt, pdt, false, __VA_ARGS__ t, b, e, u); \
	} while (0)
	if (t->format == ZK_STATE_BF16)
		ZK_RUN(bf16_run, );
	else if (t->format == ZK_STATE_Q8)
		ZK_RUN(q8_run, false, );
	else
		ZK_RUN(q8_run, true, );
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
	    const struct zk_qtensor *t, size_t b, size_t e, struct zk_undo *u) \
	{ \
		qrun(k, O, G, P, t, b, e, u); \
	}
#define ZK_DEFS_P(O, G) \
	ZK_DEF(O, G, ZK_DTYPE_F32) ZK_DEF(O, G, ZK_DTYPE_BF16) \
	ZK_DEF(O, G, ZK_DTYPE_F16) ZK_DEF(O, G, ZK_NO_PARAM)
#define ZK_DEFS(O) \
	ZK_DEFS_P(O, ZK_DTYPE_F32) ZK_DEFS_P(O, ZK_DTYPE_BF16) ZK_DEFS_P(O, ZK_DTYPE_F16)
ZK_DEFS(ZK_OPTIM_ADAMW)
ZK_DEFS(ZK_OPTIM_ADAM)

#define ZK_CASE(O, G, P) case (G) * 4 + (P): run_##O##_##G##_##P(&k, t, b, e, u); break
#define ZK_CASES_P(O, G) \
	ZK_CASE(O, G, ZK_DTYPE_F32); ZK_CASE(O, G, ZK_DTYPE_BF16); \
	ZK_CASE(O, G, ZK_DTYPE_F16); ZK_CASE(O, G, ZK_NO_PARAM)
#define ZK_CASES(O) \
	ZK_CASES_P(O, ZK_DTYPE_F32); ZK_CASES_P(O, ZK_DTYPE_BF16); ZK_CASES_P(O, ZK_DTYPE_F16)

void ZK_QFN(zk_qstep)(const struct zk_qconsts *c, enum zk_optim optim, const struct zk_qtensor *t,
    size_t b, size_t e, struct zk_undo *u)
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

#ifndef ZK_Q8_BF16	/* the probe has no bf16 rounding to speed up: built once per ISA */

/* ---- memory-only probe: the same loads and stores, no arithmetic ---- */

#if ZK_VEC_BITS == 512
typedef __m128i vb;		/* ZK_W bytes */
ZK_INLINE vb vb_load(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
ZK_INLINE void vb_store(uint8_t *p, vb x) { _mm_storeu_si128((__m128i *)p, x); }
#else
typedef __m128i vb;		/* ZK_W bytes in the low half */
ZK_INLINE vb vb_load(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)p); }
ZK_INLINE void vb_store(uint8_t *p, vb x) { _mm_storel_epi64((__m128i *)p, x); }
#endif

ZK_INLINE void qmem_body(int gdt, int pdt, int ms, int mb, bool nt, void *master, uint8_t *m,
    uint8_t *v, const void *grad, void *param)
{
	vf x;

	if (mb == 4) {
		x = vf_load(master);
		ZK_OPAQUE_V(x);
		vf_store(master, x);
	} else {
		vh h = vh_load(master);

		ZK_OPAQUE_V(h);
		vh_store(master, h);
		x = vf_from_bf16(h);	/* what a bf16 master gives an fp32 param */
	}
	if (gdt == ZK_DTYPE_F32) {
		vf gx = vf_load(grad);

		ZK_OPAQUE_V(gx);
	} else {
		vh gx = vh_load(grad);

		ZK_OPAQUE_V(gx);
	}
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

ZK_INLINE void qmem_run(int gdt, int pdt, int ms, int mb, const struct zk_qtensor *t, size_t b,
    size_t e)
{
	size_t gs = dsize(gdt), ps = dsize(pdt), i = b;
	const char *g = t->grad;
	char *param = t->param, *m = t->m, *v = t->v;
	bool nt = pdt != ZK_NO_PARAM && nt_ok(param + b * ps, ps);

	for (; i + ZK_W <= e; i += ZK_W) {
		/* The steps' prefetches too: the limit is for the same memory traffic, hints included. */
		if (i % ZK_PF_EVERY == 0)
			prefetch_ahead((char *)t->master + i * mb, mb, m + i * ms, v + i * ms, g + i * gs, gs, ms);
		if (ms == 1 && i % ZK_Q8_BLOCK == 0) {
			size_t kb = i / ZK_Q8_BLOCK;
			float sm = t->m_scale[kb], sr = t->v_scale[kb];

			__asm__ volatile("" : "+x"(sm), "+x"(sr));
			t->m_scale[kb] = sm;
			t->v_scale[kb] = sr;
		}
		qmem_body(gdt, pdt, ms, mb, nt, (char *)t->master + i * mb, (uint8_t *)m + i * ms,
		    (uint8_t *)v + i * ms, g + i * gs, pdt != ZK_NO_PARAM ? param + i * ps : NULL);
	}
	if (i < e)
		zk_qmemonly_scalar(t, i, e);
	if (nt)
		_mm_sfence();
}

#define ZK_MCASE(G, P) case (G) * 4 + (P): \
	if (t->format == ZK_STATE_Q8) qmem_run(G, P, 1, 4, t, b, e); \
	else if (t->format == ZK_STATE_BF16) qmem_run(G, P, 2, 4, t, b, e); \
	else qmem_run(G, P, 1, 2, t, b, e); \
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

#endif
