/*
 * Checkpoint pieces on the I/O threads: a piece of a transfer's file written (CRC'd on
 * the way) or read (CRC'd, and for state in memory its params refreshed), and the
 * piece buffers they move through, charged to the uid whose transfer has them.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint_xfer.h"
#include "crc32c.h"
#include "daemon.h"
#include "fileio.h"
#include "log.h"
#include "uid.h"

/*
 * Whole-piece buffers (12 MiB for fp32's PIECE, a whole chunk's for compressed state on
 * NVMe, and room for q8's scales) kept for the next transfers: a fresh one costs a page
 * fault and a page of zeros per 4 KiB, which was a quarter of a restore's time.  Two
 * transfers' worth are kept (a client saves or restores three tensors at once: the
 * third's are fresh, to bound what an idle daemon keeps), of the size last given back;
 * the process has one daemon, and they live as long.  Kept ones are charged to nobody:
 * SPARE_BUFS of them at most, whatever the uids do.
 */
#define SPARE_BUFS 4
static struct {
	char *buf;
	uint64_t elements;
} spare[SPARE_BUFS];

/*
 * Room for any format's arrays of `elements` (a multiple of 1024 where fp32's are
 * stride() apart: fp32's are the largest, but for q8's scales).
 */
uint64_t
zd_ckpt_buf_bytes(uint64_t elements)
{
	return 3 * elements * sizeof(float) + 2 * sizeof(float) * ((elements + 255) / 256);
}

/* 4 KiB aligned, as the swap's direct I/O wants its buffers. */
char *
zd_ckpt_buf_get(uint64_t elements)
{
	void *b;

	for (unsigned i = 0; i < SPARE_BUFS; i++) {
		if (spare[i].buf != NULL && spare[i].elements == elements) {
			b = spare[i].buf;
			spare[i].buf = NULL;
			return b;
		}
	}
	return posix_memalign(&b, 4096, zd_ckpt_buf_bytes(elements)) == 0 ? b : NULL;
}

void
zd_ckpt_buf_put(char *b, uint64_t elements)
{
	unsigned keep = SPARE_BUFS;

	if (b == NULL)
		return;
	/* A tensor's last piece, or a small tensor's only one, is not a size to keep. */
	if (elements < PIECE) {
		free(b);
		return;
	}
	for (unsigned i = 0; i < SPARE_BUFS && keep == SPARE_BUFS; i++)
		if (spare[i].buf == NULL)
			keep = i;
	for (unsigned i = 0; i < SPARE_BUFS && keep == SPARE_BUFS; i++)
		if (spare[i].elements != elements)
			keep = i;
	if (keep == SPARE_BUFS) {
		free(b);
		return;
	}
	free(spare[keep].buf);
	spare[keep].buf = b;
	spare[keep].elements = elements;
}

/* The bytes w's buffers take: what its uid is charged while it has them. */
uint64_t
zd_ckpt_bufs_need(const struct zd_ckpt_xfer *w)
{
	return w->nbufs * zd_ckpt_buf_bytes(w->buf_elements);
}

/* w's buffers back, and its uid's charge for them. */
void
zd_ckpt_bufs_put(struct zd_ckpt_xfer *w)
{
	zd_ckpt_buf_put(w->buf[0], w->buf_elements);
	zd_ckpt_buf_put(w->buf[1], w->buf_elements);
	w->buf[0] = w->buf[1] = NULL;
	w->uid->ckpt_buffer_bytes -= w->buf_charge;
	w->buf_charge = 0;
}

/* w's buffers, charged to its uid (room for them was found); 0 or -ENOMEM. */
int
zd_ckpt_bufs_take(struct zd_ckpt_xfer *w)
{
	if (w->nbufs == 0)
		return 0;
	w->buf[0] = zd_ckpt_buf_get(w->buf_elements);
	w->buf[1] = w->nbufs > 1 ? zd_ckpt_buf_get(w->buf_elements) : NULL;
	w->buf_charge = zd_ckpt_bufs_need(w);
	w->uid->ckpt_buffer_bytes += w->buf_charge;
	if (w->buf[0] == NULL || (w->nbufs > 1 && w->buf[1] == NULL)) {
		zd_ckpt_bufs_put(w);
		return -ENOMEM;
	}
	return 0;
}

/*
 * Whether w's buffers fit in its uid's limits.uid_ckpt_buffer_budget now.  A transfer
 * alone always does: a reload may have lowered the budget under what one needs.
 */
bool
zd_ckpt_bufs_fit(const struct zd_daemon *d, const struct zd_ckpt_xfer *w)
{
	uint64_t budget = d->cfg.uid_ckpt_buffer_budget, used = w->uid->ckpt_buffer_bytes;

	return budget == 0 || used == 0 || used + zd_ckpt_bufs_need(w) <= budget;
}

/*
 * Room in w's uid's limits.uid_ckpt_buffer_budget for w's buffers: 0 now, 1 once its
 * uid's transfers before it have given theirs back (it waits its turn), -EDQUOT with err
 * when it needs more than the budget on its own.
 */
int
zd_ckpt_bufs_room(const struct zd_daemon *d, const struct zd_ckpt_xfer *w, char *err,
    size_t errlen)
{
	uint64_t budget = d->cfg.uid_ckpt_buffer_budget, need = zd_ckpt_bufs_need(w);
	char a[32], b[32];

	if (need == 0 || budget == 0)
		return 0;
	if (need > budget) {
		zd_fmt_bytes(need, a, sizeof(a));
		zd_fmt_bytes(budget, b, sizeof(b));
		snprintf(err, errlen, "a checkpoint transfer of it needs %s of buffers, more than "
		    "limits.uid_ckpt_buffer_budget (%s)", a, b);
		return -EDQUOT;
	}
	return w->uid->ckpt_waiting == 0 && zd_ckpt_bufs_fit(d, w) ? 0 : 1;
}

/*
 * Bytes CRC'd and then written at a time: the write's copy into the page cache finds
 * them in the CPU's cache, where the CRC left them.  A whole array's CRC and then its
 * write read it from memory twice, and the copy was the save's largest cost.
 */
#define WRITE_BLOCK (256u << 10)

static void
io_write_piece(struct zd_ckpt_xfer *w)
{
	for (unsigned i = 0; i < ZP_CKPT_ARRAYS; i++) {
		const char *src = w->io_src[i];
		uint64_t at = w->file_offset[i] + ze_raw_array_bytes(w->format, i, w->io_off);
		uint64_t len = ze_raw_array_bytes(w->format, i, w->io_n);

		if (len == 0)
			continue;
		for (uint64_t done = 0; done < len;) {
			size_t n = len - done < WRITE_BLOCK ? (size_t)(len - done) : WRITE_BLOCK;
			int r;

			w->crc[i] = zu_crc32c(w->crc[i], src + done, n);
			r = zp_pwrite_full(w->fd, src + done, n, at + done);
			if (r < 0) {
				snprintf(w->io_err, sizeof(w->io_err), "tensor '%s': writing the "
				    "checkpoint file failed at byte %llu: %s", w->name,
				    (unsigned long long)(at + done), strerror(-r));
				w->io_result = r;
				return;
			}
			done += n;
		}
		/*
		 * The disk writes it now, while the next pieces are read from the tiers: the
		 * client's fsync at the end then has little left to wait for.
		 */
		(void)sync_file_range(w->fd, (off64_t)at, (off64_t)len, SYNC_FILE_RANGE_WRITE);
	}
}

/*
 * A piece's three arrays are read in turn, 16 MiB each at three places: the kernel's
 * readahead for the file (SEQUENTIAL doubles its window) queues each read whole.
 * Asking for the next piece ahead (WILLNEED) instead read a third slower, measured on a
 * virtual disk, and delayed the piece being read.  Each array is read and CRC'd
 * WRITE_BLOCK at a time, as a save writes it: the CRC finds the bytes in the CPU's cache
 * where the copy out of the page cache left them, not in memory.
 */
static void
io_read_piece(struct zd_ckpt_xfer *w)
{
	if (w->io_off == 0)
		(void)posix_fadvise(w->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
	for (unsigned i = 0; i < ZP_CKPT_ARRAYS; i++) {
		uint64_t at = w->file_offset[i] + ze_raw_array_bytes(w->format, i, w->io_off);
		uint64_t len = ze_raw_array_bytes(w->format, i, w->io_n);
		char *a = w->io_dst[i];

		for (uint64_t done = 0; done < len;) {
			size_t n = len - done < WRITE_BLOCK ? (size_t)(len - done) : WRITE_BLOCK;
			int r = zp_pread_full(w->fd, (char *)a + done, n, at + done);

			if (r < 0) {
				snprintf(w->io_err, sizeof(w->io_err), "tensor '%s': reading the "
				    "checkpoint file at byte %llu: %s", w->name,
				    (unsigned long long)(at + done), r == -ENODATA ?
				    "the file ends there (truncated)" : strerror(-r));
				w->io_result = r == -ENODATA ? -EBADMSG : r;
				return;
			}
			w->crc[i] = zu_crc32c(w->crc[i], (char *)a + done, n);
			done += n;
		}
		/* The padding goes to the swap with the chunk: zeros, not a last use's bytes. */
		if (w->io_pad && len > 0)
			memset(a + len, 0, (stride(w->io_n) - w->io_n) * sizeof(float));
	}
	/* Read into the tensor itself: its params follow here too, off the loop. */
	if (w->held != NULL)
		(void)ze_tensor_param_refresh(w->held, w->offset + w->io_off, w->io_n);
}

void
zd_ckpt_piece_run(struct zd_ckpt_io_item *item)
{
	struct zd_ckpt_xfer *w = (struct zd_ckpt_xfer *)item;

	w->io_result = 0;
	if (w->io_write)
		io_write_piece(w);
	else
		io_read_piece(w);
}
