/*
 * What the daemon does with each request: one table (requests[]) says, for every message
 * type a client may send, how many descriptors it carries, whether a drain refuses it and
 * which handler takes it; zd_request_message checks a message against its row before the
 * handler sees it.  The session transport hands every decoded message here (on_message).
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "build_config.h"
#include "checkpoint.h"
#include "closer.h"
#include "daemon.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "requests.h"
#include "session.h"
#include "uid.h"

static void
reply_ok(struct zd_session *s, uint64_t request_id)
{
	struct zp_msg m = { .hdr = { .type = ZP_OK, .request_id = request_id } };

	(void)zd_session_send(s, &m, NULL, 0);
}

/* A reply too large for one datagram goes in a sealed memfd the client reads and closes. */
static int
json_memfd(const char *text, size_t len)
{
	int fd = memfd_create("zoffload-json", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	size_t off = 0;

	if (fd < 0)
		return -errno;
	while (off < len) {
		ssize_t n = write(fd, text + off, len - off);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			int r = n < 0 ? -errno : -EIO;

			close(fd);
			return r;
		}
		off += (size_t)n;
	}
	/* What the client maps stays what we wrote. */
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
		int r = -errno;

		close(fd);
		return r;
	}
	return fd;
}

static void
reply_json(struct zd_session *s, uint64_t request_id, char *text)
{
	struct zp_msg m = { .hdr = { .type = ZP_JSON, .request_id = request_id } };
	size_t len;
	int fd;

	if (text == NULL) {
		zd_session_error(s, request_id, -ENOMEM, "out of memory");
		return;
	}
	len = strlen(text);
	if (len <= ZP_MAX_PAYLOAD) {
		m.u.json.text = text;
		m.u.json.len = (uint32_t)len;
		(void)zd_session_send(s, &m, NULL, 0);
	} else if (len > ZP_MAX_XFER) {
		zd_session_error(s, request_id, -EMSGSIZE, "reply of %zu bytes is too large", len);
	} else if ((fd = json_memfd(text, len)) < 0) {
		zd_session_error(s, request_id, fd, "cannot hand over a reply of %zu bytes: %s",
		    len, strerror(-fd));
	} else {
		m.hdr.type = ZP_JSON_FD;
		m.u.json_fd.bytes = len;
		(void)zd_session_send_blob(s, &m, fd, len);
		close(fd);
	}
	free(text);
}

static void
hello_ok(struct zd_session *s, const struct zp_msg *msg)
{
	struct zp_msg m = { .hdr = { .type = ZP_HELLO_OK, .request_id = msg->hdr.request_id } };

	snprintf(s->name, sizeof(s->name), "%s", msg->u.hello.client_name);
	s->hello_done = true;
	m.u.hello_ok.session_id = s->id;
	m.u.hello_ok.uid = (uint32_t)s->uid;
	snprintf(m.u.hello_ok.daemon_version, sizeof(m.u.hello_ok.daemon_version), "%s",
	    ZOFFLOAD_VERSION);
	(void)zd_session_send(s, &m, NULL, 0);
}

static void
handle_job_open(struct zd_session *s, const struct zp_msg *msg)
{
	const struct zp_job_open *req = &msg->u.job_open;
	struct zp_msg m = { .hdr = { .type = ZP_JOB_OK, .request_id = msg->hdr.request_id } };
	char err[ZP_ERRMSG_MAX + 1];
	int r;

	r = zd_job_attach(s, req, err, sizeof(err));
	if (r < 0) {
		zd_session_error(s, msg->hdr.request_id, r, "%s", err);
		return;
	}
	m.u.job_ok.job_id = s->job->id;
	m.u.job_ok.last_step = s->job->last_step;
	snprintf(m.u.job_ok.state_format, sizeof(m.u.job_ok.state_format), "%s",
	    zk_state_format_name((enum zk_state_format)s->job->state_format));
	(void)zd_session_send(s, &m, NULL, 0);
}

static void
handle_tensor_register(struct zd_session *s, const struct zp_msg *msg)
{
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_OK, .request_id = msg->hdr.request_id } };
	char err[ZP_ERRMSG_MAX + 1];
	struct zd_tensor *t;
	bool resumed;
	int r;

	r = zd_tensor_create(s, &msg->u.tensor_register, &t, &resumed, err, sizeof(err));
	if (r < 0) {
		zd_session_error(s, msg->hdr.request_id, r, "%s", err);
		log_info("session %u: %s", s->id, err);
		return;
	}
	m.u.tensor_ok.handle = t->handle;
	/* The client maps what it uses; the memfds are page-rounded. */
	m.u.tensor_ok.grad_bytes = ze_tensor_numel(t->et) *
	    zk_dtype_size(ze_tensor_grad_dtype(t->et));
	m.u.tensor_ok.param_bytes = ze_tensor_numel(t->et) *
	    zk_dtype_size(ze_tensor_param_dtype(t->et));
	m.u.tensor_ok.resumed = resumed;
	m.u.tensor_ok.last_step = ze_tensor_last_step(t->et);
	(void)zd_session_send_slots(s, &m, t->handle);
}

static struct zd_tensor *
find_tensor(struct zd_session *s, uint64_t request_id, uint32_t handle)
{
	struct zd_tensor *t = zd_session_tensor(s, handle);

	if (t == NULL)
		zd_session_error(s, request_id, -ENOENT, "no tensor with handle %u on this connection",
		    handle);
	else if (ze_tensor_busy(t->et)) {
		zd_session_error(s, request_id, -EBUSY, "tensor '%s' is in a step", t->name);
		t = NULL;
	} else if (zd_ckpt_in_transfer(s->daemon, t->et)) {
		zd_session_error(s, request_id, -EBUSY, "tensor '%s' is in a checkpoint transfer; "
		    "wait for its answer first", t->name);
		t = NULL;
	}
	return t;
}

static void
handle_tensor_unregister(struct zd_session *s, const struct zp_msg *msg)
{
	struct zd_tensor *t = find_tensor(s, msg->hdr.request_id, msg->u.tensor_handle.handle);

	if (t == NULL)
		return;
	s->tensors[t->handle - 1] = NULL;
	zd_tensor_release(s->daemon, t);
	reply_ok(s, msg->hdr.request_id);
}

/*
 * A client that wrote back saved state says which step it is at; steps at or below it are
 * refused from then on, as for state the daemon stepped itself.  The job's last step only
 * rises: other ranks may be further on.
 */
static void
handle_tensor_set_step(struct zd_session *s, const struct zp_msg *msg)
{
	const struct zp_tensor_step *req = &msg->u.tensor_step;
	struct zd_tensor *t = find_tensor(s, msg->hdr.request_id, req->handle);
	int r;

	if (t == NULL)
		return;
	r = ze_tensor_set_step(t->et, req->step);
	if (r < 0) {
		zd_session_error(s, msg->hdr.request_id, r, "tensor '%s': %s", t->name,
		    ze_strerror(r));
		return;
	}
	if (req->step > t->job->last_step)
		t->job->last_step = req->step;
	reply_ok(s, msg->hdr.request_id);
}

static void
handle_xfer_open(struct zd_session *s, const struct zp_msg *msg)
{
	struct zp_msg m = { .hdr = { .type = ZP_XFER_OK, .request_id = msg->hdr.request_id } };
	int r;

	if (s->xfer.map == NULL) {
		struct zd_daemon *d = s->daemon;
		char err[ZP_ERRMSG_MAX + 1];
		uint64_t bytes = (d->cfg.xfer_window + 4095) / 4096 * 4096;

		/* One descriptor and the window's pages, the uid's. */
		r = zd_uid_charge(d, s->uid_usage, 1, bytes, 0, err, sizeof(err));
		if (r < 0) {
			zd_session_error(s, msg->hdr.request_id, r, "cannot create the transfer "
			    "window: %s", err);
			return;
		}
		r = ze_shm_create(d->engine, "zoffload-xfer", bytes, false, &s->xfer);
		if (r < 0) {
			zd_uid_refund(d, s->uid_usage, 1, bytes, 0);
			zd_session_error(s, msg->hdr.request_id, r,
			    "cannot create the transfer window: %s",
			    r == -ENOSPC ? "shared-memory budget exhausted" : strerror(-r));
			return;
		}
	}
	m.u.xfer_ok.bytes = s->xfer.bytes;
	(void)zd_session_send_xfer(s, &m);
}

/* Copies between a tensor's state and the transfer window; offsets come from the message only. */
static void
handle_tensor_io(struct zd_session *s, const struct zp_msg *msg)
{
	const struct zp_tensor_io *io = &msg->u.tensor_io;
	bool write = msg->hdr.type == ZP_TENSOR_WRITE;
	struct zd_tensor *t;
	uint64_t numel;
	int r;

	if (s->xfer.map == NULL) {
		zd_session_error(s, msg->hdr.request_id, -ENXIO, "no transfer window: send XFER_OPEN first");
		return;
	}
	t = find_tensor(s, msg->hdr.request_id, io->handle);
	if (t == NULL)
		return;
	numel = ze_tensor_numel(t->et);
	if (io->offset > numel || io->count > numel - io->offset) {
		zd_session_error(s, msg->hdr.request_id, -ERANGE,
		    "tensor '%s': elements %llu..%llu are outside its %llu", t->name,
		    (unsigned long long)io->offset, (unsigned long long)(io->offset + io->count),
		    (unsigned long long)numel);
		return;
	}
	if (io->count * sizeof(float) > s->xfer.bytes) {
		zd_session_error(s, msg->hdr.request_id, -EMSGSIZE,
		    "%llu elements do not fit the %zu-byte transfer window",
		    (unsigned long long)io->count, s->xfer.bytes);
		return;
	}
	r = ze_tensor_io(t->et, write, (enum ze_state)io->state, io->offset, io->count,
	    s->xfer.map, s->id, msg->hdr.request_id);
	if (r == -EAGAIN)
		zd_session_error(s, msg->hdr.request_id, r, "tensor '%s': its params were "
		    "released; fetch them before writing master weights", t->name);
	else if (r < 0)
		zd_session_error(s, msg->hdr.request_id, ze_errno(r), "tensor '%s': %s", t->name,
		    ze_strerror(r));
	else if (r > 0)
		reply_ok(s, msg->hdr.request_id);
	/* 0: on NVMe, chunk by chunk; the reply comes when the engine reports. */
}

static void
send_step_done(struct zd_session *s, uint64_t request_id, const struct ze_step_result *r,
    enum zp_step_status status, int error)
{
	struct zp_msg m = { .hdr = { .type = ZP_STEP_DONE, .request_id = request_id } };

	m.u.step_done.step = r->step;
	m.u.step_done.status = status;
	m.u.step_done.error = ze_errno(error);
	m.u.step_done.grad_norm = r->grad_norm;
	m.u.step_done.latency_ns = r->submit_ns != 0 ? zu_now_ns() - r->submit_ns : 0;
	m.u.step_done.count = (uint32_t)r->count;
	(void)zd_session_send(s, &m, NULL, 0);
}

/* A set that cannot run is answered at once, so a client that does not wait still learns why. */
static void
refuse_step(struct zd_session *s, const struct zp_msg *msg, int error, const char *text)
{
	struct ze_step_result r = { .step = msg->u.step_submit.step, .grad_norm = NAN,
		.count = msg->u.step_submit.count };

	zd_session_error(s, msg->hdr.request_id, ze_errno(error), "%s", text);
	send_step_done(s, msg->hdr.request_id, &r, ZP_STEP_FAILED, error);
}

static void
handle_step_submit(struct zd_session *s, const struct zp_msg *msg)
{
	const struct zp_step_submit *req = &msg->u.step_submit;
	char err[ZP_ERRMSG_MAX + 1];
	struct ze_tensor **ts;
	int r;

	if (s->job == NULL) {
		refuse_step(s, msg, -ENOTCONN, "open a job before submitting steps");
		return;
	}
	ts = calloc(req->count, sizeof(*ts));
	if (ts == NULL) {
		refuse_step(s, msg, -ENOMEM, "out of memory");
		return;
	}
	for (uint32_t i = 0; i < req->count; i++) {
		struct zd_tensor *t = zd_session_tensor(s, req->handles[i]);

		if (t == NULL) {
			snprintf(err, sizeof(err), "step %llu: no tensor with handle %u on this "
			    "connection", (unsigned long long)req->step, req->handles[i]);
			refuse_step(s, msg, -ENOENT, err);
			free(ts);
			return;
		}
		if (zd_ckpt_in_transfer(s->daemon, t->et)) {
			snprintf(err, sizeof(err), "step %llu: tensor '%s' is in a checkpoint "
			    "transfer", (unsigned long long)req->step, t->name);
			refuse_step(s, msg, -EBUSY, err);
			free(ts);
			return;
		}
		ts[i] = t->et;
	}
	/* Counted first: the engine may report a step that has nothing left to do at once. */
	s->steps_in_flight++;
	r = ze_step_submit(s->daemon->engine, &(struct ze_step){
		.lane = s->id,
		.id = msg->hdr.request_id,
		.hp = {
			.optim = (enum zk_optim)req->optim,
			.lr = req->lr,
			.beta1 = req->beta1,
			.beta2 = req->beta2,
			.eps = req->eps,
			.weight_decay = req->weight_decay,
			.lr_decay = req->lr_decay,
			.step = req->step,
			.bias_correction = (req->flags & ZP_STEP_NO_BIAS_CORRECTION) == 0,
			.grad_scale = req->grad_scale,
			.clip_coef = 1.0,
		},
		.check_finite = (req->flags & ZP_STEP_CHECK_FINITE) != 0,
		.max_grad_norm = (req->flags & ZP_STEP_CLIP_COEF) ? 0 : req->max_grad_norm,
		.clip_coef = (req->flags & ZP_STEP_CLIP_COEF) ? req->max_grad_norm : 0,
		.count = req->count,
		.tensors = ts,
	}, err, sizeof(err));
	free(ts);
	if (r < 0) {
		s->steps_in_flight--;
		refuse_step(s, msg, r, err);
	}
}

/* The first phase of a step clipped across sets: GRAD_PARTIAL comes when the pass is done. */
static void
handle_grad_pass(struct zd_session *s, const struct zp_msg *msg)
{
	const struct zp_grad_pass *req = &msg->u.grad_pass;
	char err[ZP_ERRMSG_MAX + 1];
	struct ze_tensor **ts;
	int r;

	ts = calloc(req->count, sizeof(*ts));
	if (ts == NULL) {
		zd_session_error(s, msg->hdr.request_id, -ENOMEM, "out of memory");
		return;
	}
	for (uint32_t i = 0; i < req->count; i++) {
		struct zd_tensor *t = zd_session_tensor(s, req->handles[i]);

		if (t == NULL) {
			zd_session_error(s, msg->hdr.request_id, -ENOENT, "GRAD_PASS: no tensor with "
			    "handle %u on this connection", req->handles[i]);
			free(ts);
			return;
		}
		ts[i] = t->et;
	}
	s->steps_in_flight++;
	r = ze_grad_pass(s->daemon->engine, s->id, msg->hdr.request_id, req->grad_scale, ts,
	    req->count, err, sizeof(err));
	free(ts);
	if (r < 0) {
		s->steps_in_flight--;
		zd_session_error(s, msg->hdr.request_id, ze_errno(r), "GRAD_PASS: %s", err);
	}
}

static void
send_param_ready(struct zd_session *s, uint64_t request_id, uint32_t handle, int error)
{
	struct zp_msg m = { .hdr = { .type = ZP_PARAM_READY, .request_id = request_id } };

	m.u.param_ready.handle = handle;
	m.u.param_ready.error = ze_errno(error);
	(void)zd_session_send(s, &m, NULL, 0);
}

/* One PARAM_READY per handle: now, or when the engine has read it from NVMe. */
static void
handle_param_fetch(struct zd_session *s, const struct zp_msg *msg)
{
	const struct zp_handles *h = &msg->u.handles;

	for (uint32_t i = 0; i < h->count; i++) {
		struct zd_tensor *t = zd_session_tensor(s, h->handles[i]);
		int r = t == NULL ? -ENOENT : ze_param_fetch(t->et, s->id, msg->hdr.request_id);

		if (r != 0)
			send_param_ready(s, msg->hdr.request_id, h->handles[i], r > 0 ? 0 : r);
	}
}

static void
handle_param_release(struct zd_session *s, const struct zp_msg *msg)
{
	const struct zp_handles *h = &msg->u.handles;
	struct ze_tensor **ts;
	int r;

	/* Check every handle first: a release is all or nothing. */
	for (uint32_t i = 0; i < h->count; i++) {
		struct zd_tensor *t = zd_session_tensor(s, h->handles[i]);

		if (t == NULL || ze_tensor_busy(t->et) || zd_ckpt_in_transfer(s->daemon, t->et)) {
			zd_session_error(s, msg->hdr.request_id, t == NULL ? -ENOENT : -EBUSY,
			    "PARAM_RELEASE: tensor handle %u %s", h->handles[i], t != NULL ?
			    "is in a step or transfer" : "is not on this connection");
			return;
		}
	}
	ts = calloc(h->count, sizeof(*ts));
	if (ts == NULL) {
		zd_session_error(s, msg->hdr.request_id, -ENOMEM, "out of memory");
		return;
	}
	for (uint32_t i = 0; i < h->count; i++)
		ts[i] = zd_session_tensor(s, h->handles[i])->et;
	r = ze_param_release(s->daemon->engine, ts, h->count, s->id, msg->hdr.request_id);
	free(ts);
	if (r > 0)
		reply_ok(s, msg->hdr.request_id);
	else if (r < 0)
		zd_session_error(s, msg->hdr.request_id, ze_errno(r), "writing released params "
		    "to NVMe failed: %s", ze_strerror(r));
}

static void
handle_hello(struct zd_session *s, const struct zp_msg *msg)
{
	if (s->hello_done) {
		zd_session_error(s, msg->hdr.request_id, -EPROTO, "HELLO sent twice");
		s->closing = true;
		return;
	}
	hello_ok(s, msg);
}

static void
handle_ping(struct zd_session *s, const struct zp_msg *msg)
{
	struct zp_msg m = { .hdr = { .type = ZP_PONG, .request_id = msg->hdr.request_id } };

	(void)zd_session_send(s, &m, NULL, 0);
}

static void
handle_job_close(struct zd_session *s, const struct zp_msg *msg)
{
	uint64_t id = msg->hdr.request_id;

	if (s->job == NULL) {
		zd_session_error(s, id, -ENOTCONN, "no job is open on this connection");
		return;
	}
	if (s->steps_in_flight > 0) {
		zd_session_error(s, id, -EBUSY, "steps are still in flight; wait for them first");
		return;
	}
	for (uint32_t i = 0; i < s->ntensor_slots; i++)
		if (s->tensors[i] != NULL && zd_ckpt_in_transfer(s->daemon, s->tensors[i]->et)) {
			zd_session_error(s, id, -EBUSY, "tensor '%s' is in a checkpoint transfer; "
			    "wait for its answer first", s->tensors[i]->name);
			return;
		}
	zd_job_detach(s, false);
	reply_ok(s, id);
}

static void
handle_job_drop(struct zd_session *s, const struct zp_msg *msg)
{
	char err[ZP_ERRMSG_MAX + 1];
	int r = zd_job_drop(s, msg->u.job_drop.job_name, err, sizeof(err));

	if (r < 0)
		zd_session_error(s, msg->hdr.request_id, r, "%s", err);
	else
		reply_ok(s, msg->hdr.request_id);
}

static void
handle_stats(struct zd_session *s, const struct zp_msg *msg)
{
	reply_json(s, msg->hdr.request_id, zd_stats_json_as(s->daemon, s->uid_usage));
}

static void
handle_jobs(struct zd_session *s, const struct zp_msg *msg)
{
	reply_json(s, msg->hdr.request_id, zd_jobs_json_as(s->daemon, s->uid_usage));
}

/*
 * Every request.  A drain refuses what would start new work (a job, a tensor, a step);
 * the rest still runs, so that a client can finish, checkpoint and close what it has
 * while the daemon waits for it.  Replies built from the whole daemon (STATS, JOBS: 130 KB
 * with 300 jobs) end the session's burst of reads: pipelined, they cost the others one
 * each per wakeup, not 32.
 */
const struct zd_request_row zd_requests[] = {
	{ ZP_HELLO, 0, false, false, handle_hello, NULL },
	{ ZP_PING, 0, false, false, handle_ping, NULL },
	{ ZP_JOB_OPEN, 0, true, false, handle_job_open, NULL },
	{ ZP_JOB_CLOSE, 0, false, false, handle_job_close, NULL },
	{ ZP_TENSOR_REGISTER, 0, true, false, handle_tensor_register, NULL },
	{ ZP_TENSOR_UNREGISTER, 0, false, false, handle_tensor_unregister, NULL },
	{ ZP_TENSOR_SET_STEP, 0, false, false, handle_tensor_set_step, NULL },
	{ ZP_XFER_OPEN, 0, false, false, handle_xfer_open, NULL },
	{ ZP_TENSOR_WRITE, 0, false, false, handle_tensor_io, NULL },
	{ ZP_TENSOR_READ, 0, false, false, handle_tensor_io, NULL },
	{ ZP_STEP_SUBMIT, 0, true, false, handle_step_submit, NULL },
	{ ZP_GRAD_PASS, 0, false, false, handle_grad_pass, NULL },
	{ ZP_JOB_DROP, 0, false, false, handle_job_drop, NULL },
	{ ZP_PARAM_FETCH, 0, false, false, handle_param_fetch, NULL },
	{ ZP_PARAM_RELEASE, 0, false, false, handle_param_release, NULL },
	{ ZP_STATS, 0, false, true, handle_stats, NULL },
	{ ZP_JOBS, 0, false, true, handle_jobs, NULL },
	{ ZP_CKPT_WRITE, 1, false, false, NULL, zd_ckpt_handle_transfer },
	{ ZP_CKPT_READ, 1, false, false, NULL, zd_ckpt_handle_transfer },
	{ ZP_CKPT_RELEASE, 1, false, false, NULL, zd_ckpt_handle_release },
};
const size_t zd_nrequests = sizeof(zd_requests) / sizeof(zd_requests[0]);

const struct zd_request_row *
zd_request_row(uint16_t type)
{
	for (size_t i = 0; i < zd_nrequests; i++)
		if (zd_requests[i].type == type)
			return &zd_requests[i];
	return NULL;
}

/* Answered with an error, its descriptors to the closer, and the connection ends. */
static void
drop(struct zd_session *s, const struct zp_msg *msg, const int *fds, unsigned nfds, int code,
    const char *why)
{
	zd_closer_close_fds(s->daemon, s->uid_usage, fds, nfds);
	zd_session_error(s, msg->hdr.request_id, code, "%s", why);
	log_info("session %u (pid %d): dropped: %s", s->id, (int)s->pid, why);
	s->closing = true;
}

bool
zd_request_message(struct zd_session *s, const struct zp_msg *msg, const int *fds,
    unsigned nfds)
{
	const struct zd_request_row *row = zd_request_row(msg->hdr.type);
	uint64_t id = msg->hdr.request_id;
	char why[ZP_ERRMSG_MAX + 1];

	if (row == NULL) {
		snprintf(why, sizeof(why), "%s is not a request", zp_type_name(msg->hdr.type));
		drop(s, msg, fds, nfds, -EBADMSG, why);
		return false;
	}
	/* Descriptors come only with the requests that carry them, exactly. */
	if (nfds != row->fds) {
		snprintf(why, sizeof(why), "%s carries %u file descriptors, not %u",
		    zp_type_name(msg->hdr.type), nfds, row->fds);
		drop(s, msg, fds, nfds, -EBADMSG, why);
		return false;
	}
	/* The message after a CKPT_RELEASE: the client let go of its copy first. */
	zd_ckpt_release_held(s);
	if (!s->hello_done && msg->hdr.type != ZP_HELLO) {
		zd_closer_close_fds(s->daemon, s->uid_usage, fds, nfds);
		zd_session_error(s, id, -EPROTO, "%s before HELLO", zp_type_name(msg->hdr.type));
		s->closing = true;
		return false;
	}
	if (s->daemon->draining && row->refused_draining) {
		zd_closer_close_fds(s->daemon, s->uid_usage, fds, nfds);
		zd_session_error(s, id, -ESHUTDOWN, "zoffloadd is shutting down");
		return false;
	}
	/* The handler owns the descriptor from here. */
	if (row->fds > 0)
		row->handle_fd(s, msg, fds[0]);
	else
		row->handle(s, msg);
	return row->ends_burst;
}

void
zd_request_close(struct zd_session *s)
{
	zd_ckpt_session_end(s);
	/* A connection that goes without JOB_CLOSE is a rank that died: keep its state a while. */
	zd_job_detach(s, true);
}

const struct zd_session_hooks zd_request_hooks = {
	.on_message = zd_request_message,
	.on_close = zd_request_close,
};
