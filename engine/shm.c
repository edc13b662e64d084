/* Shared memory the daemon creates for clients: memfd, sealed against resizing, mapped here. */
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine_impl.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

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
	void *map;

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
	map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED) {
		r = -errno;
		goto fail;
	}
	/*
	 * A client that shrinks the file would make our mapping fault with
	 * SIGBUS; sealed, it cannot.  Slots the client only reads are also
	 * sealed against new writable mappings (our own predates the seal).
	 */
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
		r = -errno;
		munmap(map, bytes);
		goto fail;
	}
	if (client_read_only)
		(void)fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE);
	(void)fcntl(fd, F_ADD_SEALS, F_SEAL_SEAL);
	e->stats.shm_bytes += bytes;
	e->stats.shm_objects++;
	*ret = (struct ze_shm){ .fd = fd, .map = map, .bytes = bytes };
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
	e->stats.shm_bytes -= shm->bytes;
	e->stats.shm_objects--;
	*shm = (struct ze_shm){ .fd = -1 };
}

int
ze_shm_adopt(struct ze_engine *e, int fd, size_t bytes, struct ze_shm *ret)
{
	struct stat st;
	void *map;

	bytes = (bytes + 4095) / 4096 * 4096;
	if (fstat(fd, &st) != 0)
		return -errno;
	if ((uint64_t)st.st_size != bytes)
		return -EBADFD;
	map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED)
		return -errno;
	e->stats.shm_bytes += bytes;
	e->stats.shm_objects++;
	*ret = (struct ze_shm){ .fd = fd, .map = map, .bytes = bytes };
	return 0;
}
