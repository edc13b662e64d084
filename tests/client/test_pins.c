/* zc_param_release never lets the daemon drop pages a driver has pinned: the pin hook, driven without a GPU. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "itd.h"

static struct itd daemon_;

static void
setup(void)
{
	itd_start(&daemon_, NULL);
}

static void
teardown(void)
{
	itd_cleanup(&daemon_);
}

TestSuite(pins, .init = setup, .fini = teardown, .timeout = 60);

#define NUMEL 5000

static struct zc_tensor *
reg(struct zc_conn *c, const char *name, bool offload)
{
	struct zc_tensor_desc desc = { .name = name, .numel = NUMEL, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16, .param_offload = offload };
	static float init[NUMEL];
	struct zc_tensor *t = NULL;

	for (size_t i = 0; i < NUMEL; i++)
		init[i] = 1.0f + (float)i / NUMEL;
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "register %s: %s", name,
	    zc_errmsg(c));
	return t;
}

/*
 * What a driver would do (libzclient_cuda: wait for the copy, then
 * cudaHostUnregister), recorded: when it ran, the daemon must not yet have
 * released anything and the slot must still hold the parameters.
 */
struct fake_driver {
	struct zc_conn *observer;	/* another connection, to read the daemon's stats */
	int result;			/* what the unpin returns */
	unsigned unpins;
	double releases_seen;		/* the daemon's release count during the unpin */
	bool params_intact;
};

static bool
slot_holds_init(struct zc_tensor *t)
{
	const uint16_t *p = zc_tensor_param_slot(t, NULL);

	for (size_t i = 0; i < NUMEL; i++)
		if (p[i] != zc_f32_to_bf16(1.0f + (float)i / NUMEL))
			return false;
	return true;
}

static int
fake_unpin(struct zc_tensor *t, void *arg)
{
	struct fake_driver *fd = arg;

	fd->unpins++;
	fd->releases_seen = itd_stat(fd->observer, "pipeline.params.releases");
	fd->params_intact = slot_holds_init(t);
	return fd->result;
}

Test(pins, release_unpins_first)
{
	struct zc_conn *c = itd_connect(&daemon_);
	struct fake_driver drv = { .observer = itd_connect(&daemon_) };
	struct zc_tensor *t[2];

	cr_assert_eq(zc_job_open(c, "pins", 0, 1), 0, "%s", zc_errmsg(c));
	t[0] = reg(c, "offloaded", true);
	t[1] = reg(c, "resident", false);
	cr_assert_not(zc_tensor_param_pinned(t[0]));
	zc_tensor_set_param_pin(t[0], fake_unpin, &drv);
	zc_tensor_set_param_pin(t[1], fake_unpin, &drv);
	cr_assert(zc_tensor_param_pinned(t[0]));

	cr_assert_eq(zc_param_release(c, t, 2), 0, "%s", zc_errmsg(c));
	/* Once, for the slot the daemon drops; a tensor without param_offload keeps its pages. */
	cr_assert_eq(drv.unpins, 1, "unpinned %u times", drv.unpins);
	cr_assert_eq(drv.releases_seen, 0, "the daemon released before the unpin");
	cr_assert(drv.params_intact, "the slot's params were gone before the unpin");
	cr_assert_not(zc_tensor_param_pinned(t[0]));
	cr_assert(zc_tensor_param_pinned(t[1]));
	cr_assert_eq(itd_stat(drv.observer, "pipeline.params.releases"), 1);

	/* Back, and released again: nothing pinned it since, nothing to unpin. */
	cr_assert_eq(zc_param_wait(t[0]), 0, "%s", zc_errmsg(c));
	cr_assert(slot_holds_init(t[0]));
	cr_assert_eq(zc_param_release(c, t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(drv.unpins, 1);
	zc_disconnect(c);
	zc_disconnect(drv.observer);
}

/* An unpin that fails: nothing is released, the slot stays pinned, the error says why. */
Test(pins, failed_unpin_releases_nothing)
{
	struct zc_conn *c = itd_connect(&daemon_);
	struct fake_driver drv = { .observer = itd_connect(&daemon_), .result = -EIO };
	struct zc_param_stats ps;
	struct zc_tensor *t;
	int r;

	cr_assert_eq(zc_job_open(c, "pins", 0, 1), 0, "%s", zc_errmsg(c));
	t = reg(c, "offloaded", true);
	zc_tensor_set_param_pin(t, fake_unpin, &drv);
	r = zc_param_release(c, &t, 1);
	cr_assert_eq(r, -EIO, "release with a failing unpin gave %d (%s)", r, zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "cannot unpin its param slot") != NULL, "%s",
	    zc_errmsg(c));
	cr_assert_eq(drv.unpins, 1);
	cr_assert(zc_tensor_param_pinned(t));
	cr_assert_eq(itd_stat(drv.observer, "pipeline.params.releases"), 0);
	/* The params never left: a wait finds them in place. */
	cr_assert_eq(zc_param_wait_timeout(t, 0), 0, "%s", zc_errmsg(c));
	zc_param_stats(c, &ps);
	cr_assert_eq(ps.ready, 1);
	cr_assert(slot_holds_init(t));

	/* The driver recovers: the release goes through. */
	drv.result = 0;
	cr_assert_eq(zc_param_release(c, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(drv.unpins, 2);
	cr_assert_eq(itd_stat(drv.observer, "pipeline.params.releases"), 1);
	/* Unpinning is the hook's job; clearing it by hand is allowed too. */
	zc_tensor_set_param_pin(t, fake_unpin, &drv);
	zc_tensor_set_param_pin(t, NULL, &drv);
	cr_assert_not(zc_tensor_param_pinned(t));
	zc_disconnect(c);
	zc_disconnect(drv.observer);
}
