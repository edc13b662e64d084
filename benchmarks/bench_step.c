/* One offloaded step over state 4x the pinned budget, beside its I/O bound (the swap engine) and compute bound (the kernels), measured in the same run. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>
#include <unistd.h>

#include "arena.h"
#include "bench_common.h"
#include "bench_daemon.h"
#include "optim.h"
#include "pool.h"
#include "quant.h"
#include "swap.h"
#include "zclient.h"

#define MiB (1024.0 * 1024.0)

struct opts {
	const char *daemon;		/* zoffloadd; $ZOFFLOADD by default */
	const char *dir;		/* swap and scratch; $TMPDIR or /tmp */
	uint64_t pinned_budget;
	uint64_t state_bytes;		/* master + m + v over all tensors */
	unsigned tensors;
	unsigned steps;			/* timed, after one warm-up */
	unsigned threads;		/* daemon workers and the compute bound's pool */
	unsigned staging;
	uint64_t chunk_elements;
	unsigned queue_depth;
	uint64_t block_size;
	bool json;
	/*
	 * --formats: state formats to step one after the other, every tensor on NVMe
	 * (policy nvme), fp32 first as the reference; NULL: fp32 as the job's policy auto
	 * places it, the default run.
	 */
	const char *formats;
	bool pinned_tier;		/* --pinned-tier: --formats with every tensor pinned instead */
	bool no_journal;		/* --no-journal: recovery.journal false (the default is on) */
	/*
	 * --fp32: fp32 grads and params, not bf16.  An fp32 master's param slot is then
	 * the master (docs/tiers.md): the daemon's step and its compute bound write no
	 * param copy, and with --pinned-tier fp32/step_vs_kernel_with_copy compares the
	 * step with the kernel writing one (what the step cost when the slot was a copy).
	 */
	bool fp32;
};

/* What the daemon run measured. */
struct step_run {
	double best_s;
	double mean_s;
	/*
	 * The state the tensors placed on NVMe keep there: zk_state_bytes (fp32: 12/param),
	 * less the master where their slot is it (--fp32 and an fp32 master: 8/param; bf16
	 * params and bf16-master+q8).
	 */
	double nvme_state_bytes;
	double nvme_placed_bytes;	/* their swap space, chunk rounding included */
	double pinned_state_bytes;
	double read_per_step;		/* pipeline counters over the timed steps */
	double written_per_step;
	double compute_wait_ms;		/* per step: compute idle, waiting for reads */
	double io_wait_ms;		/* per step: chunks waiting for a free staging buffer */
	/* Per step, summed over staging buffers: held by a read, a compute, a write (engine.h). */
	double staging_read_ms;
	double staging_compute_ms;
	double staging_write_ms;
	char engine[32];
	char isa[16];
};

static void
die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

static void
die(const char *fmt, ...)
{
	va_list ap;

	fputs("bench_step: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(1);
}

/* Sizes as "256M", "1G" or bytes. */
static uint64_t
parse_size(const char *s)
{
	char *end;
	uint64_t v = strtoull(s, &end, 0);

	switch (*end) {
	case 'k': case 'K': return v << 10;
	case 'm': case 'M': return v << 20;
	case 'g': case 'G': return v << 30;
	default: return v;
	}
}

static void
usage(void)
{
	fprintf(stderr,
	    "usage: bench_step [--daemon PATH] [--dir DIR] [--pinned-budget SIZE] [--state SIZE]\n"
	    "                  [--tensors N] [--steps N] [--threads N] [--staging N]\n"
	    "                  [--chunk-elements N] [--queue-depth N] [--block-size SIZE] [--json]\n"
	    "                  [--formats fp32,bf16-moments,q8-moments,bf16-master+q8 [--pinned-tier]]\n"
	    "                  [--no-journal] [--fp32]\n");
}

static int
parse(int argc, char **argv, struct opts *o)
{
	static const struct option longopts[] = {
		{ "daemon", required_argument, NULL, 'd' },
		{ "dir", required_argument, NULL, 'D' },
		{ "pinned-budget", required_argument, NULL, 'p' },
		{ "state", required_argument, NULL, 's' },
		{ "tensors", required_argument, NULL, 't' },
		{ "steps", required_argument, NULL, 'n' },
		{ "threads", required_argument, NULL, 'T' },
		{ "staging", required_argument, NULL, 'b' },
		{ "chunk-elements", required_argument, NULL, 'c' },
		{ "queue-depth", required_argument, NULL, 'q' },
		{ "block-size", required_argument, NULL, 'B' },
		{ "json", no_argument, NULL, 'j' },
		{ "formats", required_argument, NULL, 'f' },
		{ "pinned-tier", no_argument, NULL, 'P' },
		{ "no-journal", no_argument, NULL, 'J' },
		{ "fp32", no_argument, NULL, 'F' },
		{ NULL, 0, NULL, 0 },
	};
	int ch;

	while ((ch = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		switch (ch) {
		case 'd': o->daemon = optarg; break;
		case 'D': o->dir = optarg; break;
		case 'p': o->pinned_budget = parse_size(optarg); break;
		case 's': o->state_bytes = parse_size(optarg); break;
		case 't': o->tensors = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'n': o->steps = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'T': o->threads = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'b': o->staging = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'c': o->chunk_elements = parse_size(optarg); break;
		case 'q': o->queue_depth = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'B': o->block_size = parse_size(optarg); break;
		case 'j': o->json = true; break;
		case 'f': o->formats = optarg; break;
		case 'P': o->pinned_tier = true; break;
		case 'J': o->no_journal = true; break;
		case 'F': o->fp32 = true; break;
		default: return -1;
		}
	}
	if (o->tensors == 0 || o->steps == 0 || o->threads == 0 || o->staging < 2 ||
	    o->chunk_elements == 0 || o->chunk_elements % 1024 != 0 || o->queue_depth == 0 ||
	    o->state_bytes < 12ull * o->tensors || o->pinned_budget < (1 << 20) ||
	    o->block_size == 0 || (o->block_size & (o->block_size - 1)) != 0)
		return -1;
	return 0;
}

/* Elements of tensor k: the state split evenly, the remainder on the last. */
static uint64_t
tensor_numel(const struct opts *o, unsigned k)
{
	uint64_t total = o->state_bytes / 12, each = total / o->tensors;

	return k + 1 < o->tensors ? each : total - each * (o->tensors - 1);
}

static double
stat_number(struct zc_conn *c, const char *path)
{
	double v = 0;
	int r = bench_stat_number(c, path, &v);

	if (r < 0)
		die("stats at %s: %s", path, r == -ENOENT ? "no number there" : zc_errmsg(c));
	return v;
}

static void
daemon_start(struct bench_daemon *dp, const struct opts *o)
{
	FILE *f;
	int r;

	r = bench_daemon_prepare(dp, o->dir, "zoff-bench-step");
	if (r < 0)
		die("temporary directory in %s: %s", o->dir, strerror(-r));
	f = fopen(dp->config, "w");
	if (f == NULL)
		die("%s: %s", dp->config, strerror(errno));
	/* Swap twice the state, so placement never fails on rounding. */
	fprintf(f, "{ \"compute\": { \"worker_threads\": %u }, \"log\": { \"level\": \"info\" },\n"
	    "  \"recovery\": { \"journal\": %s },\n"
	    "  \"memory\": { \"pinned_budget\": %" PRIu64 ", \"policy\": \"auto\" },\n"
	    "  \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": %" PRIu64 " } ],\n"
	    "    \"chunk_elements\": %" PRIu64 ", \"staging_buffers\": %u, \"queue_depth\": %u,\n"
	    "    \"block_size\": %" PRIu64 " } }\n", o->threads, o->no_journal ? "false" : "true",
	    /* --pinned-tier: room for all of it, with the arrays' padding. */
	    o->pinned_tier ? 2 * o->state_bytes + (64u << 20) : o->pinned_budget, dp->dir,
	    2 * o->state_bytes + (64u << 20), o->chunk_elements, o->staging, o->queue_depth,
	    o->block_size);
	fclose(f);
	/* Preallocating the swap file takes a moment on a big state. */
	r = bench_daemon_start(dp, o->daemon, NULL, 60);
	if (r == -ECHILD)
		die("zoffloadd exited at start; see %s", dp->log);
	if (r == -ETIMEDOUT)
		die("zoffloadd did not listen within 60 s; see %s", dp->log);
	if (r < 0)
		die("starting zoffloadd: %s", strerror(-r));
}

static void
daemon_stop(struct bench_daemon *dp)
{
	int status = bench_daemon_stop(dp);

	if (status != 0)
		fprintf(stderr, "bench_step: zoffloadd exited with status 0x%x; see %s\n", status,
		    dp->log);
}

/* Small gradients of both signs, the same every step: timing does not depend on the values. */
static void
fill_grads(struct zc_tensor *t, uint64_t n, unsigned k, bool fp32)
{
	void *g = zc_tensor_grad_slot(t, NULL);
	uint64_t x = 0x9e3779b97f4a7c15ull * (k + 1);

	for (uint64_t i = 0; i < n; i++) {
		float f;

		x ^= x >> 12;
		x ^= x << 25;
		x ^= x >> 27;
		f = (float)((double)(x >> 40) / (double)(1 << 24) - 0.5) * 1e-2f;
		if (fp32)
			((float *)g)[i] = f;
		else
			((uint16_t *)g)[i] = zc_f32_to_bf16(f);
	}
}

static void
run_daemon(const struct opts *o, enum zk_state_format format, struct step_run *res)
{
	struct zc_job_options jo = { .policy = o->pinned_tier ? ZC_POLICY_CPU :
		o->formats != NULL ? ZC_POLICY_NVME : ZC_POLICY_DEFAULT,
		.state_format = zk_state_format_name(format) };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .lr = 1e-4, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 };
	struct zc_tensor **t = calloc(o->tensors, sizeof(*t));
	double r0 = 0, w0 = 0, cw0 = 0, iw0 = 0, sr0 = 0, sc0 = 0, sw0 = 0, sum = 0;
	struct bench_daemon dp;
	struct zc_conn *c;
	float *init;
	uint64_t maxn = tensor_numel(o, o->tensors - 1);

	init = calloc(maxn, sizeof(float));
	if (t == NULL || init == NULL)
		die("out of memory");
	daemon_start(&dp, o);
	if (zc_connect(dp.socket, &c) < 0 || zc_job_open_opts(c, "bench_step", 0, 1, &jo) < 0)
		die("job: %s", zc_errmsg(c));
	for (unsigned k = 0; k < o->tensors; k++) {
		char name[32];
		struct zc_tensor_desc desc = { .name = name, .numel = tensor_numel(o, k),
			.grad_dtype = o->fp32 ? ZC_F32 : ZC_BF16,
			.param_dtype = o->fp32 ? ZC_F32 : ZC_BF16 };

		for (uint64_t i = 0; i < desc.numel; i++)
			init[i] = (float)((int)(i % 2001) - 1000) * 1e-3f;
		snprintf(name, sizeof(name), "layer%u.weight", k);
		if (zc_tensor_register(c, &desc, init, &t[k]) < 0)
			die("register %s: %s", name, zc_errmsg(c));
		fill_grads(t[k], desc.numel, k, o->fp32);
		/* Its placement: did the job's NVMe bytes grow? */
		if (stat_number(c, "jobs.0.nvme_bytes") > res->nvme_placed_bytes) {
			res->nvme_placed_bytes = stat_number(c, "jobs.0.nvme_bytes");
			res->nvme_state_bytes += (double)zk_state_bytes(format, desc.numel);
			/* The slot is the master where its dtype is the master's (docs/tiers.md). */
			if (zk_state_master_bytes(format, 1) == (o->fp32 ? 4u : 2u))
				res->nvme_state_bytes -= (double)zk_state_master_bytes(format,
				    desc.numel);
		}
	}
	free(init);
	res->pinned_state_bytes = stat_number(c, "jobs.0.pinned_bytes");
	bench_stat_string(c, "tiers.nvme.engine", res->engine, sizeof(res->engine));
	bench_stat_string(c, "kernel_isa", res->isa, sizeof(res->isa));
	res->best_s = 1e30;
	for (unsigned i = 0; i <= o->steps; i++) {
		double t0, dt;

		if (i == 1) {
			/* Counters from after the warm-up step. */
			r0 = stat_number(c, "pipeline.bytes_read");
			w0 = stat_number(c, "pipeline.bytes_written");
			cw0 = stat_number(c, "pipeline.compute_waiting_on_io_ms");
			iw0 = stat_number(c, "pipeline.io_waiting_on_compute_ms");
			sr0 = stat_number(c, "pipeline.staging_reading_ms");
			sc0 = stat_number(c, "pipeline.staging_computing_ms");
			sw0 = stat_number(c, "pipeline.staging_writing_ms");
		}
		sp.step = i + 1;
		t0 = bench_now();
		if (zc_step_submit(c, &sp, t, o->tensors) < 0 || zc_wait_all(c, NULL) < 0)
			die("step %u: %s", i + 1, zc_errmsg(c));
		dt = bench_now() - t0;
		if (i == 0)
			continue;
		sum += dt;
		if (dt < res->best_s)
			res->best_s = dt;
	}
	res->mean_s = sum / o->steps;
	res->read_per_step = (stat_number(c, "pipeline.bytes_read") - r0) / o->steps;
	res->written_per_step = (stat_number(c, "pipeline.bytes_written") - w0) / o->steps;
	res->compute_wait_ms = (stat_number(c, "pipeline.compute_waiting_on_io_ms") - cw0) /
	    o->steps;
	res->io_wait_ms = (stat_number(c, "pipeline.io_waiting_on_compute_ms") - iw0) / o->steps;
	res->staging_read_ms = (stat_number(c, "pipeline.staging_reading_ms") - sr0) / o->steps;
	res->staging_compute_ms = (stat_number(c, "pipeline.staging_computing_ms") - sc0) /
	    o->steps;
	res->staging_write_ms = (stat_number(c, "pipeline.staging_writing_ms") - sw0) / o->steps;
	zc_disconnect(c);
	free(t);
	daemon_stop(&dp);
}

/*
 * Seconds for one sequential pass over size bytes: chunk-sized requests kept
 * `depth` deep, as the daemon keeps its staging buffers busy.
 */
static double
engine_pass(struct zs_swap *e, struct zs_extent *x, struct bench_slot *slots, unsigned depth,
    uint64_t chunk, uint64_t size, bool write)
{
	double t = 0;
	int r = bench_stream_pass(e, x, slots, depth, chunk, size, write, &t);

	if (r < 0)
		die("engine %s: %s", write ? "write" : "read", zs_strerror(r));
	return t;
}

/*
 * The engine alone, on a file in the same directory, with the daemon's
 * chunk size, queue depth, stripe unit and pinned, registered buffers:
 * read and write bandwidth in bytes/s.  The first write pass turns the
 * preallocated (unwritten) extents into written ones, as registration does
 * for the daemon; the timed passes are the steady state a step sees.
 */
static void
engine_bandwidth(const struct opts *o, uint64_t bytes, double *ret_read, double *ret_write)
{
	uint64_t chunk = 3 * o->chunk_elements * sizeof(float);
	uint64_t size = (bytes + chunk - 1) / chunk * chunk;
	struct zs_path path = { .path = o->dir, .capacity = size + (64u << 20) };
	struct zs_config zc = { .paths = &path, .npaths = 1, .stripe_unit = (uint32_t)o->block_size,
		.queue_depth = o->queue_depth, .engine = ZS_SWAP_AUTO, .allow_fallback = true };
	struct bench_slot *slots = calloc(o->staging, sizeof(*slots));
	struct zs_error_info info = { .path = -1 };
	struct zt_arena *arena;
	struct zs_swap *e;
	struct zs_extent x;
	bool *pinned = calloc(o->staging, sizeof(*pinned));
	double best_r = 1e30, best_w = 1e30;
	int r;

	if (slots == NULL || pinned == NULL)
		die("out of memory");
	r = zs_swap_new(&zc, &e, &info);
	if (r < 0)
		die("swap engine on %s: %s", o->dir, zs_strerror(info.cause ? info.cause : r));
	r = zt_arena_new(&(struct zt_arena_config){ .budget_bytes = chunk * o->staging,
		.numa_node = -1, .hugepages = true }, &arena);
	if (r < 0)
		die("arena: %s", strerror(-r));
	for (unsigned i = 0; i < o->staging; i++) {
		r = zt_arena_alloc(arena, chunk, (void **)&slots[i].buf, &pinned[i]);
		if (r < 0)
			die("staging buffer: %s", strerror(-r));
		memset(slots[i].buf, 0x5a, chunk);
		(void)zs_swap_register_buffer(e, slots[i].buf, chunk);
	}
	r = zs_extent_alloc(e, size, &x);
	if (r < 0)
		die("extent of %" PRIu64 " bytes: %s", size, zs_strerror(r));
	(void)engine_pass(e, &x, slots, o->staging, chunk, size, true);
	for (int rep = 0; rep < 2; rep++) {
		double tw = engine_pass(e, &x, slots, o->staging, chunk, size, true);
		double tr = engine_pass(e, &x, slots, o->staging, chunk, size, false);

		best_w = tw < best_w ? tw : best_w;
		best_r = tr < best_r ? tr : best_r;
	}
	*ret_read = (double)size / best_r;
	*ret_write = (double)size / best_w;
	zs_extent_free(e, &x);
	for (unsigned i = 0; i < o->staging; i++) {
		(void)zs_swap_unregister_buffer(e, slots[i].buf);
		zt_arena_release(arena, slots[i].buf, chunk, pinned[i]);
	}
	zs_swap_free(e);
	zt_arena_free(arena);
	free(slots);
	free(pinned);
}

/*
 * zk_pool_step over the same tensors in memory: same element counts, bf16
 * grads and params (--fp32: fp32 grads, and no param copy, as the daemon
 * steps a slot that is the master; copy: an fp32 param copy written
 * beside it all the same), AdamW, the daemon's thread count and ISA.
 * Seconds, best of the timed passes after one warm-up.
 */
static double
compute_bound(const struct opts *o, enum zk_isa isa, bool copy)
{
	enum zk_dtype dt_io = o->fp32 ? ZK_DTYPE_F32 : ZK_DTYPE_BF16;
	size_t io_size = o->fp32 ? 4 : 2;
	bool param_out = !o->fp32 || copy;
	struct zk_hparams hp = { .optim = ZK_OPTIM_ADAMW, .lr = 1e-4, .beta1 = 0.9, .beta2 = 0.999,
		.eps = 1e-8, .weight_decay = 0.01, .bias_correction = true, .grad_scale = 1.0,
		.clip_coef = 1.0 };
	struct zk_tensor *ts = calloc(o->tensors, sizeof(*ts));
	struct zk_pool *pool;
	double best = 1e30;
	int r;

	if (ts == NULL)
		die("out of memory");
	r = zk_pool_new(o->threads, NULL, 0, &pool);
	if (r < 0)
		die("pool: %s", strerror(-r));
	for (unsigned k = 0; k < o->tensors; k++) {
		uint64_t n = tensor_numel(o, k);
		/* Padded apart like the daemon's arrays: power-of-two distances alias in the cache. */
		size_t stride = ((size_t)n * sizeof(float) + 4095) / 4096 * 4096 + 4160;
		/* aligned_alloc takes whole multiples of the alignment (C11; ASan holds us to it). */
		char *state = aligned_alloc(4096, (3 * stride + 4095) / 4096 * 4096);
		void *grad = aligned_alloc(4096, ((size_t)n * io_size + 4095) / 4096 * 4096);
		void *param = param_out ? aligned_alloc(4096, ((size_t)n * io_size + 4095) / 4096 *
		    4096) : NULL;

		if (state == NULL || grad == NULL || (param_out && param == NULL))
			die("out of memory for the compute bound");
		/* In 2 MiB pages where the kernel gives them, as the daemon's state and slots are. */
		(void)madvise(state, (3 * stride + 4095) / 4096 * 4096, MADV_HUGEPAGE);
		(void)madvise(grad, ((size_t)n * io_size + 4095) / 4096 * 4096, MADV_HUGEPAGE);
		if (param != NULL)
			(void)madvise(param, ((size_t)n * io_size + 4095) / 4096 * 4096, MADV_HUGEPAGE);
		ts[k] = (struct zk_tensor){ .master = (float *)state, .m = (float *)(state + stride),
			.v = (float *)(state + 2 * stride), .grad = grad, .grad_dtype = dt_io,
			.param = param, .param_dtype = dt_io, .n = n };
		for (uint64_t i = 0; i < n; i++) {
			float g = (float)((int)(i % 977) - 488) * 1e-5f;

			ts[k].master[i] = (float)((int)(i % 2001) - 1000) * 1e-3f;
			ts[k].m[i] = 0;
			ts[k].v[i] = 0;
			if (o->fp32)
				((float *)grad)[i] = g;
			else
				((uint16_t *)grad)[i] = zk_f32_to_bf16(g);
		}
		if (param != NULL)
			memset(param, 0, (size_t)n * io_size);
	}
	for (unsigned i = 0; i <= o->steps; i++) {
		double t0 = bench_now(), dt;

		hp.step = i + 1;
		r = zk_pool_step(pool, isa, &hp, ts, o->tensors);
		if (r < 0)
			die("zk_pool_step: %s", strerror(-r));
		dt = bench_now() - t0;
		if (i > 0 && dt < best)
			best = dt;
	}
	for (unsigned k = 0; k < o->tensors; k++) {
		free(ts[k].master);
		free((void *)ts[k].grad);
		free(ts[k].param);
	}
	free(ts);
	zk_pool_free(pool);
	return best;
}

/*
 * zk_pool_qstep over the same tensors in memory in a compressed format (compute_bound's
 * counterpart; --fp32: fp32 grads and no param copy where the master is fp32, an fp32 copy
 * of bf16-master+q8's bf16 master): seconds, best of the timed passes after one warm-up.
 */
static double
qcompute_bound(const struct opts *o, enum zk_isa isa, enum zk_state_format f)
{
	enum zk_dtype dt_io = o->fp32 ? ZK_DTYPE_F32 : ZK_DTYPE_BF16;
	bool param_out = !o->fp32 || f == ZK_STATE_BF16_Q8;
	struct zk_hparams hp = { .optim = ZK_OPTIM_ADAMW, .lr = 1e-4, .beta1 = 0.9, .beta2 = 0.999,
		.eps = 1e-8, .weight_decay = 0.01, .bias_correction = true, .grad_scale = 1.0,
		.clip_coef = 1.0 };
	struct zk_qtensor *ts = calloc(o->tensors, sizeof(*ts));
	struct zk_pool *pool;
	double best = 1e30;
	int r;

	if (ts == NULL)
		die("out of memory");
	r = zk_pool_new(o->threads, NULL, 0, &pool);
	if (r < 0)
		die("pool: %s", strerror(-r));
	for (unsigned k = 0; k < o->tensors; k++) {
		uint64_t n = tensor_numel(o, k);
		size_t mb = zk_state_moment_bytes(f, n), nb = zk_state_blocks(f, n) + 1;
		/* calloc: zero moments and scales decode to zero state, a fresh tensor's. */
		/* master: float[n], or uint16_t[n] bf16 for bf16-master+q8. */
		void *master = calloc(zk_state_master_bytes(f, n), 1);
		bool blocked = zk_state_blocks(f, 1) > 0;
		float *sc = blocked ? calloc(2 * nb, sizeof(float)) : NULL;
		void *m = calloc(mb + 64, 1), *v = calloc(mb + 64, 1);
		void *grad = calloc(n, zk_dtype_size(dt_io));
		void *param = param_out ? calloc(n, zk_dtype_size(dt_io)) : NULL;

		if (master == NULL || (blocked && sc == NULL) || m == NULL || v == NULL ||
		    grad == NULL || (param_out && param == NULL))
			die("out of memory for the compute bound");
		ts[k] = (struct zk_qtensor){ .format = f, .master = master, .m = m, .v = v,
			.m_scale = sc, .v_scale = sc != NULL ? sc + nb : NULL, .grad = grad,
			.grad_dtype = dt_io, .param = param, .param_dtype = dt_io, .n = n };
		for (uint64_t i = 0; i < n; i++) {
			float w = (float)((int)(i % 2001) - 1000) * 1e-3f;

			if (f == ZK_STATE_BF16_Q8)
				ts[k].master_bf16[i] = zk_f32_to_bf16(w);
			else
				ts[k].master[i] = w;
			if (o->fp32)
				((float *)grad)[i] = (float)((int)(i % 977) - 488) * 1e-5f;
			else
				((uint16_t *)grad)[i] = zk_f32_to_bf16((float)((int)(i % 977) - 488) * 1e-5f);
		}
	}
	for (unsigned i = 0; i <= o->steps; i++) {
		double t0 = bench_now(), dt;

		hp.step = i + 1;
		r = zk_pool_qstep(pool, isa, &hp, ts, o->tensors);
		if (r < 0)
			die("zk_pool_qstep: %s", strerror(-r));
		dt = bench_now() - t0;
		if (i > 0 && dt < best)
			best = dt;
	}
	for (unsigned k = 0; k < o->tensors; k++) {
		free(ts[k].master);
		free(ts[k].m);
		free(ts[k].v);
		free(ts[k].m_scale);	/* both scale arrays, one allocation */
		free((void *)ts[k].grad);
		free(ts[k].param);
	}
	free(ts);
	zk_pool_free(pool);
	return best;
}

/*
 * --formats: each format's step with every tensor on NVMe, one daemon run after another,
 * against fp32 state's in the same run (<format>/speedup: throughput, limit fp32's, ratio
 * the speedup) and against the I/O bound of its own byte count (<format>/step_vs_io_bound:
 * the compressed state read once and written once at the engine's bandwidth).
 */
static int
run_formats(const struct opts *o, enum zk_isa isa)
{
	enum zk_state_format fs[ZK_STATE_COUNT] = { ZK_STATE_FP32 };
	struct step_run runs[ZK_STATE_COUNT];
	double compute_s[ZK_STATE_COUNT], copy_s = 0;
	const char *io = o->fp32 ? "fp32" : "bf16";
	double bw_read, bw_write, params = (double)(o->state_bytes / 12), fp32_tput;
	char *list = strdup(o->formats), *save = NULL;
	unsigned n = 1, fig = 0;

	if (list == NULL)
		die("out of memory");
	for (char *tok = strtok_r(list, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
		enum zk_state_format f;

		if (zk_state_format_parse(tok, &f) < 0)
			die("--formats: unknown state format '%s' (fp32, bf16-moments, q8-moments, "
			    "bf16-master+q8)", tok);
		for (unsigned i = 0; i < n && f != ZK_STATE_FP32; i++)
			if (fs[i] == f)
				f = ZK_STATE_FP32;
		if (f != ZK_STATE_FP32)
			fs[n++] = f;
	}
	free(list);
	for (unsigned i = 0; i < n; i++) {
		memset(&runs[i], 0, sizeof(runs[i]));
		run_daemon(o, fs[i], &runs[i]);
		if (!o->pinned_tier && runs[i].nvme_state_bytes <= 0)
			die("%s: no state went to NVMe", zk_state_format_name(fs[i]));
	}
	/* The engine's bandwidth once, over fp32 state's bytes (the most). */
	if (o->pinned_tier)
		bw_read = bw_write = 0;
	else
		engine_bandwidth(o, (uint64_t)runs[0].nvme_state_bytes, &bw_read, &bw_write);
	for (unsigned i = 0; i < n; i++)
		compute_s[i] = fs[i] == ZK_STATE_FP32 ? compute_bound(o, isa, false) :
		    qcompute_bound(o, isa, fs[i]);
	/* The pinned fp32 step's slot is its master: the kernel that still wrote a copy, beside. */
	if (o->fp32 && o->pinned_tier && fs[0] == ZK_STATE_FP32)
		copy_s = compute_bound(o, isa, true);
	fp32_tput = params / runs[0].best_s;
	if (o->json)
		printf("[");
	else if (o->pinned_tier)
		printf("AdamW step, every tensor pinned, %s grads and params: %u tensors, %.1fM "
		    "params, %u threads, %s\n", io, o->tensors, params / 1e6, o->threads, runs[0].isa);
	else
		printf("AdamW step, every tensor on NVMe, %s grads and params: %u tensors, %.1fM "
		    "params, chunks of %" PRIu64 " elements, %u staging buffers, %u threads, %s; "
		    "engine alone: read %.0f MiB/s, write %.0f MiB/s\n", io, o->tensors, params / 1e6,
		    o->chunk_elements, o->staging, o->threads, runs[0].isa, bw_read / MiB,
		    bw_write / MiB);
	for (unsigned i = 0; i < n; i++) {
		const char *name = zk_state_format_name(fs[i]);
		double bytes = runs[i].nvme_state_bytes, tput = params / runs[i].best_s;
		double io_s = o->pinned_tier ? 0 : bytes / bw_read + bytes / bw_write;
		char fname[64];

		if (o->json) {
			snprintf(fname, sizeof(fname), "%s/speedup", name);
			bench_json_figure(fig++, fname, tput / 1e6, "Mparams/s", fp32_tput / 1e6, 3);
			snprintf(fname, sizeof(fname), "%s/step_vs_io_bound", name);
			if (!o->pinned_tier)
				bench_json_figure(fig++, fname, runs[i].best_s, "s", io_s, 4);
			snprintf(fname, sizeof(fname), "%s/step_vs_compute_bound", name);
			bench_json_figure(fig++, fname, runs[i].best_s, "s", compute_s[i], 4);
			/* What the slot as the master saves: the step against the kernel writing a copy. */
			if (copy_s > 0 && fs[i] == ZK_STATE_FP32)
				bench_json_figure(fig++, "fp32/step_vs_kernel_with_copy", runs[i].best_s,
				    "s", copy_s, 4);
			continue;
		}
		if (o->pinned_tier) {
			printf("  %-14s %5.2f B/param pinned  step %6.3f s (mean %.3f)  %6.1f Mparams/s"
			    "  speedup %.2fx  compute bound %.3f s (step/bound %.2f)\n", name,
			    zk_state_bytes(fs[i], 1000000) / 1e6, runs[i].best_s, runs[i].mean_s,
			    tput / 1e6, tput / fp32_tput, compute_s[i], runs[i].best_s / compute_s[i]);
			if (copy_s > 0 && i == 0)
				printf("  %-14s the kernel writing an fp32 param copy beside: %.3f s "
				    "(step/that %.2f)\n", "", copy_s, runs[i].best_s / copy_s);
			continue;
		}
		printf("  %-14s %5.2f B/param on NVMe  step %6.3f s (mean %.3f)  %6.1f Mparams/s  "
		    "speedup %.2fx  I/O bound %.3f s (step/bound %.2f)  compute bound %.3f s  read "
		    "%.0f MiB, wrote %.0f MiB per step\n", name, bytes / params, runs[i].best_s,
		    runs[i].mean_s, tput / 1e6, tput / fp32_tput, io_s, runs[i].best_s / io_s,
		    compute_s[i], runs[i].read_per_step / MiB, runs[i].written_per_step / MiB);
	}
	if (o->json)
		printf("\n]\n");
	return 0;
}

int
main(int argc, char **argv)
{
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	const char *tmp = getenv("TMPDIR");
	struct opts o = {
		.daemon = getenv("ZOFFLOADD"),
		.dir = tmp != NULL && *tmp != '\0' ? tmp : "/tmp",
		.pinned_budget = 256ull << 20,
		.state_bytes = 1ull << 30,
		.tensors = 6,
		.steps = 3,
		.threads = ncpu > 0 ? (unsigned)ncpu : 1,
		/* The daemon's defaults (daemon/config.c). */
		.staging = 4,
		.chunk_elements = 4u << 20,
		.queue_depth = 32,
		.block_size = 1u << 20,
	};
	struct step_run run = { 0 };
	double bw_read, bw_write, io_s, compute_s, limit, step_ms, buffer_ms;
	enum zk_isa isa;
	int r;

	if (parse(argc, argv, &o) < 0) {
		usage();
		return 2;
	}
	if (o.daemon == NULL || o.daemon[0] == '\0' || access(o.daemon, X_OK) != 0) {
		fprintf(stderr, "bench_step: no zoffloadd: pass --daemon PATH or set $ZOFFLOADD\n");
		return 2;
	}
	r = zk_isa_select(NULL, &isa);
	if (r < 0)
		die("ISA: %s", strerror(-r));
	if (o.formats != NULL)
		return run_formats(&o, isa);

	/* One at a time, so none of the three disturbs another's measurement. */
	run_daemon(&o, ZK_STATE_FP32, &run);
	if (run.nvme_state_bytes <= 0)
		die("no state went to NVMe: raise --state or lower --pinned-budget");
	engine_bandwidth(&o, (uint64_t)run.nvme_state_bytes, &bw_read, &bw_write);
	compute_s = compute_bound(&o, isa, false);
	/* The state itself, read once and written once: padding the daemon moves counts against it. */
	io_s = run.nvme_state_bytes / bw_read + run.nvme_state_bytes / bw_write;
	limit = io_s > compute_s ? io_s : compute_s;

	/* The breakdown's figures are per step, as the step's mean: its counters cover every step. */
	step_ms = run.mean_s * 1e3;
	buffer_ms = step_ms * o.staging;
	if (o.json) {
		printf("[");
		/* The target: the step within 10% of the slower bound. */
		bench_json_figure(0, "step_vs_bound", run.best_s / limit, "x", 1.10, 3);
		bench_json_figure(1, "step_vs_io_bound", run.best_s, "s", io_s, 4);
		bench_json_figure(2, "step_vs_compute_bound", run.best_s, "s", compute_s, 4);
		/* Where the step's time goes; limit: the mean step, so ratio is its share. */
		bench_json_figure(3, "compute_waited_on_reads", run.compute_wait_ms, "ms", step_ms, 1);
		bench_json_figure(4, "reads_waited_for_staging", run.io_wait_ms, "ms", step_ms, 1);
		/* Buffer time: limit the mean step times the buffers, so ratio is the share. */
		bench_json_figure(5, "staging_reading", run.staging_read_ms, "buffer-ms", buffer_ms, 1);
		bench_json_figure(6, "staging_computing", run.staging_compute_ms, "buffer-ms",
		    buffer_ms, 1);
		bench_json_figure(7, "staging_writing", run.staging_write_ms, "buffer-ms", buffer_ms, 1);
		printf("\n]\n");
		return 0;
	}
	printf("offloaded AdamW step, %s grads and params: %u tensors, %.0f MiB of state "
	    "(%.1fM params), pinned budget %.0f MiB\n", o.fp32 ? "fp32" : "bf16", o.tensors,
	    (double)o.state_bytes / MiB, (double)(o.state_bytes / 12) / 1e6,
	    (double)o.pinned_budget / MiB);
	printf("  placed: %.0f MiB pinned, %.0f MiB on NVMe (%s, engine %s); chunks of %" PRIu64
	    " elements (%.0f MiB), %u staging buffers, queue depth %u, %u threads, %s\n",
	    run.pinned_state_bytes / MiB, run.nvme_placed_bytes / MiB, o.dir, run.engine,
	    o.chunk_elements, 3.0 * (double)o.chunk_elements * 4 / MiB, o.staging, o.queue_depth,
	    o.threads, run.isa);
	printf("  step time          %8.3f s   (best of %u; mean %.3f s)\n", run.best_s, o.steps,
	    run.mean_s);
	printf("  I/O bound          %8.3f s   (%.0f MiB of NVMe state read at %.0f MiB/s and "
	    "written at %.0f MiB/s, the engine alone)\n", io_s, run.nvme_state_bytes / MiB,
	    bw_read / MiB, bw_write / MiB);
	printf("  compute bound      %8.3f s   (zk_pool_step over the same %.1fM params in "
	    "memory)\n", compute_s, (double)(o.state_bytes / 12) / 1e6);
	printf("  step / max(bounds) %8.3f     (target <= 1.10)\n", run.best_s / limit);
	printf("  per step: daemon read %.0f MiB, wrote %.0f MiB; compute waited on reads %.0f ms, "
	    "reads waited for a staging buffer %.0f ms\n", run.read_per_step / MiB,
	    run.written_per_step / MiB, run.compute_wait_ms, run.io_wait_ms);
	printf("  staging buffers' time per step (%u x %.0f ms): reading %.0f ms (%.0f%%), "
	    "computing %.0f ms (%.0f%%), writing %.0f ms (%.0f%%), free %.0f ms\n", o.staging,
	    step_ms, run.staging_read_ms, 100 * run.staging_read_ms / buffer_ms,
	    run.staging_compute_ms, 100 * run.staging_compute_ms / buffer_ms, run.staging_write_ms,
	    100 * run.staging_write_ms / buffer_ms, buffer_ms - run.staging_read_ms -
	    run.staging_compute_ms - run.staging_write_ms);
	return 0;
}
