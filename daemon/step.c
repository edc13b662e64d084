/* The loop's side of a step: checking a submission, handing it to the stepper, reporting back. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "log.h"
#include "stepper.h"

static void
send_step_done(struct zd_session *s, const struct zd_batch *b, uint64_t request_id,
    uint64_t step, enum zp_step_status status, int error, size_t count)
{
	struct zp_msg m = { .hdr = { .type = ZP_STEP_DONE, .request_id = request_id } };

	m.u.step_done.step = step;
	m.u.step_done.status = status;
	m.u.step_done.error = error;
	m.u.step_done.grad_norm = b != NULL ? b->grad_norm : NAN;
	m.u.step_done.latency_ns = b != NULL ? zd_now_ns() - b->submit_ns : 0;
	m.u.step_done.count = (uint32_t)count;
	(void)zd_session_send(s, &m, NULL, 0);
}

/* A set that cannot run is answered at once, so a client that does not wait still learns why. */
static void
refuse(struct zd_session *s, const struct zp_msg *msg, int error, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void
refuse(struct zd_session *s, const struct zp_msg *msg, int error, const char *fmt, ...)
{
	struct zp_msg m = { .hdr = { .type = ZP_ERROR, .request_id = msg->hdr.request_id } };
	va_list ap;

	m.u.error.code = error;
	va_start(ap, fmt);
	vsnprintf(m.u.error.message, sizeof(m.u.error.message), fmt, ap);
	va_end(ap);
	log_debug("session %u: step refused: %s", s->id, m.u.error.message);
	(void)zd_session_send(s, &m, NULL, 0);
	send_step_done(s, NULL, msg->hdr.request_id, msg->u.step_submit.step, ZP_STEP_FAILED,
	    error, msg->u.step_submit.count);
}

static void
batch_free(struct zd_batch *b)
{
	for (size_t i = 0; i < b->count; i++)
		if (b->tensors[i] != NULL)
			b->tensors[i]->busy = false;
	free(b->tensors);
	free(b->views);
	free(b);
}

void
zd_step_submit(struct zd_session *s, const struct zp_msg *msg)
{
	const struct zp_step_submit *req = &msg->u.step_submit;
	struct zd_daemon *d = s->daemon;
	struct zd_batch *b;
	int r;

	if (s->job == NULL) {
		refuse(s, msg, -ENOTCONN, "open a job before submitting steps");
		return;
	}
	b = calloc(1, sizeof(*b));
	if (b != NULL) {
		b->tensors = calloc(req->count, sizeof(*b->tensors));
		b->views = calloc(req->count, sizeof(*b->views));
	}
	if (b == NULL || b->tensors == NULL || b->views == NULL) {
		if (b != NULL)
			batch_free(b);
		refuse(s, msg, -ENOMEM, "out of memory");
		return;
	}
	b->hp = (struct zk_hparams){
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
	};
	r = zk_hparams_validate(&b->hp);
	if (r < 0) {
		batch_free(b);
		refuse(s, msg, r, "step %llu: hyperparameters out of range (lr %g, betas %g/%g, "
		    "eps %g, weight decay %g)", (unsigned long long)req->step, req->lr, req->beta1,
		    req->beta2, req->eps, req->weight_decay);
		return;
	}
	for (uint32_t i = 0; i < req->count; i++) {
		struct zd_tensor *t = zd_session_tensor(s, req->handles[i]);

		if (t == NULL) {
			batch_free(b);
			refuse(s, msg, -ENOENT, "step %llu: no tensor with handle %u on this "
			    "connection", (unsigned long long)req->step, req->handles[i]);
			return;
		}
		if (t->busy) {
			/* Also catches a handle listed twice in one set. */
			batch_free(b);
			refuse(s, msg, -EBUSY, "step %llu: tensor '%s' is already in a step",
			    (unsigned long long)req->step, t->name);
			return;
		}
		if (req->step <= t->last_step) {
			batch_free(b);
			refuse(s, msg, -EALREADY, "step %llu: tensor '%s' is already at step %llu",
			    (unsigned long long)req->step, t->name,
			    (unsigned long long)t->last_step);
			return;
		}
		t->busy = true;
		b->tensors[i] = t;
		b->count = i + 1;
		b->views[i] = (struct zk_tensor){
			.master = t->master,
			.m = t->m,
			.v = t->v,
			.grad = t->grad_slot.map,
			.grad_dtype = t->grad_dtype,
			.param = t->param_slot.map,
			.param_dtype = t->param_dtype,
			.n = t->numel,
		};
	}
	b->session = s;
	b->lane = s->id;
	b->request_id = msg->hdr.request_id;
	b->isa = d->isa;
	b->check_finite = (req->flags & ZP_STEP_CHECK_FINITE) != 0;
	b->max_grad_norm = req->max_grad_norm;
	b->submit_ns = zd_now_ns();
	TAILQ_INSERT_TAIL(&s->inflight, b, session_entry);
	d->inflight_batches++;
	zd_stepper_submit(d->stepper, b);
}

/* Tensor done: free it if its session went away, else tell the client. */
static void
tensor_done(struct zd_daemon *d, struct zd_batch *b, size_t i, enum zp_step_status status,
    int error)
{
	struct zd_tensor *t = b->tensors[i];
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_DONE, .request_id = b->request_id } };

	b->tensors[i] = NULL;
	t->busy = false;
	if (status == ZP_STEP_APPLIED)
		t->last_step = b->hp.step;
	if (t->session == NULL) {
		struct zd_job *job = t->job;

		/* Kept for a reattach: only its rank died. */
		if (t->detached)
			return;
		zd_tensor_release(d, t);
		zd_job_unref(d, job);
		return;
	}
	if (b->session == NULL)
		return;
	m.u.tensor_done.handle = t->handle;
	m.u.tensor_done.step = b->hp.step;
	m.u.tensor_done.status = status;
	m.u.tensor_done.error = error;
	(void)zd_session_send(b->session, &m, NULL, 0);
}

static void
batch_done(struct zd_daemon *d, struct zd_batch *b)
{
	struct zd_session *s = b->session;
	uint64_t params = 0;

	for (size_t i = 0; i < b->count; i++) {
		if (b->tensors[i] != NULL)
			tensor_done(d, b, i, b->status, b->error);
		params += b->views[i].n;
	}
	zd_stats_record(d, b, b->status == ZP_STEP_APPLIED ? params : 0);
	if (s != NULL) {
		struct zd_job *job = s->job;

		if (job != NULL) {
			if (b->status == ZP_STEP_APPLIED) {
				job->steps_applied++;
				if (b->hp.step > job->last_step)
					job->last_step = b->hp.step;
			} else if (b->status == ZP_STEP_SKIPPED_NONFINITE) {
				job->steps_skipped++;
			} else {
				job->steps_failed++;
			}
		}
		if (b->status == ZP_STEP_SKIPPED_NONFINITE)
			log_debug("session %u: step %llu skipped: non-finite gradients", s->id,
			    (unsigned long long)b->hp.step);
		else if (b->status == ZP_STEP_FAILED)
			log_warn(b->error, "session %u: step %llu failed", s->id,
			    (unsigned long long)b->hp.step);
		TAILQ_REMOVE(&s->inflight, b, session_entry);
		send_step_done(s, b, b->request_id, b->hp.step, b->status, b->error, b->count);
	}
	d->inflight_batches--;
	batch_free(b);
}

void
zd_step_completions(struct zd_daemon *d)
{
	struct zd_completion done[64];
	size_t n;

	while ((n = zd_stepper_reap(d->stepper, done, 64)) > 0) {
		for (size_t i = 0; i < n; i++) {
			if (done[i].index == SIZE_MAX)
				batch_done(d, done[i].batch);
			else
				tensor_done(d, done[i].batch, done[i].index, ZP_STEP_APPLIED, 0);
		}
	}
}
