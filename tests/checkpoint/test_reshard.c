/*
 * Save at step K with N ranks, resume with M ranks (same or another shard layout), go on to
 * step END: the state is bit for bit that of a run never interrupted, for every optimizer,
 * with the state pinned or on NVMe.
 */
#include <criterion/criterion.h>
#include <stdio.h>

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
