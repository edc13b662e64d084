/* State 4x the pinned budget, stepped through NVMe chunks, gives the same bits as all in memory. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "th.h"

#define STEPS 10

/*
 * 5.69M elements, 65.2 MiB of master, m and v: 4x the 16 MiB budget below.
 * Odd sizes, one exactly a chunk, one a chunk and one element, two smaller
 * than a chunk (they get small chunks of their own).  In registration order
 * under auto: 'a' does not fit and goes to NVMe, 'b' (14.1 MiB) fits, the
 * rest of the big ones do not, the small ones fill what is left.
 */
static const size_t sizes[] = { 2400007, 1234567, 1000001, 655361, 333331, 65536, 65537,
	4099, 17 };
static const struct th_layout layout = { sizes, sizeof(sizes) / sizeof(sizes[0]), ZC_BF16,
	ZC_BF16, false };

/* Chunks of 64 Ki elements (768 KiB): the big tensors span 5 to 31 chunks, through 3 buffers. */
#define NVME_CONFIG \
	"{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"info\" }," \
	" \"memory\": { \"pinned_budget\": \"16M\" }," \
	" \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"512M\" } ]," \
	" \"chunk_elements\": 65536, \"staging_buffers\": 3 } }\n"

static struct itd mem_d, nvme_d;
static struct th_job jobs[3];
static char swapdir[64];

static void
teardown(void)
{
	for (size_t i = 0; i < 3; i++)
		th_job_close(&jobs[i]);
	itd_cleanup(&mem_d);
	itd_cleanup(&nvme_d);
	th_swapdir_remove(swapdir);
	swapdir[0] = '\0';
}

TestSuite(bits, .fini = teardown, .timeout = 60);

static void
start_nvme_daemon(void)
{
	char config[512];

	th_swapdir(swapdir, sizeof(swapdir));
	snprintf(config, sizeof(config), NVME_CONFIG, swapdir);
	itd_start(&nvme_d, config);
}

/* Fills every tensor's gradients for this step and submits them as one set. */
static void
submit_whole(struct th_job *j, const struct zc_step_params *p)
{
	for (size_t k = 0; k < layout.count; k++)
		th_fill_grads(j, k, p->step);
	cr_assert_eq(zc_step_submit(j->c, p, j->t, layout.count), 0, "step %llu: %s",
	    (unsigned long long)p->step, zc_errmsg(j->c));
}

static void
wait_applied(struct th_job *j, uint64_t step)
{
	struct zc_step_result res;

	cr_assert_eq(zc_wait_all(j->c, &res), 0, "step %llu: %s", (unsigned long long)step,
	    zc_errmsg(j->c));
	cr_assert_eq(res.status, ZC_STEP_APPLIED, "step %llu: status %d",
	    (unsigned long long)step, (int)res.status);
}

static void
pinned_within_budget(struct zc_conn *c, const char *when)
{
	double used = itd_stat(c, "tiers.pinned.used_bytes");
	double budget = itd_stat(c, "tiers.pinned.budget_bytes");

	cr_assert_leq(used, budget, "%s: %.0f pinned bytes used, budget %.0f", when, used, budget);
}

/* (a) all in memory, (b) auto with state 4x the budget, (c) nvme for all: same bits. */
static void
same_bits(enum zc_optim optim)
{
	static const char *const names[3] = { "memory", "auto", "nvme" };
	struct th_snap snaps[3];
	double state_bytes = 0;

	itd_start(&mem_d, NULL);
	start_nvme_daemon();
	th_job_open(&jobs[0], &mem_d, "memory", ZC_POLICY_CPU, 0);
	th_job_open(&jobs[1], &nvme_d, "auto", ZC_POLICY_AUTO, 0);
	th_job_open(&jobs[2], &nvme_d, "nvme", ZC_POLICY_NVME, 0);
	for (size_t i = 0; i < 3; i++)
		th_register(&jobs[i], &layout);
	for (size_t k = 0; k < layout.count; k++)
		state_bytes += 12.0 * (double)sizes[k];
	cr_assert_geq(state_bytes, 4.0 * itd_stat(jobs[1].c, "tiers.pinned.budget_bytes") * 0.99,
	    "the layout is meant to be 4x the pinned budget");
	pinned_within_budget(jobs[1].c, "after registration");
	/* auto really split the job: some state pinned, most on NVMe; nvme put nothing pinned. */
	cr_assert_gt(itd_stat(jobs[1].c, "jobs.0.pinned_bytes"), 0);
	cr_assert_gt(itd_stat(jobs[1].c, "jobs.0.nvme_bytes"), 2 * itd_stat(jobs[1].c,
	    "jobs.0.pinned_bytes"), "auto left most of the state pinned");
	cr_assert_eq(itd_stat(jobs[2].c, "jobs.1.pinned_bytes"), 0);
	cr_assert_geq(itd_stat(jobs[2].c, "jobs.1.nvme_bytes"), state_bytes);

	for (uint64_t step = 1; step <= STEPS; step++) {
		struct zc_step_params p = th_params(optim, step);

		/* Clipping to the set's global norm covers the norm pass over NVMe tensors too. */
		p.max_grad_norm = 1.0;
		p.lr_decay = optim == ZC_ADAGRAD ? 0.05 : 0;
		p.check_finite = true;
		for (size_t i = 0; i < 3; i++)
			submit_whole(&jobs[i], &p);
		for (size_t i = 0; i < 3; i++)
			wait_applied(&jobs[i], step);
	}
	for (size_t i = 0; i < 3; i++)
		th_snapshot(&jobs[i], &snaps[i]);
	for (size_t i = 1; i < 3; i++) {
		char what[64];

		snprintf(what, sizeof(what), "%s after %d %s steps against memory", names[i], STEPS,
		    (const char *[]){ "AdamW", "Adam", "Adagrad", "Lion" }[optim]);
		th_assert_same(&snaps[i], &snaps[0], what);
	}

	cr_assert_gt(itd_stat(jobs[1].c, "pipeline.tensor_steps_nvme"), 0);
	cr_assert_gt(itd_stat(jobs[1].c, "pipeline.tensor_steps_pinned"), 0);
	cr_assert_gt(itd_stat(jobs[1].c, "tiers.nvme.paths.0.used_bytes"), state_bytes);
	/* Every chunk of the nvme job alone is read and written once per step. */
	cr_assert_geq(itd_stat(jobs[1].c, "pipeline.bytes_read"), STEPS * state_bytes);
	cr_assert_geq(itd_stat(jobs[1].c, "pipeline.bytes_written"), STEPS * state_bytes);
	cr_assert_eq(itd_stat(jobs[1].c, "pipeline.io_errors"), 0);
	cr_assert_eq(itd_stat(jobs[1].c, "pipeline.staging_buffers"), 3);
	pinned_within_budget(jobs[1].c, "after the steps");
	cr_assert_eq(itd_stat(jobs[0].c, "pipeline.tensor_steps_nvme"), 0);
	for (size_t i = 0; i < 3; i++)
		th_snap_free(&snaps[i]);
}

Test(bits, adamw_memory_auto_nvme)
{
	same_bits(ZC_ADAMW);
}

Test(bits, adam_memory_auto_nvme)
{
	same_bits(ZC_ADAM);
}

/* One moment each (exp_avg), so the chunks carry an unused v: it must stay as it was. */
Test(bits, lion_memory_auto_nvme)
{
	same_bits(ZC_LION);
}

Test(bits, adagrad_memory_auto_nvme)
{
	same_bits(ZC_ADAGRAD);
}

/*
 * A backward hands tensors over one at a time, last layer first, without
 * waiting: one set per tensor in reverse registration order, all in flight
 * together through the shared staging buffers.  Same bits as one set.
 */
Test(bits, backward_order_sets)
{
	struct th_snap whole, split;

	start_nvme_daemon();
	th_job_open(&jobs[0], &nvme_d, "whole", ZC_POLICY_NVME, 0);
	th_job_open(&jobs[1], &nvme_d, "backward", ZC_POLICY_NVME, 0);
	th_register(&jobs[0], &layout);
	th_register(&jobs[1], &layout);
	for (uint64_t step = 1; step <= 5; step++) {
		struct zc_step_params p = th_params(ZC_ADAMW, step);

		submit_whole(&jobs[0], &p);
		for (size_t k = layout.count; k-- > 0;) {
			th_fill_grads(&jobs[1], k, step);
			cr_assert_eq(zc_step_submit(jobs[1].c, &p, &jobs[1].t[k], 1), 0,
			    "step %llu tensor %zu: %s", (unsigned long long)step, k,
			    zc_errmsg(jobs[1].c));
		}
		if (step == 1)
			cr_assert_geq(itd_stat(jobs[1].c, "steps.in_flight"), 2,
			    "the sets did not overlap");
		/* Waited in registration order, the opposite of submission. */
		for (size_t k = 0; k < layout.count; k++) {
			struct zc_step_result res;

			cr_assert_eq(zc_wait_tensor(jobs[1].t[k], &res), 0, "%s",
			    zc_errmsg(jobs[1].c));
			cr_assert_eq(res.status, ZC_STEP_APPLIED);
			cr_assert_eq(res.step, step);
		}
		wait_applied(&jobs[1], step);
		wait_applied(&jobs[0], step);
	}
	th_snapshot(&jobs[0], &whole);
	th_snapshot(&jobs[1], &split);
	th_assert_same(&split, &whole, "one set per tensor, backward order, against one set");
	th_snap_free(&whole);
	th_snap_free(&split);
}
