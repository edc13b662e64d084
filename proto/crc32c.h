/* CRC-32C (Castagnoli), as in iSCSI, ext4 and the checksums of zoffload's checkpoints. */
#ifndef ZP_CRC32C_H
#define ZP_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/*
 * The CRC of buf continued from crc (0 to start): crc32c(crc32c(0, a), b)
 * is the CRC of a followed by b.  SSE4.2 when the CPU has it.
 */
uint32_t zp_crc32c(uint32_t crc, const void *buf, size_t len);

#endif
