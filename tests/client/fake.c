/* The fake daemon of the client suite: a child process that answers libzclient as zoffloadd would, except where a test scripts it. */
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
#include "fake.h"

char fake_dir[64];
pid_t fake_child;

void
fake_teardown(void)
{
	if (fake_child > 0) {
		kill(fake_child, SIGKILL);
		waitpid(fake_child, NULL, 0);
	}
	fake_child = 0;
	if (fake_dir[0] != '\0') {
		char path[96];

		snprintf(path, sizeof(path), "%s/sock", fake_dir);
		unlink(path);
		rmdir(fake_dir);
	}
	fake_dir[0] = '\0';
}


unsigned
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
int
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
void
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

int
memfd_of(size_t bytes)
{
	int fd = memfd_create("fake-slot", MFD_CLOEXEC);

	if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0)
		_exit(4);
	return fd;
}

void
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

void
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
int req_fds[ZP_MAX_FDS];
unsigned req_nfds;
/* A script's verdict, given when the client hangs up: the fake exits with it. */
int script_status;

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

int
fake_listen(char path[FAKE_PATH_MAX])
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int lfd;

	snprintf(fake_dir, sizeof(fake_dir), "/tmp/zoff-fake-XXXXXX");
	cr_assert_not_null(mkdtemp(fake_dir));
	snprintf(path, FAKE_PATH_MAX, "%s/sock", fake_dir);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	cr_assert_geq(lfd, 0);
	cr_assert_eq(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0, "%s", strerror(errno));
	cr_assert_eq(listen(lfd, 4), 0);
	return lfd;
}

/* Starts the fake daemon; returns its socket path. */
const char *
fake_start(const struct fake *f)
{
	static char path[FAKE_PATH_MAX];
	int lfd = fake_listen(path);

	fake_child = fork();
	cr_assert_geq(fake_child, 0);
	if (fake_child == 0) {
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
void
fake_finish(void)
{
	int status;

	cr_assert_eq(waitpid(fake_child, &status, 0), fake_child);
	fake_child = 0;
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
	    "the fake daemon failed (status 0x%x)", status);
}

void
expect_error(struct zc_conn *c, int r, int code, const char *text)
{
	cr_assert_eq(r, code, "%d (%s), want %d; message: %s", r, strerror(-r), code,
	    zc_errmsg(c));
	cr_assert_not_null(strstr(zc_errmsg(c), text), "'%s' does not say '%s'", zc_errmsg(c),
	    text);
}

/* Connects and opens a job against the fake daemon. */
struct zc_conn *
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

int
try_register(struct zc_conn *c, uint64_t n)
{
	struct zc_tensor_desc desc = { .name = "w", .numel = n, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	static float init[4096];
	struct zc_tensor *t = NULL;

	cr_assert_leq(n, 4096);
	return zc_tensor_register(c, &desc, init, &t);
}

