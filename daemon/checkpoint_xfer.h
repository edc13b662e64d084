/*
 * A checkpoint transfer's state, shared by the loop's side (checkpoint.c) and the I/O
 * threads' side (checkpoint_piece.c): one file piece at a time moves between the two.
 */
#ifndef ZD_CHECKPOINT_XFER_H
#define ZD_CHECKPOINT_XFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "checkpoint_io.h"
#include "engine.h"
#include "proto.h"

struct zd_uid;

/*
 * Elements per piece: a transfer moves a request's range a piece at a time through two
 * buffers.  A save reads the next piece from the tiers (NVMe: through the staging
 * buffers) while it writes this one to the file; a restore reads the next piece from the
 * file while the engine writes this one into the tiers.
 *
 * An fp32 piece's three arrays lie in its buffer stride() apart (a raw piece's as
 * ze_raw_layout packs them) and, for an fp32 tensor on NVMe, a piece lies within one of
 * its chunks: the swap then reads or writes the buffer itself (ze_tensor_read_all),
 * where a copy through a staging buffer on the event loop bounded the transfers' speed.
 * A piece is a quarter of a default 4M-element chunk: as fast as whole chunks, measured
 * (the other side's first I/O starts sooner, but the disk was busy meanwhile), on a
 * quarter of the memory (bench_checkpoint's daemon peaked 120 MB lower).
 */
#define PIECE (1u << 20)

/* Elements between a piece's arrays in its buffer: as the engine's NVMe chunks lay them. */
static inline uint64_t
stride(uint64_t n)
{
	return ze_chunk_round(n);
}

/*
 * Byte offsets of the arrays of a piece of n elements in its buffer: fp32's three
 * stride(n) apart (each a 4 KiB multiple, as the swap's direct I/O moves them; a whole NVMe
 * chunk lies there as on the disk), a raw format's as ze_raw_layout packs them.
 */
static inline void
piece_layout(enum zk_state_format f, uint64_t n, uint64_t off[ZE_RAW_ARRAYS])
{
	if (f != ZK_STATE_FP32) {
		ze_raw_layout(f, n, off);
		return;
	}
	for (unsigned i = 0; i < ZE_RAW_ARRAYS; i++)
		off[i] = (i < 3 ? i : 3) * stride(n) * sizeof(float);
}

/*
 * One CKPT_WRITE or CKPT_READ, on the daemon's list from its start to its end.  Two
 * things may be in flight for it at once: a piece in the engine (in_engine) and a piece
 * in the file (in_io, on an I/O thread); it ends when both are back.
 *
 * Ownership while in_io: the I/O thread has item, fd, crc, the io_* fields and the
 * buffer they name (or, for a save or restore of state in memory, the tensor's arrays
 * and, for a restore, its param slot, which `held` keeps busy so that no step changes
 * them and no free takes them); the loop does not touch them, and has everything else.
 * The engine has the buffer it was given while in_engine, the other one of the two.  fd
 * and bufs are this struct's.  et is the tensor while it lives: zd_ckpt_tensor_gone
 * clears it.
 */
struct zd_ckpt_xfer {
	struct zd_ckpt_io_item item;		/* first: the I/O threads see only it */
	struct zd_ckpt_xfer *next;
	uint32_t lane;
	uint64_t id;			/* the request's */
	int fd;				/* charged to uid's descriptors until closed */
	struct zd_uid *uid;
	struct ze_tensor *et;
	struct ze_tensor *held;		/* state in memory: busy until w ends */
	bool restore;
	bool dead;			/* answered (an error) or its client gone: ends when idle */
	bool in_engine, in_io;
	/*
	 * Accepted, waiting for room in its uid's limits.uid_ckpt_buffer_budget: no buffers
	 * yet, nothing in flight; started in turn (seq) as the uid's other transfers end.
	 */
	bool waiting;
	uint64_t seq;
	uint64_t offset;		/* in the tensor */
	uint64_t count;
	enum zk_state_format format;	/* of the file's arrays: fp32, or the tensor's (raw) */
	uint64_t file_offset[ZP_CKPT_ARRAYS];	/* of element offset, per array */
	uint32_t crc[ZP_CKPT_ARRAYS];
	char *buf[2];			/* the arrays of one piece each (piece_layout) */
	uint64_t buf_elements;		/* per array in each */
	unsigned nbufs;			/* buffers it needs: 1, or 2 (a range of several pieces) */
	uint64_t buf_charge;		/* bytes of them charged to uid (ckpt_buffer_bytes) */
	uint64_t chunk;			/* the tensor's NVMe chunk (0: in memory): pieces end there */
	uint64_t piece_most;		/* elements in a piece at most (PIECE, or the chunk) */
	unsigned cur;			/* save: buf[cur] is the engine's; restore: the I/O's */
	uint64_t issued;		/* save: elements asked of the engine; restore: of the file */
	uint64_t pending_off, pending_n;	/* save: read, to write; restore: read, to store */
	/* The piece on the I/O thread: elements [io_off, io_off + io_n) of the range. */
	bool io_write;
	const char *io_src[ZP_CKPT_ARRAYS];	/* a save's arrays */
	char *io_dst[ZP_CKPT_ARRAYS];		/* where a restore's arrays go */
	bool io_pad;				/* ... in a buffer, fp32's stride() apart */
	uint64_t io_off, io_n;
	int io_result;
	char io_err[ZP_ERRMSG_MAX + 1];
	uint64_t last_step;
	char name[ZP_NAME_MAX + 1];
};

/* The bytes of a buffer for a piece of `elements` (zd_ckpt_buf_get's). */
uint64_t zd_ckpt_buf_bytes(uint64_t elements);
/* A 4 KiB-aligned buffer for a piece of `elements` (a kept one when it is a whole PIECE). */
char *zd_ckpt_buf_get(uint64_t elements);
void zd_ckpt_buf_put(char *b, uint64_t elements);
/*
 * Checkpoint buffers are charged to the uid that asked (zd_uid's ckpt_buffer_bytes), at
 * most limits.uid_ckpt_buffer_budget: a transfer without room waits its turn.
 * zd_ckpt_bufs_need: the bytes w's buffers take.  zd_ckpt_bufs_room: 0 room now, 1 wait,
 * -EDQUOT (err says why) when w alone needs more than the budget.  zd_ckpt_bufs_fit: room
 * now, for a waiting one (alone, it always fits).  zd_ckpt_bufs_take: the buffers, charged
 * (0 or -ENOMEM); zd_ckpt_bufs_put: given back, and the charge.
 */
struct zd_daemon;
uint64_t zd_ckpt_bufs_need(const struct zd_ckpt_xfer *w);
int zd_ckpt_bufs_room(const struct zd_daemon *d, const struct zd_ckpt_xfer *w, char *err,
    size_t errlen);
bool zd_ckpt_bufs_fit(const struct zd_daemon *d, const struct zd_ckpt_xfer *w);
int zd_ckpt_bufs_take(struct zd_ckpt_xfer *w);
void zd_ckpt_bufs_put(struct zd_ckpt_xfer *w);
/* The piece w names (io_*) read from or written to its file: run on an I/O thread. */
void zd_ckpt_piece_run(struct zd_ckpt_io_item *item);

#endif
