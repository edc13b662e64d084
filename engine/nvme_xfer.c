/*
 * The NVMe tier's state transfers: a range through the chunks' staging buffers, or a
 * whole chunk straight to or from the caller's buffer.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "nvme_impl.h"

/* xfer_chunk for a compressed format: decode, or patch and encode, the range in the chunk. */
static void
xfer_chunk_coded(struct ze_engine *e, struct chunk_io *io, uint64_t from, uint64_t to)
{
	struct nvme_work *w = io->work;
	struct ze_tensor *t = w->tensor;
	uint64_t first = io->chunk * t->chunk_elements;
	bool all = w->kind == WORK_READ_ALL || w->kind == WORK_WRITE_ALL;
	bool write = w->kind == WORK_WRITE || w->kind == WORK_WRITE_ALL;
	float *bufs[3] = { NULL, NULL, NULL };
	struct zk_qtensor q;
	int r;

	for (unsigned k = 0; k < 3 && !w->raw; k++)
		if (all || k == (unsigned)w->state)
			bufs[k] = (float *)w->buf + (all ? k * w->stride : 0) + (from - w->offset);
	/* A chunk written whole was not read: no stale bytes of the buffer's last use stay. */
	if (w->kind == WORK_WRITE_ALL && ze_nvme_covers_chunk(w, io->chunk))
		memset(io->staging->buf, 0, chunk_mem_bytes(t, io->chunk));
	chunk_view(t, io->chunk, io->staging->buf, &q);
	if (w->raw)
		r = ze_state_raw(&q, write, from - first, to - from, w->buf, w->count,
		    from - w->offset);
	else
		r = ze_state_rw(&q, write, all ? 7u : 1u << w->state, from - first, to - from, bufs);
	if (r < 0 || !write) {
		ze_nvme_chunk_finished(e, io, r);
		return;
	}
	if (all || w->state == ZE_STATE_MASTER)
		ze_tensor_param_from_master(t, from, to - from, &q, from - first);
	ze_nvme_write_back(e, io);
}

/* A state transfer: copy the part of this chunk the request covers. */
void
ze_nvme_xfer_chunk(struct ze_engine *e, struct chunk_io *io)
{
	struct nvme_work *w = io->work;
	struct ze_tensor *t = w->tensor;
	uint64_t first = io->chunk * t->chunk_elements, last = first + chunk_len(t, io->chunk);
	uint64_t from = w->offset > first ? w->offset : first;
	uint64_t to = w->offset + w->count < last ? w->offset + w->count : last;
	float *array = (float *)io->staging->buf + (size_t)w->state * chunk_stride(t, io->chunk);
	float *window;

	if (w->buf == NULL) {
		ze_nvme_chunk_finished(e, io, -ECANCELED);
		return;
	}
	window = (float *)w->buf + (from - w->offset);
	if (t->format != ZK_STATE_FP32) {
		xfer_chunk_coded(e, io, from, to);
		return;
	}
	if (w->kind == WORK_READ_ALL) {
		/* Read into the buffer itself: nothing to copy. */
		if (io->direct != NULL) {
			ze_nvme_chunk_finished(e, io, 0);
			return;
		}
		/* master, m, v: each to its own third of the buffer */
		for (unsigned s = 0; s < 3; s++)
			memcpy((float *)w->buf + s * w->stride + (from - w->offset),
			    (float *)io->staging->buf + s * chunk_stride(t, io->chunk) + (from - first),
			    (to - from) * sizeof(float));
		ze_nvme_chunk_finished(e, io, 0);
		return;
	}
	if (w->kind == WORK_WRITE_ALL) {
		uint64_t stride = chunk_stride(t, io->chunk);

		/*
		 * Written from the buffer itself, padding and all (split: each array from
		 * its place there); the params are refreshed from it on the stepper
		 * meanwhile (the conversion was the last of a restore's work on the loop).
		 */
		if (io->direct != NULL) {
			ze_param_flags(t, t->param_resident, true);
			/* The refresh is a part; ze_nvme_write_back adds the writes. */
			ze_nvme_post_param(e, io, io->direct, from, to - from);
			ze_nvme_write_back(e, io);
			return;
		}
		for (unsigned s = 0; s < 3; s++) {
			float *a = (float *)io->staging->buf + s * stride;

			memcpy(a + (from - first), (float *)w->buf + s * w->stride + (from - w->offset),
			    (to - from) * sizeof(float));
			/* A chunk written whole was not read: its padding is the buffer's last use. */
			memset(a + (last - first), 0, (stride - (last - first)) * sizeof(float));
		}
		ze_tensor_write_param(t, from, to - from, (float *)io->staging->buf + (from - first));
		ze_nvme_write_back(e, io);
		return;
	}
	if (w->kind == WORK_READ) {
		memcpy(window, array + (from - first), (to - from) * sizeof(float));
		ze_nvme_chunk_finished(e, io, 0);
		return;
	}
	memcpy(array + (from - first), window, (to - from) * sizeof(float));
	if (w->state == ZE_STATE_MASTER)
		ze_tensor_write_param(t, from, to - from, array + (from - first));
	ze_nvme_write_back(e, io);
}

/*
 * A whole-state transfer of fp32 into or out of a buffer aligned for the disk moves
 * between the disk and the buffer with no copy (the copy through a staging buffer on the
 * loop was most of a checkpoint's loop time).  WHOLE: the range is chunk c and the
 * buffer holds it as it lies on the disk, the arrays the chunk's stride apart: one I/O.
 * SPLIT: the range is a part of chunk c that starts on a 1024-element (4 KiB) boundary
 * of its arrays and ends on one or at the chunk's end, the buffer's arrays a multiple of
 * 1024 elements apart: an I/O per array, and a write reads nothing first, so that a
 * checkpoint's pieces (and buffers) can be smaller than a chunk.  A split write to a
 * chunk this tensor has not written whole needs init_bits to say which of its elements
 * hold state (zero_unwritten, nvme.c); a tensor created initialized has none.
 */
enum ze_direct
ze_nvme_direct(const struct nvme_work *w, uint64_t c)
{
	const struct ze_tensor *t = w->tensor;
	uint64_t first = c * t->chunk_elements, last = first + chunk_len(t, c);
	uint32_t mem_align = zs_swap_mem_align(t->e->swap);

	if ((w->kind != WORK_READ_ALL && w->kind != WORK_WRITE_ALL) ||
	    t->format != ZK_STATE_FP32 || w->raw || w->buf == NULL ||
	    (uintptr_t)w->buf % mem_align != 0 || w->offset < first || w->offset + w->count > last)
		return ZE_DIRECT_NONE;
	if (w->offset == first && w->count == last - first && w->stride == chunk_stride(t, c))
		return ZE_DIRECT_WHOLE;
	if ((w->offset - first) % ZE_CHUNK_ALIGN != 0 || w->stride % ZE_CHUNK_ALIGN != 0 ||
	    (w->count % ZE_CHUNK_ALIGN != 0 && w->offset + w->count != last) ||
	    w->stride < ze_chunk_round(w->count) || 4096 % mem_align != 0 ||
	    4096 % zs_swap_offset_align(t->e->swap) != 0)
		return ZE_DIRECT_NONE;
	if (w->kind == WORK_WRITE_ALL && t->init_bits == NULL && !chunk_written(t, c))
		return ZE_DIRECT_NONE;
	return ZE_DIRECT_SPLIT;
}

uint64_t
ze_nvme_io_bytes(const struct nvme_work *w, uint64_t c, enum ze_direct d)
{
	if (d == ZE_DIRECT_SPLIT)
		return (w->tensor->master_in_slot ? 2 : 3) * ze_chunk_round(w->count) * sizeof(float);
	return chunk_io_bytes(w->tensor, c);
}

static int
xfer_queue(struct ze_tensor *t, enum work_kind kind, enum ze_state which, uint64_t offset,
    uint64_t count, uint64_t stride, void *buf, bool raw, uint32_t lane, uint64_t id)
{
	struct ze_engine *e = t->e;
	struct nvme_work *w;

	if (count == 0)
		return 1;
	w = calloc(1, sizeof(*w));
	if (w == NULL)
		return -ENOMEM;
	w->kind = kind;
	w->tensor = t;
	w->lane = lane;
	w->id = id;
	w->state = which;
	w->offset = offset;
	w->count = count;
	w->stride = stride;
	w->buf = buf;
	w->raw = raw;
	w->next_chunk = offset / t->chunk_elements;
	w->end_chunk = (offset + count + t->chunk_elements - 1) / t->chunk_elements;
	if (ze_nvme_enqueue(e, w) < 0) {
		free(w);
		return -ENOMEM;
	}
	TAILQ_INSERT_TAIL(&e->xfer_works, w, xfer_entry);
	/* No step may touch the chunks while they are read and patched. */
	t->busy = true;
	e->xfers++;
	ze_nvme_pump(e);
	return 0;
}

int
ze_nvme_xfer(struct ze_tensor *t, bool write, enum ze_state which, uint64_t offset,
    uint64_t count, void *buf, uint32_t lane, uint64_t id)
{
	return xfer_queue(t, write ? WORK_WRITE : WORK_READ, which, offset, count, count, buf, false,
	    lane, id);
}

int
ze_nvme_read_all(struct ze_tensor *t, uint64_t offset, uint64_t count, uint64_t stride,
    void *buf, bool raw, uint32_t lane, uint64_t id)
{
	return xfer_queue(t, WORK_READ_ALL, ZE_STATE_MASTER, offset, count, stride, buf, raw, lane,
	    id);
}

int
ze_nvme_write_all(struct ze_tensor *t, uint64_t offset, uint64_t count, uint64_t stride,
    const void *buf, bool raw, uint32_t lane, uint64_t id)
{
	/* The buffer is only read from: a write's source. */
	return xfer_queue(t, WORK_WRITE_ALL, ZE_STATE_MASTER, offset, count, stride,
	    (void *)(uintptr_t)buf, raw, lane, id);
}

void
ze_nvme_cancel_lane(struct ze_engine *e, uint32_t lane)
{
	struct nvme_work *w;

	/*
	 * Chunks queued or in flight find buf NULL when their read lands; one the disk
	 * reads into or writes from directly still holds it until then (ze_tensor_read_all).
	 */
	TAILQ_FOREACH(w, &e->xfer_works, xfer_entry)
		if (w->lane == lane)
			w->buf = NULL;
}
