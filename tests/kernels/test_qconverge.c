/*
 * Quality of the compressed state: a small MLP trained with AdamW on fp32
 * state, bf16-moments, q8-moments, bf16-master+q8 and the published
 * blockwise dynamic 8-bit quantization (Dettmers et al. 2022), all from the
 * same start on the same batches.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "helpers.h"
#include "quant.h"

/* 64 -> 192 (tanh) -> 8, regression on a random teacher of the same shape plus noise. */
#define NIN 64
#define NHID 192
#define NOUT 8
#define NPARAM (NHID * NIN + NHID + NOUT * NHID + NOUT)
#define NDATA 4096
#define BATCH 64
#define STEPS 500

struct data {
	float x[NDATA][NIN], y[NDATA][NOUT];
};

static void init_params(float *w, struct rng *r, float gain)
{
	float a1 = gain * sqrtf(3.0f / NIN), a2 = gain * sqrtf(3.0f / NHID);
	size_t i = 0;

	for (; i < NHID * NIN; i++)
		w[i] = rng_float(r, -a1, a1);
	for (; i < NHID * NIN + NHID; i++)
		w[i] = rng_float(r, -0.1f, 0.1f);
	for (; i < NPARAM; i++)
		w[i] = rng_float(r, -a2, a2);
}

static void forward(const float *w, const float *x, float *h, float *y)
{
	const float *w1 = w, *b1 = w + NHID * NIN, *w2 = b1 + NHID, *b2 = w2 + NOUT * NHID;

	for (int j = 0; j < NHID; j++) {
		float z = b1[j];

		for (int i = 0; i < NIN; i++)
			z += w1[j * NIN + i] * x[i];
		h[j] = tanhf(z);
	}
	for (int o = 0; o < NOUT; o++) {
		y[o] = b2[o];
		for (int j = 0; j < NHID; j++)
			y[o] += w2[o * NHID + j] * h[j];
	}
}

/* Mean squared error over samples [b, b + n); its gradient into g when g is not NULL. */
static double mlp(const float *w, const struct data *d, size_t b, size_t n, float *g)
{
	const float *w2 = w + NHID * NIN + NHID;
	double loss = 0;

	if (g)
		memset(g, 0, NPARAM * sizeof(float));
	for (size_t s = b; s < b + n; s++) {
		float h[NHID], y[NOUT], dy[NOUT];

		forward(w, d->x[s], h, y);
		for (int o = 0; o < NOUT; o++) {
			loss += (double)(y[o] - d->y[s][o]) * (y[o] - d->y[s][o]);
			dy[o] = 2.0f * (y[o] - d->y[s][o]) / (float)(n * NOUT);
		}
		if (!g)
			continue;
		float *g1 = g, *gb1 = g + NHID * NIN, *g2 = gb1 + NHID, *gb2 = g2 + NOUT * NHID;

		for (int o = 0; o < NOUT; o++) {
			gb2[o] += dy[o];
			for (int j = 0; j < NHID; j++)
				g2[o * NHID + j] += dy[o] * h[j];
		}
		for (int j = 0; j < NHID; j++) {
			float dh = 0;

			for (int o = 0; o < NOUT; o++)
				dh += w2[o * NHID + j] * dy[o];
			dh *= 1.0f - h[j] * h[j];
			gb1[j] += dh;
			for (int i = 0; i < NIN; i++)
				g1[j * NIN + i] += dh * d->x[s][i];
		}
	}
	return loss / (double)(n * NOUT);
}

/* y = teacher(x) + uniform noise of std 0.05 */
static void make_data(struct data *d, uint64_t seed)
{
	static float teacher[NPARAM];
	struct rng r = { seed };
	float h[NHID];

	init_params(teacher, &r, 2.0f);
	for (int s = 0; s < NDATA; s++) {
		for (int i = 0; i < NIN; i++)
			d->x[s][i] = rng_float(&r, -1, 1);
		forward(teacher, d->x[s], h, d->y[s]);
		for (int o = 0; o < NOUT; o++)
			d->y[s][o] += rng_float(&r, -0.0866f, 0.0866f);
	}
}

/*
 * bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8):
 * for i in 0..6, 2^i (signed) or 2^(i+1) (unsigned) midpoints of
 * linspace(0.1, 1) scaled by 10^(i-6), mirrored when signed, plus 0 and 1.
 */
static void dynamic_map(bool is_signed, float map[256])
{
	size_t k = 0;

	for (int i = 0; i < 7; i++) {
		int items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;

		for (int j = 0; j + 1 < items; j++) {
			double lo = 0.1 + 0.9 * j / (items - 1), hi = 0.1 + 0.9 * (j + 1) / (items - 1);
			double v = pow(10.0, i - 6) * (lo + hi) / 2;

			map[k++] = (float)v;
			if (is_signed)
				map[k++] = (float)-v;
		}
	}
	map[k++] = 0;
	map[k++] = 1;
	cr_assert_eq(k, 256);
	for (size_t a = 1; a < 256; a++)	/* sort */
		for (size_t b = a; b > 0 && map[b - 1] > map[b]; b--) {
			float t = map[b];

			map[b] = map[b - 1];
			map[b - 1] = t;
		}
}

/* The published encoder: a binary search of the sorted map, then the nearer neighbour. */
static uint8_t dyn_quantize(const float map[256], float x)
{
	int lo = 0, hi = 255;

	while (lo < hi) {
		int mid = (lo + hi) / 2;

		if (map[mid] < x)
			lo = mid + 1;
		else
			hi = mid;
	}
	if (lo > 0 && fabsf(x - map[lo - 1]) <= fabsf(map[lo] - x))
		lo--;
	return (uint8_t)lo;
}

#define DYN_BLOCK 2048

/* 8-bit blockwise AdamW as bitsandbytes' AdamW8bit: new moments in fp32 for the update, then absmax-scaled codes. */
struct dyn_state {
	float smap[256], umap[256];
	uint8_t c1[NPARAM], c2[NPARAM];
	float a1[NPARAM / DYN_BLOCK + 1], a2[NPARAM / DYN_BLOCK + 1];
};

static void dyn_step(struct dyn_state *st, const struct zk_hparams *h, float *p, const float *g)
{
	float bc1 = (float)(1 - pow(h->beta1, (double)h->step));
	float bc2 = (float)sqrt(1 - pow(h->beta2, (double)h->step));

	for (size_t b = 0; b < NPARAM; b += DYN_BLOCK) {
		size_t e = b + DYN_BLOCK < NPARAM ? b + DYN_BLOCK : NPARAM, k = b / DYN_BLOCK;
		static float s1[DYN_BLOCK], s2[DYN_BLOCK];
		float m1 = 0, m2 = 0;

		for (size_t i = b; i < e; i++) {
			float m = st->smap[st->c1[i]] * st->a1[k], v = st->umap[st->c2[i]] * st->a2[k];

			m = m * (float)h->beta1 + (float)(1 - h->beta1) * g[i];
			v = v * (float)h->beta2 + (float)(1 - h->beta2) * g[i] * g[i];
			p[i] *= (float)(1 - h->lr * h->weight_decay);
			p[i] -= (float)h->lr / bc1 * m / (sqrtf(v) / bc2 + (float)h->eps);
			s1[i - b] = m;
			s2[i - b] = v;
			m1 = fmaxf(m1, fabsf(m));
			m2 = fmaxf(m2, v);
		}
		st->a1[k] = m1;
		st->a2[k] = m2;
		for (size_t i = b; i < e; i++) {
			st->c1[i] = dyn_quantize(st->smap, m1 > 0 ? s1[i - b] / m1 : 0);
			st->c2[i] = dyn_quantize(st->umap, m2 > 0 ? s2[i - b] / m2 : 0);
		}
	}
}

enum run { RUN_FP32, RUN_BF16, RUN_Q8, RUN_DYN, RUN_BF16Q8, RUN_COUNT };
static const char *const run_names[RUN_COUNT] = {
	"fp32", "bf16-moments", "q8-moments", "dynamic-8bit", "bf16-master+q8",
};

static double train(enum run run, const struct data *d, uint64_t seed)
{
	static float w[NPARAM], g[NPARAM], m[NPARAM], v[NPARAM];
	static uint16_t m16[NPARAM], v16[NPARAM];
	static uint8_t m8[NPARAM], v8[NPARAM];
	static uint16_t w16[NPARAM];
	static float ms[NPARAM / ZK_Q8_BLOCK + 1], vs[NPARAM / ZK_Q8_BLOCK + 1];
	static struct dyn_state dyn;
	struct zk_hparams h = {
		.optim = ZK_OPTIM_ADAMW, .lr = 3e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
		.weight_decay = 0.01, .step = 1, .bias_correction = true, .grad_scale = 1, .clip_coef = 1,
	};
	struct zk_tensor ft = { w, m, v, g, ZK_DTYPE_F32, NULL, ZK_DTYPE_F32, NPARAM };
	struct zk_qtensor qt = { .format = run == RUN_BF16 ? ZK_STATE_BF16 : ZK_STATE_Q8, .master = w,
		.m = run == RUN_BF16 ? (void *)m16 : (void *)m8, .v = run == RUN_BF16 ? (void *)v16 : (void *)v8,
		.m_scale = run == RUN_BF16 ? NULL : ms, .v_scale = run == RUN_BF16 ? NULL : vs,
		.grad = g, .grad_dtype = ZK_DTYPE_F32, .n = NPARAM };
	struct rng r = { seed ^ 0x5eed };

	init_params(w, &r, 1.0f);
	if (run == RUN_BF16Q8) {
		/* Master in bf16 (rounded to nearest from the same start); the model reads param, its value. */
		qt.format = ZK_STATE_BF16_Q8;
		qt.master_bf16 = w16;
		qt.param = w;
		qt.param_dtype = ZK_DTYPE_F32;
		cr_assert_eq(zk_qstate_master_encode(&qt, w), 0);
		cr_assert_eq(zk_qstate_master_decode(&qt, w), 0);
	}
	memset(m, 0, sizeof(m));
	memset(v, 0, sizeof(v));
	memset(m16, 0, sizeof(m16));
	memset(v16, 0, sizeof(v16));
	memset(m8, 0, sizeof(m8));
	memset(v8, 0, sizeof(v8));
	memset(ms, 0, sizeof(ms));
	memset(vs, 0, sizeof(vs));
	dynamic_map(true, dyn.smap);
	dynamic_map(false, dyn.umap);
	/* Code of 0 in each map, with zero scales: the zero state. */
	memset(dyn.c1, dyn_quantize(dyn.smap, 0), sizeof(dyn.c1));
	memset(dyn.c2, dyn_quantize(dyn.umap, 0), sizeof(dyn.c2));
	memset(dyn.a1, 0, sizeof(dyn.a1));
	memset(dyn.a2, 0, sizeof(dyn.a2));
	for (int s = 0; s < STEPS; s++, h.step++) {
		/* Linear decay to a tenth: the end compares settled models, not points on a slope. */
		h.lr = 3e-3 * (1.0 - 0.9 * s / STEPS);
		mlp(w, d, (size_t)(s * BATCH) % NDATA, BATCH, g);
		if (run == RUN_FP32)
			cr_assert_eq(zk_step(zk_isa_best(), &h, &ft, 0, NPARAM), 0);
		else if (run == RUN_DYN)
			dyn_step(&dyn, &h, w, g);
		else
			cr_assert_eq(zk_qstep(zk_isa_best(), &h, &qt, 0, NPARAM), 0);
	}
	return mlp(w, d, 0, NDATA, NULL);
}

/*
 * Seeds 1 and 2 (data, teacher and start), 500 AdamW steps each.  Passes
 * when bf16-moments, q8-moments and bf16-master+q8 end within 2% of fp32
 * state's loss and q8-moments within 2% of the dynamic map's (or below it).
 */
Test(qconverge, mlp_adamw_vs_fp32_and_dynamic_map, .timeout = 120)
{
	static struct data d;

	if (!test_general_enabled())
		cr_skip_test("ISA-independent");
	for (uint64_t seed = 1; seed <= 2; seed++) {
		double loss[RUN_COUNT], init;
		static float w0[NPARAM];
		struct rng r = { seed ^ 0x5eed };

		make_data(&d, seed);
		init_params(w0, &r, 1.0f);
		init = mlp(w0, &d, 0, NDATA, NULL);
		for (int k = 0; k < RUN_COUNT; k++)
			loss[k] = train((enum run)k, &d, seed);
		fprintf(stderr, "qconverge seed %llu: loss at start %.6f", (unsigned long long)seed, init);
		for (int k = 0; k < RUN_COUNT; k++)
			fprintf(stderr, ", %s %.6f", run_names[k], loss[k]);
		fprintf(stderr, "\n");
		/* Training did something: the comparison is not between untrained models. */
		cr_assert(loss[RUN_FP32] < 0.5 * init, "seed %llu: fp32 loss %g from %g",
		    (unsigned long long)seed, loss[RUN_FP32], init);
		cr_assert(fabs(loss[RUN_BF16] - loss[RUN_FP32]) <= 0.02 * loss[RUN_FP32],
		    "seed %llu: bf16-moments %g vs fp32 %g", (unsigned long long)seed, loss[RUN_BF16], loss[RUN_FP32]);
		cr_assert(fabs(loss[RUN_Q8] - loss[RUN_FP32]) <= 0.02 * loss[RUN_FP32],
		    "seed %llu: q8-moments %g vs fp32 %g", (unsigned long long)seed, loss[RUN_Q8], loss[RUN_FP32]);
		cr_assert(fabs(loss[RUN_BF16Q8] - loss[RUN_FP32]) <= 0.02 * loss[RUN_FP32],
		    "seed %llu: bf16-master+q8 %g vs fp32 %g", (unsigned long long)seed, loss[RUN_BF16Q8],
		    loss[RUN_FP32]);
		cr_assert(loss[RUN_Q8] <= 1.02 * loss[RUN_DYN],
		    "seed %llu: q8-moments %g vs dynamic map %g", (unsigned long long)seed, loss[RUN_Q8], loss[RUN_DYN]);
	}
}
