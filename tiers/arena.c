/* The pinned host tier: NUMA-placed, mlocked allocations within a budget. */
#include <errno.h>
#include <fcntl.h>
#include <numa.h>
#include <numaif.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "arena.h"

#define HUGEPAGE_SIZE ((size_t)2 << 20)

struct zt_arena {
	struct zt_arena_config config;
	size_t page_size;
	uint64_t used_bytes;
	uint64_t pinned_bytes;
	uint64_t unpinned_bytes;
	uint64_t allocations;
	uint64_t memlock_limit;
	int last_pin_error;
};

int
zt_arena_new(const struct zt_arena_config *config, struct zt_arena **ret)
{
	struct zt_arena *arena;
	struct rlimit rl;

	if (config->numa_node >= 0) {
		if (numa_available() < 0)
			return -ENOTSUP;
		if (config->numa_node > numa_max_node())
			return -ENODEV;
	}
	arena = calloc(1, sizeof(*arena));
	if (arena == NULL)
		return -ENOMEM;
	arena->config = *config;
	arena->page_size = (size_t)sysconf(_SC_PAGESIZE);
	if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
		arena->memlock_limit = rl.rlim_cur;
	else
		arena->memlock_limit = UINT64_MAX;
	*ret = arena;
	return 0;
}

void
zt_arena_free(struct zt_arena *arena)
{
	free(arena);
}

static size_t
round_up(size_t size, size_t align)
{
	return (size + align - 1) / align * align;
}

/*
 * Large allocations start on a 2 MiB boundary so that transparent hugepages
 * can back all of them: a 1 MiB O_DIRECT transfer from 4 KiB pages needs 256
 * segments, more than some queues take (virtio-blk: 254), and is split.
 * fd >= 0: the memory is that file's, shared (it outlives the process
 * wherever the descriptor is kept).
 */
void *
zt_map_aligned(size_t size, bool huge, int fd)
{
	size_t span = huge ? size + HUGEPAGE_SIZE : size;
	uintptr_t start, aligned;
	char *p;

	if (!huge) {
		p = mmap(NULL, size, PROT_READ | PROT_WRITE, fd >= 0 ? MAP_SHARED :
		    MAP_PRIVATE | MAP_ANONYMOUS, fd, 0);
		return p == MAP_FAILED ? NULL : p;
	}
	p = mmap(NULL, span, fd >= 0 ? PROT_NONE : PROT_READ | PROT_WRITE,
	    MAP_PRIVATE | MAP_ANONYMOUS | (fd >= 0 ? MAP_NORESERVE : 0), -1, 0);
	if (p == MAP_FAILED)
		return NULL;
	start = (uintptr_t)p;
	aligned = (start + HUGEPAGE_SIZE - 1) & ~(uintptr_t)(HUGEPAGE_SIZE - 1);
	if (aligned > start)
		munmap(p, aligned - start);
	if (start + span > aligned + size)
		munmap((char *)aligned + size, start + span - (aligned + size));
	if (fd >= 0 && mmap((void *)aligned, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
	    fd, 0) == MAP_FAILED) {
		int err = errno;

		munmap((void *)aligned, size);
		errno = err;
		return NULL;
	}
	(void)madvise((void *)aligned, size, MADV_HUGEPAGE);
	return (void *)aligned;
}

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25	/* Linux 6.1; older C libraries do not name it */
#endif

/*
 * A new file gets one zero byte written per 2 MiB first: the collapse then
 * fills each huge page with zeros instead of copying 512 faulted-in small
 * pages (15 ms for 48 MiB against 200 ms), and on no pages at all it fails.
 * A kept file is collapsed as it is, its contents copied.
 */
void
zt_collapse(void *map, size_t size, bool fresh)
{
	char *p = map;

	if (fresh)
		for (size_t off = 0; off < size; off += HUGEPAGE_SIZE)
			p[off] = 0;
	(void)madvise(p, size, MADV_COLLAPSE);
}

/* fd: -1 anonymous; else the file to map (already size bytes long). */
static int
arena_map(struct zt_arena *arena, size_t size, int fd, bool budget, void **ret,
    bool *ret_pinned)
{
	void *p;
	bool pinned = true;

	if (budget && arena->used_bytes + size > arena->config.budget_bytes)
		return -ENOSPC;
	p = zt_map_aligned(size, arena->config.hugepages && size >= ZT_HUGEPAGE_MIN, fd);
	if (p == NULL)
		return -errno;
	if (arena->config.numa_node >= 0) {
		unsigned long mask = 1ul << arena->config.numa_node;

		if (mbind(p, size, MPOL_BIND, &mask, sizeof(mask) * 8, 0) != 0) {
			int err = -errno;

			munmap(p, size);
			return err;
		}
	}
	if (fd >= 0 && arena->config.collapse && arena->config.hugepages && size >= ZT_HUGEPAGE_MIN &&
	    (budget || arena->config.collapse_kept))
		zt_collapse(p, size, budget);
	/*
	 * mlock faults the pages in, on the bound node.  A kept file's pages are
	 * in memory already (it was locked until its process died): they are
	 * locked as they are mapped again, which the first step does, so that a
	 * restart does not walk gigabytes first (0.15 s per GiB measured).
	 */
	if ((fd >= 0 && !budget ? mlock2(p, size, MLOCK_ONFAULT) : mlock(p, size)) != 0) {
		arena->last_pin_error = -errno;
		if (arena->config.require_pinned) {
			munmap(p, size);
			return -ENOMEM;
		}
		pinned = false;
	}

	arena->used_bytes += size;
	if (pinned)
		arena->pinned_bytes += size;
	else
		arena->unpinned_bytes += size;
	arena->allocations++;
	*ret = p;
	if (ret_pinned != NULL)
		*ret_pinned = pinned;
	return 0;
}

int
zt_arena_alloc(struct zt_arena *arena, size_t size, void **ret, bool *ret_pinned)
{
	if (size == 0)
		return -EINVAL;
	return arena_map(arena, round_up(size, arena->page_size), -1, true, ret, ret_pinned);
}

int
zt_arena_alloc_fd(struct zt_arena *arena, size_t size, const char *name, int fd, void **ret,
    bool *ret_pinned, int *ret_fd)
{
	bool made = fd < 0;
	struct stat st;
	int r;

	if (size == 0)
		return -EINVAL;
	size = round_up(size, arena->page_size);
	if (made) {
		if (arena->used_bytes + size > arena->config.budget_bytes)
			return -ENOSPC;
		fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
		if (fd < 0)
			return -errno;
		if (ftruncate(fd, (off_t)size) != 0) {
			r = -errno;
			goto fail;
		}
		/* The state's layout depends on its size: nobody may change it under us. */
		(void)fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
	} else if (fstat(fd, &st) != 0) {
		return -errno;
	} else if ((uint64_t)st.st_size != size) {
		return -EBADFD;
	}
	/* Kept state is taken back whatever the budget is now: it exists already. */
	r = arena_map(arena, size, fd, made, ret, ret_pinned);
	if (r < 0)
		goto fail;
	*ret_fd = fd;
	return 0;
fail:
	if (made)
		close(fd);
	return r;
}

void
zt_arena_release(struct zt_arena *arena, void *ptr, size_t size, bool pinned)
{
	if (ptr == NULL)
		return;
	size = round_up(size, arena->page_size);
	if (pinned)
		arena->pinned_bytes -= size;
	else
		arena->unpinned_bytes -= size;
	/* munmap drops the lock too. */
	munmap(ptr, size);
	arena->used_bytes -= size;
	arena->allocations--;
}

void
zt_arena_set_budget(struct zt_arena *arena, uint64_t budget_bytes)
{
	arena->config.budget_bytes = budget_bytes;
}

size_t
zt_arena_fd_bytes(const struct zt_arena *arena, size_t size)
{
	return round_up(size, arena->page_size);
}

void
zt_arena_get_stats(const struct zt_arena *arena, struct zt_arena_stats *ret)
{
	*ret = (struct zt_arena_stats){
		.budget_bytes = arena->config.budget_bytes,
		.used_bytes = arena->used_bytes,
		.pinned_bytes = arena->pinned_bytes,
		.unpinned_bytes = arena->unpinned_bytes,
		.allocations = arena->allocations,
		.memlock_limit = arena->memlock_limit,
		.numa_node = arena->config.numa_node,
		.last_pin_error = arena->last_pin_error,
	};
}
