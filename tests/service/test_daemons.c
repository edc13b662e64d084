/* Two daemons on one node: swap paths and sockets they must not share, and what each may remove. */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "svc.h"

static struct itd daemon_;
static char swapdir[64];

static void
teardown(void)
{
	char path[128];

	itd_cleanup(&daemon_);
	if (swapdir[0] != '\0') {
		snprintf(path, sizeof(path), "%s/swapfile", swapdir);
		(void)unlink(path);
		(void)rmdir(swapdir);
		swapdir[0] = '\0';
	}
}

TestSuite(daemons, .fini = teardown, .timeout = 60);

static void
make_swapdir(void)
{
	snprintf(swapdir, sizeof(swapdir), "/tmp/zoff-daemons-XXXXXX");
	cr_assert_not_null(mkdtemp(swapdir), "mkdtemp: %s", strerror(errno));
}

/* A second daemon on the first one's configuration, its own socket: must refuse, naming the first's pid. */
static void
expect_second_refused(void)
{
	static char out[16384];
	char sock[128], want[64];
	const char *argv[] = { "--config", daemon_.config, "--socket", sock, NULL };
	int status;

	snprintf(sock, sizeof(sock), "%s/sock2", daemon_.dir);
	status = itd_run(argv, out, sizeof(out), 20);
	cr_assert_neq(status, -1, "a second daemon on the same swap path ran on: %s", out);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0, "status 0x%x: %s", status, out);
	snprintf(want, sizeof(want), "in use by pid %d", (int)daemon_.pid);
	cr_assert(strstr(out, want) != NULL, "'%s' not said: %s", want, out);
}

static void
start_with_swap(const char *path)
{
	char config[512];

	snprintf(config, sizeof(config), "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"16M\" } ],"
	    " \"engine\": \"pthread\", \"chunk_elements\": 1024 } }", path);
	itd_start(&daemon_, config);
}

Test(daemons, swap_file_is_locked)
{
	char path[128];
	struct stat st;
	struct zc_conn *c;

	make_swapdir();
	snprintf(path, sizeof(path), "%s/swapfile", swapdir);
	start_with_swap(path);
	expect_second_refused();
	/* The first goes on untouched, its file the size it made it. */
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	cr_assert_eq(stat(path, &st), 0);
	cr_assert_eq(st.st_size, 16 << 20);
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
	/* Once it is gone, the path is free again. */
	start_with_swap(path);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

Test(daemons, swap_dir_is_locked)
{
	make_swapdir();
	start_with_swap(swapdir);
	expect_second_refused();
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}
