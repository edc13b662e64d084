/* What the daemon does with each request, once it has been decoded and validated. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "build_config.h"
#include "daemon.h"
#include "log.h"

static void
reply_ok(struct zd_session *s, uint64_t request_id)
{
	struct zp_msg m = { .hdr = { .type = ZP_OK, .request_id = request_id } };

	(void)zd_session_send(s, &m, NULL, 0);
}

static void
reply_json(struct zd_session *s, uint64_t request_id, char *text)
{
	struct zp_msg m = { .hdr = { .type = ZP_JSON, .request_id = request_id } };
	size_t len;

	if (text == NULL) {
		zd_session_error(s, request_id, -ENOMEM, "out of memory");
		return;
	}
	len = strlen(text);
	if (len > ZP_MAX_PAYLOAD) {
		zd_session_error(s, request_id, -EMSGSIZE, "reply of %zu bytes is too large", len);
	} else {
		m.u.json.text = text;
		m.u.json.len = (uint32_t)len;
		(void)zd_session_send(s, &m, NULL, 0);
	}
	free(text);
}

static void
handle_hello(struct zd_session *s, const struct zp_msg *msg)
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
	(void)zd_session_send(s, &m, NULL, 0);
}

static void
handle_tensor_register(struct zd_session *s, const struct zp_msg *msg)
{
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_OK, .request_id = msg->hdr.request_id } };
	char err[ZP_ERRMSG_MAX + 1];
	struct zd_tensor *t;
	bool resumed;
	int fds[2], r;

	r = zd_tensor_create(s, &msg->u.tensor_register, &t, &resumed, err, sizeof(err));
	if (r < 0) {
		zd_session_error(s, msg->hdr.request_id, r, "%s", err);
		log_info("session %u: %s", s->id, err);
		return;
	}
	m.u.tensor_ok.handle = t->handle;
	/* The client maps what it uses; the memfds are page-rounded. */
	m.u.tensor_ok.grad_bytes = t->numel * zk_dtype_size(t->grad_dtype);
	m.u.tensor_ok.param_bytes = t->numel * zk_dtype_size(t->param_dtype);
	m.u.tensor_ok.resumed = resumed;
	m.u.tensor_ok.last_step = t->last_step;
	fds[0] = t->grad_slot.fd;
	fds[1] = t->param_slot.fd;
	(void)zd_session_send(s, &m, fds, 2);
}

static struct zd_tensor *
find_tensor(struct zd_session *s, uint64_t request_id, uint32_t handle)
{
	struct zd_tensor *t = zd_session_tensor(s, handle);

	if (t == NULL)
		zd_session_error(s, request_id, -ENOENT, "no tensor with handle %u on this connection",
		    handle);
	else if (t->busy) {
		zd_session_error(s, request_id, -EBUSY, "tensor '%s' is in a step", t->name);
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

	if (t == NULL)
		return;
	t->last_step = req->step;
	if (t->job != NULL && req->step > t->job->last_step)
		t->job->last_step = req->step;
	reply_ok(s, msg->hdr.request_id);
}

static void
handle_xfer_open(struct zd_session *s, const struct zp_msg *msg)
{
	struct zp_msg m = { .hdr = { .type = ZP_XFER_OK, .request_id = msg->hdr.request_id } };
	int r;

	if (s->xfer.map == NULL) {
		r = zd_shm_create(s->daemon, "zoffload-xfer", s->daemon->cfg.xfer_window, false,
		    &s->xfer);
		if (r < 0) {
			zd_session_error(s, msg->hdr.request_id, r,
			    "cannot create the transfer window: %s",
			    r == -ENOSPC ? "shared-memory budget exhausted" : strerror(-r));
			return;
		}
	}
	m.u.xfer_ok.bytes = s->xfer.bytes;
	(void)zd_session_send(s, &m, &s->xfer.fd, 1);
}

static float *
state_array(struct zd_tensor *t, uint8_t which)
{
	switch (which) {
	case ZP_STATE_MASTER: return t->master;
	case ZP_STATE_EXP_AVG: return t->m;
	default: return t->v;
	}
}

/* Copies between a tensor's state and the transfer window; offsets come from the message only. */
static void
handle_tensor_io(struct zd_session *s, const struct zp_msg *msg)
{
	const struct zp_tensor_io *io = &msg->u.tensor_io;
	struct zd_tensor *t;
	float *state;

	if (s->xfer.map == NULL) {
		zd_session_error(s, msg->hdr.request_id, -ENXIO, "no transfer window: send XFER_OPEN first");
		return;
	}
	t = find_tensor(s, msg->hdr.request_id, io->handle);
	if (t == NULL)
		return;
	if (io->offset > t->numel || io->count > t->numel - io->offset) {
		zd_session_error(s, msg->hdr.request_id, -ERANGE,
		    "tensor '%s': elements %llu..%llu are outside its %llu", t->name,
		    (unsigned long long)io->offset, (unsigned long long)(io->offset + io->count),
		    (unsigned long long)t->numel);
		return;
	}
	if (io->count * sizeof(float) > s->xfer.bytes) {
		zd_session_error(s, msg->hdr.request_id, -EMSGSIZE,
		    "%llu elements do not fit the %zu-byte transfer window",
		    (unsigned long long)io->count, s->xfer.bytes);
		return;
	}
	if (msg->hdr.type == ZP_TENSOR_WRITE && io->state == ZP_STATE_MASTER && !t->param_resident) {
		zd_session_error(s, msg->hdr.request_id, -EAGAIN, "tensor '%s': its params were "
		    "released; fetch them before writing master weights", t->name);
		return;
	}
	/* On NVMe: chunk by chunk through staging buffers; the reply comes when done. */
	if (t->on_nvme) {
		zd_tier_xfer(s, t, msg);
		return;
	}
	state = state_array(t, io->state) + io->offset;
	if (msg->hdr.type == ZP_TENSOR_WRITE) {
		memcpy(state, s->xfer.map, io->count * sizeof(float));
		/* The param slot always mirrors the master weights. */
		if (io->state == ZP_STATE_MASTER)
			zd_tensor_write_param(t, io->offset, io->count, state);
	} else {
		memcpy(s->xfer.map, state, io->count * sizeof(float));
	}
	reply_ok(s, msg->hdr.request_id);
}

void
zd_handle_request(struct zd_session *s, const struct zp_msg *msg)
{
	uint64_t id = msg->hdr.request_id;

	if (!s->hello_done && msg->hdr.type != ZP_HELLO) {
		zd_session_error(s, id, -EPROTO, "%s before HELLO", zp_type_name(msg->hdr.type));
		s->closing = true;
		return;
	}
	if (s->daemon->draining && (msg->hdr.type == ZP_STEP_SUBMIT ||
	    msg->hdr.type == ZP_TENSOR_REGISTER || msg->hdr.type == ZP_JOB_OPEN)) {
		zd_session_error(s, id, -ESHUTDOWN, "zoffloadd is shutting down");
		return;
	}
	switch (msg->hdr.type) {
	case ZP_HELLO:
		if (s->hello_done) {
			zd_session_error(s, id, -EPROTO, "HELLO sent twice");
			s->closing = true;
			return;
		}
		handle_hello(s, msg);
		break;
	case ZP_PING: {
		struct zp_msg m = { .hdr = { .type = ZP_PONG, .request_id = id } };

		(void)zd_session_send(s, &m, NULL, 0);
		break;
	}
	case ZP_JOB_OPEN:
		handle_job_open(s, msg);
		break;
	case ZP_JOB_CLOSE:
		if (s->job == NULL) {
			zd_session_error(s, id, -ENOTCONN, "no job is open on this connection");
			return;
		}
		if (!TAILQ_EMPTY(&s->inflight)) {
			zd_session_error(s, id, -EBUSY, "steps are still in flight; wait for them first");
			return;
		}
		zd_job_detach(s, false);
		reply_ok(s, id);
		break;
	case ZP_TENSOR_REGISTER:
		handle_tensor_register(s, msg);
		break;
	case ZP_TENSOR_UNREGISTER:
		handle_tensor_unregister(s, msg);
		break;
	case ZP_TENSOR_SET_STEP:
		handle_tensor_set_step(s, msg);
		break;
	case ZP_XFER_OPEN:
		handle_xfer_open(s, msg);
		break;
	case ZP_TENSOR_WRITE:
	case ZP_TENSOR_READ:
		handle_tensor_io(s, msg);
		break;
	case ZP_STEP_SUBMIT:
		zd_step_submit(s, msg);
		break;
	case ZP_JOB_DROP: {
		char err[ZP_ERRMSG_MAX + 1];
		int r = zd_job_drop(s, msg->u.job_drop.job_name, err, sizeof(err));

		if (r < 0)
			zd_session_error(s, id, r, "%s", err);
		else
			reply_ok(s, id);
		break;
	}
	case ZP_PARAM_FETCH:
		zd_tier_param_fetch(s, msg);
		break;
	case ZP_PARAM_RELEASE:
		zd_tier_param_release(s, msg);
		break;
	case ZP_STATS:
		reply_json(s, id, zd_stats_json(s->daemon));
		break;
	case ZP_JOBS:
		reply_json(s, id, zd_jobs_json(s->daemon));
		break;
	default:
		zd_session_error(s, id, -EBADMSG, "%s is not a request", zp_type_name(msg->hdr.type));
		s->closing = true;
		break;
	}
}
