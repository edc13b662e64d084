/* Compressed-state front end (names, sizes, checks, dispatch) and its scalar reference step. */
#include <cpuid.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "quant_impl.h"

/*
 * Built with -ffp-contract=off like optim_scalar.c: the reference is the
 * fp32 step's operations in the fp32 step's order, with the moments decoded
 * before and encoded after, and optim_q8_simd.c repeats it bit for bit.
 */

static const char *const format_names[ZK_STATE_COUNT] = {
	[ZK_STATE_FP32] = "fp32",
	[ZK_STATE_BF16] = "bf16-moments",
	[ZK_STATE_Q8] = "q8-moments",
	[ZK_STATE_BF16_Q8] = "bf16-master+q8",
};

static zk_qstep_fn *const qstep_fns[ZK_ISA_COUNT] = {
	zk_qstep_scalar, zk_qstep_avx2, zk_qstep_avx512,
};

static zk_qmemonly_fn *const qmemonly_fns[ZK_ISA_COUNT] = {
	zk_qmemonly_scalar, zk_qmemonly_avx2, zk_qmemonly_avx512,
};

bool zk__q8_no_avx512bf16;

/* CPUID.(7,1):EAX bit 5; asked once (cpuid traps in a VM), like cpu_has_f16c in optim.c. */
static bool cpu_has_avx512bf16(void)
{
	static int known = -1;
	int v = __atomic_load_n(&known, __ATOMIC_RELAXED);
	unsigned a, b, c, d;

	if (v < 0) {
		v = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5)) != 0;
		__atomic_store_n(&known, v, __ATOMIC_RELAXED);
	}
	return v;
}

static zk_qstep_fn *qstep_fn(enum zk_isa isa)
{
	if (isa == ZK_ISA_AVX512 && !zk__q8_no_avx512bf16 && cpu_has_avx512bf16())
		return zk_qstep_avx512bf16;
	return qstep_fns[isa];
}

const char *zk_state_format_name(enum zk_state_format f)
{
	return (unsigned)f < ZK_STATE_COUNT ? format_names[f] : "unknown";
}

void zk_state_format_list(char *buf, size_t len)
{
	size_t off = 0;

	buf[0] = '\0';
	for (unsigned i = 0; i < ZK_STATE_COUNT && off < len; i++) {
		int n = snprintf(buf + off, len - off, "%s\"%s\"", i > 0 ? ", " : "",
		    format_names[i]);

		if (n < 0)
			break;
		off += (size_t)n;
	}
}

int zk_state_format_parse(const char *name, enum zk_state_format *ret)
{
	if (!name)
		return -EINVAL;
	for (unsigned i = 0; i < ZK_STATE_COUNT; i++) {
		if (!strcasecmp(name, format_names[i])) {
			*ret = (enum zk_state_format)i;
			return 0;
		}
	}
	if (!strcasecmp(name, "bf16")) {
		*ret = ZK_STATE_BF16;
		return 0;
	}
	if (!strcasecmp(name, "q8")) {
		*ret = ZK_STATE_Q8;
		return 0;
	}
	if (!strcasecmp(name, "bf16-q8")) {
		*ret = ZK_STATE_BF16_Q8;
		return 0;
	}
	return -EINVAL;
}

static bool blocked(enum zk_state_format f)
{
	return f == ZK_STATE_Q8 || f == ZK_STATE_BF16_Q8;
}

static bool format_ok(enum zk_state_format f)
{
	return f == ZK_STATE_BF16 || blocked(f);
}

int zk_qtensor_slice(const struct zk_qtensor *t, size_t off, size_t len, struct zk_qtensor *ret)
{
	size_t ms;

	if (!t || !ret || !format_ok(t->format) || off > t->n || len > t->n - off)
		return -EINVAL;
	if (blocked(t->format) && off % ZK_Q8_BLOCK)
		return -EINVAL;
	ms = zk_state_moment_bytes(t->format, 1);
	*ret = *t;
	ret->n = len;
	ret->base = t->base + off;
	if (t->format == ZK_STATE_BF16_Q8)
		ret->master_bf16 = t->master_bf16 ? t->master_bf16 + off : NULL;
	else
		ret->master = t->master ? t->master + off : NULL;
	ret->m = t->m ? (char *)t->m + off * ms : NULL;
	ret->v = t->v ? (char *)t->v + off * ms : NULL;
	if (blocked(t->format)) {
		ret->m_scale = t->m_scale ? t->m_scale + off / ZK_Q8_BLOCK : NULL;
		ret->v_scale = t->v_scale ? t->v_scale + off / ZK_Q8_BLOCK : NULL;
	}
	ret->grad = t->grad ? (const char *)t->grad + off * zk_dtype_size(t->grad_dtype) : NULL;
	if (t->param)
		ret->param = (char *)t->param + off * zk_dtype_size(t->param_dtype);
	return 0;
}

static int check_qtensor(enum zk_isa isa, const struct zk_qtensor *t, size_t begin, size_t end)
{
	if ((unsigned)isa >= ZK_ISA_COUNT || !t || !format_ok(t->format))
		return -EINVAL;
	if (!t->master || !t->grad || !t->m || !t->v)
		return -EINVAL;
	if (blocked(t->format) && (!t->m_scale || !t->v_scale))
		return -EINVAL;
	if ((unsigned)t->grad_dtype >= ZK_DTYPE_COUNT)
		return -EINVAL;
	if (t->param && (unsigned)t->param_dtype >= ZK_DTYPE_COUNT)
		return -EINVAL;
	if (begin > end || end > t->n)
		return -EINVAL;
	/* A block's scale covers all of it: a range must own its blocks whole. */
	if (blocked(t->format) &&
	    (begin % ZK_Q8_BLOCK || (end % ZK_Q8_BLOCK && end != t->n)))
		return -EINVAL;
	if (!zk_isa_supported(isa))
		return -ENOTSUP;
	return 0;
}

int zk_qstep(enum zk_isa isa, const struct zk_hparams *hp, const struct zk_qtensor *t,
    size_t begin, size_t end)
{
	return zk_qstep_undo(isa, hp, t, begin, end, NULL);
}

int zk_qstep_undo(enum zk_isa isa, const struct zk_hparams *hp, const struct zk_qtensor *t,
    size_t begin, size_t end, struct zk_undo *u)
{
	struct zk_qconsts qc;
	double bc2 = 1;
	int r;

	r = zk_hparams_validate(hp);
	if (r < 0)
		return r;
	r = check_qtensor(isa, t, begin, end);
	if (r < 0)
		return r;
	if (hp->optim != ZK_OPTIM_ADAMW && hp->optim != ZK_OPTIM_ADAM)
		return -ENOTSUP;
	r = zk_consts_init(hp, &qc.c);
	if (r < 0)
		return r;
	if (hp->bias_correction)
		bc2 = 1.0 - pow(hp->beta2, (double)hp->step);
	qc.inv_bc2_sqrt = (float)(1.0 / sqrt(bc2));
	qc.sr_key = zk__sr_key(hp->step);
	if (!isfinite(qc.inv_bc2_sqrt))
		return -EINVAL;
	if (begin < end)
		qstep_fn(isa)(&qc, hp->optim, t, begin, end, u);
	return 0;
}

int zk_qundo_restore(const struct zk_qtensor *t, const struct zk_undo *u, uint64_t record)
{
	uint64_t at = zk_undo_at(record), n = zk_undo_count(record);
	const char *slot = (const char *)u->ring + (size_t)zk_undo_slot(record) * ZK_UNDO_SLOT;
	size_t mb, ms;

	if (!t || !format_ok(t->format) || record == 0 || n == 0 || n > ZK_Q8_BLOCK ||
	    at > t->n || n > t->n - at || (blocked(t->format) && at % ZK_Q8_BLOCK != 0))
		return -EINVAL;
	mb = zk_state_master_bytes(t->format, 1);
	ms = zk_state_moment_bytes(t->format, 1);
	memcpy((char *)t->master + at * mb, slot, n * mb);
	memcpy((char *)t->m + at * ms, slot + ZK_UNDO_M, n * ms);
	memcpy((char *)t->v + at * ms, slot + ZK_UNDO_V, n * ms);
	if (blocked(t->format)) {
		memcpy(&t->m_scale[at / ZK_Q8_BLOCK], slot + ZK_UNDO_SCALES, sizeof(float));
		memcpy(&t->v_scale[at / ZK_Q8_BLOCK], slot + ZK_UNDO_SCALES + sizeof(float),
		    sizeof(float));
	}
	return 0;
}

int zk_qstep_memonly(enum zk_isa isa, const struct zk_qtensor *t, size_t begin, size_t end)
{
	int r = check_qtensor(isa, t, begin, end);

	if (r < 0)
		return r;
	if (begin < end)
		qmemonly_fns[isa](t, begin, end);
	return 0;
}

int zk_qstate_encode(const struct zk_qtensor *t, const float *m, const float *v)
{
	if (!t || !format_ok(t->format) || !t->m || !t->v || !m || !v)
		return -EINVAL;
	if (t->format == ZK_STATE_BF16) {
		for (size_t i = 0; i < t->n; i++) {
			((uint16_t *)t->m)[i] = zk__f32_to_bf16(m[i]);
			((uint16_t *)t->v)[i] = zk__f32_to_bf16(v[i]);
		}
		return 0;
	}
	if (!t->m_scale || !t->v_scale)
		return -EINVAL;
	for (size_t b = 0; b < t->n; b += ZK_Q8_BLOCK) {
		size_t len = t->n - b < ZK_Q8_BLOCK ? t->n - b : ZK_Q8_BLOCK;
		uint32_t mm = 0, mr = 0;
		float qm, qr;

		for (size_t j = b; j < b + len; j++) {
			uint32_t a = zk__absbits(m[j]), r = zk__absbits(sqrtf(v[j]));

			mm = a > mm ? a : mm;
			mr = r > mr ? r : mr;
		}
		t->m_scale[b / ZK_Q8_BLOCK] = zk__bits_f32(mm);
		t->v_scale[b / ZK_Q8_BLOCK] = zk__bits_f32(mr);
		qm = zk__q8_encode_mul(ZK_Q8_VMAX_M, zk__bits_f32(mm));
		qr = zk__q8_encode_mul(ZK_Q8_VMAX_V, zk__bits_f32(mr));
		for (size_t j = b; j < b + len; j++) {
			((uint8_t *)t->m)[j] = zk__q8_encode_m(m[j], qm);
			((uint8_t *)t->v)[j] = zk__q8_encode_r(sqrtf(v[j]), qr);
		}
	}
	return 0;
}

int zk_qstate_decode(const struct zk_qtensor *t, float *m, float *v)
{
	if (!t || !format_ok(t->format) || !t->m || !t->v || !m || !v)
		return -EINVAL;
	if (blocked(t->format) && (!t->m_scale || !t->v_scale))
		return -EINVAL;
	for (size_t i = 0; i < t->n; i++) {
		if (t->format == ZK_STATE_BF16) {
			m[i] = zk__bf16_to_f32(((const uint16_t *)t->m)[i]);
			v[i] = zk__bf16_to_f32(((const uint16_t *)t->v)[i]);
		} else {
			float um = zk__q8_decode_mul(ZK_Q8_RCP_VMAX_M, t->m_scale[i / ZK_Q8_BLOCK]);
			float ur = zk__q8_decode_mul(ZK_Q8_RCP_VMAX_V, t->v_scale[i / ZK_Q8_BLOCK]);
			float r = zk__q8_decode_r(((const uint8_t *)t->v)[i], ur, ZK_Q8_OFFSET * ur);

			m[i] = zk__q8_decode_m(((const uint8_t *)t->m)[i], um, ZK_Q8_OFFSET * um);
			v[i] = r * r;
		}
	}
	return 0;
}

int zk_qstate_master_encode(const struct zk_qtensor *t, const float *master)
{
	if (!t || !format_ok(t->format) || !t->master || !master)
		return -EINVAL;
	for (size_t i = 0; i < t->n; i++) {
		if (t->format == ZK_STATE_BF16_Q8)
			t->master_bf16[i] = zk__f32_to_bf16(master[i]);
		else
			t->master[i] = master[i];
	}
	return 0;
}

int zk_qstate_master_decode(const struct zk_qtensor *t, float *master)
{
	if (!t || !format_ok(t->format) || !t->master || !master)
		return -EINVAL;
	for (size_t i = 0; i < t->n; i++)
		master[i] = t->format == ZK_STATE_BF16_Q8 ? zk__bf16_to_f32(t->master_bf16[i]) : t->master[i];
	return 0;
}

/* ---- scalar reference ---- */

/*
 * Element i of the AdamW/Adam step from decoded moments (mo, vo): the new
 * moments come back in *mi and *vi.  zk_step_scalar's operations, but for
 * the multiply by 1/sqrt(bc2) (struct zk_qconsts).  bf16-moments.
 */
static inline void adam_elem(const struct zk_qconsts *qc, enum zk_optim optim,
    const struct zk_qtensor *t, size_t i, float mo, float vo, float *mi, float *vi)
{
	const struct zk_consts *c = &qc->c;
	float g = zk_load_grad(t->grad, t->grad_dtype, i) * c->inv_scale * c->clip;
	float p = t->master[i], d;

	if (optim == ZK_OPTIM_ADAMW)
		p = p * c->decay;
	else if (c->l2)
		g = g + c->wd * p;
	if (c->lerp_small)
		*mi = mo + c->lerp_w * (g - mo);
	else
		*mi = g - (g - mo) * c->lerp_omw;
	*vi = vo * c->beta2 + c->omb2 * g * g;
	d = sqrtf(*vi) * qc->inv_bc2_sqrt + c->eps;
	p = p + c->neg_step * *mi / d;
	t->master[i] = p;
	if (t->param != NULL)
		zk_store_param(t->param, t->param_dtype, i, p);
}

/*
 * The 8-bit formats' step (quant.h): the same formulas with every
 * multiply-add that can be one fused: fewer roundings and, what matters
 * here, fewer operations per element for the SIMD bodies, which the decode
 * and encode around the step make compute-bound.  Returns the new master
 * value; the new m and sqrt(v) come back in *mi and *r.
 */
static inline float adam_elem_q8(const struct zk_qconsts *qc, enum zk_optim optim, float gin,
    float p, float mo, float ro, float *mi, float *r)
{
	const struct zk_consts *c = &qc->c;
	float g = gin * c->inv_scale * c->clip, vi, u;

	if (optim == ZK_OPTIM_ADAM && c->l2)
		g = fmaf(c->wd, p, g);
	if (c->lerp_small)
		*mi = fmaf(c->lerp_w, g - mo, mo);
	else
		*mi = fmaf(mo - g, c->lerp_omw, g);
	vi = fmaf(ro * ro, c->beta2, c->omb2 * g * g);
	*r = sqrtf(vi);
	u = c->neg_step * *mi / fmaf(*r, qc->inv_bc2_sqrt, c->eps);
	return optim == ZK_OPTIM_ADAMW ? fmaf(p, c->decay, u) : p + u;
}

/* A block's decode constants (quant.h): u = s / VMAX and c0 = 2^-15 u. */
struct q8blk {
	float um, cm, ur, cr;
};

static inline struct q8blk q8blk_init(float sm, float sr)
{
	struct q8blk k;

	k.um = zk__q8_decode_mul(ZK_Q8_RCP_VMAX_M, sm);
	k.ur = zk__q8_decode_mul(ZK_Q8_RCP_VMAX_V, sr);
	k.cm = ZK_Q8_OFFSET * k.um;
	k.cr = ZK_Q8_OFFSET * k.ur;
	return k;
}

void zk_qstep_scalar(const struct zk_qconsts *c, enum zk_optim optim, const struct zk_qtensor *t,
    size_t begin, size_t end, struct zk_undo *u)
{
	if (t->format == ZK_STATE_BF16) {
		uint16_t *m = t->m, *v = t->v;

		for (size_t i = begin; i < end; i++) {
			float mi, vi;

			if (u != NULL)
				zk_qundo_save(u, t, i, 1, 4, 2, false);
			adam_elem(c, optim, t, i, zk__bf16_to_f32(m[i]), zk__bf16_to_f32(v[i]), &mi, &vi);
			m[i] = zk__f32_to_bf16(mi);
			v[i] = zk__f32_to_bf16(vi);
		}
		return;
	}
	bool bf16m = t->format == ZK_STATE_BF16_Q8;

	for (size_t b = begin; b < end; b += ZK_Q8_BLOCK) {
		uint8_t *m = (uint8_t *)t->m + b, *v = (uint8_t *)t->v + b;
		size_t k = b / ZK_Q8_BLOCK, len = end - b < ZK_Q8_BLOCK ? end - b : ZK_Q8_BLOCK;
		struct q8blk q = q8blk_init(t->m_scale[k], t->v_scale[k]);
		float bm[ZK_Q8_BLOCK], br[ZK_Q8_BLOCK], qm, qr;
		uint32_t mm = 0, mr = 0;

		uint32_t hk = zk__sr_block_key(c->sr_key, t->base + b);

		if (u != NULL)
			zk_qundo_save(u, t, b, len, bf16m ? 2 : 4, 1, true);
		for (size_t j = 0; j < len; j++) {
			size_t i = b + j;
			float p = bf16m ? zk__bf16_to_f32(t->master_bf16[i]) : t->master[i];

			p = adam_elem_q8(c, optim, zk_load_grad(t->grad, t->grad_dtype, i), p,
			    zk__q8_decode_m(m[j], q.um, q.cm), zk__q8_decode_r(v[j], q.ur, q.cr),
			    &bm[j], &br[j]);
			if (bf16m) {
				/* param is the stored master: bf16 exactly, other dtypes from its value */
				t->master_bf16[i] = zk__sr_bf16(p, zk__sr_bits(hk, t->base + i));
				p = zk__bf16_to_f32(t->master_bf16[i]);
			} else {
				t->master[i] = p;
			}
			if (t->param != NULL)
				zk_store_param(t->param, t->param_dtype, i, p);
			mm = zk__absbits(bm[j]) > mm ? zk__absbits(bm[j]) : mm;
			mr = zk__f32_bits(br[j]) > mr ? zk__f32_bits(br[j]) : mr;
		}
		t->m_scale[k] = zk__bits_f32(mm);
		t->v_scale[k] = zk__bits_f32(mr);
		qm = zk__q8_encode_mul(ZK_Q8_VMAX_M, zk__bits_f32(mm));
		qr = zk__q8_encode_mul(ZK_Q8_VMAX_V, zk__bits_f32(mr));
		for (size_t j = 0; j < len; j++) {
			m[j] = zk__q8_encode_m(bm[j], qm);
			v[j] = zk__q8_encode_r(br[j], qr);
		}
	}
}

void zk_qmemonly_scalar(const struct zk_qtensor *t, size_t begin, size_t end)
{
	size_t ms = zk_state_moment_bytes(t->format, 1), mb = zk_state_master_bytes(t->format, 1);
	size_t gs = zk_dtype_size(t->grad_dtype), ps = zk_dtype_size(t->param_dtype);
	unsigned char *m = t->m, *v = t->v, *master = (unsigned char *)t->master, *param = t->param;
	const unsigned char *g = t->grad;

	for (size_t i = begin; i < end; i++) {
		uint32_t x = 0, gx = 0;

		memcpy(&x, master + i * mb, mb);
		memcpy(&gx, g + i * gs, gs);
		__asm__ volatile("" : "+r"(x), "+r"(gx));
		memcpy(master + i * mb, &x, mb);
		if (param)
			memcpy(param + i * ps, &gx, ps);
	}
	for (size_t i = begin * ms; i < end * ms; i++) {
		unsigned char x = m[i], y = v[i];

		__asm__ volatile("" : "+r"(x), "+r"(y));
		m[i] = x;
		v[i] = y;
	}
	if (blocked(t->format)) {
		for (size_t k = begin / ZK_Q8_BLOCK; k < (end + ZK_Q8_BLOCK - 1) / ZK_Q8_BLOCK; k++) {
			float x = t->m_scale[k], y = t->v_scale[k];

			__asm__ volatile("" : "+x"(x), "+x"(y));
			t->m_scale[k] = x;
			t->v_scale[k] = y;
		}
	}
}
