/* One uid must not starve, blind or corrupt another: replies it does not read, descriptors, shared memory, job names. */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "msgio.h"
#include "svc.h"

static struct itd daemon_;

static void
teardown(void)
{
	itd_cleanup(&daemon_);
}

TestSuite(isolation, .fini = teardown, .timeout = 120);

#define OTHER_UID 65534	/* nobody */
#define THIRD_UID 65533

static bool
log_has(const char *text)
{
	return strstr(itd_log_text(&daemon_), text) != NULL;
}

/* ---- raw protocol for children, which must not assert ---- */

static int
child_connect(void)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

	if (fd < 0)
		return -errno;
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", daemon_.socket);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
		int r = -errno;

		close(fd);
		return r;
	}
	return fd;
}

/* One request and its reply; descriptors that come with it are closed.  0 or the error's code. */
static int
child_call(int fd, uint16_t type, struct zp_msg *m, char *text, size_t textlen)
{
	static uint8_t buf[ZP_MAX_MESSAGE];
	struct pollfd p = { .fd = fd, .events = POLLIN };
	int fds[ZP_MAX_FDS], r;
	unsigned nfds = 0;
	char why[256];
	ssize_t n;

	m->hdr.type = type;
	m->hdr.request_id = 7;
	r = zp_send(fd, m, NULL, 0);
	if (r < 0) {
		snprintf(text, textlen, "send: %s", strerror(-r));
		return r;
	}
	if (poll(&p, 1, 10000) != 1) {
		snprintf(text, textlen, "no reply within 10 s");
		return -ETIMEDOUT;
	}
	n = zp_recv_raw(fd, buf, sizeof(buf), fds, ZP_MAX_FDS, &nfds, 0);
	for (unsigned i = 0; i < nfds; i++)
		close(fds[i]);
	if (n <= 0) {
		snprintf(text, textlen, "connection closed");
		return n < 0 ? (int)n : -ECONNRESET;
	}
	if (zp_decode(buf, (size_t)n, m, why, sizeof(why)) != ZP_S_OK) {
		snprintf(text, textlen, "undecodable reply: %.100s", why);
		return -EBADMSG;
	}
	if (m->hdr.type == ZP_ERROR) {
		snprintf(text, textlen, "%s", m->u.error.message);
		return m->u.error.code;
	}
	text[0] = '\0';
	return 0;
}

/* HELLO and JOB_OPEN of job `name` as rank 0 of 1. */
static int
child_session(const char *name, char *text, size_t textlen)
{
	static struct zp_msg m;
	int fd = child_connect(), r;

	if (fd < 0) {
		snprintf(text, textlen, "connect: %s", strerror(-fd));
		return fd;
	}
	memset(&m, 0, sizeof(m));
	snprintf(m.u.hello.client_name, sizeof(m.u.hello.client_name), "isolation");
	r = child_call(fd, ZP_HELLO, &m, text, textlen);
	if (r == 0 && name != NULL) {
		memset(&m, 0, sizeof(m));
		snprintf(m.u.job_open.job_name, sizeof(m.u.job_open.job_name), "%s", name);
		m.u.job_open.world_size = 1;
		r = child_call(fd, ZP_JOB_OPEN, &m, text, textlen);
	}
	if (r < 0) {
		close(fd);
		return r;
	}
	return fd;
}

static int
child_register(int fd, unsigned i, char *text, size_t textlen)
{
	static struct zp_msg m;

	memset(&m, 0, sizeof(m));
	snprintf(m.u.tensor_register.name, sizeof(m.u.tensor_register.name), "t%u", i);
	m.u.tensor_register.numel = 1;
	m.u.tensor_register.grad_dtype = ZP_DTYPE_F32;
	m.u.tensor_register.param_dtype = ZP_DTYPE_F32;
	return child_call(fd, ZP_TENSOR_REGISTER, &m, text, textlen);
}

/*
 * In a child: registers one-element tensors until refused (or `max`); the
 * report's result is the refusal's code, its text "N: message".
 */
struct flood { const char *job; unsigned max; };

static void
flood_tensors(void *arg, struct svc_report *out)
{
	const struct flood *f = arg;
	char text[ZP_ERRMSG_MAX + 1];
	unsigned n = 0;
	int fd, r;

	fd = child_session(f->job, text, sizeof(text));
	if (fd < 0) {
		out->result = fd;
		snprintf(out->text, sizeof(out->text), "session: %s", text);
		return;
	}
	while (n < f->max && (r = child_register(fd, n, text, sizeof(text))) == 0)
		n++;
	out->result = n == f->max ? 0 : r;
	snprintf(out->text, sizeof(out->text), "%u: %s", n, n == f->max ? "" : text);
	/* The connection stays: the process ends and the daemon keeps the rank's tensors. */
}

static void
start_open(const char *config)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to act as other uids");
	itd_start(&daemon_, config);
	/* mkdtemp made the directory 0700: let the other uids reach the socket in it. */
	cr_assert_eq(chmod(daemon_.dir, 0711), 0);
}

/* ---- 1: replies a client does not read ---- */

/* Sends STATS on fd until n went or the daemon hung up; returns how many went. */
static unsigned
send_stats(int fd, unsigned n)
{
	struct zp_msg m = { .hdr = { .type = ZP_STATS, .request_id = 9 } };
	uint8_t buf[256];
	size_t len;
	unsigned i;

	cr_assert_eq(zp_encode(&m, buf, sizeof(buf), &len), ZP_S_OK);
	for (i = 0; i < n; i++)
		if (send(fd, buf, len, MSG_NOSIGNAL) != (ssize_t)len)
			break;
	return i;
}

Test(isolation, unread_replies_bounded_per_session)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"limits\": { \"max_queued_messages\": 1000000, \"max_queued_bytes\": \"1M\","
	    " \"uid_queued_bytes\": \"64M\" } }";
	struct zc_conn *c;
	uint64_t rss0, rss;
	int fd;

	itd_start(&daemon_, config);
	c = itd_connect(&daemon_);
	rss0 = svc_rss_kib(daemon_.pid);
	fd = itd_raw_connect(&daemon_);
	itd_raw_hello(fd);
	/* Each STATS reply is about 2 KiB: 20,000 unread would queue some 40 MiB. */
	send_stats(fd, 20000);
	cr_assert_eq(svc_wait_stat(c, "sessions", 1, 30), 1,
	    "a session with 20,000 unread replies is still connected: %s", itd_log_text(&daemon_));
	cr_assert(log_has("limits.max_queued_bytes"), "the log does not say why: %s",
	    itd_log_text(&daemon_));
	rss = svc_rss_kib(daemon_.pid);
	cr_assert_lt(rss, rss0 + 24 * 1024, "the daemon grew from %llu to %llu KiB",
	    (unsigned long long)rss0, (unsigned long long)rss);
	cr_assert_eq(itd_stat(c, "uids.0.queued_bytes"), 0, "queued bytes left counted");
	close(fd);
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

Test(isolation, unread_replies_bounded_per_uid)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"limits\": { \"max_queued_messages\": 1000000, \"max_queued_bytes\": \"64M\","
	    " \"uid_queued_bytes\": \"2M\" } }";
	struct zc_conn *c;
	int fds[3];

	itd_start(&daemon_, config);
	c = itd_connect(&daemon_);
	for (int i = 0; i < 3; i++) {
		fds[i] = itd_raw_connect(&daemon_);
		itd_raw_hello(fds[i]);
	}
	/* No one session passes its 64 MiB; together they pass the uid's 2 MiB. */
	for (int i = 0; i < 3; i++)
		send_stats(fds[i], 6000);
	cr_assert(log_has("limits.uid_queued_bytes"), "no session was dropped for its uid's "
	    "queue: %s", itd_log_text(&daemon_));
	for (int i = 0; i < 3; i++)
		close(fds[i]);
	cr_assert_eq(svc_wait_stat(c, "sessions", 1, 30), 1);
	cr_assert_eq(itd_stat(c, "uids.0.queued_bytes"), 0, "queued bytes left counted");
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* ---- 2: descriptors ---- */

Test(isolation, uid_max_tensors)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"socket\": { \"mode\": \"0666\" }, \"limits\": { \"uid_max_tensors\": 20 } }";
	struct flood f = { "flood", 1000 };
	struct svc_report rep;
	struct zc_conn *c;

	start_open(config);
	svc_in_child(OTHER_UID, flood_tensors, &f, &rep);
	cr_assert_eq(rep.result, -EDQUOT, "%d %s", rep.result, rep.text);
	cr_assert(strncmp(rep.text, "20: ", 4) == 0, "'%s': not refused at the 21st", rep.text);
	cr_assert(strstr(rep.text, "limits.uid_max_tensors") != NULL, "'%s'", rep.text);
	/* The dead rank's tensors still count: a new process of the uid gets none. */
	f.job = "flood-2";
	svc_in_child(OTHER_UID, flood_tensors, &f, &rep);
	cr_assert(strncmp(rep.text, "0: ", 3) == 0, "'%s'", rep.text);
	/* Another uid is not touched. */
	f.max = 20;
	svc_in_child(THIRD_UID, flood_tensors, &f, &rep);
	cr_assert_eq(rep.result, 0, "the third uid: %d %s", rep.result, rep.text);
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/*
 * With few descriptors to go round, one uid that takes all it can leaves
 * the reserve: root and accept still work.  Before, one connection took
 * the daemon to EMFILE and nobody else could register or connect.
 */
Test(isolation, descriptor_reserve)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"socket\": { \"mode\": \"0666\" }, \"limits\": { \"uid_max_fds\": 100000 } }";
	static const struct zc_tensor_desc desc = { .name = "w", .numel = 16,
		.grad_dtype = ZC_F32, .param_dtype = ZC_F32 };
	struct rlimit rl = { 400, 400 };
	struct flood f = { "flood", 100000 };
	static float init[16];
	struct svc_report rep;
	struct zc_tensor *t;
	struct zc_conn *c;
	char name[32];

	/* Inherited by the daemon: the hard limit it cannot raise. */
	cr_assert_eq(setrlimit(RLIMIT_NOFILE, &rl), 0, "%s", strerror(errno));
	start_open(config);
	svc_in_child(OTHER_UID, flood_tensors, &f, &rep);
	cr_assert_eq(rep.result, -ENFILE, "%d %s", rep.result, rep.text);
	cr_assert(strstr(rep.text, "kept for accept and root") != NULL, "'%s'", rep.text);
	/* Root connects and registers from the reserve. */
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "roots", 0, 1), 0, "%s", zc_errmsg(c));
	for (int i = 0; i < 8; i++) {
		snprintf(name, sizeof(name), "w%d", i);
		cr_assert_eq(zc_tensor_register(c, &(struct zc_tensor_desc){ .name = name,
		    .numel = desc.numel, .grad_dtype = desc.grad_dtype,
		    .param_dtype = desc.param_dtype }, init, &t), 0,
		    "root's tensor %d with the other uid at its most: %s", i, zc_errmsg(c));
	}
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* A client that registers without reading: its unread TENSOR_OKs hold no descriptors. */
Test(isolation, unread_replies_hold_no_descriptors)
{
	static struct zp_msg m;
	enum { N = 1500 };
	struct zc_conn *c;
	unsigned fds0, fds;
	int fd;

	itd_start(&daemon_, NULL);
	c = itd_connect(&daemon_);
	fd = itd_raw_connect(&daemon_);
	itd_raw_hello(fd);
	memset(&m, 0, sizeof(m));
	strcpy(m.u.job_open.job_name, "unread");
	m.u.job_open.world_size = 1;
	itd_raw_send(fd, ZP_JOB_OPEN, 2, &m);
	cr_assert(itd_raw_recv(fd, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_JOB_OK);
	fds0 = svc_fd_count(daemon_.pid);
	for (unsigned i = 0; i < N; i++) {
		memset(&m, 0, sizeof(m));
		snprintf(m.u.tensor_register.name, sizeof(m.u.tensor_register.name), "t%u", i);
		m.u.tensor_register.numel = 1;
		m.u.tensor_register.grad_dtype = ZP_DTYPE_F32;
		m.u.tensor_register.param_dtype = ZP_DTYPE_F32;
		itd_raw_send(fd, ZP_TENSOR_REGISTER, 10 + i, &m);
	}
	cr_assert_eq(svc_wait_stat(c, "tensors", N, 30), N, "%s", itd_log_text(&daemon_));
	/*
	 * Two slots, the param slot's read-only reopening, its record and its state per
	 * tensor, and nothing more.
	 */
	fds = svc_fd_count(daemon_.pid);
	cr_assert_leq(fds, fds0 + 5 * N + 4, "%u descriptors for %u tensors (%u before)", fds, N,
	    fds0);
	/* And every reply still arrives, with its slots. */
	for (unsigned i = 0; i < N; i++) {
		cr_assert(itd_raw_recv(fd, &m, 5), "reply %u never came", i);
		cr_assert_eq(m.hdr.type, ZP_TENSOR_OK, "reply %u: %s", i, zp_type_name(m.hdr.type));
	}
	close(fd);
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* ---- 3: shared memory ---- */

static void
open_windows(void *arg, struct svc_report *out)
{
	char text[ZP_ERRMSG_MAX + 1];
	static struct zp_msg m;
	int n = 0, r = 0;

	for (; n < *(int *)arg; n++) {
		int fd = child_session(NULL, text, sizeof(text));

		if (fd < 0) {
			r = fd;
			break;
		}
		memset(&m, 0, sizeof(m));
		r = child_call(fd, ZP_XFER_OPEN, &m, text, sizeof(text));
		if (r < 0)
			break;
		/* Kept open: the window lives as long as the connection. */
	}
	out->result = r;
	snprintf(out->text, sizeof(out->text), "%d: %s", n, r < 0 ? text : "");
	/* Report while holding the windows; they go when the child does. */
}

Test(isolation, uid_shm_budget)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"socket\": { \"mode\": \"0666\" },"
	    " \"memory\": { \"shm_budget\": \"96M\", \"xfer_window\": \"16M\" },"
	    " \"limits\": { \"uid_shm_budget\": \"40M\" } }";
	static float buf[16];
	struct svc_report rep;
	struct zc_tensor *t;
	struct zc_conn *c;
	int want = 8;

	start_open(config);
	svc_in_child(OTHER_UID, open_windows, &want, &rep);
	cr_assert_eq(rep.result, -EDQUOT, "%d %s", rep.result, rep.text);
	cr_assert(strncmp(rep.text, "2: ", 3) == 0, "'%s': not refused at the third window",
	    rep.text);
	cr_assert(strstr(rep.text, "limits.uid_shm_budget") != NULL, "'%s'", rep.text);
	/* Another uid still gets a window. */
	want = 2;
	svc_in_child(THIRD_UID, open_windows, &want, &rep);
	cr_assert_eq(rep.result, 0, "the third uid: %d %s", rep.result, rep.text);
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "roots", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &(struct zc_tensor_desc){ .name = "w", .numel = 16,
	    .grad_dtype = ZC_F32, .param_dtype = ZC_F32 }, buf, &t), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, 16, buf), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* ---- 6: job names per uid, and what each uid sees ---- */

/* In a child: a rank of job `arg` that registers a tensor and dies (its state is kept). */
static void
own_job(void *arg, struct svc_report *out)
{
	struct zc_tensor_desc desc = { .name = "w", .numel = 1000, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	static float init[1000];
	struct zc_conn *c = NULL;
	struct zc_tensor *t;
	int r;

	if ((r = zc_connect(daemon_.socket, &c)) < 0) {
		out->result = r;
		snprintf(out->text, sizeof(out->text), "connect: %s", strerror(-r));
		return;
	}
	if ((r = zc_job_open(c, arg, 0, 2)) == 0)
		r = zc_tensor_register(c, &desc, init, &t);
	out->result = r;
	snprintf(out->text, sizeof(out->text), "%s", zc_errmsg(c));
}

/* "name/uid name/uid ..." of every job c is shown, in the JOBS reply or the stats. */
static void
list_jobs(struct zc_conn *c, bool stats, char *out, size_t outlen)
{
	char *json = NULL;
	const cJSON *j;
	cJSON *root;
	size_t len = 0;
	int r = stats ? zc_stats_json(c, &json) : zc_jobs_json(c, &json);

	out[0] = '\0';
	if (r < 0) {
		snprintf(out, outlen, "error %d", r);
		return;
	}
	root = cJSON_Parse(json);
	cJSON_ArrayForEach(j, cJSON_GetObjectItemCaseSensitive(root, "jobs"))
		if (len < outlen)
			len += (size_t)snprintf(out + len, outlen - len, "%s/%.0f ",
			    cJSON_GetObjectItemCaseSensitive(j, "name")->valuestring,
			    cJSON_GetObjectItemCaseSensitive(j, "uid")->valuedouble);
	if (stats && len < outlen) {
		cJSON_ArrayForEach(j, cJSON_GetObjectItemCaseSensitive(root, "uids"))
			if (len < outlen)
				len += (size_t)snprintf(out + len, outlen - len, "uid%.0f ",
				    cJSON_GetObjectItemCaseSensitive(j, "uid")->valuedouble);
		if (len < outlen)
			snprintf(out + len, outlen - len, "tensors=%.0f",
			    cJSON_GetObjectItemCaseSensitive(root, "tensors")->valuedouble);
	}
	cJSON_Delete(root);
	free(json);
}

/* In a child: what this uid is shown, then what it may do to "train" of uid 65534. */
static void
look_and_trespass(void *arg, struct svc_report *out)
{
	char jobs[128], stats[128];
	struct zc_conn *c = NULL;
	int r1, r2, r3;

	if ((out->result = zc_connect(daemon_.socket, &c)) < 0)
		return;
	list_jobs(c, false, jobs, sizeof(jobs));
	list_jobs(c, true, stats, sizeof(stats));
	r1 = zc_job_drop(c, "65534:train");
	r2 = zc_job_open(c, "65534:train", 1, 2);
	r3 = zc_job_drop(c, "train");
	out->result = 0;
	snprintf(out->text, sizeof(out->text), "jobs[%s] stats[%s] drop=%d open=%d own=%d",
	    jobs, stats, r1, r2, r3);
	zc_disconnect(c);
}

Test(isolation, job_names_per_uid)
{
	struct svc_report rep;
	char seen[256];
	struct zc_conn *c;

	start_open("{ \"compute\": { \"worker_threads\": 2 }, \"socket\": { \"mode\": \"0666\" } }");
	/* One uid takes the name first; the real owner still gets it, in its own names. */
	svc_in_child(OTHER_UID, own_job, "train", &rep);
	cr_assert_eq(rep.result, 0, "%d %s", rep.result, rep.text);
	svc_in_child(THIRD_UID, own_job, "train", &rep);
	cr_assert_eq(rep.result, 0, "the second uid's 'train' was refused: %d %s", rep.result,
	    rep.text);
	/*
	 * The third uid sees its own job and the node's totals, nothing of the
	 * other's; it may neither join nor drop it.  Its drop of "train" is its own.
	 */
	svc_in_child(THIRD_UID, look_and_trespass, NULL, &rep);
	cr_assert_eq(rep.result, 0, "%s", rep.text);
	cr_assert(strstr(rep.text, "jobs[train/65533 ]") != NULL, "JOBS shows: %s", rep.text);
	cr_assert(strstr(rep.text, "stats[train/65533 uid65533 tensors=2]") != NULL,
	    "STATS shows: %s", rep.text);
	cr_assert(strstr(rep.text, "drop=-1 ") != NULL, "dropping another uid's job: %s",
	    rep.text);
	cr_assert(strstr(rep.text, "open=-13 ") != NULL, "joining another uid's job: %s",
	    rep.text);
	cr_assert(strstr(rep.text, "own=0") != NULL, "dropping its own job: %s", rep.text);
	/* Root sees all, and names one of two like-named jobs by its uid. */
	c = itd_connect(&daemon_);
	svc_in_child(THIRD_UID, own_job, "train", &rep);
	cr_assert_eq(rep.result, 0, "%d %s", rep.result, rep.text);
	list_jobs(c, false, seen, sizeof(seen));
	cr_assert(strstr(seen, "train/65534") != NULL && strstr(seen, "train/65533") != NULL,
	    "root is shown: %s", seen);
	cr_assert_eq(zc_job_drop(c, "train"), -ENOTUNIQ, "%s", zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "65534:train") != NULL, "'%s'", zc_errmsg(c));
	cr_assert_eq(zc_job_drop(c, "65534:train"), 0, "%s", zc_errmsg(c));
	list_jobs(c, false, seen, sizeof(seen));
	cr_assert_str_eq(seen, "train/65533 ");
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* ---- 4: stats and jobs of any size ---- */

/*
 * 200 detached jobs with long names make the replies far larger than one
 * datagram: they come in a memfd, and zoffctl stats and jobs both work.
 */
Test(isolation, replies_of_any_size)
{
	static const struct zc_tensor_desc desc = { .name = "w", .numel = 16,
		.grad_dtype = ZC_F32, .param_dtype = ZC_F32 };
	enum { JOBS = 200 };
	static char out[1 << 20];
	static float init[16];
	char name[ZP_NAME_MAX + 1];
	const char *argv[] = { getenv("ZOFFCTL"), "--socket", daemon_.socket, "jobs", NULL, NULL };
	struct zc_tensor *t;
	struct zc_conn *c;
	cJSON *root;
	char *json;
	int status;

	itd_start(&daemon_, NULL);
	for (int i = 0; i < JOBS; i++) {
		c = itd_connect(&daemon_);
		memset(name, 'j', ZP_NAME_MAX);
		snprintf(name, sizeof(name), "%03d", i);
		name[3] = 'j';
		cr_assert_eq(zc_job_open(c, name, 0, 2), 0, "%s", zc_errmsg(c));
		cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
		zc_disconnect(c);	/* the rank is gone; its job waits for it */
	}
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_jobs_json(c, &json), 0, "JOBS: %s", zc_errmsg(c));
	cr_assert_gt(strlen(json), ZP_MAX_PAYLOAD, "only %zu bytes: not the case at hand",
	    strlen(json));
	root = cJSON_Parse(json);
	cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(root, "jobs")), JOBS);
	cJSON_Delete(root);
	free(json);
	cr_assert_eq(zc_stats_json(c, &json), 0, "STATS: %s", zc_errmsg(c));
	root = cJSON_Parse(json);
	cr_assert_eq(cJSON_GetObjectItemCaseSensitive(root, "jobs_total")->valuedouble, JOBS);
	cJSON_Delete(root);
	free(json);
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	/* The admin's tools: every job listed, the stats a summary. */
	status = svc_run(argv, out, sizeof(out), 30);
	cr_assert_eq(status, 0, "zoffctl jobs: %d: %.300s", status, out);
	cr_assert(strstr(out, "199j") != NULL, "the last job is not listed");
	argv[3] = "stats";
	status = svc_run(argv, out, sizeof(out), 30);
	cr_assert_eq(status, 0, "zoffctl stats: %d: %.300s", status, out);
	cr_assert(strstr(out, "and 180 more jobs") != NULL, "%.2000s", out);
	/* And the descriptors of the replies went back: this connection and the tensors'. */
	cr_assert_eq(svc_wait_stat(c, "uids.0.fds", 1 + 5 * JOBS, 10), 1 + 5 * JOBS);
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* ---- 5: the stats' counters, kept as things change rather than counted per request ---- */

static void
register_three(struct zc_conn *c, const char *only)
{
	static float init[64];
	static const char *const names[] = { "a", "b", "c" };
	struct zc_tensor *t;

	for (int i = 0; i < 3; i++) {
		if (only != NULL && strcmp(only, names[i]) != 0)
			continue;
		cr_assert_eq(zc_tensor_register(c, &(struct zc_tensor_desc){ .name = names[i],
		    .numel = 64, .grad_dtype = ZC_F32, .param_dtype = ZC_F32 }, init, &t), 0,
		    "%s", zc_errmsg(c));
	}
}

static void
expect_counts(struct zc_conn *c, double ranks, double tensors, double total)
{
	cr_assert_eq(svc_wait_stat(c, "jobs.0.ranks_detached", ranks, 10), ranks,
	    "ranks_detached %.0f, not %.0f", itd_stat(c, "jobs.0.ranks_detached"), ranks);
	cr_assert_eq(itd_stat(c, "jobs.0.tensors_detached"), tensors);
	cr_assert_eq(itd_stat(c, "tensors"), total);
	cr_assert_eq(itd_stat(c, "params"), 64 * total);
}

Test(isolation, detached_counts_follow_every_change)
{
	struct zc_conn *watch, *r0, *r1;

	itd_start(&daemon_, NULL);
	watch = itd_connect(&daemon_);
	r0 = itd_connect(&daemon_);
	r1 = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(r0, "counts", 0, 3), 0, "%s", zc_errmsg(r0));
	cr_assert_eq(zc_job_open(r1, "counts", 1, 3), 0, "%s", zc_errmsg(r1));
	register_three(r0, NULL);
	register_three(r1, NULL);
	expect_counts(watch, 0, 0, 6);
	zc_disconnect(r0);	/* two ranks die */
	zc_disconnect(r1);
	expect_counts(watch, 2, 6, 6);
	/* A new rank 0 takes one back: its rank still has two waiting. */
	r0 = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(r0, "counts", 0, 3), 0, "%s", zc_errmsg(r0));
	register_three(r0, "a");
	expect_counts(watch, 2, 5, 6);
	register_three(r0, "b");
	register_three(r0, "c");
	expect_counts(watch, 1, 3, 6);
	/* It dies again: its rank waits again, as one rank. */
	zc_disconnect(r0);
	expect_counts(watch, 2, 6, 6);
	r0 = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(r0, "counts", 0, 3), 0, "%s", zc_errmsg(r0));
	cr_assert_eq(zc_job_close(r0), 0, "%s", zc_errmsg(r0));	/* frees rank 0's state */
	zc_disconnect(r0);
	expect_counts(watch, 1, 3, 3);
	cr_assert_eq(zc_job_drop(watch, "counts"), 0, "%s", zc_errmsg(watch));
	cr_assert_eq(svc_wait_stat(watch, "tensors", 0, 10), 0);
	cr_assert_eq(itd_stat(watch, "params"), 0);
	cr_assert_eq(itd_stat(watch, "jobs_total"), 0);
	zc_disconnect(watch);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}
