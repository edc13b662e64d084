/* libzclient_cuda: ZeRO-3 over NCCL: partitioned flat parameters, gather, reduce-scatter, handoff. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zcc_impl.h"

/*
 * Shards are a multiple of 128 elements: every rank's piece of an NCCL
 * collective then starts 256-byte aligned (bf16), which NCCL's copy kernels
 * and the DMA engines move at full speed.  The cost is at most 127 padding
 * elements per rank and parameter.
 */
#define SHARD_ALIGN 128

/* Shards per gradient pass: within the protocol's 4096 tensors a set. */
#define GRAD_PASS_MAX 1024

struct zcc_flat {
	struct zcc_zero3 *z;
	struct zcc_flat *next;
	char name[128];
	struct zcc_partition part;
	enum zc_dtype dtype;
	size_t esize;
	struct zc_tensor *tensor;
	struct zcc_slots *slots;
	void *param_shard;		/* device */
	void *grad_shard;		/* device */
	bool queued;			/* reduce-scattered in this step */
};

struct zcc_zero3 {
	struct zc_conn *conn;
	ncclComm_t comm;
	int rank, world;
	struct zcc_flat *flats;
	size_t nflats;
	/* This step: queue[0..qhead) submitted, queue[qhead..qlen) waiting for their copy. */
	struct zcc_flat **queue;
	size_t qhead, qlen, qcap;
	struct zc_step_params params;
	bool in_step;
	bool param_offload;		/* for the flat parameters created from now on */
	/*
	 * max_grad_norm or check_finite: the norm and the inf/NaN check cover
	 * the whole model on every rank, so the shards are held until backward
	 * is done and stepped in two phases (gradient pass, all-reduce, step).
	 */
	bool global;
	double *reduce_buf;		/* device: sumsq and the non-finite count, all-reduced */
};

int
zcc_partition(uint64_t numel, uint32_t world, uint32_t rank, uint64_t align,
    struct zcc_partition *ret)
{
	uint64_t shard;

	if (world == 0 || rank >= world || numel == 0 || ret == NULL)
		return zcc__fail(-EINVAL, "partition of %llu elements: rank %u of %u",
		    (unsigned long long)numel, rank, world);
	if (align == 0)
		align = 1;
	/* Rounded up without forming numel + world - 1, which can wrap. */
	shard = numel / world + (numel % world != 0);
	if (shard > UINT64_MAX - (align - 1))
		return zcc__fail(-EOVERFLOW, "partition of %llu elements overflows",
		    (unsigned long long)numel);
	shard = (shard + align - 1) / align * align;
	if (shard > UINT64_MAX / world)
		return zcc__fail(-EOVERFLOW, "partition of %llu elements overflows",
		    (unsigned long long)numel);
	*ret = (struct zcc_partition){
		.numel = numel,
		.shard_numel = shard,
		.padded_numel = shard * world,
		.offset = shard * rank,
	};
	if (ret->offset < numel)
		ret->valid = numel - ret->offset < shard ? numel - ret->offset : shard;
	return 0;
}

static int
nccl_type(enum zc_dtype dtype, ncclDataType_t *ret)
{
	switch (dtype) {
	case ZC_F32:
		*ret = ncclFloat32;
		return 0;
	case ZC_BF16:
		*ret = ncclBfloat16;
		return 0;
	case ZC_F16:
		*ret = ncclFloat16;
		return 0;
	default:
		return zcc__fail(-EINVAL, "unknown dtype %d", (int)dtype);
	}
}

int
zcc_zero3_create(struct zc_conn *conn, ncclComm_t comm, struct zcc_zero3 **ret)
{
	struct zcc_zero3 *z;
	int rank, world, r;

	if (conn == NULL || comm == NULL || ret == NULL)
		return zcc__fail(-EINVAL, "zcc_zero3_create: no connection or communicator");
	r = zcc__nccl(ncclCommUserRank(comm, &rank), comm, "ncclCommUserRank");
	if (r == 0)
		r = zcc__nccl(ncclCommCount(comm, &world), comm, "ncclCommCount");
	if (r < 0)
		return r;
	z = calloc(1, sizeof(*z));
	if (z == NULL)
		return zcc__fail(-ENOMEM, "out of memory");
	z->conn = conn;
	z->comm = comm;
	z->rank = rank;
	z->world = world;
	*ret = z;
	return 0;
}

static void
flat_free(struct zcc_flat *f)
{
	(void)zcc_slots_detach(f->slots);
	if (f->tensor != NULL)
		(void)zc_tensor_unregister(f->tensor);
	if (f->param_shard != NULL)
		(void)cudaFree(f->param_shard);
	if (f->grad_shard != NULL)
		(void)cudaFree(f->grad_shard);
	free(f);
}

void
zcc_zero3_destroy(struct zcc_zero3 *z)
{
	struct zcc_flat *f;

	if (z == NULL)
		return;
	/* Tensors in a step cannot be unregistered: let the daemon finish them. */
	if (z->qhead > 0)
		(void)zc_wait_all(z->conn, NULL);
	while ((f = z->flats) != NULL) {
		z->flats = f->next;
		flat_free(f);
	}
	if (z->reduce_buf != NULL)
		(void)cudaFree(z->reduce_buf);
	free(z->queue);
	free(z);
}

int
zcc_flat_create(struct zcc_zero3 *z, const char *name, uint64_t numel, enum zc_dtype dtype,
    const float *init, struct zcc_flat **ret)
{
	struct zc_tensor_desc desc = { .name = name, .grad_dtype = dtype, .param_dtype = dtype,
		.param_offload = z != NULL && z->param_offload };
	struct zcc_flat *f, **bigger;
	ncclDataType_t nt = ncclBfloat16;
	float *shard_init = NULL;
	int r;

	if (z == NULL || name == NULL || init == NULL || ret == NULL)
		return zcc__fail(-EINVAL, "zcc_flat_create: missing argument");
	if (z->in_step)
		return zcc__fail(-EBUSY, "zcc_flat_create: a step is in progress");
	r = nccl_type(dtype, &nt);
	if (r < 0)
		return r;
	f = calloc(1, sizeof(*f));
	if (f == NULL)
		return zcc__fail(-ENOMEM, "out of memory");
	f->z = z;
	snprintf(f->name, sizeof(f->name), "%s", name);
	f->dtype = dtype;
	f->esize = zcc__dtype_size(dtype);
	r = zcc_partition(numel, (uint32_t)z->world, (uint32_t)z->rank, SHARD_ALIGN, &f->part);
	if (r < 0)
		goto fail;
	if (z->nflats + 1 > z->qcap) {
		size_t cap = z->qcap ? z->qcap * 2 : 16;

		bigger = realloc(z->queue, cap * sizeof(*bigger));
		if (bigger == NULL) {
			r = zcc__fail(-ENOMEM, "out of memory");
			goto fail;
		}
		z->queue = bigger;
		z->qcap = cap;
	}
	/* The daemon holds this rank's slice; padding starts (and, with zero gradients, stays) 0. */
	shard_init = calloc(f->part.shard_numel, sizeof(float));
	if (shard_init == NULL) {
		r = zcc__fail(-ENOMEM, "out of memory");
		goto fail;
	}
	if (f->part.valid > 0)
		memcpy(shard_init, init + f->part.offset, f->part.valid * sizeof(float));
	desc.numel = f->part.shard_numel;
	r = zc_tensor_register(z->conn, &desc, shard_init, &f->tensor);
	free(shard_init);
	if (r < 0) {
		zcc__fail(r, "register '%s': %s", name, zc_errmsg(z->conn));
		goto fail;
	}
	r = zcc_slots_attach(f->tensor, &f->slots);
	if (r < 0)
		goto fail;
	r = zcc__cuda(cudaMalloc(&f->param_shard, f->part.shard_numel * f->esize),
	    "cudaMalloc(param shard)");
	if (r == 0)
		r = zcc__cuda(cudaMalloc(&f->grad_shard, f->part.shard_numel * f->esize),
		    "cudaMalloc(grad shard)");
	if (r < 0)
		goto fail;
	/* The param slot mirrors the master weights (resumed ones too): start from it. */
	r = zcc_param_h2d(f->slots, 0, f->part.shard_numel, f->param_shard, NULL);
	if (r == 0)
		r = zcc__cuda(cudaEventSynchronize(zcc_param_event(f->slots)),
		    "first parameter copy");
	if (r < 0)
		goto fail;
	f->next = z->flats;
	z->flats = f;
	z->nflats++;
	*ret = f;
	return 0;
fail:
	flat_free(f);
	return r;
}

int
zcc_zero3_set_param_offload(struct zcc_zero3 *z, bool on)
{
	if (z == NULL)
		return zcc__fail(-EINVAL, "zcc_zero3_set_param_offload: no zcc_zero3");
	z->param_offload = on;
	return 0;
}

uint32_t
zcc_zero3_submitted(const struct zcc_zero3 *z)
{
	return z != NULL && z->in_step ? (uint32_t)z->qhead : 0;
}

const struct zcc_partition *
zcc_flat_partition(const struct zcc_flat *f)
{
	return &f->part;
}

struct zc_tensor *
zcc_flat_tensor(struct zcc_flat *f)
{
	return f->tensor;
}

struct zcc_slots *
zcc_flat_slots(struct zcc_flat *f)
{
	return f->slots;
}

void *
zcc_flat_param_shard(struct zcc_flat *f)
{
	return f->param_shard;
}

void *
zcc_flat_grad_shard(struct zcc_flat *f)
{
	return f->grad_shard;
}

int
zcc_flat_gather(struct zcc_flat *f, void *full, cudaStream_t stream)
{
	ncclDataType_t nt = ncclBfloat16;
	int r = nccl_type(f->dtype, &nt);

	if (r < 0)
		return r;
	if (full == NULL)
		return zcc__fail(-EINVAL, "zcc_flat_gather: no buffer");
	return zcc__nccl(ncclAllGather(f->param_shard, full, f->part.shard_numel, nt, f->z->comm,
	    stream), f->z->comm, "ncclAllGather");
}

int
zcc_zero3_begin_step(struct zcc_zero3 *z, const struct zc_step_params *params)
{
	if (z->in_step)
		return zcc__fail(-EBUSY, "zcc_zero3_begin_step: the last step has not ended");
	z->params = *params;
	z->global = params->max_grad_norm > 0 || params->check_finite;
	z->qhead = z->qlen = 0;
	z->in_step = true;
	return 0;
}

int
zcc_flat_reduce_scatter(struct zcc_flat *f, const void *full_grad, cudaStream_t stream)
{
	struct zcc_zero3 *z = f->z;
	ncclDataType_t nt = ncclBfloat16;
	int r;

	if (!z->in_step)
		return zcc__fail(-EINVAL, "zcc_flat_reduce_scatter outside a step");
	if (f->queued)
		return zcc__fail(-EBUSY, "flat parameter already reduced in this step");
	if (full_grad == NULL)
		return zcc__fail(-EINVAL, "zcc_flat_reduce_scatter: no gradients");
	r = nccl_type(f->dtype, &nt);
	if (r < 0)
		return r;
	/* Average: every rank's gradient is of its own mean loss; the step wants the global mean. */
	r = zcc__nccl(ncclReduceScatter(full_grad, f->grad_shard, f->part.shard_numel, nt, ncclAvg,
	    z->comm, stream), z->comm, "ncclReduceScatter");
	if (r < 0)
		return r;
	r = zcc_grad_d2h(f->slots, 0, f->part.shard_numel, f->grad_shard, stream);
	if (r < 0)
		return r;
	f->queued = true;
	z->queue[z->qlen++] = f;
	/* Whatever earlier layers have finished goes to the daemon now, not at the end. */
	r = zcc_zero3_poll(z);
	return r < 0 ? r : 0;
}

/* 1 when the event has completed (or was never recorded), 0 when not yet, -errno on error. */
static int
event_done(cudaEvent_t ev)
{
	cudaError_t e = cudaEventQuery(ev);

	if (e == cudaSuccess)
		return 1;
	if (e == cudaErrorNotReady) {
		/* Not an error: keep it from showing up as one at the caller's next check. */
		if (cudaPeekAtLastError() == cudaErrorNotReady)
			(void)cudaGetLastError();
		return 0;
	}
	return zcc__cuda(e, "cudaEventQuery");
}

static int
submit_one(struct zcc_zero3 *z, struct zcc_flat *f)
{
	struct zc_tensor *t = f->tensor;
	int r = zc_step_submit(z->conn, &z->params, &t, 1);

	if (r < 0)
		return zcc__fail(r, "zc_step_submit: %s", zc_errmsg(z->conn));
	return 0;
}

int
zcc_zero3_poll(struct zcc_zero3 *z)
{
	int n = 0, r;

	/* A norm over the whole model needs every shard first: end_step submits them. */
	while (!z->global && z->qhead < z->qlen) {
		struct zcc_flat *f = z->queue[z->qhead];

		/* In order: NCCL and the copies finish in stream order, so the head is first anyway. */
		r = event_done(zcc_grad_event(f->slots));
		if (r == 1)
			r = event_done(zcc_param_event(f->slots));
		if (r <= 0)
			return r < 0 ? r : n;
		r = submit_one(z, f);
		if (r < 0)
			return r;
		z->qhead++;
		n++;
	}
	return n;
}

/*
 * Phase one of a step clipped over the whole model: this rank's share from
 * the daemon (GRAD_PASS_MAX shards at a time), summed over the ranks
 * by NCCL in double.  *ret_skip: some rank saw inf/NaN; else *ret_coef is
 * clip_grad_norm_'s coefficient for the global norm (1 without max_grad_norm).
 */
static int
global_coef(struct zcc_zero3 *z, cudaStream_t stream, bool *ret_skip, double *ret_coef)
{
	struct zc_tensor *ts[GRAD_PASS_MAX];
	double share[2] = { 0, 0 };
	int r;

	for (size_t i = 0; i < z->qlen; ) {
		struct zc_grad_partial p;
		size_t n = 0;

		while (i < z->qlen && n < GRAD_PASS_MAX)
			ts[n++] = z->queue[i++]->tensor;
		r = zc_grad_pass(z->conn, ts, n, z->params.grad_scale, &p);
		if (r < 0)
			return zcc__fail(r, "gradient pass: %s", zc_errmsg(z->conn));
		share[0] += p.sumsq;
		share[1] += (double)p.nonfinite;
	}
	if (z->reduce_buf == NULL) {
		r = zcc__cuda(cudaMalloc((void **)&z->reduce_buf, sizeof(share)),
		    "cudaMalloc for the norm all-reduce");
		if (r < 0)
			return r;
	}
	r = zcc__cuda(cudaMemcpyAsync(z->reduce_buf, share, sizeof(share), cudaMemcpyHostToDevice,
	    stream), "norm share to the device");
	if (r == 0)
		r = zcc__nccl(ncclAllReduce(z->reduce_buf, z->reduce_buf, 2, ncclFloat64, ncclSum,
		    z->comm, stream), z->comm, "ncclAllReduce of the gradient norm");
	if (r == 0)
		r = zcc__cuda(cudaMemcpyAsync(share, z->reduce_buf, sizeof(share),
		    cudaMemcpyDeviceToHost, stream), "norm back from the device");
	if (r == 0)
		r = zcc__cuda(cudaStreamSynchronize(stream), "wait for the norm all-reduce");
	if (r < 0)
		return r;
	*ret_skip = z->params.check_finite && share[1] > 0;
	*ret_coef = zc_clip_coef(z->params.max_grad_norm, share[0]);
	return 0;
}

/* Phase two: every shard with the one coefficient, or none when the step is skipped. */
static int
submit_global(struct zcc_zero3 *z, cudaStream_t stream, struct zcc_step_summary *sum)
{
	struct zc_step_params p = z->params;
	bool skip = false;
	double coef = 1;
	int r;

	r = global_coef(z, stream, &skip, &coef);
	if (r < 0)
		return r;
	if (skip) {
		/* Nothing was submitted: the daemon's state and the device shards stay as they were. */
		sum->skipped = (uint32_t)z->qlen;
		z->qhead = 0;
		return 0;
	}
	p.check_finite = false;
	p.max_grad_norm = 0;
	p.clip_coef = coef < 1 ? coef : 0;
	for (z->qhead = 0; z->qhead < z->qlen; z->qhead++) {
		struct zc_tensor *t = z->queue[z->qhead]->tensor;

		r = zc_step_submit(z->conn, &p, &t, 1);
		if (r < 0)
			return zcc__fail(r, "zc_step_submit: %s", zc_errmsg(z->conn));
	}
	return 0;
}

int
zcc_zero3_end_step(struct zcc_zero3 *z, cudaStream_t stream, struct zcc_step_summary *ret)
{
	struct zcc_step_summary sum = { 0 };
	int r = 0, r2;

	if (!z->in_step)
		return zcc__fail(-EINVAL, "zcc_zero3_end_step outside a step");
	/* Blocking on each copy in turn hands every shard over the moment it lands. */
	while (r == 0 && z->qhead < z->qlen) {
		struct zcc_flat *f = z->queue[z->qhead];

		r = zcc__cuda(cudaEventSynchronize(zcc_grad_event(f->slots)),
		    "wait for the grad copy");
		if (r == 0)
			r = zcc__cuda(cudaEventSynchronize(zcc_param_event(f->slots)),
			    "wait for the param copy");
		if (r == 0 && !z->global)
			r = submit_one(z, f);
		if (r == 0)
			z->qhead++;
	}
	if (r == 0 && z->global)
		r = submit_global(z, stream, &sum);
	else if (z->global)
		z->qhead = 0;	/* none was submitted: nothing to wait for */
	/* Everything submitted is waited for, even after an error: slots must be idle again. */
	for (size_t i = 0; i < z->qhead; i++) {
		struct zcc_flat *f = z->queue[i];
		struct zc_step_result res;

		sum.submitted++;
		r2 = zc_wait_tensor(f->tensor, &res);
		if (r2 < 0) {
			if (r == 0)
				r = zcc__fail(r2, "step of '%s': %s", f->name,
				    zc_errmsg(z->conn));
			continue;
		}
		if (res.status == ZC_STEP_SKIPPED_NONFINITE) {
			sum.skipped++;
			continue;
		}
		sum.applied++;
		r2 = zcc_param_h2d(f->slots, 0, f->part.shard_numel, f->param_shard, stream);
		if (r2 < 0 && r == 0)
			r = r2;
	}
	for (size_t i = 0; i < z->qlen; i++)
		z->queue[i]->queued = false;
	z->qhead = z->qlen = 0;
	z->in_step = false;
	if (ret != NULL)
		*ret = sum;
	return r;
}
