/* libzclient's transport: send and receive once, deadlines, errors; replies go up through c->hooks. */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "build_config.h"
#include "convert.h"
#include "msgio.h"
#include "zclient.h"
#include "zclient_connerr.h"
#include "zclient_impl.h"

const char *
zc_errmsg(const struct zc_conn *conn)
{
	/* A failed zc_connect left the caller's NULL: the reason is this thread's. */
	if (conn == NULL)
		return strcmp(zc_connect_errmsg(), "no error") != 0 ? zc_connect_errmsg() :
		    "no connection";
	return conn->err[0] != '\0' ? conn->err : "no error";
}

int
zc_conn_fd(const struct zc_conn *conn)
{
	return conn->fd;
}

int
zc_set_timeout(struct zc_conn *c, int timeout_ms)
{
	if (timeout_ms == 0)
		return zci_seterr(c, -EINVAL, "a timeout of 0 ms would let no request through; "
		    "use -1 for none");
	c->timeout_ms = timeout_ms < 0 ? -1 : timeout_ms;
	return 0;
}

uint64_t
zci_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* timeout_ms < 0: none, 0: no waiting. */
uint64_t
zci_deadline_after(int timeout_ms)
{
	if (timeout_ms < 0)
		return ZCI_NO_DEADLINE;
	if (timeout_ms == 0)
		return ZCI_NO_WAIT;
	return zci_now_ns() + (uint64_t)timeout_ms * 1000000u;
}

/* Waits until fd has `events` (or an error to report) or the deadline passes. */
static int
await_fd(int fd, short events, uint64_t deadline)
{
	for (;;) {
		struct pollfd p = { .fd = fd, .events = events };
		int ms = -1, n;

		if (deadline != ZCI_NO_DEADLINE) {
			uint64_t now = zci_now_ns(), left;

			if (now >= deadline)
				return -ETIMEDOUT;
			left = (deadline - now + 999999u) / 1000000u;
			ms = left > INT_MAX ? INT_MAX : (int)left;
		}
		n = poll(&p, 1, ms);
		/* POLLHUP and POLLERR too: the recv or send that follows says what happened. */
		if (n > 0)
			return 0;
		if (n < 0 && errno != EINTR)
			return -errno;
	}
}

/*
 * Reads one message, waiting for it until the deadline (-ETIMEDOUT after,
 * with no message set: the caller knows what was awaited).  Events are
 * applied here and 0 returned; a reply is left in c->msg and 1 returned.
 * fds receives a reply's descriptors.
 */
int
zci_recv_one(struct zc_conn *c, int *fds, unsigned *nfds, uint64_t deadline)
{
	struct zp_msg *m = c->msg;
	char why[256];
	ssize_t n;
	int r;

	*nfds = 0;
	for (;;) {
		n = zp_recv_raw(c->fd, c->buf, ZP_MAX_MESSAGE, fds, ZP_MAX_FDS, nfds,
		    MSG_DONTWAIT);
		/*
		 * A daemon that closes with our request unread makes the kernel
		 * report ECONNRESET once, ahead of what it sent last (the ERROR
		 * saying why).
		 */
		if (n == -ECONNRESET)
			n = zp_recv_raw(c->fd, c->buf, ZP_MAX_MESSAGE, fds, ZP_MAX_FDS, nfds,
			    MSG_DONTWAIT);
		if (n != -EAGAIN)
			break;
		r = await_fd(c->fd, POLLIN, deadline);
		if (r == -ETIMEDOUT)
			return r;
		if (r < 0)
			return zci_seterr(c, r, "wait for zoffloadd: %s", strerror(-r));
	}
	if (n == 0 || n == -ECONNRESET)
		return c->hooks->lost(c, "zoffloadd closed the connection");
	if (n < 0)
		return zci_seterr(c, (int)n, "receive from zoffloadd: %s", strerror((int)-n));
	if (zp_decode(c->buf, (size_t)n, m, why, sizeof(why)) != ZP_S_OK) {
		for (unsigned i = 0; i < *nfds; i++)
			close(fds[i]);
		return zci_seterr(c, -EBADMSG, "bad message from zoffloadd: %s", why);
	}
	if (*nfds != zp_type_fds(m->hdr.type)) {
		for (unsigned i = 0; i < *nfds; i++)
			close(fds[i]);
		return zci_seterr(c, -EBADMSG, "%s from zoffloadd carries %u descriptors",
		    zp_type_name(m->hdr.type), *nfds);
	}
	switch (m->hdr.type) {
	case ZP_TENSOR_DONE:
		c->hooks->tensor_done(c, m);
		return 0;
	case ZP_STEP_DONE:
		c->hooks->step_done(c, m);
		return 0;
	case ZP_PARAM_READY:
		c->hooks->param_ready(c, m);
		return 0;
	case ZP_ERROR:
		/*
		 * A daemon shutting down refuses new work: with reconnects on, its
		 * successor gets it (the steps stay pending, the request is sent again).
		 */
		if (m->u.error.code == -ESHUTDOWN && c->reconnect_ms != 0)
			return c->hooks->lost(c, "zoffloadd is shutting down");
		/* A refused step: its STEP_DONE follows; keep the reason. */
		if (c->hooks->set_pending(c, m->hdr.request_id)) {
			zci_seterr(c, m->u.error.code, "%s", m->u.error.message);
			return 0;
		}
		/*
		 * Request id 0 answers no request: it is about the connection (a
		 * limit refused it, its job was dropped) and the daemon closes it
		 * next.  Skipping it as a stray reply would leave only "closed".
		 */
		if (m->hdr.request_id == 0)
			return c->hooks->closed_by_daemon(c, m->u.error.code < 0 ? m->u.error.code : -EIO,
			    m->u.error.message);
		return 1;
	default:
		return 1;
	}
}

/* Applies whatever events have already arrived, without blocking. */
int
zci_drain(struct zc_conn *c)
{
	int fds[ZP_MAX_FDS];
	unsigned nfds;
	int r;

	for (;;) {
		r = zci_recv_one(c, fds, &nfds, ZCI_NO_WAIT);
		if (r == -ETIMEDOUT)
			return 0;
		if (r <= 0)
			return r;
		/* A reply nobody waits for cannot happen: requests are synchronous. */
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
	}
}

static bool
reads_only(uint16_t type)
{
	return type == ZP_PING || type == ZP_STATS || type == ZP_JOBS;
}

/* Sends m with a new request id; drain: apply (and drop) what arrived first. */
static int
send_once(struct zc_conn *c, struct zp_msg *m, uint64_t deadline, int sendfd, bool drain)
{
	int r;

	if (c->broken_by != 0)
		return zci_seterr(c, -ENOTCONN, "connection unusable: an earlier %s got no answer in "
		    "time and zoffloadd may still carry it out; disconnect and connect again",
		    zp_type_name(c->broken_by));
	m->hdr.request_id = ++c->next_id;
	r = drain ? zci_drain(c) : 0;
	if (r < 0)
		return r;
	/* A datagram goes whole or not at all: a send that times out leaves nothing half-sent. */
	while ((r = zp_send(c->fd, m, &sendfd, sendfd >= 0 ? 1 : 0)) == -EAGAIN) {
		r = await_fd(c->fd, POLLOUT, deadline);
		if (r == -ETIMEDOUT)
			return zci_seterr(c, r, "send %s to zoffloadd: timed out with no room to send "
			    "(is it stopped or overloaded?)", zp_type_name(m->hdr.type));
		if (r < 0)
			break;
	}
	if (r == -EPIPE || r == -ECONNRESET) {
		/* The daemon may have said why just before it closed: that beats "broken pipe". */
		int why = zci_drain(c);

		if (why < 0)
			return why;
		/* Gone, but with nothing to read yet (the reading side was cut). */
		if (c->reconnect_ms != 0) {
			char text[128];

			snprintf(text, sizeof(text), "send %s to zoffloadd: %s",
			    zp_type_name(m->hdr.type), strerror(-r));
			return c->hooks->lost(c, text);
		}
	}
	if (r < 0)
		return zci_seterr(c, r, "send %s to zoffloadd: %s", zp_type_name(m->hdr.type),
		    strerror(-r));
	return 0;
}

int
zci_send_once(struct zc_conn *c, struct zp_msg *m, uint64_t deadline, int sendfd)
{
	return send_once(c, m, deadline, sendfd, true);
}

/*
 * Requests of several chains in flight (zclient_chains.c, which reconnects before
 * the first) go once: the others' answers went with the old connection, so a loss
 * fails the whole batch, which then takes back what it registered.
 */
int
zci_send_async(struct zc_conn *c, struct zp_msg *m, uint64_t deadline, int sendfd)
{
	if (c->lost)
		return zci_seterr(c, -ECONNRESET, "the connection to zoffloadd went during the "
		    "transfer; it is being made again");
	return send_once(c, m, deadline, sendfd, false);
}

int
zci_recv_reply(struct zc_conn *c, uint16_t awaited, uint64_t deadline)
{
	int fds[ZP_MAX_FDS];
	unsigned nfds;
	int r;

	do {
		r = zci_recv_one(c, fds, &nfds, deadline);
		for (unsigned i = 0; r > 0 && i < nfds; i++)
			close(fds[i]);
	} while (r == 0);
	if (r == -ETIMEDOUT) {
		c->broken_by = awaited;
		return zci_seterr(c, r, "zoffloadd did not answer %s within %d ms; the connection "
		    "is no longer usable", zp_type_name(awaited), c->timeout_ms);
	}
	return r < 0 ? r : 0;
}

/*
 * Request (with sendfd unless -1) and reply of type reply_type or alt_type; the reply is in
 * c->msg, its descriptors in fds.
 */
int
zci_exchange(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, uint16_t alt_type,
    int *fds, int sendfd, uint64_t deadline)
{
	int tmpfds[ZP_MAX_FDS];
	unsigned nfds;
	int r;

	r = zci_send_once(c, req, deadline, sendfd);
	if (r < 0)
		return r;
	for (;;) {
		r = zci_recv_one(c, fds != NULL ? fds : tmpfds, &nfds, deadline);
		/*
		 * A late reply is skipped by request id, so a request that only
		 * reads leaves the connection as it was; any other may yet be
		 * carried out, after which the client no longer knows its state.
		 */
		if (r == -ETIMEDOUT) {
			if (!reads_only(req->hdr.type))
				c->broken_by = req->hdr.type;
			return zci_seterr(c, r, "zoffloadd did not answer %s within %d ms%s",
			    zp_type_name(req->hdr.type), c->timeout_ms, reads_only(req->hdr.type) ?
			    "" : "; the connection is no longer usable");
		}
		if (r < 0)
			return r;
		if (r == 0)
			continue;
		if (c->msg->hdr.request_id != req->hdr.request_id) {
			for (unsigned i = 0; i < nfds; i++)
				close((fds != NULL ? fds : tmpfds)[i]);
			continue;
		}
		if (c->msg->hdr.type == ZP_ERROR)
			return zci_seterr(c, c->msg->u.error.code < 0 ? c->msg->u.error.code : -EIO,
			    "%s", c->msg->u.error.message);
		if (c->msg->hdr.type != reply_type && c->msg->hdr.type != alt_type) {
			for (unsigned i = 0; i < nfds; i++)
				close((fds != NULL ? fds : tmpfds)[i]);
			return zci_seterr(c, -EBADMSG, "zoffloadd answered %s with %s",
			    zp_type_name(req->hdr.type), zp_type_name(c->msg->hdr.type));
		}
		if (fds == NULL)
			for (unsigned i = 0; i < nfds; i++)
				close(tmpfds[i]);
		return 0;
	}
}

int
zci_rpc_once(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, int *fds,
    uint64_t deadline)
{
	return zci_exchange(c, req, reply_type, reply_type, fds, -1, deadline);
}

int
zci_seterr(struct zc_conn *c, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(c->err, sizeof(c->err), fmt, ap);
	va_end(ap);
	return code;
}

uint16_t
zc_f32_to_bf16(float f)
{
	return zk__f32_to_bf16(f);
}

float
zc_bf16_to_f32(uint16_t h)
{
	return zk__bf16_to_f32(h);
}

uint16_t
zc_f32_to_f16(float f)
{
	return zk__f32_to_f16(f);
}

float
zc_f16_to_f32(uint16_t h)
{
	return zk__f16_to_f32(h);
}
