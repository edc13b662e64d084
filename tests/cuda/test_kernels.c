/* GPU kernels against the CPU reference: casts bit for bit, unscale/norm vs double, flatten round trip. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "optim.h"
#include "zk_cuda.h"

#define CUDA_OK(call) do {						\
	cudaError_t e_ = (call);					\
	cr_assert_eq(e_, cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_)); \
} while (0)

static uint64_t rng = 0x2545f4914f6cdd1dull;

static uint32_t
rnd32(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (uint32_t)(rng >> 32);
}

static float
bits_f32(uint32_t u)
{
	float f;

	memcpy(&f, &u, sizeof(f));
	return f;
}

static void *
dev_copy(const void *host, size_t bytes)
{
	void *d = NULL;

	CUDA_OK(cudaMalloc(&d, bytes ? bytes : 1));
	if (bytes)
		CUDA_OK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
	return d;
}

static void
host_copy(void *host, const void *dev, size_t bytes)
{
	CUDA_OK(cudaDeviceSynchronize());
	CUDA_OK(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
}

/* Random floats of every kind: ordinary, ties, subnormal, huge, inf, NaN with payloads. */
static float *
make_floats(size_t n)
{
	float *x = malloc(n * sizeof(*x));

	cr_assert_not_null(x);
	for (size_t i = 0; i < n; i++) {
		uint32_t r = rnd32();

		switch (i % 8) {
		case 0:
			x[i] = bits_f32(r);			/* any bit pattern */
			break;
		case 1:
			x[i] = bits_f32((r & 0x807fffffu) | (uint32_t)(100 + i % 60) << 23);
			break;
		case 2:
			x[i] = bits_f32((r & 0xffff0000u) | 0x8000u);	/* bf16 tie */
			break;
		case 3:
			x[i] = bits_f32((r & 0xffffe000u) | 0x1000u);	/* f16 tie region */
			break;
		case 4:
			x[i] = bits_f32(r & 0x807fffffu);	/* f32 subnormal */
			break;
		case 5:
			x[i] = bits_f32(0x7f800000u | (r & 0x807fffffu));	/* inf/NaN */
			break;
		default:
			x[i] = ((float)(r >> 8) / 16777216.0f - 0.5f) * 70000.0f;
			break;
		}
	}
	return x;
}

Test(cast, f32_to_bf16_and_f16_match_cpu)
{
	const size_t n = 1 << 20;
	float *x = make_floats(n);
	uint16_t *got = malloc(n * 2);
	void *dx = dev_copy(x, n * 4), *dy = NULL;

	CUDA_OK(cudaMalloc(&dy, n * 2));
	cr_assert_eq(zkc_cast(dx, ZK_DTYPE_F32, dy, ZK_DTYPE_BF16, n, NULL), 0);
	host_copy(got, dy, n * 2);
	for (size_t i = 0; i < n; i++)
		cr_assert_eq(got[i], zk_f32_to_bf16(x[i]), "bf16 [%zu] %08x: %04x vs %04x", i,
		    *(uint32_t *)&x[i], got[i], zk_f32_to_bf16(x[i]));
	cr_assert_eq(zkc_cast(dx, ZK_DTYPE_F32, dy, ZK_DTYPE_F16, n, NULL), 0);
	host_copy(got, dy, n * 2);
	for (size_t i = 0; i < n; i++)
		cr_assert_eq(got[i], zk_f32_to_f16(x[i]), "f16 [%zu] %08x: %04x vs %04x", i,
		    *(uint32_t *)&x[i], got[i], zk_f32_to_f16(x[i]));
	cudaFree(dx);
	cudaFree(dy);
	free(x);
	free(got);
}

Test(cast, every_half_value_both_ways)
{
	const size_t n = 65536;
	uint16_t *h = malloc(n * 2), *back = malloc(n * 2);
	uint32_t *f = malloc(n * 4);
	void *dh, *df, *db;

	for (size_t i = 0; i < n; i++)
		h[i] = (uint16_t)i;
	dh = dev_copy(h, n * 2);
	CUDA_OK(cudaMalloc(&df, n * 4));
	CUDA_OK(cudaMalloc(&db, n * 2));
	/* bf16 -> f32 -> bf16, and bf16 -> f16 through the same conversions as the CPU. */
	cr_assert_eq(zkc_cast(dh, ZK_DTYPE_BF16, df, ZK_DTYPE_F32, n, NULL), 0);
	host_copy(f, df, n * 4);
	for (size_t i = 0; i < n; i++) {
		float ref = zk_bf16_to_f32(h[i]);

		cr_assert_eq(memcmp(&f[i], &ref, 4), 0, "bf16 %04zx", i);
	}
	cr_assert_eq(zkc_cast(dh, ZK_DTYPE_BF16, db, ZK_DTYPE_F16, n, NULL), 0);
	host_copy(back, db, n * 2);
	for (size_t i = 0; i < n; i++)
		cr_assert_eq(back[i], zk_f32_to_f16(zk_bf16_to_f32(h[i])), "bf16->f16 %04zx", i);
	cr_assert_eq(zkc_cast(dh, ZK_DTYPE_F16, df, ZK_DTYPE_F32, n, NULL), 0);
	host_copy(f, df, n * 4);
	for (size_t i = 0; i < n; i++) {
		float ref = zk_f16_to_f32(h[i]);

		cr_assert_eq(memcmp(&f[i], &ref, 4), 0, "f16 %04zx", i);
	}
	/* f16 -> f32 -> f16 as the CPU does it: identity except that signalling NaNs get quiet. */
	cr_assert_eq(zkc_cast(df, ZK_DTYPE_F32, db, ZK_DTYPE_F16, n, NULL), 0);
	host_copy(back, db, n * 2);
	for (size_t i = 0; i < n; i++)
		cr_assert_eq(back[i], zk_f32_to_f16(zk_f16_to_f32(h[i])), "f16 round trip %04zx", i);
	/* In place between the two 16-bit types. */
	cr_assert_eq(zkc_cast(db, ZK_DTYPE_F16, db, ZK_DTYPE_BF16, n, NULL), 0);
	host_copy(back, db, n * 2);
	for (size_t i = 0; i < n; i++)
		cr_assert_eq(back[i], zk_f32_to_bf16(zk_f16_to_f32(h[i])), "f16->bf16 %04zx", i);
	cudaFree(dh);
	cudaFree(df);
	cudaFree(db);
	free(h);
	free(back);
	free(f);
}

/* Host copies of one gradient list in a dtype, and the double reference of its statistics. */
struct glist {
	size_t n;
	uint64_t *numel;
	void **host, **dev;
	double sumsq;
	unsigned long long nonfinite;
};

static void
glist_make(struct glist *g, size_t n, enum zk_dtype dt, float inv_scale, bool with_inf)
{
	size_t es = zk_dtype_size(dt);

	g->n = n;
	g->numel = calloc(n, sizeof(*g->numel));
	g->host = calloc(n, sizeof(void *));
	g->dev = calloc(n, sizeof(void *));
	g->sumsq = 0;
	g->nonfinite = 0;
	for (size_t t = 0; t < n; t++) {
		/* Empty, tiny, odd, and one big tensor that needs the grid-stride loop. */
		uint64_t m = t % 7 == 3 ? 0 : t == 1 ? (1u << 21) + 3 : 1 + rnd32() % 5000;

		g->numel[t] = m;
		g->host[t] = malloc(m * es + 1);
		for (uint64_t i = 0; i < m; i++) {
			float v = ((float)(rnd32() >> 8) / 16777216.0f - 0.5f) * 64.0f;

			if (with_inf && t == 2 && i == m / 2)
				v = i % 2 ? INFINITY : NAN;
			if (dt == ZK_DTYPE_F32)
				((float *)g->host[t])[i] = v;
			else if (dt == ZK_DTYPE_BF16)
				((uint16_t *)g->host[t])[i] = zk_f32_to_bf16(v);
			else
				((uint16_t *)g->host[t])[i] = zk_f32_to_f16(v);
		}
		g->dev[t] = dev_copy(g->host[t], m * es);
		struct zk_grad_stats st = { 0 };
		/* The daemon's own gradient pass is the reference, in double. */
		cr_assert_eq(zk_grad_check(ZK_ISA_SCALAR, g->host[t], dt, 1.0 / inv_scale, 0, m,
		    &st), 0);
		g->sumsq += st.sumsq;
		g->nonfinite += st.nonfinite;
	}
}

static void
glist_free(struct glist *g)
{
	for (size_t t = 0; t < g->n; t++) {
		cudaFree(g->dev[t]);
		free(g->host[t]);
	}
	free(g->numel);
	free(g->host);
	free(g->dev);
}

static void
check_unscale(enum zk_dtype dt, bool with_inf)
{
	/* More tensors than one launch carries. */
	const size_t n = 113;
	const float inv_scale = 1.0f / 1024.0f;
	struct zkc_grad_stats got, *dstats;
	struct glist g;

	glist_make(&g, n, dt, inv_scale, with_inf);
	CUDA_OK(cudaMalloc((void **)&dstats, sizeof(*dstats)));
	CUDA_OK(cudaMemset(dstats, 0, sizeof(*dstats)));
	cr_assert_eq(zkc_unscale_norm(g.dev, g.numel, n, dt, inv_scale, true, dstats, NULL), 0);
	host_copy(&got, dstats, sizeof(got));
	cr_assert_eq(got.nonfinite, g.nonfinite);
	if (with_inf) {
		cr_assert(!isfinite(got.sumsq));
	} else {
		/* Only the order of the double additions differs. */
		cr_assert(fabs(got.sumsq - g.sumsq) <= 1e-12 * g.sumsq, "sumsq %.17g vs %.17g",
		    got.sumsq, g.sumsq);
	}
	/* Written back: each element is the CPU's conversion of the float product. */
	size_t es = zk_dtype_size(dt);
	for (size_t t = 0; t < n; t++) {
		uint64_t m = g.numel[t];
		void *back = malloc(m * es + 1);

		host_copy(back, g.dev[t], m * es);
		for (uint64_t i = 0; i < m; i++) {
			if (dt == ZK_DTYPE_F32) {
				float want = ((float *)g.host[t])[i] * inv_scale;
				float have = ((float *)back)[i];

				cr_assert(memcmp(&want, &have, 4) == 0 || (isnan(want) && isnan(have)));
			} else {
				/* NaN * x is a canonical NaN on the GPU, the input NaN on x86: NaN-ness is what counts. */
				bool bf = dt == ZK_DTYPE_BF16;
				uint16_t in = ((uint16_t *)g.host[t])[i], have = ((uint16_t *)back)[i];
				float prod = (bf ? zk_bf16_to_f32(in) : zk_f16_to_f32(in)) * inv_scale;
				uint16_t want = bf ? zk_f32_to_bf16(prod) : zk_f32_to_f16(prod);
				uint16_t expo = bf ? 0x7f80u : 0x7c00u;

				if (isnan(prod))
					cr_assert((have & expo) == expo && (have & ~expo & 0x7fffu) != 0);
				else
					cr_assert_eq(have, want);
			}
		}
		free(back);
	}
	cudaFree(dstats);
	glist_free(&g);
}

Test(unscale, f32_matches_reference) { check_unscale(ZK_DTYPE_F32, false); }
Test(unscale, bf16_matches_reference) { check_unscale(ZK_DTYPE_BF16, false); }
Test(unscale, f16_matches_reference) { check_unscale(ZK_DTYPE_F16, false); }
Test(unscale, counts_inf_and_nan) { check_unscale(ZK_DTYPE_BF16, true); }

Test(unscale, check_only_leaves_gradients)
{
	struct zkc_grad_stats got, *dstats;
	struct glist g;
	uint16_t *back;

	glist_make(&g, 3, ZK_DTYPE_BF16, 0.5f, false);
	CUDA_OK(cudaMalloc((void **)&dstats, sizeof(*dstats)));
	CUDA_OK(cudaMemset(dstats, 0, sizeof(*dstats)));
	cr_assert_eq(zkc_unscale_norm(g.dev, g.numel, 3, ZK_DTYPE_BF16, 0.5f, false, dstats, NULL),
	    0);
	host_copy(&got, dstats, sizeof(got));
	cr_assert(fabs(got.sumsq - g.sumsq) <= 1e-12 * g.sumsq);
	back = malloc(g.numel[1] * 2);
	host_copy(back, g.dev[1], g.numel[1] * 2);
	cr_assert_eq(memcmp(back, g.host[1], g.numel[1] * 2), 0);
	free(back);
	cudaFree(dstats);
	glist_free(&g);
}

static void
check_flatten(size_t es)
{
	const size_t n = 150;
	uint64_t numel[150], total = 0;
	void *host[150], *dev[150], *out[150];
	unsigned char *flat_host, *flat_back;
	void *flat;

	for (size_t t = 0; t < n; t++) {
		numel[t] = t % 11 == 5 ? 0 : t == 7 ? 300001 : 1 + rnd32() % 3000;
		host[t] = malloc(numel[t] * es + 1);
		for (uint64_t i = 0; i < numel[t] * es; i++)
			((unsigned char *)host[t])[i] = (unsigned char)rnd32();
		dev[t] = dev_copy(host[t], numel[t] * es);
		CUDA_OK(cudaMalloc(&out[t], numel[t] * es + 1));
		total += numel[t];
	}
	flat_host = malloc(total * es);
	flat_back = malloc(total * es);
	for (size_t t = 0, off = 0; t < n; off += numel[t] * es, t++)
		memcpy(flat_host + off, host[t], numel[t] * es);
	CUDA_OK(cudaMalloc(&flat, total * es));
	cr_assert_eq(zkc_flatten(flat, (const void *const *)dev, numel, n, es, NULL), 0);
	host_copy(flat_back, flat, total * es);
	cr_assert_eq(memcmp(flat_back, flat_host, total * es), 0);
	cr_assert_eq(zkc_unflatten(flat, out, numel, n, es, NULL), 0);
	for (size_t t = 0; t < n; t++) {
		void *back = malloc(numel[t] * es + 1);

		host_copy(back, out[t], numel[t] * es);
		cr_assert_eq(memcmp(back, host[t], numel[t] * es), 0, "tensor %zu", t);
		free(back);
		cudaFree(dev[t]);
		cudaFree(out[t]);
		free(host[t]);
	}
	cudaFree(flat);
	free(flat_host);
	free(flat_back);
}

Test(flatten, round_trip_16bit) { check_flatten(2); }
Test(flatten, round_trip_32bit) { check_flatten(4); }
