/* libzclient's slot mappings: advice and file identity, for a register and a reconnect's remap alike. */
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "zclient.h"
#include "zclient_impl.h"

void
zci_advise_huge(void *map, size_t bytes)
{
	if (bytes >= (2u << 20))
		(void)madvise(map, bytes, MADV_HUGEPAGE);
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
