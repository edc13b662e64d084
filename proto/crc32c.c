/* CRC-32C: a table for any CPU, the SSE4.2 instruction where there is one. */
#include <stdbool.h>
#include <string.h>

#include "crc32c.h"

#define POLY 0x82f63b78u	/* Castagnoli, reflected */

static uint32_t table[256];
static bool table_ready;

static void
make_table(void)
{
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;

		for (int k = 0; k < 8; k++)
			c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
		table[i] = c;
	}
	table_ready = true;
}

static uint32_t
crc_table(uint32_t crc, const uint8_t *p, size_t len)
{
	/* Racing threads compute the same table: every store writes the same value. */
	if (!__atomic_load_n(&table_ready, __ATOMIC_ACQUIRE))
		make_table();
	while (len-- > 0)
		crc = table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
	return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2")))
static uint32_t
crc_sse42(uint32_t crc, const uint8_t *p, size_t len)
{
	uint64_t c = crc;

	while (len > 0 && ((uintptr_t)p & 7) != 0) {
		crc = __builtin_ia32_crc32qi((uint32_t)c, *p++);
		c = crc;
		len--;
	}
	while (len >= 8) {
		uint64_t v;

		memcpy(&v, p, 8);
		c = __builtin_ia32_crc32di(c, v);
		p += 8;
		len -= 8;
	}
	crc = (uint32_t)c;
	while (len-- > 0)
		crc = __builtin_ia32_crc32qi(crc, *p++);
	return crc;
}
#endif

uint32_t
zp_crc32c(uint32_t crc, const void *buf, size_t len)
{
	crc = ~crc;
#if defined(__x86_64__)
	if (__builtin_cpu_supports("sse4.2"))
		return ~crc_sse42(crc, buf, len);
#endif
	return ~crc_table(crc, buf, len);
}
