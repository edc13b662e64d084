/* A client killed while its NVMe chunks are in flight gives back staging, swap and pinned memory. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "th.h"

/* No grace: a dead rank's state is freed as soon as nothing in flight uses it. */
#define CONFIG \
	"{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"info\" }," \
	" \"memory\": { \"pinned_budget\": \"64M\" }," \
	" \"limits\": { \"detach_grace_s\": 0 }," \
	" \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"512M\" } ]," \
	" \"chunk_elements\": 65536, \"staging_buffers\": 3 } }\n"

/* The victim: 3 x 3M elements, 108 MiB on NVMe, 216 MiB of I/O in its one step. */
#define VICTIM_TENSORS 3
#define VICTIM_NUMEL (3u << 20)

static const size_t sizes[] = { 300007, 65537, 4099 };
static const struct th_layout layout = { sizes, 3, ZC_BF16, ZC_BF16, false };

static struct itd daemon_;
static struct th_job ref, early, late;
static char swapdir[64];

static void
teardown(void)
{
	th_job_close(&ref);
	th_job_close(&early);
	th_job_close(&late);
	itd_cleanup(&daemon_);
	th_swapdir_remove(swapdir);
}

TestSuite(kill, .fini = teardown, .timeout = 60);

/* Child: registers its NVMe tensors, submits one step, tells the parent, waits to die. */
static void
victim(int report)
{
	struct zc_job_options o = { .policy = ZC_POLICY_NVME };
	struct zc_step_params sp = th_params(ZC_ADAMW, 1);
	struct zc_tensor *t[VICTIM_TENSORS];
	float *init = calloc(VICTIM_NUMEL, sizeof(float));
	struct zc_conn *c;
	char ok = 'k';

	if (init == NULL || zc_connect(daemon_.socket, &c) < 0 ||
	    zc_job_open_opts(c, "victim", 0, 1, &o) < 0)
		_exit(2);
	for (int k = 0; k < VICTIM_TENSORS; k++) {
		char name[16];
		struct zc_tensor_desc desc = { .name = name, .numel = VICTIM_NUMEL,
			.grad_dtype = ZC_BF16, .param_dtype = ZC_BF16 };

		snprintf(name, sizeof(name), "big%d", k);
		if (zc_tensor_register(c, &desc, init, &t[k]) < 0)
			_exit(3);
		memset(zc_tensor_grad_slot(t[k], NULL), 0x3c, VICTIM_NUMEL * 2);
	}
	if (zc_step_submit(c, &sp, t, VICTIM_TENSORS) < 0)
		_exit(4);
	/* The ping's reply comes after the daemon has taken the step in. */
	if (zc_ping(c, NULL) < 0)
		_exit(5);
	if (write(report, &ok, 1) != 1)
		_exit(6);
	pause();
	_exit(0);
}

struct usage {
	double pinned, nvme, shm, tensors;
};

static struct usage
usage(struct zc_conn *c)
{
	return (struct usage){
		.pinned = itd_stat(c, "tiers.pinned.used_bytes"),
		.nvme = itd_stat(c, "tiers.nvme.paths.0.used_bytes"),
		.shm = itd_stat(c, "tiers.shm.used_bytes"),
		.tensors = itd_stat(c, "tensors"),
	};
}

static void
step_jobs(struct th_job *const *jobs, size_t njobs, uint64_t step)
{
	struct zc_step_params p = th_params(ZC_ADAMW, step);

	for (size_t i = 0; i < njobs; i++) {
		for (size_t k = 0; k < layout.count; k++)
			th_fill_grads(jobs[i], k, step);
		cr_assert_eq(zc_step_submit(jobs[i]->c, &p, jobs[i]->t, layout.count), 0, "%s",
		    zc_errmsg(jobs[i]->c));
	}
	for (size_t i = 0; i < njobs; i++)
		cr_assert_eq(zc_wait_all(jobs[i]->c, NULL), 0, "%s", zc_errmsg(jobs[i]->c));
}

Test(kill, client_killed_mid_pipeline)
{
	struct th_job *before[] = { &ref, &early }, *after[] = { &ref, &early, &late };
	struct th_snap want, got;
	struct usage u0, u;
	char config[512];
	double deadline, in_flight, nvme_steps0;
	int status;

	th_swapdir(swapdir, sizeof(swapdir));
	snprintf(config, sizeof(config), CONFIG, swapdir);
	itd_start(&daemon_, config);
	th_job_open(&ref, &daemon_, "reference", ZC_POLICY_CPU, 0);
	th_job_open(&early, &daemon_, "early", ZC_POLICY_NVME, 0);
	th_register(&ref, &layout);
	th_register(&early, &layout);
	step_jobs(before, 2, 1);
	u0 = usage(ref.c);
	nvme_steps0 = itd_stat(ref.c, "pipeline.tensor_steps_nvme");

	itd_fork_client(&daemon_, victim, 30, "the victim", "submit");
	in_flight = itd_stat(ref.c, "steps.in_flight");
	u = usage(ref.c);
	cr_assert_geq(in_flight, 1, "the victim's step is not in flight");
	cr_assert_geq(u.nvme, u0.nvme + VICTIM_TENSORS * 12.0 * VICTIM_NUMEL);
	cr_assert_lt(itd_stat(ref.c, "pipeline.tensor_steps_nvme"), nvme_steps0 + VICTIM_TENSORS,
	    "the victim's step finished before the kill");
	cr_assert_eq(itd_kill_client(&daemon_, &status), 0);
	cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "victim status 0x%x", status);

	/* Everything comes back once the orphaned chunks have landed. */
	deadline = itd_now() + 10;
	do {
		u = usage(ref.c);
		in_flight = itd_stat(ref.c, "steps.in_flight");
		if (in_flight == 0 && u.pinned == u0.pinned && u.nvme == u0.nvme && u.shm == u0.shm &&
		    u.tensors == u0.tensors)
			break;
		usleep(20000);
	} while (itd_now() < deadline);
	cr_assert_eq(in_flight, 0, "the victim's step is still in flight after 10 s");
	cr_assert_eq(u.nvme, u0.nvme, "swap: %.0f bytes used, %.0f before the victim", u.nvme,
	    u0.nvme);
	cr_assert_eq(u.pinned, u0.pinned, "pinned: %.0f bytes used, %.0f before the victim",
	    u.pinned, u0.pinned);
	cr_assert_eq(u.shm, u0.shm, "shm: %.0f bytes used, %.0f before", u.shm, u0.shm);
	cr_assert_eq(u.tensors, u0.tensors);
	cr_assert_eq(itd_stat(ref.c, "tiers.nvme.in_flight"), 0);
	cr_assert_eq(itd_stat(ref.c, "pipeline.io_errors"), 0);

	/*
	 * The others go on: a job registered before and one registered after
	 * (into the victim's old swap space) step through every staging buffer
	 * and match the in-memory reference bit for bit.
	 */
	th_job_open(&late, &daemon_, "late", ZC_POLICY_NVME, 0);
	th_register(&late, &layout);
	{
		/* late starts at step 1 where the others are at 2: catch it up first. */
		struct th_job *one[] = { &late };

		step_jobs(one, 1, 1);
	}
	for (uint64_t step = 2; step <= 4; step++)
		step_jobs(after, 3, step);
	th_snapshot(&ref, &want);
	th_snapshot(&early, &got);
	th_assert_same(&got, &want, "job registered before the kill");
	th_snap_free(&got);
	th_snapshot(&late, &got);
	th_assert_same(&got, &want, "job registered after the kill");
	th_snap_free(&got);
	th_snap_free(&want);

	th_job_close(&ref);
	th_job_close(&early);
	th_job_close(&late);
	status = itd_stop(&daemon_, 20);
	cr_assert_eq(status, 0, "zoffloadd did not exit 0 on SIGTERM (status 0x%x): %s", status,
	    itd_log_text(&daemon_));
}
