/* Temporaries of rank files being saved: locked while written, removed once their writer died. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_tmpfile.h"

/* fd is the file that path names now (nobody unlinked or replaced it). */
static bool
still_named(int fd, const char *path)
{
	struct stat a, b;

	return fstat(fd, &a) == 0 && lstat(path, &b) == 0 && a.st_dev == b.st_dev &&
	    a.st_ino == b.st_ino;
}

int
zck_tmp_create(const char *path)
{
	for (unsigned tries = 0;; tries++) {
		int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
		int r;

		if (fd < 0)
			return -errno;
		do
			r = flock(fd, LOCK_EX);
		while (r < 0 && errno == EINTR);
		/*
		 * A file system without flock: unlocked, but a cleaner cannot lock it either,
		 * so it leaves the file alone.
		 */
		if (r < 0)
			return fd;
		/*
		 * Between the open and the lock a cleaner may have found the file unlocked and
		 * removed it (it holds the lock meanwhile, so flock waited): then path is no
		 * longer this file, and a file of our own is made again.  Inode numbers that
		 * never match (an odd file system) end it after a few tries: at worst the
		 * rename fails, with an error.
		 */
		if (still_named(fd, path) || tries == 8)
			return fd;
		close(fd);
	}
}

/* `.rank-RRRRR-of-WWWWW.safetensors.PID.tmp`, as zc_checkpoint_save names them. */
static bool
is_tmp_name(const char *name)
{
	unsigned rank, world, pid;
	int used = 0;

	return sscanf(name, ".rank-%5u-of-%5u.safetensors.%u.tmp%n", &rank, &world, &pid,
	    &used) == 3 && used > 0 && name[used] == '\0';
}

int
zck_tmp_remove_stale(const char *dir)
{
	struct dirent *de;
	int dfd, n = 0;
	DIR *d;

	dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0)
		return -errno;
	d = fdopendir(dfd);
	if (d == NULL) {
		n = -errno;
		close(dfd);
		return n;
	}
	while ((de = readdir(d)) != NULL) {
		struct stat a, b;
		int fd;

		if (!is_tmp_name(de->d_name))
			continue;
		fd = openat(dfd, de->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
		if (fd < 0)
			continue;
		/*
		 * Locked: its writer lives (or zoffloadd still writes through the descriptor
		 * it was passed).  A file system without flock says so here too: left alone.
		 * Ours: removed while we hold it, if the name is still this file.
		 */
		if (flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &a) == 0 && S_ISREG(a.st_mode) &&
		    fstatat(dfd, de->d_name, &b, AT_SYMLINK_NOFOLLOW) == 0 &&
		    a.st_dev == b.st_dev && a.st_ino == b.st_ino && unlinkat(dfd, de->d_name, 0) == 0)
			n++;
		close(fd);
	}
	closedir(d);
	return n;
}
