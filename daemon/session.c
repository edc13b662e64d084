/* One connected client: its socket, output queue and lifetime. */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "checkpoint.h"
#include "daemon.h"
#include "job.h"
#include "log.h"
#include "msgio.h"
#include "requests.h"
#include "session.h"

struct zd_out {
	TAILQ_ENTRY(zd_out) entry;
	size_t len;
	int fds[ZP_MAX_FDS];
	unsigned nfds;
	uint8_t data[];
};

/* Messages handled per wakeup, so that one busy client cannot starve the others. */
#define READ_BURST 32

static void session_read_cb(evutil_socket_t fd, short what, void *arg);
static void session_write_cb(evutil_socket_t fd, short what, void *arg);

void
zd_session_accept(struct zd_daemon *d, int fd)
{
	struct zd_session *s;
	struct ucred cred;
	socklen_t len = sizeof(cred);

	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
		log_warn(errno, "SO_PEERCRED");
		close(fd);
		return;
	}
	if (d->cfg.max_clients_per_uid > 0) {
		struct zd_uid *u = zd_uid_get(d, cred.uid);

		if (u != NULL && u->sessions >= d->cfg.max_clients_per_uid) {
			struct zp_msg m = { .hdr = { .type = ZP_ERROR } };

			m.u.error.code = -EUSERS;
			snprintf(m.u.error.message, sizeof(m.u.error.message),
			    "uid %u already has %u connections (limits.max_clients_per_uid)",
			    (unsigned)cred.uid, u->sessions);
			(void)zp_send(fd, &m, NULL, 0);
			log_warnx("refused a client of uid %u: %u connections", (unsigned)cred.uid,
			    u->sessions);
			close(fd);
			return;
		}
	}
	s = calloc(1, sizeof(*s));
	if (s == NULL) {
		log_warnx("out of memory accepting a client");
		close(fd);
		return;
	}
	s->daemon = d;
	s->id = ++d->next_session_id;
	s->fd = fd;
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
		close(fd);
		return;
	}
	s->uid_usage = zd_uid_get(d, s->uid);
	if (s->uid_usage != NULL)
		s->uid_usage->sessions++;
	TAILQ_INSERT_TAIL(&d->sessions, s, entry);
	d->nsessions++;
	log_debug("session %u: connected, pid %d uid %u", s->id, (int)s->pid, (unsigned)s->uid);
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
	/* A connection that goes without JOB_CLOSE is a rank that died: keep its state a while. */
	zd_job_detach(s, true);
	if (s->uid_usage != NULL) {
		s->uid_usage->sessions--;
		zd_uid_put(d, s->uid_usage);
	}
	ze_shm_destroy(d->engine, &s->xfer);
	while ((o = TAILQ_FIRST(&s->outq)) != NULL) {
		TAILQ_REMOVE(&s->outq, o, entry);
		for (unsigned i = 0; i < o->nfds; i++)
			close(o->fds[i]);
		free(o);
	}
	event_free(s->ev_read);
	event_free(s->ev_write);
	close(s->fd);
	TAILQ_REMOVE(&d->sessions, s, entry);
	d->nsessions--;
	free(s->tensors);
	free(s);
}

static int
queue_out(struct zd_session *s, const void *buf, size_t len, const int *fds, unsigned nfds)
{
	struct zd_out *o;

	if (s->outq_len >= s->daemon->cfg.max_queued_messages)
		return -ENOBUFS;
	o = malloc(sizeof(*o) + len);
	if (o == NULL)
		return -ENOMEM;
	o->len = len;
	o->nfds = 0;
	memcpy(o->data, buf, len);
	for (unsigned i = 0; i < nfds; i++) {
		o->fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 0);
		if (o->fds[i] < 0) {
			for (unsigned j = 0; j < i; j++)
				close(o->fds[j]);
			free(o);
			return -EMFILE;
		}
		o->nfds++;
	}
	TAILQ_INSERT_TAIL(&s->outq, o, entry);
	s->outq_len++;
	event_add(s->ev_write, NULL);
	return 0;
}

int
zd_session_send(struct zd_session *s, const struct zp_msg *msg, const int *fds, unsigned nfds)
{
	uint8_t buf[ZP_MAX_MESSAGE];
	size_t len;
	int r;

	if (zp_encode(msg, buf, sizeof(buf), &len) != ZP_S_OK) {
		log_warnx("session %u: cannot encode %s", s->id, zp_type_name(msg->hdr.type));
		return -EPROTO;
	}
	/* Keep order: nothing goes around messages already queued. */
	if (TAILQ_EMPTY(&s->outq)) {
		r = zp_send_raw(s->fd, buf, len, fds, nfds);
		if (r != -EAGAIN)
			return r;
	}
	r = queue_out(s, buf, len, fds, nfds);
	if (r == -ENOBUFS && !s->closing) {
		log_warnx("session %u (pid %d): not reading its replies; %u queued, disconnecting",
		    s->id, (int)s->pid, s->outq_len);
		/* The loop must not free the session under its caller: close on the next pass. */
		s->closing = true;
		event_del(s->ev_read);
		event_active(s->ev_write, EV_WRITE, 0);
	}
	return r;
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
	struct zd_out *o;
	int r;

	while ((o = TAILQ_FIRST(&s->outq)) != NULL) {
		r = zp_send_raw(s->fd, o->data, o->len, o->fds, o->nfds);
		if (r == -EAGAIN) {
			if (!s->closing || s->outq_len < s->daemon->cfg.max_queued_messages) {
				event_add(s->ev_write, NULL);
				return;
			}
			break;	/* not reading and over the bound: give up on it */
		}
		TAILQ_REMOVE(&s->outq, o, entry);
		s->outq_len--;
		for (unsigned i = 0; i < o->nfds; i++)
			close(o->fds[i]);
		free(o);
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

static void
session_read_cb(evutil_socket_t fd, short what, void *arg)
{
	struct zd_session *s = arg;
	uint8_t buf[ZP_MAX_MESSAGE];
	struct zp_msg *msg;
	char why[256];
	int fds[ZP_MAX_FDS];
	unsigned nfds;
	ssize_t n;

	msg = malloc(sizeof(*msg));
	if (msg == NULL)
		return;
	for (int i = 0; i < READ_BURST && !s->closing; i++) {
		n = zp_recv_raw(s->fd, buf, sizeof(buf), fds, ZP_MAX_FDS, &nfds, MSG_DONTWAIT);
		if (n == -EAGAIN)
			break;
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

		if (st == ZP_S_OK && !zp_type_is_request(msg->hdr.type)) {
			st = ZP_S_TYPE;
			snprintf(why, sizeof(why), "%s is not a request", zp_type_name(msg->hdr.type));
		}
		/* Descriptors come only with the requests that carry one (CKPT_WRITE), exactly. */
		if (st == ZP_S_OK && nfds != zp_type_fds(msg->hdr.type)) {
			for (unsigned j = 0; j < nfds; j++)
				close(fds[j]);
			zd_session_error(s, msg->hdr.request_id, -EBADMSG, "%s carries %u file "
			    "descriptors, not %u", zp_type_name(msg->hdr.type), nfds,
			    zp_type_fds(msg->hdr.type));
			log_info("session %u (pid %d): dropped: %s with %u descriptors", s->id,
			    (int)s->pid, zp_type_name(msg->hdr.type), nfds);
			session_fail(s);
			break;
		}
		if (st != ZP_S_OK) {
			for (unsigned j = 0; j < nfds; j++)
				close(fds[j]);
			zd_session_error(s, st == ZP_S_SHORT ? 0 : msg->hdr.request_id,
			    st == ZP_S_VERSION ? -EPROTONOSUPPORT : -EBADMSG, "%s", why);
			log_info("session %u (pid %d): dropped: %s", s->id, (int)s->pid, why);
			session_fail(s);
			break;
		}
		if (nfds > 0) {
			/* The handler owns the descriptor from here. */
			zd_handle_request_fd(s, msg, fds[0]);
			if (s->closing) {
				session_fail(s);
				break;
			}
			continue;
		}
		zd_handle_request(s, msg);
		if (s->closing) {
			session_fail(s);
			break;
		}
	}
	free(msg);
}
