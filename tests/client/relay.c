/* A relay between libzclient and a real zoffloadd that can cut the connection, wholly or half. */
#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "itd.h"
#include "msgio.h"
#include "relay.h"

static int
unix_addr(const char *path, struct sockaddr_un *sa)
{
	*sa = (struct sockaddr_un){ .sun_family = AF_UNIX };
	if (strlen(path) >= sizeof(sa->sun_path))
		return -ENAMETOOLONG;
	memcpy(sa->sun_path, path, strlen(path));
	return 0;
}

enum fwd { FWD_OK, FWD_CLOSED, FWD_CUT };

/* Moves one datagram, or cuts at it when the armed cut says so. */
static enum fwd
forward(struct relay *r, int from, int to, bool to_daemon)
{
	static __thread unsigned char buf[ZP_MAX_MESSAGE];
	static __thread struct zp_msg msg;
	int fds[ZP_MAX_FDS];
	unsigned nfds = 0;
	bool cut = false;
	uint16_t type;
	ssize_t n;

	n = zp_recv_raw(from, buf, sizeof(buf), fds, ZP_MAX_FDS, &nfds, MSG_DONTWAIT);
	if (n == -EAGAIN)
		return FWD_OK;
	if (n <= 0)
		return FWD_CLOSED;
	type = __atomic_load_n(&r->cut_type, __ATOMIC_ACQUIRE);
	if (type != 0 && r->cut_to_daemon == to_daemon &&
	    zp_decode(buf, (size_t)n, &msg, NULL, 0) == ZP_S_OK)
		cut = msg.hdr.type == type;
	if (!cut || r->cut_deliver)
		(void)zp_send_raw(to, buf, (size_t)n, fds, nfds);
	for (unsigned i = 0; i < nfds; i++)
		close(fds[i]);
	if (!cut)
		return FWD_OK;
	__atomic_store_n(&r->cut_type, 0, __ATOMIC_RELEASE);
	return FWD_CUT;
}

static void
close_pair(struct relay *r, bool counted)
{
	int fd = __atomic_exchange_n(&r->client_fd, -1, __ATOMIC_ACQ_REL);

	if (fd >= 0)
		close(fd);
	if (r->daemon_fd >= 0)
		close(r->daemon_fd);
	r->daemon_fd = -1;
	if (counted)
		__atomic_add_fetch(&r->cuts, 1, __ATOMIC_ACQ_REL);
}

/* Serves one client until it, the daemon or a cut ends it; false when told to stop. */
static bool
serve(struct relay *r, int fd)
{
	struct sockaddr_un sa;
	bool client_open = true;

	r->daemon_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (r->daemon_fd < 0 || unix_addr(r->upstream, &sa) < 0 ||
	    connect(r->daemon_fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
		close(fd);
		if (r->daemon_fd >= 0)
			close(r->daemon_fd);
		r->daemon_fd = -1;
		return true;
	}
	__atomic_store_n(&r->client_fd, fd, __ATOMIC_RELEASE);
	__atomic_add_fetch(&r->clients, 1, __ATOMIC_ACQ_REL);
	for (;;) {
		struct pollfd p[3] = {
			{ .fd = r->stop[0], .events = POLLIN },
			{ .fd = r->daemon_fd, .events = POLLIN },
			/* A client shut for reading polls readable for ever: leave it. */
			{ .fd = client_open ? fd : -1, .events = POLLIN },
		};
		enum fwd f;
		char cmd;

		if (poll(p, 3, -1) < 0 && errno != EINTR)
			return false;
		if (p[0].revents != 0) {
			if (read(r->stop[0], &cmd, 1) != 1 || cmd != 'c')
				return false;
			close_pair(r, true);
			return true;
		}
		if (p[1].revents != 0) {
			f = forward(r, r->daemon_fd, fd, false);
			if (f != FWD_OK) {
				close_pair(r, f == FWD_CUT);
				return true;
			}
		}
		if (p[2].revents != 0 && client_open) {
			f = forward(r, fd, r->daemon_fd, true);
			if (f == FWD_CUT) {
				close_pair(r, true);
				return true;
			}
			/* The client hung up (not cut for reading by the test): so does the daemon side. */
			if (f == FWD_CLOSED && !__atomic_load_n(&r->half_cut, __ATOMIC_ACQUIRE)) {
				close_pair(r, false);
				return true;
			}
			client_open = f == FWD_OK;
		}
	}
}

static void *
relay_main(void *arg)
{
	struct relay *r = arg;

	for (;;) {
		struct pollfd p[2] = {
			{ .fd = r->stop[0], .events = POLLIN },
			{ .fd = r->listen_fd, .events = POLLIN },
		};
		int fd;

		if (poll(p, 2, -1) < 0 && errno != EINTR)
			return NULL;
		if (p[0].revents != 0) {
			char cmd;

			/* A cut with no client: nothing to cut. */
			if (read(r->stop[0], &cmd, 1) != 1 || cmd != 'c')
				return NULL;
			continue;
		}
		if (p[1].revents == 0)
			continue;
		fd = accept4(r->listen_fd, NULL, NULL, SOCK_CLOEXEC);
		if (fd < 0)
			continue;
		if (!serve(r, fd))
			return NULL;
	}
}

void
relay_start(struct relay *r, const char *path, const char *upstream)
{
	struct sockaddr_un sa;

	memset(r, 0, sizeof(*r));
	r->client_fd = r->daemon_fd = -1;
	snprintf(r->path, sizeof(r->path), "%s", path);
	snprintf(r->upstream, sizeof(r->upstream), "%s", upstream);
	cr_assert_eq(pipe(r->stop), 0);
	r->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	cr_assert_geq(r->listen_fd, 0);
	cr_assert_eq(unix_addr(path, &sa), 0);
	unlink(path);
	cr_assert_eq(bind(r->listen_fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "bind %s: %s",
	    path, strerror(errno));
	cr_assert_eq(listen(r->listen_fd, 4), 0);
	cr_assert_eq(pthread_create(&r->thread, NULL, relay_main, r), 0);
	r->running = true;
}

/* The current client's socket, waiting (bounded) for one. */
static int
client_fd(struct relay *r)
{
	double deadline = itd_now() + 10;
	int fd;

	while ((fd = __atomic_load_n(&r->client_fd, __ATOMIC_ACQUIRE)) < 0) {
		cr_assert_lt(itd_now(), deadline, "the relay got no client within 10 s");
		usleep(1000);
	}
	return fd;
}

void
relay_cut_requests(struct relay *r)
{
	int fd = client_fd(r);

	__atomic_store_n(&r->half_cut, true, __ATOMIC_RELEASE);
	cr_assert_eq(shutdown(fd, SHUT_RD), 0, "shutdown: %s", strerror(errno));
}

void
relay_cut_at(struct relay *r, uint16_t type, bool to_daemon, bool deliver)
{
	r->cut_to_daemon = to_daemon;
	r->cut_deliver = deliver;
	__atomic_store_n(&r->cut_type, type, __ATOMIC_RELEASE);
}

void
relay_cut_now(struct relay *r)
{
	unsigned before = relay_cuts(r);
	double deadline = itd_now() + 10;

	(void)client_fd(r);
	cr_assert_eq(write(r->stop[1], "c", 1), 1);
	while (relay_cuts(r) == before) {
		cr_assert_lt(itd_now(), deadline, "the relay did not cut within 10 s");
		usleep(1000);
	}
}

unsigned
relay_cuts(struct relay *r)
{
	return __atomic_load_n(&r->cuts, __ATOMIC_ACQUIRE);
}

void
relay_stop(struct relay *r)
{
	if (!r->running)
		return;
	if (write(r->stop[1], "x", 1) != 1)
		cr_log_warn("relay: cannot signal the thread: %s", strerror(errno));
	pthread_join(r->thread, NULL);
	r->running = false;
	close_pair(r, false);
	close(r->listen_fd);
	close(r->stop[0]);
	close(r->stop[1]);
	unlink(r->path);
}
