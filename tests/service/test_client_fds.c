/*
 * Descriptors a client sends: every one is closed (an empty message's too), and never on
 * the event loop, where the last close of an unlinked file of many extents froze every
 * client for seconds.  The daemon's closer threads open ZOFFLOADD_TEST_CLOSE_GATE (a
 * FIFO) for reading before each close, so a test that holds the FIFO shut sees a close
 * wait there, while the loop answers.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "msgio.h"
#include "svc.h"

static struct itd daemon_;
static char gatedir[64], gate[96];
static int gate_fd = -1;

static void
teardown(void)
{
	/* A gated closer must be let go, or the daemon cannot stop. */
	if (gate[0] != '\0' && gate_fd < 0)
		gate_fd = open(gate, O_RDWR);
	itd_cleanup(&daemon_);
	if (gate_fd >= 0)
		close(gate_fd);
	gate_fd = -1;
	if (gate[0] != '\0') {
		(void)unlink(gate);
		(void)rmdir(gatedir);
	}
	gate[0] = '\0';
}

TestSuite(client_fds, .fini = teardown, .timeout = 90);

static void
gated_start(void)
{
	snprintf(gatedir, sizeof(gatedir), "/tmp/zoff-gate-XXXXXX");
	cr_assert_not_null(mkdtemp(gatedir));
	snprintf(gate, sizeof(gate), "%s/gate", gatedir);
	cr_assert_eq(mkfifo(gate, 0600), 0, "mkfifo %s: %s", gate, strerror(errno));
	cr_assert_eq(setenv("ZOFFLOADD_TEST_CLOSE_GATE", gate, 1), 0);
	itd_start(&daemon_, NULL);
	cr_assert_eq(unsetenv("ZOFFLOADD_TEST_CLOSE_GATE"), 0);
}

/* Lets every close the closer holds, and every later one, through. */
static void
open_gate(void)
{
	gate_fd = open(gate, O_RDWR);
	cr_assert_geq(gate_fd, 0, "open %s: %s", gate, strerror(errno));
}

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

/* Sends msg with fd. */
static void
send_msg_fd(int sock, uint16_t type, uint64_t id, struct zp_msg *m, int fd)
{
	static uint8_t buf[ZP_MAX_MESSAGE];
	size_t len;
	int r;

	m->hdr.type = type;
	m->hdr.request_id = id;
	cr_assert_eq(zp_encode(m, buf, sizeof(buf), &len), ZP_S_OK);
	r = send_fd(sock, buf, len, fd);
	cr_assert_eq(r, 0, "send %s: %s", zp_type_name(type), strerror(-r));
}

/* A reply within timeout_s, or false. */
static bool
recv_within(int sock, struct zp_msg *m, double timeout_s)
{
	struct pollfd p = { .fd = sock, .events = POLLIN };

	if (poll(&p, 1, (int)(timeout_s * 1000)) != 1)
		return false;
	return itd_raw_recv(sock, m, 1);
}

/* Whether pid holds a descriptor of the file with inode ino. */
static bool
holds_inode(pid_t pid, ino_t ino)
{
	char dir[64], path[PATH_MAX];
	struct dirent *e;
	struct stat st;
	bool found = false;
	DIR *dp;

	snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)pid);
	dp = opendir(dir);
	cr_assert_not_null(dp, "%s: %s", dir, strerror(errno));
	while (!found && (e = readdir(dp)) != NULL) {
		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		found = stat(path, &st) == 0 && st.st_ino == ino && S_ISREG(st.st_mode);
	}
	closedir(dp);
	return found;
}

/* A writable file, unlinked: the descriptor is its only reference. */
static int
scratch_file(ino_t *ino)
{
	char path[] = "/tmp/zoff-scratch-XXXXXX";
	struct stat st;
	int fd = mkstemp(path);

	cr_assert_geq(fd, 0, "mkstemp: %s", strerror(errno));
	cr_assert_eq(unlink(path), 0);
	cr_assert_eq(fstat(fd, &st), 0);
	*ino = st.st_ino;
	return fd;
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

/*
 * A refused CKPT_WRITE, and a PING that carries a descriptor (malformed): the file is the
 * daemon's to close last, and that close waits on a closer thread while the loop goes on.
 */
Test(client_fds, refused_descriptors_close_off_the_loop)
{
	static struct zp_msg m;
	struct zc_conn *c;
	ino_t ino[2];
	int sock, file;

	gated_start();
	c = itd_connect(&daemon_);
	sock = itd_raw_connect(&daemon_);
	itd_raw_hello(sock);

	/* Refused: no tensor with that handle.  The connection stays. */
	file = scratch_file(&ino[0]);
	memset(&m, 0, sizeof(m));
	m.u.ckpt_write.handle = 999;
	m.u.ckpt_write.count = 1;
	send_msg_fd(sock, ZP_CKPT_WRITE, 7, &m, file);
	close(file);
	cr_assert(itd_raw_recv(sock, &m, 10));
	cr_assert_eq(m.hdr.type, ZP_ERROR, "a CKPT_WRITE for no tensor answered %s",
	    zp_type_name(m.hdr.type));
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	cr_assert(holds_inode(daemon_.pid, ino[0]), "the refused file was closed on the loop");

	/* Malformed: a PING carries no descriptor.  The connection goes. */
	file = scratch_file(&ino[1]);
	memset(&m, 0, sizeof(m));
	send_msg_fd(sock, ZP_PING, 8, &m, file);
	close(file);
	cr_assert(itd_raw_recv(sock, &m, 10));
	cr_assert_eq(m.hdr.type, ZP_ERROR, "a PING with a descriptor answered %s",
	    zp_type_name(m.hdr.type));
	cr_assert(strstr(m.u.error.message, "carries 1 file descriptors") != NULL, "%s",
	    m.u.error.message);
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	cr_assert(holds_inode(daemon_.pid, ino[1]), "the malformed message's file was closed "
	    "on the loop");
	cr_assert_eq(itd_stat(c, "limits.fds_closed_off_loop"), 0);

	/* Its socket held nothing more: closed at once, on the loop, with nothing to free. */
	cr_assert_not(itd_raw_recv(sock, &m, 10), "connection still open after its error");
	close(sock);
	open_gate();
	cr_assert_geq(svc_wait_stat(c, "limits.fds_closed_off_loop", 2, 30), 2,
	    "the two files were not closed");
	for (double end = itd_now() + 30; itd_now() < end; usleep(20000))
		if (!holds_inode(daemon_.pid, ino[0]) && !holds_inode(daemon_.pid, ino[1]))
			break;
	cr_assert_not(holds_inode(daemon_.pid, ino[0]) || holds_inode(daemon_.pid, ino[1]),
	    "a file is still open in the daemon after its close was let through");
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/*
 * A uid whose closes pile up (each can take seconds) is not read from until they are
 * done: what it sends waits in its own socket, and its descriptors stay bounded.
 */
Test(client_fds, a_uid_with_closes_waiting_is_not_read)
{
	enum { SENT = 24 };
	static struct zp_msg m;
	unsigned answered = 0, fds0;
	struct zc_conn *c;
	int sock, file;
	ino_t ino;

	gated_start();
	c = itd_connect(&daemon_);
	sock = itd_raw_connect(&daemon_);
	itd_raw_hello(sock);
	fds0 = svc_fd_count(daemon_.pid);
	file = scratch_file(&ino);
	for (int i = 0; i < SENT; i++) {
		memset(&m, 0, sizeof(m));
		m.u.ckpt_write.handle = 999;
		m.u.ckpt_write.count = 1;
		send_msg_fd(sock, ZP_CKPT_WRITE, 10 + (uint64_t)i, &m, file);
	}
	close(file);
	/* The first ones are answered; then the uid waits for its closes. */
	while (answered < SENT && recv_within(sock, &m, 3)) {
		cr_assert_eq(m.hdr.type, ZP_ERROR);
		answered++;
	}
	cr_assert_lt(answered, SENT, "every message was read while %u closes waited",
	    answered);
	cr_assert_leq(svc_fd_count(daemon_.pid), fds0 + 16 + 1, "the daemon took more of the "
	    "uid's descriptors than the closer's bound");
	open_gate();
	while (answered < SENT) {
		cr_assert(itd_raw_recv(sock, &m, 30), "%u of %d answered after the closes",
		    answered, SENT);
		cr_assert_eq(m.hdr.type, ZP_ERROR);
		answered++;
	}
	close(sock);
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}
