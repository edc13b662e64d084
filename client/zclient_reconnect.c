/*
 * libzclient's reconnects: when the connection goes away, connect again to the
 * same socket, reattach the job and its tensors (the daemon's detach and
 * take-back path), keep or replace the slot mappings in place, and send again
 * what had no answer.
 *
 * What this relies on from the daemon:
 * - JOB_OPEN of the same job and rank, once the old session is gone
 *   (-EADDRINUSE until then: tried again), and TENSOR_REGISTER of the same
 *   descriptor hand back the tensor kept detached: TENSOR_OK with resumed 1
 *   and last_step the step its state is at (-EAGAIN while a step the old
 *   session submitted still runs on it: tried again).  resumed 0 for a tensor
 *   whose initial values were all in means the state is gone.
 * - The slots come back in the same files (memfds) as long as the state was
 *   kept; other files are handled, by mapping them in place.
 * - A step whose number is at or below a tensor's last_step is refused for
 *   the whole set (-EALREADY): such tensors are never submitted again, their
 *   step is done.  A step that landed on part of a tensor (last_step below
 *   it) is finished by submitting it again: the daemon skips the units
 *   stamped with it, so each element is stepped once.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "zclient.h"
#include "zclient_connerr.h"
#include "zclient_impl.h"

#define RECONNECT_DEFAULT_MS	60000
/* Backoff between attempts: from the first to the most, doubling. */
#define BACKOFF_FIRST_US	5000u
#define BACKOFF_MAX_US		200000u

int
zc_set_reconnect(struct zc_conn *c, int timeout_ms)
{
	c->reconnect_ms = timeout_ms < 0 ? -1 : timeout_ms;
	return 0;
}

void
zc_conn_stats(const struct zc_conn *c, struct zc_conn_stats *ret)
{
	*ret = c->conn_stats;
}

int
zci_reconnect_default(int *ret_ms)
{
	const char *text = getenv("ZOFFLOAD_RECONNECT_MS");
	char *end;
	long v;

	*ret_ms = RECONNECT_DEFAULT_MS;
	if (text == NULL || text[0] == '\0')
		return 0;
	errno = 0;
	v = strtol(text, &end, 10);
	if (errno != 0 || *end != '\0' || v < -1 || v > INT32_MAX)
		return zcl_connect_fail(-EINVAL, "$ZOFFLOAD_RECONNECT_MS is '%s': milliseconds to "
		    "keep reconnecting, -1 for no bound or 0 for none", text);
	*ret_ms = (int)v;
	return 0;
}

int
zci_lost(struct zc_conn *c, const char *why)
{
	/*
	 * Off, or a request that timed out may yet be carried out (broken_by):
	 * what the daemon holds is unknown, and a reattach would not make it known.
	 */
	if (c->reconnect_ms == 0 || (!c->lost && c->broken_by != 0))
		return zci_seterr(c, -ECONNRESET, "%s", why);
	if (!c->lost) {
		c->lost = true;
		c->lost_ns = zci_now_ns();
	}
	c->losses++;
	/* The number stays ours (see struct zc_conn); the daemon sees the session end. */
	(void)shutdown(c->fd, SHUT_RDWR);
	return zci_seterr(c, -ECONNRESET, "%s; reconnecting", why);
}

int
zci_closed_by_daemon(struct zc_conn *c, int code, const char *why)
{
	if (c->reconnect_ms != 0 && c->dead == 0 && !c->lost) {
		c->dead = code;
		snprintf(c->dead_msg, sizeof(c->dead_msg), "%s", why);
		c->lost = false;
	}
	return zci_seterr(c, code, "%s", why);
}

int
zci_ready(struct zc_conn *c, struct zp_msg *inflight, uint64_t deadline)
{
	if (c->dead != 0)
		return zci_seterr(c, c->dead, "%s", c->dead_msg);
	if (!c->lost)
		return 0;
	return zci_reconnect(c, inflight, deadline);
}

/* Gives up for good: this and every later call fail with code and the message. */
static int
give_up(struct zc_conn *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static int
give_up(struct zc_conn *c, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(c->dead_msg, sizeof(c->dead_msg), fmt, ap);
	va_end(ap);
	c->dead = code;
	c->lost = false;
	(void)shutdown(c->fd, SHUT_RDWR);
	return zci_seterr(c, code, "%s", c->dead_msg);
}

static uint64_t
earlier(uint64_t a, uint64_t b)
{
	return a < b ? a : b;
}

/* Sleeps the backoff, or less when a deadline comes first; doubles it. */
static void
pause_before_retry(unsigned *backoff_us, uint64_t deadline)
{
	uint64_t us = *backoff_us, now = zci_now_ns();

	if (deadline != ZCI_NO_DEADLINE)
		us = deadline > now ? earlier(us, (deadline - now) / 1000u) : 0;
	if (us > 0)
		usleep((useconds_t)us);
	*backoff_us = *backoff_us * 2 < BACKOFF_MAX_US ? *backoff_us * 2 : BACKOFF_MAX_US;
}

/*
 * One attempt at a new socket in c->fd's place and its HELLO.  The reason
 * it failed is left in c->err.
 */
static int
connect_once(struct zc_conn *c, uint64_t deadline)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct zp_msg hello = { .hdr = { .type = ZP_HELLO } };
	int fd, r;

	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return zci_seterr(c, -errno, "socket(AF_UNIX, SOCK_SEQPACKET): %s", strerror(errno));
	memcpy(sa.sun_path, c->path, strlen(c->path));
	if (connect(fd, (const struct sockaddr *)&sa, sizeof(sa)) != 0) {
		r = -errno;
		close(fd);
		return zci_seterr(c, r, "cannot connect to %s: %s", c->path, strerror(-r));
	}
	if (dup3(fd, c->fd, O_CLOEXEC) < 0) {
		r = -errno;
		close(fd);
		return zci_seterr(c, r, "dup3: %s", strerror(-r));
	}
	close(fd);
	c->broken_by = 0;
	snprintf(hello.u.hello.client_name, sizeof(hello.u.hello.client_name), "pid %d",
	    (int)getpid());
	r = zci_rpc_once(c, &hello, ZP_HELLO_OK, NULL, deadline);
	if (r < 0)
		return r;
	c->session_id = c->msg->u.hello_ok.session_id;
	return 0;
}

static int
open_job(struct zc_conn *c, uint64_t deadline)
{
	struct zp_msg m = { .hdr = { .type = ZP_JOB_OPEN } };
	unsigned backoff = BACKOFF_FIRST_US;
	int r;

	snprintf(m.u.job_open.job_name, sizeof(m.u.job_open.job_name), "%s", c->job_name);
	m.u.job_open.rank = c->rank;
	m.u.job_open.world_size = c->world_size;
	m.u.job_open.policy = (uint8_t)c->job_opts.policy;
	m.u.job_open.pinned_budget = c->job_opts.pinned_budget;
	snprintf(m.u.job_open.state_format, sizeof(m.u.job_open.state_format), "%s",
	    c->state_format);
	/* The daemon may not have seen the old session go yet: that rank is still attached. */
	while ((r = zci_rpc_once(c, &m, ZP_JOB_OK, NULL, deadline)) == -EADDRINUSE &&
	    zci_now_ns() < deadline)
		pause_before_retry(&backoff, deadline);
	if (r == 0)
		c->job_last_step = c->msg->u.job_ok.last_step;
	return r;
}

/* The request frees t on the daemon: t may come back new, being about to go anyway. */
static bool
frees(const struct zp_msg *m, const struct zc_tensor *t, uint32_t old_handle)
{
	if (m == NULL)
		return false;
	if (m->hdr.type == ZP_JOB_CLOSE)
		return true;
	return m->hdr.type == ZP_TENSOR_UNREGISTER && m->u.tensor_handle.handle == old_handle &&
	    t != NULL;
}

/*
 * The slot at addr is now in fd: the same file keeps its mapping; another is
 * mapped over it in place (copy: what the caller wrote there is carried over).
 */
static int
remap_slot(struct zc_conn *c, void *addr, size_t bytes, int prot, int fd, uint64_t *dev,
    uint64_t *ino, bool copy)
{
	uint64_t ndev, nino;
	void *tmp;

	zci_file_id(fd, &ndev, &nino);
	if (ndev == *dev && nino == *ino)
		return 0;
	if (copy) {
		tmp = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (tmp == MAP_FAILED)
			return -errno;
		memcpy(tmp, addr, bytes);
		munmap(tmp, bytes);
	}
	if (mmap(addr, bytes, prot, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED)
		return -errno;
	zci_advise_huge(addr, bytes);
	*dev = ndev;
	*ino = nino;
	c->conn_stats.slots_remapped++;
	return 0;
}

/*
 * Slots coming back in other files are mapped over the old pages; a driver
 * that registered those pages (libzclient_cuda: cudaHostRegister) would go on
 * copying through them, not the new files.  So it lets go first: the param
 * pin's unpin, then the slots hook told it is a remap (the tensor, and what
 * the driver keeps for it, live on); copies then go through pageable memory,
 * correct if slower.
 */
static int
let_go_of_driver(struct zc_conn *c, struct zc_tensor *t, const int *fds)
{
	uint64_t gdev, gino, pdev, pino;
	int r;

	zci_file_id(fds[0], &gdev, &gino);
	zci_file_id(fds[1], &pdev, &pino);
	if (gdev == t->grad_dev && gino == t->grad_ino && pdev == t->param_dev &&
	    pino == t->param_ino)
		return 0;
	if (t->unpin != NULL) {
		r = t->unpin(t, t->unpin_arg);
		if (r < 0)
			return zci_seterr(c, r, "tensor '%s' came back in other slot files and its "
			    "param slot cannot be unpinned: %s", t->name, strerror(-r));
		t->unpin = NULL;
		t->unpin_arg = NULL;
	}
	c->hooks->slots_event(t, ZC_SLOTS_REMAP);
	return 0;
}

/* Registers t again; *ret_handle gets its handle on this session. */
static int
reattach_tensor(struct zc_conn *c, struct zc_tensor *t, bool may_be_new, uint64_t deadline,
    uint32_t *ret_handle)
{
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_REGISTER } };
	unsigned backoff = BACKOFF_FIRST_US;
	const struct zp_tensor_ok *ok;
	int fds[2], r;

	snprintf(m.u.tensor_register.name, sizeof(m.u.tensor_register.name), "%s", t->name);
	m.u.tensor_register.numel = t->numel;
	m.u.tensor_register.grad_dtype = (uint8_t)t->grad_dtype;
	m.u.tensor_register.param_dtype = (uint8_t)t->param_dtype;
	m.u.tensor_register.flags = t->param_offload ? ZP_TENSOR_PARAM_OFFLOAD : 0;
	/* A step the old session submitted still runs on it. */
	while ((r = zci_rpc_once(c, &m, ZP_TENSOR_OK, fds, deadline)) == -EAGAIN &&
	    zci_now_ns() < deadline)
		pause_before_retry(&backoff, deadline);
	if (r < 0)
		return r;
	ok = &c->msg->u.tensor_ok;
	if (ok->grad_bytes != t->grad_bytes || ok->param_bytes != t->param_bytes) {
		r = zci_seterr(c, -EBADMSG, "tensor '%s' came back with slots of %llu and %llu bytes, "
		    "not %zu and %zu", t->name, (unsigned long long)ok->grad_bytes,
		    (unsigned long long)ok->param_bytes, t->grad_bytes, t->param_bytes);
		goto out;
	}
	if (!ok->resumed && !may_be_new) {
		r = zci_seterr(c, -ESTALE, "zoffloadd lost the state of job '%s' rank %u: tensor "
		    "'%s' came back new after reconnecting to %s (the daemon restarted without "
		    "keeping it); nothing was re-initialized: resume the training from a checkpoint",
		    c->job_name, c->rank, t->name, c->path);
		goto out;
	}
	/* Files a fresh tensor did not have before are another tensor's: its writes are lost. */
	if (!ok->resumed) {
		uint64_t dev, ino;

		zci_file_id(fds[0], &dev, &ino);
		if ((dev != t->grad_dev || ino != t->grad_ino) && t->fresh) {
			r = zci_seterr(c, -ESTALE, "zoffloadd lost the state of job '%s' rank %u: "
			    "tensor '%s', whose initial values were being written, came back new in "
			    "other slots", c->job_name, c->rank, t->name);
			goto out;
		}
	}
	*ret_handle = ok->handle;
	t->last_step = ok->last_step;
	if (ok->resumed)
		t->fresh = false;
	r = let_go_of_driver(c, t, fds);
	if (r < 0)
		goto out;
	r = remap_slot(c, t->grad, t->grad_bytes, PROT_READ | PROT_WRITE, fds[0], &t->grad_dev,
	    &t->grad_ino, true);
	if (r == 0) {
		uint64_t dev, ino;

		zci_file_id(fds[1], &dev, &ino);
		if (dev != t->param_dev || ino != t->param_ino)
			r = zci_view_remap(t, fds[1]);
	}
	if (r == 0)
		r = remap_slot(c, t->param, t->param_bytes, PROT_READ, fds[1], &t->param_dev,
		    &t->param_ino, false);
	if (r < 0)
		zci_seterr(c, r, "map the new slots of '%s' in place: %s", t->name, strerror(-r));
out:
	close(fds[0]);
	close(fds[1]);
	return r;
}

/* The transfer window is the session's: a new one, holding what the old one held. */
static int
reopen_xfer(struct zc_conn *c, uint64_t deadline)
{
	struct zp_msg m = { .hdr = { .type = ZP_XFER_OPEN } };
	struct stat st;
	void *map;
	int fd, r;

	if (c->xfer == NULL)
		return 0;
	r = zci_rpc_once(c, &m, ZP_XFER_OK, &fd, deadline);
	if (r < 0)
		return r;
	if (c->msg->u.xfer_ok.bytes != c->xfer_bytes || fstat(fd, &st) != 0 ||
	    (uint64_t)st.st_size < c->xfer_bytes) {
		close(fd);
		return zci_seterr(c, -EBADMSG, "zoffloadd sent a transfer window of %llu bytes, not "
		    "%zu as before", (unsigned long long)c->msg->u.xfer_ok.bytes, c->xfer_bytes);
	}
	map = mmap(NULL, c->xfer_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	r = map == MAP_FAILED ? -errno : 0;
	close(fd);
	if (r < 0)
		return zci_seterr(c, r, "map the transfer window: %s", strerror(-r));
	memcpy(map, c->xfer, c->xfer_bytes);
	munmap(c->xfer, c->xfer_bytes);
	c->xfer = map;
	return 0;
}

/* Asks again for the params of every tensor whose fetch had no answer. */
static int
refetch(struct zc_conn *c, uint64_t deadline)
{
	struct zp_msg *m = calloc(1, sizeof(*m));
	int r = 0;

	if (m == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	m->hdr.type = ZP_PARAM_FETCH;
	for (uint32_t i = 0; i <= c->tensor_cap && r == 0; i++) {
		struct zc_tensor *t = i < c->tensor_cap ? c->tensors[i] : NULL;

		if (t != NULL && t->param_state == PARAM_FETCHING)
			m->u.handles.handles[m->u.handles.count++] = t->handle;
		if (m->u.handles.count == ZP_MAX_STEP_TENSORS ||
		    (i == c->tensor_cap && m->u.handles.count > 0)) {
			r = zci_send_once(c, m, deadline, -1);
			m->u.handles.count = 0;
		}
	}
	free(m);
	return r;
}

/* The handles in a request, to be rewritten after a reattach. */
static uint32_t *
request_handles(struct zp_msg *m, uint32_t *ret_count)
{
	*ret_count = 1;
	switch (m->hdr.type) {
	case ZP_TENSOR_UNREGISTER:
		return &m->u.tensor_handle.handle;
	case ZP_TENSOR_SET_STEP:
		return &m->u.tensor_step.handle;
	case ZP_TENSOR_READ:
	case ZP_TENSOR_WRITE:
		return &m->u.tensor_io.handle;
	case ZP_CKPT_WRITE:
	case ZP_CKPT_READ:
		return &m->u.ckpt_write.handle;
	case ZP_STEP_SUBMIT:
		*ret_count = m->u.step_submit.count;
		return m->u.step_submit.handles;
	case ZP_GRAD_PASS:
		*ret_count = m->u.grad_pass.count;
		return m->u.grad_pass.handles;
	case ZP_PARAM_FETCH:
	case ZP_PARAM_RELEASE:
		*ret_count = m->u.handles.count;
		return m->u.handles.handles;
	default:
		*ret_count = 0;
		return NULL;
	}
}

/* The old handles of inflight (indexed by old, the old table) to this session's. */
static void
rehandle_request(struct zp_msg *inflight, struct zc_tensor *const *old, uint32_t cap)
{
	uint32_t count, *h;

	if (inflight == NULL || (h = request_handles(inflight, &count)) == NULL)
		return;
	for (uint32_t i = 0; i < count; i++)
		h[i] = h[i] > 0 && h[i] <= cap && old[h[i] - 1] != NULL ? old[h[i] - 1]->handle : 0;
}

/*
 * Registers every tensor again, then puts the new handles and table in place
 * and rewrites inflight's and the pending sets' handles to them: all or
 * nothing, so that a reattach cut short starts again from the old table.
 */
static int
reattach_tensors(struct zc_conn *c, struct zp_msg *inflight, uint64_t deadline)
{
	uint32_t cap = c->tensor_cap, new_cap = 0, *handles;
	struct zc_tensor **table = NULL, **old = c->tensors;
	int r = 0;

	handles = calloc(cap > 0 ? cap : 1, sizeof(*handles));
	if (handles == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	for (uint32_t i = 0; i < cap; i++) {
		struct zc_tensor *t = old[i];

		if (t == NULL)
			continue;
		r = reattach_tensor(c, t, t->fresh || frees(inflight, t, i + 1), deadline,
		    &handles[i]);
		if (r < 0)
			goto out;
		if (handles[i] == 0 || handles[i] > (1u << 24)) {
			r = zci_seterr(c, -EBADMSG, "zoffloadd gave '%s' handle %u on reattach",
			    t->name, handles[i]);
			goto out;
		}
		new_cap = handles[i] > new_cap ? handles[i] : new_cap;
	}
	table = calloc(new_cap > 0 ? new_cap : 1, sizeof(*table));
	if (table == NULL) {
		r = zci_seterr(c, -ENOMEM, "out of memory");
		goto out;
	}
	for (uint32_t i = 0; i < cap; i++) {
		if (old[i] == NULL)
			continue;
		if (table[handles[i] - 1] != NULL) {
			r = zci_seterr(c, -EBADMSG, "zoffloadd gave '%s' and '%s' the same handle %u "
			    "on reattach", table[handles[i] - 1]->name, old[i]->name, handles[i]);
			goto out;
		}
		table[handles[i] - 1] = old[i];
	}
	for (uint32_t i = 0; i < cap; i++)
		if (old[i] != NULL)
			old[i]->handle = handles[i];
	rehandle_request(inflight, old, cap);
	c->hooks->sets_rehandle(c, old, cap);
	c->tensors = table;
	c->tensor_cap = new_cap;
	table = old;
out:
	free(table);
	free(handles);
	return r;
}

/* Connects, retrying until the earlier deadline; -ETIMEDOUT at the caller's. */
static int
reconnect_socket(struct zc_conn *c, uint64_t call_deadline, uint64_t rc_deadline)
{
	uint64_t deadline = earlier(call_deadline, rc_deadline);
	unsigned backoff = BACKOFF_FIRST_US;
	int r;

	for (;;) {
		r = connect_once(c, rc_deadline);
		if (r == 0)
			return 0;
		if (zci_now_ns() >= rc_deadline)
			return give_up(c, -ECONNRESET, "zoffloadd at %s closed the connection and did "
			    "not come back within the reconnect timeout of %d ms (last attempt: %s)",
			    c->path, c->reconnect_ms, c->err);
		if (zci_now_ns() >= deadline)
			return zci_seterr(c, -ETIMEDOUT, "reconnecting to zoffloadd at %s (%s)",
			    c->path, c->err);
		pause_before_retry(&backoff, deadline);
	}
}

int
zci_reconnect(struct zc_conn *c, struct zp_msg *inflight, uint64_t deadline)
{
	uint64_t rc_deadline = c->reconnect_ms < 0 ? ZCI_NO_DEADLINE :
	    c->lost_ns + (uint64_t)c->reconnect_ms * 1000000u;
	unsigned backoff = BACKOFF_FIRST_US, losses;
	bool attaching = false;
	int r;

	for (;;) {
		/* Once the tensors are being registered again, only the reconnect timeout stops it. */
		r = reconnect_socket(c, attaching ? ZCI_NO_DEADLINE : deadline, rc_deadline);
		if (r < 0)
			return r;
		attaching = true;
		losses = c->losses;
		r = c->job_open ? open_job(c, rc_deadline) : 0;
		if (r == 0)
			r = reattach_tensors(c, inflight, rc_deadline);
		if (r == 0)
			r = reopen_xfer(c, rc_deadline);
		if (r == 0)
			r = c->hooks->sets_resubmit(c, rc_deadline);
		if (r == 0)
			r = refetch(c, rc_deadline);
		if (r == 0)
			break;
		/*
		 * Gone again (the daemon went down once more, or is shutting down and
		 * refuses the job): connect again, after a pause, to its successor.
		 */
		if (c->losses != losses && c->dead == 0) {
			pause_before_retry(&backoff, rc_deadline);
			continue;
		}
		if (r == -ETIMEDOUT)
			return give_up(c, -ECONNRESET, "reconnected to zoffloadd at %s, but it did not "
			    "reattach job '%s' rank %u within the reconnect timeout of %d ms: %s",
			    c->path, c->job_name, c->rank, c->reconnect_ms, c->err);
		if (r == -ESTALE)
			return give_up(c, r, "%s", c->err);
		return give_up(c, r, "reconnected to zoffloadd at %s, but could not reattach job "
		    "'%s' rank %u: %s", c->path, c->job_name, c->rank, c->err);
	}
	c->lost = false;
	c->conn_stats.reconnects++;
	c->conn_stats.reconnect_ns += zci_now_ns() - c->lost_ns;
	return 0;
}

/* The retrying requests: each goes again on a new connection when this one goes. */

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

/*
 * zci_exchange, again on a new connection when this one goes before the reply:
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
		r = zci_exchange(c, req, reply_type, alt_type, fds, sendfd,
		    zci_deadline_after(c->timeout_ms));
		if (r >= 0 || !c->lost)
			return r;
	}
}

/* Request and reply of type reply_type or alt_type; the reply is in c->msg, its descriptors in fds. */
int
zci_rpc_either(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, uint16_t alt_type,
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
		r = zci_recv_one(c, fds, &nfds, deadline);
		if (r < 0 && c->lost)
			continue;
		if (r < 0)
			return r;
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
	}
	return 0;
}
