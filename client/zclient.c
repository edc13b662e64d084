/* libzclient: a training process's connection to zoffloadd. */
#include <errno.h>
#include <limits.h>
#include <math.h>
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

struct pending_set {
	struct pending_set *next;
	uint64_t request_id;
	uint64_t step;
	uint32_t count;
	uint32_t *handles;
};

struct zc_tensor {
	struct zc_conn *conn;
	uint32_t handle;
	char name[ZP_NAME_MAX + 1];
	uint64_t numel;
	void *grad;
	size_t grad_bytes;
	void *param;
	size_t param_bytes;
	bool pending;
	uint64_t pending_set;		/* request id of the set it waits on, while pending */
	uint64_t last_step;
	struct zc_step_result result;
	bool param_offload;
	enum { PARAM_RESIDENT, PARAM_RELEASED, PARAM_FETCHING } param_state;
	int param_error;
	bool param_waited;		/* counted in `waited` by a wait that has not ended */
	zc_release_fn *release;		/* see zc_tensor_set_release_hook */
	void *release_arg;
	/*
	 * Non-NULL while a driver has the param slot pinned (see
	 * zc_tensor_set_param_pin).  Invariant: no PARAM_RELEASE names this
	 * tensor while it is set, since the daemon's hole punch would leave
	 * the driver with stale pages.
	 */
	zc_unpin_fn *unpin;
	void *unpin_arg;
};

/*
 * The socket is non-blocking: every wait is a poll() bounded by a deadline,
 * so that each blocking call can have a timeout (zc_set_timeout, the
 * *_timeout waits) and the descriptor can be polled by the caller.
 */
struct zc_conn {
	int fd;
	int timeout_ms;			/* per request and reply; < 0: none */
	/*
	 * Non-zero: a request of this type got no answer in time and may still
	 * be carried out; what the daemon holds for this connection is unknown,
	 * so no more requests go out.  Waits for steps and params still work.
	 */
	uint16_t broken_by;
	uint64_t next_id;
	char err[ZP_ERRMSG_MAX + 128];
	uint8_t *buf;
	struct zp_msg *msg;
	bool job_open;
	uint32_t rank;
	uint32_t world_size;
	uint64_t job_last_step;
	uint32_t session_id;
	struct zc_tensor **tensors;	/* by handle - 1 */
	uint32_t tensor_cap;
	void *xfer;
	size_t xfer_bytes;
	struct pending_set *sets;
	struct zc_step_result last;
	struct zc_param_stats param_stats;
};

static int
seterr(struct zc_conn *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static int
seterr(struct zc_conn *c, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(c->err, sizeof(c->err), fmt, ap);
	va_end(ap);
	return code;
}

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
		return seterr(c, -EINVAL, "a timeout of 0 ms would let no request through; "
		    "use -1 for none");
	c->timeout_ms = timeout_ms < 0 ? -1 : timeout_ms;
	return 0;
}

static uint64_t
now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Deadlines are CLOCK_MONOTONIC nanoseconds; these two are special. */
#define NO_WAIT		0		/* take what has arrived, never block */
#define NO_DEADLINE	UINT64_MAX

/* timeout_ms < 0: none, 0: no waiting. */
static uint64_t
deadline_after(int timeout_ms)
{
	if (timeout_ms < 0)
		return NO_DEADLINE;
	if (timeout_ms == 0)
		return NO_WAIT;
	return now_ns() + (uint64_t)timeout_ms * 1000000u;
}

/* Waits until fd has `events` (or an error to report) or the deadline passes. */
static int
await_fd(int fd, short events, uint64_t deadline)
{
	for (;;) {
		struct pollfd p = { .fd = fd, .events = events };
		int ms = -1, n;

		if (deadline != NO_DEADLINE) {
			uint64_t now = now_ns(), left;

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
 * Bytes per element.  Local, with the header-only converters below, so that
 * libzclient links no part of the kernel library (tests/client checks it).
 */
static size_t
dtype_size(enum zc_dtype dtype)
{
	return dtype == ZC_F32 ? 4 : 2;
}

static struct zc_tensor *
tensor_by_handle(struct zc_conn *c, uint32_t handle)
{
	if (handle == 0 || handle > c->tensor_cap)
		return NULL;
	return c->tensors[handle - 1];
}

static void
finish_set(struct zc_conn *c, const struct zp_step_done *done, uint64_t request_id)
{
	struct pending_set **pp, *set;

	for (pp = &c->sets; *pp != NULL; pp = &(*pp)->next)
		if ((*pp)->request_id == request_id)
			break;
	set = *pp;
	c->last = (struct zc_step_result){
		.step = done->step,
		.status = (enum zc_step_status)done->status,
		.error = done->error,
		.grad_norm = done->grad_norm,
		.latency_ns = done->latency_ns,
	};
	if (set == NULL)
		return;
	/*
	 * Tensors without their own TENSOR_DONE (a refused or skipped set) end
	 * with the set; one already in a later set waits on that one.
	 */
	for (uint32_t i = 0; i < set->count; i++) {
		struct zc_tensor *t = tensor_by_handle(c, set->handles[i]);

		if (t != NULL && t->pending && t->pending_set == request_id) {
			t->pending = false;
			t->result = c->last;
		}
	}
	*pp = set->next;
	free(set->handles);
	free(set);
}

static bool
is_pending_set(const struct zc_conn *c, uint64_t request_id)
{
	for (const struct pending_set *s = c->sets; s != NULL; s = s->next)
		if (s->request_id == request_id)
			return true;
	return false;
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
			return seterr(c, r, "wait for zoffloadd: %s", strerror(-r));
	}
	if (n == 0 || n == -ECONNRESET)
		return seterr(c, -ECONNRESET, "zoffloadd closed the connection");
	if (n < 0)
		return seterr(c, (int)n, "receive from zoffloadd: %s", strerror((int)-n));
	if (zp_decode(c->buf, (size_t)n, m, why, sizeof(why)) != ZP_S_OK) {
		for (unsigned i = 0; i < *nfds; i++)
			close(fds[i]);
		return seterr(c, -EBADMSG, "bad message from zoffloadd: %s", why);
	}
	if (*nfds != zp_type_fds(m->hdr.type)) {
		for (unsigned i = 0; i < *nfds; i++)
			close(fds[i]);
		return seterr(c, -EBADMSG, "%s from zoffloadd carries %u descriptors",
		    zp_type_name(m->hdr.type), *nfds);
	}
	switch (m->hdr.type) {
	case ZP_TENSOR_DONE: {
		struct zc_tensor *t = tensor_by_handle(c, m->u.tensor_done.handle);

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
		finish_set(c, &m->u.step_done, m->hdr.request_id);
		return 0;
	case ZP_PARAM_READY: {
		struct zc_tensor *t = tensor_by_handle(c, m->u.param_ready.handle);

		if (t != NULL && t->param_state == PARAM_FETCHING) {
			t->param_state = m->u.param_ready.error == 0 ? PARAM_RESIDENT : PARAM_RELEASED;
			t->param_error = m->u.param_ready.error;
		}
		return 0;
	}
	case ZP_ERROR:
		/* A refused step: its STEP_DONE follows; keep the reason. */
		if (is_pending_set(c, m->hdr.request_id)) {
			seterr(c, m->u.error.code, "%s", m->u.error.message);
			return 0;
		}
		/*
		 * Request id 0 answers no request: it is about the connection (a
		 * limit refused it, its job was dropped) and the daemon closes it
		 * next.  Skipping it as a stray reply would leave only "closed".
		 */
		if (m->hdr.request_id == 0)
			return seterr(c, m->u.error.code < 0 ? m->u.error.code : -EIO, "%s",
			    m->u.error.message);
		return 1;
	default:
		return 1;
	}
}

/* Applies whatever events have already arrived, without blocking. */
static int
drain(struct zc_conn *c)
{
	int fds[ZP_MAX_FDS];
	unsigned nfds;
	int r;

	for (;;) {
		r = recv_one(c, fds, &nfds, NO_WAIT);
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

static int
send_msg(struct zc_conn *c, struct zp_msg *m, uint64_t deadline, int sendfd)
{
	int r;

	if (c->broken_by != 0)
		return seterr(c, -ENOTCONN, "connection unusable: an earlier %s got no answer in "
		    "time and zoffloadd may still carry it out; disconnect and connect again",
		    zp_type_name(c->broken_by));
	m->hdr.request_id = ++c->next_id;
	r = drain(c);
	if (r < 0)
		return r;
	/* A datagram goes whole or not at all: a send that times out leaves nothing half-sent. */
	while ((r = zp_send(c->fd, m, &sendfd, sendfd >= 0 ? 1 : 0)) == -EAGAIN) {
		r = await_fd(c->fd, POLLOUT, deadline);
		if (r == -ETIMEDOUT)
			return seterr(c, r, "send %s to zoffloadd: timed out with no room to send "
			    "(is it stopped or overloaded?)", zp_type_name(m->hdr.type));
		if (r < 0)
			break;
	}
	if (r == -EPIPE || r == -ECONNRESET) {
		/* The daemon may have said why just before it closed: that beats "broken pipe". */
		int why = drain(c);

		if (why < 0)
			return why;
	}
	if (r < 0)
		return seterr(c, r, "send %s to zoffloadd: %s", zp_type_name(m->hdr.type),
		    strerror(-r));
	return 0;
}

/*
 * Request (with sendfd unless -1) and reply of type reply_type or alt_type; the reply is in
 * c->msg, its descriptors in fds.
 */
static int
rpc_full(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, uint16_t alt_type,
    int *fds, int sendfd)
{
	uint64_t deadline = deadline_after(c->timeout_ms);
	int tmpfds[ZP_MAX_FDS];
	unsigned nfds;
	int r;

	r = send_msg(c, req, deadline, sendfd);
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
			return seterr(c, r, "zoffloadd did not answer %s within %d ms%s",
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
			return seterr(c, c->msg->u.error.code < 0 ? c->msg->u.error.code : -EIO,
			    "%s", c->msg->u.error.message);
		if (c->msg->hdr.type != reply_type && c->msg->hdr.type != alt_type) {
			for (unsigned i = 0; i < nfds; i++)
				close((fds != NULL ? fds : tmpfds)[i]);
			return seterr(c, -EBADMSG, "zoffloadd answered %s with %s",
			    zp_type_name(req->hdr.type), zp_type_name(c->msg->hdr.type));
		}
		if (fds == NULL)
			for (unsigned i = 0; i < nfds; i++)
				close(tmpfds[i]);
		return 0;
	}
}

/* Request and reply of type reply_type or alt_type; the reply is in c->msg, its descriptors in fds. */
static int
rpc_either(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, uint16_t alt_type,
    int *fds)
{
	return rpc_full(c, req, reply_type, alt_type, fds, -1);
}

/* Request and reply; the reply is in c->msg, its descriptors in fds. */
static int
rpc(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, int *fds)
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

bool
zci_job_rank(const struct zc_conn *c, uint32_t *rank, uint32_t *world_size)
{
	*rank = c->rank;
	*world_size = c->world_size;
	return c->job_open;
}

const char *
zci_tensor_name(const struct zc_tensor *t)
{
	return t->name;
}

uint32_t
zci_tensor_handle(const struct zc_tensor *t)
{
	return t->handle;
}

bool
zci_tensor_pending(const struct zc_tensor *t)
{
	return t->pending;
}

struct zc_conn *
zci_tensor_conn(const struct zc_tensor *t)
{
	return t->conn;
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
		if (deadline != NO_DEADLINE && now_ns() >= deadline)
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
	int r;

	if (path == NULL)
		path = getenv("ZOFFLOAD_SOCKET");
	if (path == NULL || path[0] == '\0')
		path = ZOFFLOAD_DEFAULT_SOCKET;
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
	r = connect_deadline(c->fd, &sa, deadline_after(c->timeout_ms));
	if (r < 0) {
		close(c->fd);
		zcl_connect_refused(r, path);
		goto fail;
	}
	snprintf(hello.u.hello.client_name, sizeof(hello.u.hello.client_name), "pid %d",
	    (int)getpid());
	r = rpc(c, &hello, ZP_HELLO_OK, NULL);
	if (r < 0) {
		/* The connection and its message go; the daemon's reason (a limit) stays. */
		zcl_connect_fail(r, "zoffloadd at %s: %s", path,
		    c->err[0] != '\0' ? c->err : strerror(-r));
		close(c->fd);
		goto fail;
	}
	c->session_id = c->msg->u.hello_ok.session_id;
	zcl_connect_ok();
	*ret = c;
	return 0;
fail:
	free(c->buf);
	free(c->msg);
	free(c);
	return r;
}

static void
tensor_unmap(struct zc_tensor *t)
{
	/* Before munmap: a driver's registration must not outlive the mapping. */
	if (t->release != NULL)
		t->release(t, t->release_arg);
	munmap(t->grad, t->grad_bytes);
	munmap(t->param, t->param_bytes);
	free(t);
}

void
zc_disconnect(struct zc_conn *c)
{
	struct pending_set *s;

	if (c == NULL)
		return;
	close(c->fd);
	for (uint32_t i = 0; i < c->tensor_cap; i++)
		if (c->tensors[i] != NULL)
			tensor_unmap(c->tensors[i]);
	while ((s = c->sets) != NULL) {
		c->sets = s->next;
		free(s->handles);
		free(s);
	}
	if (c->xfer != NULL)
		munmap(c->xfer, c->xfer_bytes);
	free(c->tensors);
	free(c->buf);
	free(c->msg);
	free(c);
}

int
zc_job_open(struct zc_conn *c, const char *job_name, uint32_t rank, uint32_t world_size)
{
	return zc_job_open_opts(c, job_name, rank, world_size, NULL);
}

int
zc_job_open_opts(struct zc_conn *c, const char *job_name, uint32_t rank, uint32_t world_size,
    const struct zc_job_options *opts)
{
	struct zp_msg m = { .hdr = { .type = ZP_JOB_OPEN } };
	int r;

	if (opts != NULL && (unsigned)opts->policy > ZC_POLICY_AUTO)
		return seterr(c, -EINVAL, "unknown policy %d", (int)opts->policy);
	if (opts != NULL) {
		m.u.job_open.policy = (uint8_t)opts->policy;
		m.u.job_open.pinned_budget = opts->pinned_budget;
	}
	if (job_name == NULL || strlen(job_name) == 0 || strlen(job_name) > ZP_NAME_MAX)
		return seterr(c, -EINVAL, "job name must be 1 to %d bytes", ZP_NAME_MAX);
	snprintf(m.u.job_open.job_name, sizeof(m.u.job_open.job_name), "%s", job_name);
	m.u.job_open.rank = rank;
	m.u.job_open.world_size = world_size;
	if (world_size == 0 || rank >= world_size)
		return seterr(c, -EINVAL, "rank %u is not below world size %u", rank, world_size);
	r = rpc(c, &m, ZP_JOB_OK, NULL);
	if (r == 0) {
		c->job_open = true;
		c->rank = rank;
		c->world_size = world_size;
		c->job_last_step = c->msg->u.job_ok.last_step;
	}
	return r;
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
		return seterr(c, -EINVAL, "job name must be 1 to %d bytes", ZP_NAME_MAX);
	snprintf(m.u.job_drop.job_name, sizeof(m.u.job_drop.job_name), "%s", job_name);
	return rpc(c, &m, ZP_OK, NULL);
}

int
zc_job_close(struct zc_conn *c)
{
	struct zp_msg m = { .hdr = { .type = ZP_JOB_CLOSE } };
	int r;

	r = rpc(c, &m, ZP_OK, NULL);
	if (r < 0)
		return r;
	c->job_open = false;
	/* The daemon freed this rank's tensors. */
	for (uint32_t i = 0; i < c->tensor_cap; i++) {
		if (c->tensors[i] != NULL) {
			tensor_unmap(c->tensors[i]);
			c->tensors[i] = NULL;
		}
	}
	return 0;
}

/* Bytes of the file behind fd; 0 when it cannot be told. */
static uint64_t
file_bytes(int fd)
{
	struct stat st;

	return fstat(fd, &st) == 0 && st.st_size > 0 ? (uint64_t)st.st_size : 0;
}

static int
ensure_xfer(struct zc_conn *c)
{
	struct zp_msg m = { .hdr = { .type = ZP_XFER_OPEN } };
	uint64_t bytes, file;
	int fd, r;
	void *map;

	if (c->xfer != NULL)
		return 0;
	r = rpc(c, &m, ZP_XFER_OK, &fd);
	if (r < 0)
		return r;
	/*
	 * Below one element the copy loop would make no progress; past the
	 * file's end the mapping would SIGBUS on first touch.
	 */
	bytes = c->msg->u.xfer_ok.bytes;
	file = file_bytes(fd);
	if (bytes < sizeof(float) || file < bytes) {
		close(fd);
		return seterr(c, -EBADMSG, "zoffloadd sent a transfer window of %llu bytes in a "
		    "%llu-byte file", (unsigned long long)bytes, (unsigned long long)file);
	}
	map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	r = map == MAP_FAILED ? -errno : 0;
	close(fd);
	if (r < 0)
		return seterr(c, r, "map the transfer window: %s", strerror(-r));
	c->xfer = map;
	c->xfer_bytes = c->msg->u.xfer_ok.bytes;
	return 0;
}

/* Moves count fp32 values between a tensor's state and the caller, a window at a time. */
static int
tensor_copy(struct zc_tensor *t, uint16_t type, enum zc_state which, uint64_t offset,
    uint64_t count, float *data)
{
	struct zc_conn *c = t->conn;
	uint64_t chunk, done = 0;
	int r;

	if (offset > t->numel || count > t->numel - offset)
		return seterr(c, -ERANGE, "elements %llu..%llu are outside the tensor's %llu",
		    (unsigned long long)offset, (unsigned long long)(offset + count),
		    (unsigned long long)t->numel);
	if (t->pending)
		return seterr(c, -EBUSY, "tensor is in a step; wait for it first");
	r = ensure_xfer(c);
	if (r < 0)
		return r;
	chunk = c->xfer_bytes / sizeof(float);
	while (done < count) {
		struct zp_msg m = { .hdr = { .type = type } };
		uint64_t n = count - done < chunk ? count - done : chunk;

		m.u.tensor_io = (struct zp_tensor_io){
			.handle = t->handle, .state = (uint8_t)which,
			.offset = offset + done, .count = n,
		};
		if (type == ZP_TENSOR_WRITE)
			memcpy(c->xfer, data + done, n * sizeof(float));
		r = rpc(c, &m, ZP_OK, NULL);
		if (r < 0)
			return r;
		if (type == ZP_TENSOR_READ)
			memcpy(data + done, c->xfer, n * sizeof(float));
		done += n;
	}
	return 0;
}

static int
add_tensor(struct zc_conn *c, struct zc_tensor *t)
{
	if (t->handle > c->tensor_cap) {
		uint32_t cap = c->tensor_cap ? c->tensor_cap : 64;
		struct zc_tensor **bigger;

		while (cap < t->handle)
			cap *= 2;
		bigger = realloc(c->tensors, cap * sizeof(*bigger));
		if (bigger == NULL)
			return -ENOMEM;
		memset(bigger + c->tensor_cap, 0, (cap - c->tensor_cap) * sizeof(*bigger));
		c->tensors = bigger;
		c->tensor_cap = cap;
	}
	c->tensors[t->handle - 1] = t;
	return 0;
}

static void
unregister_quietly(struct zc_conn *c, uint32_t handle)
{
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_UNREGISTER } };

	m.u.tensor_handle.handle = handle;
	(void)rpc(c, &m, ZP_OK, NULL);
}

int
zc_tensor_register(struct zc_conn *c, const struct zc_tensor_desc *desc, const float *init,
    struct zc_tensor **ret)
{
	if (init == NULL && desc != NULL && desc->name != NULL)
		return seterr(c, -EINVAL, "tensor '%s': initial values are required", desc->name);
	return zci_tensor_register(c, desc, init, ret);
}

int
zci_tensor_register(struct zc_conn *c, const struct zc_tensor_desc *desc, const float *init,
    struct zc_tensor **ret)
{
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_REGISTER } };
	struct zc_tensor *t;
	char saved[sizeof(c->err)];
	bool resumed;
	int fds[2], r;

	if (desc->name == NULL || strlen(desc->name) == 0 || strlen(desc->name) > ZP_NAME_MAX)
		return seterr(c, -EINVAL, "tensor name must be 1 to %d bytes", ZP_NAME_MAX);
	if ((unsigned)desc->grad_dtype > ZC_F16 || (unsigned)desc->param_dtype > ZC_F16)
		return seterr(c, -EINVAL, "tensor '%s': unknown dtype", desc->name);
	if (desc->numel == 0)
		return seterr(c, -EINVAL, "tensor '%s': numel is 0", desc->name);
	snprintf(m.u.tensor_register.name, sizeof(m.u.tensor_register.name), "%s", desc->name);
	m.u.tensor_register.numel = desc->numel;
	m.u.tensor_register.grad_dtype = (uint8_t)desc->grad_dtype;
	m.u.tensor_register.param_dtype = (uint8_t)desc->param_dtype;
	m.u.tensor_register.flags = desc->param_offload ? ZP_TENSOR_PARAM_OFFLOAD : 0;
	r = rpc(c, &m, ZP_TENSOR_OK, fds);
	if (r < 0)
		return r;
	t = calloc(1, sizeof(*t));
	if (t == NULL) {
		r = seterr(c, -ENOMEM, "out of memory");
		goto fail_fds;
	}
	t->conn = c;
	snprintf(t->name, sizeof(t->name), "%s", desc->name);
	t->handle = c->msg->u.tensor_ok.handle;
	t->numel = desc->numel;
	t->grad_bytes = c->msg->u.tensor_ok.grad_bytes;
	t->param_bytes = c->msg->u.tensor_ok.param_bytes;
	t->last_step = c->msg->u.tensor_ok.last_step;
	t->param_offload = desc->param_offload;
	resumed = c->msg->u.tensor_ok.resumed != 0;
	/* Handle 0 would index tensors[-1]; a handle in use would take another tensor's place. */
	if (t->handle == 0 || tensor_by_handle(c, t->handle) != NULL) {
		r = seterr(c, -EBADMSG, "zoffloadd gave '%s' handle %u, %s", desc->name, t->handle,
		    t->handle == 0 ? "which is not a handle" : "which another tensor has");
		goto fail_free;
	}
	if (t->grad_bytes != desc->numel * dtype_size(desc->grad_dtype) ||
	    t->param_bytes != desc->numel * dtype_size(desc->param_dtype)) {
		r = seterr(c, -EBADMSG, "zoffloadd sized the slots of '%s' wrongly", desc->name);
		goto fail_tensor;
	}
	/* A slot mapped past its file's end would SIGBUS in the training process. */
	if (file_bytes(fds[0]) < t->grad_bytes || file_bytes(fds[1]) < t->param_bytes) {
		r = seterr(c, -EBADMSG, "zoffloadd sent the slots of '%s' (%zu and %zu bytes) in "
		    "files of %llu and %llu bytes", desc->name, t->grad_bytes, t->param_bytes,
		    (unsigned long long)file_bytes(fds[0]), (unsigned long long)file_bytes(fds[1]));
		goto fail_tensor;
	}
	t->grad = mmap(NULL, t->grad_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
	t->param = mmap(NULL, t->param_bytes, PROT_READ, MAP_SHARED, fds[1], 0);
	if (t->grad == MAP_FAILED || t->param == MAP_FAILED) {
		r = seterr(c, -errno, "map the slots of '%s': %s", desc->name, strerror(errno));
		if (t->grad != MAP_FAILED)
			munmap(t->grad, t->grad_bytes);
		if (t->param != MAP_FAILED)
			munmap(t->param, t->param_bytes);
		goto fail_tensor;
	}
	close(fds[0]);
	close(fds[1]);
	r = add_tensor(c, t);
	if (r < 0) {
		seterr(c, r, "out of memory");
		goto fail_mapped;
	}
	/*
	 * Taken back from a rank that died: its state is newer than any initial values.
	 * No init: the caller writes every element itself (a restore).
	 */
	r = resumed || init == NULL ? 0 : tensor_copy(t, ZP_TENSOR_WRITE, ZC_STATE_MASTER, 0, t->numel,
	    (float *)init);
	if (r < 0) {
		c->tensors[t->handle - 1] = NULL;
		goto fail_mapped;
	}
	*ret = t;
	return 0;
fail_mapped:
	/* Keep the first error, not the clean-up's. */
	memcpy(saved, c->err, sizeof(saved));
	unregister_quietly(c, t->handle);
	memcpy(c->err, saved, sizeof(saved));
	tensor_unmap(t);
	return r;
fail_tensor:
	memcpy(saved, c->err, sizeof(saved));
	unregister_quietly(c, t->handle);
	memcpy(c->err, saved, sizeof(saved));
fail_free:
	free(t);
fail_fds:
	close(fds[0]);
	close(fds[1]);
	return r;
}

int
zc_tensor_unregister(struct zc_tensor *t)
{
	struct zc_conn *c = t->conn;
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_UNREGISTER } };
	int r;

	if (t->pending)
		return seterr(c, -EBUSY, "tensor is in a step; wait for it first");
	m.u.tensor_handle.handle = t->handle;
	r = rpc(c, &m, ZP_OK, NULL);
	if (r < 0)
		return r;
	c->tensors[t->handle - 1] = NULL;
	tensor_unmap(t);
	return 0;
}

void
zc_tensor_set_release_hook(struct zc_tensor *t, zc_release_fn *fn, void *arg)
{
	t->release = fn;
	t->release_arg = fn != NULL ? arg : NULL;
}

void
zc_tensor_set_param_pin(struct zc_tensor *t, zc_unpin_fn *unpin, void *arg)
{
	t->unpin = unpin;
	t->unpin_arg = unpin != NULL ? arg : NULL;
}

bool
zc_tensor_param_pinned(const struct zc_tensor *t)
{
	return t->unpin != NULL;
}

uint64_t
zc_tensor_numel(const struct zc_tensor *t)
{
	return t->numel;
}

uint64_t
zc_tensor_last_step(const struct zc_tensor *t)
{
	return t->last_step;
}

void *
zc_tensor_grad_slot(struct zc_tensor *t, size_t *ret_bytes)
{
	if (ret_bytes != NULL)
		*ret_bytes = t->grad_bytes;
	return t->grad;
}

const void *
zc_tensor_param_slot(struct zc_tensor *t, size_t *ret_bytes)
{
	if (ret_bytes != NULL)
		*ret_bytes = t->param_bytes;
	return t->param;
}

int
zc_tensor_read(struct zc_tensor *t, enum zc_state which, uint64_t offset, uint64_t count,
    float *dst)
{
	if ((unsigned)which > ZC_STATE_EXP_AVG_SQ)
		return seterr(t->conn, -EINVAL, "unknown state %d", (int)which);
	return tensor_copy(t, ZP_TENSOR_READ, which, offset, count, dst);
}

int
zc_tensor_write(struct zc_tensor *t, enum zc_state which, uint64_t offset, uint64_t count,
    const float *src)
{
	if ((unsigned)which > ZC_STATE_EXP_AVG_SQ)
		return seterr(t->conn, -EINVAL, "unknown state %d", (int)which);
	/* tensor_copy only reads from data on a write. */
	return tensor_copy(t, ZP_TENSOR_WRITE, which, offset, count, (float *)(uintptr_t)src);
}

int
zc_tensor_set_step(struct zc_tensor *t, uint64_t step)
{
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_SET_STEP } };
	int r;

	if (t->pending)
		return seterr(t->conn, -EBUSY, "tensor is in a step; wait for it first");
	m.u.tensor_step.handle = t->handle;
	m.u.tensor_step.step = step;
	r = rpc(t->conn, &m, ZP_OK, NULL);
	if (r < 0)
		return r;
	t->last_step = step;
	return 0;
}

int
zc_grad_pass(struct zc_conn *c, struct zc_tensor *const *tensors, size_t ntensors,
    double grad_scale, struct zc_grad_partial *ret)
{
	struct zp_msg *m;
	int r;

	if (ntensors == 0 || ntensors > ZP_MAX_STEP_TENSORS)
		return seterr(c, -EINVAL, "a gradient pass takes 1 to %d tensors, not %zu",
		    ZP_MAX_STEP_TENSORS, ntensors);
	for (size_t i = 0; i < ntensors; i++) {
		if (tensors[i] == NULL || tensors[i]->conn != c)
			return seterr(c, -EINVAL, "tensor %zu does not belong to this connection", i);
		if (tensors[i]->pending)
			return seterr(c, -EBUSY, "tensor %zu is still in a step", i);
	}
	m = calloc(1, sizeof(*m));
	if (m == NULL)
		return seterr(c, -ENOMEM, "out of memory");
	m->hdr.type = ZP_GRAD_PASS;
	m->u.grad_pass.grad_scale = grad_scale > 0 ? grad_scale : 1.0;
	m->u.grad_pass.count = (uint32_t)ntensors;
	for (size_t i = 0; i < ntensors; i++)
		m->u.grad_pass.handles[i] = tensors[i]->handle;
	r = rpc(c, m, ZP_GRAD_PARTIAL, NULL);
	free(m);
	if (r < 0)
		return r;
	ret->sumsq = c->msg->u.grad_partial.sumsq;
	ret->nonfinite = c->msg->u.grad_partial.nonfinite;
	ret->elements = c->msg->u.grad_partial.elements;
	return 0;
}

double
zc_clip_coef(double max_norm, double total_sumsq)
{
	double norm = sqrt(total_sumsq), coef;

	if (!(max_norm > 0) || !isfinite(norm))
		return 1.0;
	coef = max_norm / (norm + 1e-6);
	return coef < 1.0 ? coef : 1.0;
}

int
zc_step_submit(struct zc_conn *c, const struct zc_step_params *p,
    struct zc_tensor *const *tensors, size_t ntensors)
{
	struct zp_msg *m;
	struct pending_set *set;
	int r;

	if (ntensors == 0 || ntensors > ZP_MAX_STEP_TENSORS)
		return seterr(c, -EINVAL, "a step takes 1 to %d tensors, not %zu",
		    ZP_MAX_STEP_TENSORS, ntensors);
	if ((unsigned)p->optim > ZC_LION)
		return seterr(c, -EINVAL, "unknown optimizer %d", (int)p->optim);
	if (p->step == 0)
		return seterr(c, -EINVAL, "steps count from 1");
	if (!(p->clip_coef >= 0 && p->clip_coef <= 1))
		return seterr(c, -EINVAL, "clip_coef %g is outside [0, 1] (0: none)", p->clip_coef);
	for (size_t i = 0; i < ntensors; i++) {
		if (tensors[i] == NULL || tensors[i]->conn != c)
			return seterr(c, -EINVAL, "tensor %zu does not belong to this connection", i);
		if (tensors[i]->pending)
			return seterr(c, -EBUSY, "tensor %zu is still in a step", i);
	}
	m = calloc(1, sizeof(*m));
	set = calloc(1, sizeof(*set));
	if (m == NULL || set == NULL || (set->handles = calloc(ntensors, 4)) == NULL) {
		free(m);
		free(set);
		return seterr(c, -ENOMEM, "out of memory");
	}
	m->hdr.type = ZP_STEP_SUBMIT;
	m->u.step_submit = (struct zp_step_submit){
		.step = p->step,
		.optim = (uint8_t)p->optim,
		.flags = (uint8_t)((p->no_bias_correction ? ZP_STEP_NO_BIAS_CORRECTION : 0) |
		    (p->check_finite ? ZP_STEP_CHECK_FINITE : 0) |
		    (p->clip_coef > 0 ? ZP_STEP_CLIP_COEF : 0)),
		.lr = p->lr,
		.beta1 = p->beta1,
		.beta2 = p->beta2,
		.eps = p->eps,
		.weight_decay = p->weight_decay,
		.lr_decay = p->lr_decay,
		.grad_scale = p->grad_scale > 0 ? p->grad_scale : 1.0,
		.max_grad_norm = p->clip_coef > 0 ? p->clip_coef : p->max_grad_norm,
		.count = (uint32_t)ntensors,
	};
	for (size_t i = 0; i < ntensors; i++) {
		m->u.step_submit.handles[i] = tensors[i]->handle;
		set->handles[i] = tensors[i]->handle;
	}
	set->count = (uint32_t)ntensors;
	set->step = p->step;
	r = send_msg(c, m, deadline_after(c->timeout_ms), -1);
	if (r < 0) {
		free(set->handles);
		free(set);
		free(m);
		return r;
	}
	set->request_id = m->hdr.request_id;
	set->next = c->sets;
	c->sets = set;
	for (size_t i = 0; i < ntensors; i++) {
		tensors[i]->pending = true;
		tensors[i]->pending_set = set->request_id;
	}
	free(m);
	return 0;
}

static int
wait_until(struct zc_conn *c, bool (*done)(void *), void *arg, uint64_t deadline)
{
	int fds[ZP_MAX_FDS];
	unsigned nfds;
	int r;

	while (!done(arg)) {
		r = recv_one(c, fds, &nfds, deadline);
		if (r < 0)
			return r;
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
	}
	return 0;
}

static bool
tensor_idle(void *arg)
{
	return !((struct zc_tensor *)arg)->pending;
}

static bool
conn_idle(void *arg)
{
	return ((struct zc_conn *)arg)->sets == NULL;
}

int
zc_wait_tensor(struct zc_tensor *t, struct zc_step_result *ret)
{
	return zc_wait_tensor_timeout(t, ret, -1);
}

int
zc_wait_tensor_timeout(struct zc_tensor *t, struct zc_step_result *ret, int timeout_ms)
{
	int r = wait_until(t->conn, tensor_idle, t, deadline_after(timeout_ms));

	if (r == -ETIMEDOUT)
		return seterr(t->conn, r, "the tensor's step is not done after %d ms (it still runs; "
		    "wait again)", timeout_ms);
	if (r == 0 && ret != NULL)
		*ret = t->result;
	if (r == 0 && t->result.status == ZC_STEP_FAILED)
		return t->result.error < 0 ? t->result.error : -EIO;
	return r;
}

int
zc_wait_all(struct zc_conn *c, struct zc_step_result *ret)
{
	return zc_wait_all_timeout(c, ret, -1);
}

int
zc_wait_all_timeout(struct zc_conn *c, struct zc_step_result *ret, int timeout_ms)
{
	int r = wait_until(c, conn_idle, c, deadline_after(timeout_ms));

	if (r == -ETIMEDOUT)
		return seterr(c, r, "steps are not done after %d ms (they still run; wait again)",
		    timeout_ms);
	if (r == 0 && ret != NULL)
		*ret = c->last;
	if (r == 0 && c->last.status == ZC_STEP_FAILED)
		return c->last.error < 0 ? c->last.error : -EIO;
	return r;
}

static int
handles_request(struct zc_conn *c, uint16_t type, struct zc_tensor *const *tensors, size_t n,
    struct zp_msg **ret)
{
	struct zp_msg *m;

	if (n == 0 || n > ZP_MAX_STEP_TENSORS)
		return seterr(c, -EINVAL, "1 to %d tensors, not %zu", ZP_MAX_STEP_TENSORS, n);
	for (size_t i = 0; i < n; i++) {
		if (tensors[i] == NULL || tensors[i]->conn != c)
			return seterr(c, -EINVAL, "tensor %zu does not belong to this connection", i);
		if (tensors[i]->pending)
			return seterr(c, -EBUSY, "tensor %zu is in a step; wait for it first", i);
	}
	m = calloc(1, sizeof(*m));
	if (m == NULL)
		return seterr(c, -ENOMEM, "out of memory");
	m->hdr.type = type;
	m->u.handles.count = (uint32_t)n;
	for (size_t i = 0; i < n; i++)
		m->u.handles.handles[i] = tensors[i]->handle;
	*ret = m;
	return 0;
}

/* zc_param_prefetch with the send bounded by `deadline` (a wait's own, from zc_param_wait). */
static int
prefetch(struct zc_conn *c, struct zc_tensor *const *tensors, size_t n, uint64_t deadline)
{
	struct zp_msg *m = NULL;
	int r = handles_request(c, ZP_PARAM_FETCH, tensors, n, &m);

	if (r < 0)
		return r;
	/* Only what is not in its slot yet; READY events arrive as the daemon stages them. */
	m->u.handles.count = 0;
	for (size_t i = 0; i < n; i++) {
		if (tensors[i]->param_state != PARAM_RELEASED)
			continue;
		tensors[i]->param_state = PARAM_FETCHING;
		m->u.handles.handles[m->u.handles.count++] = tensors[i]->handle;
	}
	r = m->u.handles.count > 0 ? send_msg(c, m, deadline, -1) : 0;
	/*
	 * Not sent: no READY will come, and a tensor left fetching would have
	 * zc_param_wait wait for it forever.
	 */
	for (uint32_t i = 0; r < 0 && i < m->u.handles.count; i++) {
		struct zc_tensor *t = tensor_by_handle(c, m->u.handles.handles[i]);

		if (t != NULL && t->param_state == PARAM_FETCHING)
			t->param_state = PARAM_RELEASED;
	}
	free(m);
	return r;
}

int
zc_param_prefetch(struct zc_conn *c, struct zc_tensor *const *tensors, size_t n)
{
	return prefetch(c, tensors, n, deadline_after(c->timeout_ms));
}

static bool
param_arrived(void *arg)
{
	return ((struct zc_tensor *)arg)->param_state != PARAM_FETCHING;
}

int
zc_param_wait(struct zc_tensor *t)
{
	return zc_param_wait_timeout(t, -1);
}

int
zc_param_wait_timeout(struct zc_tensor *t, int timeout_ms)
{
	struct zc_conn *c = t->conn;
	uint64_t t0, deadline = deadline_after(timeout_ms);
	int r;

	/* A READY already in the socket means the params are there: ready, no waiting. */
	if (t->param_state == PARAM_FETCHING) {
		r = drain(c);
		if (r < 0)
			return r;
	}
	if (t->param_state == PARAM_RESIDENT) {
		/* The end of a wait that timed out before is not a new ready one. */
		if (!t->param_waited)
			c->param_stats.ready++;
		t->param_waited = false;
		return 0;
	}
	/* One per wait, however many timed-out calls (or polls) it takes. */
	if (!t->param_waited)
		c->param_stats.waited++;
	t->param_waited = true;
	t0 = now_ns();
	if (t->param_state == PARAM_RELEASED) {
		r = prefetch(c, &t, 1, deadline);
		if (r < 0)
			return r;
	}
	r = wait_until(c, param_arrived, t, deadline);
	c->param_stats.wait_ns += now_ns() - t0;
	if (r == -ETIMEDOUT)
		return seterr(c, r, "the params are not back after %d ms (the fetch goes on; wait "
		    "again)", timeout_ms);
	if (r < 0)
		return r;
	t->param_waited = false;
	if (t->param_state != PARAM_RESIDENT)
		return seterr(c, t->param_error < 0 ? t->param_error : -EIO,
		    "staging the params failed: %s", strerror(-t->param_error));
	return 0;
}

int
zc_param_release(struct zc_conn *c, struct zc_tensor *const *tensors, size_t n)
{
	struct zp_msg *m = NULL;
	int r = handles_request(c, ZP_PARAM_RELEASE, tensors, n, &m);

	if (r < 0)
		return r;
	for (size_t i = 0; i < n; i++) {
		if (tensors[i]->param_state == PARAM_FETCHING) {
			free(m);
			return seterr(c, -EBUSY, "tensor %zu is being fetched; wait for it first", i);
		}
	}
	/*
	 * The daemon drops the pages of every offloaded slot it releases and
	 * refills it with new ones: a driver must let go of the old pages first.
	 * A failed unpin releases nothing (those already unpinned stay so).
	 */
	for (size_t i = 0; i < n; i++) {
		struct zc_tensor *t = tensors[i];

		if (!t->param_offload || t->param_state != PARAM_RESIDENT || t->unpin == NULL)
			continue;
		r = t->unpin(t, t->unpin_arg);
		if (r < 0) {
			free(m);
			return seterr(c, r, "tensor %zu: cannot unpin its param slot before the "
			    "release: %s", i, strerror(-r));
		}
		t->unpin = NULL;
		t->unpin_arg = NULL;
	}
	r = rpc(c, m, ZP_OK, NULL);
	free(m);
	if (r < 0)
		return r;
	for (size_t i = 0; i < n; i++)
		if (tensors[i]->param_offload)
			tensors[i]->param_state = PARAM_RELEASED;
	return 0;
}

void
zc_param_stats(const struct zc_conn *c, struct zc_param_stats *ret)
{
	*ret = c->param_stats;
}

int
zc_ping(struct zc_conn *c, uint64_t *ret_rtt_ns)
{
	struct zp_msg m = { .hdr = { .type = ZP_PING } };
	uint64_t t0 = now_ns();
	int r;

	r = rpc(c, &m, ZP_PONG, NULL);
	if (r == 0 && ret_rtt_ns != NULL)
		*ret_rtt_ns = now_ns() - t0;
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
		return seterr(c, -EBADMSG, "zoffloadd's reply of %llu bytes came in a smaller file",
		    (unsigned long long)bytes);
	}
	map = mmap(NULL, (size_t)bytes, PROT_READ, MAP_SHARED, fd, 0);
	close(fd);
	if (map == MAP_FAILED)
		return seterr(c, -errno, "cannot map zoffloadd's reply: %s", strerror(errno));
	text = malloc((size_t)bytes + 1);
	if (text != NULL) {
		memcpy(text, map, (size_t)bytes);
		text[bytes] = '\0';
	}
	munmap(map, (size_t)bytes);
	if (text == NULL)
		return seterr(c, -ENOMEM, "out of memory");
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
		return seterr(c, -ENOMEM, "out of memory");
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
