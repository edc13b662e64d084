/* Helpers shared by the tiers and engine tests: temp dirs, engines, synchronous I/O, huge pages. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE	/* statx, fallocate, O_DIRECT, strerrordesc_np */
#endif
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/mman.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "swap_helpers.h"

char *
th_tmpdir(void)
{
	const char *base = getenv("TMPDIR");
	char *dir;

	if (base == NULL || base[0] == '\0')
		base = "/tmp";
	if (asprintf(&dir, "%s/zs-test-XXXXXX", base) < 0)
		return NULL;
	if (mkdtemp(dir) == NULL) {
		free(dir);
		return NULL;
	}
	return dir;
}

void
th_rmdir(char *dir)
{
	DIR *d;
	struct dirent *de;
	char path[PATH_MAX];

	if (dir == NULL)
		return;
	d = opendir(dir);
	if (d != NULL) {
		while ((de = readdir(d)) != NULL) {
			if (de->d_type != DT_REG)
				continue;
			snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
			unlink(path);
		}
		closedir(d);
	}
	rmdir(dir);
	free(dir);
}

int
th_engine(enum zs_swap_kind kind, const char *dir, uint64_t capacity, unsigned qd,
    uint32_t unit, const struct zs_inject *inject, struct zs_swap **ret)
{
	struct zs_path path = { .path = dir, .capacity = capacity };
	struct zs_config c = {
		.paths = &path,
		.npaths = 1,
		.stripe_unit = unit,
		.queue_depth = qd,
		.engine = kind,
		.inject = inject,
	};

	return zs_swap_new(&c, ret, NULL);
}

static void
io_done(int result, void *arg)
{
	int *r = arg;

	*r = result;
}

int
th_io(struct zs_swap *e, bool write, const struct zs_extent *x, uint64_t off, void *buf,
    size_t len)
{
	int result = 1, r;
	time_t deadline = time(NULL) + 10;

	r = write ? zs_write(e, x, off, buf, len, io_done, &result) :
	    zs_read(e, x, off, buf, len, io_done, &result);
	if (r < 0)
		return r;
	while (result == 1 && time(NULL) < deadline) {
		r = zs_swap_wait(e, 1000);
		if (r < 0)
			return r;
	}
	return result == 1 ? -ETIMEDOUT : result;
}

int
th_drain(struct zs_swap *e, const unsigned *pending)
{
	time_t deadline = time(NULL) + 10;
	int r;

	while (*pending > 0 && time(NULL) < deadline) {
		r = zs_swap_wait(e, 1000);
		if (r < 0)
			return r;
	}
	return *pending > 0 ? -ETIMEDOUT : 0;
}

void *
th_alloc(size_t len)
{
	void *p = NULL;

	if (posix_memalign(&p, 4096, len) != 0)
		return NULL;
	memset(p, 0, len);
	return p;
}

void
th_fill(void *buf, size_t len, uint64_t seed)
{
	uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
	unsigned char *p = buf;
	size_t i;

	for (i = 0; i < len; i++) {
		/* xorshift: cheap, and a shifted or misplaced block never matches. */
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		p[i] = (unsigned char)(x >> 24);
	}
}

static const char *
engine_problem(enum zs_swap_kind kind)
{
	static char why[256];
	struct zs_error_info info;
	struct zs_path path;
	struct zs_config c = { .paths = &path, .npaths = 1, .engine = kind };
	struct zs_swap *e = NULL;
	char *dir = th_tmpdir();
	int r;

	if (dir == NULL)
		return "cannot create a directory under $TMPDIR or /tmp";
	path = (struct zs_path){ .path = dir, .capacity = 4 * MiB };
	r = zs_swap_new(&c, &e, &info);
	zs_swap_free(e);
	if (r < 0)
		snprintf(why, sizeof(why), "%s: %s (%s: %s)", dir, zs_strerror(r), info.step,
		    zs_strerror(info.cause));
	th_rmdir(dir);
	return r < 0 ? why : NULL;
}

const char *
th_uring_problem(void)
{
	return engine_problem(ZS_SWAP_URING);
}

const char *
th_environment_problem(void)
{
	return engine_problem(ZS_SWAP_PTHREAD);
}

int
th_main(int argc, char **argv, const char *(*problem)(void))
{
	struct criterion_test_set *tests;
	const char *why;
	int result = 0;

	/* First: in a test worker this runs the test and never returns. */
	tests = criterion_initialize();
	why = problem != NULL ? problem() : NULL;
	if (why != NULL) {
		fprintf(stderr, "skipped: %s\n", why);
		criterion_finalize(tests);
		return 77;
	}
	if (criterion_handle_args(argc, argv, true))
		result = !criterion_run_all_tests(tests);
	criterion_finalize(tests);
	return result;
}

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

/* KiB of the mapping holding p mapped by 2 MiB shared-memory pages (/proc/self/smaps). */
unsigned long
th_shmem_pmd_kib(const void *p)
{
	FILE *f = fopen("/proc/self/smaps", "r");
	char line[512];
	unsigned long lo, hi, kib = 0, v;
	bool in = false;

	cr_assert_not_null(f);
	while (fgets(line, sizeof(line), f) != NULL) {
		if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, ':') > strchr(line, ' '))
			in = lo <= (uintptr_t)p && (uintptr_t)p < hi;
		else if (in && sscanf(line, "ShmemPmdMapped: %lu kB", &v) == 1)
			kib = v;
	}
	fclose(f);
	return kib;
}

/* Whether this kernel collapses shared memory at all (Linux 6.1, THP configured). */
bool
th_kernel_collapses_shmem(void)
{
	size_t size = 4u << 20, huge = 2u << 20;
	int fd = memfd_create("probe", MFD_CLOEXEC);
	char *span, *p;
	bool ok;

	cr_assert_geq(fd, 0);
	cr_assert_eq(ftruncate(fd, (off_t)size), 0);
	/* On a 2 MiB boundary, as the arena maps: elsewhere no page of the file can be huge. */
	span = mmap(NULL, size + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	cr_assert_neq(span, MAP_FAILED);
	p = (char *)(((uintptr_t)span + huge - 1) & ~(uintptr_t)(huge - 1));
	cr_assert_neq(mmap(p, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0),
	    MAP_FAILED);
	memset(p, 1, size);
	ok = madvise(p, size, MADV_COLLAPSE) == 0;
	munmap(span, size + huge);
	close(fd);
	return ok;
}
