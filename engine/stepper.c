/* The step thread: runs compute tasks from the loop on the worker pool and hands them back. */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "engine_impl.h"
#include "pool.h"
#include "stepper.h"

TAILQ_HEAD(task_list, ze_task);

/*
 * One lane's queue of tasks (the shell's fairness key: a connection, for the daemon).
 * Tasks are taken round robin from the lanes that have work, and the loop cuts steps into slices of at most
 * ZE_QUANTUM_ELEMENTS, so a job stepping a billion parameters delays a
 * small job by one slice, not a whole step.
 */
struct lane {
	TAILQ_ENTRY(lane) entry;
	uint32_t key;
	struct task_list tasks;
};

TAILQ_HEAD(lane_list, lane);

struct ze_stepper {
	struct zk_pool *pool;
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct lane_list lanes;		/* lanes with work; the head goes next */
	struct task_list done;
	bool stopping;
	int efd;
};

/* A copy split over the pool's workers, in cache lines. */
struct pool_copy {
	char *dst;
	const char *src;
	size_t bytes;
};

static void
copy_part(void *arg, unsigned idx, unsigned nthreads)
{
	const struct pool_copy *c = arg;
	size_t lines = (c->bytes + 63) / 64;
	size_t from = lines * idx / nthreads * 64, to = lines * (idx + 1) / nthreads * 64;

	if (to > c->bytes)
		to = c->bytes;
	if (from < to)
		memcpy(c->dst + from, c->src + from, to - from);
}

/*
 * The NVMe master's copies (nvme_impl.h) hold a staging buffer: one thread alone
 * copied at about half the memory's speed, and the pool's workers sat idle meanwhile.
 */
static void
pool_copy(struct zk_pool *pool, void *dst, const void *src, size_t bytes)
{
	struct pool_copy c = { .dst = dst, .src = src, .bytes = bytes };

	if (zk_pool_run(pool, copy_part, &c) < 0)
		memcpy(dst, src, bytes);
}

static void
run_task(struct ze_stepper *st, struct ze_task *task)
{
	struct ze_batch *b = task->batch;
	uint64_t t0 = zu_now_ns();

	if (task->kind == ZE_TASK_PARAM) {
		if (task->copy_bytes > 0)
			pool_copy(st->pool, task->view.param, task->view.master, task->copy_bytes);
		else
			ze_param_convert(task->view.param, task->view.param_dtype, 0, task->view.n,
			    task->view.master);
		task->result = 0;
	} else if (task->kind == ZE_TASK_CHECK) {
		b->check = (struct zk_grad_stats){ 0 };
		task->result = zk_pool_grad_check(st->pool, b->isa, b->views, b->count,
		    b->hp.grad_scale, &b->check);
	} else if (task->stamp == NULL) {
		if (task->master_from != NULL && task->qview.format != ZK_STATE_FP32)
			pool_copy(st->pool, task->qview.master, task->master_from,
			    zk_state_master_bytes(task->qview.format, task->qview.n));
		else if (task->master_from != NULL)
			pool_copy(st->pool, task->view.master, task->master_from,
			    task->view.n * sizeof(float));
		task->result = task->qview.format != ZK_STATE_FP32 ?
		    zk_pool_qstep(st->pool, b->isa, &b->hp_run, &task->qview, 1) :
		    zk_pool_step(st->pool, b->isa, &b->hp_run, &task->view, 1);
	} else {
		task->result = ze_journal_step(task->e, st->pool, b->isa, &b->hp_run, task);
		/* Landed: stamped before the next slice's journal record replaces this one's. */
		if (task->stamp != NULL && task->result == 0)
			__atomic_store_n(task->stamp, task->step, __ATOMIC_RELEASE);
	}
	task->compute_ns = zu_now_ns() - t0;
}

static void *
stepper_main(void *arg)
{
	struct ze_stepper *st = arg;
	struct ze_task *task;
	struct lane *lane;
	uint64_t one = 1;

	pthread_mutex_lock(&st->lock);
	for (;;) {
		while (TAILQ_EMPTY(&st->lanes) && !st->stopping)
			pthread_cond_wait(&st->cond, &st->lock);
		lane = TAILQ_FIRST(&st->lanes);
		if (lane == NULL)
			break;
		task = TAILQ_FIRST(&lane->tasks);
		TAILQ_REMOVE(&lane->tasks, task, entry);
		/* Round robin: this lane goes to the back, or away when empty. */
		TAILQ_REMOVE(&st->lanes, lane, entry);
		if (TAILQ_EMPTY(&lane->tasks))
			free(lane);
		else
			TAILQ_INSERT_TAIL(&st->lanes, lane, entry);
		pthread_mutex_unlock(&st->lock);

		run_task(st, task);

		pthread_mutex_lock(&st->lock);
		TAILQ_INSERT_TAIL(&st->done, task, entry);
		(void)!write(st->efd, &one, sizeof(one));
	}
	pthread_mutex_unlock(&st->lock);
	return NULL;
}

int
ze_stepper_new(struct zk_pool *pool, struct ze_stepper **ret)
{
	struct ze_stepper *st;
	int r;

	st = calloc(1, sizeof(*st));
	if (st == NULL)
		return -ENOMEM;
	st->pool = pool;
	TAILQ_INIT(&st->lanes);
	TAILQ_INIT(&st->done);
	pthread_mutex_init(&st->lock, NULL);
	pthread_cond_init(&st->cond, NULL);
	st->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (st->efd < 0) {
		r = -errno;
		goto fail;
	}
	r = -pthread_create(&st->thread, NULL, stepper_main, st);
	if (r < 0)
		goto fail;
	*ret = st;
	return 0;
fail:
	if (st->efd >= 0)
		close(st->efd);
	pthread_mutex_destroy(&st->lock);
	pthread_cond_destroy(&st->cond);
	free(st);
	return r;
}

void
ze_stepper_free(struct ze_stepper *st)
{
	if (st == NULL)
		return;
	/* Tasks still queued run first: they point into memory the loop frees after us. */
	pthread_mutex_lock(&st->lock);
	st->stopping = true;
	pthread_cond_signal(&st->cond);
	pthread_mutex_unlock(&st->lock);
	pthread_join(st->thread, NULL);
	close(st->efd);
	pthread_mutex_destroy(&st->lock);
	pthread_cond_destroy(&st->cond);
	free(st);
}

int
ze_stepper_fd(const struct ze_stepper *st)
{
	return st->efd;
}

void
ze_stepper_submit(struct ze_stepper *st, struct ze_task *task)
{
	/* Allocated before taking the lock: nothing waits on memory with it held. */
	struct lane *spare = malloc(sizeof(*spare)), *lane;
	struct ze_task *q;
	uint64_t one = 1;

	pthread_mutex_lock(&st->lock);
	TAILQ_FOREACH(lane, &st->lanes, entry)
		if (lane->key == task->lane)
			break;
	if (lane == NULL) {
		if (spare == NULL) {
			/* No lane for it: it comes back at once, failed, like any task. */
			task->result = -ENOMEM;
			task->compute_ns = 0;
			TAILQ_INSERT_TAIL(&st->done, task, entry);
			(void)!write(st->efd, &one, sizeof(one));
			pthread_mutex_unlock(&st->lock);
			return;
		}
		lane = spare;
		spare = NULL;
		lane->key = task->lane;
		TAILQ_INIT(&lane->tasks);
		TAILQ_INSERT_TAIL(&st->lanes, lane, entry);
	}
	/*
	 * The lane's tasks are kept in ze_runs_before order and leave from the
	 * head: the new one goes behind every task that runs before it or
	 * ties (its own submission's), searched from the tail.
	 */
	q = TAILQ_LAST(&lane->tasks, task_list);
	while (q != NULL && ze_runs_before(task->step, task->seq, q->step, q->seq))
		q = TAILQ_PREV(q, task_list, entry);
	if (q == NULL)
		TAILQ_INSERT_HEAD(&lane->tasks, task, entry);
	else
		TAILQ_INSERT_AFTER(&lane->tasks, q, task, entry);
	pthread_cond_signal(&st->cond);
	pthread_mutex_unlock(&st->lock);
	free(spare);
}

size_t
ze_stepper_reap(struct ze_stepper *st, struct ze_task **out, size_t max)
{
	struct ze_task *task;
	size_t count = 0;
	uint64_t v;

	(void)!read(st->efd, &v, sizeof(v));
	pthread_mutex_lock(&st->lock);
	while (count < max && (task = TAILQ_FIRST(&st->done)) != NULL) {
		TAILQ_REMOVE(&st->done, task, entry);
		out[count++] = task;
	}
	/* More left: make sure the loop comes back for them. */
	if (!TAILQ_EMPTY(&st->done)) {
		v = 1;
		(void)!write(st->efd, &v, sizeof(v));
	}
	pthread_mutex_unlock(&st->lock);
	return count;
}
