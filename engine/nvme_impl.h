/* The NVMe tier's own structs and helpers: nvme.c (chunks, steps), nvme_xfer.c (transfers). */
#ifndef ZE_NVME_IMPL_H
#define ZE_NVME_IMPL_H

#include <stdbool.h>
#include <stdint.h>

#include "engine_impl.h"
#include "stepper.h"
#include "swap.h"

/*
 * On NVMe a tensor is a run of chunks; chunk c holds elements
 * [c*C, (c+1)*C) as master, m, v back to back, each C*4 bytes (C a
 * multiple of ZE_CHUNK_ALIGN, so every array and chunk is 4 KiB aligned).  A
 * compressed format packs its smaller m and v and then the scales the same
 * way (ze_layout_of), the chunk rounded up to 4 KiB: C is a multiple of the
 * 256-element q8 block, so a chunk owns its blocks whole and steps alone.  One chunk
 * is one sequential read and one sequential write.  The last chunk holds
 * only the rest, each array rounded up to ZE_CHUNK_ALIGN elements (ze_chunk_round): moving a whole
 * chunk there cost a 4M-element chunk's worth of padding per tensor and
 * step, 12% of the I/O of bench_step's tensors.
 *
 * Where the param slot is the master (master_in_slot, engine_impl.h), the disk keeps
 * a chunk's m, v and scales only: 8 B an fp32 element, not 12 (a third less I/O), 2.03
 * of bf16-master+q8's 4.03 (half).  chunk_layout rounds the master's array to 4 KiB.
 * Its staging buffer keeps the whole layout all the same, master first: the stepper
 * copies the master from the slot (ze_task.master_from; a transfer's read,
 * fill_master), the step computes the new master there (the slot is not written: it must hold the old
 * values until m and v have landed), and the write moves the rest.  Once that write
 * has landed the stepper copies the new master into the slot (a ZE_TASK_PARAM),
 * before the chunk is stamped; a crash in between leaves the staging buffer
 * journaled (ze_journal_staging), and adoption writes it and copies it again
 * (ze_nvme_rewrite).  Transfers see the staging layout as before.
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
	bool raw;			/* READ_ALL/WRITE_ALL of the arrays as kept (ze_tensor_read_raw) */
};

TAILQ_HEAD(nvme_works, nvme_work);

/* One chunk in flight through a staging buffer. */
struct chunk_io {
	struct ze_engine *e;
	struct nvme_work *work;
	struct ze_staging *staging;
	uint64_t chunk;
	/*
	 * The disk reads into, or writes from, the transfer's own buffer (ze_nvme_direct);
	 * the staging buffer is taken all the same, so that transfers and steps share
	 * the chunks in flight as before.  split: the transfer is part of the chunk, each
	 * array its own I/O.
	 */
	void *direct;
	bool split;
	/* A step's chunk whose slot is the master: the slot has taken its new master. */
	bool slot_taken;
	uint64_t bytes;			/* moved to or from the disk */
	/*
	 * The read, or the write, ends in parts: a split one's I/Os, and a restore's
	 * direct write has its param refresh (a ZE_TASK_PARAM in task) running meanwhile.
	 * parts counts those still out, part_result keeps the first error.
	 */
	unsigned parts;
	int part_result;
	uint64_t start_ns;
	uint64_t phase_ns;		/* a step's chunk: when its read, or its compute, ended */
	struct ze_task task;
};

/* Where chunk io's bytes are read to and written from. */
static inline void *
io_buf(const struct chunk_io *io)
{
	return io->direct != NULL ? io->direct : io->staging->buf;
}

/*
 * A chunk of `stride` elements as its staging buffer holds it: ze_layout_of's, but where
 * the slot is the master, the master's array is rounded up to 4 KiB (a bf16 master is 2 B
 * an element), so that what goes to disk, from m to the 4 KiB-rounded end, starts on one.
 */
static inline void
chunk_layout(const struct ze_tensor *t, uint64_t stride, struct ze_layout *l)
{
	size_t end, m;

	ze_layout_of(t->format, stride, false, l);
	if (!t->master_in_slot)
		return;
	end = l->v_scale + (l->v_scale - l->m_scale);
	m = (l->m + 4095) / 4096 * 4096;
	l->v += m - l->m;
	l->m_scale += m - l->m;
	l->v_scale += m - l->m;
	l->bytes = m + (end - l->m + 4095) / 4096 * 4096;
	l->m = m;
}

/* Bytes at the start of a chunk's staging layout of `stride` elements that are not on disk. */
static inline uint64_t
chunk_skip(const struct ze_tensor *t, uint64_t stride)
{
	struct ze_layout l;

	if (!t->master_in_slot)
		return 0;
	chunk_layout(t, stride, &l);
	return l.m;
}

/* Bytes a chunk of `stride` elements takes on disk: its staging layout from chunk_skip on. */
static inline uint64_t
chunk_disk_bytes(const struct ze_tensor *t, uint64_t stride)
{
	struct ze_layout l;

	chunk_layout(t, stride, &l);
	return l.bytes - (t->master_in_slot ? l.m : 0);
}

/* Bytes a whole chunk takes on disk: chunk c starts at c * chunk_bytes(t). */
static inline uint64_t
chunk_bytes(const struct ze_tensor *t)
{
	return chunk_disk_bytes(t, t->chunk_elements);
}

static inline uint64_t
chunk_count(const struct ze_tensor *t)
{
	return (t->numel + t->chunk_elements - 1) / t->chunk_elements;
}

static inline uint64_t
chunk_len(const struct ze_tensor *t, uint64_t c)
{
	uint64_t left = t->numel - c * t->chunk_elements;

	return left < t->chunk_elements ? left : t->chunk_elements;
}

/* Chunk c was written whole since the tensor was placed (else the disk holds another's bytes). */
static inline bool
chunk_written(const struct ze_tensor *t, uint64_t c)
{
	return (t->chunks_written[c / 8] & (1u << (c % 8))) != 0;
}

static inline void
chunk_mark_written(struct ze_tensor *t, uint64_t c)
{
	t->chunks_written[c / 8] |= (uint8_t)(1u << (c % 8));
}

/* Elements per array in chunk c (C, or less in the last): 4 KiB multiples. */
static inline uint64_t
chunk_stride(const struct ze_tensor *t, uint64_t c)
{
	return ze_chunk_round(chunk_len(t, c));
}

/* Bytes of chunk c's layout in its staging buffer. */
static inline uint64_t
chunk_mem_bytes(const struct ze_tensor *t, uint64_t c)
{
	struct ze_layout l;

	chunk_layout(t, chunk_stride(t, c), &l);
	return l.bytes;
}

/* Bytes chunk c takes on disk and moves. */
static inline uint64_t
chunk_io_bytes(const struct ze_tensor *t, uint64_t c)
{
	return chunk_disk_bytes(t, chunk_stride(t, c));
}

/* Chunk c's state in the staging buffer it was read into. */
static inline void
chunk_view(const struct ze_tensor *t, uint64_t c, void *buf, struct zk_qtensor *ret)
{
	struct ze_layout l;

	chunk_layout(t, chunk_stride(t, c), &l);
	ze_state_view(t->format, buf, &l, chunk_len(t, c), ret);
	/* bf16-master+q8 rounds by the element's index in the whole tensor. */
	ret->base = c * t->chunk_elements;
}

/* nvme.c */
/* A chunk is done (error < 0: failed): its buffer goes back, its work ends with the last. */
void ze_nvme_chunk_finished(struct ze_engine *e, struct chunk_io *io, int error);
/*
 * The stepper writes the param slot's elements [first, first + n) from `from`: the master's
 * own bytes where the slot is the master, else fp32 it converts (a ZE_TASK_PARAM in
 * io->task, io's one part out: it ends in ze_nvme_param_done).
 */
void ze_nvme_post_param(struct ze_engine *e, struct chunk_io *io, const void *from,
    uint64_t first, uint64_t n);
/* Writes the chunk back from io_buf(io); it finishes once that and any other part end. */
void ze_nvme_write_back(struct ze_engine *e, struct chunk_io *io);
int ze_nvme_enqueue(struct ze_engine *e, struct nvme_work *w);
/* Starts chunks while staging buffers are free and the read window has room. */
void ze_nvme_pump(struct ze_engine *e);
bool ze_nvme_covers_chunk(const struct nvme_work *w, uint64_t c);

/* nvme_xfer.c */
/* A transfer's chunk is in io's buffer (or needs no read): copied, then ended or written. */
void ze_nvme_xfer_chunk(struct ze_engine *e, struct chunk_io *io);
enum ze_direct { ZE_DIRECT_NONE, ZE_DIRECT_WHOLE, ZE_DIRECT_SPLIT };
enum ze_direct ze_nvme_direct(const struct nvme_work *w, uint64_t c);
/* Bytes a chunk_io of w on chunk c moves: the chunk, or a split one's part of its arrays. */
uint64_t ze_nvme_io_bytes(const struct nvme_work *w, uint64_t c, enum ze_direct d);

#endif
