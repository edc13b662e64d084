/* A rank killed mid-training comes back bit for bit; zoffctl shows and drops what it left; a small job's step is not stuck behind a big one's. */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "svc.h"

static struct itd daemon_;

static void
teardown(void)
{
	itd_cleanup(&daemon_);
}

TestSuite(reattach, .fini = teardown, .timeout = 120);

#define NT 2
/*
 * Four slices of the stepper's 4M-element quantum plus a remainder, and a
 * small one: big enough that the step left in flight by the dying rank is
 * usually still running when its successor registers.
 */
static const size_t sizes[NT] = { (16u << 20) + 3, 1001 };
static const char *const names[NT] = { "w", "b" };
static const enum zc_dtype param_dtypes[NT] = { ZC_BF16, ZC_F32 };
enum { STEPS = 8, KILLED_AFTER = 4 };

static const struct zc_step_params base_params = { .optim = ZC_ADAMW, .lr = 1e-3, .beta1 = 0.9,
	.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .max_grad_norm = 1.0 };

static void
fill(float *x, size_t n, uint64_t seed)
{
	struct itd_rng rng = { 0x9e3779b97f4a7c15ull ^ (seed * 7919 + 1) };

	for (size_t i = 0; i < n; i++)
		x[i] = (float)itd_uniform(&rng);
}

/* Registers the tensors with the same initial values everywhere; returns what the daemon said. */
static int
register_all(struct zc_conn *c, struct zc_tensor **ts)
{
	for (int k = 0; k < NT; k++) {
		struct zc_tensor_desc d = { .name = names[k], .numel = sizes[k], .grad_dtype = ZC_F32,
			.param_dtype = param_dtypes[k] };
		float *init = malloc(sizes[k] * sizeof(float));
		int r;

		if (init == NULL)
			return -ENOMEM;
		fill(init, sizes[k], 1000 + (uint64_t)k);
		r = zc_tensor_register(c, &d, init, &ts[k]);
		free(init);
		if (r < 0)
			return r;
	}
	return 0;
}

/* Step s over both tensors, gradients a function of s alone; no waiting. */
static int
submit(struct zc_conn *c, struct zc_tensor **ts, uint64_t s)
{
	struct zc_step_params sp = base_params;

	sp.step = s;
	for (int k = 0; k < NT; k++)
		fill(zc_tensor_grad_slot(ts[k], NULL), sizes[k], 10 * s + (uint64_t)k);
	return zc_step_submit(c, &sp, ts, NT);
}

static void
run_steps(struct zc_conn *c, struct zc_tensor **ts, uint64_t first, uint64_t last)
{
	struct zc_step_result res;

	for (uint64_t s = first; s <= last; s++) {
		cr_assert_eq(submit(c, ts, s), 0, "step %llu: %s", (unsigned long long)s,
		    zc_errmsg(c));
		cr_assert_eq(zc_wait_all(c, &res), 0, "step %llu: %s", (unsigned long long)s,
		    zc_errmsg(c));
		cr_assert_eq(res.status, ZC_STEP_APPLIED, "step %llu: status %d",
		    (unsigned long long)s, res.status);
	}
}

/* Everything a tensor is: master, m, v and the param slot's bytes. */
struct snapshot {
	float *state[NT];
	void *param[NT];
	size_t param_bytes[NT];
};

static void
snap(struct zc_tensor **ts, struct snapshot *sn)
{
	for (int k = 0; k < NT; k++) {
		const void *p = zc_tensor_param_slot(ts[k], &sn->param_bytes[k]);

		sn->state[k] = malloc(3 * sizes[k] * sizeof(float));
		sn->param[k] = malloc(sn->param_bytes[k]);
		cr_assert(sn->state[k] != NULL && sn->param[k] != NULL);
		for (int w = 0; w < 3; w++)
			cr_assert_eq(zc_tensor_read(ts[k], (enum zc_state)w, 0, sizes[k],
			    sn->state[k] + w * sizes[k]), 0);
		memcpy(sn->param[k], p, sn->param_bytes[k]);
	}
}

static void
snap_free(struct snapshot *sn)
{
	for (int k = 0; k < NT; k++) {
		free(sn->state[k]);
		free(sn->param[k]);
	}
}

/* Child: the rank that dies.  Steps 1..KILLED_AFTER, then one more left in flight. */
static void
doomed_rank(int report)
{
	struct zc_tensor *ts[NT];
	struct zc_step_result res;
	struct zc_conn *c;
	char ok = 'k';

	if (zc_connect(daemon_.socket, &c) < 0 || zc_job_open(c, "crash", 0, 1) < 0 ||
	    register_all(c, ts) < 0)
		_exit(2);
	for (uint64_t s = 1; s <= KILLED_AFTER; s++)
		if (submit(c, ts, s) < 0 || zc_wait_all(c, &res) < 0 ||
		    res.status != ZC_STEP_APPLIED)
			_exit(3);
	/* The ping's reply comes after the daemon has taken the step in. */
	if (submit(c, ts, KILLED_AFTER + 1) < 0 || zc_ping(c, NULL) < 0)
		_exit(4);
	if (write(report, &ok, 1) != 1)
		_exit(5);
	pause();
	_exit(0);
}

static const char *
zoffctl_path(void)
{
	const char *p = getenv("ZOFFCTL");

	cr_assert(p != NULL && p[0] != '\0', "$ZOFFCTL (the built zoffctl) is not set");
	return p;
}

/* zoffctl jobs --json, parsed; the job named `name` (NULL if absent) in *ret_job. */
static cJSON *
zoffctl_jobs(const char *name, const cJSON **ret_job)
{
	const char *argv[] = { zoffctl_path(), "--socket", daemon_.socket, "jobs", "--json", NULL };
	static char out[65536];
	const cJSON *j;
	cJSON *root;

	cr_assert_eq(svc_run(argv, out, sizeof(out), 10), 0, "zoffctl jobs --json: %s", out);
	root = cJSON_Parse(out);
	cr_assert_not_null(root, "zoffctl jobs --json printed no JSON: %s", out);
	*ret_job = NULL;
	cJSON_ArrayForEach(j, cJSON_GetObjectItemCaseSensitive(root, "jobs"))
		if (strcmp(cJSON_GetObjectItemCaseSensitive(j, "name")->valuestring, name) == 0)
			*ret_job = j;
	return root;
}

static double
field(const cJSON *j, const char *key)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);

	cr_assert(cJSON_IsNumber(v), "job has no number '%s'", key);
	return v->valuedouble;
}

/* Polls zoffctl until job `name` shows `detached` detached ranks; bounded. */
static void
expect_detached(const char *name, double attached, double detached)
{
	double deadline = itd_now() + 10;
	const cJSON *j;
	cJSON *root;

	for (;;) {
		root = zoffctl_jobs(name, &j);
		cr_assert_not_null(j, "zoffctl jobs does not list '%s'", name);
		if ((field(j, "ranks_detached") == detached && field(j, "ranks_attached") == attached) ||
		    itd_now() > deadline)
			break;
		cJSON_Delete(root);
		usleep(20000);
	}
	cr_assert_eq(field(j, "ranks_detached"), detached, "'%s': %.0f ranks detached", name,
	    field(j, "ranks_detached"));
	cr_assert_eq(field(j, "ranks_attached"), attached);
	cJSON_Delete(root);
}

Test(reattach, killed_rank_resumes_bit_identical)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"limits\": { \"detach_grace_s\": 30 } }";
	struct zc_tensor *ref_ts[NT], *ts[NT];
	struct snapshot want, got;
	struct zc_conn *ref, *c;
	char out[4096], doomed_step[16];
	const char *drop_argv[] = { zoffctl_path(), "--socket", NULL, "drop", "crash", NULL };
	const char *jobs_argv[] = { zoffctl_path(), "--socket", NULL, "jobs", NULL };
	const cJSON *j;
	cJSON *root;
	double pinned0, v, deadline;
	unsigned busy_retries = 0;
	int r;

	itd_start(&daemon_, config);
	drop_argv[2] = jobs_argv[2] = daemon_.socket;

	/* The uninterrupted run. */
	ref = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(ref, "reference", 0, 1), 0, "%s", zc_errmsg(ref));
	cr_assert_eq(register_all(ref, ref_ts), 0, "%s", zc_errmsg(ref));
	run_steps(ref, ref_ts, 1, STEPS);
	snap(ref_ts, &want);
	pinned0 = itd_stat(ref, "tiers.pinned.used_bytes");

	/* The run that loses its process. */
	snprintf(doomed_step, sizeof(doomed_step), "step %d", KILLED_AFTER + 1);
	itd_fork_client(&daemon_, doomed_rank, 60, "the doomed rank", doomed_step);
	cr_assert_eq(itd_kill_client(&daemon_, NULL), 0);

	/*
	 * A new process of the same rank takes the state back, at once: the step
	 * its predecessor left in flight is usually still running.  Until the
	 * daemon has seen the old connection go, the rank counts as attached.
	 */
	c = itd_connect(&daemon_);
	deadline = itd_now() + 10;
	while ((r = zc_job_open(c, "crash", 0, 1)) == -EADDRINUSE && itd_now() < deadline)
		usleep(2000);
	cr_assert_eq(r, 0, "%s", zc_errmsg(c));
	deadline = itd_now() + 30;
	while ((r = register_all(c, ts)) == -EAGAIN && itd_now() < deadline) {
		busy_retries++;
		usleep(2000);
	}
	cr_assert_eq(r, 0, "re-registering: %s", zc_errmsg(c));
	cr_log_info("reattach: registered after %u retries while the last step finished",
	    busy_retries);
	for (int k = 0; k < NT; k++)
		cr_assert_eq(zc_tensor_last_step(ts[k]), KILLED_AFTER + 1,
		    "tensor '%s' resumes after step %llu; the dead rank's last step was %d",
		    names[k], (unsigned long long)zc_tensor_last_step(ts[k]), KILLED_AFTER + 1);
	cr_assert_eq(svc_wait_stat(c, "steps.in_flight", 0, 10), 0);
	root = zoffctl_jobs("crash", &j);
	cr_assert_eq(field(j, "last_step"), KILLED_AFTER + 1, "the job says it is at step %.0f",
	    field(j, "last_step"));
	cJSON_Delete(root);
	/* Reattaching took state back; it allocated nothing new. */
	cr_assert_eq(itd_stat(c, "tiers.pinned.used_bytes"), 2 * pinned0);

	run_steps(c, ts, KILLED_AFTER + 2, STEPS);
	snap(ts, &got);
	for (int k = 0; k < NT; k++) {
		cr_assert(memcmp(got.state[k], want.state[k], 3 * sizes[k] * sizeof(float)) == 0,
		    "tensor '%s': state after the reattach differs from the uninterrupted run",
		    names[k]);
		cr_assert_eq(got.param_bytes[k], want.param_bytes[k]);
		cr_assert(memcmp(got.param[k], want.param[k], got.param_bytes[k]) == 0,
		    "tensor '%s': parameters differ from the uninterrupted run", names[k]);
	}
	snap_free(&got);
	snap_free(&want);

	/* Gone again: zoffctl shows the rank as detached while it is away ... */
	zc_disconnect(c);
	expect_detached("crash", 0, 1);
	cr_assert_eq(svc_run(jobs_argv, out, sizeof(out), 10), 0, "zoffctl jobs: %s", out);
	cr_assert(strstr(out, "crash") != NULL, "zoffctl jobs does not show the job:\n%s", out);
	/* ... and zoffctl drop frees it without waiting out the grace. */
	cr_assert_eq(svc_run(drop_argv, out, sizeof(out), 10), 0, "zoffctl drop: %s", out);
	cr_assert(strstr(out, "dropped") != NULL, "%s", out);
	v = svc_wait_stat(ref, "tiers.pinned.used_bytes", pinned0, 10);
	cr_assert_eq(v, pinned0, "pinned %.0f bytes after the drop, %.0f before the job", v,
	    pinned0);
	root = zoffctl_jobs("crash", &j);
	cr_assert_null(j, "the dropped job is still listed");
	cJSON_Delete(root);
	/* Dropping what does not exist says so. */
	cr_assert_neq(svc_run(drop_argv, out, sizeof(out), 10), 0, "a second drop succeeded");
	cr_assert(strstr(out, "no job named 'crash'") != NULL, "%s", out);
	zc_disconnect(ref);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* Child: registers a 64M-element tensor, submits step 1 and reports once the daemon has it. */
static void
racer(int report)
{
	struct zc_tensor_desc d = { .name = "huge", .numel = 64u << 20, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16 };
	struct zc_step_params sp = base_params;
	struct zc_tensor *t;
	struct zc_conn *c;
	float *init = calloc(d.numel, sizeof(float));
	char ok = 'k';

	if (init == NULL || zc_connect(daemon_.socket, &c) < 0 || zc_job_open(c, "racer", 0, 1) < 0 ||
	    zc_tensor_register(c, &d, init, &t) < 0)
		_exit(2);
	sp.step = 1;
	if (zc_step_submit(c, &sp, &t, 1) < 0 || zc_ping(c, NULL) < 0)
		_exit(3);
	if (write(report, &ok, 1) != 1)
		_exit(4);
	pause();
	_exit(0);
}

/*
 * The successor comes back while the step its predecessor submitted is still
 * being computed (16 slices of a 64M-element tensor): it must not be told the
 * state is at step 0 while step 1 is about to land on it.
 */
Test(reattach, successor_while_last_step_runs)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"limits\": { \"detach_grace_s\": 30 } }";
	struct zc_tensor_desc d = { .name = "huge", .numel = 64u << 20, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16 };
	struct zc_step_params sp = base_params;
	struct zc_step_result res;
	struct zc_tensor *t;
	struct zc_conn *c;
	unsigned retries = 0;
	double deadline;
	float *init;
	int r;

	itd_start(&daemon_, config);
	itd_fork_client(&daemon_, racer, 60, "the racer", "submit");
	itd_kill_client(&daemon_, NULL);

	c = itd_connect(&daemon_);
	deadline = itd_now() + 10;
	while ((r = zc_job_open(c, "racer", 0, 1)) == -EADDRINUSE && itd_now() < deadline)
		usleep(1000);
	cr_assert_eq(r, 0, "%s", zc_errmsg(c));
	deadline = itd_now() + 30;
	/* Untouched zero pages: a resumed tensor does not read them. */
	init = calloc(d.numel, sizeof(float));
	cr_assert_not_null(init);
	while ((r = zc_tensor_register(c, &d, init, &t)) == -EAGAIN && itd_now() < deadline) {
		retries++;
		usleep(2000);
	}
	free(init);
	cr_assert_eq(r, 0, "re-registering: %s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_last_step(t), 1, "resumed at step %llu; step 1 was taken in before "
	    "the rank died", (unsigned long long)zc_tensor_last_step(t));
	sp.step = 2;
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, &res), 0, "step 2 after the reattach: %s", zc_errmsg(c));
	cr_assert_eq(res.status, ZC_STEP_APPLIED);
	cr_log_info("successor: %u retries while step 1 finished", retries);
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 20), 0, "%s", itd_log_text(&daemon_));
}

TestSuite(fairness, .fini = teardown, .timeout = 120);

Test(fairness, small_set_passes_big_one)
{
	/* 64M elements: 16 of the stepper's 4M-element slices. */
	const size_t big_n = 64u << 20, small_n = 1000;
	struct zc_tensor_desc big = { .name = "big", .numel = big_n, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16 };
	struct zc_tensor_desc small = { .name = "small", .numel = small_n, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16 };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	struct zc_step_result ra, rb;
	struct zc_tensor *ta, *tb;
	struct zc_conn *a, *b;
	float *init = calloc(big_n, sizeof(float));
	float *g;

	cr_assert_not_null(init);
	itd_start(&daemon_, NULL);
	a = itd_connect(&daemon_);
	b = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(a, "big-job", 0, 1), 0, "%s", zc_errmsg(a));
	cr_assert_eq(zc_job_open(b, "small-job", 0, 1), 0, "%s", zc_errmsg(b));
	cr_assert_eq(zc_tensor_register(a, &big, init, &ta), 0, "%s", zc_errmsg(a));
	cr_assert_eq(zc_tensor_register(b, &small, init, &tb), 0, "%s", zc_errmsg(b));
	free(init);
	g = zc_tensor_grad_slot(ta, NULL);
	for (size_t i = 0; i < big_n; i++)
		g[i] = 1.0f;
	g = zc_tensor_grad_slot(tb, NULL);
	for (size_t i = 0; i < small_n; i++)
		g[i] = 1.0f;

	cr_assert_eq(zc_step_submit(a, &sp, &ta, 1), 0, "%s", zc_errmsg(a));
	/* The ping's reply comes after the daemon queued A's set: A is first in line. */
	cr_assert_eq(zc_ping(a, NULL), 0, "%s", zc_errmsg(a));
	cr_assert_eq(zc_step_submit(b, &sp, &tb, 1), 0, "%s", zc_errmsg(b));
	cr_assert_eq(zc_wait_all(b, &rb), 0, "%s", zc_errmsg(b));
	cr_assert_eq(rb.status, ZC_STEP_APPLIED);
	/* B's STEP_DONE is here; A's set is still being stepped. */
	cr_assert_eq(itd_stat(b, "steps.in_flight"), 1,
	    "the big set finished before the small one that came after it");
	cr_assert_eq(zc_wait_all(a, &ra), 0, "%s", zc_errmsg(a));
	cr_assert_eq(ra.status, ZC_STEP_APPLIED);
	cr_assert_lt(rb.latency_ns, ra.latency_ns);
	cr_log_info("fairness: small set %.1f ms, big set %.1f ms", rb.latency_ns / 1e6,
	    ra.latency_ns / 1e6);
	zc_disconnect(a);
	zc_disconnect(b);
	cr_assert_eq(itd_stop(&daemon_, 20), 0, "%s", itd_log_text(&daemon_));
}

/*
 * Initialization is part of the state: a rank that dies between TENSOR_OK
 * and the end of its initial writes leaves a tensor a successor must
 * initialize again (TENSOR_OK says resumed 0), not one it takes back as
 * "resumed at step 0" and trains from zeros.
 */
Test(reattach, half_initialized_tensor_asks_for_init_again)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"limits\": { \"detach_grace_s\": 30 } }";
	enum { N = 5000 };
	static struct zp_msg m;
	static float init[N], got[N];
	struct zc_tensor_desc d = { .name = "w", .numel = N, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_tensor *t;
	struct zc_conn *c;
	double deadline;
	int fd, r;

	itd_start(&daemon_, config);
	/* The rank that dies: registers, writes the first half of its initial values, goes. */
	fd = itd_raw_connect(&daemon_);
	itd_raw_hello(fd);
	memset(&m, 0, sizeof(m));
	snprintf(m.u.job_open.job_name, sizeof(m.u.job_open.job_name), "half");
	m.u.job_open.world_size = 1;
	itd_raw_send(fd, ZP_JOB_OPEN, 1, &m);
	cr_assert(itd_raw_recv(fd, &m, 5) && m.hdr.type == ZP_JOB_OK);
	memset(&m, 0, sizeof(m));
	snprintf(m.u.tensor_register.name, sizeof(m.u.tensor_register.name), "w");
	m.u.tensor_register.numel = N;
	m.u.tensor_register.grad_dtype = ZC_F32;
	m.u.tensor_register.param_dtype = ZC_F32;
	itd_raw_send(fd, ZP_TENSOR_REGISTER, 2, &m);
	cr_assert(itd_raw_recv(fd, &m, 5) && m.hdr.type == ZP_TENSOR_OK, "%s",
	    zp_type_name(m.hdr.type));
	cr_assert_eq(m.u.tensor_ok.resumed, 0);
	memset(&m, 0, sizeof(m));
	itd_raw_send(fd, ZP_XFER_OPEN, 3, &m);
	cr_assert(itd_raw_recv(fd, &m, 5) && m.hdr.type == ZP_XFER_OK);
	memset(&m, 0, sizeof(m));
	m.u.tensor_io.handle = 1;
	m.u.tensor_io.state = ZP_STATE_MASTER;
	m.u.tensor_io.offset = 0;
	m.u.tensor_io.count = N / 2;
	itd_raw_send(fd, ZP_TENSOR_WRITE, 4, &m);
	cr_assert(itd_raw_recv(fd, &m, 5) && m.hdr.type == ZP_OK, "%s", zp_type_name(m.hdr.type));
	close(fd);

	/* Its successor must be asked for the initial values, and then hold them. */
	fill(init, N, 77);
	c = itd_connect(&daemon_);
	deadline = itd_now() + 10;
	while ((r = zc_job_open(c, "half", 0, 1)) == -EADDRINUSE && itd_now() < deadline)
		usleep(2000);
	cr_assert_eq(r, 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &d, init, &t), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_last_step(t), 0);
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, N, got), 0, "%s", zc_errmsg(c));
	cr_assert(memcmp(got, init, sizeof(got)) == 0, "the successor took back a tensor whose "
	    "initial values were never all written (master[N-1] = %g, want %g)", got[N - 1],
	    init[N - 1]);
	/* Fully written now: the next successor resumes it. */
	zc_disconnect(c);
	c = itd_connect(&daemon_);
	deadline = itd_now() + 10;
	while ((r = zc_job_open(c, "half", 0, 1)) == -EADDRINUSE && itd_now() < deadline)
		usleep(2000);
	cr_assert_eq(r, 0, "%s", zc_errmsg(c));
	memset(got, 0, sizeof(got));
	cr_assert_eq(zc_tensor_register(c, &d, got, &t), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, N, got), 0, "%s", zc_errmsg(c));
	cr_assert(memcmp(got, init, sizeof(got)) == 0, "an initialized tensor was not resumed");
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}
