/* libzclient_cuda: the GPU side of libzclient: CUDA-registered slots, async copies, kernels, ZeRO-3 over NCCL. */
#ifndef ZCLIENT_CUDA_H
#define ZCLIENT_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "zclient.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * A separate library (libzclient_cuda.so.0, symbols ZCLIENT_CUDA_0.1) so that
 * libzclient itself never needs CUDA.  Calls return 0 (or a count) or a
 * negative errno; CUDA and NCCL errors are mapped (zcc_errno_cuda,
 * zcc_errno_nccl) and zcc_errmsg() gives the text of this thread's last
 * failure, with the CUDA/NCCL error name in it.
 *
 * Devices: one per process.  libzclient_cuda never calls cudaSetDevice and
 * stores no device: every call works on the device current in the calling
 * thread, so select it (cudaSetDevice) before the first call, keep it, and
 * pass only streams of that device.  Each object is used from one thread at
 * a time (as its zc_conn).
 */
ZC_API const char *zcc_errmsg(void);
ZC_API int zcc_errno_cuda(cudaError_t err);
ZC_API int zcc_errno_nccl(ncclResult_t res);

/* ---- Slots: a tensor's grad and param slots, page-locked for DMA ---- */

/*
 * Registration is per process, and unmapping a registered range behind the
 * driver's back leaves it stale, so the CUDA layer owns it and libzclient
 * calls back before it unmaps: zcc_slots_attach registers both slots
 * (cudaHostRegister, portable to every device; the read-only param slot with
 * cudaHostRegisterReadOnly) and installs a slots hook on the tensor.
 * zc_tensor_unregister, zc_job_close and zc_disconnect then wait for copies in
 * flight, unregister and free the zcc_slots themselves: after any of those the
 * zcc_slots pointer is gone.  zcc_slots_detach does the same earlier.  A
 * reconnect whose daemon hands the slots back in other files (mapped over the
 * old ones in place) makes it wait and unregister both slots, and nothing
 * more: the zcc_slots stays good, its copies go on through pageable memory
 * (zcc_slots_param_pinned() false).
 *
 * Where the device cannot register read-only memory (attribute
 * cudaDevAttrHostRegisterReadOnlySupported is 0) the param slot stays
 * pageable: copies out of it still work, synchronously and slower;
 * zcc_slots_param_pinned() says which.
 *
 * zc_param_release drops the pages of a param_offload tensor's param slot,
 * so libzclient unpins a registered param slot first (through the hook
 * zc_tensor_set_param_pin): it waits for the param copy and unregisters the
 * slot, which stays pageable from then on (zcc_slots_param_pinned() false);
 * zcc_slots_detach and zcc_slots_attach again, once the params are back,
 * pin it anew.
 */
struct zcc_slots;

ZC_API int zcc_slots_attach(struct zc_tensor *tensor, struct zcc_slots **ret);
/* Waits for this tensor's copies, unregisters, frees; NULL is a no-op. */
ZC_API int zcc_slots_detach(struct zcc_slots *slots);
ZC_API struct zc_tensor *zcc_slots_tensor(const struct zcc_slots *slots);
ZC_API bool zcc_slots_param_pinned(const struct zcc_slots *slots);

/*
 * Asynchronous copies on the caller's stream, element offsets and counts in
 * the slot's dtype.  Each records the slot's event after the copy: the grad
 * event once the gradients are in host memory, the param event once the
 * parameters have left it.  Only the last copy of each kind is tracked, so
 * give one tensor's copies one stream.  The tensor must not be in a step
 * (zc_wait_tensor first): the daemon reads the grad slot and writes the
 * param slot while it is.
 */
ZC_API int zcc_grad_d2h(struct zcc_slots *slots, uint64_t offset, uint64_t count,
    const void *src, cudaStream_t stream);
ZC_API int zcc_param_h2d(struct zcc_slots *slots, uint64_t offset, uint64_t count, void *dst,
    cudaStream_t stream);
ZC_API cudaEvent_t zcc_grad_event(const struct zcc_slots *slots);
ZC_API cudaEvent_t zcc_param_event(const struct zcc_slots *slots);

/*
 * zc_step_submit for these tensors once their gradients have landed and the
 * last parameter copy out of their param slots is done (waits on both events
 * of each; returns without waiting for the step).
 */
ZC_API int zcc_step_submit(struct zc_conn *conn, const struct zc_step_params *params,
    struct zcc_slots *const *slots, size_t nslots);

/* ---- Kernels (device pointers; host arrays of pointers and sizes) ---- */

/* Device memory the unscale pass adds into; zero it before the first call. */
struct zcc_grad_stats {
	double sumsq;			/* squared L2 norm of the unscaled gradients */
	unsigned long long nonfinite;	/* inf/NaN elements after unscaling */
};

/*
 * For n gradient tensors of one dtype: g * inv_scale (the float product, as
 * zoffloadd's gradient check computes it), inf/NaN count and squared norm
 * added into *stats; with write_back the unscaled values replace g.
 */
ZC_API int zcc_unscale_norm(void *const *grads, const uint64_t *numel, size_t n,
    enum zc_dtype dtype, float inv_scale, bool write_back, struct zcc_grad_stats *stats,
    cudaStream_t stream);
/* n elements from -> to; rounding and NaNs bit-identical to zc_f32_to_bf16 / zc_f32_to_f16. */
ZC_API int zcc_cast(const void *src, enum zc_dtype from, void *dst, enum zc_dtype to,
    uint64_t n, cudaStream_t stream);
/* The n tensors back to back into flat (elem_size 2 or 4), in order; unflatten reverses. */
ZC_API int zcc_flatten(void *flat, const void *const *srcs, const uint64_t *numel, size_t n,
    size_t elem_size, cudaStream_t stream);
ZC_API int zcc_unflatten(const void *flat, void *const *dsts, const uint64_t *numel, size_t n,
    size_t elem_size, cudaStream_t stream);

/* ---- ZeRO-3 over NCCL ---- */

/*
 * A flat parameter of numel elements split over world ranks: every rank owns
 * shard_numel elements (a multiple of align), the last shards padded with
 * zeros up to padded_numel = shard_numel * world, as NCCL's reduce-scatter
 * and all-gather need equal pieces.
 */
struct zcc_partition {
	uint64_t numel;
	uint64_t shard_numel;
	uint64_t padded_numel;
	uint64_t offset;	/* first element of this rank's shard in the flat parameter */
	uint64_t valid;		/* elements of the shard that are real, the rest is padding */
};

/* align 0 means 1; -EINVAL for world 0, rank >= world or numel 0. */
ZC_API int zcc_partition(uint64_t numel, uint32_t world, uint32_t rank, uint64_t align,
    struct zcc_partition *ret);

struct zcc_zero3;
struct zcc_flat;

/*
 * One per rank: conn has this rank's job open (zc_job_open with the
 * communicator's rank and size); conn and comm are the caller's and must
 * outlive this (zcc_zero3_destroy before zc_disconnect and ncclCommDestroy).
 */
ZC_API int zcc_zero3_create(struct zc_conn *conn, ncclComm_t comm, struct zcc_zero3 **ret);
/* Frees every flat parameter (slots, daemon tensors, device shards); NULL is a no-op. */
ZC_API void zcc_zero3_destroy(struct zcc_zero3 *zero3);

/*
 * A flat parameter (e.g. one layer's weights and biases flattened): this
 * rank's shard is registered with zoffloadd as tensor `name` (fp32 master
 * there, dtype grads and params in the slots), init holds all numel fp32
 * starting values (host; only this rank's part is sent), and the bf16/fp16
 * parameter and gradient shards are allocated on the device, the parameter
 * shard filled from the param slot before this returns.
 */
ZC_API int zcc_flat_create(struct zcc_zero3 *zero3, const char *name, uint64_t numel,
    enum zc_dtype dtype, const float *init, struct zcc_flat **ret);
/*
 * Flat parameters created from now on are registered with param_offload:
 * once zcc_zero3_end_step has copied the new shards out, zc_param_release on
 * their tensors (zcc_flat_tensor) hands the param slots' memory back to the
 * daemon (the unpin waits for that copy); the next step refills them.
 */
ZC_API int zcc_zero3_set_param_offload(struct zcc_zero3 *zero3, bool on);
ZC_API const struct zcc_partition *zcc_flat_partition(const struct zcc_flat *flat);
ZC_API struct zc_tensor *zcc_flat_tensor(struct zcc_flat *flat);
ZC_API struct zcc_slots *zcc_flat_slots(struct zcc_flat *flat);
/* Device shards, shard_numel elements of the flat's dtype each. */
ZC_API void *zcc_flat_param_shard(struct zcc_flat *flat);
ZC_API void *zcc_flat_grad_shard(struct zcc_flat *flat);

/* ncclAllGather of every rank's parameter shard into full (device, padded_numel elements). */
ZC_API int zcc_flat_gather(struct zcc_flat *flat, void *full, cudaStream_t stream);

/*
 * Starts a step: every zcc_flat_reduce_scatter until zcc_zero3_end_step hands
 * its shard to zoffloadd with these parameters.  Without max_grad_norm and
 * check_finite each flat parameter is its own step set, submitted the moment
 * its gradients are in the grad slot, so the CPU step overlaps the rest of
 * backward.  With either, clipping and the inf/NaN skip cover the whole
 * model on every rank, as torch.nn.utils.clip_grad_norm_ over all
 * parameters would: end_step asks the daemon for this rank's share of the
 * norm (zc_grad_pass), all-reduces the shares over the communicator, then
 * steps every shard with the one coefficient, or none of them when any rank
 * saw inf/NaN (the summary counts them skipped).  The CPU step then starts
 * after backward.
 */
ZC_API int zcc_zero3_begin_step(struct zcc_zero3 *zero3, const struct zc_step_params *params);

/*
 * ncclReduceScatter (average over ranks) of full_grad (device, padded_numel
 * elements) into this rank's gradient shard, then its copy into the grad slot,
 * both on stream; the shard is queued for the daemon.  Between begin_step and
 * end_step, once per flat parameter.
 */
ZC_API int zcc_flat_reduce_scatter(struct zcc_flat *flat, const void *full_grad,
    cudaStream_t stream);

/* Submits every queued shard whose copy has finished, in order; returns how many. */
ZC_API int zcc_zero3_poll(struct zcc_zero3 *zero3);
/* Shards of this step submitted so far (by poll, before end_step); 0 outside a step. */
ZC_API uint32_t zcc_zero3_submitted(const struct zcc_zero3 *zero3);

struct zcc_step_summary {
	uint32_t submitted;	/* flat parameters stepped by the daemon */
	uint32_t applied;
	uint32_t skipped;	/* ZC_STEP_SKIPPED_NONFINITE: parameters unchanged */
};

/*
 * Submits the rest of the queue (each as soon as its copy finishes), waits for
 * the daemon, and copies every new parameter shard from its param slot to the
 * device on stream.  ret is nullable.  The first failing tensor's error is
 * returned after all have been waited for.
 */
ZC_API int zcc_zero3_end_step(struct zcc_zero3 *zero3, cudaStream_t stream,
    struct zcc_step_summary *ret);

#ifdef __cplusplus
}
#endif

#endif
