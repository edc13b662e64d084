/* The step thread: takes batches from the loop, runs them on the worker pool, hands them back. */
#ifndef ZD_STEPPER_H
#define ZD_STEPPER_H

#include <stddef.h>

struct zd_batch;
struct zd_stepper;
struct zk_pool;

/* One completion handed back to the loop: tensor index, or SIZE_MAX for the whole batch. */
struct zd_completion {
	struct zd_batch *batch;
	size_t index;
};

int zd_stepper_new(struct zk_pool *pool, struct zd_stepper **ret);
/* Finishes queued batches, then joins the thread. */
void zd_stepper_free(struct zd_stepper *st);
/* eventfd, readable when completions are waiting. */
int zd_stepper_fd(const struct zd_stepper *st);
void zd_stepper_submit(struct zd_stepper *st, struct zd_batch *b);
/* Pops up to max completions; returns how many. */
size_t zd_stepper_reap(struct zd_stepper *st, struct zd_completion *out, size_t max);

#endif
