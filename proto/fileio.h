/* Whole positioned reads and writes of checkpoint files, shared by libzclient and zoffloadd. */
#ifndef ZP_FILEIO_H
#define ZP_FILEIO_H

#include <stddef.h>
#include <stdint.h>

/* All of len bytes at offset, across short transfers and EINTR: 0, or -errno (-ENODATA at end of file). */
int zp_pread_full(int fd, void *buf, size_t len, uint64_t offset);
/* 0, or -errno (-EIO when the file takes no more bytes). */
int zp_pwrite_full(int fd, const void *buf, size_t len, uint64_t offset);

#endif
