/* libzclient's tensors: register and unregister, slots, state read and write, hooks and pins. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "zclient.h"
#include "zclient_impl.h"

/*
 * Bytes per element.  Local, with the header-only converters below, so that
 * libzclient links no part of the kernel library (tests/client checks it).
 */
static size_t
dtype_size(enum zc_dtype dtype)
{
	return dtype == ZC_F32 ? 4 : 2;
}

struct zc_tensor *
zci_tensor_by_handle(struct zc_conn *c, uint32_t handle)
{
	if (handle == 0 || handle > c->tensor_cap)
		return NULL;
	return c->tensors[handle - 1];
}

/* Bytes of the file behind fd; 0 when it cannot be told. */
static uint64_t
file_bytes(int fd)
{
	struct stat st;

	return fstat(fd, &st) == 0 && st.st_size > 0 ? (uint64_t)st.st_size : 0;
}

static int
ensure_xfer(struct zc_conn *c)
{
	struct zp_msg m = { .hdr = { .type = ZP_XFER_OPEN } };
	uint64_t bytes, file;
	int fd, r;
	void *map;

	if (c->xfer != NULL)
		return 0;
	r = zci_rpc(c, &m, ZP_XFER_OK, &fd);
	if (r < 0)
		return r;
	/*
	 * Below one element the copy loop would make no progress; past the
	 * file's end the mapping would SIGBUS on first touch.
	 */
	bytes = c->msg->u.xfer_ok.bytes;
	file = file_bytes(fd);
	if (bytes < sizeof(float) || file < bytes) {
		close(fd);
		return zci_seterr(c, -EBADMSG, "zoffloadd sent a transfer window of %llu bytes in a "
		    "%llu-byte file", (unsigned long long)bytes, (unsigned long long)file);
	}
	map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	r = map == MAP_FAILED ? -errno : 0;
	close(fd);
	if (r < 0)
		return zci_seterr(c, r, "map the transfer window: %s", strerror(-r));
	c->xfer = map;
	c->xfer_bytes = c->msg->u.xfer_ok.bytes;
	return 0;
}

/*
 * A trainer reads and writes state at its start and at its checkpoints, not each step:
 * punched, the window holds no pages (16 MiB by default, the daemon's mapping's too, as
 * they are the file's) between those.  Reads give zeros after, and nothing reads the
 * window before filling it.
 */
void
zci_xfer_release(struct zc_conn *c)
{
	if (!c->xfer_touched)
		return;
	/* Best effort: a window that keeps its pages costs memory, never correctness. */
	(void)madvise(c->xfer, c->xfer_bytes, MADV_REMOVE);
	c->xfer_touched = false;
}

/* Moves count fp32 values between a tensor's state and the caller, a window at a time. */
static int
tensor_copy(struct zc_tensor *t, uint16_t type, enum zc_state which, uint64_t offset,
    uint64_t count, float *data)
{
	struct zc_conn *c = t->conn;
	uint64_t chunk, done = 0;
	int r;

	if (offset > t->numel || count > t->numel - offset)
		return zci_seterr(c, -ERANGE, "elements %llu..%llu are outside the tensor's %llu",
		    (unsigned long long)offset, (unsigned long long)(offset + count),
		    (unsigned long long)t->numel);
	if (t->pending)
		return zci_seterr(c, -EBUSY, "tensor is in a step; wait for it first");
	r = ensure_xfer(c);
	if (r < 0)
		return r;
	chunk = c->xfer_bytes / sizeof(float);
	c->xfer_touched = true;
	while (done < count) {
		struct zp_msg m = { .hdr = { .type = type } };
		uint64_t n = count - done < chunk ? count - done : chunk;

		m.u.tensor_io = (struct zp_tensor_io){
			.handle = t->handle, .state = (uint8_t)which,
			.offset = offset + done, .count = n,
		};
		if (type == ZP_TENSOR_WRITE)
			memcpy(c->xfer, data + done, n * sizeof(float));
		r = zci_rpc(c, &m, ZP_OK, NULL);
		if (r < 0)
			return r;
		if (type == ZP_TENSOR_READ)
			memcpy(data + done, c->xfer, n * sizeof(float));
		done += n;
	}
	return 0;
}

static int
add_tensor(struct zc_conn *c, struct zc_tensor *t)
{
	if (t->handle > c->tensor_cap) {
		uint32_t cap = c->tensor_cap ? c->tensor_cap : 64;
		struct zc_tensor **bigger;

		while (cap < t->handle)
			cap *= 2;
		bigger = realloc(c->tensors, cap * sizeof(*bigger));
		if (bigger == NULL)
			return -ENOMEM;
		memset(bigger + c->tensor_cap, 0, (cap - c->tensor_cap) * sizeof(*bigger));
		c->tensors = bigger;
		c->tensor_cap = cap;
	}
	c->tensors[t->handle - 1] = t;
	return 0;
}

static void
unregister_quietly(struct zc_conn *c, uint32_t handle)
{
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_UNREGISTER } };

	m.u.tensor_handle.handle = handle;
	(void)zci_rpc(c, &m, ZP_OK, NULL);
}

void
zci_tensor_slots_event(struct zc_tensor *t, enum zc_slots_event why)
{
	if (t->slots_hook != NULL) {
		t->slots_hook(t, why, t->release_arg);
		return;
	}
	if (t->release == NULL)
		return;
	t->release(t, t->release_arg);
	/* Not told why, it let go as for an unmap: it must not be called for the pages again. */
	t->release = NULL;
	t->release_arg = NULL;
}

void
zci_tensor_unmap(struct zc_tensor *t)
{
	/* Before munmap: a driver's registration must not outlive the mapping. */
	zci_tensor_slots_event(t, ZC_SLOTS_UNMAP);
	if (t->kept != NULL) {
		*t->kept = (struct zc_kept_slots){
			.grad = { t->grad, t->grad_bytes },
			.param = { t->param, t->param_bytes },
		};
		zci_view_keep(t, &t->kept->param_view.addr, &t->kept->param_view.bytes);
		free(t);
		return;
	}
	munmap(t->grad, t->grad_bytes);
	munmap(t->param, t->param_bytes);
	zci_view_unmap(t);
	free(t);
}

void
zc_tensor_keep_slots(struct zc_tensor *t, struct zc_kept_slots *kept)
{
	t->kept = kept;
}

int
zc_tensor_register(struct zc_conn *c, const struct zc_tensor_desc *desc, const float *init,
    struct zc_tensor **ret)
{
	if (init == NULL && desc != NULL && desc->name != NULL)
		return zci_seterr(c, -EINVAL, "tensor '%s': initial values are required", desc->name);
	return zci_tensor_register(c, desc, init, ret);
}

int
zci_tensor_register(struct zc_conn *c, const struct zc_tensor_desc *desc, const float *init,
    struct zc_tensor **ret)
{
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_REGISTER } };
	struct zc_tensor *t;
	char saved[sizeof(c->err)];
	bool resumed;
	int fds[2], r;

	if (desc->name == NULL || strlen(desc->name) == 0 || strlen(desc->name) > ZP_NAME_MAX)
		return zci_seterr(c, -EINVAL, "tensor name must be 1 to %d bytes", ZP_NAME_MAX);
	if ((unsigned)desc->grad_dtype > ZC_F16 || (unsigned)desc->param_dtype > ZC_F16)
		return zci_seterr(c, -EINVAL, "tensor '%s': unknown dtype", desc->name);
	if (desc->numel == 0)
		return zci_seterr(c, -EINVAL, "tensor '%s': numel is 0", desc->name);
	snprintf(m.u.tensor_register.name, sizeof(m.u.tensor_register.name), "%s", desc->name);
	m.u.tensor_register.numel = desc->numel;
	m.u.tensor_register.grad_dtype = (uint8_t)desc->grad_dtype;
	m.u.tensor_register.param_dtype = (uint8_t)desc->param_dtype;
	m.u.tensor_register.flags = desc->param_offload ? ZP_TENSOR_PARAM_OFFLOAD : 0;
	r = zci_rpc(c, &m, ZP_TENSOR_OK, fds);
	if (r < 0)
		return r;
	t = calloc(1, sizeof(*t));
	if (t == NULL) {
		r = zci_seterr(c, -ENOMEM, "out of memory");
		goto fail_fds;
	}
	t->conn = c;
	snprintf(t->name, sizeof(t->name), "%s", desc->name);
	t->handle = c->msg->u.tensor_ok.handle;
	t->numel = desc->numel;
	t->grad_bytes = c->msg->u.tensor_ok.grad_bytes;
	t->param_bytes = c->msg->u.tensor_ok.param_bytes;
	t->last_step = c->msg->u.tensor_ok.last_step;
	t->param_offload = desc->param_offload;
	t->grad_dtype = desc->grad_dtype;
	t->param_dtype = desc->param_dtype;
	resumed = c->msg->u.tensor_ok.resumed != 0;
	/* Until every initial value is in, a reattach may find it new (zclient_reconnect.c). */
	t->fresh = !resumed;
	/* Handle 0 would index tensors[-1]; a handle in use would take another tensor's place. */
	if (t->handle == 0 || zci_tensor_by_handle(c, t->handle) != NULL) {
		r = zci_seterr(c, -EBADMSG, "zoffloadd gave '%s' handle %u, %s", desc->name, t->handle,
		    t->handle == 0 ? "which is not a handle" : "which another tensor has");
		goto fail_free;
	}
	if (t->grad_bytes != desc->numel * dtype_size(desc->grad_dtype) ||
	    t->param_bytes != desc->numel * dtype_size(desc->param_dtype)) {
		r = zci_seterr(c, -EBADMSG, "zoffloadd sized the slots of '%s' wrongly", desc->name);
		goto fail_tensor;
	}
	/* A slot mapped past its file's end would SIGBUS in the training process. */
	if (file_bytes(fds[0]) < t->grad_bytes || file_bytes(fds[1]) < t->param_bytes) {
		r = zci_seterr(c, -EBADMSG, "zoffloadd sent the slots of '%s' (%zu and %zu bytes) in "
		    "files of %llu and %llu bytes", desc->name, t->grad_bytes, t->param_bytes,
		    (unsigned long long)file_bytes(fds[0]), (unsigned long long)file_bytes(fds[1]));
		goto fail_tensor;
	}
	t->grad = zci_map_slot(t->grad_bytes, PROT_READ | PROT_WRITE, fds[0]);
	t->param = zci_map_slot(t->param_bytes, PROT_READ, fds[1]);
	if (t->grad == MAP_FAILED || t->param == MAP_FAILED) {
		r = zci_seterr(c, -errno, "map the slots of '%s': %s", desc->name, strerror(errno));
		if (t->grad != MAP_FAILED)
			munmap(t->grad, t->grad_bytes);
		if (t->param != MAP_FAILED)
			munmap(t->param, t->param_bytes);
		goto fail_tensor;
	}
	zci_advise_huge(t->grad, t->grad_bytes);
	zci_advise_huge(t->param, t->param_bytes);
	if (c->param_views && (r = zci_view_map(t, fds[1])) < 0) {
		zci_seterr(c, r, "map the param view of '%s': %s", desc->name, strerror(-r));
		munmap(t->grad, t->grad_bytes);
		munmap(t->param, t->param_bytes);
		goto fail_tensor;
	}
	zci_file_id(fds[0], &t->grad_dev, &t->grad_ino);
	zci_file_id(fds[1], &t->param_dev, &t->param_ino);
	close(fds[0]);
	close(fds[1]);
	r = add_tensor(c, t);
	if (r < 0) {
		zci_seterr(c, r, "out of memory");
		goto fail_mapped;
	}
	/*
	 * Taken back from a rank that died: its state is newer than any initial values.
	 * No init: the caller writes every element itself (a restore).
	 */
	r = resumed || init == NULL ? 0 : tensor_copy(t, ZP_TENSOR_WRITE, ZC_STATE_MASTER, 0, t->numel,
	    (float *)init);
	if (r < 0) {
		c->tensors[t->handle - 1] = NULL;
		goto fail_mapped;
	}
	/* A restore (init NULL) says when it is done: zc_tensor_register_checkpoint. */
	if (init != NULL)
		t->fresh = false;
	*ret = t;
	return 0;
fail_mapped:
	/* Keep the first error, not the clean-up's. */
	memcpy(saved, c->err, sizeof(saved));
	unregister_quietly(c, t->handle);
	memcpy(c->err, saved, sizeof(saved));
	zci_tensor_unmap(t);
	return r;
fail_tensor:
	memcpy(saved, c->err, sizeof(saved));
	unregister_quietly(c, t->handle);
	memcpy(c->err, saved, sizeof(saved));
fail_free:
	free(t);
fail_fds:
	close(fds[0]);
	close(fds[1]);
	return r;
}

int
zc_tensor_unregister(struct zc_tensor *t)
{
	struct zc_conn *c = t->conn;
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_UNREGISTER } };
	int r;

	if (t->pending)
		return zci_seterr(c, -EBUSY, "tensor is in a step; wait for it first");
	m.u.tensor_handle.handle = t->handle;
	r = zci_rpc(c, &m, ZP_OK, NULL);
	if (r < 0)
		return r;
	c->tensors[t->handle - 1] = NULL;
	zci_tensor_unmap(t);
	return 0;
}

void
zc_tensor_set_slots_hook(struct zc_tensor *t, zc_slots_fn *fn, void *arg)
{
	t->slots_hook = fn;
	t->release = NULL;
	t->release_arg = fn != NULL ? arg : NULL;
}

void
zc_tensor_set_release_hook(struct zc_tensor *t, zc_release_fn *fn, void *arg)
{
	t->slots_hook = NULL;
	t->release = fn;
	t->release_arg = fn != NULL ? arg : NULL;
}

void
zc_tensor_set_param_pin(struct zc_tensor *t, zc_unpin_fn *unpin, void *arg)
{
	t->unpin = unpin;
	t->unpin_arg = unpin != NULL ? arg : NULL;
}

bool
zc_tensor_param_pinned(const struct zc_tensor *t)
{
	return t->unpin != NULL;
}

uint64_t
zc_tensor_numel(const struct zc_tensor *t)
{
	return t->numel;
}

uint64_t
zc_tensor_last_step(const struct zc_tensor *t)
{
	return t->last_step;
}

void *
zc_tensor_grad_slot(struct zc_tensor *t, size_t *ret_bytes)
{
	if (ret_bytes != NULL)
		*ret_bytes = t->grad_bytes;
	return t->grad;
}

const void *
zc_tensor_param_slot(struct zc_tensor *t, size_t *ret_bytes)
{
	if (ret_bytes != NULL)
		*ret_bytes = t->param_bytes;
	return t->param;
}

int
zc_tensor_read(struct zc_tensor *t, enum zc_state which, uint64_t offset, uint64_t count,
    float *dst)
{
	if ((unsigned)which > ZC_STATE_EXP_AVG_SQ)
		return zci_seterr(t->conn, -EINVAL, "unknown state %d", (int)which);
	return tensor_copy(t, ZP_TENSOR_READ, which, offset, count, dst);
}

int
zc_tensor_write(struct zc_tensor *t, enum zc_state which, uint64_t offset, uint64_t count,
    const float *src)
{
	if ((unsigned)which > ZC_STATE_EXP_AVG_SQ)
		return zci_seterr(t->conn, -EINVAL, "unknown state %d", (int)which);
	/* tensor_copy only reads from data on a write. */
	return tensor_copy(t, ZP_TENSOR_WRITE, which, offset, count, (float *)(uintptr_t)src);
}

int
zc_tensor_set_step(struct zc_tensor *t, uint64_t step)
{
	struct zp_msg m = { .hdr = { .type = ZP_TENSOR_SET_STEP } };
	int r;

	if (t->pending)
		return zci_seterr(t->conn, -EBUSY, "tensor is in a step; wait for it first");
	m.u.tensor_step.handle = t->handle;
	m.u.tensor_step.step = step;
	r = zci_rpc(t->conn, &m, ZP_OK, NULL);
	if (r < 0)
		return r;
	t->last_step = step;
	return 0;
}

/* A TENSOR_DONE (through c->hooks): the tensor's step ended, with its result. */
void
zci_tensor_done(struct zc_conn *c, const struct zp_msg *m)
{
	struct zc_tensor *t = zci_tensor_by_handle(c, m->u.tensor_done.handle);

	if (t != NULL && t->pending && t->pending_set == m->hdr.request_id) {
		t->pending = false;
		if (m->u.tensor_done.status == ZP_STEP_APPLIED) {
			t->last_step = m->u.tensor_done.step;
			/* The step wrote the parameters into the slot. */
			t->param_state = PARAM_RESIDENT;
		}
		t->result = (struct zc_step_result){
			.step = m->u.tensor_done.step,
			.status = (enum zc_step_status)m->u.tensor_done.status,
			.error = m->u.tensor_done.error,
			.grad_norm = 0,
		};
	}
}

/* A PARAM_READY (through c->hooks): the fetch of the tensor's parameters ended. */
void
zci_tensor_param_ready(struct zc_conn *c, const struct zp_msg *m)
{
	struct zc_tensor *t = zci_tensor_by_handle(c, m->u.param_ready.handle);

	if (t != NULL && t->param_state == PARAM_FETCHING) {
		t->param_state = m->u.param_ready.error == 0 ? PARAM_RESIDENT : PARAM_RELEASED;
		t->param_error = m->u.param_ready.error;
	}
}
