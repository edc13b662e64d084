/* The engine's life: the pinned arena, the worker pool, the stepper, the swap engine. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_impl.h"
#include "pool.h"
#include "recover.h"
#include "stepper.h"
#include "swap.h"

int
ze_engine_new(const struct ze_config *cfg, struct zs_swap *swap,
    const struct ze_callbacks *cb, void *cb_arg, struct ze_engine **ret, char *err,
    size_t errlen)
{
	struct ze_engine *e = calloc(1, sizeof(*e));
	int r;

	if (e == NULL) {
		zs_swap_free(swap);
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	e->cfg = *cfg;
	/* The caller's name array need not outlive this call. */
	e->cfg.swap_path_names = NULL;
	e->cfg.cpus = NULL;
	e->cfg.ncpus = 0;
	if (cfg->nswap_paths > 0 && cfg->swap_path_names != NULL) {
		char **names = calloc(cfg->nswap_paths, sizeof(*names));

		e->cfg.swap_path_names = (const char *const *)names;
		for (unsigned i = 0; names != NULL && i < cfg->nswap_paths; i++)
			names[i] = strdup(cfg->swap_path_names[i]);
	}
	e->cb = *cb;
	e->cb_arg = cb_arg;
	e->swap = swap;
	e->stats.shm_budget = cfg->shm_budget;
	TAILQ_INIT(&e->staging_free);
	TAILQ_INIT(&e->nvme_lanes);
	TAILQ_INIT(&e->xfer_works);
	r = zt_arena_new(&(struct zt_arena_config){
		.budget_bytes = cfg->pinned_budget,
		.numa_node = cfg->numa_node,
		.require_pinned = cfg->require_pinned,
		.hugepages = cfg->hugepages,
		.collapse = cfg->hugepages,
	}, &e->arena);
	if (r < 0) {
		snprintf(err, errlen, "%s %d: %s", cfg->numa_node_what != NULL ?
		    cfg->numa_node_what : "NUMA node", cfg->numa_node, ze_strerror(r));
		goto fail;
	}
	r = zk_pool_new(cfg->worker_threads, cfg->ncpus > 0 ? cfg->cpus : NULL, cfg->ncpus,
	    &e->pool);
	if (r < 0) {
		snprintf(err, errlen, "cannot start %u worker threads: %s", cfg->worker_threads,
		    ze_strerror(r));
		goto fail;
	}
	r = ze_stepper_new(e->pool, &e->stepper);
	if (r < 0) {
		snprintf(err, errlen, "cannot start the step thread: %s", ze_strerror(r));
		goto fail;
	}
	e->journal_fd = -1;
	e->cfg.kept_staging_fds = NULL;
	e->cfg.nkept_staging = 0;
	if (cfg->journal || cfg->kept_journal_fd > 2) {
		r = ze_journal_start(e, cfg->kept_journal_fd > 2 ? cfg->kept_journal_fd : -1);
		if (r < 0) {
			snprintf(err, errlen, "the kept step journal: %s", r == -EPROTO ?
			    "not a journal this zoffloadd knows" : ze_strerror(r));
			goto fail;
		}
	}
	/* Staging memfds are taken over only while the buffers are made. */
	e->cfg.kept_staging_fds = cfg->kept_staging_fds;
	e->cfg.nkept_staging = cfg->nkept_staging;
	r = ze_nvme_start(e);
	e->cfg.kept_staging_fds = NULL;
	e->cfg.nkept_staging = 0;
	/* A kept journal still names the old buffers until every tensor is back. */
	if (r == 0 && cfg->kept_journal_fd <= 2)
		ze_journal_set_staging(e);
	if (r < 0) {
		snprintf(err, errlen, "NVMe tier: cannot set up %u staging buffers: %s",
		    cfg->staging_buffers, ze_strerror(r));
		goto fail;
	}
	*ret = e;
	return 0;
fail:
	ze_engine_free(e);
	return r;
}

static bool
swap_busy(const struct ze_engine *e)
{
	struct zs_swap_stats es;

	if (e->swap == NULL)
		return false;
	zs_swap_stats(e->swap, &es);
	return es.requests_queued > 0;
}

void
ze_engine_free(struct ze_engine *e)
{
	if (e == NULL)
		return;
	/*
	 * Work still running is finished and reported: it points into state
	 * freed below, and tensors their owner let go are destroyed when it ends.
	 */
	while (e->stepper != NULL && ze_engine_in_flight(e) > 0 && (e->tasks_outstanding > 0 ||
	    swap_busy(e)))
		(void)ze_engine_wait(e, 100);
	ze_stepper_free(e->stepper);
	e->stepper = NULL;
	ze_adopt_checks_done(e);
	/* The swap engine runs its last callbacks into the staging buffers: it goes first. */
	zs_swap_free(e->swap);
	e->swap = NULL;
	ze_nvme_stop(e);
	ze_journal_stop(e);
	zk_pool_free(e->pool);
	zt_arena_free(e->arena);
	for (unsigned i = 0; e->cfg.swap_path_names != NULL && i < e->cfg.nswap_paths; i++)
		free((char *)e->cfg.swap_path_names[i]);
	free((void *)e->cfg.swap_path_names);
	free(e);
}

int
ze_engine_step_fd(const struct ze_engine *e)
{
	return ze_stepper_fd(e->stepper);
}

int
ze_engine_swap_fd(const struct ze_engine *e)
{
	return e->swap != NULL ? zs_swap_fd(e->swap) : -1;
}

struct zs_swap *
ze_engine_swap(const struct ze_engine *e)
{
	return e->swap;
}

int
ze_engine_process(struct ze_engine *e)
{
	int r = 0;

	ze_step_completions(e);
	if (e->swap != NULL) {
		r = zs_swap_process(e->swap);
		if (r > 0)
			r = 0;
	}
	ze_step_completions(e);
	return r;
}

int
ze_engine_wait(struct ze_engine *e, int timeout_ms)
{
	struct pollfd p[2] = {
		{ .fd = ze_engine_step_fd(e), .events = POLLIN },
		{ .fd = ze_engine_swap_fd(e), .events = POLLIN },
	};

	(void)poll(p, e->swap != NULL ? 2 : 1, timeout_ms);
	return ze_engine_process(e);
}

unsigned
ze_engine_in_flight(const struct ze_engine *e)
{
	return e->batches + e->xfers;
}

unsigned
ze_engine_steps_in_flight(const struct ze_engine *e)
{
	return e->batches;
}

void
ze_engine_set_isa(struct ze_engine *e, enum zk_isa isa)
{
	e->cfg.isa = isa;
}

void
ze_engine_set_budgets(struct ze_engine *e, uint64_t pinned_budget, uint64_t shm_budget)
{
	zt_arena_set_budget(e->arena, pinned_budget);
	e->cfg.pinned_budget = pinned_budget;
	e->cfg.shm_budget = shm_budget;
	e->stats.shm_budget = shm_budget;
}

void
ze_engine_stats(const struct ze_engine *e, struct ze_stats *ret)
{
	*ret = e->stats;
	ret->staging_buffers = e->nstaging;
}

void
ze_engine_arena_stats(const struct ze_engine *e, struct zt_arena_stats *ret)
{
	zt_arena_get_stats(e->arena, ret);
}

void
ze_engine_cancel_lane(struct ze_engine *e, uint32_t lane)
{
	ze_nvme_cancel_lane(e, lane);
}

int
ze_engine_staging_fd(const struct ze_engine *e, unsigned i)
{
	return i < e->nstaging ? e->staging[i].fd : -1;
}

unsigned
ze_engine_staging_count(const struct ze_engine *e)
{
	return e->nstaging;
}
