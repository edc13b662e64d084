/* Client waits against a daemon that fails or stops answering: nothing is left waiting for ever. */
#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
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
	if (daemon_.pid > 0)
		kill(daemon_.pid, SIGCONT);
	itd_cleanup(&daemon_);
}

TestSuite(waits, .init = setup, .fini = teardown, .timeout = 60);

#define NUMEL 1000

static struct zc_tensor *
register_offloaded(struct zc_conn *c, const char *name)
{
	struct zc_tensor_desc desc = { .name = name, .numel = NUMEL, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16, .param_offload = true };
	static float init[NUMEL];
	struct zc_tensor *t = NULL;

	for (size_t i = 0; i < NUMEL; i++)
		init[i] = (float)i / NUMEL;
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "register %s: %s", name,
	    zc_errmsg(c));
	return t;
}

/*
 * A prefetch whose request cannot be sent must leave the tensor released:
 * marked as being fetched, zc_param_wait would wait for an answer to a
 * request the daemon never got.  Here the connection stays up (the relay
 * still passes the daemon's messages) but the client's sends fail.
 */
Test(waits, failed_prefetch_is_not_left_fetching)
{
	char path[160];
	struct zc_conn *c = NULL;
	struct zc_tensor *t;
	int r;

	snprintf(path, sizeof(path), "%s/relay.sock", daemon_.dir);
	relay_start(&relay_, path, daemon_.socket);
	cr_assert_eq(zc_connect(path, &c), 0, "connect through the relay");
	/* Fail rather than reconnect: the relay takes one client at a time, this one stays. */
	cr_assert_eq(zc_set_reconnect(c, 0), 0);
	cr_assert_eq(zc_job_open(c, "cut", 0, 1), 0, "%s", zc_errmsg(c));
	t = register_offloaded(c, "w");
	cr_assert_eq(zc_param_release(c, &t, 1), 0, "%s", zc_errmsg(c));

	relay_cut_requests(&relay_);
	r = zc_param_prefetch(c, &t, 1);
	cr_assert_eq(r, -EPIPE, "prefetch over a cut connection gave %d (%s)", r, zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "send PARAM_FETCH") != NULL, "%s", zc_errmsg(c));
	/* Still released: the wait asks again, and that send fails the same way. */
	r = zc_param_wait(t);
	cr_assert_eq(r, -EPIPE, "wait after a failed prefetch gave %d (%s)", r, zc_errmsg(c));
	zc_disconnect(c);
}

/* SIGSTOP, and wait (bounded) until the daemon's main thread, the one that reads sockets, is stopped. */
static void
stop_daemon(void)
{
	char path[64], stat[512];
	double deadline = itd_now() + 10;

	cr_assert_eq(kill(daemon_.pid, SIGSTOP), 0);
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)daemon_.pid);
	for (;;) {
		FILE *f = fopen(path, "r");
		size_t n = f != NULL ? fread(stat, 1, sizeof(stat) - 1, f) : 0;
		const char *state;

		if (f != NULL)
			fclose(f);
		stat[n] = '\0';
		/* "pid (comm) S ...": the state follows the last ')'. */
		state = strrchr(stat, ')');
		if (state != NULL && state[1] == ' ' && (state[2] == 'T' || state[2] == 't'))
			return;
		cr_assert_lt(itd_now(), deadline, "zoffloadd did not stop within 10 s: %s", stat);
		usleep(1000);
	}
}

static void
continue_daemon(void)
{
	cr_assert_eq(kill(daemon_.pid, SIGCONT), 0);
}

static struct zc_tensor *
register_plain(struct zc_conn *c, const char *name)
{
	struct zc_tensor_desc desc = { .name = name, .numel = NUMEL, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	static float init[NUMEL];
	struct zc_tensor *t = NULL;

	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "register %s: %s", name,
	    zc_errmsg(c));
	return t;
}

static const struct zc_step_params sgd_like = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-3,
	.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8 };

/*
 * A step the daemon cannot answer (it is stopped): the waits return
 * -ETIMEDOUT, nothing is lost, and once it runs again the same step's
 * result arrives, found here by polling the connection's descriptor.
 */
Test(waits, step_waits_time_out_and_resume)
{
	struct zc_conn *c = itd_connect(&daemon_);
	struct zc_step_result res = { 0 };
	struct zc_tensor *t;
	double deadline;
	int r;

	cr_assert_eq(zc_job_open(c, "stopped", 0, 1), 0, "%s", zc_errmsg(c));
	t = register_plain(c, "w");
	stop_daemon();
	cr_assert_eq(zc_step_submit(c, &sgd_like, &t, 1), 0, "%s", zc_errmsg(c));
	r = zc_wait_all_timeout(c, &res, 200);
	cr_assert_eq(r, -ETIMEDOUT, "wait_all on a stopped daemon gave %d (%s)", r, zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "not done after 200 ms") != NULL, "%s", zc_errmsg(c));
	r = zc_wait_tensor_timeout(t, &res, 0);
	cr_assert_eq(r, -ETIMEDOUT, "a poll of the tensor gave %d (%s)", r, zc_errmsg(c));
	/* The tensor is still in its step: the client says so rather than sending. */
	cr_assert_eq(zc_step_submit(c, &sgd_like, &t, 1), -EBUSY);

	continue_daemon();
	deadline = itd_now() + 30;
	for (;;) {
		struct pollfd p = { .fd = zc_conn_fd(c), .events = POLLIN };

		cr_assert_lt(itd_now(), deadline, "no step result within 30 s of SIGCONT");
		if (poll(&p, 1, 1000) != 1)
			continue;
		r = zc_wait_tensor_timeout(t, &res, 0);
		if (r != -ETIMEDOUT)
			break;
	}
	cr_assert_eq(r, 0, "%s", zc_errmsg(c));
	cr_assert_eq(res.status, ZC_STEP_APPLIED);
	cr_assert_eq(res.step, 1);
	cr_assert_eq(zc_wait_all_timeout(c, &res, 30000), 0, "%s", zc_errmsg(c));
	/* The connection goes on. */
	memset(zc_tensor_grad_slot(t, NULL), 0, NUMEL * sizeof(float));
	struct zc_step_params next = sgd_like;

	next.step = 2;
	cr_assert_eq(zc_step_submit(c, &next, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all_timeout(c, &res, 30000), 0, "%s", zc_errmsg(c));
	cr_assert_eq(res.step, 2);
	zc_disconnect(c);
}

/*
 * Requests: one that only reads leaves the connection usable when it times
 * out; one that changes something breaks it, clearly, for every later call.
 */
Test(waits, request_timeouts)
{
	struct zc_conn *c = itd_connect(&daemon_);
	struct zc_tensor *t;
	float out[NUMEL];
	int r;

	cr_assert_eq(zc_set_timeout(c, 0), -EINVAL);
	cr_assert_eq(zc_set_timeout(c, 200), 0);
	cr_assert_eq(zc_job_open(c, "requests", 0, 1), 0, "%s", zc_errmsg(c));
	t = register_plain(c, "w");

	stop_daemon();
	r = zc_ping(c, NULL);
	cr_assert_eq(r, -ETIMEDOUT, "ping to a stopped daemon gave %d (%s)", r, zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "did not answer PING within 200 ms") != NULL, "%s",
	    zc_errmsg(c));
	continue_daemon();
	/* The late PONG is skipped; this ping gets its own. */
	cr_assert_eq(zc_set_timeout(c, 30000), 0);
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, NUMEL, out), 0, "%s", zc_errmsg(c));

	cr_assert_eq(zc_set_timeout(c, 200), 0);
	stop_daemon();
	r = zc_tensor_read(t, ZC_STATE_MASTER, 0, NUMEL, out);
	cr_assert_eq(r, -ETIMEDOUT, "read from a stopped daemon gave %d (%s)", r, zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "no longer usable") != NULL, "%s", zc_errmsg(c));
	continue_daemon();
	cr_assert_eq(zc_set_timeout(c, 30000), 0);
	r = zc_ping(c, NULL);
	cr_assert_eq(r, -ENOTCONN, "ping on a broken connection gave %d (%s)", r, zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "TENSOR_READ got no answer in time") != NULL, "%s",
	    zc_errmsg(c));
	zc_disconnect(c);

	/* A new connection works. */
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
}

/*
 * A send that finds no room (the stopped daemon reads nothing) times out
 * too, sending nothing; a param wait bounds the fetch it has to send by
 * its own timeout, and leaves the tensor released for the next one.
 */
Test(waits, send_times_out)
{
	struct zc_conn *c = itd_connect(&daemon_);
	int small = 4096, r = 0;
	struct zc_tensor *t;
	bool no_room = false;

	cr_assert_eq(zc_job_open(c, "full", 0, 1), 0, "%s", zc_errmsg(c));
	t = register_offloaded(c, "w");
	cr_assert_eq(zc_param_release(c, &t, 1), 0, "%s", zc_errmsg(c));
	/* A small send buffer fills after a few messages rather than a few hundred. */
	cr_assert_eq(setsockopt(zc_conn_fd(c), SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)), 0);
	cr_assert_eq(zc_set_timeout(c, 20), 0);
	stop_daemon();
	for (int i = 0; i < 1000 && !no_room; i++) {
		r = zc_ping(c, NULL);
		cr_assert_eq(r, -ETIMEDOUT, "ping %d gave %d (%s)", i, r, zc_errmsg(c));
		no_room = strstr(zc_errmsg(c), "timed out with no room to send") != NULL;
	}
	cr_assert(no_room, "the send buffer never filled: %s", zc_errmsg(c));
	/* No request timeout now: only the wait's own bounds the PARAM_FETCH it sends. */
	cr_assert_eq(zc_set_timeout(c, -1), 0);
	r = zc_param_wait_timeout(t, 100);
	cr_assert_eq(r, -ETIMEDOUT, "param wait with a full send buffer gave %d (%s)", r,
	    zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "send PARAM_FETCH") != NULL, "%s", zc_errmsg(c));
	continue_daemon();
	cr_assert_eq(zc_set_timeout(c, 30000), 0);
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_param_wait_timeout(t, 30000), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
}

/* Parameters that do not come back in time: -ETIMEDOUT, then the same fetch completes. */
Test(waits, param_wait_times_out)
{
	struct zc_conn *c = itd_connect(&daemon_);
	struct zc_param_stats ps;
	struct zc_tensor *t;
	int r;

	cr_assert_eq(zc_job_open(c, "params", 0, 1), 0, "%s", zc_errmsg(c));
	t = register_offloaded(c, "w");
	cr_assert_eq(zc_param_release(c, &t, 1), 0, "%s", zc_errmsg(c));
	stop_daemon();
	cr_assert_eq(zc_param_prefetch(c, &t, 1), 0, "%s", zc_errmsg(c));
	r = zc_param_wait_timeout(t, 200);
	cr_assert_eq(r, -ETIMEDOUT, "param wait on a stopped daemon gave %d (%s)", r,
	    zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "not back after 200 ms") != NULL, "%s", zc_errmsg(c));
	cr_assert_eq(zc_param_wait_timeout(t, 0), -ETIMEDOUT);
	continue_daemon();
	cr_assert_eq(zc_param_wait_timeout(t, 30000), 0, "%s", zc_errmsg(c));
	cr_assert_eq(((const uint16_t *)zc_tensor_param_slot(t, NULL))[NUMEL - 1],
	    zc_f32_to_bf16((float)(NUMEL - 1) / NUMEL), "the params did not come back");
	/* Three calls, one wait: counted once in waited. */
	zc_param_stats(c, &ps);
	cr_assert_eq(ps.waited, 1);
	cr_assert_eq(ps.ready, 0);
	cr_assert_eq(zc_param_wait_timeout(t, 0), 0);
	zc_param_stats(c, &ps);
	cr_assert_eq(ps.ready, 1);
	zc_disconnect(c);
}

/* HELLO unanswered: zc_connect_timeout gives up rather than hang. */
Test(waits, connect_times_out)
{
	struct zc_conn *c = NULL;
	int r;

	stop_daemon();
	r = zc_connect_timeout(daemon_.socket, 200, &c);
	cr_assert_eq(r, -ETIMEDOUT, "connect to a stopped daemon gave %d", r);
	cr_assert_null(c);
	cr_assert_eq(zc_connect_timeout(daemon_.socket, 0, &c), -EINVAL);
	continue_daemon();
	cr_assert_eq(zc_connect_timeout(daemon_.socket, 30000, &c), 0);
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
}
