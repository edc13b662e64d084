/*
 * A save whose fsync fails (the file's, or its directory's after the rename) fails with the
 * error named, not a save that says it is durable: a disk that loses writes reports it at
 * fsync.  The file's failure leaves the earlier checkpoint in the directory and no
 * temporary.  fsync is this program's own (libzclient's calls come here: an executable's
 * symbols come first), failing for the descriptors of the paths the test names.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ck.h"

#define K 3

static struct itd d;
static char swapdir[64], ckdir[64];
/* fsync fails for a path holding fail_sub, or equal to fail_exact; NULL: neither. */
static const char *fail_sub, *fail_exact;
static unsigned fsyncs_failed;

/* Default visibility (the build hides symbols): exported, so libzclient's calls bind here. */
__attribute__((visibility("default"))) int fsync(int fd);

int
fsync(int fd)
{
	char link[64], path[512];
	ssize_t n;

	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	n = readlink(link, path, sizeof(path) - 1);
	if (n > 0) {
		path[n] = '\0';
		if ((fail_sub != NULL && strstr(path, fail_sub) != NULL) ||
		    (fail_exact != NULL && strcmp(path, fail_exact) == 0)) {
			fsyncs_failed++;
			errno = EIO;
			return -1;
		}
	}
	return (int)syscall(SYS_fsync, fd);
}

static void
teardown(void)
{
	fail_sub = fail_exact = NULL;
	itd_cleanup(&d);
	ck_rmdir(ckdir);
	ck_rmdir(swapdir);
}

TestSuite(fsync, .fini = teardown, .timeout = 120);

static unsigned
temporaries(const char *dir)
{
	DIR *dp = opendir(dir);
	struct dirent *de;
	unsigned n = 0;

	cr_assert_not_null(dp);
	while ((de = readdir(dp)) != NULL)
		n += strstr(de->d_name, ".tmp") != NULL;
	closedir(dp);
	return n;
}

Test(fsync, a_failed_fsync_fails_the_save_by_name)
{
	struct zc_step_params sp = ck_params(ZC_ADAMW, K);
	struct ck_state want, got;
	struct ck_job a, b;
	struct zc_checkpoint_entry es[CK_PARAMS];
	char config[512];
	size_t n = 0;
	int r;

	ck_tmpdir(swapdir, sizeof(swapdir), "swap");
	ck_config(config, sizeof(config), swapdir);
	itd_start(&d, config);
	ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
	ck_job_start(&a, &d, "fsync", 1, ZC_ADAMW, ZC_POLICY_CPU);
	ck_job_steps(&a, 1, K);
	ck_job_save(&a, ckdir, K);
	ck_job_gather(&a, &want);
	ck_job_steps(&a, K + 1, K + 1);
	for (unsigned p = 0; p < CK_PARAMS; p++)
		es[n++] = (struct zc_checkpoint_entry){ a.r[0].t[p], ck_param_name[p], 0,
			ck_param_numel[p] };
	sp.step = K + 1;

	/* The new file's fsync: the save fails, the step-K file stays, no temporary is left. */
	fail_sub = ".tmp";
	r = zc_checkpoint_save(a.r[0].c, ckdir, es, n, &sp);
	cr_assert_eq(r, -EIO, "%d: %s", r, zc_errmsg(a.r[0].c));
	cr_assert_eq(fsyncs_failed, 1);
	cr_assert(strstr(zc_errmsg(a.r[0].c), ".tmp: Input/output error") != NULL, "%s",
	    zc_errmsg(a.r[0].c));
	cr_assert_eq(temporaries(ckdir), 0);
	fail_sub = NULL;
	ck_job_restore(&b, &d, "fsync-b", 1, ZC_ADAMW, ZC_POLICY_CPU, ckdir, K);
	ck_job_gather(&b, &got);
	ck_assert_same(&want, &got, "the checkpoint before the failed save");
	ck_state_free(&got);
	ck_job_close(&b);

	/* The directory's, after the rename: the file is there, but the save says it failed. */
	fail_exact = ckdir;
	r = zc_checkpoint_save(a.r[0].c, ckdir, es, n, &sp);
	cr_assert_eq(r, -EIO, "%d: %s", r, zc_errmsg(a.r[0].c));
	cr_assert(strstr(zc_errmsg(a.r[0].c), "fsync of") != NULL &&
	    strstr(zc_errmsg(a.r[0].c), ": Input/output error") != NULL, "%s",
	    zc_errmsg(a.r[0].c));
	cr_assert_eq(fsyncs_failed, 2);
	fail_exact = NULL;
	/* The job goes on, and a save works again. */
	ck_job_steps(&a, K + 2, K + 2);
	sp.step = K + 2;
	cr_assert_eq(zc_checkpoint_save(a.r[0].c, ckdir, es, n, &sp), 0, "%s",
	    zc_errmsg(a.r[0].c));
	ck_state_free(&want);
	ck_job_close(&a);
}
