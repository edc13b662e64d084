/* libzclient_cuda: errors, CUDA-registered grad/param slots, async copies, kernel entry points. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zcc_impl.h"
#include "zk_cuda.h"

/* The public enums and structs mirror the kernels' own, so they pass straight through. */
_Static_assert(ZC_F32 == (int)ZK_DTYPE_F32 && ZC_BF16 == (int)ZK_DTYPE_BF16 &&
    ZC_F16 == (int)ZK_DTYPE_F16, "zc_dtype and zk_dtype differ");
_Static_assert(sizeof(struct zcc_grad_stats) == sizeof(struct zkc_grad_stats) &&
    offsetof(struct zcc_grad_stats, nonfinite) == offsetof(struct zkc_grad_stats, nonfinite),
    "zcc_grad_stats and zkc_grad_stats differ");

/* Per thread: the objects are per thread anyway, and the kernel calls have no object. */
static __thread char errbuf[384];

const char *
zcc_errmsg(void)
{
	return errbuf[0] != '\0' ? errbuf : "no error";
}

int
zcc__fail(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(errbuf, sizeof(errbuf), fmt, ap);
	va_end(ap);
	return err;
}

int
zcc_errno_cuda(cudaError_t err)
{
	return zkc_errno(err);
}

int
zcc_errno_nccl(ncclResult_t res)
{
	switch (res) {
	case ncclSuccess:
		return 0;
	case ncclInvalidArgument:
	case ncclInvalidUsage:
		return -EINVAL;
	case ncclRemoteError:
		return -ECONNRESET;
	case ncclInProgress:
		return -EINPROGRESS;
	case ncclInternalError:
		return -EPROTO;
	case ncclUnhandledCudaError:
	case ncclSystemError:
	default:
		return -EIO;
	}
}

int
zcc__cuda(cudaError_t e, const char *what)
{
	if (e == cudaSuccess)
		return 0;
	return zcc__fail(zkc_errno(e), "%s: %s: %s", what, cudaGetErrorName(e),
	    cudaGetErrorString(e));
}

int
zcc__nccl(ncclResult_t res, ncclComm_t comm, const char *what)
{
	const char *detail;

	if (res == ncclSuccess)
		return 0;
	detail = ncclGetLastError(comm);
	return zcc__fail(zcc_errno_nccl(res), "%s: %s%s%s", what, ncclGetErrorString(res),
	    detail != NULL && detail[0] != '\0' ? ": " : "", detail != NULL ? detail : "");
}

size_t
zcc__dtype_size(enum zc_dtype dtype)
{
	switch (dtype) {
	case ZC_F32:
		return 4;
	case ZC_BF16:
	case ZC_F16:
		return 2;
	default:
		return 0;
	}
}

/* ---- Slots ---- */

/*
 * Who owns a zcc_slots, and when each pointer to it dies: it is created by
 * zcc_slots_attach and installed as its tensor's slots hook, and it is freed
 * exactly once, by whichever comes first:
 *   - zcc_slots_detach (which removes the hook first);
 *   - the hook with ZC_SLOTS_UNMAP: zc_tensor_unregister, zc_job_close or
 *     zc_disconnect is about to unmap the slots, and the tensor goes too.
 * Every pointer to it (the caller's, zcc_flat's f->slots) dies at that
 * moment and at no other.  The hook with ZC_SLOTS_REMAP (a reconnect mapping
 * other files over the slots) frees nothing: it waits for the copies,
 * unregisters both slots, and the struct lives on with them pageable, its
 * events still good, so zcc_zero3 and every other holder go on with it.
 * unpin_param (before zc_param_release) likewise only unregisters.
 */
struct zcc_slots {
	struct zc_tensor *tensor;
	uint64_t numel;
	void *grad;
	size_t grad_bytes, grad_esize;
	const void *param;
	size_t param_bytes, param_esize;
	bool grad_registered, param_registered;
	bool grad_recorded, param_recorded;	/* an event was recorded and may be pending */
	cudaEvent_t grad_event, param_event;
};

/*
 * Waits for copies in flight and unregisters both slots, which are pageable
 * from then on; the first error wins.  Either way nothing stays registered:
 * the pages are about to go.
 */
static int
slots_let_go(struct zcc_slots *s)
{
	int r = 0, r2;

	if (s->grad_recorded)
		r = zcc__cuda(cudaEventSynchronize(s->grad_event), "wait for the grad copy");
	if (s->param_recorded) {
		r2 = zcc__cuda(cudaEventSynchronize(s->param_event), "wait for the param copy");
		r = r < 0 ? r : r2;
	}
	s->grad_recorded = s->param_recorded = false;
	/* A DMA must not run into pages that are about to be unpinned: unregister after the waits. */
	if (s->grad_registered) {
		r2 = zcc__cuda(cudaHostUnregister(s->grad), "unregister the grad slot");
		r = r < 0 ? r : r2;
	}
	if (s->param_registered) {
		r2 = zcc__cuda(cudaHostUnregister((void *)s->param), "unregister the param slot");
		r = r < 0 ? r : r2;
	}
	s->grad_registered = s->param_registered = false;
	return r;
}

/* Lets go and frees: the end of the struct (see above for when). */
static int
slots_release(struct zcc_slots *s)
{
	int r = slots_let_go(s);

	if (s->grad_event != NULL)
		(void)cudaEventDestroy(s->grad_event);
	if (s->param_event != NULL)
		(void)cudaEventDestroy(s->param_event);
	free(s);
	return r;
}

/*
 * libzclient calls this before a param release: the daemon is about to drop
 * the slot's pages, so the copies from them end and the driver lets go.  The
 * slot stays pageable from then on.
 */
static int
unpin_param(struct zc_tensor *tensor, void *arg)
{
	struct zcc_slots *s = arg;
	int r = 0, r2;

	(void)tensor;
	if (s->param_recorded)
		r = zcc__cuda(cudaEventSynchronize(s->param_event), "wait for the param copy");
	s->param_recorded = false;
	if (s->param_registered) {
		r2 = zcc__cuda(cudaHostUnregister((void *)s->param), "unregister the param slot");
		r = r < 0 ? r : r2;
		s->param_registered = false;
	}
	return r;
}

/* libzclient calls this before the slots' pages go; no error can go back, and at exit CUDA may be gone. */
static void
slots_hook(struct zc_tensor *tensor, enum zc_slots_event why, void *arg)
{
	(void)tensor;
	if (why == ZC_SLOTS_REMAP)
		(void)slots_let_go(arg);
	else
		(void)slots_release(arg);
}

int
zcc_slots_attach(struct zc_tensor *tensor, struct zcc_slots **ret)
{
	struct zcc_slots *s;
	int device, ro = 0, r;
	cudaError_t e;

	if (tensor == NULL || ret == NULL)
		return zcc__fail(-EINVAL, "zcc_slots_attach: no tensor");
	s = calloc(1, sizeof(*s));
	if (s == NULL)
		return zcc__fail(-ENOMEM, "out of memory");
	s->tensor = tensor;
	s->numel = zc_tensor_numel(tensor);
	s->grad = zc_tensor_grad_slot(tensor, &s->grad_bytes);
	s->param = zc_tensor_param_slot(tensor, &s->param_bytes);
	s->grad_esize = s->grad_bytes / s->numel;
	s->param_esize = s->param_bytes / s->numel;

	r = zcc__cuda(cudaGetDevice(&device), "cudaGetDevice");
	if (r < 0)
		goto fail;
	/* Portable: a rank may copy through the slots from streams of any device. */
	r = zcc__cuda(cudaHostRegister(s->grad, s->grad_bytes, cudaHostRegisterPortable),
	    "cudaHostRegister(grad slot)");
	if (r < 0)
		goto fail;
	s->grad_registered = true;
	/*
	 * The daemon hands the param slot over read-only (mapped PROT_READ); the driver
	 * can pin such pages only as device-read-only.  Without that ability the
	 * slot stays pageable: copies from it work, through a driver bounce.
	 */
	(void)cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported, device);
	if (ro) {
		e = cudaHostRegister((void *)s->param, s->param_bytes,
		    cudaHostRegisterPortable | cudaHostRegisterReadOnly);
		if (e == cudaSuccess) {
			s->param_registered = true;
		} else if (e == cudaErrorNotSupported || e == cudaErrorInvalidValue) {
			(void)cudaGetLastError();
		} else {
			r = zcc__cuda(e, "cudaHostRegister(param slot, read-only)");
			goto fail;
		}
	}
	/* No timing: cheaper to record, and only ordering is needed. */
	r = zcc__cuda(cudaEventCreateWithFlags(&s->grad_event, cudaEventDisableTiming),
	    "cudaEventCreate");
	if (r < 0)
		goto fail;
	r = zcc__cuda(cudaEventCreateWithFlags(&s->param_event, cudaEventDisableTiming),
	    "cudaEventCreate");
	if (r < 0)
		goto fail;
	zc_tensor_set_slots_hook(tensor, slots_hook, s);
	if (s->param_registered)
		zc_tensor_set_param_pin(tensor, unpin_param, s);
	*ret = s;
	return 0;
fail:
	(void)slots_release(s);
	return r;
}

int
zcc_slots_detach(struct zcc_slots *s)
{
	if (s == NULL)
		return 0;
	zc_tensor_set_slots_hook(s->tensor, NULL, NULL);
	zc_tensor_set_param_pin(s->tensor, NULL, NULL);
	return slots_release(s);
}

struct zc_tensor *
zcc_slots_tensor(const struct zcc_slots *s)
{
	return s->tensor;
}

bool
zcc_slots_param_pinned(const struct zcc_slots *s)
{
	return s->param_registered;
}

cudaEvent_t
zcc_grad_event(const struct zcc_slots *s)
{
	return s->grad_event;
}

cudaEvent_t
zcc_param_event(const struct zcc_slots *s)
{
	return s->param_event;
}

static int
check_range(const struct zcc_slots *s, uint64_t offset, uint64_t count, const void *dev)
{
	if (offset > s->numel || count > s->numel - offset)
		return zcc__fail(-ERANGE, "elements %llu..%llu are outside the tensor's %llu",
		    (unsigned long long)offset, (unsigned long long)(offset + count),
		    (unsigned long long)s->numel);
	if (dev == NULL && count > 0)
		return zcc__fail(-EINVAL, "no device buffer");
	return 0;
}

int
zcc_grad_d2h(struct zcc_slots *s, uint64_t offset, uint64_t count, const void *src,
    cudaStream_t stream)
{
	int r = check_range(s, offset, count, src);

	if (r < 0)
		return r;
	r = zcc__cuda(cudaMemcpyAsync((char *)s->grad + offset * s->grad_esize, src,
	    count * s->grad_esize, cudaMemcpyDeviceToHost, stream), "grad copy to the slot");
	if (r < 0)
		return r;
	r = zcc__cuda(cudaEventRecord(s->grad_event, stream), "cudaEventRecord");
	if (r == 0)
		s->grad_recorded = true;
	return r;
}

int
zcc_param_h2d(struct zcc_slots *s, uint64_t offset, uint64_t count, void *dst,
    cudaStream_t stream)
{
	int r = check_range(s, offset, count, dst);

	if (r < 0)
		return r;
	r = zcc__cuda(cudaMemcpyAsync(dst, (const char *)s->param + offset * s->param_esize,
	    count * s->param_esize, cudaMemcpyHostToDevice, stream), "param copy from the slot");
	if (r < 0)
		return r;
	r = zcc__cuda(cudaEventRecord(s->param_event, stream), "cudaEventRecord");
	if (r == 0)
		s->param_recorded = true;
	return r;
}

int
zcc_step_submit(struct zc_conn *conn, const struct zc_step_params *params,
    struct zcc_slots *const *slots, size_t nslots)
{
	struct zc_tensor **tensors;
	int r = 0;

	if (nslots == 0 || slots == NULL)
		return zcc__fail(-EINVAL, "zcc_step_submit: no tensors");
	tensors = calloc(nslots, sizeof(*tensors));
	if (tensors == NULL)
		return zcc__fail(-ENOMEM, "out of memory");
	for (size_t i = 0; i < nslots && r == 0; i++) {
		/* The daemon reads the grad slot and then writes the param slot. */
		if (slots[i]->grad_recorded)
			r = zcc__cuda(cudaEventSynchronize(slots[i]->grad_event),
			    "wait for the grad copy");
		if (r == 0 && slots[i]->param_recorded)
			r = zcc__cuda(cudaEventSynchronize(slots[i]->param_event),
			    "wait for the param copy");
		tensors[i] = slots[i]->tensor;
	}
	if (r == 0) {
		r = zc_step_submit(conn, params, tensors, nslots);
		if (r < 0)
			zcc__fail(r, "zc_step_submit: %s", zc_errmsg(conn));
	}
	free(tensors);
	return r;
}

/* ---- Kernels ---- */

/*
 * Checked here, in C, before the value becomes the kernels' C++ enum: there a
 * value outside the enumerators' range (an (enum zc_dtype)7 from a caller) is
 * undefined behaviour before any comparison could reject it.
 */
static bool
dtype_ok(enum zc_dtype dt)
{
	return dt == ZC_F32 || dt == ZC_BF16 || dt == ZC_F16;
}

int
zcc_unscale_norm(void *const *grads, const uint64_t *numel, size_t n, enum zc_dtype dtype,
    float inv_scale, bool write_back, struct zcc_grad_stats *stats, cudaStream_t stream)
{
	int r;

	if (!dtype_ok(dtype))
		return zcc__fail(-EINVAL, "zcc_unscale_norm: unknown dtype %d", (int)dtype);
	r = zkc_unscale_norm(grads, numel, n, (enum zk_dtype)dtype, inv_scale, write_back,
	    (struct zkc_grad_stats *)stats, stream);
	return r < 0 ? zcc__fail(r, "zcc_unscale_norm: %s", strerror(-r)) : 0;
}

int
zcc_cast(const void *src, enum zc_dtype from, void *dst, enum zc_dtype to, uint64_t n,
    cudaStream_t stream)
{
	int r;

	if (!dtype_ok(from) || !dtype_ok(to))
		return zcc__fail(-EINVAL, "zcc_cast: unknown dtype %d", (int)(dtype_ok(from) ? to :
		    from));
	r = zkc_cast(src, (enum zk_dtype)from, dst, (enum zk_dtype)to, n, stream);
	return r < 0 ? zcc__fail(r, "zcc_cast: %s", strerror(-r)) : 0;
}

int
zcc_flatten(void *flat, const void *const *srcs, const uint64_t *numel, size_t n,
    size_t elem_size, cudaStream_t stream)
{
	int r = zkc_flatten(flat, srcs, numel, n, elem_size, stream);

	return r < 0 ? zcc__fail(r, "zcc_flatten: %s", strerror(-r)) : 0;
}

int
zcc_unflatten(const void *flat, void *const *dsts, const uint64_t *numel, size_t n,
    size_t elem_size, cudaStream_t stream)
{
	int r = zkc_unflatten(flat, dsts, numel, n, elem_size, stream);

	return r < 0 ? zcc__fail(r, "zcc_unflatten: %s", strerror(-r)) : 0;
}
