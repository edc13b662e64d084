/*
 * A restore (CKPT_READ) from a file too short for the range it names is refused before
 * any element is read: it read into the tensor as it went, and a short file left the
 * elements before its end overwritten (100 of 4096).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "itd.h"
#include "msgio.h"

#define N 4096

static struct itd d;

static void
teardown(void)
{
	itd_cleanup(&d);
}

TestSuite(short_file, .fini = teardown, .timeout = 60);

/* An unlinked scratch file with len bytes of byte. */
static int
scratch(size_t len, uint8_t byte)
{
	char path[] = "/tmp/zoff-short-XXXXXX";
	int fd = mkstemp(path);
	uint8_t *buf = malloc(len > 0 ? len : 1);

	cr_assert_geq(fd, 0);
	cr_assert_eq(unlink(path), 0);
	memset(buf, byte, len);
	cr_assert_eq(pwrite(fd, buf, len, 0), (ssize_t)len);
	free(buf);
	return fd;
}

/* A CKPT_WRITE or CKPT_READ of the whole tensor's fp32 arrays, one after another in fd. */
static void
ckpt(int sock, uint16_t type, uint64_t id, int fd, struct zp_msg *m)
{
	int r;

	memset(m, 0, sizeof(*m));
	m->hdr.type = type;
	m->hdr.request_id = id;
	m->u.ckpt_write.handle = 1;
	m->u.ckpt_write.count = N;
	for (unsigned i = 0; i < 3; i++)
		m->u.ckpt_write.file_offset[i] = (uint64_t)i * N * sizeof(float);
	r = zp_send(sock, m, &fd, 1);
	cr_assert_eq(r, 0, "send %s: %s", zp_type_name(type), strerror(-r));
	cr_assert(itd_raw_recv(sock, m, 30), "no answer to %s", zp_type_name(type));
}

/* The tensor's master, m and v as a CKPT_WRITE saves them. */
static void
save(int sock, uint64_t id, uint8_t *out)
{
	static struct zp_msg m;
	int fd = scratch(0, 0);

	ckpt(sock, ZP_CKPT_WRITE, id, fd, &m);
	cr_assert_eq(m.hdr.type, ZP_CKPT_DONE, "CKPT_WRITE answered %s: %s",
	    zp_type_name(m.hdr.type), m.hdr.type == ZP_ERROR ? m.u.error.message : "");
	cr_assert_eq(pread(fd, out, 3 * N * sizeof(float), 0), (ssize_t)(3 * N * sizeof(float)));
	close(fd);
}

Test(short_file, restore_from_a_short_file_changes_nothing)
{
	static uint8_t before[3 * N * sizeof(float)], after[3 * N * sizeof(float)];
	static struct zp_msg m;
	int sock, fd;

	itd_start(&d, NULL);
	sock = itd_raw_connect(&d);
	itd_raw_hello(sock);
	memset(&m, 0, sizeof(m));
	strcpy(m.u.job_open.job_name, "short");
	m.u.job_open.world_size = 1;
	itd_raw_send(sock, ZP_JOB_OPEN, 2, &m);
	cr_assert(itd_raw_recv(sock, &m, 10));
	cr_assert_eq(m.hdr.type, ZP_JOB_OK, "JOB_OPEN answered %s", zp_type_name(m.hdr.type));
	memset(&m, 0, sizeof(m));
	strcpy(m.u.tensor_register.name, "w");
	m.u.tensor_register.numel = N;
	m.u.tensor_register.grad_dtype = ZP_DTYPE_F32;
	m.u.tensor_register.param_dtype = ZP_DTYPE_F32;
	itd_raw_send(sock, ZP_TENSOR_REGISTER, 3, &m);
	cr_assert(itd_raw_recv(sock, &m, 10));	/* closes the slots' descriptors */
	cr_assert_eq(m.hdr.type, ZP_TENSOR_OK, "TENSOR_REGISTER answered %s",
	    zp_type_name(m.hdr.type));
	cr_assert_eq(m.u.tensor_ok.handle, 1);
	save(sock, 4, before);

	/* 400 bytes of 0xff where the range needs 48 KiB. */
	fd = scratch(400, 0xff);
	ckpt(sock, ZP_CKPT_READ, 5, fd, &m);
	close(fd);
	cr_assert_eq(m.hdr.type, ZP_ERROR, "a restore from a short file answered %s",
	    zp_type_name(m.hdr.type));
	cr_assert_eq(m.u.error.code, -EBADMSG, "%d: %s", m.u.error.code, m.u.error.message);
	cr_assert(strstr(m.u.error.message, "truncated") != NULL &&
	    strstr(m.u.error.message, "'w'") != NULL, "%s", m.u.error.message);

	save(sock, 6, after);
	for (size_t i = 0; i < sizeof(before); i++)
		cr_assert_eq(after[i], before[i], "byte %zu of the state changed (array %zu, "
		    "element %zu) by a refused restore", i, i / (N * sizeof(float)),
		    i % (N * sizeof(float)) / sizeof(float));
	close(sock);
	cr_assert_eq(itd_stop(&d, 10), 0, "%s", itd_log_text(&d));
}
