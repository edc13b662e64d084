/*
 * One connected client: its socket, output queue and lifetime.  A transport: what a
 * message asks for is its hooks' business (requests.c), never this file's.
 */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "closer.h"
#include "daemon.h"
#include "job.h"		/* struct zd_tensor: a reply's slots are looked up as it goes */
#include "log.h"
#include "msgio.h"
#include "session.h"
#include "uid.h"

/* Where a queued reply's descriptors come from when it goes out. */
enum out_fds { OUT_FDS_NONE, OUT_FDS_DUP, OUT_FDS_SLOTS, OUT_FDS_XFER };

/*
 * A reply the client has not read yet.  Only OUT_FDS_DUP holds descriptors
 * (counted in the uid's); slots and the window are looked up at send time,
 * so unread replies cannot pile up descriptors.
 */
struct zd_out {
	TAILQ_ENTRY(zd_out) entry;
	size_t len;
	size_t cost;			/* bytes counted against the queue bounds */
	enum out_fds source;
	uint32_t handle;		/* OUT_FDS_SLOTS: the tensor's */
	int fds[ZP_MAX_FDS];
	unsigned nfds;
	uint8_t data[];
};

/* Messages handled per wakeup, so that one busy client cannot starve the others. */
#define READ_BURST 32

static void session_read_cb(evutil_socket_t fd, short what, void *arg);
static void session_write_cb(evutil_socket_t fd, short what, void *arg);

/* A client turned away at accept: one ERROR that says why, then the end. */
static void
refuse(struct zd_daemon *d, int fd, struct zd_uid *u, int code, const char *why)
{
	struct zp_msg m = { .hdr = { .type = ZP_ERROR } };

	m.u.error.code = code;
	snprintf(m.u.error.message, sizeof(m.u.error.message), "%s", why);
	(void)zp_send(fd, &m, NULL, 0);
	log_warnx("refused a client of uid %u: %s", (unsigned)u->uid, why);
	/* It may have sent descriptors already: they go with the socket, off the loop. */
	zd_closer_close_socket(d, u, fd, ZD_CLOSE_UNCHARGED);
	zd_uid_put(d, u);
}

static void
out_free(struct zd_session *s, struct zd_out *o)
{
	struct zd_uid *u = s->uid_usage;

	TAILQ_REMOVE(&s->outq, o, entry);
	s->outq_len--;
	s->outq_bytes -= o->cost;
	u->queued_bytes -= o->cost;
	for (unsigned i = 0; i < o->nfds; i++)
		close(o->fds[i]);
	if (o->nfds > 0)
		zd_uid_refund(s->daemon, u, o->nfds, 0, 0);
	free(o);
}

void
zd_session_accept(struct zd_daemon *d, int fd, const struct zd_session_hooks *hooks)
{
	struct zd_session *s;
	struct ucred cred;
	socklen_t len = sizeof(cred);
	struct zd_uid *u;
	char err[ZP_ERRMSG_MAX + 1];
	int r;

	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
		log_warn(errno, "SO_PEERCRED");
		close(fd);
		return;
	}
	u = zd_uid_get(d, cred.uid);
	if (u == NULL) {
		log_warnx("out of memory accepting a client");
		close(fd);
		return;
	}
	if (d->cfg.max_clients_per_uid > 0 && u->sessions >= d->cfg.max_clients_per_uid) {
		snprintf(err, sizeof(err), "uid %u already has %u connections "
		    "(limits.max_clients_per_uid)", (unsigned)cred.uid, u->sessions);
		refuse(d, fd, u, -EUSERS, err);
		return;
	}
	/* Its socket is one of the uid's descriptors. */
	r = zd_uid_charge(d, u, 1, 0, 0, err, sizeof(err));
	if (r < 0) {
		refuse(d, fd, u, r, err);
		return;
	}
	s = calloc(1, sizeof(*s));
	if (s == NULL) {
		log_warnx("out of memory accepting a client");
		goto fail;
	}
	s->daemon = d;
	s->id = ++d->next_session_id;
	s->fd = fd;
	s->hooks = hooks;
	s->uid = cred.uid;
	s->gid = cred.gid;
	s->pid = cred.pid;
	s->xfer.fd = -1;
	s->connected_ns = zu_now_ns();
	TAILQ_INIT(&s->outq);
	s->ev_read = event_new(d->base, fd, EV_READ | EV_PERSIST, session_read_cb, s);
	s->ev_write = event_new(d->base, fd, EV_WRITE, session_write_cb, s);
	if (s->ev_read == NULL || s->ev_write == NULL || event_add(s->ev_read, NULL) != 0) {
		log_warnx("cannot watch client socket");
		if (s->ev_read)
			event_free(s->ev_read);
		if (s->ev_write)
			event_free(s->ev_write);
		free(s);
		goto fail;
	}
	s->uid_usage = u;
	u->sessions++;
	TAILQ_INSERT_TAIL(&d->sessions, s, entry);
	d->nsessions++;
	log_debug("session %u: connected, pid %d uid %u", s->id, (int)s->pid, (unsigned)s->uid);
	return;
fail:
	zd_closer_close_socket(d, u, fd, ZD_CLOSE_CHARGED);
	zd_uid_put(d, u);
}

void
zd_session_close(struct zd_session *s)
{
	struct zd_daemon *d = s->daemon;
	struct zd_out *o;

	log_debug("session %u: closed", s->id);
	/*
	 * Steps in flight finish without us (the engine keeps their tensors
	 * until then); transfers stop touching the window freed below.
	 */
	ze_engine_cancel_lane(d->engine, s->id);
	s->hooks->on_close(s);
	s->uid_usage->sessions--;
	while ((o = TAILQ_FIRST(&s->outq)) != NULL)
		out_free(s, o);
	if (s->xfer.map != NULL)
		zd_uid_refund(d, s->uid_usage, 1, s->xfer.bytes, 0);
	ze_shm_destroy(d->engine, &s->xfer);
	event_free(s->ev_read);
	event_free(s->ev_write);
	TAILQ_REMOVE(&d->sessions, s, entry);
	d->nsessions--;
	/*
	 * Off the loop, with its charge: messages the client queued and we did not read go
	 * with the socket's last close, and so do the descriptors they carry.
	 */
	zd_closer_close_socket(d, s->uid_usage, s->fd, ZD_CLOSE_CHARGED);
	zd_uid_put(d, s->uid_usage);
	free(s->tensors);
	free(s);
}

/*
 * Why a reply cannot be queued: a bound it would pass.  Every bound drops
 * the session, so that a client that does not read costs the daemon a
 * fixed amount whatever it sends.
 */
static int
over_bound(const struct zd_session *s, size_t cost, char *why, size_t whylen)
{
	const struct zd_config *c = &s->daemon->cfg;
	char have[32], limit[32];

	if (s->outq_len >= c->max_queued_messages) {
		snprintf(why, whylen, "%u replies queued (limits.max_queued_messages)", s->outq_len);
		return -ENOBUFS;
	}
	if (s->outq_bytes + cost > c->max_queued_bytes) {
		zd_fmt_bytes(s->outq_bytes, have, sizeof(have));
		zd_fmt_bytes(c->max_queued_bytes, limit, sizeof(limit));
		snprintf(why, whylen, "%s of replies queued, limits.max_queued_bytes is %s", have,
		    limit);
		return -ENOBUFS;
	}
	if (s->uid_usage->queued_bytes + cost > c->uid_queued_bytes) {
		zd_fmt_bytes(s->uid_usage->queued_bytes, have, sizeof(have));
		zd_fmt_bytes(c->uid_queued_bytes, limit, sizeof(limit));
		snprintf(why, whylen, "its uid has %s of replies queued, limits.uid_queued_bytes "
		    "is %s", have, limit);
		return -ENOBUFS;
	}
	return 0;
}

static int
queue_out(struct zd_session *s, const void *buf, size_t len, enum out_fds source,
    uint32_t handle, const int *fds, unsigned nfds, size_t extra, char *why, size_t whylen)
{
	struct zd_daemon *d = s->daemon;
	size_t cost = sizeof(struct zd_out) + len + extra;
	struct zd_out *o;
	int r;

	r = over_bound(s, cost, why, whylen);
	if (r < 0)
		return r;
	if (nfds > 0) {
		r = zd_uid_charge(d, s->uid_usage, nfds, 0, 0, why, whylen);
		if (r < 0)
			return r;
	}
	o = malloc(sizeof(*o) + len);
	if (o == NULL) {
		snprintf(why, whylen, "out of memory for its replies");
		r = -ENOMEM;
		goto fail;
	}
	o->len = len;
	o->cost = cost;
	o->source = source;
	o->handle = handle;
	o->nfds = 0;
	memcpy(o->data, buf, len);
	for (unsigned i = 0; i < nfds; i++) {
		o->fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 0);
		if (o->fds[i] < 0) {
			r = -errno;
			snprintf(why, whylen, "cannot keep a descriptor for its reply: %s",
			    strerror(-r));
			for (unsigned j = 0; j < i; j++)
				close(o->fds[j]);
			free(o);
			goto fail;
		}
		o->nfds++;
	}
	TAILQ_INSERT_TAIL(&s->outq, o, entry);
	s->outq_len++;
	s->outq_bytes += cost;
	s->uid_usage->queued_bytes += cost;
	event_add(s->ev_write, NULL);
	return 0;
fail:
	if (nfds > 0)
		zd_uid_refund(d, s->uid_usage, nfds, 0, 0);
	return r;
}

/* The descriptors a reply carries, now: 0 and *nfds, or -ENOENT when their owner is gone. */
static int
resolve_fds(struct zd_session *s, enum out_fds source, uint32_t handle, const int *given,
    unsigned ngiven, int *fds, unsigned *nfds)
{
	struct zd_tensor *t;

	switch (source) {
	case OUT_FDS_SLOTS:
		t = zd_session_tensor(s, handle);
		if (t == NULL)
			return -ENOENT;
		fds[0] = ze_tensor_grad_fd(t->et);
		fds[1] = ze_tensor_param_fd(t->et);
		*nfds = 2;
		return 0;
	case OUT_FDS_XFER:
		if (s->xfer.map == NULL)
			return -ENOENT;
		fds[0] = s->xfer.fd;
		*nfds = 1;
		return 0;
	default:
		for (unsigned i = 0; i < ngiven; i++)
			fds[i] = given[i];
		*nfds = ngiven;
		return 0;
	}
}

/* Dropped for not reading: the loop must not free the session under its caller. */
static void
stall(struct zd_session *s, const char *why)
{
	if (s->stalled)
		return;
	log_warnx("session %u (pid %d, uid %u): not reading its replies: %s; disconnecting",
	    s->id, (int)s->pid, (unsigned)s->uid, why);
	s->stalled = true;
	s->closing = true;
	event_del(s->ev_read);
	event_active(s->ev_write, EV_WRITE, 0);
}

static int
send_msg(struct zd_session *s, const struct zp_msg *msg, enum out_fds source, uint32_t handle,
    const int *given, unsigned ngiven, size_t extra)
{
	uint8_t buf[ZP_MAX_MESSAGE];
	char why[ZP_ERRMSG_MAX + 1];
	int fds[ZP_MAX_FDS];
	unsigned nfds = 0;
	size_t len;
	int r;

	if (s->stalled)
		return -ENOBUFS;
	if (zp_encode(msg, buf, sizeof(buf), &len) != ZP_S_OK) {
		log_warnx("session %u: cannot encode %s", s->id, zp_type_name(msg->hdr.type));
		return -EPROTO;
	}
	/* Keep order: nothing goes around messages already queued. */
	if (TAILQ_EMPTY(&s->outq)) {
		r = resolve_fds(s, source, handle, given, ngiven, fds, &nfds);
		if (r == 0)
			r = zp_send_raw(s->fd, buf, len, fds, nfds);
		if (r != -EAGAIN)
			return r;
	}
	r = queue_out(s, buf, len, source, handle, source == OUT_FDS_DUP ? given : NULL,
	    source == OUT_FDS_DUP ? ngiven : 0, extra, why, sizeof(why));
	if (r < 0)
		stall(s, why);
	return r;
}

int
zd_session_send(struct zd_session *s, const struct zp_msg *msg, const int *fds, unsigned nfds)
{
	return send_msg(s, msg, nfds > 0 ? OUT_FDS_DUP : OUT_FDS_NONE, 0, fds, nfds, 0);
}

int
zd_session_send_blob(struct zd_session *s, const struct zp_msg *msg, int fd, size_t bytes)
{
	return send_msg(s, msg, OUT_FDS_DUP, 0, &fd, 1, bytes);
}

int
zd_session_send_slots(struct zd_session *s, const struct zp_msg *msg, uint32_t handle)
{
	return send_msg(s, msg, OUT_FDS_SLOTS, handle, NULL, 0, 0);
}

int
zd_session_send_xfer(struct zd_session *s, const struct zp_msg *msg)
{
	return send_msg(s, msg, OUT_FDS_XFER, 0, NULL, 0, 0);
}

void
zd_session_verror(struct zd_session *s, uint64_t request_id, int code, const char *fmt,
    va_list ap)
{
	struct zp_msg m = { .hdr = { .type = ZP_ERROR, .request_id = request_id } };

	m.u.error.code = code;
	vsnprintf(m.u.error.message, sizeof(m.u.error.message), fmt, ap);
	log_debug("session %u: error reply: %s", s->id, m.u.error.message);
	(void)zd_session_send(s, &m, NULL, 0);
}

void
zd_session_error(struct zd_session *s, uint64_t request_id, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	zd_session_verror(s, request_id, code, fmt, ap);
	va_end(ap);
}

struct zd_session *
zd_session_by_id(struct zd_daemon *d, uint32_t id)
{
	struct zd_session *s;

	TAILQ_FOREACH(s, &d->sessions, entry)
		if (s->id == id)
			return s;
	return NULL;
}

struct zd_tensor *
zd_session_tensor(struct zd_session *s, uint32_t handle)
{
	if (handle == 0 || handle > s->ntensor_slots)
		return NULL;
	return s->tensors[handle - 1];
}

static void
session_write_cb(evutil_socket_t fd, short what, void *arg)
{
	struct zd_session *s = arg;
	int fds[ZP_MAX_FDS];
	unsigned nfds;
	struct zd_out *o;
	int r;

	while ((o = TAILQ_FIRST(&s->outq)) != NULL) {
		r = resolve_fds(s, o->source, o->handle, o->fds, o->nfds, fds, &nfds);
		if (r < 0) {
			/* Only a client that unregisters a handle it was never told gets here. */
			log_info("session %u (pid %d): dropped: tensor %u went before its reply",
			    s->id, (int)s->pid, o->handle);
			s->closing = true;
			break;
		}
		r = zp_send_raw(s->fd, o->data, o->len, fds, nfds);
		if (r == -EAGAIN) {
			if (!s->stalled) {
				event_add(s->ev_write, NULL);
				return;
			}
			break;	/* not reading and over a bound: give up on it */
		}
		out_free(s, o);
		if (r < 0)
			break;
	}
	if (s->closing)
		zd_session_close(s);
}

/* After an error reply, the connection goes; nothing it asked for is kept. */
static void
session_fail(struct zd_session *s)
{
	s->closing = true;
	event_del(s->ev_read);
	if (TAILQ_EMPTY(&s->outq))
		zd_session_close(s);
}

void
zd_session_resume(struct zd_session *s)
{
	if (!s->read_paused || s->closing)
		return;
	s->read_paused = false;
	event_add(s->ev_read, NULL);
}

static void
session_read_cb(evutil_socket_t fd, short what, void *arg)
{
	struct zd_session *s = arg;
	uint8_t buf[ZP_MAX_MESSAGE];
	struct zp_msg *msg;
	char why[256];
	int fds[ZP_RECV_ALL_FDS];
	unsigned nfds;
	ssize_t n;

	msg = malloc(sizeof(*msg));
	if (msg == NULL)
		return;
	for (int i = 0; i < READ_BURST && !s->closing; i++) {
		/* Its uid's descriptors wait for the closer: what it sends waits in the socket. */
		if (zd_closer_uid_busy(s->uid_usage)) {
			s->read_paused = true;
			event_del(s->ev_read);
			break;
		}
		n = zp_recv_all(s->fd, buf, sizeof(buf), fds, &nfds, MSG_DONTWAIT);
		if (n == -EAGAIN)
			break;
		/*
		 * Any descriptor not for a handler (an empty message's too: it reads as the
		 * end) goes to the closer, never closed here.
		 */
		if (n <= 0 || nfds > ZP_MAX_FDS) {
			zd_closer_close_fds(s->daemon, s->uid_usage, fds, nfds);
			if (n > 0)
				n = -ETOOMANYREFS;
		}
		if (n == 0 || n == -ECONNRESET) {
			free(msg);
			zd_session_close(s);
			return;
		}
		if (n < 0) {
			zd_session_error(s, 0, (int)n, "%s",
			    n == -EMSGSIZE ? "message larger than the protocol allows" :
			    n == -ETOOMANYREFS ? "message carries file descriptors" :
			    "receive failed");
			log_info("session %u (pid %d): dropped: receive: %s", s->id, (int)s->pid,
			    strerror((int)-n));
			session_fail(s);
			break;
		}
		enum zp_status st = zp_decode(buf, (size_t)n, msg, why, sizeof(why));
		bool end_burst;

		if (st != ZP_S_OK) {
			zd_closer_close_fds(s->daemon, s->uid_usage, fds, nfds);
			zd_session_error(s, st == ZP_S_SHORT ? 0 : msg->hdr.request_id,
			    st == ZP_S_VERSION ? -EPROTONOSUPPORT : -EBADMSG, "%s", why);
			log_info("session %u (pid %d): dropped: %s", s->id, (int)s->pid, why);
			session_fail(s);
			break;
		}
		/* The hooks own the descriptors from here. */
		end_burst = s->hooks->on_message(s, msg, fds, nfds);
		if (s->closing) {
			session_fail(s);
			break;
		}
		if (end_burst)
			break;
	}
	free(msg);
}
