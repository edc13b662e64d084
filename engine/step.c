/* Steps: checking a set, cutting it into units for the stepper, stamping what landed, reporting. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_impl.h"
#include "stepper.h"

static void
batch_free(struct ze_batch *b)
{
	for (size_t i = 0; i < b->count; i++)
		if (b->tensors[i] != NULL)
			ze_tensor_unbusy(b->tensors[i]);
	free(b->tensors);
	free(b->views);
	free(b->pending);
	free(b->errors);
	free(b->landed);
	free(b);
}

static void batch_end_all(struct ze_engine *e, struct ze_batch *b,
    enum ze_step_status status, int error);
static void batch_run(struct ze_engine *e, struct ze_batch *b);

static struct ze_batch *
batch_alloc(size_t count)
{
	struct ze_batch *b = calloc(1, sizeof(*b));

	if (b == NULL)
		return NULL;
	b->tensors = calloc(count, sizeof(*b->tensors));
	b->views = calloc(count, sizeof(*b->views));
	b->pending = calloc(count, sizeof(*b->pending));
	b->errors = calloc(count, sizeof(*b->errors));
	b->landed = calloc(count, sizeof(*b->landed));
	if (b->tensors == NULL || b->views == NULL || b->pending == NULL || b->errors == NULL ||
	    b->landed == NULL) {
		batch_free(b);
		return NULL;
	}
	return b;
}

double
ze_clip_coef(double max_norm, double sumsq)
{
	double norm = sqrt(sumsq), coef;

	/* torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), capped at 1. */
	if (!(max_norm > 0) || !isfinite(norm))
		return 1.0;
	coef = max_norm / (norm + 1e-6);
	return coef < 1.0 ? coef : 1.0;
}

/* "adamw, adam": the optimizers with a kernel for format f. */
static void
optims_of(enum zk_state_format f, char *buf, size_t len)
{
	size_t off = 0;

	buf[0] = '\0';
	for (unsigned o = 0; o < ZK_OPTIM_COUNT && off < len; o++) {
		int n;

		if (!ze_format_supports(f, (enum zk_optim)o))
			continue;
		n = snprintf(buf + off, len - off, "%s%s", off > 0 ? ", " : "",
		    zk_optim_name((enum zk_optim)o));
		if (n < 0)
			break;
		off += (size_t)n;
	}
}

/* Marks the set busy and fills the views; err says why a tensor cannot take part. */
static int
batch_take(struct ze_batch *b, uint64_t step, enum zk_optim hp_optim,
    struct ze_tensor *const *ts, size_t n, bool stepping, char *err, size_t errlen)
{
	for (size_t i = 0; i < n; i++) {
		struct ze_tensor *t = ts[i];

		/* Busy also catches a tensor listed twice in one set. */
		if (t->busy) {
			snprintf(err, errlen, "step %llu: tensor '%s' is already in a step",
			    (unsigned long long)step, t->name);
			return -EBUSY;
		}
		if (stepping && t->torn_step != 0) {
			snprintf(err, errlen, "step %llu: tensor '%s' was left half way through step "
			    "%llu by a daemon crash; restore it from a checkpoint", (unsigned long long)step,
			    t->name, (unsigned long long)t->torn_step);
			return -EIO;
		}
		if (stepping && step <= t->last_step) {
			snprintf(err, errlen, "step %llu: tensor '%s' is already at step %llu",
			    (unsigned long long)step, t->name, (unsigned long long)t->last_step);
			return -EALREADY;
		}
		if (stepping && t->partial_step != 0 && step != t->partial_step) {
			/* Another step now would leave its elements a step apart for good. */
			snprintf(err, errlen, "step %llu: step %llu of tensor '%s' landed on part of "
			    "it only; submit step %llu again to finish it, or set the step",
			    (unsigned long long)step, (unsigned long long)t->partial_step, t->name,
			    (unsigned long long)t->partial_step);
			return -EINPROGRESS;
		}
		if (stepping && !ze_format_supports(t->format, hp_optim)) {
			char can[64];

			optims_of(t->format, can, sizeof(can));
			snprintf(err, errlen, "step %llu: tensor '%s' keeps its state as %s, which the "
			    "%s optimizer cannot step (%s can); use state format fp32",
			    (unsigned long long)step, t->name, zk_state_format_name(t->format),
			    zk_optim_name(hp_optim), can);
			return -ENOTSUP;
		}
		t->busy = true;
		b->tensors[i] = t;
		b->count = i + 1;
		/* The gradient pass reads grads only; a compressed state steps through qview. */
		b->views[i] = (struct zk_tensor){
			.master = t->format == ZK_STATE_FP32 ? t->master : NULL,
			.m = t->format == ZK_STATE_FP32 ? t->m : NULL,
			.v = t->format == ZK_STATE_FP32 ? t->v : NULL,
			.grad = t->grad_slot.map,
			.grad_dtype = t->grad_dtype,
			/* The slot that is the master gets no copy: the step writes it as master. */
			.param = t->master_in_slot ? NULL : t->param_slot.map,
			.param_dtype = t->param_dtype,
			.n = t->numel,
		};
		b->params += t->numel;
	}
	return 0;
}

static void
post_check(struct ze_engine *e, struct ze_batch *b)
{
	struct ze_task *task = calloc(1, sizeof(*task));

	if (task == NULL) {
		b->check.sumsq = NAN;
		if (b->grad_only) {
			e->batches--;
			e->cb.grad_done(e->cb_arg, b->lane, b->id, -ENOMEM, NULL);
			batch_free(b);
		} else {
			batch_end_all(e, b, ZE_STEP_FAILED, -ENOMEM);
		}
		return;
	}
	task->kind = ZE_TASK_CHECK;
	task->lane = b->lane;
	task->batch = b;
	ze_step_post(e, task);
}

int
ze_grad_pass(struct ze_engine *e, uint32_t lane, uint64_t id, double grad_scale,
    struct ze_tensor *const *ts, size_t n, char *err, size_t errlen)
{
	struct ze_batch *b;
	int r;

	if (!(grad_scale > 0) || !isfinite(grad_scale)) {
		snprintf(err, errlen, "gradient pass: grad_scale %g is not a positive number",
		    grad_scale);
		return -EINVAL;
	}
	b = batch_alloc(n);
	if (b == NULL) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	r = batch_take(b, 0, ZK_OPTIM_ADAMW, ts, n, false, err, errlen);
	if (r < 0) {
		batch_free(b);
		return r;
	}
	b->grad_only = true;
	b->lane = lane;
	b->id = id;
	b->hp.grad_scale = grad_scale;
	b->isa = e->cfg.isa;
	b->submit_ns = zu_now_ns();
	b->seq = ++e->batch_seq;
	e->batches++;
	post_check(e, b);
	return 0;
}

int
ze_step_submit(struct ze_engine *e, const struct ze_step *s, char *err, size_t errlen)
{
	unsigned long long step = (unsigned long long)s->hp.step;
	struct zk_hparams hp = s->hp;
	struct ze_batch *b;
	int r;

	/* The coefficient is the engine's to set (from max_grad_norm or clip_coef). */
	hp.clip_coef = 1.0;
	r = zk_hparams_validate(&hp);
	if (r < 0) {
		snprintf(err, errlen, "step %llu: hyperparameters out of range (lr %g, betas %g/%g, "
		    "eps %g, weight decay %g)", step, s->hp.lr, s->hp.beta1, s->hp.beta2, s->hp.eps,
		    s->hp.weight_decay);
		return r;
	}
	b = batch_alloc(s->count);
	if (b == NULL) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	r = batch_take(b, s->hp.step, s->hp.optim, s->tensors, s->count, true, err, errlen);
	if (r < 0) {
		batch_free(b);
		return r;
	}
	b->lane = s->lane;
	b->id = s->id;
	b->hp = s->hp;
	b->hp.clip_coef = 1.0;
	b->hp_run = b->hp;
	b->isa = e->cfg.isa;
	b->check_finite = s->check_finite;
	b->max_grad_norm = s->max_grad_norm;
	/* The second phase of a clipped step: the norm came from every set, through the client. */
	if (s->clip_coef > 0) {
		b->hp_run.clip_coef = s->clip_coef < 1.0 ? s->clip_coef : 1.0;
		b->max_grad_norm = 0;
	}
	b->submit_ns = zu_now_ns();
	b->seq = ++e->batch_seq;
	b->status = ZE_STEP_APPLIED;
	b->grad_norm = NAN;
	b->tensors_left = b->count;
	e->batches++;
	/* The finiteness check and the global norm cover the whole set before any of it runs. */
	if (b->check_finite || b->max_grad_norm > 0) {
		post_check(e, b);
		return 0;
	}
	batch_run(e, b);
	return 0;
}

/* Tensor i is done: its last step moves only when every unit is at this one. */
static void
tensor_done(struct ze_engine *e, struct ze_batch *b, size_t i, enum ze_step_status status,
    int error)
{
	struct ze_tensor *t = b->tensors[i];
	struct ze_tensor_result r = { .step = b->hp.step, .status = status, .error = error,
		.landed = b->landed[i], .numel = t->numel };

	b->tensors[i] = NULL;
	b->tensors_left--;
	if (status == ZE_STEP_FAILED && b->landed[i] > 0)
		t->partial_step = b->hp.step;
	if (status == ZE_STEP_APPLIED) {
		t->last_step = b->hp.step;
		t->partial_step = 0;
		/* The step wrote every parameter into the slot. */
		ze_param_flags(t, true, true);
		if (t->on_nvme) {
			e->stats.nvme_steps++;
			e->stats.nvme_step_bytes += zk_state_bytes(t->format, t->numel);
		} else {
			e->stats.pinned_steps++;
			e->stats.pinned_step_bytes += zk_state_bytes(t->format, t->numel);
		}
	}
	if (status == ZE_STEP_SKIPPED_NONFINITE)
		r.landed = 0;
	if (t->user != NULL)
		e->cb.tensor_done(e->cb_arg, b->lane, b->id, t->user, &r);
	ze_tensor_unbusy(t);
}

static void
batch_done(struct ze_engine *e, struct ze_batch *b)
{
	struct ze_step_result r = {
		.step = b->hp.step,
		.status = b->status,
		.error = b->error,
		.grad_norm = b->grad_norm,
		.count = b->count,
		.params = b->params,
		.submit_ns = b->submit_ns,
		.compute_ns = b->compute_ns,
	};

	for (size_t i = 0; i < b->count; i++)
		r.landed += b->status == ZE_STEP_SKIPPED_NONFINITE ? 0 : b->landed[i];
	e->batches--;
	e->cb.step_done(e->cb_arg, b->lane, b->id, &r);
	batch_free(b);
}

/* Ends every tensor still open with one status (a skipped or failed check). */
static void
batch_end_all(struct ze_engine *e, struct ze_batch *b, enum ze_step_status status, int error)
{
	b->status = status;
	b->error = error;
	for (size_t i = 0; i < b->count; i++)
		if (b->tensors[i] != NULL)
			tensor_done(e, b, i, status, error);
	batch_done(e, b);
}

/*
 * A unit of tensor i (slice or chunk; UINT64_MAX: none) finished with 0 or
 * -errno.  A unit that landed is stamped with the step, so a retry of this
 * step passes it by.
 */
void
ze_step_unit_done(struct ze_engine *e, struct ze_batch *b, size_t i, uint64_t unit, int error)
{
	struct ze_tensor *t = b->tensors[i];

	if (error == 0 && unit != UINT64_MAX) {
		t->unit_step[unit] = b->hp.step;
		b->landed[i] += ze_unit_len(t, unit);
	}
	if (error < 0 && b->errors[i] == 0)
		b->errors[i] = error;
	if (--b->pending[i] > 0)
		return;
	if (b->errors[i] < 0) {
		b->status = ZE_STEP_FAILED;
		if (b->error == 0)
			b->error = b->errors[i];
	}
	tensor_done(e, b, i, b->errors[i] < 0 ? ZE_STEP_FAILED : ZE_STEP_APPLIED, b->errors[i]);
	if (b->tensors_left == 0)
		batch_done(e, b);
}

void
ze_step_post(struct ze_engine *e, struct ze_task *task)
{
	uint64_t now = zu_now_ns();

	/*
	 * The stepper sat idle while this chunk was read: compute waited on I/O
	 * from the later of its last task and this read's start (before that the
	 * client was computing, not us).
	 */
	if (e->tasks_outstanding == 0 && task->staging != NULL && task->kind == ZE_TASK_STEP) {
		uint64_t since = e->compute_idle_since > task->io_start_ns ? e->compute_idle_since :
		    task->io_start_ns;

		e->stats.compute_waits++;
		e->stats.compute_wait_ns += now - since;
	}
	/* A PARAM task (no batch) keeps step 0: ahead of its lane's steps, it is short. */
	if (task->batch != NULL) {
		task->step = task->batch->hp.step;
		task->seq = task->batch->seq;
	}
	e->tasks_outstanding++;
	ze_stepper_submit(e->stepper, task);
}

/* Pinned tensors step in place, a slice at a time; NVMe tensors go through staging. */
static void
batch_run(struct ze_engine *e, struct ze_batch *b)
{
	size_t count = b->count;

	/* Units can fail on the spot; this guard keeps the batch alive until the loop ends. */
	b->tensors_left++;
	for (size_t i = 0; i < count; i++) {
		struct ze_tensor *t = b->tensors[i];
		const struct zk_tensor *v = &b->views[i];
		struct zk_qtensor q;
		size_t needed = 0;

		if (t->on_nvme) {
			ze_nvme_queue_step(e, b, i);
			continue;
		}
		for (uint64_t k = 0; k < t->nunits; k++) {
			if (t->unit_step[k] >= b->hp.step)
				b->landed[i] += ze_unit_len(t, k);
			else
				needed++;
		}
		if (needed == 0) {
			b->pending[i] = 1;
			ze_step_unit_done(e, b, i, UINT64_MAX, 0);
			continue;
		}
		b->pending[i] = needed;
		ze_tensor_state_view(t, &q);
		for (uint64_t k = 0; k < t->nunits; k++) {
			size_t off = k * ZE_QUANTUM_ELEMENTS;
			struct ze_task *task;

			if (t->unit_step[k] >= b->hp.step)
				continue;
			task = calloc(1, sizeof(*task));
			if (task == NULL) {
				ze_step_unit_done(e, b, i, UINT64_MAX, -ENOMEM);
				continue;
			}
			task->kind = ZE_TASK_STEP;
			task->lane = b->lane;
			task->batch = b;
			task->index = i;
			task->unit = k;
			task->e = e;
			task->tensor_id = t->id;
			task->stamp = &t->unit_step[k];
			t->unit_pend[k] = b->hp.step;
			if (t->format != ZK_STATE_FP32) {
				/* Slices start on ZE_QUANTUM_ELEMENTS: whole q8 blocks. */
				(void)zk_qtensor_slice(&q, off, ze_unit_len(t, k), &task->qview);
			} else {
				task->view = *v;
				task->view.master += off;
				task->view.m += off;
				task->view.v += off;
				task->view.grad = (const char *)v->grad +
				    off * zk_dtype_size(v->grad_dtype);
				if (v->param != NULL)
					task->view.param = (char *)v->param +
					    off * zk_dtype_size(v->param_dtype);
				task->view.n = ze_unit_len(t, k);
			}
			ze_step_post(e, task);
		}
	}
	if (--b->tensors_left == 0)
		batch_done(e, b);
}

static void
check_done(struct ze_engine *e, struct ze_task *task)
{
	struct ze_batch *b = task->batch;

	b->grad_norm = sqrt(b->check.sumsq);
	if (b->grad_only) {
		struct ze_grad_partial p = { .sumsq = b->check.sumsq,
			.nonfinite = b->check.nonfinite, .elements = b->params };

		e->batches--;
		e->cb.grad_done(e->cb_arg, b->lane, b->id, task->result,
		    task->result < 0 ? NULL : &p);
		batch_free(b);
		return;
	}
	if (task->result < 0) {
		batch_end_all(e, b, ZE_STEP_FAILED, task->result);
		return;
	}
	if (b->check.nonfinite > 0 && b->check_finite) {
		batch_end_all(e, b, ZE_STEP_SKIPPED_NONFINITE, 0);
		return;
	}
	if (b->max_grad_norm > 0)
		b->hp_run.clip_coef = ze_clip_coef(b->max_grad_norm, b->check.sumsq);
	batch_run(e, b);
}

static void
task_finished(struct ze_engine *e, struct ze_task *task)
{
	e->tasks_outstanding--;
	if (e->tasks_outstanding == 0)
		e->compute_idle_since = zu_now_ns();
	if (task->kind == ZE_TASK_PARAM) {
		ze_nvme_param_done(e, task);
		return;
	}
	task->batch->compute_ns += task->compute_ns;
	if (task->kind == ZE_TASK_CHECK) {
		check_done(e, task);
		free(task);
	} else if (task->staging != NULL) {
		/* Lives in the chunk's I/O record; the chunk is written back from there. */
		ze_nvme_step_computed(e, task);
	} else {
		struct ze_batch *b = task->batch;
		size_t index = task->index;
		uint64_t unit = task->unit;
		int result = task->result;

		free(task);
		ze_step_unit_done(e, b, index, unit, result);
	}
}

void
ze_step_completions(struct ze_engine *e)
{
	struct ze_task *done[64];
	size_t n;

	while ((n = ze_stepper_reap(e->stepper, done, 64)) > 0)
		for (size_t i = 0; i < n; i++)
			task_finished(e, done[i]);
}
