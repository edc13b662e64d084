/* Service-test helpers on top of itd: a daemon's descriptors and memory from /proc, waiting on stats, child processes that report back. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <grp.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "svc.h"

unsigned
svc_fd_count(pid_t pid)
{
	char path[64];
	struct dirent *e;
	unsigned n = 0;
	DIR *dir;

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
	dir = opendir(path);
	cr_assert_not_null(dir, "opendir %s: %s", path, strerror(errno));
	while ((e = readdir(dir)) != NULL)
		if (e->d_name[0] != '.')
			n++;
	closedir(dir);
	return n;
}

uint64_t
svc_rss_kib(pid_t pid)
{
	char path[64], line[256];
	unsigned long long kib = 0;
	bool found = false;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	f = fopen(path, "r");
	cr_assert_not_null(f, "%s: %s", path, strerror(errno));
	while (fgets(line, sizeof(line), f) != NULL)
		if (sscanf(line, "VmRSS: %llu kB", &kib) == 1)
			found = true;
	fclose(f);
	cr_assert(found, "%s has no VmRSS line", path);
	return kib;
}

double
svc_wait_stat(struct zc_conn *c, const char *path, double want, double timeout_s)
{
	double deadline = itd_now() + timeout_s, v;

	for (;;) {
		v = itd_stat(c, path);
		if (v == want || itd_now() > deadline)
			return v;
		usleep(10000);
	}
}

unsigned
svc_wait_fds(pid_t pid, unsigned want, double timeout_s)
{
	double deadline = itd_now() + timeout_s;
	unsigned n;

	for (;;) {
		n = svc_fd_count(pid);
		if (n == want || itd_now() > deadline)
			return n;
		usleep(10000);
	}
}

void
svc_in_child(uid_t uid, void (*fn)(void *arg, struct svc_report *out), void *arg,
    struct svc_report *ret)
{
	struct svc_report rep = { .result = -EIO };
	struct pollfd pfd;
	int p[2], status;
	pid_t pid;
	ssize_t n;

	cr_assert_eq(pipe(p), 0);
	pid = fork();
	cr_assert_geq(pid, 0, "fork: %s", strerror(errno));
	if (pid == 0) {
		close(p[0]);
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (uid != (uid_t)-1 && (setgroups(0, NULL) != 0 || setgid(uid) != 0 ||
		    setuid(uid) != 0)) {
			snprintf(rep.text, sizeof(rep.text), "cannot become uid %u: %s",
			    (unsigned)uid, strerror(errno));
		} else {
			fn(arg, &rep);
		}
		(void)!write(p[1], &rep, sizeof(rep));
		_exit(0);
	}
	close(p[1]);
	pfd = (struct pollfd){ .fd = p[0], .events = POLLIN };
	cr_assert_eq(poll(&pfd, 1, 30000), 1, "the child did not report within 30 s");
	n = read(p[0], &rep, sizeof(rep));
	close(p[0]);
	cr_assert_eq(waitpid(pid, &status, 0), pid);
	cr_assert_eq(n, (ssize_t)sizeof(rep), "the child died before reporting (status 0x%x)",
	    status);
	*ret = rep;
}

int
svc_run(const char *const *argv, char *out, size_t outlen, double timeout_s)
{
	char path[] = "/tmp/zoff-svc-run-XXXXXX";
	double deadline = itd_now() + timeout_s;
	int fd, status = -1;
	ssize_t n;
	pid_t pid;

	fd = mkstemp(path);
	cr_assert_geq(fd, 0);
	unlink(path);
	pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		dup2(fd, STDOUT_FILENO);
		dup2(fd, STDERR_FILENO);
		execv(argv[0], (char *const *)argv);
		_exit(127);
	}
	for (;;) {
		pid_t r = waitpid(pid, &status, WNOHANG);

		if (r == pid)
			break;
		if (itd_now() > deadline) {
			kill(pid, SIGKILL);
			waitpid(pid, NULL, 0);
			status = -1;
			break;
		}
		usleep(2000);
	}
	n = pread(fd, out, outlen - 1, 0);
	out[n > 0 ? n : 0] = '\0';
	close(fd);
	return status;
}

bool
svc_asan(void)
{
#if defined(__SANITIZE_ADDRESS__)
	return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
	return true;
#else
	return false;
#endif
#else
	return false;
#endif
}
