/* Shared memory the daemon creates for clients: memfd, sealed against resizing, mapped here. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine_impl.h"

/*
 * What a client that only reads a slot gets: a new open file description of
 * it, read-only, so that no mapping of it can be made or turned writable and
 * write(), fallocate() and ftruncate() refuse.  The file's mode drops to
 * 0400 first, so that a client of another uid can neither reopen it for
 * writing through /proc/self/fd nor chmod it back (it is not the owner).
 * Unlike a seal this binds only the client's descriptor: ours, kept in the
 * fd store, still maps the slot writable after a restart.
 */
static int
reopen_read_only(int fd)
{
	char path[32];
	int ro;

	if (fchmod(fd, 0400) != 0)
		return -errno;
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	ro = open(path, O_RDONLY | O_CLOEXEC);
	return ro < 0 ? -errno : ro;
}

/*
 * A slot of 4 MiB or more is mapped on a 2 MiB boundary and, made here, put
 * into 2 MiB pages (with memory.hugepages): the step streams its grad and
 * param slots beside the state, and over 4 KiB pages it ran 8-10% slower
 * (bench_torch_c, 100 M params in 24 tensors, 2 threads: 66.7 ms against
 * 60.7).  Huge pages also mean fewer faults to fill a slot, and far fewer
 * page tables to tear down when the daemon dies (its successor waits for
 * that).  A kept slot is mapped as its last process left it: no walk of it
 * at a restart.  A copied one (src) is not collapsed either (its pages would
 * be copied twice).
 */
static int
map_slot(struct ze_engine *e, int fd, size_t bytes, bool client_read_only, bool fresh,
    struct ze_shm *ret)
{
	bool huge = e->cfg.hugepages && bytes >= ZT_HUGEPAGE_MIN;
	void *map;
	int ro = -1;

	if (client_read_only && (ro = reopen_read_only(fd)) < 0)
		return ro;
	map = zt_map_aligned(bytes, huge, fd);
	if (map == NULL) {
		int r = -errno;

		if (ro >= 0)
			close(ro);
		return r;
	}
	if (huge && fresh)
		zt_collapse(map, bytes, true);
	*ret = (struct ze_shm){ .fd = fd, .map = map, .bytes = bytes,
		.client_read_only = client_read_only, .ro_fd = ro };
	return 0;
}

/* A copy of src (bytes of it) in the kernel: no page of it faults into this process. */
static int
copy_from(int fd, int src, size_t bytes)
{
	off64_t in = 0, out = 0;

	while ((size_t)in < bytes) {
		ssize_t n = copy_file_range(src, &in, fd, &out, bytes - (size_t)in, 0);

		if (n < 0)
			return -errno;
		if (n == 0)
			return -EIO;
	}
	return 0;
}

int
ze_shm_create_from(struct ze_engine *e, const char *name, size_t bytes, bool client_read_only,
    int src, struct ze_shm *ret)
{
	int fd, r;

	/* Whole pages, so O_DIRECT can move a slot's last page too. */
	bytes = (bytes + 4095) / 4096 * 4096;
	if (src < 0 && e->stats.shm_bytes + bytes > e->cfg.shm_budget)
		return -ENOSPC;
	fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)bytes) != 0) {
		r = -errno;
		goto fail;
	}
	if (src >= 0 && (r = copy_from(fd, src, bytes)) < 0)
		goto fail;
	/*
	 * A client that shrinks the file would make our mapping fault with
	 * SIGBUS; sealed, it cannot.  No seal against writes: that one would
	 * bind our own descriptor too, and a restarted daemon could not map
	 * the slot writable again (see reopen_read_only).
	 */
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
		r = -errno;
		goto fail;
	}
	r = map_slot(e, fd, bytes, client_read_only, src < 0, ret);
	if (r < 0)
		goto fail;
	e->stats.shm_bytes += bytes;
	e->stats.shm_objects++;
	return 0;
fail:
	close(fd);
	return r;
}

int
ze_shm_create(struct ze_engine *e, const char *name, size_t bytes, bool client_read_only,
    struct ze_shm *ret)
{
	return ze_shm_create_from(e, name, bytes, client_read_only, -1, ret);
}

void
ze_shm_destroy(struct ze_engine *e, struct ze_shm *shm)
{
	if (shm->map == NULL)
		return;
	munmap(shm->map, shm->bytes);
	close(shm->fd);
	if (shm->client_read_only)
		close(shm->ro_fd);
	e->stats.shm_bytes -= shm->bytes;
	e->stats.shm_objects--;
	*shm = (struct ze_shm){ .fd = -1 };
}

int
ze_shm_adopt(struct ze_engine *e, int fd, size_t bytes, bool client_read_only,
    struct ze_shm *ret)
{
	struct stat st;
	int r;

	bytes = (bytes + 4095) / 4096 * 4096;
	if (fstat(fd, &st) != 0)
		return -errno;
	if ((uint64_t)st.st_size != bytes)
		return -EBADFD;
	r = map_slot(e, fd, bytes, client_read_only, false, ret);
	if (r < 0)
		return r;
	e->stats.shm_bytes += bytes;
	e->stats.shm_objects++;
	return 0;
}
