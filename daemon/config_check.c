/*
 * --check-config beyond the syntax: what can be checked on this machine
 * without starting (swap paths, free space, memory file systems, the socket's
 * group).  Nothing is created or changed.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <grp.h>
#include <libgen.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "config.h"
#include "config_check.h"
#include "log.h"

struct zd_check {
	FILE *out;
	unsigned problems;
};

/* One swap path as found: the file system it will live on and what it already holds there. */
struct found {
	bool usable;		/* checks passed that free space depends on */
	bool blockdev;
	dev_t fs_dev;		/* st_dev of the file system */
	uint64_t free_bytes;	/* available to unprivileged users */
	uint64_t reusable;	/* an existing file's blocks, reused by preallocation */
};

static void
problem(struct zd_check *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void
problem(struct zd_check *c, const char *fmt, ...)
{
	va_list ap;

	c->problems++;
	fputs("error: ", c->out);
	va_start(ap, fmt);
	vfprintf(c->out, fmt, ap);
	va_end(ap);
	fputc('\n', c->out);
}

static void
note(struct zd_check *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void
note(struct zd_check *c, const char *fmt, ...)
{
	va_list ap;

	fputs("ok: ", c->out);
	va_start(ap, fmt);
	vfprintf(c->out, fmt, ap);
	va_end(ap);
	fputc('\n', c->out);
}

static const char *
memory_fs_name(long type)
{
	switch (type) {
	case TMPFS_MAGIC: return "tmpfs (or devtmpfs)";
	case RAMFS_MAGIC: return "ramfs";
	default: return NULL;
	}
}

/* Where the path will be: itself when it exists, else its directory (a file is created there). */
static void
check_swap_path(struct zd_check *c, const struct zd_config *cfg, const struct zd_swap_path *sp,
    struct found *f)
{
	char cap[32], parent_buf[4096], *parent;
	const char *fs_path = sp->path, *memfs;
	struct statvfs vfs;
	struct statfs sfs;
	struct stat st;

	memset(f, 0, sizeof(*f));
	zd_fmt_bytes(sp->capacity, cap, sizeof(cap));
	if (stat(sp->path, &st) == 0) {
		if (S_ISBLK(st.st_mode)) {
			uint64_t size = 0;
			int fd = open(sp->path, O_RDONLY | O_CLOEXEC);

			f->blockdev = true;
			if (access(sp->path, R_OK | W_OK) != 0) {
				problem(c, "swap path %s: block device not readable and writable by "
				    "this user: %s", sp->path, strerror(errno));
			} else if (fd < 0 || ioctl(fd, BLKGETSIZE64, &size) != 0) {
				problem(c, "swap path %s: cannot read the device's size: %s",
				    sp->path, strerror(errno));
			} else if (size < sp->capacity) {
				char have[32];

				problem(c, "swap path %s: capacity %s but the device holds %s",
				    sp->path, cap, zd_fmt_bytes(size, have, sizeof(have)));
			} else {
				note(c, "swap path %s: block device, capacity %s", sp->path, cap);
			}
			if (fd >= 0)
				close(fd);
			return;
		}
		if (S_ISDIR(st.st_mode)) {
			if (access(sp->path, W_OK | X_OK) != 0) {
				problem(c, "swap path %s: directory not writable by this user: %s",
				    sp->path, strerror(errno));
				return;
			}
		} else if (S_ISREG(st.st_mode)) {
			if (access(sp->path, R_OK | W_OK) != 0) {
				problem(c, "swap path %s: file not readable and writable by this user: "
				    "%s", sp->path, strerror(errno));
				return;
			}
			f->reusable = (uint64_t)st.st_blocks * 512;
		} else {
			problem(c, "swap path %s: not a directory, a file or a block device",
			    sp->path);
			return;
		}
	} else if (errno == ENOENT) {
		snprintf(parent_buf, sizeof(parent_buf), "%s", sp->path);
		parent = dirname(parent_buf);
		if (stat(parent, &st) != 0 || !S_ISDIR(st.st_mode)) {
			problem(c, "swap path %s: does not exist, nor does its directory %s",
			    sp->path, parent);
			return;
		}
		if (access(parent, W_OK | X_OK) != 0) {
			problem(c, "swap path %s: does not exist and its directory %s is not "
			    "writable by this user: %s", sp->path, parent, strerror(errno));
			return;
		}
		fs_path = parent;
	} else {
		problem(c, "swap path %s: %s", sp->path, strerror(errno));
		return;
	}
	if (statfs(fs_path, &sfs) == 0 && (memfs = memory_fs_name((long)sfs.f_type)) != NULL) {
		if (!cfg->swap_allow_memory_fs) {
			problem(c, "swap path %s: on %s, a memory file system: swapping there only "
			    "moves memory around (set swap.allow_memory_fs to true to allow it, for "
			    "tests)", sp->path, memfs);
			return;
		}
		note(c, "swap path %s: on %s, allowed by swap.allow_memory_fs", sp->path, memfs);
	}
	if (statvfs(fs_path, &vfs) != 0) {
		problem(c, "swap path %s: statvfs: %s", sp->path, strerror(errno));
		return;
	}
	f->usable = true;
	f->fs_dev = st.st_dev;
	f->free_bytes = (uint64_t)vfs.f_bavail * vfs.f_frsize;
}

/* Paths on one file system share its free space: their capacities add up. */
static void
check_space(struct zd_check *c, const struct zd_config *cfg, const struct found *f)
{
	for (unsigned i = 0; i < cfg->nswap_paths; i++) {
		uint64_t need = 0, avail, cap;
		bool first = true;
		unsigned npaths = 0;
		char a[32], b[32];

		if (!f[i].usable)
			continue;
		for (unsigned j = 0; j < cfg->nswap_paths; j++) {
			if (!f[j].usable || f[j].fs_dev != f[i].fs_dev)
				continue;
			if (j < i)
				first = false;
			cap = cfg->swap_paths[j].capacity;
			need += cap - (f[j].reusable < cap ? f[j].reusable : cap);
			npaths++;
		}
		if (!first)
			continue;
		avail = f[i].free_bytes;
		zd_fmt_bytes(need, a, sizeof(a));
		zd_fmt_bytes(avail, b, sizeof(b));
		if (need > avail)
			problem(c, "swap path %s%s: needs %s more on its file system, %s is free",
			    cfg->swap_paths[i].path, npaths > 1 ? " (and the others on its file system)" :
			    "", a, b);
		else
			note(c, "swap path %s%s: needs %s more, %s free", cfg->swap_paths[i].path,
			    npaths > 1 ? " (and the others on its file system)" : "", a, b);
	}
}

unsigned
zd_config_check_host(const struct zd_config *cfg, FILE *out)
{
	struct zd_check c = { .out = out };
	struct found f[ZD_MAX_SWAP_PATHS];

	for (unsigned i = 0; i < cfg->nswap_paths; i++)
		check_swap_path(&c, cfg, &cfg->swap_paths[i], &f[i]);
	check_space(&c, cfg, f);
	if (cfg->socket_group != NULL) {
		if (getgrnam(cfg->socket_group) == NULL)
			problem(&c, "socket.group: group '%s' does not exist (systemd-sysusers creates "
			    "it from the installed sysusers.d snippet, or groupadd %s)",
			    cfg->socket_group, cfg->socket_group);
		else
			note(&c, "socket.group: group '%s' exists", cfg->socket_group);
	}
	return c.problems;
}
