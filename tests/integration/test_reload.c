/* SIGHUP changes each reloadable key, seen in the stats and in behaviour; a job's last step after a skipped set. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "itd.h"

static struct itd daemon_;

static void
teardown(void)
{
	itd_cleanup(&daemon_);
}

TestSuite(reload, .fini = teardown, .timeout = 60);

static void
write_config(const char *text)
{
	FILE *f = fopen(daemon_.config, "w");

	cr_assert_not_null(f);
	fputs(text, f);
	cr_assert_eq(fclose(f), 0);
}

/* A string from zc_stats_json at the top level. */
static bool
stat_string_is(struct zc_conn *c, const char *key, const char *want)
{
	char *json = NULL, pattern[96];
	bool found;

	cr_assert_eq(zc_stats_json(c, &json), 0, "%s", zc_errmsg(c));
	snprintf(pattern, sizeof(pattern), "\"%s\":\"%s\"", key, want);
	found = strstr(json, pattern) != NULL;
	free(json);
	return found;
}

/*
 * The loop handles SIGHUP on its next turn: poll (bounded) until the stat
 * says want, over via, or a fresh connection each time when via is NULL.
 */
static void
reload_via(struct zc_conn *via, const char *config, const char *path, double want,
    const char *str)
{
	struct zc_conn *c = via;
	bool ok = false;

	write_config(config);
	cr_assert_eq(kill(daemon_.pid, SIGHUP), 0);
	for (int i = 0; i < 200 && !ok; i++) {
		if (via != NULL || zc_connect(daemon_.socket, &c) == 0) {
			ok = str != NULL ? stat_string_is(c, path, str) : itd_stat(c, path) == want;
			if (via == NULL)
				zc_disconnect(c);
		}
		if (!ok)
			usleep(20000);
	}
	cr_assert(ok, "after SIGHUP with %s\n%s is not %s%g\n%s", config, path, str ? str : "",
	    str ? 0.0 : want, itd_log_text(&daemon_));
}

static void
reload_and_expect(const char *config, const char *path, double want, const char *str)
{
	reload_via(NULL, config, path, want, str);
}

#define BASE "\"compute\": { \"worker_threads\": 2 }"

/*
 * Every key SIGHUP reloads (README), one at a time from the same base, each
 * checked where the stats show it.  Keys needing a restart are not here.
 */
Test(reload, each_reloadable_key)
{
	static const struct {
		const char *config, *path, *str;
		double want;
	} keys[] = {
		{ "\"log\": { \"level\": \"debug\" }", "log_level", "debug", 0 },
		{ "\"memory\": { \"pinned_budget\": \"48M\" }", "tiers.pinned.budget_bytes", NULL, 48 << 20 },
		{ "\"memory\": { \"shm_budget\": \"40M\" }", "tiers.shm.budget_bytes", NULL, 40 << 20 },
		{ "\"compute\": { \"worker_threads\": 2, \"isa\": \"scalar\" }", "kernel_isa", "scalar", 0 },
		{ "\"limits\": { \"max_clients\": 7 }", "limits.max_clients", NULL, 7 },
		{ "\"limits\": { \"max_clients_per_uid\": 5 }", "limits.max_clients_per_uid", NULL, 5 },
		{ "\"limits\": { \"max_queued_messages\": 99 }", "limits.max_queued_messages", NULL, 99 },
		{ "\"limits\": { \"uid_pinned_budget\": \"3M\" }", "limits.uid_pinned_budget", NULL, 3 << 20 },
		{ "\"limits\": { \"uid_swap_budget\": \"5M\" }", "limits.uid_swap_budget", NULL, 5 << 20 },
		{ "\"limits\": { \"detach_grace_s\": 17 }", "limits.detach_grace_s", NULL, 17 },
		{ "\"limits\": { \"uid_ckpt_buffer_budget\": \"7M\" }",
		    "limits.uid_ckpt_buffer_budget", NULL, 7 << 20 },
	};
	char config[512];

	unsetenv("ZOFFLOAD_ISA");
	itd_start(&daemon_, "{ " BASE ", \"log\": { \"level\": \"info\" }, "
	    "\"memory\": { \"pinned_budget\": \"64M\", \"shm_budget\": \"64M\" } }\n");
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
		/* The key's own section replaces the base's (compute keeps its threads). */
		snprintf(config, sizeof(config), "{ %s%s%s }\n",
		    strncmp(keys[i].config, "\"compute\"", 9) == 0 ? "" : BASE,
		    strncmp(keys[i].config, "\"compute\"", 9) == 0 ? "" : ", ", keys[i].config);
		reload_and_expect(config, keys[i].path, keys[i].want, keys[i].str);
	}
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* A lowered connection limit applies to the next connection; raised again, it admits. */
static void
client_limit_reloads(const char *key, const char *limit_text)
{
	struct zc_conn *a, *b = NULL;
	char config[256];
	int r;

	snprintf(config, sizeof(config), "{ " BASE ", \"limits\": { \"%s\": 4 } }\n", key);
	itd_start(&daemon_, config);
	a = itd_connect(&daemon_);
	snprintf(config, sizeof(config), "{ " BASE ", \"limits\": { \"%s\": 1 } }\n", key);
	/* Over the one connection there is: a second would be refused. */
	reload_via(a, config, limit_text, 1, NULL);
	r = zc_connect(daemon_.socket, &b);
	cr_assert_eq(r, -EUSERS, "a second client past %s = 1 after SIGHUP: %d", key, r);
	snprintf(config, sizeof(config), "{ " BASE ", \"limits\": { \"%s\": 2 } }\n", key);
	write_config(config);
	cr_assert_eq(kill(daemon_.pid, SIGHUP), 0);
	for (int i = 0; i < 200 && (r = zc_connect(daemon_.socket, &b)) != 0; i++)
		usleep(20000);
	cr_assert_eq(r, 0, "no second client after %s went back to 2: %s", key, strerror(-r));
	zc_disconnect(b);
	zc_disconnect(a);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

Test(reload, max_clients_applies)
{
	client_limit_reloads("max_clients", "limits.max_clients");
}

Test(reload, max_clients_per_uid_applies)
{
	client_limit_reloads("max_clients_per_uid", "limits.max_clients_per_uid");
}

/* A lowered uid budget refuses the next tensor; what is in stays. */
Test(reload, uid_pinned_budget_applies)
{
	struct zc_tensor_desc desc = { .name = "a", .numel = 1 << 16, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	static float init[1 << 16];
	struct zc_conn *c;
	struct zc_tensor *t;
	int r;

	itd_start(&daemon_, "{ " BASE ", \"limits\": { \"uid_pinned_budget\": \"8M\" } }\n");
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "j", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	reload_and_expect("{ " BASE ", \"limits\": { \"uid_pinned_budget\": \"1M\" } }\n",
	    "limits.uid_pinned_budget", 1 << 20, NULL);
	desc.name = "b";
	r = zc_tensor_register(c, &desc, init, &t);
	cr_assert_eq(r, -EDQUOT, "past the reloaded uid budget: %d (%s)", r, zc_errmsg(c));
	cr_assert_eq(itd_stat(c, "tensors"), 1);
	zc_disconnect(c);
}

/*
 * A skipped set (non-finite gradient) does not move the job's or the
 * tensor's last step: not in the stats, not for libzclient, not for a rank
 * that opens the job afterwards, not in the step counters.
 */
Test(reload, last_step_after_skipped_set)
{
	struct zc_tensor_desc desc = { .name = "w", .numel = 1000, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
		.eps = 1e-8, .grad_scale = 1, .check_finite = true };
	static float init[1000];
	struct zc_step_result res;
	struct zc_conn *c, *c2;
	struct zc_tensor *t;
	float *g;

	itd_start(&daemon_, NULL);
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "skips", 0, 2), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	g = zc_tensor_grad_slot(t, NULL);
	for (uint64_t step = 1; step <= 3; step++) {
		for (int i = 0; i < 1000; i++)
			g[i] = step == 3 && i == 500 ? NAN : 0.01f * (float)(i % 7);
		sp.step = step;
		cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
		cr_assert_eq(zc_wait_all(c, &res), 0, "%s", zc_errmsg(c));
		cr_assert_eq(res.status, step == 3 ? ZC_STEP_SKIPPED_NONFINITE : ZC_STEP_APPLIED);
	}
	cr_assert_eq(zc_tensor_last_step(t), 2, "the tensor's last step moved to %llu",
	    (unsigned long long)zc_tensor_last_step(t));
	cr_assert_eq(itd_stat(c, "jobs.0.last_step"), 2);
	cr_assert_eq(itd_stat(c, "jobs.0.steps_applied"), 2);
	cr_assert_eq(itd_stat(c, "jobs.0.steps_skipped"), 1);
	cr_assert_eq(itd_stat(c, "jobs.0.steps_failed"), 0);
	c2 = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c2, "skips", 1, 2), 0, "%s", zc_errmsg(c2));
	cr_assert_eq(zc_job_last_step(c2), 2, "a joining rank is told step %llu",
	    (unsigned long long)zc_job_last_step(c2));
	zc_disconnect(c2);
	/* Step 3 again, clean: it applies and is the last step now. */
	g[500] = 0;
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, &res), 0, "%s", zc_errmsg(c));
	cr_assert_eq(res.status, ZC_STEP_APPLIED);
	cr_assert_eq(zc_tensor_last_step(t), 3);
	cr_assert_eq(itd_stat(c, "jobs.0.last_step"), 3);
	zc_disconnect(c);
}
