/* The step thread when memory runs out: a task it cannot queue comes back failed, nothing waits with the lock held. */
#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "pool.h"
#include "stepper.h"

/* Linked with -Wl,--wrap=malloc: the engine's malloc calls come here first. */
void *__real_malloc(size_t size);
void *__wrap_malloc(size_t size);
static atomic_int fail_mallocs;

void *
__wrap_malloc(size_t size)
{
	if (atomic_load(&fail_mallocs) > 0) {
		atomic_fetch_sub(&fail_mallocs, 1);
		return NULL;
	}
	return __real_malloc(size);
}

/*
 * Used to retry malloc every millisecond with the stepper's lock held, for
 * as long as memory stayed short: the loop and the step thread both stuck.
 */
Test(stepper, task_without_memory_for_its_lane_comes_back_failed, .timeout = 20)
{
	struct ze_task task = { .kind = ZE_TASK_STEP, .lane = 7 };
	struct zk_pool *pool;
	struct ze_stepper *st;
	struct ze_task *out[4];
	struct pollfd p;
	size_t n = 0;

	cr_assert_eq(zk_pool_new(1, NULL, 0, &pool), 0);
	cr_assert_eq(ze_stepper_new(pool, &st), 0);
	/* More failures than the old loop would ever give up on within the timeout. */
	atomic_store(&fail_mallocs, 1000000);
	ze_stepper_submit(st, &task);
	atomic_store(&fail_mallocs, 0);
	p = (struct pollfd){ .fd = ze_stepper_fd(st), .events = POLLIN };
	cr_assert_eq(poll(&p, 1, 5000), 1, "the task never came back");
	n = ze_stepper_reap(st, out, 4);
	cr_assert_eq(n, 1);
	cr_assert_eq(out[0], &task);
	cr_assert_eq(task.result, -ENOMEM, "%d", task.result);
	ze_stepper_free(st);
	zk_pool_free(pool);
}
