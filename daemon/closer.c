/*
 * The closer: descriptors clients sent, closed off the loop.  A file's last close frees
 * what it holds (an unlinked file of 100k extents took 10 s), and a client can make that
 * close ours: it sends the descriptor, closes its own copy, and unlinks the file.  The
 * loop hands every such descriptor here; the threads close them, a uid at a time in
 * turn, and the loop counts them back to their uid.
 */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <linux/sock_diag.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <unistd.h>

#include "closer.h"
#include "daemon.h"
#include "log.h"
#include "uid.h"

#define CLOSER_THREADS 2

/* One descriptor to close.  uid is the loop's (a thread only compares it). */
struct zd_close {
	TAILQ_ENTRY(zd_close) entry;
	int fd;
	enum zd_close_kind kind;
	struct zd_uid *uid;
};

TAILQ_HEAD(close_list, zd_close);

/* A uid's closes in order; on one thread at a time (busy), so others take the rest. */
struct lane {
	TAILQ_ENTRY(lane) entry;
	struct zd_uid *uid;
	struct close_list queue;
	bool busy;
};

/*
 * lock guards the lanes, done and stopping.  A lane is freed by the thread that finds it
 * empty and idle; a close on `done` waits for the loop (close_cb).
 */
struct zd_closer {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	TAILQ_HEAD(, lane) lanes;
	struct close_list done;
	bool stopping;
	int efd;
	const char *gate;
	struct event *ev;
	unsigned nthreads;
	pthread_t threads[CLOSER_THREADS];
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

/* The first lane with work and no thread on it, moved to the tail: uids take turns. */
static struct lane *
next_lane(struct zd_closer *c)
{
	struct lane *l;

	TAILQ_FOREACH(l, &c->lanes, entry)
		if (!l->busy && !TAILQ_EMPTY(&l->queue)) {
			TAILQ_REMOVE(&c->lanes, l, entry);
			TAILQ_INSERT_TAIL(&c->lanes, l, entry);
			return l;
		}
	return NULL;
}

static void *
closer_main(void *arg)
{
	struct zd_closer *c = arg;
	struct zd_close *x;
	struct lane *l;
	uint64_t one = 1;

	pthread_mutex_lock(&c->lock);
	for (;;) {
		while ((l = next_lane(c)) == NULL && !c->stopping)
			pthread_cond_wait(&c->cond, &c->lock);
		if (l == NULL)
			break;
		x = TAILQ_FIRST(&l->queue);
		TAILQ_REMOVE(&l->queue, x, entry);
		l->busy = true;
		pthread_mutex_unlock(&c->lock);

		if (c->gate != NULL)
			wait_gate(c->gate);
		close(x->fd);

		pthread_mutex_lock(&c->lock);
		l->busy = false;
		if (TAILQ_EMPTY(&l->queue)) {
			TAILQ_REMOVE(&c->lanes, l, entry);
			free(l);
		} else {
			pthread_cond_signal(&c->cond);
		}
		TAILQ_INSERT_TAIL(&c->done, x, entry);
		(void)!write(c->efd, &one, sizeof(one));
	}
	pthread_mutex_unlock(&c->lock);
	return NULL;
}

/* A charged descriptor of u's is closed: its charge goes back, through the hook if released. */
static void
refund(struct zd_daemon *d, struct zd_uid *u, enum zd_close_kind kind)
{
	if (kind == ZD_CLOSE_RELEASED && d->closer_hooks != NULL)
		d->closer_hooks->released(d, u);
	else
		zd_uid_refund(d, u, 1, 0, 0);
}

/*
 * A descriptor of u's is closed: its charge goes back; u's sessions read again once u is
 * not busy.  u stays: a caller on the loop puts it itself.
 */
static void
account(struct zd_daemon *d, struct zd_uid *u, enum zd_close_kind kind)
{
	if (u == NULL)
		return;
	u->closing--;
	refund(d, u, kind);
	if (u->closing == ZD_CLOSER_UID_MAX - 1 && d->closer_hooks != NULL)
		d->closer_hooks->uid_ready(d, u);
}

/* From a thread: the charge was all that kept the uid, maybe. */
static void
closed(struct zd_daemon *d, struct zd_close *x)
{
	d->closed_off_loop++;
	account(d, x->uid, x->kind);
	if (x->uid != NULL)
		zd_uid_put(d, x->uid);
	free(x);
}

static void
close_cb(evutil_socket_t fd, short what, void *arg)
{
	struct zd_daemon *d = arg;
	struct zd_closer *c = d->closer;
	struct zd_close *x;
	uint64_t n;

	for (;;) {
		pthread_mutex_lock(&c->lock);
		x = TAILQ_FIRST(&c->done);
		if (x != NULL)
			TAILQ_REMOVE(&c->done, x, entry);
		else
			(void)!read(c->efd, &n, sizeof(n));	/* drained: the next close wakes us */
		pthread_mutex_unlock(&c->lock);
		if (x == NULL)
			break;
		closed(d, x);
	}
}

static void
closer_free(struct zd_closer *c)
{
	if (c->ev != NULL)
		event_free(c->ev);
	if (c->efd >= 0)
		close(c->efd);
	pthread_mutex_destroy(&c->lock);
	pthread_cond_destroy(&c->cond);
	free(c);
}

static void
join(struct zd_closer *c)
{
	pthread_mutex_lock(&c->lock);
	c->stopping = true;
	pthread_cond_broadcast(&c->cond);
	pthread_mutex_unlock(&c->lock);
	for (unsigned i = 0; i < c->nthreads; i++)
		pthread_join(c->threads[i], NULL);
	c->nthreads = 0;
}

int
zd_closer_start(struct zd_daemon *d, const struct zd_closer_hooks *hooks)
{
	struct zd_closer *c = calloc(1, sizeof(*c));
	int r;

	d->closer_hooks = hooks;
	if (c == NULL)
		return -ENOMEM;
	TAILQ_INIT(&c->lanes);
	TAILQ_INIT(&c->done);
	pthread_mutex_init(&c->lock, NULL);
	pthread_cond_init(&c->cond, NULL);
	c->gate = getenv("ZOFFLOADD_TEST_CLOSE_GATE");
	c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (c->efd < 0) {
		r = -errno;
		goto fail;
	}
	c->ev = event_new(d->base, c->efd, EV_READ | EV_PERSIST, close_cb, d);
	if (c->ev == NULL || event_add(c->ev, NULL) != 0) {
		r = -ENOMEM;
		goto fail;
	}
	for (; c->nthreads < CLOSER_THREADS; c->nthreads++) {
		r = -pthread_create(&c->threads[c->nthreads], NULL, closer_main, c);
		if (r < 0)
			goto fail;
	}
	d->closer = c;
	return 0;
fail:
	join(c);
	closer_free(c);
	return r;
}

void
zd_closer_stop(struct zd_daemon *d)
{
	struct zd_closer *c = d->closer;
	struct zd_close *x;

	if (c == NULL)
		return;
	/* The threads finish every lane before they see stopping with nothing left. */
	join(c);
	d->closer = NULL;
	while ((x = TAILQ_FIRST(&c->done)) != NULL) {
		TAILQ_REMOVE(&c->done, x, entry);
		closed(d, x);
	}
	closer_free(c);
}

void
zd_closer_close(struct zd_daemon *d, struct zd_uid *u, int fd, enum zd_close_kind kind)
{
	struct zd_closer *c = d->closer;
	struct zd_close *x = c != NULL ? calloc(1, sizeof(*x)) : NULL;
	struct lane *l;

	if (u != NULL && kind == ZD_CLOSE_UNCHARGED)
		zd_uid_hold_fd(d, u);
	if (u != NULL)
		u->closing++;
	if (x == NULL) {
		/* Before the loop runs, after it stopped, or out of memory: here, then. */
		if (c != NULL)
			log_warnx("out of memory for a descriptor's close: closed on the loop");
		close(fd);
		account(d, u, kind);
		return;
	}
	x->fd = fd;
	x->kind = kind;
	x->uid = u;
	pthread_mutex_lock(&c->lock);
	TAILQ_FOREACH(l, &c->lanes, entry)
		if (l->uid == u)
			break;
	if (l == NULL) {
		l = calloc(1, sizeof(*l));
		if (l == NULL) {
			pthread_mutex_unlock(&c->lock);
			log_warnx("out of memory for a descriptor's close: closed on the loop");
			free(x);
			close(fd);
			account(d, u, kind);
			return;
		}
		l->uid = u;
		TAILQ_INIT(&l->queue);
		TAILQ_INSERT_TAIL(&c->lanes, l, entry);
	}
	TAILQ_INSERT_TAIL(&l->queue, x, entry);
	pthread_cond_signal(&c->cond);
	pthread_mutex_unlock(&c->lock);
}

void
zd_closer_close_fds(struct zd_daemon *d, struct zd_uid *u, const int *fds, unsigned n)
{
	for (unsigned i = 0; i < n; i++)
		zd_closer_close(d, u, fds[i], ZD_CLOSE_UNCHARGED);
}

bool
zd_closer_uid_busy(const struct zd_uid *u)
{
	return u->closing >= ZD_CLOSER_UID_MAX;
}

void
zd_closer_close_socket(struct zd_daemon *d, struct zd_uid *u, int fd, enum zd_close_kind kind)
{
	uint32_t mem[SK_MEMINFO_VARS];
	socklen_t len = sizeof(mem);

	/*
	 * The peer can queue nothing more (its sends fail with EPIPE).  With nothing queued,
	 * nothing in flight can be freed with the socket: closed here, at once.
	 */
	if (shutdown(fd, SHUT_RD) == 0 &&
	    getsockopt(fd, SOL_SOCKET, SO_MEMINFO, mem, &len) == 0 &&
	    len >= sizeof(uint32_t) * (SK_MEMINFO_RMEM_ALLOC + 1) &&
	    mem[SK_MEMINFO_RMEM_ALLOC] == 0) {
		close(fd);
		/* The charge back, and nothing else: the caller still holds u (and puts it). */
		if (u != NULL && kind != ZD_CLOSE_UNCHARGED)
			refund(d, u, kind);
		return;
	}
	zd_closer_close(d, u, fd, kind);
}
