/* The metrics endpoint: libevent's evhttp serving GET /metrics on a Unix socket or loopback port. */
#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"
#include "metrics.h"

/*
 * Ownership: http owns its listening sockets (evhttp closes them);
 * unix_path is set only once this daemon made the socket file, so that
 * zd_metrics_free never removes someone else's.
 */
struct zd_metrics {
	struct zd_daemon *d;
	struct evhttp *http;
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

static void
metrics_cb(struct evhttp_request *req, void *arg)
{
	struct zd_metrics *m = arg;
	struct evbuffer *body = NULL;
	cJSON *tree = NULL;
	char *text = NULL;
	size_t len = 0;

	if (evhttp_request_get_command(req) != EVHTTP_REQ_GET &&
	    evhttp_request_get_command(req) != EVHTTP_REQ_HEAD) {
		evhttp_send_error(req, 405, "only GET and HEAD");
		return;
	}
	tree = zd_stats_tree(m->d);
	if (tree != NULL)
		text = zd_metrics_render(tree, m->d->cfg.metrics_max_jobs, &len);
	body = evbuffer_new();
	if (text == NULL || body == NULL || evbuffer_add(body, text, len) != 0) {
		evhttp_send_error(req, HTTP_INTERNAL, "out of memory");
		goto out;
	}
	evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
	    "text/plain; version=0.0.4; charset=utf-8");
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
	evhttp_send_error(req, HTTP_NOTFOUND, "zoffloadd serves /metrics only");
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
	if (chmod(path, m->d->cfg.socket_mode) != 0 || listen(fd, 16) != 0 ||
	    evhttp_accept_socket(m->http, fd) != 0) {
		r = errno != 0 ? -errno : -ENOMEM;
		close(fd);
		return r;
	}
	return 0;
}

static int
bind_tcp(struct zd_metrics *m, const struct zd_metrics_addr *a, unsigned *port)
{
	struct evhttp_bound_socket *bs;
	struct sockaddr_storage ss;
	socklen_t sl = sizeof(ss);

	bs = evhttp_bind_socket_with_handle(m->http, a->host, (uint16_t)a->port);
	if (bs == NULL)
		return errno != 0 ? -errno : -EADDRNOTAVAIL;
	*port = a->port;
	if (getsockname(evhttp_bound_socket_get_fd(bs), (struct sockaddr *)&ss, &sl) == 0)
		*port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port :
		    ((struct sockaddr_in *)&ss)->sin_port);
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
	m->http = evhttp_new(base);
	if (m->http == NULL) {
		free(m);
		return -ENOMEM;
	}
	/* A scraper that stalls does not hold a connection for ever. */
	evhttp_set_timeout(m->http, 30);
	evhttp_set_max_headers_size(m->http, 16384);
	if (evhttp_set_cb(m->http, "/metrics", metrics_cb, m) != 0) {
		r = -ENOMEM;
		goto fail;
	}
	evhttp_set_gencb(m->http, other_cb, m);
	errno = 0;
	r = a.family == AF_UNIX ? bind_unix(m, a.path) : bind_tcp(m, &a, &port);
	if (r < 0) {
		log_error(r, "metrics.listen: cannot listen on %s", d->cfg.metrics_listen);
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
	evhttp_free(m->http);
	if (m->unix_path[0] != '\0')
		unlink(m->unix_path);
	free(m);
}
