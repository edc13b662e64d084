/*
 * Save at step K with N ranks, resume with M ranks (same or another shard layout), go on to
 * step END: the state is bit for bit that of a run never interrupted, for every optimizer,
 * with the state pinned or on NVMe.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ck.h"

#define K 3
#define END 6

static struct itd d;
static char swapdir[64], ckdir[64];

static void
teardown(void)
{
	itd_cleanup(&d);
	ck_rmdir(ckdir);
	ck_rmdir(swapdir);
}

TestSuite(reshard, .fini = teardown, .timeout = 240);

static const unsigned pairs[][2] = { { 2, 2 }, { 2, 3 }, { 3, 1 }, { 1, 4 } };

static void
run(enum zc_optim optim)
{
	static const enum zc_policy policies[] = { ZC_POLICY_CPU, ZC_POLICY_NVME };
	static const char *const policy_names[] = { "pinned", "nvme" };
	char config[512], what[128];
	unsigned job = 0;

	ck_tmpdir(swapdir, sizeof(swapdir), "swap");
	ck_config(config, sizeof(config), swapdir);
	itd_start(&d, config);
	for (unsigned pi = 0; pi < 2; pi++) {
		struct ck_job ref, a, b;
		struct ck_state want, got;
		char name[32];

		snprintf(name, sizeof(name), "ref%u", job++);
		ck_job_start(&ref, &d, name, 1, optim, policies[pi]);
		ck_job_steps(&ref, 1, END);
		/* The NVMe runs really go through the chunk pipeline. */
		if (policies[pi] == ZC_POLICY_NVME)
			cr_assert_gt(itd_stat(ref.r[0].c, "pipeline.tensor_steps_nvme"), 0);
		else
			cr_assert_eq(itd_stat(ref.r[0].c, "pipeline.tensor_steps_nvme"), 0);
		ck_job_gather(&ref, &want);
		ck_job_close(&ref);
		for (size_t k = 0; k < sizeof(pairs) / sizeof(pairs[0]); k++) {
			ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
			snprintf(name, sizeof(name), "a%u", job++);
			ck_job_start(&a, &d, name, pairs[k][0], optim, policies[pi]);
			ck_job_steps(&a, 1, K);
			ck_job_save(&a, ckdir, K);
			ck_job_close(&a);
			snprintf(name, sizeof(name), "b%u", job++);
			ck_job_restore(&b, &d, name, pairs[k][1], optim, policies[pi], ckdir, K);
			ck_job_steps(&b, K + 1, END);
			ck_job_gather(&b, &got);
			ck_job_close(&b);
			snprintf(what, sizeof(what), "%s, %u -> %u ranks", policy_names[pi], pairs[k][0],
			    pairs[k][1]);
			ck_assert_same(&want, &got, what);
			ck_state_free(&got);
			ck_rmdir(ckdir);
			ckdir[0] = '\0';
		}
		ck_state_free(&want);
	}
}

Test(reshard, adamw) { run(ZC_ADAMW); }
Test(reshard, adam) { run(ZC_ADAM); }
Test(reshard, adagrad) { run(ZC_ADAGRAD); }
Test(reshard, lion) { run(ZC_LION); }

/*
 * A tensor longer than the daemon's piece (4 Mi elements) is saved through both of its
 * buffers in turn, the next piece read while one is written; restored onto two ranks.
 */
#define LONG ((9u << 20) + 12345)

static void
read_state(struct zc_tensor *t, uint64_t n, float *out[3])
{
	for (unsigned st = 0; st < 3; st++)
		cr_assert_eq(zc_tensor_read(t, (enum zc_state)st, 0, n, out[st]), 0);
}

Test(reshard, longer_than_a_piece)
{
	static const enum zc_policy policies[] = { ZC_POLICY_CPU, ZC_POLICY_NVME };
	char config[512];

	ck_tmpdir(swapdir, sizeof(swapdir), "swap");
	ck_config(config, sizeof(config), swapdir);
	itd_start(&d, config);
	for (unsigned pi = 0; pi < 2; pi++) {
		struct zc_job_options o = { .policy = policies[pi] };
		struct zc_step_params sp = ck_params(ZC_ADAMW, 1);
		struct zc_tensor_desc desc = { "long", LONG, ZC_F32, ZC_F32, false };
		struct zc_conn *c = itd_connect(&d);
		struct zc_checkpoint_entry e;
		struct zc_tensor *t;
		float *want[3], *got[3], *g;
		char job[16];

		for (unsigned st = 0; st < 3; st++) {
			want[st] = malloc((size_t)LONG * sizeof(float));
			got[st] = malloc((size_t)LONG * sizeof(float));
		}
		for (uint32_t i = 0; i < LONG; i++)
			want[0][i] = (float)(i % 7919) * 1e-4f;
		snprintf(job, sizeof(job), "long%u", pi);
		cr_assert_eq(zc_job_open_opts(c, job, 0, 1, &o), 0, "%s", zc_errmsg(c));
		cr_assert_eq(zc_tensor_register(c, &desc, want[0], &t), 0, "%s", zc_errmsg(c));
		g = zc_tensor_grad_slot(t, NULL);
		for (uint32_t i = 0; i < LONG; i++)
			g[i] = (float)(i % 101) * 1e-3f - 0.05f;
		cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
		cr_assert_eq(zc_wait_all(c, NULL), 0, "%s", zc_errmsg(c));
		ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
		e = (struct zc_checkpoint_entry){ t, NULL, 0, 0 };
		cr_assert_eq(zc_checkpoint_save(c, ckdir, &e, 1, &sp), 0, "%s", zc_errmsg(c));
		/* zoffctl stats counts what was saved (both policies: the first's bytes too). */
		cr_assert_eq(itd_stat(c, "checkpoint.bytes_written"), (pi + 1) * 12.0 * LONG);
		read_state(t, LONG, want);
		cr_assert_eq(zc_job_close(c), 0);
		zc_disconnect(c);
		for (unsigned r = 0; r < 2; r++) {
			uint64_t lo = r == 0 ? 0 : LONG / 2, n = r == 0 ? LONG / 2 : LONG - LONG / 2;
			struct zc_tensor_desc half = { "long-half", n, ZC_F32, ZC_F32, false };
			struct zc_checkpoint_place place = { "long", lo, LONG };
			struct zc_checkpoint *ck;
			float *part[3] = { got[0] + lo, got[1] + lo, got[2] + lo };

			c = itd_connect(&d);
			snprintf(job, sizeof(job), "back%u", pi);
			cr_assert_eq(zc_job_open_opts(c, job, r, 2, &o), 0, "%s", zc_errmsg(c));
			cr_assert_eq(zc_checkpoint_open(c, ckdir, &ck), 0, "%s", zc_errmsg(c));
			cr_assert_eq(zc_tensor_register_checkpoint(c, &half, ck, &place, ZC_ADAMW, &t),
			    0, "%s", zc_errmsg(c));
			cr_assert_eq(zc_tensor_last_step(t), 1);
			read_state(t, n, part);
			/* The params mirror the restored master (f32: bit for bit). */
			cr_assert_eq(memcmp(zc_tensor_param_slot(t, NULL), part[0], n * sizeof(float)),
			    0, "policy %u, rank %u: the param slot is not the restored master", pi, r);
			cr_assert_geq(itd_stat(c, "checkpoint.bytes_read"), 12.0 * n);
			zc_checkpoint_close(ck);
			cr_assert_eq(zc_job_close(c), 0);
			zc_disconnect(c);
		}
		for (unsigned st = 0; st < 3; st++) {
			cr_assert_eq(memcmp(want[st], got[st], (size_t)LONG * sizeof(float)), 0,
			    "policy %u, state %u differs", pi, st);
			free(want[st]);
			free(got[st]);
		}
		ck_rmdir(ckdir);
		ckdir[0] = '\0';
	}
}
