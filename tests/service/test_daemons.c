/* Two daemons on one node: swap paths and sockets they must not share, and what each may remove. */
#include <cjson/cJSON.h>
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
		snprintf(path, sizeof(path), "%s/a", swapdir);
		(void)unlink(path);
		snprintf(path, sizeof(path), "%s/b", swapdir);
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

/* 1 when swap path i is reported bad, 0 when good, -1 when the stats do not say. */
static int
path_bad(struct zc_conn *c, int i)
{
	const cJSON *paths, *p, *bad;
	char *json = NULL;
	cJSON *root;
	int v = -1;

	cr_assert_eq(zc_stats_json(c, &json), 0, "%s", zc_errmsg(c));
	root = cJSON_Parse(json);
	paths = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(
	    cJSON_GetObjectItemCaseSensitive(root, "tiers"), "nvme"), "paths");
	p = cJSON_GetArrayItem(paths, i);
	bad = cJSON_GetObjectItemCaseSensitive(p, "bad");
	if (cJSON_IsBool(bad))
		v = cJSON_IsTrue(bad);
	cJSON_Delete(root);
	free(json);
	return v;
}

/* A swap file truncated under the daemon is marked bad, shown so, and takes no new state. */
Test(daemons, truncated_swap_path_goes_bad)
{
	enum { N = 1 << 16 };
	static float init[N], got[N];
	char config[512], a[128], b[128];
	struct zc_tensor *t;
	struct zc_conn *c;
	double deadline;
	int bad = -1;

	make_swapdir();
	snprintf(a, sizeof(a), "%s/a", swapdir);
	snprintf(b, sizeof(b), "%s/b", swapdir);
	snprintf(config, sizeof(config), "{ \"compute\": { \"worker_threads\": 2 },"
	    " \"memory\": { \"policy\": \"nvme\" },"
	    " \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"16M\" },"
	    " { \"path\": \"%s\", \"capacity\": \"16M\" } ], \"engine\": \"pthread\","
	    " \"chunk_elements\": 4096 } }", a, b);
	itd_start(&daemon_, config);
	c = itd_connect(&daemon_);
	cr_assert_eq(path_bad(c, 0), 0, "a fresh path is not shown good");
	cr_assert_eq(truncate(a, 0), 0, "%s", strerror(errno));
	deadline = itd_now() + 10;
	while (itd_now() < deadline && (bad = path_bad(c, 0)) != 1)
		usleep(50000);
	cr_assert_eq(bad, 1, "the truncated path is not shown bad: %s", itd_log_text(&daemon_));
	cr_assert_eq(path_bad(c, 1), 0);
	cr_assert(strstr(itd_log_text(&daemon_), "is bad") != NULL, "%s", itd_log_text(&daemon_));
	/* New state goes to the good path only, and reads back whole. */
	for (int i = 0; i < N; i++)
		init[i] = (float)i * 0.5f;
	cr_assert_eq(zc_job_open(c, "after", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &(struct zc_tensor_desc){ .name = "w", .numel = N,
	    .grad_dtype = ZC_F32, .param_dtype = ZC_F32 }, init, &t), 0, "%s", zc_errmsg(c));
	cr_assert_eq(itd_stat(c, "tiers.nvme.paths.0.used_bytes"), 0, "state went to the bad path");
	cr_assert_gt(itd_stat(c, "tiers.nvme.paths.1.used_bytes"), 0);
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, N, got), 0, "%s", zc_errmsg(c));
	cr_assert(memcmp(got, init, sizeof(got)) == 0, "the state did not read back");
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

static int
raw_socket_to(const char *path, bool nonblock)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0), 0);

	cr_assert_geq(fd, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
		int r = -errno;

		close(fd);
		return r;
	}
	return fd;
}

/*
 * A daemon that is stopped, its backlog full: a second one on its socket
 * must see that someone is there, at once, instead of hanging in connect.
 */
Test(daemons, probe_of_a_stopped_daemon_does_not_block)
{
	static char out[16384];
	const char *argv[] = { "--config", NULL, "--socket", NULL, NULL };
	int fds[1024], n = 0, r, status;

	itd_start(&daemon_, NULL);
	argv[1] = daemon_.config;
	argv[3] = daemon_.socket;
	cr_assert_eq(kill(daemon_.pid, SIGSTOP), 0);
	/* Fill the listener's backlog: the kernel answers EAGAIN once it is full. */
	while (n < 1024 && (r = raw_socket_to(daemon_.socket, true)) >= 0)
		fds[n++] = r;
	cr_assert_eq(r, -EAGAIN, "connect: %s after %d", strerror(-r), n);
	status = itd_run(argv, out, sizeof(out), 20);
	cr_assert_eq(kill(daemon_.pid, SIGCONT), 0);
	cr_assert_neq(status, -1, "the second daemon hung probing the socket: %s", out);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0, "status 0x%x: %s", status, out);
	cr_assert(strstr(out, "another zoffloadd is listening") != NULL, "%s", out);
	while (n > 0)
		close(fds[--n]);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* A daemon whose socket path was taken over leaves the successor's socket alone at exit. */
Test(daemons, exit_leaves_a_successors_socket)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct stat before, after;
	char moved[128];
	int succ;

	itd_start(&daemon_, NULL);
	snprintf(moved, sizeof(moved), "%s.old", daemon_.socket);
	cr_assert_eq(rename(daemon_.socket, moved), 0, "%s", strerror(errno));
	succ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", daemon_.socket);
	cr_assert_eq(bind(succ, (struct sockaddr *)&sa, sizeof(sa)), 0, "%s", strerror(errno));
	cr_assert_eq(listen(succ, 4), 0);
	cr_assert_eq(lstat(daemon_.socket, &before), 0);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
	cr_assert_eq(lstat(daemon_.socket, &after), 0, "the successor's socket was removed");
	cr_assert_eq(after.st_ino, before.st_ino, "the successor's socket was replaced");
	close(succ);
	(void)unlink(daemon_.socket);
	(void)unlink(moved);
}

/* The log so far has `text` on the line that starts with `line`. */
static bool
log_line_has(const char *line, const char *text)
{
	const char *log = itd_log_text(&daemon_), *p = strstr(log, line), *end;

	if (p == NULL)
		return false;
	end = strchr(p, '\n');
	for (const char *q = strstr(p, text); q != NULL; q = strstr(q + 1, text))
		if (end == NULL || q < end)
			return true;
	return false;
}

/* SIGHUP applies each key that can change live and names, key by key, what needs a restart. */
Test(daemons, reload_applies_and_names_each_key)
{
	static const char *const live[] = { "memory.xfer_window", "memory.policy",
		"limits.detach_grace_s", "limits.max_clients_per_uid", "limits.uid_pinned_budget",
		"limits.uid_max_tensors" };
	static const char *const restart[] = { "swap.paths", "compute.worker_threads" };
	static struct zp_msg m;
	char config[512], *json = NULL;
	struct zc_conn *c;
	double deadline;
	FILE *f;
	int fd;

	make_swapdir();
	itd_start(&daemon_, "{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": "
	    "\"info\" } }");
	snprintf(config, sizeof(config), "{ \"compute\": { \"worker_threads\": 3 },"
	    " \"log\": { \"level\": \"info\" },"
	    " \"memory\": { \"xfer_window\": \"4M\", \"policy\": \"cpu\" },"
	    " \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"16M\" } ] },"
	    " \"limits\": { \"detach_grace_s\": 5, \"max_clients_per_uid\": 3,"
	    " \"uid_pinned_budget\": \"1G\", \"uid_max_tensors\": 99 } }", swapdir);
	f = fopen(daemon_.config, "w");
	cr_assert_not_null(f);
	fputs(config, f);
	cr_assert_eq(fclose(f), 0);
	cr_assert_eq(kill(daemon_.pid, SIGHUP), 0);
	deadline = itd_now() + 10;
	while (itd_now() < deadline && !log_line_has("SIGHUP: reloaded", "changed live"))
		usleep(20000);
	for (size_t i = 0; i < sizeof(live) / sizeof(live[0]); i++)
		cr_assert(log_line_has("SIGHUP: reloaded", live[i]), "%s not said to have changed "
		    "live: %s", live[i], itd_log_text(&daemon_));
	for (size_t i = 0; i < sizeof(restart) / sizeof(restart[0]); i++)
		cr_assert(log_line_has("SIGHUP: changed in", restart[i]), "%s not said to need a "
		    "restart: %s", restart[i], itd_log_text(&daemon_));
	cr_assert_not(log_line_has("SIGHUP: reloaded", "swap.paths"), "%s",
	    itd_log_text(&daemon_));
	cr_assert_not(log_line_has("SIGHUP: changed in", "xfer_window"), "%s",
	    itd_log_text(&daemon_));
	/* Applied: a new window has the new size, a new job the new policy. */
	fd = raw_socket_to(daemon_.socket, false);
	cr_assert_geq(fd, 0);
	itd_raw_hello(fd);
	memset(&m, 0, sizeof(m));
	itd_raw_send(fd, ZP_XFER_OPEN, 5, &m);
	cr_assert(itd_raw_recv(fd, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_XFER_OK, "%s", zp_type_name(m.hdr.type));
	cr_assert_eq(m.u.xfer_ok.bytes, 4 << 20, "window of %llu bytes",
	    (unsigned long long)m.u.xfer_ok.bytes);
	close(fd);
	c = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open(c, "reloaded", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_jobs_json(c, &json), 0, "%s", zc_errmsg(c));
	cr_assert(strstr(json, "\"policy\":\"cpu\"") != NULL, "%s", json);
	free(json);
	cr_assert_eq(itd_stat(c, "limits.detach_grace_s"), 5);
	cr_assert_eq(itd_stat(c, "worker_threads"), 2, "the worker count changed live");
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}
