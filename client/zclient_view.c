/*
 * Param views: a private, writable mapping of a tensor's param slot, so that a
 * framework's parameter can live in it with no copy out after a step.
 *
 * The slot's pages are the daemon's (the process maps them read-only, and for
 * fp32 they are the master itself).  A MAP_PRIVATE mapping of the same file
 * reads those pages while the process leaves them alone: every step the daemon
 * writes shows through.  A page the process writes (a model's load_state_dict,
 * p.data.normal_(), numpy) becomes the process's own copy and stops following;
 * the daemon never sees it.  /proc/self/pagemap tells the two apart per page
 * (bit 61: a file or shared page, clear for a copy the process made), so the
 * layer above can find such writes before a step, hand the values to the
 * daemon as the new master, and drop the copies (MADV_DONTNEED on a private
 * file mapping throws them away: the next touch reads the slot again).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "zclient_impl.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

#define PM_PRESENT	(UINT64_C(1) << 63)
#define PM_SWAPPED	(UINT64_C(1) << 62)
#define PM_FILE		(UINT64_C(1) << 61)
#define PM_BATCH	4096		/* pagemap entries read at once (32 KiB) */

int
zc_conn_set_param_views(struct zc_conn *c, bool on)
{
	c->param_views = on;
	return 0;
}

int
zci_view_map(struct zc_tensor *t, int fd)
{
	void *map;

	map = mmap(NULL, t->param_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
	if (map == MAP_FAILED)
		return -errno;
	/*
	 * Read faults now rather than during the first forward.  Not MAP_POPULATE: on
	 * a writable private mapping it faults for writing, copying every page.
	 */
	(void)madvise(map, t->param_bytes, MADV_POPULATE_READ);
	t->param_view = map;
	return 0;
}

void
zci_view_unmap(struct zc_tensor *t)
{
	if (t->param_view != NULL)
		munmap(t->param_view, t->param_bytes);
	t->param_view = NULL;
}

static int
pagemap_fd(struct zc_conn *c)
{
	if (c->pagemap_fd < 0) {
		c->pagemap_fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
		if (c->pagemap_fd < 0)
			return -errno;
	}
	return c->pagemap_fd;
}

void
zci_view_close_pagemap(struct zc_conn *c)
{
	if (c->pagemap_fd >= 0)
		close(c->pagemap_fd);
	c->pagemap_fd = -1;
}

/*
 * Calls fn(arg, page index) for each page of [map, map + bytes) the process
 * made its own; returns how many, or -errno.
 */
static int64_t
own_pages(struct zc_conn *c, const void *map, size_t bytes,
    void (*fn)(void *arg, size_t page), void *arg)
{
	uint64_t entries[PM_BATCH];
	size_t page = (size_t)sysconf(_SC_PAGESIZE);
	size_t first = (uintptr_t)map / page, n = (bytes + page - 1) / page;
	int64_t own = 0;
	int fd = pagemap_fd(c);

	if (fd < 0)
		return fd;
	for (size_t done = 0; done < n;) {
		size_t want = n - done < PM_BATCH ? n - done : PM_BATCH;
		ssize_t got = pread(fd, entries, want * sizeof(entries[0]),
		    (off_t)((first + done) * sizeof(entries[0])));

		if (got < 0)
			return -errno;
		if (got == 0 || (size_t)got % sizeof(entries[0]) != 0)
			return -EIO;
		for (size_t i = 0; i < (size_t)got / sizeof(entries[0]); i++) {
			uint64_t e = entries[i];

			/* Absent pages follow the slot when touched; swapped ones were copies. */
			if ((e & PM_SWAPPED) || ((e & PM_PRESENT) && !(e & PM_FILE))) {
				own++;
				if (fn != NULL)
					fn(arg, done + i);
			}
		}
		done += (size_t)got / sizeof(entries[0]);
	}
	return own;
}

void *
zc_tensor_param_view(struct zc_tensor *t, size_t *ret_bytes)
{
	if (ret_bytes != NULL)
		*ret_bytes = t->param_view != NULL ? t->param_bytes : 0;
	return t->param_view;
}

int
zc_tensor_param_view_written(struct zc_tensor *t, uint64_t *ret_pages)
{
	int64_t own;

	if (t->param_view == NULL)
		return zci_seterr(t->conn, -ENOENT, "tensor '%s' has no param view", t->name);
	own = own_pages(t->conn, t->param_view, t->param_bytes, NULL, NULL);
	if (own < 0)
		return zci_seterr(t->conn, (int)own, "read /proc/self/pagemap for the param view "
		    "of '%s': %s", t->name, strerror((int)-own));
	*ret_pages = (uint64_t)own;
	return 0;
}

int
zc_tensor_param_view_reset(struct zc_tensor *t)
{
	if (t->param_view == NULL)
		return zci_seterr(t->conn, -ENOENT, "tensor '%s' has no param view", t->name);
	if (madvise(t->param_view, t->param_bytes, MADV_DONTNEED) < 0)
		return zci_seterr(t->conn, -errno, "drop the written pages of the param view of "
		    "'%s': %s", t->name, strerror(errno));
	return 0;
}

struct carry {
	unsigned char *from, *to;
	size_t page;
};

static void
carry_page(void *arg, size_t index)
{
	struct carry *cy = arg;

	memcpy(cy->to + index * cy->page, cy->from + index * cy->page, cy->page);
}

int
zci_view_remap(struct zc_tensor *t, int fd)
{
	struct carry cy = { .from = t->param_view, .page = (size_t)sysconf(_SC_PAGESIZE) };
	int64_t own;
	void *map;

	if (t->param_view == NULL)
		return 0;
	map = mmap(NULL, t->param_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
	if (map == MAP_FAILED)
		return -errno;
	/*
	 * What the process wrote into the view and no step has taken yet is its
	 * own, not the old file's: those pages come along, the rest follows the
	 * new slot.  Then the new mapping takes the old one's place (the
	 * framework's tensors keep their address).
	 */
	cy.to = map;
	own = own_pages(t->conn, t->param_view, t->param_bytes, carry_page, &cy);
	if (own < 0 || mremap(map, t->param_bytes, t->param_bytes, MREMAP_MAYMOVE | MREMAP_FIXED,
	    t->param_view) == MAP_FAILED) {
		int r = own < 0 ? (int)own : -errno;

		munmap(map, t->param_bytes);
		return r;
	}
	return 0;
}
