/* Swap engine sequential bandwidth beside fio on the same file, in the same run. */
#include <cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "arena.h"
#include "bench_common.h"
#include "swap.h"

#define MiB (1024.0 * 1024.0)

struct opts {
	const char *path;
	uint64_t size;
	uint32_t bs;
	unsigned qd;
	unsigned threads;
	unsigned reps;
	bool json;
	bool small_pages;	/* buffers in 4 KiB pages, as fio's may be */
	bool uring;
	bool pthread;
};

struct result {
	const char *name;
	double value;		/* MiB/s */
	double limit;		/* fio, MiB/s */
	const char *against;
};

/* Sequential pass over the whole extent with qd requests of bs in flight; MiB/s. */
static double
engine_pass(struct zs_swap *e, struct zs_extent *x, char *bufs, const struct opts *o, bool write)
{
	struct bench_slot *slots = calloc(o->qd, sizeof(*slots));
	double t = 0;
	unsigned i;
	int r;

	if (slots == NULL)
		return -1;
	for (i = 0; i < o->qd; i++)
		slots[i].buf = bufs + (size_t)i * o->bs;
	r = bench_stream_pass(e, x, slots, o->qd, o->bs, o->size, write, &t);
	free(slots);
	if (r < 0) {
		fprintf(stderr, "bench_swap: %s: %s\n", write ? "write" : "read", zs_strerror(r));
		return -1;
	}
	/* Every byte of the extent moved: parse() keeps size a multiple of bs. */
	return (double)o->size / MiB / t;
}

/* fio's bandwidth in MiB/s for the same file, block size and concurrency. */
static double
fio_pass(const struct opts *o, bool write, bool psync)
{
	char cmd[1024], *out = NULL;
	size_t cap = 0, len = 0, n;
	cJSON *root, *job, *dir, *bw;
	double v = -1;
	FILE *p;
	int w;

	if (psync) {
		/* One job per worker thread, each on its own slice, as the pool's threads are. */
		uint64_t slice = o->size / o->threads / o->bs * o->bs;

		w = snprintf(cmd, sizeof(cmd),
		    "fio --name=bench --filename=%s --rw=%s --bs=%" PRIu32 " --direct=1 "
		    "--ioengine=psync --numjobs=%u --size=%" PRIu64 " --offset_increment=%" PRIu64
		    " --group_reporting --output-format=json 2>/dev/null",
		    o->path, write ? "write" : "read", o->bs, o->threads, slice, slice);
	} else {
		w = snprintf(cmd, sizeof(cmd),
		    "fio --name=bench --filename=%s --rw=%s --bs=%" PRIu32 " --direct=1 "
		    "--ioengine=io_uring --iodepth=%u --fixedbufs=1 --registerfiles=1 "
		    "--size=%" PRIu64 " --output-format=json 2>/dev/null",
		    o->path, write ? "write" : "read", o->bs, o->qd, o->size);
	}
	if (w < 0 || (size_t)w >= sizeof(cmd))
		return -1;
	p = popen(cmd, "r");
	if (p == NULL)
		return -1;
	for (;;) {
		if (cap - len < 4096) {
			char *grown = realloc(out, cap + 65536);

			if (grown == NULL)
				break;
			out = grown;
			cap += 65536;
		}
		n = fread(out + len, 1, cap - len - 1, p);
		if (n == 0)
			break;
		len += n;
	}
	if (pclose(p) != 0 || out == NULL) {
		free(out);
		return -1;
	}
	out[len] = '\0';
	/* fio may print notes before the JSON. */
	root = cJSON_Parse(strchr(out, '{') != NULL ? strchr(out, '{') : out);
	job = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "jobs"), 0);
	dir = cJSON_GetObjectItem(job, write ? "write" : "read");
	bw = cJSON_GetObjectItem(dir, "bw_bytes");
	if (cJSON_IsNumber(bw))
		v = bw->valuedouble / MiB;
	cJSON_Delete(root);
	free(out);
	return v;
}

static bool
have_fio(void)
{
	return system("fio --version >/dev/null 2>&1") == 0;
}

static double
best(double a, double b)
{
	return a > b ? a : b;
}

/* Best of reps for engine and fio alike, alternating so drift hits both the same. */
static int
run_engine(const struct opts *o, enum zs_swap_kind kind, struct result *res)
{
	struct zs_path path = { .path = o->path, .capacity = o->size };
	struct zs_config c = {
		.paths = &path, .npaths = 1, .stripe_unit = o->bs, .queue_depth = o->qd,
		.threads = o->threads, .engine = kind,
	};
	/*
	 * Hugepages, as the daemon's arena uses: a 1 MiB transfer in 4 KiB pages
	 * needs 256 segments, more than many queues take (virtio-blk here: 254), and
	 * is split in two; fio's buffers get THP.  Measured: reads 1.1 vs 2.8 GB/s.
	 */
	struct zt_arena_config ac = {
		.budget_bytes = (uint64_t)o->qd * o->bs, .numa_node = -1, .hugepages = !o->small_pages,
	};
	struct zt_arena *arena = NULL;
	struct zs_error_info info;
	struct zs_swap *e = NULL;
	struct zs_extent x;
	bool psync = kind == ZS_SWAP_PTHREAD, pinned = false;
	double ew = 0, er = 0, fw = 0, fr = 0, fur = 0, fuw = 0;
	char *bufs = NULL;
	unsigned rep;
	int r;

	r = zs_swap_new(&c, &e, &info);
	if (r < 0) {
		fprintf(stderr, "bench_swap: %s engine: %s (path %d, %s: %s)\n",
		    kind == ZS_SWAP_URING ? "io_uring" : "pthread", zs_strerror(r), info.path,
		    info.step, zs_strerror(info.cause));
		return r == -ZS_E_NOURING ? 77 : 1;
	}
	r = zt_arena_new(&ac, &arena);
	if (r == 0)
		r = zt_arena_alloc(arena, (size_t)o->qd * o->bs, (void **)&bufs, &pinned);
	if (r == 0)
		r = zs_swap_register_buffer(e, bufs, (size_t)o->qd * o->bs);
	if (r == 0)
		r = zs_extent_alloc(e, o->size, &x);
	if (r < 0) {
		fprintf(stderr, "bench_swap: setup: %s\n", zs_strerror(r));
		r = 1;
		goto out;
	}
	memset(bufs, 0x5a, (size_t)o->qd * o->bs);
	/* Written once untimed: later passes then hit allocated, written blocks. */
	if (engine_pass(e, &x, bufs, o, true) < 0) {
		r = 1;
		goto out;
	}
	for (rep = 0; rep < o->reps; rep++) {
		ew = best(ew, engine_pass(e, &x, bufs, o, true));
		fw = best(fw, fio_pass(o, true, psync));
		er = best(er, engine_pass(e, &x, bufs, o, false));
		fr = best(fr, fio_pass(o, false, psync));
		if (psync) {
			fuw = best(fuw, fio_pass(o, true, false));
			fur = best(fur, fio_pass(o, false, false));
		}
	}
	if (ew <= 0 || er <= 0 || fw <= 0 || fr <= 0) {
		fprintf(stderr, "bench_swap: a pass failed (engine %.0f/%.0f, fio %.0f/%.0f MiB/s)\n",
		    ew, er, fw, fr);
		r = 1;
		goto out;
	}
	if (psync) {
		res[0] = (struct result){ "swap_pthread_seq_write", ew, fw, "fio psync" };
		res[1] = (struct result){ "swap_pthread_seq_read", er, fr, "fio psync" };
		res[2] = (struct result){ "swap_pthread_seq_write_vs_uring", ew, fuw, "fio io_uring" };
		res[3] = (struct result){ "swap_pthread_seq_read_vs_uring", er, fur, "fio io_uring" };
	} else {
		res[0] = (struct result){ "swap_uring_seq_write", ew, fw, "fio io_uring" };
		res[1] = (struct result){ "swap_uring_seq_read", er, fr, "fio io_uring" };
	}
	r = 0;
out:
	zs_extent_free(e, &x);
	zs_swap_free(e);
	if (bufs != NULL)
		zt_arena_release(arena, bufs, (size_t)o->qd * o->bs, pinned);
	zt_arena_free(arena);
	return r;
}

static void
usage(void)
{
	fprintf(stderr,
	    "usage: bench_swap [--path FILE] [--size MiB] [--bs KiB] [--qd N] [--threads N]\n"
	    "                  [--reps N] [--engine uring|pthread|both] [--small-pages]\n"
	    "                  [--json]\n");
}

static int
parse(int argc, char **argv, struct opts *o)
{
	static const struct option longopts[] = {
		{ "path", required_argument, NULL, 'p' },
		{ "size", required_argument, NULL, 's' },
		{ "bs", required_argument, NULL, 'b' },
		{ "qd", required_argument, NULL, 'q' },
		{ "threads", required_argument, NULL, 't' },
		{ "reps", required_argument, NULL, 'r' },
		{ "engine", required_argument, NULL, 'e' },
		{ "json", no_argument, NULL, 'j' },
		{ "small-pages", no_argument, NULL, 'm' },
		{ NULL, 0, NULL, 0 },
	};
	int ch;

	while ((ch = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		switch (ch) {
		case 'p': o->path = optarg; break;
		case 's': o->size = strtoull(optarg, NULL, 0) << 20; break;
		case 'b': o->bs = (uint32_t)strtoul(optarg, NULL, 0) << 10; break;
		case 'q': o->qd = (unsigned)strtoul(optarg, NULL, 0); break;
		case 't': o->threads = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'r': o->reps = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'j': o->json = true; break;
		case 'm': o->small_pages = true; break;
		case 'e':
			o->uring = strcmp(optarg, "pthread") != 0;
			o->pthread = strcmp(optarg, "uring") != 0;
			break;
		default:
			return -1;
		}
	}
	if (o->size == 0 || o->bs == 0 || o->bs % 4096 != 0 || o->qd == 0 || o->reps == 0 ||
	    o->size % o->bs != 0)
		return -1;
	if (o->threads == 0)
		o->threads = o->qd;
	return 0;
}

int
main(int argc, char **argv)
{
	struct opts o = {
		.size = 1024ull << 20, .bs = 1 << 20, .qd = 32, .reps = 3,
		.uring = true, .pthread = true,
	};
	struct result res[8];
	char tmp[512];
	struct stat st;
	bool made = false;
	unsigned n = 0, i;
	int r = 0, rr;

	if (parse(argc, argv, &o) < 0) {
		usage();
		return 2;
	}
	if (!have_fio()) {
		fprintf(stderr, "bench_swap: fio not found in PATH; it is the limit measured against\n");
		return 77;
	}
	if (o.path == NULL) {
		const char *d = getenv("TMPDIR");

		snprintf(tmp, sizeof(tmp), "%s/zs-bench-%ld.swap", d && *d ? d : "/tmp", (long)getpid());
		o.path = tmp;
	}
	made = stat(o.path, &st) != 0;

	if (o.uring) {
		rr = run_engine(&o, ZS_SWAP_URING, res + n);
		if (rr == 0)
			n += 2;
		else if (r == 0)
			r = rr;
	}
	if (o.pthread) {
		rr = run_engine(&o, ZS_SWAP_PTHREAD, res + n);
		if (rr == 0)
			n += 4;
		else
			r = rr;
	}
	if (made)
		unlink(o.path);

	if (o.json) {
		printf("[");
		for (i = 0; i < n; i++)
			bench_json_figure(i, res[i].name, res[i].value, "MiB/s", res[i].limit, 1);
		printf("\n]\n");
	} else {
		printf("sequential, %" PRIu32 " KiB blocks, QD %u, %u pthread workers, %" PRIu64
		    " MiB file %s, %s buffers, best of %u\n", o.bs >> 10, o.qd, o.threads,
		    o.size >> 20, o.path, o.small_pages ? "4 KiB page" : "hugepage", o.reps);
		for (i = 0; i < n; i++)
			printf("  %-34s %8.0f MiB/s   %-12s %8.0f MiB/s   ratio %.3f\n", res[i].name,
			    res[i].value, res[i].against, res[i].limit, res[i].value / res[i].limit);
	}
	return n > 0 && r == 77 ? 0 : r;
}
