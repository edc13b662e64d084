/* libzclient's optimizer steps: gradient passes, clipping, submitting steps and waiting for them. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "zclient.h"
#include "zclient_impl.h"

/* A submitted step's tensors, on c->sets until its STEP_DONE. */
struct pending_set {
	struct pending_set *next;
	uint64_t request_id;
	uint64_t step;
	struct zc_step_params params;	/* to submit it again after a reconnect */
	uint32_t count;
	uint32_t *handles;
};

/* A STEP_SUBMIT of p, without its handles. */
static void
fill_submit(struct zp_msg *m, const struct zc_step_params *p, size_t ntensors)
{
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
}

void
zci_sets_finish(struct zc_conn *c, const struct zp_step_done *done, uint64_t request_id)
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
		struct zc_tensor *t = zci_tensor_by_handle(c, set->handles[i]);

		if (t != NULL && t->pending && t->pending_set == request_id) {
			t->pending = false;
			t->result = c->last;
		}
	}
	*pp = set->next;
	free(set->handles);
	free(set);
}

bool
zci_sets_pending(const struct zc_conn *c, uint64_t request_id)
{
	for (const struct pending_set *s = c->sets; s != NULL; s = s->next)
		if (s->request_id == request_id)
			return true;
	return false;
}

void
zci_sets_free(struct zc_conn *c)
{
	struct pending_set *s;

	while ((s = c->sets) != NULL) {
		c->sets = s->next;
		free(s->handles);
		free(s);
	}
}

void
zci_sets_rehandle(struct zc_conn *c, struct zc_tensor *const *old, uint32_t cap)
{
	for (struct pending_set *s = c->sets; s != NULL; s = s->next) {
		for (uint32_t i = 0; i < s->count; i++) {
			uint32_t h = s->handles[i];

			/* 0: a tensor gone since (unregistered after its own TENSOR_DONE). */
			s->handles[i] = h > 0 && h <= cap && old[h - 1] != NULL ? old[h - 1]->handle : 0;
		}
	}
}

/* Ends a tensor's step as the daemon did it while the connection was gone. */
static void
end_applied(struct zc_tensor *t, uint64_t step)
{
	t->pending = false;
	t->result = (struct zc_step_result){ .step = step, .status = ZC_STEP_APPLIED,
		.grad_norm = NAN };
	t->param_state = PARAM_RESIDENT;
}

/*
 * One set after a reattach.  The daemon refuses a step at or below a
 * tensor's last step for the whole set (-EALREADY), so those tensors are
 * done and left out; the rest go again.  A set's global norm clip
 * (max_grad_norm without clip_coef) covers all of it: applied to part, the
 * rest cannot go alone.
 */
static int
resubmit_set(struct zc_conn *c, struct pending_set *set, uint64_t deadline)
{
	struct zp_msg *m;
	uint32_t left = 0;
	bool some_done = false;
	const char *done_name = NULL;
	int r;

	m = calloc(1, sizeof(*m));
	if (m == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	fill_submit(m, &set->params, 0);
	for (uint32_t i = 0; i < set->count; i++) {
		struct zc_tensor *t = zci_tensor_by_handle(c, set->handles[i]);

		if (t == NULL || !t->pending || t->pending_set != set->request_id) {
			some_done = some_done || (t != NULL && t->result.step == set->step &&
			    t->result.status == ZC_STEP_APPLIED);
			continue;
		}
		if (t->last_step >= set->step) {
			end_applied(t, set->step);
			some_done = true;
			done_name = t->name;
			continue;
		}
		m->u.step_submit.handles[left++] = t->handle;
	}
	if (left > 0 && some_done && set->params.max_grad_norm > 0 && !(set->params.clip_coef > 0)) {
		free(m);
		return zci_seterr(c, -EIO, "step %llu was applied to part of its set (tensor '%s') "
		    "before the connection to zoffloadd went; its clipping norm covers the whole "
		    "set, so the rest cannot be submitted alone", (unsigned long long)set->step,
		    done_name != NULL ? done_name : "?");
	}
	if (left == 0) {
		free(m);
		c->conn_stats.steps_completed_away++;
		return 1;
	}
	m->u.step_submit.count = left;
	r = zci_send_once(c, m, deadline, -1);
	if (r == 0) {
		memcpy(set->handles, m->u.step_submit.handles, left * sizeof(*set->handles));
		set->count = left;
		for (uint32_t i = 0; i < left; i++)
			zci_tensor_by_handle(c, set->handles[i])->pending_set = m->hdr.request_id;
		set->request_id = m->hdr.request_id;
		c->conn_stats.steps_resubmitted++;
	}
	free(m);
	return r;
}

int
zci_sets_resubmit(struct zc_conn *c, uint64_t deadline)
{
	struct pending_set *order[64], **list = order, *s;
	size_t n = 0, i;
	int r = 0;

	for (s = c->sets; s != NULL; s = s->next)
		n++;
	if (n > sizeof(order) / sizeof(order[0]) && (list = calloc(n, sizeof(*list))) == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	/* The list is newest first: submit again in the order they were submitted. */
	i = n;
	for (s = c->sets; s != NULL; s = s->next)
		list[--i] = s;
	for (i = 0; i < n && r >= 0; i++) {
		r = resubmit_set(c, list[i], deadline);
		if (r == 1) {
			struct zp_step_done done = { .step = list[i]->step, .status = ZP_STEP_APPLIED,
				.grad_norm = NAN };

			/* All of it was applied: it ends here, its STEP_DONE lost with the connection. */
			zci_sets_finish(c, &done, list[i]->request_id);
			r = 0;
		}
	}
	if (list != order)
		free(list);
	return r;
}

int
zc_grad_pass(struct zc_conn *c, struct zc_tensor *const *tensors, size_t ntensors,
    double grad_scale, struct zc_grad_partial *ret)
{
	struct zp_msg *m;
	int r;

	if (ntensors == 0 || ntensors > ZP_MAX_STEP_TENSORS)
		return zci_seterr(c, -EINVAL, "a gradient pass takes 1 to %d tensors, not %zu",
		    ZP_MAX_STEP_TENSORS, ntensors);
	for (size_t i = 0; i < ntensors; i++) {
		if (tensors[i] == NULL || tensors[i]->conn != c)
			return zci_seterr(c, -EINVAL, "tensor %zu does not belong to this connection", i);
		if (tensors[i]->pending)
			return zci_seterr(c, -EBUSY, "tensor %zu is still in a step", i);
	}
	m = calloc(1, sizeof(*m));
	if (m == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	m->hdr.type = ZP_GRAD_PASS;
	m->u.grad_pass.grad_scale = grad_scale > 0 ? grad_scale : 1.0;
	m->u.grad_pass.count = (uint32_t)ntensors;
	for (size_t i = 0; i < ntensors; i++)
		m->u.grad_pass.handles[i] = tensors[i]->handle;
	r = zci_rpc(c, m, ZP_GRAD_PARTIAL, NULL);
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
		return zci_seterr(c, -EINVAL, "a step takes 1 to %d tensors, not %zu",
		    ZP_MAX_STEP_TENSORS, ntensors);
	if ((unsigned)p->optim > ZC_LION)
		return zci_seterr(c, -EINVAL, "unknown optimizer %d", (int)p->optim);
	if (p->step == 0)
		return zci_seterr(c, -EINVAL, "steps count from 1");
	if (!(p->clip_coef >= 0 && p->clip_coef <= 1))
		return zci_seterr(c, -EINVAL, "clip_coef %g is outside [0, 1] (0: none)", p->clip_coef);
	for (size_t i = 0; i < ntensors; i++) {
		if (tensors[i] == NULL || tensors[i]->conn != c)
			return zci_seterr(c, -EINVAL, "tensor %zu does not belong to this connection", i);
		if (tensors[i]->pending)
			return zci_seterr(c, -EBUSY, "tensor %zu is still in a step", i);
	}
	m = calloc(1, sizeof(*m));
	set = calloc(1, sizeof(*set));
	if (m == NULL || set == NULL || (set->handles = calloc(ntensors, 4)) == NULL) {
		free(m);
		free(set);
		return zci_seterr(c, -ENOMEM, "out of memory");
	}
	fill_submit(m, p, ntensors);
	for (size_t i = 0; i < ntensors; i++) {
		m->u.step_submit.handles[i] = tensors[i]->handle;
		set->handles[i] = tensors[i]->handle;
	}
	set->count = (uint32_t)ntensors;
	set->step = p->step;
	set->params = *p;
	zci_xfer_release(c);
	r = zci_send_msg(c, m, zci_deadline_after(c->timeout_ms), -1);
	if (r < 0) {
		free(set->handles);
		free(set);
		free(m);
		return r;
	}
	/* A reconnect during the send gave the tensors new handles: the message has them. */
	for (size_t i = 0; i < ntensors; i++)
		set->handles[i] = m->u.step_submit.handles[i];
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
	int r = zci_wait_until(t->conn, tensor_idle, t, zci_deadline_after(timeout_ms));

	if (r == -ETIMEDOUT)
		return zci_seterr(t->conn, r, "the tensor's step is not done after %d ms (it still runs; "
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
	int r = zci_wait_until(c, conn_idle, c, zci_deadline_after(timeout_ms));

	if (r == -ETIMEDOUT)
		return zci_seterr(c, r, "steps are not done after %d ms (they still run; wait again)",
		    timeout_ms);
	if (r == 0 && ret != NULL)
		*ret = c->last;
	if (r == 0 && c->last.status == ZC_STEP_FAILED)
		return c->last.error < 0 ? c->last.error : -EIO;
	return r;
}

/* A STEP_DONE (through c->hooks). */
void
zci_sets_step_done(struct zc_conn *c, const struct zp_msg *m)
{
	zci_sets_finish(c, &m->u.step_done, m->hdr.request_id);
}
