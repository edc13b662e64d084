/* zoffloadd speaks sd_notify to a fake $NOTIFY_SOCKET: READY=1 with STATUS=, WATCHDOG=1 at half of $WATCHDOG_USEC, STOPPING=1 on SIGTERM. */
#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "svc.h"

static struct itd daemon_;
static int notify_fd = -1;
static char notify_path[108];

static void
teardown(void)
{
	itd_cleanup(&daemon_);
	if (notify_fd >= 0) {
		close(notify_fd);
		unlink(notify_path);
		notify_fd = -1;
	}
}

TestSuite(notify, .fini = teardown, .timeout = 60);

/* What systemd binds: a datagram socket whose path the service finds in $NOTIFY_SOCKET. */
static void
bind_notify_socket(void)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	char dir[] = "/tmp/zoff-notify-XXXXXX";

	cr_assert_not_null(mkdtemp(dir));
	snprintf(notify_path, sizeof(notify_path), "%s/notify", dir);
	notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	cr_assert_geq(notify_fd, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", notify_path);
	cr_assert_eq(bind(notify_fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "bind: %s",
	    strerror(errno));
	cr_assert_eq(setenv("NOTIFY_SOCKET", notify_path, 1), 0);
}

/* One datagram within timeout_s, NUL-terminated; false when none came. */
static bool
next_notification(char *buf, size_t len, double timeout_s)
{
	struct pollfd p = { .fd = notify_fd, .events = POLLIN };
	ssize_t n;

	if (poll(&p, 1, (int)(timeout_s * 1000)) != 1)
		return false;
	n = recv(notify_fd, buf, len - 1, 0);
	cr_assert_geq(n, 0, "recv: %s", strerror(errno));
	buf[n] = '\0';
	return true;
}

/* True when the datagram holds this exact assignment as one of its lines. */
static bool
has_line(const char *msg, const char *line)
{
	size_t n = strlen(line);

	for (const char *p = msg; p != NULL; ) {
		if (strncmp(p, line, n) == 0 && (p[n] == '\n' || p[n] == '\0'))
			return true;
		p = strchr(p, '\n');
		if (p != NULL)
			p++;
	}
	return false;
}

Test(notify, ready_watchdog_stopping)
{
	char msg[1024], status_line[1024] = "";
	unsigned watchdogs_after_ready = 0;
	bool ready = false, stopping = false;
	double deadline;
	int status;

	bind_notify_socket();
	/* 200 ms asked for, so a ping every 100 ms; WATCHDOG_PID unset means "this process". */
	cr_assert_eq(setenv("WATCHDOG_USEC", "200000", 1), 0);
	unsetenv("WATCHDOG_PID");
	itd_start(&daemon_, NULL);

	/* Bounded in count as well as time: 200 datagrams is far more than 10 s of pings. */
	deadline = itd_now() + 10;
	for (int i = 0; i < 200 && itd_now() < deadline && watchdogs_after_ready < 2; i++) {
		if (!next_notification(msg, sizeof(msg), deadline - itd_now()))
			break;
		if (has_line(msg, "READY=1")) {
			ready = true;
			snprintf(status_line, sizeof(status_line), "%s", msg);
		}
		if (ready && has_line(msg, "WATCHDOG=1"))
			watchdogs_after_ready++;
	}
	cr_assert(ready, "no READY=1 from zoffloadd: %s", itd_log_text(&daemon_));
	cr_assert(strstr(status_line, "\nSTATUS=") != NULL || strncmp(status_line, "STATUS=", 7) == 0,
	    "READY=1 came without STATUS=: '%s'", status_line);
	cr_assert(strstr(status_line, daemon_.socket) != NULL,
	    "STATUS= does not say where it listens: '%s'", status_line);
	cr_assert_geq(watchdogs_after_ready, 2, "%u WATCHDOG=1 after READY=1 within 10 s",
	    watchdogs_after_ready);

	cr_assert_eq(kill(daemon_.pid, SIGTERM), 0);
	deadline = itd_now() + 10;
	for (int i = 0; i < 200 && !stopping && itd_now() < deadline; i++) {
		if (!next_notification(msg, sizeof(msg), deadline - itd_now()))
			break;
		stopping = has_line(msg, "STOPPING=1");
	}
	cr_assert(stopping, "no STOPPING=1 after SIGTERM: %s", itd_log_text(&daemon_));
	status = itd_wait(&daemon_, 10);
	cr_assert(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
	    "status 0x%x after SIGTERM: %s", status, itd_log_text(&daemon_));
}

/* systemd sets WATCHDOG_PID to the main process; a daemon started by that process must not ping for it. */
Test(notify, watchdog_for_another_pid)
{
	char msg[1024], pid[32];
	bool ready = false;
	unsigned watchdogs = 0;
	double deadline;

	bind_notify_socket();
	cr_assert_eq(setenv("WATCHDOG_USEC", "200000", 1), 0);
	snprintf(pid, sizeof(pid), "%d", (int)getpid());
	cr_assert_eq(setenv("WATCHDOG_PID", pid, 1), 0);
	itd_start(&daemon_, NULL);
	deadline = itd_now() + 10;
	for (int i = 0; i < 50 && !ready && itd_now() < deadline; i++) {
		if (!next_notification(msg, sizeof(msg), deadline - itd_now()))
			break;
		ready = has_line(msg, "READY=1");
		watchdogs += has_line(msg, "WATCHDOG=1");
	}
	cr_assert(ready, "no READY=1: %s", itd_log_text(&daemon_));
	/* Five ping intervals: a daemon that pinged would have sent several by now. */
	for (int i = 0; i < 100 && next_notification(msg, sizeof(msg), 0.5); i++)
		watchdogs += has_line(msg, "WATCHDOG=1");
	cr_assert_eq(watchdogs, 0, "WATCHDOG=1 sent although WATCHDOG_PID names another process");
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}
