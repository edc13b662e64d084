/* Clients that die, crowd in, churn and stop reading: the daemon stays up, gives every byte and descriptor back, and other clients' results stay exact. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "msgio.h"
#include "svc.h"

static struct itd daemon_;

static void
teardown(void)
{
	itd_cleanup(&daemon_);
}

TestSuite(churn, .fini = teardown, .timeout = 120);

/* A 64 KiB transfer window per connection: hundreds of clients need no more. */
#define CHURN_CONFIG(extra) \
	"{ \"compute\": { \"worker_threads\": 2 }, \"memory\": { \"xfer_window\": \"64K\" }, " \
	"\"limits\": { \"detach_grace_s\": 0" extra " } }"

static const struct zc_step_params base_params = { .optim = ZC_ADAMW, .lr = 1e-3, .beta1 = 0.9,
	.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 };

/* Gradients of step s, the same in every run that asks for them. */
static void
fill_grads(float *g, size_t n, uint64_t s)
{
	struct itd_rng rng = { 0x9e3779b97f4a7c15ull ^ (s * 7919 + 1) };

	for (size_t i = 0; i < n; i++)
		g[i] = (float)itd_uniform(&rng);
}

static void
fill_init(float *p, size_t n)
{
	struct itd_rng rng = { 42 };

	for (size_t i = 0; i < n; i++)
		p[i] = (float)itd_uniform(&rng);
}

/* Steps t once with step s's gradients; asserts it was applied. */
static void
step_once(struct zc_conn *c, struct zc_tensor *t, uint64_t s)
{
	struct zc_step_params sp = base_params;
	struct zc_step_result res;

	sp.step = s;
	fill_grads(zc_tensor_grad_slot(t, NULL), zc_tensor_numel(t), s);
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "step %llu: %s", (unsigned long long)s,
	    zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, &res), 0, "step %llu: %s", (unsigned long long)s, zc_errmsg(c));
	cr_assert_eq(res.status, ZC_STEP_APPLIED, "step %llu: status %d", (unsigned long long)s,
	    res.status);
}

/* A registered tensor of job/rank 0 with the shared initial values. */
static struct zc_tensor *
open_tensor(struct zc_conn *c, const char *job, size_t n)
{
	struct zc_tensor_desc desc = { .name = "w", .numel = n, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_tensor *t;
	float *init = malloc(n * sizeof(float));

	cr_assert_not_null(init);
	fill_init(init, n);
	cr_assert_eq(zc_job_open(c, job, 0, 1), 0, "%s: %s", job, zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s: %s", job, zc_errmsg(c));
	free(init);
	return t;
}

/* Master, m and v of t, one after the other. */
static float *
read_state(struct zc_tensor *t)
{
	size_t n = zc_tensor_numel(t);
	float *s = malloc(3 * n * sizeof(float));

	cr_assert_not_null(s);
	for (int w = 0; w < 3; w++)
		cr_assert_eq(zc_tensor_read(t, (enum zc_state)w, 0, n, s + w * n), 0);
	return s;
}

/* Child: a rank that registers and steps until it is killed; any point of that may be the last. */
static void
victim(const char *socket, int index, uint64_t seed)
{
	struct itd_rng rng = { seed };
	struct zc_tensor_desc desc = { .name = "v", .grad_dtype = ZC_F32, .param_dtype = ZC_BF16 };
	struct zc_step_params sp = base_params;
	struct zc_conn *c;
	struct zc_tensor *t;
	char job[32];
	float *init;

	/* 1K to 1M elements: small ones die stepping, big ones mid-registration. */
	desc.numel = 1024 + itd_rand(&rng) % (1u << 20);
	init = calloc(desc.numel, sizeof(float));
	snprintf(job, sizeof(job), "victim-%d", index);
	if (init == NULL || zc_connect(socket, &c) < 0 || zc_job_open(c, job, 0, 1) < 0 ||
	    zc_tensor_register(c, &desc, init, &t) < 0)
		_exit(2);
	for (uint64_t s = 1; s < 1000000; s++) {
		sp.step = s;
		fill_grads(zc_tensor_grad_slot(t, NULL), desc.numel < 4096 ? desc.numel : 4096, s);
		if (zc_step_submit(c, &sp, &t, 1) < 0 || zc_wait_all(c, NULL) < 0)
			_exit(3);
	}
	_exit(0);
}

Test(churn, sigkill_clients_at_random_points)
{
	enum { KILLS = 50, N = 4099 };
	struct itd_rng rng = { 20240611 };
	struct zc_conn *c, *control;
	struct zc_tensor *t, *tc;
	uint64_t pinned0, shm0;
	unsigned fds0, fds;
	float *got, *want;
	double v;

	itd_start(&daemon_, CHURN_CONFIG(""));
	c = itd_connect(&daemon_);
	t = open_tensor(c, "survivor", N);
	pinned0 = (uint64_t)itd_stat(c, "tiers.pinned.used_bytes");
	shm0 = (uint64_t)itd_stat(c, "tiers.shm.used_bytes");
	fds0 = svc_fd_count(daemon_.pid);

	for (int k = 0; k < KILLS; k++) {
		uint64_t seed = itd_rand(&rng);
		/* 0 to 40 ms: before the connection, during registration, between and inside steps. */
		useconds_t delay = (useconds_t)(itd_rand(&rng) % 40000);
		pid_t pid = fork();
		int status;

		cr_assert_geq(pid, 0);
		if (pid == 0)
			victim(daemon_.socket, k, seed);
		usleep(delay);
		/* The survivor keeps training while its neighbours die. */
		step_once(c, t, (uint64_t)k + 1);
		kill(pid, SIGKILL);
		cr_assert_eq(waitpid(pid, &status, 0), pid);
		cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
		    "victim %d exited on its own (status 0x%x): %s", k, status,
		    itd_log_text(&daemon_));
	}

	/* Orphaned steps finish, then everything the victims held comes back. */
	v = svc_wait_stat(c, "sessions", 1, 10);
	cr_assert_eq(v, 1, "%.0f sessions after the kills", v);
	v = svc_wait_stat(c, "tiers.pinned.used_bytes", (double)pinned0, 10);
	cr_assert_eq(v, (double)pinned0, "pinned %.0f bytes, %llu before: %s", v,
	    (unsigned long long)pinned0, itd_log_text(&daemon_));
	v = svc_wait_stat(c, "tiers.shm.used_bytes", (double)shm0, 10);
	cr_assert_eq(v, (double)shm0, "shm %.0f bytes, %llu before", v, (unsigned long long)shm0);
	cr_assert_eq(itd_stat(c, "steps.in_flight"), 0);
	fds = svc_wait_fds(daemon_.pid, fds0, 10);
	cr_assert_eq(fds, fds0, "the daemon holds %u descriptors, %u before the kills", fds, fds0);

	/* The survivor's state is exactly what a quiet run of the same steps gives. */
	control = itd_connect(&daemon_);
	tc = open_tensor(control, "control", N);
	for (int k = 0; k < KILLS; k++)
		step_once(control, tc, (uint64_t)k + 1);
	got = read_state(t);
	want = read_state(tc);
	cr_assert(memcmp(got, want, 3 * N * sizeof(float)) == 0,
	    "the survivor's state differs from a run without the kills");
	free(got);
	free(want);
	zc_disconnect(control);
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* One client thread: its own connection and job, a few steps, its final weights. */
#define CROWD 100
#define CROWD_N 1000
#define CROWD_STEPS 5
struct crowd_member {
	int index;
	pthread_barrier_t *barrier;
	float master[CROWD_N];
	char error[256];
};

static void *
crowd_thread(void *arg)
{
	struct crowd_member *cm = arg;
	struct zc_tensor_desc desc = { .name = "w", .numel = CROWD_N, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16 };
	struct zc_step_params sp = base_params;
	struct zc_step_result res;
	struct zc_conn *c = NULL;
	struct zc_tensor *t;
	float init[CROWD_N];
	char job[32];
	int r;

	fill_init(init, CROWD_N);
	snprintf(job, sizeof(job), "crowd-%d", cm->index);
	r = zc_connect(daemon_.socket, &c);
	/* Everyone connected before anyone steps: 100 sessions at once. */
	pthread_barrier_wait(cm->barrier);
	if (r < 0) {
		snprintf(cm->error, sizeof(cm->error), "connect: %d", r);
		return NULL;
	}
	if ((r = zc_job_open(c, job, 0, 1)) < 0 || (r = zc_tensor_register(c, &desc, init, &t)) < 0)
		goto fail;
	for (uint64_t s = 1; s <= CROWD_STEPS; s++) {
		sp.step = s;
		fill_grads(zc_tensor_grad_slot(t, NULL), CROWD_N, s);
		if ((r = zc_step_submit(c, &sp, &t, 1)) < 0 || (r = zc_wait_all(c, &res)) < 0)
			goto fail;
		if (res.status != ZC_STEP_APPLIED) {
			r = -EIO;
			goto fail;
		}
	}
	if ((r = zc_tensor_read(t, ZC_STATE_MASTER, 0, CROWD_N, cm->master)) < 0)
		goto fail;
	zc_disconnect(c);
	return NULL;
fail:
	snprintf(cm->error, sizeof(cm->error), "%s: %d %s", job, r, zc_errmsg(c));
	zc_disconnect(c);
	return NULL;
}

static void
cycle_connections(unsigned n)
{
	for (unsigned i = 0; i < n; i++) {
		struct zc_conn *c = NULL;
		int r = zc_connect(daemon_.socket, &c);

		cr_assert_eq(r, 0, "connect %u of %u: %s", i + 1, n, strerror(-r));
		zc_disconnect(c);
	}
}

Test(churn, crowd_then_connection_churn)
{
	/* Enough slack for the allocator's caches, far less than one leaked session per cycle (>= 400 B x 5000). */
	enum { CYCLES = 5000, WARMUP = 500, RSS_SLACK_KIB = 1024 };
	static struct crowd_member crowd[CROWD];
	pthread_t threads[CROWD];
	pthread_barrier_t barrier;
	double ref_p[CROWD_N], ref_m[CROWD_N] = { 0 }, ref_v[CROWD_N] = { 0 }, g[CROWD_N];
	float init[CROWD_N], grads[CROWD_N];
	struct zc_conn *c;
	unsigned fds0, fds;
	uint64_t rss0, rss1;
	double v;

	/* The crowd is one uid, past the default limits.max_clients_per_uid of 64. */
	itd_start(&daemon_, CHURN_CONFIG(", \"max_clients_per_uid\": 0"));
	c = itd_connect(&daemon_);
	fds0 = svc_fd_count(daemon_.pid);

	cr_assert_eq(pthread_barrier_init(&barrier, NULL, CROWD), 0);
	for (int i = 0; i < CROWD; i++) {
		crowd[i] = (struct crowd_member){ .index = i, .barrier = &barrier };
		cr_assert_eq(pthread_create(&threads[i], NULL, crowd_thread, &crowd[i]), 0);
	}
	for (int i = 0; i < CROWD; i++)
		pthread_join(threads[i], NULL);
	pthread_barrier_destroy(&barrier);
	for (int i = 0; i < CROWD; i++)
		cr_assert_eq(crowd[i].error[0], '\0', "client %d: %s", i, crowd[i].error);
	/* Same start and gradients: every client ends bit for bit where the first does ... */
	for (int i = 1; i < CROWD; i++)
		cr_assert(memcmp(crowd[i].master, crowd[0].master, sizeof(crowd[0].master)) == 0,
		    "client %d's weights differ from client 0's", i);
	/* ... which is where PyTorch's AdamW goes. */
	fill_init(init, CROWD_N);
	for (int i = 0; i < CROWD_N; i++)
		ref_p[i] = init[i];
	for (uint64_t s = 1; s <= CROWD_STEPS; s++) {
		struct zc_step_params sp = base_params;

		sp.step = s;
		fill_grads(grads, CROWD_N, s);
		for (int i = 0; i < CROWD_N; i++)
			g[i] = grads[i];
		itd_ref_adam(ref_p, ref_m, ref_v, g, CROWD_N, &sp);
	}
	v = itd_max_rel_err(crowd[0].master, ref_p, CROWD_N);
	cr_assert_leq(v, 2e-6, "relative error %.3g against the reference", v);

	v = svc_wait_stat(c, "sessions", 1, 10);
	cr_assert_eq(v, 1, "%.0f sessions after the crowd left", v);
	fds = svc_wait_fds(daemon_.pid, fds0, 10);
	cr_assert_eq(fds, fds0, "%u descriptors after the crowd, %u before", fds, fds0);

	/* Churn: warm the allocator up, then the same again must not grow anything. */
	cycle_connections(WARMUP);
	cr_assert_eq(svc_wait_stat(c, "sessions", 1, 10), 1);
	rss0 = svc_rss_kib(daemon_.pid);
	cycle_connections(CYCLES);
	cr_assert_eq(svc_wait_stat(c, "sessions", 1, 10), 1);
	rss1 = svc_rss_kib(daemon_.pid);
	fds = svc_wait_fds(daemon_.pid, fds0, 10);
	cr_assert_eq(fds, fds0, "%u descriptors after %d connections, %u before", fds, CYCLES, fds0);
	/* ASan's quarantine keeps freed memory resident on purpose; its leak check at exit covers this. */
	if (!svc_asan())
		cr_assert_lt(rss1, rss0 + RSS_SLACK_KIB, "RSS grew from %llu to %llu KiB over %d "
		    "connections", (unsigned long long)rss0, (unsigned long long)rss1, CYCLES);
	cr_log_info("daemon RSS %llu -> %llu KiB over %d connections, %u descriptors",
	    (unsigned long long)rss0, (unsigned long long)rss1, CYCLES, fds);
	cr_assert_eq(itd_stat(c, "sessions"), 1);
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

Test(churn, client_that_stops_reading)
{
	enum { MAX_PINGS = 200000 };
	static uint8_t buf[ZP_MAX_MESSAGE];
	struct zp_msg ping = { .hdr = { .type = ZP_PING } };
	struct zc_conn *c;
	struct zc_tensor *t;
	unsigned fds0, fds, sent = 0, replies = 0;
	bool dropped = false, eof = false;
	double deadline, v;
	size_t len;
	int fd, r = 0;

	itd_start(&daemon_, CHURN_CONFIG(", \"max_queued_messages\": 16"));
	c = itd_connect(&daemon_);
	t = open_tensor(c, "bystander", 1000);
	fds0 = svc_fd_count(daemon_.pid);

	fd = itd_raw_connect(&daemon_);
	itd_raw_hello(fd);
	cr_assert_eq(fcntl(fd, F_SETFL, O_NONBLOCK), 0);
	cr_assert_eq(zp_encode(&ping, buf, sizeof(buf), &len), ZP_S_OK);
	/* Pings, never a read: the replies fill our socket, then the daemon's queue of 16. */
	deadline = itd_now() + 20;
	while (sent < MAX_PINGS && itd_now() < deadline) {
		r = zp_send_raw(fd, buf, len, NULL, 0);
		if (r == -EAGAIN) {
			/* The daemon stopped reading us: it is deciding, or already has. */
			usleep(1000);
			continue;
		}
		if (r < 0)
			break;
		sent++;
		/* The bystander is served all along. */
		if (sent % 1000 == 0)
			cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	}
	dropped = r == -EPIPE || r == -ECONNRESET;
	cr_assert(dropped, "after %u unread pings the connection is still open (last send %d): %s",
	    sent, r, itd_log_text(&daemon_));
	/* What was sent before the drop is still ours to read, then the end. */
	cr_assert_eq(fcntl(fd, F_SETFL, 0), 0);
	for (unsigned i = 0; i < MAX_PINGS && !eof; i++) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		int fds_in[ZP_MAX_FDS];
		unsigned nfds;
		ssize_t n;

		cr_assert_eq(poll(&p, 1, 5000), 1, "neither a reply nor the end within 5 s");
		n = zp_recv_raw(fd, buf, sizeof(buf), fds_in, ZP_MAX_FDS, &nfds, 0);
		eof = n == 0 || n == -ECONNRESET;
		replies += n > 0;
	}
	cr_assert(eof, "no end of the connection after %u replies", replies);
	close(fd);
	cr_assert(strstr(itd_log_text(&daemon_), "not reading its replies") != NULL, "%s",
	    itd_log_text(&daemon_));

	/* The bystander steps, its session is the only one, nothing leaked. */
	step_once(c, t, 1);
	v = svc_wait_stat(c, "sessions", 1, 10);
	cr_assert_eq(v, 1, "%.0f sessions", v);
	fds = svc_wait_fds(daemon_.pid, fds0, 10);
	cr_assert_eq(fds, fds0, "%u descriptors, %u before the slow reader", fds, fds0);
	cr_log_info("slow reader: %u pings sent, %u replies read before the drop", sent, replies);
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}
