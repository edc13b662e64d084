/* The wire codec: every message type survives encode/decode, every malformed datagram is refused with a reason. */
#include <criterion/criterion.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "proto.h"

/* Big enough for any message; static because a zp_msg with 4096 handles is 16 KiB. */
static uint8_t buf[ZP_MAX_MESSAGE + 16];
static uint8_t buf2[ZP_MAX_MESSAGE + 16];
/* The last request number; the ranges leave it free. */
#define UNUSED_TYPE 63
static struct zp_msg in, out;
static char why[256];

static size_t
encode(const struct zp_msg *m)
{
	size_t len = 0;
	enum zp_status st = zp_encode(m, buf, sizeof(buf), &len);

	cr_assert_eq(st, ZP_S_OK, "encode %s: %s", zp_type_name(m->hdr.type), zp_status_str(st));
	cr_assert_geq(len, ZP_HEADER_SIZE);
	return len;
}

static enum zp_status
decode(size_t len)
{
	why[0] = '\0';
	return zp_decode(buf, len, &out, why, sizeof(why));
}

/* Encodes in, decodes into out, and checks the header made it across. */
static void
round_trip(uint16_t type, uint64_t request_id)
{
	size_t len;
	enum zp_status st;

	in.hdr.type = type;
	in.hdr.request_id = request_id;
	len = encode(&in);
	memset(&out, 0xa5, sizeof(out));
	st = decode(len);
	cr_assert_eq(st, ZP_S_OK, "%s: %s (%s)", zp_type_name(type), zp_status_str(st), why);
	cr_assert_eq(out.hdr.type, type);
	cr_assert_eq(out.hdr.version, ZP_VERSION);
	cr_assert_eq(out.hdr.request_id, request_id);
	cr_assert_eq(out.hdr.payload_len, len - ZP_HEADER_SIZE);
}

static void
reset(void)
{
	memset(&in, 0, sizeof(in));
	memset(&out, 0, sizeof(out));
}

static void
put32(size_t off, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		buf[off + i] = (uint8_t)(v >> (8 * i));
}

static void
put16(size_t off, uint16_t v)
{
	buf[off] = (uint8_t)v;
	buf[off + 1] = (uint8_t)(v >> 8);
}

/* Rewrites the header's payload_len after a test changed the payload's size. */
static void
fix_len(size_t len)
{
	put32(16, (uint32_t)(len - ZP_HEADER_SIZE));
}

/* Decoding must fail with status, and why must name the type and the field. */
static void
expect_reject(size_t len, enum zp_status status, const char *type, const char *field)
{
	enum zp_status st = decode(len);

	cr_assert_eq(st, status, "expected '%s', got '%s' (%s)", zp_status_str(status),
	    zp_status_str(st), why);
	if (type != NULL)
		cr_assert(strstr(why, type) != NULL, "why '%s' does not name %s", why, type);
	if (field != NULL)
		cr_assert(strstr(why, field) != NULL, "why '%s' does not name %s", why, field);
}

TestSuite(codec, .init = reset);

Test(codec, type_tables)
{
	cr_assert_str_eq(zp_type_name(ZP_STEP_SUBMIT), "STEP_SUBMIT");
	cr_assert_null(zp_type_name(0));
	cr_assert_null(zp_type_name(UNUSED_TYPE));
	cr_assert_null(zp_type_name(0xffff));
	cr_assert_eq(zp_type_fds(ZP_TENSOR_OK), 2);
	cr_assert_eq(zp_type_fds(ZP_XFER_OK), 1);
	cr_assert_eq(zp_type_fds(ZP_JSON_FD), 1);
	cr_assert_eq(zp_type_fds(ZP_JSON), 0);
	cr_assert(zp_type_is_request(ZP_HELLO));
	cr_assert(zp_type_is_request(ZP_JOBS));
	cr_assert_not(zp_type_is_request(ZP_OK));
	cr_assert_not(zp_type_is_request(ZP_STEP_DONE));
	cr_assert_not(zp_type_is_request(UNUSED_TYPE));
	cr_assert_str_eq(zp_status_str(ZP_S_OK), "ok");
	cr_assert_str_eq(zp_status_str(ZP_S_COUNT), "unknown status");
}

/* A message of this type with every field in range (zero where zero is valid). */
static void
fill_valid(uint16_t type)
{
	memset(&in, 0, sizeof(in));
	in.hdr.type = type;
	switch (type) {
	case ZP_JOB_OPEN:
		strcpy(in.u.job_open.job_name, "job");
		in.u.job_open.world_size = 4;
		in.u.job_open.rank = 3;
		break;
	case ZP_TENSOR_REGISTER:
		strcpy(in.u.tensor_register.name, "w");
		in.u.tensor_register.numel = 1000;
		break;
	case ZP_TENSOR_READ:
	case ZP_TENSOR_WRITE:
		in.u.tensor_io.count = 10;
		break;
	case ZP_CKPT_WRITE:
	case ZP_CKPT_READ:
		in.u.ckpt_write.count = 10;
		break;
	case ZP_STEP_SUBMIT:
		in.u.step_submit = (struct zp_step_submit){ .step = 5, .lr = 1e-3, .beta1 = 0.9,
			.beta2 = 0.999, .eps = 1e-8, .grad_scale = 1, .count = 2,
			.handles = { 1, 2 } };
		break;
	case ZP_XFER_OK:
		in.u.xfer_ok.bytes = 1 << 20;
		break;
	case ZP_JSON_FD:
		in.u.json_fd.bytes = 1 << 20;
		break;
	case ZP_ERROR:
		in.u.error.code = -22;
		strcpy(in.u.error.message, "bad");
		break;
	case ZP_HELLO_OK:
		strcpy(in.u.hello_ok.daemon_version, "9.9");
		break;
	case ZP_JSON:
		in.u.json.text = "{}";
		in.u.json.len = 2;
		break;
	case ZP_PARAM_FETCH:
	case ZP_PARAM_RELEASE:
		in.u.handles.count = 3;
		in.u.handles.handles[0] = 7;
		in.u.handles.handles[2] = UINT32_MAX;
		break;
	case ZP_GRAD_PASS:
		in.u.grad_pass.grad_scale = 1;
		in.u.grad_pass.count = 2;
		in.u.grad_pass.handles[1] = 9;
		break;
	default:
		/* Names sit first in every payload that starts with one; elsewhere it is a number. */
		strcpy((char *)&in.u, "nm");
		break;
	}
}

/*
 * Every type the protocol defines, today's and any added later: decoding
 * and encoding again gives the same bytes, so no field is lost or altered.
 * The per-type tests below check the fields by name.
 */
Test(codec, round_trip_every_type)
{
	static const uint16_t types[] = {
#define ZP_TYPE_LIST(name, value) value,
		ZP_TYPES(ZP_TYPE_LIST)
#undef ZP_TYPE_LIST
	};
	size_t len, len2;
	enum zp_status st;

	for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
		fill_valid(types[i]);
		in.hdr.request_id = 0x0102030405060708ull + i;
		len = encode(&in);
		st = decode(len);
		cr_assert_eq(st, ZP_S_OK, "%s: %s", zp_type_name(types[i]), why);
		cr_assert_eq(out.hdr.type, types[i]);
		cr_assert_eq(out.hdr.request_id, in.hdr.request_id);
		/* out's JSON points into buf, so re-encode before buf is reused. */
		cr_assert_eq(zp_encode(&out, buf2, sizeof(buf2), &len2), ZP_S_OK);
		cr_assert_eq(len2, len, "%s: %zu bytes, then %zu", zp_type_name(types[i]), len, len2);
		cr_assert_eq(memcmp(buf, buf2, len), 0, "%s changed in a round trip",
		    zp_type_name(types[i]));
	}
}

/* Messages without a payload. */
Test(codec, round_trip_empty)
{
	static const uint16_t types[] = { ZP_PING, ZP_JOB_CLOSE, ZP_XFER_OPEN, ZP_STATS, ZP_JOBS,
		ZP_OK, ZP_PONG };

	for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
		round_trip(types[i], 1000 + i);
		cr_assert_eq(out.hdr.payload_len, 0, "%s", zp_type_name(types[i]));
	}
}

Test(codec, round_trip_hello)
{
	strcpy(in.u.hello.client_name, "trainer rank 3 (pid 4242)");
	round_trip(ZP_HELLO, 1);
	cr_assert_str_eq(out.u.hello.client_name, in.u.hello.client_name);
	/* An anonymous client is allowed. */
	in.u.hello.client_name[0] = '\0';
	round_trip(ZP_HELLO, 2);
	cr_assert_str_eq(out.u.hello.client_name, "");
}

Test(codec, round_trip_job_open)
{
	/* Longest name the protocol allows, and the largest world. */
	memset(in.u.job_open.job_name, 'j', ZP_NAME_MAX);
	in.u.job_open.job_name[ZP_NAME_MAX] = '\0';
	in.u.job_open.rank = 65535;
	in.u.job_open.world_size = 65536;
	in.u.job_open.policy = ZP_POLICY_AUTO;
	in.u.job_open.pinned_budget = UINT64_MAX - 1;
	memset(in.u.job_open.state_format, 'f', ZP_FORMAT_MAX);
	in.u.job_open.state_format[ZP_FORMAT_MAX] = '\0';
	round_trip(ZP_JOB_OPEN, UINT64_MAX);
	cr_assert_str_eq(out.u.job_open.state_format, in.u.job_open.state_format);
	cr_assert_str_eq(out.u.job_open.job_name, in.u.job_open.job_name);
	cr_assert_eq(out.u.job_open.rank, 65535);
	cr_assert_eq(out.u.job_open.world_size, 65536);
	cr_assert_eq(out.u.job_open.policy, ZP_POLICY_AUTO);
	cr_assert_eq(out.u.job_open.pinned_budget, UINT64_MAX - 1);
}

Test(codec, round_trip_tensor_register)
{
	strcpy(in.u.tensor_register.name, "layers.17.mlp.up_proj.weight");
	in.u.tensor_register.numel = (1ull << 40);
	in.u.tensor_register.grad_dtype = ZP_DTYPE_F16;
	in.u.tensor_register.param_dtype = ZP_DTYPE_BF16;
	round_trip(ZP_TENSOR_REGISTER, 7);
	cr_assert_str_eq(out.u.tensor_register.name, in.u.tensor_register.name);
	cr_assert_eq(out.u.tensor_register.numel, 1ull << 40);
	cr_assert_eq(out.u.tensor_register.grad_dtype, ZP_DTYPE_F16);
	cr_assert_eq(out.u.tensor_register.param_dtype, ZP_DTYPE_BF16);
	cr_assert_eq(out.u.tensor_register.flags, 0);
	in.u.tensor_register.flags = ZP_TENSOR_PARAM_OFFLOAD;
	round_trip(ZP_TENSOR_REGISTER, 8);
	cr_assert_eq(out.u.tensor_register.flags, ZP_TENSOR_PARAM_OFFLOAD);
}

Test(codec, round_trip_tensor_unregister)
{
	in.u.tensor_handle.handle = 0xdeadbeef;
	round_trip(ZP_TENSOR_UNREGISTER, 8);
	cr_assert_eq(out.u.tensor_handle.handle, 0xdeadbeef);
}

Test(codec, round_trip_tensor_set_step)
{
	in.u.tensor_step = (struct zp_tensor_step){ .handle = 0x01020304, .step = 1ull << 40 };
	round_trip(ZP_TENSOR_SET_STEP, 12);
	cr_assert_eq(out.u.tensor_step.handle, 0x01020304);
	cr_assert_eq(out.u.tensor_step.step, 1ull << 40);
}

Test(codec, round_trip_ckpt_write_and_done)
{
	in.u.ckpt_write = (struct zp_ckpt_write){ .handle = 9, .offset = 1ull << 33,
		.count = 1u << 24, .format = 2,
		.file_offset = { 4096, 4096 + (1ull << 40), 1ull << 41, 7, (1ull << 42) + 3 },
		.crc = { 0xe3069283u, 1, 0xffffffffu, 4, 0x89abcdefu } };
	round_trip(ZP_CKPT_WRITE, 37);
	cr_assert_eq(out.u.ckpt_write.handle, 9);
	cr_assert_eq(out.u.ckpt_write.offset, 1ull << 33);
	cr_assert_eq(out.u.ckpt_write.count, 1u << 24);
	cr_assert_eq(out.u.ckpt_write.file_offset[1], 4096 + (1ull << 40));
	cr_assert_eq(out.u.ckpt_write.file_offset[2], 1ull << 41);
	cr_assert_eq(out.u.ckpt_write.crc[0], 0xe3069283u);
	cr_assert_eq(out.u.ckpt_write.crc[2], 0xffffffffu);
	/* The scale arrays of a q8-moments tensor, and its raw format. */
	cr_assert_eq(out.u.ckpt_write.format, 2);
	cr_assert_eq(out.u.ckpt_write.file_offset[3], 7);
	cr_assert_eq(out.u.ckpt_write.file_offset[4], (1ull << 42) + 3);
	cr_assert_eq(out.u.ckpt_write.crc[3], 4);
	cr_assert_eq(out.u.ckpt_write.crc[4], 0x89abcdefu);
	cr_assert_eq(zp_type_fds(ZP_CKPT_WRITE), 1);
	cr_assert_eq(zp_type_fds(ZP_CKPT_READ), 1);
	/* A replaced checkpoint file's descriptor and no payload: a byte more is refused. */
	cr_assert_eq(zp_type_fds(ZP_CKPT_RELEASE), 1);
	round_trip(ZP_CKPT_RELEASE, 13);
	cr_assert_eq(out.hdr.payload_len, 0);
	/* No empty write, none past the transfer limit, no offset near the end of a file's range. */
	in.hdr.type = ZP_CKPT_WRITE;
	in.u.ckpt_write.count = 0;
	cr_assert_eq(decode(encode(&in)), ZP_S_VALUE);
	cr_assert(strstr(why, "count") != NULL, "%s", why);
	in.u.ckpt_write.count = (1ull << 40) + 1;
	cr_assert_eq(decode(encode(&in)), ZP_S_VALUE);
	/* Both stream: any tensor's length. */
	in.u.ckpt_write.count = 1ull << 40;
	cr_assert_eq(decode(encode(&in)), ZP_S_OK);
	in.u.ckpt_write.count = 1;
	in.u.ckpt_write.file_offset[2] = UINT64_MAX - 5;
	cr_assert_eq(decode(encode(&in)), ZP_S_VALUE);
	cr_assert(strstr(why, "file_offset") != NULL, "%s", why);
	/* No format the daemon does not know. */
	in.u.ckpt_write.file_offset[2] = 0;
	in.u.ckpt_write.format = 3;
	cr_assert_eq(decode(encode(&in)), ZP_S_VALUE);
	cr_assert(strstr(why, "format") != NULL, "%s", why);
	in.u.ckpt_done = (struct zp_ckpt_done){ .crc = { 0x12345678u, 2, 3, 4, 0xfedcba98u },
		.last_step = 77 };
	round_trip(ZP_CKPT_DONE, 12);
	cr_assert_eq(out.u.ckpt_done.crc[0], 0x12345678u);
	cr_assert_eq(out.u.ckpt_done.crc[2], 3);
	cr_assert_eq(out.u.ckpt_done.crc[4], 0xfedcba98u);
	cr_assert_eq(out.u.ckpt_done.last_step, 77);
}

Test(codec, crc32c_known_values)
{
	/* RFC 3720 B.4 and the usual check value. */
	static uint8_t zeros[32], ones[32];

	memset(ones, 0xff, sizeof(ones));
	cr_assert_eq(zu_crc32c(0, "123456789", 9), 0xe3069283u);
	cr_assert_eq(zu_crc32c(0, zeros, 32), 0x8a9136aau);
	cr_assert_eq(zu_crc32c(0, ones, 32), 0x62a8ab43u);
	/* Continued: the CRC of the halves chained is that of the whole. */
	cr_assert_eq(zu_crc32c(zu_crc32c(0, "1234", 4), "56789", 5), 0xe3069283u);
	cr_assert_eq(zu_crc32c(0, "", 0), 0);
}

/* Bit by bit, the definition: reflected Castagnoli polynomial, register and result inverted. */
static uint32_t
crc32c_bitwise(uint32_t crc, const uint8_t *p, size_t len)
{
	crc = ~crc;
	while (len-- > 0) {
		crc ^= *p++;
		for (int k = 0; k < 8; k++)
			crc = (crc & 1) ? (crc >> 1) ^ 0x82f63b78u : crc >> 1;
	}
	return ~crc;
}

Test(codec, crc32c_long_datafers_three_streams)
{
	/* Lengths about the 3 x 4096-byte blocks the instruction path runs in streams. */
	static const size_t lens[] = { 12287, 12288, 12289, 24576 + 5, 100000, 1u << 20 };
	size_t max = (1u << 20) + 16;
	uint8_t *data = malloc(max);
	uint32_t x = 12345;

	cr_assert_not_null(data);
	for (size_t i = 0; i < max; i++) {
		x = x * 1103515245u + 12345u;
		data[i] = (uint8_t)(x >> 16);
	}
	for (size_t l = 0; l < sizeof(lens) / sizeof(lens[0]); l++)
		for (size_t off = 0; off < 3; off++) {
			uint32_t want = crc32c_bitwise(0, data + off, lens[l]);
			size_t half = lens[l] / 3;

			cr_assert_eq(zu_crc32c(0, data + off, lens[l]), want, "length %zu at +%zu",
			    lens[l], off);
			/* Continued from a CRC that is not 0, cut anywhere. */
			cr_assert_eq(zu_crc32c(zu_crc32c(0, data + off, half), data + off + half,
			    lens[l] - half), want, "length %zu cut at %zu", lens[l], half);
		}
	free(data);
}

Test(codec, round_trip_grad_pass_and_partial)
{
	in.u.grad_pass.grad_scale = 1024.0;
	in.u.grad_pass.count = ZP_MAX_STEP_TENSORS;
	for (uint32_t i = 0; i < ZP_MAX_STEP_TENSORS; i++)
		in.u.grad_pass.handles[i] = i * 2654435761u;
	round_trip(ZP_GRAD_PASS, 12 + 4 * ZP_MAX_STEP_TENSORS);
	cr_assert_eq(out.u.grad_pass.grad_scale, 1024.0);
	cr_assert_eq(out.u.grad_pass.count, ZP_MAX_STEP_TENSORS);
	cr_assert_eq(out.u.grad_pass.handles[ZP_MAX_STEP_TENSORS - 1],
	    (ZP_MAX_STEP_TENSORS - 1) * 2654435761u);
	in.u.grad_partial = (struct zp_grad_partial){ .sumsq = 12.5, .nonfinite = 3,
		.elements = 1ull << 40 };
	round_trip(ZP_GRAD_PARTIAL, 24);
	cr_assert_eq(out.u.grad_partial.sumsq, 12.5);
	cr_assert_eq(out.u.grad_partial.nonfinite, 3);
	cr_assert_eq(out.u.grad_partial.elements, 1ull << 40);
}

/* A client-given clip coefficient lies in (0, 1]. */
Test(codec, clip_coefficient_in_range)
{
	fill_valid(ZP_STEP_SUBMIT);
	in.u.step_submit.flags = ZP_STEP_CLIP_COEF;
	in.u.step_submit.max_grad_norm = 0.25;
	cr_assert_eq(decode(encode(&in)), ZP_S_OK, "%s", why);
	in.u.step_submit.max_grad_norm = 0;
	cr_assert_eq(decode(encode(&in)), ZP_S_VALUE);
	in.u.step_submit.max_grad_norm = 1.5;
	cr_assert_eq(decode(encode(&in)), ZP_S_VALUE);
}

Test(codec, round_trip_tensor_io)
{
	static const uint16_t types[] = { ZP_TENSOR_WRITE, ZP_TENSOR_READ };

	for (size_t i = 0; i < 2; i++) {
		in.u.tensor_io = (struct zp_tensor_io){ .handle = 0x01020304, .state = ZP_STATE_EXP_AVG_SQ,
			.offset = 0x1122334455667788ull, .count = ZP_MAX_XFER / sizeof(float) };
		round_trip(types[i], 9);
		cr_assert_eq(out.u.tensor_io.handle, 0x01020304);
		cr_assert_eq(out.u.tensor_io.state, ZP_STATE_EXP_AVG_SQ);
		cr_assert_eq(out.u.tensor_io.offset, 0x1122334455667788ull);
		cr_assert_eq(out.u.tensor_io.count, ZP_MAX_XFER / sizeof(float));
	}
}

Test(codec, round_trip_step_submit)
{
	struct zp_step_submit *s = &in.u.step_submit;

	*s = (struct zp_step_submit){ .step = 123456789012ull, .optim = ZP_OPTIM_LION,
		.flags = ZP_STEP_FLAGS_ALL, .lr = 3e-4, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
		.weight_decay = 0.01, .lr_decay = -0.0, .grad_scale = 65536.0,
		.max_grad_norm = 1.0, .count = ZP_MAX_STEP_TENSORS };
	for (uint32_t i = 0; i < s->count; i++)
		s->handles[i] = i * 2654435761u;
	round_trip(ZP_STEP_SUBMIT, 10);
	cr_assert_eq(out.u.step_submit.step, s->step);
	cr_assert_eq(out.u.step_submit.optim, ZP_OPTIM_LION);
	cr_assert_eq(out.u.step_submit.flags, ZP_STEP_FLAGS_ALL);
	/* Doubles travel as their bits: compare bits, so -0.0 and the last ulp count. */
	cr_assert_eq(memcmp(&out.u.step_submit.lr, &s->lr, 8 * sizeof(double)), 0);
	cr_assert(signbit(out.u.step_submit.lr_decay));
	cr_assert_eq(out.u.step_submit.count, ZP_MAX_STEP_TENSORS);
	cr_assert_eq(memcmp(out.u.step_submit.handles, s->handles, s->count * sizeof(uint32_t)), 0);
}

Test(codec, round_trip_error)
{
	in.u.error.code = -90;	/* negative codes must survive the u32 on the wire */
	memset(in.u.error.message, 'e', ZP_ERRMSG_MAX);
	in.u.error.message[ZP_ERRMSG_MAX] = '\0';
	round_trip(ZP_ERROR, 11);
	cr_assert_eq(out.u.error.code, -90);
	cr_assert_str_eq(out.u.error.message, in.u.error.message);
}

Test(codec, round_trip_hello_ok)
{
	in.u.hello_ok = (struct zp_hello_ok){ .session_id = 77, .uid = 4294967294u };
	strcpy(in.u.hello_ok.daemon_version, "0.1.0");
	round_trip(ZP_HELLO_OK, 12);
	cr_assert_eq(out.u.hello_ok.session_id, 77);
	cr_assert_eq(out.u.hello_ok.uid, 4294967294u);
	cr_assert_str_eq(out.u.hello_ok.daemon_version, "0.1.0");
}

Test(codec, round_trip_job_ok)
{
	in.u.job_ok = (struct zp_job_ok){ .job_id = 0x8000000000000001ull, .last_step = 41,
		.state_format = "q8-moments" };
	round_trip(ZP_JOB_OK, 13);
	cr_assert_str_eq(out.u.job_ok.state_format, "q8-moments");
	cr_assert_eq(out.u.job_ok.job_id, 0x8000000000000001ull);
	cr_assert_eq(out.u.job_ok.last_step, 41);
}

Test(codec, round_trip_tensor_ok)
{
	in.u.tensor_ok = (struct zp_tensor_ok){ .handle = 5, .grad_bytes = 400012,
		.param_bytes = 200006, .resumed = 1, .last_step = 0x0123456789abcdefull };
	round_trip(ZP_TENSOR_OK, 14);
	cr_assert_eq(out.u.tensor_ok.handle, 5);
	cr_assert_eq(out.u.tensor_ok.grad_bytes, 400012);
	cr_assert_eq(out.u.tensor_ok.param_bytes, 200006);
	cr_assert_eq(out.u.tensor_ok.resumed, 1);
	cr_assert_eq(out.u.tensor_ok.last_step, 0x0123456789abcdefull);
	/* resumed is a flag: 2 is refused. */
	in.u.tensor_ok.resumed = 2;
	expect_reject(encode(&in), ZP_S_VALUE, "TENSOR_OK", "resumed");
}

Test(codec, round_trip_job_drop)
{
	strcpy(in.u.job_drop.job_name, "stale-run-7");
	round_trip(ZP_JOB_DROP, 20);
	cr_assert_str_eq(out.u.job_drop.job_name, "stale-run-7");
	in.u.job_drop.job_name[0] = '\0';
	expect_reject(encode(&in), ZP_S_STRING, "JOB_DROP", "job_name");
}

Test(codec, round_trip_xfer_ok)
{
	in.u.xfer_ok.bytes = ZP_MAX_XFER;
	round_trip(ZP_XFER_OK, 15);
	cr_assert_eq(out.u.xfer_ok.bytes, ZP_MAX_XFER);
}

Test(codec, round_trip_json)
{
	static const char text[] = "{\"tiers\":{\"pinned\":{\"used_bytes\":0}}}";
	size_t len;

	in.u.json.text = text;
	in.u.json.len = (uint32_t)strlen(text);
	round_trip(ZP_JSON, 16);
	cr_assert_eq(out.u.json.len, strlen(text));
	cr_assert_eq(memcmp(out.u.json.text, text, strlen(text)), 0);
	/* It points into the datagram, which is what the header promises. */
	cr_assert_eq((const uint8_t *)out.u.json.text, buf + ZP_HEADER_SIZE);
	/* The largest JSON that fits, and one byte more does not encode. */
	char *big = malloc(ZP_MAX_PAYLOAD + 1);

	cr_assert_not_null(big);
	memset(big, ' ', ZP_MAX_PAYLOAD + 1);
	in.u.json.text = big;
	in.u.json.len = ZP_MAX_PAYLOAD;
	round_trip(ZP_JSON, 17);
	cr_assert_eq(out.u.json.len, ZP_MAX_PAYLOAD);
	in.u.json.len = ZP_MAX_PAYLOAD + 1;
	cr_assert_neq(zp_encode(&in, buf, sizeof(buf), &len), ZP_S_OK);
	free(big);
}

Test(codec, round_trip_tensor_done)
{
	in.u.tensor_done = (struct zp_tensor_done){ .handle = 3, .step = 20,
		.status = ZP_STEP_SKIPPED_NONFINITE, .error = -28 };
	round_trip(ZP_TENSOR_DONE, 18);
	cr_assert_eq(out.u.tensor_done.handle, 3);
	cr_assert_eq(out.u.tensor_done.step, 20);
	cr_assert_eq(out.u.tensor_done.status, ZP_STEP_SKIPPED_NONFINITE);
	cr_assert_eq(out.u.tensor_done.error, -28);
}

Test(codec, round_trip_step_done)
{
	in.u.step_done = (struct zp_step_done){ .step = 19, .status = ZP_STEP_FAILED, .error = -5,
		.grad_norm = NAN, .latency_ns = 123456789, .count = 3 };
	round_trip(ZP_STEP_DONE, 19);
	cr_assert_eq(out.u.step_done.step, 19);
	cr_assert_eq(out.u.step_done.status, ZP_STEP_FAILED);
	cr_assert_eq(out.u.step_done.error, -5);
	/* grad_norm is NaN when it was not computed; a report may carry it. */
	cr_assert(isnan(out.u.step_done.grad_norm));
	cr_assert_eq(out.u.step_done.latency_ns, 123456789);
	cr_assert_eq(out.u.step_done.count, 3);
}

Test(codec, encode_refuses)
{
	size_t len = 12345;

	in.hdr.type = UNUSED_TYPE;
	cr_assert_eq(zp_encode(&in, buf, sizeof(buf), &len), ZP_S_TYPE);
	in.hdr.type = ZP_PING;
	cr_assert_eq(zp_encode(&in, buf, ZP_HEADER_SIZE - 1, &len), ZP_S_NOSPACE);
	cr_assert_eq(len, 12345, "ret_len written on failure");
	in.hdr.type = ZP_STEP_SUBMIT;
	in.u.step_submit.count = ZP_MAX_STEP_TENSORS + 1;
	cr_assert_neq(zp_encode(&in, buf, sizeof(buf), &len), ZP_S_OK);
}

Test(codec, header_rejects)
{
	size_t len;

	in.hdr.type = ZP_PING;
	len = encode(&in);
	expect_reject(ZP_HEADER_SIZE - 1, ZP_S_SHORT, NULL, "header");
	expect_reject(0, ZP_S_SHORT, NULL, NULL);
	expect_reject(ZP_MAX_MESSAGE + 1, ZP_S_LONG, NULL, NULL);

	buf[0] ^= 0xff;
	expect_reject(len, ZP_S_MAGIC, NULL, "magic");
	buf[0] ^= 0xff;

	put16(4, ZP_VERSION + 1);
	{
		char named[32];

		snprintf(named, sizeof(named), "version %d", ZP_VERSION + 1);
		expect_reject(len, ZP_S_VERSION, NULL, named);
	}
	/* A client of the first wire format is told, not misread. */
	put16(4, 1);
	expect_reject(len, ZP_S_VERSION, NULL, "version 1");
	put16(4, 0);
	expect_reject(len, ZP_S_VERSION, NULL, "version 0");
	put16(4, ZP_VERSION);

	put16(6, 63);
	expect_reject(len, ZP_S_TYPE, NULL, "63");
	put16(6, 0);
	expect_reject(len, ZP_S_TYPE, NULL, NULL);
	put16(6, 300);
	expect_reject(len, ZP_S_TYPE, NULL, "300");
	put16(6, ZP_PING);

	put32(20, 1);
	expect_reject(len, ZP_S_RESERVED, "PING", "reserved");
	put32(20, 0);

	put32(16, 1);
	expect_reject(len, ZP_S_LENGTH, "PING", NULL);
	put32(16, 0);
	buf[len] = 0;
	expect_reject(len + 1, ZP_S_LENGTH, "PING", NULL);
	cr_assert_eq(decode(len), ZP_S_OK, "%s", why);
}

Test(codec, trailing_bytes)
{
	size_t len;

	in.hdr.type = ZP_PING;
	len = encode(&in);
	buf[len] = 0;
	fix_len(len + 1);
	expect_reject(len + 1, ZP_S_TRAILING, "PING", "payload");

	in.hdr.type = ZP_JOB_OPEN;
	strcpy(in.u.job_open.job_name, "j");
	in.u.job_open.world_size = 1;
	len = encode(&in);
	buf[len] = 0;
	buf[len + 1] = 0;
	fix_len(len + 2);
	expect_reject(len + 2, ZP_S_TRAILING, "JOB_OPEN", "payload");
}

Test(codec, truncated_fields)
{
	size_t len;

	in.hdr.type = ZP_JOB_OPEN;
	strcpy(in.u.job_open.job_name, "job");
	in.u.job_open.rank = 1;
	in.u.job_open.world_size = 2;
	strcpy(in.u.job_open.state_format, "q8-moments");
	len = encode(&in);
	/* Cut into state_format, the last field, then into pinned_budget before it. */
	fix_len(len - 2);
	expect_reject(len - 2, ZP_S_TRUNCATED, "JOB_OPEN", "state_format");
	fix_len(len - 2 - 10 - 2);
	expect_reject(len - 2 - 10 - 2, ZP_S_TRUNCATED, "JOB_OPEN", "pinned_budget");
	/* Cut into world_size: after the name, rank and two of its bytes. */
	fix_len(ZP_HEADER_SIZE + 2 + 3 + 4 + 2);
	expect_reject(ZP_HEADER_SIZE + 2 + 3 + 4 + 2, ZP_S_TRUNCATED, "JOB_OPEN", "world_size");
	/* Only the name's length prefix, claiming more bytes than follow. */
	fix_len(ZP_HEADER_SIZE + 2);
	expect_reject(ZP_HEADER_SIZE + 2, ZP_S_TRUNCATED, "JOB_OPEN", "job_name");
	/* Nothing at all. */
	fix_len(ZP_HEADER_SIZE);
	expect_reject(ZP_HEADER_SIZE, ZP_S_TRUNCATED, "JOB_OPEN", "job_name");

	reset();
	in.hdr.type = ZP_STEP_SUBMIT;
	in.u.step_submit = (struct zp_step_submit){ .step = 1, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .grad_scale = 1, .count = 3 };
	len = encode(&in);
	fix_len(len - 1);
	expect_reject(len - 1, ZP_S_TRUNCATED, "STEP_SUBMIT", "handles");

	reset();
	in.hdr.type = ZP_TENSOR_DONE;
	len = encode(&in);
	fix_len(len - 4);
	expect_reject(len - 4, ZP_S_TRUNCATED, "TENSOR_DONE", "error");
}

/* Names: printable, bounded, and not empty where the field needs one. */
Test(codec, bad_strings)
{
	size_t len;
	size_t name_off = ZP_HEADER_SIZE + 2;

	in.hdr.type = ZP_JOB_OPEN;
	strcpy(in.u.job_open.job_name, "abc");
	in.u.job_open.world_size = 1;
	len = encode(&in);
	static const uint8_t bad_chars[] = { 0x00, 0x01, '\n', 0x1f, 0x7f };

	for (size_t i = 0; i < sizeof(bad_chars); i++) {
		buf[name_off + 1] = bad_chars[i];
		expect_reject(len, ZP_S_STRING, "JOB_OPEN", "job_name");
	}
	buf[name_off + 1] = 'b';
	cr_assert_eq(decode(len), ZP_S_OK, "%s", why);

	/* Empty job and tensor names are refused; an empty client name is not. */
	in.u.job_open.job_name[0] = '\0';
	len = encode(&in);
	expect_reject(len, ZP_S_STRING, "JOB_OPEN", "job_name");
	in.hdr.type = ZP_TENSOR_REGISTER;
	in.u.tensor_register.name[0] = '\0';
	in.u.tensor_register.numel = 1;
	len = encode(&in);
	expect_reject(len, ZP_S_STRING, "TENSOR_REGISTER", "name");
	reset();
	in.hdr.type = ZP_HELLO;
	len = encode(&in);
	cr_assert_eq(decode(len), ZP_S_OK, "%s", why);

	/* 128 bytes: one over ZP_NAME_MAX.  The struct cannot hold it, so build it by hand. */
	in.hdr.type = ZP_HELLO;
	len = encode(&in);
	put16(ZP_HEADER_SIZE, ZP_NAME_MAX + 1);
	memset(buf + ZP_HEADER_SIZE + 2, 'x', ZP_NAME_MAX + 1);
	len = ZP_HEADER_SIZE + 2 + ZP_NAME_MAX + 1;
	fix_len(len);
	expect_reject(len, ZP_S_STRING, "HELLO", "client_name");
	/* Exactly ZP_NAME_MAX is fine. */
	put16(ZP_HEADER_SIZE, ZP_NAME_MAX);
	fix_len(len - 1);
	cr_assert_eq(decode(len - 1), ZP_S_OK, "%s", why);
	cr_assert_eq(strlen(out.u.hello.client_name), ZP_NAME_MAX);

	/* Error text over ZP_ERRMSG_MAX. */
	reset();
	in.hdr.type = ZP_ERROR;
	len = encode(&in);
	put16(ZP_HEADER_SIZE + 4, ZP_ERRMSG_MAX + 1);
	memset(buf + ZP_HEADER_SIZE + 6, 'y', ZP_ERRMSG_MAX + 1);
	len = ZP_HEADER_SIZE + 6 + ZP_ERRMSG_MAX + 1;
	fix_len(len);
	expect_reject(len, ZP_S_STRING, "ERROR", "message");
}

/* Encodes in (the encoder does not validate values) and expects the decoder to refuse field. */
static void
expect_value(const char *type, const char *field)
{
	size_t len = encode(&in);

	expect_reject(len, ZP_S_VALUE, type, field);
}

static void
job_open(uint32_t rank, uint32_t world)
{
	reset();
	in.hdr.type = ZP_JOB_OPEN;
	strcpy(in.u.job_open.job_name, "j");
	in.u.job_open.rank = rank;
	in.u.job_open.world_size = world;
}

static void
tensor_register(uint64_t numel, uint8_t grad, uint8_t param)
{
	reset();
	in.hdr.type = ZP_TENSOR_REGISTER;
	strcpy(in.u.tensor_register.name, "w");
	in.u.tensor_register.numel = numel;
	in.u.tensor_register.grad_dtype = grad;
	in.u.tensor_register.param_dtype = param;
}

static void
tensor_io(uint8_t state, uint64_t count)
{
	reset();
	in.hdr.type = ZP_TENSOR_READ;
	in.u.tensor_io = (struct zp_tensor_io){ .handle = 1, .state = state, .count = count };
}

static void
step_submit(void)
{
	reset();
	in.hdr.type = ZP_STEP_SUBMIT;
	in.u.step_submit = (struct zp_step_submit){ .step = 1, .optim = ZP_OPTIM_ADAMW, .lr = 1e-3,
		.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .grad_scale = 1,
		.count = 1, .handles = { 1 } };
}

Test(codec, out_of_range)
{
	size_t len;

	job_open(0, 1);
	len = encode(&in);
	cr_assert_eq(decode(len), ZP_S_OK, "%s", why);
	job_open(0, 0);
	expect_value("JOB_OPEN", "world_size");
	job_open(0, 65537);
	expect_value("JOB_OPEN", "world_size");
	job_open(2, 2);
	expect_value("JOB_OPEN", "rank");
	job_open(UINT32_MAX, 8);
	expect_value("JOB_OPEN", "rank");
	job_open(0, 1);
	in.u.job_open.policy = ZP_POLICY_COUNT;
	expect_value("JOB_OPEN", "policy");

	tensor_register(1, ZP_DTYPE_F32, ZP_DTYPE_F32);
	len = encode(&in);
	cr_assert_eq(decode(len), ZP_S_OK, "%s", why);
	tensor_register(0, ZP_DTYPE_F32, ZP_DTYPE_F32);
	expect_value("TENSOR_REGISTER", "numel");
	tensor_register((1ull << 40) + 1, ZP_DTYPE_F32, ZP_DTYPE_F32);
	expect_value("TENSOR_REGISTER", "numel");
	tensor_register(1, 3, ZP_DTYPE_F32);
	expect_value("TENSOR_REGISTER", "grad_dtype");
	tensor_register(1, ZP_DTYPE_BF16, 3);
	expect_value("TENSOR_REGISTER", "param_dtype");

	tensor_io(ZP_STATE_MASTER, 1);
	len = encode(&in);
	cr_assert_eq(decode(len), ZP_S_OK, "%s", why);
	tensor_io(3, 1);
	expect_value("TENSOR_READ", "state");
	tensor_io(ZP_STATE_MASTER, 0);
	expect_value("TENSOR_READ", "count");
	tensor_io(ZP_STATE_MASTER, ZP_MAX_XFER / sizeof(float) + 1);
	expect_value("TENSOR_READ", "count");

	reset();
	in.hdr.type = ZP_JSON_FD;
	expect_value("JSON_FD", "bytes");
	in.u.json_fd.bytes = ZP_MAX_XFER + 1;
	expect_value("JSON_FD", "bytes");
	in.hdr.type = ZP_XFER_OK;
	expect_value("XFER_OK", "bytes");
	in.u.xfer_ok.bytes = ZP_MAX_XFER + 1;
	expect_value("XFER_OK", "bytes");

	reset();
	in.hdr.type = ZP_TENSOR_DONE;
	in.u.tensor_done.status = ZP_STEP_STATUS_COUNT;
	expect_value("TENSOR_DONE", "status");
	reset();
	in.hdr.type = ZP_STEP_DONE;
	in.u.step_done.status = ZP_STEP_STATUS_COUNT;
	expect_value("STEP_DONE", "status");
}

Test(codec, step_submit_out_of_range)
{
	size_t len;

	step_submit();
	len = encode(&in);
	cr_assert_eq(decode(len), ZP_S_OK, "%s", why);

	step_submit();
	in.u.step_submit.step = 0;
	expect_value("STEP_SUBMIT", "step");
	step_submit();
	in.u.step_submit.optim = ZP_OPTIM_COUNT;
	expect_value("STEP_SUBMIT", "optim");
	step_submit();
	in.u.step_submit.flags = ZP_STEP_FLAGS_ALL + 1;
	expect_value("STEP_SUBMIT", "flags");
	step_submit();
	in.u.step_submit.flags = 0x80;
	expect_value("STEP_SUBMIT", "flags");

	/* Every double must be finite; lr is the one a diverging schedule breaks. */
	static const double bad[] = { INFINITY, -INFINITY, NAN };
	static const char *const names[] = { "lr", "beta1", "beta2", "eps", "weight_decay",
		"lr_decay", "grad_scale", "max_grad_norm" };

	static const size_t offsets[] = {
		offsetof(struct zp_step_submit, lr), offsetof(struct zp_step_submit, beta1),
		offsetof(struct zp_step_submit, beta2), offsetof(struct zp_step_submit, eps),
		offsetof(struct zp_step_submit, weight_decay),
		offsetof(struct zp_step_submit, lr_decay),
		offsetof(struct zp_step_submit, grad_scale),
		offsetof(struct zp_step_submit, max_grad_norm) };

	for (size_t f = 0; f < 8; f++) {
		for (size_t b = 0; b < 3; b++) {
			step_submit();
			memcpy((char *)&in.u.step_submit + offsets[f], &bad[b], sizeof(double));
			expect_value("STEP_SUBMIT", names[f]);
		}
	}
	step_submit();
	in.u.step_submit.grad_scale = 0;
	expect_value("STEP_SUBMIT", "grad_scale");
	step_submit();
	in.u.step_submit.grad_scale = -1024;
	expect_value("STEP_SUBMIT", "grad_scale");
	step_submit();
	in.u.step_submit.max_grad_norm = -1;
	expect_value("STEP_SUBMIT", "max_grad_norm");

	step_submit();
	in.u.step_submit.count = 0;
	expect_value("STEP_SUBMIT", "count");
	/* The encoder refuses count > ZP_MAX_STEP_TENSORS, so patch the wire. */
	step_submit();
	len = encode(&in);
	put32(ZP_HEADER_SIZE + 74, ZP_MAX_STEP_TENSORS + 1);
	expect_reject(len, ZP_S_VALUE, "STEP_SUBMIT", "count");
	put32(ZP_HEADER_SIZE + 74, UINT32_MAX);
	expect_reject(len, ZP_S_VALUE, "STEP_SUBMIT", "count");
	put32(ZP_HEADER_SIZE + 74, 1);
	cr_assert_eq(decode(len), ZP_S_OK, "%s", why);
}

/* A NULL or zero-length why must not be written. */
Test(codec, why_optional)
{
	char small[4] = "abc";

	cr_assert_eq(zp_decode(buf, 3, &out, NULL, 0), ZP_S_SHORT);
	cr_assert_eq(zp_decode(buf, 3, &out, small, 0), ZP_S_SHORT);
	cr_assert_str_eq(small, "abc");
	cr_assert_eq(zp_decode(buf, 3, &out, small, sizeof(small)), ZP_S_SHORT);
	cr_assert_eq(strlen(small), 3, "why not truncated to its buffer");
}

/* PARAM_FETCH / PARAM_RELEASE carry a list of handles; PARAM_READY answers one. */
Test(codec, round_trip_param_handles)
{
	static const uint16_t types[] = { ZP_PARAM_FETCH, ZP_PARAM_RELEASE };

	for (size_t i = 0; i < 2; i++) {
		memset(&in, 0, sizeof(in));
		in.u.handles.count = ZP_MAX_STEP_TENSORS;
		for (uint32_t k = 0; k < ZP_MAX_STEP_TENSORS; k++)
			in.u.handles.handles[k] = k * 2654435761u;
		round_trip(types[i], 40 + i);
		cr_assert_eq(out.u.handles.count, ZP_MAX_STEP_TENSORS);
		cr_assert_eq(memcmp(out.u.handles.handles, in.u.handles.handles,
		    sizeof(in.u.handles.handles)), 0);
		/* No tensors, or more than a step takes: refused. */
		in.u.handles.count = 0;
		in.hdr.type = types[i];
		expect_value(zp_type_name(types[i]), "count");
	}
	memset(&in, 0, sizeof(in));
	in.u.param_ready.handle = 9;
	in.u.param_ready.error = -5;
	round_trip(ZP_PARAM_READY, 99);
	cr_assert_eq(out.u.param_ready.handle, 9);
	cr_assert_eq(out.u.param_ready.error, -5);
}
