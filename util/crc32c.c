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
crc_serial(uint32_t crc, const uint8_t *p, size_t len)
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

/*
 * The crc32 instruction takes 3 cycles and can start one a cycle: three independent
 * streams over three neighbouring blocks run three times as fast as one.  The CRC of
 * A B C is then shift(shift(crc(A)) ^ crc(B)) ^ crc(C), shift being the CRC register
 * run over STREAM zero bytes: linear in the register, so a table per register byte.
 */
#define STREAM 4096
static uint32_t shift_table[4][256];
static bool shift_ready;

__attribute__((target("sse4.2")))
static void
make_shift_table(void)
{
	static const uint8_t zeros[STREAM];
	uint32_t basis[32];

	for (int i = 0; i < 32; i++)
		basis[i] = crc_serial(1u << i, zeros, STREAM);
	for (int k = 0; k < 4; k++)
		for (int b = 0; b < 256; b++) {
			uint32_t v = 0;

			for (int bit = 0; bit < 8; bit++)
				if ((b >> bit) & 1)
					v ^= basis[8 * k + bit];
			shift_table[k][b] = v;
		}
	/* Racing threads compute the same table, as make_table's. */
	__atomic_store_n(&shift_ready, true, __ATOMIC_RELEASE);
}

static uint32_t
shift(uint32_t c)
{
	return shift_table[0][c & 0xff] ^ shift_table[1][(c >> 8) & 0xff] ^
	    shift_table[2][(c >> 16) & 0xff] ^ shift_table[3][c >> 24];
}

__attribute__((target("sse4.2")))
static uint32_t
crc_sse42(uint32_t crc, const uint8_t *p, size_t len)
{
	if (len >= 3 * STREAM && !__atomic_load_n(&shift_ready, __ATOMIC_ACQUIRE))
		make_shift_table();
	while (len >= 3 * STREAM) {
		uint64_t a = crc, b = 0, c = 0;

		for (size_t i = 0; i < STREAM; i += 8) {
			uint64_t va, vb, vc;

			memcpy(&va, p + i, 8);
			memcpy(&vb, p + STREAM + i, 8);
			memcpy(&vc, p + 2 * STREAM + i, 8);
			a = __builtin_ia32_crc32di(a, va);
			b = __builtin_ia32_crc32di(b, vb);
			c = __builtin_ia32_crc32di(c, vc);
		}
		crc = shift(shift((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
		p += 3 * STREAM;
		len -= 3 * STREAM;
	}
	return crc_serial(crc, p, len);
}
#endif

uint32_t
zu_crc32c(uint32_t crc, const void *buf, size_t len)
{
	crc = ~crc;
#if defined(__x86_64__)
	if (__builtin_cpu_supports("sse4.2"))
		return ~crc_sse42(crc, buf, len);
#endif
	return ~crc_table(crc, buf, len);
}
