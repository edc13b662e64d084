/* libzclient's connection to zoffloadd: connect, send and receive, requests, timeouts, jobs. */
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
static int
recv_one(struct zc_conn *c, int *fds, unsigned *nfds, uint64_t deadline)
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
		return zci_lost(c, "zoffloadd closed the connection");
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
	case ZP_TENSOR_DONE: {
		struct zc_tensor *t = zci_tensor_by_handle(c, m->u.tensor_done.handle);

		if (t != NULL && t->pending && t->pending_set == m->hdr.request_id) {
			t->pending = false;
			if (m->u.tensor_done.status == ZP_STEP_APPLIED) {
				t->last_step = m->u.tensor_done.step;
				/* The step wrote the parameters into the slot. */
				t->param_state = PARAM_RESIDENT;
			}
			t->result = (struct zc_step_result){
				.step = m->u.tensor_done.step,
				.status = (enum zc_step_status)m->u.tensor_done.status,
				.error = m->u.tensor_done.error,
				.grad_norm = 0,
			};
		}
		return 0;
	}
	case ZP_STEP_DONE:
		zci_sets_finish(c, &m->u.step_done, m->hdr.request_id);
		return 0;
	case ZP_PARAM_READY: {
		struct zc_tensor *t = zci_tensor_by_handle(c, m->u.param_ready.handle);

		if (t != NULL && t->param_state == PARAM_FETCHING) {
			t->param_state = m->u.param_ready.error == 0 ? PARAM_RESIDENT : PARAM_RELEASED;
			t->param_error = m->u.param_ready.error;
		}
		return 0;
	}
	case ZP_ERROR:
		/*
		 * A daemon shutting down refuses new work: with reconnects on, its
		 * successor gets it (the steps stay pending, the request is sent again).
		 */
		if (m->u.error.code == -ESHUTDOWN && c->reconnect_ms != 0)
			return zci_lost(c, "zoffloadd is shutting down");
		/* A refused step: its STEP_DONE follows; keep the reason. */
		if (zci_sets_pending(c, m->hdr.request_id)) {
			zci_seterr(c, m->u.error.code, "%s", m->u.error.message);
			return 0;
		}
		/*
		 * Request id 0 answers no request: it is about the connection (a
		 * limit refused it, its job was dropped) and the daemon closes it
		 * next.  Skipping it as a stray reply would leave only "closed".
		 */
		if (m->hdr.request_id == 0)
			return zci_closed_by_daemon(c, m->u.error.code < 0 ? m->u.error.code : -EIO,
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
		r = recv_one(c, fds, &nfds, ZCI_NO_WAIT);
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
			return zci_lost(c, text);
		}
	}
	if (r < 0)
		return zci_seterr(c, r, "send %s to zoffloadd: %s", zp_type_name(m->hdr.type),
		    strerror(-r));
	return 0;
}

/* Sends m, reconnecting (and sending it again, its handles rewritten) when the connection goes. */
int
zci_send_msg(struct zc_conn *c, struct zp_msg *m, uint64_t deadline, int sendfd)
{
	int r;

	for (;;) {
		r = zci_ready(c, m, ZCI_NO_DEADLINE);
		if (r < 0)
			return r;
		r = zci_send_once(c, m, deadline, sendfd);
		if (r >= 0 || !c->lost)
			return r;
	}
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
		r = recv_one(c, fds, &nfds, deadline);
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
static int
rpc_once(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, uint16_t alt_type,
    int *fds, int sendfd, uint64_t deadline)
{
	int tmpfds[ZP_MAX_FDS];
	unsigned nfds;
	int r;

	r = zci_send_once(c, req, deadline, sendfd);
	if (r < 0)
		return r;
	for (;;) {
		r = recv_one(c, fds != NULL ? fds : tmpfds, &nfds, deadline);
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

/*
 * rpc_once, again on a new connection when this one goes before the reply:
 * every request is one the reattached daemon may take a second time (see
 * zclient_reconnect.c for those that free something).
 */
static int
rpc_full(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, uint16_t alt_type,
    int *fds, int sendfd)
{
	int r;

	for (;;) {
		r = zci_ready(c, req, ZCI_NO_DEADLINE);
		if (r < 0)
			return r;
		r = rpc_once(c, req, reply_type, alt_type, fds, sendfd,
		    zci_deadline_after(c->timeout_ms));
		if (r >= 0 || !c->lost)
			return r;
	}
}

int
zci_rpc_once(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, int *fds,
    uint64_t deadline)
{
	return rpc_once(c, req, reply_type, reply_type, fds, -1, deadline);
}

/* Request and reply of type reply_type or alt_type; the reply is in c->msg, its descriptors in fds. */
static int
rpc_either(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, uint16_t alt_type,
    int *fds)
{
	return rpc_full(c, req, reply_type, alt_type, fds, -1);
}

/* Request and reply; the reply is in c->msg, its descriptors in fds. */
int
zci_rpc(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, int *fds)
{
	return rpc_full(c, req, reply_type, reply_type, fds, -1);
}

int
zci_rpc_fd(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, int sendfd,
    const struct zp_msg **reply)
{
	int r = rpc_full(c, req, reply_type, reply_type, NULL, sendfd);

	if (r == 0)
		*reply = c->msg;
	return r;
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

int
zc_connect(const char *socket_path, struct zc_conn **ret)
{
	return zc_connect_timeout(socket_path, -1, ret);
}

/* Non-blocking connect: a listener with a full backlog says EAGAIN; try again until the deadline. */
static int
connect_deadline(int fd, const struct sockaddr_un *sa, uint64_t deadline)
{
	useconds_t pause_us = 1000;

	for (;;) {
		if (connect(fd, (const struct sockaddr *)sa, sizeof(*sa)) == 0)
			return 0;
		if (errno != EAGAIN && errno != EINTR)
			return -errno;
		if (deadline != ZCI_NO_DEADLINE && zci_now_ns() >= deadline)
			return -ETIMEDOUT;
		usleep(pause_us);
		pause_us = pause_us < 50000 ? pause_us * 2 : pause_us;
	}
}

int
zc_connect_timeout(const char *socket_path, int timeout_ms, struct zc_conn **ret)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct zp_msg hello = { .hdr = { .type = ZP_HELLO } };
	struct zc_conn *c;
	const char *path = socket_path;
	int reconnect_ms, r;

	if (path == NULL)
		path = getenv("ZOFFLOAD_SOCKET");
	if (path == NULL || path[0] == '\0')
		path = ZOFFLOAD_DEFAULT_SOCKET;
	r = zci_reconnect_default(&reconnect_ms);
	if (r < 0)
		return r;
	if (strlen(path) >= sizeof(sa.sun_path))
		return zcl_connect_fail(-ENAMETOOLONG, "socket path of %zu bytes, at most %zu: %s",
		    strlen(path), sizeof(sa.sun_path) - 1, path);
	if (timeout_ms == 0)
		return zcl_connect_fail(-EINVAL, "timeout 0 ms: -1 waits without bound, a "
		    "positive timeout is in milliseconds");
	c = calloc(1, sizeof(*c));
	if (c == NULL)
		return zcl_connect_fail(-ENOMEM, "no memory for a connection");
	c->timeout_ms = timeout_ms < 0 ? -1 : timeout_ms;
	c->pagemap_fd = -1;
	c->uffd = -1;
	/* No reconnect during HELLO: a connect that fails says so. */
	c->reconnect_ms = 0;
	memcpy(c->path, path, strlen(path) + 1);
	c->buf = malloc(ZP_MAX_MESSAGE);
	c->msg = malloc(sizeof(*c->msg));
	if (c->buf == NULL || c->msg == NULL) {
		r = zcl_connect_fail(-ENOMEM, "no memory for a connection");
		goto fail;
	}
	c->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (c->fd < 0) {
		r = zcl_connect_fail(-errno, "socket(AF_UNIX, SOCK_SEQPACKET): %s", strerror(errno));
		goto fail;
	}
	memcpy(sa.sun_path, path, strlen(path));
	r = connect_deadline(c->fd, &sa, zci_deadline_after(c->timeout_ms));
	if (r < 0) {
		close(c->fd);
		zcl_connect_refused(r, path);
		goto fail;
	}
	snprintf(hello.u.hello.client_name, sizeof(hello.u.hello.client_name), "pid %d",
	    (int)getpid());
	r = zci_rpc(c, &hello, ZP_HELLO_OK, NULL);
	if (r < 0) {
		/* The connection and its message go; the daemon's reason (a limit) stays. */
		zcl_connect_fail(r, "zoffloadd at %s: %s", path,
		    c->err[0] != '\0' ? c->err : strerror(-r));
		close(c->fd);
		goto fail;
	}
	c->session_id = c->msg->u.hello_ok.session_id;
	c->reconnect_ms = reconnect_ms;
	zcl_connect_ok();
	*ret = c;
	return 0;
fail:
	free(c->buf);
	free(c->msg);
	free(c);
	return r;
}

void
zc_disconnect(struct zc_conn *c)
{
	if (c == NULL)
		return;
	close(c->fd);
	for (uint32_t i = 0; i < c->tensor_cap; i++)
		if (c->tensors[i] != NULL)
			zci_tensor_unmap(c->tensors[i]);
	zci_view_close(c);
	zci_sets_free(c);
	if (c->xfer != NULL)
		munmap(c->xfer, c->xfer_bytes);
	free(c->tensors);
	free(c->buf);
	free(c->msg);
	free(c);
}

static int
job_open(struct zc_conn *c, const char *job_name, uint32_t rank, uint32_t world_size,
    enum zc_policy policy, uint64_t pinned_budget, const char *state_format)
{
	struct zp_msg m = { .hdr = { .type = ZP_JOB_OPEN } };
	int r;

	if ((unsigned)policy > ZC_POLICY_AUTO)
		return zci_seterr(c, -EINVAL, "unknown policy %d", (int)policy);
	m.u.job_open.policy = (uint8_t)policy;
	m.u.job_open.pinned_budget = pinned_budget;
	if (state_format != NULL && strlen(state_format) > ZP_FORMAT_MAX)
		return zci_seterr(c, -EINVAL, "unknown state format '%.*s...'", ZP_FORMAT_MAX,
		    state_format);
	if (state_format != NULL)
		snprintf(m.u.job_open.state_format, sizeof(m.u.job_open.state_format), "%s",
		    state_format);
	if (job_name == NULL || strlen(job_name) == 0 || strlen(job_name) > ZP_NAME_MAX)
		return zci_seterr(c, -EINVAL, "job name must be 1 to %d bytes", ZP_NAME_MAX);
	snprintf(m.u.job_open.job_name, sizeof(m.u.job_open.job_name), "%s", job_name);
	m.u.job_open.rank = rank;
	m.u.job_open.world_size = world_size;
	if (world_size == 0 || rank >= world_size)
		return zci_seterr(c, -EINVAL, "rank %u is not below world size %u", rank, world_size);
	r = zci_rpc(c, &m, ZP_JOB_OK, NULL);
	if (r == 0) {
		c->job_open = true;
		snprintf(c->job_name, sizeof(c->job_name), "%s", job_name);
		/* What a reconnect asks for again; the format is the one the daemon chose. */
		c->job_opts = (struct zc_job_options){ .policy = policy,
		    .pinned_budget = pinned_budget };
		c->rank = rank;
		c->world_size = world_size;
		c->job_last_step = c->msg->u.job_ok.last_step;
		snprintf(c->state_format, sizeof(c->state_format), "%s",
		    c->msg->u.job_ok.state_format);
	}
	return r;
}

int
zc_job_open(struct zc_conn *c, const char *job_name, uint32_t rank, uint32_t world_size)
{
	return job_open(c, job_name, rank, world_size, ZC_POLICY_DEFAULT, 0, NULL);
}

/*
 * zc_job_open_opts grew state_format in ZCLIENT_0.2.  Programs linked
 * against 0.1 pass the struct without it and get zc_job_open_opts@ZCLIENT_0.1,
 * which reads the two fields they have; new ones bind the default version.
 * The definitions have internal names (local in zclient.map) and are exported
 * only through these aliases.
 */
struct zc_job_options_v01 {
	enum zc_policy policy;
	uint64_t pinned_budget;
};

ZC_API int zci_job_open_opts_v01(struct zc_conn *c, const char *job_name, uint32_t rank,
    uint32_t world_size, const struct zc_job_options_v01 *opts);
ZC_API int zci_job_open_opts_v02(struct zc_conn *c, const char *job_name, uint32_t rank,
    uint32_t world_size, const struct zc_job_options *opts);
__asm__(".symver zci_job_open_opts_v01, zc_job_open_opts@ZCLIENT_0.1");
__asm__(".symver zci_job_open_opts_v02, zc_job_open_opts@@ZCLIENT_0.2");

int
zci_job_open_opts_v01(struct zc_conn *c, const char *job_name, uint32_t rank,
    uint32_t world_size, const struct zc_job_options_v01 *opts)
{
	return job_open(c, job_name, rank, world_size, opts != NULL ? opts->policy :
	    ZC_POLICY_DEFAULT, opts != NULL ? opts->pinned_budget : 0, NULL);
}

int
zci_job_open_opts_v02(struct zc_conn *c, const char *job_name, uint32_t rank,
    uint32_t world_size, const struct zc_job_options *opts)
{
	if (opts == NULL)
		return job_open(c, job_name, rank, world_size, ZC_POLICY_DEFAULT, 0, NULL);
	return job_open(c, job_name, rank, world_size, opts->policy, opts->pinned_budget,
	    opts->state_format);
}

const char *
zc_job_state_format(const struct zc_conn *c)
{
	return c->job_open ? c->state_format : "";
}

uint64_t
zc_job_last_step(const struct zc_conn *c)
{
	return c->job_last_step;
}

int
zc_job_drop(struct zc_conn *c, const char *job_name)
{
	struct zp_msg m = { .hdr = { .type = ZP_JOB_DROP } };

	if (job_name == NULL || strlen(job_name) == 0 || strlen(job_name) > ZP_NAME_MAX)
		return zci_seterr(c, -EINVAL, "job name must be 1 to %d bytes", ZP_NAME_MAX);
	snprintf(m.u.job_drop.job_name, sizeof(m.u.job_drop.job_name), "%s", job_name);
	return zci_rpc(c, &m, ZP_OK, NULL);
}

int
zc_job_close(struct zc_conn *c)
{
	struct zp_msg m = { .hdr = { .type = ZP_JOB_CLOSE } };
	int r;

	r = zci_rpc(c, &m, ZP_OK, NULL);
	if (r < 0)
		return r;
	c->job_open = false;
	/* The daemon freed this rank's tensors. */
	for (uint32_t i = 0; i < c->tensor_cap; i++) {
		if (c->tensors[i] != NULL) {
			zci_tensor_unmap(c->tensors[i]);
			c->tensors[i] = NULL;
		}
	}
	return 0;
}

int
zci_wait_until(struct zc_conn *c, bool (*done)(void *), void *arg, uint64_t deadline)
{
	int fds[ZP_MAX_FDS];
	unsigned nfds;
	int r;

	if (c->dead != 0)
		return zci_seterr(c, c->dead, "%s", c->dead_msg);
	while (!done(arg)) {
		/* A reconnect resubmits what this waits for; done() may then be true. */
		r = zci_ready(c, NULL, deadline);
		if (r < 0)
			return r;
		if (done(arg))
			break;
		r = recv_one(c, fds, &nfds, deadline);
		if (r < 0 && c->lost)
			continue;
		if (r < 0)
			return r;
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
	}
	return 0;
}

int
zc_ping(struct zc_conn *c, uint64_t *ret_rtt_ns)
{
	struct zp_msg m = { .hdr = { .type = ZP_PING } };
	uint64_t t0 = zci_now_ns();
	int r;

	r = zci_rpc(c, &m, ZP_PONG, NULL);
	if (r == 0 && ret_rtt_ns != NULL)
		*ret_rtt_ns = zci_now_ns() - t0;
	return r;
}

/* A reply too large for a datagram comes as a memfd holding the text. */
static int
json_from_fd(struct zc_conn *c, int fd, uint64_t bytes, char **ret)
{
	struct stat st;
	char *text;
	void *map;

	if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < bytes) {
		close(fd);
		return zci_seterr(c, -EBADMSG, "zoffloadd's reply of %llu bytes came in a smaller file",
		    (unsigned long long)bytes);
	}
	map = mmap(NULL, (size_t)bytes, PROT_READ, MAP_SHARED, fd, 0);
	close(fd);
	if (map == MAP_FAILED)
		return zci_seterr(c, -errno, "cannot map zoffloadd's reply: %s", strerror(errno));
	text = malloc((size_t)bytes + 1);
	if (text != NULL) {
		memcpy(text, map, (size_t)bytes);
		text[bytes] = '\0';
	}
	munmap(map, (size_t)bytes);
	if (text == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	*ret = text;
	return 0;
}

static int
json_request(struct zc_conn *c, uint16_t type, char **ret)
{
	struct zp_msg m = { .hdr = { .type = type } };
	int fds[ZP_MAX_FDS];
	char *text;
	int r;

	r = rpc_either(c, &m, ZP_JSON, ZP_JSON_FD, fds);
	if (r < 0)
		return r;
	if (c->msg->hdr.type == ZP_JSON_FD)
		return json_from_fd(c, fds[0], c->msg->u.json_fd.bytes, ret);
	text = malloc(c->msg->u.json.len + 1);
	if (text == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	memcpy(text, c->msg->u.json.text, c->msg->u.json.len);
	text[c->msg->u.json.len] = '\0';
	*ret = text;
	return 0;
}

int
zc_stats_json(struct zc_conn *c, char **ret)
{
	return json_request(c, ZP_STATS, ret);
}

int
zc_jobs_json(struct zc_conn *c, char **ret)
{
	return json_request(c, ZP_JOBS, ret);
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
