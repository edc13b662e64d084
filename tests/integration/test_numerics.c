/* A real zoffloadd's AdamW/Adam/Lion/Adagrad steps and gradient clipping against double-precision references (itd.c), driven through libzclient. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "itd.h"

/*
 * Tolerance: the daemon keeps master, m and v in fp32 and rounds after every
 * operation; the reference is double.  Each step rounds p twice (decay,
 * update), m and v a few times each, every rounding at most half an ulp,
 * i.e. 2^-24 of the largest magnitude.  Over 20 steps the roundings of p add
 * up to at most 40 half-ulps worst case (2.4e-6 relative) but they are
 * independent, so the sum grows like sqrt(40); m and v are moving averages
 * that forget old errors (by 0.9 and 0.999 a step).  Measured on these seeds,
 * the worst element of any array is off by 6e-7 of the array's maximum.
 * 2e-6 leaves 3x room for that and for the fp32 rounding of the
 * hyperparameters (1 - beta1 = 0.1 is not exact in fp32), and is still ~1000
 * times smaller than one step's update (lr = 2e-3), so a wrong formula, a
 * missing bias correction or decay, or a skipped step cannot pass.
 */
#define REL_TOL 2e-6
#define STEPS 20

/* Not multiples of any vector width, and one smaller than a vector. */
static const size_t sizes[] = { 100003, 33335, 17 };
#define NT (sizeof(sizes) / sizeof(sizes[0]))

struct ref {
	size_t n;
	enum zc_dtype grad_dtype;
	enum zc_dtype param_dtype;
	double *p, *m, *v;
	double *g;		/* the gradient the daemon consumes this step, unscaled */
	bool *coin;		/* Lion: elements whose sign(c) was within rounding of zero */
	struct zc_tensor *t;
};

/* One numerics run: hyperparameters, clipping, the gradients' shape. */
struct ncase {
	struct zc_step_params sp;	/* step set per step, lr scaled down per step */
	double clip_factor;		/* > 0: max_grad_norm = clip_factor x the set's norm */
	double acc0;			/* Adagrad: state_sum written before step 1 */
	double grad_mag;		/* f32 gradients are uniform in +-grad_mag (0: 1) */
	bool zero_grads;		/* every 8th element's gradient is 0 throughout */
};

static double grad_mag = 1;
static bool zero_grads;

static struct itd daemon_;
static struct zc_conn *conn;
static struct ref refs[NT];

static void
setup(void)
{
	itd_start(&daemon_, NULL);
	conn = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(conn, "numerics", 0, 1), 0, "%s", zc_errmsg(conn));
}

static void
teardown(void)
{
	zc_disconnect(conn);
	conn = NULL;
	for (size_t i = 0; i < NT; i++) {
		free(refs[i].p);
		free(refs[i].m);
		free(refs[i].v);
		free(refs[i].g);
		free(refs[i].coin);
		memset(&refs[i], 0, sizeof(refs[i]));
	}
	itd_cleanup(&daemon_);
}

TestSuite(numerics, .init = setup, .fini = teardown, .timeout = 60);

static void
register_tensors(struct itd_rng *rng, const enum zc_dtype *grad_dtypes, enum zc_dtype param_dtype)
{
	char name[32];

	for (size_t k = 0; k < NT; k++) {
		struct ref *r = &refs[k];
		float *init = malloc(sizes[k] * sizeof(float));
		struct zc_tensor_desc desc = { .name = name, .numel = sizes[k],
			.grad_dtype = grad_dtypes[k], .param_dtype = param_dtype };
		int rc;

		r->n = sizes[k];
		r->grad_dtype = grad_dtypes[k];
		r->param_dtype = param_dtype;
		r->p = calloc(r->n, sizeof(double));
		r->m = calloc(r->n, sizeof(double));
		r->v = calloc(r->n, sizeof(double));
		r->g = calloc(r->n, sizeof(double));
		r->coin = calloc(r->n, sizeof(bool));
		cr_assert(init && r->p && r->m && r->v && r->g && r->coin);
		for (size_t i = 0; i < r->n; i++) {
			init[i] = (float)itd_uniform(rng);
			r->p[i] = init[i];
		}
		snprintf(name, sizeof(name), "layer%zu.weight", k);
		rc = zc_tensor_register(conn, &desc, init, &r->t);
		cr_assert_eq(rc, 0, "register %s: %s", name, zc_errmsg(conn));
		free(init);
	}
}

/*
 * Writes a fresh random gradient into each grad slot and records the value
 * the daemon will consume: the dtype's own rounding, then divided by scale.
 */
static void
fill_grads(struct itd_rng *rng, double scale)
{
	for (size_t k = 0; k < NT; k++) {
		struct ref *r = &refs[k];
		void *slot = zc_tensor_grad_slot(r->t, NULL);

		for (size_t i = 0; i < r->n; i++) {
			/* Lion's sign(0) and Adagrad's untouched sum: g = 0 (and m = 0) forever. */
			if (zero_grads && i % 8 == 0) {
				memset((char *)slot + i * (r->grad_dtype == ZC_F32 ? 4 : 2), 0,
				    r->grad_dtype == ZC_F32 ? 4 : 2);
				r->g[i] = 0;
				continue;
			}
			switch (r->grad_dtype) {
			case ZC_F32: {
				float g = (float)(itd_uniform(rng) * grad_mag * scale);

				((float *)slot)[i] = g;
				r->g[i] = (double)g / scale;
				break;
			}
			case ZC_BF16: {
				/* Truncation makes a bf16 value without the daemon's converter. */
				float f = (float)(itd_uniform(rng) * scale);
				uint32_t bits;

				memcpy(&bits, &f, sizeof(bits));
				((uint16_t *)slot)[i] = (uint16_t)(bits >> 16);
				r->g[i] = (double)itd_bf16_to_f32((uint16_t)(bits >> 16)) / scale;
				break;
			}
			case ZC_F16: {
				/*
				 * Random fp16 bit patterns, exponents 0 (subnormal) to 26
				 * (< 4096): what a loss-scaled fp16 backward leaves behind.
				 */
				uint64_t x = itd_rand(rng);
				uint16_t h = (uint16_t)(((x & 1) << 15) | (((x >> 1) % 27) << 10) |
				    ((x >> 8) & 0x3ff));

				((uint16_t *)slot)[i] = h;
				r->g[i] = (double)itd_f16_to_f32(h) / scale;
				break;
			}
			}
		}
	}
}

static void
ref_step(struct ref *r, const struct zc_step_params *sp)
{
	float *got;

	switch (sp->optim) {
	case ZC_ADAMW:
	case ZC_ADAM:
		itd_ref_adam(r->p, r->m, r->v, r->g, r->n, sp);
		break;
	case ZC_ADAGRAD:
		itd_ref_adagrad(r->p, r->m, r->g, r->n, sp);
		break;
	case ZC_LION:
		if (itd_ref_lion(r->p, r->m, r->g, r->n, sp, r->coin) == 0)
			break;
		/* A coin-toss sign: take the daemon's weight for that element. */
		got = malloc(r->n * sizeof(float));
		cr_assert_not_null(got);
		cr_assert_eq(zc_tensor_read(r->t, ZC_STATE_MASTER, 0, r->n, got), 0, "%s",
		    zc_errmsg(conn));
		for (size_t i = 0; i < r->n; i++)
			if (r->coin[i])
				r->p[i] = got[i];
		free(got);
		break;
	}
}

static double
sum_sq(void)
{
	double s = 0;

	for (size_t k = 0; k < NT; k++)
		for (size_t i = 0; i < refs[k].n; i++)
			s += refs[k].g[i] * refs[k].g[i];
	return s;
}

static void
compare_state(const char *what, struct ref *r, enum zc_state which, const double *want)
{
	float *got = malloc(r->n * sizeof(float));
	double max_err = 0, max_mag = 0;
	size_t worst = 0;
	int rc;

	cr_assert_not_null(got);
	rc = zc_tensor_read(r->t, which, 0, r->n, got);
	cr_assert_eq(rc, 0, "zc_tensor_read: %s", zc_errmsg(conn));
	for (size_t i = 0; i < r->n; i++) {
		double err = fabs((double)got[i] - want[i]);

		cr_assert(isfinite(got[i]), "%s[%zu] of %zu is %f", what, i, r->n, got[i]);
		if (err > max_err) {
			max_err = err;
			worst = i;
		}
		if (fabs(want[i]) > max_mag)
			max_mag = fabs(want[i]);
	}
	cr_assert_gt(max_mag, 0, "%s: reference is all zero", what);
	cr_assert_leq(max_err, REL_TOL * max_mag,
	    "%s (n=%zu): max error %.3g at [%zu] (got %.9g, want %.9g) > %.1g x %.3g", what, r->n,
	    max_err, worst, (double)got[worst], want[worst], REL_TOL, max_mag);
	free(got);
}

/* The param slot is the master weights rounded to the slot's dtype, exactly. */
static void
check_param_slot(struct ref *r)
{
	const void *slot = zc_tensor_param_slot(r->t, NULL);
	float *master = malloc(r->n * sizeof(float));

	cr_assert_not_null(master);
	cr_assert_eq(zc_tensor_read(r->t, ZC_STATE_MASTER, 0, r->n, master), 0, "%s",
	    zc_errmsg(conn));
	for (size_t i = 0; i < r->n; i++) {
		if (r->param_dtype == ZC_BF16) {
			uint16_t want = itd_f32_to_bf16_rne(master[i]);
			uint16_t got = ((const uint16_t *)slot)[i];

			cr_assert_eq(got, want, "param[%zu] = 0x%04x, bf16(%.9g) is 0x%04x", i, got,
			    (double)master[i], want);
		} else if (r->param_dtype == ZC_F32) {
			cr_assert_eq(memcmp(&((const float *)slot)[i], &master[i], 4), 0,
			    "param[%zu] = %.9g, master %.9g", i, (double)((const float *)slot)[i],
			    (double)master[i]);
		}
	}
	free(master);
}

/* Lion and Adagrad keep one moment (momentum, sum of squares) in exp_avg. */
static void
compare_all(enum zc_optim optim)
{
	for (size_t k = 0; k < NT; k++) {
		compare_state("master", &refs[k], ZC_STATE_MASTER, refs[k].p);
		compare_state(optim == ZC_LION ? "exp_avg (momentum)" : optim == ZC_ADAGRAD ?
		    "exp_avg (state_sum)" : "exp_avg", &refs[k], ZC_STATE_EXP_AVG, refs[k].m);
		if (optim == ZC_ADAMW || optim == ZC_ADAM)
			compare_state("exp_avg_sq", &refs[k], ZC_STATE_EXP_AVG_SQ, refs[k].v);
		check_param_slot(&refs[k]);
	}
}

/* Submits the set, waits, checks every tensor and the set applied step sp->step. */
static void
step_and_check(const struct zc_step_params *sp, struct zc_step_result *ret)
{
	struct zc_tensor *ts[NT];
	struct zc_step_result res;
	int rc;

	for (size_t k = 0; k < NT; k++)
		ts[k] = refs[k].t;
	rc = zc_step_submit(conn, sp, ts, NT);
	cr_assert_eq(rc, 0, "submit step %llu: %s", (unsigned long long)sp->step, zc_errmsg(conn));
	for (size_t k = 0; k < NT; k++) {
		rc = zc_wait_tensor(ts[k], &res);
		cr_assert_eq(rc, 0, "wait tensor %zu: %s", k, zc_errmsg(conn));
		cr_assert_eq(res.status, ZC_STEP_APPLIED, "tensor %zu step %llu: status %d", k,
		    (unsigned long long)sp->step, res.status);
		cr_assert_eq(res.step, sp->step);
	}
	rc = zc_wait_all(conn, &res);
	cr_assert_eq(rc, 0, "wait all: %s", zc_errmsg(conn));
	cr_assert_eq(res.status, ZC_STEP_APPLIED);
	cr_assert_eq(res.step, sp->step);
	if (ret != NULL)
		*ret = res;
	for (size_t k = 0; k < NT; k++)
		ref_step(&refs[k], sp);
}

/* Loads Adagrad's initial accumulator into the daemon and the reference. */
static void
write_accumulator(double acc0)
{
	for (size_t k = 0; k < NT; k++) {
		struct ref *r = &refs[k];
		float *sum = malloc(r->n * sizeof(float));

		cr_assert_not_null(sum);
		for (size_t i = 0; i < r->n; i++) {
			sum[i] = (float)acc0;
			r->m[i] = sum[i];
		}
		cr_assert_eq(zc_tensor_write(r->t, ZC_STATE_EXP_AVG, 0, r->n, sum), 0, "%s",
		    zc_errmsg(conn));
		free(sum);
	}
}

static void
run_case(const struct ncase *nc, const enum zc_dtype *grad_dtypes, enum zc_dtype param_dtype,
    uint64_t seed)
{
	struct itd_rng rng = { seed };
	struct zc_step_params sp = nc->sp;
	struct zc_step_result res;

	grad_mag = nc->grad_mag > 0 ? nc->grad_mag : 1;
	zero_grads = nc->zero_grads;
	register_tensors(&rng, grad_dtypes, param_dtype);
	if (nc->acc0 != 0)
		write_accumulator(nc->acc0);
	for (uint64_t t = 1; t <= STEPS; t++) {
		double norm, coef = 1;

		sp.step = t;
		/* A per-step lr, as a schedule would send. */
		sp.lr = nc->sp.lr * (1.0 - 0.02 * (double)t);
		fill_grads(&rng, sp.grad_scale);
		norm = sqrt(sum_sq());
		/*
		 * torch.nn.utils.clip_grad_norm_ over the whole set: coef =
		 * max_norm / (total_norm + 1e-6), applied only when below 1.  The
		 * reference clips the gradients it feeds itself; the daemon gets
		 * only max_grad_norm.
		 */
		if (nc->clip_factor > 0) {
			sp.max_grad_norm = nc->clip_factor * norm;
			coef = sp.max_grad_norm / (norm + 1e-6);
			if (coef < 1)
				for (size_t k = 0; k < NT; k++)
					for (size_t i = 0; i < refs[k].n; i++)
						refs[k].g[i] *= coef;
		}
		step_and_check(&sp, &res);
		/*
		 * With check_finite or clipping the daemon reports the set's global
		 * norm of the unscaled gradients before clipping (what
		 * clip_grad_norm_ returns); it sums squares in double, so 1e-9
		 * relative.
		 */
		if (sp.check_finite || sp.max_grad_norm > 0)
			cr_assert(fabs(res.grad_norm - norm) <= 1e-9 * norm,
			    "step %llu: grad_norm %.12g, want %.12g (clip coefficient %.6g)",
			    (unsigned long long)t, res.grad_norm, norm, coef);
	}
	compare_all(sp.optim);
}

static void
run(enum zc_optim optim, const enum zc_dtype *grad_dtypes, enum zc_dtype param_dtype,
    double grad_scale, uint64_t seed)
{
	const struct ncase nc = { .sp = { .optim = optim, .lr = 2e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1, .grad_scale = grad_scale,
		.check_finite = grad_scale != 1.0 } };

	run_case(&nc, grad_dtypes, param_dtype, seed);
}

Test(numerics, adamw_f32_grads_bf16_params)
{
	static const enum zc_dtype g[NT] = { ZC_F32, ZC_F32, ZC_F32 };

	run(ZC_ADAMW, g, ZC_BF16, 1.0, 0x1234567);
}

Test(numerics, adam_l2_weight_decay)
{
	static const enum zc_dtype g[NT] = { ZC_F32, ZC_F32, ZC_F32 };

	run(ZC_ADAM, g, ZC_F32, 1.0, 0xabcdef);
}

Test(numerics, adamw_bf16_grads)
{
	static const enum zc_dtype g[NT] = { ZC_BF16, ZC_BF16, ZC_BF16 };

	run(ZC_ADAMW, g, ZC_BF16, 1.0, 0x5eed);
}

Test(numerics, adamw_f16_grads_loss_scale)
{
	static const enum zc_dtype g[NT] = { ZC_F16, ZC_F16, ZC_F16 };

	run(ZC_ADAMW, g, ZC_BF16, 1024.0, 0xf16f16);
}

/* Tensors of different gradient dtypes in one set, with Adam. */
Test(numerics, adam_mixed_grad_dtypes_loss_scale)
{
	static const enum zc_dtype g[NT] = { ZC_F16, ZC_BF16, ZC_F32 };

	run(ZC_ADAM, g, ZC_F32, 1024.0, 0x77);
}

/* Lion with its decoupled decay, sign(0) = 0 on the elements whose g and m stay 0. */
Test(numerics, lion_vs_double)
{
	static const enum zc_dtype g[NT] = { ZC_F32, ZC_BF16, ZC_F16 };
	const struct ncase nc = { .sp = { .optim = ZC_LION, .lr = 1e-2, .beta1 = 0.9,
		.beta2 = 0.99, .weight_decay = 0.5, .grad_scale = 1 }, .zero_grads = true };

	run_case(&nc, g, ZC_BF16, 0x1107);
}

/*
 * Adagrad with lr_decay, L2 decay and torch's initial_accumulator_value.
 * The API has no initial_accumulator_value: a client gets torch's
 * behaviour by writing it into the sum (exp_avg) before the first step,
 * which is what this does.
 */
Test(numerics, adagrad_vs_double)
{
	static const enum zc_dtype g[NT] = { ZC_F32, ZC_F16, ZC_BF16 };
	const struct ncase nc = { .sp = { .optim = ZC_ADAGRAD, .lr = 5e-2, .eps = 1e-10,
		.weight_decay = 0.01, .lr_decay = 0.1, .grad_scale = 1 }, .acc0 = 0.1,
		.zero_grads = true };

	run_case(&nc, g, ZC_F32, 0xada);
}

/* torch's Adagrad defaults: no decay, sum from 0, eps 1e-10. */
Test(numerics, adagrad_defaults_vs_double)
{
	static const enum zc_dtype g[NT] = { ZC_F32, ZC_F32, ZC_F32 };
	const struct ncase nc = { .sp = { .optim = ZC_ADAGRAD, .lr = 1e-2, .eps = 1e-10,
		.grad_scale = 1 } };

	run_case(&nc, g, ZC_BF16, 0xada2);
}

/*
 * Clipping against the reference's own clip_grad_norm_: max_grad_norm below
 * the set's norm scales every gradient of the set by one coefficient; m and
 * v are linear and quadratic in it, so a wrong coefficient shows there even
 * where Adam's update is scale-free.
 */
Test(numerics, clip_below_norm)
{
	static const enum zc_dtype g[NT] = { ZC_F32, ZC_F32, ZC_F32 };
	const struct ncase nc = { .sp = { .optim = ZC_ADAMW, .lr = 2e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1, .grad_scale = 1 },
		.clip_factor = 0.25 };

	run_case(&nc, g, ZC_BF16, 0xc11b);
}

/* Above the norm the coefficient would be 1.5: it is capped at 1 (no clipping). */
Test(numerics, clip_above_norm)
{
	static const enum zc_dtype g[NT] = { ZC_F32, ZC_F32, ZC_F32 };
	const struct ncase nc = { .sp = { .optim = ZC_ADAM, .lr = 2e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1, .grad_scale = 1 },
		.clip_factor = 1.5 };

	run_case(&nc, g, ZC_F32, 0xc11a);
}

/*
 * A set whose norm (~2e-6) is comparable to the 1e-6 in the coefficient's
 * denominator: coef = 0.5 x norm / (norm + 1e-6) is a third below 0.5, so
 * the 1e-6 is checked too.  Lion would not see the scale; Adagrad's sum does.
 */
Test(numerics, clip_tiny_norm)
{
	static const enum zc_dtype g[NT] = { ZC_F32, ZC_F32, ZC_F32 };
	const struct ncase nc = { .sp = { .optim = ZC_ADAGRAD, .lr = 1e-2, .eps = 1e-10,
		.grad_scale = 1 }, .clip_factor = 0.5, .grad_mag = 1e-8 };

	run_case(&nc, g, ZC_F32, 0xc117);
}

/* fp16 loss-scaled grads: the norm and the clipping apply to the unscaled gradients. */
Test(numerics, clip_loss_scaled_mixed_dtypes)
{
	static const enum zc_dtype g[NT] = { ZC_F16, ZC_BF16, ZC_F32 };
	const struct ncase nc = { .sp = { .optim = ZC_ADAMW, .lr = 2e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1, .grad_scale = 1024,
		.check_finite = true }, .clip_factor = 0.3 };

	run_case(&nc, g, ZC_BF16, 0xc116);
}

struct snapshot {
	float *state[3];
	void *param;
	size_t param_bytes;
};

static void
take_snapshot(struct snapshot *s, struct ref *r)
{
	const void *slot = zc_tensor_param_slot(r->t, &s->param_bytes);

	for (int w = 0; w < 3; w++) {
		s->state[w] = malloc(r->n * sizeof(float));
		cr_assert_not_null(s->state[w]);
		cr_assert_eq(zc_tensor_read(r->t, (enum zc_state)w, 0, r->n, s->state[w]), 0, "%s",
		    zc_errmsg(conn));
	}
	s->param = malloc(s->param_bytes);
	cr_assert_not_null(s->param);
	memcpy(s->param, slot, s->param_bytes);
}

static void
expect_unchanged(struct snapshot *s, struct ref *r, size_t k)
{
	float *now = malloc(r->n * sizeof(float));

	cr_assert_not_null(now);
	for (int w = 0; w < 3; w++) {
		cr_assert_eq(zc_tensor_read(r->t, (enum zc_state)w, 0, r->n, now), 0, "%s",
		    zc_errmsg(conn));
		cr_assert_eq(memcmp(now, s->state[w], r->n * sizeof(float)), 0,
		    "tensor %zu state %d changed by a skipped step", k, w);
	}
	cr_assert_eq(memcmp(zc_tensor_param_slot(r->t, NULL), s->param, s->param_bytes), 0,
	    "tensor %zu param slot changed by a skipped step", k);
	free(now);
}

static void
free_snapshot(struct snapshot *s)
{
	for (int w = 0; w < 3; w++)
		free(s->state[w]);
	free(s->param);
}

/* Submits with one poisoned gradient and expects the whole set skipped, nothing touched. */
static void
expect_skipped(const struct zc_step_params *sp)
{
	struct zc_tensor *ts[NT];
	struct snapshot snap[NT];
	struct zc_step_result res;
	int rc;

	for (size_t k = 0; k < NT; k++) {
		ts[k] = refs[k].t;
		take_snapshot(&snap[k], &refs[k]);
	}
	rc = zc_step_submit(conn, sp, ts, NT);
	cr_assert_eq(rc, 0, "%s", zc_errmsg(conn));
	rc = zc_wait_all(conn, &res);
	cr_assert_eq(rc, 0, "a skipped set is not an error: %s", zc_errmsg(conn));
	cr_assert_eq(res.status, ZC_STEP_SKIPPED_NONFINITE, "set status %d", res.status);
	cr_assert_eq(res.step, sp->step);
	for (size_t k = 0; k < NT; k++) {
		rc = zc_wait_tensor(ts[k], &res);
		cr_assert_eq(rc, 0);
		cr_assert_eq(res.status, ZC_STEP_SKIPPED_NONFINITE, "tensor %zu status %d", k,
		    res.status);
		cr_assert_eq(res.step, sp->step);
		expect_unchanged(&snap[k], &refs[k], k);
		free_snapshot(&snap[k]);
	}
}

Test(numerics, nonfinite_set_skipped)
{
	static const enum zc_dtype g[NT] = { ZC_F32, ZC_F16, ZC_BF16 };
	struct itd_rng rng = { 99 };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .lr = 2e-3, .beta1 = 0.9, .beta2 = 0.999,
		.eps = 1e-8, .weight_decay = 0.1, .grad_scale = 1024, .check_finite = true };
	uint16_t *h;
	float *f;

	register_tensors(&rng, g, ZC_BF16);
	sp.step = 1;
	fill_grads(&rng, 1024);
	step_and_check(&sp, NULL);

	/* Step 2, fp16 overflow in one element of the middle tensor: the whole set waits. */
	sp.step = 2;
	fill_grads(&rng, 1024);
	h = zc_tensor_grad_slot(refs[1].t, NULL);
	h[refs[1].n / 2] = 0x7c00;	/* +inf */
	expect_skipped(&sp);

	/* Step 2 again (a skipped step does not count), NaN in the last element of the last tensor. */
	fill_grads(&rng, 1024);
	h = zc_tensor_grad_slot(refs[2].t, NULL);
	h[refs[2].n - 1] = 0x7fc1;	/* bf16 NaN */
	expect_skipped(&sp);

	/* -inf in fp32, first element. */
	fill_grads(&rng, 1024);
	f = zc_tensor_grad_slot(refs[0].t, NULL);
	f[0] = -INFINITY;
	expect_skipped(&sp);

	/* Clean gradients: step 2 applies, then 3. */
	fill_grads(&rng, 1024);
	step_and_check(&sp, NULL);
	sp.step = 3;
	fill_grads(&rng, 1024);
	step_and_check(&sp, NULL);
	compare_all(sp.optim);
	cr_assert_eq(itd_stat(conn, "steps.skipped_nonfinite"), 3);
	cr_assert_eq(itd_stat(conn, "steps.applied"), 3);
}

/*
 * Clipping by the norm of the whole model when it is split over ranks: each
 * rank's gradient pass returns its share, the shares add up (an all-reduce),
 * and every rank steps with torch.nn.utils.clip_grad_norm_'s coefficient,
 * max_norm / (norm + 1e-6) capped at 1.  Here two sets stand for two ranks;
 * the norm is a double sum, so it matches the reference to 1e-9 relative.
 */
Test(numerics, global_clip_across_sets)
{
	static const enum zc_dtype g[NT] = { ZC_F32, ZC_BF16, ZC_F16 };
	struct itd_rng rng = { 0xc11b };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .lr = 2e-3, .beta1 = 0.9, .beta2 = 0.999,
		.eps = 1e-8, .weight_decay = 0.1, .grad_scale = 512 };
	struct zc_tensor *set_a[2], *set_b[1];
	struct zc_grad_partial pa, pb;
	struct zc_step_result res;
	unsigned clipped = 0;

	register_tensors(&rng, g, ZC_BF16);
	set_a[0] = refs[0].t;
	set_a[1] = refs[1].t;
	set_b[0] = refs[2].t;
	for (uint64_t t = 1; t <= STEPS; t++) {
		double want_a = 0, want_b = 0, norm, max_norm, coef, want_coef;

		sp.step = t;
		fill_grads(&rng, sp.grad_scale);
		for (size_t k = 0; k < NT; k++)
			for (size_t i = 0; i < refs[k].n; i++)
				*(k < 2 ? &want_a : &want_b) += refs[k].g[i] * refs[k].g[i];
		/* Phase 1: each set's share. */
		cr_assert_eq(zc_grad_pass(conn, set_a, 2, sp.grad_scale, &pa), 0, "%s",
		    zc_errmsg(conn));
		cr_assert_eq(zc_grad_pass(conn, set_b, 1, sp.grad_scale, &pb), 0, "%s",
		    zc_errmsg(conn));
		cr_assert(fabs(pa.sumsq - want_a) <= 1e-9 * want_a, "set a: %.12g, want %.12g",
		    pa.sumsq, want_a);
		cr_assert(fabs(pb.sumsq - want_b) <= 1e-9 * want_b, "set b: %.12g, want %.12g",
		    pb.sumsq, want_b);
		cr_assert_eq(pa.nonfinite + pb.nonfinite, 0);
		cr_assert_eq(pa.elements, sizes[0] + sizes[1]);
		/* Clip on most steps, not on every third: max_norm around the norm. */
		norm = sqrt(want_a + want_b);
		max_norm = t % 3 == 0 ? 2 * norm : 0.5 * norm;
		coef = zc_clip_coef(max_norm, pa.sumsq + pb.sumsq);
		want_coef = max_norm / (norm + 1e-6);
		want_coef = want_coef < 1 ? want_coef : 1;
		cr_assert(fabs(coef - want_coef) <= 1e-12, "coef %.15g, want %.15g", coef, want_coef);
		clipped += coef < 1;
		/* Phase 2: both sets with the one coefficient. */
		sp.clip_coef = coef;
		cr_assert_eq(zc_step_submit(conn, &sp, set_a, 2), 0, "%s", zc_errmsg(conn));
		cr_assert_eq(zc_step_submit(conn, &sp, set_b, 1), 0, "%s", zc_errmsg(conn));
		cr_assert_eq(zc_wait_all(conn, &res), 0, "%s", zc_errmsg(conn));
		cr_assert_eq(res.status, ZC_STEP_APPLIED);
		for (size_t k = 0; k < NT; k++) {
			for (size_t i = 0; i < refs[k].n; i++)
				refs[k].g[i] *= coef;
			ref_step(&refs[k], &sp);
		}
	}
	cr_assert_gt(clipped, STEPS / 2);
	compare_all(sp.optim);
}

/* A non-finite gradient anywhere shows in that set's share: every rank skips the step. */
Test(numerics, grad_pass_counts_nonfinite)
{
	static const enum zc_dtype g[NT] = { ZC_F32, ZC_F16, ZC_BF16 };
	struct itd_rng rng = { 0x1f };
	struct zc_tensor *ts[NT];
	struct zc_grad_partial p;

	register_tensors(&rng, g, ZC_BF16);
	for (size_t k = 0; k < NT; k++)
		ts[k] = refs[k].t;
	fill_grads(&rng, 1024);
	((uint16_t *)zc_tensor_grad_slot(refs[1].t, NULL))[5] = 0x7c00;	/* fp16 inf */
	cr_assert_eq(zc_grad_pass(conn, ts, NT, 1024, &p), 0, "%s", zc_errmsg(conn));
	cr_assert_eq(p.nonfinite, 1);
	cr_assert_eq(zc_clip_coef(1.0, p.sumsq), 1.0, "a non-finite norm clips nothing");
	/* The pass left the tensors free to step. */
	cr_assert_eq(zc_grad_pass(conn, ts, NT, 1024, &p), 0, "%s", zc_errmsg(conn));
}
