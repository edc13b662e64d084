/*
 * Compressed state formats through the engine: on either tier a tensor steps
 * exactly as the kernel run directly on the same data (the tiers add
 * nothing), stores and charges the compressed bytes, and its fp32 reads and
 * writes are the format's decode and encode.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "quant.h"
#include "swap.h"
#include "swap_helpers.h"

struct seen {
	unsigned step_done;
	unsigned io_done;
	struct ze_step_result step;
	int io_result;
};

static void
cb_tensor_done(void *arg, uint32_t lane, uint64_t id, void *user,
    const struct ze_tensor_result *r)
{
}

static void
cb_step_done(void *arg, uint32_t lane, uint64_t id, const struct ze_step_result *r)
{
	struct seen *s = arg;

	s->step_done++;
	s->step = *r;
}

static void
cb_io_done(void *arg, uint32_t lane, uint64_t id, enum ze_io kind, void *user, int result)
{
	struct seen *s = arg;

	s->io_done++;
	s->io_result = result;
}

static void
cb_param_ready(void *arg, uint32_t lane, uint64_t id, void *user, int result)
{
}

static void
cb_grad_done(void *arg, uint32_t lane, uint64_t id, int result, const struct ze_grad_partial *p)
{
}

static const struct ze_callbacks callbacks = {
	.grad_done = cb_grad_done,
	.tensor_done = cb_tensor_done,
	.step_done = cb_step_done,
	.io_done = cb_io_done,
	.param_ready = cb_param_ready,
};

/* Several chunks, and a tail that is not a whole q8 block. */
#define CHUNK 4096
#define N (3 * CHUNK + 777)

struct rig {
	char *dir;
	struct ze_engine *e;
	struct seen seen;
};

static void
rig_start(struct rig *g, bool nvme)
{
	struct zs_swap *swap = NULL;
	char err[256];
	int r;

	memset(g, 0, sizeof(*g));
	if (nvme) {
		g->dir = th_tmpdir();
		r = th_engine(ZS_SWAP_PTHREAD, g->dir, 64u << 20, 8, 0, NULL, &swap);
		cr_assert_eq(r, 0, "swap engine: %s", zs_strerror(r));
	}
	r = ze_engine_new(&(struct ze_config){
		.pinned_budget = 256u << 20,
		.numa_node = -1,
		.shm_budget = 256u << 20,
		.worker_threads = 2,
		.isa = zk_isa_best(),
		.staging_buffers = 2,
		.chunk_elements = CHUNK,
	}, swap, &callbacks, &g->seen, &g->e, err, sizeof(err));
	cr_assert_eq(r, 0, "%s", err);
}

static void
rig_stop(struct rig *g)
{
	ze_engine_free(g->e);
	if (g->dir != NULL)
		th_rmdir(g->dir);
}

static void
wait_for(struct rig *g, const unsigned *counter, unsigned want)
{
	for (int i = 0; i < 2000 && *counter < want; i++)
		cr_assert_geq(ze_engine_wait(g->e, 10), 0);
	cr_assert_geq(*counter, want, "the engine did not report");
}

static struct ze_tensor *
make(struct rig *g, uint64_t n, enum ze_policy policy, enum zk_state_format f,
    struct ze_account *job)
{
	struct ze_tensor *t;
	char err[256];
	int r;

	r = ze_tensor_new(g->e, &(struct ze_tensor_desc){ .name = "w", .numel = n,
		.grad_dtype = ZK_DTYPE_BF16, .param_dtype = ZK_DTYPE_BF16, .policy = policy,
		.state_format = f }, job, NULL, g, &t, err, sizeof(err));
	cr_assert_eq(r, 0, "%s", err);
	cr_assert_eq(ze_tensor_state_format(t), f);
	return t;
}

static int
xfer(struct rig *g, struct ze_tensor *t, bool write, enum ze_state w, uint64_t off, uint64_t n,
    float *buf)
{
	unsigned before = g->seen.io_done;
	int r = ze_tensor_io(t, write, w, off, n, buf, 1, 7);

	if (r != 0)
		return r < 0 ? r : 0;
	wait_for(g, &g->seen.io_done, before + 1);
	return g->seen.io_result;
}

static void
fill(float *x, uint64_t n, uint64_t seed, float scale)
{
	uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;

	for (uint64_t i = 0; i < n; i++) {
		s ^= s >> 12;
		s ^= s << 25;
		s ^= s >> 27;
		x[i] = scale * (float)((double)((s * 2685821657736338717ull) >> 11) /
		    9007199254740992.0 - 0.5);
	}
}

static void
fill_bf16(uint16_t *x, uint64_t n, uint64_t seed)
{
	static float f[N];

	fill(f, n, seed, 0.02f);
	for (uint64_t i = 0; i < n; i++)
		x[i] = zk_f32_to_bf16(f[i]);
}

static struct zk_hparams
hparams(enum zk_optim o, uint64_t s)
{
	return (struct zk_hparams){ .optim = o, .lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999,
		.eps = 1e-8, .weight_decay = 0.01, .step = s, .bias_correction = true,
		.grad_scale = 1.0, .clip_coef = 1.0 };
}

static int
step(struct rig *g, struct ze_tensor *t, enum zk_optim o, uint64_t s, char *err, size_t errlen)
{
	unsigned before = g->seen.step_done;
	int r = ze_step_submit(g->e, &(struct ze_step){ .lane = 1, .id = s, .hp = hparams(o, s),
		.count = 1, .tensors = &t }, err, errlen);

	if (r < 0)
		return r;
	wait_for(g, &g->seen.step_done, before + 1);
	return 0;
}

/* The reference: the kernel on a tensor of its own in plain memory. */
struct ref {
	struct zk_qtensor q;
	float master[N];
	uint8_t m[2 * N], v[2 * N];
	float ms[N / ZK_Q8_BLOCK + 1], vs[N / ZK_Q8_BLOCK + 1];
	uint16_t grad[N], param[N];
};

static void
same_as_kernel(bool nvme, enum zk_state_format f, enum zk_optim o)
{
	static struct ref ref;
	static float init[N], m0[N], v0[N], got[N], want[N], want_v[N];
	struct ze_tensor *t;
	struct rig g;
	char err[256];

	memset(&ref, 0, sizeof(ref));
	ref.q = (struct zk_qtensor){ .format = f, .master = ref.master, .m = ref.m, .v = ref.v,
		.m_scale = ref.ms, .v_scale = ref.vs, .grad = ref.grad, .grad_dtype = ZK_DTYPE_BF16,
		.param = ref.param, .param_dtype = ZK_DTYPE_BF16, .n = N };
	rig_start(&g, nvme);
	t = make(&g, N, nvme ? ZE_POLICY_NVME : ZE_POLICY_CPU, f, NULL);
	cr_assert_eq(ze_tensor_on_nvme(t), nvme);
	fill(init, N, 1, 1.0f);
	fill(m0, N, 2, 0.01f);
	fill(v0, N, 3, 1e-4f);
	for (size_t i = 0; i < N; i++)
		v0[i] = fabsf(v0[i]);
	/* Initial state through the engine's fp32 writes, and the same encode for the reference. */
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_MASTER, 0, N, init), 0);
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_EXP_AVG, 0, N, m0), 0);
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_EXP_AVG_SQ, 0, N, v0), 0);
	/* bf16-master+q8: the engine's master write rounds to nearest, as master_encode does. */
	cr_assert_eq(zk_qstate_master_encode(&ref.q, init), 0);
	cr_assert_eq(zk_qstate_encode(&ref.q, m0, v0), 0);
	for (uint64_t s = 1; s <= 3; s++) {
		struct zk_hparams hp = hparams(o, s);

		fill_bf16(ze_tensor_grad_slot(t), N, 100 + s);
		memcpy(ref.grad, ze_tensor_grad_slot(t), sizeof(ref.grad));
		cr_assert_eq(step(&g, t, o, s, err, sizeof(err)), 0, "%s", err);
		cr_assert_eq(g.seen.step.status, ZE_STEP_APPLIED, "%s",
		    ze_strerror(g.seen.step.error));
		cr_assert_eq(zk_qstep(zk_isa_best(), &hp, &ref.q, 0, N), 0);
	}
	cr_assert_eq(xfer(&g, t, false, ZE_STATE_MASTER, 0, N, got), 0);
	cr_assert_eq(zk_qstate_master_decode(&ref.q, want), 0);
	cr_assert_eq(memcmp(got, want, sizeof(got)), 0, "%s %s: master differs",
	    nvme ? "nvme" : "pinned", zk_state_format_name(f));
	cr_assert_eq(memcmp(ze_tensor_param_slot(t), ref.param, sizeof(ref.param)), 0,
	    "param slot differs");
	cr_assert_eq(zk_qstate_decode(&ref.q, want, want_v), 0);
	cr_assert_eq(xfer(&g, t, false, ZE_STATE_EXP_AVG, 0, N, got), 0);
	cr_assert_eq(memcmp(got, want, sizeof(got)), 0, "exp_avg differs");
	cr_assert_eq(xfer(&g, t, false, ZE_STATE_EXP_AVG_SQ, 0, N, got), 0);
	cr_assert_eq(memcmp(got, want_v, sizeof(got)), 0, "exp_avg_sq differs");
	ze_tensor_free(t);
	rig_stop(&g);
}

Test(formats, pinned_bf16_steps_as_the_kernel) { same_as_kernel(false, ZK_STATE_BF16, ZK_OPTIM_ADAMW); }
Test(formats, pinned_q8_steps_as_the_kernel) { same_as_kernel(false, ZK_STATE_Q8, ZK_OPTIM_ADAMW); }
Test(formats, pinned_q8_adam_steps_as_the_kernel) { same_as_kernel(false, ZK_STATE_Q8, ZK_OPTIM_ADAM); }
Test(formats, nvme_bf16_steps_as_the_kernel) { same_as_kernel(true, ZK_STATE_BF16, ZK_OPTIM_ADAMW); }
Test(formats, nvme_q8_steps_as_the_kernel) { same_as_kernel(true, ZK_STATE_Q8, ZK_OPTIM_ADAMW); }
Test(formats, nvme_q8_adam_steps_as_the_kernel) { same_as_kernel(true, ZK_STATE_Q8, ZK_OPTIM_ADAM); }
/* A wrong base on a chunk or slice rounds the bf16 master with other bits: caught here. */
Test(formats, pinned_bf16_q8_steps_as_the_kernel) { same_as_kernel(false, ZK_STATE_BF16_Q8, ZK_OPTIM_ADAMW); }
Test(formats, pinned_bf16_q8_adam_steps_as_the_kernel) { same_as_kernel(false, ZK_STATE_BF16_Q8, ZK_OPTIM_ADAM); }
Test(formats, nvme_bf16_q8_steps_as_the_kernel) { same_as_kernel(true, ZK_STATE_BF16_Q8, ZK_OPTIM_ADAMW); }
Test(formats, nvme_bf16_q8_adam_steps_as_the_kernel) { same_as_kernel(true, ZK_STATE_BF16_Q8, ZK_OPTIM_ADAM); }

/* Budgets see the compressed bytes: a q8 tensor is charged about 6 of fp32's 12 bytes. */
Test(formats, charges_and_moves_the_compressed_bytes)
{
	struct ze_account *job;
	uint64_t p32, s32, pq, sq, read32;
	struct ze_tensor *a, *b;
	struct ze_stats st;
	struct rig g;
	char err[128];

	rig_start(&g, true);
	for (int nvme = 0; nvme < 2; nvme++) {
		enum ze_policy pol = nvme ? ZE_POLICY_NVME : ZE_POLICY_CPU;

		cr_assert_eq(ze_account_new(&(struct ze_account_limits){ 0 }, &job), 0);
		a = make(&g, 1u << 20, pol, ZK_STATE_FP32, job);
		ze_account_usage(job, &p32, &s32);
		ze_tensor_free(a);
		b = make(&g, 1u << 20, pol, ZK_STATE_Q8, job);
		ze_account_usage(job, &pq, &sq);
		cr_assert_eq(ze_tensor_state_bytes(b), zk_state_bytes(ZK_STATE_Q8, 1u << 20));
		if (nvme) {
			cr_assert_eq(s32, 12u << 20);
			cr_assert_geq(sq, zk_state_bytes(ZK_STATE_Q8, 1u << 20));
			cr_assert_lt(sq, zk_state_bytes(ZK_STATE_Q8, 1u << 20) + 4096 * 256,
			    "%llu", (unsigned long long)sq);
		} else {
			cr_assert_geq(pq, zk_state_bytes(ZK_STATE_Q8, 1u << 20));
			cr_assert_lt(pq, zk_state_bytes(ZK_STATE_Q8, 1u << 20) + 32768);
			cr_assert_lt(pq * 100, p32 * 51, "%llu vs %llu", (unsigned long long)pq,
			    (unsigned long long)p32);
		}
		ze_tensor_free(b);
		ze_account_unref(job);
	}
	/* A step moves the compressed chunks: half of fp32's bytes and a little. */
	a = make(&g, 8 * CHUNK, ZE_POLICY_NVME, ZK_STATE_FP32, NULL);
	cr_assert_eq(step(&g, a, ZK_OPTIM_ADAMW, 1, err, sizeof(err)), 0, "%s", err);
	ze_engine_stats(g.e, &st);
	read32 = st.bytes_read;
	cr_assert_eq(read32, 8 * CHUNK * 12);
	cr_assert_eq(st.nvme_step_bytes, 8 * CHUNK * 12);
	ze_tensor_free(a);
	b = make(&g, 8 * CHUNK, ZE_POLICY_NVME, ZK_STATE_Q8, NULL);
	cr_assert_eq(step(&g, b, ZK_OPTIM_ADAMW, 1, err, sizeof(err)), 0, "%s", err);
	ze_engine_stats(g.e, &st);
	cr_assert_eq(st.nvme_step_bytes - 8 * CHUNK * 12, zk_state_bytes(ZK_STATE_Q8, 8 * CHUNK));
	cr_assert_leq(st.bytes_read - read32, 8 * (zk_state_bytes(ZK_STATE_Q8, CHUNK) + 4096));
	cr_assert_geq(st.bytes_read - read32, zk_state_bytes(ZK_STATE_Q8, 8 * CHUNK));
	ze_tensor_free(b);
	rig_stop(&g);
}

/* Optimizers without a compressed kernel are refused by name, before anything runs. */
Test(formats, optimizer_without_a_kernel_is_refused)
{
	struct ze_tensor *t;
	struct rig g;
	char err[256];

	rig_start(&g, false);
	t = make(&g, 1000, ZE_POLICY_CPU, ZK_STATE_Q8, NULL);
	cr_assert_eq(step(&g, t, ZK_OPTIM_LION, 1, err, sizeof(err)), -ENOTSUP);
	cr_assert(strstr(err, "q8-moments") && strstr(err, "lion") && strstr(err, "'w'") &&
	    strstr(err, "adamw"), "%s", err);
	cr_assert_eq(step(&g, t, ZK_OPTIM_ADAGRAD, 1, err, sizeof(err)), -ENOTSUP);
	cr_assert(strstr(err, "adagrad"), "%s", err);
	cr_assert_not(ze_tensor_busy(t));
	cr_assert_eq(step(&g, t, ZK_OPTIM_ADAM, 1, err, sizeof(err)), 0, "%s", err);
	ze_tensor_free(t);
	rig_stop(&g);
}

/*
 * A write of one moment is that moment quantized, leaves the other as it was,
 * and a range that starts and ends inside blocks patches just those elements.
 */
static void
moment_writes(bool nvme)
{
	static float m[N], v[N], got[N], keep[N], part[1000];
	struct zk_qtensor q;
	struct ze_tensor *t;
	static uint8_t qm[N], qv[N];
	static float qs[N / 256 + 1], rs[N / 256 + 1];
	struct rig g;

	rig_start(&g, nvme);
	t = make(&g, N, nvme ? ZE_POLICY_NVME : ZE_POLICY_CPU, ZK_STATE_Q8, NULL);
	fill(m, N, 11, 0.1f);
	fill(v, N, 12, 0.01f);
	for (size_t i = 0; i < N; i++)
		v[i] = v[i] * v[i];
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_EXP_AVG_SQ, 0, N, v), 0);
	cr_assert_eq(xfer(&g, t, false, ZE_STATE_EXP_AVG_SQ, 0, N, keep), 0);
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_EXP_AVG, 0, N, m), 0);
	cr_assert_eq(xfer(&g, t, false, ZE_STATE_EXP_AVG_SQ, 0, N, got), 0);
	cr_assert_eq(memcmp(got, keep, sizeof(got)), 0, "writing m changed v");
	/* What the format keeps of m: its encode, decoded. */
	q = (struct zk_qtensor){ .format = ZK_STATE_Q8, .m = qm, .v = qv, .m_scale = qs,
		.v_scale = rs, .n = N };
	cr_assert_eq(zk_qstate_encode(&q, m, v), 0);
	cr_assert_eq(zk_qstate_decode(&q, m, got), 0);
	cr_assert_eq(xfer(&g, t, false, ZE_STATE_EXP_AVG, 0, N, got), 0);
	cr_assert_eq(memcmp(got, m, sizeof(got)), 0, "m is not its quantized value");
	/* A range across a chunk boundary, starting and ending inside blocks: it reads back close. */
	for (size_t i = 0; i < 1000; i++)
		part[i] = 0.05f;
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_EXP_AVG, CHUNK - 300, 1000, part), 0);
	cr_assert_eq(xfer(&g, t, false, ZE_STATE_EXP_AVG, 0, N, got), 0);
	for (size_t i = 0; i < N; i++) {
		float want = i >= CHUNK - 300 && i < CHUNK + 700 ? 0.05f : m[i];

		cr_assert(fabsf(got[i] - want) <= 0.07f * 0.05f + 1e-6f, "m[%zu] %g, want %g", i,
		    got[i], want);
	}
	/* Elements in no block the write touched keep their bits. */
	cr_assert_eq(memcmp(got, m, (CHUNK - 512) * sizeof(float)), 0);
	cr_assert_eq(memcmp(got + CHUNK + 768, m + CHUNK + 768,
	    (N - CHUNK - 768) * sizeof(float)), 0);
	ze_tensor_free(t);
	rig_stop(&g);
}

Test(formats, pinned_moment_writes_are_quantized) { moment_writes(false); }
Test(formats, nvme_moment_writes_are_quantized) { moment_writes(true); }

/*
 * The checkpoint's whole-state transfers: write_all encodes m and v as the one-array
 * writes do, read_all decodes the three as the one-array reads do.
 */
static int
all_io(struct rig *g, struct ze_tensor *t, bool write, uint64_t off, uint64_t n, float *buf)
{
	unsigned before = g->seen.io_done;
	int r = write ? ze_tensor_write_all(t, off, n, n, buf, 1, 9) :
	    ze_tensor_read_all(t, off, n, n, buf, 1, 9);

	if (r != 0)
		return r < 0 ? r : 0;
	wait_for(g, &g->seen.io_done, before + 1);
	return g->seen.io_result;
}

static void
whole_state(bool nvme, enum zk_state_format f)
{
	static float in[3 * N], out[3 * N], one[N];
	struct ze_tensor *a, *b;
	struct rig g;

	rig_start(&g, nvme);
	a = make(&g, N, nvme ? ZE_POLICY_NVME : ZE_POLICY_CPU, f, NULL);
	b = make(&g, N, nvme ? ZE_POLICY_NVME : ZE_POLICY_CPU, f, NULL);
	fill(in, 3 * N, 21, 0.1f);
	for (size_t i = 2 * N; i < 3 * N; i++)
		in[i] = in[i] * in[i];
	/* a: the three arrays at once; b: one by one. */
	cr_assert_eq(all_io(&g, a, true, 0, N, in), 0);
	for (int w = 0; w < 3; w++)
		cr_assert_eq(xfer(&g, b, true, (enum ze_state)w, 0, N, in + (size_t)w * N), 0);
	cr_assert(ze_tensor_initialized(a));
	cr_assert_eq(memcmp(ze_tensor_param_slot(a), ze_tensor_param_slot(b), N * 2), 0);
	/* A range inside blocks and across a chunk: read back as the single reads give it. */
	cr_assert_eq(all_io(&g, a, false, CHUNK - 100, 2000, out), 0);
	for (int w = 0; w < 3; w++) {
		cr_assert_eq(xfer(&g, b, false, (enum ze_state)w, CHUNK - 100, 2000, one), 0);
		cr_assert_eq(memcmp(out + (size_t)w * 2000, one, 2000 * sizeof(float)), 0,
		    "array %d differs", w);
	}
	/* bf16-master+q8 keeps master rounded to nearest bf16. */
	for (size_t i = 0; i < 2000 && f == ZK_STATE_BF16_Q8; i++)
		in[CHUNK - 100 + i] = zk_bf16_to_f32(zk_f32_to_bf16(in[CHUNK - 100 + i]));
	cr_assert_eq(memcmp(out, in + CHUNK - 100, 2000 * sizeof(float)), 0, "master changed");
	ze_tensor_free(a);
	ze_tensor_free(b);
	rig_stop(&g);
}

Test(formats, pinned_q8_whole_state) { whole_state(false, ZK_STATE_Q8); }
Test(formats, nvme_q8_whole_state) { whole_state(true, ZK_STATE_Q8); }
Test(formats, nvme_bf16_whole_state) { whole_state(true, ZK_STATE_BF16); }
Test(formats, pinned_bf16_q8_whole_state) { whole_state(false, ZK_STATE_BF16_Q8); }
Test(formats, nvme_bf16_q8_whole_state) { whole_state(true, ZK_STATE_BF16_Q8); }

/*
 * bf16-master+q8: master is 2 bytes an element on both tiers (4.03 B/param
 * of state), a master write rounds to nearest even, and the param slot in
 * any dtype is the bf16 master's value.
 */
static void
bf16_master(bool nvme)
{
	static float in[N], got[N];
	enum zk_state_format f = ZK_STATE_BF16_Q8;
	struct ze_account *job;
	uint64_t pinned, swap;
	struct ze_tensor *t;
	struct rig g;
	char err[256];
	int r;

	rig_start(&g, nvme);
	cr_assert_eq(ze_account_new(&(struct ze_account_limits){ 0 }, &job), 0);
	r = ze_tensor_new(g.e, &(struct ze_tensor_desc){ .name = "w", .numel = N,
		.grad_dtype = ZK_DTYPE_BF16, .param_dtype = ZK_DTYPE_F32,
		.policy = nvme ? ZE_POLICY_NVME : ZE_POLICY_CPU, .state_format = f }, job, NULL,
	    &g, &t, err, sizeof(err));
	cr_assert_eq(r, 0, "%s", err);
	cr_assert_eq(ze_tensor_state_bytes(t), zk_state_bytes(f, N));
	cr_assert_eq(zk_state_bytes(f, N), 4 * N + 8 * ((N + 255) / 256));
	ze_account_usage(job, &pinned, &swap);
	if (nvme)
		cr_assert_leq(swap, 4 * (zk_state_bytes(f, CHUNK) + 4096), "%llu",
		    (unsigned long long)swap);	/* 4 chunks, each 4 KiB rounded */
	else
		cr_assert_lt(pinned, zk_state_bytes(f, N) + 32768, "%llu",
		    (unsigned long long)pinned);
	fill(in, N, 31, 3.0f);
	in[5] = 1.0f + 0x1.8p-8f;	/* a tie: to even, 1.0 + 2^-7 */
	in[6] = 1.0f + 0x1.0p-8f;	/* a tie: to even, 1.0 */
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_MASTER, 0, N, in), 0);
	cr_assert_eq(xfer(&g, t, false, ZE_STATE_MASTER, 0, N, got), 0);
	cr_assert_eq(got[5], 1.0f + 0x1.0p-7f);
	cr_assert_eq(got[6], 1.0f);
	for (size_t i = 0; i < N; i++) {
		cr_assert_eq(got[i], zk_bf16_to_f32(zk_f32_to_bf16(in[i])), "master[%zu]", i);
		cr_assert_eq(((const float *)ze_tensor_param_slot(t))[i], got[i], "param[%zu]", i);
	}
	cr_assert_eq(step(&g, t, ZK_OPTIM_ADAMW, 1, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(xfer(&g, t, false, ZE_STATE_MASTER, 0, N, got), 0);
	for (size_t i = 0; i < N; i++)
		cr_assert_eq(((const float *)ze_tensor_param_slot(t))[i], got[i], "param[%zu]", i);
	ze_tensor_free(t);
	ze_account_unref(job);
	rig_stop(&g);
}

Test(formats, pinned_bf16_master_rounds_and_mirrors) { bf16_master(false); }
Test(formats, nvme_bf16_master_rounds_and_mirrors) { bf16_master(true); }

/*
 * fp32 on NVMe, a chunk at a time, the arrays a chunk's stride apart in an aligned buffer
 * (as a checkpoint moves it): the disk writes from and reads into the buffer itself, so
 * the padding after the last chunk's arrays comes back from the disk as it was written;
 * the state, the param slot and the one-array reads are those of a copy through the
 * staging buffers.
 */
Test(formats, nvme_fp32_whole_chunks_move_without_a_copy)
{
	enum { LAST = N - 3 * CHUNK, LAST_STRIDE = (LAST + 1023) / 1024 * 1024 };
	static float in[3 * N], one[N];
	/* NULL: gcc -O3 cannot tell that the assert on posix_memalign never returns on failure. */
	float *buf = NULL, *back = NULL;
	struct ze_tensor *a, *b;
	struct rig g;

	cr_assert_eq(posix_memalign((void **)&buf, 4096, 3 * CHUNK * sizeof(float)), 0);
	cr_assert_eq(posix_memalign((void **)&back, 4096, 3 * CHUNK * sizeof(float)), 0);
	rig_start(&g, true);
	a = make(&g, N, ZE_POLICY_NVME, ZK_STATE_FP32, NULL);
	b = make(&g, N, ZE_POLICY_NVME, ZK_STATE_FP32, NULL);
	fill(in, 3 * N, 33, 0.1f);
	cr_assert_eq(all_io(&g, b, true, 0, N, in), 0);
	for (uint64_t first = 0; first < N; first += CHUNK) {
		uint64_t n = N - first < CHUNK ? N - first : CHUNK;
		uint64_t s = n == CHUNK ? CHUNK : LAST_STRIDE;
		unsigned before = g.seen.io_done;
		int r;

		for (unsigned k = 0; k < 3; k++) {
			memcpy(buf + k * s, in + k * N + first, n * sizeof(float));
			for (uint64_t i = n; i < s; i++)
				buf[k * s + i] = 1000.0f + (float)k;
		}
		r = ze_tensor_write_all(a, first, n, s, buf, 1, 9);
		cr_assert_geq(r, 0);
		if (r == 0)
			wait_for(&g, &g.seen.io_done, before + 1);
		cr_assert_eq(g.seen.io_result, 0);
		for (uint64_t i = 0; i < 3 * s; i++)
			back[i] = -1.0f;
		before = g.seen.io_done;
		r = ze_tensor_read_all(a, first, n, s, back, 1, 9);
		cr_assert_geq(r, 0);
		if (r == 0)
			wait_for(&g, &g.seen.io_done, before + 1);
		cr_assert_eq(g.seen.io_result, 0);
		cr_assert_eq(memcmp(back, buf, 3 * s * sizeof(float)), 0, "chunk at %llu (padding "
		    "and all) differs", (unsigned long long)first);
	}
	for (int w = 0; w < 3; w++) {
		cr_assert_eq(xfer(&g, a, false, (enum ze_state)w, 0, N, one), 0);
		cr_assert_eq(memcmp(one, in + (size_t)w * N, N * sizeof(float)), 0,
		    "array %d differs", w);
	}
	cr_assert(ze_tensor_initialized(a));
	cr_assert_eq(memcmp(ze_tensor_param_slot(a), ze_tensor_param_slot(b), N * 2), 0);
	/* A stride shorter than the range is refused. */
	cr_assert_eq(ze_tensor_read_all(a, 0, CHUNK, CHUNK - 1, back, 1, 9), -EINVAL);
	ze_tensor_free(a);
	ze_tensor_free(b);
	rig_stop(&g);
	free(buf);
	free(back);
}

Test(formats, unknown_format_is_refused)
{
	struct ze_tensor *t;
	struct rig g;
	char err[256];
	int r;

	rig_start(&g, false);
	r = ze_tensor_new(g.e, &(struct ze_tensor_desc){ .name = "x", .numel = 10,
		.grad_dtype = ZK_DTYPE_F32, .param_dtype = ZK_DTYPE_F32, .policy = ZE_POLICY_CPU,
		.state_format = ZK_STATE_COUNT }, NULL, NULL, NULL, &t, err, sizeof(err));
	cr_assert_eq(r, -EINVAL);
	cr_assert(strstr(err, "'x'") && strstr(err, "format"), "%s", err);
	rig_stop(&g);
}

/* Visible: Criterion's sandbox finds main by symbol to start test workers. */
__attribute__((visibility("default"))) int
main(int argc, char **argv)
{
	return th_main(argc, argv, th_environment_problem);
}

/*
 * The raw transfers (a checkpoint of compressed state): the arrays as kept, back to back
 * (ze_raw_layout), copied both ways with no decode or encode; for q8-moments only whole
 * 256-element blocks (or a range to the end, with its short last block).
 */
static int
raw_io(struct rig *g, struct ze_tensor *t, bool write, uint64_t off, uint64_t n, void *buf)
{
	unsigned before = g->seen.io_done;
	int r = write ? ze_tensor_write_raw(t, off, n, buf, 1, 11) :
	    ze_tensor_read_raw(t, off, n, buf, 1, 11);

	if (r != 0)
		return r < 0 ? r : 0;
	wait_for(g, &g->seen.io_done, before + 1);
	return g->seen.io_result;
}

static void
raw_state(bool nvme, enum zk_state_format f)
{
	static float in[3 * N], out_a[3 * N], out_b[3 * N];
	static char raw[12 * N + 4096], back[12 * N + 4096], part[12 * 1024 + 64];
	uint64_t off[ZE_RAW_ARRAYS], poff[ZE_RAW_ARRAYS], bytes, tail = N % 256;
	struct ze_tensor *a, *b;
	struct rig g;

	rig_start(&g, nvme);
	a = make(&g, N, nvme ? ZE_POLICY_NVME : ZE_POLICY_CPU, f, NULL);
	b = make(&g, N, nvme ? ZE_POLICY_NVME : ZE_POLICY_CPU, f, NULL);
	fill(in, 3 * N, 23, 0.1f);
	for (size_t i = 2 * N; i < 3 * N; i++)
		in[i] = in[i] * in[i];
	cr_assert_eq(all_io(&g, a, true, 0, N, in), 0);
	bytes = ze_raw_layout(f, N, off);
	cr_assert_eq(bytes, zk_state_master_bytes(f, N) + 2 * zk_state_moment_bytes(f, N) +
	    2 * 4 * zk_state_blocks(f, N));
	cr_assert_eq(raw_io(&g, a, false, 0, N, raw), 0);
	/* master as it is; b takes the raw bytes and gives them back, decoding as a does. */
	if (zk_state_master_bytes(f, N) == 4 * N)
		cr_assert_eq(memcmp(raw, in, 4 * N), 0);
	cr_assert_eq(raw_io(&g, b, true, 0, N, raw), 0);
	cr_assert(ze_tensor_initialized(b));
	cr_assert_eq(raw_io(&g, b, false, 0, N, back), 0);
	cr_assert_eq(memcmp(raw, back, bytes), 0, "raw bytes changed on the way back");
	cr_assert_eq(all_io(&g, a, false, 0, N, out_a), 0);
	cr_assert_eq(all_io(&g, b, false, 0, N, out_b), 0);
	cr_assert_eq(memcmp(out_a, out_b, sizeof(out_a)), 0);
	cr_assert_eq(memcmp(ze_tensor_param_slot(a), ze_tensor_param_slot(b), N * 2), 0);
	/* Across a chunk, on blocks: each array's part where the whole has it. */
	cr_assert_eq(raw_io(&g, a, false, CHUNK - 512, 1024, part), 0);
	ze_raw_layout(f, 1024, poff);
	for (unsigned k = 0; k < ZE_RAW_ARRAYS; k++)
		cr_assert_eq(memcmp(part + poff[k], raw + off[k] + ze_raw_array_bytes(f, k,
		    CHUNK - 512), ze_raw_array_bytes(f, k, 1024)), 0, "array %u", k);
	/* The last, short block with the range that runs to the end. */
	cr_assert_neq(tail, 0);
	cr_assert_eq(raw_io(&g, b, true, N - tail - 256, tail + 256, part), 0);
	if (zk_state_blocks(f, 1) > 0) {
		cr_assert_eq(raw_io(&g, a, false, 100, 256, part), -EINVAL);
		cr_assert_eq(raw_io(&g, a, false, 256, 300, part), -EINVAL);
		cr_assert_eq(raw_io(&g, a, true, 0, N - 1, raw), -EINVAL);
		cr_assert_eq(ze_raw_check(f, N, N - tail, tail), 0);
	} else {
		cr_assert_eq(raw_io(&g, a, false, 101, 299, part), 0);
	}
	cr_assert_eq(raw_io(&g, a, false, N, 1, part), -ERANGE);
	ze_tensor_free(a);
	ze_tensor_free(b);
	rig_stop(&g);
}

Test(formats, pinned_q8_raw_state) { raw_state(false, ZK_STATE_Q8); }
Test(formats, nvme_q8_raw_state) { raw_state(true, ZK_STATE_Q8); }
Test(formats, pinned_bf16_raw_state) { raw_state(false, ZK_STATE_BF16); }
Test(formats, nvme_bf16_raw_state) { raw_state(true, ZK_STATE_BF16); }
/* Its master is 2 bytes an element and its moments come in blocks: the raw form says so. */
Test(formats, pinned_bf16_master_q8_raw_state) { raw_state(false, ZK_STATE_BF16_Q8); }
Test(formats, nvme_bf16_master_q8_raw_state) { raw_state(true, ZK_STATE_BF16_Q8); }
