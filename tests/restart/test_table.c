/*
 * The recovery table's job slots are shared by every uid: one uid must not take them all,
 * and a job that cannot have a slot is refused up front, never kept without one (a tensor
 * kept for a job the table does not list made every later restart refuse, for everyone).
 * A table that cannot be made at all fails the start, by name.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "standin.h"
#include "zclient.h"

static struct zst st_;

static void
teardown(void)
{
	zst_fini(&st_);
}

TestSuite(table, .fini = teardown, .timeout = 300);

/* What the hostile uid got: how many jobs it opened, and the refusal that stopped it. */
struct report {
	int opened;
	int code;
	char text[300];
};

static void
register_one(struct zc_conn *c, const char *name, struct zc_tensor **t)
{
	struct zc_tensor_desc d = { .name = name, .numel = 1024, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	static float init[1024];

	(void)zc_tensor_register(c, &d, init, t);
}

/*
 * As uid 65534: jobs of one tensor each, left detached (its connections come and go, as
 * limits.max_clients_per_uid has them), until one is refused (at most `most`); the report
 * goes to fd, then it waits until `hold` closes.
 */
static void
hostile(const char *socket, int most, int fd, int hold)
{
	struct report rep = { 0 };
	char name[32], byte;

	if (setgid(65534) != 0 || setuid(65534) != 0) {
		rep.code = -errno;
		snprintf(rep.text, sizeof(rep.text), "setuid: %s", strerror(errno));
		goto out;
	}
	for (; rep.opened < most; rep.opened++) {
		struct zc_conn *c = NULL;
		struct zc_tensor *t;
		int r = zc_connect(socket, &c);

		if (r < 0) {
			rep.code = r;
			snprintf(rep.text, sizeof(rep.text), "connect: %s", zc_connect_errmsg());
			break;
		}
		snprintf(name, sizeof(name), "h%d", rep.opened);
		r = zc_job_open(c, name, 0, 1);
		if (r < 0) {
			rep.code = r;
			snprintf(rep.text, sizeof(rep.text), "%s", zc_errmsg(c));
			break;
		}
		register_one(c, "w", &t);
		/* Without JOB_CLOSE: a rank that died, its job kept detached. */
		zc_disconnect(c);
	}
out:
	(void)!write(fd, &rep, sizeof(rep));
	(void)!read(hold, &byte, 1);
	_exit(0);
}

static const char *const *
argv_for(char *sock, size_t socklen, char *config, size_t configlen)
{
	static const char *argv[6];
	const char *daemon = getenv("ZOFFLOADD");
	FILE *f;

	cr_assert_not_null(daemon, "$ZOFFLOADD is not set");
	snprintf(sock, socklen, "%s/sock", st_.dir);
	snprintf(config, configlen, "%s/zoffload.conf", st_.dir);
	f = fopen(config, "w");
	cr_assert_not_null(f);
	fprintf(f, "{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"info\" },\n"
	    "  \"socket\": { \"mode\": \"0666\" } }\n");
	fclose(f);
	argv[0] = daemon;
	argv[1] = "--config";
	argv[2] = config;
	argv[3] = "--socket";
	argv[4] = sock;
	argv[5] = NULL;
	return argv;
}

Test(table, one_uid_cannot_fill_the_recovery_table)
{
	char sock[160], config[160];
	const char *const *argv;
	struct report rep;
	struct zc_conn *v = NULL;
	struct zc_tensor *t = NULL;
	int rp[2], hold[2], status;
	pid_t child;

	if (geteuid() != 0)
		cr_skip_test("needs root to run a second uid");
	cr_assert_eq(zst_init(&st_), 0);
	cr_assert_eq(chmod(st_.dir, 0755), 0);
	argv = argv_for(sock, sizeof(sock), config, sizeof(config));
	cr_assert_eq(zst_start(&st_, argv), 0);
	cr_assert_eq(zst_wait_ready(&st_, 1, 30), 0, "%s", zst_log(&st_));

	cr_assert_eq(pipe(rp), 0);
	cr_assert_eq(pipe(hold), 0);
	child = fork();
	cr_assert_geq(child, 0);
	if (child == 0) {
		close(rp[0]);
		close(hold[1]);
		hostile(sock, 400, rp[1], hold[0]);
	}
	close(rp[1]);
	close(hold[0]);
	cr_assert_eq(read(rp[0], &rep, sizeof(rep)), (ssize_t)sizeof(rep));
	close(rp[0]);
	cr_assert_eq(rep.code, -EDQUOT, "the hostile uid opened %d jobs, then %d: %s",
	    rep.opened, rep.code, rep.text);
	cr_assert_eq(rep.opened, 256, "the hostile uid opened %d jobs", rep.opened);
	cr_assert(strstr(rep.text, "recovery table") != NULL, "%s", rep.text);

	/* Another uid's job has its slot, and its state comes back after a SIGKILL. */
	cr_assert_eq(zc_connect(sock, &v), 0);
	zc_set_reconnect(v, 0);
	cr_assert_eq(zc_job_open(v, "victim", 0, 1), 0, "%s", zc_errmsg(v));
	register_one(v, "w", &t);
	cr_assert_not_null(t, "%s", zc_errmsg(v));
	kill(st_.pid, SIGKILL);
	status = zst_wait_exit(&st_, 30);
	cr_assert(WIFSIGNALED(status), "status 0x%x", status);
	zc_disconnect(v);
	close(hold[1]);
	cr_assert_eq(waitpid(child, &status, 0), child);

	cr_assert_eq(zst_start(&st_, argv), 0);
	cr_assert_eq(zst_wait_ready(&st_, 2, 60), 0, "the restart refused: %s", zst_log(&st_));
	cr_assert(strstr(zst_log(&st_), "refusing to start") == NULL, "%s", zst_log(&st_));
	cr_assert_eq(zc_connect(sock, &v), 0);
	cr_assert_eq(zc_job_open(v, "victim", 0, 1), 0, "%s", zc_errmsg(v));
	t = NULL;
	register_one(v, "w", &t);
	cr_assert_not_null(t, "%s", zc_errmsg(v));
	cr_assert(strstr(zst_log(&st_), "recovered ") != NULL, "%s", zst_log(&st_));
	zc_disconnect(v);
	kill(st_.pid, SIGTERM);
	(void)zst_wait_exit(&st_, 30);
}

/*
 * A table that cannot be made (here its memfd cannot be sized: the table is larger than
 * RLIMIT_FSIZE) fails the start at once, by name, before the engine is made; the daemon
 * went on with no table when the error's sign was lost, and said nothing when it was not.
 */
Test(table, a_table_that_cannot_be_made_fails_the_start)
{
	struct rlimit small = { .rlim_cur = 64 << 10, .rlim_max = RLIM_INFINITY };
	char sock[160], config[160];
	const char *const *argv;
	int status;

	cr_assert_eq(zst_init(&st_), 0);
	argv = argv_for(sock, sizeof(sock), config, sizeof(config));
	/* Both inherited by the daemon: ftruncate then fails with EFBIG, not SIGXFSZ. */
	cr_assert_eq(setrlimit(RLIMIT_FSIZE, &small), 0, "setrlimit: %s", strerror(errno));
	signal(SIGXFSZ, SIG_IGN);
	cr_assert_eq(zst_start(&st_, argv), 0);
	status = zst_wait_exit(&st_, 60);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 1, "status 0x%x: %s", status,
	    zst_log(&st_));
	cr_assert_eq(st_.readies, 0, "%s", zst_log(&st_));
	cr_assert(strstr(zst_log(&st_), "cannot make the recovery table: File too large") != NULL,
	    "%s", zst_log(&st_));
}

/*
 * memfd_create answering EMFILE for this process and what it starts (a seccomp filter is
 * inherited across fork and exec).  The table is the start's first memfd, so the start fails
 * there, before any other; the test's own harness needs none after zst_init.
 */
static int
refuse_memfd_create(void)
{
	struct sock_filter code[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_memfd_create, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EMFILE & SECCOMP_RET_DATA)),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = { .len = sizeof(code) / sizeof(code[0]), .filter = code };

	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
		return -errno;
	if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0)
		return -errno;
	return 0;
}

Test(table, a_table_without_its_memfd_fails_the_start)
{
	char sock[160], config[160];
	const char *const *argv;
	int status, r;

#if !defined(__x86_64__)
	cr_skip("the filter is written for x86-64's system call numbers");
#endif
	cr_assert_eq(zst_init(&st_), 0);
	argv = argv_for(sock, sizeof(sock), config, sizeof(config));
	r = refuse_memfd_create();
	cr_assert_eq(r, 0, "seccomp: %s", strerror(-r));
	cr_assert_eq(zst_start(&st_, argv), 0);
	status = zst_wait_exit(&st_, 60);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 1, "status 0x%x: %s", status,
	    zst_log(&st_));
	cr_assert_eq(st_.readies, 0, "%s", zst_log(&st_));
	cr_assert(strstr(zst_log(&st_), "cannot make the recovery table: Too many open files") !=
	    NULL, "%s", zst_log(&st_));
}
