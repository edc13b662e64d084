/* The NVMe tier: extents, staging buffers, and the read → step → write chunk pipeline. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine_impl.h"
#include "stepper.h"
#include "swap.h"

/*
 * On NVMe a tensor is a run of chunks; chunk c holds elements
 * [c*C, (c+1)*C) as master, m, v back to back, each C*4 bytes (C a
 * multiple of 1024, so every array and chunk is 4 KiB aligned).  A
 * compressed format packs its smaller m and v and then the scales the same
 * way (ze_layout_of), the chunk rounded up to 4 KiB: C is a multiple of the
 * 256-element q8 block, so a chunk owns its blocks whole and steps alone.  One chunk
 * is one sequential read and one sequential write.  The last chunk holds
 * only the rest, each array rounded up to 1024 elements: moving a whole
 * chunk there cost a 4M-element chunk's worth of padding per tensor and
 * step, 12% of the I/O of bench_step's tensors.
 */

enum work_kind { WORK_STEP, WORK_READ, WORK_WRITE, WORK_READ_ALL, WORK_WRITE_ALL };

/*
 * Chunks of one tensor waiting for staging buffers: a step, or a state
 * transfer.  Owned by its lane while chunks wait, then by its chunks in
 * flight; the last chunk to finish frees it.  The tensor is busy meanwhile.
 */
struct nvme_work {
	TAILQ_ENTRY(nvme_work) entry;
	TAILQ_ENTRY(nvme_work) xfer_entry;	/* transfers: on the engine's list until freed */
	enum work_kind kind;
	struct ze_tensor *tensor;
	struct ze_batch *batch;		/* WORK_STEP */
	size_t index;
	uint64_t next_chunk;		/* the next one to read; skips chunks already at the step */
	uint64_t end_chunk;
	unsigned outstanding;		/* chunks in flight */
	int error;
	uint32_t lane;
	/* transfers */
	uint64_t id;
	enum ze_state state;
	uint64_t offset;
	uint64_t count;
	uint64_t stride;		/* READ_ALL, WRITE_ALL: elements between buf's arrays */
	void *buf;			/* NULL once the lane was cancelled */
};

TAILQ_HEAD(nvme_works, nvme_work);

/*
 * One lane's waiting work.  Staging buffers go to the lanes in turn, a
 * chunk each, so a job with a terabyte on NVMe cannot hold back a small
 * one's step for longer than a few chunks.  Within the lane the head goes
 * next: steps in ze_runs_before order, transfers where they came in.
 */
struct nvme_lane {
	TAILQ_ENTRY(nvme_lane) entry;
	uint32_t key;
	struct nvme_works works;
};

/* One chunk in flight through a staging buffer. */
struct chunk_io {
	struct ze_engine *e;
	struct nvme_work *work;
	struct ze_staging *staging;
	uint64_t chunk;
	/*
	 * The disk reads into, or writes from, the transfer's own buffer (direct_chunk);
	 * the staging buffer is taken all the same, so that transfers and steps share
	 * the chunks in flight as before.
	 */
	void *direct;
	/*
	 * A restore's direct chunk ends in two parts, its write and its param refresh
	 * (a ZE_TASK_PARAM in task) running meanwhile: parts counts those still out
	 * (0: the write alone), part_result keeps the first error.
	 */
	unsigned parts;
	int part_result;
	uint64_t start_ns;
	struct ze_task task;
};

/* Where chunk io's bytes are read to and written from. */
static void *
io_buf(const struct chunk_io *io)
{
	return io->direct != NULL ? io->direct : io->staging->buf;
}

static uint64_t
chunk_bytes(const struct ze_tensor *t)
{
	struct ze_layout l;

	ze_layout_of(t->format, t->chunk_elements, false, &l);
	return l.bytes;
}

static uint64_t
chunk_count(const struct ze_tensor *t)
{
	return (t->numel + t->chunk_elements - 1) / t->chunk_elements;
}

static uint64_t
chunk_len(const struct ze_tensor *t, uint64_t c)
{
	uint64_t left = t->numel - c * t->chunk_elements;

	return left < t->chunk_elements ? left : t->chunk_elements;
}

/* Elements per array in chunk c (C, or less in the last): 4 KiB multiples. */
static uint64_t
chunk_stride(const struct ze_tensor *t, uint64_t c)
{
	return (chunk_len(t, c) + 1023) / 1024 * 1024;
}

/* Bytes chunk c takes on disk and moves; it starts at c * chunk_bytes(t). */
static uint64_t
chunk_io_bytes(const struct ze_tensor *t, uint64_t c)
{
	struct ze_layout l;

	ze_layout_of(t->format, chunk_stride(t, c), false, &l);
	return l.bytes;
}

/* Chunk c's state in the staging buffer it was read into. */
static void
chunk_view(const struct ze_tensor *t, uint64_t c, void *buf, struct zk_qtensor *ret)
{
	struct ze_layout l;

	ze_layout_of(t->format, chunk_stride(t, c), false, &l);
	ze_state_view(t->format, buf, &l, chunk_len(t, c), ret);
}

int
ze_nvme_start(struct ze_engine *e)
{
	size_t bytes = (size_t)(3 * e->cfg.chunk_elements * sizeof(float));
	int r;

	if (e->swap == NULL)
		return 0;
	/* Staging is pinned like the state, but outside the state's budget. */
	r = zt_arena_new(&(struct zt_arena_config){
		.budget_bytes = (uint64_t)bytes * e->cfg.staging_buffers,
		.numa_node = e->cfg.numa_node,
		.hugepages = true,
	}, &e->staging_arena);
	if (r < 0)
		return r;
	e->staging = calloc(e->cfg.staging_buffers, sizeof(*e->staging));
	if (e->staging == NULL)
		return -ENOMEM;
	for (unsigned i = 0; i < e->cfg.staging_buffers; i++) {
		struct ze_staging *sb = &e->staging[i];

		r = zt_arena_alloc(e->staging_arena, bytes, &sb->buf, &sb->pinned);
		if (r < 0)
			return r;
		sb->bytes = bytes;
		e->nstaging++;
		/* Fixed buffers spare the kernel a page walk per I/O; not having them is fine. */
		(void)zs_engine_register_buffer(e->swap, sb->buf, bytes);
		TAILQ_INSERT_TAIL(&e->staging_free, sb, entry);
	}
	return 0;
}

/* After the swap engine is gone: nothing can be in flight. */
void
ze_nvme_stop(struct ze_engine *e)
{
	for (unsigned i = 0; i < e->nstaging; i++)
		zt_arena_release(e->staging_arena, e->staging[i].buf, e->staging[i].bytes,
		    e->staging[i].pinned);
	free(e->staging);
	e->staging = NULL;
	e->nstaging = 0;
	zt_arena_free(e->staging_arena);
	e->staging_arena = NULL;
}

int
ze_nvme_place(struct ze_engine *e, struct ze_tensor *t)
{
	uint64_t c = e->cfg.chunk_elements, bytes;
	int r;

	/* Small tensors get small chunks, so they do not take a whole chunk of disk. */
	if (t->numel < c)
		c = (t->numel + 1023) / 1024 * 1024;
	t->chunk_elements = c;
	t->extent = calloc(1, sizeof(*t->extent));
	t->chunks_written = calloc((chunk_count(t) + 7) / 8, 1);
	if (t->extent == NULL || t->chunks_written == NULL) {
		r = -ENOMEM;
		goto fail;
	}
	/* Offloaded params follow the state chunks in the same extent. */
	bytes = (chunk_count(t) - 1) * chunk_bytes(t) + chunk_io_bytes(t, chunk_count(t) - 1);
	if (t->param_offload) {
		t->param_store_offset = bytes;
		t->param_store_bytes = ((size_t)t->numel * zk_dtype_size(t->param_dtype) + 4095) /
		    4096 * 4096;
		bytes += t->param_store_bytes;
	}
	r = zs_extent_alloc(e->swap, bytes, t->extent);
	if (r < 0)
		goto fail;
	t->on_nvme = true;
	t->state_bytes = bytes;
	/* The store holds another tensor's bytes until written: the first release must write. */
	t->param_dirty = t->param_offload;
	return 0;
fail:
	free(t->extent);
	free(t->chunks_written);
	t->extent = NULL;
	t->chunks_written = NULL;
	return r;
}

void
ze_nvme_release(struct ze_engine *e, struct ze_tensor *t)
{
	if (!t->on_nvme)
		return;
	zs_extent_free(e->swap, t->extent);
	free(t->extent);
	free(t->chunks_written);
	t->extent = NULL;
	t->chunks_written = NULL;
	t->on_nvme = false;
}

static void pump(struct ze_engine *e);

static int
enqueue(struct ze_engine *e, struct nvme_work *w)
{
	struct nvme_lane *lane;
	struct nvme_work *q;

	TAILQ_FOREACH(lane, &e->nvme_lanes, entry)
		if (lane->key == w->lane)
			break;
	if (lane == NULL) {
		lane = calloc(1, sizeof(*lane));
		if (lane == NULL)
			return -ENOMEM;
		lane->key = w->lane;
		TAILQ_INIT(&lane->works);
		TAILQ_INSERT_TAIL(&e->nvme_lanes, lane, entry);
	}
	/*
	 * A step goes ahead of the queued steps it runs before (ze_runs_before),
	 * never ahead of a transfer: one queued before it keeps its turn, so
	 * steps coming in all the time cannot hold back a state read for good.
	 * Either order is correct: a step and a transfer never share a tensor
	 * (each holds it busy), and param I/O does not queue here.
	 */
	q = TAILQ_LAST(&lane->works, nvme_works);
	while (w->kind == WORK_STEP && q != NULL && q->kind == WORK_STEP &&
	    ze_runs_before(w->batch->hp.step, w->batch->seq, q->batch->hp.step, q->batch->seq))
		q = TAILQ_PREV(q, nvme_works, entry);
	if (q == NULL)
		TAILQ_INSERT_HEAD(&lane->works, w, entry);
	else
		TAILQ_INSERT_AFTER(&lane->works, q, w, entry);
	return 0;
}

/* Past the chunks already at the step: a retry reads, steps and writes only the rest. */
static void
skip_landed(struct nvme_work *w)
{
	const struct ze_tensor *t = w->tensor;

	if (w->kind != WORK_STEP)
		return;
	while (w->next_chunk < w->end_chunk && t->unit_step[w->next_chunk] >= w->batch->hp.step)
		w->next_chunk++;
}

static void
work_chunk_finished(struct ze_engine *e, struct chunk_io *io, int error)
{
	struct nvme_work *w = io->work;
	uint64_t chunk = io->chunk;

	if (error < 0) {
		e->stats.io_errors++;
		if (w->error == 0)
			w->error = error;
	}
	TAILQ_INSERT_TAIL(&e->staging_free, io->staging, entry);
	free(io);
	w->outstanding--;
	if (w->kind == WORK_STEP) {
		bool last = w->outstanding == 0 && w->next_chunk == w->end_chunk;
		struct ze_batch *b = w->batch;
		size_t index = w->index;

		if (last)
			free(w);
		ze_step_unit_done(e, b, index, chunk, error);
	} else if (w->outstanding == 0 && w->next_chunk == w->end_chunk) {
		struct ze_tensor *t = w->tensor;
		enum ze_io kind = w->kind == WORK_WRITE || w->kind == WORK_WRITE_ALL ? ZE_IO_WRITE :
		    ZE_IO_READ;
		uint32_t lane = w->lane;
		uint64_t id = w->id;
		void *user = t->user;

		error = w->error;
		TAILQ_REMOVE(&e->xfer_works, w, xfer_entry);
		free(w);
		e->xfers--;
		ze_tensor_unbusy(t);
		e->cb.io_done(e->cb_arg, lane, id, kind, user, error);
	}
	pump(e);
}

static void
write_finished(struct chunk_io *io, int result)
{
	struct nvme_work *w = io->work;
	struct ze_tensor *t = w->tensor;

	if (result == 0) {
		t->chunks_written[io->chunk / 8] |= (uint8_t)(1u << (io->chunk % 8));
		io->e->stats.chunks_written++;
		io->e->stats.bytes_written += chunk_io_bytes(t, io->chunk);
		if ((w->kind == WORK_WRITE && w->state == ZE_STATE_MASTER) ||
		    w->kind == WORK_WRITE_ALL) {
			uint64_t first = io->chunk * t->chunk_elements;
			uint64_t last = first + chunk_len(t, io->chunk);
			uint64_t from = w->offset > first ? w->offset : first;
			uint64_t to = w->offset + w->count < last ? w->offset + w->count : last;

			ze_tensor_mark_init(t, from, to - from);
		}
	}
	work_chunk_finished(io->e, io, result);
}

/* A part of io ended (its write, or its param refresh): the chunk ends with the last. */
static void
part_done(struct chunk_io *io, int result)
{
	if (io->parts > 0) {
		if (result < 0 && io->part_result == 0)
			io->part_result = result;
		if (--io->parts > 0)
			return;
		result = io->part_result;
	}
	write_finished(io, result);
}

static void
write_done(int result, void *arg)
{
	part_done(arg, result);
}

void
ze_nvme_param_done(struct ze_engine *e, struct ze_task *task)
{
	part_done((struct chunk_io *)((char *)task - offsetof(struct chunk_io, task)),
	    task->result);
}

static void
write_back(struct ze_engine *e, struct chunk_io *io)
{
	struct ze_tensor *t = io->work->tensor;
	int r = zs_write(e->swap, t->extent, io->chunk * chunk_bytes(t), io_buf(io),
	    chunk_io_bytes(t, io->chunk), write_done, io);

	if (r < 0)
		part_done(io, r);
}

static bool covers_chunk(const struct nvme_work *w, uint64_t c);

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

	for (unsigned k = 0; k < 3; k++)
		if (all || k == (unsigned)w->state)
			bufs[k] = (float *)w->buf + (all ? k * w->stride : 0) + (from - w->offset);
	/* A chunk written whole was not read: no stale bytes of the buffer's last use stay. */
	if (w->kind == WORK_WRITE_ALL && covers_chunk(w, io->chunk))
		memset(io->staging->buf, 0, chunk_io_bytes(t, io->chunk));
	chunk_view(t, io->chunk, io->staging->buf, &q);
	r = ze_state_rw(&q, write, all ? 7u : 1u << w->state, from - first, to - from, bufs);
	if (r < 0 || !write) {
		work_chunk_finished(e, io, r);
		return;
	}
	if (all || w->state == ZE_STATE_MASTER)
		ze_tensor_write_param(t, from, to - from, q.master + (from - first));
	write_back(e, io);
}

/* A state transfer: copy the part of this chunk the request covers. */
static void
xfer_chunk(struct ze_engine *e, struct chunk_io *io)
{
	struct nvme_work *w = io->work;
	struct ze_tensor *t = w->tensor;
	uint64_t first = io->chunk * t->chunk_elements, last = first + chunk_len(t, io->chunk);
	uint64_t from = w->offset > first ? w->offset : first;
	uint64_t to = w->offset + w->count < last ? w->offset + w->count : last;
	float *array = (float *)io->staging->buf + (size_t)w->state * chunk_stride(t, io->chunk);
	float *window;

	if (w->buf == NULL) {
		work_chunk_finished(e, io, -ECANCELED);
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
			work_chunk_finished(e, io, 0);
			return;
		}
		/* master, m, v: each to its own third of the buffer */
		for (unsigned s = 0; s < 3; s++)
			memcpy((float *)w->buf + s * w->stride + (from - w->offset),
			    (float *)io->staging->buf + s * chunk_stride(t, io->chunk) + (from - first),
			    (to - from) * sizeof(float));
		work_chunk_finished(e, io, 0);
		return;
	}
	if (w->kind == WORK_WRITE_ALL) {
		uint64_t stride = chunk_stride(t, io->chunk);

		/*
		 * Written from the buffer itself, padding and all; the params are refreshed
		 * from it on the stepper meanwhile (the conversion was the last of a
		 * restore's work on the loop).
		 */
		if (io->direct != NULL) {
			t->param_dirty = true;
			io->parts = 2;
			io->task = (struct ze_task){
				.kind = ZE_TASK_PARAM,
				.lane = w->lane,
				.staging = io->staging,
				.view = {
					.master = io->direct,
					.param = (char *)t->param_slot.map +
					    from * zk_dtype_size(t->param_dtype),
					.param_dtype = t->param_dtype,
					.n = to - from,
				},
			};
			ze_step_post(e, &io->task);
			write_back(e, io);
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
		write_back(e, io);
		return;
	}
	if (w->kind == WORK_READ) {
		memcpy(window, array + (from - first), (to - from) * sizeof(float));
		work_chunk_finished(e, io, 0);
		return;
	}
	memcpy(array + (from - first), window, (to - from) * sizeof(float));
	if (w->state == ZE_STATE_MASTER)
		ze_tensor_write_param(t, from, to - from, array + (from - first));
	write_back(e, io);
}

static void
read_done(int result, void *arg)
{
	struct chunk_io *io = arg;
	struct ze_engine *e = io->e;
	struct nvme_work *w = io->work;
	struct ze_tensor *t = w->tensor;
	struct ze_batch *b = w->batch;
	uint64_t off, n;
	float *buf;

	e->read_bytes_in_flight -= chunk_io_bytes(t, io->chunk);
	if (result < 0) {
		work_chunk_finished(e, io, result);
		return;
	}
	e->stats.chunks_read++;
	e->stats.bytes_read += chunk_io_bytes(t, io->chunk);
	/*
	 * Swap space comes back from freed tensors as they left it: until this
	 * tensor writes a chunk, the chunk is zeros (m and v start at 0, and no
	 * job reads another's state).
	 */
	if ((t->chunks_written[io->chunk / 8] & (1u << (io->chunk % 8))) == 0)
		memset(io_buf(io), 0, chunk_io_bytes(t, io->chunk));
	if (w->kind != WORK_STEP) {
		xfer_chunk(e, io);
		return;
	}
	buf = io->staging->buf;
	off = io->chunk * t->chunk_elements;
	n = chunk_len(t, io->chunk);
	if (t->format != ZK_STATE_FP32) {
		io->task = (struct ze_task){
			.kind = ZE_TASK_STEP,
			.lane = b->lane,
			.batch = b,
			.index = w->index,
			.unit = io->chunk,
			.staging = io->staging,
			.io_start_ns = io->start_ns,
		};
		chunk_view(t, io->chunk, buf, &io->task.qview);
		io->task.qview.grad = (const char *)t->grad_slot.map +
		    off * zk_dtype_size(t->grad_dtype);
		io->task.qview.grad_dtype = t->grad_dtype;
		io->task.qview.param = (char *)t->param_slot.map + off * zk_dtype_size(t->param_dtype);
		io->task.qview.param_dtype = t->param_dtype;
		ze_step_post(e, &io->task);
		pump(e);
		return;
	}
	io->task = (struct ze_task){
		.kind = ZE_TASK_STEP,
		.lane = b->lane,
		.batch = b,
		.index = w->index,
		.unit = io->chunk,
		.staging = io->staging,
		.io_start_ns = io->start_ns,
		.view = {
			.master = buf,
			.m = buf + chunk_stride(t, io->chunk),
			.v = buf + 2 * chunk_stride(t, io->chunk),
			.grad = (const char *)t->grad_slot.map + off * zk_dtype_size(t->grad_dtype),
			.grad_dtype = t->grad_dtype,
			.param = (char *)t->param_slot.map + off * zk_dtype_size(t->param_dtype),
			.param_dtype = t->param_dtype,
			.n = n,
		},
	};
	ze_step_post(e, &io->task);
	/* The read window has room again. */
	pump(e);
}

void
ze_nvme_step_computed(struct ze_engine *e, struct ze_task *task)
{
	struct chunk_io *io = (struct chunk_io *)((char *)task - offsetof(struct chunk_io, task));

	if (task->result < 0) {
		work_chunk_finished(e, io, task->result);
		return;
	}
	write_back(e, io);
}

/*
 * A whole-state transfer of fp32 whose buffer holds chunk c as the chunk lies on disk:
 * the range is the chunk, the arrays are the chunk's stride apart, the buffer is aligned
 * for the disk.  The chunk then moves between the disk and the buffer with no copy (the
 * copy through a staging buffer on the loop was most of a checkpoint's loop time).
 */
static bool
direct_chunk(const struct nvme_work *w, uint64_t c)
{
	const struct ze_tensor *t = w->tensor;

	return (w->kind == WORK_READ_ALL || w->kind == WORK_WRITE_ALL) &&
	    t->format == ZK_STATE_FP32 && w->buf != NULL &&
	    w->offset == c * t->chunk_elements && w->count == chunk_len(t, c) &&
	    w->stride == chunk_stride(t, c) &&
	    (uintptr_t)w->buf % zs_engine_mem_align(t->e->swap) == 0;
}

/* The transfer covers every element of chunk c. */
static bool
covers_chunk(const struct nvme_work *w, uint64_t c)
{
	uint64_t first = c * w->tensor->chunk_elements;

	return w->offset <= first && w->offset + w->count >= first + chunk_len(w->tensor, c);
}

/*
 * Starts reads while staging buffers are free and the read window has room;
 * counts the time work waits for a buffer.
 */
static void
pump_once(struct ze_engine *e)
{
	struct nvme_lane *lane;
	struct nvme_work *w;
	struct ze_staging *sb;
	struct chunk_io *io;
	uint64_t now = zu_now_ns();
	int r;

	while ((lane = TAILQ_FIRST(&e->nvme_lanes)) != NULL) {
		w = TAILQ_FIRST(&lane->works);
		sb = TAILQ_FIRST(&e->staging_free);
		if (sb == NULL) {
			if (e->io_blocked_since == 0) {
				e->io_blocked_since = now;
				e->stats.io_waits++;
			}
			return;
		}
		/* The read window (engine_impl.h): a buffer is free, the next read waits its turn. */
		if (e->read_bytes_in_flight > 0 && e->read_bytes_in_flight +
		    chunk_io_bytes(w->tensor, w->next_chunk) > sb->bytes)
			break;
		io = calloc(1, sizeof(*io));
		if (io == NULL)
			return;
		TAILQ_REMOVE(&e->staging_free, sb, entry);
		io->e = e;
		io->work = w;
		io->staging = sb;
		io->chunk = w->next_chunk++;
		io->direct = direct_chunk(w, io->chunk) ? w->buf : NULL;
		io->start_ns = now;
		skip_landed(w);
		w->outstanding++;
		if (w->next_chunk == w->end_chunk)
			TAILQ_REMOVE(&lane->works, w, entry);
		TAILQ_REMOVE(&e->nvme_lanes, lane, entry);
		if (TAILQ_EMPTY(&lane->works))
			free(lane);
		else
			TAILQ_INSERT_TAIL(&e->nvme_lanes, lane, entry);
		if (w->kind == WORK_WRITE_ALL && covers_chunk(w, io->chunk)) {
			/* Every byte of the chunk is new: nothing to read first. */
			xfer_chunk(e, io);
			continue;
		}
		e->read_bytes_in_flight += chunk_io_bytes(w->tensor, io->chunk);
		r = zs_read(e->swap, w->tensor->extent, io->chunk * chunk_bytes(w->tensor), io_buf(io),
		    chunk_io_bytes(w->tensor, io->chunk), read_done, io);
		if (r < 0) {
			e->read_bytes_in_flight -= chunk_io_bytes(w->tensor, io->chunk);
			work_chunk_finished(e, io, r);
		}
	}
	if (e->io_blocked_since != 0) {
		e->stats.io_wait_ns += now - e->io_blocked_since;
		e->io_blocked_since = 0;
	}
}

/*
 * A chunk that fails on the spot finishes inside pump_once and asks for
 * another pump: that runs as the next pass of this loop, not one stack
 * frame deeper per chunk.
 */
static void
pump(struct ze_engine *e)
{
	if (e->pumping) {
		e->pump_again = true;
		return;
	}
	e->pumping = true;
	do {
		e->pump_again = false;
		pump_once(e);
	} while (e->pump_again);
	e->pumping = false;
}

void
ze_nvme_queue_step(struct ze_engine *e, struct ze_batch *b, size_t i)
{
	struct ze_tensor *t = b->tensors[i];
	struct nvme_work *w = calloc(1, sizeof(*w));
	uint64_t needed = 0;

	if (w == NULL) {
		b->pending[i] = 1;
		ze_step_unit_done(e, b, i, UINT64_MAX, -ENOMEM);
		return;
	}
	w->kind = WORK_STEP;
	w->tensor = t;
	w->batch = b;
	w->index = i;
	w->lane = b->lane;
	w->end_chunk = chunk_count(t);
	for (uint64_t c = 0; c < w->end_chunk; c++) {
		if (t->unit_step[c] >= b->hp.step) {
			b->landed[i] += chunk_len(t, c);
			e->stats.chunks_skipped++;
		} else {
			needed++;
		}
	}
	skip_landed(w);
	if (needed == 0) {
		/* A retry that finds every chunk landed: nothing to move. */
		free(w);
		b->pending[i] = 1;
		ze_step_unit_done(e, b, i, UINT64_MAX, 0);
		return;
	}
	b->pending[i] = needed;
	if (enqueue(e, w) < 0) {
		free(w);
		b->pending[i] = 1;
		ze_step_unit_done(e, b, i, UINT64_MAX, -ENOMEM);
		return;
	}
	pump(e);
}

static int
xfer_queue(struct ze_tensor *t, enum work_kind kind, enum ze_state which, uint64_t offset,
    uint64_t count, uint64_t stride, void *buf, uint32_t lane, uint64_t id)
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
	w->next_chunk = offset / t->chunk_elements;
	w->end_chunk = (offset + count + t->chunk_elements - 1) / t->chunk_elements;
	if (enqueue(e, w) < 0) {
		free(w);
		return -ENOMEM;
	}
	TAILQ_INSERT_TAIL(&e->xfer_works, w, xfer_entry);
	/* No step may touch the chunks while they are read and patched. */
	t->busy = true;
	e->xfers++;
	pump(e);
	return 0;
}

int
ze_nvme_xfer(struct ze_tensor *t, bool write, enum ze_state which, uint64_t offset,
    uint64_t count, void *buf, uint32_t lane, uint64_t id)
{
	return xfer_queue(t, write ? WORK_WRITE : WORK_READ, which, offset, count, count, buf, lane,
	    id);
}

int
ze_nvme_read_all(struct ze_tensor *t, uint64_t offset, uint64_t count, uint64_t stride,
    float *buf, uint32_t lane, uint64_t id)
{
	return xfer_queue(t, WORK_READ_ALL, ZE_STATE_MASTER, offset, count, stride, buf, lane, id);
}

int
ze_nvme_write_all(struct ze_tensor *t, uint64_t offset, uint64_t count, uint64_t stride,
    const float *buf, uint32_t lane, uint64_t id)
{
	/* The buffer is only read from: a write's source. */
	return xfer_queue(t, WORK_WRITE_ALL, ZE_STATE_MASTER, offset, count, stride,
	    (float *)(uintptr_t)buf, lane, id);
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
