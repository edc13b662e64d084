/* Lion and Adagrad kernels against double-precision references written from the papers' and PyTorch's formulas. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>

#include "helpers.h"

/*
 * The SIMD variants are checked bit for bit against the scalar kernel
 * (test_step.c); this file checks the scalar kernel's formulas themselves,
 * so a mistake shared by every variant (sign(0), a dropped decay, an ignored
 * lr_decay) fails here.
 *
 * Lion (Chen et al. 2023, torch-style decoupled weight decay):
 *	p *= 1 - lr*wd;  c = b1*m + (1-b1)*g;  p -= lr*sign(c);  m = b2*m + (1-b2)*g
 * Adagrad (torch.optim.Adagrad 1.13, state_sum starting at
 * initial_accumulator_value):
 *	g += wd*p (when wd != 0);  clr = lr / (1 + (step-1)*lr_decay);
 *	sum += g*g;  p -= clr * g / (sqrt(sum) + eps)
 * g is the gradient divided by the loss scale and multiplied by the clip
 * coefficient, as the daemon hands it to the kernel.
 *
 * Tolerance: max |error| <= 2e-6 of the largest magnitude of the array, as
 * for AdamW (test_step.c): each step rounds every array a few times at 2^-24
 * relative; a dozen steps stay well inside 2e-6 (measured: below 7e-7),
 * while the smallest update checked is lr * wd = 1e-3 relative per step.
 */
#define REL_TOL 2e-6
#define N 4099
#define STEPS 12

/* Element classes, by i % 8, so every formula's edge case is in every run. */
enum {
	ZERO_G_ZERO_M = 0,	/* g = 0 and m = 0: Lion's c = 0, sign(0) = 0; Adagrad's sum stays */
	ZERO_G = 1,		/* g = 0, m != 0: Lion follows the momentum alone */
	TINY_G = 2,		/* |g| ~ 1e-6: Adagrad's eps matters */
};

struct kcase {
	enum zk_optim optim;
	enum zk_dtype gdt;
	double lr, b1, b2, eps, wd, lr_decay, clip, scale;
	double acc0;		/* Adagrad's initial_accumulator_value (m before the first step) */
	uint64_t first_step;
};

static float master[N], m[N], v[N], gf[N];
static uint16_t gh[N], param[N];
static double dp[N], dm[N];

/* The gradient the kernel consumes, from what the slot holds. */
static double consumed(const struct kcase *k, int i)
{
	double g = k->gdt == ZK_DTYPE_F32 ? gf[i] : k->gdt == ZK_DTYPE_BF16 ? zk_bf16_to_f32(gh[i])
									 : zk_f16_to_f32(gh[i]);

	return g / k->scale * k->clip;
}

static int sign(double x)
{
	return (x > 0) - (x < 0);
}

static void check(const struct kcase *k, const char *what, const float *got, const double *want)
{
	double err = 0, big = 0;
	int worst = 0;

	for (int i = 0; i < N; i++) {
		double e = fabs((double)got[i] - want[i]);

		cr_assert(isfinite(got[i]), "%s %s[%d] = %g", zk_optim_name(k->optim), what, i, got[i]);
		if (e > err) {
			err = e;
			worst = i;
		}
		big = fmax(big, fabs(want[i]));
	}
	cr_assert_gt(big, 0, "%s: the reference is all zero", what);
	cr_assert(err <= REL_TOL * big, "%s grad %s %s: max error %g at [%d] (class %d: got %.9g, "
	    "want %.9g), %g of max %g", zk_optim_name(k->optim), zk_dtype_name(k->gdt), what, err,
	    worst, worst % 8, (double)got[worst], want[worst], err / big, big);
	cr_log_info("%s grad %s %s: relative max error %.3g", zk_optim_name(k->optim),
	    zk_dtype_name(k->gdt), what, err / big);
}

static void run(const struct kcase *k, uint64_t seed)
{
	struct rng r = { seed };
	unsigned ambiguous = 0;

	if (!test_general_enabled())
		cr_skip_test("ISA-independent");
	for (int i = 0; i < N; i++) {
		master[i] = rng_float(&r, -1, 1);
		dp[i] = master[i];
		if (k->optim == ZK_OPTIM_ADAGRAD)
			m[i] = (float)k->acc0;
		else
			m[i] = i % 8 == ZERO_G_ZERO_M ? 0.0f : rng_float(&r, -0.5f, 0.5f);
		dm[i] = m[i];
		v[i] = 0;
	}
	for (uint64_t step = k->first_step; step < k->first_step + STEPS; step++) {
		struct zk_hparams h = {
			.optim = k->optim, .lr = k->lr, .beta1 = k->b1, .beta2 = k->b2, .eps = k->eps,
			.weight_decay = k->wd, .lr_decay = k->lr_decay, .step = step,
			.grad_scale = k->scale, .clip_coef = k->clip,
		};
		struct zk_tensor t = { master, m, NULL, k->gdt == ZK_DTYPE_F32 ? (void *)gf : (void *)gh,
				       k->gdt, param, ZK_DTYPE_BF16, N };
		double clr = k->lr / (1 + ((double)step - 1) * k->lr_decay);
		static bool resync[N];

		for (int i = 0; i < N; i++) {
			float g = rng_float(&r, -1, 1) * (float)k->scale;

			if (i % 8 == ZERO_G_ZERO_M || i % 8 == ZERO_G)
				g = 0;
			else if (i % 8 == TINY_G)
				g *= 1e-6f;
			gf[i] = g;
			gh[i] = k->gdt == ZK_DTYPE_BF16 ? zk_f32_to_bf16(g) : zk_f32_to_f16(g);
		}
		for (int i = 0; i < N; i++) {
			double g = consumed(k, i), c, s;

			resync[i] = false;
			if (k->optim == ZK_OPTIM_LION) {
				dp[i] *= 1 - k->lr * k->wd;
				c = k->b1 * dm[i] + (1 - k->b1) * g;
				/*
				 * The float state drifts from the double one by a few ulps,
				 * so where c is within that of zero its sign is a coin
				 * toss: take the kernel's value for that element and count
				 * it.  Exact zeros (g = m = 0) are not ambiguous.
				 */
				s = fabs(k->b1 * dm[i]) + fabs((1 - k->b1) * g);
				if (c != 0 && fabs(c) <= 1e-5 * s) {
					resync[i] = true;
					ambiguous++;
				}
				dp[i] -= k->lr * sign(c);
				dm[i] = k->b2 * dm[i] + (1 - k->b2) * g;
			} else {
				if (k->wd != 0)
					g += k->wd * dp[i];
				dm[i] += g * g;
				dp[i] -= clr * g / (sqrt(dm[i]) + k->eps);
			}
		}
		cr_assert_eq(zk_step(ZK_ISA_SCALAR, &h, &t, 0, N), 0);
		for (int i = 0; i < N; i++)
			if (resync[i])
				dp[i] = master[i];
	}
	cr_assert_leq(ambiguous, N * STEPS / 1000, "%u sign decisions within rounding of zero",
	    ambiguous);
	check(k, "master", master, dp);
	check(k, k->optim == ZK_OPTIM_LION ? "m (momentum)" : "m (sum of squares)", m, dm);
	for (int i = 0; i < N; i++) {
		cr_assert_eq(param[i], zk_f32_to_bf16(master[i]), "param slot is the rounded master");
		cr_assert_eq(f32_bits(v[i]), 0, "v is not Lion's or Adagrad's and stays untouched");
	}
}

Test(reference, lion_vs_double)
{
	const struct kcase k = { .optim = ZK_OPTIM_LION, .gdt = ZK_DTYPE_F32, .lr = 1e-2, .b1 = 0.9,
		.b2 = 0.99, .wd = 0.5, .clip = 0.8, .scale = 1, .first_step = 1 };

	run(&k, 21);
}

/* Other betas, a later step, bf16 grads. */
Test(reference, lion_bf16_vs_double)
{
	const struct kcase k = { .optim = ZK_OPTIM_LION, .gdt = ZK_DTYPE_BF16, .lr = 3e-3,
		.b1 = 0.95, .b2 = 0.98, .wd = 0.1, .clip = 1, .scale = 1, .first_step = 7 };

	run(&k, 22);
}

/* f16 grads carrying a loss scale: unscaled before c and m see them. */
Test(reference, lion_f16_loss_scale_vs_double)
{
	const struct kcase k = { .optim = ZK_OPTIM_LION, .gdt = ZK_DTYPE_F16, .lr = 1e-2, .b1 = 0.9,
		.b2 = 0.99, .wd = 0.2, .clip = 0.5, .scale = 1024, .first_step = 1 };

	run(&k, 23);
}

/* lr_decay, L2 weight decay, an initial accumulator value, clipping. */
Test(reference, adagrad_vs_double)
{
	const struct kcase k = { .optim = ZK_OPTIM_ADAGRAD, .gdt = ZK_DTYPE_F32, .lr = 5e-2,
		.eps = 1e-10, .wd = 0.01, .lr_decay = 0.1, .clip = 0.8, .scale = 1, .acc0 = 0.1,
		.first_step = 1 };

	run(&k, 31);
}

/* torch's defaults (no decay, accumulator 0), later steps, bf16 grads, eps that matters. */
Test(reference, adagrad_bf16_defaults_vs_double)
{
	const struct kcase k = { .optim = ZK_OPTIM_ADAGRAD, .gdt = ZK_DTYPE_BF16, .lr = 1e-2,
		.eps = 1e-6, .clip = 1, .scale = 1, .first_step = 40 };

	run(&k, 32);
}

/* lr_decay from a later step: clr = lr / (1 + (step-1)*lr_decay), with f16 loss scale. */
Test(reference, adagrad_f16_lr_decay_vs_double)
{
	const struct kcase k = { .optim = ZK_OPTIM_ADAGRAD, .gdt = ZK_DTYPE_F16, .lr = 1e-1,
		.eps = 1e-10, .wd = 0.05, .lr_decay = 0.5, .clip = 0.9, .scale = 256, .acc0 = 0.5,
		.first_step = 5 };

	run(&k, 33);
}

/*
 * c exactly zero with m and g both nonzero: with b1 = 0.5 (exact in float)
 * and g = -m the kernel's c is an exact zero, so sign(c) = 0 and the step
 * only decays p.  One step, checked element by element to the bit against
 * the float formula, and against the double reference.
 */
Test(reference, lion_sign_of_exact_zero)
{
	const double lr = 0.25, wd = 0.5, b2 = 0.75;
	struct zk_hparams h = { .optim = ZK_OPTIM_LION, .lr = lr, .beta1 = 0.5, .beta2 = b2,
		.weight_decay = wd, .step = 1, .grad_scale = 1, .clip_coef = 1 };
	struct zk_tensor t = { master, m, NULL, gf, ZK_DTYPE_F32, NULL, ZK_DTYPE_F32, 64 };
	struct rng r = { 41 };

	if (!test_general_enabled())
		cr_skip_test("ISA-independent");
	for (int i = 0; i < 64; i++) {
		master[i] = rng_float(&r, -1, 1);
		m[i] = rng_float(&r, -1, 1);
		/* Every other element: g = -m, c = 0; the rest: g = m, c = m. */
		gf[i] = i % 2 ? m[i] : -m[i];
		dp[i] = master[i];
		dm[i] = m[i];
	}
	cr_assert_eq(zk_step(ZK_ISA_SCALAR, &h, &t, 0, 64), 0);
	for (int i = 0; i < 64; i++) {
		double want = dp[i] * (1 - lr * wd) - lr * (i % 2 ? sign(dm[i]) : 0);
		double mwant = b2 * dm[i] + (1 - b2) * gf[i];

		/*
		 * c = 0: p * 0.875 is exact in double, so the float product is that
		 * rounded once, to the bit.  Elsewhere one more rounding (the add).
		 */
		if (i % 2 == 0)
			cr_assert_eq(master[i], (float)want, "[%d] m %a g %a (c = 0): p %a, want %a",
			    i, dm[i], (double)gf[i], (double)master[i], want);
		else
			cr_assert_leq(fabs(master[i] - want), 2e-7, "[%d] m %a g %a: p %a, want %a",
			    i, dm[i], (double)gf[i], (double)master[i], want);
		cr_assert_leq(fabs(m[i] - mwant), 2e-7, "[%d]: momentum %a, want %a", i,
		    (double)m[i], mwant);
	}
}
