/* Jobs and connections stay apart: concurrent jobs step their own tensors, handles are per connection, ranks are exclusive. */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "itd.h"

static struct itd daemon_;

static void
setup(void)
{
	itd_start(&daemon_, NULL);
}

static void
teardown(void)
{
	itd_cleanup(&daemon_);
}

TestSuite(jobs, .init = setup, .fini = teardown, .timeout = 60);

/*
 * One rank of one job in its own thread and connection.  Threads do not
 * assert (Criterion's asserts belong to the test's thread): they report.
 */
#define RANK_STEPS 10
#define RANK_TENSORS 2
static const size_t rank_sizes[RANK_TENSORS] = { 50021, 1003 };

struct rank_run {
	const char *job;
	uint32_t rank;
	uint64_t seed;
	double lr;
	enum zc_optim optim;
	pthread_barrier_t *barrier;
	unsigned waits;		/* barrier waits done, so a failed rank can make up the rest */
	char error[512];
	double worst;		/* worst relative error over master, m, v */
};

static int
rank_fail(struct rank_run *rr, struct zc_conn *c, const char *what, int r)
{
	snprintf(rr->error, sizeof(rr->error), "%s rank %u: %s: %d %s", rr->job, rr->rank, what, r,
	    c != NULL ? zc_errmsg(c) : "");
	return r;
}

static int
rank_body(struct rank_run *rr, struct zc_conn *c, double **state, struct zc_tensor **ts)
{
	struct itd_rng rng = { rr->seed };
	struct zc_step_params sp = { .optim = rr->optim, .lr = rr->lr, .beta1 = 0.9, .beta2 = 0.99,
		.eps = 1e-8, .weight_decay = 0.05 };
	struct zc_step_result res;
	float *buf;
	int r;

	if ((r = zc_job_open(c, rr->job, rr->rank, 2)) < 0)
		return rank_fail(rr, c, "job_open", r);
	for (size_t k = 0; k < RANK_TENSORS; k++) {
		/* The same tensor names in every job and rank: names do not cross. */
		struct zc_tensor_desc desc = { .name = k == 0 ? "w" : "b", .numel = rank_sizes[k],
			.grad_dtype = ZC_F32, .param_dtype = ZC_F32 };
		double *p = state[4 * k];

		buf = malloc(rank_sizes[k] * sizeof(float));
		if (buf == NULL)
			return rank_fail(rr, NULL, "malloc", -ENOMEM);
		for (size_t i = 0; i < rank_sizes[k]; i++) {
			buf[i] = (float)itd_uniform(&rng);
			p[i] = buf[i];
		}
		r = zc_tensor_register(c, &desc, buf, &ts[k]);
		free(buf);
		if (r < 0)
			return rank_fail(rr, c, "register", r);
	}
	for (uint64_t t = 1; t <= RANK_STEPS; t++) {
		sp.step = t;
		for (size_t k = 0; k < RANK_TENSORS; k++) {
			float *g = zc_tensor_grad_slot(ts[k], NULL);

			for (size_t i = 0; i < rank_sizes[k]; i++) {
				g[i] = (float)itd_uniform(&rng);
				state[4 * k + 3][i] = g[i];
			}
		}
		/* All four ranks submit together, so their sets meet in the daemon's queue. */
		pthread_barrier_wait(rr->barrier);
		rr->waits++;
		if ((r = zc_step_submit(c, &sp, ts, RANK_TENSORS)) < 0)
			return rank_fail(rr, c, "submit", r);
		if ((r = zc_wait_all(c, &res)) < 0)
			return rank_fail(rr, c, "wait", r);
		if (res.status != ZC_STEP_APPLIED || res.step != t)
			return rank_fail(rr, c, "step status", (int)res.status);
		for (size_t k = 0; k < RANK_TENSORS; k++)
			itd_ref_adam(state[4 * k], state[4 * k + 1], state[4 * k + 2],
			    state[4 * k + 3], rank_sizes[k], &sp);
	}
	for (size_t k = 0; k < RANK_TENSORS; k++) {
		buf = malloc(rank_sizes[k] * sizeof(float));
		if (buf == NULL)
			return rank_fail(rr, NULL, "malloc", -ENOMEM);
		for (int w = 0; w < 3; w++) {
			double e;

			if ((r = zc_tensor_read(ts[k], (enum zc_state)w, 0, rank_sizes[k], buf)) < 0) {
				free(buf);
				return rank_fail(rr, c, "read", r);
			}
			e = itd_max_rel_err(buf, state[4 * k + w], rank_sizes[k]);
			if (e > rr->worst)
				rr->worst = e;
		}
		free(buf);
	}
	return 0;
}

static void *
rank_thread(void *arg)
{
	struct rank_run *rr = arg;
	double *state[4 * RANK_TENSORS] = { 0 };	/* p, m, v, g per tensor */
	struct zc_tensor *ts[RANK_TENSORS];
	struct zc_conn *c = NULL;
	int r;

	for (size_t k = 0; k < RANK_TENSORS; k++)
		for (int w = 0; w < 4; w++)
			state[4 * k + w] = calloc(rank_sizes[k], sizeof(double));
	r = zc_connect(daemon_.socket, &c);
	if (r < 0)
		rank_fail(rr, NULL, "connect", r);
	else
		(void)rank_body(rr, c, state, ts);
	/* A rank that failed early must not leave the others waiting at the barrier. */
	for (; rr->waits < RANK_STEPS; rr->waits++)
		pthread_barrier_wait(rr->barrier);
	zc_disconnect(c);
	for (size_t k = 0; k < 4 * RANK_TENSORS; k++)
		free(state[k]);
	return NULL;
}

Test(jobs, concurrent_jobs_isolated)
{
	pthread_barrier_t barrier;
	/* Different lr, optimizer and data per rank: any mix-up moves a result off its reference. */
	struct rank_run runs[4] = {
		{ .job = "job-a", .rank = 0, .seed = 11, .lr = 1e-3, .optim = ZC_ADAMW },
		{ .job = "job-a", .rank = 1, .seed = 12, .lr = 3e-3, .optim = ZC_ADAM },
		{ .job = "job-b", .rank = 0, .seed = 21, .lr = 5e-3, .optim = ZC_ADAMW },
		{ .job = "job-b", .rank = 1, .seed = 22, .lr = 7e-3, .optim = ZC_ADAM },
	};
	pthread_t th[4];
	struct zc_conn *c = itd_connect(&daemon_);

	cr_assert_eq(pthread_barrier_init(&barrier, NULL, 4), 0);
	for (int i = 0; i < 4; i++) {
		runs[i].barrier = &barrier;
		cr_assert_eq(pthread_create(&th[i], NULL, rank_thread, &runs[i]), 0);
	}
	for (int i = 0; i < 4; i++)
		pthread_join(th[i], NULL);
	pthread_barrier_destroy(&barrier);
	for (int i = 0; i < 4; i++) {
		cr_assert_eq(runs[i].error[0], '\0', "%s", runs[i].error);
		/* 10 steps in fp32 against double: see test_numerics.c for the 2e-6. */
		cr_assert_leq(runs[i].worst, 2e-6, "%s rank %u: relative error %.3g", runs[i].job,
		    runs[i].rank, runs[i].worst);
	}
	/* 4 ranks x 10 sets. */
	cr_assert_eq(itd_stat(c, "steps.applied"), 40);
	zc_disconnect(c);
}

static float *
read_master(struct zc_conn *c, struct zc_tensor *t, size_t n)
{
	float *buf = malloc(n * sizeof(float));

	cr_assert_not_null(buf);
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, n, buf), 0, "%s", zc_errmsg(c));
	return buf;
}

Test(jobs, foreign_handles_refused)
{
	static const float init[4] = { 1, 2, 3, 4 };
	struct zc_tensor_desc desc = { .name = "w", .numel = 4, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 0.1, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	struct zc_conn *a = itd_connect(&daemon_), *b = itd_connect(&daemon_);
	struct zc_tensor *ta, *tb;
	static struct zp_msg m;
	float *after;
	int fd, r;

	cr_assert_eq(zc_job_open(a, "job-a", 0, 1), 0, "%s", zc_errmsg(a));
	cr_assert_eq(zc_job_open(b, "job-b", 0, 2), 0, "%s", zc_errmsg(b));
	cr_assert_eq(zc_tensor_register(a, &desc, init, &ta), 0, "%s", zc_errmsg(a));
	cr_assert_eq(zc_tensor_register(b, &desc, init, &tb), 0, "%s", zc_errmsg(b));
	memset(zc_tensor_grad_slot(ta, NULL), 0x3f, 16);	/* ~0.75: a step would move it */

	/* The library refuses another connection's tensor before it reaches the wire. */
	r = zc_step_submit(b, &sp, &ta, 1);
	cr_assert_eq(r, -EINVAL);
	cr_assert(strstr(zc_errmsg(b), "does not belong") != NULL, "%s", zc_errmsg(b));

	/*
	 * The daemon refuses it too: a raw client (rank 1 of job-b) names handle
	 * 1, which exists only on the other connections.
	 */
	fd = itd_raw_connect(&daemon_);
	itd_raw_hello(fd);
	memset(&m, 0, sizeof(m));
	strcpy(m.u.job_open.job_name, "job-b");
	m.u.job_open.rank = 1;
	m.u.job_open.world_size = 2;
	itd_raw_send(fd, ZP_JOB_OPEN, 2, &m);
	cr_assert(itd_raw_recv(fd, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_JOB_OK, "JOB_OPEN: %s %s", zp_type_name(m.hdr.type),
	    m.hdr.type == ZP_ERROR ? m.u.error.message : "");

	memset(&m, 0, sizeof(m));
	m.u.step_submit = (struct zp_step_submit){ .step = 1, .optim = ZP_OPTIM_ADAMW, .lr = 0.1,
		.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .grad_scale = 1, .count = 1,
		.handles = { 1 } };
	itd_raw_send(fd, ZP_STEP_SUBMIT, 3, &m);
	cr_assert(itd_raw_recv(fd, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_ERROR, "foreign handle answered with %s",
	    zp_type_name(m.hdr.type));
	cr_assert_eq(m.hdr.request_id, 3);
	cr_assert_eq(m.u.error.code, -ENOENT);
	cr_assert(strstr(m.u.error.message, "handle 1") != NULL, "%s", m.u.error.message);
	cr_assert(itd_raw_recv(fd, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_STEP_DONE);
	cr_assert_eq(m.u.step_done.status, ZP_STEP_FAILED);
	cr_assert_eq(m.u.step_done.error, -ENOENT);

	/* Reading another connection's state is refused the same way. */
	itd_raw_send(fd, ZP_XFER_OPEN, 4, NULL);
	cr_assert(itd_raw_recv(fd, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_XFER_OK);
	memset(&m, 0, sizeof(m));
	m.u.tensor_io = (struct zp_tensor_io){ .handle = 1, .state = ZP_STATE_MASTER, .count = 4 };
	itd_raw_send(fd, ZP_TENSOR_READ, 5, &m);
	cr_assert(itd_raw_recv(fd, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_ERROR);
	cr_assert_eq(m.u.error.code, -ENOENT);
	/* A refused request is not a protocol error: the connection still serves. */
	itd_raw_send(fd, ZP_PING, 6, NULL);
	cr_assert(itd_raw_recv(fd, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_PONG);
	close(fd);

	/* Neither owner's tensor moved. */
	after = read_master(a, ta, 4);
	cr_assert_eq(memcmp(after, init, sizeof(init)), 0, "job-a's tensor changed");
	free(after);
	after = read_master(b, tb, 4);
	cr_assert_eq(memcmp(after, init, sizeof(init)), 0, "job-b's tensor changed");
	free(after);

	/* And the owner can step it. */
	cr_assert_eq(zc_step_submit(a, &sp, &ta, 1), 0, "%s", zc_errmsg(a));
	cr_assert_eq(zc_wait_all(a, NULL), 0, "%s", zc_errmsg(a));
	after = read_master(a, ta, 4);
	cr_assert_neq(after[0], init[0], "the owner's step did not apply");
	free(after);
	zc_disconnect(a);
	zc_disconnect(b);
}

Test(jobs, ranks_of_a_job)
{
	struct zc_conn *c0 = itd_connect(&daemon_), *c1 = itd_connect(&daemon_);
	struct zc_conn *c2 = itd_connect(&daemon_);
	double deadline;
	char *json = NULL;
	int r;

	cr_assert_eq(zc_job_open(c0, "shared", 0, 2), 0, "%s", zc_errmsg(c0));
	/* Same name, another rank: the same job. */
	cr_assert_eq(zc_job_open(c1, "shared", 1, 2), 0, "%s", zc_errmsg(c1));
	/* Same rank twice. */
	r = zc_job_open(c2, "shared", 0, 2);
	cr_assert_eq(r, -EADDRINUSE, "rank 0 twice gave %d (%s)", r, zc_errmsg(c2));
	cr_assert(strstr(zc_errmsg(c2), "rank 0") != NULL && strstr(zc_errmsg(c2), "shared"),
	    "%s", zc_errmsg(c2));
	/* Same name with another world size is not the same run. */
	r = zc_job_open(c2, "shared", 1, 4);
	cr_assert_eq(r, -EINVAL, "world size mismatch gave %d (%s)", r, zc_errmsg(c2));
	/* One job per connection. */
	r = zc_job_open(c0, "other", 0, 1);
	cr_assert_eq(r, -EISCONN, "second job on a connection gave %d (%s)", r, zc_errmsg(c0));

	cr_assert_eq(zc_jobs_json(c2, &json), 0, "%s", zc_errmsg(c2));
	cr_assert(strstr(json, "\"name\":\"shared\"") != NULL, "%s", json);
	cr_assert(strstr(json, "\"ranks_attached\":2") != NULL, "%s", json);
	cr_assert(strstr(json, "\"other\"") == NULL, "%s", json);
	free(json);

	/* Once rank 0 goes, its place is free; the daemon notices the close asynchronously. */
	zc_disconnect(c0);
	deadline = itd_now() + 5;
	while ((r = zc_job_open(c2, "shared", 0, 2)) == -EADDRINUSE && itd_now() < deadline)
		usleep(10000);
	cr_assert_eq(r, 0, "rank 0 not free after its connection closed: %s", zc_errmsg(c2));
	zc_disconnect(c1);
	zc_disconnect(c2);
}

/*
 * A set's STEP_DONE ends only the tensors still waiting on that set.  Here
 * the small tensor's step 1 is done long before the set's (the big one
 * takes four slices), step 2 of the small one is submitted meanwhile, and
 * the late STEP_DONE of step 1 used to end the wait for step 2 as well: the
 * caller then submitted step 3 onto a tensor still in step 2.
 */
Test(jobs, late_set_result_does_not_end_a_later_step)
{
	struct zc_tensor_desc big_d = { .name = "big", .numel = (16u << 20) + 5,
		.grad_dtype = ZC_F32, .param_dtype = ZC_BF16 };
	struct zc_tensor_desc small_d = { .name = "small", .numel = 1000, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
		.eps = 1e-8 };
	struct zc_conn *c = itd_connect(&daemon_);
	struct zc_tensor *ts[2];
	struct zc_step_result res;
	float *init = calloc(big_d.numel, sizeof(float));

	cr_assert_not_null(init);
	cr_assert_eq(zc_job_open(c, "late", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &small_d, init, &ts[0]), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &big_d, init, &ts[1]), 0, "%s", zc_errmsg(c));
	free(init);
	sp.step = 1;
	cr_assert_eq(zc_step_submit(c, &sp, ts, 2), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_tensor(ts[0], &res), 0, "%s", zc_errmsg(c));
	cr_assert_eq(res.step, 1);
	sp.step = 2;
	cr_assert_eq(zc_step_submit(c, &sp, &ts[0], 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_tensor(ts[0], &res), 0, "%s", zc_errmsg(c));
	cr_assert_eq(res.step, 2, "the wait for step 2 ended with step %llu's result",
	    (unsigned long long)res.step);
	cr_assert_eq(zc_tensor_last_step(ts[0]), 2);
	sp.step = 3;
	cr_assert_eq(zc_step_submit(c, &sp, &ts[0], 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, &res), 0, "%s", zc_errmsg(c));
	cr_assert_eq(res.status, ZC_STEP_APPLIED);
	zc_disconnect(c);
}
