/* The engine's work order (which queued step runs next) and its NVMe pump, with no daemon. */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "pool.h"
#include "swap.h"
#include "swap_helpers.h"

/*
 * Linked with -Wl,--wrap=zk_pool_step,--wrap=zs_read: the engine's calls
 * come here first.  The step waits at a gate the test opens a task at a
 * time, so everything the test submits is queued before the engine picks
 * what runs next; reads are counted while in flight, and can be made to
 * fail inline, as zs_read does once the swap engine is closing.
 */
int __real_zk_pool_step(struct zk_pool *pool, enum zk_isa isa, const struct zk_hparams *hp,
    const struct zk_tensor *tensors, size_t ntensors);
int __wrap_zk_pool_step(struct zk_pool *pool, enum zk_isa isa, const struct zk_hparams *hp,
    const struct zk_tensor *tensors, size_t ntensors);
int __real_zs_read(struct zs_swap *e, const struct zs_extent *x, uint64_t offset, void *buf,
    size_t len, zs_callback *cb, void *arg);
int __wrap_zs_read(struct zs_swap *e, const struct zs_extent *x, uint64_t offset, void *buf,
    size_t len, zs_callback *cb, void *arg);

static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cond = PTHREAD_COND_INITIALIZER;
static unsigned gate_tickets = UINT32_MAX;	/* steps that may start; UINT32_MAX: all */
static atomic_uint gate_entered;		/* steps that reached the gate */
static atomic_int read_fails;			/* 0, or what zs_read returns at once */
static atomic_uint reads;

int
__wrap_zk_pool_step(struct zk_pool *pool, enum zk_isa isa, const struct zk_hparams *hp,
    const struct zk_tensor *tensors, size_t ntensors)
{
	atomic_fetch_add(&gate_entered, 1);
	pthread_mutex_lock(&gate_lock);
	while (gate_tickets == 0)
		pthread_cond_wait(&gate_cond, &gate_lock);
	if (gate_tickets != UINT32_MAX)
		gate_tickets--;
	pthread_mutex_unlock(&gate_lock);
	return __real_zk_pool_step(pool, isa, hp, tensors, ntensors);
}

/* Reads in flight (submitted, callback not yet run), counted on the loop's thread. */
static unsigned reads_now, reads_peak;
static uint64_t read_bytes_now, read_bytes_peak;

struct read_wrap {
	zs_callback *cb;
	void *arg;
	size_t len;
};

static void
read_unwrap(int result, void *arg)
{
	struct read_wrap w = *(struct read_wrap *)arg;

	free(arg);
	reads_now--;
	read_bytes_now -= w.len;
	w.cb(result, w.arg);
}

int
__wrap_zs_read(struct zs_swap *e, const struct zs_extent *x, uint64_t offset, void *buf,
    size_t len, zs_callback *cb, void *arg)
{
	int fail = atomic_load(&read_fails);
	struct read_wrap *w;
	int r;

	atomic_fetch_add(&reads, 1);
	if (fail < 0)
		return fail;
	w = malloc(sizeof(*w));
	if (w == NULL)
		return -ENOMEM;
	*w = (struct read_wrap){ .cb = cb, .arg = arg, .len = len };
	r = __real_zs_read(e, x, offset, buf, len, read_unwrap, w);
	if (r < 0) {
		free(w);
		return r;
	}
	reads_now++;
	read_bytes_now += len;
	if (reads_now > reads_peak)
		reads_peak = reads_now;
	if (read_bytes_now > read_bytes_peak)
		read_bytes_peak = read_bytes_now;
	return 0;
}

static void
gate_give(unsigned tickets)
{
	pthread_mutex_lock(&gate_lock);
	gate_tickets = tickets;
	pthread_cond_broadcast(&gate_cond);
	pthread_mutex_unlock(&gate_lock);
}

/* What the callbacks saw, in order: a tensor's user value, or IO_EVENT + a transfer's id. */
#define IO_EVENT 1000
#define MAX_EVENTS 64

struct seen {
	int events[MAX_EVENTS];
	unsigned nevents;
	unsigned tensor_done;
	unsigned step_done;
	unsigned io_done;
	struct ze_step_result step;
};

static void
record(struct seen *s, int ev)
{
	if (s->nevents < MAX_EVENTS)
		s->events[s->nevents] = ev;
	s->nevents++;
}

static void
cb_tensor_done(void *arg, uint32_t lane, uint64_t id, void *user,
    const struct ze_tensor_result *r)
{
	struct seen *s = arg;

	s->tensor_done++;
	record(s, (int)(intptr_t)user - 1);
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
	record(s, IO_EVENT + (int)id);
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

#define CHUNK 1024

struct rig {
	char *dir;
	struct ze_engine *e;
	struct seen seen;
};

static void
rig_start_with(struct rig *g, bool nvme, uint64_t swap_bytes, unsigned staging, uint64_t chunk)
{
	struct zs_swap *swap = NULL;
	char err[256];
	int r;

	memset(g, 0, sizeof(*g));
	if (nvme) {
		g->dir = th_tmpdir();
		r = th_engine(ZS_SWAP_PTHREAD, g->dir, swap_bytes, 8, 0, NULL, &swap);
		cr_assert_eq(r, 0, "swap engine: %s", zs_strerror(r));
	}
	r = ze_engine_new(&(struct ze_config){
		.pinned_budget = 64u << 20,
		.numa_node = -1,
		.shm_budget = 256u << 20,
		.worker_threads = 1,
		.isa = zk_isa_best(),
		.staging_buffers = staging,
		.chunk_elements = chunk,
	}, swap, &callbacks, &g->seen, &g->e, err, sizeof(err));
	cr_assert_eq(r, 0, "%s", err);
}

/* One staging buffer: NVMe chunks go through one at a time, in the order the pump picks. */
static void
rig_start(struct rig *g, bool nvme, uint64_t swap_bytes)
{
	rig_start_with(g, nvme, swap_bytes, 1, CHUNK);
}

static void
rig_stop(struct rig *g)
{
	gate_give(UINT32_MAX);
	ze_engine_free(g->e);
	if (g->dir != NULL)
		th_rmdir(g->dir);
}

/* user + 1 is the tensor's user pointer: NULL would mean its owner let go. */
static struct ze_tensor *
make_tensor(struct rig *g, uint64_t n, bool nvme, int user)
{
	struct ze_tensor *t;
	char err[256];
	int r;

	r = ze_tensor_new(g->e, &(struct ze_tensor_desc){ .name = "layer", .numel = n,
		.grad_dtype = ZK_DTYPE_F32, .param_dtype = ZK_DTYPE_BF16,
		.policy = nvme ? ZE_POLICY_NVME : ZE_POLICY_CPU },
	    NULL, NULL, (void *)(intptr_t)(user + 1), &t, err, sizeof(err));
	cr_assert_eq(r, 0, "%s", err);
	cr_assert_eq(ze_tensor_on_nvme(t), nvme);
	return t;
}

static void
submit(struct rig *g, struct ze_tensor *const *ts, size_t n, uint64_t step)
{
	char err[256];
	int r;

	r = ze_step_submit(g->e, &(struct ze_step){
		.lane = 1,
		.id = step,
		.hp = { .optim = ZK_OPTIM_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
			.eps = 1e-8, .weight_decay = 0.01, .step = step, .bias_correction = true,
			.grad_scale = 1.0 },
		.count = n,
		.tensors = ts,
	}, err, sizeof(err));
	cr_assert_eq(r, 0, "%s", err);
}

/* Runs the engine until *counter reaches want (bounded). */
static void
wait_for(struct rig *g, const unsigned *counter, unsigned want)
{
	char got[512] = "";

	for (int i = 0; i < 3000 && *counter < want; i++)
		cr_assert_geq(ze_engine_wait(g->e, 10), 0);
	for (unsigned i = 0; i < g->seen.nevents && i < MAX_EVENTS; i++)
		snprintf(got + strlen(got), sizeof(got) - strlen(got), " %d", g->seen.events[i]);
	cr_assert_geq(*counter, want, "the engine did not report (%u of %u; done:%s)", *counter,
	    want, got);
}

/* Runs the engine until want steps have reached the gate (bounded). */
static void
wait_gate(struct rig *g, unsigned want)
{
	for (int i = 0; i < 3000 && atomic_load(&gate_entered) < want; i++)
		cr_assert_geq(ze_engine_wait(g->e, 10), 0);
	cr_assert_geq(atomic_load(&gate_entered), want, "no step reached the gate");
}

static void
expect_events(const struct seen *s, const int *want, unsigned n)
{
	char got[512] = "", exp[512] = "";

	for (unsigned i = 0; i < s->nevents && i < MAX_EVENTS; i++)
		snprintf(got + strlen(got), sizeof(got) - strlen(got), " %d", s->events[i]);
	for (unsigned i = 0; i < n; i++)
		snprintf(exp + strlen(exp), sizeof(exp) - strlen(exp), " %d", want[i]);
	cr_assert_eq(s->nevents, n, "done:%s; want:%s", got, exp);
	for (unsigned i = 0; i < n; i++)
		cr_assert_eq(s->events[i], want[i], "done:%s; want:%s", got, exp);
}

enum { LAYERS = 8, BLOCKER = 100 };

/*
 * A trainer's backward submits its layers last to first; the next forward
 * needs them first to last.  Queued behind a step already running, layer 0
 * (the last submitted) runs first; a set of several tensors keeps its own
 * order.  Pinned: a slice per tensor.
 */
Test(order, pinned_layers_queued_in_backward_finish_first_to_last, .timeout = 60)
{
	struct ze_tensor *blocker, *layer[LAYERS], *set[3];
	int want[1 + LAYERS + 3];
	unsigned n = 0;
	struct rig g;

	rig_start(&g, false, 0);
	blocker = make_tensor(&g, 4096, false, BLOCKER);
	for (int l = 0; l < LAYERS; l++)
		layer[l] = make_tensor(&g, 3000, false, l);
	for (int i = 0; i < 3; i++)
		set[i] = make_tensor(&g, 3000, false, 50 + i);
	gate_give(0);
	atomic_store(&gate_entered, 0);
	submit(&g, &blocker, 1, 1);
	wait_gate(&g, 1);
	/* One submitted set, then the layers one by one, as a backward pass ends them. */
	submit(&g, set, 3, 1);
	for (int l = LAYERS - 1; l >= 0; l--)
		submit(&g, &layer[l], 1, 1);
	gate_give(UINT32_MAX);
	wait_for(&g, &g.seen.tensor_done, 1 + LAYERS + 3);
	want[n++] = BLOCKER;
	for (int l = 0; l < LAYERS; l++)
		want[n++] = l;
	for (int i = 0; i < 3; i++)
		want[n++] = 50 + i;
	expect_events(&g.seen, want, n);
	ze_tensor_free(blocker);
	for (int l = 0; l < LAYERS; l++)
		ze_tensor_free(layer[l]);
	for (int i = 0; i < 3; i++)
		ze_tensor_free(set[i]);
	rig_stop(&g);
}

/*
 * The same on NVMe, chunks through one staging buffer: layer 0 first.  A
 * state read queued before the layers keeps its turn, and a step of a later
 * number waits for the earlier step, however new its submission.
 */
Test(order, nvme_layers_queued_in_backward_finish_first_to_last, .timeout = 60)
{
	struct ze_tensor *blocker, *layer[LAYERS], *later, *xfer;
	static float buf[3 * CHUNK];
	int want[1 + 1 + LAYERS + 1];
	unsigned n = 0;
	struct rig g;

	rig_start(&g, true, 64u << 20);
	blocker = make_tensor(&g, 2 * CHUNK, true, BLOCKER);
	for (int l = 0; l < LAYERS; l++)
		layer[l] = make_tensor(&g, 2 * CHUNK + 100, true, l);
	later = make_tensor(&g, CHUNK, true, 60);
	xfer = make_tensor(&g, 3 * CHUNK, true, 70);
	gate_give(0);
	atomic_store(&gate_entered, 0);
	submit(&g, &blocker, 1, 1);
	/* The blocker's first chunk holds the only staging buffer, waiting to step. */
	wait_gate(&g, 1);
	cr_assert_eq(ze_tensor_io(xfer, false, ZE_STATE_EXP_AVG, 0, 3 * CHUNK, buf, 1, 7), 0);
	for (int l = LAYERS - 1; l >= 0; l--)
		submit(&g, &layer[l], 1, 1);
	submit(&g, &later, 1, 2);
	gate_give(UINT32_MAX);
	wait_for(&g, &g.seen.tensor_done, 1 + LAYERS + 1);
	wait_for(&g, &g.seen.io_done, 1);
	want[n++] = BLOCKER;
	want[n++] = IO_EVENT + 7;
	for (int l = 0; l < LAYERS; l++)
		want[n++] = l;
	want[n++] = 60;
	expect_events(&g.seen, want, n);
	ze_tensor_free(blocker);
	for (int l = 0; l < LAYERS; l++)
		ze_tensor_free(layer[l]);
	ze_tensor_free(later);
	ze_tensor_free(xfer);
	rig_stop(&g);
}

/*
 * Newer submissions keep coming, a task's time apart, each of the next step
 * number: the older step still runs next.  (Taken newest first regardless of
 * the step number, it would wait for as long as they kept coming.)
 */
Test(order, older_step_is_not_starved_by_newer_submissions, .timeout = 60)
{
	enum { ROUNDS = 6 };
	struct ze_tensor *blocker, *old, *newer[ROUNDS];
	int want[2 + ROUNDS];
	unsigned n = 0;
	struct rig g;

	rig_start(&g, false, 0);
	blocker = make_tensor(&g, 4096, false, BLOCKER);
	old = make_tensor(&g, 3000, false, 1);
	for (int i = 0; i < ROUNDS; i++)
		newer[i] = make_tensor(&g, 3000, false, 10 + i);
	gate_give(0);
	atomic_store(&gate_entered, 0);
	submit(&g, &blocker, 1, 1);
	wait_gate(&g, 1);
	submit(&g, &old, 1, 1);
	for (int i = 0; i < ROUNDS; i++) {
		/* Queued before the running task ends and the stepper picks the next one. */
		submit(&g, &newer[i], 1, 2);
		gate_give(1);
		wait_for(&g, &g.seen.tensor_done, (unsigned)i + 1);
		wait_gate(&g, (unsigned)i + 2);
	}
	gate_give(UINT32_MAX);
	wait_for(&g, &g.seen.tensor_done, 2 + ROUNDS);
	want[n++] = BLOCKER;
	want[n++] = 1;
	/*
	 * Within step 2 the newest goes first, so the first of them waits for
	 * the rest: a bounded wait, as a tensor is in one step at a time and
	 * takes each step number once.
	 */
	for (int i = 1; i < ROUNDS; i++)
		want[n++] = 10 + i;
	want[n++] = 10;
	expect_events(&g.seen, want, n);
	ze_tensor_free(blocker);
	ze_tensor_free(old);
	for (int i = 0; i < ROUNDS; i++)
		ze_tensor_free(newer[i]);
	rig_stop(&g);
}

/*
 * Reads started together share the bandwidth and land together, so the
 * first layer queued would wait for the chunks behind it: the pump keeps
 * two full chunks' bytes in flight (ZE_READ_WINDOW_CHUNKS: one left the
 * disk idle between reads), however many staging buffers are free.
 * Chunks smaller than that (small tensors) are read several at a time.
 */
Test(pump, reads_in_flight_are_two_full_chunks, .timeout = 60)
{
	enum { BIG = 4 * 4096, SMALL = 1024, N = 4 };
	struct ze_tensor *big[N], *small[N];
	struct rig g;

	rig_start_with(&g, true, 64u << 20, 4, 4096);
	for (int i = 0; i < N; i++) {
		big[i] = make_tensor(&g, BIG, true, i);
		small[i] = make_tensor(&g, SMALL, true, 10 + i);
	}
	reads_peak = 0;
	read_bytes_peak = 0;
	submit(&g, big, N, 1);
	wait_for(&g, &g.seen.step_done, 1);
	cr_assert_eq(g.seen.step.status, ZE_STEP_APPLIED);
	cr_assert_eq(reads_peak, 2, "%u full chunks read at once", reads_peak);
	cr_assert_eq(read_bytes_peak, 2 * 3 * 4096 * sizeof(float));
	reads_peak = 0;
	submit(&g, small, N, 1);
	wait_for(&g, &g.seen.step_done, 2);
	cr_assert_eq(g.seen.step.status, ZE_STEP_APPLIED);
	cr_assert_eq(reads_peak, N, "%u small chunks read at once, want %d", reads_peak, N);
	cr_assert_eq(reads_now, 0);
	for (int i = 0; i < N; i++) {
		ze_tensor_free(big[i]);
		ze_tensor_free(small[i]);
	}
	rig_stop(&g);
}

/*
 * Every read of a step failing on the spot (zs_read refusing inline, as it
 * does once the swap engine is closing): each chunk's failure asks for the
 * next pump.  Run on a thread with a small stack: a pump that recursed once
 * per chunk would overflow it long before the last of these chunks.
 */
enum { PUMP_CHUNKS = 8192 };
#define PUMP_STACK (256u << 10)

struct pump_run {
	struct rig *g;
	struct ze_tensor *t;
	int submit_result;
	char err[256];
};

static void *
pump_thread(void *arg)
{
	struct pump_run *p = arg;
	struct ze_tensor *ts[1] = { p->t };

	p->submit_result = ze_step_submit(p->g->e, &(struct ze_step){
		.lane = 1,
		.id = 1,
		.hp = { .optim = ZK_OPTIM_ADAM, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
			.eps = 1e-8, .step = 1, .grad_scale = 1.0 },
		.count = 1,
		.tensors = ts,
	}, p->err, sizeof(p->err));
	return NULL;
}

Test(pump, chunks_failing_inline_do_not_grow_the_stack, .timeout = 60)
{
	struct pump_run p = { 0 };
	pthread_attr_t attr;
	pthread_t thread;
	struct rig g;

	rig_start(&g, true, (uint64_t)PUMP_CHUNKS * 3 * CHUNK * sizeof(float) + (16u << 20));
	p.g = &g;
	p.t = make_tensor(&g, (uint64_t)PUMP_CHUNKS * CHUNK, true, 1);
	atomic_store(&reads, 0);
	atomic_store(&read_fails, -ESHUTDOWN);
	cr_assert_eq(pthread_attr_init(&attr), 0);
	cr_assert_eq(pthread_attr_setstacksize(&attr, PUMP_STACK), 0);
	cr_assert_eq(pthread_create(&thread, &attr, pump_thread, &p), 0);
	cr_assert_eq(pthread_join(thread, NULL), 0);
	pthread_attr_destroy(&attr);
	atomic_store(&read_fails, 0);
	cr_assert_eq(p.submit_result, 0, "%s", p.err);
	cr_assert_eq(atomic_load(&reads), PUMP_CHUNKS, "%u reads", atomic_load(&reads));
	/* Every chunk failed inside the submission: the step is reported already. */
	cr_assert_eq(g.seen.step_done, 1);
	cr_assert_eq(g.seen.step.status, ZE_STEP_FAILED);
	cr_assert_eq(g.seen.step.error, -ESHUTDOWN, "%d", g.seen.step.error);
	cr_assert_eq(g.seen.step.landed, 0);
	cr_assert_eq(ze_engine_in_flight(g.e), 0);
	ze_tensor_free(p.t);
	rig_stop(&g);
}

/* Visible: Criterion's sandbox finds main by symbol to start test workers. */
__attribute__((visibility("default"))) int
main(int argc, char **argv)
{
	return th_main(argc, argv, th_environment_problem);
}
