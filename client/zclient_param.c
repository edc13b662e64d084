/* libzclient's parameter offload: prefetch, wait for, and release param slots; their statistics. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "zclient.h"
#include "zclient_impl.h"

static int
handles_request(struct zc_conn *c, uint16_t type, struct zc_tensor *const *tensors, size_t n,
    struct zp_msg **ret)
{
	struct zp_msg *m;

	if (n == 0 || n > ZP_MAX_STEP_TENSORS)
		return zci_seterr(c, -EINVAL, "1 to %d tensors, not %zu", ZP_MAX_STEP_TENSORS, n);
	for (size_t i = 0; i < n; i++) {
		if (tensors[i] == NULL || tensors[i]->conn != c)
			return zci_seterr(c, -EINVAL, "tensor %zu does not belong to this connection", i);
		if (tensors[i]->pending)
			return zci_seterr(c, -EBUSY, "tensor %zu is in a step; wait for it first", i);
	}
	m = calloc(1, sizeof(*m));
	if (m == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	m->hdr.type = type;
	m->u.handles.count = (uint32_t)n;
	for (size_t i = 0; i < n; i++)
		m->u.handles.handles[i] = tensors[i]->handle;
	*ret = m;
	return 0;
}

/* zc_param_prefetch with the send bounded by `deadline` (a wait's own, from zc_param_wait). */
static int
prefetch(struct zc_conn *c, struct zc_tensor *const *tensors, size_t n, uint64_t deadline)
{
	struct zp_msg *m = NULL;
	int r = handles_request(c, ZP_PARAM_FETCH, tensors, n, &m);

	if (r < 0)
		return r;
	/* Only what is not in its slot yet; READY events arrive as the daemon stages them. */
	m->u.handles.count = 0;
	for (size_t i = 0; i < n; i++) {
		if (tensors[i]->param_state != PARAM_RELEASED)
			continue;
		m->u.handles.handles[m->u.handles.count++] = tensors[i]->handle;
	}
	r = m->u.handles.count > 0 ? zci_send_msg(c, m, deadline, -1) : 0;
	/*
	 * Fetching once sent, not before: a tensor left fetching with no request
	 * sent would have zc_param_wait wait for it forever, and a reconnect
	 * during the send asks for those being fetched itself (then this goes
	 * again).  No READY can come before: the send only drains before it.
	 */
	for (uint32_t i = 0; r == 0 && i < m->u.handles.count; i++) {
		struct zc_tensor *t = zci_tensor_by_handle(c, m->u.handles.handles[i]);

		if (t != NULL && t->param_state == PARAM_RELEASED)
			t->param_state = PARAM_FETCHING;
	}
	free(m);
	return r;
}

int
zc_param_prefetch(struct zc_conn *c, struct zc_tensor *const *tensors, size_t n)
{
	return prefetch(c, tensors, n, zci_deadline_after(c->timeout_ms));
}

static bool
param_arrived(void *arg)
{
	return ((struct zc_tensor *)arg)->param_state != PARAM_FETCHING;
}

int
zc_param_wait(struct zc_tensor *t)
{
	return zc_param_wait_timeout(t, -1);
}

int
zc_param_wait_timeout(struct zc_tensor *t, int timeout_ms)
{
	struct zc_conn *c = t->conn;
	uint64_t t0, deadline = zci_deadline_after(timeout_ms);
	int r;

	/* A READY already in the socket means the params are there: ready, no waiting. */
	if (t->param_state == PARAM_FETCHING) {
		r = zci_drain(c);
		/* Gone: the wait below reconnects (and asks again). */
		if (r < 0 && !c->lost)
			return r;
	}
	if (t->param_state == PARAM_RESIDENT) {
		/* The end of a wait that timed out before is not a new ready one. */
		if (!t->param_waited)
			c->param_stats.ready++;
		t->param_waited = false;
		return 0;
	}
	/* One per wait, however many timed-out calls (or polls) it takes. */
	if (!t->param_waited)
		c->param_stats.waited++;
	t->param_waited = true;
	t0 = zci_now_ns();
	if (t->param_state == PARAM_RELEASED) {
		r = prefetch(c, &t, 1, deadline);
		if (r < 0)
			return r;
	}
	r = zci_wait_until(c, param_arrived, t, deadline);
	c->param_stats.wait_ns += zci_now_ns() - t0;
	if (r == -ETIMEDOUT)
		return zci_seterr(c, r, "the params are not back after %d ms (the fetch goes on; wait "
		    "again)", timeout_ms);
	if (r < 0)
		return r;
	t->param_waited = false;
	if (t->param_state != PARAM_RESIDENT)
		return zci_seterr(c, t->param_error < 0 ? t->param_error : -EIO,
		    "staging the params failed: %s", strerror(-t->param_error));
	return 0;
}

int
zc_param_release(struct zc_conn *c, struct zc_tensor *const *tensors, size_t n)
{
	struct zp_msg *m = NULL;
	int r = handles_request(c, ZP_PARAM_RELEASE, tensors, n, &m);

	if (r < 0)
		return r;
	for (size_t i = 0; i < n; i++) {
		if (tensors[i]->param_state == PARAM_FETCHING) {
			free(m);
			return zci_seterr(c, -EBUSY, "tensor %zu is being fetched; wait for it first", i);
		}
	}
	/*
	 * The daemon drops the pages of every offloaded slot it releases and
	 * refills it with new ones: a driver must let go of the old pages first.
	 * A failed unpin releases nothing (those already unpinned stay so).
	 */
	for (size_t i = 0; i < n; i++) {
		struct zc_tensor *t = tensors[i];

		if (!t->param_offload || t->param_state != PARAM_RESIDENT || t->unpin == NULL)
			continue;
		r = t->unpin(t, t->unpin_arg);
		if (r < 0) {
			free(m);
			return zci_seterr(c, r, "tensor %zu: cannot unpin its param slot before the "
			    "release: %s", i, strerror(-r));
		}
		t->unpin = NULL;
		t->unpin_arg = NULL;
	}
	r = zci_rpc(c, m, ZP_OK, NULL);
	free(m);
	if (r < 0)
		return r;
	for (size_t i = 0; i < n; i++)
		if (tensors[i]->param_offload)
			tensors[i]->param_state = PARAM_RELEASED;
	return 0;
}

void
zc_param_stats(const struct zc_conn *c, struct zc_param_stats *ret)
{
	*ret = c->param_stats;
}
