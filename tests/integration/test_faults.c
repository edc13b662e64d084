/* A real zoffloadd under faults: malformed and wrong-version clients, a client killed mid-step, a full pinned budget, SIGTERM mid-step. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "itd.h"
#include "msgio.h"

static struct itd daemon_;

static void
teardown(void)
{
	itd_cleanup(&daemon_);
}

TestSuite(faults, .fini = teardown, .timeout = 60);

/* After a fault, a fresh client still gets served. */
static void
expect_serving(void)
{
	struct zc_conn *c = itd_connect(&daemon_);
	uint64_t rtt = 0;

	cr_assert_eq(zc_ping(c, &rtt), 0, "ping after the fault: %s", zc_errmsg(c));
	zc_disconnect(c);
}

/* Sends a raw datagram and expects ERROR(code) naming `text`, then the connection closed. */
static void
expect_refused(const void *data, size_t len, bool hello_first, int code, const char *text)
{
	int fd = itd_raw_connect(&daemon_);

	if (hello_first)
		itd_raw_hello(fd);
	cr_assert_eq(zp_send_raw(fd, data, len, NULL, 0), 0);
	itd_raw_expect_refusal(fd, code, text);
}

static size_t
encode(const struct zp_msg *m, uint8_t *buf)
{
	size_t len;

	cr_assert_eq(zp_encode(m, buf, ZP_MAX_MESSAGE, &len), ZP_S_OK);
	return len;
}

Test(faults, malformed_messages)
{
	static uint8_t buf[ZP_MAX_MESSAGE];
	static struct zp_msg m;
	size_t len;

	itd_start(&daemon_, NULL);

	/* Garbage shorter than a header. */
	expect_refused("hello?", 6, false, -EBADMSG, "shorter than");
	/* 32 bytes of garbage: a header with the wrong magic. */
	memset(buf, 0xee, 32);
	expect_refused(buf, 32, false, -EBADMSG, "magic");

	/* Well-formed header, unknown type. */
	m.hdr.type = ZP_PING;
	len = encode(&m, buf);
	buf[6] = 63;
	expect_refused(buf, len, true, -EBADMSG, "unknown message type 63");

	/* A reply type sent as a request. */
	m.hdr.type = ZP_PONG;
	len = encode(&m, buf);
	expect_refused(buf, len, true, -EBADMSG, "PONG is not a request");

	/* Header promises more payload than there is. */
	m.hdr.type = ZP_PING;
	len = encode(&m, buf);
	buf[16] = 4;
	expect_refused(buf, len, true, -EBADMSG, "PING");

	/* Bad field: world size 0, named with its message type. */
	memset(&m, 0, sizeof(m));
	m.hdr.type = ZP_JOB_OPEN;
	strcpy(m.u.job_open.job_name, "j");
	len = encode(&m, buf);
	expect_refused(buf, len, true, -EBADMSG, "JOB_OPEN: world_size");

	/* A request before HELLO. */
	memset(&m, 0, sizeof(m));
	m.hdr.type = ZP_STATS;
	len = encode(&m, buf);
	expect_refused(buf, len, false, -EPROTO, "before HELLO");

	/* Clients never send descriptors. */
	{
		static struct zp_msg r;
		int fd = itd_raw_connect(&daemon_), pass = STDIN_FILENO;

		itd_raw_hello(fd);
		m.hdr.type = ZP_PING;
		len = encode(&m, buf);
		cr_assert_eq(zp_send_raw(fd, buf, len, &pass, 1), 0);
		cr_assert(itd_raw_recv(fd, &r, 5));
		cr_assert_eq(r.hdr.type, ZP_ERROR);
		cr_assert(strstr(r.u.error.message, "descriptor") != NULL, "%s", r.u.error.message);
		cr_assert_not(itd_raw_recv(fd, &r, 5));
		close(fd);
	}
	expect_serving();
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "exit status after faults: %s",
	    itd_log_text(&daemon_));
}

Test(faults, wrong_protocol_version)
{
	static uint8_t buf[ZP_MAX_MESSAGE];
	static struct zp_msg m;
	size_t len;

	itd_start(&daemon_, NULL);
	strcpy(m.u.hello.client_name, "from the future");
	m.hdr.type = ZP_HELLO;
	len = encode(&m, buf);
	buf[4] = 7;	/* version 7 */
	buf[5] = 0;
	expect_refused(buf, len, false, -EPROTONOSUPPORT, "version 7");
	expect_serving();
	cr_assert_eq(itd_stop(&daemon_, 10), 0);
}

/* A value of the named dotted path in the stats JSON, as an integer. */
static uint64_t
stat_u64(struct zc_conn *c, const char *path)
{
	return (uint64_t)itd_stat(c, path);
}

/* Child: one rank with a 20M-parameter tensor, submits a step, tells the parent, waits to die. */
static void
victim(int report)
{
	struct zc_tensor_desc desc = { .name = "huge", .numel = 20u << 20, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16 };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 };
	struct zc_conn *c;
	struct zc_tensor *t;
	float *init = calloc(desc.numel, sizeof(float));
	char ok = 'k';

	if (init == NULL || zc_connect(daemon_.socket, &c) < 0 ||
	    zc_job_open(c, "victim", 0, 1) < 0 || zc_tensor_register(c, &desc, init, &t) < 0)
		_exit(2);
	memset(zc_tensor_grad_slot(t, NULL), 0x3c, desc.numel * sizeof(float));
	if (zc_step_submit(c, &sp, &t, 1) < 0)
		_exit(3);
	/* The ping's reply comes after the daemon has taken the step in. */
	if (zc_ping(c, NULL) < 0)
		_exit(4);
	if (write(report, &ok, 1) != 1)
		_exit(5);
	pause();
	_exit(0);
}

Test(faults, client_killed_mid_step)
{
	/* No grace: a dead rank's state is freed at once rather than kept for a reattach. */
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"limits\": { \"detach_grace_s\": 0 } }";
	struct zc_tensor_desc desc = { .name = "small", .numel = 1000, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	uint64_t pinned0, shm0, pinned, shm;
	struct zc_conn *c;
	struct zc_tensor *t;
	float init[1000], got[1000];
	double deadline;
	int status;

	itd_start(&daemon_, config);
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "survivor", 0, 1), 0, "%s", zc_errmsg(c));
	for (int i = 0; i < 1000; i++)
		init[i] = (float)i / 1000.0f;
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	pinned0 = stat_u64(c, "tiers.pinned.used_bytes");
	shm0 = stat_u64(c, "tiers.shm.used_bytes");

	itd_fork_client(&daemon_, victim, 30, "the victim", "submit");
	/* Its 20M parameters hold 240 MB of state: the step of it takes tens of ms. */
	cr_assert_geq(stat_u64(c, "steps.in_flight"), 1, "the victim's step is not in flight");
	cr_assert_gt(stat_u64(c, "tiers.pinned.used_bytes"), pinned0 + (200u << 20));
	cr_assert_eq(itd_kill_client(&daemon_, &status), 0);
	cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "victim status 0x%x", status);

	/* Memory comes back once the orphaned step is done. */
	deadline = itd_now() + 5;
	do {
		pinned = stat_u64(c, "tiers.pinned.used_bytes");
		shm = stat_u64(c, "tiers.shm.used_bytes");
		if (pinned == pinned0 && shm == shm0)
			break;
		usleep(20000);
	} while (itd_now() < deadline);
	cr_assert_eq(pinned, pinned0, "pinned %llu bytes, %llu before the victim: %s",
	    (unsigned long long)pinned, (unsigned long long)pinned0, itd_log_text(&daemon_));
	cr_assert_eq(shm, shm0, "shm %llu bytes, %llu before the victim",
	    (unsigned long long)shm, (unsigned long long)shm0);

	/* The survivor steps as if nothing happened: grads of 1 move every weight by ~lr. */
	for (int i = 0; i < 1000; i++)
		((float *)zc_tensor_grad_slot(t, NULL))[i] = 1.0f;
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, NULL), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, 1000, got), 0, "%s", zc_errmsg(c));
	for (int i = 0; i < 1000; i++) {
		/* Step 1 of Adam with g = 1: p - lr * 1 / (1 + eps), to fp32 rounding of p. */
		double want = (double)init[i] - 1e-3 / (1 + 1e-8);

		cr_assert(fabs(got[i] - want) <= 1e-6, "[%d] %.9g, want %.9g", i, got[i], want);
	}
	cr_assert_eq(stat_u64(c, "sessions"), 1);
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

Test(faults, pinned_budget_exceeded)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"memory\": { \"pinned_budget\": \"16M\" } }";
	/* 2M elements need 3 x 8 MiB of state; 1M elements 3 x 4 MiB (plus padding). */
	struct zc_tensor_desc big = { .name = "big", .numel = 2u << 20, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16 };
	struct zc_tensor_desc small = { .name = "small", .numel = 1u << 20, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16 };
	struct zc_tensor *t1, *t2;
	struct zc_conn *c;
	float *init = calloc(2u << 20, sizeof(float));
	int r;

	cr_assert_not_null(init);
	itd_start(&daemon_, config);
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "budget", 0, 1), 0, "%s", zc_errmsg(c));
	r = zc_tensor_register(c, &big, init, &t1);
	cr_assert_eq(r, -ENOSPC, "24 MiB in a 16 MiB budget gave %d: %s", r, zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "budget") != NULL, "'%s' does not mention the budget",
	    zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "big") != NULL, "'%s' does not name the tensor",
	    zc_errmsg(c));
	/* The refusal cost nothing and the connection works. */
	cr_assert_eq(stat_u64(c, "tiers.pinned.used_bytes"), 0);
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	r = zc_tensor_register(c, &small, init, &t1);
	cr_assert_eq(r, 0, "a 12 MiB tensor in a 16 MiB budget: %s", zc_errmsg(c));
	/* A second one does not fit beside it, and fits once the first is gone. */
	small.name = "small2";
	r = zc_tensor_register(c, &small, init, &t2);
	cr_assert_eq(r, -ENOSPC, "second 12 MiB tensor gave %d: %s", r, zc_errmsg(c));
	cr_assert_eq(zc_tensor_unregister(t1), 0, "%s", zc_errmsg(c));
	r = zc_tensor_register(c, &small, init, &t2);
	cr_assert_eq(r, 0, "after unregister: %s", zc_errmsg(c));
	expect_serving();
	free(init);
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

Test(faults, sigterm_finishes_step_in_flight)
{
	/* Two sets of 8M parameters: ~100 ms of work that must finish, not be dropped. */
	enum { N = 8u << 20, SETS = 2 };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	struct zc_tensor *t[SETS];
	struct zc_step_result res;
	struct zc_conn *c;
	float *init = malloc(N * sizeof(float));
	int status;

	cr_assert_not_null(init);
	for (size_t i = 0; i < N; i++)
		init[i] = (float)(i % 1000) / 1000.0f;
	itd_start(&daemon_, NULL);
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "draining", 0, 1), 0, "%s", zc_errmsg(c));
	for (int k = 0; k < SETS; k++) {
		char name[8];
		struct zc_tensor_desc desc = { .name = name, .numel = N, .grad_dtype = ZC_F32,
			.param_dtype = ZC_F32 };
		float *g;

		snprintf(name, sizeof(name), "t%d", k);
		cr_assert_eq(zc_tensor_register(c, &desc, init, &t[k]), 0, "%s", zc_errmsg(c));
		g = zc_tensor_grad_slot(t[k], NULL);
		for (size_t i = 0; i < N; i++)
			g[i] = 1.0f;
	}
	for (int k = 0; k < SETS; k++)
		cr_assert_eq(zc_step_submit(c, &sp, &t[k], 1), 0, "%s", zc_errmsg(c));
	/* The stats reply comes after both submissions were taken in. */
	cr_assert_geq(itd_stat(c, "steps.in_flight"), 1, "nothing in flight to finish");
	cr_assert_eq(kill(daemon_.pid, SIGTERM), 0);

	for (int k = 0; k < SETS; k++) {
		cr_assert_eq(zc_wait_tensor(t[k], &res), 0, "set %d after SIGTERM: %s", k,
		    zc_errmsg(c));
		cr_assert_eq(res.status, ZC_STEP_APPLIED);
		cr_assert_eq(res.step, 1);
	}
	cr_assert_eq(zc_wait_all(c, &res), 0, "%s", zc_errmsg(c));
	/* The param slots (our mapping outlives the daemon) hold the stepped weights. */
	for (int k = 0; k < SETS; k++) {
		const float *p = zc_tensor_param_slot(t[k], NULL);

		for (size_t i = 0; i < N; i += 4099) {
			double want = (double)init[i] - 1e-3 / (1 + 1e-8);

			cr_assert(fabs(p[i] - want) <= 1e-6, "t%d[%zu] = %.9g, want %.9g", k, i,
			    (double)p[i], want);
		}
	}
	status = itd_wait(&daemon_, 20);
	cr_assert(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
	    "status 0x%x after SIGTERM: %s", status, itd_log_text(&daemon_));
	cr_assert(strstr(itd_log_text(&daemon_), "SIGTERM") != NULL, "%s", itd_log_text(&daemon_));
	free(init);
	zc_disconnect(c);
}
