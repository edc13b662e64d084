/*
 * A save's temporary is created and locked even when a cleaner removes the file it first
 * opened (the cleaner locked it first: a dead writer's file of the same name).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_tmpfile.h"

static char dir[64], path[128];

static void
teardown(void)
{
	if (path[0] != '\0')
		(void)unlink(path);
	if (dir[0] != '\0')
		(void)rmdir(dir);
}

TestSuite(tmpfile, .fini = teardown, .timeout = 60);

static void *
writer(void *arg)
{
	int *fd = arg;

	*fd = zck_tmp_create(path);
	return NULL;
}

Test(tmpfile, created_again_after_a_cleaner_removed_it)
{
	struct stat a, b;
	pthread_t th;
	int cleaner, fd = -1;

	snprintf(dir, sizeof(dir), "/tmp/zoff-tmpfile-XXXXXX");
	cr_assert_not_null(mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/.rank-00000-of-00001.safetensors.7.tmp", dir);
	/* A dead writer's file, which a cleaner has locked and is about to remove. */
	cleaner = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	cr_assert_geq(cleaner, 0, "%s", strerror(errno));
	cr_assert_eq(flock(cleaner, LOCK_EX), 0);
	cr_assert_eq(pthread_create(&th, NULL, writer, &fd), 0);
	/* The writer opens the same file and waits for the lock (no check of how long). */
	usleep(100000);
	cr_assert_eq(unlink(path), 0);
	close(cleaner);
	cr_assert_eq(pthread_join(th, NULL), 0);
	cr_assert_geq(fd, 0, "zck_tmp_create: %s", strerror(-fd));
	/* The writer's file is the one the name holds, and it is locked. */
	cr_assert_eq(fstat(fd, &a), 0);
	cr_assert_eq(lstat(path, &b), 0, "the writer's temporary has no name: %s", strerror(errno));
	cr_assert(a.st_ino == b.st_ino && a.st_dev == b.st_dev, "the writer holds a removed file");
	cleaner = open(path, O_RDONLY);
	cr_assert_geq(cleaner, 0);
	cr_assert_eq(flock(cleaner, LOCK_EX | LOCK_NB), -1, "the writer's file is not locked");
	cr_assert_eq(errno, EWOULDBLOCK);
	/* A cleaner now leaves it alone, and takes it once the writer is gone. */
	cr_assert_eq(zck_tmp_remove_stale(dir), 0);
	cr_assert_eq(lstat(path, &b), 0);
	close(fd);
	cr_assert_eq(zck_tmp_remove_stale(dir), 1);
	close(cleaner);
	cr_assert_neq(lstat(path, &b), 0);
	path[0] = '\0';
}
