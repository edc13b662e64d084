/*
 * Checkpoint I/O threads.  A checkpoint file may sit on a disk far slower than the
 * tiers; its pread/pwrite (and the CRC-32C of what passes) run here, so that a slow
 * target delays only its own transfer, never the loop and the other clients.  Finished
 * jobs go back to the loop through an eventfd, as the stepper's tasks do.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "checkpoint_io.h"

#define MAX_THREADS 8
/* Keys remembered for their last start; past it the oldest is forgotten (it counts as new). */
#define RECENT_KEYS 64

TAILQ_HEAD(job_list, zd_ckpt_io_item);

/*
 * The lock guards the two lists and stopping; a job on `queue` or running belongs to
 * the threads, one on `done` waits for the loop.  gate is the daemon's (its environment).
 */
struct zd_ckpt_io {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct job_list queue;
	struct job_list done;
	bool stopping;
	int efd;
	const char *gate;
	unsigned nthreads;
	pthread_t threads[MAX_THREADS];
	const void *running[MAX_THREADS];	/* the key of each thread's job (NULL: idle) */
	struct { const void *key; uint64_t seq; } recent[RECENT_KEYS];	/* last starts */
	uint64_t seq;
};

static unsigned
running_of(const struct zd_ckpt_io *io, const void *key)
{
	unsigned n = 0;

	for (unsigned i = 0; i < MAX_THREADS; i++)
		n += io->running[i] == key;
	return n;
}

static uint64_t
last_start(const struct zd_ckpt_io *io, const void *key)
{
	for (unsigned i = 0; i < RECENT_KEYS; i++)
		if (io->recent[i].seq != 0 && io->recent[i].key == key)
			return io->recent[i].seq;
	return 0;
}

static void
started(struct zd_ckpt_io *io, const void *key)
{
	unsigned at = 0;

	for (unsigned i = 0; i < RECENT_KEYS; i++) {
		if (io->recent[i].seq != 0 && io->recent[i].key == key) {
			at = i;
			break;
		}
		if (io->recent[i].seq < io->recent[at].seq)
			at = i;
	}
	io->recent[at].key = key;
	io->recent[at].seq = ++io->seq;
}

/* The job to start: its key has the fewest running, then the oldest last start; FIFO within. */
static struct zd_ckpt_io_item *
pick(struct zd_ckpt_io *io)
{
	struct zd_ckpt_io_item *job, *best = NULL;
	unsigned best_running = 0;
	uint64_t best_last = 0;

	TAILQ_FOREACH(job, &io->queue, entry) {
		unsigned r = running_of(io, job->key);
		uint64_t last = last_start(io, job->key);

		if (best == NULL || r < best_running || (r == best_running && last < best_last)) {
			best = job;
			best_running = r;
			best_last = last;
		}
	}
	return best;
}

static void
wait_gate(const char *gate)
{
	int fd;

	do
		fd = open(gate, O_RDONLY | O_CLOEXEC);
	while (fd < 0 && errno == EINTR);
	if (fd >= 0)
		close(fd);
}

struct io_thread {
	struct zd_ckpt_io *io;
	unsigned index;
};

static void *
io_main(void *arg)
{
	struct zd_ckpt_io *io = ((struct io_thread *)arg)->io;
	unsigned self = ((struct io_thread *)arg)->index;
	struct zd_ckpt_io_item *job;
	uint64_t one = 1;

	free(arg);
	pthread_mutex_lock(&io->lock);
	for (;;) {
		while (TAILQ_EMPTY(&io->queue) && !io->stopping)
			pthread_cond_wait(&io->cond, &io->lock);
		job = pick(io);
		if (job == NULL)
			break;
		TAILQ_REMOVE(&io->queue, job, entry);
		io->running[self] = job->key;
		started(io, job->key);
		pthread_mutex_unlock(&io->lock);

		if (io->gate != NULL)
			wait_gate(io->gate);
		job->run(job);

		pthread_mutex_lock(&io->lock);
		io->running[self] = NULL;
		TAILQ_INSERT_TAIL(&io->done, job, entry);
		(void)!write(io->efd, &one, sizeof(one));
	}
	pthread_mutex_unlock(&io->lock);
	return NULL;
}

int
zd_ckpt_io_new(unsigned nthreads, const char *gate, struct zd_ckpt_io **ret)
{
	struct zd_ckpt_io *io;
	int r;

	if (nthreads == 0 || nthreads > MAX_THREADS)
		return -EINVAL;
	io = calloc(1, sizeof(*io));
	if (io == NULL)
		return -ENOMEM;
	TAILQ_INIT(&io->queue);
	TAILQ_INIT(&io->done);
	pthread_mutex_init(&io->lock, NULL);
	pthread_cond_init(&io->cond, NULL);
	io->gate = gate;
	io->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (io->efd < 0) {
		r = -errno;
		goto fail;
	}
	for (; io->nthreads < nthreads; io->nthreads++) {
		struct io_thread *t = malloc(sizeof(*t));

		if (t == NULL) {
			r = -ENOMEM;
			goto fail;
		}
		*t = (struct io_thread){ .io = io, .index = io->nthreads };
		r = -pthread_create(&io->threads[io->nthreads], NULL, io_main, t);
		if (r < 0) {
			free(t);
			goto fail;
		}
	}
	*ret = io;
	return 0;
fail:
	zd_ckpt_io_stop(io);
	zd_ckpt_io_free(io);
	return r;
}

int
zd_ckpt_io_fd(const struct zd_ckpt_io *io)
{
	return io->efd;
}

void
zd_ckpt_io_submit(struct zd_ckpt_io *io, struct zd_ckpt_io_item *job)
{
	pthread_mutex_lock(&io->lock);
	TAILQ_INSERT_TAIL(&io->queue, job, entry);
	pthread_cond_signal(&io->cond);
	pthread_mutex_unlock(&io->lock);
}

struct zd_ckpt_io_item *
zd_ckpt_io_take(struct zd_ckpt_io *io)
{
	struct zd_ckpt_io_item *job;
	uint64_t n;

	pthread_mutex_lock(&io->lock);
	job = TAILQ_FIRST(&io->done);
	if (job != NULL)
		TAILQ_REMOVE(&io->done, job, entry);
	else
		(void)!read(io->efd, &n, sizeof(n));	/* drained: the next finish wakes the loop */
	pthread_mutex_unlock(&io->lock);
	return job;
}

void
zd_ckpt_io_stop(struct zd_ckpt_io *io)
{
	pthread_mutex_lock(&io->lock);
	io->stopping = true;
	pthread_cond_broadcast(&io->cond);
	pthread_mutex_unlock(&io->lock);
	for (unsigned i = 0; i < io->nthreads; i++)
		pthread_join(io->threads[i], NULL);
	io->nthreads = 0;
}

void
zd_ckpt_io_free(struct zd_ckpt_io *io)
{
	if (io == NULL)
		return;
	if (io->efd >= 0)
		close(io->efd);
	pthread_mutex_destroy(&io->lock);
	pthread_cond_destroy(&io->cond);
	free(io);
}
