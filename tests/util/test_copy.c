/* zu_copy_stream: every byte, every alignment of either side, both sides of its threshold. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "copy.h"

static void fill(unsigned char *p, size_t n, uint32_t seed)
{
	for (size_t i = 0; i < n; i++) {
		seed = seed * 1664525u + 1013904223u;
		p[i] = (unsigned char)(seed >> 24);
	}
}

/*
 * A copy of len bytes from src + soff to dst + doff, in buffers with guard
 * bytes on both sides: the copy must equal the source and leave the guards.
 */
static void check(size_t len, size_t soff, size_t doff)
{
	size_t cap = len + 256;
	unsigned char *src = malloc(cap), *dst = malloc(cap), *want = malloc(cap);

	cr_assert(src && dst && want);
	fill(src, cap, (uint32_t)(len ^ soff << 8));
	fill(dst, cap, (uint32_t)(len ^ doff << 16) + 7);
	memcpy(want, dst, cap);
	memcpy(want + doff, src + soff, len);
	zu_copy_stream(dst + doff, src + soff, len);
	if (memcmp(dst, want, cap) != 0) {
		size_t i = 0;

		while (dst[i] == want[i])
			i++;
		cr_assert_fail("len %zu, source offset %zu, destination offset %zu: byte %zu is %u, want %u",
		    len, soff, doff, i, dst[i], want[i]);
	}
	free(src);
	free(dst);
	free(want);
}

Test(util_copy, small_copies_are_exact)
{
	for (size_t len = 0; len < 300; len++)
		check(len, len % 7, len % 13);
}

Test(util_copy, streamed_copies_are_exact_at_every_alignment)
{
	/* From the threshold on the lines are streamed: the head and tail bytes around them count. */
	size_t lens[] = { ZU_COPY_STREAM_MIN, ZU_COPY_STREAM_MIN + 1, ZU_COPY_STREAM_MIN + 63,
		ZU_COPY_STREAM_MIN + 65, 3 * ZU_COPY_STREAM_MIN + 17 };

	for (size_t l = 0; l < sizeof(lens) / sizeof(lens[0]); l++)
		for (size_t soff = 0; soff < 64; soff += 9)
			for (size_t doff = 0; doff < 64; doff += 5)
				check(lens[l], soff, doff);
}

Test(util_copy, just_below_the_threshold_is_exact)
{
	check(ZU_COPY_STREAM_MIN - 1, 3, 61);
}
