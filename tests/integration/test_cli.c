/* zoffloadd's command line: a missing or bad config stops it with exit 1 and a message naming what is wrong. */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>
#include <stdio.h>
#include <string.h>
#include <grp.h>
#include <sys/stat.h>
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

/* --check-config on config_text with "%s" (once) replaced by swap_path. */
static int
check_config(const char *config_text, const char *swap_path)
{
	const char *argv[] = { "--config", NULL, "--check-config", NULL };
	const char *at = strstr(config_text, "%s");
	char text[1024];

	cr_assert_not_null(at);
	snprintf(text, sizeof(text), "%.*s%s%s", (int)(at - config_text), config_text, swap_path,
	    at + 2);
	itd_prepare(&daemon_, text);
	argv[1] = daemon_.config;
	return exit_code(itd_run(argv, out, sizeof(out), 10));
}

static char swapdir[] = "/tmp/zoff-check-XXXXXX";

static void
make_swapdir(void)
{
	cr_assert_not_null(mkdtemp(swapdir));
}

static void
remove_swapdir(void)
{
	rmdir(swapdir);
	itd_cleanup(&daemon_);
}

Test(cli, check_config_swap_path_ok_says_free_space, .init = make_swapdir,
    .fini = remove_swapdir)
{
	cr_assert_eq(check_config("{ \"swap\": { \"paths\": [ { \"path\": \"%s\", "
	    "\"capacity\": \"1M\" } ] } }\n", swapdir), 0, "%s", out);
	cr_assert(strstr(out, swapdir) != NULL && strstr(out, "free") != NULL, "%s", out);
	cr_assert(strstr(out, "configuration OK") != NULL, "%s", out);
}

Test(cli, check_config_swap_path_missing, .init = make_swapdir, .fini = remove_swapdir)
{
	char path[128];

	snprintf(path, sizeof(path), "%s/no/such/dir", swapdir);
	cr_assert_eq(check_config("{ \"swap\": { \"paths\": [ { \"path\": \"%s\", "
	    "\"capacity\": \"1M\" } ] } }\n", path), 1, "%s", out);
	cr_assert(strstr(out, path) != NULL && strstr(out, "does not exist") != NULL, "%s", out);
}

Test(cli, check_config_capacity_past_free_space, .init = make_swapdir, .fini = remove_swapdir)
{
	/* 16 EiB less a bit: no file system has it free. */
	cr_assert_eq(check_config("{ \"swap\": { \"paths\": [ { \"path\": \"%s\", "
	    "\"capacity\": \"16000000T\" } ] } }\n", swapdir), 1, "%s", out);
	cr_assert(strstr(out, swapdir) != NULL, "%s", out);
	cr_assert(strstr(out, "is free") != NULL, "does not say how much is free: %s", out);
}

static bool
is_memory_fs(const char *path)
{
	FILE *f = fopen("/proc/self/mounts", "r");
	char dev[256], dir[256], type[64];
	bool found = false;

	while (f != NULL && fscanf(f, "%255s %255s %63s %*[^\n]", dev, dir, type) == 3)
		if (strcmp(dir, path) == 0)
			found = strcmp(type, "tmpfs") == 0 || strcmp(type, "ramfs") == 0;
	if (f != NULL)
		fclose(f);
	return found;
}

Test(cli, check_config_refuses_memory_fs_unless_allowed)
{
	char path[64];

	if (!is_memory_fs("/dev/shm") || access("/dev/shm", W_OK) != 0)
		cr_skip_test("/dev/shm is not a writable tmpfs here");
	snprintf(path, sizeof(path), "/dev/shm/zoff-check-%d", (int)getpid());
	cr_assert_eq(check_config("{ \"swap\": { \"paths\": [ { \"path\": \"%s\", "
	    "\"capacity\": \"1M\" } ] } }\n", path), 1, "%s", out);
	cr_assert(strstr(out, "tmpfs") != NULL && strstr(out, "swap.allow_memory_fs") != NULL,
	    "%s", out);
	cr_assert_eq(check_config("{ \"swap\": { \"allow_memory_fs\": true, \"paths\": [ { "
	    "\"path\": \"%s\", \"capacity\": \"1M\" } ] } }\n", path), 0, "%s", out);
	cr_assert(access(path, F_OK) != 0, "--check-config created %s", path);
}

Test(cli, check_config_names_missing_group)
{
	cr_assert_eq(check_config("{ \"socket\": { \"group\": \"%s\" } }\n", "zoffnogroup"), 1,
	    "%s", out);
	cr_assert(strstr(out, "socket.group") != NULL && strstr(out, "'zoffnogroup' does not "
	    "exist") != NULL, "%s", out);
}

/*
 * Runs $ZOFFCTL with argv (NULL-terminated, without the program), stdout and
 * stderr into separate buffers, killed after run_s (0: to its end, at most
 * 10 s).  as_uid: drop to that uid first (when root).  Returns the wait status.
 */
static int
zoffctl(const char *const *argv, char *sout, char *serr, size_t len, double run_s, uid_t as_uid)
{
	const char *prog = getenv("ZOFFCTL");
	char po[] = "/tmp/zoff-ctl-out-XXXXXX", pe[] = "/tmp/zoff-ctl-err-XXXXXX";
	const char *args[16] = { prog };
	int fo = mkstemp(po), fe = mkstemp(pe), status = -1;
	double limit = run_s > 0 ? run_s : 10, waited = 0;
	ssize_t n;
	pid_t pid;

	cr_assert_not_null(prog, "$ZOFFCTL is not set");
	cr_assert(fo >= 0 && fe >= 0);
	unlink(po);
	unlink(pe);
	for (size_t i = 0; argv[i] != NULL && i < 14; i++)
		args[i + 1] = argv[i];
	pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		dup2(fo, STDOUT_FILENO);
		dup2(fe, STDERR_FILENO);
		if (as_uid != (uid_t)-1 && geteuid() == 0 && (setgroups(0, NULL) != 0 ||
		    setgid(as_uid) != 0 || setuid(as_uid) != 0))
			_exit(125);
		execv(prog, (char *const *)args);
		_exit(127);
	}
	while (waitpid(pid, &status, WNOHANG) == 0) {
		if (waited >= limit) {
			kill(pid, run_s > 0 ? SIGINT : SIGKILL);
			waitpid(pid, &status, 0);
			break;
		}
		nanosleep(&(struct timespec){ 0, 20000000 }, NULL);
		waited += 0.02;
	}
	n = pread(fo, sout, len - 1, 0);
	sout[n > 0 ? n : 0] = '\0';
	n = pread(fe, serr, len - 1, 0);
	serr[n > 0 ? n : 0] = '\0';
	close(fo);
	close(fe);
	return status;
}

static char sout[16384], serr[8192];

Test(cli, zoffctl_version)
{
	const char *argv[] = { "--version", NULL };
	int st = zoffctl(argv, sout, serr, sizeof(serr), 0, (uid_t)-1);

	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s", serr);
	cr_assert(strncmp(sout, "zoffctl ", 8) == 0 && strchr(sout, '.') != NULL, "%s", sout);
}

/* An error names the socket it tried, whichever way it was given. */
Test(cli, zoffctl_error_names_socket)
{
	const char *argv[] = { "--socket", "/nonexistent/zoff.sock", "stats", NULL };
	const char *by_env[] = { "ping", NULL };
	int st = zoffctl(argv, sout, serr, sizeof(serr), 0, (uid_t)-1);

	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "%s", serr);
	cr_assert(strstr(serr, "/nonexistent/zoff.sock") != NULL, "%s", serr);
	cr_assert(strstr(serr, "is zoffloadd running") != NULL, "%s", serr);
	setenv("ZOFFLOAD_SOCKET", "/nonexistent/env.sock", 1);
	st = zoffctl(by_env, sout, serr, sizeof(serr), 0, (uid_t)-1);
	unsetenv("ZOFFLOAD_SOCKET");
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "%s", serr);
	cr_assert(strstr(serr, "/nonexistent/env.sock") != NULL, "%s", serr);
}

/* Permission denied says which group a user needs. */
Test(cli, zoffctl_permission_denied_names_group)
{
	const char *argv[] = { "--socket", NULL, "ping", NULL };
	int st;

	if (geteuid() != 0)
		cr_skip_test("needs root to run zoffctl as another user");
	itd_start(&daemon_, "{ \"socket\": { \"mode\": \"0600\" }, "
	    "\"compute\": { \"worker_threads\": 2 } }\n");
	/* The temp dir must let others reach the socket, so the socket's mode is what refuses. */
	cr_assert_eq(chmod(daemon_.dir, 0755), 0);
	argv[1] = daemon_.socket;
	st = zoffctl(argv, sout, serr, sizeof(serr), 0, 65534);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %d: %s", st, serr);
	cr_assert(strstr(serr, daemon_.socket) != NULL, "%s", serr);
	cr_assert(strstr(serr, strerror(EACCES)) != NULL, "%s", serr);
	cr_assert(strstr(serr, "group") != NULL && strstr(serr, "zoffload") != NULL, "%s", serr);
}

/* --watch into a file or a pipe: plain text, no terminal escapes, one report after another. */
Test(cli, zoffctl_watch_no_escapes_off_terminal)
{
	const char *argv[] = { "--socket", NULL, "stats", "--watch", "0.2", NULL };
	unsigned reports = 0;

	itd_start(&daemon_, NULL);
	argv[1] = daemon_.socket;
	zoffctl(argv, sout, serr, sizeof(sout), 1.5, (uid_t)-1);
	for (const char *p = sout; (p = strstr(p, "zoffloadd ")) != NULL; p++)
		reports++;
	cr_assert_geq(reports, 2, "fewer than 2 reports in 1.5 s of --watch 0.2: %s%s", sout, serr);
	cr_assert_null(strchr(sout, '\033'), "terminal escapes in output to a file: %s", sout);
}

/*
 * The step rate of a daemon up for less than its 10 s window is averaged over
 * the whole seconds it has been up, and says so: dividing by 10 understated it.
 */
Test(cli, rate_window_not_longer_than_uptime)
{
	struct zc_conn *c;
	double window, up;

	itd_start(&daemon_, NULL);
	c = itd_connect(&daemon_);
	window = itd_stat(c, "steps.rate_window_s");
	up = itd_stat(c, "uptime_s");
	zc_disconnect(c);
	cr_assert_leq(window, 10);
	cr_assert_leq(window, up + 1, "rate over %.0f s from a daemon up %.1f s", window, up);
}
