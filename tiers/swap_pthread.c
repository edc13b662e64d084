/* Swap backend without io_uring: a pread/pwrite thread pool signalling an eventfd. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "swap_impl.h"

struct pool {
	struct zs_swap *e;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct zs_op *todo_head;	/* under lock */
	struct zs_op *todo_tail;
	struct zs_op *done;		/* under lock */
	struct zs_op *staged_head;	/* loop thread only, until submit */
	struct zs_op *staged_tail;
	unsigned staged;
	bool stop;
	unsigned nthreads;
	pthread_t threads[];
};

/* Workers read only the op and the fd table, which the loop does not change while I/O runs. */
static void *
worker(void *arg)
{
	struct pool *p = arg;
	struct zs_swap *e = p->e;

	pthread_mutex_lock(&p->lock);
	for (;;) {
		struct zs_op *op;
		ssize_t n;
		int fd;

		while (p->todo_head == NULL && !p->stop)
			pthread_cond_wait(&p->cond, &p->lock);
		if (p->todo_head == NULL)
			break;
		op = p->todo_head;
		p->todo_head = op->next;
		if (p->todo_head == NULL)
			p->todo_tail = NULL;
		pthread_mutex_unlock(&p->lock);

		fd = e->files[op->path].fd;
		if (op->write)
			n = pwrite(fd, op->buf + op->done, op->len - op->done,
			    (off_t)(op->offset + op->done));
		else
			n = pread(fd, op->buf + op->done, op->len - op->done,
			    (off_t)(op->offset + op->done));
		op->res = n < 0 ? -errno : (int)n;

		pthread_mutex_lock(&p->lock);
		op->next = p->done;
		p->done = op;
		/* Under the lock: the loop cannot free the eventfd before this write. */
		(void)eventfd_write(e->efd, 1);
	}
	pthread_mutex_unlock(&p->lock);
	return NULL;
}

static void
stop_workers(struct pool *p, unsigned started)
{
	unsigned i;

	pthread_mutex_lock(&p->lock);
	p->stop = true;
	pthread_cond_broadcast(&p->cond);
	pthread_mutex_unlock(&p->lock);
	for (i = 0; i < started; i++)
		pthread_join(p->threads[i], NULL);
}

static int
pool_init(struct zs_swap *e)
{
	struct pool *p;
	sigset_t all, old;
	unsigned i;
	int r = 0;

	p = calloc(1, sizeof(*p) + e->threads * sizeof(p->threads[0]));
	if (p == NULL)
		return -ENOMEM;
	p->e = e;
	p->nthreads = e->threads;
	pthread_mutex_init(&p->lock, NULL);
	pthread_cond_init(&p->cond, NULL);
	/* Signals belong to the daemon's loop thread, not to I/O workers. */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	for (i = 0; i < p->nthreads; i++) {
		r = -pthread_create(&p->threads[i], NULL, worker, p);
		if (r < 0)
			break;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (r < 0) {
		stop_workers(p, i);
		pthread_cond_destroy(&p->cond);
		pthread_mutex_destroy(&p->lock);
		free(p);
		return r;
	}
	e->bstate = p;
	return 0;
}

static void
pool_fini(struct zs_swap *e)
{
	struct pool *p = e->bstate;

	if (p == NULL)
		return;
	stop_workers(p, p->nthreads);
	pthread_cond_destroy(&p->cond);
	pthread_mutex_destroy(&p->lock);
	free(p);
	e->bstate = NULL;
}

static void
pool_queue(struct zs_swap *e, struct zs_op *op)
{
	struct pool *p = e->bstate;

	op->next = NULL;
	if (p->staged_tail != NULL)
		p->staged_tail->next = op;
	else
		p->staged_head = op;
	p->staged_tail = op;
	p->staged++;
}

static int
pool_submit(struct zs_swap *e)
{
	struct pool *p = e->bstate;

	if (p->staged_head == NULL)
		return 0;
	pthread_mutex_lock(&p->lock);
	if (p->todo_tail != NULL)
		p->todo_tail->next = p->staged_head;
	else
		p->todo_head = p->staged_head;
	p->todo_tail = p->staged_tail;
	if (p->staged == 1)
		pthread_cond_signal(&p->cond);
	else
		pthread_cond_broadcast(&p->cond);
	pthread_mutex_unlock(&p->lock);
	p->staged_head = p->staged_tail = NULL;
	p->staged = 0;
	return 0;
}

static int
pool_reap(struct zs_swap *e)
{
	struct pool *p = e->bstate;
	struct zs_op *op, *next;

	pthread_mutex_lock(&p->lock);
	op = p->done;
	p->done = NULL;
	pthread_mutex_unlock(&p->lock);
	for (; op != NULL; op = next) {
		next = op->next;
		zs_op_complete(e, op, op->res);
	}
	return 0;
}

const struct zs_backend zs_backend_pthread = {
	.name = "pthread",
	.init = pool_init,
	.fini = pool_fini,
	.queue = pool_queue,
	.submit = pool_submit,
	.reap = pool_reap,
};
