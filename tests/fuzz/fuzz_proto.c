/* Fuzz target: zp_decode on arbitrary bytes; whatever decodes must encode back to the same bytes and decode again. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A broken invariant is a crash, so that libFuzzer keeps the input. */
#define CHECK(cond) do {						\
	if (!(cond)) {							\
		fprintf(stderr, "fuzz_proto: %s:%d: %s\n", __FILE__, __LINE__, #cond);	\
		abort();						\
	}								\
} while (0)

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	/* Static: a zp_msg holds two 16 KiB handle arrays. */
	static struct zp_msg m1, m2;
	static uint8_t buf[ZP_MAX_MESSAGE];
	char why[256], tiny[8];
	enum zp_status st, st2;
	size_t len;

	memset(why, 0x55, sizeof(why));
	st = zp_decode(data, size, &m1, why, sizeof(why));
	CHECK((unsigned)st < ZP_S_COUNT && st != ZP_S_NOSPACE);
	CHECK(memchr(why, '\0', sizeof(why)) != NULL);
	CHECK(zp_status_str(st) != NULL);
	/* The explanation is cut to any buffer, and optional. */
	st2 = zp_decode(data, size, &m2, tiny, sizeof(tiny));
	CHECK(st2 == st && memchr(tiny, '\0', sizeof(tiny)) != NULL);
	CHECK(zp_decode(data, size, &m2, NULL, 0) == st);
	if (st != ZP_S_OK)
		return 0;

	CHECK(zp_type_name(m1.hdr.type) != NULL);
	CHECK(m1.hdr.version == ZP_VERSION);
	CHECK(m1.hdr.payload_len == size - ZP_HEADER_SIZE);
	CHECK(zp_type_fds(m1.hdr.type) <= ZP_MAX_FDS);
	/* One encoding per message: what was decoded encodes to exactly the input ... */
	CHECK(zp_encode(&m1, buf, sizeof(buf), &len) == ZP_S_OK);
	CHECK(len == size);
	CHECK(memcmp(buf, data, size) == 0);
	/* ... which decodes to the same message again. */
	CHECK(zp_decode(buf, len, &m2, why, sizeof(why)) == ZP_S_OK);
	CHECK(m2.hdr.type == m1.hdr.type && m2.hdr.request_id == m1.hdr.request_id);
	/* Too small a buffer is refused, never overrun. */
	if (len > ZP_HEADER_SIZE)
		CHECK(zp_encode(&m1, buf, len - 1, &len) == ZP_S_NOSPACE);
	return 0;
}
