/* Swap engine data path: round trips, striping, bursts, engine choice. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE	/* statx, fallocate, O_DIRECT, strerrordesc_np */
#endif
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "arena.h"
#include "swap_helpers.h"

static const enum zs_swap_kind kinds[] = { ZS_SWAP_URING, ZS_SWAP_PTHREAD };

static bool
skip_kind(enum zs_swap_kind kind)
{
	const char *why;

	if (kind != ZS_SWAP_URING)
		return false;
	why = th_uring_problem();
	if (why != NULL)
		cr_log_warn("io_uring part skipped: %s", why);
	return why != NULL;
}

static uint64_t
rnd(uint64_t *s)
{
	*s = *s * 6364136223846793005ull + 1442695040888963407ull;
	return *s >> 33;
}

/* Random aligned writes and reads against an in-memory model of the extent. */
static void
roundtrip(enum zs_swap_kind kind, unsigned npaths, bool registered)
{
	const uint64_t size = 8 * MiB;
	const uint32_t unit = 64 * 1024;
	char *dir = th_tmpdir(), sub[ZS_MAX_PATHS][512];
	struct zs_path paths[ZS_MAX_PATHS];
	struct zs_config c = {
		.paths = paths, .npaths = npaths, .capacity = 32 * MiB,
		.stripe_unit = unit, .queue_depth = 8, .engine = kind,
	};
	struct zt_arena_config ac = { .budget_bytes = 64 * MiB, .numa_node = -1 };
	struct zt_arena *arena = NULL;
	struct zs_swap *e;
	struct zs_extent x;
	struct zs_path_stats ps;
	char *model, *io, *check;
	bool pinned = false;
	uint64_t seed = 42 + npaths * 2 + registered, a, done, used;
	unsigned i;

	cr_assert_not_null(dir);
	for (i = 0; i < npaths; i++) {
		snprintf(sub[i], sizeof(sub[i]), "%s/p%u", dir, i);
		cr_assert_eq(mkdir(sub[i], 0700), 0);
		paths[i] = (struct zs_path){ .path = sub[i] };
	}
	cr_assert_eq(zs_swap_new(&c, &e, NULL), 0);
	cr_assert_str_eq(zs_swap_name(e), kind == ZS_SWAP_URING ? "io_uring" : "pthread");
	a = zs_swap_offset_align(e);
	cr_assert(a >= 512 && a <= 4096 && (a & (a - 1)) == 0, "offset align %lu", (unsigned long)a);

	model = th_alloc(size);
	check = th_alloc(size);
	if (registered) {
		cr_assert_eq(zt_arena_new(&ac, &arena), 0);
		cr_assert_eq(zt_arena_alloc(arena, size, (void **)&io, &pinned), 0);
		cr_assert_eq(zs_swap_register_buffer(e, io, size), 0);
	} else {
		io = th_alloc(size);
	}
	cr_assert_eq(zs_extent_alloc(e, size, &x), 0);

	th_fill(model, size, seed);
	memcpy(io, model, size);
	cr_assert_eq(th_io(e, true, &x, 0, io, size), 0);

	for (i = 0; i < 150; i++) {
		uint64_t len, off;
		unsigned shape = (unsigned)rnd(&seed) % 4;

		/* Small, around a unit, several units, and odd multiples of the alignment. */
		if (shape == 0)
			len = a * (1 + rnd(&seed) % 8);
		else if (shape == 1)
			len = unit - a + a * (rnd(&seed) % 3);
		else if (shape == 2)
			len = unit * (1 + rnd(&seed) % 24) + a * (rnd(&seed) % 2);
		else
			len = a * (1 + rnd(&seed) % (2 * MiB / a));
		off = a * (rnd(&seed) % ((size - len) / a + 1));
		if (rnd(&seed) % 2) {
			th_fill(io, len, seed + i);
			memcpy(model + off, io, len);
			cr_assert_eq(th_io(e, true, &x, off, io, len), 0, "write %lu+%lu",
			    (unsigned long)off, (unsigned long)len);
		} else {
			memset(io, 0xa5, len);
			cr_assert_eq(th_io(e, false, &x, off, io, len), 0);
			cr_assert(memcmp(io, model + off, len) == 0, "read %lu+%lu differs",
			    (unsigned long)off, (unsigned long)len);
		}
	}
	memset(io, 0, size);
	cr_assert_eq(th_io(e, false, &x, 0, io, size), 0);
	cr_assert(memcmp(io, model, size) == 0);

	done = used = 0;
	for (i = 0; i < npaths; i++) {
		cr_assert_eq(zs_swap_path_stats(e, i, &ps), 0);
		cr_assert_eq(ps.errors_eio + ps.errors_enospc + ps.errors_other, 0);
		cr_assert_eq(ps.in_flight, 0);
		/* Striped: every path holds its share, give or take one unit. */
		cr_assert(ps.used_bytes + unit >= size / npaths && ps.used_bytes <= size / npaths + unit);
		done += ps.bytes_read;
		used += ps.used_bytes;
	}
	cr_assert_eq(used, size);
	cr_assert(done >= 2 * size);

	zs_extent_free(e, &x);
	if (registered) {
		cr_assert_eq(zs_swap_unregister_buffer(e, io), 0);
		zt_arena_release(arena, io, size, pinned);
		zt_arena_free(arena);
	} else {
		free(io);
	}
	zs_swap_free(e);
	free(model);
	free(check);
	th_rmdir(dir);
}

Test(swap_io, roundtrip_one_path)
{
	for (unsigned k = 0; k < 2; k++)
		if (!skip_kind(kinds[k]))
			roundtrip(kinds[k], 1, false);
}

Test(swap_io, roundtrip_two_paths_registered)
{
	for (unsigned k = 0; k < 2; k++)
		if (!skip_kind(kinds[k]))
			roundtrip(kinds[k], 2, true);
}

Test(swap_io, roundtrip_three_paths)
{
	for (unsigned k = 0; k < 2; k++)
		if (!skip_kind(kinds[k]))
			roundtrip(kinds[k], 3, false);
}

/* Every stripe unit is in the file and at the place the layout says. */
static void
striping(enum zs_swap_kind kind)
{
	const uint32_t unit = 64 * 1024;
	const uint64_t size = 16 * (uint64_t)unit;
	char *dir = th_tmpdir(), f0[512], f1[512];
	struct zs_path paths[2] = { { .path = f0 }, { .path = f1 } };
	struct zs_config c = {
		.paths = paths, .npaths = 2, .capacity = 4 * MiB,
		.stripe_unit = unit, .queue_depth = 4, .engine = kind,
	};
	struct zs_swap *e;
	struct zs_extent pad, x;
	struct zs_path_stats s0, s1;
	unsigned char *buf = th_alloc(size), *back = th_alloc(unit);
	int fds[2];
	unsigned k;

	snprintf(f0, sizeof(f0), "%s/swap0", dir);
	snprintf(f1, sizeof(f1), "%s/swap1", dir);
	cr_assert_eq(zs_swap_new(&c, &e, NULL), 0);
	/* An odd-sized extent first, so that x starts neither at 0 nor on path 0 alone. */
	cr_assert_eq(zs_extent_alloc(e, unit + 4096, &pad), 0);
	cr_assert_eq(zs_extent_alloc(e, size, &x), 0);
	th_fill(buf, size, 7);
	cr_assert_eq(th_io(e, true, &x, 0, buf, size), 0);

	fds[0] = open(f0, O_RDONLY);
	fds[1] = open(f1, O_RDONLY);
	cr_assert(fds[0] >= 0 && fds[1] >= 0);
	for (k = 0; k < size / unit; k++) {
		unsigned p = (x.first_path + k) % 2;
		off_t at = (off_t)(x.offset[p] + k / 2 * unit);

		cr_assert_eq(pread(fds[p], back, unit, at), (ssize_t)unit);
		cr_assert(memcmp(back, buf + k * unit, unit) == 0, "unit %u not at path %u+%ld",
		    k, p, (long)at);
	}
	close(fds[0]);
	close(fds[1]);
	cr_assert_eq(zs_swap_path_stats(e, 0, &s0), 0);
	cr_assert_eq(zs_swap_path_stats(e, 1, &s1), 0);
	cr_assert_eq(s0.bytes_written, size / 2);
	cr_assert_eq(s1.bytes_written, size / 2);
	cr_assert_eq(s0.capacity, 4 * MiB);
	cr_assert_eq(s0.used_bytes + s1.used_bytes, size + unit + 4096);
	zs_extent_free(e, &pad);
	zs_extent_free(e, &x);
	zs_swap_free(e);
	free(buf);
	free(back);
	th_rmdir(dir);
}

Test(swap_io, striping_lands_on_both_files)
{
	for (unsigned k = 0; k < 2; k++)
		if (!skip_kind(kinds[k]))
			striping(kinds[k]);
}

struct burst {
	unsigned pending;
	unsigned failed;
	unsigned live;		/* operations between inject prepare and complete */
	unsigned live_max;
};

static int
count_prepare(void *arg, const struct zs_inject_op *op)
{
	struct burst *b = arg;

	if (++b->live > b->live_max)
		b->live_max = b->live;
	return 0;
}

static int
count_complete(void *arg, const struct zs_inject_op *op, int res)
{
	struct burst *b = arg;

	b->live--;
	return res;
}

static void
burst_done(int result, void *arg)
{
	struct burst *b = arg;

	b->pending--;
	if (result != 0)
		b->failed++;
}

/* Ten times the queue depth at once: queued inside, never more than depth in flight. */
static void
burst(enum zs_swap_kind kind)
{
	const unsigned qd = 32, n = 10 * qd;
	const uint32_t len = 64 * 1024;
	struct burst b = { 0 };
	struct zs_inject inj = { count_prepare, count_complete, &b };
	char *dir = th_tmpdir();
	struct zs_swap *e;
	struct zs_swap_stats st;
	struct zs_extent x;
	char *buf = th_alloc((size_t)n * len);
	unsigned i;

	cr_assert_eq(th_engine(kind, dir, 64 * MiB, qd, 64 * 1024, &inj, &e), 0);
	cr_assert_eq(zs_extent_alloc(e, (uint64_t)n * len, &x), 0);
	for (i = 0; i < n; i++) {
		/* Every fourth request spans two operations. */
		uint32_t l = i % 4 == 3 ? 2 * len : len;
		uint64_t off = (uint64_t)i * len;

		if (off + l > x.size)
			l = len;
		b.pending++;
		cr_assert_eq(zs_write(e, &x, off, buf + off, l, burst_done, &b), 0);
		zs_swap_stats(e, &st);
		cr_assert(st.in_flight <= qd);
	}
	zs_swap_stats(e, &st);
	cr_assert_eq(st.in_flight, qd);
	cr_assert(st.requests_queued > qd);
	cr_assert_eq(th_drain(e, &b.pending), 0);
	cr_assert_eq(b.failed, 0);
	cr_assert(b.live_max <= qd, "%u operations in flight, depth %u", b.live_max, qd);
	cr_assert_eq(b.live, 0);
	zs_swap_stats(e, &st);
	cr_assert(st.in_flight_peak == qd);
	cr_assert_eq(st.in_flight, 0);
	cr_assert_eq(st.requests_queued, 0);
	cr_assert_eq(st.requests_done, n);
	zs_extent_free(e, &x);
	zs_swap_free(e);
	free(buf);
	th_rmdir(dir);
}

Test(swap_io, burst_bounded_by_queue_depth)
{
	for (unsigned k = 0; k < 2; k++)
		if (!skip_kind(kinds[k]))
			burst(kinds[k]);
}

struct chain {
	struct zs_swap *e;
	struct zs_extent *x;
	char *buf;
	unsigned left;
	unsigned done;
	int error;
};

/* Submitting from inside a callback is how the daemon pipelines. */
static void
chain_next(int result, void *arg)
{
	struct chain *ch = arg;
	int r;

	if (result != 0 && ch->error == 0)
		ch->error = result;
	ch->done++;
	if (ch->left == 0)
		return;
	ch->left--;
	r = zs_write(ch->e, ch->x, (uint64_t)ch->left * 4096, ch->buf, 4096, chain_next, ch);
	if (r < 0)
		ch->error = r;
}

Test(swap_io, submit_from_callback)
{
	for (unsigned k = 0; k < 2; k++) {
		char *dir;
		struct zs_extent x;
		struct chain ch = { 0 };
		unsigned pending = 1;

		if (skip_kind(kinds[k]))
			continue;
		dir = th_tmpdir();
		ch.buf = th_alloc(4096);
		cr_assert_eq(th_engine(kinds[k], dir, 4 * MiB, 4, 0, NULL, &ch.e), 0);
		cr_assert_eq(zs_extent_alloc(ch.e, 1 * MiB, &x), 0);
		ch.x = &x;
		ch.left = 100;
		chain_next(0, &ch);
		ch.done = 0;
		while (ch.done < 100 && ch.error == 0)
			cr_assert(zs_swap_wait(ch.e, 1000) >= 0);
		pending = 0;
		cr_assert_eq(th_drain(ch.e, &pending), 0);
		cr_assert_eq(ch.error, 0);
		zs_swap_free(ch.e);
		free(ch.buf);
		th_rmdir(dir);
	}
}

static void
never(int result, void *arg)
{
	cr_assert_fail("callback of a rejected request");
}

Test(swap_io, rejects_misaligned_and_out_of_range)
{
	char *dir = th_tmpdir(), *buf = th_alloc(2 * MiB);
	struct zs_swap *e;
	struct zs_extent x, other;
	uint64_t a;

	cr_assert_eq(th_engine(ZS_SWAP_PTHREAD, dir, 4 * MiB, 4, 0, NULL, &e), 0);
	a = zs_swap_offset_align(e);
	cr_assert_eq(zs_extent_alloc(e, 1 * MiB, &x), 0);
	cr_assert_eq(zs_read(e, &x, a / 2, buf, a, never, NULL), -EINVAL);
	cr_assert_eq(zs_read(e, &x, 0, buf, a + 1, never, NULL), -EINVAL);
	if (zs_swap_mem_align(e) > 1)
		cr_assert_eq(zs_read(e, &x, 0, buf + 1, a, never, NULL), -EINVAL);
	cr_assert_eq(zs_read(e, &x, 0, buf, 0, never, NULL), -EINVAL);
	cr_assert_eq(zs_read(e, &x, 1 * MiB - a, buf, 2 * a, never, NULL), -ERANGE);
	cr_assert_eq(zs_write(e, &x, 2 * MiB, buf, a, never, NULL), -ERANGE);
	cr_assert_eq(zs_write(e, &x, 0, buf, a, NULL, NULL), -EINVAL);
	/* Space runs out as an error, and released space is whole again. */
	cr_assert_eq(zs_extent_alloc(e, 4 * MiB, &other), -ENOSPC);
	zs_extent_free(e, &x);
	cr_assert_eq(zs_extent_alloc(e, 4 * MiB, &other), 0);
	zs_extent_free(e, &other);
	cr_assert_eq(zs_swap_wait(e, 0), 0);
	zs_swap_free(e);
	free(buf);
	th_rmdir(dir);
}

Test(swap_io, extents_fill_and_coalesce)
{
	char *dir = th_tmpdir(), d0[512], d1[512];
	struct zs_path paths[2] = { { .path = d0 }, { .path = d1 } };
	struct zs_config c = {
		.paths = paths, .npaths = 2, .capacity = 8 * MiB,
		.stripe_unit = 1 * MiB, .engine = ZS_SWAP_PTHREAD,
	};
	struct zs_swap *e;
	struct zs_extent x[64], big;
	struct zs_path_stats s0, s1;
	unsigned i, n = 0;

	snprintf(d0, sizeof(d0), "%s/a", dir);
	snprintf(d1, sizeof(d1), "%s/b", dir);
	mkdir(d0, 0700);
	mkdir(d1, 0700);
	cr_assert_eq(zs_swap_new(&c, &e, NULL), 0);
	/* Sub-unit extents go where there is most room: both paths fill evenly. */
	while (n < 64 && zs_extent_alloc(e, 300 * 1024, &x[n]) == 0)
		n++;
	cr_assert(n >= 50, "%u extents of 300 KiB in 16 MiB", n);
	zs_swap_path_stats(e, 0, &s0);
	zs_swap_path_stats(e, 1, &s1);
	cr_assert(s0.used_bytes > 7 * MiB && s1.used_bytes > 7 * MiB);
	for (i = 0; i < n; i += 2)
		zs_extent_free(e, &x[i]);
	for (i = 1; i < n; i += 2)
		zs_extent_free(e, &x[i]);
	zs_swap_path_stats(e, 0, &s0);
	cr_assert_eq(s0.used_bytes, 0);
	cr_assert_eq(zs_extent_alloc(e, 16 * MiB, &big), 0);
	zs_extent_free(e, &big);
	zs_swap_free(e);
	th_rmdir(dir);
}

static void
count_done(int result, void *arg)
{
	int *n = arg;

	if (result == 0 || result == -ECANCELED)
		(*n)++;
}

Test(swap_io, free_with_requests_outstanding)
{
	for (unsigned k = 0; k < 2; k++) {
		char *dir, *buf;
		struct zs_swap *e;
		struct zs_extent x;
		int n = 0;
		unsigned i;

		if (skip_kind(kinds[k]))
			continue;
		dir = th_tmpdir();
		buf = th_alloc(1 * MiB);
		cr_assert_eq(th_engine(kinds[k], dir, 8 * MiB, 2, 0, NULL, &e), 0);
		cr_assert_eq(zs_extent_alloc(e, 8 * MiB, &x), 0);
		for (i = 0; i < 8; i++)
			cr_assert_eq(zs_write(e, &x, i * MiB, buf, 1 * MiB, count_done, &n), 0);
		zs_swap_free(e);
		cr_assert_eq(n, 8, "every callback runs, ok or cancelled");
		free(buf);
		th_rmdir(dir);
	}
}

Test(swap_io, forced_uring_unavailable)
{
	char *dir = th_tmpdir();
	struct zs_path path = { .path = dir, .capacity = 4 * MiB };
	struct zs_config c = { .paths = &path, .npaths = 1, .force_no_uring = true };
	struct zs_error_info info;
	struct zs_swap_stats st;
	struct zs_swap *e = NULL;

	c.engine = ZS_SWAP_AUTO;
	cr_assert_eq(zs_swap_new(&c, &e, &info), -ZS_E_NOURING);
	cr_assert_null(e);
	cr_assert_eq(info.cause, -ENOSYS);
	cr_assert_str_eq(info.step, "io_uring_queue_init");
	cr_assert(strstr(zs_strerror(-ZS_E_NOURING), "io_uring") != NULL);

	c.engine = ZS_SWAP_URING;
	c.allow_fallback = true;
	cr_assert_eq(zs_swap_new(&c, &e, &info), -ZS_E_NOURING);

	c.engine = ZS_SWAP_AUTO;
	cr_assert_eq(zs_swap_new(&c, &e, &info), 0);
	cr_assert_str_eq(zs_swap_name(e), "pthread");
	zs_swap_stats(e, &st);
	cr_assert_eq(st.uring_error, -ENOSYS);
	zs_swap_free(e);

	/* The environment knob, as a test harness or an operator would set it. */
	c.force_no_uring = false;
	c.allow_fallback = false;
	setenv("ZOFFLOAD_SWAP_NO_URING", "1", 1);
	cr_assert_eq(zs_swap_new(&c, &e, &info), -ZS_E_NOURING);
	unsetenv("ZOFFLOAD_SWAP_NO_URING");
	if (th_uring_problem() == NULL) {
		cr_assert_eq(zs_swap_new(&c, &e, &info), 0);
		cr_assert_str_eq(zs_swap_name(e), "io_uring");
		zs_swap_free(e);
	}
	th_rmdir(dir);
}

Test(swap_io, strerror_names_everything)
{
	cr_assert_str_eq(zs_strerror(0), "success");
	cr_assert_str_eq(zs_strerror(-EIO), "Input/output error");
	cr_assert(strstr(zs_strerror(-ZS_E_NODIRECT), "O_DIRECT") != NULL);
	cr_assert_not_null(zs_strerror(-ZS_E_STALLED));
	cr_assert_not_null(zs_strerror(-99999));
}

/* Visible: Criterion's sandbox finds main by symbol to start test workers. */
__attribute__((visibility("default"))) int
main(int argc, char **argv)
{
	return th_main(argc, argv, th_environment_problem);
}
