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
	va_list ap;

	va_start(ap, fmt);
	zd_session_verror(s, msg->hdr.request_id, error, fmt, ap);
	va_end(ap);
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
	free(b->pending);
	free(b->errors);
	free(b);
}

static void batch_end_all(struct zd_daemon *d, struct zd_batch *b, enum zp_step_status status,
    int error);
static void batch_run(struct zd_daemon *d, struct zd_batch *b);

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
		b->pending = calloc(req->count, sizeof(*b->pending));
		b->errors = calloc(req->count, sizeof(*b->errors));
	}
	if (b == NULL || b->tensors == NULL || b->views == NULL || b->pending == NULL ||
	    b->errors == NULL) {
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
	b->hp_run = b->hp;
	b->status = ZP_STEP_APPLIED;
	b->grad_norm = NAN;
	b->tensors_left = b->count;
	TAILQ_INSERT_TAIL(&s->inflight, b, session_entry);
	d->inflight_batches++;
	/* The finiteness check and the global norm cover the whole set before any of it runs. */
	if (b->check_finite || b->max_grad_norm > 0) {
		struct zd_task *task = calloc(1, sizeof(*task));

		if (task == NULL) {
			batch_end_all(d, b, ZP_STEP_FAILED, -ENOMEM);
			return;
		}
		task->kind = ZD_TASK_CHECK;
		task->lane = b->lane;
		task->batch = b;
		zd_step_post(d, task);
		return;
	}
	batch_run(d, b);
}

/* Clears busy; frees the tensor when its session went away and nobody keeps it. */
void
zd_tensor_unbusy(struct zd_daemon *d, struct zd_tensor *t)
{
	struct zd_job *job = t->job;

	t->busy = false;
	/* Orphaned (no session, not kept for a reattach): it waited only for us. */
	if (t->session == NULL && !t->detached) {
		zd_tensor_release(d, t);
		zd_job_unref(d, job);
	}
}

/* Tensor done: free it if its session went away, else tell the client. */
static void
tensor_done(struct zd_daemon *d, struct zd_batch *b, size_t i, enum zp_step_status status,
    int error)
{
	struct zd_tensor *t = b->tensors[i];
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_DONE, .request_id = b->request_id } };

	b->tensors[i] = NULL;
	b->tensors_left--;
	if (status == ZP_STEP_APPLIED) {
		t->last_step = b->hp.step;
		/*
		 * The job's too, here: once the rank died, batch_done has no session
		 * to find the job by, and a reattach would be told an older step.
		 */
		if (t->job != NULL && b->hp.step > t->job->last_step)
			t->job->last_step = b->hp.step;
		/* The step wrote every parameter into the slot. */
		t->param_resident = true;
		t->param_dirty = true;
		if (t->on_nvme)
			d->tier.nvme_steps++;
		else
			d->tier.pinned_steps++;
	}
	if (b->session != NULL && t->session == b->session) {
		m.u.tensor_done.handle = t->handle;
		m.u.tensor_done.step = b->hp.step;
		m.u.tensor_done.status = status;
		m.u.tensor_done.error = error;
		(void)zd_session_send(b->session, &m, NULL, 0);
	}
	zd_tensor_unbusy(d, t);
}

static void
batch_done(struct zd_daemon *d, struct zd_batch *b)
{
	struct zd_session *s = b->session;
	uint64_t params = 0;

	for (size_t i = 0; i < b->count; i++)
		params += b->views[i].n;
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

/* Ends every tensor still open with one status (a skipped or failed check). */
static void
batch_end_all(struct zd_daemon *d, struct zd_batch *b, enum zp_step_status status, int error)
{
	b->status = status;
	b->error = error;
	for (size_t i = 0; i < b->count; i++)
		if (b->tensors[i] != NULL)
			tensor_done(d, b, i, status, error);
	batch_done(d, b);
}

void
zd_step_unit_done(struct zd_daemon *d, struct zd_batch *b, size_t i, int error)
{
	if (error < 0 && b->errors[i] == 0)
		b->errors[i] = error;
	if (--b->pending[i] > 0)
		return;
	if (b->errors[i] < 0) {
		b->status = ZP_STEP_FAILED;
		if (b->error == 0)
			b->error = b->errors[i];
	}
	tensor_done(d, b, i, b->errors[i] < 0 ? ZP_STEP_FAILED : ZP_STEP_APPLIED, b->errors[i]);
	if (b->tensors_left == 0)
		batch_done(d, b);
}

void
zd_step_post(struct zd_daemon *d, struct zd_task *task)
{
	uint64_t now = zd_now_ns();

	/*
	 * The stepper sat idle while this chunk was read: compute waited on I/O
	 * from the later of its last task and this read's start (before that the
	 * client was computing, not us).
	 */
	if (d->tasks_outstanding == 0 && task->staging != NULL) {
		uint64_t since = d->compute_idle_since > task->io_start_ns ? d->compute_idle_since :
		    task->io_start_ns;

		d->tier.compute_waits++;
		d->tier.compute_wait_ns += now - since;
	}
	d->tasks_outstanding++;
	zd_stepper_submit(d->stepper, task);
}

/* Pinned tensors step in place, a slice at a time; NVMe tensors go through staging. */
static void
batch_run(struct zd_daemon *d, struct zd_batch *b)
{
	size_t count = b->count;

	/* Units can fail on the spot; this guard keeps the batch alive until the loop ends. */
	b->tensors_left++;
	for (size_t i = 0; i < count; i++) {
		struct zd_tensor *t = b->tensors[i];
		const struct zk_tensor *v = &b->views[i];
		size_t nslices;

		if (t->on_nvme) {
			zd_tier_queue_step(d, b, i);
			continue;
		}
		nslices = (v->n + ZD_QUANTUM_ELEMENTS - 1) / ZD_QUANTUM_ELEMENTS;
		b->pending[i] = nslices;
		for (size_t k = 0; k < nslices; k++) {
			size_t off = k * ZD_QUANTUM_ELEMENTS, n = v->n - off;
			struct zd_task *task = calloc(1, sizeof(*task));

			if (n > ZD_QUANTUM_ELEMENTS)
				n = ZD_QUANTUM_ELEMENTS;
			if (task == NULL) {
				zd_step_unit_done(d, b, i, -ENOMEM);
				continue;
			}
			task->kind = ZD_TASK_STEP;
			task->lane = b->lane;
			task->batch = b;
			task->index = i;
			task->view = *v;
			task->view.master += off;
			task->view.m += off;
			task->view.v += off;
			task->view.grad = (const char *)v->grad + off * zk_dtype_size(v->grad_dtype);
			task->view.param = (char *)v->param + off * zk_dtype_size(v->param_dtype);
			task->view.n = n;
			zd_step_post(d, task);
		}
	}
	if (--b->tensors_left == 0)
		batch_done(d, b);
}

static void
check_done(struct zd_daemon *d, struct zd_task *task)
{
	struct zd_batch *b = task->batch;

	b->grad_norm = sqrt(b->check.sumsq);
	if (task->result < 0) {
		batch_end_all(d, b, ZP_STEP_FAILED, task->result);
		return;
	}
	if (b->check.nonfinite > 0 && b->check_finite) {
		batch_end_all(d, b, ZP_STEP_SKIPPED_NONFINITE, 0);
		return;
	}
	/* torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), capped at 1. */
	if (b->max_grad_norm > 0 && isfinite(b->grad_norm)) {
		double coef = b->max_grad_norm / (b->grad_norm + 1e-6);

		b->hp_run.clip_coef = coef < 1.0 ? coef : 1.0;
	}
	batch_run(d, b);
}

void
zd_step_completions(struct zd_daemon *d)
{
	struct zd_task *done[64];
	size_t n;

	while ((n = zd_stepper_reap(d->stepper, done, 64)) > 0) {
		for (size_t i = 0; i < n; i++) {
			struct zd_task *task = done[i];

			d->tasks_outstanding--;
			if (d->tasks_outstanding == 0)
				d->compute_idle_since = zd_now_ns();
			task->batch->compute_ns += task->compute_ns;
			if (task->kind == ZD_TASK_CHECK) {
				check_done(d, task);
				free(task);
			} else if (task->staging != NULL) {
				/* Lives in the chunk's I/O record; the tier writes the chunk back. */
				zd_tier_step_computed(d, task);
			} else {
				struct zd_batch *b = task->batch;
				size_t index = task->index;
				int result = task->result;

				free(task);
				zd_step_unit_done(d, b, index, result);
			}
		}
	}
}
