/* zoffload._zclient.Tensor and Slot: a registered tensor, its state, and its slots as buffers. */
#include <errno.h>
#include <string.h>
#include <sys/mman.h>

#include "copy.h"
#include "zpy.h"

/*
 * A view of one of a tensor's slots through the buffer protocol (torch.frombuffer,
 * memoryview, numpy): no copy.  It holds its Tensor, and the Tensor counts it,
 * so that nothing unmaps the slot while it is alive.
 */
enum zpy_slot_kind {
	ZPY_SLOT_GRAD,			/* writable */
	ZPY_SLOT_PARAM,			/* read-only: the daemon writes it */
	ZPY_SLOT_VIEW,			/* the param view: writable, private (zc_tensor_param_view) */
};

struct zpy_slot {
	PyObject_HEAD
	struct zpy_tensor *owner;	/* strong */
	enum zpy_slot_kind kind;
	Py_ssize_t shape, stride;	/* what a typed buffer view points at */
};

static void
tensor_dealloc(struct zpy_tensor *self)
{
	PyTypeObject *tp = Py_TYPE(self);

	/* The C tensor stays with the connection (freed at disconnect), as a dead rank's would. */
	if (self->kept.grad.addr != NULL)
		munmap(self->kept.grad.addr, self->kept.grad.bytes);
	if (self->kept.param.addr != NULL)
		munmap(self->kept.param.addr, self->kept.param.bytes);
	if (self->kept.param_view.addr != NULL)
		munmap(self->kept.param_view.addr, self->kept.param_view.bytes);
	if (self->prev != NULL)
		self->prev->next = self->next;
	else if (self->conn != NULL && self->conn->tensors == self)
		self->conn->tensors = self->next;
	if (self->next != NULL)
		self->next->prev = self->prev;
	Py_XDECREF(self->name);
	Py_XDECREF(self->conn);
	tp->tp_free(self);
	Py_DECREF(tp);
}

static PyObject *
tensor_repr(struct zpy_tensor *self)
{
	return PyUnicode_FromFormat("<zoffload Tensor %R numel=%llu grad=%s param=%s%s>",
	    self->name, (unsigned long long)self->numel, zpy_dtype_name(self->grad_dtype),
	    zpy_dtype_name(self->param_dtype), self->t == NULL ? " (gone)" : "");
}

static PyObject *
tensor_slot(struct zpy_tensor *self, enum zpy_slot_kind kind)
{
	struct zpy_state *st = zpy_state_of(Py_TYPE(self));
	struct zpy_slot *s;

	if (!zpy_tensor_ready(self))
		return NULL;
	s = (struct zpy_slot *)st->slot_type->tp_alloc(st->slot_type, 0);
	if (s == NULL)
		return NULL;
	s->owner = (struct zpy_tensor *)Py_NewRef(self);
	s->kind = kind;
	self->live_slots++;
	return (PyObject *)s;
}

static PyObject *
tensor_grad(struct zpy_tensor *self, void *closure)
{
	return tensor_slot(self, ZPY_SLOT_GRAD);
}

static PyObject *
tensor_param(struct zpy_tensor *self, void *closure)
{
	return tensor_slot(self, ZPY_SLOT_PARAM);
}

static PyObject *
tensor_param_view(struct zpy_tensor *self, void *closure)
{
	if (!zpy_tensor_ready(self))
		return NULL;
	if (zc_tensor_param_view(self->t, NULL) == NULL)
		Py_RETURN_NONE;
	return tensor_slot(self, ZPY_SLOT_VIEW);
}

static PyObject *
tensor_view_tracking(struct zpy_tensor *self, void *closure)
{
	if (!zpy_tensor_ready(self))
		return NULL;
	return PyUnicode_FromString(zc_tensor_param_view_tracking(self->t));
}

static PyObject *
tensor_view_written(struct zpy_tensor *self, PyObject *unused)
{
	char err[ZPY_ERRLEN];
	uint64_t pages = 0;
	int r;

	if (!zpy_tensor_ready(self))
		return NULL;
	ZPY_CALL(self->conn, r, err, zc_tensor_param_view_written(self->t, &pages));
	if (r < 0)
		return zpy_raise(Py_TYPE(self), r, err);
	return PyLong_FromUnsignedLongLong(pages);
}

static PyObject *
tensor_view_reset(struct zpy_tensor *self, PyObject *unused)
{
	char err[ZPY_ERRLEN];
	int r;

	if (!zpy_tensor_ready(self))
		return NULL;
	ZPY_CALL(self->conn, r, err, zc_tensor_param_view_reset(self->t));
	if (r < 0)
		return zpy_raise(Py_TYPE(self), r, err);
	Py_RETURN_NONE;
}

static PyObject *
tensor_name(struct zpy_tensor *self, void *closure)
{
	return Py_NewRef(self->name);
}

static PyObject *
tensor_numel(struct zpy_tensor *self, void *closure)
{
	return PyLong_FromUnsignedLongLong(self->numel);
}

static PyObject *
tensor_grad_dtype(struct zpy_tensor *self, void *closure)
{
	return PyUnicode_FromString(zpy_dtype_name(self->grad_dtype));
}

static PyObject *
tensor_param_dtype(struct zpy_tensor *self, void *closure)
{
	return PyUnicode_FromString(zpy_dtype_name(self->param_dtype));
}

static PyObject *
tensor_registered(struct zpy_tensor *self, void *closure)
{
	return PyBool_FromLong(self->t != NULL);
}

static PyObject *
tensor_last_step(struct zpy_tensor *self, void *closure)
{
	uint64_t step;

	if (!zpy_tensor_ready(self))
		return NULL;
	/* Only events (under the lock) change it; reading it under the lock sees a whole value. */
	Py_BEGIN_ALLOW_THREADS
	PyThread_acquire_lock(self->conn->lock, WAIT_LOCK);
	step = zc_tensor_last_step(self->t);
	PyThread_release_lock(self->conn->lock);
	Py_END_ALLOW_THREADS
	return PyLong_FromUnsignedLongLong(step);
}

static PyObject *
tensor_wait(struct zpy_tensor *self, PyObject *unused)
{
	struct zc_step_result res = { 0 };
	char err[ZPY_ERRLEN];
	int r;

	if (!zpy_tensor_ready(self))
		return NULL;
	ZPY_CALL(self->conn, r, err, zc_wait_tensor(self->t, &res));
	if (r < 0 && res.status != ZC_STEP_FAILED)
		return zpy_raise(Py_TYPE(self), r, err);
	if (r < 0) {
		char msg[ZPY_ERRLEN + 160];

		snprintf(msg, sizeof(msg), "step %llu of tensor '%s' failed: %s",
		    (unsigned long long)res.step, PyUnicode_AsUTF8(self->name), err);
		return zpy_raise(Py_TYPE(self), r, msg);
	}
	return zpy_result(&res);
}

static int
parse_state(const char *s, enum zc_state *ret)
{
	if (strcmp(s, "master") == 0)
		*ret = ZC_STATE_MASTER;
	else if (strcmp(s, "exp_avg") == 0)
		*ret = ZC_STATE_EXP_AVG;
	else if (strcmp(s, "exp_avg_sq") == 0)
		*ret = ZC_STATE_EXP_AVG_SQ;
	else {
		PyErr_Format(PyExc_ValueError, "state must be 'master', 'exp_avg' or 'exp_avg_sq', "
		    "not '%s'", s);
		return -1;
	}
	return 0;
}

/* read(state, out, offset=0) / write(state, src, offset=0): fp32 values, count from the buffer. */
static PyObject *
tensor_io(struct zpy_tensor *self, PyObject *args, PyObject *kw, bool write)
{
	static char *kwlist[] = { "state", "buffer", "offset", NULL };
	unsigned long long offset = 0;
	enum zc_state which;
	const char *state;
	char err[ZPY_ERRLEN];
	Py_buffer b;
	int r;

	if (!PyArg_ParseTupleAndKeywords(args, kw, write ? "sy*|K:write" : "sw*|K:read", kwlist,
	    &state, &b, &offset))
		return NULL;
	if (parse_state(state, &which) < 0 || !zpy_tensor_ready(self))
		goto fail;
	if (b.len % sizeof(float) != 0) {
		PyErr_Format(PyExc_ValueError, "%s: the buffer holds %zd bytes, not whole fp32 values",
		    write ? "write" : "read", b.len);
		goto fail;
	}
	ZPY_CALL(self->conn, r, err, write ?
	    zc_tensor_write(self->t, which, offset, (uint64_t)b.len / sizeof(float), b.buf) :
	    zc_tensor_read(self->t, which, offset, (uint64_t)b.len / sizeof(float), b.buf));
	PyBuffer_Release(&b);
	if (r < 0)
		return zpy_raise(Py_TYPE(self), r, err);
	Py_RETURN_NONE;
fail:
	PyBuffer_Release(&b);
	return NULL;
}

static PyObject *
tensor_read(struct zpy_tensor *self, PyObject *args, PyObject *kw)
{
	return tensor_io(self, args, kw, false);
}

static PyObject *
tensor_write(struct zpy_tensor *self, PyObject *args, PyObject *kw)
{
	return tensor_io(self, args, kw, true);
}

/*
 * param_into(out) / grad_from(src): the whole slot to or from a buffer of the same size, a
 * copy without the GIL.  zoffload.torch copies this way rather than through torch's copy_,
 * whose OpenMP threads would spin on the cores the daemon is stepping on.  Streaming stores
 * (zu_copy_stream): the daemon reads a gradient next from memory, a param copied out is read
 * at the next forward, and neither is in the caches by then when it is large.
 */
static PyObject *
tensor_slot_copy(struct zpy_tensor *self, PyObject *arg, bool into)
{
	Py_buffer b;
	size_t bytes;
	void *slot;

	if (PyObject_GetBuffer(arg, &b, into ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS :
	    PyBUF_C_CONTIGUOUS) < 0)
		return NULL;
	if (!zpy_tensor_ready(self))
		goto fail;
	slot = into ? (void *)zc_tensor_param_slot(self->t, &bytes) :
	    zc_tensor_grad_slot(self->t, &bytes);
	if ((size_t)b.len != bytes) {
		PyErr_Format(PyExc_ValueError, "tensor %R: the buffer holds %zd bytes, its %s slot %zu",
		    self->name, b.len, into ? "param" : "grad", bytes);
		goto fail;
	}
	Py_BEGIN_ALLOW_THREADS
	PyThread_acquire_lock(self->conn->lock, WAIT_LOCK);
	if (into)
		zu_copy_stream(b.buf, slot, bytes);
	else
		zu_copy_stream(slot, b.buf, bytes);
	PyThread_release_lock(self->conn->lock);
	Py_END_ALLOW_THREADS
	PyBuffer_Release(&b);
	Py_RETURN_NONE;
fail:
	PyBuffer_Release(&b);
	return NULL;
}

static PyObject *
tensor_param_into(struct zpy_tensor *self, PyObject *arg)
{
	return tensor_slot_copy(self, arg, true);
}

static PyObject *
tensor_grad_from(struct zpy_tensor *self, PyObject *arg)
{
	return tensor_slot_copy(self, arg, false);
}

static PyObject *
tensor_set_step(struct zpy_tensor *self, PyObject *arg)
{
	unsigned long long step = PyLong_AsUnsignedLongLong(arg);
	char err[ZPY_ERRLEN];
	int r;

	if (step == (unsigned long long)-1 && PyErr_Occurred())
		return NULL;
	if (!zpy_tensor_ready(self))
		return NULL;
	ZPY_CALL(self->conn, r, err, zc_tensor_set_step(self->t, step));
	if (r < 0)
		return zpy_raise(Py_TYPE(self), r, err);
	Py_RETURN_NONE;
}

static PyObject *
tensor_param_wait(struct zpy_tensor *self, PyObject *unused)
{
	char err[ZPY_ERRLEN];
	int r;

	if (!zpy_tensor_ready(self))
		return NULL;
	ZPY_CALL(self->conn, r, err, zc_param_wait(self->t));
	if (r < 0)
		return zpy_raise(Py_TYPE(self), r, err);
	Py_RETURN_NONE;
}

static PyObject *
tensor_unregister(struct zpy_tensor *self, PyObject *unused)
{
	char err[ZPY_ERRLEN];
	PyObject *kept;
	int r;

	if (!zpy_tensor_ready(self) || (kept = zpy_tensors_keep_viewed(self->conn, self)) == NULL)
		return NULL;
	ZPY_CALL(self->conn, r, err, zc_tensor_unregister(self->t));
	if (r < 0) {
		zpy_tensors_kept_done(kept, false);
		return zpy_raise(Py_TYPE(self), r, err);
	}
	self->t = NULL;
	self->hook = NULL;		/* freed by its last call */
	zpy_tensors_kept_done(kept, true);
	Py_RETURN_NONE;
}

#if PY_VERSION_HEX >= 0x030D0000
#define zpy_finalizing() Py_IsFinalizing()
#else
#define zpy_finalizing() _Py_IsFinalizing()
#endif

/*
 * libzclient's slots hook: runs the record's callable with "remap" or "unmap".
 * It is called inside a libzclient call, under the connection's lock and
 * without the GIL, from the thread that made the call; the callable must not
 * use the connection (it would wait for the lock that thread holds).  An
 * exception cannot propagate through libzclient: it is reported as unraisable.
 */
static void
slots_hook_run(struct zc_tensor *t, enum zc_slots_event why, void *arg)
{
	struct zpy_slots_hook *h = arg;
	PyGILState_STATE gil;
	PyObject *r;

	(void)t;
	/* At interpreter exit nothing Python may run (the memory goes with the process). */
	if (zpy_finalizing())
		return;
	gil = PyGILState_Ensure();
	r = PyObject_CallFunction(h->fn, "s", why == ZC_SLOTS_REMAP ? "remap" : "unmap");
	if (r == NULL)
		PyErr_WriteUnraisable(h->fn);
	Py_XDECREF(r);
	if (why == ZC_SLOTS_UNMAP) {
		Py_DECREF(h->fn);
		PyMem_RawFree(h);
	}
	PyGILState_Release(gil);
}

static PyObject *
tensor_set_slots_hook(struct zpy_tensor *self, PyObject *fn)
{
	struct zpy_slots_hook *h = NULL, *old;
	char err[ZPY_ERRLEN];
	int r;

	if (!zpy_tensor_ready(self))
		return NULL;
	if (fn != Py_None && !PyCallable_Check(fn))
		return PyErr_Format(PyExc_TypeError, "set_slots_hook() takes a callable or None, "
		    "not %.100s", Py_TYPE(fn)->tp_name);
	if (fn != Py_None) {
		h = PyMem_RawMalloc(sizeof(*h));
		if (h == NULL)
			return PyErr_NoMemory();
		h->fn = Py_NewRef(fn);
	}
	old = self->hook;
	/* Under the lock: a reconnect on another thread may be running the old hook. */
	ZPY_CALL(self->conn, r, err, (zc_tensor_set_slots_hook(self->t,
	    h != NULL ? slots_hook_run : NULL, h), 0));
	(void)r;
	self->hook = h;
	if (old != NULL) {
		Py_DECREF(old->fn);
		PyMem_RawFree(old);
	}
	Py_RETURN_NONE;
}

static PyMethodDef tensor_methods[] = {
	{ "set_slots_hook", (PyCFunction)tensor_set_slots_hook, METH_O,
	  "set_slots_hook(fn): fn('remap') just before a reconnect maps other files over the "
	  "slots (same addresses; the tensor lives on), fn('unmap') just before they are "
	  "unmapped for good (its last call).  A layer that registered the slots' pages with a "
	  "driver (cudaHostRegister) lets go of them there.  fn must not use the connection; "
	  "None removes it." },
	{ "wait", (PyCFunction)tensor_wait, METH_NOARGS,
	  "wait() -> dict: wait for this tensor's step; raises if it failed." },
	{ "read", (PyCFunction)(void (*)(void))tensor_read, METH_VARARGS | METH_KEYWORDS,
	  "read(state, out, offset=0): copy fp32 'master', 'exp_avg' or 'exp_avg_sq' values "
	  "into the writable buffer out (its length gives the count)." },
	{ "write", (PyCFunction)(void (*)(void))tensor_write, METH_VARARGS | METH_KEYWORDS,
	  "write(state, src, offset=0): load fp32 values into the state (master also refreshes "
	  "the param slot); then set_step()." },
	{ "param_into", (PyCFunction)tensor_param_into, METH_O,
	  "param_into(out): copy the param slot into the writable buffer out (same size)." },
	{ "grad_from", (PyCFunction)tensor_grad_from, METH_O,
	  "grad_from(src): copy the buffer src (same size) into the grad slot." },
	{ "set_step", (PyCFunction)tensor_set_step, METH_O,
	  "set_step(step): the step the state is at; the next one submitted must be above it." },
	{ "param_wait", (PyCFunction)tensor_param_wait, METH_NOARGS,
	  "param_wait(): return once the param slot holds the params again." },
	{ "view_written", (PyCFunction)tensor_view_written, METH_NOARGS,
	  "view_written() -> int: pages of the param view this process wrote (its own copies, "
	  "which the daemon does not see and steps do not update)." },
	{ "view_reset", (PyCFunction)tensor_view_reset, METH_NOARGS,
	  "view_reset(): drop the param view's written pages: it reads the param slot again." },
	{ "unregister", (PyCFunction)tensor_unregister, METH_NOARGS,
	  "unregister(): free the tensor in the daemon.  Slot views still alive keep the "
	  "slots' memory, as it was, until the last of them goes." },
	{ NULL, NULL, 0, NULL },
};

static PyGetSetDef tensor_getset[] = {
	{ "grad", (getter)tensor_grad, NULL, "the grad slot, a writable buffer", NULL },
	{ "param", (getter)tensor_param, NULL, "the param slot, a read-only buffer", NULL },
	{ "param_view", (getter)tensor_param_view, NULL, "the param view (register(..., "
	  "param_view=True)), a writable buffer that reads the param slot where this process "
	  "has not written; None without one", NULL },
	{ "view_tracking", (getter)tensor_view_tracking, NULL, "how the param view's writes are "
	  "found: 'userfaultfd', 'pagemap' (slower) or 'none' (no view)", NULL },
	{ "name", (getter)tensor_name, NULL, NULL, NULL },
	{ "numel", (getter)tensor_numel, NULL, NULL, NULL },
	{ "grad_dtype", (getter)tensor_grad_dtype, NULL, NULL, NULL },
	{ "param_dtype", (getter)tensor_param_dtype, NULL, NULL, NULL },
	{ "registered", (getter)tensor_registered, NULL, NULL, NULL },
	{ "last_step", (getter)tensor_last_step, NULL,
	  "last step applied: 0 when new, the step to resume after when taken back", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

static PyObject *
tensor_new_refused(PyTypeObject *type, PyObject *args, PyObject *kw)
{
	PyErr_SetString(PyExc_TypeError, "Tensor objects come from Connection.register()");
	return NULL;
}

static PyType_Slot tensor_slots[] = {
	{ Py_tp_new, tensor_new_refused },
	{ Py_tp_dealloc, tensor_dealloc },
	{ Py_tp_repr, tensor_repr },
	{ Py_tp_methods, tensor_methods },
	{ Py_tp_getset, tensor_getset },
	{ Py_tp_doc, "A tensor registered with zoffloadd (Connection.register)." },
	{ 0, NULL },
};

PyType_Spec zpy_tensor_spec = {
	.name = "zoffload._zclient.Tensor",
	.basicsize = sizeof(struct zpy_tensor),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
	.slots = tensor_slots,
};

static void
slot_dealloc(struct zpy_slot *self)
{
	PyTypeObject *tp = Py_TYPE(self);

	self->owner->live_slots--;
	Py_DECREF(self->owner);
	tp->tp_free(self);
	Py_DECREF(tp);
}

static void *
slot_address_of(struct zpy_slot *self, size_t *ret_bytes)
{
	switch (self->kind) {
	case ZPY_SLOT_GRAD:
		return zc_tensor_grad_slot(self->owner->t, ret_bytes);
	case ZPY_SLOT_PARAM:
		return (void *)zc_tensor_param_slot(self->owner->t, ret_bytes);
	case ZPY_SLOT_VIEW:
		break;
	}
	return zc_tensor_param_view(self->owner->t, ret_bytes);
}

static int
slot_getbuffer(struct zpy_slot *self, Py_buffer *view, int flags)
{
	struct zpy_tensor *t = self->owner;
	enum zc_dtype dt = self->kind == ZPY_SLOT_GRAD ? t->grad_dtype : t->param_dtype;
	size_t bytes;
	void *p;

	view->obj = NULL;
	if (t->t == NULL) {
		/* A Slot made before the tensor went can outlive it only as an empty shell. */
		PyErr_Format(PyExc_BufferError, "tensor %R is no longer registered", t->name);
		return -1;
	}
	if ((flags & PyBUF_WRITABLE) && self->kind == ZPY_SLOT_PARAM) {
		PyErr_Format(PyExc_BufferError, "the param slot of tensor %R is read-only (the "
		    "daemon writes it)", t->name);
		return -1;
	}
	p = slot_address_of(self, &bytes);
	view->buf = p;
	view->obj = Py_NewRef(self);
	view->len = (Py_ssize_t)bytes;
	view->readonly = self->kind == ZPY_SLOT_PARAM;
	view->itemsize = dt == ZC_F32 ? 4 : 2;
	/* struct has no bfloat16: 'H' keeps the size right; torch.frombuffer takes the dtype. */
	view->format = (flags & PyBUF_FORMAT) ? (dt == ZC_F32 ? "f" : dt == ZC_F16 ? "e" : "H") :
	    NULL;
	view->ndim = 1;
	self->shape = view->len / view->itemsize;
	self->stride = view->itemsize;
	view->shape = (flags & PyBUF_ND) == PyBUF_ND ? &self->shape : NULL;
	view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &self->stride : NULL;
	view->suboffsets = NULL;
	view->internal = NULL;
	return 0;
}

static PyObject *
slot_nbytes(struct zpy_slot *self, void *closure)
{
	size_t bytes = 0;

	if (self->owner->t == NULL)
		return PyLong_FromLong(0);
	(void)slot_address_of(self, &bytes);
	return PyLong_FromSize_t(bytes);
}

static PyObject *
slot_address(struct zpy_slot *self, void *closure)
{
	if (!zpy_tensor_ready(self->owner))
		return NULL;
	return PyLong_FromVoidPtr(slot_address_of(self, NULL));
}

static PyGetSetDef slot_getset[] = {
	{ "nbytes", (getter)slot_nbytes, NULL, "size of the slot in bytes", NULL },
	{ "address", (getter)slot_address, NULL,
	  "the slot's address (for cudaHostRegister); valid while the tensor is registered", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

static PyType_Slot slot_slots[] = {
	{ Py_tp_new, tensor_new_refused },
	{ Py_tp_dealloc, slot_dealloc },
	{ Py_tp_getset, slot_getset },
	{ Py_bf_getbuffer, slot_getbuffer },
	{ Py_tp_doc, "A tensor's grad or param slot (shared memory with zoffloadd), viewed "
	    "through the buffer protocol: torch.frombuffer(slot, dtype=...)." },
	{ 0, NULL },
};

PyType_Spec zpy_slot_spec = {
	.name = "zoffload._zclient.Slot",
	.basicsize = sizeof(struct zpy_slot),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
	.slots = slot_slots,
};
