/* What zc_disconnect, zc_job_close and zc_job_drop free, seen in the daemon's job stats. */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "itd.h"

static struct itd daemon_;

static void
setup(void)
{
	/* The default grace (300 s): a dead rank's state stays for the whole test. */
	itd_start(&daemon_, NULL);
}

static void
teardown(void)
{
	itd_cleanup(&daemon_);
}

TestSuite(lifetime, .init = setup, .fini = teardown, .timeout = 60);

#define NUMEL 4096

/*
 * Registers `name` with every initial value `gen`; *ret_resumed (nullable)
 * says whether the daemon gave back kept state instead (its master values
 * are then not `gen`).
 */
static struct zc_tensor *
reg(struct zc_conn *c, const char *name, float gen, bool *ret_resumed)
{
	struct zc_tensor_desc desc = { .name = name, .numel = NUMEL, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16 };
	static float init[NUMEL];
	struct zc_tensor *t = NULL;
	float first;

	for (size_t i = 0; i < NUMEL; i++)
		init[i] = gen;
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "register %s: %s", name,
	    zc_errmsg(c));
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, 1, &first), 0, "%s", zc_errmsg(c));
	if (ret_resumed != NULL)
		*ret_resumed = first != gen;
	return t;
}

/* What the daemon says about job `name`; present false when it lists no such job. */
struct job_view {
	bool present;
	double ranks_attached, ranks_detached, tensors_detached, tensors;
};

static struct job_view
job_view(struct zc_conn *c, const char *name)
{
	struct job_view v = { 0 };
	const cJSON *j;
	char *json = NULL;
	cJSON *root;

	cr_assert_eq(zc_jobs_json(c, &json), 0, "%s", zc_errmsg(c));
	root = cJSON_Parse(json);
	cr_assert_not_null(root, "%s", json);
	cJSON_ArrayForEach(j, cJSON_GetObjectItemCaseSensitive(root, "jobs")) {
		if (strcmp(cJSON_GetObjectItemCaseSensitive(j, "name")->valuestring, name) != 0)
			continue;
		v.present = true;
		v.ranks_attached = cJSON_GetObjectItemCaseSensitive(j, "ranks_attached")->valuedouble;
		v.ranks_detached = cJSON_GetObjectItemCaseSensitive(j, "ranks_detached")->valuedouble;
		v.tensors_detached =
		    cJSON_GetObjectItemCaseSensitive(j, "tensors_detached")->valuedouble;
		v.tensors = cJSON_GetObjectItemCaseSensitive(j, "tensors")->valuedouble;
	}
	cJSON_Delete(root);
	free(json);
	return v;
}

/* The daemon sees a close asynchronously: poll (bounded) until the job looks as expected. */
static void
expect_job(struct zc_conn *c, const char *name, bool present, double attached,
    double detached_ranks, double detached_tensors, double tensors)
{
	double deadline = itd_now() + 10;
	struct job_view v;

	for (;;) {
		v = job_view(c, name);
		if (v.present == present && (!present || (v.ranks_attached == attached &&
		    v.ranks_detached == detached_ranks && v.tensors_detached == detached_tensors &&
		    v.tensors == tensors)))
			return;
		if (itd_now() > deadline)
			break;
		usleep(10000);
	}
	cr_assert_eq(v.present, present, "job '%s' %s", name, present ? "is gone" : "is still there");
	cr_assert_fail("job '%s': %.0f ranks attached, %.0f detached with %.0f tensors, %.0f tensors "
	    "in all; expected %.0f, %.0f with %.0f, %.0f", name, v.ranks_attached, v.ranks_detached,
	    v.tensors_detached, v.tensors, attached, detached_ranks, detached_tensors, tensors);
}

static void
open_rank(struct zc_conn *c, const char *job, uint32_t rank)
{
	cr_assert_eq(zc_job_open(c, job, rank, 2), 0, "%s", zc_errmsg(c));
}

static void
step_once(struct zc_conn *c, struct zc_tensor *t)
{
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };

	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, NULL), 0, "%s", zc_errmsg(c));
}

/* zc_disconnect without zc_job_close is a rank that died: its state waits for the grace. */
Test(lifetime, disconnect_keeps_the_rank_detached)
{
	struct zc_conn *obs = itd_connect(&daemon_), *r0 = itd_connect(&daemon_);
	struct zc_conn *r1 = itd_connect(&daemon_);
	struct zc_tensor *a;
	bool resumed;

	open_rank(r0, "j", 0);
	open_rank(r1, "j", 1);
	a = reg(r0, "a", 1, NULL);
	(void)reg(r0, "b", 1, NULL);
	(void)reg(r1, "a", 1, NULL);
	step_once(r0, a);
	expect_job(obs, "j", true, 2, 0, 0, 3);

	zc_disconnect(r0);
	expect_job(obs, "j", true, 1, 1, 2, 3);
	/* A new process of rank 0 takes its tensor back, stepped as it was. */
	r0 = itd_connect(&daemon_);
	open_rank(r0, "j", 0);
	(void)reg(r0, "a", 2, &resumed);
	cr_assert(resumed, "rank 0's 'a' came back new, not as it was kept");
	expect_job(obs, "j", true, 2, 1, 1, 3);
	zc_disconnect(r0);
	zc_disconnect(r1);
	expect_job(obs, "j", true, 0, 2, 3, 3);
	zc_disconnect(obs);
}

/*
 * zc_job_close frees this rank's state now: what it registered and what an
 * earlier process of the rank left that it did not take back.  Other ranks
 * keep theirs, and the job stays while any rank has state in it.
 */
Test(lifetime, job_close_frees_the_rank_now)
{
	struct zc_conn *obs = itd_connect(&daemon_), *r0 = itd_connect(&daemon_);
	struct zc_conn *r1 = itd_connect(&daemon_);

	open_rank(r0, "j", 0);
	open_rank(r1, "j", 1);
	(void)reg(r0, "a", 1, NULL);
	(void)reg(r0, "b", 1, NULL);
	(void)reg(r1, "a", 1, NULL);
	zc_disconnect(r0);
	expect_job(obs, "j", true, 1, 1, 2, 3);

	r0 = itd_connect(&daemon_);
	open_rank(r0, "j", 0);
	(void)reg(r0, "a", 2, NULL);		/* 'b' stays detached */
	cr_assert_eq(zc_job_close(r0), 0, "%s", zc_errmsg(r0));
	expect_job(obs, "j", true, 1, 0, 0, 1);
	/* The connection can open the job again, as a new rank 0 with nothing to resume. */
	open_rank(r0, "j", 0);
	bool resumed;

	(void)reg(r0, "b", 3, &resumed);
	cr_assert_not(resumed, "rank 0's 'b' outlived zc_job_close");
	cr_assert_eq(zc_job_close(r0), 0, "%s", zc_errmsg(r0));
	cr_assert_eq(zc_job_close(r1), 0, "%s", zc_errmsg(r1));
	/* Every rank closed: the job is gone, and with it its state. */
	expect_job(obs, "j", false, 0, 0, 0, 0);
	cr_assert_eq(itd_stat(obs, "tiers.pinned.used_bytes"), 0);
	zc_disconnect(r0);
	zc_disconnect(r1);
	zc_disconnect(obs);
}

/* zc_job_drop frees the whole job: every rank, attached or detached. */
Test(lifetime, job_drop_frees_every_rank)
{
	struct zc_conn *admin = itd_connect(&daemon_), *r0 = itd_connect(&daemon_);
	struct zc_conn *r1 = itd_connect(&daemon_);
	int r;

	open_rank(r0, "j", 0);
	open_rank(r1, "j", 1);
	(void)reg(r0, "a", 1, NULL);
	(void)reg(r1, "a", 1, NULL);
	(void)reg(r1, "b", 1, NULL);
	zc_disconnect(r0);
	expect_job(admin, "j", true, 1, 1, 1, 3);

	/* A rank of the job closes its own part instead. */
	r = zc_job_drop(r1, "j");
	cr_assert_eq(r, -EBUSY, "drop from a rank of the job gave %d (%s)", r, zc_errmsg(r1));
	cr_assert_eq(zc_job_drop(admin, "j"), 0, "%s", zc_errmsg(admin));
	expect_job(admin, "j", false, 0, 0, 0, 0);
	cr_assert_eq(itd_stat(admin, "tiers.pinned.used_bytes"), 0);
	/* The attached rank was disconnected, and told why. */
	r = zc_ping(r1, NULL);
	cr_assert_eq(r, -ECONNABORTED, "a dropped rank's ping gave %d (%s)", r, zc_errmsg(r1));
	cr_assert(strstr(zc_errmsg(r1), "dropped") != NULL, "%s", zc_errmsg(r1));
	zc_disconnect(r1);
	zc_disconnect(admin);
}

static void
expect_filled(const void *p, size_t bytes, unsigned char byte, const char *what)
{
	const unsigned char *b = p;

	for (size_t i = 0; i < bytes; i++)
		cr_assert_eq(b[i], byte, "%s: byte %zu is %#x, not %#x", what, i, b[i], byte);
}

/*
 * zc_tensor_keep_slots: pointers a binding cannot take back (a framework
 * thread's reference to a parameter's storage) stay valid past the tensor,
 * holding what they held, and writable where they were; the daemon has let
 * go of the tensor all the same.  Before, every way a tensor goes unmapped
 * its slots, and a binding had to refuse to unregister while views lived.
 */
Test(lifetime, kept_slots_outlive_the_tensor)
{
	struct zc_conn *obs = itd_connect(&daemon_), *c = itd_connect(&daemon_);
	struct zc_kept_slots kept[3] = { 0 }, none = { 0 };
	struct zc_tensor *t[3];
	const char *names[3] = { "unregistered", "job-closed", "disconnected" };
	size_t gbytes, pbytes, vbytes;

	cr_assert_eq(zc_conn_set_param_views(c, true), 0, "%s", zc_errmsg(c));
	open_rank(c, "k", 0);
	for (int i = 0; i < 3; i++) {
		t[i] = reg(c, names[i], 1, NULL);
		cr_assert_not_null(zc_tensor_param_view(t[i], &vbytes), "%s: no param view",
		    names[i]);
		(void)zc_tensor_grad_slot(t[i], &gbytes);
		(void)zc_tensor_param_slot(t[i], &pbytes);
		memset(zc_tensor_grad_slot(t[i], NULL), 0x40 + i, gbytes);
		memset(zc_tensor_param_view(t[i], NULL), 0x50 + i, vbytes);
		zc_tensor_keep_slots(t[i], &kept[i]);
	}
	cr_assert_eq(zc_tensor_unregister(t[0]), 0, "%s", zc_errmsg(c));
	expect_job(obs, "k", true, 1, 0, 0, 2);
	cr_assert_eq(memcmp(&kept[1], &none, sizeof(none)), 0, "filled before its tensor went");
	cr_assert_eq(zc_job_close(c), 0, "%s", zc_errmsg(c));
	expect_job(obs, "k", false, 0, 0, 0, 0);

	/* A tensor that goes with the connection, its job left open. */
	open_rank(c, "k2", 0);
	t[2] = reg(c, names[2], 1, NULL);
	memset(zc_tensor_grad_slot(t[2], NULL), 0x42, gbytes);
	memset(zc_tensor_param_view(t[2], NULL), 0x52, vbytes);
	zc_tensor_keep_slots(t[2], &kept[2]);
	zc_disconnect(c);
	expect_job(obs, "k2", true, 0, 1, 1, 1);

	for (int i = 0; i < 3; i++) {
		cr_assert_not_null(kept[i].grad.addr, "%s: grad slot not handed over", names[i]);
		cr_assert_not_null(kept[i].param.addr, "%s: param slot not handed over", names[i]);
		cr_assert_not_null(kept[i].param_view.addr, "%s: param view not handed over",
		    names[i]);
		cr_assert(kept[i].grad.bytes >= gbytes && kept[i].param.bytes >= pbytes &&
		    kept[i].param_view.bytes >= vbytes, "%s: ranges shorter than the slots", names[i]);
		expect_filled(kept[i].grad.addr, gbytes, 0x40 + i, names[i]);
		expect_filled(kept[i].param_view.addr, vbytes, 0x50 + i, names[i]);
		/* Still writable where they were (the view no longer write-protected). */
		memset(kept[i].grad.addr, 0x11, gbytes);
		memset(kept[i].param_view.addr, 0x22, vbytes);
		expect_filled(kept[i].param_view.addr, vbytes, 0x22, names[i]);
		cr_assert_eq(munmap(kept[i].grad.addr, kept[i].grad.bytes), 0);
		cr_assert_eq(munmap(kept[i].param.addr, kept[i].param.bytes), 0);
		cr_assert_eq(munmap(kept[i].param_view.addr, kept[i].param_view.bytes), 0);
	}
	zc_disconnect(obs);
}
