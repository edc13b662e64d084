/* The engine's reports, turned into replies to the session (lane) that asked. */
#include <errno.h>
#include <math.h>
#include <stdio.h>

#include "checkpoint.h"
#include "daemon.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "requests.h"
#include "session.h"

static const enum zp_step_status wire_status[] = {
	[ZE_STEP_APPLIED] = ZP_STEP_APPLIED,
	[ZE_STEP_SKIPPED_NONFINITE] = ZP_STEP_SKIPPED_NONFINITE,
	[ZE_STEP_FAILED] = ZP_STEP_FAILED,
};

static void
tensor_done(void *arg, uint32_t lane, uint64_t id, void *user, const struct ze_tensor_result *r)
{
	struct zd_tensor *t = user;
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_DONE, .request_id = id } };

	/*
	 * The job's too, here: once the rank died, step_done has no session to
	 * find the job by, and a reattach would be told an older step.
	 */
	if (r->status == ZE_STEP_APPLIED && r->step > t->job->last_step)
		t->job->last_step = r->step;
	if (t->session == NULL || t->session->id != lane)
		return;
	m.u.tensor_done.handle = t->handle;
	m.u.tensor_done.step = r->step;
	m.u.tensor_done.status = wire_status[r->status];
	m.u.tensor_done.error = ze_errno(r->error);
	(void)zd_session_send(t->session, &m, NULL, 0);
}

static void
step_done(void *arg, uint32_t lane, uint64_t id, const struct ze_step_result *r)
{
	struct zd_daemon *d = arg;
	struct zd_session *s = zd_session_by_id(d, lane);
	struct zp_msg m = { .hdr = { .type = ZP_STEP_DONE, .request_id = id } };
	struct zd_job *job;

	zd_stats_record(d, r);
	if (r->status == ZE_STEP_FAILED)
		log_warnx("session %u: step %llu failed: %s; %llu of %llu elements landed, a retry "
		    "of step %llu applies the rest", lane, (unsigned long long)r->step,
		    ze_strerror(r->error), (unsigned long long)r->landed,
		    (unsigned long long)r->params, (unsigned long long)r->step);
	if (s == NULL)
		return;
	s->steps_in_flight--;
	job = s->job;
	if (job != NULL) {
		if (r->status == ZE_STEP_APPLIED) {
			job->steps_applied++;
			if (r->step > job->last_step)
				job->last_step = r->step;
		} else if (r->status == ZE_STEP_SKIPPED_NONFINITE) {
			job->steps_skipped++;
		} else {
			job->steps_failed++;
		}
	}
	if (r->status == ZE_STEP_SKIPPED_NONFINITE)
		log_debug("session %u: step %llu skipped: non-finite gradients", s->id,
		    (unsigned long long)r->step);
	m.u.step_done.step = r->step;
	m.u.step_done.status = wire_status[r->status];
	m.u.step_done.error = ze_errno(r->error);
	m.u.step_done.grad_norm = r->grad_norm;
	m.u.step_done.latency_ns = zu_now_ns() - r->submit_ns;
	m.u.step_done.count = (uint32_t)r->count;
	(void)zd_session_send(s, &m, NULL, 0);
}

static void
io_done(void *arg, uint32_t lane, uint64_t id, enum ze_io kind, void *user, int result)
{
	struct zd_session *s = zd_session_by_id(arg, lane);
	struct zd_tensor *t = user;

	if (kind != ZE_IO_PARAM_RELEASE && zd_ckpt_io_done(arg, lane, id, user, result))
		return;
	if (s == NULL)
		return;
	if (result == 0) {
		struct zp_msg m = { .hdr = { .type = ZP_OK, .request_id = id } };

		(void)zd_session_send(s, &m, NULL, 0);
	} else if (kind == ZE_IO_PARAM_RELEASE) {
		zd_session_error(s, id, ze_errno(result), "writing released params to NVMe "
		    "failed: %s", ze_strerror(result));
	} else {
		zd_session_error(s, id, ze_errno(result), "tensor '%s': NVMe %s failed: %s",
		    t != NULL ? t->name : "?", kind == ZE_IO_READ ? "read" : "write",
		    ze_strerror(result));
	}
}

static void
param_ready(void *arg, uint32_t lane, uint64_t id, void *user, int result)
{
	struct zd_session *s = zd_session_by_id(arg, lane);
	struct zd_tensor *t = user;
	struct zp_msg m = { .hdr = { .type = ZP_PARAM_READY, .request_id = id } };

	if (s == NULL || t == NULL || t->session != s)
		return;
	m.u.param_ready.handle = t->handle;
	m.u.param_ready.error = ze_errno(result);
	(void)zd_session_send(s, &m, NULL, 0);
}

static void
grad_done(void *arg, uint32_t lane, uint64_t id, int result, const struct ze_grad_partial *p)
{
	struct zd_session *s = zd_session_by_id(arg, lane);
	struct zp_msg m = { .hdr = { .type = ZP_GRAD_PARTIAL, .request_id = id } };

	if (s == NULL)
		return;
	s->steps_in_flight--;
	if (result < 0) {
		zd_session_error(s, id, ze_errno(result), "gradient pass failed: %s",
		    ze_strerror(result));
		return;
	}
	m.u.grad_partial.sumsq = p->sumsq;
	m.u.grad_partial.nonfinite = p->nonfinite;
	m.u.grad_partial.elements = p->elements;
	(void)zd_session_send(s, &m, NULL, 0);
}

const struct ze_callbacks zd_engine_callbacks = {
	.grad_done = grad_done,
	.tensor_done = tensor_done,
	.step_done = step_done,
	.io_done = io_done,
	.param_ready = param_ready,
};
