/* The pinned host tier: NUMA-placed, mlocked allocations within a budget. */
#ifndef ZT_ARENA_H
#define ZT_ARENA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct zt_arena;

struct zt_arena_config {
	uint64_t budget_bytes;		/* most bytes handed out, pinned or not */
	int numa_node;			/* -1: no placement */
	bool require_pinned;		/* fail allocations that cannot be mlocked */
	bool hugepages;			/* madvise(MADV_HUGEPAGE) on large allocations */
	/*
	 * With hugepages: large memfd allocations are also put into 2 MiB pages
	 * with MADV_COLLAPSE, which shared memory does not take from MADV_HUGEPAGE
	 * where /sys/kernel/mm/transparent_hugepage/shmem_enabled is never (a
	 * common default).  For I/O buffers: see zt_map_aligned; for the state a
	 * step streams, the pages' TLB reach.
	 */
	bool collapse;
	/*
	 * A kept file's pages are collapsed too: copied into huge pages, its size
	 * in bytes, once.  Without it a kept file is left as its last process made
	 * it (in huge pages where that one collapsed it), so a restart walks none of it.
	 */
	bool collapse_kept;
};

struct zt_arena_stats {
	uint64_t budget_bytes;
	uint64_t used_bytes;		/* handed out, rounded to pages */
	uint64_t pinned_bytes;		/* of used, mlocked */
	uint64_t unpinned_bytes;	/* of used, mlock refused (memlock limit) */
	uint64_t allocations;
	uint64_t memlock_limit;		/* RLIMIT_MEMLOCK soft limit at creation; UINT64_MAX = unlimited */
	int numa_node;
	int last_pin_error;		/* -errno of the last refused mlock, 0 if none */
};

int zt_arena_new(const struct zt_arena_config *config, struct zt_arena **ret);
void zt_arena_free(struct zt_arena *arena);

/*
 * Page-aligned, zeroed memory of at least size bytes.  -ENOSPC over budget;
 * -ENOMEM when pinning was required and refused (RLIMIT_MEMLOCK).
 * *ret_pinned says whether it is mlocked.
 */
int zt_arena_alloc(struct zt_arena *arena, size_t size, void **ret, bool *ret_pinned);
/*
 * The same in a sealed memfd named name (fd -1: made here, *ret_fd is it), or
 * in fd as it is (a file kept from an earlier process: -EBADFD unless it
 * is exactly the page-rounded size), so the memory can outlive the process.
 * The caller owns *ret_fd; releasing the allocation leaves it open.
 */
int zt_arena_alloc_fd(struct zt_arena *arena, size_t size, const char *name, int fd,
    void **ret, bool *ret_pinned, int *ret_fd);
/* The bytes a memfd zt_arena_alloc_fd takes for size must have (size page-rounded). */
size_t zt_arena_fd_bytes(const struct zt_arena *arena, size_t size);
/* size and pinned as the allocation returned them. */
void zt_arena_release(struct zt_arena *arena, void *ptr, size_t size, bool pinned);
/* Budget may shrink below use: new allocations fail until enough is released. */
void zt_arena_set_budget(struct zt_arena *arena, uint64_t budget_bytes);
void zt_arena_get_stats(const struct zt_arena *arena, struct zt_arena_stats *ret);

/* Below this, transparent hugepages waste more than they save. */
#define ZT_HUGEPAGE_MIN ((size_t)4 << 20)
/*
 * size bytes of fd (shared) or of anonymous memory (fd -1), MADV_HUGEPAGE and
 * on a 2 MiB boundary where huge, so that 2 MiB pages can back all of it.
 * NULL with errno set on failure.
 */
void *zt_map_aligned(size_t size, bool huge, int fd);
/*
 * Puts a shared mapping of a memfd into 2 MiB pages (MADV_COLLAPSE, which
 * does not depend on shmem_enabled).  fresh: the file is new and all zeros.
 * Failure (an older kernel, no huge page to be had) leaves small pages: slower,
 * still correct.
 */
void zt_collapse(void *p, size_t size, bool fresh);

#endif
