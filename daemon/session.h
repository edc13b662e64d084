/*
 * One connected client: its socket, output queue, tensors by handle and lifetime.  The
 * transport knows no request: each decoded message goes to its hooks' on_message, and
 * the end of the connection to on_close (requests.c supplies them).
 */
#ifndef ZD_SESSION_H
#define ZD_SESSION_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>
#include <sys/types.h>

#include "engine.h"
#include "proto.h"

struct event;
struct zd_daemon;
struct zd_job;
struct zd_uid;
struct zd_tensor;
struct zd_out;
struct zd_session;
struct zd_session_slot;

/*
 * What the layer above does with a session's traffic.  on_message owns fds (nfds of them,
 * any number up to ZP_RECV_ALL_FDS: checking them is its business) and returns true to end
 * this wakeup's burst of reads; it asks for the connection's end by setting s->closing.
 * on_close runs once, first thing in zd_session_close, while the session is whole.
 */
struct zd_session_hooks {
	bool (*on_message)(struct zd_session *s, const struct zp_msg *msg, const int *fds,
	    unsigned nfds);
	void (*on_close)(struct zd_session *s);
};

/*
 * Owned by the daemon's list from accept to zd_session_close.  Holds a
 * reference on its job (while attached) and counts in its uid's sessions;
 * its tensors are its own until it closes (then freed, or kept detached).
 * The engine knows it only as lane `id`.
 */
struct zd_session {
	TAILQ_ENTRY(zd_session) entry;
	struct zd_daemon *daemon;
	uint32_t id;
	int fd;
	uid_t uid;
	gid_t gid;
	pid_t pid;
	char name[ZP_NAME_MAX + 1];
	bool hello_done;
	bool closing;			/* close once the output queue drains */
	struct event *ev_read;
	struct event *ev_write;
	TAILQ_HEAD(, zd_out) outq;
	unsigned outq_len;
	uint64_t outq_bytes;		/* counted in uid_usage->queued_bytes too */
	bool stalled;			/* dropped for not reading: give up on what is queued */
	bool read_paused;		/* its uid waits for the closer (closer.c) */
	struct zd_job *job;
	uint32_t rank;
	struct zd_uid *uid_usage;
	struct zd_tensor **tensors;	/* indexed by handle - 1; NULL after unregister */
	uint32_t ntensor_slots;
	uint32_t tensor_cap;
	unsigned steps_in_flight;	/* submitted, STEP_DONE not yet sent */
	struct ze_shm xfer;
	uint64_t connected_ns;
	const struct zd_session_hooks *hooks;
	/*
	 * The layer above's own per-session state (checkpoint.c's), opaque here: NULL until
	 * it sets it, and freed by it in on_close.
	 */
	struct zd_session_slot *slot;
};

/* A client connected on fd: its messages go to hooks (which outlive every session). */
void zd_session_accept(struct zd_daemon *d, int fd, const struct zd_session_hooks *hooks);
void zd_session_close(struct zd_session *s);
/* Reads again after a pause for its uid's closes. */
void zd_session_resume(struct zd_session *s);
struct zd_session *zd_session_by_id(struct zd_daemon *d, uint32_t id);
/*
 * Sends msg, or queues it while the client is not reading (bounded in
 * messages and bytes, per session and per uid; past a bound the session is
 * dropped and -ENOBUFS returned).  fds are duplicated while queued and
 * counted against the uid's descriptors.
 */
int zd_session_send(struct zd_session *s, const struct zp_msg *msg, const int *fds,
    unsigned nfds);
/*
 * The same for a reply that carries a tensor's slots or the session's
 * transfer window: while queued it holds no descriptor, they are looked up
 * when it goes out.
 */
int zd_session_send_slots(struct zd_session *s, const struct zp_msg *msg, uint32_t handle);
int zd_session_send_xfer(struct zd_session *s, const struct zp_msg *msg);
/* A reply with one memfd of `bytes` bytes (the caller keeps fd): queued, it counts them too. */
int zd_session_send_blob(struct zd_session *s, const struct zp_msg *msg, int fd, size_t bytes);
/* Error reply: code is a negative errno, the text says what was wrong. */
void zd_session_error(struct zd_session *s, uint64_t request_id, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void zd_session_verror(struct zd_session *s, uint64_t request_id, int code, const char *fmt,
    va_list ap) __attribute__((format(printf, 4, 0)));
struct zd_tensor *zd_session_tensor(struct zd_session *s, uint32_t handle);

#endif
