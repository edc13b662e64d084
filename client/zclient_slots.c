/* libzclient's slot mappings: advice and file identity, for a register and a reconnect's remap alike. */
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "zclient.h"
#include "zclient_impl.h"

#define HUGEPAGE_SIZE ((size_t)2 << 20)

void
zci_advise_huge(void *map, size_t bytes)
{
	if (bytes >= HUGEPAGE_SIZE)
		(void)madvise(map, bytes, MADV_HUGEPAGE);
}

/*
 * A slot of 4 MiB or more goes on a 2 MiB boundary: the daemon puts its
 * slots into 2 MiB pages, and only an aligned mapping takes them whole (a
 * fresh gradient copied into its slot, the params read out of theirs).
 */
void *
zci_map_slot(size_t bytes, int prot, int fd)
{
	size_t span = bytes + HUGEPAGE_SIZE;
	uintptr_t start, aligned;
	char *p;

	if (bytes < 2 * HUGEPAGE_SIZE)
		return mmap(NULL, bytes, prot, MAP_SHARED, fd, 0);
	p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED)
		return MAP_FAILED;
	start = (uintptr_t)p;
	aligned = (start + HUGEPAGE_SIZE - 1) & ~(uintptr_t)(HUGEPAGE_SIZE - 1);
	if (aligned > start)
		munmap(p, aligned - start);
	if (start + span > aligned + bytes)
		munmap((char *)aligned + bytes, start + span - (aligned + bytes));
	p = mmap((void *)aligned, bytes, prot, MAP_SHARED | MAP_FIXED, fd, 0);
	if (p == MAP_FAILED) {
		int err = errno;

		munmap((void *)aligned, bytes);
		errno = err;
	}
	return p;
}

void
zci_file_id(int fd, uint64_t *dev, uint64_t *ino)
{
	struct stat st;

	if (fstat(fd, &st) == 0) {
		*dev = (uint64_t)st.st_dev;
		*ino = (uint64_t)st.st_ino;
	} else {
		*dev = *ino = 0;
	}
}
