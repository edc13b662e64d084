/* Swap files: open with O_DIRECT, learn the DIO alignment, preallocate. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE	/* statx, fallocate, O_DIRECT, strerrordesc_np */
#endif
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ctype.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/sysmacros.h>
#include <sys/stat.h>
#include <unistd.h>

#include "swap_impl.h"

/* When the kernel cannot say (no STATX_DIOALIGN): right for 512e and 4Kn drives alike. */
#define DIO_ALIGN_FALLBACK 4096u

static int
fail(struct zs_error_info *info, const char *step, int cause, int code)
{
	if (info != NULL) {
		info->step = step;
		info->cause = cause;
	}
	return code;
}

/* Whether any descriptor in /proc/pid/fdinfo holds a lock on the file whose key is needle. */
static bool
fdinfo_has_lock(const char *pid, const char *needle)
{
	char path[320], buf[4096];
	struct dirent *e;
	bool found = false;
	DIR *dir;

	snprintf(path, sizeof(path), "/proc/%s/fdinfo", pid);
	dir = opendir(path);
	if (dir == NULL)
		return false;
	while (!found && (e = readdir(dir)) != NULL) {
		ssize_t n;
		int fd;

		if (!isdigit((unsigned char)e->d_name[0]))
			continue;
		snprintf(path, sizeof(path), "/proc/%s/fdinfo/%s", pid, e->d_name);
		fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		n = read(fd, buf, sizeof(buf) - 1);
		close(fd);
		if (n <= 0)
			continue;
		buf[n] = '\0';
		for (char *line = strstr(buf, "lock:"); line != NULL; line = strstr(line + 1, "lock:"))
			if (strstr(line, needle) != NULL) {
				found = true;
				break;
			}
	}
	closedir(dir);
	return found;
}

/*
 * Who holds the lock on fd's file: OFD locks show no pid (F_OFD_GETLK and
 * /proc/locks say -1), so look for the lock among every process's
 * descriptors, which /proc/PID/fdinfo lists with the file's device and inode.
 */
static int
lock_holder(int fd)
{
	char needle[64];
	struct dirent *e;
	struct stat st;
	int pid = 0;
	DIR *proc;

	if (fstat(fd, &st) != 0)
		return 0;
	snprintf(needle, sizeof(needle), " %02x:%02x:%llu ", major(st.st_dev), minor(st.st_dev),
	    (unsigned long long)st.st_ino);
	proc = opendir("/proc");
	if (proc == NULL)
		return 0;
	while (pid == 0 && (e = readdir(proc)) != NULL) {
		if (!isdigit((unsigned char)e->d_name[0]) || atoi(e->d_name) == getpid())
			continue;
		if (fdinfo_has_lock(e->d_name, needle))
			pid = atoi(e->d_name);
	}
	closedir(proc);
	return pid;
}

/*
 * Two daemons on one swap path would overwrite each other's state: the
 * path is locked for as long as it is open, by its open file description
 * (an OFD lock on a file or device, flock on a directory, which cannot be
 * opened for writing), so no other process can take it.  -EBUSY and the
 * holder's pid when one does.
 */
static int
lock_path(int fd, bool dir, struct zs_error_info *info)
{
	struct flock l = { .l_type = F_WRLCK, .l_whence = SEEK_SET };
	int r = dir ? flock(fd, LOCK_EX | LOCK_NB) : fcntl(fd, F_OFD_SETLK, &l);

	if (r == 0)
		return 0;
	r = errno;
	if (r != EAGAIN && r != EACCES && r != EWOULDBLOCK)
		return fail(info, "lock", -r, -r);
	if (info != NULL)
		info->holder_pid = lock_holder(fd);
	return fail(info, "lock", -EBUSY, -EBUSY);
}

/*
 * An unnamed file in the directory: swap is scratch, so nothing is left
 * behind when the daemon dies.  Filesystems without O_TMPFILE get a named
 * file that is unlinked at once.
 */
static int
open_in_dir(const char *dir)
{
	char *name = NULL;
	int fd, tmp;

	fd = open(dir, O_TMPFILE | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
	if (fd >= 0 || (errno != EOPNOTSUPP && errno != EISDIR))
		return fd >= 0 ? fd : -errno;

	if (asprintf(&name, "%s/.zoffload-swap-XXXXXX", dir) < 0)
		return -ENOMEM;
	tmp = mkostemp(name, O_CLOEXEC);
	if (tmp < 0) {
		fd = -errno;
		goto out;
	}
	fd = open(name, O_RDWR | O_DIRECT | O_CLOEXEC);
	if (fd < 0)
		fd = -errno;
	(void)unlink(name);
	close(tmp);
out:
	free(name);
	return fd;
}

static void
dio_alignment(struct zs_file *f, bool blockdev)
{
	f->dio_offset_align = DIO_ALIGN_FALLBACK;
	f->dio_mem_align = DIO_ALIGN_FALLBACK;
#ifdef STATX_DIOALIGN
	struct statx stx;

	if (statx(f->fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 &&
	    (stx.stx_mask & STATX_DIOALIGN)) {
		/* Zero means no O_DIRECT; the probe read reports it. */
		f->dio_offset_align = stx.stx_dio_offset_align;
		f->dio_mem_align = stx.stx_dio_mem_align;
		return;
	}
#endif
	if (blockdev) {
		int lbs;

		if (ioctl(f->fd, BLKSSZGET, &lbs) == 0 && lbs > 0) {
			f->dio_offset_align = (uint32_t)lbs;
			f->dio_mem_align = (uint32_t)lbs;
		}
	}
}

/*
 * Some filesystems accept O_DIRECT at open and refuse it at the first I/O;
 * find out now rather than mid-training.
 */
static int
probe_direct(struct zs_file *f)
{
	size_t align = f->dio_offset_align > f->dio_mem_align ?
	    f->dio_offset_align : f->dio_mem_align;
	void *buf;
	ssize_t n;
	int r = 0;

	if (align < 512)
		align = 512;
	if (posix_memalign(&buf, align < 4096 ? 4096 : align, align) != 0)
		return -ENOMEM;
	n = pread(f->fd, buf, f->dio_offset_align, 0);
	if (n < 0)
		r = -errno;
	free(buf);
	return r;
}

int
zs_file_open(const struct zs_path *path, uint64_t capacity, struct zs_file *f,
    struct zs_error_info *info)
{
	struct stat st;
	bool created = false, blockdev = false;
	int r;

	memset(f, 0, sizeof(*f));
	f->fd = -1;
	f->lock_fd = -1;
	if (path->path == NULL || path->path[0] == '\0')
		return fail(info, "path", -EINVAL, -EINVAL);

	if (path->kept_fd > 2) {
		/* Kept: already locked (the lock is the kept description's) and preallocated. */
		f->fd = path->kept_fd;
		f->lock_fd = path->kept_lock_fd > 2 ? path->kept_lock_fd : -1;
		if (fstat(f->fd, &st) < 0) {
			r = fail(info, "fstat", -errno, -errno);
			goto err;
		}
		blockdev = S_ISBLK(st.st_mode);
		f->regular = S_ISREG(st.st_mode);
		if (blockdev && capacity == 0 && ioctl(f->fd, BLKGETSIZE64, &capacity) < 0) {
			r = fail(info, "BLKGETSIZE64", -errno, -errno);
			goto err;
		}
		goto opened;
	}
	if (stat(path->path, &st) == 0 && S_ISDIR(st.st_mode)) {
		f->lock_fd = open(path->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		if (f->lock_fd < 0)
			return fail(info, "open", -errno, -errno);
		r = lock_path(f->lock_fd, true, info);
		if (r < 0)
			goto err;
		f->fd = open_in_dir(path->path);
		if (f->fd < 0) {
			r = f->fd;
			goto open_failed;
		}
	} else {
		f->fd = open(path->path, O_RDWR | O_DIRECT | O_CLOEXEC);
		if (f->fd < 0 && errno == ENOENT) {
			f->fd = open(path->path, O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
			created = f->fd >= 0;
		}
		if (f->fd < 0) {
			r = -errno;
			goto open_failed;
		}
		/* Before anything is written: a file in use is left exactly as it was. */
		r = lock_path(f->fd, false, info);
		if (r < 0)
			goto err;
	}
	if (fstat(f->fd, &st) < 0) {
		r = fail(info, "fstat", -errno, -errno);
		goto err;
	}
	blockdev = S_ISBLK(st.st_mode);
	f->regular = S_ISREG(st.st_mode);
	if (!blockdev && !S_ISREG(st.st_mode)) {
		r = fail(info, "open", -EINVAL, -EINVAL);
		goto err;
	}

	if (blockdev) {
		uint64_t size;

		if (ioctl(f->fd, BLKGETSIZE64, &size) < 0) {
			r = fail(info, "BLKGETSIZE64", -errno, -errno);
			goto err;
		}
		if (capacity == 0)
			capacity = size;
		if (capacity > size) {
			r = fail(info, "capacity", -ENOSPC, -ENOSPC);
			goto err;
		}
	} else {
		if (capacity == 0) {
			r = fail(info, "capacity", -EINVAL, -EINVAL);
			goto err;
		}
		/*
		 * Reserve every block now: a full disk then fails the daemon's
		 * start, not a write in the middle of a run.
		 */
		if (fallocate(f->fd, 0, 0, (off_t)capacity) < 0) {
			r = fail(info, "fallocate", -errno, -errno);
			goto err;
		}
	}

opened:
	dio_alignment(f, blockdev);
	if (f->dio_offset_align == 0 || f->dio_mem_align == 0) {
		r = fail(info, "statx", -EINVAL, -ZS_E_NODIRECT);
		goto err;
	}
	r = probe_direct(f);
	if (r == -EINVAL) {
		r = fail(info, "O_DIRECT read", r, -ZS_E_NODIRECT);
		goto err;
	} else if (r < 0) {
		r = fail(info, "O_DIRECT read", r, r);
		goto err;
	}
	r = zs_space_init(&f->space, capacity);
	if (r < 0) {
		r = fail(info, "alloc", r, r);
		goto err;
	}
	return 0;

open_failed:
	if (f->lock_fd >= 0)
		close(f->lock_fd);
	f->lock_fd = -1;
	/* Filesystems without O_DIRECT refuse it at open with EINVAL. */
	if (r == -EINVAL)
		return fail(info, "open O_DIRECT", r, -ZS_E_NODIRECT);
	return fail(info, "open", r, r);
err:
	if (created)
		(void)unlink(path->path);
	if (f->fd >= 0)
		close(f->fd);
	if (f->lock_fd >= 0)
		close(f->lock_fd);
	f->fd = -1;
	f->lock_fd = -1;
	return r;
}

void
zs_file_close(struct zs_file *f)
{
	zs_space_fini(&f->space);
	if (f->fd >= 0)
		close(f->fd);
	if (f->lock_fd >= 0)
		close(f->lock_fd);
	f->fd = -1;
	f->lock_fd = -1;
}
