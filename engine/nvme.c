/* The NVMe tier: extents, staging buffers, and the read → step → write chunk pipeline. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine_impl.h"
#include "nvme_impl.h"
#include "stepper.h"
#include "swap.h"

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
		/*
		 * The buffers are memfds (a computed chunk outlives the process), which
		 * get 4 KiB pages from MADV_HUGEPAGE alone where shmem_enabled is never:
		 * the swap engine then moved 0.36x (reads) and 0.45x (writes) of what it
		 * moves through 2 MiB pages, and bench_step's step took 2.2 times as
		 * long (2.8 times its I/O bound, median of five runs; 1.08 now).
		 */
		.collapse = true,
		.collapse_kept = true,
	}, &e->staging_arena);
	if (r < 0)
		return r;
	e->staging = calloc(e->cfg.staging_buffers, sizeof(*e->staging));
	if (e->staging == NULL)
		return -ENOMEM;
	for (unsigned i = 0; i < e->cfg.staging_buffers; i++) {
		struct ze_staging *sb = &e->staging[i];

		sb->index = i;
		r = zt_arena_alloc_fd(e->staging_arena, bytes, "zoffload-staging",
		    i < e->cfg.nkept_staging ? e->cfg.kept_staging_fds[i] : -1, &sb->buf, &sb->pinned,
		    &sb->fd);
		if (r < 0)
			return r;
		sb->bytes = bytes;
		e->nstaging++;
		/* Fixed buffers spare the kernel a page walk per I/O; not having them is fine. */
		(void)zs_swap_register_buffer(e->swap, sb->buf, bytes);
		TAILQ_INSERT_TAIL(&e->staging_free, sb, entry);
	}
	return 0;
}

/* After the swap engine is gone: nothing can be in flight. */
void
ze_nvme_stop(struct ze_engine *e)
{
	for (unsigned i = 0; i < e->nstaging; i++) {
		zt_arena_release(e->staging_arena, e->staging[i].buf, e->staging[i].bytes,
		    e->staging[i].pinned);
		close(e->staging[i].fd);
	}
	free(e->staging);
	e->staging = NULL;
	e->nstaging = 0;
	zt_arena_free(e->staging_arena);
	e->staging_arena = NULL;
}

bool
ze_nvme_written(const struct ze_tensor *t, uint64_t offset, uint64_t count)
{
	if (count == 0)
		return true;
	for (uint64_t c = offset / t->chunk_elements; c <= (offset + count - 1) / t->chunk_elements; c++)
		if (!chunk_written(t, c))
			return false;
	return true;
}

uint64_t
ze_nvme_bytes(struct ze_engine *e, struct ze_tensor *t)
{
	uint64_t c = e->cfg.chunk_elements, bytes;

	/* Small tensors get small chunks, so they do not take a whole chunk of disk. */
	if (t->numel < c)
		c = ze_chunk_round(t->numel);
	t->chunk_elements = c;
	/* Offloaded params follow the state chunks in the same extent. */
	bytes = (chunk_count(t) - 1) * chunk_bytes(t) + chunk_io_bytes(t, chunk_count(t) - 1);
	if (t->param_offload) {
		t->param_store_offset = bytes;
		t->param_store_bytes = ((size_t)t->numel * zk_dtype_size(t->param_dtype) + 4095) /
		    4096 * 4096;
		bytes += t->param_store_bytes;
	}
	return bytes;
}

int
ze_nvme_place(struct ze_engine *e, struct ze_tensor *t)
{
	uint64_t bytes = ze_nvme_bytes(e, t);
	int r;

	/* Its chunks_written bits are in its record (record.c), made once it is placed. */
	t->extent = calloc(1, sizeof(*t->extent));
	if (t->extent == NULL) {
		r = -ENOMEM;
		goto fail;
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
	t->extent = NULL;
	return r;
}

void
ze_nvme_release(struct ze_engine *e, struct ze_tensor *t)
{
	if (!t->on_nvme)
		return;
	zs_extent_free(e->swap, t->extent);
	free(t->extent);
	t->extent = NULL;
	t->on_nvme = false;
}

int
ze_nvme_enqueue(struct ze_engine *e, struct nvme_work *w)
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

void
ze_nvme_chunk_finished(struct ze_engine *e, struct chunk_io *io, int error)
{
	struct nvme_work *w = io->work;
	uint64_t chunk = io->chunk;

	if (error < 0) {
		e->stats.io_errors++;
		if (w->error == 0)
			w->error = error;
	}
	/* Stamped by write_done (or failed): the buffer's chunk is nothing to keep now. */
	if (w->kind == WORK_STEP)
		ze_journal_staging_clear(e, io->staging->index);
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
	ze_nvme_pump(e);
}

static void
write_finished(struct chunk_io *io, int result)
{
	struct nvme_work *w = io->work;
	struct ze_tensor *t = w->tensor;
	uint64_t first = io->chunk * t->chunk_elements;
	uint64_t last = first + chunk_len(t, io->chunk);

	if (result == 0 && w->kind == WORK_STEP && t->master_in_slot && !io->slot_taken) {
		/*
		 * Landed: the slot that is the master takes the new master on the stepper
		 * (a part again: this runs once more when it is done), then the chunk is
		 * stamped, before its journal entry goes (ze_step_unit_done agrees).
		 */
		if (io->e->cfg.block_gate.fn != NULL)
			io->e->cfg.block_gate.fn(io->e->cfg.block_gate.arg, w->batch->hp.step,
			    io->chunk, ZE_GATE_LANDED);
		io->slot_taken = true;
		ze_nvme_post_param(io->e, io, io->staging->buf, first, last - first);
		return;
	}
	/* The write, and the slot's copy where there is one. */
	if (w->kind == WORK_STEP)
		io->e->stats.staging_write_ns += zu_now_ns() - io->phase_ns;
	if (result == 0) {
		if (w->kind == WORK_STEP)
			t->unit_step[io->chunk] = w->batch->hp.step;
		io->e->stats.chunks_written++;
		io->e->stats.bytes_written += io->bytes;
		if ((w->kind == WORK_WRITE && w->state == ZE_STATE_MASTER) ||
		    w->kind == WORK_WRITE_ALL) {
			uint64_t from = w->offset > first ? w->offset : first;
			uint64_t to = w->offset + w->count < last ? w->offset + w->count : last;

			ze_tensor_mark_init(t, from, to - from);
		}
		/* A split part leaves the rest of the chunk as it was: whole once all is written. */
		if (!io->split || (!chunk_written(t, io->chunk) && ze_tensor_init_all(t, first, last - first)))
			chunk_mark_written(t, io->chunk);
	}
	ze_nvme_chunk_finished(io->e, io, result);
}

/*
 * A part of io's read or write ended with *result: false while others are out; true
 * for the last, *result then the first error of all.
 */
static bool
last_part(struct chunk_io *io, int *result)
{
	if (*result < 0 && io->part_result == 0)
		io->part_result = *result;
	if (--io->parts > 0)
		return false;
	*result = io->part_result;
	io->part_result = 0;
	return true;
}

/* A part of io's write ended (an I/O, or its param refresh): the chunk ends with the last. */
static void
part_done(struct chunk_io *io, int result)
{
	if (last_part(io, &result))
		write_finished(io, result);
}

static void
write_done(int result, void *arg)
{
	part_done(arg, result);
}

void
ze_nvme_post_param(struct ze_engine *e, struct chunk_io *io, const void *from, uint64_t first,
    uint64_t n)
{
	struct ze_tensor *t = io->work->tensor;
	/* from is in the slot's dtype where the slot is the master, else fp32: both copy as is. */
	bool copy = t->master_in_slot || t->param_dtype == ZK_DTYPE_F32;

	io->parts = 1;
	io->task = (struct ze_task){
		.kind = ZE_TASK_PARAM,
		.lane = io->work->lane,
		.staging = io->staging,
		.view = {
			.master = (float *)(uintptr_t)from,
			.param = (char *)t->param_slot.map + first * zk_dtype_size(t->param_dtype),
			.param_dtype = t->param_dtype,
			.n = n,
		},
		.copy_bytes = copy ? n * zk_dtype_size(t->param_dtype) : 0,
	};
	ze_step_post(e, &io->task);
}

void
ze_nvme_param_done(struct ze_engine *e, struct ze_task *task)
{
	part_done((struct chunk_io *)((char *)task - offsetof(struct chunk_io, task)),
	    task->result);
}

/*
 * Starts io's reads or writes, one, or a split one's three (parts counts them); those a
 * refused start leaves out end at once with its error.  The last may free io.
 */
static void
chunk_rw(struct ze_engine *e, struct chunk_io *io, bool write, zs_callback *cb)
{
	struct ze_tensor *t = io->work->tensor;
	uint64_t at = io->chunk * chunk_bytes(t);
	/* Where the slot is the master, the disk has no master array: the split's first is m. */
	unsigned first = t->master_in_slot ? 1 : 0;
	unsigned n = io->split ? 3 - first : 1;
	char *buf = io_buf(io);
	int r;

	io->parts += n;
	for (unsigned k = 0; k < n; k++) {
		uint64_t off = at, len = io->bytes;
		char *from = buf + chunk_skip(t, chunk_stride(t, io->chunk));

		if (io->split) {
			len = io->bytes / n;
			off = at + (k * chunk_stride(t, io->chunk) + io->work->offset -
			    io->chunk * t->chunk_elements) * sizeof(float);
			from = buf + (first + k) * io->work->stride * sizeof(float);
		}
		r = write ? zs_write(e->swap, t->extent, off, from, len, cb, io) :
		    zs_read(e->swap, t->extent, off, from, len, cb, io);
		if (r < 0) {
			for (unsigned left = n - k; left > 0; left--)
				cb(r, io);
			return;
		}
	}
}

void
ze_nvme_write_back(struct ze_engine *e, struct chunk_io *io)
{
	chunk_rw(e, io, true, write_done);
}

/*
 * What io read of a chunk this tensor has not written whole is what a freed tensor left
 * there, but for the elements a split write put there since (their init_bits are set;
 * only fp32 is written split): those stay, the rest read as zeros, as a new chunk's
 * state starts.
 */
static void
zero_unwritten(struct chunk_io *io)
{
	const struct ze_tensor *t = io->work->tensor;
	uint64_t from = io->chunk * t->chunk_elements, n = chunk_len(t, io->chunk);
	uint64_t stride = chunk_stride(t, io->chunk);
	float *buf = io_buf(io);

	if (io->split) {
		from = io->work->offset;
		n = io->work->count;
		stride = io->work->stride;
	}
	if (!io->split && (t->format != ZK_STATE_FP32 || t->init_bits == NULL)) {
		memset((char *)buf + chunk_skip(t, stride), 0, io->bytes);
		return;
	}
	/* from is a multiple of ZE_CHUNK_ALIGN: whole words of init_bits. */
	for (unsigned k = t->master_in_slot ? 1 : 0; k < 3; k++) {
		float *a = buf + k * stride;

		for (uint64_t i = 0; i < n; i += 64) {
			uint64_t bits = t->init_bits != NULL ? t->init_bits[(from + i) / 64] : 0;
			uint64_t len = n - i < 64 ? n - i : 64;

			if (bits == 0) {
				memset(a + i, 0, len * sizeof(float));
				continue;
			}
			for (uint64_t j = 0; j < len; j++)
				if ((bits & (1ull << j)) == 0)
					a[i + j] = 0;
		}
		memset(a + n, 0, (ze_chunk_round(n) - n) * sizeof(float));
	}
}

/* Where the slot is the master, the master part of what io read comes from it. */
static void
fill_master(struct chunk_io *io)
{
	const struct ze_tensor *t = io->work->tensor;
	uint64_t from = io->chunk * t->chunk_elements, n = chunk_len(t, io->chunk);
	size_t size = zk_dtype_size(t->param_dtype);	/* the master's: the slot is it */
	char *buf = io_buf(io);

	if (!t->master_in_slot)
		return;
	if (io->split) {
		from = io->work->offset;
		n = io->work->count;
	}
	memcpy(buf, (const char *)t->param_slot.map + from * size, n * size);
	/* The chunk's padding, as the disk's arrays have it (a split's buffer holds its part only). */
	if (!io->split)
		memset(buf + n * size, 0, (chunk_stride(t, io->chunk) - n) * size);
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

	if (!last_part(io, &result))
		return;
	e->read_bytes_in_flight -= io->bytes;
	if (result < 0) {
		ze_nvme_chunk_finished(e, io, result);
		return;
	}
	e->stats.chunks_read++;
	e->stats.bytes_read += io->bytes;
	/*
	 * Swap space comes back from freed tensors as they left it: until this
	 * tensor writes a chunk, the chunk is zeros (m and v start at 0, and no
	 * job reads another's state).
	 */
	if (!chunk_written(t, io->chunk))
		zero_unwritten(io);
	if (w->kind != WORK_STEP) {
		fill_master(io);
		ze_nvme_xfer_chunk(e, io);
		return;
	}
	io->phase_ns = zu_now_ns();
	e->stats.staging_read_ns += io->phase_ns - io->start_ns;
	buf = io->staging->buf;
	off = io->chunk * t->chunk_elements;
	n = chunk_len(t, io->chunk);
	io->task = (struct ze_task){
		.kind = ZE_TASK_STEP,
		.lane = b->lane,
		.batch = b,
		.index = w->index,
		.unit = io->chunk,
		.staging = io->staging,
		.io_start_ns = io->start_ns,
		/* The step's master: filled on the stepper (fill_master's copy, off the loop). */
		.master_from = t->master_in_slot ? (const char *)t->param_slot.map +
		    off * zk_dtype_size(t->param_dtype) : NULL,
	};
	if (t->format != ZK_STATE_FP32) {
		chunk_view(t, io->chunk, buf, &io->task.qview);
		io->task.qview.grad = (const char *)t->grad_slot.map +
		    off * zk_dtype_size(t->grad_dtype);
		io->task.qview.grad_dtype = t->grad_dtype;
		/* The slot that is the master is written once the chunk has landed (write_finished). */
		io->task.qview.param = t->master_in_slot ? NULL :
		    (char *)t->param_slot.map + off * zk_dtype_size(t->param_dtype);
		io->task.qview.param_dtype = t->param_dtype;
	} else {
		io->task.view = (struct zk_tensor){
			.master = buf,
			.m = buf + chunk_stride(t, io->chunk),
			.v = buf + 2 * chunk_stride(t, io->chunk),
			.grad = (const char *)t->grad_slot.map + off * zk_dtype_size(t->grad_dtype),
			.grad_dtype = t->grad_dtype,
			.param = t->master_in_slot ? NULL :
			    (char *)t->param_slot.map + off * zk_dtype_size(t->param_dtype),
			.param_dtype = t->param_dtype,
			.n = n,
		};
	}
	ze_step_post(e, &io->task);
	/* The read window has room again. */
	ze_nvme_pump(e);
}

void
ze_nvme_step_computed(struct ze_engine *e, struct ze_task *task)
{
	struct chunk_io *io = (struct chunk_io *)((char *)task - offsetof(struct chunk_io, task));
	uint64_t now = zu_now_ns();

	e->stats.staging_compute_ns += now - io->phase_ns;
	io->phase_ns = now;
	if (task->result < 0) {
		ze_nvme_chunk_finished(e, io, task->result);
		return;
	}
	/* From here until it is stamped the chunk on disk may be old, new or torn: keep it. */
	ze_journal_staging(e, io->staging->index, io->work->tensor, io->chunk,
	    io->work->batch->hp.step);
	ze_nvme_write_back(e, io);
}

/* The transfer covers every element of chunk c. */
bool
ze_nvme_covers_chunk(const struct nvme_work *w, uint64_t c)
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
	enum ze_direct direct;
	uint64_t now = zu_now_ns(), bytes;

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
		direct = ze_nvme_direct(w, w->next_chunk);
		bytes = ze_nvme_io_bytes(w, w->next_chunk, direct);
		/* The read window (engine_impl.h): a buffer is free, the next read waits its turn. */
		if (e->read_bytes_in_flight > 0 &&
		    e->read_bytes_in_flight + bytes > ZE_READ_WINDOW_CHUNKS * sb->bytes)
			break;
		io = calloc(1, sizeof(*io));
		if (io == NULL)
			return;
		TAILQ_REMOVE(&e->staging_free, sb, entry);
		io->e = e;
		io->work = w;
		io->staging = sb;
		io->chunk = w->next_chunk++;
		io->direct = direct != ZE_DIRECT_NONE ? w->buf : NULL;
		io->split = direct == ZE_DIRECT_SPLIT;
		io->bytes = bytes;
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
		if (w->kind == WORK_WRITE_ALL && (io->split || ze_nvme_covers_chunk(w, io->chunk))) {
			/* Every byte it writes is new: nothing to read first. */
			ze_nvme_xfer_chunk(e, io);
			continue;
		}
		e->read_bytes_in_flight += io->bytes;
		chunk_rw(e, io, false, read_done);
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
void
ze_nvme_pump(struct ze_engine *e)
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
			t->unit_pend[c] = b->hp.step;
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
	if (ze_nvme_enqueue(e, w) < 0) {
		free(w);
		b->pending[i] = 1;
		ze_step_unit_done(e, b, i, UINT64_MAX, -ENOMEM);
		return;
	}
	ze_nvme_pump(e);
}

static void
rewrite_done(int result, void *arg)
{
	*(int *)arg = result == 0 ? 1 : result;
}

int
ze_nvme_rewrite(struct ze_engine *e, struct ze_tensor *t, uint64_t chunk, const void *buf)
{
	int done = 0, r;

	r = zs_write(e->swap, t->extent, chunk * chunk_bytes(t),
	    (const char *)buf + chunk_skip(t, chunk_stride(t, chunk)), chunk_io_bytes(t, chunk),
	    rewrite_done, &done);
	while (r == 0 && done == 0)
		r = zs_swap_wait(e->swap, -1) < 0 ? -EIO : 0;
	if (r < 0)
		return r;
	if (done < 0)
		return done;
	/* As write_finished: the slot that is the master takes it once m and v have landed. */
	if (t->master_in_slot)
		memcpy((char *)t->param_slot.map + chunk * t->chunk_elements *
		    zk_dtype_size(t->param_dtype), buf, chunk_len(t, chunk) *
		    zk_dtype_size(t->param_dtype));
	chunk_mark_written(t, chunk);
	return 0;
}
