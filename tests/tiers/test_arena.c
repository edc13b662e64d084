/* The pinned host arena: budget, page rounding, pinning report, release. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <unistd.h>

#include "arena.h"

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
