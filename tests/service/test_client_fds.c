/* Descriptors a client sends: every one is closed, an empty message's too. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "svc.h"

static struct itd daemon_;

static void
teardown(void)
{
	itd_cleanup(&daemon_);
}

TestSuite(client_fds, .fini = teardown, .timeout = 90);

/* One datagram of len bytes with one descriptor. */
static int
send_fd(int sock, const void *buf, size_t len, int fd)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int))];
	} control;
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
		.msg_controllen = sizeof(control.buf) };
	struct cmsghdr *c = CMSG_FIRSTHDR(&mh);

	memset(&control, 0, sizeof(control));
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(c), &fd, sizeof(int));
	return sendmsg(sock, &mh, MSG_NOSIGNAL) < 0 ? -errno : 0;
}

/*
 * An empty datagram reads as the end of the connection; the descriptors that came with
 * it were kept for ever, charged to nobody (3000 connections: 3000 descriptors).
 */
Test(client_fds, empty_message_with_a_descriptor)
{
	enum { CONNECTIONS = 200 };
	struct zc_conn *c;
	unsigned fds0, fds;
	int p[2];

	itd_start(&daemon_, NULL);
	c = itd_connect(&daemon_);
	fds0 = svc_fd_count(daemon_.pid);
	cr_assert_eq(pipe2(p, O_CLOEXEC), 0);
	for (int i = 0; i < CONNECTIONS; i++) {
		int fd = itd_raw_connect(&daemon_);
		int r;

		itd_raw_hello(fd);
		r = send_fd(fd, "", 0, p[0]);
		cr_assert_eq(r, 0, "an empty datagram with a descriptor: %s", strerror(-r));
		close(fd);
	}
	close(p[0]);
	close(p[1]);
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	cr_assert_eq(svc_wait_stat(c, "sessions", 1, 30), 1);
	fds = svc_wait_fds(daemon_.pid, fds0, 30);
	cr_assert_eq(fds, fds0, "after %d empty datagrams with a descriptor the daemon holds %u "
	    "descriptors, %u before", CONNECTIONS, fds, fds0);
	cr_assert_eq(svc_wait_stat(c, "limits.client_fds", 1, 10), 1,
	    "descriptors still charged to the uid");
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}
