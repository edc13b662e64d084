/* Optimizer step throughput per ISA, dtype mix and thread count, beside the memory-only limit measured in the same run. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "bench_common.h"
#include "optim.h"
#include "pool.h"
#include "quant.h"

struct mix {
	enum zk_optim optim;
	enum zk_dtype grad, param;
	bool all_isas;		/* else only the best ISA, to keep the run short */
	uint64_t step0;		/* first step number */
};

static const struct mix mixes[] = {
	{ ZK_OPTIM_ADAMW, ZK_DTYPE_BF16, ZK_DTYPE_BF16, true, 1 },	/* the target case */
	/* Same, late in training: sqrt(1 - beta2^step) == 1.0f, one division fewer per element. */
	{ ZK_OPTIM_ADAMW, ZK_DTYPE_BF16, ZK_DTYPE_BF16, true, 100000 },
	{ ZK_OPTIM_ADAMW, ZK_DTYPE_F16, ZK_DTYPE_F16, true, 1 },
	{ ZK_OPTIM_ADAMW, ZK_DTYPE_F32, ZK_DTYPE_BF16, true, 1 },
	{ ZK_OPTIM_ADAMW, ZK_DTYPE_F32, ZK_DTYPE_F32, true, 1 },
	/*
	 * p=none: no param copy, the daemon's step of fp32 params whose slot is the master
	 * (docs/tiers.md): 28 bytes an element, as torch's fused AdamW moves.
	 */
	{ ZK_OPTIM_ADAMW, ZK_DTYPE_F32, ZK_DTYPE_COUNT, true, 1 },
	{ ZK_OPTIM_ADAM, ZK_DTYPE_BF16, ZK_DTYPE_BF16, false, 1 },
	{ ZK_OPTIM_ADAGRAD, ZK_DTYPE_BF16, ZK_DTYPE_BF16, false, 1 },
	{ ZK_OPTIM_LION, ZK_DTYPE_BF16, ZK_DTYPE_BF16, false, 1 },
};

struct arrays {
	void *base;
	size_t len;
	float *master, *m, *v, *grad, *param;
	double *ta, *tb, *tc;	/* triad */
	size_t n;
};

struct opts {
	size_t sizes[4];
	size_t nsizes;
	int reps;
	bool json;
	int isa;		/* -1: every ISA the CPU has */
	unsigned threads;	/* 0: 1 and 2 */
	bool fp32_only;		/* skip the compressed-state formats */
	bool formats_only;	/* only the formats (and the fp32 step beside them) */
};

static bool first_json = true;

static void report(const struct opts *o, const char *name, double value, const char *unit,
    double limit)
{
	if (o->json) {
		printf("%s\n  {\"name\": \"%s\", \"value\": %.6g, \"unit\": \"%s\", ", first_json ? "[" : ",",
		    name, value, unit);
		if (limit > 0)
			printf("\"limit\": %.6g, \"ratio\": %.4f}", limit, value / limit);
		else
			printf("\"limit\": null, \"ratio\": null}");
		first_json = false;
	} else if (limit > 0) {
		printf("%-44s %9.1f M%-8s limit %9.1f  ratio %.3f\n", name, value / 1e6, unit, limit / 1e6,
		    value / limit);
	} else {
		printf("%-44s %9.2f %s\n", name, value, unit);
	}
	fflush(stdout);
}

/*
 * One mapping for everything.  Arrays sit a few KiB more than their size
 * apart: placed an exact power of two apart they alias in the caches and
 * DRAM banks, which halved bandwidth on the development machine.
 */
static int arrays_new(size_t n, struct arrays *a)
{
	const size_t pad = 4096 + 64;
	size_t bytes = n * sizeof(float), off = 0;
	size_t tri = n * sizeof(double) / 2;	/* triad arrays: n/2 doubles, 2 bytes/param each */
	char *p;

	memset(a, 0, sizeof(*a));
	a->n = n;
	a->len = 5 * (bytes + 6 * pad) + 3 * (tri + 6 * pad);
	p = mmap(NULL, a->len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return -errno;
	madvise(p, a->len, MADV_HUGEPAGE);	/* fewer TLB misses over GiBs; fine if refused */
	a->base = p;
#define PLACE(field, type, size) do { off += pad; a->field = (type *)(void *)(p + off); off += (size); } while (0)
	PLACE(master, float, bytes);
	PLACE(m, float, bytes);
	PLACE(v, float, bytes);
	PLACE(grad, float, bytes);
	PLACE(param, float, bytes);
	PLACE(ta, double, tri);
	PLACE(tb, double, tri);
	PLACE(tc, double, tri);
#undef PLACE
	return 0;
}

static void arrays_fill(struct arrays *a)
{
	uint64_t s = 1;

	for (size_t i = 0; i < a->n; i++) {
		s = s * 6364136223846793005ull + 1442695040888963407ull;
		float r = (float)(s >> 40) * 0x1p-24f - 0.5f;

		a->master[i] = r;
		a->m[i] = r * 1e-2f;
		a->v[i] = r * r * 1e-4f;
		a->param[i] = 0;
	}
	for (size_t i = 0; i < a->n / 2; i++) {
		a->ta[i] = 0;
		a->tb[i] = 1.0;
		a->tc[i] = 2.0;
	}
}

static void fill_grad(struct arrays *a, enum zk_dtype dt)
{
	for (size_t i = 0; i < a->n; i++) {
		float g = (float)((i * 2654435761u) % 2001) * 1e-3f - 1.0f;

		if (dt == ZK_DTYPE_F32)
			a->grad[i] = g;
		else
			((uint16_t *)a->grad)[i] = dt == ZK_DTYPE_BF16 ? zk_f32_to_bf16(g) : zk_f32_to_f16(g);
	}
}

struct triad {
	double *a, *b, *c;
	size_t n;
};

static void triad_slice(void *arg, unsigned idx, unsigned nthreads)
{
	struct triad *t = arg;
	size_t lo = t->n * idx / nthreads, hi = t->n * (idx + 1) / nthreads;

	for (size_t i = lo; i < hi; i++)
		t->a[i] = t->b[i] + 3.0 * t->c[i];
}

/*
 * Compressed state (quant.h) on the headline mix, AdamW with bf16 grad and
 * param: each format's step beside the fp32 step and beside its own
 * memory-only probe (the same bytes: its limit), all interleaved per rep so
 * drift hits them alike.  `<format>/speedup` is that format's step over the
 * fp32 step of the same run.
 */
#define NFMT 3

static int bench_formats(const struct opts *o, struct arrays *a, struct zk_pool *pool,
    unsigned threads)
{
	static const enum zk_state_format fmts[NFMT] = { ZK_STATE_BF16, ZK_STATE_Q8, ZK_STATE_BF16_Q8 };
	const size_t pad = 4096 + 64;
	size_t n = a->n, off[NFMT][4], len = 0;
	struct zk_qtensor qt[NFMT];
	char name[128], *p;
	int r = 0;

	/* master (bf16-master+q8 only: the others share a->master), m, v and the scales of each format */
	for (int f = 0; f < NFMT; f++) {
		size_t sizes[4] = {
			fmts[f] == ZK_STATE_BF16_Q8 ? zk_state_master_bytes(fmts[f], n) : 0,
			zk_state_moment_bytes(fmts[f], n), zk_state_moment_bytes(fmts[f], n),
			2 * sizeof(float) * zk_state_blocks(fmts[f], n),
		};

		for (int k = 0; k < 4; k++) {
			/* Arrays a page and a line apart, as arrays_new places them, against aliasing. */
			len += pad;
			off[f][k] = len;
			len += sizes[k];
		}
	}
	p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return -errno;
	madvise(p, len, MADV_HUGEPAGE);
	fill_grad(a, ZK_DTYPE_BF16);
	for (int f = 0; f < NFMT; f++) {
		qt[f] = (struct zk_qtensor){ .format = fmts[f], .master = a->master, .m = p + off[f][1],
			.v = p + off[f][2], .grad = a->grad, .grad_dtype = ZK_DTYPE_BF16,
			.param = a->param, .param_dtype = ZK_DTYPE_BF16, .n = n };
		if (fmts[f] == ZK_STATE_BF16_Q8)
			qt[f].master_bf16 = (uint16_t *)(void *)(p + off[f][0]);
		if (zk_state_blocks(fmts[f], n)) {
			qt[f].m_scale = (float *)(void *)(p + off[f][3]);
			qt[f].v_scale = qt[f].m_scale + zk_state_blocks(fmts[f], n);
		}
		r = zk_qstate_encode(&qt[f], a->m, a->v);
		if (r == 0 && fmts[f] == ZK_STATE_BF16_Q8)
			r = zk_qstate_master_encode(&qt[f], a->master);
		if (r < 0)
			goto out;
	}
	for (int isa = ZK_ISA_COUNT - 1; isa > ZK_ISA_SCALAR; isa--) {
		struct zk_tensor t = { a->master, a->m, a->v, a->grad, ZK_DTYPE_BF16, a->param,
			ZK_DTYPE_BF16, n };
		struct zk_hparams h = {
			.optim = ZK_OPTIM_ADAMW, .lr = 1e-4, .beta1 = 0.9, .beta2 = 0.999,
			.eps = 1e-8, .weight_decay = 0.01, .step = 1, .bias_correction = true,
			.grad_scale = 1, .clip_coef = 1,
		};
		double b32 = 1e30, m32 = 1e30, bq[NFMT], mq[NFMT];

		if (!zk_isa_supported((enum zk_isa)isa) || (o->isa >= 0 && isa != o->isa))
			continue;
		for (int f = 0; f < NFMT; f++)
			bq[f] = mq[f] = 1e30;
		for (int rep = 0; rep < o->reps; rep++) {
			double t0 = bench_now();

			r = zk_pool_memonly(pool, (enum zk_isa)isa, &t, 1);
			double t1 = bench_now();
			if (r == 0)
				r = zk_pool_step(pool, (enum zk_isa)isa, &h, &t, 1);
			double t2 = bench_now();
			if (r < 0)
				goto out;
			m32 = t1 - t0 < m32 ? t1 - t0 : m32;
			b32 = t2 - t1 < b32 ? t2 - t1 : b32;
			for (int f = 0; f < NFMT; f++) {
				t0 = bench_now();
				r = zk_pool_qmemonly(pool, (enum zk_isa)isa, &qt[f], 1);
				t1 = bench_now();
				if (r == 0)
					r = zk_pool_qstep(pool, (enum zk_isa)isa, &h, &qt[f], 1);
				t2 = bench_now();
				if (r < 0)
					goto out;
				mq[f] = t1 - t0 < mq[f] ? t1 - t0 : mq[f];
				bq[f] = t2 - t1 < bq[f] ? t2 - t1 : bq[f];
			}
			h.step++;
		}
		snprintf(name, sizeof(name), "fp32/adamw/%s/g=bf16/p=bf16/t=%u/n=%zuM",
		    zk_isa_name((enum zk_isa)isa), threads, n >> 20);
		report(o, name, (double)n / b32, "params/s", (double)n / m32);
		for (int f = 0; f < NFMT; f++) {
			const char *fn = zk_state_format_name(fmts[f]);

			snprintf(name, sizeof(name), "%s/adamw/%s/g=bf16/p=bf16/t=%u/n=%zuM", fn,
			    zk_isa_name((enum zk_isa)isa), threads, n >> 20);
			report(o, name, (double)n / bq[f], "params/s", (double)n / mq[f]);
			snprintf(name, sizeof(name), "%s/speedup/%s/t=%u/n=%zuM", fn,
			    zk_isa_name((enum zk_isa)isa), threads, n >> 20);
			report(o, name, (double)n / bq[f], "params/s", (double)n / b32);
		}
	}
out:
	munmap(p, len);
	return r;
}

static int bench_size(const struct opts *o, size_t n)
{
	struct arrays a;
	char name[128];
	int r;

	r = arrays_new(n, &a);
	if (r < 0)
		return r;
	arrays_fill(&a);
	for (unsigned threads = 1; threads <= 2; threads++) {
		struct zk_pool *pool;
		struct triad tr = { a.ta, a.tb, a.tc, n / 2 };
		double best = 1e30;

		if (o->threads && threads != o->threads)
			continue;
		r = zk_pool_new(threads, NULL, 0, &pool);
		if (r < 0)
			goto out;
		/* STREAM triad for context: 24 bytes per element as STREAM counts them. */
		for (int rep = 0; rep < o->reps; rep++) {
			double t0 = bench_now();

			zk_pool_run(pool, triad_slice, &tr);
			double dt = bench_now() - t0;
			best = dt < best ? dt : best;
		}
		snprintf(name, sizeof(name), "triad/t=%u/n=%zuM", threads, n >> 20);
		report(o, name, 24.0 * (double)tr.n / best / 1e9, "GB/s", 0);

		for (size_t mi = 0; mi < sizeof(mixes) / sizeof(mixes[0]) && !o->formats_only; mi++) {
			const struct mix *mx = &mixes[mi];

			fill_grad(&a, mx->grad);
			for (int isa = ZK_ISA_COUNT - 1; isa >= 0; isa--) {
				bool none = mx->param == ZK_DTYPE_COUNT;
				struct zk_tensor t = { a.master, a.m, a.v, a.grad, mx->grad,
					none ? NULL : a.param, none ? ZK_DTYPE_F32 : mx->param, n };
				struct zk_hparams h = {
					.optim = mx->optim, .lr = 1e-4, .beta1 = 0.9, .beta2 = 0.999,
					.eps = 1e-8, .weight_decay = 0.01, .step = mx->step0,
					.bias_correction = true, .grad_scale = 1, .clip_coef = 1,
				};
				/*
				 * The scalar reference has no streaming stores of its own worth
				 * measuring: its limit is the best ISA's probe, i.e. the machine's.
				 */
				enum zk_isa probe = isa == ZK_ISA_SCALAR ? zk_isa_best() : (enum zk_isa)isa;
				double bs = 1e30, bm = 1e30;

				if (!zk_isa_supported((enum zk_isa)isa) || (o->isa >= 0 && isa != o->isa))
					continue;
				if (!mx->all_isas && isa != (int)zk_isa_best())
					continue;
				/* The scalar reference is not a throughput target: only the headline mix. */
				if (isa == ZK_ISA_SCALAR && mi != 0)
					continue;
				if (mx->optim == ZK_OPTIM_ADAGRAD || mx->optim == ZK_OPTIM_LION)
					t.v = NULL;
				/* Interleave step and probe so drift (other jobs on the box) hits both alike. */
				for (int rep = 0; rep < o->reps; rep++) {
					double t0 = bench_now();

					r = zk_pool_memonly(pool, probe, &t, 1);
					double t1 = bench_now();
					if (r == 0)
						r = zk_pool_step(pool, (enum zk_isa)isa, &h, &t, 1);
					double t2 = bench_now();
					if (r < 0) {
						zk_pool_free(pool);
						goto out;
					}
					bm = t1 - t0 < bm ? t1 - t0 : bm;
					bs = t2 - t1 < bs ? t2 - t1 : bs;
					h.step++;
				}
				snprintf(name, sizeof(name), "%s/%s/g=%s/p=%s/t=%u/n=%zuM%s",
				    zk_optim_name(mx->optim), zk_isa_name((enum zk_isa)isa),
				    zk_dtype_name(mx->grad), none ? "none" : zk_dtype_name(mx->param),
				    threads, n >> 20,
				    mx->step0 > 1 ? "/late" : "");
				report(o, name, (double)n / bs, "params/s", (double)n / bm);
			}
		}
		if (!o->fp32_only) {
			r = bench_formats(o, &a, pool, threads);
			if (r < 0) {
				zk_pool_free(pool);
				goto out;
			}
		}
		zk_pool_free(pool);
	}
out:
	munmap(a.base, a.len);
	return r;
}

static int parse_size(const char *s, size_t *ret)
{
	char *end;
	unsigned long long v = strtoull(s, &end, 10);

	if (end == s)
		return -EINVAL;
	if (*end == 'M' || *end == 'm')
		v <<= 20, end++;
	else if (*end == 'K' || *end == 'k')
		v <<= 10, end++;
	if (*end || v < 1024)
		return -EINVAL;
	*ret = (size_t)v;
	return 0;
}

int main(int argc, char **argv)
{
	struct opts o = { .reps = 5, .isa = -1 };

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--json")) {
			o.json = true;
		} else if (!strcmp(argv[i], "--size") && i + 1 < argc && o.nsizes < 4) {
			if (parse_size(argv[++i], &o.sizes[o.nsizes++]) < 0) {
				fprintf(stderr, "bad --size %s (e.g. 16M)\n", argv[i]);
				return 2;
			}
		} else if (!strcmp(argv[i], "--isa") && i + 1 < argc) {
			enum zk_isa isa;

			if (zk_isa_parse(argv[++i], &isa) < 0) {
				fprintf(stderr, "bad --isa %s\n", argv[i]);
				return 2;
			}
			o.isa = (int)isa;
		} else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
			o.threads = (unsigned)atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--formats")) {
			o.formats_only = true;
		} else if (!strcmp(argv[i], "--no-formats")) {
			o.fp32_only = true;
		} else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
			o.reps = atoi(argv[++i]);
			if (o.reps < 1)
				o.reps = 1;
		} else {
			fprintf(stderr, "usage: %s [--size N[K|M]]... [--isa NAME] [--threads 1|2] [--reps N] [--formats|--no-formats] [--json]\n", argv[0]);
			return 2;
		}
	}
	if (!o.nsizes) {
		o.sizes[0] = 16u << 20;
		o.sizes[1] = 256u << 20;
		o.nsizes = 2;
	}
	if (!o.json)
		printf("best of %d; figure and limit in M params/s (limit: memory-only kernel, same bytes, same stores)\n",
		    o.reps);
	for (size_t i = 0; i < o.nsizes; i++) {
		int r = bench_size(&o, o.sizes[i]);

		if (r < 0) {
			fprintf(stderr, "bench_optimizer: size %zu: %s\n", o.sizes[i], strerror(-r));
			return 1;
		}
	}
	if (o.json)
		printf("%s]\n", first_json ? "[" : "\n");
	return 0;
}
