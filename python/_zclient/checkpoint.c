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

/* A str or None for a global name; -1 (raised) when it is neither. */
static int
parse_gname(PyObject *gname, const char **ret, const char *what, Py_ssize_t i)
{
	*ret = NULL;
	if (gname == Py_None)
		return 0;
	*ret = PyUnicode_Check(gname) ? PyUnicode_AsUTF8(gname) : NULL;
	if (*ret == NULL) {
		if (!PyErr_Occurred())
			PyErr_Format(PyExc_TypeError, "%s %zd: global_name must be a str or None",
			    what, i);
		return -1;
	}
	return 0;
}

/*
 * One (Tensor, global_name or None, global_offset, global_numel[, offset, count]) tuple of
 * checkpoint_save: the tensor's elements [offset, offset + count) (count 0: to its end).
 */
static int
parse_save_entry(struct zpy_conn *conn, PyObject *item, Py_ssize_t i,
    struct zc_checkpoint_piece *e, PyObject **tensor)
{
	PyObject *gname, *wrap;
	unsigned long long off, gnumel, t_off = 0, count = 0;
	struct zc_tensor **one;
	size_t n;
	int r;

	if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "OOKK|KK", tensor, &gname, &off,
	    &gnumel, &t_off, &count)) {
		if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
			PyErr_Clear();
			PyErr_Format(PyExc_TypeError, "entry %zd: expected (Tensor, global_name or "
			    "None, global_offset, global_numel[, offset, count]), not %R", i, item);
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
	if (parse_gname(gname, &e->range.global_name, "entry", i) < 0)
		return -1;
	if (count == 0) {
		uint64_t numel = zc_tensor_numel(e->tensor);

		/* An offset past the end: the library names it. */
		count = t_off < numel ? numel - t_off : 1;
	}
	e->range.offset = t_off;
	e->range.count = count;
	e->range.global_offset = off;
	e->range.global_numel = gnumel;
	return 0;
}

PyObject *
zpy_checkpoint_save(struct zpy_conn *self, PyObject *args, PyObject *kw)
{
	static char *kwlist[] = { "dir", "entries", "optim", "step", "lr", "beta1", "beta2",
		"eps", "weight_decay", "lr_decay", NULL };
	struct zc_step_params sp = { .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8 };
	struct zc_checkpoint_piece *es = NULL;
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
	ZPY_CALL(self, r, err, zc_checkpoint_save_pieces(self->c, PyBytes_AS_STRING(dir), es,
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
	struct zc_checkpoint_range *ranges;	/* PyMem */
	size_t nranges;
};

/* One (offset, count, global_name, global_offset, global_numel) of a tensor's ranges. */
static int
parse_range(PyObject *item, PyObject *name, Py_ssize_t k, struct zc_checkpoint_range *rg)
{
	PyObject *gname;
	unsigned long long off, count, goff, gnumel;

	if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "KKOKK", &off, &count, &gname, &goff,
	    &gnumel)) {
		if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
			PyErr_Clear();
			PyErr_Format(PyExc_TypeError, "tensor %R, range %zd: expected (offset, count, "
			    "global_name, global_offset, global_numel), not %R", name, k, item);
		}
		return -1;
	}
	if (parse_gname(gname, &rg->global_name, "range", k) < 0)
		return -1;
	*rg = (struct zc_checkpoint_range){ off, count, rg->global_name, goff, gnumel };
	return 0;
}

/*
 * (name, numel, grad_dtype, param_dtype, global_name or None, global_offset, global_numel):
 * the whole tensor at one place; (name, numel, grad_dtype, param_dtype, ranges): its
 * ranges, a list of parse_range's tuples.
 */
static int
parse_restore_item(PyObject *item, Py_ssize_t i, struct restore_item *it)
{
	PyObject *gd, *pd, *gname = Py_None, *ranges = NULL;
	unsigned long long numel, off = 0, gnumel = 0;
	bool by_ranges = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 5;
	int g, p;

	if (!PyTuple_Check(item) || !(by_ranges ?
	    PyArg_ParseTuple(item, "UKOOO", &it->name, &numel, &gd, &pd, &ranges) :
	    PyArg_ParseTuple(item, "UKOOOKK", &it->name, &numel, &gd, &pd, &gname, &off, &gnumel))) {
		if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
			PyErr_Clear();
			PyErr_Format(PyExc_TypeError, "tensor %zd: expected (name, numel, grad_dtype, "
			    "param_dtype, global_name or None, global_offset, global_numel) or (name, "
			    "numel, grad_dtype, param_dtype, ranges), not %R", i, item);
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
	if (!by_ranges) {
		it->ranges = PyMem_Calloc(1, sizeof(*it->ranges));
		if (it->ranges == NULL) {
			PyErr_NoMemory();
			return -1;
		}
		it->nranges = 1;
		if (parse_gname(gname, &it->ranges[0].global_name, "tensor", i) < 0)
			return -1;
		it->ranges[0].count = numel;
		it->ranges[0].global_offset = off;
		it->ranges[0].global_numel = gnumel;
		return 0;
	}
	if (!PyList_Check(ranges)) {
		PyErr_Format(PyExc_TypeError, "tensor %R: ranges must be a list, not %R", it->name,
		    ranges);
		return -1;
	}
	it->nranges = (size_t)PyList_GET_SIZE(ranges);
	it->ranges = PyMem_Calloc(it->nranges > 0 ? it->nranges : 1, sizeof(*it->ranges));
	if (it->ranges == NULL) {
		PyErr_NoMemory();
		return -1;
	}
	for (size_t k = 0; k < it->nranges; k++)
		if (parse_range(PyList_GET_ITEM(ranges, (Py_ssize_t)k), it->name, (Py_ssize_t)k,
		    &it->ranges[k]) < 0)
			return -1;
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
	size_t *nranges = calloc(n > 0 ? n : 1, sizeof(*nranges)), total = 0, at = 0;
	struct zc_checkpoint_range *ranges = NULL;
	struct zc_checkpoint *ck = NULL;
	int r;

	for (size_t i = 0; i < n; i++)
		total += items[i].nranges;
	ranges = calloc(total > 0 ? total : 1, sizeof(*ranges));
	if (descs == NULL || nranges == NULL || ranges == NULL) {
		free(descs);
		free(nranges);
		free(ranges);
		snprintf(err, ZPY_ERRLEN, "out of memory");
		return -ENOMEM;
	}
	for (size_t i = 0; i < n; i++) {
		descs[i] = items[i].desc;
		nranges[i] = items[i].nranges;
		memcpy(ranges + at, items[i].ranges, items[i].nranges * sizeof(*ranges));
		at += items[i].nranges;
	}
	zc_conn_set_param_views(c, views);
	r = zc_checkpoint_open(c, dir, &ck);
	if (r >= 0) {
		zc_checkpoint_allow_convert(ck, convert);
		r = zc_checkpoint_step_params(ck, sp);
	}
	if (r >= 0)
		r = zc_tensors_register_checkpoint_ranges(c, n, descs, ck, ranges, nranges, optim,
		    ts);
	if (r < 0)
		snprintf(err, ZPY_ERRLEN, "%s", zc_errmsg(c));
	zc_checkpoint_close(ck);
	free(ranges);
	free(nranges);
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
	Py_ssize_t n = 0;
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
	for (Py_ssize_t i = 0; items != NULL && i < n; i++)
		PyMem_Free(items[i].ranges);
	PyMem_Free(items);
	Py_XDECREF(fast);
	Py_DECREF(dir);
	return ret;
}
