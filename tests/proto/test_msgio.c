/* msgio over a SOCK_SEQPACKET socketpair: whole datagrams, descriptors passed, extras refused without leaking. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "msgio.h"

static int sv[2] = { -1, -1 };
static uint8_t rbuf[ZP_MAX_MESSAGE];

static void
setup(void)
{
	cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
}

static void
teardown(void)
{
	close(sv[0]);
	close(sv[1]);
}

TestSuite(msgio, .init = setup, .fini = teardown);

static unsigned
open_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	unsigned n = 0;

	cr_assert_not_null(d);
	while (readdir(d) != NULL)
		n++;
	closedir(d);
	return n;
}

/* Two descriptors refer to the same open file. */
static bool
same_file(int a, int b)
{
	struct stat sa, sb;

	return fstat(a, &sa) == 0 && fstat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
	    sa.st_ino == sb.st_ino;
}

/* Sends n copies of fd in one SCM_RIGHTS message with plain sendmsg, bypassing msgio's bound. */
static void
send_fds_raw(int sock, const void *data, size_t len, int fd, unsigned n)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * 8)];
	} control;
	struct iovec iov = { .iov_base = (void *)data, .iov_len = len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
		.msg_controllen = CMSG_SPACE(sizeof(int) * n) };
	struct cmsghdr *c;

	cr_assert_leq(n, 8);
	memset(&control, 0, sizeof(control));
	c = CMSG_FIRSTHDR(&mh);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int) * n);
	for (unsigned i = 0; i < n; i++)
		memcpy(CMSG_DATA(c) + i * sizeof(int), &fd, sizeof(int));
	cr_assert_eq(sendmsg(sock, &mh, 0), (ssize_t)len, "sendmsg: %s", strerror(errno));
}

Test(msgio, message_without_fds)
{
	struct zp_msg m = { .hdr = { .type = ZP_JOB_OPEN, .request_id = 99 } }, got;
	unsigned nfds = 77;
	int fds[ZP_MAX_FDS];
	ssize_t n;

	strcpy(m.u.job_open.job_name, "llama");
	m.u.job_open.rank = 1;
	m.u.job_open.world_size = 8;
	cr_assert_eq(zp_send(sv[0], &m, NULL, 0), 0);
	n = zp_recv_raw(sv[1], rbuf, sizeof(rbuf), fds, ZP_MAX_FDS, &nfds, 0);
	cr_assert_gt(n, 0, "%s", strerror((int)-n));
	cr_assert_eq(nfds, 0);
	cr_assert_eq(zp_decode(rbuf, (size_t)n, &got, NULL, 0), ZP_S_OK);
	cr_assert_eq(got.hdr.request_id, 99);
	cr_assert_str_eq(got.u.job_open.job_name, "llama");
	cr_assert_eq(got.u.job_open.world_size, 8);
}

Test(msgio, one_and_two_fds)
{
	struct zp_msg m = { .hdr = { .type = ZP_XFER_OK, .request_id = 1 } };
	int p[2], fds[ZP_MAX_FDS];
	unsigned nfds;
	char c = 0;
	ssize_t n;

	cr_assert_eq(pipe2(p, O_CLOEXEC), 0);
	m.u.xfer_ok.bytes = 4096;
	cr_assert_eq(zp_send(sv[0], &m, &p[1], 1), 0);
	n = zp_recv_raw(sv[1], rbuf, sizeof(rbuf), fds, ZP_MAX_FDS, &nfds, 0);
	cr_assert_gt(n, 0);
	cr_assert_eq(nfds, 1);
	cr_assert_neq(fds[0], p[1]);
	cr_assert(same_file(fds[0], p[1]));
	/* Received with close-on-exec, so a client's children do not inherit slots. */
	cr_assert(fcntl(fds[0], F_GETFD) & FD_CLOEXEC);
	/* It really is the pipe: a byte written through it comes out of the other end. */
	cr_assert_eq(write(fds[0], "z", 1), 1);
	cr_assert_eq(read(p[0], &c, 1), 1);
	cr_assert_eq(c, 'z');
	close(fds[0]);

	m.hdr.type = ZP_TENSOR_OK;
	m.u.tensor_ok = (struct zp_tensor_ok){ .handle = 1, .grad_bytes = 4, .param_bytes = 2 };
	cr_assert_eq(zp_send(sv[0], &m, p, 2), 0);
	n = zp_recv_raw(sv[1], rbuf, sizeof(rbuf), fds, ZP_MAX_FDS, &nfds, 0);
	cr_assert_gt(n, 0);
	cr_assert_eq(nfds, 2);
	cr_assert(same_file(fds[0], p[0]));
	cr_assert(same_file(fds[1], p[1]));
	/* Both ends of a pipe share an inode; the access mode tells them apart, in order. */
	cr_assert_eq(fcntl(fds[0], F_GETFL) & O_ACCMODE, O_RDONLY);
	cr_assert_eq(fcntl(fds[1], F_GETFL) & O_ACCMODE, O_WRONLY);
	close(fds[0]);
	close(fds[1]);
	close(p[0]);
	close(p[1]);
}

Test(msgio, send_refuses_too_many_fds)
{
	int fds[3] = { 0, 1, 2 };

	cr_assert_eq(zp_send_raw(sv[0], "x", 1, fds, ZP_MAX_FDS + 1), -EINVAL);
}

/* More descriptors than the caller takes: all of them closed, -ETOOMANYREFS, none leaked. */
Test(msgio, too_many_fds_closed)
{
	int p[2], fds[ZP_MAX_FDS] = { -1, -1 };
	unsigned before, nfds = 77;
	ssize_t n;

	cr_assert_eq(pipe2(p, O_CLOEXEC), 0);
	before = open_fds();

	/* Two sent, one accepted. */
	send_fds_raw(sv[0], "ab", 2, p[0], 2);
	n = zp_recv_raw(sv[1], rbuf, sizeof(rbuf), fds, 1, &nfds, 0);
	cr_assert_eq(n, -ETOOMANYREFS);
	cr_assert_eq(nfds, 0);
	cr_assert_eq(open_fds(), before, "descriptors leaked");

	/* Three sent, the protocol's two accepted. */
	send_fds_raw(sv[0], "abc", 3, p[1], 3);
	n = zp_recv_raw(sv[1], rbuf, sizeof(rbuf), fds, ZP_MAX_FDS, &nfds, 0);
	cr_assert_eq(n, -ETOOMANYREFS);
	cr_assert_eq(open_fds(), before, "descriptors leaked");

	/* Any at all where none are expected (the daemon's case). */
	send_fds_raw(sv[0], "a", 1, p[1], 1);
	n = zp_recv_raw(sv[1], rbuf, sizeof(rbuf), fds, 0, &nfds, 0);
	cr_assert_eq(n, -ETOOMANYREFS);
	cr_assert_eq(open_fds(), before, "descriptors leaked");

	/* Only our own two ends remain: closing the write end gives EOF on the read end. */
	close(p[1]);
	char c;

	cr_assert_eq(read(p[0], &c, 1), 0, "a copy of the write end is still open");
	close(p[0]);
}

/* A datagram larger than the buffer is refused, and its descriptors with it. */
Test(msgio, oversized_datagram)
{
	static uint8_t big[ZP_MAX_MESSAGE + 1];
	int p[2], fds[ZP_MAX_FDS];
	unsigned before, nfds;
	int sndbuf = 4 * ZP_MAX_MESSAGE;

	cr_assert_eq(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf)), 0);
	cr_assert_eq(pipe2(p, O_CLOEXEC), 0);
	before = open_fds();
	cr_assert_eq(zp_send_raw(sv[0], big, sizeof(big), p, 1), 0);
	cr_assert_eq(zp_recv_raw(sv[1], rbuf, sizeof(rbuf), fds, ZP_MAX_FDS, &nfds, 0), -EMSGSIZE);
	cr_assert_eq(open_fds(), before, "descriptors leaked");
	close(p[0]);
	close(p[1]);
}

Test(msgio, datagram_boundaries_kept)
{
	int fds[ZP_MAX_FDS];
	unsigned nfds;

	cr_assert_eq(zp_send_raw(sv[0], "first", 5, NULL, 0), 0);
	cr_assert_eq(zp_send_raw(sv[0], "2nd", 3, NULL, 0), 0);
	cr_assert_eq(zp_recv_raw(sv[1], rbuf, sizeof(rbuf), fds, ZP_MAX_FDS, &nfds, 0), 5);
	cr_assert_eq(memcmp(rbuf, "first", 5), 0);
	cr_assert_eq(zp_recv_raw(sv[1], rbuf, sizeof(rbuf), fds, ZP_MAX_FDS, &nfds, 0), 3);
	cr_assert_eq(memcmp(rbuf, "2nd", 3), 0);
}

Test(msgio, empty_and_closed)
{
	int fds[ZP_MAX_FDS];
	unsigned nfds;

	cr_assert_eq(zp_recv_raw(sv[1], rbuf, sizeof(rbuf), fds, ZP_MAX_FDS, &nfds, MSG_DONTWAIT),
	    -EAGAIN);
	cr_assert_eq(shutdown(sv[0], SHUT_WR), 0);
	cr_assert_eq(zp_recv_raw(sv[1], rbuf, sizeof(rbuf), fds, ZP_MAX_FDS, &nfds, 0), 0);
	/* Sending to a peer that is gone is an error, not SIGPIPE. */
	close(sv[1]);
	sv[1] = -1;
	cr_assert_eq(zp_send_raw(sv[0], "x", 1, NULL, 0), -EPIPE);
}

Test(msgio, send_refuses_unencodable)
{
	struct zp_msg m = { .hdr = { .type = 63 } };	/* no such type */

	cr_assert_eq(zp_send(sv[0], &m, NULL, 0), -EPROTO);
}

/*
 * zp_recv_all closes nothing: the descriptors of an empty datagram, of one with more than
 * a message carries, and of one too large all come back, for the caller to close where it
 * chooses.
 */
Test(msgio, recv_all_returns_every_descriptor)
{
	static uint8_t big[ZP_MAX_MESSAGE + 1];
	int p[2], fds[ZP_RECV_ALL_FDS];
	int sndbuf = 4 * ZP_MAX_MESSAGE;
	unsigned nfds;

	cr_assert_eq(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf)), 0);
	cr_assert_eq(pipe2(p, O_CLOEXEC), 0);
	send_fds_raw(sv[0], "", 0, p[0], 1);
	cr_assert_eq(zp_recv_all(sv[1], rbuf, sizeof(rbuf), fds, &nfds, 0), 0);
	cr_assert_eq(nfds, 1, "an empty datagram's descriptor was dropped");
	cr_assert(same_file(fds[0], p[0]));
	close(fds[0]);

	send_fds_raw(sv[0], "abc", 3, p[0], 8);
	cr_assert_eq(zp_recv_all(sv[1], rbuf, sizeof(rbuf), fds, &nfds, 0), 3);
	cr_assert_eq(nfds, 8);
	for (unsigned i = 0; i < nfds; i++) {
		cr_assert(same_file(fds[i], p[0]));
		close(fds[i]);
	}

	send_fds_raw(sv[0], big, sizeof(big), p[0], 2);
	cr_assert_eq(zp_recv_all(sv[1], rbuf, sizeof(rbuf), fds, &nfds, 0), -EMSGSIZE);
	cr_assert_eq(nfds, 2);
	close(fds[0]);
	close(fds[1]);
	close(p[0]);
	close(p[1]);
}
