/* Hostile and unlucky clients: sealed and read-only slots, oversized and fd-stuffed datagrams, a low memlock limit, other uids' jobs, per-uid caps. */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
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

TestSuite(hostile, .fini = teardown, .timeout = 60);

static void
expect_serving(void)
{
	struct zc_conn *c = itd_connect(&daemon_);

	cr_assert_eq(zc_ping(c, NULL), 0, "ping after the fault: %s", zc_errmsg(c));
	zc_disconnect(c);
}

/* Receives one message and keeps its descriptors (itd_raw_recv closes them). */
static void
recv_keep_fds(int fd, struct zp_msg *m, int *fds, unsigned *nfds)
{
	static uint8_t buf[ZP_MAX_MESSAGE];
	struct pollfd p = { .fd = fd, .events = POLLIN };
	char why[256];
	ssize_t n;

	cr_assert_eq(poll(&p, 1, 5000), 1, "no reply within 5 s");
	n = zp_recv_raw(fd, buf, sizeof(buf), fds, ZP_MAX_FDS, nfds, 0);
	cr_assert_gt(n, 0, "recv: %zd", n);
	cr_assert_eq(zp_decode(buf, (size_t)n, m, why, sizeof(why)), ZP_S_OK, "%s", why);
}

/* Registers a 4096-element f32 tensor without param offload: its grad and param descriptors. */
static void
register_slots(int *fd, int *grad, int *param)
{
	static struct zp_msg m;
	int fds[ZP_MAX_FDS];
	unsigned nfds;

	*fd = itd_raw_connect(&daemon_);
	itd_raw_hello(*fd);
	memset(&m, 0, sizeof(m));
	strcpy(m.u.job_open.job_name, "sealed");
	m.u.job_open.world_size = 1;
	itd_raw_send(*fd, ZP_JOB_OPEN, 2, &m);
	cr_assert(itd_raw_recv(*fd, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_JOB_OK, "JOB_OPEN answered %s", zp_type_name(m.hdr.type));
	memset(&m, 0, sizeof(m));
	strcpy(m.u.tensor_register.name, "w");
	m.u.tensor_register.numel = 4096;
	m.u.tensor_register.grad_dtype = ZP_DTYPE_F32;
	m.u.tensor_register.param_dtype = ZP_DTYPE_F32;
	itd_raw_send(*fd, ZP_TENSOR_REGISTER, 3, &m);
	recv_keep_fds(*fd, &m, fds, &nfds);
	cr_assert_eq(m.hdr.type, ZP_TENSOR_OK, "TENSOR_REGISTER answered %s: %s",
	    zp_type_name(m.hdr.type), m.hdr.type == ZP_ERROR ? m.u.error.message : "");
	cr_assert_eq(nfds, 2);
	*grad = fds[0];
	*param = fds[1];
}

/*
 * Every way a holder of the param slot's descriptor could write it: NULL when
 * all were refused, else which one worked.  Reopening through /proc/self/fd
 * is refused only to a uid other than the daemon's (the slot's owner could
 * chmod it back; root passes any mode): a client of the daemon's own uid
 * could as well write the daemon's memory.
 */
static const char *
write_param_slot(int param, size_t bytes, bool reopen)
{
	char byte = 1, path[32];
	void *map;
	int fd;

	map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, param, 0);
	if (map != MAP_FAILED || errno != EACCES)
		return "mmap(PROT_WRITE, MAP_SHARED)";
	map = mmap(NULL, bytes, PROT_READ, MAP_SHARED, param, 0);
	if (map == MAP_FAILED)
		return "(mmap(PROT_READ) refused: the client could not read its params)";
	if (mprotect(map, bytes, PROT_READ | PROT_WRITE) == 0) {
		munmap(map, bytes);
		return "mprotect(PROT_WRITE) of a read-only mapping";
	}
	munmap(map, bytes);
	if (write(param, &byte, 1) != -1)
		return "write()";
	if (pwrite(param, &byte, 1, 0) != -1)
		return "pwrite()";
	if (ftruncate(param, 0) == 0 || ftruncate(param, (off_t)bytes * 2) == 0)
		return "ftruncate()";
	if (fallocate(param, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)bytes) == 0)
		return "fallocate(PUNCH_HOLE)";
	if (!reopen)
		return NULL;
	(void)fchmod(param, 0666);
	snprintf(path, sizeof(path), "/proc/self/fd/%d", param);
	fd = open(path, O_RDWR);
	if (fd >= 0) {
		close(fd);
		return "open(\"/proc/self/fd/N\", O_RDWR) after fchmod";
	}
	return NULL;
}

Test(hostile, slots_are_sealed_and_params_read_only)
{
	int fd, grad, param;
	struct stat st;
	void *map;
	const char *how;

	itd_start(&daemon_, NULL);
	register_slots(&fd, &grad, &param);
	cr_assert_eq(fstat(grad, &st), 0);

	/* Shrinking would make the daemon's mapping fault; growing is refused as well. */
	errno = 0;
	cr_assert_neq(ftruncate(grad, 0), 0, "the grad slot could be shrunk");
	cr_assert_eq(errno, EPERM, "shrinking the grad slot: %s", strerror(errno));
	errno = 0;
	cr_assert_neq(ftruncate(grad, st.st_size * 2), 0, "the grad slot could be grown");
	cr_assert_eq(errno, EPERM, "growing the grad slot: %s", strerror(errno));
	/* Nor can the seals be taken off. */
	cr_assert_eq(fcntl(grad, F_GET_SEALS) & F_SEAL_SEAL, F_SEAL_SEAL);
	/*
	 * The client writes gradients (a hole in the grad slot only zeroes its
	 * own gradients: the daemon's mapping reads zeros, it cannot fault) ...
	 */
	map = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, grad, 0);
	cr_assert_neq(map, MAP_FAILED, "grad slot: %s", strerror(errno));
	munmap(map, (size_t)st.st_size);
	/* ... and only reads parameters, by any means its descriptor gives it. */
	how = write_param_slot(param, (size_t)st.st_size, false);
	cr_assert_null(how, "the param slot could be written by %s", how);
	/* Not sealed against writes: the daemon's own descriptor maps it again after a restart. */
	cr_assert_eq(fcntl(param, F_GET_SEALS) & F_SEAL_WRITE, 0);
	close(grad);
	close(param);
	close(fd);
	expect_serving();
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

struct param_try {
	int param;
	size_t bytes;
};

static void
try_write_param(void *arg, struct svc_report *out)
{
	const struct param_try *p = arg;
	const char *how = write_param_slot(p->param, p->bytes, true);

	out->result = how == NULL ? 0 : -1;
	snprintf(out->text, sizeof(out->text), "%s", how == NULL ? "" : how);
}

Test(hostile, param_slot_read_only_to_another_uid)
{
	struct svc_report rep;
	struct param_try p;
	int fd, grad, param;
	struct stat st;

	if (geteuid() != 0)
		cr_skip_test("needs root to hold the slot as a second uid");
	itd_start(&daemon_, NULL);
	register_slots(&fd, &grad, &param);
	cr_assert_eq(fstat(param, &st), 0);
	p = (struct param_try){ .param = param, .bytes = (size_t)st.st_size };
	svc_in_child(65534, try_write_param, &p, &rep);
	cr_assert_eq(rep.result, 0, "the param slot could be written by %s", rep.text);
	close(grad);
	close(param);
	close(fd);
	expect_serving();
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* Sends len bytes with nfds copies of stdin attached, past msgio's own limit of ZP_MAX_FDS. */
static int
send_with_fds(int sock, const void *buf, size_t len, unsigned nfds)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * 64)];
	} control;
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	int fds[64];

	cr_assert_leq(nfds, 64);
	for (unsigned i = 0; i < nfds; i++)
		fds[i] = STDIN_FILENO;
	if (nfds > 0) {
		struct cmsghdr *c;

		memset(&control, 0, sizeof(control));
		mh.msg_control = control.buf;
		mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
		c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
		memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
	}
	return sendmsg(sock, &mh, MSG_NOSIGNAL) == (ssize_t)len ? 0 : -errno;
}

/* Sends, then expects ERROR(code) saying `text` and the end of the connection. */
static void
expect_dropped(const void *buf, size_t len, unsigned nfds, int code, const char *text)
{
	int fd = itd_raw_connect(&daemon_);
	int r;

	itd_raw_hello(fd);
	r = send_with_fds(fd, buf, len, nfds);
	cr_assert_eq(r, 0, "sending %zu bytes with %u fds: %s", len, nfds, strerror(-r));
	itd_raw_expect_refusal(fd, code, text);
}

/* test_faults covers short, bad magic, bad type, bad length and one fd; these are the rest. */
Test(hostile, oversized_and_fd_stuffed_datagrams)
{
	static uint8_t big[100 << 10];
	struct zp_msg ping = { .hdr = { .type = ZP_PING } };
	struct zc_conn *c;
	unsigned fds0, fds;
	size_t len;
	int fd;

	itd_start(&daemon_, NULL);
	c = itd_connect(&daemon_);
	fds0 = svc_fd_count(daemon_.pid);
	cr_assert_eq(zp_encode(&ping, big, sizeof(big), &len), ZP_S_OK);

	/* One byte past the protocol's limit, and well past it. */
	expect_dropped(big, ZP_MAX_MESSAGE + 1, 0, -EMSGSIZE, "larger than the protocol allows");
	expect_dropped(big, sizeof(big), 0, -EMSGSIZE, "larger than the protocol allows");
	/* More descriptors than any message carries: the daemon must close every one it got. */
	expect_dropped(big, len, 3, -ETOOMANYREFS, "file descriptors");
	expect_dropped(big, len, 64, -ETOOMANYREFS, "file descriptors");
	/* Descriptors on an oversized datagram: refused for its size, descriptors closed all the same. */
	expect_dropped(big, ZP_MAX_MESSAGE + 1, 2, -EMSGSIZE, "larger than the protocol allows");
	/* An empty datagram reads as the end of the connection: it goes, quietly. */
	fd = itd_raw_connect(&daemon_);
	itd_raw_hello(fd);
	cr_assert_eq(send_with_fds(fd, big, 0, 0), 0);
	{
		static struct zp_msg m;

		cr_assert_not(itd_raw_recv(fd, &m, 5), "an empty datagram was answered");
	}
	close(fd);

	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	cr_assert_eq(svc_wait_stat(c, "sessions", 1, 10), 1);
	fds = svc_wait_fds(daemon_.pid, fds0, 10);
	cr_assert_eq(fds, fds0, "the daemon holds %u descriptors, %u before", fds, fds0);
	zc_disconnect(c);
	expect_serving();
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/*
 * The daemon must start as an unprivileged service would: no CAP_IPC_LOCK
 * (dropped from the bounding set, so the exec'd daemon cannot get it back
 * even as root) and RLIMIT_MEMLOCK of 64 KiB.  Criterion runs each test in
 * its own process, so this stays inside the test.
 */
static void
lose_memlock(void)
{
	struct rlimit rl = { 64 << 10, 64 << 10 };

	/* ASan's mlock interceptor does nothing and reports success. */
	if (svc_asan())
		cr_skip_test("AddressSanitizer ignores mlock");
	if (prctl(PR_CAPBSET_READ, CAP_IPC_LOCK) == 1 &&
	    prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK) != 0)
		cr_skip_test("cannot drop CAP_IPC_LOCK here: %s", strerror(errno));
	cr_assert_eq(setrlimit(RLIMIT_MEMLOCK, &rl), 0, "setrlimit: %s", strerror(errno));
}

static const struct zc_tensor_desc memlock_desc = { .name = "unpinnable", .numel = 1u << 18,
	.grad_dtype = ZC_F32, .param_dtype = ZC_BF16 };

Test(hostile, memlock_too_low_required)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"memory\": { \"pinned_budget\": \"64M\", \"require_pinned\": true } }";
	static float init[1u << 18];
	struct zc_tensor *t;
	struct zc_conn *c;
	int r;

	lose_memlock();
	itd_start(&daemon_, config);
	cr_assert(strstr(itd_log_text(&daemon_), "RLIMIT_MEMLOCK is 64.0 KiB") != NULL,
	    "the start-up log does not say what the memlock limit allows: %s",
	    itd_log_text(&daemon_));
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "locked-out", 0, 1), 0, "%s", zc_errmsg(c));
	r = zc_tensor_register(c, &memlock_desc, init, &t);
	cr_assert_lt(r, 0, "3 MiB of state was taken although only 64 KiB can be locked");
	cr_assert(strstr(zc_errmsg(c), "memlock") != NULL, "'%s' does not mention memlock",
	    zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "unpinnable") != NULL, "'%s' does not name the tensor",
	    zc_errmsg(c));
	cr_assert_eq(itd_stat(c, "tiers.pinned.used_bytes"), 0);
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

Test(hostile, memlock_too_low_pageable)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"memory\": { \"pinned_budget\": \"64M\", \"require_pinned\": false } }";
	static float init[1u << 18], got[1u << 18];
	struct zc_tensor *t;
	struct zc_conn *c;

	lose_memlock();
	for (size_t i = 0; i < memlock_desc.numel; i++)
		init[i] = (float)i;
	itd_start(&daemon_, config);
	cr_assert(strstr(itd_log_text(&daemon_), "only 64.0 KiB can be locked") != NULL,
	    "the start-up log does not say what can be pinned: %s", itd_log_text(&daemon_));
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "pageable", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &memlock_desc, init, &t), 0, "%s", zc_errmsg(c));
	cr_assert_gt(itd_stat(c, "tiers.pinned.unlocked_bytes"), 0,
	    "state beyond the memlock limit is not reported as unlocked");
	cr_assert_eq(itd_stat(c, "tiers.pinned.memlock_limit_bytes"), 64 << 10);
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, memlock_desc.numel, got), 0, "%s",
	    zc_errmsg(c));
	cr_assert(memcmp(got, init, sizeof(got)) == 0, "pageable state lost its values");
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* Socket open to all (mode 0666), so that another uid can reach it. */
static const char open_config[] = "{ \"compute\": { \"worker_threads\": 2 },"
    " \"socket\": { \"mode\": \"0666\" } }";
#define OTHER_UID 65534	/* nobody */

static void
start_for_other_uids(void)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to act as a second uid");
	itd_start(&daemon_, open_config);
	/* mkdtemp made the directory 0700: let the other uid reach the socket in it. */
	cr_assert_eq(chmod(daemon_.dir, 0711), 0);
}

/* In the other uid: try to take and to drop root's job. */
static void
trespass(void *arg, struct svc_report *out)
{
	struct zc_conn *c = NULL;
	int r;

	r = zc_connect(daemon_.socket, &c);
	if (r < 0) {
		out->result = r;
		snprintf(out->text, sizeof(out->text), "connect: %s", strerror(-r));
		return;
	}
	/* Job names are per uid: root's job is "0:roots-job" to anyone else. */
	if (strcmp(arg, "open") == 0)
		r = zc_job_open(c, "0:roots-job", 1, 2);
	else if (strcmp(arg, "drop") == 0)
		r = zc_job_drop(c, "0:roots-job");
	else
		r = zc_job_drop(c, "roots-job");
	out->result = r;
	snprintf(out->text, sizeof(out->text), "%s", zc_errmsg(c));
	zc_disconnect(c);
}

/* In the other uid: a rank of its own job that registers a tensor and dies (its state is kept). */
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
		return;
	}
	if ((r = zc_job_open(c, "nobodys-job", 0, 2)) == 0)
		r = zc_tensor_register(c, &desc, init, &t);
	out->result = r;
	snprintf(out->text, sizeof(out->text), "%s", zc_errmsg(c));
	/* No zc_disconnect: the process just ends, like a crashed rank. */
}

/* True when zoffctl jobs --json-like stats list a job of this name. */
static bool
has_job(struct zc_conn *c, const char *name, double *ret_uid)
{
	char *json = NULL;
	const cJSON *j;
	cJSON *root;
	bool found = false;

	cr_assert_eq(zc_jobs_json(c, &json), 0, "%s", zc_errmsg(c));
	root = cJSON_Parse(json);
	cr_assert_not_null(root);
	cJSON_ArrayForEach(j, cJSON_GetObjectItemCaseSensitive(root, "jobs")) {
		const cJSON *n = cJSON_GetObjectItemCaseSensitive(j, "name");

		if (cJSON_IsString(n) && strcmp(n->valuestring, name) == 0) {
			found = true;
			if (ret_uid != NULL)
				*ret_uid = cJSON_GetObjectItemCaseSensitive(j, "uid")->valuedouble;
		}
	}
	cJSON_Delete(root);
	free(json);
	return found;
}

Test(hostile, jobs_belong_to_their_uid)
{
	struct svc_report rep;
	struct zc_conn *c, *c2;
	double uid = -1;

	start_for_other_uids();
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "roots-job", 0, 2), 0, "%s", zc_errmsg(c));

	svc_in_child(OTHER_UID, trespass, "open", &rep);
	cr_assert_eq(rep.result, -EACCES, "another uid opening root's job: %d %s", rep.result,
	    rep.text);
	cr_assert(strstr(rep.text, "uid 0's names") != NULL, "'%s'", rep.text);
	svc_in_child(OTHER_UID, trespass, "drop", &rep);
	cr_assert_eq(rep.result, -EPERM, "another uid dropping root's job: %d %s", rep.result,
	    rep.text);
	cr_assert(strstr(rep.text, "uid 0's names") != NULL, "'%s'", rep.text);
	/* Its own name space has no such job. */
	svc_in_child(OTHER_UID, trespass, "drop-own", &rep);
	cr_assert_eq(rep.result, -ENOENT, "%d %s", rep.result, rep.text);
	cr_assert(has_job(c, "roots-job", NULL), "root's job is gone after the attempts");

	/* The other uid's own job, left behind by a rank that died. */
	svc_in_child(OTHER_UID, own_job, NULL, &rep);
	cr_assert_eq(rep.result, 0, "the other uid's own job: %d %s", rep.result, rep.text);
	cr_assert(has_job(c, "nobodys-job", &uid));
	cr_assert_eq(uid, OTHER_UID);
	/* Root may join it and may drop it. */
	c2 = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c2, "65534:nobodys-job", 1, 2), 0, "root joining: %s",
	    zc_errmsg(c2));
	cr_assert_eq(zc_job_close(c2), 0, "%s", zc_errmsg(c2));
	zc_disconnect(c2);
	cr_assert_eq(zc_job_drop(c, "nobodys-job"), 0, "root dropping: %s", zc_errmsg(c));
	cr_assert_not(has_job(c, "nobodys-job", NULL), "dropped, but still listed");
	cr_assert_eq(svc_wait_stat(c, "tiers.pinned.used_bytes", 0, 10), 0);
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* A connection past a limit gets one ERROR that names the limit, then the end. */
static void
expect_refusal(const char *text)
{
	static struct zp_msg m;
	int fd = itd_raw_connect(&daemon_);

	cr_assert(itd_raw_recv(fd, &m, 5), "closed without saying why");
	cr_assert_eq(m.hdr.type, ZP_ERROR, "answered %s", zp_type_name(m.hdr.type));
	cr_assert_eq(m.u.error.code, -EUSERS, "code %d (%s)", m.u.error.code, m.u.error.message);
	cr_assert(strstr(m.u.error.message, text) != NULL, "'%s' does not name %s",
	    m.u.error.message, text);
	cr_assert_not(itd_raw_recv(fd, &m, 5), "still open after the refusal");
	close(fd);
}

Test(hostile, max_clients_per_uid)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"limits\": { \"max_clients_per_uid\": 2 } }";
	struct zc_conn *a, *b, *c = NULL;
	double deadline;
	int r;

	itd_start(&daemon_, config);
	a = itd_connect(&daemon_);
	b = itd_connect(&daemon_);
	expect_refusal("limits.max_clients_per_uid");
	/* No connection is left to hold the daemon's reason: the thread's connect message does. */
	r = zc_connect(daemon_.socket, &c);
	cr_assert_eq(r, -EUSERS, "a third connection of one uid gave %d (%s)", r, strerror(-r));
	cr_assert(strstr(zc_connect_errmsg(), daemon_.socket) != NULL &&
	    strstr(zc_connect_errmsg(), "limits.max_clients_per_uid") != NULL, "'%s'",
	    zc_connect_errmsg());
	cr_assert_str_eq(zc_errmsg(NULL), zc_connect_errmsg());
	cr_assert(strstr(itd_log_text(&daemon_), "refused a client of uid") != NULL, "%s",
	    itd_log_text(&daemon_));
	/* A slot frees when a connection goes; the daemon sees that asynchronously. */
	zc_disconnect(a);
	deadline = itd_now() + 10;
	do {
		r = zc_connect(daemon_.socket, &c);
		if (r == 0)
			break;
		usleep(10000);
	} while (itd_now() < deadline);
	cr_assert_eq(r, 0, "no connection after one of two went: %s", strerror(-r));
	cr_assert_str_eq(zc_connect_errmsg(), "no error", "a connect that worked left a message");
	zc_disconnect(b);
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

Test(hostile, max_clients)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"limits\": { \"max_clients\": 2 } }";
	struct zc_conn *a, *b, *c = NULL;
	int r;

	itd_start(&daemon_, config);
	a = itd_connect(&daemon_);
	b = itd_connect(&daemon_);
	expect_refusal("limits.max_clients)");
	/*
	 * Again and again: the daemon may close before or after our HELLO lands,
	 * and either way the client must report the refusal, not a reset.
	 */
	for (int i = 0; i < 200; i++) {
		r = zc_connect(daemon_.socket, &c);
		cr_assert_eq(r, -EUSERS, "attempt %d past limits.max_clients gave %d (%s)", i, r,
		    strerror(-r));
	}
	cr_assert(strstr(itd_log_text(&daemon_), "refused a client") != NULL, "%s",
	    itd_log_text(&daemon_));
	cr_assert_eq(zc_ping(a, NULL), 0, "%s", zc_errmsg(a));
	zc_disconnect(a);
	zc_disconnect(b);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

Test(hostile, uid_pinned_budget)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"memory\": { \"pinned_budget\": \"256M\" },"
	    " \"limits\": { \"uid_pinned_budget\": \"16M\" } }";
	/* 1M elements hold 12 MiB of state: one fits the uid's 16 MiB, a second does not. */
	struct zc_tensor_desc desc = { .name = "a", .numel = 1u << 20, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16 };
	static float init[1u << 20];
	struct zc_conn *c, *c2;
	struct zc_tensor *t;
	int r;

	itd_start(&daemon_, config);
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "quota-1", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	/* The budget is the uid's, across connections and jobs. */
	c2 = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c2, "quota-2", 0, 1), 0, "%s", zc_errmsg(c2));
	desc.name = "b";
	r = zc_tensor_register(c2, &desc, init, &t);
	cr_assert_eq(r, -EDQUOT, "past the uid's budget gave %d: %s", r, zc_errmsg(c2));
	cr_assert(strstr(zc_errmsg(c2), "uid_pinned_budget") != NULL, "'%s' does not name the "
	    "limit", zc_errmsg(c2));
	cr_assert(strstr(zc_errmsg(c2), "'b'") != NULL, "'%s' does not name the tensor",
	    zc_errmsg(c2));
	/* Once the first is gone there is room again. */
	zc_disconnect(c);
	cr_assert_eq(svc_wait_stat(c2, "sessions", 1, 10), 1);
	r = zc_tensor_register(c2, &desc, init, &t);
	cr_assert_eq(r, -EDQUOT, "the dead rank's kept state should still count: %d", r);
	cr_assert_eq(zc_job_drop(c2, "quota-1"), 0, "%s", zc_errmsg(c2));
	cr_assert_eq(zc_tensor_register(c2, &desc, init, &t), 0, "after the drop: %s",
	    zc_errmsg(c2));
	zc_disconnect(c2);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* pinned_bytes of uid in the stats, or -1 when the daemon lists no such uid. */
static double
uid_pinned(struct zc_conn *c, uid_t uid)
{
	char *json = NULL;
	const cJSON *u;
	cJSON *root;
	double v = -1;

	cr_assert_eq(zc_stats_json(c, &json), 0, "%s", zc_errmsg(c));
	root = cJSON_Parse(json);
	cr_assert_not_null(root);
	cJSON_ArrayForEach(u, cJSON_GetObjectItemCaseSensitive(root, "uids"))
		if (cJSON_GetObjectItemCaseSensitive(u, "uid")->valuedouble == (double)uid)
			v = cJSON_GetObjectItemCaseSensitive(u, "pinned_bytes")->valuedouble;
	cJSON_Delete(root);
	free(json);
	return v;
}

/* In the other uid: registers tensor "w" of 1M elements in its job "nobodys-job" as rank 0. */
static void
own_big_tensor(void *arg, struct svc_report *out)
{
	struct zc_tensor_desc desc = { .name = arg, .numel = 1u << 20, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16 };
	static float init[1u << 20];
	struct zc_conn *c = NULL;
	struct zc_tensor *t;
	int r;

	if ((r = zc_connect(daemon_.socket, &c)) < 0) {
		out->result = r;
		return;
	}
	r = zc_job_open(c, "nobodys-job", 0, 2);
	if (r == 0)
		r = zc_tensor_register(c, &desc, init, &t);
	out->result = r;
	snprintf(out->text, sizeof(out->text), "%s", zc_errmsg(c));
	if (r == 0)
		r = zc_job_close(c);
	zc_disconnect(c);
}

/*
 * A tensor is refunded to the uid it was charged to: root registering in
 * another uid's job and closing used to take root's charge off the job
 * owner's uid (wrapping it to 1.8e19 bytes, and refusing it from then on)
 * while root kept a charge for a tensor that no longer existed.
 */
Test(hostile, charges_go_back_to_whom_they_were_charged)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"socket\": { \"mode\": \"0666\" }, \"limits\": { \"detach_grace_s\": 30,"
	    " \"uid_pinned_budget\": \"16M\" } }";
	struct zc_tensor_desc desc = { .name = "roots", .numel = 1000, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	static float init[1000];
	struct svc_report rep;
	struct zc_conn *c, *keep;
	struct zc_tensor *t;

	if (geteuid() != 0)
		cr_skip_test("needs root to act as a second uid");
	itd_start(&daemon_, config);
	cr_assert_eq(chmod(daemon_.dir, 0711), 0);
	keep = itd_connect(&daemon_);
	/* The other uid's job, kept open by a rank that died. */
	svc_in_child(OTHER_UID, own_job, NULL, &rep);
	cr_assert_eq(rep.result, 0, "the other uid's own job: %d %s", rep.result, rep.text);
	cr_assert_gt(uid_pinned(keep, OTHER_UID), 0);
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "65534:nobodys-job", 1, 2), 0, "root joining: %s",
	    zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	cr_assert_gt(uid_pinned(keep, 0), 0, "root's tensor is not charged to root");
	cr_assert_eq(zc_job_close(c), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
	cr_assert_leq(uid_pinned(keep, 0), 0, "root keeps a charge of %.0f bytes for a tensor it "
	    "closed", uid_pinned(keep, 0));
	cr_assert_lt(uid_pinned(keep, OTHER_UID), 1e12, "the job owner's uid holds %.4g bytes",
	    uid_pinned(keep, OTHER_UID));
	cr_assert_eq(zc_job_drop(keep, "nobodys-job"), 0, "%s", zc_errmsg(keep));
	cr_assert_leq(uid_pinned(keep, OTHER_UID), 0, "%.4g bytes left with the owner's uid",
	    uid_pinned(keep, OTHER_UID));
	/* And its budget is whole again: 12 MiB of state fit its 16 MiB. */
	svc_in_child(OTHER_UID, own_big_tensor, "big", &rep);
	cr_assert_eq(rep.result, 0, "the owner's uid after the drop: %d %s", rep.result, rep.text);
	zc_disconnect(keep);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* In the other uid: connect, report the result and libzclient's message for it. */
static void
try_connect(void *arg, struct svc_report *out)
{
	struct zc_conn *c = NULL;

	(void)arg;
	out->result = zc_connect(daemon_.socket, &c);
	snprintf(out->text, sizeof(out->text), "%s", zc_connect_errmsg());
	/* zc_errmsg of the NULL left behind says the same. */
	if (out->result < 0 && strcmp(zc_errmsg(c), out->text) != 0)
		snprintf(out->text, sizeof(out->text), "zc_errmsg(NULL) says '%s'", zc_errmsg(c));
	zc_disconnect(c);
}

/* The name of the group that owns path, as a user reads it. */
static void
owning_group(const char *path, char *buf, size_t len)
{
	struct stat st;
	struct group *g;

	cr_assert_eq(stat(path, &st), 0, "%s: %s", path, strerror(errno));
	g = getgrgid(st.st_gid);
	cr_assert_not_null(g, "gid %u has no name", (unsigned)st.st_gid);
	snprintf(buf, len, "%s", g->gr_name);
}

/*
 * A user outside the socket's group gets -EACCES and a message naming the
 * socket and the group to join (zoffload with the shipped configuration,
 * the daemon's own group here); a socket no group may open says so instead.
 */
Test(hostile, connect_denied_names_the_group)
{
	char group[64], want[512];
	struct svc_report rep;

	if (geteuid() != 0)
		cr_skip_test("needs root to act as a second uid");
	itd_start(&daemon_, "{ \"compute\": { \"worker_threads\": 2 } }");
	cr_assert_eq(chmod(daemon_.dir, 0711), 0);
	owning_group(daemon_.socket, group, sizeof(group));
	snprintf(want, sizeof(want), "permission denied on %s: add your user to group %s (sudo "
	    "usermod -aG %s $USER, then log in again)", daemon_.socket, group, group);
	svc_in_child(OTHER_UID, try_connect, NULL, &rep);
	cr_assert_eq(rep.result, -EACCES, "%d: %s", rep.result, rep.text);
	cr_assert_str_eq(rep.text, want);

	/* Owner only: joining a group would not help, and the message does not say it would. */
	cr_assert_eq(chmod(daemon_.socket, 0600), 0);
	svc_in_child(OTHER_UID, try_connect, NULL, &rep);
	cr_assert_eq(rep.result, -EACCES, "%d: %s", rep.result, rep.text);
	cr_assert(strstr(rep.text, daemon_.socket) != NULL && strstr(rep.text, "0600") != NULL &&
	    strstr(rep.text, "socket.mode") != NULL && strstr(rep.text, "zoffload") != NULL &&
	    strstr(rep.text, "add your user") == NULL, "'%s'", rep.text);

	/* A directory above it closed to the user: the socket cannot even be looked at. */
	cr_assert_eq(chmod(daemon_.dir, 0700), 0);
	svc_in_child(OTHER_UID, try_connect, NULL, &rep);
	cr_assert_eq(rep.result, -EACCES, "%d: %s", rep.result, rep.text);
	cr_assert(strstr(rep.text, "a directory above it") != NULL && strstr(rep.text,
	    "zoffload") != NULL, "'%s'", rep.text);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}
