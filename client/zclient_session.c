/* libzclient's connection: connect and disconnect, jobs, ping and the daemon's JSON reports. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "build_config.h"
#include "msgio.h"
#include "zclient.h"
#include "zclient_connerr.h"
#include "zclient_impl.h"

/*
 * Who takes what the transport (zclient.c) and the reconnect hand upward:
 * this file sits above all of them, so none of those below calls the one
 * above it.
 */
static const struct zci_hooks hooks = {
	.tensor_done = zci_tensor_done,
	.step_done = zci_sets_step_done,
	.param_ready = zci_tensor_param_ready,
	.set_pending = zci_sets_pending,
	.lost = zci_lost,
	.closed_by_daemon = zci_closed_by_daemon,
	.slots_event = zci_tensor_slots_event,
	.sets_rehandle = zci_sets_rehandle,
	.sets_resubmit = zci_sets_resubmit,
};

int
zc_connect(const char *socket_path, struct zc_conn **ret)
{
	return zc_connect_timeout(socket_path, -1, ret);
}

/* Non-blocking connect: a listener with a full backlog says EAGAIN; try again until the deadline. */
static int
connect_deadline(int fd, const struct sockaddr_un *sa, uint64_t deadline)
{
	useconds_t pause_us = 1000;

	for (;;) {
		if (connect(fd, (const struct sockaddr *)sa, sizeof(*sa)) == 0)
			return 0;
		if (errno != EAGAIN && errno != EINTR)
			return -errno;
		if (deadline != ZCI_NO_DEADLINE && zci_now_ns() >= deadline)
			return -ETIMEDOUT;
		usleep(pause_us);
		pause_us = pause_us < 50000 ? pause_us * 2 : pause_us;
	}
}

int
zc_connect_timeout(const char *socket_path, int timeout_ms, struct zc_conn **ret)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct zp_msg hello = { .hdr = { .type = ZP_HELLO } };
	struct zc_conn *c;
	const char *path = socket_path;
	int reconnect_ms, r;

	if (path == NULL)
		path = getenv("ZOFFLOAD_SOCKET");
	if (path == NULL || path[0] == '\0')
		path = ZOFFLOAD_DEFAULT_SOCKET;
	r = zci_reconnect_default(&reconnect_ms);
	if (r < 0)
		return r;
	if (strlen(path) >= sizeof(sa.sun_path))
		return zcl_connect_fail(-ENAMETOOLONG, "socket path of %zu bytes, at most %zu: %s",
		    strlen(path), sizeof(sa.sun_path) - 1, path);
	if (timeout_ms == 0)
		return zcl_connect_fail(-EINVAL, "timeout 0 ms: -1 waits without bound, a "
		    "positive timeout is in milliseconds");
	c = calloc(1, sizeof(*c));
	if (c == NULL)
		return zcl_connect_fail(-ENOMEM, "no memory for a connection");
	c->hooks = &hooks;
	c->timeout_ms = timeout_ms < 0 ? -1 : timeout_ms;
	c->pagemap_fd = -1;
	c->uffd = -1;
	/* No reconnect during HELLO: a connect that fails says so. */
	c->reconnect_ms = 0;
	memcpy(c->path, path, strlen(path) + 1);
	c->buf = malloc(ZP_MAX_MESSAGE);
	c->msg = malloc(sizeof(*c->msg));
	if (c->buf == NULL || c->msg == NULL) {
		r = zcl_connect_fail(-ENOMEM, "no memory for a connection");
		goto fail;
	}
	c->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (c->fd < 0) {
		r = zcl_connect_fail(-errno, "socket(AF_UNIX, SOCK_SEQPACKET): %s", strerror(errno));
		goto fail;
	}
	memcpy(sa.sun_path, path, strlen(path));
	r = connect_deadline(c->fd, &sa, zci_deadline_after(c->timeout_ms));
	if (r < 0) {
		close(c->fd);
		zcl_connect_refused(r, path);
		goto fail;
	}
	snprintf(hello.u.hello.client_name, sizeof(hello.u.hello.client_name), "pid %d",
	    (int)getpid());
	r = zci_rpc(c, &hello, ZP_HELLO_OK, NULL);
	if (r < 0) {
		/* The connection and its message go; the daemon's reason (a limit) stays. */
		zcl_connect_fail(r, "zoffloadd at %s: %s", path,
		    c->err[0] != '\0' ? c->err : strerror(-r));
		close(c->fd);
		goto fail;
	}
	c->session_id = c->msg->u.hello_ok.session_id;
	c->reconnect_ms = reconnect_ms;
	zcl_connect_ok();
	*ret = c;
	return 0;
fail:
	free(c->buf);
	free(c->msg);
	free(c);
	return r;
}

void
zc_disconnect(struct zc_conn *c)
{
	if (c == NULL)
		return;
	close(c->fd);
	for (uint32_t i = 0; i < c->tensor_cap; i++)
		if (c->tensors[i] != NULL)
			zci_tensor_unmap(c->tensors[i]);
	zci_view_close(c);
	zci_sets_free(c);
	if (c->xfer != NULL)
		munmap(c->xfer, c->xfer_bytes);
	free(c->tensors);
	free(c->buf);
	free(c->msg);
	free(c);
}

static int
job_open(struct zc_conn *c, const char *job_name, uint32_t rank, uint32_t world_size,
    enum zc_policy policy, uint64_t pinned_budget, const char *state_format)
{
	struct zp_msg m = { .hdr = { .type = ZP_JOB_OPEN } };
	int r;

	if ((unsigned)policy > ZC_POLICY_AUTO)
		return zci_seterr(c, -EINVAL, "unknown policy %d", (int)policy);
	m.u.job_open.policy = (uint8_t)policy;
	m.u.job_open.pinned_budget = pinned_budget;
	if (state_format != NULL && strlen(state_format) > ZP_FORMAT_MAX)
		return zci_seterr(c, -EINVAL, "unknown state format '%.*s...'", ZP_FORMAT_MAX,
		    state_format);
	if (state_format != NULL)
		snprintf(m.u.job_open.state_format, sizeof(m.u.job_open.state_format), "%s",
		    state_format);
	if (job_name == NULL || strlen(job_name) == 0 || strlen(job_name) > ZP_NAME_MAX)
		return zci_seterr(c, -EINVAL, "job name must be 1 to %d bytes", ZP_NAME_MAX);
	snprintf(m.u.job_open.job_name, sizeof(m.u.job_open.job_name), "%s", job_name);
	m.u.job_open.rank = rank;
	m.u.job_open.world_size = world_size;
	if (world_size == 0 || rank >= world_size)
		return zci_seterr(c, -EINVAL, "rank %u is not below world size %u", rank, world_size);
	r = zci_rpc(c, &m, ZP_JOB_OK, NULL);
	if (r == 0) {
		c->job_open = true;
		snprintf(c->job_name, sizeof(c->job_name), "%s", job_name);
		/* What a reconnect asks for again; the format is the one the daemon chose. */
		c->job_opts = (struct zc_job_options){ .policy = policy,
		    .pinned_budget = pinned_budget };
		c->rank = rank;
		c->world_size = world_size;
		c->job_last_step = c->msg->u.job_ok.last_step;
		snprintf(c->state_format, sizeof(c->state_format), "%s",
		    c->msg->u.job_ok.state_format);
	}
	return r;
}

int
zc_job_open(struct zc_conn *c, const char *job_name, uint32_t rank, uint32_t world_size)
{
	return job_open(c, job_name, rank, world_size, ZC_POLICY_DEFAULT, 0, NULL);
}

/*
 * zc_job_open_opts grew state_format in ZCLIENT_0.2.  Programs linked
 * against 0.1 pass the struct without it and get zc_job_open_opts@ZCLIENT_0.1,
 * which reads the two fields they have; new ones bind the default version.
 * The definitions have internal names (local in zclient.map) and are exported
 * only through these aliases.
 */
struct zc_job_options_v01 {
	enum zc_policy policy;
	uint64_t pinned_budget;
};

ZC_API int zci_job_open_opts_v01(struct zc_conn *c, const char *job_name, uint32_t rank,
    uint32_t world_size, const struct zc_job_options_v01 *opts);
ZC_API int zci_job_open_opts_v02(struct zc_conn *c, const char *job_name, uint32_t rank,
    uint32_t world_size, const struct zc_job_options *opts);
__asm__(".symver zci_job_open_opts_v01, zc_job_open_opts@ZCLIENT_0.1");
__asm__(".symver zci_job_open_opts_v02, zc_job_open_opts@@ZCLIENT_0.2");

int
zci_job_open_opts_v01(struct zc_conn *c, const char *job_name, uint32_t rank,
    uint32_t world_size, const struct zc_job_options_v01 *opts)
{
	return job_open(c, job_name, rank, world_size, opts != NULL ? opts->policy :
	    ZC_POLICY_DEFAULT, opts != NULL ? opts->pinned_budget : 0, NULL);
}

int
zci_job_open_opts_v02(struct zc_conn *c, const char *job_name, uint32_t rank,
    uint32_t world_size, const struct zc_job_options *opts)
{
	if (opts == NULL)
		return job_open(c, job_name, rank, world_size, ZC_POLICY_DEFAULT, 0, NULL);
	return job_open(c, job_name, rank, world_size, opts->policy, opts->pinned_budget,
	    opts->state_format);
}

const char *
zc_job_state_format(const struct zc_conn *c)
{
	return c->job_open ? c->state_format : "";
}

uint64_t
zc_job_last_step(const struct zc_conn *c)
{
	return c->job_last_step;
}

int
zc_job_drop(struct zc_conn *c, const char *job_name)
{
	struct zp_msg m = { .hdr = { .type = ZP_JOB_DROP } };

	if (job_name == NULL || strlen(job_name) == 0 || strlen(job_name) > ZP_NAME_MAX)
		return zci_seterr(c, -EINVAL, "job name must be 1 to %d bytes", ZP_NAME_MAX);
	snprintf(m.u.job_drop.job_name, sizeof(m.u.job_drop.job_name), "%s", job_name);
	return zci_rpc(c, &m, ZP_OK, NULL);
}

int
zc_job_close(struct zc_conn *c)
{
	struct zp_msg m = { .hdr = { .type = ZP_JOB_CLOSE } };
	int r;

	r = zci_rpc(c, &m, ZP_OK, NULL);
	if (r < 0)
		return r;
	c->job_open = false;
	/* The daemon freed this rank's tensors. */
	for (uint32_t i = 0; i < c->tensor_cap; i++) {
		if (c->tensors[i] != NULL) {
			zci_tensor_unmap(c->tensors[i]);
			c->tensors[i] = NULL;
		}
	}
	return 0;
}

int
zc_ping(struct zc_conn *c, uint64_t *ret_rtt_ns)
{
	struct zp_msg m = { .hdr = { .type = ZP_PING } };
	uint64_t t0 = zci_now_ns();
	int r;

	r = zci_rpc(c, &m, ZP_PONG, NULL);
	if (r == 0 && ret_rtt_ns != NULL)
		*ret_rtt_ns = zci_now_ns() - t0;
	return r;
}

/* A reply too large for a datagram comes as a memfd holding the text. */
static int
json_from_fd(struct zc_conn *c, int fd, uint64_t bytes, char **ret)
{
	struct stat st;
	char *text;
	void *map;

	if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < bytes) {
		close(fd);
		return zci_seterr(c, -EBADMSG, "zoffloadd's reply of %llu bytes came in a smaller file",
		    (unsigned long long)bytes);
	}
	map = mmap(NULL, (size_t)bytes, PROT_READ, MAP_SHARED, fd, 0);
	close(fd);
	if (map == MAP_FAILED)
		return zci_seterr(c, -errno, "cannot map zoffloadd's reply: %s", strerror(errno));
	text = malloc((size_t)bytes + 1);
	if (text != NULL) {
		memcpy(text, map, (size_t)bytes);
		text[bytes] = '\0';
	}
	munmap(map, (size_t)bytes);
	if (text == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	*ret = text;
	return 0;
}

static int
json_request(struct zc_conn *c, uint16_t type, char **ret)
{
	struct zp_msg m = { .hdr = { .type = type } };
	int fds[ZP_MAX_FDS];
	char *text;
	int r;

	r = zci_rpc_either(c, &m, ZP_JSON, ZP_JSON_FD, fds);
	if (r < 0)
		return r;
	if (c->msg->hdr.type == ZP_JSON_FD)
		return json_from_fd(c, fds[0], c->msg->u.json_fd.bytes, ret);
	text = malloc(c->msg->u.json.len + 1);
	if (text == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	memcpy(text, c->msg->u.json.text, c->msg->u.json.len);
	text[c->msg->u.json.len] = '\0';
	*ret = text;
	return 0;
}

int
zc_stats_json(struct zc_conn *c, char **ret)
{
	return json_request(c, ZP_STATS, ret);
}

int
zc_jobs_json(struct zc_conn *c, char **ret)
{
	return json_request(c, ZP_JOBS, ret);
}

