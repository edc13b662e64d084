/* Checkpoint I/O threads: a checkpoint file's pread/pwrite and CRC-32C, off the event loop. */
#ifndef ZD_CHECKPOINT_IO_H
#define ZD_CHECKPOINT_IO_H

#include <sys/queue.h>

struct zd_ckpt_io;

/*
 * One piece of file work.  The loop fills it and submits it; from then until the loop
 * takes it back from zd_ckpt_io_take, it and what run touches belong to a thread.
 */
struct zd_ckpt_io_item {
	TAILQ_ENTRY(zd_ckpt_io_item) entry;
	void (*run)(struct zd_ckpt_io_item *job);	/* on an I/O thread */
	/*
	 * Whose it is (the daemon's: the uid), for taking turns: a free thread takes a job of
	 * the key with the fewest jobs running, then the one that started one least recently,
	 * so that one key's many transfers do not hold back another's one.
	 */
	const void *key;
};

/*
 * nthreads threads.  gate (NULL: none) is a FIFO that a thread opens for reading before
 * each job, so it waits until a writer holds it open: tests hold a transfer with it.
 */
int zd_ckpt_io_new(unsigned nthreads, const char *gate, struct zd_ckpt_io **ret);
/* Readable (an eventfd) when finished jobs wait for zd_ckpt_io_take. */
int zd_ckpt_io_fd(const struct zd_ckpt_io *io);
void zd_ckpt_io_submit(struct zd_ckpt_io *io, struct zd_ckpt_io_item *job);
/* A finished job, back to the loop; NULL when none is left. */
struct zd_ckpt_io_item *zd_ckpt_io_take(struct zd_ckpt_io *io);
/* Runs what was submitted to its end, then joins the threads; finished jobs stay to take. */
void zd_ckpt_io_stop(struct zd_ckpt_io *io);
/* After zd_ckpt_io_stop and taking every job. */
void zd_ckpt_io_free(struct zd_ckpt_io *io);

#endif
