/* zoffload._zclient: the CPython binding of libzclient; types shared by its files. */
#ifndef ZPY_H
#define ZPY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>

#include "zclient.h"

/* One per module object (multi-phase init): the exception and the heap types. */
struct zpy_state {
	PyObject *error;		/* ZoffloadError(OSError) */
	PyTypeObject *conn_type;
	PyTypeObject *tensor_type;
	PyTypeObject *slot_type;
	PyTypeObject *graft_type;
};

struct zpy_tensor;

/*
 * A libzclient connection.  libzclient allows one thread at a time on a
 * connection; since every call runs with the GIL released, lock serialises
 * them (taken only without the GIL, so it never deadlocks against it).
 * tensors lists (borrowed) the live Python Tensor objects of this connection,
 * which unlink themselves when freed; each holds a strong reference back, so
 * the connection outlives them.
 */
struct zpy_conn {
	PyObject_HEAD
	struct zc_conn *c;		/* NULL once closed */
	PyThread_type_lock lock;
	struct zpy_tensor *tensors;
};

/*
 * A registered tensor.  t belongs to the libzclient connection; it is NULL
 * once unregistered or once the connection or job closed.  live_slots counts
 * the Slot objects alive (each holds a reference to us): the slots' memory is
 * unmapped with t, so nothing that frees t runs while any view could remain.
 */
struct zpy_tensor {
	PyObject_HEAD
	struct zpy_conn *conn;		/* strong */
	struct zc_tensor *t;
	PyObject *name;
	uint64_t numel;
	enum zc_dtype grad_dtype, param_dtype;
	Py_ssize_t live_slots;
	/*
	 * Where views outlived the C tensor (zc_tensor_keep_slots): the slots'
	 * mappings, now this object's to unmap.  Every live Slot holds this
	 * Tensor, and every exported buffer its Slot, so the dealloc that
	 * unmaps them runs after the last pointer into them is gone.
	 */
	struct zc_kept_slots kept;
	struct zpy_slots_hook *hook;	/* set_slots_hook's; owned by t's hook (below) */
	struct zpy_tensor *prev, *next;	/* in conn->tensors */
};

/*
 * A Python callable run as t's libzclient slots hook (Tensor.set_slots_hook).
 * The record belongs to the C tensor's hook, not to the Python Tensor: the C
 * tensor can outlive its Python object (it stays with the connection until
 * disconnect), and its last hook call (ZC_SLOTS_UNMAP) frees the record and
 * the reference to fn.  Replacing the hook frees the old record; the Python
 * Tensor's pointer to it is used only while t is registered, when the record
 * is surely alive.
 */
struct zpy_slots_hook {
	PyObject *fn;			/* strong */
};

extern PyType_Spec zpy_conn_spec, zpy_tensor_spec, zpy_slot_spec, zpy_graft_spec;

struct zpy_state *zpy_state_of(PyTypeObject *type);
/* Raises ZoffloadError(-neg_errno, msg); returns NULL. */
PyObject *zpy_raise(PyTypeObject *type, int neg_errno, const char *msg);
/* Raises with the connection's last error; call with the connection's lock not held. */
PyObject *zpy_raise_conn(struct zpy_conn *conn, int neg_errno, const char *msg);

/* A closed connection or a freed tensor: raises and returns false. */
bool zpy_conn_ready(struct zpy_conn *conn);
bool zpy_tensor_ready(struct zpy_tensor *t);

/* Error text copied out under the lock, so that another thread cannot overwrite it first. */
#define ZPY_ERRLEN 512
/*
 * Runs expr (an int libzclient call) without the GIL and under the
 * connection's lock; on a negative result copies zc_errmsg into errbuf.
 */
#define ZPY_CALL(conn, r, errbuf, expr) do {				\
	Py_BEGIN_ALLOW_THREADS						\
	PyThread_acquire_lock((conn)->lock, WAIT_LOCK);			\
	(r) = (expr);							\
	if ((r) < 0)							\
		snprintf((errbuf), ZPY_ERRLEN, "%s", zc_errmsg((conn)->c)); \
	PyThread_release_lock((conn)->lock);				\
	Py_END_ALLOW_THREADS						\
} while (0)

/* "fp32" | "bf16" | "fp16" (also torch's names) to a zc_dtype; -1 with an exception set. */
int zpy_dtype(PyObject *name, const char *what);
const char *zpy_dtype_name(enum zc_dtype d);
/* A step result as a dict. */
PyObject *zpy_result(const struct zc_step_result *r);
/*
 * seq as a fast sequence (*ret_fast, a new reference; its length in *ret_n) and a zeroed
 * array of as many elements of elem bytes (PyMem_Free it); NULL with an exception set.
 */
void *zpy_seq_array(PyObject *seq, const char *what, size_t elem, PyObject **ret_fast,
    Py_ssize_t *ret_n);
/* Tensor objects from a sequence, for the calls that take a list (borrowed pointers into out). */
int zpy_tensor_list(struct zpy_conn *conn, PyObject *seq, struct zc_tensor ***ret, size_t *ret_n);

/* A Python Tensor over a C tensor just registered on conn (name: a str). */
PyObject *zpy_tensor_wrap(struct zpy_conn *conn, struct zc_tensor *ct, PyObject *name,
    const struct zc_tensor_desc *desc);
/* "adamw" | "adam" | "adagrad" | "lion" to a zc_optim; -1 with ValueError set. */
int zpy_optim(const char *s, enum zc_optim *ret);
/* Conn.graft_grad_slots (graft.c). */
PyObject *zpy_graft_grad_slots(struct zpy_conn *self, PyObject *args);
/* Connection methods of checkpoint.c. */
PyObject *zpy_checkpoint_save(struct zpy_conn *self, PyObject *args, PyObject *kw);
PyObject *zpy_register_checkpoint(struct zpy_conn *self, PyObject *args, PyObject *kw);

/*
 * Before a call that frees C tensors: each tensor whose slots are still
 * viewed keeps them mapped (zc_tensor_keep_slots), and is held in the list
 * returned (NULL with an exception set) until zpy_tensors_kept_done.  ok
 * false: the call failed and the tensors are still registered.
 */
PyObject *zpy_tensors_keep_viewed(struct zpy_conn *conn, struct zpy_tensor *only);
void zpy_tensors_kept_done(PyObject *kept, bool ok);
/* After the C tensors went away with the connection or the job. */
void zpy_conn_forget_tensors(struct zpy_conn *conn);

#endif
