/*
 * The metrics endpoint: GET /metrics on a Unix socket or a loopback port.  A small HTTP/1.x
 * server of its own rather than evhttp, which buffered any body whole, counted its
 * connections against no one and timed each read, not the request: here a request is its
 * headers (16 KiB at most, no body), a connection has DEADLINE_S from accept to the reply's
 * end, and connections are capped in all and per uid, each charged to its uid's descriptors.
 */
#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <event2/event.h>
#include <grp.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "closer.h"
#include "daemon.h"
#include "log.h"
#include "metrics.h"
#include "msgio.h"
#include "uid.h"

struct mconn;

/*
 * Owns its listening socket and its connections (each holds a charge on its peer's uid);
 * unix_path is set only once this daemon made the socket file, so that zd_metrics_free
 * never removes someone else's.
 */
struct zd_metrics {
	struct zd_daemon *d;
	int listen_fd;
	bool tcp;
	struct event *ev_listen;
	TAILQ_HEAD(, mconn) conns;
	unsigned nconns;
	char unix_path[108];
};

static bool
is_loopback(int family, const char *host)
{
	unsigned char a[16];

	if (family == AF_INET)
		return inet_pton(AF_INET, host, a) == 1 && a[0] == 127;
	return inet_pton(AF_INET6, host, a) == 1 && memcmp(a, &in6addr_loopback, 16) == 0;
}

int
zd_metrics_parse_listen(const char *spec, struct zd_metrics_addr *ret, char *err,
    size_t errlen)
{
	const char *colon, *host = spec;
	size_t hostlen;
	char *end;
	unsigned long port;

	memset(ret, 0, sizeof(*ret));
	if (strncmp(spec, "unix:", 5) == 0) {
		if (spec[5] != '/' || strlen(spec + 5) >= sizeof(ret->path)) {
			snprintf(err, errlen, "\"%s\": a Unix socket needs an absolute path under %zu "
			    "bytes (\"unix:/run/zoffload/metrics.sock\")", spec, sizeof(ret->path));
			return -EINVAL;
		}
		ret->family = AF_UNIX;
		snprintf(ret->path, sizeof(ret->path), "%s", spec + 5);
		return 0;
	}
	colon = strrchr(spec, ':');
	if (colon == NULL || colon == spec || colon[1] == '\0')
		goto bad;
	if (spec[0] == '[') {
		if (colon[-1] != ']')
			goto bad;
		host = spec + 1;
		hostlen = (size_t)(colon - 1 - host);
		ret->family = AF_INET6;
	} else {
		hostlen = (size_t)(colon - spec);
		ret->family = AF_INET;
	}
	if (hostlen == 0 || hostlen >= sizeof(ret->host))
		goto bad;
	memcpy(ret->host, host, hostlen);
	errno = 0;
	port = strtoul(colon + 1, &end, 10);
	if (*end != '\0' || errno != 0 || port > 65535 || colon[1] == '-' || colon[1] == '+')
		goto bad;
	ret->port = (unsigned)port;
	if (ret->family == AF_INET && strcmp(ret->host, "localhost") == 0)
		snprintf(ret->host, sizeof(ret->host), "127.0.0.1");
	if (!is_loopback(ret->family, ret->host)) {
		snprintf(err, errlen, "\"%s\": %s is not a loopback address; the endpoint has no "
		    "authentication, so it listens on 127.0.0.0/8, [::1] or a Unix socket only",
		    spec, ret->host);
		return -EINVAL;
	}
	return 0;
bad:
	snprintf(err, errlen, "\"%s\" is not \"unix:/PATH\", \"127.0.0.1:PORT\" or \"[::1]:PORT\"",
	    spec);
	return -EINVAL;
}

/* The whole request, headers included, and the blank line: a larger one gets a 400. */
#define HEADER_MAX 16384
/*
 * From accept to the reply's last byte: a peer that sends a byte now and then (slowloris)
 * is cut off here, not after each read.
 */
#define DEADLINE_S 10
/* Connections at once, and per uid: past them a connection gets a 503 and goes. */
#define MAX_CONNECTIONS 32
#define UID_CONNECTIONS 4
/* What a lingering close reads and drops (a body we refused) before it just closes. */
#define LINGER_MAX (64u << 10)

/*
 * One connection: its socket (one of its uid's descriptors until it is closed), the request
 * read so far, the reply being written.
 */
struct mconn {
	TAILQ_ENTRY(mconn) entry;
	struct zd_metrics *m;
	int fd;
	struct zd_uid *uid;
	struct event *ev_read, *ev_write, *ev_deadline;
	char in[HEADER_MAX];
	size_t inlen;
	char *out;
	size_t outlen, outoff;
	bool lingering;			/* replied: reading what is left until the peer's end */
	size_t dropped;
};

static void
conn_close(struct mconn *c)
{
	struct zd_metrics *m = c->m;

	TAILQ_REMOVE(&m->conns, c, entry);
	m->nconns--;
	c->uid->metrics_conns--;
	event_free(c->ev_read);
	event_free(c->ev_write);
	event_free(c->ev_deadline);
	/* A Unix socket may hold descriptors sent with what we did not read: off the loop. */
	zd_closer_close_socket(m->d, c->uid, c->fd, ZD_CLOSE_CHARGED);
	zd_uid_put(m->d, c->uid);
	free(c->out);
	free(c);
}

static void
set_reply(struct mconn *c, int code, const char *reason, const char *type,
    const char *extra, const char *body, size_t len, bool head)
{
	char hdr[512];
	int n;

	n = snprintf(hdr, sizeof(hdr), "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: "
	    "%zu\r\n%sConnection: close\r\n\r\n", code, reason, type, len, extra);
	free(c->out);
	c->outlen = (size_t)n + (head ? 0 : len);
	c->outoff = 0;
	c->out = malloc(c->outlen);
	if (c->out == NULL) {
		c->outlen = 0;
		return;
	}
	memcpy(c->out, hdr, (size_t)n);
	if (!head)
		memcpy(c->out + n, body, len);
}

static void
error_reply(struct mconn *c, int code, const char *reason, const char *extra,
    const char *text)
{
	set_reply(c, code, reason, "text/plain; charset=utf-8", extra, text, strlen(text),
	    false);
}

static void
metrics_reply(struct mconn *c, bool head)
{
	cJSON *tree = zd_stats_tree(c->m->d);
	char *text = NULL;
	size_t len = 0;

	if (tree != NULL)
		text = zd_metrics_render(tree, c->m->d->cfg.metrics_max_jobs, &len);
	if (text == NULL)
		error_reply(c, 500, "Internal Server Error", "", "out of memory\n");
	else
		set_reply(c, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", "", text, len,
		    head);
	free(text);
	cJSON_Delete(tree);
}

/*
 * A header named name (with its colon, any case), before the blank line that ends them,
 * has a value other than "0".
 */
static bool
has_header(const char *headers, const char *name)
{
	size_t n = strlen(name);

	for (const char *p = headers; p != NULL && *p != '\0'; p = strchr(p, '\n')) {
		if (*p == '\n')
			p++;
		if (*p == '\r' || *p == '\n')
			return false;
		if (strncasecmp(p, name, n) == 0) {
			p += n;
			while (*p == ' ' || *p == '\t')
				p++;
			return !(p[0] == '0' && (p[1] == '\r' || p[1] == '\n'));
		}
	}
	return false;
}

/* The request line and headers in c->in (NUL-terminated): the reply to write. */
static void
answer(struct mconn *c)
{
	char method[16], target[HEADER_MAX], version[16];
	const char *headers = strchr(c->in, '\n');
	char *q;

	if (sscanf(c->in, "%15s %16383s %15s", method, target, version) != 3 ||
	    strncmp(version, "HTTP/1.", 7) != 0) {
		error_reply(c, 400, "Bad Request", "", "not an HTTP/1.x request line\n");
		return;
	}
	q = strchr(target, '?');
	if (q != NULL)
		*q = '\0';
	if (strcmp(target, "/metrics") != 0 && strcmp(target, "http://localhost/metrics") != 0) {
		error_reply(c, 404, "Not Found", "", "zoffloadd serves /metrics only\n");
		return;
	}
	if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
		error_reply(c, 405, "Method Not Allowed", "Allow: GET, HEAD\r\n",
		    "only GET and HEAD\n");
		return;
	}
	/* Nothing is read past the headers: a body is refused, never buffered. */
	if (has_header(headers, "content-length:") || has_header(headers, "transfer-encoding:")) {
		error_reply(c, 413, "Content Too Large", "", "/metrics takes no request body\n");
		return;
	}
	metrics_reply(c, strcmp(method, "HEAD") == 0);
}

static void
start_reply(struct mconn *c)
{
	if (c->out == NULL) {
		conn_close(c);
		return;
	}
	event_del(c->ev_read);
	event_active(c->ev_write, EV_WRITE, 0);
}

/* Reads what there is; descriptors sent on a Unix socket go to the closer. */
static ssize_t
conn_recv(struct mconn *c, void *buf, size_t len)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * ZP_RECV_ALL_FDS)];
	} control;
	struct iovec iov = { .iov_base = buf, .iov_len = len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
		.msg_controllen = sizeof(control.buf) };
	ssize_t n;

	n = recvmsg(c->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
	for (struct cmsghdr *h = CMSG_FIRSTHDR(&mh); n >= 0 && h != NULL;
	    h = CMSG_NXTHDR(&mh, h)) {
		size_t count = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		int fd;

		if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS)
			continue;
		for (size_t i = 0; i < count; i++) {
			memcpy(&fd, CMSG_DATA(h) + i * sizeof(int), sizeof(int));
			zd_closer_close(c->m->d, c->uid, fd, ZD_CLOSE_UNCHARGED);
		}
	}
	return n;
}

static void
read_cb(evutil_socket_t fd, short what, void *arg)
{
	struct mconn *c = arg;
	char drop[4096];
	ssize_t n;

	if (c->lingering) {
		n = conn_recv(c, drop, sizeof(drop));
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			return;
		c->dropped += n > 0 ? (size_t)n : 0;
		if (n <= 0 || c->dropped > LINGER_MAX)
			conn_close(c);
		return;
	}
	n = conn_recv(c, c->in + c->inlen, sizeof(c->in) - 1 - c->inlen);
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	if (n <= 0) {
		conn_close(c);
		return;
	}
	c->inlen += (size_t)n;
	c->in[c->inlen] = '\0';
	if (strstr(c->in, "\r\n\r\n") != NULL || strstr(c->in, "\n\n") != NULL)
		answer(c);
	else if (c->inlen == sizeof(c->in) - 1)
		error_reply(c, 400, "Bad Request", "", "request headers over 16 KiB\n");
	else if (memchr(c->in, '\0', c->inlen) != NULL)
		error_reply(c, 400, "Bad Request", "", "a NUL byte in the request\n");
	else
		return;
	start_reply(c);
}

static void
write_cb(evutil_socket_t fd, short what, void *arg)
{
	struct mconn *c = arg;
	ssize_t n;

	while (c->outoff < c->outlen) {
		n = send(c->fd, c->out + c->outoff, c->outlen - c->outoff, MSG_NOSIGNAL |
		    MSG_DONTWAIT);
		if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
			event_add(c->ev_write, NULL);
			return;
		}
		if (n <= 0) {
			conn_close(c);
			return;
		}
		c->outoff += (size_t)n;
	}
	event_del(c->ev_write);
	/* Said all: read what the peer still sends until it closes, so it gets the reply. */
	(void)shutdown(c->fd, SHUT_WR);
	c->lingering = true;
	event_add(c->ev_read, NULL);
}

static void
deadline_cb(evutil_socket_t fd, short what, void *arg)
{
	conn_close(arg);
}

/*
 * The uid behind a loopback TCP peer: its socket is the one with the peer's address as
 * its source and ours as its destination (sock_diag).  (uid_t)-1 when it cannot be told.
 */
static uid_t
tcp_peer_uid(int fd)
{
	struct sockaddr_storage local, peer;
	socklen_t ll = sizeof(local), pl = sizeof(peer);
	struct {
		struct nlmsghdr nlh;
		struct inet_diag_req_v2 req;
	} q;
	union {
		struct nlmsghdr nlh;
		char buf[1024];
	} a;
	uid_t uid = (uid_t)-1;
	struct inet_diag_msg *msg;
	int nl;
	ssize_t n;

	if (getsockname(fd, (struct sockaddr *)&local, &ll) != 0 ||
	    getpeername(fd, (struct sockaddr *)&peer, &pl) != 0)
		return uid;
	memset(&q, 0, sizeof(q));
	q.nlh.nlmsg_len = sizeof(q);
	q.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
	q.nlh.nlmsg_flags = NLM_F_REQUEST;
	q.req.sdiag_family = (uint8_t)peer.ss_family;
	q.req.sdiag_protocol = IPPROTO_TCP;
	q.req.idiag_states = ~0u;
	q.req.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
	q.req.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
	if (peer.ss_family == AF_INET) {
		const struct sockaddr_in *p = (void *)&peer, *l = (void *)&local;

		q.req.id.idiag_sport = p->sin_port;
		q.req.id.idiag_dport = l->sin_port;
		memcpy(q.req.id.idiag_src, &p->sin_addr, 4);
		memcpy(q.req.id.idiag_dst, &l->sin_addr, 4);
	} else if (peer.ss_family == AF_INET6) {
		const struct sockaddr_in6 *p = (void *)&peer, *l = (void *)&local;

		q.req.id.idiag_sport = p->sin6_port;
		q.req.id.idiag_dport = l->sin6_port;
		memcpy(q.req.id.idiag_src, &p->sin6_addr, 16);
		memcpy(q.req.id.idiag_dst, &l->sin6_addr, 16);
	} else {
		return uid;
	}
	nl = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
	if (nl < 0)
		return uid;
	if (send(nl, &q, sizeof(q), 0) == (ssize_t)sizeof(q) &&
	    (n = recv(nl, &a, sizeof(a), 0)) >= (ssize_t)NLMSG_LENGTH(sizeof(*msg)) &&
	    a.nlh.nlmsg_type == SOCK_DIAG_BY_FAMILY) {
		msg = NLMSG_DATA(&a.nlh);
		uid = (uid_t)msg->idiag_uid;
	}
	close(nl);
	return uid;
}

static uid_t
peer_uid(struct zd_metrics *m, int fd)
{
	struct ucred cred;
	socklen_t len = sizeof(cred);

	if (!m->tcp)
		return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 ? cred.uid :
		    (uid_t)-1;
	return tcp_peer_uid(fd);
}

/* Turned away: a 503 that says why, in one try, then the end (off the loop). */
static void
turn_away(struct zd_metrics *m, int fd, const char *why)
{
	char buf[256];
	int n;

	n = snprintf(buf, sizeof(buf), "HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
	    "text/plain; charset=utf-8\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n%s\n",
	    strlen(why) + 1, why);
	(void)!send(fd, buf, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
	zd_closer_close_socket(m->d, NULL, fd, ZD_CLOSE_CHARGED);
}

static void
accept_one(struct zd_metrics *m, int fd)
{
	struct timeval tv = { .tv_sec = DEADLINE_S };
	char why[ZP_ERRMSG_MAX + 1];
	struct zd_uid *u;
	struct mconn *c;
	uid_t uid;

	if (m->nconns >= MAX_CONNECTIONS) {
		turn_away(m, fd, "the metrics endpoint serves 32 connections at once");
		return;
	}
	uid = peer_uid(m, fd);
	u = zd_uid_get(m->d, uid);
	if (u == NULL) {
		turn_away(m, fd, "out of memory");
		return;
	}
	if (u->metrics_conns >= UID_CONNECTIONS) {
		snprintf(why, sizeof(why), "uid %d has %u metrics connections, the most one uid "
		    "may have", (int)uid, u->metrics_conns);
		turn_away(m, fd, why);
		zd_uid_put(m->d, u);
		return;
	}
	/* Its socket is one of the uid's descriptors, as a client's is. */
	if (zd_uid_charge(m->d, u, 1, 0, 0, why, sizeof(why)) < 0) {
		turn_away(m, fd, why);
		zd_uid_put(m->d, u);
		return;
	}
	c = calloc(1, sizeof(*c));
	if (c != NULL) {
		c->ev_read = event_new(m->d->base, fd, EV_READ | EV_PERSIST, read_cb, c);
		c->ev_write = event_new(m->d->base, fd, EV_WRITE, write_cb, c);
		c->ev_deadline = evtimer_new(m->d->base, deadline_cb, c);
	}
	if (c == NULL || c->ev_read == NULL || c->ev_write == NULL || c->ev_deadline == NULL ||
	    event_add(c->ev_read, NULL) != 0 || evtimer_add(c->ev_deadline, &tv) != 0) {
		if (c != NULL) {
			if (c->ev_read != NULL)
				event_free(c->ev_read);
			if (c->ev_write != NULL)
				event_free(c->ev_write);
			if (c->ev_deadline != NULL)
				event_free(c->ev_deadline);
			free(c);
		}
		zd_closer_close_socket(m->d, u, fd, ZD_CLOSE_CHARGED);
		zd_uid_put(m->d, u);
		return;
	}
	c->m = m;
	c->fd = fd;
	c->uid = u;
	u->metrics_conns++;
	TAILQ_INSERT_TAIL(&m->conns, c, entry);
	m->nconns++;
}

static void
accept_cb(evutil_socket_t lfd, short what, void *arg)
{
	struct zd_metrics *m = arg;

	for (int i = 0; i < 16; i++) {
		int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);

		if (fd < 0) {
			if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
				log_warn(errno, "metrics: accept");
			return;
		}
		accept_one(m, fd);
	}
}

/* A socket file left by a crash is removed; a live one, or a non-socket, is in the way. */
static int
bind_unix(struct zd_metrics *m, const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct stat st;
	int fd, r;

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	if (lstat(path, &st) == 0) {
		if (!S_ISSOCK(st.st_mode))
			return -EEXIST;
		fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (fd < 0)
			return -errno;
		r = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
		close(fd);
		if (r == 0)
			return -EADDRINUSE;
		if (unlink(path) != 0)
			return -errno;
	}
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
		r = -errno;
		close(fd);
		return r;
	}
	snprintf(m->unix_path, sizeof(m->unix_path), "%s", path);
	/* The socket's group and mode follow the control socket's: the same users may look. */
	if (m->d->cfg.socket_group != NULL) {
		struct group *g = getgrnam(m->d->cfg.socket_group);

		if (g == NULL || chown(path, (uid_t)-1, g->gr_gid) != 0) {
			r = g == NULL ? -ENOENT : -errno;
			close(fd);
			return r;
		}
	}
	if (chmod(path, m->d->cfg.socket_mode) != 0 || listen(fd, 16) != 0) {
		r = -errno;
		close(fd);
		return r;
	}
	m->listen_fd = fd;
	return 0;
}

static int
bind_tcp(struct zd_metrics *m, const struct zd_metrics_addr *a, unsigned *port)
{
	struct sockaddr_storage ss;
	socklen_t sl;
	int fd, one = 1, r;

	memset(&ss, 0, sizeof(ss));
	if (a->family == AF_INET6) {
		struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;

		s6->sin6_family = AF_INET6;
		s6->sin6_port = htons((uint16_t)a->port);
		(void)inet_pton(AF_INET6, a->host, &s6->sin6_addr);
		sl = sizeof(*s6);
	} else {
		struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;

		s4->sin_family = AF_INET;
		s4->sin_port = htons((uint16_t)a->port);
		(void)inet_pton(AF_INET, a->host, &s4->sin_addr);
		sl = sizeof(*s4);
	}
	fd = socket(a->family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	(void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(fd, (struct sockaddr *)&ss, sl) != 0 || listen(fd, 16) != 0) {
		r = -errno;
		close(fd);
		return r;
	}
	sl = sizeof(ss);
	*port = a->port;
	if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
		*port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port :
		    ((struct sockaddr_in *)&ss)->sin_port);
	m->listen_fd = fd;
	m->tcp = true;
	return 0;
}

int
zd_metrics_start(struct zd_daemon *d, struct event_base *base, struct zd_metrics **ret)
{
	struct zd_metrics_addr a;
	struct zd_metrics *m;
	char err[256];
	unsigned port = 0;
	int r;

	*ret = NULL;
	if (d->cfg.metrics_listen == NULL)
		return 0;
	r = zd_metrics_parse_listen(d->cfg.metrics_listen, &a, err, sizeof(err));
	if (r < 0) {
		log_errorx("metrics.listen: %s", err);
		return r;
	}
	m = calloc(1, sizeof(*m));
	if (m == NULL)
		return -ENOMEM;
	m->d = d;
	m->listen_fd = -1;
	TAILQ_INIT(&m->conns);
	r = a.family == AF_UNIX ? bind_unix(m, a.path) : bind_tcp(m, &a, &port);
	if (r < 0) {
		log_error(r, "metrics.listen: cannot listen on %s", d->cfg.metrics_listen);
		goto fail;
	}
	m->ev_listen = event_new(base, m->listen_fd, EV_READ | EV_PERSIST, accept_cb, m);
	if (m->ev_listen == NULL || event_add(m->ev_listen, NULL) != 0) {
		r = -ENOMEM;
		goto fail;
	}
	if (a.family == AF_UNIX)
		log_info("metrics: serving http://localhost/metrics on Unix socket %s", a.path);
	else
		log_info("metrics: serving http://%s%s%s:%u/metrics", a.family == AF_INET6 ? "[" : "",
		    a.host, a.family == AF_INET6 ? "]" : "", port);
	*ret = m;
	return 0;
fail:
	zd_metrics_free(m);
	return r;
}

void
zd_metrics_free(struct zd_metrics *m)
{
	if (m == NULL)
		return;
	while (!TAILQ_EMPTY(&m->conns))
		conn_close(TAILQ_FIRST(&m->conns));
	if (m->ev_listen != NULL)
		event_free(m->ev_listen);
	if (m->listen_fd >= 0)
		close(m->listen_fd);
	if (m->unix_path[0] != '\0')
		unlink(m->unix_path);
	free(m);
}
