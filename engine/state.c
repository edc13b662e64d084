/* A tensor's state in its format: where the arrays sit, and fp32 reads and writes of any range. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "engine_impl.h"

static size_t
round_up(size_t x, size_t a)
{
	return (x + a - 1) / a * a;
}

/*
 * Pinned (pad): each array page-rounded plus 4160 bytes, because an exact
 * power-of-two distance between them aliases in the cache (fp32 state:
 * master, m, v at 0, S, 2S as always).  NVMe chunk (no pad): the arrays back
 * to back and the whole rounded to 4 KiB for direct I/O; fp32 chunks of a
 * multiple of 1024 elements come out 12 bytes an element with no rounding.
 * The scales follow v; q8 arrays of `elements` (a multiple of 256) have
 * elements / 256 of them.  master is zk_state_master_bytes long: 4 bytes an
 * element, 2 for bf16-master+q8 (whose m then starts at 2 * elements, and
 * the scales at 4 * elements, still float aligned).
 */
void
ze_layout_of(enum zk_state_format f, size_t elements, bool pad, struct ze_layout *ret)
{
	size_t ms = zk_state_moment_bytes(f, elements), nb = zk_state_blocks(f, elements);
	size_t mab = zk_state_master_bytes(f, elements);
	size_t mb = pad ? round_up(mab, 4096) + 4160 : mab;
	size_t qb = pad ? round_up(ms, 4096) + 4160 : ms;
	size_t sb = pad ? round_up(nb * sizeof(float), 64) : nb * sizeof(float);

	ret->master = 0;
	ret->m = mb;
	ret->v = mb + qb;
	ret->m_scale = mb + 2 * qb;
	ret->v_scale = ret->m_scale + sb;
	ret->bytes = ret->v_scale + sb;
	if (pad && nb > 0)
		ret->bytes += 4160;
	if (!pad)
		ret->bytes = round_up(ret->bytes, 4096);
}

bool
ze_slot_can_be_master(enum zk_state_format f, enum zk_dtype param_dtype, bool param_offload)
{
	/*
	 * param_offload: the client writes the slot and a release drops its
	 * pages; the master must outlive both, so it stays the engine's own.
	 */
	if (param_offload)
		return false;
	return f == ZK_STATE_BF16_Q8 ? param_dtype == ZK_DTYPE_BF16 : param_dtype == ZK_DTYPE_F32;
}

void
ze_tensor_layout(const struct ze_tensor *t, struct ze_layout *ret)
{
	size_t shift;

	ze_layout_of(t->format, t->numel, true, ret);
	if (!t->master_in_slot)
		return;
	/* The same arrays, padded the same, from m on: the master's span is the slot's. */
	shift = ret->m;
	ret->master = 0;
	ret->m -= shift;
	ret->v -= shift;
	ret->m_scale -= shift;
	ret->v_scale -= shift;
	ret->bytes -= shift;
}

void
ze_state_view(enum zk_state_format f, void *base, const struct ze_layout *l, size_t n,
    struct zk_qtensor *ret)
{
	bool blocked = zk_state_blocks(f, 1) > 0;
	char *p = base;

	/* master is float[] or, for bf16-master+q8, uint16_t[] through master_bf16 (a union). */
	*ret = (struct zk_qtensor){
		.format = f,
		.master = (float *)(p + l->master),
		.m = p + l->m,
		.v = p + l->v,
		.m_scale = blocked ? (float *)(p + l->m_scale) : NULL,
		.v_scale = blocked ? (float *)(p + l->v_scale) : NULL,
		.n = n,
	};
}

void
ze_tensor_state_view(const struct ze_tensor *t, struct zk_qtensor *ret)
{
	*ret = (struct zk_qtensor){
		.format = t->format,
		.master = t->master,
		.m = t->m,
		.v = t->v,
		.m_scale = t->m_scale,
		.v_scale = t->v_scale,
		.grad = t->grad_slot.map,
		.grad_dtype = t->grad_dtype,
		/* The slot is the master: the step updates it as master, no param copy. */
		.param = t->master_in_slot ? NULL : t->param_slot.map,
		.param_dtype = t->param_dtype,
		.n = t->numel,
	};
}

/* Compressed ranges are decoded and encoded this many elements at a time (two fp32 buffers). */
#define PIECE (64u << 10)

/*
 * The fp32 reads and writes of a compressed state go through whole blocks:
 * the blocks covering [from, from + count) are decoded into buf, and for a
 * write patched and encoded again.  A write encodes only the moment it
 * changes: the other one's bytes and scales are left as they were (encode
 * writes both, so the other lands in scratch).  Elements of a block outside
 * the range are re-encoded with it and may round differently after a write
 * changed its scale.
 */
static int
qstate_rw(const struct zk_qtensor *q, bool write, unsigned mask, size_t from, size_t count,
    float *const dst[3])
{
	size_t align = zk_state_blocks(q->format, 1) > 0 ? ZK_Q8_BLOCK : 1, done = 0;
	float *buf = NULL, *scratch = NULL;
	int r = 0;

	if (count == 0)
		return 0;
	buf = malloc(2 * PIECE * sizeof(float));
	scratch = write ? malloc(PIECE * (sizeof(uint16_t) + sizeof(float))) : NULL;
	if (buf == NULL || (write && scratch == NULL)) {
		r = -ENOMEM;
		goto out;
	}
	while (done < count) {
		size_t at = from + done, b0 = at / align * align;
		size_t b1 = b0 + PIECE < from + count ? b0 + PIECE : round_up(from + count, align);
		size_t lo = at - b0, len;
		struct zk_qtensor s, w;

		if (b1 > q->n)
			b1 = q->n;
		len = (b1 < from + count ? b1 : from + count) - at;
		r = zk_qtensor_slice(q, b0, b1 - b0, &s);
		if (r == 0)
			r = zk_qstate_decode(&s, buf, buf + PIECE);
		if (r < 0)
			goto out;
		for (unsigned k = 1; k < 3; k++) {
			float *a = k == 1 ? buf : buf + PIECE;

			if (!(mask & (1u << k)))
				continue;
			if (write)
				memcpy(a + lo, dst[k] + done, len * sizeof(float));
			else
				memcpy(dst[k] + done, a + lo, len * sizeof(float));
		}
		if (write) {
			w = s;
			/* The moment not written goes to scratch. */
			if (!(mask & 2u)) {
				w.m = scratch;
				w.m_scale = w.m_scale != NULL ? (float *)((char *)scratch + PIECE * 2) : NULL;
			}
			if (!(mask & 4u)) {
				w.v = scratch;
				w.v_scale = w.v_scale != NULL ? (float *)((char *)scratch + PIECE * 2) : NULL;
			}
			r = zk_qstate_encode(&w, buf, buf + PIECE);
			if (r < 0)
				goto out;
		}
		done += len;
	}
out:
	free(buf);
	free(scratch);
	return r;
}

int
ze_state_rw(const struct zk_qtensor *q, bool write, unsigned mask, size_t from, size_t count,
    float *const bufs[3])
{
	if (from > q->n || count > q->n - from)
		return -ERANGE;
	if ((mask & 1u) && q->format == ZK_STATE_BF16_Q8) {
		/* Element by element: no block alignment.  A write rounds to nearest even. */
		struct zk_qtensor mq = { .format = q->format, .master_bf16 = q->master_bf16 + from,
			.n = count };
		int r = write ? zk_qstate_master_encode(&mq, bufs[0]) :
		    zk_qstate_master_decode(&mq, bufs[0]);

		if (r < 0)
			return r;
	} else if (mask & 1u) {
		if (write)
			memcpy(q->master + from, bufs[0], count * sizeof(float));
		else
			memcpy(bufs[0], q->master + from, count * sizeof(float));
	}
	if (!(mask & 6u))
		return 0;
	if (q->format == ZK_STATE_FP32) {
		for (unsigned k = 1; k < 3; k++) {
			float *a = (float *)(k == 1 ? q->m : q->v) + from;

			if (!(mask & (1u << k)))
				continue;
			if (write)
				memcpy(a, bufs[k], count * sizeof(float));
			else
				memcpy(bufs[k], a, count * sizeof(float));
		}
		return 0;
	}
	return qstate_rw(q, write, mask, from, count, bufs);
}

uint64_t
ze_raw_array_bytes(enum zk_state_format f, unsigned k, uint64_t count)
{
	if (k == 0)
		return zk_state_master_bytes(f, count);
	if (k < 3)
		return zk_state_moment_bytes(f, count);
	return k < ZE_RAW_ARRAYS ? zk_state_blocks(f, count) * sizeof(float) : 0;
}

uint64_t
ze_raw_layout(enum zk_state_format f, uint64_t count, uint64_t off[ZE_RAW_ARRAYS])
{
	uint64_t at = 0;

	for (unsigned k = 0; k < ZE_RAW_ARRAYS; k++) {
		off[k] = at;
		at += ze_raw_array_bytes(f, k, count);
	}
	return at;
}

int
ze_raw_check(enum zk_state_format f, uint64_t n, uint64_t from, uint64_t count)
{
	size_t b = zk_state_blocks(f, 1) > 0 ? ZK_Q8_BLOCK : 1;

	if (from > n || count > n - from)
		return -ERANGE;
	/* A block partly in the range would take a scale of another's. */
	if (from % b != 0 || (count % b != 0 && from + count != n))
		return -EINVAL;
	return 0;
}

int
ze_state_raw(const struct zk_qtensor *q, bool write, size_t from, size_t count, void *buf,
    size_t total, size_t at)
{
	void *arrays[ZE_RAW_ARRAYS] = { q->master, q->m, q->v, q->m_scale, q->v_scale };
	uint64_t off[ZE_RAW_ARRAYS];
	int r = ze_raw_check(q->format, q->n, from, count);

	if (r == 0)
		r = ze_raw_check(q->format, total, at, count);
	if (r < 0)
		return r;
	ze_raw_layout(q->format, total, off);
	for (unsigned k = 0; k < ZE_RAW_ARRAYS; k++) {
		size_t len = ze_raw_array_bytes(q->format, k, count);
		char *mem, *raw;

		if (len == 0)
			continue;
		mem = (char *)arrays[k] + ze_raw_array_bytes(q->format, k, from);
		raw = (char *)buf + off[k] + ze_raw_array_bytes(q->format, k, at);
		if (write)
			memcpy(mem, raw, len);
		else
			memcpy(raw, mem, len);
	}
	return 0;
}

bool
ze_format_supports(enum zk_state_format f, enum zk_optim optim)
{
	static float x[1];
	static uint8_t c[2];
	struct zk_hparams hp = { .optim = optim, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
		.eps = 1e-8, .step = 1, .grad_scale = 1.0, .clip_coef = 1.0 };
	struct zk_qtensor q = { .format = f, .master = x, .m = c, .v = c, .m_scale = x,
		.v_scale = x, .grad = x, .grad_dtype = ZK_DTYPE_F32, .n = 0 };

	if (f == ZK_STATE_FP32)
		return true;
	/* An empty range still checks the optimizer: a kernel added later shows up here. */
	return zk_qstep(ZK_ISA_SCALAR, &hp, &q, 0, 0) != -ENOTSUP;
}

/* fp32 into a param slot of its dtype (stepper.c's param write-back, tensor.c's writes). */
void
ze_param_convert(void *slot, enum zk_dtype dtype, uint64_t offset, uint64_t count,
    const float *src)
{
	switch (dtype) {
	case ZK_DTYPE_F32:
		memcpy((float *)slot + offset, src, count * sizeof(float));
		break;
	/*
	 * The inline forms: a call per element was three to five times slower, and a
	 * restore converts every element of master here.
	 */
	case ZK_DTYPE_BF16:
		for (uint64_t i = 0; i < count; i++)
			((uint16_t *)slot)[offset + i] = zk__f32_to_bf16(src[i]);
		break;
	case ZK_DTYPE_F16:
		for (uint64_t i = 0; i < count; i++)
			((uint16_t *)slot)[offset + i] = zk__f32_to_f16(src[i]);
		break;
	default:
		break;
	}
}
