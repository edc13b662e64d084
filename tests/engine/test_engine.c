/* The engine alone, no daemon, no socket: charges, initialization, exactly-once steps under I/O faults. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "arena.h"
#include "engine.h"
#include "recover.h"
#include "swap.h"
#include "swap_helpers.h"

/* What the callbacks saw. */
struct seen {
	unsigned tensor_done;
	unsigned step_done;
	unsigned io_done;
	struct ze_step_result step;
	struct ze_tensor_result tensor;
	int io_result;
	void *last_user;
	unsigned grad_done;
	int grad_result;
	struct ze_grad_partial grad;
};

static void
cb_tensor_done(void *arg, uint32_t lane, uint64_t id, void *user,
    const struct ze_tensor_result *r)
{
	struct seen *s = arg;

	s->tensor_done++;
	s->tensor = *r;
	s->last_user = user;
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
	struct seen *s = arg;

	s->grad_done++;
	s->grad_result = result;
	if (p != NULL)
		s->grad = *p;
}

static const struct ze_callbacks callbacks = {
	.grad_done = cb_grad_done,
	.tensor_done = cb_tensor_done,
	.step_done = cb_step_done,
	.io_done = cb_io_done,
	.param_ready = cb_param_ready,
};

/*
 * Fails one write with EIO, once `after` writes have gone through, before it
 * reaches the disk (a write that fails after landing leaves the chunk newer
 * than the engine was told: no step count can make that exactly once).
 */
struct fault {
	bool armed;
	unsigned writes;
	unsigned after;
	unsigned failed;
};

static int
fault_prepare(void *arg, const struct zs_inject_op *op)
{
	struct fault *f = arg;

	if (!f->armed || !op->write)
		return 0;
	if (f->writes++ == f->after) {
		f->failed++;
		return -EIO;
	}
	return 0;
}

#define CHUNK 4096

struct rig {
	char *dir;
	struct ze_engine *e;
	struct seen seen;
	struct fault fault;
	struct zs_inject inject;
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
		g->inject = (struct zs_inject){ .prepare = fault_prepare, .arg = &g->fault };
		r = th_engine(ZS_SWAP_PTHREAD, g->dir, 64u << 20, 8, 0, &g->inject, &swap);
		cr_assert_eq(r, 0, "swap engine: %s", zs_strerror(r));
	}
	r = ze_engine_new(&(struct ze_config){
		.pinned_budget = 256u << 20,
		.numa_node = -1,
		.shm_budget = 256u << 20,
		.worker_threads = 1,
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

/* Runs the engine until the callback counter reaches want (bounded). */
static void
wait_for(struct rig *g, const unsigned *counter, unsigned want)
{
	for (int i = 0; i < 2000 && *counter < want; i++)
		cr_assert_geq(ze_engine_wait(g->e, 10), 0);
	cr_assert_geq(*counter, want, "the engine did not report");
}

static struct ze_tensor *
make_tensor(struct rig *g, const char *name, uint64_t n, enum ze_policy policy,
    struct ze_account *job, struct ze_account *uid, void *user)
{
	struct ze_tensor *t;
	char err[256];
	int r;

	r = ze_tensor_new(g->e, &(struct ze_tensor_desc){ .name = name, .numel = n,
		.grad_dtype = ZK_DTYPE_F32, .param_dtype = ZK_DTYPE_BF16, .policy = policy },
	    job, uid, user, &t, err, sizeof(err));
	cr_assert_eq(r, 0, "%s", err);
	return t;
}

/* Synchronous state transfer, queued or not. */
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
fill(float *x, uint64_t n, uint64_t seed)
{
	uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;

	for (uint64_t i = 0; i < n; i++) {
		s ^= s >> 12;
		s ^= s << 25;
		s ^= s >> 27;
		x[i] = (float)((double)((s * 2685821657736338717ull) >> 11) / 9007199254740992.0 -
		    0.5);
	}
}

static int
step_clipped(struct rig *g, struct ze_tensor *t, uint64_t n, uint64_t s, double max_norm,
    double coef)
{
	struct ze_tensor *ts[1] = { t };
	unsigned before = g->seen.step_done;
	char err[256];
	int r;

	fill(ze_tensor_grad_slot(t), n, 100 + s);
	r = ze_step_submit(g->e, &(struct ze_step){
		.lane = 1,
		.id = s,
		.hp = { .optim = ZK_OPTIM_ADAMW, .lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999,
			.eps = 1e-8, .weight_decay = 0.01, .step = s, .bias_correction = true,
			.grad_scale = 1.0 },
		.max_grad_norm = max_norm,
		.clip_coef = coef,
		.count = 1,
		.tensors = ts,
	}, err, sizeof(err));
	if (r < 0)
		return r;
	wait_for(g, &g->seen.step_done, before + 1);
	return 0;
}

static int
step(struct rig *g, struct ze_tensor *t, uint64_t n, uint64_t s)
{
	return step_clipped(g, t, n, s, 0, 0);
}

static void
read_all(struct rig *g, struct ze_tensor *t, uint64_t n, float *out)
{
	for (int w = 0; w < 3; w++)
		cr_assert_eq(xfer(g, t, false, (enum ze_state)w, 0, n, out + (size_t)w * n), 0);
}

/*
 * A write error after some chunks of a step landed: the step reports failed
 * with how much landed; the retry of the same step applies only the rest.
 * The result is the uninterrupted run's, bit for bit.
 */
Test(engine, nvme_step_retried_after_a_write_error_is_exactly_once)
{
	enum { N = 5 * CHUNK + 777, STEPS = 3 };
	struct rig ref, bad;
	struct ze_tensor *a, *b;
	static float init[N], want[3 * N], got[3 * N];
	struct ze_stats st;

	rig_start(&ref, true);
	rig_start(&bad, true);
	a = make_tensor(&ref, "w", N, ZE_POLICY_NVME, NULL, NULL, &ref);
	b = make_tensor(&bad, "w", N, ZE_POLICY_NVME, NULL, NULL, &bad);
	cr_assert(ze_tensor_on_nvme(a) && ze_tensor_on_nvme(b));
	fill(init, N, 1);
	cr_assert_eq(xfer(&ref, a, true, ZE_STATE_MASTER, 0, N, init), 0);
	cr_assert_eq(xfer(&bad, b, true, ZE_STATE_MASTER, 0, N, init), 0);
	for (uint64_t s = 1; s <= STEPS; s++) {
		cr_assert_eq(step(&ref, a, N, s), 0);
		cr_assert_eq(ref.seen.step.status, ZE_STEP_APPLIED);
	}
	cr_assert_eq(step(&bad, b, N, 1), 0);
	cr_assert_eq(bad.seen.step.status, ZE_STEP_APPLIED);
	/* Step 2: the third chunk write fails; two chunks (at least) are in by then. */
	bad.fault = (struct fault){ .armed = true, .after = 2 };
	cr_assert_eq(step(&bad, b, N, 2), 0);
	cr_assert_eq(bad.fault.failed, 1);
	cr_assert_eq(bad.seen.step.status, ZE_STEP_FAILED);
	cr_assert_eq(bad.seen.step.error, -EIO, "%d", bad.seen.step.error);
	cr_assert_gt(bad.seen.step.landed, 0, "no chunk landed before the error");
	cr_assert_lt(bad.seen.step.landed, N);
	cr_assert_eq(bad.seen.tensor.landed, bad.seen.step.landed);
	cr_assert_eq(ze_tensor_last_step(b), 1, "a step that failed part-way moved last_step");
	bad.fault.armed = false;
	/* Moving on would leave the elements it reached a step ahead for good. */
	cr_assert_eq(step(&bad, b, N, 3), -EINPROGRESS);
	/* The retry. */
	cr_assert_eq(step(&bad, b, N, 2), 0);
	cr_assert_eq(bad.seen.step.status, ZE_STEP_APPLIED, "retry: %s",
	    ze_strerror(bad.seen.step.error));
	cr_assert_eq(bad.seen.step.landed, N);
	ze_engine_stats(bad.e, &st);
	cr_assert_gt(st.chunks_skipped, 0, "the retry stepped every chunk again");
	cr_assert_eq(step(&bad, b, N, 3), 0);
	cr_assert_eq(bad.seen.step.status, ZE_STEP_APPLIED);
	read_all(&ref, a, N, want);
	read_all(&bad, b, N, got);
	for (size_t i = 0; i < 3 * (size_t)N; i++)
		cr_assert_eq(memcmp(&got[i], &want[i], sizeof(float)), 0,
		    "%s[%zu]: %.9g, uninterrupted %.9g", i < N ? "master" : i < 2 * N ? "m" : "v",
		    i % N, got[i], want[i]);
	cr_assert_eq(memcmp(ze_tensor_param_slot(a), ze_tensor_param_slot(b), N * 2), 0,
	    "param slots differ");
	/* A step number already applied is refused, not applied twice. */
	cr_assert_eq(step(&bad, b, N, 3), -EALREADY);
	ze_tensor_free(a);
	ze_tensor_free(b);
	rig_stop(&ref);
	rig_stop(&bad);
}

/* Setting the step (state written back from a checkpoint) sets every chunk's too. */
Test(engine, set_step_lowers_every_chunk)
{
	enum { N = 3 * CHUNK };
	struct rig g;
	struct ze_tensor *t;
	static float init[N];
	struct ze_stats st;

	rig_start(&g, true);
	t = make_tensor(&g, "w", N, ZE_POLICY_NVME, NULL, NULL, &g);
	fill(init, N, 3);
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_MASTER, 0, N, init), 0);
	cr_assert_eq(step(&g, t, N, 1), 0);
	cr_assert_eq(step(&g, t, N, 2), 0);
	cr_assert_eq(ze_tensor_set_step(t, 1), 0);
	cr_assert_eq(ze_tensor_last_step(t), 1);
	cr_assert_eq(step(&g, t, N, 2), 0);
	cr_assert_eq(g.seen.step.status, ZE_STEP_APPLIED);
	ze_engine_stats(g.e, &st);
	cr_assert_eq(st.chunks_skipped, 0, "chunks kept step 2 after the step was set to 1");
	cr_assert_eq(st.chunks_written, 3 + 3 + 3 + 3, "%llu", (unsigned long long)st.chunks_written);
	ze_tensor_free(t);
	rig_stop(&g);
}

/* One charge per tensor, refunded once, to the accounts it was taken from; late when busy. */
Test(engine, charge_refunded_once_to_its_accounts)
{
	enum { N = 100000 };
	struct ze_account *job, *uid, *other;
	struct ze_tensor *t;
	struct rig g;
	uint64_t pinned, swap, p2, s2;

	rig_start(&g, false);
	cr_assert_eq(ze_account_new(&(struct ze_account_limits){ 0 }, &job), 0);
	cr_assert_eq(ze_account_new(&(struct ze_account_limits){ 0 }, &uid), 0);
	cr_assert_eq(ze_account_new(&(struct ze_account_limits){ 0 }, &other), 0);
	t = make_tensor(&g, "w", N, ZE_POLICY_CPU, job, uid, &g);
	ze_account_usage(job, &pinned, &swap);
	ze_account_usage(uid, &p2, &s2);
	cr_assert_geq(pinned, 3 * N * sizeof(float));
	cr_assert_eq(pinned, p2);
	cr_assert_eq(swap + s2, 0);
	ze_account_usage(other, &p2, &s2);
	cr_assert_eq(p2 + s2, 0);
	/* The owner lets go while a step runs: the charge stays until the step ends. */
	fill(ze_tensor_grad_slot(t), N, 9);
	cr_assert_eq(ze_step_submit(g.e, &(struct ze_step){ .lane = 1, .id = 1,
		.hp = { .optim = ZK_OPTIM_ADAM, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
			.eps = 1e-8, .step = 1, .grad_scale = 1.0, .clip_coef = 1.0 },
		.count = 1, .tensors = &t }, (char[64]){ 0 }, 64), 0);
	/* The account outlives its maker: the tensor holds a reference. */
	ze_account_unref(job);
	ze_tensor_free(t);
	ze_account_usage(uid, &p2, &s2);
	if (g.seen.step_done == 0)
		cr_assert_eq(p2, pinned, "refunded while the step still runs on the state");
	wait_for(&g, &g.seen.step_done, 1);
	cr_assert_eq(g.seen.tensor_done, 0, "a freed tensor was reported to its old owner");
	ze_account_usage(uid, &p2, &s2);
	cr_assert_eq(p2 + s2, 0, "%llu bytes left charged", (unsigned long long)p2);
	ze_account_unref(uid);
	ze_account_unref(other);
	rig_stop(&g);
}

Test(engine, budgets_of_both_accounts)
{
	struct ze_account *job, *uid;
	struct ze_tensor *t;
	struct rig g;
	char err[256];
	int r;

	rig_start(&g, false);
	cr_assert_eq(ze_account_new(&(struct ze_account_limits){ .pinned_budget = 1u << 20,
		.pinned_what = "limits.uid_pinned_budget of its uid" }, &uid), 0);
	cr_assert_eq(ze_account_new(&(struct ze_account_limits){ 0 }, &job), 0);
	r = ze_tensor_new(g.e, &(struct ze_tensor_desc){ .name = "big", .numel = 1u << 20,
		.grad_dtype = ZK_DTYPE_F32, .param_dtype = ZK_DTYPE_F32, .policy = ZE_POLICY_CPU },
	    job, uid, NULL, &t, err, sizeof(err));
	cr_assert_eq(r, -EDQUOT, "%d: %s", r, err);
	cr_assert(strstr(err, "uid_pinned_budget") != NULL && strstr(err, "'big'") != NULL,
	    "%s", err);
	t = make_tensor(&g, "small", 1000, ZE_POLICY_CPU, job, uid, NULL);
	ze_tensor_free(t);
	ze_account_unref(job);
	ze_account_unref(uid);
	rig_stop(&g);
}

/* Initialized only once every master element was written, in any order and overlap. */
static void
init_tracking(bool nvme)
{
	enum { N = 2 * CHUNK + 100 };
	static float v[N];
	struct ze_tensor *t;
	struct rig g;

	rig_start(&g, nvme);
	t = make_tensor(&g, "w", N, nvme ? ZE_POLICY_NVME : ZE_POLICY_CPU, NULL, NULL, &g);
	fill(v, N, 5);
	cr_assert_not(ze_tensor_initialized(t));
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_MASTER, 1000, N - 1000, v + 1000), 0);
	cr_assert_not(ze_tensor_initialized(t));
	/* m and v are not initial values. */
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_EXP_AVG, 0, N, v), 0);
	cr_assert_not(ze_tensor_initialized(t));
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_MASTER, 0, 999, v), 0);
	cr_assert_not(ze_tensor_initialized(t), "element 999 was never written");
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_MASTER, 999, 2, v + 999), 0);
	cr_assert(ze_tensor_initialized(t));
	ze_tensor_free(t);
	rig_stop(&g);
}

Test(engine, initialized_when_all_of_master_is_in_pinned)
{
	init_tracking(false);
}

Test(engine, initialized_when_all_of_master_is_in_nvme)
{
	init_tracking(true);
}

/*
 * The record's init bits, a bit an element (12 MiB for 100 M), are not looked at once every
 * element was written: their pages go back then, and the record keeps its few stamp pages.
 */
Test(engine, init_bits_given_back_once_initialized)
{
	enum { N = 1 << 20 };
	static float v[N];
	struct ze_tensor_fds fds;
	struct stat before, after;
	struct ze_tensor *t;
	struct rig g;

	rig_start(&g, false);
	t = make_tensor(&g, "w", N, ZE_POLICY_CPU, NULL, NULL, &g);
	ze_tensor_fds(t, &fds);
	fill(v, N, 5);
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_MASTER, 0, N - 64, v), 0);
	cr_assert_not(ze_tensor_initialized(t));
	cr_assert_eq(fstat(fds.record, &before), 0);
	cr_assert_geq((uint64_t)before.st_blocks * 512, N / 8 - 4096, "the bits are in the record");
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_MASTER, N - 64, 64, v + N - 64), 0);
	cr_assert(ze_tensor_initialized(t));
	cr_assert_eq(fstat(fds.record, &after), 0);
	cr_assert_leq((uint64_t)after.st_blocks * 512, 4 * 4096,
	    "%llu bytes of the record still held", (unsigned long long)after.st_blocks * 512);
	ze_tensor_free(t);
	rig_stop(&g);
}

/* A failed initial write on NVMe does not count as written. */
Test(engine, failed_write_is_not_initialization)
{
	enum { N = 3 * CHUNK };
	static float v[N];
	struct ze_tensor *t;
	struct rig g;

	rig_start(&g, true);
	t = make_tensor(&g, "w", N, ZE_POLICY_NVME, NULL, NULL, &g);
	fill(v, N, 6);
	g.fault = (struct fault){ .armed = true, .after = 1 };
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_MASTER, 0, N, v), -EIO);
	cr_assert_not(ze_tensor_initialized(t));
	g.fault.armed = false;
	cr_assert_eq(xfer(&g, t, true, ZE_STATE_MASTER, 0, N, v), 0);
	cr_assert(ze_tensor_initialized(t));
	ze_tensor_free(t);
	rig_stop(&g);
}

/*
 * The two phases give the one-phase numbers: a gradient pass's partial, made
 * into a coefficient by the caller, steps exactly as the engine's own
 * max_grad_norm clipping of the same set.
 */
Test(engine, grad_pass_then_coefficient_equals_max_grad_norm)
{
	enum { N = 3 * CHUNK + 11 };
	static float init[N], want[3 * N], got[3 * N];
	struct ze_tensor *a, *b;
	struct rig g;
	double sumsq = 0, coef;
	char err[128];

	rig_start(&g, true);
	a = make_tensor(&g, "a", N, ZE_POLICY_CPU, NULL, NULL, &g);
	b = make_tensor(&g, "b", N, ZE_POLICY_NVME, NULL, NULL, &g);
	fill(init, N, 8);
	cr_assert_eq(xfer(&g, a, true, ZE_STATE_MASTER, 0, N, init), 0);
	cr_assert_eq(xfer(&g, b, true, ZE_STATE_MASTER, 0, N, init), 0);
	for (uint64_t s = 1; s <= 3; s++) {
		/* One phase, on a. */
		cr_assert_eq(step_clipped(&g, a, N, s, 0.5, 0), 0);
		cr_assert_eq(g.seen.step.status, ZE_STEP_APPLIED);
		/* Two phases, on b: the same gradients (the same seed). */
		fill(ze_tensor_grad_slot(b), N, 100 + s);
		cr_assert_eq(ze_grad_pass(g.e, 1, 50 + s, 1.0, &b, 1, err, sizeof(err)), 0, "%s",
		    err);
		wait_for(&g, &g.seen.grad_done, (unsigned)s);
		cr_assert_eq(g.seen.grad_result, 0);
		cr_assert_eq(g.seen.grad.elements, N);
		cr_assert_eq(g.seen.grad.nonfinite, 0);
		sumsq = 0;
		for (size_t i = 0; i < N; i++)
			sumsq += (double)((float *)ze_tensor_grad_slot(b))[i] *
			    ((float *)ze_tensor_grad_slot(b))[i];
		cr_assert(fabs(g.seen.grad.sumsq - sumsq) <= 1e-9 * sumsq, "%.12g, want %.12g",
		    g.seen.grad.sumsq, sumsq);
		coef = ze_clip_coef(0.5, g.seen.grad.sumsq);
		cr_assert_lt(coef, 1, "the test means to clip");
		cr_assert_eq(step_clipped(&g, b, N, s, 0, coef), 0);
		cr_assert_eq(g.seen.step.status, ZE_STEP_APPLIED);
	}
	read_all(&g, a, N, want);
	read_all(&g, b, N, got);
	cr_assert_eq(memcmp(got, want, sizeof(got)), 0, "two phases differ from one");
	cr_assert_eq(ze_clip_coef(0.5, INFINITY), 1.0);
	cr_assert_eq(ze_clip_coef(0, 4.0), 1.0);
	cr_assert_eq(ze_clip_coef(10, 4.0), 1.0);
	ze_tensor_free(a);
	ze_tensor_free(b);
	rig_stop(&g);
}

/* The swap engine's own codes have one text and one errno, from one list. */
Test(engine, error_codes_have_text_and_errno)
{
	cr_assert_str_eq(ze_strerror(-ZS_E_STALLED), "the kernel kept returning no progress for "
	    "an I/O");
	cr_assert_eq(ze_errno(-ZS_E_STALLED), -EIO);
	cr_assert_eq(ze_errno(-ZS_E_NOURING), -ENOSYS);
	cr_assert_eq(ze_errno(-ENOSPC), -ENOSPC);
	cr_assert_null(strstr(ze_strerror(-ZS_E_NODIRECT), "Unknown"));
}

/* Visible: Criterion's sandbox finds main by symbol to start test workers. */
__attribute__((visibility("default"))) int
main(int argc, char **argv)
{
	return th_main(argc, argv, th_environment_problem);
}

/*
 * A whole chunk restored straight from the caller's buffer (ze_tensor_write_all's direct
 * case) ends in two parts, the disk's write and the param refresh on the stepper: a
 * write that fails reports once, after both, and leaves the tensor free for the retry,
 * which lands (state and param slot) as written.
 */
Test(engine, nvme_direct_chunk_write_error_reports_once_and_retries)
{
	static float one[CHUNK];
	struct ze_tensor *t;
	unsigned before;
	float *buf = NULL;	/* set by posix_memalign, asserted (gcc -O3 cannot tell) */
	struct rig g;

	cr_assert_eq(posix_memalign((void **)&buf, 4096, 3 * CHUNK * sizeof(float)), 0);
	fill(buf, 3 * CHUNK, 77);
	rig_start(&g, true);
	t = make_tensor(&g, "w", 2 * CHUNK, ZE_POLICY_NVME, NULL, NULL, NULL);
	g.fault = (struct fault){ .armed = true, .after = 0 };
	before = g.seen.io_done;
	cr_assert_eq(ze_tensor_write_all(t, CHUNK, CHUNK, CHUNK, buf, 1, 9), 0);
	wait_for(&g, &g.seen.io_done, before + 1);
	cr_assert_eq(g.seen.io_result, -EIO);
	cr_assert_eq(g.fault.failed, 1);
	/* Nothing more comes of it, and the tensor is not held. */
	for (int i = 0; i < 5; i++)
		cr_assert_geq(ze_engine_wait(g.e, 10), 0);
	cr_assert_eq(g.seen.io_done, before + 1);
	cr_assert_not(ze_tensor_busy(t));
	g.fault.armed = false;
	before = g.seen.io_done;
	cr_assert_eq(ze_tensor_write_all(t, CHUNK, CHUNK, CHUNK, buf, 1, 9), 0);
	wait_for(&g, &g.seen.io_done, before + 1);
	cr_assert_eq(g.seen.io_result, 0);
	for (int w = 0; w < 3; w++) {
		cr_assert_eq(xfer(&g, t, false, (enum ze_state)w, CHUNK, CHUNK, one), 0);
		cr_assert_eq(memcmp(one, buf + (size_t)w * CHUNK, sizeof(one)), 0,
		    "array %d differs", w);
	}
	for (uint64_t i = 0; i < CHUNK; i++)
		cr_assert_eq(((uint16_t *)ze_tensor_param_slot(t))[CHUNK + i],
		    zk_f32_to_bf16(buf[i]), "param %llu", (unsigned long long)i);
	ze_tensor_free(t);
	rig_stop(&g);
	free(buf);
}

/*
 * A restore straight into a tensor in memory: its holder writes the arrays and refreshes
 * the params (as a checkpoint's I/O thread does), ze_tensor_restored records the range;
 * the tensor then reads and mirrors what was written, and is initialized once every
 * element was.
 */
Test(engine, held_tensor_restored_in_place)
{
	enum { N = 3000 };
	static float in[3 * N], one[N];
	struct ze_tensor *t;
	struct rig g;

	fill(in, 3 * N, 5);
	rig_start(&g, false);
	t = make_tensor(&g, "w", N, ZE_POLICY_CPU, NULL, NULL, NULL);
	cr_assert_eq(ze_tensor_hold(t), 0);
	for (int w = 0; w < 3; w++)
		memcpy((float *)(uintptr_t)ze_tensor_memory_state(t, (enum ze_state)w),
		    in + (size_t)w * N, sizeof(one));
	cr_assert_eq(ze_tensor_param_refresh(t, 0, N), 0);
	cr_assert_eq(ze_tensor_param_refresh(t, N - 1, 2), -ERANGE);
	cr_assert_eq(ze_tensor_restored(t, 0, 1000), 0);
	cr_assert_not(ze_tensor_initialized(t));
	cr_assert_eq(ze_tensor_restored(t, 1000, N - 1000), 0);
	cr_assert_eq(ze_tensor_restored(t, N, 1), -ERANGE);
	ze_tensor_release(t);
	cr_assert(ze_tensor_initialized(t));
	for (int w = 0; w < 3; w++) {
		cr_assert_eq(xfer(&g, t, false, (enum ze_state)w, 0, N, one), 0);
		cr_assert_eq(memcmp(one, in + (size_t)w * N, sizeof(one)), 0, "array %d", w);
	}
	for (uint64_t i = 0; i < N; i++)
		cr_assert_eq(((uint16_t *)ze_tensor_param_slot(t))[i], zk_f32_to_bf16(in[i]));
	ze_tensor_free(t);
	rig_stop(&g);
}

/* ze_tensor_write_all or ze_tensor_read_all of buf's arrays, stride apart: its result. */
static int
all_io(struct rig *g, struct ze_tensor *t, bool write, uint64_t off, uint64_t n, uint64_t stride,
    float *buf)
{
	unsigned before = g->seen.io_done;
	int r = write ? ze_tensor_write_all(t, off, n, stride, buf, 1, 9) :
	    ze_tensor_read_all(t, off, n, stride, buf, 1, 9);

	if (r != 0)
		return r < 0 ? r : 0;
	wait_for(g, &g->seen.io_done, before + 1);
	return g->seen.io_result;
}

/* Array w of tensor t as ze_tensor_io reads it (through the staging buffers). */
static void
read_state(struct rig *g, struct ze_tensor *t, enum ze_state w, uint64_t n, float *out)
{
	cr_assert_eq(xfer(g, t, false, w, 0, n, out), 0);
}

/*
 * A checkpoint's pieces smaller than a chunk move straight between the disk and the
 * caller's buffer, each array its own I/O, with nothing read first.  They land on swap
 * space another tensor left its state in: until the chunk is written whole, its
 * elements not yet written read as zeros (not as that tensor's bytes), those written
 * as written; a part that fails leaves its elements unwritten.  The last chunk's part
 * ends with the tensor, mid-block.
 */
Test(engine, nvme_split_parts_of_a_chunk_land_on_used_swap)
{
	enum { N = 2 * CHUNK - 100, PART = 1024 };
	static float old[N], want[3][N], one[N];
	struct ze_stats before, after;
	struct ze_tensor *t;
	float *buf = NULL;	/* set by posix_memalign, asserted (gcc -O3 cannot tell) */
	struct rig g;

	cr_assert_eq(posix_memalign((void **)&buf, 4096, 3 * CHUNK * sizeof(float)), 0);
	rig_start(&g, true);
	/* Another tensor's state on the swap space, then freed. */
	t = make_tensor(&g, "old", N, ZE_POLICY_NVME, NULL, NULL, NULL);
	fill(old, N, 3);
	for (int w = 0; w < 3; w++)
		cr_assert_eq(xfer(&g, t, true, (enum ze_state)w, 0, N, old), 0);
	ze_tensor_free(t);
	t = make_tensor(&g, "w", N, ZE_POLICY_NVME, NULL, NULL, NULL);
	for (int w = 0; w < 3; w++)
		fill(want[w], N, 10 + (uint64_t)w);

	/* Elements [PART, 2 PART) of chunk 0: three writes of PART, no read. */
	for (int w = 0; w < 3; w++)
		memcpy(buf + (size_t)w * PART, want[w] + PART, PART * sizeof(float));
	ze_engine_stats(g.e, &before);
	cr_assert_eq(all_io(&g, t, true, PART, PART, PART, buf), 0);
	ze_engine_stats(g.e, &after);
	cr_assert_eq(after.bytes_read, before.bytes_read, "a split part was read first");
	cr_assert_eq(after.bytes_written - before.bytes_written, 3 * PART * sizeof(float));
	for (int w = 0; w < 3; w++) {
		read_state(&g, t, (enum ze_state)w, CHUNK, one);
		for (uint64_t i = 0; i < CHUNK; i++)
			cr_assert_eq(one[i], i >= PART && i < 2 * PART ? want[w][i] : 0.0f,
			    "array %d, element %llu", w, (unsigned long long)i);
	}

	/* The next part fails on its second array's write: its elements stay unwritten. */
	for (int w = 0; w < 3; w++)
		memcpy(buf + (size_t)w * PART, want[w] + 2 * PART, PART * sizeof(float));
	g.fault = (struct fault){ .armed = true, .after = 1 };
	cr_assert_eq(all_io(&g, t, true, 2 * PART, PART, PART, buf), -EIO);
	g.fault.armed = false;
	cr_assert_not(ze_tensor_busy(t));
	cr_assert_not(ze_tensor_initialized(t));
	ze_engine_stats(g.e, &before);
	/* A split read of it: zeros, not what the failed part or the old tensor left. */
	cr_assert_eq(all_io(&g, t, false, 2 * PART, PART, PART, buf), 0);
	ze_engine_stats(g.e, &after);
	cr_assert_eq(after.bytes_read - before.bytes_read, 3 * PART * sizeof(float));
	for (uint64_t i = 0; i < 3 * PART; i++)
		cr_assert_eq(buf[i], 0.0f, "element %llu of the failed part", (unsigned long long)i);

	/* The rest of chunk 0 and all of chunk 1, in parts, out of order; the last ends mid-block. */
	static const uint64_t parts[][2] = { { 3 * PART, PART }, { 2 * PART, PART }, { 0, PART },
		{ CHUNK + 2 * PART, N - CHUNK - 2 * PART }, { CHUNK, 2 * PART } };
	for (unsigned p = 0; p < sizeof(parts) / sizeof(parts[0]); p++) {
		uint64_t off = parts[p][0], n = parts[p][1], stride = (n + 1023) / 1024 * 1024;

		for (int w = 0; w < 3; w++) {
			memcpy(buf + (size_t)w * stride, want[w] + off, n * sizeof(float));
			memset(buf + (size_t)w * stride + n, 0, (stride - n) * sizeof(float));
		}
		ze_engine_stats(g.e, &before);
		cr_assert_eq(all_io(&g, t, true, off, n, stride, buf), 0, "part %u", p);
		ze_engine_stats(g.e, &after);
		cr_assert_eq(after.bytes_read, before.bytes_read, "part %u was read first", p);
	}
	cr_assert(ze_tensor_initialized(t));
	for (int w = 0; w < 3; w++) {
		read_state(&g, t, (enum ze_state)w, N, one);
		cr_assert_eq(memcmp(one, want[w], sizeof(one)), 0, "array %d", w);
	}
	/* Split reads of parts of both chunks. */
	cr_assert_eq(all_io(&g, t, false, CHUNK + PART, N - CHUNK - PART, 3 * PART, buf), 0);
	for (int w = 0; w < 3; w++)
		cr_assert_eq(memcmp(buf + (size_t)w * 3 * PART, want[w] + CHUNK + PART,
		    (N - CHUNK - PART) * sizeof(float)), 0, "array %d of chunk 1's part", w);
	for (uint64_t i = 0; i < N; i++)
		cr_assert_eq(((uint16_t *)ze_tensor_param_slot(t))[i], zk_f32_to_bf16(want[0][i]),
		    "param %llu", (unsigned long long)i);
	ze_tensor_free(t);
	rig_stop(&g);
	free(buf);
}

/*
 * A set skipped for a non-finite gradient ends every one of its tensors: each is reported
 * (skipped, nothing landed) and none stays busy, the first as much as the last.
 */
Test(engine, skipped_set_ends_every_tensor)
{
	enum { N = CHUNK + 5 };
	struct ze_tensor *ts[2];
	struct rig g;
	char err[256];

	rig_start(&g, false);
	ts[0] = make_tensor(&g, "a", N, ZE_POLICY_CPU, NULL, NULL, &g);
	ts[1] = make_tensor(&g, "b", N, ZE_POLICY_CPU, NULL, NULL, &g);
	fill(ze_tensor_grad_slot(ts[0]), N, 1);
	fill(ze_tensor_grad_slot(ts[1]), N, 2);
	((float *)ze_tensor_grad_slot(ts[1]))[N - 1] = NAN;
	cr_assert_eq(ze_step_submit(g.e, &(struct ze_step){
		.lane = 1,
		.id = 1,
		.hp = { .optim = ZK_OPTIM_ADAMW, .lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999,
			.eps = 1e-8, .step = 1, .bias_correction = true, .grad_scale = 1.0 },
		.check_finite = true,
		.count = 2,
		.tensors = ts,
	}, err, sizeof(err)), 0, "%s", err);
	wait_for(&g, &g.seen.step_done, 1);
	cr_assert_eq(g.seen.step.status, ZE_STEP_SKIPPED_NONFINITE);
	cr_assert_eq(g.seen.tensor_done, 2, "%u of 2 tensors reported", g.seen.tensor_done);
	cr_assert_eq(g.seen.tensor.status, ZE_STEP_SKIPPED_NONFINITE);
	cr_assert_eq(g.seen.tensor.landed, 0);
	cr_assert(!ze_tensor_busy(ts[0]), "the first tensor of a skipped set stayed busy");
	cr_assert(!ze_tensor_busy(ts[1]));
	ze_tensor_free(ts[0]);
	ze_tensor_free(ts[1]);
	rig_stop(&g);
}

/* A pinned tensor's state goes back to the arena when it is freed: a loop of them leaks nothing. */
Test(engine, freed_state_goes_back_to_the_arena)
{
	struct zt_arena_stats before, made, after;
	struct ze_tensor *t;
	struct rig g;

	rig_start(&g, false);
	ze_engine_arena_stats(g.e, &before);
	t = make_tensor(&g, "w", 100000, ZE_POLICY_CPU, NULL, NULL, &g);
	ze_engine_arena_stats(g.e, &made);
	cr_assert_gt(made.used_bytes, before.used_bytes, "the test means a state in the arena");
	ze_tensor_free(t);
	ze_engine_arena_stats(g.e, &after);
	cr_assert_eq(after.used_bytes, before.used_bytes, "%llu bytes of a freed state kept",
	    (unsigned long long)(after.used_bytes - before.used_bytes));
	rig_stop(&g);
}
