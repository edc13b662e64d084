/*
 * Reconnects: the connection cut at chosen points (the daemon alive) is a
 * pause, the training ends bit-identical to one never cut; a daemon that
 * lost the job's state is a clear failure, never a silent new start; the
 * fail-fast option and the reconnect timeout.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <inttypes.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "itd.h"
#include "relay.h"

static struct itd daemon_;
static struct relay relay_;

static void
setup(void)
{
	itd_start(&daemon_, NULL);
}

static void
teardown(void)
{
	relay_stop(&relay_);
	itd_cleanup(&daemon_);
}

TestSuite(reconnect, .init = setup, .fini = teardown, .timeout = 120);

#define NT 3
#define STEPS 12

static const struct zc_tensor_desc descs[NT] = {
	{ .name = "plain", .numel = 5000, .grad_dtype = ZC_F32, .param_dtype = ZC_F32 },
	{ .name = "bf16grad", .numel = 3001, .grad_dtype = ZC_BF16, .param_dtype = ZC_F32,
	  .param_offload = true },
	{ .name = "offload", .numel = 7000, .grad_dtype = ZC_F32, .param_dtype = ZC_F32,
	  .param_offload = true },
};

/* What a run ends with: each tensor's three state arrays and its param slot. */
struct outcome {
	float *state[NT][3];
	float *param[NT];
};

static void
outcome_free(struct outcome *o)
{
	for (int k = 0; k < NT; k++) {
		for (int s = 0; s < 3; s++)
			free(o->state[k][s]);
		free(o->param[k]);
	}
}

/* Called before each step's calls: arms cuts for it. */
typedef void arm_fn(int step);

static void
register_all(struct zc_conn *c, struct zc_tensor **t)
{
	for (int k = 0; k < NT; k++) {
		float *init = malloc(descs[k].numel * sizeof(float));

		cr_assert_not_null(init);
		for (uint64_t i = 0; i < descs[k].numel; i++)
			init[i] = (float)sin((double)(i + 1) * (k + 1) * 0.001);
		cr_assert_eq(zc_tensor_register(c, &descs[k], init, &t[k]), 0, "register %s: %s",
		    descs[k].name, zc_errmsg(c));
		free(init);
	}
}

/*
 * The gradients depend on the parameters in the slots (as a model's would),
 * so parameters fetched wrongly after a reconnect change the outcome too.
 */
static void
write_grads(struct zc_tensor **t, int step)
{
	for (int k = 0; k < NT; k++) {
		const float *p = zc_tensor_param_slot(t[k], NULL);
		void *g = zc_tensor_grad_slot(t[k], NULL);

		for (uint64_t i = 0; i < descs[k].numel; i++) {
			float v = 0.5f * p[i] + (float)cos((double)i * 0.01 + step) * 0.01f;

			if (descs[k].grad_dtype == ZC_BF16)
				((uint16_t *)g)[i] = zc_f32_to_bf16(v);
			else
				((float *)g)[i] = v;
		}
	}
}

/* Steps 1..STEPS on c's open job; every third step clips with a gradient pass first. */
static void
train(struct zc_conn *c, struct zc_tensor **t, arm_fn *arm)
{
	struct zc_tensor *offl[2] = { t[1], t[2] };
	struct zc_step_result res;

	for (int step = 1; step <= STEPS; step++) {
		struct zc_step_params sp = { .optim = ZC_ADAMW, .step = (uint64_t)step, .lr = 1e-2,
			.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 };

		if (arm != NULL)
			arm(step);
		if (step > 1) {
			cr_assert_eq(zc_param_prefetch(c, offl, 2), 0, "step %d prefetch: %s", step,
			    zc_errmsg(c));
			for (int k = 0; k < 2; k++)
				cr_assert_eq(zc_param_wait(offl[k]), 0, "step %d param wait: %s", step,
				    zc_errmsg(c));
		}
		write_grads(t, step);
		if (step % 3 == 0) {
			struct zc_grad_partial gp;

			cr_assert_eq(zc_grad_pass(c, t, NT, 1.0, &gp), 0, "step %d grad pass: %s", step,
			    zc_errmsg(c));
			sp.clip_coef = zc_clip_coef(0.5, gp.sumsq);
		}
		cr_assert_eq(zc_step_submit(c, &sp, t, NT), 0, "step %d submit: %s", step,
		    zc_errmsg(c));
		cr_assert_eq(zc_wait_all(c, &res), 0, "step %d wait: %s", step, zc_errmsg(c));
		cr_assert_eq(res.status, ZC_STEP_APPLIED, "step %d: status %d", step, res.status);
		cr_assert_eq(res.step, (uint64_t)step);
		for (int k = 0; k < NT; k++)
			cr_assert_eq(zc_tensor_last_step(t[k]), (uint64_t)step);
		cr_assert_eq(zc_param_release(c, offl, 2), 0, "step %d release: %s", step,
		    zc_errmsg(c));
	}
	cr_assert_eq(zc_param_prefetch(c, offl, 2), 0, "%s", zc_errmsg(c));
	for (int k = 0; k < 2; k++)
		cr_assert_eq(zc_param_wait(offl[k]), 0, "%s", zc_errmsg(c));
}

static void
collect(struct zc_conn *c, struct zc_tensor **t, struct outcome *o)
{
	for (int k = 0; k < NT; k++) {
		size_t bytes;
		const void *p = zc_tensor_param_slot(t[k], &bytes);

		for (int s = 0; s < 3; s++) {
			o->state[k][s] = malloc(descs[k].numel * sizeof(float));
			cr_assert_not_null(o->state[k][s]);
			cr_assert_eq(zc_tensor_read(t[k], (enum zc_state)s, 0, descs[k].numel,
			    o->state[k][s]), 0, "read %s: %s", descs[k].name, zc_errmsg(c));
		}
		o->param[k] = malloc(bytes);
		memcpy(o->param[k], p, bytes);
	}
}

static void
run(struct zc_conn *c, const char *job, arm_fn *arm, struct outcome *o, struct zc_tensor **t)
{
	cr_assert_eq(zc_job_open(c, job, 0, 1), 0, "%s", zc_errmsg(c));
	register_all(c, t);
	train(c, t, arm);
	collect(c, t, o);
}

static void
assert_identical(const struct outcome *a, const struct outcome *b)
{
	static const char *states[3] = { "master", "exp_avg", "exp_avg_sq" };

	for (int k = 0; k < NT; k++) {
		for (int s = 0; s < 3; s++)
			cr_assert_eq(memcmp(a->state[k][s], b->state[k][s],
			    descs[k].numel * sizeof(float)), 0, "%s %s differs from the uncut run",
			    descs[k].name, states[s]);
		cr_assert_eq(memcmp(a->param[k], b->param[k], descs[k].numel * sizeof(float)), 0,
		    "%s param slot differs from the uncut run", descs[k].name);
	}
}

static struct zc_conn *
connect_relay(void)
{
	char path[160];
	struct zc_conn *c = NULL;

	snprintf(path, sizeof(path), "%s/relay.sock", daemon_.dir);
	relay_start(&relay_, path, daemon_.socket);
	cr_assert_eq(zc_connect(path, &c), 0, "connect through the relay: %s", zc_errmsg(NULL));
	return c;
}

/*
 * Where the connection is cut, step by step: requests dropped before the
 * daemon saw them, requests it got (and carried out) whose answers were
 * lost, and an idle connection between steps.
 */
static void
arm_cuts(int step)
{
	switch (step) {
	case 2:	/* the step never reached the daemon: submitted again */
		relay_cut_at(&relay_, ZP_STEP_SUBMIT, true, false);
		break;
	case 3:	/* the daemon applied the step, the answers were lost: not applied twice */
		relay_cut_at(&relay_, ZP_STEP_SUBMIT, true, true);
		break;
	case 4:	/* every tensor's TENSOR_DONE arrived, the set's STEP_DONE did not */
		relay_cut_at(&relay_, ZP_STEP_DONE, false, false);
		break;
	case 5:	/* idle: the next call finds the connection gone */
		relay_cut_now(&relay_);
		break;
	case 6:	/* the prefetch never reached the daemon */
		relay_cut_at(&relay_, ZP_PARAM_FETCH, true, false);
		break;
	case 7:	/* the params were staged, the answer was lost */
		relay_cut_at(&relay_, ZP_PARAM_READY, false, false);
		break;
	case 9:	/* the gradient pass was answered, the answer lost */
		relay_cut_at(&relay_, ZP_GRAD_PARTIAL, false, false);
		break;
	case 10: /* the release reached the daemon, its OK did not */
		relay_cut_at(&relay_, ZP_PARAM_RELEASE, true, true);
		break;
	default:
		break;
	}
}

#define CUTS 8

Test(reconnect, cut_connection_is_a_pause)
{
	struct zc_conn *ref = itd_connect(&daemon_), *c;
	struct outcome want = { 0 }, got = { 0 };
	struct zc_tensor *rt[NT], *t[NT];
	struct zc_conn_stats cs;
	float out[16];

	run(ref, "uncut", NULL, &want, rt);
	zc_conn_stats(ref, &cs);
	cr_assert_eq(cs.reconnects, 0);

	c = connect_relay();
	run(c, "cut", arm_cuts, &got, t);
	cr_assert_eq(relay_cuts(&relay_), CUTS, "%u cuts made", relay_cuts(&relay_));
	zc_conn_stats(c, &cs);
	cr_assert_eq(cs.reconnects, CUTS, "%llu reconnects for %d cuts",
	    (unsigned long long)cs.reconnects, CUTS);
	cr_assert_gt(cs.reconnect_ns, 0);
	/* Step 2 went again; steps 3 and 4 were done by the daemon while the connection was gone. */
	cr_assert_eq(cs.steps_resubmitted, 1, "%llu sets resubmitted",
	    (unsigned long long)cs.steps_resubmitted);
	cr_assert_eq(cs.steps_completed_away, 2, "%llu sets completed away",
	    (unsigned long long)cs.steps_completed_away);
	/* The daemon kept the slots: the same files, the same mappings. */
	cr_assert_eq(cs.slots_remapped, 0);
	assert_identical(&got, &want);

	/* A read whose answer is lost goes again, through a new transfer window. */
	relay_cut_at(&relay_, ZP_OK, false, false);
	cr_assert_eq(zc_tensor_read(t[0], ZC_STATE_MASTER, 0, 16, out), 0, "%s", zc_errmsg(c));
	cr_assert_eq(memcmp(out, want.state[0][0], sizeof(out)), 0, "read after a cut differs");
	zc_conn_stats(c, &cs);
	cr_assert_eq(cs.reconnects, CUTS + 1);
	outcome_free(&want);
	outcome_free(&got);
	zc_disconnect(ref);
	zc_disconnect(c);
}

/*
 * What a resubmission relies on: the daemon refuses a step at or below a
 * tensor's last step for the whole set (-EALREADY), rather than applying it
 * again.  So the client must leave such tensors out, and does: a step the
 * daemon applied before the connection went is not sent again.
 */
Test(reconnect, applied_step_is_not_sent_again)
{
	struct zc_conn *c = connect_relay();
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-2, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	struct zc_step_result res;
	struct zc_tensor *t[NT];
	struct zc_conn_stats cs;
	int r;

	cr_assert_eq(zc_job_open(c, "once", 0, 1), 0, "%s", zc_errmsg(c));
	register_all(c, t);
	write_grads(t, 1);
	cr_assert_eq(zc_step_submit(c, &sp, t, NT), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, &res), 0, "%s", zc_errmsg(c));
	/* The engine's answer to the same step again: refused, nothing applied twice. */
	cr_assert_eq(zc_step_submit(c, &sp, t, NT), 0, "%s", zc_errmsg(c));
	r = zc_wait_all(c, &res);
	cr_assert_eq(r, -EALREADY, "step 1 again gave %d (%s)", r, zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "already at step 1") != NULL, "%s", zc_errmsg(c));

	/* Step 2 reaches the daemon, the connection goes before any answer. */
	sp.step = 2;
	relay_cut_at(&relay_, ZP_STEP_SUBMIT, true, true);
	cr_assert_eq(zc_step_submit(c, &sp, t, NT), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_tensor(t[0], &res), 0, "%s", zc_errmsg(c));
	cr_assert_eq(res.step, 2);
	cr_assert_eq(res.status, ZC_STEP_APPLIED);
	cr_assert_eq(zc_wait_all(c, &res), 0, "%s", zc_errmsg(c));
	cr_assert_eq(res.status, ZC_STEP_APPLIED);
	cr_assert(isnan(res.grad_norm), "a result lost with the connection has no norm");
	zc_conn_stats(c, &cs);
	cr_assert_eq(cs.reconnects, 1, "%llu reconnects", (unsigned long long)cs.reconnects);
	cr_assert_eq(cs.steps_resubmitted, 0);
	cr_assert_eq(cs.steps_completed_away, 1);
	for (int k = 0; k < NT; k++)
		cr_assert_eq(zc_tensor_last_step(t[k]), 2);
	/* The daemon agrees: step 3 is the next one it takes. */
	sp.step = 3;
	cr_assert_eq(zc_step_submit(c, &sp, t, NT), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, &res), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
}

/* Starts a new zoffloadd on the same socket and config: one that kept nothing. */
static void
restart_daemon(void)
{
	const char *bin = getenv("ZOFFLOADD");
	pid_t parent = getpid();
	double deadline = itd_now() + 10;
	int log_fd;

	cr_assert_not_null(bin, "ZOFFLOADD is not set");
	log_fd = open(daemon_.log, O_WRONLY | O_APPEND | O_CLOEXEC);
	cr_assert_geq(log_fd, 0);
	daemon_.pid = fork();
	cr_assert_geq(daemon_.pid, 0);
	if (daemon_.pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(127);
		dup2(log_fd, STDOUT_FILENO);
		dup2(log_fd, STDERR_FILENO);
		execl(bin, bin, "--config", daemon_.config, "--socket", daemon_.socket,
		    (char *)NULL);
		_exit(127);
	}
	close(log_fd);
	for (;;) {
		struct zc_conn *probe = NULL;

		if (zc_connect(daemon_.socket, &probe) == 0) {
			zc_disconnect(probe);
			return;
		}
		cr_assert_lt(itd_now(), deadline, "zoffloadd did not come back: %s",
		    itd_log_text(&daemon_));
		usleep(5000);
	}
}

static void
kill_daemon(void)
{
	cr_assert_eq(kill(daemon_.pid, SIGKILL), 0);
	cr_assert_eq(waitpid(daemon_.pid, NULL, 0), daemon_.pid);
	daemon_.pid = 0;
}

/*
 * A daemon that comes back without the job's state (this one keeps none
 * across a restart): the client says so and stops, rather than register the
 * tensors anew and go on from fresh values.
 */
Test(reconnect, lost_state_is_an_error)
{
	struct zc_conn *c = itd_connect(&daemon_);
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-2, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	struct zc_step_result res;
	struct zc_tensor *t[NT];
	int r;

	cr_assert_eq(zc_job_open(c, "lost", 0, 1), 0, "%s", zc_errmsg(c));
	register_all(c, t);
	write_grads(t, 1);
	cr_assert_eq(zc_step_submit(c, &sp, t, NT), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, &res), 0, "%s", zc_errmsg(c));
	kill_daemon();
	restart_daemon();

	sp.step = 2;
	r = zc_step_submit(c, &sp, t, NT);
	cr_assert_eq(r, -ESTALE, "submit to a daemon that lost the job gave %d (%s)", r,
	    zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "zoffloadd lost the state of job 'lost' rank 0") != NULL,
	    "%s", zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "nothing was re-initialized") != NULL, "%s", zc_errmsg(c));
	/* Dead for good: every later call says the same. */
	r = zc_ping(c, NULL);
	cr_assert_eq(r, -ESTALE, "ping after it gave %d (%s)", r, zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, &res), -ESTALE);
	zc_disconnect(c);
}

/* A step in flight when the daemon dies and comes back empty: its wait fails the same way. */
Test(reconnect, lost_state_fails_the_wait)
{
	struct zc_conn *c = itd_connect(&daemon_);
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-2, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	struct zc_step_result res;
	struct zc_tensor *t[NT];
	int r;

	cr_assert_eq(zc_job_open(c, "lostwait", 0, 1), 0, "%s", zc_errmsg(c));
	register_all(c, t);
	write_grads(t, 1);
	kill(daemon_.pid, SIGSTOP);
	cr_assert_eq(zc_step_submit(c, &sp, t, NT), 0, "%s", zc_errmsg(c));
	kill_daemon();
	restart_daemon();
	r = zc_wait_tensor(t[1], &res);
	cr_assert_eq(r, -ESTALE, "wait gave %d (%s)", r, zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "lost the state") != NULL, "%s", zc_errmsg(c));
	zc_disconnect(c);
}

/* The fail-fast option: the behaviour before reconnects. */
Test(reconnect, fail_fast_option)
{
	struct zc_conn *c = connect_relay();
	struct zc_conn_stats cs;
	struct zc_tensor *t[NT];
	int r;

	cr_assert_eq(zc_set_reconnect(c, 0), 0);
	cr_assert_eq(zc_job_open(c, "failfast", 0, 1), 0, "%s", zc_errmsg(c));
	register_all(c, t);
	relay_cut_now(&relay_);
	r = zc_ping(c, NULL);
	cr_assert_eq(r, -ECONNRESET, "ping on a cut connection gave %d (%s)", r, zc_errmsg(c));
	cr_assert_str_eq(zc_errmsg(c), "zoffloadd closed the connection");
	zc_conn_stats(c, &cs);
	cr_assert_eq(cs.reconnects, 0);
	cr_assert_eq(relay_.clients, 1, "the client came back");
	zc_disconnect(c);
}

/* The same from the environment, and a value there that means nothing is refused. */
Test(reconnect, environment_default)
{
	struct zc_conn *c = NULL;
	int r;

	cr_assert_eq(setenv("ZOFFLOAD_RECONNECT_MS", "soon", 1), 0);
	r = zc_connect(daemon_.socket, &c);
	cr_assert_eq(r, -EINVAL, "connect with a bad ZOFFLOAD_RECONNECT_MS gave %d", r);
	cr_assert(strstr(zc_connect_errmsg(), "$ZOFFLOAD_RECONNECT_MS is 'soon'") != NULL, "%s",
	    zc_connect_errmsg());
	cr_assert_eq(setenv("ZOFFLOAD_RECONNECT_MS", "0", 1), 0);
	c = connect_relay();
	unsetenv("ZOFFLOAD_RECONNECT_MS");
	relay_cut_now(&relay_);
	r = zc_ping(c, NULL);
	cr_assert_eq(r, -ECONNRESET, "ping gave %d (%s)", r, zc_errmsg(c));
	cr_assert_str_eq(zc_errmsg(c), "zoffloadd closed the connection");
	zc_disconnect(c);
}

/* A daemon that does not come back: a clear error once the reconnect timeout is over. */
Test(reconnect, timeout_expires)
{
	struct zc_conn *c = itd_connect(&daemon_);
	struct zc_step_result res;
	struct zc_tensor *t[NT];
	int r;

	cr_assert_eq(zc_set_reconnect(c, 300), 0);
	cr_assert_eq(zc_job_open(c, "gone", 0, 1), 0, "%s", zc_errmsg(c));
	register_all(c, t);
	kill_daemon();
	r = zc_ping(c, NULL);
	cr_assert_eq(r, -ECONNRESET, "ping gave %d (%s)", r, zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "did not come back within the reconnect timeout of 300 "
	    "ms") != NULL, "%s", zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), daemon_.socket) != NULL, "%s", zc_errmsg(c));
	r = zc_wait_all(c, &res);
	cr_assert_eq(r, -ECONNRESET, "wait after it gave %d (%s)", r, zc_errmsg(c));
	zc_disconnect(c);
}

/* A wait with its own timeout stops trying to reconnect at it; the next call goes on. */
Test(reconnect, wait_timeout_during_reconnect)
{
	struct zc_conn *c = itd_connect(&daemon_);
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-2, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	struct zc_step_result res;
	struct zc_tensor *t[NT];
	int r;

	cr_assert_eq(zc_job_open(c, "waits", 0, 1), 0, "%s", zc_errmsg(c));
	register_all(c, t);
	write_grads(t, 1);
	kill(daemon_.pid, SIGSTOP);
	cr_assert_eq(zc_step_submit(c, &sp, t, NT), 0, "%s", zc_errmsg(c));
	kill_daemon();
	r = zc_wait_all_timeout(c, &res, 100);
	cr_assert_eq(r, -ETIMEDOUT, "wait with no daemon gave %d (%s)", r, zc_errmsg(c));
	r = zc_wait_tensor_timeout(t[0], &res, 0);
	cr_assert_eq(r, -ETIMEDOUT, "poll with no daemon gave %d (%s)", r, zc_errmsg(c));
	/* Back, but empty: the wait that reconnects says the state is gone. */
	restart_daemon();
	r = zc_wait_all_timeout(c, &res, 30000);
	cr_assert_eq(r, -ESTALE, "wait gave %d (%s)", r, zc_errmsg(c));
	zc_disconnect(c);
}

/*
 * Requests that free state, carried out before the connection went: their
 * tensors may come back new (that is no lost state), and the request goes
 * again to free them on the new session.  Nothing is left in the daemon.
 */
Test(reconnect, freeing_requests_carried_out_before_the_cut)
{
	struct zc_conn *c = connect_relay(), *probe;
	struct zc_tensor *t[NT];
	struct zc_conn_stats cs;

	cr_assert_eq(zc_job_open(c, "frees", 0, 1), 0, "%s", zc_errmsg(c));
	register_all(c, t);
	relay_cut_at(&relay_, ZP_TENSOR_UNREGISTER, true, true);
	cr_assert_eq(zc_tensor_unregister(t[1]), 0, "%s", zc_errmsg(c));
	relay_cut_at(&relay_, ZP_JOB_CLOSE, true, true);
	cr_assert_eq(zc_job_close(c), 0, "%s", zc_errmsg(c));
	zc_conn_stats(c, &cs);
	cr_assert_eq(cs.reconnects, 2);
	probe = itd_connect(&daemon_);
	cr_assert_eq(itd_stat(probe, "tensors"), 0, "tensors left in the daemon");
	zc_disconnect(probe);
	/* The connection goes on: a job again. */
	cr_assert_eq(zc_job_open(c, "frees", 0, 1), 0, "%s", zc_errmsg(c));
	register_all(c, t);
	zc_disconnect(c);
}

/*
 * A connection the daemon closes on purpose, saying why (its job was
 * dropped), is not one to come back to: every later call says why.
 */
Test(reconnect, dropped_job_is_not_reconnected)
{
	struct zc_conn *c = itd_connect(&daemon_), *other = itd_connect(&daemon_);
	struct zc_conn_stats cs;
	struct zc_tensor *t[NT];
	int r;

	cr_assert_eq(zc_job_open(c, "dropped", 0, 1), 0, "%s", zc_errmsg(c));
	register_all(c, t);
	cr_assert_eq(zc_job_drop(other, "dropped"), 0, "%s", zc_errmsg(other));
	for (int i = 0; i < 3; i++) {
		r = zc_ping(c, NULL);
		cr_assert_eq(r, -ECONNABORTED, "call %d after the drop gave %d (%s)", i, r,
		    zc_errmsg(c));
		cr_assert(strstr(zc_errmsg(c), "job 'dropped' was dropped") != NULL, "%s",
		    zc_errmsg(c));
	}
	zc_conn_stats(c, &cs);
	cr_assert_eq(cs.reconnects, 0);
	zc_disconnect(other);
	zc_disconnect(c);
}

/*
 * A restore of several tensors keeps requests of each in flight on one
 * connection; cut under it, it fails as a whole (nothing left registered)
 * and the same restore done again after the reconnect gives the saved state.
 */
Test(reconnect, restore_cut_fails_whole_and_can_be_done_again)
{
	struct zc_conn *c = itd_connect(&daemon_);
	struct zc_checkpoint_entry entries[NT];
	struct zc_tensor *t[NT], *back[NT] = { 0 };
	struct zc_checkpoint *ck = NULL;
	struct zc_step_params last = { .optim = ZC_ADAMW, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	struct zc_conn_stats cs;
	float *saved[NT];
	char dir[200];
	int r;

	snprintf(dir, sizeof(dir), "%s/ckpt", daemon_.dir);
	cr_assert_eq(mkdir(dir, 0700), 0);
	cr_assert_eq(zc_job_open(c, "saver", 0, 1), 0, "%s", zc_errmsg(c));
	register_all(c, t);
	for (int k = 0; k < NT; k++) {
		entries[k] = (struct zc_checkpoint_entry){ .tensor = t[k] };
		saved[k] = malloc(descs[k].numel * sizeof(float));
		cr_assert_eq(zc_tensor_read(t[k], ZC_STATE_MASTER, 0, descs[k].numel, saved[k]), 0);
	}
	cr_assert_eq(zc_checkpoint_save(c, dir, entries, NT, &last), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);

	c = connect_relay();
	cr_assert_eq(zc_job_open(c, "restorer", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_checkpoint_open(c, dir, &ck), 0, "%s", zc_errmsg(c));
	relay_cut_at(&relay_, ZP_CKPT_DONE, false, false);
	r = zc_tensors_register_checkpoint(c, NT, descs, ck, NULL, ZC_ADAMW, back);
	cr_assert_eq(r, -ECONNRESET, "a restore cut under it gave %d (%s)", r, zc_errmsg(c));
	for (int k = 0; k < NT; k++)
		cr_assert_null(back[k], "tensor %d handed out by a failed restore", k);
	r = zc_tensors_register_checkpoint(c, NT, descs, ck, NULL, ZC_ADAMW, back);
	cr_assert_eq(r, 0, "the restore done again: %s", zc_errmsg(c));
	zc_conn_stats(c, &cs);
	cr_assert_eq(cs.reconnects, 1, "%" PRIu64 " reconnects", (uint64_t)cs.reconnects);
	for (int k = 0; k < NT; k++) {
		float *got = malloc(descs[k].numel * sizeof(float));

		cr_assert_eq(zc_tensor_read(back[k], ZC_STATE_MASTER, 0, descs[k].numel, got), 0,
		    "%s", zc_errmsg(c));
		cr_assert_eq(memcmp(got, saved[k], descs[k].numel * sizeof(float)), 0,
		    "%s restored differs from what was saved", descs[k].name);
		free(got);
		free(saved[k]);
	}
	zc_checkpoint_close(ck);
	zc_disconnect(c);
}
