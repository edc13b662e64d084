/* zu_copy_stream: SSE2 streaming stores, which every x86-64 has, so no dispatch. */
#include <stdint.h>
#include <string.h>

#include "copy.h"

#ifdef __SSE2__
#include <emmintrin.h>

void zu_copy_stream(void *dst, const void *src, size_t bytes)
{
	char *d = dst;
	const char *s = src;
	size_t head = (64 - ((uintptr_t)d & 63)) & 63, i;

	if (bytes < ZU_COPY_STREAM_MIN) {
		memcpy(dst, src, bytes);
		return;
	}
	/*
	 * Whole destination lines from the first line boundary on: four stores
	 * fill a line in the write-combining buffer, which then goes to memory
	 * without the line being read.  The source may have any alignment.
	 */
	memcpy(d, s, head);
	for (i = head; i + 64 <= bytes; i += 64) {
		__m128i a = _mm_loadu_si128((const __m128i *)(const void *)(s + i));
		__m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 16));
		__m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 32));
		__m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 48));

		_mm_stream_si128((__m128i *)(void *)(d + i), a);
		_mm_stream_si128((__m128i *)(void *)(d + i + 16), b);
		_mm_stream_si128((__m128i *)(void *)(d + i + 32), c);
		_mm_stream_si128((__m128i *)(void *)(d + i + 48), e);
	}
	memcpy(d + i, s + i, bytes - i);
	/* Streaming stores are weakly ordered: fence them before whatever tells the reader. */
	_mm_sfence();
}

#else

void zu_copy_stream(void *dst, const void *src, size_t bytes)
{
	memcpy(dst, src, bytes);
}

#endif
