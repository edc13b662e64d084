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

TAILQ_HEAD(job_list, zd_ckpt_job);

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
};

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

static void *
io_main(void *arg)
{
	struct zd_ckpt_io *io = arg;
	struct zd_ckpt_job *job;
	uint64_t one = 1;

	pthread_mutex_lock(&io->lock);
	for (;;) {
		while (TAILQ_EMPTY(&io->queue) && !io->stopping)
			pthread_cond_wait(&io->cond, &io->lock);
		job = TAILQ_FIRST(&io->queue);
		if (job == NULL)
			break;
		TAILQ_REMOVE(&io->queue, job, entry);
		pthread_mutex_unlock(&io->lock);

		if (io->gate != NULL)
			wait_gate(io->gate);
		job->run(job);

		pthread_mutex_lock(&io->lock);
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
		r = -pthread_create(&io->threads[io->nthreads], NULL, io_main, io);
		if (r < 0)
			goto fail;
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
zd_ckpt_io_submit(struct zd_ckpt_io *io, struct zd_ckpt_job *job)
{
	pthread_mutex_lock(&io->lock);
	TAILQ_INSERT_TAIL(&io->queue, job, entry);
	pthread_cond_signal(&io->cond);
	pthread_mutex_unlock(&io->lock);
}

struct zd_ckpt_job *
zd_ckpt_io_take(struct zd_ckpt_io *io)
{
	struct zd_ckpt_job *job;
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
