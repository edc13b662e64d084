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

/*
 * Work is done in quanta of at most this many elements, taken round robin
 * from the sessions that have work, so that a job stepping a billion
 * parameters delays a small job by one quantum (about 10 ms), not a step.
 * A multiple of every kernel's slice alignment, so slices stay aligned.
 */
#define QUANTUM_ELEMENTS (4u << 20)

struct completion_node {
	struct zd_completion c;
	struct completion_node *next;
};

/* One session's queue of batches, oldest first. */
struct lane {
	TAILQ_ENTRY(lane) entry;
	uint32_t key;
	struct zd_batch_list batches;
};

TAILQ_HEAD(lane_list, lane);

struct zd_stepper {
	struct zk_pool *pool;
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct lane_list lanes;		/* lanes with work; the head goes next */
	bool stopping;
	int efd;
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
	 * forever; wait for the allocator rather than drop it.
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

/* The batch's own completion is posted by stepper_main, once nothing here touches it again. */
static void
finish(struct zd_stepper *st, struct zd_batch *b, enum zp_step_status status, int error)
{
	b->status = status;
	b->error = error;
	b->next_tensor = b->count;
}

/* The finiteness check and the global norm cover the whole set before any of it is applied. */
static void
check_batch(struct zd_stepper *st, struct zd_batch *b)
{
	struct zk_grad_stats gs = { 0 };
	int r;

	b->checked = true;
	b->hp_run = b->hp;
	b->status = ZP_STEP_APPLIED;
	b->grad_norm = NAN;
	if (!b->check_finite && !(b->max_grad_norm > 0))
		return;
	r = zk_pool_grad_check(st->pool, b->isa, b->views, b->count, b->hp.grad_scale, &gs);
	if (r < 0) {
		finish(st, b, ZP_STEP_FAILED, r);
		return;
	}
	b->grad_norm = sqrt(gs.sumsq);
	if (gs.nonfinite > 0 && b->check_finite) {
		finish(st, b, ZP_STEP_SKIPPED_NONFINITE, 0);
		return;
	}
	/* torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), capped at 1. */
	if (b->max_grad_norm > 0 && isfinite(b->grad_norm)) {
		double coef = b->max_grad_norm / (b->grad_norm + 1e-6);

		b->hp_run.clip_coef = coef < 1.0 ? coef : 1.0;
	}
}

/* A view of elements [off, off + n) of a tensor. */
static struct zk_tensor
slice(const struct zk_tensor *t, size_t off, size_t n)
{
	struct zk_tensor s = *t;

	s.master += off;
	s.m += off;
	s.v += off;
	s.grad = (const char *)t->grad + off * zk_dtype_size(t->grad_dtype);
	if (t->param != NULL)
		s.param = (char *)t->param + off * zk_dtype_size(t->param_dtype);
	s.n = n;
	return s;
}

/* One quantum of a batch: the check, or up to QUANTUM_ELEMENTS of one tensor. */
static void
run_quantum(struct zd_stepper *st, struct zd_batch *b)
{
	uint64_t t0 = zd_now_ns();
	const struct zk_tensor *t;
	struct zk_tensor part;
	size_t n;
	int r;

	if (!b->checked) {
		check_batch(st, b);
		goto out;
	}
	t = &b->views[b->next_tensor];
	n = t->n - b->next_offset;
	if (n > QUANTUM_ELEMENTS)
		n = QUANTUM_ELEMENTS;
	part = slice(t, b->next_offset, n);
	r = zk_pool_step(st->pool, b->isa, &b->hp_run, &part, 1);
	if (r < 0) {
		finish(st, b, ZP_STEP_FAILED, r);
		goto out;
	}
	b->next_offset += n;
	if (b->next_offset == t->n) {
		post(st, b, b->next_tensor);
		b->next_tensor++;
		b->next_offset = 0;
		if (b->next_tensor == b->count)
			finish(st, b, ZP_STEP_APPLIED, 0);
	}
out:
	b->compute_ns += zd_now_ns() - t0;
}

static bool
batch_done(const struct zd_batch *b)
{
	return b->checked && b->next_tensor >= b->count;
}

static void *
stepper_main(void *arg)
{
	struct zd_stepper *st = arg;
	struct lane *lane;
	struct zd_batch *b;
	bool done;

	pthread_mutex_lock(&st->lock);
	for (;;) {
		while (TAILQ_EMPTY(&st->lanes) && !st->stopping)
			pthread_cond_wait(&st->cond, &st->lock);
		lane = TAILQ_FIRST(&st->lanes);
		if (lane == NULL)
			break;
		b = TAILQ_FIRST(&lane->batches);
		pthread_mutex_unlock(&st->lock);

		run_quantum(st, b);
		done = batch_done(b);

		pthread_mutex_lock(&st->lock);
		if (done)
			TAILQ_REMOVE(&lane->batches, b, entry);
		/* Round robin: this lane goes to the back, or away when empty. */
		TAILQ_REMOVE(&st->lanes, lane, entry);
		if (TAILQ_EMPTY(&lane->batches))
			free(lane);
		else
			TAILQ_INSERT_TAIL(&st->lanes, lane, entry);
		/*
		 * Posted last: the loop frees the batch as soon as it reaps this,
		 * so it must be off the lane and its compute_ns final by then.
		 */
		if (done) {
			pthread_mutex_unlock(&st->lock);
			post(st, b, SIZE_MAX);
			pthread_mutex_lock(&st->lock);
		}
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
	TAILQ_INIT(&st->lanes);
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
	/* Batches still queued run to the end first: their tensors' memory is ours to free. */
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
	struct lane *lane;

	b->checked = false;
	b->next_tensor = 0;
	b->next_offset = 0;
	b->compute_ns = 0;
	pthread_mutex_lock(&st->lock);
	TAILQ_FOREACH(lane, &st->lanes, entry)
		if (lane->key == b->lane)
			break;
	if (lane == NULL) {
		/* Not allocated under the lock's hot path often: one per session with work. */
		lane = malloc(sizeof(*lane));
		while (lane == NULL) {
			usleep(1000);
			lane = malloc(sizeof(*lane));
		}
		lane->key = b->lane;
		TAILQ_INIT(&lane->batches);
		TAILQ_INSERT_TAIL(&st->lanes, lane, entry);
	}
	TAILQ_INSERT_TAIL(&lane->batches, b, entry);
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
