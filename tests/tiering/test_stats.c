/* What the pipeline's figures count: the pinned hit rate is the share of stepped state bytes, not of tensors. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "th.h"

#define NVME_CONFIG \
	"{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"info\" }," \
	" \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"64M\" } ]," \
	" \"chunk_elements\": 65536, \"staging_buffers\": 2 } }\n"

/*
 * Three small tensors pinned, one large on NVMe: 3 of 4 tensor steps are
 * pinned, but under 2% of the state bytes.  A rate by tensors says 75%.
 */
static const size_t small[] = { 17, 1023, 4099 };
static const size_t large[] = { 300007 };
static const struct th_layout pinned_layout = { small, 3, ZC_BF16, ZC_BF16, false };
static const struct th_layout nvme_layout = { large, 1, ZC_BF16, ZC_BF16, false };

static struct itd daemon_;
static struct th_job pin, nvme;
static char swapdir[64];

static void
setup(void)
{
	char config[512];

	th_swapdir(swapdir, sizeof(swapdir));
	snprintf(config, sizeof(config), NVME_CONFIG, swapdir);
	itd_start(&daemon_, config);
	th_job_open(&pin, &daemon_, "pinned", ZC_POLICY_CPU, 0);
	th_job_open(&nvme, &daemon_, "nvme", ZC_POLICY_NVME, 0);
	th_register(&pin, &pinned_layout);
	th_register(&nvme, &nvme_layout);
}

static void
teardown(void)
{
	th_job_close(&pin);
	th_job_close(&nvme);
	itd_cleanup(&daemon_);
	th_swapdir_remove(swapdir);
}

TestSuite(stats, .init = setup, .fini = teardown, .timeout = 60);

/* One step of both jobs; with nan, tensor 0 of each gets a NaN gradient and the sets are skipped. */
static void
step_both(uint64_t step, bool nan)
{
	struct th_job *jobs[] = { &pin, &nvme };
	struct zc_step_params p = th_params(ZC_ADAMW, step);
	struct zc_step_result res;

	p.check_finite = true;
	for (size_t i = 0; i < 2; i++) {
		for (size_t k = 0; k < jobs[i]->layout->count; k++)
			th_fill_grads(jobs[i], k, step);
		if (nan)
			((uint16_t *)zc_tensor_grad_slot(jobs[i]->t[0], NULL))[0] = 0x7fc0;
		cr_assert_eq(zc_step_submit(jobs[i]->c, &p, jobs[i]->t, jobs[i]->layout->count),
		    0, "%s", zc_errmsg(jobs[i]->c));
	}
	for (size_t i = 0; i < 2; i++) {
		cr_assert_eq(zc_wait_all(jobs[i]->c, &res), 0, "%s", zc_errmsg(jobs[i]->c));
		cr_assert_eq(res.status, nan ? ZC_STEP_SKIPPED_NONFINITE : ZC_STEP_APPLIED,
		    "step %llu: status %d", (unsigned long long)step, (int)res.status);
	}
}

static double
elements(const struct th_layout *l)
{
	double n = 0;

	for (size_t k = 0; k < l->count; k++)
		n += (double)l->sizes[k];
	return n;
}

Test(stats, pinned_hit_rate_is_by_bytes)
{
	/* Master, m and v in fp32: 12 bytes an element on either tier. */
	double pinned_bytes = 12 * elements(&pinned_layout);
	double nvme_bytes = 12 * elements(&nvme_layout);
	double want = pinned_bytes / (pinned_bytes + nvme_bytes);
	double rate;

	cr_assert_eq(itd_stat(pin.c, "pipeline.pinned_hit_rate"), 0, "no step yet");
	for (uint64_t step = 1; step <= 2; step++)
		step_both(step, false);
	/* A skipped step moves no state: it is not counted. */
	step_both(3, true);

	cr_assert_eq(itd_stat(pin.c, "pipeline.tensor_steps_pinned"), 2 * 3);
	cr_assert_eq(itd_stat(pin.c, "pipeline.tensor_steps_nvme"), 2 * 1);
	cr_assert_eq(itd_stat(pin.c, "pipeline.state_bytes_stepped_pinned"), 2 * pinned_bytes,
	    "%.0f bytes stepped pinned", itd_stat(pin.c, "pipeline.state_bytes_stepped_pinned"));
	cr_assert_eq(itd_stat(pin.c, "pipeline.state_bytes_stepped_nvme"), 2 * nvme_bytes,
	    "%.0f bytes stepped on NVMe", itd_stat(pin.c, "pipeline.state_bytes_stepped_nvme"));
	rate = itd_stat(pin.c, "pipeline.pinned_hit_rate");
	cr_assert_lt(fabs(rate - want), 1e-9, "pinned hit rate %.6f, want %.6f of the bytes "
	    "(%.2f would be by tensors)", rate, want, 6.0 / 8.0);
}
