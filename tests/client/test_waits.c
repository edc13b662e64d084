/* Client waits against a daemon that fails or stops answering: nothing is left waiting for ever. */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "itd.h"
#include "relay.h"

static struct itd daemon_;
static struct relay relay_;

static void
setup(void)
{
	itd_start(&daemon_, NULL);
}

static void
teardown(void)
{
	relay_stop(&relay_);
	if (daemon_.pid > 0)
		kill(daemon_.pid, SIGCONT);
	itd_cleanup(&daemon_);
}

TestSuite(waits, .init = setup, .fini = teardown, .timeout = 60);

#define NUMEL 1000

static struct zc_tensor *
register_offloaded(struct zc_conn *c, const char *name)
{
	struct zc_tensor_desc desc = { .name = name, .numel = NUMEL, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16, .param_offload = true };
	static float init[NUMEL];
	struct zc_tensor *t = NULL;

	for (size_t i = 0; i < NUMEL; i++)
		init[i] = (float)i / NUMEL;
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "register %s: %s", name,
	    zc_errmsg(c));
	return t;
}

/*
 * A prefetch whose request cannot be sent must leave the tensor released:
 * marked as being fetched, zc_param_wait would wait for an answer to a
 * request the daemon never got.  Here the connection stays up (the relay
 * still passes the daemon's messages) but the client's sends fail.
 */
Test(waits, failed_prefetch_is_not_left_fetching)
{
	char path[160];
	struct zc_conn *c = NULL;
	struct zc_tensor *t;
	int r;

	snprintf(path, sizeof(path), "%s/relay.sock", daemon_.dir);
	relay_start(&relay_, path, daemon_.socket);
	cr_assert_eq(zc_connect(path, &c), 0, "connect through the relay");
	cr_assert_eq(zc_job_open(c, "cut", 0, 1), 0, "%s", zc_errmsg(c));
	t = register_offloaded(c, "w");
	cr_assert_eq(zc_param_release(c, &t, 1), 0, "%s", zc_errmsg(c));

	relay_cut_requests(&relay_);
	r = zc_param_prefetch(c, &t, 1);
	cr_assert_eq(r, -EPIPE, "prefetch over a cut connection gave %d (%s)", r, zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "send PARAM_FETCH") != NULL, "%s", zc_errmsg(c));
	/* Still released: the wait asks again, and that send fails the same way. */
	r = zc_param_wait(t);
	cr_assert_eq(r, -EPIPE, "wait after a failed prefetch gave %d (%s)", r, zc_errmsg(c));
	zc_disconnect(c);
}
