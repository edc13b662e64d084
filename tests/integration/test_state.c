/* Saved state written back into a fresh tensor (zc_tensor_write, zc_tensor_set_step) resumes training bit for bit. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "itd.h"

static struct itd daemon_;

static void
setup(void)
{
	itd_start(&daemon_, NULL);
}

static void
teardown(void)
{
	itd_cleanup(&daemon_);
}

TestSuite(state, .init = setup, .fini = teardown, .timeout = 60);

/* Larger than one 16 MiB transfer window of fp32 (4M elements) would be slow; odd-sized. */
#define N 300007
#define STEPS 6
#define SAVE_AT 3

static const enum zc_state states[3] = { ZC_STATE_MASTER, ZC_STATE_EXP_AVG, ZC_STATE_EXP_AVG_SQ };

static struct zc_tensor *
make(struct zc_conn *c, const char *job, const float *init)
{
	struct zc_tensor_desc desc = { .name = "w", .numel = N, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_tensor *t;

	cr_assert_eq(zc_job_open(c, job, 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	return t;
}

static void
step(struct zc_conn *c, struct zc_tensor *t, uint64_t k)
{
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = k, .lr = 1e-2, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 };
	struct zc_step_result res;
	float *g = zc_tensor_grad_slot(t, NULL);
	struct itd_rng rng = { 1000 + k };

	for (size_t i = 0; i < N; i++)
		g[i] = (float)(itd_uniform(&rng) - 0.5);
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_tensor(t, &res), 0, "%s", zc_errmsg(c));
	cr_assert_eq(res.status, ZC_STEP_APPLIED);
}

Test(state, write_back_resumes_bit_for_bit)
{
	struct zc_conn *a = itd_connect(&daemon_), *b = itd_connect(&daemon_);
	float *init = malloc(N * sizeof(float)), *saved[3], *got = malloc(N * sizeof(float)),
	    *want = malloc(N * sizeof(float));
	struct itd_rng rng = { 7 };
	struct zc_tensor *ta, *tb;

	cr_assert(init != NULL && got != NULL && want != NULL);
	for (size_t i = 0; i < N; i++)
		init[i] = (float)itd_uniform(&rng);
	ta = make(a, "uninterrupted", init);
	tb = make(b, "restored", init);
	for (uint64_t k = 1; k <= SAVE_AT; k++)
		step(a, ta, k);
	for (int s = 0; s < 3; s++) {
		saved[s] = malloc(N * sizeof(float));
		cr_assert(saved[s] != NULL);
		cr_assert_eq(zc_tensor_read(ta, states[s], 0, N, saved[s]), 0, "%s", zc_errmsg(a));
	}
	/* b has taken one step of its own: the write must replace all of it. */
	step(b, tb, 1);
	for (int s = 0; s < 3; s++)
		cr_assert_eq(zc_tensor_write(tb, states[s], 0, N, saved[s]), 0, "%s", zc_errmsg(b));
	cr_assert_eq(zc_tensor_set_step(tb, SAVE_AT), 0, "%s", zc_errmsg(b));
	cr_assert_eq(zc_tensor_last_step(tb), SAVE_AT);
	/* The param slot follows the written master weights at once. */
	cr_assert_eq(memcmp(zc_tensor_param_slot(tb, NULL), saved[0], N * sizeof(float)), 0);

	for (uint64_t k = SAVE_AT + 1; k <= STEPS; k++) {
		step(a, ta, k);
		step(b, tb, k);
	}
	for (int s = 0; s < 3; s++) {
		cr_assert_eq(zc_tensor_read(ta, states[s], 0, N, want), 0, "%s", zc_errmsg(a));
		cr_assert_eq(zc_tensor_read(tb, states[s], 0, N, got), 0, "%s", zc_errmsg(b));
		cr_assert_eq(memcmp(got, want, N * sizeof(float)), 0, "state %d differs", s);
		free(saved[s]);
	}
	free(init);
	free(got);
	free(want);
	zc_disconnect(a);
	zc_disconnect(b);
}

Test(state, step_at_or_below_the_set_step_is_refused)
{
	struct zc_conn *c = itd_connect(&daemon_);
	float init[N / 1000];
	struct zc_tensor_desc desc = { .name = "b", .numel = N / 1000, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 5, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	struct zc_step_result res;
	struct zc_tensor *t;

	memset(init, 0, sizeof(init));
	cr_assert_eq(zc_job_open(c, "set-step", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_set_step(t, 5), 0, "%s", zc_errmsg(c));
	/* The refusal comes back with the set's result (submit does not wait for the daemon). */
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_tensor(t, &res), -EALREADY, "%s", zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "already at step 5") != NULL, "%s", zc_errmsg(c));
	sp.step = 6;
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_tensor(t, &res), 0, "%s", zc_errmsg(c));
	cr_assert_eq(res.status, ZC_STEP_APPLIED);
	/* Back to an earlier step (loading an older checkpoint) is allowed. */
	cr_assert_eq(zc_tensor_set_step(t, 2), 0, "%s", zc_errmsg(c));
	sp.step = 3;
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_tensor(t, &res), 0, "%s", zc_errmsg(c));
	cr_assert_eq(res.status, ZC_STEP_APPLIED);
	cr_assert_eq(zc_tensor_write(t, (enum zc_state)7, 0, 1, init), -EINVAL);
	cr_assert_eq(zc_tensor_write(t, ZC_STATE_EXP_AVG, N, 1, init), -ERANGE);
	zc_disconnect(c);
}

/* Resident KiB of the daemon's mappings of its transfer windows. */
static unsigned long
xfer_resident_kib(pid_t pid)
{
	char path[64], line[512];
	unsigned long kib = 0, v;
	bool in = false;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/smaps", (int)pid);
	f = fopen(path, "r");
	cr_assert_not_null(f, "%s", path);
	while (fgets(line, sizeof(line), f) != NULL) {
		unsigned long lo, hi;

		if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2)
			in = strstr(line, "zoffload-xfer") != NULL;
		else if (in && sscanf(line, "Rss: %lu kB", &v) == 1)
			kib += v;
	}
	fclose(f);
	return kib;
}

/*
 * The transfer window's pages (state read or written through it: initial values, a
 * state_dict, a load) are given back at the next step (libzclient punches them before its
 * submit), not held for the session's life:
 * 16 MiB per trainer otherwise, a tenth of a byte a parameter beside 100 M.  The window
 * still works after.
 */
Test(state, transfer_window_given_back_at_the_next_step)
{
	struct zc_conn *c = itd_connect(&daemon_);
	float *init = malloc(N * sizeof(float)), *got = malloc(N * sizeof(float));
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	struct zc_step_result res;
	struct zc_tensor *t;

	for (size_t i = 0; i < N; i++)
		init[i] = (float)i / N;
	t = make(c, "window", init);
	cr_assert_geq(xfer_resident_kib(daemon_.pid), N * sizeof(float) / 1024,
	    "the initial values went through the window");
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_tensor(t, &res), 0, "%s", zc_errmsg(c));
	cr_assert_eq(xfer_resident_kib(daemon_.pid), 0);
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_EXP_AVG, 0, N, got), 0, "%s", zc_errmsg(c));
	/* A zero gradient (the grad slot as made) leaves the master and a zero moment. */
	for (size_t i = 0; i < N; i++)
		cr_assert_eq(got[i], 0.0f);
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, N, got), 0, "%s", zc_errmsg(c));
	cr_assert(memcmp(got, init, N * sizeof(float)) == 0, "the master moved on a zero gradient");
	cr_assert_gt(xfer_resident_kib(daemon_.pid), 0);
	sp.step = 2;
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_tensor(t, &res), 0, "%s", zc_errmsg(c));
	cr_assert_eq(xfer_resident_kib(daemon_.pid), 0);
	free(init);
	free(got);
	zc_disconnect(c);
}

/*
 * A write through the window right after a step submit (the submit does not wait for the
 * daemon) is what the tensor holds.  The daemon used to give the window's pages back when
 * it read the STEP_SUBMIT, which could come after the client had filled the window for
 * the next TENSOR_WRITE: part of the write read as zeros.  zoffload.torch does exactly
 * this with overlap=True (a hook writes a param the user changed, then submits, then the
 * next hook writes the next one).
 */
Test(state, write_right_after_a_submit_is_kept)
{
	enum { BIG = 1 << 21, ROUNDS = 16 };
	struct zc_conn *c = itd_connect(&daemon_);
	struct zc_tensor_desc big = { .name = "big", .numel = BIG, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_tensor_desc small = { .name = "small", .numel = 1024, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	float *vals = malloc(BIG * sizeof(float)), *got = calloc(BIG, sizeof(float));
	struct zc_step_result res;
	struct zc_tensor *tb, *ts;

	cr_assert(vals != NULL && got != NULL);
	cr_assert_eq(zc_job_open(c, "write-after-submit", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &big, got, &tb), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &small, got, &ts), 0, "%s", zc_errmsg(c));
	for (int k = 1; k <= ROUNDS; k++) {
		for (size_t i = 0; i < BIG; i++)
			vals[i] = (float)k + (float)i / BIG;
		/* The round before wrote through the window: this submit releases its pages. */
		sp.step = (uint64_t)k;
		cr_assert_eq(zc_step_submit(c, &sp, &ts, 1), 0, "%s", zc_errmsg(c));
		cr_assert_eq(zc_tensor_write(tb, ZC_STATE_MASTER, 0, BIG, vals), 0, "%s",
		    zc_errmsg(c));
		cr_assert_eq(zc_wait_tensor(ts, &res), 0, "%s", zc_errmsg(c));
		cr_assert_eq(zc_tensor_read(tb, ZC_STATE_MASTER, 0, BIG, got), 0, "%s",
		    zc_errmsg(c));
		for (size_t i = 0; i < BIG; i++)
			cr_assert_eq(got[i], vals[i], "round %d: element %zu is %g, %g written", k,
			    i, (double)got[i], (double)vals[i]);
	}
	free(vals);
	free(got);
	zc_disconnect(c);
}
