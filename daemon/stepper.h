/* The step thread: runs compute tasks from the loop on the worker pool and hands them back. */
#ifndef ZD_STEPPER_H
#define ZD_STEPPER_H

#include <stddef.h>
#include <stdint.h>
#include <sys/queue.h>

#include "optim.h"

struct zd_batch;
struct zd_staging;
struct zd_stepper;
struct zk_pool;

enum zd_task_kind {
	ZD_TASK_CHECK,		/* gradient pass over the whole batch: writes batch->check */
	ZD_TASK_STEP,		/* one slice of one tensor */
};

/*
 * A piece of compute.  The loop fills it and owns it again once reaped;
 * in between only the stepper touches it (and the memory it points to).
 */
struct zd_task {
	TAILQ_ENTRY(zd_task) entry;
	enum zd_task_kind kind;
	uint32_t lane;			/* fairness key: the submitting session */
	struct zd_batch *batch;
	size_t index;			/* tensor within the batch */
	struct zk_tensor view;		/* STEP: the slice, in place or in a staging buffer */
	struct zd_staging *staging;	/* NVMe chunk being stepped, NULL in place */
	uint64_t chunk;
	uint64_t io_start_ns;		/* NVMe: when its read was issued */
	int result;
	uint64_t compute_ns;
};

int zd_stepper_new(struct zk_pool *pool, struct zd_stepper **ret);
/* Finishes queued tasks, then joins the thread. */
void zd_stepper_free(struct zd_stepper *st);
/* eventfd, readable when finished tasks are waiting. */
int zd_stepper_fd(const struct zd_stepper *st);
void zd_stepper_submit(struct zd_stepper *st, struct zd_task *task);
/* Pops up to max finished tasks; returns how many. */
size_t zd_stepper_reap(struct zd_stepper *st, struct zd_task **out, size_t max);

#endif
