/*
 * The engine's own bookkeeping around the step: a start it cannot make fails by name, a
 * budget change is what its stats say, and param offload on NVMe refuses a busy tensor and
 * leaves nothing counted in flight once its I/O is reported (a drain at SIGTERM waits for
 * that count to reach 0, so one count too many hangs the daemon's exit for ever).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "swap.h"
#include "swap_helpers.h"

#define CHUNK 16384u
#define NUMEL (2 * CHUNK + 5)

struct seen {
	unsigned io_done;
	int io_result;
	unsigned param_ready;
	int param_result;
};

static void
cb_io_done(void *arg, uint32_t lane, uint64_t id, enum ze_io kind, void *user, int result)
{
	struct seen *s = arg;

	(void)lane, (void)id, (void)kind, (void)user;
	s->io_done++;
	s->io_result = result;
}

static void
cb_param_ready(void *arg, uint32_t lane, uint64_t id, void *user, int result)
{
	struct seen *s = arg;

	(void)lane, (void)id, (void)user;
	s->param_ready++;
	s->param_result = result;
}

static void
cb_tensor_done(void *arg, uint32_t lane, uint64_t id, void *user,
    const struct ze_tensor_result *r)
{
	(void)arg, (void)lane, (void)id, (void)user, (void)r;
}

static void
cb_step_done(void *arg, uint32_t lane, uint64_t id, const struct ze_step_result *r)
{
	(void)arg, (void)lane, (void)id, (void)r;
}

static void
cb_grad_done(void *arg, uint32_t lane, uint64_t id, int result, const struct ze_grad_partial *p)
{
	(void)arg, (void)lane, (void)id, (void)result, (void)p;
}

static const struct ze_callbacks callbacks = {
	.grad_done = cb_grad_done,
	.tensor_done = cb_tensor_done,
	.step_done = cb_step_done,
	.io_done = cb_io_done,
	.param_ready = cb_param_ready,
};

static struct ze_config
config(void)
{
	return (struct ze_config){
		.pinned_budget = 64u << 20,
		.numa_node = -1,
		.shm_budget = 64u << 20,
		.worker_threads = 1,
		.isa = zk_isa_best(),
		.staging_buffers = 2,
		.chunk_elements = CHUNK,
	};
}

static void
wait_for(struct ze_engine *e, const unsigned *counter, unsigned want)
{
	for (int i = 0; i < 2000 && *counter < want; i++)
		cr_assert_geq(ze_engine_wait(e, 10), 0);
	cr_assert_geq(*counter, want, "the engine did not report");
}

Test(lifecycle, a_pool_that_cannot_start_fails_the_engine_by_name)
{
	struct ze_config cfg = config();
	struct ze_engine *e = NULL;
	char err[256] = "";
	struct seen seen = { 0 };

	/* More workers than a CPU set holds: the pool refuses before any thread starts. */
	cfg.worker_threads = 100000;
	cr_assert_eq(ze_engine_new(&cfg, NULL, &callbacks, &seen, &e, err, sizeof(err)), -EINVAL);
	cr_assert_null(e);
	cr_assert(strstr(err, "cannot start 100000 worker threads") != NULL, "%s", err);
}

Test(lifecycle, new_budgets_are_what_the_stats_say)
{
	struct ze_config cfg = config();
	struct ze_engine *e;
	struct ze_stats st;
	char err[256];
	struct seen seen = { 0 };

	cr_assert_eq(ze_engine_new(&cfg, NULL, &callbacks, &seen, &e, err, sizeof(err)), 0, "%s",
	    err);
	ze_engine_stats(e, &st);
	cr_assert_eq(st.shm_budget, 64u << 20);
	ze_engine_set_budgets(e, 32u << 20, 48u << 20);
	ze_engine_stats(e, &st);
	cr_assert_eq(st.shm_budget, 48u << 20, "stats say a shm budget of %llu after the change",
	    (unsigned long long)st.shm_budget);
	ze_engine_free(e);
}

Test(lifecycle, nvme_param_offload_refuses_busy_and_counts_back_to_zero)
{
	struct ze_config cfg = config();
	struct zs_swap *swap = NULL;
	struct seen seen = { 0 };
	struct ze_engine *e;
	struct ze_tensor *t;
	char err[256], *dir = th_tmpdir();
	void *before;
	float *buf;
	int r;

	r = th_engine(ZS_SWAP_PTHREAD, dir, 64u << 20, 8, 0, NULL, &swap);
	cr_assert_eq(r, 0, "swap engine: %s", zs_strerror(r));
	cr_assert_eq(ze_engine_new(&cfg, swap, &callbacks, &seen, &e, err, sizeof(err)), 0, "%s",
	    err);
	cr_assert_eq(ze_tensor_new(e, &(struct ze_tensor_desc){ .name = "w", .numel = NUMEL,
		.grad_dtype = ZK_DTYPE_F32, .param_dtype = ZK_DTYPE_BF16, .param_offload = true,
		.policy = ZE_POLICY_NVME }, NULL, NULL, NULL, &t, err, sizeof(err)), 0, "%s", err);
	buf = calloc(NUMEL, sizeof(float));
	cr_assert_not_null(buf);
	for (uint32_t i = 0; i < NUMEL; i++)
		buf[i] = (float)i * 0.25f - 100.0f;
	/* The master written: its params land in the slot, to be written back on release. */
	r = ze_tensor_io(t, true, ZE_STATE_MASTER, 0, NUMEL, buf, 1, 1);
	cr_assert_geq(r, 0);
	if (r == 0)
		wait_for(e, &seen.io_done, 1);
	cr_assert_eq(seen.io_result, 0);
	cr_assert_eq(ze_engine_in_flight(e), 0);
	before = malloc(NUMEL * 2);
	cr_assert_not_null(before);
	memcpy(before, ze_tensor_param_slot(t), NUMEL * 2);

	/* A read in flight: the tensor is busy, and a release is refused whole. */
	r = ze_tensor_io(t, false, ZE_STATE_EXP_AVG, 0, NUMEL, buf, 1, 2);
	cr_assert_eq(r, 0, "the read was not queued (%d)", r);
	cr_assert(ze_tensor_busy(t));
	cr_assert_eq(ze_param_release(e, &t, 1, 1, 3), -EBUSY);
	wait_for(e, &seen.io_done, seen.io_done + 1);
	cr_assert_eq(ze_engine_in_flight(e), 0);

	/* Released (written back to NVMe), then fetched: nothing left counted, same params. */
	r = ze_param_release(e, &t, 1, 1, 4);
	cr_assert_geq(r, 0);
	if (r == 0)
		wait_for(e, &seen.io_done, seen.io_done + 1);
	cr_assert_eq(seen.io_result, 0);
	cr_assert_eq(ze_engine_in_flight(e), 0, "%u in flight after the release",
	    ze_engine_in_flight(e));
	r = ze_param_fetch(t, 1, 5);
	cr_assert_eq(r, 0, "the fetch from NVMe was not queued (%d)", r);
	wait_for(e, &seen.param_ready, 1);
	cr_assert_eq(seen.param_result, 0);
	cr_assert_eq(ze_engine_in_flight(e), 0, "%u in flight after the fetch",
	    ze_engine_in_flight(e));
	cr_assert_eq(memcmp(before, ze_tensor_param_slot(t), NUMEL * 2), 0,
	    "the fetched params are not the released ones");

	free(before);
	free(buf);
	ze_tensor_free(t);
	ze_engine_free(e);
	th_rmdir(dir);
}

/* Visible: Criterion's sandbox finds main by symbol to start test workers. */
__attribute__((visibility("default"))) int
main(int argc, char **argv)
{
	return th_main(argc, argv, th_environment_problem);
}
