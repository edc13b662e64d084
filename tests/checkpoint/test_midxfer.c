/*
 * A save of an NVMe tensor goes a piece at a time, and between pieces the tensor is not
 * busy in the engine: a step, TENSOR_WRITE, TENSOR_SET_STEP, PARAM_RELEASE, unregister or
 * JOB_CLOSE then was accepted, tearing what the file got (or, for the last two, leaving
 * the save unanswered).  They are refused with -EBUSY while the transfer is in flight, and
 * the save, let through, is answered.
 *
 * The transfer is held with the checkpoint I/O threads' gate (ZOFFLOADD_TEST_CKPT_GATE):
 * its first piece waits there to be written while the requests come.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ck.h"
#include "msgio.h"

#define N 65536		/* 4 chunks of ck_config's 16384 */

static struct itd d;
static struct ck_gated g = { .fd = -1 };

static void
teardown(void)
{
	ck_gated_cleanup(&d, &g);
}

TestSuite(midxfer, .fini = teardown, .timeout = 120);

static void
expect(int sock, uint16_t type, const char *text)
{
	static struct zp_msg m;

	cr_assert(itd_raw_recv(sock, &m, 10), "no answer");
	cr_assert_eq(m.hdr.type, type, "answered %s (%s), not %s", zp_type_name(m.hdr.type),
	    m.hdr.type == ZP_ERROR ? m.u.error.message : "", zp_type_name(type));
	if (text != NULL)
		cr_assert(strstr(m.u.error.message, text) != NULL, "%s", m.u.error.message);
}

Test(midxfer, requests_on_a_tensor_in_a_transfer_are_refused)
{
	static struct zp_msg m;
	char path[] = "/tmp/zoff-midxfer-XXXXXX";
	int sock, file;

	ck_gated_start(&d, &g);
	sock = itd_raw_connect(&d);
	itd_raw_hello(sock);
	memset(&m, 0, sizeof(m));
	strcpy(m.u.job_open.job_name, "midxfer");
	m.u.job_open.world_size = 1;
	m.u.job_open.policy = ZP_POLICY_NVME;
	itd_raw_send(sock, ZP_JOB_OPEN, 2, &m);
	expect(sock, ZP_JOB_OK, NULL);
	memset(&m, 0, sizeof(m));
	strcpy(m.u.tensor_register.name, "w");
	m.u.tensor_register.numel = N;
	m.u.tensor_register.grad_dtype = ZP_DTYPE_F32;
	m.u.tensor_register.param_dtype = ZP_DTYPE_F32;
	itd_raw_send(sock, ZP_TENSOR_REGISTER, 3, &m);
	expect(sock, ZP_TENSOR_OK, NULL);

	file = mkstemp(path);
	cr_assert_geq(file, 0);
	cr_assert_eq(unlink(path), 0);
	memset(&m, 0, sizeof(m));
	m.hdr.type = ZP_CKPT_WRITE;
	m.hdr.request_id = 4;
	m.u.ckpt_write.handle = 1;
	m.u.ckpt_write.count = N;
	for (unsigned i = 0; i < 3; i++)
		m.u.ckpt_write.file_offset[i] = (uint64_t)i * N * sizeof(float);
	cr_assert_eq(zp_send(sock, &m, &file, 1), 0);
	close(file);

	/*
	 * Each is refused, and the connection goes on.  While the first piece is in the engine
	 * the tensor is busy there ("in a step"); once it waits at the gate it is not.
	 */
	for (int i = 0; i < 500; i++) {
		memset(&m, 0, sizeof(m));
		m.u.tensor_step.handle = 1;
		m.u.tensor_step.step = 5;
		itd_raw_send(sock, ZP_TENSOR_SET_STEP, 5, &m);
		cr_assert(itd_raw_recv(sock, &m, 10), "no answer");
		if (m.hdr.type != ZP_ERROR || strstr(m.u.error.message, "is in a step") == NULL)
			break;
		usleep(10000);
	}
	cr_assert_eq(m.hdr.type, ZP_ERROR, "TENSOR_SET_STEP mid-transfer answered %s",
	    zp_type_name(m.hdr.type));
	cr_assert(strstr(m.u.error.message, "checkpoint transfer") != NULL, "%s",
	    m.u.error.message);
	memset(&m, 0, sizeof(m));
	m.u.handles.count = 1;
	m.u.handles.handles[0] = 1;
	itd_raw_send(sock, ZP_PARAM_RELEASE, 6, &m);
	expect(sock, ZP_ERROR, "in a step or transfer");
	memset(&m, 0, sizeof(m));
	m.u.tensor_handle.handle = 1;
	itd_raw_send(sock, ZP_TENSOR_UNREGISTER, 7, &m);
	expect(sock, ZP_ERROR, "checkpoint transfer");
	itd_raw_send(sock, ZP_JOB_CLOSE, 8, NULL);
	expect(sock, ZP_ERROR, "checkpoint transfer");

	/* Let through, the save is answered; then the tensor is free again. */
	g.fd = open(g.gate, O_RDWR);
	cr_assert_geq(g.fd, 0);
	expect(sock, ZP_CKPT_DONE, NULL);
	memset(&m, 0, sizeof(m));
	m.u.tensor_handle.handle = 1;
	itd_raw_send(sock, ZP_TENSOR_UNREGISTER, 9, &m);
	expect(sock, ZP_OK, NULL);
	close(sock);
	cr_assert_eq(itd_stop(&d, 10), 0, "%s", itd_log_text(&d));
}
