/*
 * zoffctl tune: measures the swap paths with the daemon's own swap engine the
 * way its NVMe pipeline uses them (staging buffers of one chunk each, every
 * buffer reading a chunk and writing it back, over and over) across block
 * size, queue depth and staging buffers, then the CPU step rate, and prints a
 * recommended configuration with the figures behind it.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <libgen.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "optim.h"
#include "pool.h"
#include "swap.h"
#include "zoffctl.h"

#define MiB (1024.0 * 1024.0)

/* The sweep: block sizes and queue depths at one buffer count, then buffer counts at the best. */
struct sweep {
	uint32_t block[4];
	unsigned nblock;
	unsigned depth[4];
	unsigned ndepth;
	unsigned buffers[4];
	unsigned nbuffers;
	unsigned first_buffers;		/* buffer count of the first pass */
	uint64_t chunk_elements;
	size_t step_elements;		/* tensor size of the CPU measurement */
};

static const struct sweep full_sweep = {
	{ 256u << 10, 1u << 20, 4u << 20 }, 3, { 8, 32, 128 }, 3, { 2, 4, 8 }, 3, 4,
	4u << 20, 16u << 20,
};
/* For tests and a first look: a few small points. */
static const struct sweep quick_sweep = {
	{ 64u << 10, 256u << 10 }, 2, { 4, 16 }, 2, { 2, 4 }, 2, 2, 64u << 10, 256u << 10,
};

struct point {
	uint32_t block;
	unsigned depth;
	unsigned buffers;
	double mib_s;		/* read + write */
	int error;
};

struct run;

/* One staging buffer going round: read chunk, write it back, next chunk. */
struct slot {
	struct run *run;
	char *buf;
	uint64_t chunk;
	bool writing;
};

struct run {
	struct zs_swap *e;
	struct zs_extent x;
	size_t chunk_bytes;
	uint64_t nchunks;
	uint64_t next_chunk;
	double deadline;
	uint64_t bytes;
	unsigned pending;
	int error;
};

static double
now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void slot_issue(struct slot *s);

static void
slot_done(int result, void *arg)
{
	struct slot *s = arg;
	struct run *r = s->run;

	r->pending--;
	if (result < 0) {
		if (r->error == 0)
			r->error = result;
		return;
	}
	r->bytes += r->chunk_bytes;
	if (r->error != 0 || now_s() >= r->deadline)
		return;
	if (s->writing) {
		s->writing = false;
		s->chunk = r->next_chunk++ % r->nchunks;
	} else {
		s->writing = true;
	}
	slot_issue(s);
}

static void
slot_issue(struct slot *s)
{
	struct run *r = s->run;
	uint64_t off = s->chunk * r->chunk_bytes;
	int rc = s->writing ? zs_write(r->e, &r->x, off, s->buf, r->chunk_bytes, slot_done, s) :
	    zs_read(r->e, &r->x, off, s->buf, r->chunk_bytes, slot_done, s);

	if (rc < 0) {
		if (r->error == 0)
			r->error = rc;
		return;
	}
	r->pending++;
}

static void
measure(const char *const *paths, unsigned npaths, uint64_t size, const struct sweep *sw,
    double seconds, struct point *p)
{
	struct zs_path zp[ZS_MAX_PATHS];
	struct zs_config zc = {
		.paths = zp, .npaths = npaths, .stripe_unit = p->block, .queue_depth = p->depth,
		.engine = ZS_SWAP_AUTO, .allow_fallback = true,
	};
	struct run r = { .chunk_bytes = (size_t)sw->chunk_elements * 12 };
	struct slot *slots = calloc(p->buffers, sizeof(*slots));
	char *bufs = NULL;
	double t0;

	p->error = 0;
	p->mib_s = 0;
	for (unsigned i = 0; i < npaths; i++)
		zp[i] = (struct zs_path){ .path = paths[i], .capacity = size };
	if (slots == NULL || (p->error = zs_swap_new(&zc, &r.e, NULL)) < 0)
		goto out;
	/* One chunk short of the whole: the extent's stripes round up per path. */
	r.nchunks = size * npaths / r.chunk_bytes - 1;
	if (r.nchunks < p->buffers) {
		p->error = -ENOSPC;
		goto out;
	}
	if ((p->error = zs_extent_alloc(r.e, r.nchunks * r.chunk_bytes, &r.x)) < 0)
		goto out;
	bufs = aligned_alloc(4096, r.chunk_bytes * p->buffers);
	if (bufs == NULL) {
		p->error = -ENOMEM;
		goto out_extent;
	}
	memset(bufs, 0x5a, r.chunk_bytes * p->buffers);
	/* As the daemon does with its staging buffers; I/O works unregistered too, only slower. */
	(void)zs_swap_register_buffer(r.e, bufs, r.chunk_bytes * p->buffers);
	t0 = now_s();
	r.deadline = t0 + seconds;
	for (unsigned i = 0; i < p->buffers; i++) {
		slots[i] = (struct slot){ &r, bufs + i * r.chunk_bytes, r.next_chunk++, false };
		slot_issue(&slots[i]);
	}
	while (r.pending > 0) {
		int rc = zs_swap_wait(r.e, 5000);

		if (rc < 0 && r.error == 0)
			r.error = rc;
	}
	p->error = r.error;
	p->mib_s = (double)r.bytes / MiB / (now_s() - t0);
	(void)zs_swap_unregister_buffer(r.e, bufs);
out_extent:
	zs_extent_free(r.e, &r.x);
out:
	zs_swap_free(r.e);
	free(bufs);
	free(slots);
}

/* AdamW, bf16 gradients and parameters, over every CPU: parameters per second. */
static double
step_rate(size_t n, double seconds, unsigned *ret_threads, enum zk_isa *ret_isa)
{
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	struct zk_hparams hp = { .optim = ZK_OPTIM_ADAMW, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .bias_correction = true,
		.grad_scale = 1, .clip_coef = 1 };
	float *state = calloc(n * 3, sizeof(float));
	uint16_t *grad = calloc(n, 2), *param = calloc(n, 2);
	struct zk_tensor t = { state, state + n, state + 2 * n, grad, ZK_DTYPE_BF16, param,
		ZK_DTYPE_BF16, n };
	struct zk_pool *pool = NULL;
	double t0, elapsed, done = 0;

	*ret_threads = ncpu > 0 ? (unsigned)ncpu : 1;
	*ret_isa = zk_isa_best();
	if (state == NULL || grad == NULL || param == NULL ||
	    zk_pool_new(*ret_threads, NULL, 0, &pool) < 0)
		goto fail;
	for (size_t i = 0; i < n; i++)
		grad[i] = 0x3c00;	/* bf16 0.0078125 */
	t0 = now_s();
	do {
		hp.step++;
		if (zk_pool_step(pool, *ret_isa, &hp, &t, 1) < 0)
			goto fail;
		done += (double)n;
		elapsed = now_s() - t0;
	} while (elapsed < seconds);
	zk_pool_free(pool);
	free(state);
	free(grad);
	free(param);
	return done / elapsed;
fail:
	zk_pool_free(pool);
	free(state);
	free(grad);
	free(param);
	return -1;
}

/* The cheapest point within 5% of the best: fewer buffers, shallower queue, smaller blocks. */
static const struct point *
choose(const struct point *pts, size_t n)
{
	const struct point *best = NULL, *pick = NULL;

	for (size_t i = 0; i < n; i++)
		if (pts[i].error == 0 && (best == NULL || pts[i].mib_s > best->mib_s))
			best = &pts[i];
	for (size_t i = 0; best != NULL && i < n; i++) {
		const struct point *p = &pts[i];

		if (p->error != 0 || p->mib_s < 0.95 * best->mib_s)
			continue;
		if (pick == NULL || p->buffers < pick->buffers ||
		    (p->buffers == pick->buffers && (p->depth < pick->depth ||
		    (p->depth == pick->depth && p->block < pick->block))))
			pick = p;
	}
	return pick;
}

static void
print_point(FILE *out, const struct point *p)
{
	if (p->error != 0)
		fprintf(out, "  block %5u KiB  queue depth %4u  buffers %2u  failed: %s\n",
		    p->block >> 10, p->depth, p->buffers, zs_strerror(p->error));
	else
		fprintf(out, "  block %5u KiB  queue depth %4u  buffers %2u  %9.1f MiB/s\n",
		    p->block >> 10, p->depth, p->buffers, p->mib_s);
}

int
zoffctl_tune(const char *const *paths, unsigned npaths, const struct zoffctl_tune_opts *o,
    FILE *out)
{
	const struct sweep *sw = o->quick ? &quick_sweep : &full_sweep;
	struct point pts[32];
	size_t n = 0;
	const struct point *pick;
	double seconds = o->seconds > 0 ? o->seconds : o->quick ? 0.2 : 2;
	uint64_t size = o->size > 0 ? o->size : o->quick ? 32ull << 20 : 1ull << 30;
	double rate, io_rate;
	unsigned threads, buffers;
	enum zk_isa isa;
	cJSON *root, *swap, *figs;
	char *text;

	if (npaths == 0 || npaths > ZS_MAX_PATHS) {
		fprintf(stderr, "zoffctl: tune: 1 to %d swap paths, not %u\n", ZS_MAX_PATHS, npaths);
		return 2;
	}
	/* Directories only: the engine writes an unnamed file there that goes when it does. */
	for (unsigned i = 0; i < npaths; i++) {
		struct stat st;

		if (stat(paths[i], &st) != 0 || !S_ISDIR(st.st_mode)) {
			fprintf(stderr, "zoffctl: tune: %s: %s\n", paths[i], stat(paths[i], &st) != 0 ?
			    strerror(errno) : "not a directory (tune writes a temporary file in a "
			    "directory of the swap device; it never writes to files or devices)");
			return 1;
		}
	}
	if (!o->json)
		fprintf(out, "Measuring %u path(s), %.1f s per point, %llu MiB per path, chunks of "
		    "%llu elements (%.1f MiB):\n", npaths, seconds,
		    (unsigned long long)(size >> 20), (unsigned long long)sw->chunk_elements,
		    (double)sw->chunk_elements * 12 / MiB);
	for (unsigned b = 0; b < sw->nblock; b++) {
		for (unsigned d = 0; d < sw->ndepth; d++) {
			pts[n] = (struct point){ .block = sw->block[b], .depth = sw->depth[d],
			    .buffers = sw->first_buffers };
			measure(paths, npaths, size, sw, seconds, &pts[n]);
			if (pts[n].error == -ENOENT || pts[n].error == -EACCES ||
			    pts[n].error == -EROFS || pts[n].error == -ZS_E_NODIRECT) {
				fprintf(stderr, "zoffctl: tune: %s\n", zs_strerror(pts[n].error));
				return 1;
			}
			if (!o->json)
				print_point(out, &pts[n]);
			n++;
		}
	}
	pick = choose(pts, n);
	if (pick == NULL) {
		fprintf(stderr, "zoffctl: tune: every point failed (%s)\n", zs_strerror(pts[0].error));
		return 1;
	}
	/* Then the buffer counts at the best block size and depth. */
	{
		uint32_t block = pick->block;
		unsigned depth = pick->depth;

		for (unsigned i = 0; i < sw->nbuffers; i++) {
			if (sw->buffers[i] == sw->first_buffers)
				continue;
			pts[n] = (struct point){ .block = block, .depth = depth,
			    .buffers = sw->buffers[i] };
			measure(paths, npaths, size, sw, seconds, &pts[n]);
			if (!o->json)
				print_point(out, &pts[n]);
			n++;
		}
	}
	pick = choose(pts, n);
	buffers = pick->buffers;
	rate = step_rate(sw->step_elements, seconds, &threads, &isa);
	/* Each parameter stepped on NVMe reads and writes master, m and v: 24 bytes. */
	io_rate = pick->mib_s * MiB / 24;

	root = cJSON_CreateObject();
	swap = cJSON_AddObjectToObject(root, "swap");
	{
		cJSON *arr = cJSON_AddArrayToObject(swap, "paths");

		for (unsigned i = 0; i < npaths; i++) {
			cJSON *p = cJSON_CreateObject();
			struct statvfs vfs;
			char cap[32], dir[4096];

			snprintf(dir, sizeof(dir), "%s", paths[i]);
			if (statvfs(paths[i], &vfs) != 0)
				statvfs(dirname(dir), &vfs);
			/* 90% of what is free there now, whole GiB. */
			snprintf(cap, sizeof(cap), "%lluG", ((unsigned long long)vfs.f_bavail *
			    vfs.f_frsize / 10 * 9 >> 30) > 0 ? (unsigned long long)vfs.f_bavail *
			    vfs.f_frsize / 10 * 9 >> 30 : 1);
			cJSON_AddStringToObject(p, "path", paths[i]);
			cJSON_AddStringToObject(p, "capacity", cap);
			cJSON_AddItemToArray(arr, p);
		}
	}
	cJSON_AddNumberToObject(swap, "block_size", pick->block);
	cJSON_AddNumberToObject(swap, "queue_depth", pick->depth);
	cJSON_AddNumberToObject(swap, "staging_buffers", buffers);
	cJSON_AddNumberToObject(swap, "chunk_elements", (double)sw->chunk_elements);
	if (o->json) {
		cJSON *all = cJSON_CreateObject(), *arr;

		cJSON_AddItemToObject(all, "config", root);
		figs = cJSON_AddObjectToObject(all, "measured");
		arr = cJSON_AddArrayToObject(figs, "points");
		for (size_t i = 0; i < n; i++) {
			cJSON *p = cJSON_CreateObject();

			cJSON_AddNumberToObject(p, "block_size", pts[i].block);
			cJSON_AddNumberToObject(p, "queue_depth", pts[i].depth);
			cJSON_AddNumberToObject(p, "staging_buffers", pts[i].buffers);
			cJSON_AddNumberToObject(p, "mib_per_s", pts[i].mib_s);
			if (pts[i].error != 0)
				cJSON_AddStringToObject(p, "error", zs_strerror(pts[i].error));
			cJSON_AddItemToArray(arr, p);
		}
		cJSON_AddNumberToObject(figs, "seconds_per_point", seconds);
		cJSON_AddNumberToObject(figs, "nvme_mib_per_s", pick->mib_s);
		cJSON_AddNumberToObject(figs, "nvme_bound_params_per_s", io_rate);
		/* fp32 params: the slot is the master, m and v alone on disk (docs/tiers.md). */
		cJSON_AddNumberToObject(figs, "nvme_bound_params_per_s_fp32_params",
		    io_rate * 24 / 16);
		cJSON_AddNumberToObject(figs, "cpu_params_per_s", rate);
		cJSON_AddNumberToObject(figs, "cpu_threads", threads);
		cJSON_AddStringToObject(figs, "kernels", zk_isa_name(isa));
		text = cJSON_Print(all);
		fprintf(out, "%s\n", text != NULL ? text : "{}");
		free(text);
		cJSON_Delete(all);
		return 0;
	}
	fprintf(out, "\nNVMe pipeline: %.1f MiB/s read + write (block %u KiB, queue depth %u, %u "
	    "staging buffers of %.1f MiB): at most %.1f M params/s stepped from NVMe (24 bytes "
	    "moved per parameter; %.1f M with fp32 params, whose slot is the master, 16 bytes)\n",
	    pick->mib_s, pick->block >> 10, pick->depth, buffers,
	    (double)sw->chunk_elements * 12 / MiB, io_rate / 1e6, io_rate * 24 / 16 / 1e6);
	fprintf(out, "CPU step: %.1f M params/s (AdamW, bf16 gradients, %u threads, %s kernels)\n",
	    rate / 1e6, threads, zk_isa_name(isa));
	fprintf(out, "%s\n", rate > io_rate ? "The NVMe paths bound steps on NVMe state: more or "
	    "faster paths help, more threads do not." : "The CPU bounds the step: more worker "
	    "threads help, faster NVMe does not.");
	text = cJSON_Print(root);
	fprintf(out, "\n# recommended zoffload.conf block (capacity: 90%% of the free space now)\n"
	    "%s\n", text != NULL ? text : "{}");
	free(text);
	cJSON_Delete(root);
	return 0;
}
