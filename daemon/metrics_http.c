/*
 * The metrics endpoint: libevent's evhttp serving GET /metrics on a Unix socket or a
 * loopback port, with what evhttp 2.1 does not bound put in front of it: each connection
 * is tracked from the bufferevent we make for it (evhttp_set_bevcb), admitted against a
 * cap in all and per uid and charged to its uid's descriptors, and cut off DEADLINE_S
 * after accept however slowly it sends (evhttp times each read, not the request).
 */
#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <grp.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"
#include "metrics.h"
#include "proto.h"
#include "uid.h"

struct mconn;

/*
 * Owns http (which owns the listening socket once evhttp_accept_socket took it, and its
 * connections) and the trackers of those connections; unix_path is set only once this
 * daemon made the socket file, so that zd_metrics_free never removes someone else's.
 */
struct zd_metrics {
	struct zd_daemon *d;
	struct evhttp *http;
	int listen_fd;			/* ours until evhttp takes it */
	bool tcp;
	TAILQ_HEAD(, mconn) conns;	/* admitted, and made but not yet admitted */
	unsigned nconns;		/* admitted */
	char unix_path[108];
};


/* Headers and request line; past this evhttp answers 400. */
#define HEADER_MAX 16384
/* GET and HEAD have no body: with 0, evhttp answers any body 413 before reading it. */
#define BODY_MAX 0
/*
 * From accept to the connection's end: a peer that sends a byte now and then (slowloris)
 * is cut off here, not after each read.
 */
#define DEADLINE_S 10
/* Connections at once, and per uid: past them a connection gets a 503 and goes. */
#define MAX_CONNECTIONS 32
#define UID_CONNECTIONS 4
#ifndef SO_PASSRIGHTS
#define SO_PASSRIGHTS 83	/* Linux 6.16; not yet in every libc's headers */
#endif

/*
 * One connection, from the bufferevent we made for evhttp to its end.  It holds a
 * reference on bev: a bufferevent made with BEV_OPT_CLOSE_ON_FREE closes its fd only at its
 * last reference, so the fd stays this connection's (never closed and reused by another)
 * for as long as we may shutdown() it.  Once admitted it also holds one descriptor charged
 * to uid and a place in m->nconns.  evcon is set at the first request, whose close
 * callback then releases the tracker as evhttp frees the connection; until then (or if
 * evhttp frees it before any request) the deadline does.  Released exactly once
 * (conn_release), by whichever comes first: refusal, close callback, deadline, shutdown.
 */
struct mconn {
	TAILQ_ENTRY(mconn) entry;
	struct zd_metrics *m;
	struct bufferevent *bev;
	struct evhttp_connection *evcon;
	struct zd_uid *uid;		/* NULL until admitted */
	struct event *ev_admit, *ev_deadline;
};

static void
conn_release(struct mconn *c)
{
	struct zd_metrics *m = c->m;

	if (c->evcon != NULL)
		evhttp_connection_set_closecb(c->evcon, NULL, NULL);
	if (c->uid != NULL) {
		m->nconns--;
		c->uid->metrics_conns--;
		zd_uid_refund(m->d, c->uid, 1, 0, 0);
		zd_uid_put(m->d, c->uid);
	}
	event_free(c->ev_admit);
	event_free(c->ev_deadline);
	TAILQ_REMOVE(&m->conns, c, entry);
	/* The last reference when evhttp is done with it: the fd is closed now. */
	bufferevent_decref(c->bev);
	free(c);
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


/*
 * Admits c's connection, or says in why which limit turns it away.  Its socket is one of
 * its uid's descriptors, as a client's is.
 */
static int
admit(struct mconn *c, char *why, size_t len)
{
	struct zd_metrics *m = c->m;
	int fd = bufferevent_getfd(c->bev);
	struct zd_uid *u;
	uid_t uid;

	if (fd < 0) {
		/* evhttp gave up on it before handing it its socket. */
		snprintf(why, len, "the connection has no socket");
		return -1;
	}
	if (m->nconns >= MAX_CONNECTIONS) {
		snprintf(why, len, "the metrics endpoint serves %d connections at once",
		    MAX_CONNECTIONS);
		return -1;
	}
	uid = peer_uid(m, fd);
	u = zd_uid_get(m->d, uid);
	if (u == NULL) {
		snprintf(why, len, "out of memory");
		return -1;
	}
	if (u->metrics_conns >= UID_CONNECTIONS) {
		snprintf(why, len, "uid %d has %u metrics connections, the most one uid may have",
		    (int)uid, u->metrics_conns);
	} else if (zd_uid_charge(m->d, u, 1, 0, 0, why, len) == 0) {
		c->uid = u;
		u->metrics_conns++;
		m->nconns++;
		return 0;
	}
	zd_uid_put(m->d, u);
	return -1;
}

/*
 * Runs in the loop pass that accepted the connection, before evhttp can have read from it
 * (it is made active, not timed).  A refused one gets a 503 that says why, in one try;
 * shutdown makes evhttp read its end and free it, and our reference dropped, that closes
 * the fd.
 */
static void
admit_cb(evutil_socket_t unused, short what, void *arg)
{
	struct mconn *c = arg;
	char why[ZP_ERRMSG_MAX + 1], buf[ZP_ERRMSG_MAX + 160];
	int fd = bufferevent_getfd(c->bev), n;

	if (admit(c, why, sizeof(why)) == 0)
		return;
	if (fd >= 0) {
		n = snprintf(buf, sizeof(buf), "HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
		    "text/plain; charset=utf-8\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n"
		    "%s\n", strlen(why) + 1, why);
		(void)!send(fd, buf, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
		(void)shutdown(fd, SHUT_RDWR);
	}
	conn_release(c);
}

/*
 * The deadline: shutdown ends evhttp's reads and writes, so it frees the connection (its
 * own timeout, DEADLINE_S per read or write, backs this); the charge goes now.
 */
static void
deadline_cb(evutil_socket_t unused, short what, void *arg)
{
	struct mconn *c = arg;
	int fd = bufferevent_getfd(c->bev);

	if (fd >= 0)
		(void)shutdown(fd, SHUT_RDWR);
	conn_release(c);
}

/* evhttp_set_bevcb: the connection's bufferevent, evhttp sets its fd right after. */
static struct bufferevent *
make_bev(struct event_base *base, void *arg)
{
	struct timeval tv = { .tv_sec = DEADLINE_S };
	struct zd_metrics *m = arg;
	struct bufferevent *bev;
	struct mconn *c;

	bev = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
	c = calloc(1, sizeof(*c));
	if (bev == NULL || c == NULL)
		goto untracked;
	/*
	 * Our reference keeps bev reading after evhttp freed its connection (a refused body,
	 * a bad request) until the deadline: it stops at this, one byte more than evhttp
	 * takes for a request's headers, so that evhttp still sees them overflow.
	 */
	bufferevent_setwatermark(bev, EV_READ, 0, HEADER_MAX + 1);
	c->ev_admit = event_new(base, -1, 0, admit_cb, c);
	c->ev_deadline = evtimer_new(base, deadline_cb, c);
	if (c->ev_admit == NULL || c->ev_deadline == NULL ||
	    evtimer_add(c->ev_deadline, &tv) != 0)
		goto untracked;
	c->m = m;
	c->bev = bev;
	bufferevent_incref(bev);
	TAILQ_INSERT_TAIL(&m->conns, c, entry);
	event_active(c->ev_admit, EV_TIMEOUT, 0);
	return bev;
untracked:
	/* A connection with no tracker is answered 503 (admitted() finds none). */
	if (c != NULL) {
		if (c->ev_admit != NULL)
			event_free(c->ev_admit);
		if (c->ev_deadline != NULL)
			event_free(c->ev_deadline);
		free(c);
	}
	return bev;
}

static void
conn_closed(struct evhttp_connection *evcon, void *arg)
{
	conn_release(arg);
}

/*
 * req's connection's tracker, admitted now if its admission has not run yet, and set to be
 * released when evhttp frees the connection; NULL once req was answered 503.
 */
static struct mconn *
admitted(struct zd_metrics *m, struct evhttp_request *req)
{
	struct evhttp_connection *evcon = evhttp_request_get_connection(req);
	struct bufferevent *bev = evhttp_connection_get_bufferevent(evcon);
	char why[ZP_ERRMSG_MAX + 1] = "the metrics endpoint did not admit this connection";
	struct mconn *c;

	TAILQ_FOREACH(c, &m->conns, entry)
		if (c->bev == bev)
			break;
	if (c != NULL && c->uid == NULL) {
		event_del(c->ev_admit);
		if (admit(c, why, sizeof(why)) < 0) {
			conn_release(c);
			c = NULL;
		}
	}
	if (c == NULL) {
		evhttp_send_error(req, 503, why);
		return NULL;
	}
	if (c->evcon == NULL) {
		c->evcon = evcon;
		evhttp_connection_set_closecb(evcon, conn_closed, c);
	}
	return c;
}

static void
metrics_cb(struct evhttp_request *req, void *arg)
{
	struct zd_metrics *m = arg;
	struct evbuffer *body = NULL;
	cJSON *tree = NULL;
	char *text = NULL, length[24];
	size_t len = 0;
	bool head;

	if (admitted(m, req) == NULL)
		return;
	/* evhttp would answer 501 (evhttp_set_allowed_methods); this method is known, not ours. */
	if (evhttp_request_get_command(req) != EVHTTP_REQ_GET &&
	    evhttp_request_get_command(req) != EVHTTP_REQ_HEAD) {
		evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", "GET, HEAD");
		evhttp_send_error(req, 405, "only GET and HEAD");
		return;
	}
	tree = zd_stats_tree(m->d);
	if (tree != NULL)
		text = zd_metrics_render(tree, m->d->cfg.metrics_max_jobs, &len);
	body = evbuffer_new();
	/* evhttp 2.1 would send a HEAD's body: it gets the length alone. */
	head = evhttp_request_get_command(req) == EVHTTP_REQ_HEAD;
	snprintf(length, sizeof(length), "%zu", len);
	if (text == NULL || body == NULL || (!head && evbuffer_add(body, text, len) != 0)) {
		evhttp_send_error(req, HTTP_INTERNAL, "out of memory");
		goto out;
	}
	evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
	    "text/plain; version=0.0.4; charset=utf-8");
	if (head)
		evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Length", length);
	/* One request per connection: its deadline is the request's. */
	evhttp_add_header(evhttp_request_get_output_headers(req), "Connection", "close");
	evhttp_send_reply(req, HTTP_OK, "OK", body);
out:
	if (body != NULL)
		evbuffer_free(body);
	free(text);
	cJSON_Delete(tree);
}

static void
other_cb(struct evhttp_request *req, void *arg)
{
	if (admitted(arg, req) != NULL)
		evhttp_send_error(req, HTTP_NOTFOUND, "zoffloadd serves /metrics only");
}

/* A socket file left by a crash is removed; a live one, or a non-socket, is in the way. */
static int
bind_unix(struct zd_metrics *m, const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct stat st;
	int fd, r, zero = 0;

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
	/*
	 * No descriptor may come with a request (the peer's sendmsg fails): evhttp's reads would
	 * drop it, and its last close on the event loop may take seconds.  Accepted sockets
	 * inherit this.  Kernels before 6.16 have no such option, and take them.
	 */
	(void)setsockopt(fd, SOL_SOCKET, SO_PASSRIGHTS, &zero, sizeof(zero));
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
	m->http = evhttp_new(base);
	if (m->http == NULL) {
		r = -ENOMEM;
		goto fail;
	}
	/* Per read or write; the deadline (DEADLINE_S from accept) is the tracker's. */
	evhttp_set_timeout(m->http, DEADLINE_S);
	evhttp_set_max_headers_size(m->http, HEADER_MAX);
	evhttp_set_max_body_size(m->http, BODY_MAX);
	/*
	 * evhttp's default methods (GET, HEAD, POST, PUT, DELETE) reach metrics_cb, which
	 * answers the last three 405; evhttp answers others 501.
	 */
	evhttp_set_bevcb(m->http, make_bev, m);
	if (evhttp_set_cb(m->http, "/metrics", metrics_cb, m) != 0) {
		r = -ENOMEM;
		goto fail;
	}
	evhttp_set_gencb(m->http, other_cb, m);
	r = a.family == AF_UNIX ? bind_unix(m, a.path) : bind_tcp(m, &a, &port);
	if (r < 0) {
		log_error(r, "metrics.listen: cannot listen on %s", d->cfg.metrics_listen);
		goto fail;
	}
	if (evhttp_accept_socket(m->http, m->listen_fd) != 0) {
		r = -ENOMEM;
		goto fail;
	}
	m->listen_fd = -1;
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
	/* Frees every connection: those with a request release their trackers on the way. */
	if (m->http != NULL)
		evhttp_free(m->http);
	while (!TAILQ_EMPTY(&m->conns))
		conn_release(TAILQ_FIRST(&m->conns));
	if (m->listen_fd >= 0)
		close(m->listen_fd);
	if (m->unix_path[0] != '\0')
		unlink(m->unix_path);
	free(m);
}
