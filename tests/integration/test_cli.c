/* zoffloadd's command line: a missing or bad config stops it with exit 1 and a message naming what is wrong. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "itd.h"

static struct itd daemon_;
static char out[8192];

static void
teardown(void)
{
	itd_cleanup(&daemon_);
}

TestSuite(cli, .fini = teardown, .timeout = 30);

static int
exit_code(int status)
{
	cr_assert_geq(status, 0, "zoffloadd did not exit within its time");
	cr_assert(WIFEXITED(status), "zoffloadd died of signal %d: %s",
	    WIFSIGNALED(status) ? WTERMSIG(status) : 0, out);
	return WEXITSTATUS(status);
}

Test(cli, missing_config)
{
	const char *argv[] = { "--config", "/nonexistent/zoffload.conf", "--socket", NULL, NULL };

	itd_prepare(&daemon_, NULL);
	argv[3] = daemon_.socket;
	cr_assert_eq(exit_code(itd_run(argv, out, sizeof(out), 10)), 1, "%s", out);
	cr_assert(strstr(out, "/nonexistent/zoffload.conf") != NULL, "stderr: %s", out);
}

Test(cli, bad_config)
{
	const char *argv[] = { "--config", NULL, "--socket", NULL, NULL };

	itd_prepare(&daemon_, "{ \"memory\": { \"numa_node\": -7 } }\n");
	argv[1] = daemon_.config;
	argv[3] = daemon_.socket;
	cr_assert_eq(exit_code(itd_run(argv, out, sizeof(out), 10)), 1, "%s", out);
	cr_assert(strstr(out, daemon_.config) != NULL, "stderr does not name the file: %s", out);
	cr_assert(strstr(out, "memory.numa_node") != NULL, "stderr does not name the key: %s", out);
	cr_assert(strstr(out, "-7") != NULL, "stderr does not name the value: %s", out);
}

Test(cli, unknown_key)
{
	const char *argv[] = { "--config", NULL, "--check-config", NULL };

	itd_prepare(&daemon_, "{ \"socket\": { \"pth\": \"/run/x.sock\" } }\n");
	argv[1] = daemon_.config;
	cr_assert_eq(exit_code(itd_run(argv, out, sizeof(out), 10)), 1, "%s", out);
	cr_assert(strstr(out, "socket.pth") != NULL, "%s", out);
	cr_assert(strstr(out, daemon_.config) != NULL, "%s", out);
}

Test(cli, check_config_ok)
{
	const char *argv[] = { "--config", NULL, "--check-config", NULL };

	itd_prepare(&daemon_, "{ \"memory\": { \"pinned_budget\": \"64M\" },"
	    " \"log\": { \"level\": \"warn\" } }\n");
	argv[1] = daemon_.config;
	cr_assert_eq(exit_code(itd_run(argv, out, sizeof(out), 10)), 0, "%s", out);
	cr_assert(strstr(out, "OK") != NULL, "%s", out);
	/* Only checked: nothing listens. */
	cr_assert(access(daemon_.socket, F_OK) != 0, "--check-config created the socket");
}

Test(cli, bad_usage)
{
	const char *unknown[] = { "--frobnicate", NULL };
	const char *level[] = { "--config", NULL, "--socket", NULL, "--log-level", "loud", NULL };

	cr_assert_eq(exit_code(itd_run(unknown, out, sizeof(out), 10)), 2, "%s", out);
	itd_prepare(&daemon_, NULL);
	level[1] = daemon_.config;
	level[3] = daemon_.socket;
	cr_assert_eq(exit_code(itd_run(level, out, sizeof(out), 10)), 2, "%s", out);
	cr_assert(strstr(out, "loud") != NULL, "%s", out);
}

/* Started and stopped cleanly: SIGTERM with nothing to do exits 0 and removes the socket. */
Test(cli, start_stop)
{
	itd_start(&daemon_, NULL);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
	cr_assert(access(daemon_.socket, F_OK) != 0, "socket left behind");
}

static void
write_config(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");

	cr_assert_not_null(f);
	fputs(text, f);
	fclose(f);
}

/* Polls the pinned budget until it is want (SIGHUP is handled by the loop, not at once). */
static bool
budget_becomes(const char *socket, double want)
{
	for (int i = 0; i < 100; i++) {
		struct zc_conn *c;
		double got = -1;

		if (zc_connect(socket, &c) == 0) {
			got = itd_stat(c, "tiers.pinned.budget_bytes");
			zc_disconnect(c);
		}
		if (got == want)
			return true;
		usleep(20000);
	}
	return false;
}

/*
 * SIGHUP reloads what can change live (the pinned budget here); a config
 * that no longer parses is refused with the running one kept, and the
 * daemon goes on serving.
 */
Test(cli, sighup_reload)
{
	itd_start(&daemon_, "{ \"memory\": { \"pinned_budget\": \"64M\" }, "
	    "\"compute\": { \"worker_threads\": 2 } }\n");
	cr_assert(budget_becomes(daemon_.socket, 64.0 * 1024 * 1024));

	write_config(daemon_.config, "{ \"memory\": { \"pinned_budget\": \"32M\" }, "
	    "\"compute\": { \"worker_threads\": 2 } }\n");
	cr_assert_eq(kill(daemon_.pid, SIGHUP), 0);
	cr_assert(budget_becomes(daemon_.socket, 32.0 * 1024 * 1024), "%s",
	    itd_log_text(&daemon_));

	write_config(daemon_.config, "{ \"memory\": { \"pinned_budget\": \"lots\" } }\n");
	cr_assert_eq(kill(daemon_.pid, SIGHUP), 0);
	/* The refusal is logged; the budget stays. */
	for (int i = 0; i < 100 && strstr(itd_log_text(&daemon_), "keeping the running") == NULL;
	     i++)
		usleep(20000);
	cr_assert_not_null(strstr(itd_log_text(&daemon_), "memory.pinned_budget"), "%s",
	    itd_log_text(&daemon_));
	cr_assert(budget_becomes(daemon_.socket, 32.0 * 1024 * 1024));
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}
