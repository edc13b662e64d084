/* Swap paths on a really full filesystem (a small tmpfs): refused at start, with the path named. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE	/* statx, fallocate, O_DIRECT, strerrordesc_np */
#endif
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <unistd.h>

#include "swap_helpers.h"

static char *small;	/* an 8 MiB tmpfs, per test process */
static char *big;

static bool
mount_small(char **ret)
{
	char *dir = th_tmpdir();

	if (dir == NULL)
		return false;
	if (mount("zs-test", dir, "tmpfs", MS_NOSUID | MS_NODEV, "size=8m") != 0) {
		rmdir(dir);
		free(dir);
		return false;
	}
	*ret = dir;
	return true;
}

static const char *
mount_problem(void)
{
	static char why[128];
	char *dir;

	if (th_environment_problem() != NULL)
		return th_environment_problem();
	if (!mount_small(&dir)) {
		snprintf(why, sizeof(why), "cannot mount a small tmpfs: %s", strerror(errno));
		return why;
	}
	umount2(dir, MNT_DETACH);
	th_rmdir(dir);
	return NULL;
}

static void
up(void)
{
	cr_assert(mount_small(&small));
	big = th_tmpdir();
}

static void
down(void)
{
	umount2(small, MNT_DETACH);
	th_rmdir(small);
	th_rmdir(big);
}

TestSuite(swap_full, .init = up, .fini = down);

Test(swap_full, capacity_beyond_free_space)
{
	struct zs_path paths[2] = { { .path = big }, { .path = small } };
	struct zs_config c = {
		.paths = paths, .npaths = 2, .capacity = 16 * MiB, .engine = ZS_SWAP_PTHREAD,
	};
	struct zs_error_info info;
	struct zs_swap *e = NULL;

	cr_assert_eq(zs_swap_new(&c, &e, &info), -ENOSPC);
	cr_assert_null(e);
	cr_assert_eq(info.path, 1);
	cr_assert_str_eq(info.step, "fallocate");
	cr_assert_eq(info.cause, -ENOSPC);
}

Test(swap_full, filesystem_already_full)
{
	char filler[512], file[512];
	struct zs_path path = { .path = file, .capacity = 1 * MiB };
	struct zs_config c = { .paths = &path, .npaths = 1, .engine = ZS_SWAP_AUTO,
	    .allow_fallback = true };
	struct zs_error_info info;
	struct zs_swap *e = NULL;
	int fd;

	snprintf(filler, sizeof(filler), "%s/filler", small);
	snprintf(file, sizeof(file), "%s/swap", small);
	fd = open(filler, O_CREAT | O_WRONLY, 0600);
	cr_assert(fd >= 0);
	/* Every page of the tmpfs, so nothing is left. */
	cr_assert_eq(fallocate(fd, 0, 0, 8 * MiB), 0);
	close(fd);
	cr_assert_eq(zs_swap_new(&c, &e, &info), -ENOSPC);
	cr_assert_eq(info.path, 0);
	cr_assert_eq(access(file, F_OK), -1);
	unlink(filler);
}

Test(swap_full, fits_then_works)
{
	struct zs_path path = { .path = small, .capacity = 4 * MiB };
	struct zs_config c = { .paths = &path, .npaths = 1, .engine = ZS_SWAP_AUTO,
	    .allow_fallback = true };
	struct zs_error_info info;
	struct zs_swap *e = NULL;
	struct zs_extent x;
	char *buf = th_alloc(1 * MiB), *back = th_alloc(1 * MiB);
	int r;

	r = zs_swap_new(&c, &e, &info);
	if (r == -ZS_E_NODIRECT)
		cr_skip_test("tmpfs here has no O_DIRECT");
	cr_assert_eq(r, 0, "%s", zs_strerror(r));
	/* Preallocated: the space is taken now, nothing is left for others. */
	cr_assert_eq(zs_extent_alloc(e, 4 * MiB, &x), 0);
	th_fill(buf, 1 * MiB, 3);
	cr_assert_eq(th_io(e, true, &x, 3 * MiB, buf, 1 * MiB), 0);
	cr_assert_eq(th_io(e, false, &x, 3 * MiB, back, 1 * MiB), 0);
	cr_assert(memcmp(buf, back, 1 * MiB) == 0);
	zs_extent_free(e, &x);
	zs_swap_free(e);
	free(buf);
	free(back);
}

/* Visible: Criterion's sandbox finds main by symbol to start test workers. */
__attribute__((visibility("default"))) int
main(int argc, char **argv)
{
	return th_main(argc, argv, mount_problem);
}
