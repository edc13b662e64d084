/*
 * Param views: a private, writable mapping of a tensor's param slot, so that a
 * framework's parameter can live in it with no copy out after a step.
 *
 * The slot's pages are the daemon's (the process maps them read-only, and for
 * fp32 they are the master itself).  A MAP_PRIVATE mapping of the same file
 * reads those pages while the process leaves them alone: every step the daemon
 * writes shows through.  A page the process writes (a model's load_state_dict,
 * p.data.normal_(), numpy, a read() into it) becomes the process's own copy and
 * stops following; the daemon never sees it.  The layer above asks before each
 * step whether any page was written, hands the values to the daemon as the new
 * master, and drops the copies (MADV_DONTNEED on a private file mapping throws
 * them away: the next touch reads the slot again).
 *
 * How writes are found, cheapest first:
 * - userfaultfd's asynchronous write protection (Linux 6.7): each page of the
 *   view carries a marker that the kernel clears, with no handler and no signal,
 *   when the page is first written, by user or kernel code alike; PAGEMAP_SCAN
 *   then finds cleared markers from the page table bits alone.  About 0.2 ms for
 *   400 MB of view, against 15-30 ms for the next way;
 * - else /proc/self/pagemap, page by page: bit 61 (a file or shared page) is
 *   clear for a copy the process made.  ZOFFLOAD_PARAM_VIEW_TRACKING=pagemap
 *   forces this way, for a connection made after it is set.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <linux/userfaultfd.h>

#include "zclient_impl.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

#define PM_PRESENT	(UINT64_C(1) << 63)
#define PM_SWAPPED	(UINT64_C(1) << 62)
#define PM_FILE		(UINT64_C(1) << 61)
#define PM_BATCH	4096		/* pagemap entries read at once (32 KiB) */

/* Linux 6.7's uapi, which older headers (Debian 12's) lack. */
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY	1
#endif
#define VIEW_UFFD_FEATURES	((UINT64_C(1) << 12) /* WP_HUGETLBFS_SHMEM */ | \
	(UINT64_C(1) << 13) /* WP_UNPOPULATED */ | (UINT64_C(1) << 15) /* WP_ASYNC */)
struct view_page_region {
	uint64_t start, end, categories;
};
struct view_pm_scan_arg {
	uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
	uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
#define VIEW_PAGEMAP_SCAN	_IOWR('f', 16, struct view_pm_scan_arg)
#define VIEW_PAGE_IS_WRITTEN	(UINT64_C(1) << 1)
#define VIEW_PM_SCAN_CHECK_WPASYNC (UINT64_C(1) << 1)

static size_t
page_size(void)
{
	return (size_t)sysconf(_SC_PAGESIZE);
}

int
zc_conn_set_param_views(struct zc_conn *c, bool on)
{
	c->param_views = on;
	return 0;
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

/*
 * The connection's userfaultfd with asynchronous write protection, or -1 where
 * the kernel (older than 6.7) or a seccomp filter (a container's) refuses it:
 * pagemap is read instead.  Asked once.
 */
static int
view_uffd(struct zc_conn *c)
{
	struct uffdio_api api = { .api = UFFD_API, .features = VIEW_UFFD_FEATURES };
	int fd;

	const char *how = getenv("ZOFFLOAD_PARAM_VIEW_TRACKING");

	if (c->uffd != -1)
		return c->uffd;
	c->uffd = -2;
	/* pagemap forced: to compare the two, or where userfaultfd misbehaves. */
	if (how != NULL && strcmp(how, "pagemap") == 0)
		return -1;
	fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
	if (fd < 0)
		return -1;
	if (ioctl(fd, UFFDIO_API, &api) < 0 || (api.features & VIEW_UFFD_FEATURES) !=
	    VIEW_UFFD_FEATURES || pagemap_fd(c) < 0) {
		close(fd);
		return -1;
	}
	c->uffd = fd;
	return fd;
}

/* Marks every page of t's view unwritten (markers on absent pages too). */
static int
view_protect(struct zc_tensor *t)
{
	struct uffdio_writeprotect wp = {
		.range = { (uintptr_t)t->param_view, t->param_bytes },
		.mode = UFFDIO_WRITEPROTECT_MODE_WP,
	};

	return ioctl(t->conn->uffd, UFFDIO_WRITEPROTECT, &wp) < 0 ? -errno : 0;
}

/* Tracks t's view with write protection where the kernel allows it; else pagemap. */
static void
view_track(struct zc_tensor *t)
{
	struct uffdio_register reg = {
		.range = { (uintptr_t)t->param_view, t->param_bytes },
		.mode = UFFDIO_REGISTER_MODE_WP,
	};
	int fd = view_uffd(t->conn);

	t->view_wp = false;
	if (fd < 0 || ioctl(fd, UFFDIO_REGISTER, &reg) < 0)
		return;
	if (view_protect(t) < 0) {
		struct uffdio_range range = reg.range;

		(void)ioctl(fd, UFFDIO_UNREGISTER, &range);
		return;
	}
	t->view_wp = true;
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
	t->view_carried = 0;
	view_track(t);
	return 0;
}

void
zci_view_unmap(struct zc_tensor *t)
{
	/* The unmap ends its userfaultfd registration too. */
	if (t->param_view != NULL)
		munmap(t->param_view, t->param_bytes);
	t->param_view = NULL;
}

void
zci_view_keep(struct zc_tensor *t, void **ret_addr, size_t *ret_bytes)
{
	struct uffdio_range range = { (uintptr_t)t->param_view, t->param_bytes };

	/*
	 * The mapping stays for pointers the caller cannot take back; without
	 * write protection a write to it is a plain write again, as after an
	 * unmap, and closing the connection's userfaultfd then changes nothing.
	 */
	if (t->param_view != NULL && t->view_wp)
		(void)ioctl(t->conn->uffd, UFFDIO_UNREGISTER, &range);
	*ret_addr = t->param_view;
	*ret_bytes = t->param_view != NULL ? t->param_bytes : 0;
	t->param_view = NULL;
}

void
zci_view_close(struct zc_conn *c)
{
	if (c->pagemap_fd >= 0)
		close(c->pagemap_fd);
	if (c->uffd >= 0)
		close(c->uffd);
	c->pagemap_fd = c->uffd = -1;
}

/*
 * Calls fn(arg, page index) for each page of [map, map + bytes) the process
 * made its own, from pagemap; returns how many, or -errno.
 */
static int64_t
own_pages(struct zc_conn *c, const void *map, size_t bytes,
    void (*fn)(void *arg, size_t page), void *arg)
{
	uint64_t entries[PM_BATCH];
	size_t page = page_size();
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

/* Pages of t's view whose write-protect marker a write cleared, or -errno. */
static int64_t
written_pages(struct zc_tensor *t)
{
	struct view_page_region regions[64];
	struct view_pm_scan_arg a = {
		.size = sizeof(a),
		.flags = VIEW_PM_SCAN_CHECK_WPASYNC,
		.start = (uintptr_t)t->param_view,
		.end = (uintptr_t)t->param_view + t->param_bytes,
		.vec = (uintptr_t)regions,
		.vec_len = sizeof(regions) / sizeof(regions[0]),
		.category_mask = VIEW_PAGE_IS_WRITTEN,
		.return_mask = VIEW_PAGE_IS_WRITTEN,
	};
	int64_t pages = 0;

	while (a.start < a.end) {
		int n = ioctl(t->conn->pagemap_fd, VIEW_PAGEMAP_SCAN, &a);

		if (n < 0)
			return -errno;
		for (int i = 0; i < n; i++)
			pages += (int64_t)((regions[i].end - regions[i].start) / page_size());
		/* Stopped early when the regions ran out: go on where the walk ended. */
		a.start = a.walk_end;
	}
	return pages;
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
	if (t->view_wp)
		own = written_pages(t);
	else
		own = own_pages(t->conn, t->param_view, t->param_bytes, NULL, NULL);
	if (own < 0)
		return zci_seterr(t->conn, (int)own, "find the written pages of the param view "
		    "of '%s' (%s): %s", t->name, t->view_wp ? "PAGEMAP_SCAN" :
		    "/proc/self/pagemap", strerror((int)-own));
	*ret_pages = (uint64_t)own + t->view_carried;
	return 0;
}

int
zc_tensor_param_view_reset(struct zc_tensor *t)
{
	int r;

	if (t->param_view == NULL)
		return zci_seterr(t->conn, -ENOENT, "tensor '%s' has no param view", t->name);
	if (madvise(t->param_view, t->param_bytes, MADV_DONTNEED) < 0)
		return zci_seterr(t->conn, -errno, "drop the written pages of the param view of "
		    "'%s': %s", t->name, strerror(errno));
	t->view_carried = 0;
	/* A dropped page comes back unmarked: mark the whole view again. */
	if (t->view_wp && (r = view_protect(t)) < 0)
		return zci_seterr(t->conn, r, "write-protect the param view of '%s' again: %s",
		    t->name, strerror(-r));
	return 0;
}

const char *
zc_tensor_param_view_tracking(const struct zc_tensor *t)
{
	if (t->param_view == NULL)
		return "none";
	return t->view_wp ? "userfaultfd" : "pagemap";
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
	struct carry cy = { .from = t->param_view, .page = page_size() };
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
	 * framework's tensors keep their address), tracked afresh: the carried
	 * pages are counted written apart, since the new markers do not know them.
	 */
	cy.to = map;
	own = own_pages(t->conn, t->param_view, t->param_bytes, carry_page, &cy);
	if (own < 0 || mremap(map, t->param_bytes, t->param_bytes, MREMAP_MAYMOVE | MREMAP_FIXED,
	    t->param_view) == MAP_FAILED) {
		int r = own < 0 ? (int)own : -errno;

		munmap(map, t->param_bytes);
		return r;
	}
	view_track(t);
	/* pagemap would find the carried pages itself. */
	t->view_carried = t->view_wp ? (uint64_t)own : 0;
	return 0;
}
