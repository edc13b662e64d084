/*
 * zoffload._zclient: the streaming checkpoint (zc_checkpoint_save, and zc_checkpoint_open +
 * zc_tensors_register_checkpoint for a restore), as two Connection methods.  A restore
 * registers a whole list of tensors inside one call so that it is all or none: the
 * checkpoint handle never reaches Python, and a failure leaves none registered.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zpy.h"

/* One (Tensor, global_name or None, global_offset, global_numel) tuple of checkpoint_save. */
static int
parse_save_entry(struct zpy_conn *conn, PyObject *item, Py_ssize_t i,
    struct zc_checkpoint_entry *e, PyObject **tensor)
{
	PyObject *gname, *wrap;
	unsigned long long off, gnumel;
	struct zc_tensor **one;
	size_t n;
	int r;

	if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "OOKK", tensor, &gname, &off,
	    &gnumel)) {
		if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
			PyErr_Clear();
			PyErr_Format(PyExc_TypeError, "entry %zd: expected (Tensor, global_name or "
			    "None, global_offset, global_numel), not %R", i, item);
		}
		return -1;
	}
	wrap = PyTuple_Pack(1, *tensor);
	r = wrap == NULL ? -1 : zpy_tensor_list(conn, wrap, &one, &n);
	Py_XDECREF(wrap);
	if (r < 0)
		return -1;
	e->tensor = one[0];
	PyMem_Free(one);
	e->global_name = NULL;
	if (gname != Py_None) {
		e->global_name = PyUnicode_Check(gname) ? PyUnicode_AsUTF8(gname) : NULL;
		if (e->global_name == NULL) {
			if (!PyErr_Occurred())
				PyErr_Format(PyExc_TypeError, "entry %zd: global_name must be a str "
				    "or None", i);
			return -1;
		}
	}
	e->global_offset = off;
	e->global_numel = gnumel;
	return 0;
}

PyObject *
zpy_checkpoint_save(struct zpy_conn *self, PyObject *args, PyObject *kw)
{
	static char *kwlist[] = { "dir", "entries", "optim", "step", "lr", "beta1", "beta2",
		"eps", "weight_decay", "lr_decay", NULL };
	struct zc_step_params sp = { .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8 };
	struct zc_checkpoint_entry *es = NULL;
	PyObject *dir, *seq, *fast = NULL, *ret = NULL;
	unsigned long long step;
	const char *optim;
	char err[ZPY_ERRLEN];
	Py_ssize_t n;
	int r;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "O&OsKd|ddddd:checkpoint_save", kwlist,
	    PyUnicode_FSConverter, &dir, &seq, &optim, &step, &sp.lr, &sp.beta1, &sp.beta2,
	    &sp.eps, &sp.weight_decay, &sp.lr_decay))
		return NULL;
	if (zpy_optim(optim, &sp.optim) < 0 || !zpy_conn_ready(self))
		goto out;
	sp.step = step;
	fast = PySequence_Fast(seq, "entries: expected a sequence of tuples");
	if (fast == NULL)
		goto out;
	n = PySequence_Fast_GET_SIZE(fast);
	if (n == 0) {
		PyErr_SetString(PyExc_ValueError, "checkpoint_save: no entries to save");
		goto out;
	}
	es = PyMem_Calloc((size_t)n, sizeof(*es));
	if (es == NULL) {
		PyErr_NoMemory();
		goto out;
	}
	/* The names point into the tuples' str objects, which fast keeps alive. */
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *tensor;

		if (parse_save_entry(self, PySequence_Fast_GET_ITEM(fast, i), i, &es[i], &tensor)
		    < 0)
			goto out;
	}
	ZPY_CALL(self, r, err, zc_checkpoint_save(self->c, PyBytes_AS_STRING(dir), es,
	    (size_t)n, &sp));
	if (r < 0) {
		zpy_raise_conn(self, r, err);
		goto out;
	}
	ret = Py_NewRef(Py_None);
out:
	PyMem_Free(es);
	Py_XDECREF(fast);
	Py_DECREF(dir);
	return ret;
}

/* What one tuple of register_checkpoint asks for; the strs stay owned by the tuple. */
struct restore_item {
	PyObject *name;
	struct zc_tensor_desc desc;
	struct zc_checkpoint_place place;
};

static int
parse_restore_item(PyObject *item, Py_ssize_t i, struct restore_item *it)
{
	PyObject *gd, *pd, *gname;
	unsigned long long numel, off, gnumel;
	int g, p;

	if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "UKOOOKK", &it->name, &numel, &gd,
	    &pd, &gname, &off, &gnumel)) {
		if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
			PyErr_Clear();
			PyErr_Format(PyExc_TypeError, "tensor %zd: expected (name, numel, grad_dtype, "
			    "param_dtype, global_name or None, global_offset, global_numel), not %R",
			    i, item);
		}
		return -1;
	}
	g = zpy_dtype(gd, "grad_dtype");
	p = g < 0 ? -1 : zpy_dtype(pd, "param_dtype");
	if (p < 0)
		return -1;
	it->desc.name = PyUnicode_AsUTF8(it->name);
	if (it->desc.name == NULL)
		return -1;
	if (numel == 0) {
		PyErr_Format(PyExc_ValueError, "tensor %R: numel must be > 0", it->name);
		return -1;
	}
	it->desc.numel = numel;
	it->desc.grad_dtype = (enum zc_dtype)g;
	it->desc.param_dtype = (enum zc_dtype)p;
	it->place.global_name = NULL;
	if (gname != Py_None) {
		it->place.global_name = PyUnicode_Check(gname) ? PyUnicode_AsUTF8(gname) : NULL;
		if (it->place.global_name == NULL) {
			if (!PyErr_Occurred())
				PyErr_Format(PyExc_TypeError, "tensor %R: global_name must be a str or "
				    "None", it->name);
			return -1;
		}
	}
	it->place.global_offset = off;
	it->place.global_numel = gnumel;
	return 0;
}

static const char *const optim_names[] = { "adamw", "adam", "adagrad", "lion" };

static PyObject *
step_params_dict(const struct zc_step_params *sp)
{
	return Py_BuildValue("{s:s,s:K,s:d,s:d,s:d,s:d,s:d,s:d}", "optim",
	    (unsigned)sp->optim <= ZC_LION ? optim_names[sp->optim] : "unknown", "step",
	    (unsigned long long)sp->step, "lr", sp->lr, "beta1", sp->beta1, "beta2", sp->beta2,
	    "eps", sp->eps, "weight_decay", sp->weight_decay, "lr_decay", sp->lr_decay);
}

/*
 * Opens dir, registers every item from it in one zc_tensors_register_checkpoint (their
 * restores overlap), closes it; all without the GIL in one go.  On failure none is left
 * registered and err holds the error.
 */
static int
restore_all(struct zc_conn *c, const char *dir, struct restore_item *items, size_t n,
    enum zc_optim optim, bool convert, bool views, struct zc_tensor **ts,
    struct zc_step_params *sp, char *err)
{
	struct zc_tensor_desc *descs = calloc(n > 0 ? n : 1, sizeof(*descs));
	struct zc_checkpoint_place *places = calloc(n > 0 ? n : 1, sizeof(*places));
	struct zc_checkpoint *ck = NULL;
	int r;

	if (descs == NULL || places == NULL) {
		free(descs);
		free(places);
		snprintf(err, ZPY_ERRLEN, "out of memory");
		return -ENOMEM;
	}
	for (size_t i = 0; i < n; i++) {
		descs[i] = items[i].desc;
		places[i] = items[i].place;
	}
	zc_conn_set_param_views(c, views);
	r = zc_checkpoint_open(c, dir, &ck);
	if (r >= 0) {
		zc_checkpoint_allow_convert(ck, convert);
		r = zc_checkpoint_step_params(ck, sp);
	}
	if (r >= 0)
		r = zc_tensors_register_checkpoint(c, n, descs, ck, places, optim, ts);
	if (r < 0)
		snprintf(err, ZPY_ERRLEN, "%s", zc_errmsg(c));
	zc_checkpoint_close(ck);
	free(places);
	free(descs);
	return r;
}

PyObject *
zpy_register_checkpoint(struct zpy_conn *self, PyObject *args, PyObject *kw)
{
	static char *kwlist[] = { "dir", "tensors", "optim", "convert", "param_views", NULL };
	int convert = 0, views = 0;
	struct zc_step_params sp = { 0 };
	struct restore_item *items = NULL;
	struct zc_tensor **ts = NULL;
	PyObject *dir, *seq, *fast = NULL, *list = NULL, *ret = NULL;
	enum zc_optim optim;
	const char *oname;
	char err[ZPY_ERRLEN], rerr[ZPY_ERRLEN];
	Py_ssize_t n;
	int r;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "O&Os|$pp:register_checkpoint", kwlist,
	    PyUnicode_FSConverter, &dir, &seq, &oname, &convert, &views))
		return NULL;
	if (zpy_optim(oname, &optim) < 0 || !zpy_conn_ready(self))
		goto out;
	fast = PySequence_Fast(seq, "tensors: expected a sequence of tuples");
	if (fast == NULL)
		goto out;
	n = PySequence_Fast_GET_SIZE(fast);
	items = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(*items));
	ts = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(*ts));
	list = PyList_New(n);
	if (items == NULL || ts == NULL || list == NULL) {
		if (!PyErr_Occurred())
			PyErr_NoMemory();
		goto out;
	}
	for (Py_ssize_t i = 0; i < n; i++)
		if (parse_restore_item(PySequence_Fast_GET_ITEM(fast, i), i, &items[i]) < 0)
			goto out;
	ZPY_CALL(self, r, err, restore_all(self->c, PyBytes_AS_STRING(dir), items, (size_t)n,
	    optim, convert != 0, views != 0, ts, &sp, rerr));
	if (r < 0) {
		/* rerr: the first error, before the clean-up's calls could replace it. */
		zpy_raise_conn(self, r, rerr);
		goto out;
	}
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *t = zpy_tensor_wrap(self, ts[i], items[i].name, &items[i].desc);

		/* Unreachable in practice; the rest stay registered until disconnect. */
		if (t == NULL)
			goto out;
		PyList_SET_ITEM(list, i, t);
	}
	ret = Py_BuildValue("(ON)", list, step_params_dict(&sp));
out:
	Py_XDECREF(list);
	PyMem_Free(ts);
	PyMem_Free(items);
	Py_XDECREF(fast);
	Py_DECREF(dir);
	return ret;
}
