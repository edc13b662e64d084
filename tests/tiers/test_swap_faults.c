/* Swap engine under what the kernel can return: short I/O, EIO, ENOSPC, EAGAIN, no progress. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE	/* statx, fallocate, O_DIRECT, strerrordesc_np */
#endif
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "swap_helpers.h"

static const enum zs_swap_kind kinds[] = { ZS_SWAP_URING, ZS_SWAP_PTHREAD };

enum fault {
	F_SHORT,		/* first try of every op moves half, unaligned */
	F_EIO_PATH1,		/* every op on path 1 fails */
	F_EIO_PREPARE,		/* failed before reaching the kernel */
	F_ENOSPC_WRITE,
	F_EAGAIN_3,		/* three tries fail with EAGAIN, then through */
	F_EAGAIN_ALWAYS,
	F_NO_PROGRESS,
};

struct faults {
	enum fault fault;
	unsigned tries;		/* completions seen */
	unsigned failed;	/* injected failures */
	unsigned max_attempt;
};

static int
f_prepare(void *arg, const struct zs_inject_op *op)
{
	struct faults *f = arg;

	if (f->fault == F_EIO_PREPARE && op->len > 4096) {
		f->failed++;
		return -EIO;
	}
	return 0;
}

static int
f_complete(void *arg, const struct zs_inject_op *op, int res)
{
	struct faults *f = arg;

	f->tries++;
	if (op->attempt > f->max_attempt)
		f->max_attempt = op->attempt;
	if (res < 0)
		return res;
	switch (f->fault) {
	case F_SHORT:
		if (op->attempt == 0 && res > 8192) {
			int part = res / 2 + 100;

			/* What was "not transferred" is garbage, so a wrong resubmit shows. */
			if (!op->write)
				memset((char *)op->buf + part, 0xee, (size_t)(res - part));
			f->failed++;
			return part;
		}
		return res;
	case F_EIO_PATH1:
		if (op->path == 1) {
			f->failed++;
			return -EIO;
		}
		return res;
	case F_ENOSPC_WRITE:
		if (op->write) {
			f->failed++;
			return -ENOSPC;
		}
		return res;
	case F_EAGAIN_3:
		if (op->attempt < 3) {
			f->failed++;
			return -EAGAIN;
		}
		return res;
	case F_EAGAIN_ALWAYS:
		f->failed++;
		return -EAGAIN;
	case F_NO_PROGRESS:
		return 0;
	default:
		return res;
	}
}

struct setup {
	char *dir;
	struct zs_swap *e;
	struct zs_extent x;
	struct faults f;
	struct zs_inject inj;
	char *buf;
	char *back;
	uint64_t size;
};

static bool
setup(struct setup *s, enum zs_swap_kind kind, enum fault fault, unsigned npaths)
{
	char sub[2][512];
	struct zs_path paths[2];
	struct zs_config c = {
		.paths = paths, .npaths = npaths, .capacity = 8 * MiB,
		.stripe_unit = 64 * 1024, .queue_depth = 4, .engine = kind,
	};
	const char *why = kind == ZS_SWAP_URING ? th_uring_problem() : NULL;
	unsigned i;

	if (why != NULL) {
		cr_log_warn("io_uring part skipped: %s", why);
		return false;
	}
	memset(s, 0, sizeof(*s));
	s->size = 1 * MiB;
	s->f.fault = fault;
	s->inj = (struct zs_inject){ f_prepare, f_complete, &s->f };
	c.inject = &s->inj;
	s->dir = th_tmpdir();
	for (i = 0; i < npaths; i++) {
		snprintf(sub[i], sizeof(sub[i]), "%s/p%u", s->dir, i);
		mkdir(sub[i], 0700);
		paths[i] = (struct zs_path){ .path = sub[i] };
	}
	cr_assert_eq(zs_swap_new(&c, &s->e, NULL), 0);
	cr_assert_eq(zs_extent_alloc(s->e, s->size, &s->x), 0);
	s->buf = th_alloc(s->size);
	s->back = th_alloc(s->size);
	th_fill(s->buf, s->size, fault + 1);
	return true;
}

static void
teardown(struct setup *s)
{
	struct zs_swap_stats st;

	/* Whatever failed, nothing stays in flight or queued. */
	zs_swap_stats(s->e, &st);
	cr_assert_eq(st.in_flight, 0);
	cr_assert_eq(st.requests_queued, 0);
	zs_extent_free(s->e, &s->x);
	zs_swap_free(s->e);
	free(s->buf);
	free(s->back);
	th_rmdir(s->dir);
}

static uint64_t
errors(struct zs_swap *e, unsigned path, int which)
{
	struct zs_path_stats ps;

	cr_assert_eq(zs_swap_path_stats(e, path, &ps), 0);
	return which == EIO ? ps.errors_eio : which == ENOSPC ? ps.errors_enospc : ps.errors_other;
}

Test(swap_faults, short_io_resubmitted)
{
	for (unsigned k = 0; k < 2; k++) {
		struct setup s;
		struct zs_swap_stats st;

		if (!setup(&s, kinds[k], F_SHORT, 2))
			continue;
		cr_assert_eq(th_io(s.e, true, &s.x, 0, s.buf, s.size), 0);
		cr_assert_eq(th_io(s.e, false, &s.x, 0, s.back, s.size), 0);
		cr_assert(memcmp(s.buf, s.back, s.size) == 0);
		zs_swap_stats(s.e, &st);
		cr_assert(s.f.failed >= 2 && st.short_ios == s.f.failed, "%u short, %lu resubmitted",
		    s.f.failed, (unsigned long)st.short_ios);
		cr_assert_eq(errors(s.e, 0, EIO) + errors(s.e, 0, 0), 0);
		teardown(&s);
	}
}

Test(swap_faults, eio_reported_and_counted_per_path)
{
	for (unsigned k = 0; k < 2; k++) {
		struct setup s;
		uint32_t unit = 64 * 1024;
		unsigned p0 = 0;

		if (!setup(&s, kinds[k], F_EIO_PATH1, 2))
			continue;
		/* The whole extent crosses path 1: fails; a unit on path 0 alone works. */
		cr_assert_eq(th_io(s.e, true, &s.x, 0, s.buf, s.size), -EIO);
		if (s.x.first_path != 0)
			p0 = 1;
		cr_assert_eq(th_io(s.e, true, &s.x, p0 * unit, s.buf, unit), 0);
		cr_assert_eq(th_io(s.e, false, &s.x, (p0 ^ 1) * unit, s.back, unit), -EIO);
		cr_assert(errors(s.e, 1, EIO) >= 2);
		cr_assert_eq(errors(s.e, 0, EIO), 0);
		cr_assert_eq(s.f.max_attempt, 0, "an EIO is never retried");
		teardown(&s);
	}
}

Test(swap_faults, eio_before_submission)
{
	for (unsigned k = 0; k < 2; k++) {
		struct setup s;

		if (!setup(&s, kinds[k], F_EIO_PREPARE, 1))
			continue;
		cr_assert_eq(th_io(s.e, false, &s.x, 0, s.back, s.size), -EIO);
		cr_assert_eq(th_io(s.e, false, &s.x, 0, s.back, 4096), 0);
		cr_assert(errors(s.e, 0, EIO) >= 1);
		teardown(&s);
	}
}

Test(swap_faults, enospc_reported_never_retried)
{
	for (unsigned k = 0; k < 2; k++) {
		struct setup s;

		if (!setup(&s, kinds[k], F_ENOSPC_WRITE, 2))
			continue;
		cr_assert_eq(th_io(s.e, true, &s.x, 0, s.buf, s.size), -ENOSPC);
		cr_assert_eq(s.f.max_attempt, 0);
		cr_assert(errors(s.e, 0, ENOSPC) + errors(s.e, 1, ENOSPC) >= 1);
		/* Reads still work. */
		cr_assert_eq(th_io(s.e, false, &s.x, 0, s.back, s.size), 0);
		teardown(&s);
	}
}

Test(swap_faults, eagain_retried)
{
	for (unsigned k = 0; k < 2; k++) {
		struct setup s;
		struct zs_swap_stats st;

		if (!setup(&s, kinds[k], F_EAGAIN_3, 2))
			continue;
		cr_assert_eq(th_io(s.e, true, &s.x, 0, s.buf, s.size), 0);
		cr_assert_eq(th_io(s.e, false, &s.x, 0, s.back, s.size), 0);
		cr_assert(memcmp(s.buf, s.back, s.size) == 0);
		zs_swap_stats(s.e, &st);
		cr_assert_eq(st.retries, s.f.failed);
		cr_assert_eq(errors(s.e, 0, 0) + errors(s.e, 1, 0), 0);
		teardown(&s);
	}
}

Test(swap_faults, endless_eagain_is_an_error)
{
	for (unsigned k = 0; k < 2; k++) {
		struct setup s;

		if (!setup(&s, kinds[k], F_EAGAIN_ALWAYS, 1))
			continue;
		cr_assert_eq(th_io(s.e, true, &s.x, 0, s.buf, 64 * 1024), -EAGAIN);
		cr_assert_eq(errors(s.e, 0, 0), 1);
		teardown(&s);
	}
}

Test(swap_faults, no_progress_is_an_error)
{
	for (unsigned k = 0; k < 2; k++) {
		struct setup s;

		if (!setup(&s, kinds[k], F_NO_PROGRESS, 1))
			continue;
		cr_assert_eq(th_io(s.e, false, &s.x, 0, s.back, 64 * 1024), -ZS_E_STALLED);
		cr_assert_eq(errors(s.e, 0, 0), 1);
		teardown(&s);
	}
}

/* A file that cannot grow (RLIMIT_FSIZE) fails at start, not at the first write. */
Test(swap_faults, file_size_limit_fails_at_start)
{
	char *dir = th_tmpdir(), file[512];
	struct zs_path path = { .path = file, .capacity = 8 * MiB };
	struct zs_config c = { .paths = &path, .npaths = 1, .engine = ZS_SWAP_PTHREAD };
	struct zs_error_info info;
	struct rlimit rl = { 1 * MiB, 1 * MiB };
	struct zs_swap *e = NULL;

	snprintf(file, sizeof(file), "%s/swap", dir);
	signal(SIGXFSZ, SIG_IGN);
	cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
	cr_assert_eq(zs_swap_new(&c, &e, &info), -EFBIG);
	cr_assert_null(e);
	cr_assert_eq(info.path, 0);
	cr_assert_str_eq(info.step, "fallocate");
	cr_assert_eq(access(file, F_OK), -1, "a file the engine created is removed on failure");
	th_rmdir(dir);
}

/* Visible: Criterion's sandbox finds main by symbol to start test workers. */
__attribute__((visibility("default"))) int
main(int argc, char **argv)
{
	return th_main(argc, argv, th_environment_problem);
}

/* A path whose I/O failed is bad: new extents go to the others only, and work there. */
Test(swap_faults, failing_path_takes_no_new_extents)
{
	for (unsigned k = 0; k < 2; k++) {
		struct zs_path_stats ps;
		struct zs_extent y;
		uint64_t used1;
		struct setup s;

		if (!setup(&s, kinds[k], F_EIO_PATH1, 2))
			continue;
		cr_assert_eq(zs_swap_path_stats(s.e, 1, &ps), 0);
		cr_assert_eq(ps.bad, 0, "bad before any I/O");
		cr_assert_eq(th_io(s.e, true, &s.x, 0, s.buf, s.size), -EIO);
		cr_assert_eq(zs_swap_path_stats(s.e, 1, &ps), 0);
		cr_assert_eq(ps.bad, -EIO, "path 1 failed its I/O but is not bad (%d)", ps.bad);
		used1 = ps.used_bytes;
		cr_assert_eq(zs_swap_path_stats(s.e, 0, &ps), 0);
		cr_assert_eq(ps.bad, 0);
		cr_assert_eq(zs_extent_alloc(s.e, s.size, &y), 0);
		cr_assert_eq(y.nslots, 1);
		cr_assert_eq(y.paths[0], 0);
		cr_assert_eq(zs_swap_path_stats(s.e, 1, &ps), 0);
		cr_assert_eq(ps.used_bytes, used1, "the bad path took part of a new extent");
		cr_assert_eq(zs_swap_check_paths(s.e), 1);
		cr_assert_eq(th_io(s.e, true, &y, 0, s.buf, s.size), 0);
		cr_assert_eq(th_io(s.e, false, &y, 0, s.back, s.size), 0);
		cr_assert(memcmp(s.buf, s.back, s.size) == 0);
		zs_extent_free(s.e, &y);
		teardown(&s);
	}
}
