/*
 * Conn.graft_grad_slots: one buffer made of several tensors' grad slots, each
 * at a byte offset the caller chooses, for a collective to write gradients
 * straight into the slots (FSDP2's reduce-scatter output: zoffload/_graft.py).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE		/* mremap's MREMAP_FIXED */
#endif
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "zpy.h"

/*
 * The buffer is a reserved anonymous range with each slot's pages mapped
 * again over its part (mremap with old size 0 maps a shared mapping's pages
 * a second time): a write there is a write into the slot's file, which the
 * daemon steps from.  What lies between and after the parts is private
 * scratch nobody reads (FSDP2's shard padding).  The mappings are the
 * object's: they keep the slot files alive after a reconnect or an
 * unregister replaced or dropped them (then writes here no longer reach the
 * daemon: zoffload/_graft.py stops trusting the graft at the slots hook), and
 * go in the dealloc, once the last exported buffer is released.
 */
struct zpy_graft {
	PyObject_HEAD
	char *base;
	size_t mapped;			/* page-rounded */
	Py_ssize_t nbytes;		/* what the buffer shows */
	Py_ssize_t shape, stride;
};

static size_t page_round(size_t n, size_t page)
{
	return (n + page - 1) / page * page;
}

static void graft_dealloc(struct zpy_graft *self)
{
	PyTypeObject *tp = Py_TYPE(self);

	if (self->base != NULL)
		munmap(self->base, self->mapped);
	tp->tp_free(self);
	Py_DECREF(tp);
}

static int graft_getbuffer(struct zpy_graft *self, Py_buffer *view, int flags)
{
	view->buf = self->base;
	view->obj = Py_NewRef(self);
	view->len = self->nbytes;
	view->readonly = 0;
	view->itemsize = 4;
	view->format = (flags & PyBUF_FORMAT) ? "f" : NULL;
	view->ndim = 1;
	self->shape = self->nbytes / 4;
	self->stride = 4;
	view->shape = (flags & PyBUF_ND) == PyBUF_ND ? &self->shape : NULL;
	view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &self->stride : NULL;
	view->suboffsets = NULL;
	view->internal = NULL;
	return 0;
}

static PyObject *graft_address(struct zpy_graft *self, void *closure)
{
	return PyLong_FromVoidPtr(self->base);
}

static PyObject *graft_get_nbytes(struct zpy_graft *self, void *closure)
{
	return PyLong_FromSsize_t(self->nbytes);
}

static PyGetSetDef graft_getset[] = {
	{ "address", (getter)graft_address, NULL, "the buffer's first byte", NULL },
	{ "nbytes", (getter)graft_get_nbytes, NULL, "size of the buffer in bytes", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

static PyObject *graft_new_refused(PyTypeObject *type, PyObject *args, PyObject *kw)
{
	return PyErr_Format(PyExc_TypeError, "a Graft is made by Conn.graft_grad_slots()");
}

static PyType_Slot graft_slots[] = {
	{ Py_tp_new, graft_new_refused },
	{ Py_tp_dealloc, graft_dealloc },
	{ Py_tp_getset, graft_getset },
	{ Py_bf_getbuffer, graft_getbuffer },
	{ Py_tp_doc, "fp32 grad slots of several tensors in one buffer, each at its offset "
	    "(Conn.graft_grad_slots): torch.frombuffer(graft, dtype=torch.float32)." },
	{ 0, NULL },
};

PyType_Spec zpy_graft_spec = {
	.name = "zoffload._zclient.Graft",
	.basicsize = sizeof(struct zpy_graft),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
	.slots = graft_slots,
};

struct part {
	struct zpy_tensor *t;		/* borrowed from the caller's list */
	size_t off;
};

/* The parts as (Tensor, byte offset) pairs of this connection, fp32, in order, apart, inside. */
static int parse_parts(struct zpy_conn *conn, PyObject *seq, size_t nbytes, size_t page,
    struct part **ret, size_t *ret_n)
{
	struct zpy_state *st = zpy_state_of(Py_TYPE(conn));
	size_t end = 0;
	struct part *out;
	PyObject *fast;
	Py_ssize_t n;

	out = zpy_seq_array(seq, "parts: expected a sequence of (Tensor, offset)", sizeof(*out),
	    &fast, &n);
	if (out == NULL)
		return -1;
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *o = PySequence_Fast_GET_ITEM(fast, i), *to;
		struct zpy_tensor *t;
		unsigned long long off;

		if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 2 ||
		    !PyObject_TypeCheck((to = PyTuple_GET_ITEM(o, 0)), st->tensor_type)) {
			PyErr_Format(PyExc_TypeError, "parts[%zd]: expected a (Tensor, offset) pair", i);
			goto fail;
		}
		t = (struct zpy_tensor *)to;
		off = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(o, 1));
		if (off == (unsigned long long)-1 && PyErr_Occurred())
			goto fail;
		if (!zpy_tensor_ready(t))
			goto fail;
		if (t->conn != conn) {
			PyErr_Format(PyExc_ValueError, "parts[%zd]: tensor %R is another connection's",
			    i, t->name);
			goto fail;
		}
		if (t->grad_dtype != ZC_F32) {
			PyErr_Format(PyExc_ValueError, "parts[%zd]: tensor %R has %s gradients, not fp32",
			    i, t->name, zpy_dtype_name(t->grad_dtype));
			goto fail;
		}
		if (off % page != 0 || off < end || off > nbytes ||
		    t->numel * 4 > nbytes - off) {
			PyErr_Format(PyExc_ValueError, "parts[%zd]: tensor %R at byte %llu: not on a page "
			    "boundary, overlapping the part before, or past the %zu bytes", i, t->name,
			    off, nbytes);
			goto fail;
		}
		out[i] = (struct part){ t, off };
		end = off + page_round(t->numel * 4, page);
	}
	Py_DECREF(fast);
	*ret = out;
	*ret_n = (size_t)n;
	return 0;
fail:
	Py_DECREF(fast);
	PyMem_Free(out);
	return -1;
}

PyObject *zpy_graft_grad_slots(struct zpy_conn *self, PyObject *args)
{
	struct zpy_state *st = zpy_state_of(Py_TYPE(self));
	size_t page = (size_t)sysconf(_SC_PAGESIZE), mapped, n = 0;
	struct zpy_graft *g = NULL;
	struct part *parts = NULL;
	Py_ssize_t nbytes;
	PyObject *seq;
	char *base;
	int err = 0;

	if (!PyArg_ParseTuple(args, "nO:graft_grad_slots", &nbytes, &seq))
		return NULL;
	if (nbytes <= 0 || nbytes % 4 != 0)
		return PyErr_Format(PyExc_ValueError, "graft_grad_slots: nbytes %zd is not a positive "
		    "multiple of 4", nbytes);
	if (!zpy_conn_ready(self) || parse_parts(self, seq, (size_t)nbytes, page, &parts, &n) < 0)
		return NULL;
	mapped = page_round((size_t)nbytes, page);
	/*
	 * Under the connection's lock: a reconnect on another thread maps other
	 * files over the slots, and the parts must be the slots of one moment.
	 */
	Py_BEGIN_ALLOW_THREADS
	PyThread_acquire_lock(self->lock, WAIT_LOCK);
	base = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS |
	    MAP_NORESERVE, -1, 0);
	if (base == MAP_FAILED)
		err = errno;
	for (size_t i = 0; err == 0 && i < n; i++) {
		void *slot = zc_tensor_grad_slot(parts[i].t->t, NULL);
		size_t len = page_round(parts[i].t->numel * 4, page);

		if (len > 0 && mremap(slot, 0, len, MREMAP_MAYMOVE | MREMAP_FIXED,
		    base + parts[i].off) == MAP_FAILED)
			err = errno;
	}
	PyThread_release_lock(self->lock);
	Py_END_ALLOW_THREADS
	PyMem_Free(parts);
	if (err != 0) {
		if (base != MAP_FAILED)
			munmap(base, mapped);
		errno = err;
		return PyErr_SetFromErrno(PyExc_OSError);
	}
	g = (struct zpy_graft *)st->graft_type->tp_alloc(st->graft_type, 0);
	if (g == NULL) {
		munmap(base, mapped);
		return NULL;
	}
	g->base = base;
	g->mapped = mapped;
	g->nbytes = nbytes;
	return (PyObject *)g;
}
