/* The kernel worker pool: fixed pinned threads, static slices, one blocking call at a time. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE	/* pthread_attr_setaffinity_np */
#endif
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pool.h"
#include "quant.h"

/*
 * Slice boundaries fall on multiples of 32 elements inside each tensor: a
 * whole number of AVX-512 vectors, a 64 B line of a bf16/fp16 param slot and
 * two lines of each fp32 array, so no two threads write the same cache line
 * (given 64 B-aligned arrays) and each slice's streaming stores are aligned
 * wherever the tensor's are.
 */
#define ZK_SLICE_ALIGN 32

/*
 * The norm is summed per fixed chunk of each tensor, then over chunks in
 * order: the grouping never depends on the thread count.  64 Ki elements is
 * small enough to balance two threads over a few MB, large enough that the
 * per-chunk record (16 B) is noise.
 */
#define ZK_GRAD_CHUNK 65536

#define ZK_POOL_SPIN_NS 50000u

enum job {
	JOB_STEP,
	JOB_MEMONLY,
	JOB_GRAD,
	JOB_FN,
	JOB_QSTEP,		/* compressed state: qtensors, slices on block boundaries */
	JOB_QMEMONLY,
};

struct worker {
	struct zk_pool *pool;
	unsigned idx;
	pthread_t thread;
};

struct zk_pool {
	unsigned nthreads;
	struct worker *workers;		/* [1, nthreads); slot 0 is the caller */
	unsigned started;

	pthread_mutex_t mu;
	pthread_cond_t start_cv;
	pthread_cond_t done_cv;
	unsigned long gen;
	unsigned long pending;
	bool quit;

	/* The job in flight; written by the caller before gen moves on. */
	enum job job;
	enum zk_isa isa;
	const struct zk_hparams *hp;
	const struct zk_tensor *tensors;
	const struct zk_qtensor *qtensors;	/* JOB_QSTEP, JOB_QMEMONLY (ntensors of them) */
	size_t ntensors;
	size_t total;			/* elements over all tensors */
	size_t nchunks;			/* JOB_GRAD */
	double grad_scale;
	struct zk_grad_stats *chunks;
	size_t chunks_cap;
	void (*fn)(void *arg, unsigned idx, unsigned nthreads);
	void *fn_arg;
};

/* Global element offset x → (tensor, offset) snapped down to the slice alignment. */
static void locate(const struct zk_pool *p, size_t x, size_t *tidx, size_t *off)
{
	size_t k = 0;

	while (k < p->ntensors && x >= p->tensors[k].n) {
		x -= p->tensors[k].n;
		k++;
	}
	*tidx = k;
	*off = x - x % ZK_SLICE_ALIGN;
}

static void run_elements(struct zk_pool *p, unsigned idx)
{
	size_t lo = p->total * idx / p->nthreads, hi = p->total * (idx + 1) / p->nthreads;
	size_t ka, oa, kb, ob;

	locate(p, lo, &ka, &oa);
	locate(p, hi, &kb, &ob);
	for (size_t k = ka; k <= kb && k < p->ntensors; k++) {
		const struct zk_tensor *t = &p->tensors[k];
		size_t b = k == ka ? oa : 0, e = k == kb ? ob : t->n;

		if (idx == p->nthreads - 1 && k == kb)
			e = t->n;
		if (b >= e)
			continue;
		/* Arguments were validated before dispatch: these cannot fail. */
		if (p->job == JOB_STEP)
			zk_step(p->isa, p->hp, t, b, e);
		else
			zk_step_memonly(p->isa, t, b, e);
	}
}

static void run_chunks(struct zk_pool *p, unsigned idx)
{
	size_t lo = p->nchunks * idx / p->nthreads, hi = p->nchunks * (idx + 1) / p->nthreads;
	size_t c = 0;

	for (size_t k = 0; k < p->ntensors && c < hi; k++) {
		const struct zk_tensor *t = &p->tensors[k];

		for (size_t b = 0; b < t->n && c < hi; b += ZK_GRAD_CHUNK, c++) {
			size_t e = t->n - b < ZK_GRAD_CHUNK ? t->n : b + ZK_GRAD_CHUNK;

			if (c < lo)
				continue;
			p->chunks[c] = (struct zk_grad_stats){ 0 };
			zk_grad_check(p->isa, t->grad, t->grad_dtype, p->grad_scale, b, e, &p->chunks[c]);
		}
	}
}

/*
 * The compressed-state job: run_elements over qtensors, slice boundaries on
 * ZK_Q8_BLOCK (a multiple of ZK_SLICE_ALIGN), since a block's scale belongs
 * to one thread.  Bit-identical for every thread count like the fp32 step.
 */
static void qlocate(const struct zk_pool *p, size_t x, size_t *tidx, size_t *off)
{
	size_t k = 0;

	while (k < p->ntensors && x >= p->qtensors[k].n) {
		x -= p->qtensors[k].n;
		k++;
	}
	*tidx = k;
	*off = x - x % ZK_Q8_BLOCK;
}

static void run_qelements(struct zk_pool *p, unsigned idx)
{
	size_t lo = p->total * idx / p->nthreads, hi = p->total * (idx + 1) / p->nthreads;
	size_t ka, oa, kb, ob;

	qlocate(p, lo, &ka, &oa);
	qlocate(p, hi, &kb, &ob);
	for (size_t k = ka; k <= kb && k < p->ntensors; k++) {
		const struct zk_qtensor *t = &p->qtensors[k];
		size_t b = k == ka ? oa : 0, e = k == kb ? ob : t->n;

		if (idx == p->nthreads - 1 && k == kb)
			e = t->n;
		if (b >= e)
			continue;
		if (p->job == JOB_QSTEP)
			zk_qstep(p->isa, p->hp, t, b, e);
		else
			zk_qstep_memonly(p->isa, t, b, e);
	}
}

static void run_slice(struct zk_pool *p, unsigned idx)
{
	switch (p->job) {
	case JOB_STEP:
	case JOB_MEMONLY:
		run_elements(p, idx);
		break;
	case JOB_GRAD:
		run_chunks(p, idx);
		break;
	case JOB_FN:
		p->fn(p->fn_arg, idx, p->nthreads);
		break;
	case JOB_QSTEP:
	case JOB_QMEMONLY:
		run_qelements(p, idx);
		break;
	}
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#endif
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/*
 * Waits up to ZK_POOL_SPIN_NS for *word to differ from old (until_zero: to
 * reach 0) before the caller sleeps on its condition variable.  A step is a
 * dispatch a tensor slice, back to back: a worker put to sleep between them
 * is woken by a futex, and on a virtual machine the wake-up of an idle vCPU
 * took about 40 us a dispatch (1536 tensors of 64 Ki elements stepped in
 * 125-147 ms against 76-79 ms spinning; 24 of 4 Mi, 49-51 ms either way).
 */
static void spin_for(const unsigned long *word, unsigned long old, bool until_zero)
{
	uint64_t deadline = 0;

	for (unsigned i = 1;; i++) {
		unsigned long v = __atomic_load_n(word, __ATOMIC_ACQUIRE);

		if (until_zero ? v == 0 : v != old)
			return;
		cpu_relax();
		if (i % 64 == 0) {
			uint64_t t = now_ns();

			if (deadline == 0)
				deadline = t + ZK_POOL_SPIN_NS;
			else if (t >= deadline)
				return;
		}
	}
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	struct zk_pool *p = w->pool;
	unsigned long seen = 0;

	pthread_mutex_lock(&p->mu);
	for (;;) {
		if (p->gen == seen && !p->quit) {
			pthread_mutex_unlock(&p->mu);
			spin_for(&p->gen, seen, false);
			pthread_mutex_lock(&p->mu);
		}
		while (p->gen == seen && !p->quit)
			pthread_cond_wait(&p->start_cv, &p->mu);
		if (p->quit)
			break;
		seen = p->gen;
		pthread_mutex_unlock(&p->mu);
		run_slice(p, w->idx);
		pthread_mutex_lock(&p->mu);
		if (__atomic_sub_fetch(&p->pending, 1, __ATOMIC_RELEASE) == 0)
			pthread_cond_signal(&p->done_cv);
	}
	pthread_mutex_unlock(&p->mu);
	return NULL;
}

/* Runs the job in p on every thread; the caller takes slice 0. */
static void dispatch(struct zk_pool *p)
{
	pthread_mutex_lock(&p->mu);
	__atomic_store_n(&p->pending, p->nthreads - 1, __ATOMIC_RELAXED);
	__atomic_store_n(&p->gen, p->gen + 1, __ATOMIC_RELEASE);
	pthread_cond_broadcast(&p->start_cv);
	pthread_mutex_unlock(&p->mu);

	run_slice(p, 0);

	spin_for(&p->pending, 0, true);
	pthread_mutex_lock(&p->mu);
	while (p->pending)
		pthread_cond_wait(&p->done_cv, &p->mu);
	pthread_mutex_unlock(&p->mu);
}

int zk_pool_new(unsigned nthreads, const int *cpus, size_t ncpus, struct zk_pool **ret)
{
	struct zk_pool *p;
	sigset_t all, old;
	int r = 0;

	if (!ret || nthreads == 0 || nthreads > CPU_SETSIZE || (ncpus && !cpus))
		return -EINVAL;
	for (size_t i = 0; i < ncpus; i++)
		if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE)
			return -EINVAL;
	p = calloc(1, sizeof(*p));
	if (!p)
		return -ENOMEM;
	p->nthreads = nthreads;
	pthread_mutex_init(&p->mu, NULL);
	pthread_cond_init(&p->start_cv, NULL);
	pthread_cond_init(&p->done_cv, NULL);
	p->workers = calloc(nthreads, sizeof(*p->workers));
	if (!p->workers) {
		r = -ENOMEM;
		goto fail;
	}

	/* Workers never take signals: the daemon handles them on its own threads. */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	for (unsigned i = 1; i < nthreads; i++) {
		struct worker *w = &p->workers[i];
		pthread_attr_t attr;

		w->pool = p;
		w->idx = i;
		pthread_attr_init(&attr);
		if (ncpus) {
			cpu_set_t set;

			CPU_ZERO(&set);
			CPU_SET(cpus[i % ncpus], &set);
			pthread_attr_setaffinity_np(&attr, sizeof(set), &set);
		}
		r = -pthread_create(&w->thread, &attr, worker_main, w);
		pthread_attr_destroy(&attr);
		if (r < 0)
			break;
		p->started++;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (r < 0)
		goto fail;
	*ret = p;
	return 0;

fail:
	zk_pool_free(p);
	return r;
}

void zk_pool_free(struct zk_pool *p)
{
	if (!p)
		return;
	pthread_mutex_lock(&p->mu);
	p->quit = true;
	pthread_cond_broadcast(&p->start_cv);
	pthread_mutex_unlock(&p->mu);
	for (unsigned i = 1; i <= p->started; i++)
		pthread_join(p->workers[i].thread, NULL);
	pthread_cond_destroy(&p->done_cv);
	pthread_cond_destroy(&p->start_cv);
	pthread_mutex_destroy(&p->mu);
	free(p->chunks);
	free(p->workers);
	free(p);
}

unsigned zk_pool_threads(const struct zk_pool *pool)
{
	return pool->nthreads;
}

static int set_tensors(struct zk_pool *p, enum zk_isa isa, const struct zk_tensor *tensors,
    size_t ntensors)
{
	if (!tensors && ntensors)
		return -EINVAL;
	p->isa = isa;
	p->tensors = tensors;
	p->ntensors = ntensors;
	p->total = 0;
	for (size_t k = 0; k < ntensors; k++)
		p->total += tensors[k].n;
	return 0;
}

int zk_pool_step(struct zk_pool *pool, enum zk_isa isa, const struct zk_hparams *hp,
    const struct zk_tensor *tensors, size_t ntensors)
{
	int r;

	if (!pool || !hp)
		return -EINVAL;
	/* Validate everything up front: an empty range checks the arguments and does no work. */
	for (size_t k = 0; k < ntensors; k++) {
		r = zk_step(isa, hp, &tensors[k], 0, 0);
		if (r < 0)
			return r;
	}
	r = zk_hparams_validate(hp);
	if (r < 0)
		return r;
	r = set_tensors(pool, isa, tensors, ntensors);
	if (r < 0)
		return r;
	pool->job = JOB_STEP;
	pool->hp = hp;
	dispatch(pool);
	return 0;
}

int zk_pool_memonly(struct zk_pool *pool, enum zk_isa isa, const struct zk_tensor *tensors,
    size_t ntensors)
{
	int r;

	if (!pool)
		return -EINVAL;
	for (size_t k = 0; k < ntensors; k++) {
		r = zk_step_memonly(isa, &tensors[k], 0, 0);
		if (r < 0)
			return r;
	}
	r = set_tensors(pool, isa, tensors, ntensors);
	if (r < 0)
		return r;
	pool->job = JOB_MEMONLY;
	dispatch(pool);
	return 0;
}

int zk_pool_grad_check(struct zk_pool *pool, enum zk_isa isa, const struct zk_tensor *tensors,
    size_t ntensors, double grad_scale, struct zk_grad_stats *stats)
{
	struct zk_grad_stats sum = { 0 };
	size_t nchunks = 0;
	float dummy = 0;
	int r = 0;

	if (!pool || !stats)
		return -EINVAL;
	for (size_t k = 0; k < ntensors; k++) {
		r = zk_grad_check(isa, tensors[k].grad, tensors[k].grad_dtype, grad_scale, 0, 0, &sum);
		if (r < 0)
			return r;
		nchunks += (tensors[k].n + ZK_GRAD_CHUNK - 1) / ZK_GRAD_CHUNK;
	}
	if (ntensors == 0)	/* still reject a bad isa or scale */
		r = zk_grad_check(isa, &dummy, ZK_DTYPE_F32, grad_scale, 0, 0, &sum);
	if (r < 0)
		return r;
	if (nchunks > pool->chunks_cap) {
		struct zk_grad_stats *c = realloc(pool->chunks, nchunks * sizeof(*c));

		if (!c)
			return -ENOMEM;
		pool->chunks = c;
		pool->chunks_cap = nchunks;
	}
	r = set_tensors(pool, isa, tensors, ntensors);
	if (r < 0)
		return r;
	pool->job = JOB_GRAD;
	pool->nchunks = nchunks;
	pool->grad_scale = grad_scale;
	dispatch(pool);
	for (size_t c = 0; c < nchunks; c++) {
		sum.sumsq += pool->chunks[c].sumsq;
		sum.nonfinite += pool->chunks[c].nonfinite;
	}
	stats->sumsq += sum.sumsq;
	stats->nonfinite += sum.nonfinite;
	return 0;
}

int zk_pool_run(struct zk_pool *pool, void (*fn)(void *arg, unsigned idx, unsigned nthreads),
    void *arg)
{
	if (!pool || !fn)
		return -EINVAL;
	pool->job = JOB_FN;
	pool->fn = fn;
	pool->fn_arg = arg;
	dispatch(pool);
	return 0;
}

static int set_qtensors(struct zk_pool *p, enum zk_isa isa, const struct zk_qtensor *tensors,
    size_t ntensors)
{
	if (!tensors && ntensors)
		return -EINVAL;
	p->isa = isa;
	p->qtensors = tensors;
	p->ntensors = ntensors;
	p->total = 0;
	for (size_t k = 0; k < ntensors; k++)
		p->total += tensors[k].n;
	return 0;
}

int zk_pool_qstep(struct zk_pool *pool, enum zk_isa isa, const struct zk_hparams *hp,
    const struct zk_qtensor *tensors, size_t ntensors)
{
	int r;

	if (!pool || !hp || (!tensors && ntensors))
		return -EINVAL;
	for (size_t k = 0; k < ntensors; k++) {
		r = zk_qstep(isa, hp, &tensors[k], 0, 0);
		if (r < 0)
			return r;
	}
	r = zk_hparams_validate(hp);
	if (r < 0)
		return r;
	/* zk_qstep on an empty range does not look at the optimizer. */
	if (hp->optim != ZK_OPTIM_ADAMW && hp->optim != ZK_OPTIM_ADAM)
		return -ENOTSUP;
	r = set_qtensors(pool, isa, tensors, ntensors);
	if (r < 0)
		return r;
	pool->job = JOB_QSTEP;
	pool->hp = hp;
	dispatch(pool);
	return 0;
}

int zk_pool_qmemonly(struct zk_pool *pool, enum zk_isa isa, const struct zk_qtensor *tensors,
    size_t ntensors)
{
	int r;

	if (!pool || (!tensors && ntensors))
		return -EINVAL;
	for (size_t k = 0; k < ntensors; k++) {
		r = zk_qstep_memonly(isa, &tensors[k], 0, 0);
		if (r < 0)
			return r;
	}
	r = set_qtensors(pool, isa, tensors, ntensors);
	if (r < 0)
		return r;
	pool->job = JOB_QMEMONLY;
	dispatch(pool);
	return 0;
}
