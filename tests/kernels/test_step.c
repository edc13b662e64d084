/* Step tests: every SIMD variant against the scalar reference, and the reference against double precision. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "helpers.h"

#define MAXN 1100
#define PAD 64		/* room to shift the arrays off their alignment */

/*
 * Tolerance SIMD vs scalar: none.  Both do the same IEEE operations in the
 * same order, with no FMA anywhere (-ffp-contract=off on the library), and
 * the conversions are exact or round-to-nearest-even the same way, so each
 * result must have the same bits; only NaN payloads may differ (helpers.h).
 * Anything looser would hide a reordered or fused operation.
 */

static const uint32_t extremes[] = {
	0x00000000, 0x80000000,			/* +-0 */
	0x00000001, 0x807fffff, 0x00400000,	/* f32 subnormals */
	0x00800000, 0x33000000, 0x33800000,	/* FLT_MIN, f16 subnormal range */
	0x38800000, 0x387fc000,			/* around the f16 normal boundary */
	0x3f800000, 0xbf800000, 0x3f808000,	/* 1, -1, a bf16 tie */
	0x477fe000, 0x477ff000, 0xc77fefff,	/* around f16 overflow */
	0x7f7fffff, 0xff7fffff, 0x7e000000,	/* FLT_MAX, huge */
	0x7f800000, 0xff800000,			/* inf */
	0x7fc00000, 0xffc00001, 0x7f800001,	/* NaNs */
	0x2f800000, 0x1e3ce508,			/* tiny but normal */
};
#define NEXTREME (sizeof(extremes) / sizeof(extremes[0]))

static float pick(struct rng *r, bool extreme, float lo, float hi)
{
	if (extreme && rng_next(r) % 3 == 0)
		return bits_f32(extremes[rng_next(r) % NEXTREME]);
	return rng_float(r, lo, hi);
}

struct bufs {
	float master[MAXN + PAD], m[MAXN + PAD], v[MAXN + PAD];
	uint32_t grad[MAXN + PAD];
	uint32_t param[MAXN + PAD];
};

static void fill(struct bufs *b, struct rng *r, enum zk_dtype gdt, bool extreme, bool zero_grad)
{
	for (size_t i = 0; i < MAXN + PAD; i++) {
		float g = zero_grad ? 0.0f : pick(r, extreme, -2, 2);

		b->master[i] = pick(r, extreme, -1, 1);
		b->m[i] = pick(r, extreme, -0.1f, 0.1f);
		b->v[i] = extreme && rng_next(r) % 4 == 0 ? bits_f32(extremes[rng_next(r) % NEXTREME])
							  : rng_float(r, 0, 0.01f);
		b->param[i] = 0xdeadbeef;
		if (gdt == ZK_DTYPE_F32) {
			b->grad[i] = f32_bits(g);
		} else {
			/* Half the extreme grads are raw 16-bit patterns: NaNs, infs, subnormals of that format. */
			uint16_t h = gdt == ZK_DTYPE_BF16 ? zk_f32_to_bf16(g) : zk_f32_to_f16(g);

			if (extreme && rng_next(r) % 2)
				h = (uint16_t)rng_next(r);
			((uint16_t *)b->grad)[i] = h;
		}
	}
}

static struct zk_hparams hparams(enum zk_optim optim, int set, enum zk_dtype gdt)
{
	struct zk_hparams h = {
		.optim = optim, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
		.weight_decay = 0.01, .lr_decay = 0.01, .step = 5, .bias_correction = true,
		.grad_scale = gdt == ZK_DTYPE_F16 ? 1024.0 : 1.0, .clip_coef = 0.7,
	};

	if (set == 1) {
		/* The other lerp branch (1 - beta1 >= 0.5), no decay, no bias correction. */
		h.beta1 = 0.3;
		h.beta2 = 0.5;
		h.weight_decay = 0;
		h.bias_correction = false;
		h.step = 1;
		h.lr = 0.5;
		h.eps = 0;
		h.clip_coef = 1.0;
	}
	if (set == 2)
		h.step = 100000;	/* sqrt(bc2) rounds to 1.0f: the SIMD shortcut */
	return h;
}

static void compare(const struct bufs *a, const struct bufs *b, size_t n, enum zk_dtype pdt,
    bool param, const char *what)
{
	long i;

	i = first_mismatch(a->master, b->master, ZK_DTYPE_F32, n);
	cr_assert_eq(i, -1, "%s: master[%ld] %a vs %a", what, i, i < 0 ? 0 : a->master[i],
	    i < 0 ? 0 : b->master[i]);
	i = first_mismatch(a->m, b->m, ZK_DTYPE_F32, n);
	cr_assert_eq(i, -1, "%s: m[%ld]", what, i);
	i = first_mismatch(a->v, b->v, ZK_DTYPE_F32, n);
	cr_assert_eq(i, -1, "%s: v[%ld]", what, i);
	if (param) {
		i = first_mismatch(a->param, b->param, pdt, n);
		cr_assert_eq(i, -1, "%s: param[%ld]", what, i);
	}
}

static void simd_vs_scalar(enum zk_isa isa)
{
	static const size_t lens[] = { 1, 2, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 257, 1000 };
	static struct bufs ref, out, init;
	struct rng r = { 42 };
	char what[200];

	if (!test_isa_enabled(isa))
		cr_skip_test("%s not under test here", zk_isa_name(isa));
	for (int o = 0; o < ZK_OPTIM_COUNT; o++)
	for (int gdt = 0; gdt < ZK_DTYPE_COUNT; gdt++)
	for (int pdt = 0; pdt <= ZK_DTYPE_COUNT; pdt++)	/* COUNT: no param output */
	for (int mode = 0; mode < 3; mode++)		/* random, extreme, zero gradients */
	for (int set = 0; set < 3; set++)
	for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
		struct zk_hparams h = hparams((enum zk_optim)o, set, (enum zk_dtype)gdt);
		size_t n = lens[li], shift = rng_next(&r) % 9, gs = zk_dtype_size((enum zk_dtype)gdt);
		size_t ps = zk_dtype_size((enum zk_dtype)pdt);
		/* Sub-range calls too: any split of [0, n) must give the same bits. */
		size_t begin = n > 4 && (li & 1) ? rng_next(&r) % (n / 2) : 0;

		fill(&init, &r, (enum zk_dtype)gdt, mode == 1, mode == 2);
		ref = init;
		out = init;
		for (struct bufs *b = &ref; b; b = b == &ref ? &out : NULL) {
			/* Shifted starts make the param slot misaligned, so the head/tail paths run. */
			struct zk_tensor t = {
				.master = b->master + shift, .m = b->m + shift, .v = o <= ZK_OPTIM_ADAM ? b->v + shift : NULL,
				.grad = (char *)b->grad + shift * gs, .grad_dtype = (enum zk_dtype)gdt,
				.param = pdt < ZK_DTYPE_COUNT ? (char *)b->param + shift * ps : NULL,
				.param_dtype = pdt < ZK_DTYPE_COUNT ? (enum zk_dtype)pdt : ZK_DTYPE_F32,
				.n = n,
			};
			enum zk_isa use = b == &ref ? ZK_ISA_SCALAR : isa;

			if (begin)
				cr_assert_eq(zk_step(use, &h, &t, 0, begin), 0);
			cr_assert_eq(zk_step(use, &h, &t, begin, n), 0);
		}
		snprintf(what, sizeof(what), "%s %s grad %s param %s mode %d set %d n %zu shift %zu",
		    zk_isa_name(isa), zk_optim_name((enum zk_optim)o), zk_dtype_name((enum zk_dtype)gdt),
		    pdt < ZK_DTYPE_COUNT ? zk_dtype_name((enum zk_dtype)pdt) : "none", mode, set, n, shift);
		compare(&ref, &out, MAXN + PAD, (enum zk_dtype)pdt, pdt < ZK_DTYPE_COUNT, what);
	}
}

Test(step, avx2_matches_scalar) { simd_vs_scalar(ZK_ISA_AVX2); }
Test(step, avx512_matches_scalar) { simd_vs_scalar(ZK_ISA_AVX512); }

/* The norm is summed in the same 32 lanes by every variant: it must match to the bit too. */
static void grad_vs_scalar(enum zk_isa isa)
{
	static struct bufs b;
	struct rng r = { 5 };

	if (!test_isa_enabled(isa))
		cr_skip_test("%s not under test here", zk_isa_name(isa));
	for (int gdt = 0; gdt < ZK_DTYPE_COUNT; gdt++)
	for (int mode = 0; mode < 2; mode++)
	for (size_t n = 0; n < 300; n += 1 + n / 4) {
		struct zk_grad_stats a = { 1.5, 3 }, c = { 1.5, 3 };
		double scale = gdt == ZK_DTYPE_F16 ? 65536.0 : 1.0;
		size_t begin = n % 5;

		fill(&b, &r, (enum zk_dtype)gdt, mode == 1, false);
		cr_assert_eq(zk_grad_check(ZK_ISA_SCALAR, b.grad, (enum zk_dtype)gdt, scale, begin, n + begin, &a), 0);
		cr_assert_eq(zk_grad_check(isa, b.grad, (enum zk_dtype)gdt, scale, begin, n + begin, &c), 0);
		cr_assert_eq(a.nonfinite, c.nonfinite, "grad %s n %zu", zk_dtype_name((enum zk_dtype)gdt), n);
		cr_assert(memcmp(&a.sumsq, &c.sumsq, sizeof(double)) == 0 || (isnan(a.sumsq) && isnan(c.sumsq)),
		    "grad %s mode %d n %zu: %a vs %a", zk_dtype_name((enum zk_dtype)gdt), mode, n, a.sumsq, c.sumsq);
	}
}

Test(grad, avx2_matches_scalar) { grad_vs_scalar(ZK_ISA_AVX2); }
Test(grad, avx512_matches_scalar) { grad_vs_scalar(ZK_ISA_AVX512); }

Test(grad, counts_and_norm)
{
	uint16_t g[100];
	struct zk_grad_stats s = { 0 };

	if (!test_general_enabled())
		cr_skip_test("ISA-independent");
	for (int i = 0; i < 100; i++)
		g[i] = zk_f32_to_f16(2.0f);
	g[10] = 0x7c00;		/* inf */
	g[20] = 0x7e00;		/* NaN */
	g[30] = 0xfc00;		/* -inf */
	cr_assert_eq(zk_grad_check(ZK_ISA_SCALAR, g, ZK_DTYPE_F16, 4.0, 0, 10, &s), 0);
	cr_assert_eq(s.nonfinite, 0);
	cr_assert_eq(s.sumsq, 10 * 0.25, "unscaled: (2/4)^2 per element");
	cr_assert_eq(zk_grad_check(ZK_ISA_SCALAR, g, ZK_DTYPE_F16, 4.0, 10, 100, &s), 0);
	cr_assert_eq(s.nonfinite, 3);
}

/*
 * The reference against an independent double-precision AdamW/Adam over 20
 * steps, on the same float inputs.  Bound: max |error| <= 2e-6 of the largest
 * magnitude, for master, m and v.  Float rounds each op to 2^-24 relative; 20
 * steps of a handful of ops each stay well inside that unless an operation
 * were missing or in the wrong order (e.g. decay after the update, or eps
 * inside the sqrt, which are off by far more).
 */
static void double_reference(enum zk_optim optim, enum zk_dtype gdt)
{
	enum { N = 4099, STEPS = 20 };
	static float master[N], m[N], v[N], gf[N];
	static double dp[N], dm[N], dv[N];
	static uint16_t gh[N], param[N];
	const double lr = 2e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.05, clip = 0.8;
	const double scale = gdt == ZK_DTYPE_F16 ? 256.0 : 1.0;
	struct rng r = { 11 };
	double err[3] = { 0 }, big[3] = { 0 };

	if (!test_general_enabled())
		cr_skip_test("ISA-independent");
	for (int i = 0; i < N; i++) {
		master[i] = rng_float(&r, -1, 1);
		m[i] = v[i] = 0;
		dp[i] = master[i];
		dm[i] = dv[i] = 0;
	}
	for (uint64_t step = 1; step <= STEPS; step++) {
		struct zk_hparams h = {
			.optim = optim, .lr = lr, .beta1 = b1, .beta2 = b2, .eps = eps,
			.weight_decay = wd, .step = step, .bias_correction = true,
			.grad_scale = scale, .clip_coef = clip,
		};
		struct zk_tensor t = { master, m, v, gdt == ZK_DTYPE_F32 ? (void *)gf : (void *)gh, gdt,
				       param, ZK_DTYPE_BF16, N };
		double bc1 = 1 - pow(b1, (double)step), bc2 = 1 - pow(b2, (double)step);

		for (int i = 0; i < N; i++) {
			/* Wide dynamic range: some elements see tiny gradients, so eps matters. */
			float g = rng_float(&r, -1, 1) * (i % 7 == 0 ? 1e-6f : 1.0f) * (float)scale;

			gf[i] = g;
			gh[i] = gdt == ZK_DTYPE_BF16 ? zk_f32_to_bf16(g) : zk_f32_to_f16(g);
		}
		cr_assert_eq(zk_step(ZK_ISA_SCALAR, &h, &t, 0, N), 0);
		for (int i = 0; i < N; i++) {
			double g = gdt == ZK_DTYPE_F32 ? gf[i] : gdt == ZK_DTYPE_BF16 ? zk_bf16_to_f32(gh[i])
										: zk_f16_to_f32(gh[i]);

			g = g / scale * clip;
			if (optim == ZK_OPTIM_ADAMW)
				dp[i] *= 1 - lr * wd;
			else
				g += wd * dp[i];
			dm[i] = b1 * dm[i] + (1 - b1) * g;
			dv[i] = b2 * dv[i] + (1 - b2) * g * g;
			dp[i] -= lr / bc1 * dm[i] / (sqrt(dv[i]) / sqrt(bc2) + eps);
		}
	}
	for (int i = 0; i < N; i++) {
		const double got[3] = { master[i], m[i], v[i] }, want[3] = { dp[i], dm[i], dv[i] };

		for (int k = 0; k < 3; k++) {
			err[k] = fmax(err[k], fabs(got[k] - want[k]));
			big[k] = fmax(big[k], fabs(want[k]));
		}
		cr_assert_eq(param[i], zk_f32_to_bf16(master[i]), "param slot is the rounded master");
	}
	for (int k = 0; k < 3; k++)
		cr_assert(err[k] <= 2e-6 * big[k], "%s grad %s %s: max error %g, %g of max %g",
		    zk_optim_name(optim), zk_dtype_name(gdt), (const char *[]){ "master", "m", "v" }[k],
		    err[k], err[k] / big[k], big[k]);
	cr_log_info("%s grad %s: relative max error master %.3g m %.3g v %.3g", zk_optim_name(optim),
	    zk_dtype_name(gdt), err[0] / big[0], err[1] / big[1], err[2] / big[2]);
}

Test(reference, adamw_vs_double) { double_reference(ZK_OPTIM_ADAMW, ZK_DTYPE_F32); }
Test(reference, adam_vs_double) { double_reference(ZK_OPTIM_ADAM, ZK_DTYPE_F32); }
Test(reference, adamw_bf16_vs_double) { double_reference(ZK_OPTIM_ADAMW, ZK_DTYPE_BF16); }
Test(reference, adam_f16_vs_double) { double_reference(ZK_OPTIM_ADAM, ZK_DTYPE_F16); }
