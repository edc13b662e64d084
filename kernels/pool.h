/* Fixed, pinned worker threads that run the kernels over slices of a tensor. */
#ifndef ZK_POOL_H
#define ZK_POOL_H

#include <stddef.h>

#include "optim.h"

struct zk_pool;

/*
 * nthreads workers including the calling thread; cpus (nullable) lists the
 * cores to pin them to, round robin.
 */
int zk_pool_new(unsigned nthreads, const int *cpus, size_t ncpus, struct zk_pool **ret);
void zk_pool_free(struct zk_pool *pool);
unsigned zk_pool_threads(const struct zk_pool *pool);

/*
 * Blocking: the whole step for each tensor, split over the pool in slices
 * aligned to the vector width and cache lines.  Results are bit-identical
 * for every thread count.
 */
int zk_pool_step(struct zk_pool *pool, enum zk_isa isa, const struct zk_hparams *hp,
    const struct zk_tensor *tensors, size_t ntensors);

/*
 * Blocking: gradient pass over several tensors, summed in a fixed order
 * (fixed-size chunks), so the norm is bit-identical for every thread count.
 */
int zk_pool_grad_check(struct zk_pool *pool, enum zk_isa isa, const struct zk_tensor *tensors,
    size_t ntensors, double grad_scale, struct zk_grad_stats *stats);

/* Additions to the original interface, for benchmarks and tools. */

/* Blocking: zk_step_memonly over the tensors, split exactly as zk_pool_step splits them. */
int zk_pool_memonly(struct zk_pool *pool, enum zk_isa isa, const struct zk_tensor *tensors,
    size_t ntensors);

/* Blocking: fn(arg, i, nthreads) on every thread i of the pool (i = 0 is the caller). */
int zk_pool_run(struct zk_pool *pool, void (*fn)(void *arg, unsigned idx, unsigned nthreads),
    void *arg);

/*
 * Compressed state (quant.h): as zk_pool_step and zk_pool_memonly, slices on
 * ZK_Q8_BLOCK boundaries.  -ENOTSUP for an optimizer other than AdamW/Adam.
 */
struct zk_qtensor;
int zk_pool_qstep(struct zk_pool *pool, enum zk_isa isa, const struct zk_hparams *hp,
    const struct zk_qtensor *tensors, size_t ntensors);
int zk_pool_qmemonly(struct zk_pool *pool, enum zk_isa isa, const struct zk_qtensor *tensors,
    size_t ntensors);

#endif
