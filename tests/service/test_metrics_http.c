/*
 * The metrics endpoint on a loopback port, against what one uid could do to it: a body
 * is refused, never buffered; connections are capped per uid and charged to it; a request
 * has one deadline from accept, not one per read (slowloris); a Unix socket takes no
 * descriptors.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "svc.h"

static struct itd daemon_;
static unsigned port_;

static void
teardown(void)
{
	itd_cleanup(&daemon_);
}

TestSuite(metrics_http, .fini = teardown, .timeout = 120);

static void
start(void)
{
	static const char config[] = "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"log\": { \"level\": \"info\" }, \"metrics\": { \"listen\": \"127.0.0.1:0\" } }";
	const char *p;

	itd_start(&daemon_, config);
	for (double end = itd_now() + 20; itd_now() < end; usleep(50000)) {
		p = strstr(itd_log_text(&daemon_), "metrics: serving http://127.0.0.1:");
		if (p != NULL && sscanf(p, "metrics: serving http://127.0.0.1:%u/", &port_) == 1)
			return;
	}
	cr_assert_fail("no metrics port in the log: %s", itd_log_text(&daemon_));
}

static int
tcp_connect(void)
{
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port_) };
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	cr_assert_geq(fd, 0);
	sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "connect: %s",
	    strerror(errno));
	return fd;
}

/* What the endpoint answers to req, up to its close (bounded): the status code, or 0. */
static int
request(const char *req, size_t len, char *reply, size_t cap)
{
	int fd = tcp_connect();
	size_t got = 0;
	int code = 0;

	cr_assert_eq(send(fd, req, len, MSG_NOSIGNAL), (ssize_t)len);
	for (;;) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		ssize_t n;

		if (poll(&p, 1, 10000) != 1)
			break;
		n = recv(fd, reply + got, cap - 1 - got, 0);
		if (n <= 0)
			break;
		got += (size_t)n;
		if (got == cap - 1)
			break;
	}
	reply[got] = '\0';
	close(fd);
	(void)sscanf(reply, "HTTP/1.%*d %d", &code);
	return code;
}

static int
get(const char *req, char *reply, size_t cap)
{
	return request(req, strlen(req), reply, cap);
}

/* In a forked child (no assertions there): the status of a GET /metrics, or -errno. */
static void
get_as_child(void *arg, struct svc_report *out)
{
	static const char req[] = "GET /metrics HTTP/1.1\r\n\r\n";
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port_) };
	char buf[256];
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), code = 0;
	ssize_t n;

	sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
	    send(fd, req, strlen(req), MSG_NOSIGNAL) != (ssize_t)strlen(req) ||
	    (n = recv(fd, buf, sizeof(buf) - 1, 0)) <= 0) {
		out->result = -errno;
		snprintf(out->text, sizeof(out->text), "%s", strerror(errno));
		return;
	}
	buf[n] = '\0';
	(void)sscanf(buf, "HTTP/1.%*d %d", &code);
	out->result = code;
	snprintf(out->text, sizeof(out->text), "%.200s", buf);
	close(fd);
}

Test(metrics_http, answers_and_refusals)
{
	static char reply[1 << 20], big[20000];
	int code;

	start();
	code = get("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", reply, sizeof(reply));
	cr_assert_eq(code, 200, "GET /metrics: %.200s", reply);
	cr_assert(strstr(reply, "zoffload_") != NULL, "no series in %.300s", reply);
	cr_assert(strstr(reply, "text/plain; version=0.0.4") != NULL);
	code = get("HEAD /metrics HTTP/1.1\r\n\r\n", reply, sizeof(reply));
	cr_assert_eq(code, 200);
	cr_assert(strstr(reply, "zoffload_") == NULL, "HEAD has a body");
	cr_assert_eq(get("GET /other HTTP/1.1\r\n\r\n", reply, sizeof(reply)), 404);
	cr_assert_eq(get("DELETE /metrics HTTP/1.1\r\n\r\n", reply, sizeof(reply)), 405);
	cr_assert_eq(get("POST /metrics HTTP/1.1\r\n\r\n", reply, sizeof(reply)), 405);
	/* A body is refused (evhttp's max body size, 0) before its method is looked at. */
	cr_assert_eq(get("POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", reply,
	    sizeof(reply)), 413);
	cr_assert_eq(get("GET /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", reply,
	    sizeof(reply)), 413);
	cr_assert_eq(get("GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc"
	    "\r\n0\r\n\r\n", reply, sizeof(reply)), 413);
	/* Headers over 16 KiB. */
	memset(big, 'a', sizeof(big));
	memcpy(big, "GET /metrics HTTP/1.1\r\nX: ", 26);
	cr_assert_eq(request(big, sizeof(big), reply, sizeof(reply)), 400, "%.200s", reply);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* A body is never buffered: 256 MiB sent after the headers leave the daemon's RSS as it was. */
Test(metrics_http, a_body_is_not_buffered)
{
	static char chunk[1 << 20];
	static const char head[] = "POST /metrics HTTP/1.1\r\nHost: x\r\n"
	    "Content-Length: 1610612736\r\n\r\n";
	uint64_t rss0, rss;
	size_t sent = 0;
	int fd;

	start();
	rss0 = svc_rss_kib(daemon_.pid);
	fd = tcp_connect();
	cr_assert_eq(send(fd, head, strlen(head), MSG_NOSIGNAL), (ssize_t)strlen(head));
	memset(chunk, 'x', sizeof(chunk));
	while (sent < (256u << 20)) {
		struct pollfd p = { .fd = fd, .events = POLLOUT };
		ssize_t n;

		if (poll(&p, 1, 10000) != 1)
			break;		/* not read at all: not buffered either */
		n = send(fd, chunk, sizeof(chunk), MSG_NOSIGNAL | MSG_DONTWAIT);
		if (n < 0 && errno == EAGAIN)
			continue;
		if (n <= 0)
			break;		/* refused and closed */
		sent += (size_t)n;
	}
	close(fd);
	rss = svc_rss_kib(daemon_.pid);
	/* Bound: 16 KiB of headers and 64 KiB drained per connection; 32 MiB is allocator slack. */
	cr_assert_lt(rss, rss0 + (32u << 10), "after %zu MiB of body the daemon's RSS went from "
	    "%llu to %llu KiB", sent >> 20, (unsigned long long)rss0, (unsigned long long)rss);
	cr_assert_lt(sent, 256u << 20, "the daemon read all of a 256 MiB body");
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* One uid's connections are capped and held against it: the daemon's descriptors stay bounded. */
Test(metrics_http, connections_capped_per_uid)
{
	enum { HELD = 64 };
	static char reply[1 << 20];
	unsigned fds0, fds = 0;
	int held[HELD];

	start();
	fds0 = svc_fd_count(daemon_.pid);
	for (int i = 0; i < HELD; i++)
		held[i] = tcp_connect();
	for (double end = itd_now() + 20; itd_now() < end; usleep(50000)) {
		fds = svc_fd_count(daemon_.pid);
		if (fds <= fds0 + 4)
			break;
	}
	cr_assert_leq(fds, fds0 + 4, "%d connections of one uid hold %u descriptors in the "
	    "daemon (%u before)", HELD, fds - fds0, fds0);
	/* The first four hold theirs; the rest were told why and closed. */
	{
		char buf[512];
		ssize_t n;
		struct pollfd p = { .fd = held[HELD - 1], .events = POLLIN };

		cr_assert_eq(poll(&p, 1, 10000), 1);
		n = recv(held[HELD - 1], buf, sizeof(buf) - 1, 0);
		cr_assert_gt(n, 0);
		buf[n] = '\0';
		cr_assert(strstr(buf, " 503 ") != NULL && strstr(buf, "metrics connections") != NULL,
		    "%s", buf);
	}
	/* Another uid is served meanwhile: a loopback TCP peer's uid is told apart. */
	if (geteuid() == 0) {
		struct svc_report rep;

		svc_in_child(65534, get_as_child, NULL, &rep);
		cr_assert_eq(rep.result, 200, "another uid's GET while one uid holds 4: %d %s",
		    rep.result, rep.text);
	}
	for (int i = 0; i < HELD; i++)
		close(held[i]);
	/* Once they are gone the uid is served again. */
	for (double end = itd_now() + 20; itd_now() < end; usleep(50000))
		if (get("GET /metrics HTTP/1.1\r\n\r\n", reply, sizeof(reply)) == 200)
			break;
	cr_assert_eq(get("GET /metrics HTTP/1.1\r\n\r\n", reply, sizeof(reply)), 200, "%.200s",
	    reply);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/*
 * A byte every half second keeps no connection past its deadline (10 s from accept): the
 * peer is cut off long before 60 bytes (30 s), where a per-read timeout never would.
 */
Test(metrics_http, slowloris_meets_one_deadline)
{
	static const char req[] = "GET /metrics HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
	unsigned sent = 0;
	bool closed = false;
	int fd;

	start();
	fd = tcp_connect();
	while (sent < 60 && !closed) {
		struct pollfd p = { .fd = fd, .events = POLLIN };

		if (send(fd, req + sent, 1, MSG_NOSIGNAL) != 1)
			break;
		sent++;
		/* The wait between bytes: the daemon's close shows as readable (EOF). */
		if (poll(&p, 1, 500) == 1) {
			char buf[64];

			closed = recv(fd, buf, sizeof(buf), 0) <= 0;
		}
	}
	close(fd);
	cr_assert_lt(sent, 60, "a connection sending a byte every 0.5 s was still open after %u "
	    "bytes", sent);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

#ifndef SO_PASSRIGHTS
#define SO_PASSRIGHTS 83
#endif

/*
 * A descriptor sent to a Unix-socket endpoint is refused by the kernel (SO_PASSRIGHTS off):
 * evhttp's reads would drop it, closing it on the event loop.  Kernels before 6.16 have no
 * such option: skipped there.
 */
Test(metrics_http, unix_socket_refuses_descriptors)
{
	char config[512], path[64];
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int))];
	} control;
	char byte = 'G';
	struct iovec iov = { .iov_base = &byte, .iov_len = 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
		.msg_controllen = sizeof(control.buf) };
	struct cmsghdr *h;
	int fd, probe, zero = 0, sent = 0;
	ssize_t n;

	probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	cr_assert_geq(probe, 0);
	if (setsockopt(probe, SOL_SOCKET, SO_PASSRIGHTS, &zero, sizeof(zero)) != 0) {
		close(probe);
		cr_skip_test("SO_PASSRIGHTS: %s (Linux 6.16 has it)", strerror(errno));
	}
	close(probe);
	snprintf(path, sizeof(path), "/tmp/zoff-metrics-test-%d.sock", (int)getpid());
	snprintf(config, sizeof(config), "{ \"compute\": { \"worker_threads\": 2 }, \"log\": "
	    "{ \"level\": \"info\" }, \"metrics\": { \"listen\": \"unix:%s\" } }", path);
	itd_start(&daemon_, config);
	for (double end = itd_now() + 20; itd_now() < end; usleep(50000))
		if (strstr(itd_log_text(&daemon_), "metrics: serving") != NULL)
			break;
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	cr_assert_geq(fd, 0);
	cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "connect %s: %s", path,
	    strerror(errno));
	h = CMSG_FIRSTHDR(&mh);
	h->cmsg_level = SOL_SOCKET;
	h->cmsg_type = SCM_RIGHTS;
	h->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(h), &sent, sizeof(int));
	n = sendmsg(fd, &mh, MSG_NOSIGNAL);
	cr_assert(n < 0 && errno == EPERM, "a descriptor sent to the metrics socket: %zd (%s)", n,
	    n < 0 ? strerror(errno) : "taken");
	close(fd);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}
