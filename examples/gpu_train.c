/* Example GPU training: an MLP trained with ZeRO-3 over NCCL and AdamW in zoffloadd, checked against a GPU-only AdamW. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpu_train_kernels.h"
#include "zclient_cuda.h"

/*
 * One process per GPU, forked here (a process that has touched CUDA must not
 * fork, so the parent never does).  Every rank trains two copies of the same
 * model from the same start on the same data, step for step:
 *   offload: bf16 parameter shards, AdamW in zoffloadd (libzclient_cuda's
 *            ZeRO-3 helpers: gather, reduce-scatter, handoff per layer);
 *   gpu:     the same shards and collectives, AdamW on the GPU (fp32 master,
 *            gpu_train_kernels.cu).
 * Forward and backward are bit-identical given identical parameters, so any
 * difference comes from the optimizers; the run fails when the masters or
 * the bf16 parameters differ by more than bf16 rounding, or with --exact
 * when they differ at all (the GPU AdamW does zk_step_scalar's operations in
 * its order; the CUDA stand-in's test run, tests/cuda/gpu_train.sh, holds it
 * to that).
 * --offload-params registers the shards with param_offload and hands their
 * param slots back to the daemon after each step (zc_param_release, the
 * unpin hook first); --no-check-finite drops the global inf/NaN check, so
 * each layer's shard goes to the daemon from zcc_zero3_poll as it lands, and
 * says how many did during backward.
 */

#define NCLASSES 10
#define NLAYERS 3
#define INPUT 256
#define NDATA 4096

struct opts {
	const char *socket, *job;
	int ranks, steps, hidden, batch, ndev;
	bool exact;		/* --exact: bit for bit, not within bf16 tolerance */
	bool offload_params;	/* param slots released after every step but the last */
	bool no_check_finite;	/* each layer's shard to the daemon as it lands */
};

struct layer_buf {
	int in, out;
	uint64_t numel;			/* in*out weights, then out biases */
	struct zcc_partition part;
	uint16_t *full_bf16;		/* gathered parameters, padded */
	float *full_f32;
	float *w, *b;			/* unflattened fp32 */
	float *dw, *db;
	float *gflat_f32;		/* flattened gradients, padded with zeros */
	uint16_t *gflat_bf16;
	/* gpu model only: its shard and optimizer state */
	float *master, *m, *v;
	uint16_t *param_shard, *grad_shard;
	struct zcc_flat *flat;		/* offload model only */
};

struct model {
	bool offload;
	struct layer_buf l[NLAYERS];
};

struct rank_ctx {
	const struct opts *o;
	int rank, world;
	unsigned early;			/* shards handed over during backward, all steps */
	cudaStream_t s;
	ncclComm_t comm;
	struct zc_conn *conn;
	struct zcc_zero3 *z;
	float *data, *act[NLAYERS + 1], *dact[NLAYERS + 1], *loss;
	int *labels;
	struct zcc_grad_stats *stats;
};

#define CK(call) do {							\
	cudaError_t e_ = (call);					\
	if (e_ != cudaSuccess) {					\
		fprintf(stderr, "rank %d: %s:%d: %s: %s\n", rank_id, __FILE__, __LINE__, \
		    #call, cudaGetErrorString(e_));			\
		exit(1);						\
	}								\
} while (0)

#define ZK(call) do {							\
	int r_ = (call);						\
	if (r_ < 0) {							\
		fprintf(stderr, "rank %d: %s:%d: %s: %s\n", rank_id, __FILE__, __LINE__, \
		    #call, zcc_errmsg());				\
		exit(1);						\
	}								\
} while (0)

static int rank_id = -1;

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static float
uniform(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (float)((rng >> 40) * (1.0 / 16777216.0));
}

static float
normal(void)
{
	float u1 = uniform() + 1e-7f, u2 = uniform();

	return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

/*
 * Zeroed on the rank's stream.  Never cudaMemset or cudaMemcpy here: they go
 * to the legacy default stream, which a cudaStreamNonBlocking stream is not
 * ordered with, so the kernels on x->s could see the buffers before they are
 * zeroed or filled.  All of this rank's device work is on x->s.
 */
static void *
dmalloc(struct rank_ctx *x, size_t bytes)
{
	void *p = NULL;

	CK(cudaMalloc(&p, bytes));
	CK(cudaMemsetAsync(p, 0, bytes, x->s));
	return p;
}

/* Host to device on the rank's stream; the host buffer may be freed on return. */
static void
upload(struct rank_ctx *x, void *dev, const void *host, size_t bytes)
{
	CK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, x->s));
	CK(cudaStreamSynchronize(x->s));
}

/* Device to host on the rank's stream, after everything queued there. */
static void
download(struct rank_ctx *x, void *host, const void *dev, size_t bytes)
{
	CK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, x->s));
	CK(cudaStreamSynchronize(x->s));
}

static double
now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* As zk_consts_init: double arithmetic, rounded to float once. */
static void
adamw_consts(const struct zc_step_params *p, struct gt_adamw *c)
{
	double bc1 = 1.0 - pow(p->beta1, (double)p->step);
	double bc2 = 1.0 - pow(p->beta2, (double)p->step);
	float w = (float)(1.0 - p->beta1);

	*c = (struct gt_adamw){
		.inv_scale = (float)(1.0 / (p->grad_scale > 0 ? p->grad_scale : 1.0)),
		.clip = 1.0f,
		.decay = (float)(1.0 - p->lr * p->weight_decay),
		.lerp_w = w,
		.lerp_small = fabsf(w) < 0.5f,
		.lerp_omw = 1.0f - w,
		.beta2 = (float)p->beta2,
		.omb2 = (float)(1.0 - p->beta2),
		.bc2_sqrt = (float)sqrt(bc2),
		.eps = (float)p->eps,
		.neg_step = (float)-(p->lr / bc1),
	};
}

/* Both models start from these values: He-initialised weights, zero biases. */
static float **
initial_values(const int *dims)
{
	float **init = calloc(NLAYERS, sizeof(*init));

	rng = 0x9e3779b97f4a7c15ull;
	for (int i = 0; i < NLAYERS; i++) {
		size_t nw = (size_t)dims[i] * dims[i + 1];
		float scale = sqrtf(2.0f / (float)dims[i]);

		init[i] = calloc(nw + (size_t)dims[i + 1], sizeof(float));
		for (size_t k = 0; k < nw; k++)
			init[i][k] = normal() * scale;
	}
	return init;
}

static void
model_init(struct rank_ctx *x, struct model *m, bool offload, const int *dims, float **init)
{
	m->offload = offload;
	for (int i = 0; i < NLAYERS; i++) {
		struct layer_buf *l = &m->l[i];
		char name[32];

		l->in = dims[i];
		l->out = dims[i + 1];
		l->numel = (uint64_t)l->in * l->out + (uint64_t)l->out;
		if (offload) {
			snprintf(name, sizeof(name), "layer%d", i);
			ZK(zcc_flat_create(x->z, name, l->numel, ZC_BF16, init[i], &l->flat));
			l->part = *zcc_flat_partition(l->flat);
		} else {
			/* The same split as the offload model's, so shards compare one to one. */
			ZK(zcc_partition(l->numel, (uint32_t)x->world, (uint32_t)x->rank, 128,
			    &l->part));
			float *shard = calloc(l->part.shard_numel, sizeof(float));

			memcpy(shard, init[i] + l->part.offset, l->part.valid * sizeof(float));
			l->master = dmalloc(x, l->part.shard_numel * 4);
			l->m = dmalloc(x, l->part.shard_numel * 4);
			l->v = dmalloc(x, l->part.shard_numel * 4);
			l->param_shard = dmalloc(x, l->part.shard_numel * 2);
			l->grad_shard = dmalloc(x, l->part.shard_numel * 2);
			upload(x, l->master, shard, l->part.shard_numel * 4);
			ZK(zcc_cast(l->master, ZC_F32, l->param_shard, ZC_BF16, l->part.shard_numel,
			    x->s));
			free(shard);
		}
		l->full_bf16 = dmalloc(x, l->part.padded_numel * 2);
		l->full_f32 = dmalloc(x, l->part.padded_numel * 4);
		l->w = dmalloc(x, (size_t)l->in * l->out * 4);
		l->b = dmalloc(x, (size_t)l->out * 4);
		l->dw = dmalloc(x, (size_t)l->in * l->out * 4);
		l->db = dmalloc(x, (size_t)l->out * 4);
		l->gflat_f32 = dmalloc(x, l->part.padded_numel * 4);
		l->gflat_bf16 = dmalloc(x, l->part.padded_numel * 2);
	}
}

static void
gather_layer(struct rank_ctx *x, struct model *m, int i)
{
	struct layer_buf *l = &m->l[i];
	void *parts[2] = { l->w, l->b };
	uint64_t counts[2] = { (uint64_t)l->in * l->out, (uint64_t)l->out };

	if (m->offload) {
		ZK(zcc_flat_gather(l->flat, l->full_bf16, x->s));
	} else if (ncclAllGather(l->param_shard, l->full_bf16, l->part.shard_numel, ncclBfloat16,
	    x->comm, x->s) != ncclSuccess) {
		fprintf(stderr, "rank %d: ncclAllGather failed\n", x->rank);
		exit(1);
	}
	/* Compute in fp32 from the bf16 parameters, the usual mixed-precision arrangement. */
	ZK(zcc_cast(l->full_bf16, ZC_BF16, l->full_f32, ZC_F32, l->numel, x->s));
	ZK(zcc_unflatten(l->full_f32, parts, counts, 2, 4, x->s));
}

/* Hands layer i's gradients on: to the daemon (offload) or to the GPU AdamW (gpu). */
static void
reduce_layer(struct rank_ctx *x, struct model *m, int i, const struct gt_adamw *c)
{
	struct layer_buf *l = &m->l[i];
	const void *parts[2] = { l->dw, l->db };
	uint64_t counts[2] = { (uint64_t)l->in * l->out, (uint64_t)l->out };

	ZK(zcc_flatten(l->gflat_f32, parts, counts, 2, 4, x->s));
	ZK(zcc_cast(l->gflat_f32, ZC_F32, l->gflat_bf16, ZC_BF16, l->part.padded_numel, x->s));
	if (m->offload) {
		ZK(zcc_flat_reduce_scatter(l->flat, l->gflat_bf16, x->s));
		return;
	}
	if (ncclReduceScatter(l->gflat_bf16, l->grad_shard, l->part.shard_numel, ncclBfloat16,
	    ncclAvg, x->comm, x->s) != ncclSuccess) {
		fprintf(stderr, "rank %d: ncclReduceScatter failed\n", x->rank);
		exit(1);
	}
	CK(gt_adamw_step(l->master, l->m, l->v, l->grad_shard, l->param_shard,
	    l->part.shard_numel, c, x->s));
}

/* One training step of one model; returns rank-local mean loss. */
static double
train_step(struct rank_ctx *x, struct model *m, const struct zc_step_params *sp, int start,
    bool want_norm, double *ret_norm)
{
	int b = x->o->batch;
	struct gt_adamw c;
	float loss[4096];
	double sum = 0;

	adamw_consts(sp, &c);
	if (m->offload)
		ZK(zcc_zero3_begin_step(x->z, sp));
	for (int i = 0; i < NLAYERS; i++)
		gather_layer(x, m, i);
	/* Rank r takes its own slice of the global batch. */
	x->act[0] = x->data + (size_t)(start + x->rank * b) * INPUT;
	for (int i = 0; i < NLAYERS; i++)
		CK(gt_linear_forward(x->act[i], m->l[i].w, m->l[i].b, x->act[i + 1], b,
		    m->l[i].in, m->l[i].out, i < NLAYERS - 1, x->s));
	CK(gt_softmax_xent(x->act[NLAYERS], x->labels + start + x->rank * b, x->loss,
	    x->dact[NLAYERS], b, NCLASSES, x->s));
	/* Backward, last layer first; each layer's gradients leave as soon as they exist. */
	for (int i = NLAYERS - 1; i >= 0; i--) {
		struct layer_buf *l = &m->l[i];

		CK(gt_linear_backward_params(x->act[i], x->dact[i + 1], l->dw, l->db, b, l->in,
		    l->out, x->s));
		if (i > 0)
			CK(gt_linear_backward_input(x->dact[i + 1], l->w, x->act[i], x->dact[i], b,
			    l->in, l->out, x->s));
		reduce_layer(x, m, i, &c);
	}
	if (m->offload) {
		struct zcc_step_summary sum_step;

		x->early += zcc_zero3_submitted(x->z);
		ZK(zcc_zero3_end_step(x->z, x->s, &sum_step));
		if (sum_step.skipped > 0)
			printf("rank %d: step %llu: %u layers skipped (inf/NaN)\n", x->rank,
			    (unsigned long long)sp->step, sum_step.skipped);
	}
	if (want_norm) {
		/* The rank-local gradient norm, with the multi-tensor kernel. */
		void *g[NLAYERS];
		uint64_t n[NLAYERS];
		struct zcc_grad_stats st;

		for (int i = 0; i < NLAYERS; i++) {
			g[i] = m->l[i].gflat_bf16;
			n[i] = m->l[i].numel;
		}
		CK(cudaMemsetAsync(x->stats, 0, sizeof(*x->stats), x->s));
		ZK(zcc_unscale_norm(g, n, NLAYERS, ZC_BF16, 1.0f, false, x->stats, x->s));
		CK(cudaMemcpyAsync(&st, x->stats, sizeof(st), cudaMemcpyDeviceToHost, x->s));
		CK(cudaStreamSynchronize(x->s));
		*ret_norm = sqrt(st.sumsq);
	}
	CK(cudaMemcpyAsync(loss, x->loss, sizeof(float) * (size_t)b, cudaMemcpyDeviceToHost,
	    x->s));
	CK(cudaStreamSynchronize(x->s));
	for (int i = 0; i < b; i++)
		sum += loss[i];
	return sum / b;
}

static void
release_params(struct rank_ctx *x, struct model *m)
{
	struct zc_tensor *ts[NLAYERS];

	for (int i = 0; i < NLAYERS; i++)
		ts[i] = zcc_flat_tensor(m->l[i].flat);
	if (zc_param_release(x->conn, ts, NLAYERS) < 0) {
		fprintf(stderr, "rank %d: zc_param_release: %s\n", x->rank, zc_errmsg(x->conn));
		exit(1);
	}
}

/* After the releases: every param slot pageable (unpinned before its first release). */
static void
print_param_stats(struct rank_ctx *x, struct model *m)
{
	int pinned = 0;

	for (int i = 0; i < NLAYERS; i++)
		pinned += zcc_slots_param_pinned(zcc_flat_slots(m->l[i].flat));
	printf("rank %d: param slots released %d times each, %d of %d still pinned\n", x->rank,
	    x->o->steps - 1, pinned, NLAYERS);
}

/* Compares this rank's shards of the two models; returns the number of layers that disagree. */
static int
compare(struct rank_ctx *x, struct model *a, struct model *g)
{
	int bad_layers = 0;

	for (int i = 0; i < NLAYERS; i++) {
		struct layer_buf *la = &a->l[i], *lg = &g->l[i];
		uint64_t n = la->part.valid, bad = 0, differ = 0;
		float *ma = malloc(n * 4 + 4), *mg = malloc(n * 4 + 4);
		uint16_t *pa = malloc(n * 2 + 2), *pg = malloc(n * 2 + 2);
		double maxdiff = 0;

		if (n > 0) {
			ZK(zc_tensor_read(zcc_flat_tensor(la->flat), ZC_STATE_MASTER, 0, n, ma));
			download(x, mg, lg->master, n * 4);
			download(x, pa, zcc_flat_param_shard(la->flat), n * 2);
			download(x, pg, lg->param_shard, n * 2);
		}
		for (uint64_t k = 0; k < n; k++) {
			double d = fabs((double)ma[k] - (double)mg[k]);
			float fa = zc_bf16_to_f32(pa[k]), fg = zc_bf16_to_f32(pg[k]);

			maxdiff = d > maxdiff ? d : maxdiff;
			differ += pa[k] != pg[k];
			/* Same operations in the same order on both sides: nothing may differ. */
			if (x->o->exact && (memcmp(&ma[k], &mg[k], 4) != 0 || pa[k] != pg[k])) {
				bad++;
				continue;
			}
			/* bf16 tolerance: one bf16 step (2^-7 relative) plus a floor near zero. */
			if (d > 0x1p-7 * fabs((double)mg[k]) + 1e-6 ||
			    fabsf(fa - fg) > 0x1p-7f * fabsf(fg) + 1e-6f || isnan(ma[k]))
				bad++;
		}
		printf("rank %d layer %d: %llu elements, master max |diff| %.3g, bf16 params "
		    "differing %llu, outside %s %llu\n", x->rank, i,
		    (unsigned long long)n, maxdiff, (unsigned long long)differ,
		    x->o->exact ? "bit-exact" : "bf16 tolerance", (unsigned long long)bad);
		bad_layers += bad > 0;
		free(ma);
		free(mg);
		free(pa);
		free(pg);
	}
	return bad_layers;
}

static int
rank_main(const struct opts *o, int rank, int id_fd[2])
{
	struct rank_ctx x = { .o = o, .rank = rank, .world = o->ranks };
	struct zc_step_params sp = {
		.optim = ZC_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
		.weight_decay = 0.01, .check_finite = !o->no_check_finite,
		/* No clipping: the daemon would clip per layer, the GPU AdamW has none. */
		.max_grad_norm = 0,
	};
	int dims[NLAYERS + 1] = { INPUT, o->hidden, o->hidden, NCLASSES };
	struct model ma, mg;
	ncclUniqueId id;
	float **init, *data;
	int *labels, r, bad;
	double t_off = 0, t_gpu = 0;

	rank_id = rank;
	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Rank 0 makes the NCCL id and passes one copy per peer down the pipe. */
	if (rank == 0) {
		if (ncclGetUniqueId(&id) != ncclSuccess) {
			fprintf(stderr, "rank 0: ncclGetUniqueId failed\n");
			return 1;
		}
		for (int i = 1; i < o->ranks; i++)
			if (write(id_fd[1], &id, sizeof(id)) != (ssize_t)sizeof(id))
				return 1;
	} else {
		size_t got = 0;

		while (got < sizeof(id)) {
			ssize_t n = read(id_fd[0], (char *)&id + got, sizeof(id) - got);

			if (n <= 0)
				return 1;
			got += (size_t)n;
		}
	}
	close(id_fd[0]);
	close(id_fd[1]);
	CK(cudaSetDevice(rank % o->ndev));
	CK(cudaStreamCreateWithFlags(&x.s, cudaStreamNonBlocking));
	if (ncclCommInitRank(&x.comm, o->ranks, id, rank) != ncclSuccess) {
		fprintf(stderr, "rank %d: ncclCommInitRank failed\n", rank);
		return 1;
	}
	r = zc_connect(o->socket, &x.conn);
	if (r < 0) {
		fprintf(stderr, "rank %d: %s\n", rank, zc_connect_errmsg());
		return 1;
	}
	if (zc_job_open(x.conn, o->job, (uint32_t)rank, (uint32_t)o->ranks) < 0) {
		fprintf(stderr, "rank %d: %s\n", rank, zc_errmsg(x.conn));
		return 1;
	}
	ZK(zcc_zero3_create(x.conn, x.comm, &x.z));
	ZK(zcc_zero3_set_param_offload(x.z, o->offload_params));

	/* Same data on every rank (same seed); labels from a random linear teacher. */
	data = malloc(sizeof(float) * NDATA * INPUT);
	labels = malloc(sizeof(int) * NDATA);
	float *teacher = malloc(sizeof(float) * INPUT * NCLASSES);
	init = initial_values(dims);
	for (int i = 0; i < INPUT * NCLASSES; i++)
		teacher[i] = normal();
	for (int n = 0; n < NDATA; n++) {
		float best = -INFINITY;

		for (int k = 0; k < INPUT; k++)
			data[(size_t)n * INPUT + k] = normal();
		for (int j = 0; j < NCLASSES; j++) {
			float s = 0;

			for (int k = 0; k < INPUT; k++)
				s += data[(size_t)n * INPUT + k] * teacher[k * NCLASSES + j];
			if (s > best) {
				best = s;
				labels[n] = j;
			}
		}
	}
	x.data = dmalloc(&x, sizeof(float) * NDATA * INPUT);
	x.labels = dmalloc(&x, sizeof(int) * NDATA);
	upload(&x, x.data, data, sizeof(float) * NDATA * INPUT);
	upload(&x, x.labels, labels, sizeof(int) * NDATA);
	for (int i = 1; i <= NLAYERS; i++) {
		x.act[i] = dmalloc(&x, sizeof(float) * (size_t)o->batch * dims[i]);
		x.dact[i] = dmalloc(&x, sizeof(float) * (size_t)o->batch * dims[i]);
	}
	x.dact[0] = NULL;
	x.loss = dmalloc(&x, sizeof(float) * (size_t)o->batch);
	x.stats = dmalloc(&x, sizeof(*x.stats));
	model_init(&x, &ma, true, dims, init);
	model_init(&x, &mg, false, dims, init);
	CK(cudaStreamSynchronize(x.s));
	if (rank == 0)
		printf("gpu_train: %d-%d-%d-%d MLP, %d rank(s), batch %d per rank, ZeRO-3 bf16 "
		    "shards; AdamW in zoffloadd vs on the GPU, %d steps\n", dims[0], dims[1],
		    dims[2], dims[3], o->ranks, o->batch, o->steps);

	for (int step = 1; step <= o->steps; step++) {
		int global = o->batch * o->ranks;
		int start = ((step - 1) * global) % (NDATA - global + 1);
		bool show = rank == 0 && (step == 1 || step % 10 == 0 || step == o->steps);
		double la, lg, norm = 0, t0;

		sp.step = (uint64_t)step;
		t0 = now_s();
		la = train_step(&x, &ma, &sp, start, show, &norm);
		/*
		 * The param slots go back to the daemon once the new shards are on
		 * the GPU (the unpin waits for that copy); the next step refills them.
		 * Not after the last: compare() reads the master through them.
		 */
		if (o->offload_params && step < o->steps)
			release_params(&x, &ma);
		t_off += now_s() - t0;
		t0 = now_s();
		lg = train_step(&x, &mg, &sp, start, false, NULL);
		t_gpu += now_s() - t0;
		if (show)
			printf("step %4d  loss offload %.5f  gpu %.5f  local grad norm %.4f\n", step,
			    la, lg, norm);
	}
	if (rank == 0)
		printf("gpu_train: %.2f ms/step with AdamW in zoffloadd, %.2f ms/step on the GPU "
		    "(naive kernels: the comparison, not the speed, is the point)\n",
		    1e3 * t_off / o->steps, 1e3 * t_gpu / o->steps);
	if (o->no_check_finite)
		printf("rank %d: %u of %d layer shards handed to zoffloadd during backward\n", rank,
		    x.early, NLAYERS * o->steps);
	if (o->offload_params)
		print_param_stats(&x, &ma);
	bad = compare(&x, &ma, &mg);
	if (o->exact)
		printf("rank %d: %s\n", rank, bad ? "DISAGREE: zoffloadd's AdamW and the GPU AdamW "
		    "differ (--exact)" : "agree bit for bit");
	else
		printf("rank %d: %s\n", rank, bad ? "DISAGREE: zoffloadd's AdamW and the GPU AdamW "
		    "differ beyond bf16 tolerance" : "agree within bf16 tolerance");
	/* Objects here go with the process; the daemon's tensors go with the connection. */
	zcc_zero3_destroy(x.z);
	zc_disconnect(x.conn);
	ncclCommDestroy(x.comm);
	free(data);
	free(labels);
	free(teacher);
	for (int i = 0; i < NLAYERS; i++)
		free(init[i]);
	free(init);
	return bad ? 1 : 0;
}

/* Counted in a child: the parent forks the ranks and must not have touched CUDA. */
static int
gpu_count(void)
{
	int status, n = 0;
	pid_t pid;

	fflush(NULL);
	pid = fork();
	if (pid == 0) {
		if (cudaGetDeviceCount(&n) != cudaSuccess)
			n = 0;
		_exit(n > 100 ? 100 : n);
	}
	if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
		return 0;
	return WEXITSTATUS(status);
}

int
main(int argc, char **argv)
{
	static const struct option lopts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "ranks", required_argument, NULL, 'r' },
		{ "steps", required_argument, NULL, 'n' },
		{ "hidden", required_argument, NULL, 'H' },
		{ "batch", required_argument, NULL, 'b' },
		{ "job", required_argument, NULL, 'j' },
		{ "exact", no_argument, NULL, 'e' },
		{ "offload-params", no_argument, NULL, 'p' },
		{ "no-check-finite", no_argument, NULL, 'f' },
		{ NULL, 0, NULL, 0 },
	};
	struct opts o = { .job = "gpu-example", .steps = 50, .hidden = 512, .batch = 32 };
	int opt, id_fd[2], failed = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	while ((opt = getopt_long(argc, argv, "s:r:n:H:b:j:", lopts, NULL)) != -1) {
		switch (opt) {
		case 's': o.socket = optarg; break;
		case 'r': o.ranks = atoi(optarg); break;
		case 'n': o.steps = atoi(optarg); break;
		case 'H': o.hidden = atoi(optarg); break;
		case 'b': o.batch = atoi(optarg); break;
		case 'j': o.job = optarg; break;
		case 'e': o.exact = true; break;
		case 'p': o.offload_params = true; break;
		case 'f': o.no_check_finite = true; break;
		default:
			fprintf(stderr, "usage: gpu_train [--socket PATH] [--ranks N (default: every "
			    "GPU)] [--steps N] [--hidden N] [--batch N] [--job NAME] [--exact] "
			    "[--offload-params] [--no-check-finite]\n");
			return 2;
		}
	}
	o.ndev = gpu_count();
	if (o.ndev == 0) {
		fprintf(stderr, "gpu_train: no usable CUDA device\n");
		return 77;
	}
	if (o.ranks == 0)
		o.ranks = o.ndev;
	/* NCCL refuses two ranks on one GPU. */
	if (o.ranks < 1 || o.ranks > o.ndev || o.steps < 1 || o.hidden < 16 || o.batch < 1 ||
	    o.batch > 4096 || o.ranks > 128 || o.batch * o.ranks > NDATA) {
		fprintf(stderr, "gpu_train: need 1 <= --ranks <= %d GPUs, --steps >= 1, "
		    "--hidden >= 16, 1 <= --batch, batch * ranks <= %d\n", o.ndev, NDATA);
		return 2;
	}
	if (pipe(id_fd) != 0) {
		perror("gpu_train: pipe");
		return 1;
	}
	pid_t pids[128];

	for (int r = 0; r < o.ranks && r < 128; r++) {
		pids[r] = fork();
		if (pids[r] < 0) {
			perror("gpu_train: fork");
			return 1;
		}
		if (pids[r] == 0)
			_exit(rank_main(&o, r, id_fd));
	}
	close(id_fd[0]);
	close(id_fd[1]);
	for (int left = o.ranks; left > 0; left--) {
		int status;

		if (wait(&status) < 0)
			break;
		if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
			continue;
		/* The others would wait in NCCL for the dead rank forever. */
		if (failed++ == 0)
			for (int r = 0; r < o.ranks; r++)
				(void)kill(pids[r], SIGTERM);
	}
	if (failed)
		fprintf(stderr, "gpu_train: %d of %d ranks failed\n", failed, o.ranks);
	return failed ? 1 : 0;
}
