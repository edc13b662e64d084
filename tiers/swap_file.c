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
#include <sys/ioctl.h>
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
	if (path->path == NULL || path->path[0] == '\0')
		return fail(info, "path", -EINVAL, -EINVAL);

	if (stat(path->path, &st) == 0 && S_ISDIR(st.st_mode)) {
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
	}
	if (fstat(f->fd, &st) < 0) {
		r = fail(info, "fstat", -errno, -errno);
		goto err;
	}
	blockdev = S_ISBLK(st.st_mode);
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
	/* Filesystems without O_DIRECT refuse it at open with EINVAL. */
	if (r == -EINVAL)
		return fail(info, "open O_DIRECT", r, -ZS_E_NODIRECT);
	return fail(info, "open", r, r);
err:
	if (created)
		(void)unlink(path->path);
	close(f->fd);
	f->fd = -1;
	return r;
}

void
zs_file_close(struct zs_file *f)
{
	zs_space_fini(&f->space);
	if (f->fd >= 0)
		close(f->fd);
	f->fd = -1;
}
