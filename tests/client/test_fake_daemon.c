/* libzclient's own checks on what the daemon sends: a fake daemon in a child process answers wrongly; the client must fail clearly and leak no descriptor. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "msgio.h"
#include "proto.h"
#include "zclient.h"

/*
 * The fake daemon answers HELLO, JOB_OPEN, TENSOR_REGISTER (f32 slots) and
 * XFER_OPEN (a 64 KiB window) as the real one does, STATS with "{}", CKPT_WRITE
 * with CKPT_DONE (writing nothing), PING with PONG, every other request with OK,
 * except the one
 * request type a test scripts: that gets the test's reply.  It runs until
 * the client hangs up, so the client's clean-up requests (an UNREGISTER
 * after a failed register) are answered too.
 */
struct fake {
	uint16_t on;			/* request type whose reply is scripted */
	void (*reply)(int sock, const struct zp_msg *req);
};

static char dir[64];
static pid_t child;

static void
teardown(void)
{
	if (child > 0) {
		kill(child, SIGKILL);
		waitpid(child, NULL, 0);
	}
	child = 0;
	if (dir[0] != '\0') {
		char path[96];

		snprintf(path, sizeof(path), "%s/sock", dir);
		unlink(path);
		rmdir(dir);
	}
	dir[0] = '\0';
}

TestSuite(fake_daemon, .fini = teardown, .timeout = 30);

static unsigned
fd_count(void)
{
	DIR *d = opendir("/proc/self/fd");
	unsigned n = 0;

	cr_assert_not_null(d);
	while (readdir(d) != NULL)
		n++;
	closedir(d);
	return n;
}

/* Like zp_send_raw, but any number of descriptors: msgio refuses to send more than it takes. */
static int
sendmsg_fds(int sock, const void *buf, size_t len, const int *fds, unsigned nfds)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * 8)];
	} control;
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	struct cmsghdr *c;

	if (nfds > 8)
		return -EINVAL;
	if (nfds > 0) {
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

/* Child side: never asserts (Criterion's asserts belong to the test's process). */
static void
send_or_die(int sock, uint16_t type, uint64_t id, struct zp_msg *m, const int *fds,
    unsigned nfds)
{
	static uint8_t buf[ZP_MAX_MESSAGE];
	size_t len;

	m->hdr.type = type;
	m->hdr.request_id = id;
	if (zp_encode(m, buf, sizeof(buf), &len) != ZP_S_OK || sendmsg_fds(sock, buf, len, fds,
	    nfds) != 0)
		_exit(3);
}

static int
memfd_of(size_t bytes)
{
	int fd = memfd_create("fake-slot", MFD_CLOEXEC);

	if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0)
		_exit(4);
	return fd;
}

static void
tensor_ok_fds(int sock, const struct zp_msg *req, unsigned nfds)
{
	static uint32_t handle;
	struct zp_msg m = { .u.tensor_ok = { .handle = ++handle,
		.grad_bytes = req->u.tensor_register.numel * 4,
		.param_bytes = req->u.tensor_register.numel * 4 } };
	int fds[3] = { -1, -1, -1 };

	for (unsigned i = 0; i < nfds; i++)
		fds[i] = memfd_of(req->u.tensor_register.numel * 4);
	send_or_die(sock, ZP_TENSOR_OK, req->hdr.request_id, &m, fds, nfds);
	for (unsigned i = 0; i < nfds; i++)
		close(fds[i]);
}

static void
default_reply(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { 0 };
	int fd;

	switch (req->hdr.type) {
	case ZP_HELLO:
		strcpy(m.u.hello_ok.daemon_version, "fake");
		m.u.hello_ok.session_id = 1;
		send_or_die(sock, ZP_HELLO_OK, req->hdr.request_id, &m, NULL, 0);
		break;
	case ZP_JOB_OPEN:
		m.u.job_ok.job_id = 1;
		send_or_die(sock, ZP_JOB_OK, req->hdr.request_id, &m, NULL, 0);
		break;
	case ZP_TENSOR_REGISTER:
		/* f32 grads and params only. */
		tensor_ok_fds(sock, req, 2);
		break;
	case ZP_XFER_OPEN:
		fd = memfd_of(64 << 10);
		m.u.xfer_ok.bytes = 64 << 10;
		send_or_die(sock, ZP_XFER_OK, req->hdr.request_id, &m, &fd, 1);
		close(fd);
		break;
	case ZP_STATS:
		m.u.json.text = "{}";
		m.u.json.len = 2;
		send_or_die(sock, ZP_JSON, req->hdr.request_id, &m, NULL, 0);
		break;
	case ZP_CKPT_WRITE:
		send_or_die(sock, ZP_CKPT_DONE, req->hdr.request_id, &m, NULL, 0);
		break;
	case ZP_PING:
		send_or_die(sock, ZP_PONG, req->hdr.request_id, &m, NULL, 0);
		break;
	default:
		send_or_die(sock, ZP_OK, req->hdr.request_id, &m, NULL, 0);
		break;
	}
}

/* The descriptors that came with the request being answered (closed after the answer). */
static int req_fds[ZP_MAX_FDS];
static unsigned req_nfds;
/* A script's verdict, given when the client hangs up: the fake exits with it. */
static int script_status;

static void
serve(int sock, const struct fake *f)
{
	static uint8_t buf[ZP_MAX_MESSAGE];
	static struct zp_msg req;
	ssize_t n;

	for (;;) {
		n = zp_recv_raw(sock, buf, sizeof(buf), req_fds, ZP_MAX_FDS, &req_nfds, 0);
		if (n <= 0)
			_exit(script_status);
		if (zp_decode(buf, (size_t)n, &req, NULL, 0) != ZP_S_OK)
			_exit(2);
		if (req.hdr.type == f->on)
			f->reply(sock, &req);
		else
			default_reply(sock, &req);
		for (unsigned i = 0; i < req_nfds; i++)
			close(req_fds[i]);
	}
}

/* Starts the fake daemon; returns its socket path. */
static const char *
fake_start(const struct fake *f)
{
	static char path[96];
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int lfd;

	snprintf(dir, sizeof(dir), "/tmp/zoff-fake-XXXXXX");
	cr_assert_not_null(mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/sock", dir);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	cr_assert_geq(lfd, 0);
	cr_assert_eq(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0, "%s", strerror(errno));
	cr_assert_eq(listen(lfd, 4), 0);
	child = fork();
	cr_assert_geq(child, 0);
	if (child == 0) {
		int sock;

		signal(SIGPIPE, SIG_IGN);
		sock = accept(lfd, NULL, NULL);
		if (sock < 0)
			_exit(5);
		close(lfd);
		serve(sock, f);
	}
	close(lfd);
	return path;
}

/* The fake daemon ran its script to the end (the client hung up). */
static void
fake_finish(void)
{
	int status;

	cr_assert_eq(waitpid(child, &status, 0), child);
	child = 0;
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
	    "the fake daemon failed (status 0x%x)", status);
}

static void
expect_error(struct zc_conn *c, int r, int code, const char *text)
{
	cr_assert_eq(r, code, "%d (%s), want %d; message: %s", r, strerror(-r), code,
	    zc_errmsg(c));
	cr_assert_not_null(strstr(zc_errmsg(c), text), "'%s' does not say '%s'", zc_errmsg(c),
	    text);
}

/* Connects and opens a job against the fake daemon. */
static struct zc_conn *
fake_connect(const struct fake *f)
{
	struct zc_conn *c = NULL;
	const char *path = fake_start(f);
	int r = zc_connect(path, &c);

	cr_assert_eq(r, 0, "connect to the fake daemon: %d", r);
	/* The fake serves one connection: what its answers do, not reconnects, is tested here. */
	cr_assert_eq(zc_set_reconnect(c, 0), 0);
	cr_assert_eq(zc_job_open(c, "fake", 0, 1), 0, "%s", zc_errmsg(c));
	return c;
}

static int
try_register(struct zc_conn *c, uint64_t n)
{
	struct zc_tensor_desc desc = { .name = "w", .numel = n, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	static float init[4096];
	struct zc_tensor *t = NULL;

	cr_assert_leq(n, 4096);
	return zc_tensor_register(c, &desc, init, &t);
}

/* ---- descriptors where none are expected, or the wrong number ---- */

static void
pong_with_fd(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { 0 };
	int fd = memfd_of(4096);

	send_or_die(sock, ZP_PONG, req->hdr.request_id, &m, &fd, 1);
	close(fd);
}

Test(fake_daemon, fd_where_none_is_expected)
{
	const struct fake f = { ZP_PING, pong_with_fd };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, zc_ping(c, NULL), -EBADMSG, "PONG from zoffloadd carries 1 descriptors");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void
hello_with_fd(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { 0 };
	int fd = memfd_of(4096);

	strcpy(m.u.hello_ok.daemon_version, "fake");
	send_or_die(sock, ZP_HELLO_OK, req->hdr.request_id, &m, &fd, 1);
	close(fd);
}

/* zc_connect has no connection left to hold a message: the code says it. */
Test(fake_daemon, fd_with_hello)
{
	const struct fake f = { ZP_HELLO, hello_with_fd };
	unsigned before = fd_count();
	struct zc_conn *c = NULL;
	int r = zc_connect(fake_start(&f), &c);

	cr_assert_eq(r, -EBADMSG, "HELLO_OK with a descriptor: %d", r);
	cr_assert_null(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void tensor_ok_one_fd(int sock, const struct zp_msg *req) { tensor_ok_fds(sock, req, 1); }
static void tensor_ok_no_fd(int sock, const struct zp_msg *req) { tensor_ok_fds(sock, req, 0); }
static void tensor_ok_three_fds(int sock, const struct zp_msg *req) { tensor_ok_fds(sock, req, 3); }

Test(fake_daemon, tensor_ok_with_one_descriptor)
{
	const struct fake f = { ZP_TENSOR_REGISTER, tensor_ok_one_fd };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, try_register(c, 1000), -EBADMSG,
	    "TENSOR_OK from zoffloadd carries 1 descriptors");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

Test(fake_daemon, tensor_ok_without_descriptors)
{
	const struct fake f = { ZP_TENSOR_REGISTER, tensor_ok_no_fd };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, try_register(c, 1000), -EBADMSG,
	    "TENSOR_OK from zoffloadd carries 0 descriptors");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

/* More than ZP_MAX_FDS: the kernel hands them over, msgio closes them all. */
Test(fake_daemon, tensor_ok_with_three_descriptors)
{
	const struct fake f = { ZP_TENSOR_REGISTER, tensor_ok_three_fds };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);
	int r = try_register(c, 1000);

	cr_assert_eq(r, -ETOOMANYREFS, "%d: %s", r, zc_errmsg(c));
	cr_assert_not_null(strstr(zc_errmsg(c), "receive from zoffloadd"), "%s", zc_errmsg(c));
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void
xfer_ok_no_fd(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { .u.xfer_ok.bytes = 64 << 10 };

	send_or_die(sock, ZP_XFER_OK, req->hdr.request_id, &m, NULL, 0);
}

/* The window is opened by the first register, after the slots are mapped. */
Test(fake_daemon, xfer_ok_without_descriptor)
{
	const struct fake f = { ZP_XFER_OPEN, xfer_ok_no_fd };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, try_register(c, 1000), -EBADMSG,
	    "XFER_OK from zoffloadd carries 0 descriptors");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

/* ---- truncated, garbage and wrong replies ---- */

static void
truncated_pong(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { .hdr = { .type = ZP_JOB_OK, .request_id = req->hdr.request_id } };
	uint8_t buf[ZP_MAX_MESSAGE];
	size_t len;

	(void)sock;
	if (zp_encode(&m, buf, sizeof(buf), &len) != ZP_S_OK)
		_exit(6);
	/* The header promises 16 bytes of payload; 5 arrive (payload_len patched to match). */
	buf[16] = 5;
	if (sendmsg_fds(sock, buf, ZP_HEADER_SIZE + 5, NULL, 0) != 0)
		_exit(3);
}

Test(fake_daemon, truncated_reply)
{
	const struct fake f = { ZP_PING, truncated_pong };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, zc_ping(c, NULL), -EBADMSG, "bad message from zoffloadd");
	cr_assert_not_null(strstr(zc_errmsg(c), "JOB_OK"), "'%s' does not name the message",
	    zc_errmsg(c));
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void
garbage(int sock, const struct zp_msg *req)
{
	uint8_t buf[100];
	int fd = memfd_of(4096);

	(void)req;
	for (size_t i = 0; i < sizeof(buf); i++)
		buf[i] = (uint8_t)(i * 37 + 11);
	/* With a descriptor: the decode fails first, and the descriptor must still be closed. */
	if (sendmsg_fds(sock, buf, sizeof(buf), &fd, 1) != 0)
		_exit(3);
	close(fd);
}

Test(fake_daemon, garbage_reply_with_descriptor)
{
	const struct fake f = { ZP_PING, garbage };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, zc_ping(c, NULL), -EBADMSG, "bad message from zoffloadd: bad magic");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void
wrong_type(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { .u.job_ok = { .job_id = 9 } };

	send_or_die(sock, ZP_JOB_OK, req->hdr.request_id, &m, NULL, 0);
}

Test(fake_daemon, reply_of_the_wrong_type)
{
	const struct fake f = { ZP_PING, wrong_type };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, zc_ping(c, NULL), -EBADMSG, "answered PING with JOB_OK");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void
hang_up(int sock, const struct zp_msg *req)
{
	(void)req;
	close(sock);
	_exit(0);
}

Test(fake_daemon, hang_up_mid_request)
{
	const struct fake f = { ZP_TENSOR_REGISTER, hang_up };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, try_register(c, 1000), -ECONNRESET, "zoffloadd closed the connection");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

/* ---- replies that decode but do not hold together ---- */

static void
xfer_ok_tiny(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { .u.xfer_ok.bytes = 2 };
	int fd = memfd_of(4096);

	send_or_die(sock, ZP_XFER_OK, req->hdr.request_id, &m, &fd, 1);
	close(fd);
}

/* A window smaller than one element would move nothing, forever. */
Test(fake_daemon, xfer_window_below_one_element)
{
	const struct fake f = { ZP_XFER_OPEN, xfer_ok_tiny };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, try_register(c, 1000), -EBADMSG, "transfer window of 2 bytes");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void
xfer_ok_short_file(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { .u.xfer_ok.bytes = 64 << 10 };
	int fd = memfd_of(4096);

	send_or_die(sock, ZP_XFER_OK, req->hdr.request_id, &m, &fd, 1);
	close(fd);
}

/* Mapped past the file's end, the window would SIGBUS on the first copy beyond 4 KiB. */
Test(fake_daemon, xfer_window_larger_than_its_file)
{
	const struct fake f = { ZP_XFER_OPEN, xfer_ok_short_file };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, try_register(c, 4096), -EBADMSG, "transfer window of 65536 bytes");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static uint32_t scripted_handle;
static size_t scripted_grad_file;

/* TENSOR_OK with scripted_handle and a grad slot file of scripted_grad_file bytes. */
static void
tensor_ok_scripted(int sock, const struct zp_msg *req)
{
	uint64_t bytes = req->u.tensor_register.numel * 4;
	struct zp_msg m = { .u.tensor_ok = { .handle = scripted_handle, .grad_bytes = bytes,
		.param_bytes = bytes } };
	int fds[2] = { memfd_of(scripted_grad_file ? scripted_grad_file : bytes), memfd_of(bytes) };

	send_or_die(sock, ZP_TENSOR_OK, req->hdr.request_id, &m, fds, 2);
	close(fds[0]);
	close(fds[1]);
}

Test(fake_daemon, tensor_handle_zero)
{
	const struct fake f = { ZP_TENSOR_REGISTER, tensor_ok_scripted };
	unsigned before = fd_count();
	struct zc_conn *c;

	scripted_handle = 0;
	c = fake_connect(&f);
	expect_error(c, try_register(c, 1000), -EBADMSG, "handle 0");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

/* A second tensor given the first one's handle would take its place. */
Test(fake_daemon, tensor_handle_in_use)
{
	const struct fake f = { ZP_TENSOR_REGISTER, tensor_ok_scripted };
	unsigned before = fd_count();
	struct zc_tensor_desc desc = { .name = "first", .numel = 1000, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	static float init[1000];
	struct zc_tensor *first;
	struct zc_conn *c;

	scripted_handle = 3;
	c = fake_connect(&f);
	cr_assert_eq(zc_tensor_register(c, &desc, init, &first), 0, "%s", zc_errmsg(c));
	expect_error(c, try_register(c, 1000), -EBADMSG, "handle 3");
	cr_assert_eq(zc_tensor_numel(first), 1000, "the first tensor was replaced");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

/* A slot file shorter than the slot: the training process would SIGBUS writing gradients. */
Test(fake_daemon, slot_larger_than_its_file)
{
	const struct fake f = { ZP_TENSOR_REGISTER, tensor_ok_scripted };
	unsigned before = fd_count();
	struct zc_conn *c;

	scripted_handle = 1;
	scripted_grad_file = 4096;
	c = fake_connect(&f);
	expect_error(c, try_register(c, 4096), -EBADMSG, "slots of 'w'");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

/* ---- a reconnect that gets the state back in other slot files ---- */

#define REMAP_N 1000

/* The second connection's TENSOR_REGISTER: taken back (resumed), in new files, params 7. */
static void
tensor_ok_resumed_elsewhere(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { .u.tensor_ok = { .handle = 1, .resumed = 1, .last_step = 5,
		.grad_bytes = req->u.tensor_register.numel * 4,
		.param_bytes = req->u.tensor_register.numel * 4 } };
	int fds[2] = { memfd_of(req->u.tensor_register.numel * 4),
		memfd_of(req->u.tensor_register.numel * 4) };
	float *p = mmap(NULL, req->u.tensor_register.numel * 4, PROT_READ | PROT_WRITE, MAP_SHARED,
	    fds[1], 0);

	if (p == MAP_FAILED)
		_exit(4);
	for (uint64_t i = 0; i < req->u.tensor_register.numel; i++)
		p[i] = 7.0f;
	munmap(p, req->u.tensor_register.numel * 4);
	send_or_die(sock, ZP_TENSOR_OK, req->hdr.request_id, &m, fds, 2);
	close(fds[0]);
	close(fds[1]);
}

/*
 * Serves until the client's TENSOR_SET_STEP, then hangs up (or refuses it as
 * a daemon shutting down, and waits for the client to hang up), then serves a
 * second connection as a daemon that kept the state.
 */
static void
serve_two_lives(int lfd, bool shutting_down)
{
	static uint8_t buf[ZP_MAX_MESSAGE];
	static struct zp_msg req;
	int fds[ZP_MAX_FDS];
	unsigned nfds;

	for (int life = 0; life < 2; life++) {
		int sock = accept(lfd, NULL, NULL);

		if (sock < 0)
			_exit(5);
		for (;;) {
			ssize_t n = zp_recv_raw(sock, buf, sizeof(buf), fds, ZP_MAX_FDS, &nfds, 0);

			if (n <= 0 && life == 0 && shutting_down) {
				close(sock);
				break;
			}
			if (n <= 0)
				_exit(life == 1 ? 0 : 6);
			for (unsigned i = 0; i < nfds; i++)
				close(fds[i]);
			if (zp_decode(buf, (size_t)n, &req, NULL, 0) != ZP_S_OK)
				_exit(2);
			if (life == 0 && req.hdr.type == ZP_TENSOR_SET_STEP && shutting_down) {
				struct zp_msg m = { .u.error = { .code = -ESHUTDOWN } };

				strcpy(m.u.error.message, "zoffloadd is shutting down");
				send_or_die(sock, ZP_ERROR, req.hdr.request_id, &m, NULL, 0);
				continue;
			}
			if (life == 0 && req.hdr.type == ZP_TENSOR_SET_STEP) {
				close(sock);
				break;
			}
			if (life == 1 && req.hdr.type == ZP_TENSOR_REGISTER)
				tensor_ok_resumed_elsewhere(sock, &req);
			else
				default_reply(sock, &req);
		}
	}
	_exit(7);
}

/*
 * The daemon hands the tensor back with its state but in other files: the
 * new files are mapped at the old addresses (pointers the trainer holds stay
 * good), the grads written before are carried over, the params are the new
 * file's.
 */
/* A driver's registration of the slots, counted: it must let go before the pages change. */
static unsigned released, unpinned, remapped, unmapped;

static void
count_release(struct zc_tensor *t, void *arg)
{
	(void)t;
	(void)arg;
	released++;
}

/* The slots hook is told which: the remap keeps it, the unmap is its last call. */
static void
count_slots(struct zc_tensor *t, enum zc_slots_event why, void *arg)
{
	(void)t;
	(void)arg;
	if (why == ZC_SLOTS_REMAP)
		remapped++;
	else
		unmapped++;
}

static int
count_unpin(struct zc_tensor *t, void *arg)
{
	(void)t;
	(void)arg;
	unpinned++;
	return 0;
}

static void
reattach_in_other_files(bool shutting_down, bool slots_hook)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct zc_tensor_desc desc = { .name = "w", .numel = REMAP_N, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	static float init[REMAP_N];
	struct zc_conn_stats cs;
	struct zc_conn *c = NULL;
	struct zc_tensor *t = NULL;
	char path[96];
	float *grad, out[4];
	const float *param;
	int lfd;

	snprintf(dir, sizeof(dir), "/tmp/zoff-fake-XXXXXX");
	cr_assert_not_null(mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/sock", dir);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	cr_assert_geq(lfd, 0);
	cr_assert_eq(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0, "%s", strerror(errno));
	cr_assert_eq(listen(lfd, 4), 0);
	child = fork();
	cr_assert_geq(child, 0);
	if (child == 0) {
		signal(SIGPIPE, SIG_IGN);
		serve_two_lives(lfd, shutting_down);
	}
	close(lfd);

	cr_assert_eq(zc_connect(path, &c), 0);
	cr_assert_eq(zc_set_reconnect(c, 10000), 0);
	cr_assert_eq(zc_job_open(c, "fake", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	grad = zc_tensor_grad_slot(t, NULL);
	param = zc_tensor_param_slot(t, NULL);
	for (int i = 0; i < REMAP_N; i++)
		grad[i] = (float)i;
	released = unpinned = remapped = unmapped = 0;
	if (slots_hook)
		zc_tensor_set_slots_hook(t, count_slots, NULL);
	else
		zc_tensor_set_release_hook(t, count_release, NULL);
	zc_tensor_set_param_pin(t, count_unpin, NULL);
	/* The fake hangs up on this request; its second life answers it. */
	cr_assert_eq(zc_tensor_set_step(t, 6), 0, "%s", zc_errmsg(c));
	zc_conn_stats(c, &cs);
	cr_assert_eq(cs.reconnects, 1);
	cr_assert_eq(cs.slots_remapped, 2);
	cr_assert_eq(zc_tensor_grad_slot(t, NULL), grad, "the grad slot moved");
	cr_assert_eq(zc_tensor_param_slot(t, NULL), param, "the param slot moved");
	cr_assert_eq(zc_tensor_last_step(t), 6);
	/* The driver let go of the old pages, once, and holds none now. */
	cr_assert_eq(released + remapped, 1);
	cr_assert_eq(unmapped, 0);
	cr_assert_eq(unpinned, 1);
	cr_assert(!zc_tensor_param_pinned(t));
	for (int i = 0; i < REMAP_N; i++) {
		cr_assert_eq(grad[i], (float)i, "grad %d was not carried over", i);
		cr_assert_eq(param[i], 7.0f, "param %d is not the new file's", i);
	}
	/* The transfer window is the new session's too. */
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, 4, out), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
	if (slots_hook)
		cr_assert_eq(unmapped, 1, "the slots hook was not told of the unmap");
	else
		cr_assert_eq(released, 1, "the release hook ran again at the unmap");
	fake_finish();
}

Test(fake_daemon, reattach_in_other_files_maps_in_place)
{
	reattach_in_other_files(false, false);
}

Test(fake_daemon, reattach_in_other_files_tells_the_slots_hook_remap_then_unmap)
{
	reattach_in_other_files(false, true);
}

/* "zoffloadd is shutting down" is a connection going away too: the request goes to its successor. */
Test(fake_daemon, shutting_down_is_a_reconnect)
{
	reattach_in_other_files(true, false);
}

/* ---- a save over an earlier checkpoint ---- */

/* Whether process pid has a descriptor open on the file fd is open on. */
static bool
holds_file_of(pid_t pid, int fd)
{
	char dirpath[64], path[400];
	struct stat want, st;
	struct dirent *de;
	bool found = false;
	DIR *d;

	snprintf(dirpath, sizeof(dirpath), "/proc/%d/fd", (int)pid);
	d = opendir(dirpath);
	if (d == NULL || fstat(fd, &want) != 0)
		_exit(7);
	while (!found && (de = readdir(d)) != NULL) {
		snprintf(path, sizeof(path), "%s/%s", dirpath, de->d_name);
		found = de->d_name[0] != '.' && stat(path, &st) == 0 && st.st_dev == want.st_dev &&
		    st.st_ino == want.st_ino;
	}
	closedir(d);
	return found;
}

/*
 * CKPT_RELEASE: answered only once the client has closed its own descriptor of the file,
 * so that the daemon's close is the last.  A client that waits for the answer first never
 * does: after 10 s (a bound for that hang, not a timing) the fake answers and fails.
 */
static void
release_after_the_client_let_go(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { 0 };
	int waited_ms = 0;

	if (req_nfds != 1)
		_exit(8);
	while (holds_file_of(getppid(), req_fds[0]) && waited_ms < 10000) {
		usleep(1000);
		waited_ms++;
	}
	if (holds_file_of(getppid(), req_fds[0]))
		script_status = 6;
	send_or_die(sock, ZP_OK, req->hdr.request_id, &m, NULL, 0);
}

Test(fake_daemon, a_save_hands_over_the_replaced_file_after_closing_its_own)
{
	const struct fake f = { ZP_CKPT_RELEASE, release_after_the_client_let_go };
	struct zc_tensor_desc desc = { .name = "w", .numel = 1024, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-3f, .beta1 = 0.9f,
		.beta2 = 0.999f, .eps = 1e-8f };
	static float init[1024];
	char ckdir[64], path[128];
	struct zc_checkpoint_entry e = { 0 };
	struct zc_conn *c = fake_connect(&f);
	int fd;

	snprintf(ckdir, sizeof(ckdir), "/tmp/zoff-fake-ckpt-XXXXXX");
	cr_assert_not_null(mkdtemp(ckdir));
	snprintf(path, sizeof(path), "%s/rank-00000-of-00001.safetensors", ckdir);
	fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
	cr_assert_eq(write(fd, "earlier", 7), 7);
	close(fd);
	cr_assert_eq(zc_tensor_register(c, &desc, init, &e.tensor), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_checkpoint_save(c, ckdir, &e, 1, &sp), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
	unlink(path);
	rmdir(ckdir);
	fake_finish();
}
