/* zoffload._zclient: module state, ZoffloadError, and the helpers the types share. */
#include <errno.h>
#include <string.h>

#include "zpy.h"

static struct PyModuleDef zpy_module;

struct zpy_state *
zpy_state_of(PyTypeObject *type)
{
	return PyType_GetModuleState(type);
}

PyObject *
zpy_raise(PyTypeObject *type, int neg_errno, const char *msg)
{
	struct zpy_state *st = zpy_state_of(type);
	PyObject *args = Py_BuildValue("(is)", neg_errno < 0 ? -neg_errno : EIO, msg);

	/* OSError(errno, strerror): .errno is set and str() reads "[Errno N] msg". */
	if (args != NULL) {
		PyErr_SetObject(st->error, args);
		Py_DECREF(args);
	}
	return NULL;
}

PyObject *
zpy_raise_conn(struct zpy_conn *conn, int neg_errno, const char *msg)
{
	return zpy_raise(Py_TYPE(conn), neg_errno, msg);
}

bool
zpy_conn_ready(struct zpy_conn *conn)
{
	if (conn->c != NULL)
		return true;
	zpy_raise(Py_TYPE(conn), -ENOTCONN, "the connection to zoffloadd is closed");
	return false;
}

bool
zpy_tensor_ready(struct zpy_tensor *t)
{
	if (t->t != NULL)
		return true;
	zpy_raise(Py_TYPE(t), -EBADF, t->conn->c == NULL ?
	    "the tensor's connection to zoffloadd is closed" :
	    "the tensor is no longer registered (unregistered, or its job was closed)");
	return false;
}

int
zpy_dtype(PyObject *name, const char *what)
{
	static const struct { const char *name; enum zc_dtype d; } names[] = {
		{ "fp32", ZC_F32 }, { "float32", ZC_F32 }, { "torch.float32", ZC_F32 },
		{ "bf16", ZC_BF16 }, { "bfloat16", ZC_BF16 }, { "torch.bfloat16", ZC_BF16 },
		{ "fp16", ZC_F16 }, { "float16", ZC_F16 }, { "torch.float16", ZC_F16 },
	};
	const char *s;

	if (name == NULL || name == Py_None)
		return ZC_F32;
	s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
	if (s == NULL) {
		PyErr_Format(PyExc_TypeError, "%s must be a string such as 'bf16', not %R", what,
		    name);
		return -1;
	}
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (strcmp(s, names[i].name) == 0)
			return (int)names[i].d;
	PyErr_Format(PyExc_ValueError, "%s must be 'fp32', 'bf16' or 'fp16', not %R", what, name);
	return -1;
}

const char *
zpy_dtype_name(enum zc_dtype d)
{
	switch (d) {
	case ZC_BF16:
		return "bf16";
	case ZC_F16:
		return "fp16";
	default:
		return "fp32";
	}
}

PyObject *
zpy_result(const struct zc_step_result *r)
{
	static const char *status[] = { "applied", "skipped_nonfinite", "failed" };
	unsigned s = (unsigned)r->status;

	return Py_BuildValue("{s:K,s:s,s:i,s:d,s:K}", "step", (unsigned long long)r->step,
	    "status", s < 3 ? status[s] : "unknown", "error", r->error, "grad_norm", r->grad_norm,
	    "latency_ns", (unsigned long long)r->latency_ns);
}

void *
zpy_seq_array(PyObject *seq, const char *what, size_t elem, PyObject **ret_fast,
    Py_ssize_t *ret_n)
{
	PyObject *fast = PySequence_Fast(seq, what);
	Py_ssize_t n;
	void *out;

	if (fast == NULL)
		return NULL;
	n = PySequence_Fast_GET_SIZE(fast);
	out = PyMem_Calloc(n > 0 ? (size_t)n : 1, elem);
	if (out == NULL) {
		Py_DECREF(fast);
		PyErr_NoMemory();
		return NULL;
	}
	*ret_fast = fast;
	*ret_n = n;
	return out;
}

int
zpy_tensor_list(struct zpy_conn *conn, PyObject *seq, struct zc_tensor ***ret, size_t *ret_n)
{
	struct zpy_state *st = zpy_state_of(Py_TYPE(conn));
	struct zc_tensor **out;
	PyObject *fast;
	Py_ssize_t n;

	out = zpy_seq_array(seq, "expected a sequence of Tensor", sizeof(*out), &fast, &n);
	if (out == NULL)
		return -1;
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *o = PySequence_Fast_GET_ITEM(fast, i);
		struct zpy_tensor *t = (struct zpy_tensor *)o;

		if (!Py_IS_TYPE(o, st->tensor_type)) {
			PyErr_Format(PyExc_TypeError, "item %zd is %R, not a Tensor", i, o);
			goto fail;
		}
		if (t->conn != conn) {
			PyErr_Format(PyExc_ValueError, "tensor %R belongs to another connection",
			    t->name);
			goto fail;
		}
		if (!zpy_tensor_ready(t))
			goto fail;
		out[i] = t->t;
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

static int
zpy_exec(PyObject *m)
{
	struct zpy_state *st = PyModule_GetState(m);
	static const struct { const char *name; long value; } consts[] = {
		{ "F32", ZC_F32 }, { "BF16", ZC_BF16 }, { "F16", ZC_F16 },
		{ "ADAMW", ZC_ADAMW }, { "ADAM", ZC_ADAM }, { "ADAGRAD", ZC_ADAGRAD },
		{ "LION", ZC_LION },
	};

	st->error = PyErr_NewExceptionWithDoc("zoffload._zclient.ZoffloadError",
	    "An error from zoffloadd or libzclient: an OSError whose errno is the call's and "
	    "whose message is the daemon's (zc_errmsg).", PyExc_OSError, NULL);
	if (st->error == NULL || PyModule_AddObjectRef(m, "ZoffloadError", st->error) < 0)
		return -1;
	st->conn_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &zpy_conn_spec, NULL);
	st->tensor_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &zpy_tensor_spec, NULL);
	st->slot_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &zpy_slot_spec, NULL);
	st->graft_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &zpy_graft_spec, NULL);
	if (st->conn_type == NULL || st->tensor_type == NULL || st->slot_type == NULL ||
	    st->graft_type == NULL)
		return -1;
	if (PyModule_AddType(m, st->conn_type) < 0 || PyModule_AddType(m, st->tensor_type) < 0 ||
	    PyModule_AddType(m, st->slot_type) < 0 || PyModule_AddType(m, st->graft_type) < 0)
		return -1;
	for (size_t i = 0; i < sizeof(consts) / sizeof(consts[0]); i++)
		if (PyModule_AddIntConstant(m, consts[i].name, consts[i].value) < 0)
			return -1;
	return 0;
}

static int
zpy_traverse(PyObject *m, visitproc visit, void *arg)
{
	struct zpy_state *st = PyModule_GetState(m);

	Py_VISIT(st->error);
	Py_VISIT(st->conn_type);
	Py_VISIT(st->tensor_type);
	Py_VISIT(st->slot_type);
	Py_VISIT(st->graft_type);
	return 0;
}

static int
zpy_clear(PyObject *m)
{
	struct zpy_state *st = PyModule_GetState(m);

	Py_CLEAR(st->error);
	Py_CLEAR(st->conn_type);
	Py_CLEAR(st->tensor_type);
	Py_CLEAR(st->slot_type);
	Py_CLEAR(st->graft_type);
	return 0;
}

static void
zpy_free(void *m)
{
	zpy_clear(m);
}

static PyModuleDef_Slot zpy_slots[] = {
	{ Py_mod_exec, zpy_exec },
	{ 0, NULL },
};

static struct PyModuleDef zpy_module = {
	PyModuleDef_HEAD_INIT,
	.m_name = "zoffload._zclient",
	.m_doc = "libzclient, the client library of zoffloadd, for Python. Every call that "
	    "talks to the daemon releases the GIL; errors raise ZoffloadError.",
	.m_size = sizeof(struct zpy_state),
	.m_slots = zpy_slots,
	.m_traverse = zpy_traverse,
	.m_clear = zpy_clear,
	.m_free = zpy_free,
};

PyMODINIT_FUNC PyInit__zclient(void);

PyMODINIT_FUNC
PyInit__zclient(void)
{
	return PyModuleDef_Init(&zpy_module);
}
