/* The step thread: runs compute tasks from the loop on the worker pool and hands them back. */
#ifndef ZE_STEPPER_H
#define ZE_STEPPER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/queue.h>

#include "optim.h"
#include "quant.h"

struct ze_batch;
struct ze_engine;
struct ze_staging;
struct ze_stepper;
struct zk_pool;

enum ze_task_kind {
	ZE_TASK_CHECK,		/* gradient pass over the whole batch: writes batch->check */
	ZE_TASK_STEP,		/* one unit (slice or chunk) of one tensor */
	/*
	 * A restore's NVMe chunk written straight from the caller's buffer: the param
	 * slot's view.n elements at view.param from master at view.master, off the loop
	 * while the disk writes the chunk.  No batch.
	 */
	ZE_TASK_PARAM,
};

/*
 * A piece of compute.  The loop fills it and owns it again once reaped;
 * in between only the stepper touches it (and the memory it points to).
 */
struct ze_task {
	TAILQ_ENTRY(ze_task) entry;
	enum ze_task_kind kind;
	uint32_t lane;			/* fairness key: the submitting client */
	uint64_t step;			/* order within the lane: ze_runs_before() */
	uint64_t seq;
	struct ze_batch *batch;		/* NULL for PARAM */
	size_t index;			/* tensor within the batch */
	uint64_t unit;			/* slice or chunk of that tensor */
	struct zk_tensor view;		/* STEP: the unit, in place or in a staging buffer (fp32) */
	struct zk_qtensor qview;	/* ... in a compressed format: used when its format is not fp32 */
	struct ze_staging *staging;	/* NVMe chunk being stepped, NULL in place */
	/*
	 * In place: the tensor's id and stamp for the unit.  The stepper steps
	 * it through the step journal and stamps it when it lands, so a crash at
	 * any instant leaves it finishable (journal.c).
	 */
	struct ze_engine *e;
	uint64_t tensor_id;
	uint64_t *stamp;
	uint64_t io_start_ns;		/* NVMe: when its read was issued */
	/*
	 * NVMe, where the slot is the master: the slot's elements the stepper copies
	 * into the staging buffer's master before the step (nvme_impl.h), off the loop.
	 */
	const void *master_from;
	/* PARAM: bytes copied as they are (the slot's dtype is the source's), 0: converted. */
	size_t copy_bytes;
	int result;
	uint64_t compute_ns;
};

/*
 * The order of step work within one lane (the stepper's tasks, the NVMe
 * chunks waiting for staging): the lower step number first, so a newer step
 * never holds back an older one; within one step number the newer
 * submission (seq) first, and within one submission the order it came in.
 * A trainer submits its layers last to first as its backward pass ends them
 * and needs them first to last in the next forward pass: run in submission
 * order, the first layer it waits for would be the last one done.
 */
static inline bool
ze_runs_before(uint64_t step_a, uint64_t seq_a, uint64_t step_b, uint64_t seq_b)
{
	return step_a < step_b || (step_a == step_b && seq_a > seq_b);
}

int ze_stepper_new(struct zk_pool *pool, struct ze_stepper **ret);
/* Finishes queued tasks, then joins the thread. */
void ze_stepper_free(struct ze_stepper *st);
/* eventfd, readable when finished tasks are waiting. */
int ze_stepper_fd(const struct ze_stepper *st);
/* Queues task in its lane (ze_runs_before); without memory for its lane it comes back at once with -ENOMEM. */
void ze_stepper_submit(struct ze_stepper *st, struct ze_task *task);
/* Pops up to max finished tasks; returns how many. */
size_t ze_stepper_reap(struct ze_stepper *st, struct ze_task **out, size_t max);

#endif
