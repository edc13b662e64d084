/* CRC-32C (Castagnoli), as in iSCSI and ext4: the checksums of checkpoints, kept records and the restart table. */
#ifndef ZU_CRC32C_H
#define ZU_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/*
 * The CRC of buf continued from crc (0 to start): crc32c(crc32c(0, a), b)
 * is the CRC of a followed by b.  SSE4.2 when the CPU has it.
 */
uint32_t zu_crc32c(uint32_t crc, const void *buf, size_t len);

#endif
