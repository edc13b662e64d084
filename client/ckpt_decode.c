/*
 * A checkpoint's compressed arrays decoded to fp32, for a restore that converts: into a
 * job of another state format, or across a reshard that splits a q8-moments block.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ckpt_decode.h"
#include "convert.h"
#include "fileio.h"
#include "q8.h"

/* Elements decoded at a time: a multiple of the block, two buffers' worth of fp32. */
#define STRIDE (1u << 20)

/* Elements [c0, c1) (c0 on a block) of e's moments decoded into m and v. */
static int
decode_moments(const struct zck_file *f, const struct zck_entry *e, uint64_t c0, uint64_t c1,
    void *raw, float *m, float *v, char *err, size_t errlen)
{
	uint64_t n = c1 - c0, nb = (n + ZK_Q8_BLOCK - 1) / ZK_Q8_BLOCK;
	unsigned esz = (unsigned)(zck_array_bytes(e->arrays, 1, 1));
	/* The scales first: aligned for floats whatever n. */
	float *ms = raw, *vs = ms + nb;
	uint8_t *mr = (uint8_t *)(vs + nb), *vr = mr + n * esz;
	int r;

	r = zck_pread_array(f, e, 1, mr, n * esz, c0 * esz, err, errlen);
	if (r == 0)
		r = zck_pread_array(f, e, 2, vr, n * esz, c0 * esz, err, errlen);
	if (r == 0 && e->arrays == ZCK_ARRAYS_Q8)
		r = zck_pread_array(f, e, 3, ms, 4 * nb, 4 * (c0 / ZK_Q8_BLOCK), err, errlen);
	if (r == 0 && e->arrays == ZCK_ARRAYS_Q8)
		r = zck_pread_array(f, e, 4, vs, 4 * nb, 4 * (c0 / ZK_Q8_BLOCK), err, errlen);
	if (r < 0)
		return r;
	for (uint64_t i = 0; i < n; i++) {
		if (e->arrays == ZCK_ARRAYS_F32) {
			memcpy(&m[i], mr + 4 * i, 4);
			memcpy(&v[i], vr + 4 * i, 4);
		} else if (e->arrays == ZCK_ARRAYS_BF16) {
			uint16_t a, b;

			memcpy(&a, mr + 2 * i, 2);
			memcpy(&b, vr + 2 * i, 2);
			m[i] = zk__bf16_to_f32(a);
			v[i] = zk__bf16_to_f32(b);
		} else {
			zk_q8_decode(mr[i], vr[i], ms[i / ZK_Q8_BLOCK], vs[i / ZK_Q8_BLOCK], &m[i],
			    &v[i]);
		}
	}
	return 0;
}

int
zck_decode_fd(const struct zck_file *f, const struct zck_entry *e, uint64_t x, uint64_t n,
    char *err, size_t errlen)
{
	uint64_t x0 = x / ZK_Q8_BLOCK * ZK_Q8_BLOCK, end = x + n;
	float *buf = malloc(3 * (size_t)STRIDE * sizeof(float));
	void *raw = malloc(2 * (size_t)STRIDE * 4 + 2 * 4 * (STRIDE / ZK_Q8_BLOCK));
	int fd = -1, r = 0;

	err[0] = '\0';
	if (buf == NULL || raw == NULL) {
		r = -ENOMEM;
		snprintf(err, errlen, "out of memory to convert tensor '%s'", e->name);
		goto out;
	}
	fd = memfd_create("zoffload-ckpt-convert", MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, (off_t)(12 * n)) < 0) {
		r = -errno;
		snprintf(err, errlen, "tensor '%s': no memory file to convert it in: %s", e->name,
		    strerror(errno));
		goto out;
	}
	/* Whole blocks from x0: the first and last may reach outside [x, end). */
	for (uint64_t c0 = x0; c0 < end && r == 0; c0 += STRIDE) {
		uint64_t c1 = c0 + STRIDE < e->numel ? c0 + STRIDE : e->numel;
		uint64_t lo = c0 > x ? c0 : x, hi = c1 < end ? c1 : end;
		float *m = buf + STRIDE, *v = buf + 2 * (size_t)STRIDE;

		c1 = (c1 - c0 + ZK_Q8_BLOCK - 1) / ZK_Q8_BLOCK * ZK_Q8_BLOCK + c0;
		if (c1 > e->numel)
			c1 = e->numel;
		r = zck_pread_array(f, e, 0, buf, 4 * (hi - lo), 4 * lo, err, errlen);
		if (r == 0)
			r = decode_moments(f, e, c0, c1, raw, m, v, err, errlen);
		if (r == 0)
			r = zp_pwrite_full(fd, buf, 4 * (hi - lo), 4 * (lo - x));
		if (r == 0)
			r = zp_pwrite_full(fd, m + (lo - c0), 4 * (hi - lo), 4 * (n + lo - x));
		if (r == 0)
			r = zp_pwrite_full(fd, v + (lo - c0), 4 * (hi - lo), 4 * (2 * n + lo - x));
		if (r < 0 && err[0] == '\0')
			snprintf(err, errlen, "tensor '%s': converting it: %s", e->name, strerror(-r));
	}
out:
	free(buf);
	free(raw);
	if (r < 0 && fd >= 0)
		close(fd);
	return r < 0 ? r : fd;
}
