/* The step thread: takes batches from the loop, runs them on the worker pool, hands them back. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "daemon.h"
#include "pool.h"
#include "stepper.h"

struct completion_node {
	struct zd_completion c;
	struct completion_node *next;
};

struct zd_stepper {
	struct zk_pool *pool;
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct zd_batch_list queue;
	bool stopping;
	int efd;
	/* Completions, oldest first. */
	struct completion_node *head;
	struct completion_node **tail;
};

static void
post(struct zd_stepper *st, struct zd_batch *b, size_t index)
{
	struct completion_node *n = malloc(sizeof(*n));
	uint64_t one = 1;

	/*
	 * Out of memory here would lose a completion and leave a tensor busy
	 * forever; spin until the allocator recovers rather than drop it.
	 */
	while (n == NULL) {
		usleep(1000);
		n = malloc(sizeof(*n));
	}
	n->c.batch = b;
	n->c.index = index;
	n->next = NULL;
	pthread_mutex_lock(&st->lock);
	*st->tail = n;
	st->tail = &n->next;
	pthread_mutex_unlock(&st->lock);
	(void)!write(st->efd, &one, sizeof(one));
}

static void
run_batch(struct zd_stepper *st, struct zd_batch *b)
{
	uint64_t t0 = zd_now_ns();
	struct zk_hparams hp = b->hp;
	int r;

	b->status = ZP_STEP_APPLIED;
	b->error = 0;
	b->grad_norm = NAN;
	/* The finiteness check covers the whole set before any of it is applied. */
	if (b->check_finite || b->max_grad_norm > 0) {
		struct zk_grad_stats gs = { 0 };

		r = zk_pool_grad_check(st->pool, b->isa, b->views, b->count, hp.grad_scale, &gs);
		if (r < 0) {
			b->status = ZP_STEP_FAILED;
			b->error = r;
			goto done;
		}
		b->grad_norm = sqrt(gs.sumsq);
		if (gs.nonfinite > 0 && b->check_finite) {
			b->status = ZP_STEP_SKIPPED_NONFINITE;
			goto done;
		}
		/* torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), capped at 1. */
		if (b->max_grad_norm > 0 && isfinite(b->grad_norm)) {
			double coef = b->max_grad_norm / (b->grad_norm + 1e-6);

			hp.clip_coef = coef < 1.0 ? coef : 1.0;
		}
	}
	for (size_t i = 0; i < b->count; i++) {
		r = zk_pool_step(st->pool, b->isa, &hp, &b->views[i], 1);
		if (r < 0) {
			b->status = ZP_STEP_FAILED;
			b->error = r;
			goto done;
		}
		post(st, b, i);
	}
done:
	b->compute_ns = zd_now_ns() - t0;
	post(st, b, SIZE_MAX);
}

static void *
stepper_main(void *arg)
{
	struct zd_stepper *st = arg;
	struct zd_batch *b;

	pthread_mutex_lock(&st->lock);
	for (;;) {
		while (TAILQ_EMPTY(&st->queue) && !st->stopping)
			pthread_cond_wait(&st->cond, &st->lock);
		b = TAILQ_FIRST(&st->queue);
		if (b == NULL)
			break;
		TAILQ_REMOVE(&st->queue, b, entry);
		pthread_mutex_unlock(&st->lock);
		run_batch(st, b);
		pthread_mutex_lock(&st->lock);
	}
	pthread_mutex_unlock(&st->lock);
	return NULL;
}

int
zd_stepper_new(struct zk_pool *pool, struct zd_stepper **ret)
{
	struct zd_stepper *st;
	int r;

	st = calloc(1, sizeof(*st));
	if (st == NULL)
		return -ENOMEM;
	st->pool = pool;
	TAILQ_INIT(&st->queue);
	st->tail = &st->head;
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
zd_stepper_free(struct zd_stepper *st)
{
	struct completion_node *n;

	if (st == NULL)
		return;
	pthread_mutex_lock(&st->lock);
	st->stopping = true;
	pthread_cond_signal(&st->cond);
	pthread_mutex_unlock(&st->lock);
	pthread_join(st->thread, NULL);
	while ((n = st->head) != NULL) {
		st->head = n->next;
		free(n);
	}
	close(st->efd);
	pthread_mutex_destroy(&st->lock);
	pthread_cond_destroy(&st->cond);
	free(st);
}

int
zd_stepper_fd(const struct zd_stepper *st)
{
	return st->efd;
}

void
zd_stepper_submit(struct zd_stepper *st, struct zd_batch *b)
{
	pthread_mutex_lock(&st->lock);
	TAILQ_INSERT_TAIL(&st->queue, b, entry);
	pthread_cond_signal(&st->cond);
	pthread_mutex_unlock(&st->lock);
}

size_t
zd_stepper_reap(struct zd_stepper *st, struct zd_completion *out, size_t max)
{
	struct completion_node *list, *n;
	size_t count = 0;
	uint64_t v;

	(void)!read(st->efd, &v, sizeof(v));
	pthread_mutex_lock(&st->lock);
	list = st->head;
	while (list != NULL && count < max) {
		n = list;
		list = n->next;
		out[count++] = n->c;
		free(n);
	}
	st->head = list;
	if (list == NULL)
		st->tail = &st->head;
	pthread_mutex_unlock(&st->lock);
	/* More left: make sure the loop comes back for them. */
	if (list != NULL) {
		v = 1;
		(void)!write(st->efd, &v, sizeof(v));
	}
	return count;
}
