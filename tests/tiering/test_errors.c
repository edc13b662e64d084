/* Placement errors (no swap, swap full) and state transfers on NVMe tensors across chunk boundaries. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "th.h"

static struct itd daemon_;
static struct th_job job;
static char swapdir[64];

static void
teardown(void)
{
	th_job_close(&job);
	itd_cleanup(&daemon_);
	th_swapdir_remove(swapdir);
	swapdir[0] = '\0';
}

TestSuite(errors, .fini = teardown, .timeout = 60);

/* A daemon with one swap directory of this capacity, chunks of 64 Ki elements, extra keys. */
static void
start_with_swap(const char *capacity, const char *memory)
{
	char config[768];

	th_swapdir(swapdir, sizeof(swapdir));
	snprintf(config, sizeof(config),
	    "{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"info\" },"
	    " \"memory\": { %s },"
	    " \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"%s\" } ],"
	    " \"chunk_elements\": 65536, \"staging_buffers\": 3 } }\n", memory, swapdir, capacity);
	itd_start(&daemon_, config);
}

static int
try_register(const char *name, size_t n, struct zc_tensor **ret)
{
	struct zc_tensor_desc desc = { .name = name, .numel = n, .grad_dtype = ZC_BF16,
		.param_dtype = ZC_BF16 };
	float *init = calloc(n, sizeof(float));
	int r;

	cr_assert_not_null(init);
	r = zc_tensor_register(job.c, &desc, init, ret);
	free(init);
	return r;
}

Test(errors, nvme_policy_without_swap_paths)
{
	struct zc_tensor *t = NULL;
	int r;

	itd_start(&daemon_, NULL);
	th_job_open(&job, &daemon_, "nvme-nowhere", ZC_POLICY_NVME, 0);
	r = try_register("w", 10000, &t);
	cr_assert_eq(r, -ENODEV, "register returned %d (%s)", r, zc_errmsg(job.c));
	cr_assert_not_null(strstr(zc_errmsg(job.c), "no swap.paths"),
	    "the message does not say why: %s", zc_errmsg(job.c));
	cr_assert_not_null(strstr(zc_errmsg(job.c), "'w'"), "%s", zc_errmsg(job.c));
	cr_assert_eq(itd_stat(job.c, "tensors"), 0, "the failed tensor is still counted");
	cr_assert_eq(itd_stat(job.c, "tiers.shm.used_bytes"), 0);
}

/* 4 MiB of swap: a 12 MiB tensor does not fit, whatever the policy; smaller ones still do. */
static void
swap_full(enum zc_policy policy)
{
	struct zc_tensor *t = NULL;
	double used0;
	int r;

	start_with_swap("4M", "\"pinned_budget\": \"1M\"");
	th_job_open(&job, &daemon_, "full", policy, 0);
	used0 = itd_stat(job.c, "tiers.nvme.paths.0.used_bytes");
	r = try_register("big", 1u << 20, &t);
	cr_assert_lt(r, 0, "12 MiB of state went into 4 MiB of swap");
	cr_assert_not_null(strstr(zc_errmsg(job.c), swapdir),
	    "the message does not name the swap path %s: %s", swapdir, zc_errmsg(job.c));
	cr_assert_not_null(strstr(zc_errmsg(job.c), "'big'"), "%s", zc_errmsg(job.c));
	cr_assert_eq(itd_stat(job.c, "tiers.nvme.paths.0.used_bytes"), used0,
	    "the failed tensor kept swap space");
	cr_assert_eq(itd_stat(job.c, "tiers.shm.used_bytes"), 0);
	cr_assert_eq(try_register("small", 100003, &t), 0, "%s", zc_errmsg(job.c));
	cr_assert_gt(itd_stat(job.c, "jobs.0.nvme_bytes"), 0);
}

Test(errors, swap_full_nvme)
{
	swap_full(ZC_POLICY_NVME);
}

Test(errors, swap_full_auto)
{
	swap_full(ZC_POLICY_AUTO);
}

static void
assert_bits(const float *got, const float *want, size_t n, const char *what)
{
	if (memcmp(got, want, n * sizeof(float)) == 0)
		return;
	for (size_t i = 0; i < n; i++)
		cr_assert_eq(memcmp(&got[i], &want[i], sizeof(float)), 0, "%s[%zu]: %.9g, want %.9g",
		    what, i, got[i], want[i]);
}

/*
 * Registration writes the master weights chunk by chunk (read, patch,
 * write back); reads come back the same way.  With a 100 KiB transfer
 * window (25600 elements) the requests start and end inside chunks.
 */
Test(errors, nvme_reads_across_chunks)
{
	static const size_t sizes[] = { 3 * 65536 + 5, 70001, 1000 };
	static const struct th_layout layout = { sizes, 3, ZC_BF16, ZC_BF16, false };
	/* [offset, count): inside one chunk, across one boundary, across several, the tail. */
	static const size_t ranges[][2] = { { 7, 1 }, { 65530, 13 }, { 1, 3 * 65536 }, { 196600, 9 } };

	start_with_swap("64M", "\"xfer_window\": \"100K\"");
	th_job_open(&job, &daemon_, "xfer", ZC_POLICY_NVME, 0);
	th_register(&job, &layout);
	cr_assert_eq(itd_stat(job.c, "jobs.0.pinned_bytes"), 0);
	for (size_t k = 0; k < 3; k++) {
		size_t n = sizes[k];
		float *init = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
		float *zeros = calloc(n, sizeof(float));
		const uint16_t *param = zc_tensor_param_slot(job.t[k], NULL);

		cr_assert(init && got && zeros);
		th_init(k, init, n);
		cr_assert_eq(zc_tensor_read(job.t[k], ZC_STATE_MASTER, 0, n, got), 0, "%s",
		    zc_errmsg(job.c));
		assert_bits(got, init, n, "master");
		for (size_t i = 0; i < n; i++)
			cr_assert_eq(param[i], itd_f32_to_bf16_rne(init[i]), "tensor %zu param[%zu]",
			    k, i);
		for (int w = ZC_STATE_EXP_AVG; w <= ZC_STATE_EXP_AVG_SQ; w++) {
			memset(got, 0xff, n * sizeof(float));
			cr_assert_eq(zc_tensor_read(job.t[k], (enum zc_state)w, 0, n, got), 0, "%s",
			    zc_errmsg(job.c));
			assert_bits(got, zeros, n, w == ZC_STATE_EXP_AVG ? "exp_avg" : "exp_avg_sq");
		}
		for (size_t r = 0; k == 0 && r < sizeof(ranges) / sizeof(ranges[0]); r++) {
			size_t off = ranges[r][0], count = ranges[r][1];

			memset(got, 0, n * sizeof(float));
			cr_assert_eq(zc_tensor_read(job.t[k], ZC_STATE_MASTER, off, count, got), 0,
			    "%s", zc_errmsg(job.c));
			assert_bits(got, init + off, count, "master range");
		}
		free(init);
		free(got);
		free(zeros);
	}
	cr_assert_gt(itd_stat(job.c, "pipeline.chunks_read"), 0);
	cr_assert_eq(itd_stat(job.c, "pipeline.io_errors"), 0);
}

/*
 * Swap space freed by one tensor and handed to the next must not carry the
 * old moments over: a new tensor starts from m = v = 0 like a pinned one.
 */
Test(errors, reused_swap_starts_from_zero)
{
	static const size_t sizes[] = { 2 * 65536 + 3 };
	static const struct th_layout layout = { sizes, 1, ZC_BF16, ZC_BF16, false };
	size_t n = sizes[0];
	float *got = malloc(n * sizeof(float)), *zeros = calloc(n, sizeof(float));
	struct zc_tensor *t = NULL;

	cr_assert(got && zeros);
	start_with_swap("8M", "\"pinned_budget\": \"1M\"");
	th_job_open(&job, &daemon_, "reuse", ZC_POLICY_NVME, 0);
	th_register(&job, &layout);
	for (uint64_t step = 1; step <= 3; step++) {
		struct zc_step_params p = th_params(ZC_ADAMW, step);

		th_fill_grads(&job, 0, step);
		cr_assert_eq(zc_step_submit(job.c, &p, job.t, 1), 0, "%s", zc_errmsg(job.c));
		cr_assert_eq(zc_wait_all(job.c, NULL), 0, "%s", zc_errmsg(job.c));
	}
	cr_assert_eq(zc_tensor_read(job.t[0], ZC_STATE_EXP_AVG, 0, n, got), 0, "%s",
	    zc_errmsg(job.c));
	cr_assert_neq(memcmp(got, zeros, n * sizeof(float)), 0, "the steps left m at zero");
	cr_assert_eq(zc_tensor_unregister(job.t[0]), 0, "%s", zc_errmsg(job.c));
	/* 8 MiB of swap holds one such tensor at a time: the new one gets the old space. */
	cr_assert_eq(try_register("next", n, &t), 0, "%s", zc_errmsg(job.c));
	for (int w = ZC_STATE_EXP_AVG; w <= ZC_STATE_EXP_AVG_SQ; w++) {
		cr_assert_eq(zc_tensor_read(t, (enum zc_state)w, 0, n, got), 0, "%s",
		    zc_errmsg(job.c));
		assert_bits(got, zeros, n, w == ZC_STATE_EXP_AVG ? "new exp_avg" : "new exp_avg_sq");
	}
	free(got);
	free(zeros);
}
