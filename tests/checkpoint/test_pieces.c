/*
 * A framework's flat buffers (DeepSpeed's ZeRO partitions: every parameter laid end to end,
 * padded to a multiple of the world, one slice a rank) saved piece by piece under the
 * parameters' own names (zc_checkpoint_save_pieces), and restored into per-parameter
 * shards or into flat buffers of another world (zc_tensors_register_checkpoint_ranges):
 * bit for bit the uninterrupted run, the padding zero.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ck.h"

#define K 3
#define END 6
/* Padding to a multiple of world * PAD_TO elements: the last rank's slice ends in some. */
#define PAD_TO 64

static struct itd d;
static char swapdir[64], ckdir[64];

static void
teardown(void)
{
	itd_cleanup(&d);
	ck_rmdir(ckdir);
	ck_rmdir(swapdir);
}

TestSuite(pieces, .fini = teardown, .timeout = 240);

/* One rank's slice of the flat buffer, as a tensor. */
struct flat {
	unsigned world;
	uint64_t per;			/* elements a rank */
	struct zc_conn *c[CK_MAX_RANKS];
	struct zc_tensor *t[CK_MAX_RANKS];
};

static uint64_t
param_start(unsigned p)
{
	uint64_t at = 0;

	for (unsigned q = 0; q < p; q++)
		at += ck_param_numel[q];
	return at;
}

static uint64_t
flat_numel(void)
{
	return param_start(CK_PARAMS);
}

/* The ranges of rank r's slice that hold parameters: at most one a parameter. */
static size_t
flat_ranges(const struct flat *f, unsigned r, struct zc_checkpoint_range *out)
{
	uint64_t lo = r * f->per, hi = lo + f->per;
	size_t n = 0;

	for (unsigned p = 0; p < CK_PARAMS; p++) {
		uint64_t a = param_start(p), b = a + ck_param_numel[p];
		uint64_t x = a > lo ? a : lo, y = b < hi ? b : hi;

		if (x < y)
			out[n++] = (struct zc_checkpoint_range){ x - lo, y - x, ck_param_name[p],
				x - a, ck_param_numel[p] };
	}
	return n;
}

/* Element k of rank r's slice: parameter *p, element *i, or false for padding. */
static bool
flat_where(const struct flat *f, unsigned r, uint64_t k, unsigned *p, uint64_t *i)
{
	uint64_t x = r * f->per + k;

	for (unsigned q = 0; q < CK_PARAMS; q++)
		if (x >= param_start(q) && x < param_start(q) + ck_param_numel[q]) {
			*p = q;
			*i = x - param_start(q);
			return true;
		}
	return false;
}

static void
flat_open(struct flat *f, const char *job, unsigned world, enum zc_policy policy)
{
	uint64_t pad = (uint64_t)world * PAD_TO;
	struct zc_job_options o = { .policy = policy };

	memset(f, 0, sizeof(*f));
	f->world = world;
	f->per = (flat_numel() + pad - 1) / pad * pad / world;
	cr_assert_gt(f->per * world, flat_numel(), "the layout has padding");
	for (unsigned r = 0; r < world; r++) {
		f->c[r] = itd_connect(&d);
		cr_assert_eq(zc_job_open_opts(f->c[r], job, r, world, &o), 0, "%s",
		    zc_errmsg(f->c[r]));
	}
}

static void
flat_desc(const struct flat *f, unsigned r, char *name, size_t len, struct zc_tensor_desc *desc)
{
	snprintf(name, len, "flat#%u", r);
	*desc = (struct zc_tensor_desc){ name, f->per, ZC_F32, ZC_F32, false };
}

static void
flat_start(struct flat *f, const char *job, unsigned world, enum zc_policy policy)
{
	flat_open(f, job, world, policy);
	for (unsigned r = 0; r < world; r++) {
		struct zc_tensor_desc desc;
		char name[32];
		float *init = calloc(f->per, sizeof(float));
		unsigned p;
		uint64_t i;

		for (uint64_t k = 0; k < f->per; k++)
			if (flat_where(f, r, k, &p, &i))
				init[k] = ck_value(p, i, 0, 0.5f);
		flat_desc(f, r, name, sizeof(name), &desc);
		cr_assert_eq(zc_tensor_register(f->c[r], &desc, init, &f->t[r]), 0, "%s",
		    zc_errmsg(f->c[r]));
		free(init);
	}
}

static void
flat_restore(struct flat *f, const char *job, unsigned world, enum zc_policy policy,
    const char *dir)
{
	flat_open(f, job, world, policy);
	for (unsigned r = 0; r < world; r++) {
		struct zc_checkpoint_range rg[CK_PARAMS];
		struct zc_tensor_desc desc;
		struct zc_checkpoint *ck;
		char name[32];
		size_t n = flat_ranges(f, r, rg);

		flat_desc(f, r, name, sizeof(name), &desc);
		cr_assert_eq(zc_checkpoint_open(f->c[r], dir, &ck), 0, "%s", zc_errmsg(f->c[r]));
		cr_assert_eq(zc_tensors_register_checkpoint_ranges(f->c[r], 1, &desc, ck, rg, &n,
		    ZC_ADAMW, &f->t[r]), 0, "rank %u: %s", r, zc_errmsg(f->c[r]));
		cr_assert_eq(zc_tensor_last_step(f->t[r]), K);
		zc_checkpoint_close(ck);
	}
}

static void
flat_steps(struct flat *f, uint64_t from, uint64_t to)
{
	for (uint64_t step = from; step <= to; step++) {
		struct zc_step_params sp = ck_params(ZC_ADAMW, step);

		for (unsigned r = 0; r < f->world; r++) {
			float *g = zc_tensor_grad_slot(f->t[r], NULL);
			unsigned p;
			uint64_t i;

			for (uint64_t k = 0; k < f->per; k++)
				g[k] = flat_where(f, r, k, &p, &i) ? ck_value(p, i, step, 0.01f) : 0;
			cr_assert_eq(zc_step_submit(f->c[r], &sp, &f->t[r], 1), 0, "%s",
			    zc_errmsg(f->c[r]));
		}
		for (unsigned r = 0; r < f->world; r++) {
			struct zc_step_result res;

			cr_assert_eq(zc_wait_all(f->c[r], &res), 0, "%s", zc_errmsg(f->c[r]));
			cr_assert_eq(res.status, ZC_STEP_APPLIED);
		}
	}
}

static void
flat_save(struct flat *f, const char *dir)
{
	struct zc_step_params sp = ck_params(ZC_ADAMW, K);

	for (unsigned r = 0; r < f->world; r++) {
		struct zc_checkpoint_range rg[CK_PARAMS];
		struct zc_checkpoint_piece ps[CK_PARAMS];
		size_t n = flat_ranges(f, r, rg);

		for (size_t k = 0; k < n; k++)
			ps[k] = (struct zc_checkpoint_piece){ f->t[r], rg[k] };
		cr_assert_eq(zc_checkpoint_save_pieces(f->c[r], dir, ps, n, &sp), 0, "rank %u: %s",
		    r, zc_errmsg(f->c[r]));
	}
}

/* The parameters' state gathered from the slices; every padding element asserted zero. */
static void
flat_gather(struct flat *f, struct ck_state *s, const char *what)
{
	float *buf = malloc(f->per * sizeof(float));

	for (unsigned p = 0; p < CK_PARAMS; p++)
		for (unsigned st = 0; st < 3; st++)
			s->a[p][st] = calloc(ck_param_numel[p], sizeof(float));
	for (unsigned r = 0; r < f->world; r++)
		for (unsigned st = 0; st < 3; st++) {
			cr_assert_eq(zc_tensor_read(f->t[r], (enum zc_state)st, 0, f->per, buf), 0);
			for (uint64_t k = 0; k < f->per; k++) {
				unsigned p;
				uint64_t i;

				if (flat_where(f, r, k, &p, &i))
					s->a[p][st][i] = buf[k];
				else
					cr_assert_eq(buf[k], 0.0f, "%s: rank %u's padding element %llu "
					    "of state %u: %a", what, r, (unsigned long long)k, st,
					    (double)buf[k]);
			}
		}
	free(buf);
}

static void
flat_close(struct flat *f)
{
	for (unsigned r = 0; r < f->world; r++) {
		(void)zc_job_close(f->c[r]);
		zc_disconnect(f->c[r]);
	}
}

static void
start_daemon(void)
{
	char config[512];

	ck_tmpdir(swapdir, sizeof(swapdir), "swap");
	ck_config(config, sizeof(config), swapdir);
	itd_start(&d, config);
}

/*
 * Flat slices of 2 ranks saved at K; restored as per-parameter shards of 3 ranks and as
 * flat slices of 3 and of 1; each goes on to END and must be the uninterrupted run of
 * per-parameter shards, bit for bit, its padding zero all along.
 */
Test(pieces, flat_slices_reshard_by_parameter)
{
	static const enum zc_policy policies[] = { ZC_POLICY_CPU, ZC_POLICY_NVME };
	static const unsigned flat_worlds[] = { 3, 1 };
	unsigned job = 0;
	char name[32], what[96];

	start_daemon();
	for (unsigned pi = 0; pi < 2; pi++) {
		struct ck_state want, got;
		struct ck_job ref, b;
		struct flat a, fb;

		snprintf(name, sizeof(name), "ref%u", job++);
		ck_job_start(&ref, &d, name, 1, ZC_ADAMW, policies[pi]);
		ck_job_steps(&ref, 1, END);
		ck_job_gather(&ref, &want);
		ck_job_close(&ref);

		ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
		snprintf(name, sizeof(name), "a%u", job++);
		flat_start(&a, name, 2, policies[pi]);
		flat_steps(&a, 1, K);
		flat_save(&a, ckdir);
		flat_close(&a);

		snprintf(name, sizeof(name), "b%u", job++);
		ck_job_restore(&b, &d, name, 3, ZC_ADAMW, policies[pi], ckdir, K);
		ck_job_steps(&b, K + 1, END);
		ck_job_gather(&b, &got);
		ck_job_close(&b);
		snprintf(what, sizeof(what), "policy %u, 2 flat -> 3 shards", pi);
		ck_assert_same(&want, &got, what);
		ck_state_free(&got);

		for (unsigned w = 0; w < 2; w++) {
			snprintf(name, sizeof(name), "c%u", job++);
			snprintf(what, sizeof(what), "policy %u, 2 flat -> %u flat", pi, flat_worlds[w]);
			flat_restore(&fb, name, flat_worlds[w], policies[pi], ckdir);
			/* Restored: the padding is zero before any step too. */
			flat_gather(&fb, &got, what);
			ck_state_free(&got);
			flat_steps(&fb, K + 1, END);
			flat_gather(&fb, &got, what);
			flat_close(&fb);
			ck_assert_same(&want, &got, what);
			ck_state_free(&got);
		}
		ck_state_free(&want);
		ck_rmdir(ckdir);
		ckdir[0] = '\0';
	}
}

/* Overlaps and ranges outside a tensor, on either side, refused by name; nothing left. */
Test(pieces, bad_pieces_and_ranges_refused)
{
	struct zc_step_params sp = ck_params(ZC_ADAMW, 0);
	struct zc_checkpoint_range rg[2];
	struct zc_checkpoint_piece ps[2];
	struct zc_tensor_desc desc;
	struct zc_checkpoint *ck;
	struct zc_tensor *t;
	struct flat f;
	char name[32];
	size_t n = 2;

	start_daemon();
	ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
	flat_start(&f, "bad", 1, ZC_POLICY_CPU);
	ps[0] = (struct zc_checkpoint_piece){ f.t[0], { 0, 100, "w", 0, 1000 } };
	ps[1] = (struct zc_checkpoint_piece){ f.t[0], { 50, 100, "b", 0, 1000 } };
	cr_assert_eq(zc_checkpoint_save_pieces(f.c[0], ckdir, ps, 2, &sp), -EINVAL);
	cr_assert(strstr(zc_errmsg(f.c[0]), "elements 50..100 of tensor 'flat#0' are in two "
	    "pieces") != NULL, "%s", zc_errmsg(f.c[0]));
	ps[1].range = (struct zc_checkpoint_range){ f.per - 10, 11, "b", 0, 1000 };
	cr_assert_eq(zc_checkpoint_save_pieces(f.c[0], ckdir, ps, 2, &sp), -EINVAL);
	cr_assert(strstr(zc_errmsg(f.c[0]), "has no elements") != NULL, "%s", zc_errmsg(f.c[0]));
	ps[1].range = (struct zc_checkpoint_range){ 100, 100, "b", 950, 1000 };
	cr_assert_eq(zc_checkpoint_save_pieces(f.c[0], ckdir, ps, 2, &sp), -EINVAL);
	cr_assert(strstr(zc_errmsg(f.c[0]), "does not fit at 950 in 'b' of 1000") != NULL, "%s",
	    zc_errmsg(f.c[0]));
	ps[1].range = (struct zc_checkpoint_range){ 100, 100, "b", 0, 1000 };
	cr_assert_eq(zc_checkpoint_save_pieces(f.c[0], ckdir, ps, 2, &sp), 0, "%s",
	    zc_errmsg(f.c[0]));
	flat_close(&f);

	flat_open(&f, "bad2", 1, ZC_POLICY_CPU);
	flat_desc(&f, 0, name, sizeof(name), &desc);
	cr_assert_eq(zc_checkpoint_open(f.c[0], ckdir, &ck), 0, "%s", zc_errmsg(f.c[0]));
	rg[0] = (struct zc_checkpoint_range){ 0, 100, "w", 0, 1000 };
	rg[1] = (struct zc_checkpoint_range){ 99, 100, "b", 0, 1000 };
	cr_assert_eq(zc_tensors_register_checkpoint_ranges(f.c[0], 1, &desc, ck, rg, &n,
	    ZC_ADAMW, &t), -EINVAL);
	cr_assert(strstr(zc_errmsg(f.c[0]), "tensor 'flat#0': two of its ranges restore "
	    "elements 99..100") != NULL, "%s", zc_errmsg(f.c[0]));
	rg[1] = (struct zc_checkpoint_range){ f.per - 5, 6, "b", 0, 1000 };
	cr_assert_eq(zc_tensors_register_checkpoint_ranges(f.c[0], 1, &desc, ck, rg, &n,
	    ZC_ADAMW, &t), -EINVAL);
	cr_assert(strstr(zc_errmsg(f.c[0]), "has no elements") != NULL, "%s", zc_errmsg(f.c[0]));
	/* Elements 100..200 of 'b' were never saved. */
	rg[1] = (struct zc_checkpoint_range){ 100, 200, "b", 0, 1000 };
	cr_assert_eq(zc_tensors_register_checkpoint_ranges(f.c[0], 1, &desc, ck, rg, &n,
	    ZC_ADAMW, &t), -ENOENT);
	cr_assert(strstr(zc_errmsg(f.c[0]), "elements 100..200 of 'b' are in none") != NULL,
	    "%s", zc_errmsg(f.c[0]));
	/* None of those left a tensor: the name registers now, and restores. */
	rg[1] = (struct zc_checkpoint_range){ 100, 100, "b", 0, 1000 };
	cr_assert_eq(zc_tensors_register_checkpoint_ranges(f.c[0], 1, &desc, ck, rg, &n,
	    ZC_ADAMW, &t), 0, "%s", zc_errmsg(f.c[0]));
	zc_checkpoint_close(ck);
	flat_close(&f);
}
