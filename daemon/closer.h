/* Descriptors that came from clients, closed on threads of their own. */
#ifndef ZD_CLOSER_H
#define ZD_CLOSER_H

#include <stdbool.h>
#include <stdint.h>

struct zd_daemon;
struct zd_uid;

/*
 * The last close of a file a client sent can take seconds (an unlinked file of many
 * extents frees them all in close), so no such descriptor is closed on the loop: they
 * go to the closer's threads.  Each one is charged to the uid that sent it, past the
 * uid's cap if need be (it is held already), until it is closed; a uid with
 * ZD_CLOSER_UID_MAX or more waiting is not read from until they are closed
 * (zd_closer_uid_busy), so what it sends waits in its own sockets.  The threads take
 * uids in turn, one uid on one thread at a time: a uid's slow closes delay its own.
 */
#define ZD_CLOSER_UID_MAX 16

/* What a close is, for the counts the loop keeps when it is done. */
enum zd_close_kind {
	ZD_CLOSE_UNCHARGED,	/* a descriptor a client sent: charged from here */
	ZD_CLOSE_CHARGED,	/* charged already: a checkpoint file, a session's socket */
	ZD_CLOSE_RELEASED,	/* a CKPT_RELEASE file (charged): counted in d->ckpt_released */
};

/*
 * What the loop does when closes are done (the closer knows neither checkpoints nor
 * sessions): released, after a ZD_CLOSE_RELEASED close, gives its charge back and counts
 * it; uid_ready, when u's closes waiting fall below ZD_CLOSER_UID_MAX, reads u's sessions
 * again.
 */
struct zd_closer_hooks {
	void (*released)(struct zd_daemon *d, struct zd_uid *u);
	void (*uid_ready)(struct zd_daemon *d, struct zd_uid *u);
};

/*
 * Threads and their eventfd on d's loop; hooks outlive the daemon's closes.
 * ZOFFLOADD_TEST_CLOSE_GATE names a FIFO that each close waits to open (tests).
 */
int zd_closer_start(struct zd_daemon *d, const struct zd_closer_hooks *hooks);
/* Closes what is left (on the threads), joins them; later closes happen in place. */
void zd_closer_stop(struct zd_daemon *d);
/*
 * Takes fd, from a client of u: closed on a closer thread.  The caller puts u after
 * (zd_uid_put), as the charge may have been given back at once.  u NULL: a client turned away
 * before it had a uid here, charged to no one.  A session's socket goes this
 * way too: the messages still queued in it, and the descriptors they carry, are freed
 * with its last close.
 */
void zd_closer_close(struct zd_daemon *d, struct zd_uid *u, int fd, enum zd_close_kind kind);
void zd_closer_close_fds(struct zd_daemon *d, struct zd_uid *u, const int *fds, unsigned n);
/*
 * A socket a client connected: closed here when nothing is queued in it (after a
 * shutdown, so that nothing can be), else as zd_closer_close.  The caller's u outlives
 * the call either way (zd_uid_put after it).
 */
void zd_closer_close_socket(struct zd_daemon *d, struct zd_uid *u, int fd,
    enum zd_close_kind kind);
/* u has ZD_CLOSER_UID_MAX closes waiting: its sessions are not read from meanwhile. */
bool zd_closer_uid_busy(const struct zd_uid *u);

#endif
