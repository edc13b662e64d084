/* The pinned host arena: budget, page rounding, pinning report, release. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "arena.h"
#include "swap_helpers.h"

Test(arena, budget_and_release)
{
	struct zt_arena_config c = { .budget_bytes = 1 << 20, .numa_node = -1 };
	struct zt_arena *a;
	struct zt_arena_stats st;
	size_t page = (size_t)sysconf(_SC_PAGESIZE);
	void *p, *q;
	bool pinned, qpinned;

	cr_assert_eq(zt_arena_new(&c, &a), 0);
	cr_assert_eq(zt_arena_alloc(a, 0, &p, &pinned), -EINVAL);
	cr_assert_eq(zt_arena_alloc(a, 100, &p, &pinned), 0);
	cr_assert_eq((uintptr_t)p % page, 0);
	cr_assert_eq(((unsigned char *)p)[99], 0);
	zt_arena_get_stats(a, &st);
	cr_assert_eq(st.used_bytes, page);
	cr_assert_eq(st.pinned_bytes + st.unpinned_bytes, page);
	cr_assert_eq(st.pinned_bytes == page, pinned);
	cr_assert_eq(zt_arena_alloc(a, 1 << 20, &q, &qpinned), -ENOSPC);
	zt_arena_release(a, p, 100, pinned);
	cr_assert_eq(zt_arena_alloc(a, 1 << 20, &q, &qpinned), 0);
	zt_arena_set_budget(a, 4096);
	cr_assert_eq(zt_arena_alloc(a, 1, &p, &pinned), -ENOSPC);
	zt_arena_release(a, q, 1 << 20, qpinned);
	zt_arena_get_stats(a, &st);
	cr_assert_eq(st.used_bytes, 0);
	cr_assert_eq(st.allocations, 0);
	zt_arena_release(a, NULL, 0, false);
	zt_arena_free(a);
}

Test(arena, missing_numa_node_refused)
{
	struct zt_arena_config c = { .budget_bytes = 1 << 20, .numa_node = 4095 };
	struct zt_arena *a = NULL;
	int r = zt_arena_new(&c, &a);

	cr_assert(r == -ENODEV || r == -ENOTSUP, "%d", r);
	cr_assert_null(a);
}

/*
 * A kept file's first huge page split into small ones by a punched hole, its
 * first 4 KiB written back as byte i was (i * mul + add).
 */
static void
split_first_huge_page(int fd, size_t size, unsigned mul, unsigned add)
{
	unsigned char *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);

	cr_assert_neq(p, MAP_FAILED);
	cr_assert_eq(fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, 0, 4096), 0);
	for (size_t i = 0; i < 4096; i++)
		p[i] = (unsigned char)(i * mul + add);
	munmap(p, size);
}

/*
 * A memfd allocation with collapse is in 2 MiB pages whatever shmem_enabled says
 * (the NVMe staging buffers: from 4 KiB pages the swap engine read at 0.36x), and a
 * kept file's contents survive its collapse (a staging buffer may hold a computed chunk
 * whose write had not landed).  Fails without the collapse where shmem_enabled is
 * never; skipped where the kernel collapses no shared memory.
 */
Test(arena, memfd_collapsed_into_huge_pages)
{
	struct zt_arena_config c = { .budget_bytes = 64u << 20, .numa_node = -1,
		.hugepages = true, .collapse = true, .collapse_kept = true };
	size_t size = 12u << 20;
	struct zt_arena *a;
	unsigned char *p;
	bool pinned;
	int fd, kept;

	if (!th_kernel_collapses_shmem())
		cr_skip_test("this kernel does not collapse shared memory into huge pages");
	cr_assert_eq(zt_arena_new(&c, &a), 0);
	cr_assert_eq(zt_arena_alloc_fd(a, size, "collapse-test", -1, (void **)&p, &pinned, &fd), 0);
	cr_assert_eq((uintptr_t)p % (2u << 20), 0);
	cr_assert_eq(th_shmem_pmd_kib(p), size / 1024, "%lu KiB of %zu in 2 MiB pages",
	    th_shmem_pmd_kib(p), size / 1024);
	for (size_t i = 0; i < size; i += 4096)
		cr_assert_eq(p[i], 0, "byte %zu of a new allocation is not zero", i);
	for (size_t i = 0; i < size; i++)
		p[i] = (unsigned char)(i * 7 + 3);
	zt_arena_release(a, p, size, pinned);

	/* Kept: its first huge page split into small ones, then mapped back. */
	kept = fd;
	split_first_huge_page(kept, size, 7, 3);
	cr_assert_eq(zt_arena_alloc_fd(a, size, "collapse-test", kept, (void **)&p, &pinned, &fd), 0);
	cr_assert_eq(fd, kept);
	cr_assert_eq(th_shmem_pmd_kib(p), size / 1024);
	for (size_t i = 0; i < size; i++)
		cr_assert_eq(p[i], (unsigned char)(i * 7 + 3), "byte %zu of the kept file changed", i);
	zt_arena_release(a, p, size, pinned);
	close(kept);
	zt_arena_free(a);
}

/*
 * Without collapse_kept (the pinned state's arena) a new file is collapsed
 * and a kept one mapped as it is: its huge pages mapped whole as they are
 * touched, a part its last process left in small pages left so, nothing
 * copied (a restart walks none of its state).
 */
Test(arena, kept_memfd_mapped_as_it_was_left)
{
	struct zt_arena_config c = { .budget_bytes = 64u << 20, .numa_node = -1,
		.hugepages = true, .collapse = true };
	size_t size = 12u << 20, huge = 2u << 20;
	struct zt_arena *a;
	unsigned char *p;
	bool pinned;
	int fd, kept;

	if (!th_kernel_collapses_shmem())
		cr_skip_test("this kernel does not collapse shared memory into huge pages");
	cr_assert_eq(zt_arena_new(&c, &a), 0);
	cr_assert_eq(zt_arena_alloc_fd(a, size, "kept-test", -1, (void **)&p, &pinned, &fd), 0);
	cr_assert_eq(th_shmem_pmd_kib(p), size / 1024);
	for (size_t i = 0; i < size; i++)
		p[i] = (unsigned char)(i * 5 + 1);
	zt_arena_release(a, p, size, pinned);

	kept = fd;
	split_first_huge_page(kept, size, 5, 1);
	cr_assert_eq(zt_arena_alloc_fd(a, size, "kept-test", kept, (void **)&p, &pinned, &fd), 0);
	for (size_t i = 0; i < size; i++)
		cr_assert_eq(p[i], (unsigned char)(i * 5 + 1), "byte %zu of the kept file changed", i);
	cr_assert_eq(th_shmem_pmd_kib(p), (size - huge) / 1024, "%lu KiB of %zu in 2 MiB pages",
	    th_shmem_pmd_kib(p), (size - huge) / 1024);
	zt_arena_release(a, p, size, pinned);
	close(kept);
	zt_arena_free(a);
}
