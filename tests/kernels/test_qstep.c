/* Compressed-state step: SIMD against the scalar reference bit for bit, the scalar one against an independent double-precision model of the encoding. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "helpers.h"
#include "pool.h"
#include "quant.h"
#include "quant_impl.h"

#define MAXN 1100
#define PAD 64
#define NBLK ((MAXN + PAD) / ZK_Q8_BLOCK + 2)

/*
 * The encoding as quant.h defines it, written from the definition with
 * doubles and a search over the grid (no bit tricks): grid value k of the m
 * magnitude (3 mantissa bits) or of r = sqrt(v) (4 bits), in units where the
 * block's maximum sits at VMAX.
 */
static double grid(unsigned mant, unsigned k)
{
	unsigned e = k >> mant, f = k & ((1u << mant) - 1);
	double base = ldexp(1.0, (int)e - 15) * (1.0 + f / (double)(1u << mant));

	return base - ldexp(1.0, -15);
}

static double vmax(unsigned mant)
{
	return grid(mant, mant == 3 ? 127 : 255);
}

/* Nearest grid code to y >= 0 (ties: the larger). */
static unsigned nearest(unsigned mant, double y)
{
	unsigned top = mant == 3 ? 127 : 255, best = 0;

	for (unsigned k = 1; k <= top; k++) {
		double d = fabs(y - grid(mant, k)), db = fabs(y - grid(mant, best));

		if (d <= db)
			best = k;
	}
	return best;
}

/* bf16-master+q8's random bits, from quant.h's definition. */
static uint32_t sr_mix(uint32_t x)
{
	x = (x ^ (x >> 16)) * 0x7feb352du;
	x = (x ^ (x >> 15)) * 0x846ca68bu;
	return x ^ (x >> 16);
}

static uint32_t sr_random(uint64_t step, uint64_t j)
{
	uint32_t key = sr_mix(sr_mix((uint32_t)step + 0x9e3779b9u) + (uint32_t)(step >> 32));
	uint32_t h = ((uint32_t)j ^ sr_mix((uint32_t)(j >> 32) + key)) * 0x7feb352du;

	return ((h ^ (h >> 15)) * 0x846ca68bu) >> 16;
}

struct qbufs {
	float master[MAXN + PAD];
	uint16_t master16[MAXN + PAD];	/* bf16-master+q8 */
	uint32_t grad[MAXN + PAD], param[MAXN + PAD];
	uint8_t m8[MAXN + PAD], v8[MAXN + PAD];
	uint16_t m16[MAXN + PAD], v16[MAXN + PAD];
	float ms[NBLK], vs[NBLK];
};

static const uint32_t extremes[] = {
	0x00000000, 0x80000000, 0x00000001, 0x00400000, 0x00800000, 0x3f800000, 0xbf800000,
	0x7f7fffff, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001, 0x1e3ce508, 0x60000000,
};
#define NEXTREME (sizeof(extremes) / sizeof(extremes[0]))

static float pick(struct rng *r, bool extreme, float lo, float hi)
{
	if (extreme && rng_next(r) % 5 == 0)
		return bits_f32(extremes[rng_next(r) % NEXTREME]);
	return rng_float(r, lo, hi);
}

/* Any bytes are a valid state: random codes, random (sometimes extreme) scales. */
static void fill_state(struct qbufs *b, struct rng *r, bool extreme)
{
	for (size_t i = 0; i < MAXN + PAD; i++) {
		b->master[i] = pick(r, extreme, -1, 1);
		b->master16[i] = zk_f32_to_bf16(pick(r, extreme, -1, 1));
		b->m8[i] = (uint8_t)rng_next(r);
		b->v8[i] = (uint8_t)rng_next(r);
		b->m16[i] = zk_f32_to_bf16(pick(r, extreme, -0.1f, 0.1f));
		b->v16[i] = zk_f32_to_bf16(extreme && rng_next(r) % 4 == 0 ?
		    bits_f32(extremes[rng_next(r) % NEXTREME]) : rng_float(r, 0, 0.01f));
		b->param[i] = 0xdeadbeef;
	}
	for (size_t k = 0; k < NBLK; k++) {
		b->ms[k] = extreme && k % 2 ? fabsf(pick(r, true, 0, 0.1f)) : rng_float(r, 1e-4f, 0.1f);
		b->vs[k] = extreme && k % 3 == 1 ? fabsf(pick(r, true, 0, 0.1f)) : rng_float(r, 1e-4f, 0.1f);
	}
	if (extreme) {
		b->ms[0] = 0;	/* the zero-state block */
		memset(b->m8, 0, ZK_Q8_BLOCK);
	}
}

static void fill_grad(struct qbufs *b, struct rng *r, enum zk_dtype gdt, int mode)
{
	for (size_t i = 0; i < MAXN + PAD; i++) {
		float g = mode == 2 ? 0.0f : pick(r, mode == 1, -2, 2);

		if (gdt == ZK_DTYPE_F32)
			b->grad[i] = f32_bits(g);
		else
			((uint16_t *)b->grad)[i] = gdt == ZK_DTYPE_BF16 ? zk_f32_to_bf16(g) : zk_f32_to_f16(g);
	}
}

static struct zk_qtensor view(struct qbufs *b, enum zk_state_format f, size_t shift, int gdt,
    int pdt, size_t n)
{
	size_t gs = zk_dtype_size((enum zk_dtype)gdt), ps = zk_dtype_size((enum zk_dtype)pdt);

	bool q8 = f != ZK_STATE_BF16;

	struct zk_qtensor t = {
		.format = f, .master = b->master + shift,
		.m = q8 ? (void *)(b->m8 + shift) : (void *)(b->m16 + shift),
		.v = q8 ? (void *)(b->v8 + shift) : (void *)(b->v16 + shift),
		.m_scale = q8 ? b->ms : NULL, .v_scale = q8 ? b->vs : NULL,
		.grad = (char *)b->grad + shift * gs, .grad_dtype = (enum zk_dtype)gdt,
		.param = pdt < ZK_DTYPE_COUNT ? (char *)b->param + shift * ps : NULL,
		.param_dtype = pdt < ZK_DTYPE_COUNT ? (enum zk_dtype)pdt : ZK_DTYPE_F32, .n = n,
	};

	if (f == ZK_STATE_BF16_Q8)
		t.master_bf16 = b->master16 + shift;
	return t;
}

static struct zk_hparams hparams(enum zk_optim optim, int set)
{
	struct zk_hparams h = {
		.optim = optim, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
		.weight_decay = 0.01, .step = 5, .bias_correction = true, .grad_scale = 2.0,
		.clip_coef = 0.7,
	};

	if (set == 1) {	/* the other lerp branch, no decay, no bias correction */
		h.beta1 = 0.3;
		h.beta2 = 0.5;
		h.weight_decay = 0;
		h.bias_correction = false;
		h.step = 1;
		h.lr = 0.5;
		h.eps = 0;
		h.grad_scale = 1.0;
		h.clip_coef = 1.0;
	}
	if (set == 2)
		h.step = 100000;	/* sqrt(bc2) == 1.0f: the SIMD shortcut */
	return h;
}

static void compare(const struct qbufs *a, const struct qbufs *b, enum zk_state_format f,
    int pdt, size_t shift, const char *what)
{
	long i = first_mismatch(a->master, b->master, ZK_DTYPE_F32, MAXN + PAD);

	cr_assert_eq(i, -1, "%s: master[%ld] %a vs %a", what, i, i < 0 ? 0 : a->master[i],
	    i < 0 ? 0 : b->master[i]);
	i = first_mismatch(a->master16, b->master16, ZK_DTYPE_BF16, MAXN + PAD);
	cr_assert_eq(i, -1, "%s: bf16 master[%ld] %04x vs %04x", what, i, i < 0 ? 0 : a->master16[i],
	    i < 0 ? 0 : b->master16[i]);
	if (pdt < ZK_DTYPE_COUNT) {
		i = first_mismatch(a->param, b->param, (enum zk_dtype)pdt, MAXN + PAD);
		cr_assert_eq(i, -1, "%s: param[%ld]", what, i);
	}
	if (f == ZK_STATE_BF16) {
		i = first_mismatch(a->m16, b->m16, ZK_DTYPE_BF16, MAXN + PAD);
		cr_assert_eq(i, -1, "%s: m[%ld] %04x vs %04x", what, i, i < 0 ? 0 : a->m16[i], i < 0 ? 0 : b->m16[i]);
		i = first_mismatch(a->v16, b->v16, ZK_DTYPE_BF16, MAXN + PAD);
		cr_assert_eq(i, -1, "%s: v[%ld]", what, i);
		return;
	}
	i = first_mismatch(a->ms, b->ms, ZK_DTYPE_F32, NBLK);
	cr_assert_eq(i, -1, "%s: m_scale[%ld] %a vs %a", what, i, i < 0 ? 0 : a->ms[i], i < 0 ? 0 : b->ms[i]);
	i = first_mismatch(a->vs, b->vs, ZK_DTYPE_F32, NBLK);
	cr_assert_eq(i, -1, "%s: v_scale[%ld]", what, i);
	for (size_t j = 0; j < MAXN + PAD; j++) {
		/* A NaN's sign is not part of the contract: in a NaN block, m's sign bit of a NaN is free. */
		uint8_t mask = j >= shift && isnan(a->ms[(j - shift) / ZK_Q8_BLOCK]) ? 0x7f : 0xff;

		cr_assert_eq(a->m8[j] & mask, b->m8[j] & mask, "%s: m code [%zu] %02x vs %02x", what, j,
		    a->m8[j], b->m8[j]);
		cr_assert_eq(a->v8[j], b->v8[j], "%s: v code [%zu] %02x vs %02x", what, j, a->v8[j], b->v8[j]);
	}
}

static void simd_vs_scalar(enum zk_isa isa, enum zk_state_format f)
{
	static const size_t lens[] = { 1, 7, 16, 17, 255, 256, 257, 300, 512, 777, 1100 };
	static struct qbufs ref, out, init;
	struct rng r = { 19 };
	char what[200];

	if (!test_isa_enabled(isa))
		cr_skip_test("%s not under test here", zk_isa_name(isa));
	for (int o = ZK_OPTIM_ADAMW; o <= ZK_OPTIM_ADAM; o++)
	for (int gdt = 0; gdt < ZK_DTYPE_COUNT; gdt++)
	for (int pdt = 0; pdt <= ZK_DTYPE_COUNT; pdt++)
	for (int mode = 0; mode < 3; mode++)		/* random, extreme, zero gradients */
	for (int set = 0; set < 3; set++)
	for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
		struct zk_hparams h = hparams((enum zk_optim)o, set);
		size_t n = lens[li], shift = rng_next(&r) % 9;
		size_t nb = n / ZK_Q8_BLOCK;
		/* A split on a block boundary: any must give the same bits. */
		size_t split = nb && (li & 1) ? ZK_Q8_BLOCK * (rng_next(&r) % (nb + 1)) : 0;

		fill_state(&init, &r, mode == 1);
		ref = init;
		out = init;
		/* Three steps, new gradients each, so later steps decode what earlier ones encoded. */
		for (int s = 0; s < 3; s++) {
			fill_grad(&init, &r, (enum zk_dtype)gdt, mode);
			memcpy(ref.grad, init.grad, sizeof(init.grad));
			memcpy(out.grad, init.grad, sizeof(init.grad));
			for (struct qbufs *b = &ref; b; b = b == &ref ? &out : NULL) {
				struct zk_qtensor t = view(b, f, shift, gdt, pdt, n);
				enum zk_isa use = b == &ref ? ZK_ISA_SCALAR : isa;

				/* A piece of a larger tensor whose second block starts at index 2^32. */
				if (li % 3 == 0)
					t.base = 0xffffff00u;

				/* A piece stepped as its own slice (base = split) gives the same bits too. */
				if (split && b == &out && (li & 2)) {
					struct zk_qtensor s0, s1;

					cr_assert_eq(zk_qtensor_slice(&t, 0, split, &s0), 0);
					cr_assert_eq(zk_qtensor_slice(&t, split, n - split, &s1), 0);
					cr_assert_eq(zk_qstep(use, &h, &s0, 0, split), 0);
					cr_assert_eq(zk_qstep(use, &h, &s1, 0, n - split), 0);
					continue;
				}
				if (split)
					cr_assert_eq(zk_qstep(use, &h, &t, 0, split), 0);
				cr_assert_eq(zk_qstep(use, &h, &t, split, n), 0);
			}
			h.step++;
		}
		snprintf(what, sizeof(what), "%s %s %s grad %s param %s mode %d set %d n %zu shift %zu",
		    zk_isa_name(isa), zk_state_format_name(f), zk_optim_name((enum zk_optim)o),
		    zk_dtype_name((enum zk_dtype)gdt),
		    pdt < ZK_DTYPE_COUNT ? zk_dtype_name((enum zk_dtype)pdt) : "none", mode, set, n, shift);
		compare(&ref, &out, f, pdt, shift, what);
	}
}

Test(qstep, avx2_q8_matches_scalar) { simd_vs_scalar(ZK_ISA_AVX2, ZK_STATE_Q8); }
Test(qstep, avx512_q8_matches_scalar) { simd_vs_scalar(ZK_ISA_AVX512, ZK_STATE_Q8); }
Test(qstep, avx2_bf16q8_matches_scalar) { simd_vs_scalar(ZK_ISA_AVX2, ZK_STATE_BF16_Q8); }
Test(qstep, avx512_bf16q8_matches_scalar) { simd_vs_scalar(ZK_ISA_AVX512, ZK_STATE_BF16_Q8); }
/* Where the CPU has AVX512_BF16, the baseline AVX-512 body as well (on others it is the one above). */
static void plain_avx512(enum zk_state_format f)
{
	zk__q8_no_avx512bf16 = true;
	simd_vs_scalar(ZK_ISA_AVX512, f);
	zk__q8_no_avx512bf16 = false;
}

Test(qstep, avx512_plain_q8_matches_scalar) { plain_avx512(ZK_STATE_Q8); }
Test(qstep, avx512_plain_bf16_matches_scalar) { plain_avx512(ZK_STATE_BF16); }
Test(qstep, avx512_plain_bf16q8_matches_scalar) { plain_avx512(ZK_STATE_BF16_Q8); }
Test(qstep, avx2_bf16_matches_scalar) { simd_vs_scalar(ZK_ISA_AVX2, ZK_STATE_BF16); }
Test(qstep, avx512_bf16_matches_scalar) { simd_vs_scalar(ZK_ISA_AVX512, ZK_STATE_BF16); }

/* The ISA under test, for the checks each entry runs on its own variant. */
static enum zk_isa isa_under_test(void)
{
	for (int i = ZK_ISA_COUNT - 1; i >= 0; i--)
		if (test_isa_enabled((enum zk_isa)i))
			return (enum zk_isa)i;
	return ZK_ISA_SCALAR;
}

/*
 * Code k is acceptable for the exact value y when it is as near as the
 * nearest code, give or take tol (the fp32 step's own rounding, which the
 * double model does not have).
 */
static void check_code(unsigned mant, double y, unsigned k, double tol, const char *what, size_t i)
{
	unsigned kn = nearest(mant, y);
	double dk = fabs(y - grid(mant, k)), dn = fabs(y - grid(mant, kn));

	cr_assert(dk <= dn + tol, "%s: element %zu: y %.9g coded %u (%.9g), nearest %u (%.9g)", what, i,
	    y, k, grid(mant, k), kn, grid(mant, kn));
}

struct sr_tally {
	size_t decided, total;
	double err;	/* sum of (stored - exact) in ulps */
};

/*
 * bf16-master+q8: the stored master is one of the two bf16 values around the
 * exact p (within tol, the fp32 step's error), the upper one exactly when
 * frac * 2^16 + R >= 2^16 (frac: p's place between them), checked where tol
 * cannot move it across; param holds the same bf16.
 */
static void check_sr(const struct qbufs *b, size_t i, double p, uint64_t step, double tol,
    struct sr_tally *sr, const char *what)
{
	double a = fabs(p), ulp = ldexp(1.0, ilogb(a) - 7), lo = floor(a / ulp) * ulp;
	double got = zk_bf16_to_f32(b->master16[i]), frac = (a - lo) / ulp;
	double x = frac * 65536 + sr_random(step, i) - 65536, margin = tol / ulp * 65536 + 2;

	cr_assert(((const uint16_t *)b->param)[i] == b->master16[i], "%s: param[%zu] is not master", what, i);
	cr_assert(fabs(got - p) <= ulp + tol, "%s: master[%zu] %.9g vs exact %.9g", what, i, got, p);
	sr->total++;
	sr->err += (fabs(got) - a) / ulp;
	if (fabs(x) < margin)
		return;
	sr->decided++;
	cr_assert(fabs(fabs(got) - (x >= 0 ? lo + ulp : lo)) <= tol, "%s: master[%zu] %.9g, exact %.9g, "
	    "frac %.4f, R %u: rounded the wrong way", what, i, got, p, frac, sr_random(step, i));
}

/*
 * Each step of the kernel from its own previous state, against the step in
 * double: decode, AdamW/Adam, block maxima, nearest code.
 */
static void vs_double(enum zk_state_format f, enum zk_optim optim, int set, enum zk_dtype gdt)
{
	static struct qbufs b;
	double mo[MAXN], vo[MAXN], mi[MAXN], vi[MAXN], po[MAXN], pn[MAXN], gg[MAXN];
	enum zk_isa isa = isa_under_test();
	struct rng r = { 77 + (uint64_t)set };
	size_t n = 1000;
	size_t exact = 0, total = 0;
	struct sr_tally tally = { 0 };
	char what[160];

	snprintf(what, sizeof(what), "%s %s %s set %d grad %s", zk_isa_name(isa), zk_state_format_name(f),
	    zk_optim_name(optim), set, zk_dtype_name(gdt));
	fill_state(&b, &r, false);
	for (int s = 0; s < 6; s++) {
		struct zk_hparams h = hparams(optim, set);
		struct zk_qtensor t = view(&b, f, 0, gdt, ZK_DTYPE_BF16, n);
		double w = 1.0 - h.beta1, bc1 = 1, bc2 = 1;

		h.step += (uint64_t)s;
		if (h.bias_correction) {
			bc1 = 1 - pow(h.beta1, (double)h.step);
			bc2 = 1 - pow(h.beta2, (double)h.step);
		}
		fill_grad(&b, &r, gdt, 0);
		for (size_t i = 0; i < n; i++) {
			size_t k = i / ZK_Q8_BLOCK;
			double g;

			if (f != ZK_STATE_BF16) {
				double um = b.ms[k] / vmax(3), ur = b.vs[k] / vmax(4);
				double rr = grid(4, b.v8[i]) * ur;

				mo[i] = grid(3, b.m8[i] & 0x7f) * um * (b.m8[i] & 0x80 ? -1 : 1);
				vo[i] = rr * rr;
			} else {
				mo[i] = zk_bf16_to_f32(b.m16[i]);
				vo[i] = zk_bf16_to_f32(b.v16[i]);
			}
			g = gdt == ZK_DTYPE_F32 ? bits_f32(b.grad[i]) : zk_bf16_to_f32(((uint16_t *)b.grad)[i]);
			g = g / h.grad_scale * h.clip_coef;
			po[i] = f == ZK_STATE_BF16_Q8 ? zk_bf16_to_f32(b.master16[i]) : b.master[i];
			if (optim == ZK_OPTIM_ADAMW)
				po[i] *= 1 - h.lr * h.weight_decay;
			else
				g += h.weight_decay * po[i];
			gg[i] = g;
			mi[i] = mo[i] + w * (g - mo[i]);
			vi[i] = h.beta2 * vo[i] + (1 - h.beta2) * g * g;
			pn[i] = po[i] - h.lr / bc1 * mi[i] / (sqrt(vi[i]) / sqrt(bc2) + h.eps);
		}
		cr_assert_eq(zk_qstep(isa, &h, &t, 0, n), 0);
		for (size_t i = 0; i < n && f == ZK_STATE_BF16_Q8; i++)
			check_sr(&b, i, pn[i], h.step, 1e-6 * (fabs(pn[i]) + h.lr), &tally, what);
		for (size_t i = 0; i < n && f != ZK_STATE_BF16_Q8; i++)
			cr_assert(fabs(b.master[i] - pn[i]) <= 1e-6 * (fabs(pn[i]) + h.lr),
			    "%s step %d: master[%zu] %.9g vs %.9g", what, s, i, b.master[i], pn[i]);
		for (size_t blk = 0; blk < n; blk += ZK_Q8_BLOCK) {
			size_t len = n - blk < ZK_Q8_BLOCK ? n - blk : ZK_Q8_BLOCK;
			double sm = 0, sr = 0;

			if (f == ZK_STATE_BF16) {
				for (size_t i = blk; i < blk + len; i++) {
					double km = zk_bf16_to_f32(b.m16[i]), kv = zk_bf16_to_f32(b.v16[i]);
					/* Half a bf16 ulp of the exact value, plus the fp32 step's error. */
					double um = ldexp(1.0, ilogb(mi[i]) - 7), uv = ldexp(1.0, ilogb(vi[i]) - 7);

					cr_assert(fabs(km - mi[i]) <= 0.5 * um + 1e-6 * (fabs(mo[i]) + fabs(gg[i])),
					    "%s: m[%zu] %.9g vs %.9g", what, i, km, mi[i]);
					cr_assert(fabs(kv - vi[i]) <= 0.5 * uv * (1 + 1e-5) + 1e-6 * vi[i],
					    "%s: v[%zu] %.9g vs %.9g", what, i, kv, vi[i]);
				}
				continue;
			}
			for (size_t i = blk; i < blk + len; i++) {
				sm = fmax(sm, fabs(mi[i]));
				sr = fmax(sr, sqrt(vi[i]));
			}
			cr_assert(fabs(b.ms[blk / ZK_Q8_BLOCK] - sm) <= 1e-6 * sm, "%s: m scale %.9g vs %.9g",
			    what, b.ms[blk / ZK_Q8_BLOCK], sm);
			cr_assert(fabs(b.vs[blk / ZK_Q8_BLOCK] - sr) <= 1e-6 * sr, "%s: v scale %.9g vs %.9g",
			    what, b.vs[blk / ZK_Q8_BLOCK], sr);
			for (size_t i = blk; i < blk + len; i++) {
				double ym = fabs(mi[i]) / sm * vmax(3), yr = sqrt(vi[i]) / sr * vmax(4);
				double tolm = 2e-6 * (fabs(mo[i]) + fabs(gg[i])) / sm * vmax(3) + 1e-6 * ym;

				check_code(3, ym, b.m8[i] & 0x7fu, tolm, what, i);
				check_code(4, yr, b.v8[i], 2e-6 * yr, what, i);
				cr_assert(ym < grid(3, 4) || (b.m8[i] >> 7) == (mi[i] < 0), "%s: sign of m[%zu]", what, i);
				exact += (b.m8[i] & 0x7fu) == nearest(3, ym);
				exact += b.v8[i] == nearest(4, yr);
				total += 2;
			}
		}
	}
	if (f == ZK_STATE_BF16_Q8) {
		/* Most decisions far enough from the fp32 step's rounding to be checked; no bias. */
		cr_assert(tally.decided >= tally.total * 9 / 10, "%s: %zu of %zu roundings checked", what,
		    tally.decided, tally.total);
		cr_assert(fabs(tally.err / (double)tally.total) < 0.05, "%s: mean rounding error %.4f ulp", what,
		    tally.err / (double)tally.total);
	}
	/* The tolerance only lets codes next to a midpoint go either way. */
	if (f != ZK_STATE_BF16)
		cr_assert(exact >= total * 99 / 100, "%s: %zu of %zu codes the nearest", what, exact, total);
}

Test(qnumerics, q8_adamw_vs_double) { vs_double(ZK_STATE_Q8, ZK_OPTIM_ADAMW, 0, ZK_DTYPE_BF16); }
Test(qnumerics, q8_adam_vs_double) { vs_double(ZK_STATE_Q8, ZK_OPTIM_ADAM, 0, ZK_DTYPE_F32); }
Test(qnumerics, bf16q8_adamw_vs_double) { vs_double(ZK_STATE_BF16_Q8, ZK_OPTIM_ADAMW, 0, ZK_DTYPE_BF16); }
Test(qnumerics, bf16q8_adam_vs_double) { vs_double(ZK_STATE_BF16_Q8, ZK_OPTIM_ADAM, 1, ZK_DTYPE_F32); }
Test(qnumerics, q8_adamw_other_branch_vs_double) { vs_double(ZK_STATE_Q8, ZK_OPTIM_ADAMW, 1, ZK_DTYPE_F32); }
Test(qnumerics, bf16_adamw_vs_double) { vs_double(ZK_STATE_BF16, ZK_OPTIM_ADAMW, 0, ZK_DTYPE_BF16); }
Test(qnumerics, bf16_adam_vs_double) { vs_double(ZK_STATE_BF16, ZK_OPTIM_ADAM, 1, ZK_DTYPE_F32); }

/* Every code decodes to its grid value and encodes back to itself. */
Test(qcodec, every_code_round_trips)
{
	static float m[ZK_Q8_BLOCK], v[ZK_Q8_BLOCK], dm[ZK_Q8_BLOCK], dv[ZK_Q8_BLOCK];
	static uint8_t cm[ZK_Q8_BLOCK], cv[ZK_Q8_BLOCK];
	float sm = 0.375f, sr = 0.0625f, ms, vs;
	struct zk_qtensor t = { .format = ZK_STATE_Q8, .m = cm, .v = cv, .m_scale = &ms,
		.v_scale = &vs, .n = ZK_Q8_BLOCK };

	if (!test_general_enabled())
		cr_skip_test("ISA-independent");
	/* Element 0 holds each block's maximum, so the scale is exactly sm / sr. */
	for (unsigned k = 0; k < 256; k++) {
		double r = grid(4, k) * sr / vmax(4);

		m[k] = (float)(grid(3, k & 0x7f) * sm / vmax(3) * (k & 0x80 ? -1 : 1));
		v[k] = (float)(r * r);
	}
	m[0] = sm;
	v[0] = sr * sr;
	cr_assert_eq(zk_qstate_encode(&t, m, v), 0);
	cr_assert_eq(ms, sm);
	cr_assert_eq(vs, sr);
	cr_assert_eq(zk_qstate_decode(&t, dm, dv), 0);
	for (unsigned k = 1; k < 256; k++) {
		cr_assert_eq(cm[k], k, "m code %u encodes to %u", k, cm[k]);
		cr_assert_eq(cv[k], k, "v code %u encodes to %u", k, cv[k]);
		cr_assert(fabsf(dm[k] - m[k]) <= 0x1p-21f * fabsf(m[k]), "m code %u: %a vs %a", k, dm[k], m[k]);
		cr_assert(fabsf(dv[k] - v[k]) <= 0x1p-21f * v[k], "v code %u: %a vs %a", k, dv[k], v[k]);
	}
	cr_assert_eq(cm[0], 127);
	cr_assert_eq(cv[0], 255);
}

Test(qcodec, zero_state_and_midpoints)
{
	float m[4] = { 0, 0, 0, 0 }, v[4] = { 0, 0, 0, 0 }, dm[4], dv[4], ms = 1, vs = 1;
	uint8_t cm[4] = { 1, 2, 3, 4 }, cv[4] = { 5, 6, 7, 8 };
	struct zk_qtensor t = { .format = ZK_STATE_Q8, .m = cm, .v = cv, .m_scale = &ms,
		.v_scale = &vs, .n = 4 };

	if (!test_general_enabled())
		cr_skip_test("ISA-independent");
	cr_assert_eq(zk_qstate_encode(&t, m, v), 0);
	for (int i = 0; i < 4; i++)
		cr_assert(cm[i] == 0 && cv[i] == 0 && ms == 0 && vs == 0);
	cr_assert_eq(zk_qstate_decode(&t, dm, dv), 0);
	for (int i = 0; i < 4; i++)
		cr_assert(dm[i] == 0 && dv[i] == 0);
	/* Exact midpoints between two codes go to the larger; just below, to the smaller. */
	m[0] = (float)vmax(3);
	m[1] = (float)((grid(3, 40) + grid(3, 41)) / 2);
	m[2] = (float)((grid(3, 41) + grid(3, 42)) / 2);
	m[3] = nextafterf(m[1], 0);
	cr_assert_eq(zk_qstate_encode(&t, m, v), 0);
	cr_assert_eq(cm[1], 41);
	cr_assert_eq(cm[2], 42);
	cr_assert_eq(cm[3], 40);
}

Test(qapi, errors_names_sizes)
{
	static float master[600], ms[3], vs[3];
	static uint8_t m[600], v[600];
	static uint16_t m16[600];
	static uint16_t g[600];
	struct zk_qtensor t = { .format = ZK_STATE_Q8, .master = master, .m = m, .v = v, .m_scale = ms,
		.v_scale = vs, .grad = g, .grad_dtype = ZK_DTYPE_BF16, .n = 600 }, s;
	struct zk_hparams h = hparams(ZK_OPTIM_ADAMW, 0);
	enum zk_state_format f;

	if (!test_general_enabled())
		cr_skip_test("ISA-independent");
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 0, 600), 0);
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 256, 512), 0);
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 512, 600), 0);
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 100, 600), -EINVAL, "range off a block boundary");
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 0, 300), -EINVAL, "end inside a block");
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 0, 601), -EINVAL);
	cr_assert_eq(zk_qtensor_slice(&t, 100, 10, &s), -EINVAL);
	cr_assert_eq(zk_qtensor_slice(&t, 512, 89, &s), -EINVAL);
	cr_assert_eq(zk_qtensor_slice(&t, 512, 88, &s), 0);
	cr_assert(s.m_scale == ms + 2 && (uint8_t *)s.m == m + 512 && s.master == master + 512 &&
	    (const uint16_t *)s.grad == g + 512 && s.n == 88);
	h.optim = ZK_OPTIM_LION;
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 0, 600), -ENOTSUP);
	h.optim = ZK_OPTIM_ADAMW;
	t.v_scale = NULL;
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 0, 600), -EINVAL);
	t.format = ZK_STATE_FP32;
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 0, 600), -EINVAL, "fp32 state goes to zk_step");
	t.format = ZK_STATE_BF16;
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 3, 7), 0, "bf16 has no blocks");

	cr_assert_eq(zk_state_format_parse("q8-moments", &f), 0);
	cr_assert_eq(f, ZK_STATE_Q8);
	cr_assert_eq(zk_state_format_parse("BF16-moments", &f), 0);
	cr_assert_eq(f, ZK_STATE_BF16);
	cr_assert_eq(zk_state_format_parse("fp32", &f), 0);
	cr_assert_eq(f, ZK_STATE_FP32);
	cr_assert_eq(zk_state_format_parse("q4", &f), -EINVAL);
	cr_assert_str_eq(zk_state_format_name(ZK_STATE_Q8), "q8-moments");
	cr_assert_eq(zk_state_bytes(ZK_STATE_FP32, 1000), 12000);
	cr_assert_eq(zk_state_bytes(ZK_STATE_BF16, 1000), 8000);
	cr_assert_eq(zk_state_bytes(ZK_STATE_Q8, 1000), 6000 + 4 * 8);
	cr_assert_eq(zk_state_blocks(ZK_STATE_Q8, 512), 2);
	cr_assert_eq(zk_state_blocks(ZK_STATE_Q8, 513), 3);

	cr_assert_eq(zk_state_format_parse("bf16-master+q8", &f), 0);
	cr_assert_eq(f, ZK_STATE_BF16_Q8);
	cr_assert_eq(zk_state_format_parse("bf16-q8", &f), 0);
	cr_assert_eq(f, ZK_STATE_BF16_Q8);
	cr_assert_str_eq(zk_state_format_name(ZK_STATE_BF16_Q8), "bf16-master+q8");
	cr_assert_eq(zk_state_master_bytes(ZK_STATE_BF16_Q8, 1000), 2000);
	cr_assert_eq(zk_state_master_bytes(ZK_STATE_Q8, 1000), 4000);
	cr_assert_eq(zk_state_bytes(ZK_STATE_BF16_Q8, 1000), 4000 + 4 * 8);
	cr_assert_eq(zk_state_blocks(ZK_STATE_BF16_Q8, 513), 3);
	t.format = ZK_STATE_BF16_Q8;
	t.master_bf16 = (uint16_t *)m16;
	t.v_scale = vs;
	t.base = 1u << 20;
	cr_assert_eq(zk_qtensor_slice(&t, 100, 10, &s), -EINVAL, "off a block boundary");
	cr_assert_eq(zk_qtensor_slice(&t, 512, 88, &s), 0);
	cr_assert(s.master_bf16 == (uint16_t *)m16 + 512 && s.base == (1u << 20) + 512 &&
	    (uint8_t *)s.m == m + 512 && s.m_scale == ms + 2);
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 0, 600), 0);
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 0, 300), -EINVAL, "end inside a block");
	h.optim = ZK_OPTIM_ADAGRAD;
	cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &h, &t, 0, 600), -ENOTSUP);
}

/* The pool splits on block boundaries: 1-3 threads give the bits of one call. */
Test(qpool, threads_same_bits)
{
	enum zk_isa isa = isa_under_test();
	size_t n = 100003, nb = zk_state_blocks(ZK_STATE_Q8, n);
	struct rng r = { 3 };
	float *master[2], *ms[2], *vs[2];
	uint8_t *m[2], *v[2];
	uint16_t *g = malloc(n * 2), *p[2];
	struct zk_hparams h = hparams(ZK_OPTIM_ADAMW, 0);

	for (int c = 0; c < 2; c++) {
		master[c] = calloc(n, 4);
		m[c] = calloc(n, 1);
		v[c] = calloc(n, 1);
		ms[c] = calloc(nb, 4);
		vs[c] = calloc(nb, 4);
		p[c] = calloc(n, 2);
		cr_assert(master[c] && m[c] && v[c] && ms[c] && vs[c] && p[c]);
	}
	cr_assert(g);
	for (unsigned threads = 1; threads <= 3; threads++) {
		struct zk_pool *pool;
		struct zk_qtensor t[2];

		cr_assert_eq(zk_pool_new(threads, NULL, 0, &pool), 0);
		for (int c = 0; c < 2; c++) {
			for (size_t i = 0; i < n; i++)
				master[c][i] = (float)(i % 1000) * 1e-3f;
			memset(m[c], 0, n);
			memset(v[c], 0, n);
			memset(ms[c], 0, nb * 4);
			memset(vs[c], 0, nb * 4);
			t[c] = (struct zk_qtensor){ .format = ZK_STATE_Q8, .master = master[c], .m = m[c],
				.v = v[c], .m_scale = ms[c], .v_scale = vs[c], .grad = g,
				.grad_dtype = ZK_DTYPE_BF16, .param = p[c], .param_dtype = ZK_DTYPE_BF16, .n = n };
		}
		for (int s = 0; s < 3; s++) {
			for (size_t i = 0; i < n; i++)
				g[i] = zk_f32_to_bf16(rng_float(&r, -1, 1));
			cr_assert_eq(zk_qstep(isa, &h, &t[0], 0, n), 0);
			cr_assert_eq(zk_pool_qstep(pool, isa, &h, &t[1], 1), 0);
			h.step++;
		}
		cr_assert_eq(memcmp(master[0], master[1], n * 4), 0, "%u threads", threads);
		cr_assert_eq(memcmp(m[0], m[1], n), 0, "%u threads", threads);
		cr_assert_eq(memcmp(v[0], v[1], n), 0, "%u threads", threads);
		cr_assert_eq(memcmp(ms[0], ms[1], nb * 4), 0, "%u threads", threads);
		cr_assert_eq(memcmp(p[0], p[1], n * 2), 0, "%u threads", threads);
		cr_assert_eq(zk_pool_qmemonly(pool, isa, &t[1], 1), 0);
		cr_assert_eq(memcmp(master[0], master[1], n * 4), 0, "memonly leaves the state");
		cr_assert_eq(memcmp(m[0], m[1], n), 0, "memonly leaves the state");
		h.optim = ZK_OPTIM_LION;
		cr_assert_eq(zk_pool_qstep(pool, isa, &h, &t[1], 1), -ENOTSUP);
		h.optim = ZK_OPTIM_ADAMW;
		zk_pool_free(pool);
	}
	for (int c = 0; c < 2; c++) {
		free(master[c]);
		free(m[c]);
		free(v[c]);
		free(ms[c]);
		free(vs[c]);
		free(p[c]);
	}
	free(g);
}
