/* A relay between one libzclient connection and a real zoffloadd, which can cut the client's sending side. */
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

/* Moves one datagram; false when `from` is closed or shut for reading. */
static bool
forward(int from, int to)
{
	static __thread unsigned char buf[ZP_MAX_MESSAGE];
	int fds[ZP_MAX_FDS];
	unsigned nfds = 0;
	ssize_t n;

	n = zp_recv_raw(from, buf, sizeof(buf), fds, ZP_MAX_FDS, &nfds, MSG_DONTWAIT);
	if (n == -EAGAIN)
		return true;
	if (n <= 0)
		return false;
	(void)zp_send_raw(to, buf, (size_t)n, fds, nfds);
	for (unsigned i = 0; i < nfds; i++)
		close(fds[i]);
	return true;
}

static void *
relay_main(void *arg)
{
	struct relay *r = arg;
	struct sockaddr_un sa;
	bool client_open = true, daemon_open = true;
	int fd;

	fd = accept4(r->listen_fd, NULL, NULL, SOCK_CLOEXEC);
	if (fd < 0)
		return NULL;
	r->daemon_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (r->daemon_fd < 0 || unix_addr(r->upstream, &sa) < 0 ||
	    connect(r->daemon_fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
		close(fd);
		return NULL;
	}
	__atomic_store_n(&r->client_fd, fd, __ATOMIC_RELEASE);
	while (daemon_open) {
		struct pollfd p[3] = {
			{ .fd = r->stop[0], .events = POLLIN },
			{ .fd = r->daemon_fd, .events = POLLIN },
			/* A client shut for reading polls readable for ever: leave it. */
			{ .fd = client_open ? fd : -1, .events = POLLIN },
		};

		if (poll(p, 3, -1) < 0 && errno != EINTR)
			break;
		if (p[0].revents != 0)
			break;
		if (p[1].revents != 0)
			daemon_open = forward(r->daemon_fd, fd);
		if (p[2].revents != 0 && client_open)
			client_open = forward(fd, r->daemon_fd);
	}
	return NULL;
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

void
relay_cut_requests(struct relay *r)
{
	double deadline = itd_now() + 10;
	int fd;

	while ((fd = __atomic_load_n(&r->client_fd, __ATOMIC_ACQUIRE)) < 0) {
		cr_assert_lt(itd_now(), deadline, "the relay got no client within 10 s");
		usleep(1000);
	}
	cr_assert_eq(shutdown(fd, SHUT_RD), 0, "shutdown: %s", strerror(errno));
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
	if (r->client_fd >= 0)
		close(r->client_fd);
	if (r->daemon_fd >= 0)
		close(r->daemon_fd);
	close(r->listen_fd);
	close(r->stop[0]);
	close(r->stop[1]);
	unlink(r->path);
}
