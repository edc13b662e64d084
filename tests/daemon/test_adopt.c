/*
 * A tensor a restart rebuilds (zd_job_adopt_tensor) when memory runs out on the way: it
 * is refused with -ENOMEM and leaves nothing behind: no uid entry made for it, no charge,
 * no rank group.  The allocations fail through calloc wrapped at link time (meson.build:
 * -Wl,--wrap=calloc), by size, so that only the one the case names fails.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "daemon.h"
#include "engine.h"
#include "job.h"
#include "optim.h"
#include "recover.h"
#include "uid.h"

void *__real_calloc(size_t n, size_t size);
void *__wrap_calloc(size_t n, size_t size);

static size_t fail_size;	/* the next calloc of this many bytes fails (0: none) */
static unsigned failed;

void *
__wrap_calloc(size_t n, size_t size)
{
	if (fail_size != 0 && n * size == fail_size) {
		fail_size = 0;
		failed++;
		return NULL;
	}
	return __real_calloc(n, size);
}

static void
no_tensor_done(void *arg, uint32_t lane, uint64_t id, void *user,
    const struct ze_tensor_result *r)
{
	(void)arg, (void)lane, (void)id, (void)user, (void)r;
}

static void
no_step_done(void *arg, uint32_t lane, uint64_t id, const struct ze_step_result *r)
{
	(void)arg, (void)lane, (void)id, (void)r;
}

static void
no_io_done(void *arg, uint32_t lane, uint64_t id, enum ze_io kind, void *user, int result)
{
	(void)arg, (void)lane, (void)id, (void)kind, (void)user, (void)result;
}

static void
no_param_ready(void *arg, uint32_t lane, uint64_t id, void *user, int result)
{
	(void)arg, (void)lane, (void)id, (void)user, (void)result;
}

static void
no_grad_done(void *arg, uint32_t lane, uint64_t id, int result, const struct ze_grad_partial *p)
{
	(void)arg, (void)lane, (void)id, (void)result, (void)p;
}

static const struct ze_callbacks callbacks = {
	.tensor_done = no_tensor_done,
	.step_done = no_step_done,
	.io_done = no_io_done,
	.param_ready = no_param_ready,
	.grad_done = no_grad_done,
};

static struct zd_daemon *d;
static struct zd_job job;
static struct ze_tensor *kept;
static struct ze_tensor_fds fds;

static void
setup(void)
{
	char err[256];

	d = calloc(1, sizeof(*d));
	cr_assert_not_null(d);
	cr_assert_eq(zd_config_defaults(&d->cfg), 0);
	TAILQ_INIT(&d->uids);
	cr_assert_eq(ze_engine_new(&(struct ze_config){ .pinned_budget = 16u << 20,
		.numa_node = -1, .shm_budget = 16u << 20, .worker_threads = 1,
		.isa = zk_isa_best(), .staging_buffers = 2, .chunk_elements = 65536 },
	    NULL, &callbacks, NULL, &d->engine, err, sizeof(err)), 0, "%s", err);
	/* A tensor with a record: what the restart hands back. */
	cr_assert_eq(ze_tensor_new(d->engine, &(struct ze_tensor_desc){ .name = "w",
		.numel = 4096, .grad_dtype = ZK_DTYPE_F32, .param_dtype = ZK_DTYPE_F32,
		.policy = ZE_POLICY_CPU }, NULL, NULL, NULL, &kept, err, sizeof(err)), 0, "%s", err);
	ze_tensor_fds(kept, &fds);
	memset(&job, 0, sizeof(job));
	snprintf(job.name, sizeof(job.name), "kept");
	TAILQ_INIT(&job.detached);
	TAILQ_INIT(&job.rank_groups);
}

static void
teardown(void)
{
	fail_size = 0;
	if (d == NULL)
		return;
	if (kept != NULL)
		ze_tensor_free(kept);
	ze_engine_free(d->engine);
	zd_config_clear(&d->cfg);
	free(d);
}

TestSuite(adopt, .init = setup, .fini = teardown, .timeout = 30);

/* The allocation of `size` bytes fails: refused, and the daemon holds what it held before. */
static void
out_of_memory_at(size_t size)
{
	struct ze_adopt_report rep;
	struct ze_tensor *et = NULL;
	char err[256] = "";
	int r;

	fail_size = size;
	r = zd_job_adopt_tensor(d, &job, 3, 4242, &fds, &rep, &et, err, sizeof(err));
	cr_assert_eq(failed, 1, "no calloc of %zu bytes was made", size);
	cr_assert_eq(r, -ENOMEM, "%d (%s)", r, err);
	cr_assert_str_eq(err, "out of memory");
	cr_assert_null(et);
	cr_assert(TAILQ_EMPTY(&d->uids), "the uid made for the tensor stayed (tensors %u, fds %u)",
	    TAILQ_FIRST(&d->uids)->tensors, TAILQ_FIRST(&d->uids)->fds);
	cr_assert_eq(d->client_fds, 0, "%u descriptors stayed charged", d->client_fds);
	cr_assert(TAILQ_EMPTY(&job.rank_groups), "a rank group was left behind");
	cr_assert_eq(job.detached_ranks, 0);
	cr_assert_eq(job.tensors, 0);
	cr_assert_eq(d->tensors_total, 0);
}

/* Failing by size picks one allocation only while the three differ. */
Test(adopt, sizes_tell_the_allocations_apart)
{
	cr_assert_neq(sizeof(struct zd_tensor), sizeof(struct zd_rank_group));
	cr_assert_neq(sizeof(struct zd_tensor), sizeof(struct zd_uid));
	cr_assert_neq(sizeof(struct zd_rank_group), sizeof(struct zd_uid));
}

Test(adopt, no_memory_for_the_tensor)
{
	out_of_memory_at(sizeof(struct zd_tensor));
}

Test(adopt, no_memory_for_the_rank_group)
{
	out_of_memory_at(sizeof(struct zd_rank_group));
}

Test(adopt, no_memory_for_the_uid)
{
	out_of_memory_at(sizeof(struct zd_uid));
}
