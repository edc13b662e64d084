/* zoffload._zclient.Connection: a connection to zoffloadd, its job, steps and control calls. */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "zpy.h"

/* A reconnect timeout: an int, -1 (no bound) or more; 0 turns reconnects off. */
static int
parse_reconnect(PyObject *o, int *ret)
{
	long v;

	if (!PyLong_Check(o) || PyBool_Check(o)) {
		PyErr_Format(PyExc_TypeError, "reconnect_ms must be an int (milliseconds, -1 for no "
		    "bound, 0 for none), not %s", Py_TYPE(o)->tp_name);
		return -1;
	}
	v = PyLong_AsLong(o);
	if (v == -1 && PyErr_Occurred())
		return -1;
	if (v < -1 || v > INT_MAX) {
		PyErr_Format(PyExc_ValueError, "reconnect_ms must be -1 (no bound), 0 (none) or up "
		    "to %d milliseconds, not %ld", INT_MAX, v);
		return -1;
	}
	*ret = (int)v;
	return 0;
}

static PyObject *
conn_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
	static char *kwlist[] = { "socket", "reconnect_ms", NULL };
	const char *path = NULL;
	PyObject *reconnect = Py_None;
	char msg[ZPY_ERRLEN];
	struct zpy_conn *self;
	struct zc_conn *c = NULL;
	int reconnect_ms = 0, r;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "|z$O:Connection", kwlist, &path, &reconnect))
		return NULL;
	/* None: the library's default ($ZOFFLOAD_RECONNECT_MS, else 60 s). */
	if (reconnect != Py_None && parse_reconnect(reconnect, &reconnect_ms) < 0)
		return NULL;
	/* The message is the calling thread's: read it before another connect can run here. */
	Py_BEGIN_ALLOW_THREADS
	r = zc_connect(path, &c);
	if (r < 0)
		snprintf(msg, sizeof(msg), "%s%s", zc_connect_errmsg(),
		    r == -ENOENT || r == -ECONNREFUSED ? " (set socket= or $ZOFFLOAD_SOCKET)" : "");
	Py_END_ALLOW_THREADS
	if (r < 0)
		return zpy_raise(type, r, msg);
	if (reconnect != Py_None)
		(void)zc_set_reconnect(c, reconnect_ms);
	self = (struct zpy_conn *)type->tp_alloc(type, 0);
	if (self == NULL) {
		zc_disconnect(c);
		return NULL;
	}
	self->lock = PyThread_allocate_lock();
	if (self->lock == NULL) {
		zc_disconnect(c);
		Py_DECREF(self);
		return PyErr_NoMemory();
	}
	self->c = c;
	return (PyObject *)self;
}

static void
conn_dealloc(struct zpy_conn *self)
{
	PyTypeObject *tp = Py_TYPE(self);

	/* Every Tensor holds a reference to us: none is left, so no view of a slot is either. */
	if (self->c != NULL) {
		Py_BEGIN_ALLOW_THREADS
		zc_disconnect(self->c);
		Py_END_ALLOW_THREADS
	}
	if (self->lock != NULL)
		PyThread_free_lock(self->lock);
	tp->tp_free(self);
	Py_DECREF(tp);
}

static bool
keep_viewed(PyObject *kept, struct zpy_tensor *t)
{
	if (t->t == NULL || t->live_slots == 0)
		return true;
	if (PyList_Append(kept, (PyObject *)t) < 0)
		return false;
	zc_tensor_keep_slots(t->t, &t->kept);
	return true;
}

PyObject *
zpy_tensors_keep_viewed(struct zpy_conn *conn, struct zpy_tensor *only)
{
	PyObject *kept = PyList_New(0);

	if (kept == NULL)
		return NULL;
	for (struct zpy_tensor *t = only != NULL ? only : conn->tensors; t != NULL;
	    t = only != NULL ? NULL : t->next) {
		if (!keep_viewed(kept, t)) {
			zpy_tensors_kept_done(kept, false);
			return NULL;
		}
	}
	return kept;
}

void
zpy_tensors_kept_done(PyObject *kept, bool ok)
{
	for (Py_ssize_t i = 0; !ok && i < PyList_GET_SIZE(kept); i++) {
		struct zpy_tensor *t = (struct zpy_tensor *)PyList_GET_ITEM(kept, i);

		/* Still registered: the Tensor's dealloc must not find a pointer to itself there. */
		if (t->t != NULL)
			zc_tensor_keep_slots(t->t, NULL);
	}
	Py_DECREF(kept);
}

void
zpy_conn_forget_tensors(struct zpy_conn *conn)
{
	for (struct zpy_tensor *t = conn->tensors; t != NULL; t = t->next) {
		t->t = NULL;
		t->hook = NULL;		/* freed by its last call */
	}
}

static PyObject *
conn_close(struct zpy_conn *self, PyObject *unused)
{
	struct zc_conn *c = self->c;

	PyObject *kept;

	if (c == NULL)
		Py_RETURN_NONE;
	if ((kept = zpy_tensors_keep_viewed(self, NULL)) == NULL)
		return NULL;
	self->c = NULL;
	zpy_conn_forget_tensors(self);
	Py_BEGIN_ALLOW_THREADS
	PyThread_acquire_lock(self->lock, WAIT_LOCK);
	zc_disconnect(c);
	PyThread_release_lock(self->lock);
	Py_END_ALLOW_THREADS
	zpy_tensors_kept_done(kept, true);
	Py_RETURN_NONE;
}

static PyObject *
conn_enter(PyObject *self, PyObject *unused)
{
	return Py_NewRef(self);
}

static PyObject *
conn_exit(struct zpy_conn *self, PyObject *args)
{
	return conn_close(self, NULL);
}

static int
parse_policy(const char *s, enum zc_policy *ret)
{
	static const struct { const char *name; enum zc_policy p; } names[] = {
		{ "default", ZC_POLICY_DEFAULT }, { "cpu", ZC_POLICY_CPU },
		{ "nvme", ZC_POLICY_NVME }, { "auto", ZC_POLICY_AUTO },
	};

	if (s == NULL) {
		*ret = ZC_POLICY_DEFAULT;
		return 0;
	}
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		if (strcmp(s, names[i].name) == 0) {
			*ret = names[i].p;
			return 0;
		}
	}
	PyErr_Format(PyExc_ValueError, "policy must be 'cpu', 'nvme', 'auto' or 'default', not '%s'",
	    s);
	return -1;
}

static PyObject *
conn_job_open(struct zpy_conn *self, PyObject *args, PyObject *kw)
{
	static char *kwlist[] = { "name", "rank", "world_size", "policy", "pinned_budget",
		"state_format", NULL };
	const char *name, *policy = NULL, *format = NULL;
	unsigned int rank = 0, world = 1;
	unsigned long long budget = 0;
	struct zc_job_options opts = { 0 };
	char err[ZPY_ERRLEN];
	int r;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "s|II$zKz:job_open", kwlist, &name, &rank,
	    &world, &policy, &budget, &format))
		return NULL;
	/* The daemon knows the formats and names them all when this one is not among them. */
	opts.state_format = format;
	if (parse_policy(policy, &opts.policy) < 0 || !zpy_conn_ready(self))
		return NULL;
	opts.pinned_budget = budget;
	ZPY_CALL(self, r, err, zc_job_open_opts(self->c, name, rank, world, &opts));
	if (r < 0)
		return zpy_raise_conn(self, r, err);
	Py_RETURN_NONE;
}

static PyObject *
conn_job_close(struct zpy_conn *self, PyObject *unused)
{
	char err[ZPY_ERRLEN];
	PyObject *kept;
	int r;

	if (!zpy_conn_ready(self) || (kept = zpy_tensors_keep_viewed(self, NULL)) == NULL)
		return NULL;
	ZPY_CALL(self, r, err, zc_job_close(self->c));
	if (r < 0) {
		zpy_tensors_kept_done(kept, false);
		return zpy_raise_conn(self, r, err);
	}
	zpy_conn_forget_tensors(self);
	zpy_tensors_kept_done(kept, true);
	Py_RETURN_NONE;
}

static PyObject *
conn_job_drop(struct zpy_conn *self, PyObject *arg)
{
	const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
	char err[ZPY_ERRLEN];
	int r;

	if (name == NULL) {
		if (!PyErr_Occurred())
			PyErr_SetString(PyExc_TypeError, "job_drop(name): name must be a str");
		return NULL;
	}
	if (!zpy_conn_ready(self))
		return NULL;
	ZPY_CALL(self, r, err, zc_job_drop(self->c, name));
	if (r < 0)
		return zpy_raise_conn(self, r, err);
	Py_RETURN_NONE;
}

static PyObject *
conn_job_last_step(struct zpy_conn *self, void *closure)
{
	if (!zpy_conn_ready(self))
		return NULL;
	return PyLong_FromUnsignedLongLong(zc_job_last_step(self->c));
}

static PyObject *
conn_state_format(struct zpy_conn *self, void *closure)
{
	if (!zpy_conn_ready(self))
		return NULL;
	return PyUnicode_FromString(zc_job_state_format(self->c));
}

static PyObject *
conn_closed(struct zpy_conn *self, void *closure)
{
	return PyBool_FromLong(self->c == NULL);
}

PyObject *
zpy_tensor_wrap(struct zpy_conn *self, struct zc_tensor *ct, PyObject *name,
    const struct zc_tensor_desc *desc)
{
	struct zpy_state *st = zpy_state_of(Py_TYPE(self));
	struct zpy_tensor *t;

	t = (struct zpy_tensor *)st->tensor_type->tp_alloc(st->tensor_type, 0);
	if (t == NULL) {
		/* Unreachable in practice; the tensor stays registered until disconnect. */
		return NULL;
	}
	t->conn = (struct zpy_conn *)Py_NewRef(self);
	t->t = ct;
	t->name = Py_NewRef(name);
	t->numel = desc->numel;
	t->grad_dtype = desc->grad_dtype;
	t->param_dtype = desc->param_dtype;
	t->next = self->tensors;
	if (self->tensors != NULL)
		self->tensors->prev = t;
	self->tensors = t;
	return (PyObject *)t;
}

static PyObject *
conn_register(struct zpy_conn *self, PyObject *args, PyObject *kw)
{
	static char *kwlist[] = { "name", "init", "grad_dtype", "param_dtype", "param_offload",
		"param_view", NULL };
	PyObject *name, *gd = NULL, *pd = NULL;
	struct zc_tensor_desc desc = { 0 };
	struct zc_tensor *ct = NULL;
	char err[ZPY_ERRLEN];
	int offload = 0, view = 0, g, p, r;
	Py_buffer init;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "Uy*|$OOpp:register", kwlist, &name, &init,
	    &gd, &pd, &offload, &view))
		return NULL;
	g = zpy_dtype(gd, "grad_dtype");
	p = g < 0 ? -1 : zpy_dtype(pd, "param_dtype");
	if (p < 0 || !zpy_conn_ready(self))
		goto fail_buf;
	desc.name = PyUnicode_AsUTF8(name);
	if (desc.name == NULL)
		goto fail_buf;
	if (init.len <= 0 || init.len % sizeof(float) != 0) {
		PyErr_Format(PyExc_ValueError, "tensor %R: init must hold fp32 values (%zd bytes is "
		    "not a positive multiple of 4)", name, init.len);
		goto fail_buf;
	}
	desc.numel = (uint64_t)init.len / sizeof(float);
	desc.grad_dtype = (enum zc_dtype)g;
	desc.param_dtype = (enum zc_dtype)p;
	desc.param_offload = offload != 0;
	/* The daemon copies init in before the call returns: the buffer is held until then. */
	ZPY_CALL(self, r, err, (zc_conn_set_param_views(self->c, view != 0),
	    zc_tensor_register(self->c, &desc, init.buf, &ct)));
	PyBuffer_Release(&init);
	if (r < 0)
		return zpy_raise_conn(self, r, err);
	return zpy_tensor_wrap(self, ct, name, &desc);
fail_buf:
	PyBuffer_Release(&init);
	return NULL;
}

int
zpy_optim(const char *s, enum zc_optim *ret)
{
	static const struct { const char *name; enum zc_optim o; } names[] = {
		{ "adamw", ZC_ADAMW }, { "adam", ZC_ADAM }, { "adagrad", ZC_ADAGRAD },
		{ "lion", ZC_LION },
	};

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		if (strcmp(s, names[i].name) == 0) {
			*ret = names[i].o;
			return 0;
		}
	}
	PyErr_Format(PyExc_ValueError, "optim must be 'adamw', 'adam', 'adagrad' or 'lion', not "
	    "'%s'", s);
	return -1;
}

static PyObject *
conn_submit(struct zpy_conn *self, PyObject *args, PyObject *kw)
{
	static char *kwlist[] = { "tensors", "optim", "step", "lr", "beta1", "beta2", "eps",
		"weight_decay", "lr_decay", "grad_scale", "max_grad_norm", "no_bias_correction",
		"check_finite", "clip_coef", NULL };
	struct zc_step_params sp = { .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8 };
	unsigned long long step;
	int nobc = 0, finite = 0, r;
	const char *optim;
	PyObject *seq;
	struct zc_tensor **ts;
	char err[ZPY_ERRLEN];
	size_t n;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "OsKd|dddddddppd:submit", kwlist, &seq,
	    &optim, &step, &sp.lr, &sp.beta1, &sp.beta2, &sp.eps, &sp.weight_decay,
	    &sp.lr_decay, &sp.grad_scale, &sp.max_grad_norm, &nobc, &finite, &sp.clip_coef))
		return NULL;
	if (zpy_optim(optim, &sp.optim) < 0 || !zpy_conn_ready(self))
		return NULL;
	sp.step = step;
	sp.no_bias_correction = nobc != 0;
	sp.check_finite = finite != 0;
	if (zpy_tensor_list(self, seq, &ts, &n) < 0)
		return NULL;
	ZPY_CALL(self, r, err, zc_step_submit(self->c, &sp, ts, n));
	PyMem_Free(ts);
	if (r < 0)
		return zpy_raise_conn(self, r, err);
	Py_RETURN_NONE;
}

/* The first phase of a step clipped by the norm over many sets (ranks): zc_grad_pass. */
static PyObject *
conn_grad_pass(struct zpy_conn *self, PyObject *args, PyObject *kw)
{
	static char *kwlist[] = { "tensors", "grad_scale", NULL };
	struct zc_grad_partial part = { 0 };
	double grad_scale = 0;
	struct zc_tensor **ts;
	char err[ZPY_ERRLEN];
	PyObject *seq;
	size_t n;
	int r;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "O|d:grad_pass", kwlist, &seq, &grad_scale))
		return NULL;
	if (!zpy_conn_ready(self) || zpy_tensor_list(self, seq, &ts, &n) < 0)
		return NULL;
	ZPY_CALL(self, r, err, zc_grad_pass(self->c, ts, n, grad_scale, &part));
	PyMem_Free(ts);
	if (r < 0)
		return zpy_raise_conn(self, r, err);
	return Py_BuildValue("{s:d,s:K,s:K}", "sumsq", part.sumsq, "nonfinite",
	    (unsigned long long)part.nonfinite, "elements", (unsigned long long)part.elements);
}

/* zc_clip_coef: torch's clip_grad_norm_ coefficient for a total squared norm (1: none). */
static PyObject *
conn_clip_coef(PyObject *unused, PyObject *args)
{
	double max_norm, sumsq;

	if (!PyArg_ParseTuple(args, "dd:clip_coef", &max_norm, &sumsq))
		return NULL;
	return PyFloat_FromDouble(zc_clip_coef(max_norm, sumsq));
}

static PyObject *
conn_wait_all(struct zpy_conn *self, PyObject *unused)
{
	struct zc_step_result res = { 0 };
	char err[ZPY_ERRLEN];
	int r;

	if (!zpy_conn_ready(self))
		return NULL;
	ZPY_CALL(self, r, err, zc_wait_all(self->c, &res));
	if (r < 0)
		return zpy_raise_conn(self, r, err);
	return zpy_result(&res);
}

/* zc_param_prefetch / zc_param_release over a list of Tensor. */
static PyObject *
conn_handles(struct zpy_conn *self, PyObject *seq,
    int (*fn)(struct zc_conn *, struct zc_tensor *const *, size_t))
{
	struct zc_tensor **ts;
	char err[ZPY_ERRLEN];
	size_t n;
	int r;

	if (!zpy_conn_ready(self) || zpy_tensor_list(self, seq, &ts, &n) < 0)
		return NULL;
	ZPY_CALL(self, r, err, fn(self->c, ts, n));
	PyMem_Free(ts);
	if (r < 0)
		return zpy_raise_conn(self, r, err);
	Py_RETURN_NONE;
}

static PyObject *
conn_param_prefetch(struct zpy_conn *self, PyObject *seq)
{
	return conn_handles(self, seq, zc_param_prefetch);
}

static PyObject *
conn_param_release(struct zpy_conn *self, PyObject *seq)
{
	return conn_handles(self, seq, zc_param_release);
}

static PyObject *
conn_param_stats(struct zpy_conn *self, PyObject *unused)
{
	struct zc_param_stats ps;

	if (!zpy_conn_ready(self))
		return NULL;
	zc_param_stats(self->c, &ps);
	return Py_BuildValue("{s:K,s:K,s:K}", "ready", (unsigned long long)ps.ready, "waited",
	    (unsigned long long)ps.waited, "wait_ns", (unsigned long long)ps.wait_ns);
}

static PyObject *
conn_set_reconnect(struct zpy_conn *self, PyObject *arg)
{
	int ms;

	if (!zpy_conn_ready(self) || parse_reconnect(arg, &ms) < 0)
		return NULL;
	(void)zc_set_reconnect(self->c, ms);
	Py_RETURN_NONE;
}

static PyObject *
conn_conn_stats(struct zpy_conn *self, PyObject *unused)
{
	struct zc_conn_stats cs;

	if (!zpy_conn_ready(self))
		return NULL;
	zc_conn_stats(self->c, &cs);
	return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K}", "reconnects",
	    (unsigned long long)cs.reconnects, "reconnect_ns", (unsigned long long)cs.reconnect_ns,
	    "steps_resubmitted", (unsigned long long)cs.steps_resubmitted, "steps_completed_away",
	    (unsigned long long)cs.steps_completed_away, "slots_remapped",
	    (unsigned long long)cs.slots_remapped);
}

static PyObject *
conn_json(struct zpy_conn *self, int (*fn)(struct zc_conn *, char **))
{
	char err[ZPY_ERRLEN], *text = NULL;
	PyObject *s;
	int r;

	if (!zpy_conn_ready(self))
		return NULL;
	ZPY_CALL(self, r, err, fn(self->c, &text));
	if (r < 0)
		return zpy_raise_conn(self, r, err);
	s = PyUnicode_FromString(text);
	free(text);
	return s;
}

static PyObject *
conn_stats(struct zpy_conn *self, PyObject *unused)
{
	return conn_json(self, zc_stats_json);
}

static PyObject *
conn_jobs(struct zpy_conn *self, PyObject *unused)
{
	return conn_json(self, zc_jobs_json);
}

static PyObject *
conn_ping(struct zpy_conn *self, PyObject *unused)
{
	char err[ZPY_ERRLEN];
	uint64_t rtt = 0;
	int r;

	if (!zpy_conn_ready(self))
		return NULL;
	ZPY_CALL(self, r, err, zc_ping(self->c, &rtt));
	if (r < 0)
		return zpy_raise_conn(self, r, err);
	return PyLong_FromUnsignedLongLong(rtt);
}

static PyMethodDef conn_methods[] = {
	{ "close", (PyCFunction)conn_close, METH_NOARGS,
	  "close(): disconnect.  Tensors still registered stay in the daemon for "
	  "limits.detach_grace_s, for a new process of the same job and rank to take back; "
	  "unregister them (or job_close()) first to free them now." },
	{ "graft_grad_slots", (PyCFunction)zpy_graft_grad_slots, METH_VARARGS,
	  "graft_grad_slots(nbytes, parts) -> Graft: one writable fp32 buffer of nbytes in which "
	  "each (Tensor, offset) of parts is that tensor's grad slot, mapped a second time at that "
	  "byte offset (a page boundary, in order, not overlapping); the rest is scratch.  A write "
	  "there is a gradient in the slot, until a reconnect or an unregister replaces the slot "
	  "(its slots hook says when)." },
	{ "__enter__", conn_enter, METH_NOARGS, NULL },
	{ "__exit__", (PyCFunction)conn_exit, METH_VARARGS, NULL },
	{ "job_open", (PyCFunction)(void (*)(void))conn_job_open, METH_VARARGS | METH_KEYWORDS,
	  "job_open(name, rank=0, world_size=1, *, policy=None, pinned_budget=0)\n"
	  "policy: 'cpu', 'nvme', 'auto' or None / 'default' (the daemon's memory.policy)." },
	{ "job_close", (PyCFunction)conn_job_close, METH_NOARGS,
	  "job_close(): free the job's state, detached ranks included." },
	{ "job_drop", (PyCFunction)conn_job_drop, METH_O, "job_drop(name): free another job." },
	{ "register", (PyCFunction)(void (*)(void))conn_register, METH_VARARGS | METH_KEYWORDS,
	  "register(name, init, *, grad_dtype='fp32', param_dtype='fp32', param_offload=False, "
	  "param_view=False)"
	  " -> Tensor\ninit: a buffer of fp32 initial master values (its length gives numel); "
	  "unused when the tensor is taken back from a rank that died (see Tensor.last_step)." },
	{ "submit", (PyCFunction)(void (*)(void))conn_submit, METH_VARARGS | METH_KEYWORDS,
	  "submit(tensors, *, optim, step, lr, beta1=0.9, beta2=0.999, eps=1e-8, "
	  "weight_decay=0, lr_decay=0, grad_scale=0, max_grad_norm=0, no_bias_correction=False,"
	  " check_finite=False, clip_coef=0): queue one step over tensors; returns at once.\n"
	  "clip_coef > 0: multiply the gradients by it, in (0, 1] (clip_coef() of the norm over "
	  "every rank's grad_pass); max_grad_norm is then unused." },
	{ "grad_pass", (PyCFunction)(void (*)(void))conn_grad_pass, METH_VARARGS | METH_KEYWORDS,
	  "grad_pass(tensors, grad_scale=0) -> dict(sumsq, nonfinite, elements): the squared "
	  "L2 norm (in double) and inf/NaN count of the tensors' unscaled gradients, in their "
	  "grad slots (zc_grad_pass): this set's share of a norm over many ranks." },
	{ "clip_coef", (PyCFunction)conn_clip_coef, METH_VARARGS | METH_STATIC,
	  "clip_coef(max_norm, total_sumsq) -> float: torch.nn.utils.clip_grad_norm_'s "
	  "max_norm / (norm + 1e-6), capped at 1; 1 when not clipping (zc_clip_coef)." },
	{ "wait_all", (PyCFunction)conn_wait_all, METH_NOARGS,
	  "wait_all() -> dict: wait for every submitted step; the last set's result." },
	{ "param_prefetch", (PyCFunction)conn_param_prefetch, METH_O,
	  "param_prefetch(tensors): ask for released params ahead of use." },
	{ "param_release", (PyCFunction)conn_param_release, METH_O,
	  "param_release(tensors): hand the param slots' memory back; params stay on the tiers." },
	{ "param_stats", (PyCFunction)conn_param_stats, METH_NOARGS,
	  "param_stats() -> dict(ready, waited, wait_ns)" },
	{ "set_reconnect", (PyCFunction)conn_set_reconnect, METH_O,
	  "set_reconnect(timeout_ms): how long to keep reconnecting when the connection goes "
	  "(zc_set_reconnect): -1 no bound, 0 none (calls fail with ECONNRESET)." },
	{ "conn_stats", (PyCFunction)conn_conn_stats, METH_NOARGS,
	  "conn_stats() -> dict(reconnects, reconnect_ns, steps_resubmitted, "
	  "steps_completed_away, slots_remapped)" },
	{ "stats", (PyCFunction)conn_stats, METH_NOARGS, "stats() -> str: the daemon's stats JSON" },
	{ "jobs", (PyCFunction)conn_jobs, METH_NOARGS, "jobs() -> str: the daemon's jobs JSON" },
	{ "ping", (PyCFunction)conn_ping, METH_NOARGS, "ping() -> int: round trip in ns" },
	{ "checkpoint_save", (PyCFunction)(void (*)(void))zpy_checkpoint_save,
	  METH_VARARGS | METH_KEYWORDS,
	  "checkpoint_save(dir, entries, optim, step, lr, beta1=0.9, beta2=0.999, eps=1e-8, "
	  "weight_decay=0, lr_decay=0): save this rank's tensors into dir "
	  "(zc_checkpoint_save_pieces).\n"
	  "entries: (Tensor, global_name or None, global_offset, global_numel[, offset, count]) "
	  "tuples, each the tensor's elements [offset, offset + count) (count 0, or none: to its "
	  "end); the keywords are the last step's hyperparameters, saved with the file." },
	{ "register_checkpoint", (PyCFunction)(void (*)(void))zpy_register_checkpoint,
	  METH_VARARGS | METH_KEYWORDS,
	  "register_checkpoint(dir, tensors, optim, *, convert=False, param_views=False) -> "
	  "(list of Tensor, dict)\n"
	  "tensors: (name, numel, grad_dtype, param_dtype, global_name or None, global_offset, "
	  "global_numel) tuples, or (name, numel, grad_dtype, param_dtype, ranges) with ranges "
	  "a list of (offset, count, global_name, global_offset, global_numel), each "
	  "registered with its state (master, moments, step) from the checkpoint in dir "
	  "(elements in none of its ranges zero); all or none.  The dict: the hyperparameters "
	  "saved with rank 0's file (zc_checkpoint_step_params)." },
	{ NULL, NULL, 0, NULL },
};

static PyGetSetDef conn_getset[] = {
	{ "job_last_step", (getter)conn_job_last_step, NULL,
	  "highest step any rank of the open job has completed (0 for a new job)", NULL },
	{ "state_format", (getter)conn_state_format, NULL,
	  "the open job's optimizer state format as the daemon keeps it ('' with no job)", NULL },
	{ "closed", (getter)conn_closed, NULL, "True once close() ran", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

static PyType_Slot conn_slots[] = {
	{ Py_tp_new, conn_new },
	{ Py_tp_dealloc, conn_dealloc },
	{ Py_tp_methods, conn_methods },
	{ Py_tp_getset, conn_getset },
	{ Py_tp_doc, "Connection(socket=None, *, reconnect_ms=None): a connection to zoffloadd "
	    "(socket None: $ZOFFLOAD_SOCKET, else the built-in default).  When the connection "
	    "goes, calls reconnect and reattach for reconnect_ms (None: $ZOFFLOAD_RECONNECT_MS, "
	    "else 60000; -1 no bound; 0 none: they fail with ECONNRESET); conn_stats() counts "
	    "the reconnects." },
	{ 0, NULL },
};

PyType_Spec zpy_conn_spec = {
	.name = "zoffload._zclient.Connection",
	.basicsize = sizeof(struct zpy_conn),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
	.slots = conn_slots,
};
