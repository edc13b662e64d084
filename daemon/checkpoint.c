/*
 * Checkpoints: a tensor's state streamed into a file the client opened and passed over the
 * socket (CKPT_WRITE), or back from one (CKPT_READ).  The daemon never opens a path for a
 * client: the client's uid owns the file and its permissions decide where it may go; the
 * daemon only pwrites to, or preads from, the descriptor it was given.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "checkpoint_io.h"
#include "checkpoint_xfer.h"
#include "closer.h"
#include "daemon.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "session.h"
#include "uid.h"

/*
 * File I/O threads: one transfer has one piece on a thread at a time, so more threads
 * serve more transfers at once.  A client saves or restores three tensors at once: with
 * two threads the third's read waited behind the others' while the disk had room (a
 * restore measured about a fifth slower, on a loaded virtual disk).
 */
#define CKPT_IO_THREADS 3

/*
 * checkpoint.c's state of a session (its opaque slot, session.h): a replaced checkpoint
 * file (CKPT_RELEASE), held until the session's next message or its end, then closed off
 * the loop: the client sends that message only after closing its own copy, so the
 * daemon's close is the last and frees the file.  -1: none.  Charged to the session's
 * uid's descriptors until closed.  Made at the first CKPT_RELEASE, freed with the session.
 */
struct zd_session_slot {
	int released_fd;
};

void
zd_ckpt_release_closed(struct zd_daemon *d, struct zd_uid *uid)
{
	d->ckpt_releasing--;
	d->ckpt_released++;
	zd_uid_refund(d, uid, 1, 0, 0);
}

static void
ckpt_free(struct zd_daemon *d, struct zd_ckpt_xfer *w)
{
	if (w->waiting)
		w->uid->ckpt_waiting--;
	zd_ckpt_bufs_put(w);
	zd_closer_close(d, w->uid, w->fd, ZD_CLOSE_CHARGED);
	zd_uid_put(d, w->uid);
	if (w->held != NULL)
		ze_tensor_release(w->held);
	free(w);
}

static void start_waiting(struct zd_daemon *d, struct zd_uid *u);

/* Off the list and freed: w is idle (nothing in the engine or on a thread). */
static void
ckpt_end(struct zd_daemon *d, struct zd_ckpt_xfer *w)
{
	struct zd_ckpt_xfer **pp;
	struct zd_uid *u = w->uid;
	/* Transfers waiting keep u (zd_uid_put): it outlives w then. */
	bool others = u->ckpt_waiting > (w->waiting ? 1u : 0u);

	for (pp = &d->ckpt_xfers; *pp != w; pp = &(*pp)->next)
		;
	*pp = w->next;
	ckpt_free(d, w);
	if (others)
		start_waiting(d, u);
}

/* The engine's id for w's transfers: not a request id (bit 63), unique while w lives. */
static uint64_t
engine_id(const struct zd_ckpt_xfer *w)
{
	return (uint64_t)(uintptr_t)w | (1ull << 63);
}

static void
reply_done(struct zd_session *s, struct zd_ckpt_xfer *w)
{
	struct zp_msg m = { .hdr = { .type = ZP_CKPT_DONE, .request_id = w->id } };

	memcpy(m.u.ckpt_done.crc, w->crc, sizeof(w->crc));
	m.u.ckpt_done.last_step = w->last_step;
	(void)zd_session_send(s, &m, NULL, 0);
}

/* An error answer; w ends once nothing of it is in flight. */
static void
fail(struct zd_daemon *d, struct zd_session *s, struct zd_ckpt_xfer *w, int code,
    const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static void
fail(struct zd_daemon *d, struct zd_session *s, struct zd_ckpt_xfer *w, int code,
    const char *fmt, ...)
{
	char msg[ZP_ERRMSG_MAX + 1];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (!w->dead)
		zd_session_error(s, w->id, code, "%s", msg);
	w->dead = true;
	if (!w->in_engine && !w->in_io)
		ckpt_end(d, w);
}

static void
submit(struct zd_daemon *d, struct zd_ckpt_xfer *w)
{
	w->item.run = zd_ckpt_piece_run;
	w->item.key = w->uid;
	w->in_io = true;
	zd_ckpt_io_submit(d->ckpt_io, &w->item);
}

/*
 * Elements of the piece at element `at` of a range [offset, offset + count) of a tensor
 * with NVMe chunks of `chunk` elements (0: none): up to the next multiple of `most` in
 * the tensor, not past a chunk's end.  The pieces of a range that starts on a 1024-element
 * boundary then all start on one, as the engine's direct transfers want.
 */
static uint64_t
piece_at(uint64_t offset, uint64_t count, uint64_t chunk, uint64_t most, uint64_t at)
{
	uint64_t pos = offset + at;
	uint64_t n = most - pos % most;

	if (n > count - at)
		n = count - at;
	if (chunk > 0 && chunk - pos % chunk < n)
		n = chunk - pos % chunk;
	return n;
}

static uint64_t
piece_len(const struct zd_ckpt_xfer *w, uint64_t at)
{
	return piece_at(w->offset, w->count, w->chunk, w->piece_most, at);
}

/*
 * Asks the engine for the next piece into buf[cur]: 1 there now, 0 queued, < 0 refused.
 * State in memory is written to the file from where it is: nothing to ask.
 */
static int
issue(struct zd_ckpt_xfer *w)
{
	uint64_t n = piece_len(w, w->issued);
	int r;

	w->pending_off = w->issued;
	w->pending_n = n;
	w->issued += n;
	if (w->held != NULL)
		return 1;
	if (w->format != ZK_STATE_FP32)
		r = ze_tensor_read_raw(w->et, w->offset + w->pending_off, n, w->buf[w->cur],
		    w->lane, engine_id(w));
	else
		r = ze_tensor_read_all(w->et, w->offset + w->pending_off, n, stride(n),
		    (float *)(void *)w->buf[w->cur], w->lane, engine_id(w));
	w->in_engine = r == 0;
	return r;
}

/*
 * A save with nothing in flight: the piece read (pending) goes to an I/O thread, and
 * the next is asked of the engine into the other buffer meanwhile; or, all written, the
 * answer.
 */
static void
save_advance(struct zd_daemon *d, struct zd_session *s, struct zd_ckpt_xfer *w)
{
	uint64_t off[ZE_RAW_ARRAYS];
	const char *mem = NULL;
	int r;

	if (w->pending_n == 0) {
		reply_done(s, w);
		ckpt_end(d, w);
		return;
	}
	w->last_step = ze_tensor_last_step(w->et);
	w->io_write = true;
	w->io_off = w->pending_off;
	w->io_n = w->pending_n;
	piece_layout(w->format, w->io_n, off);
	for (unsigned i = 0; i < ZP_CKPT_ARRAYS; i++) {
		mem = w->held != NULL ? ze_tensor_memory_raw(w->et, i) : NULL;
		if (mem != NULL)
			w->io_src[i] = mem + ze_raw_array_bytes(w->format, i, w->offset + w->io_off);
		else
			w->io_src[i] = w->buf[w->cur] != NULL ? w->buf[w->cur] + off[i] : NULL;
	}
	w->pending_n = 0;
	if (w->issued < w->count) {
		w->cur ^= 1;
		r = issue(w);
		if (r < 0) {
			fail(d, s, w, ze_errno(r), "tensor '%s': %s", w->name, ze_strerror(r));
			return;
		}
	}
	submit(d, w);
}

/*
 * A restore's next piece to an I/O thread: into buf, the arrays stride() apart, or, for
 * a tensor in memory (held), into its own arrays, which ze_tensor_hold lets a holder
 * write.
 */
static void
submit_read(struct zd_daemon *d, struct zd_ckpt_xfer *w, char *buf)
{
	uint64_t off[ZE_RAW_ARRAYS];

	w->io_write = false;
	w->io_off = w->issued;
	w->io_n = piece_len(w, w->issued);
	w->issued += w->io_n;
	piece_layout(w->format, w->io_n, off);
	for (unsigned i = 0; i < ZP_CKPT_ARRAYS; i++) {
		if (buf != NULL)
			w->io_dst[i] = buf + off[i];
		else	/* held: fp32 state in memory, three arrays */
			w->io_dst[i] = i < ZP_STATE_COUNT ? (char *)(uintptr_t)
			    ze_tensor_memory_state(w->held, (enum ze_state)i) +
			    (w->offset + w->io_off) * sizeof(float) : NULL;
	}
	w->io_pad = buf != NULL && w->format == ZK_STATE_FP32;
	submit(d, w);
}

/*
 * A restore of a tensor in memory: the thread read the piece (pending) into the tensor
 * and refreshed its params; recorded here, and the next read, or the answer.
 */
static void
restore_held_advance(struct zd_daemon *d, struct zd_session *s, struct zd_ckpt_xfer *w)
{
	if (w->pending_n > 0)
		(void)ze_tensor_restored(w->et, w->offset + w->pending_off, w->pending_n);
	w->pending_n = 0;
	if (w->issued < w->count) {
		submit_read(d, w, NULL);
		return;
	}
	w->last_step = ze_tensor_last_step(w->et);
	reply_done(s, w);
	ckpt_end(d, w);
}

/*
 * A restore with nothing in flight: the piece read from the file (pending, in
 * buf[cur]) goes to the engine, and the next is read into the other buffer meanwhile
 * (cur then names that one); or, all stored, the answer.
 */
static void
restore_advance(struct zd_daemon *d, struct zd_session *s, struct zd_ckpt_xfer *w)
{
	int wr;

	for (;;) {
		char *ready = w->buf[w->cur];
		uint64_t off = w->pending_off, n = w->pending_n;

		if (n == 0) {
			w->last_step = ze_tensor_last_step(w->et);
			reply_done(s, w);
			ckpt_end(d, w);
			return;
		}
		w->pending_n = 0;
		/*
		 * The next read goes to a thread first: state in memory is stored right here,
		 * on the loop, and the disk reads meanwhile.
		 */
		if (w->issued < w->count) {
			w->cur ^= 1;
			submit_read(d, w, w->buf[w->cur]);
		}
		if (w->format != ZK_STATE_FP32)
			wr = ze_tensor_write_raw(w->et, w->offset + off, n, ready, w->lane,
			    engine_id(w));
		else
			wr = ze_tensor_write_all(w->et, w->offset + off, n, stride(n),
			    (const float *)(void *)ready, w->lane, engine_id(w));
		if (wr < 0) {
			fail(d, s, w, ze_errno(wr), "tensor '%s': %s", w->name, ze_strerror(wr));
			return;
		}
		w->in_engine = wr == 0;
		if (w->in_engine || w->in_io)
			return;
	}
}

/* Something of w came back: on to the next piece once both are in, or its end. */
static void
progress(struct zd_daemon *d, struct zd_ckpt_xfer *w)
{
	struct zd_session *s;

	if (w->in_engine || w->in_io)
		return;
	s = d->ckpt_io != NULL ? zd_session_by_id(d, w->lane) : NULL;
	/* The client went away, or its tensor did, or it was answered: the file is of no use. */
	if (s == NULL || w->et == NULL || w->dead) {
		/* Its tensor went (its rank's state expired): the request is still answered. */
		if (s != NULL && !w->dead)
			zd_session_error(s, w->id, -ENOENT, "tensor '%s' went during its checkpoint "
			    "transfer: the file is incomplete", w->name);
		ckpt_end(d, w);
		return;
	}
	if (w->restore && w->held != NULL)
		restore_held_advance(d, s, w);
	else if (w->restore)
		restore_advance(d, s, w);
	else
		save_advance(d, s, w);
}

/* w's first piece asked for: from the file (a restore) or from the tiers (a save). */
static void
begin(struct zd_daemon *d, struct zd_session *s, struct zd_ckpt_xfer *w)
{
	int r;

	if (w->restore) {
		/* The first piece into buf[0] (or the tensor): the advance takes it on when in. */
		submit_read(d, w, w->buf[0]);
		return;
	}
	r = issue(w);
	if (r < 0)
		fail(d, s, w, ze_errno(r), "tensor '%s': %s", w->name, ze_strerror(r));
	else
		progress(d, w);
}

/* A waiting transfer's turn: its buffers, and its first piece; or its end, if it is of no use. */
static void
begin_waiting(struct zd_daemon *d, struct zd_ckpt_xfer *w)
{
	struct zd_session *s = zd_session_by_id(d, w->lane);

	w->waiting = false;
	w->uid->ckpt_waiting--;
	if (s == NULL || w->et == NULL || w->dead) {
		progress(d, w);		/* ends it, answered if its client is there */
		return;
	}
	if (zd_ckpt_bufs_take(w) < 0) {
		fail(d, s, w, -ENOMEM, "tensor '%s': out of memory for a checkpoint transfer of "
		    "%llu elements", w->name, (unsigned long long)w->buf_elements);
		return;
	}
	begin(d, s, w);
}

/*
 * u's waiting transfers begun, oldest first, while the next one's buffers fit: as one of
 * u's transfers ends.  Not entered again from within: a transfer begun here that ends at
 * once (refused) leaves the rest to this loop.  The process has one daemon.
 */
static void
start_waiting(struct zd_daemon *d, struct zd_uid *u)
{
	static bool running;

	if (running)
		return;
	running = true;
	while (u->ckpt_waiting > 0 && d->ckpt_io != NULL) {
		struct zd_ckpt_xfer *w, *first = NULL;

		for (w = d->ckpt_xfers; w != NULL; w = w->next)
			if (w->waiting && w->uid == u && (first == NULL || w->seq < first->seq))
				first = w;
		if (first == NULL || !zd_ckpt_bufs_fit(d, first))
			break;
		begin_waiting(d, first);
	}
	running = false;
}

void
zd_ckpt_budget_reloaded(struct zd_daemon *d)
{
	struct zd_uid *u;

	TAILQ_FOREACH(u, &d->uids, entry)
		if (u->ckpt_waiting > 0)
			start_waiting(d, u);
}

bool
zd_ckpt_io_done(struct zd_daemon *d, uint32_t lane, uint64_t id, void *user, int result)
{
	struct zd_ckpt_xfer *w;
	struct zd_session *s;

	for (w = d->ckpt_xfers; w != NULL; w = w->next)
		if (w->in_engine && w->lane == lane && engine_id(w) == id)
			break;
	if (w == NULL)
		return false;
	w->in_engine = false;
	s = zd_session_by_id(d, lane);
	if (result < 0 && s != NULL && w->et != NULL && user != NULL)
		fail(d, s, w, ze_errno(result), "tensor '%s': %s its state failed: %s", w->name,
		    w->restore ? "restoring" : "reading for the checkpoint", ze_strerror(result));
	else
		progress(d, w);
	return true;
}

void
zd_ckpt_process(struct zd_daemon *d)
{
	struct zd_ckpt_io_item *item;

	while ((item = zd_ckpt_io_take(d->ckpt_io)) != NULL) {
		struct zd_ckpt_xfer *w = (struct zd_ckpt_xfer *)item;
		struct zd_session *s;
		uint64_t off[ZE_RAW_ARRAYS];
		uint64_t bytes;

		s = zd_session_by_id(d, w->lane);
		bytes = ze_raw_layout(w->format, w->io_n, off);
		w->in_io = false;
		if (w->io_result == 0 && w->io_write)
			d->ckpt_bytes += bytes;
		else if (w->io_result == 0)
			d->ckpt_bytes_read += bytes;
		if (w->io_result < 0 && s != NULL)
			fail(d, s, w, w->io_result, "%s", w->io_err);
		else if (w->io_result == 0 && !w->io_write && !w->dead)
			w->pending_off = w->io_off, w->pending_n = w->io_n, progress(d, w);
		else
			progress(d, w);
	}
}

void
zd_ckpt_tensor_gone(struct zd_daemon *d, struct ze_tensor *et)
{
	for (struct zd_ckpt_xfer *w = d->ckpt_xfers; w != NULL; w = w->next)
		if (w->et == et)
			w->et = NULL;
}

int
zd_ckpt_start(struct zd_daemon *d)
{
	return zd_ckpt_io_new(CKPT_IO_THREADS, getenv("ZOFFLOADD_TEST_CKPT_GATE"), &d->ckpt_io);
}

int
zd_ckpt_fd(const struct zd_daemon *d)
{
	return zd_ckpt_io_fd(d->ckpt_io);
}

bool
zd_ckpt_idle(const struct zd_daemon *d)
{
	return d->ckpt_xfers == NULL;
}

void
zd_ckpt_stop(struct zd_daemon *d)
{
	struct zd_ckpt_xfer *w, *next;
	struct zd_ckpt_io_item *item;

	if (d->ckpt_io == NULL)
		return;
	zd_ckpt_io_stop(d->ckpt_io);
	while ((item = zd_ckpt_io_take(d->ckpt_io)) != NULL)
		((struct zd_ckpt_xfer *)item)->in_io = false;
	/* Those waiting for buffers are not begun now: they end with the rest. */
	for (w = d->ckpt_xfers; w != NULL; w = w->next) {
		if (w->waiting)
			w->uid->ckpt_waiting--;
		w->waiting = false;
	}
	/* Those with a piece in the engine end when it comes back (no session is left). */
	for (w = d->ckpt_xfers; w != NULL; w = next) {
		next = w->next;
		if (!w->in_engine)
			ckpt_end(d, w);
	}
	zd_ckpt_io_free(d->ckpt_io);
	d->ckpt_io = NULL;
}

/*
 * Only a regular file, open for writing and not for appending (pwrite must land where
 * asked), or open for reading.
 */
static int
check_fd(int fd, bool write, char *err, size_t errlen)
{
	struct stat st;
	int fl;

	if (fstat(fd, &st) < 0 || (fl = fcntl(fd, F_GETFL)) < 0) {
		snprintf(err, errlen, "the checkpoint descriptor cannot be inspected: %s",
		    strerror(errno));
		return -EBADF;
	}
	if (!S_ISREG(st.st_mode)) {
		snprintf(err, errlen, "the checkpoint descriptor is not a regular file");
		return -EBADF;
	}
	if (!write && (fl & O_ACCMODE) == O_WRONLY) {
		snprintf(err, errlen, "the checkpoint file must be open for reading");
		return -EBADF;
	}
	if (write && ((fl & O_ACCMODE) == O_RDONLY || (fl & O_APPEND) != 0)) {
		snprintf(err, errlen, "the checkpoint file must be open for writing, not %s",
		    (fl & O_APPEND) ? "appending" : "reading only");
		return -EBADF;
	}
	return 0;
}


/* -EBADMSG with err when the file ends before an array of the range does. */
static int
short_file(int fd, const struct zp_ckpt_write *req, char *err, size_t errlen)
{
	struct stat st;

	if (fstat(fd, &st) < 0)
		return 0;	/* the read will say why */
	for (unsigned i = 0; i < ZP_CKPT_ARRAYS; i++) {
		uint64_t bytes = ze_raw_array_bytes((enum zk_state_format)req->format, i,
		    req->count);
		uint64_t end = req->file_offset[i] + bytes;

		if (bytes == 0)
			continue;
		if (end < bytes || end > (uint64_t)st.st_size) {
			snprintf(err, errlen, "the checkpoint file is %lld bytes, array %u of the "
			    "range ends at byte %llu (truncated)", (long long)st.st_size, i,
			    (unsigned long long)end);
			return -EBADMSG;
		}
	}
	return 0;
}

/* Transfers in the order they were asked for: waiting ones begin in it. */
static uint64_t ckpt_seq;

/* Validates the request; a new w, or NULL after answering why not. */
static struct zd_ckpt_xfer *
ckpt_new(struct zd_session *s, const struct zp_msg *msg, int fd)
{
	const struct zp_ckpt_write *req = &msg->u.ckpt_write;
	bool restore = msg->hdr.type == ZP_CKPT_READ;
	uint64_t id = msg->hdr.request_id, numel, piece, chunk, most;
	bool two;
	char err[ZP_ERRMSG_MAX + 1];
	struct zd_ckpt_xfer *w;
	struct zd_tensor *t;
	int r;

	r = check_fd(fd, !restore, err, sizeof(err));
	if (r < 0) {
		zd_session_error(s, id, r, "%s", err);
		return NULL;
	}
	t = zd_session_tensor(s, req->handle);
	if (t == NULL || ze_tensor_busy(t->et)) {
		zd_session_error(s, id, t == NULL ? -ENOENT : -EBUSY, t == NULL ?
		    "no tensor with handle %u on this connection" : "tensor with handle %u is in "
		    "a step or transfer: checkpoint between steps", req->handle);
		return NULL;
	}
	if (!restore && ze_tensor_step_partial(t->et)) {
		zd_session_error(s, id, -EINPROGRESS, "tensor '%s': a step failed part-way on "
		    "it; retry that step before saving a checkpoint", t->name);
		return NULL;
	}
	numel = ze_tensor_numel(t->et);
	if (req->offset > numel || req->count > numel - req->offset) {
		zd_session_error(s, id, -ERANGE, "tensor '%s': elements %llu..%llu are outside "
		    "its %llu", t->name, (unsigned long long)req->offset,
		    (unsigned long long)(req->offset + req->count), (unsigned long long)numel);
		return NULL;
	}
	/* Raw arrays: the tensor's own format, whole 256-element blocks of q8's scales. */
	if (req->format != ZK_STATE_FP32 && req->format != ze_tensor_state_format(t->et)) {
		zd_session_error(s, id, -EINVAL, "tensor '%s' keeps %s state: its arrays cannot "
		    "be %s as %s", t->name, zk_state_format_name(ze_tensor_state_format(t->et)),
		    restore ? "restored" : "saved", zk_state_format_name(req->format));
		return NULL;
	}
	if (req->format != ZK_STATE_FP32 && ze_raw_check(req->format, numel, req->offset,
	    req->count) < 0) {
		zd_session_error(s, id, -EINVAL, "tensor '%s': elements %llu..%llu split a "
		    "256-element block of its %s state (%llu elements): raw arrays move whole "
		    "blocks", t->name, (unsigned long long)req->offset,
		    (unsigned long long)(req->offset + req->count),
		    zk_state_format_name(req->format), (unsigned long long)numel);
		return NULL;
	}
	/*
	 * A restore reads into the tensor as it goes: a file too short for what it names
	 * would leave the elements before its end overwritten.  Refused before any is.
	 */
	if (restore && short_file(fd, req, err, sizeof(err)) < 0) {
		zd_session_error(s, id, -EBADMSG, "tensor '%s': %s", t->name, err);
		return NULL;
	}
	/*
	 * A save of state in memory writes it from where it is, raw or fp32, and a restore
	 * of fp32 state in memory reads into it: no buffers.  Compressed state saved as fp32
	 * is decoded into them.  Pieces end at the tensor's NVMe chunks' ends: an fp32 piece
	 * moves straight between the disk and the buffer; compressed state on NVMe moves
	 * whole chunks, as the engine codes a chunk at a time (a part of one would be read,
	 * patched and written back whole).
	 */
	chunk = ze_tensor_chunk_elements(t->et);
	most = chunk > 0 && ze_tensor_state_format(t->et) != ZK_STATE_FP32 ? chunk : PIECE;
	piece = stride(req->count < most ? req->count : most);
	two = piece_at(req->offset, req->count, chunk, most, 0) < req->count;
	if (restore ? ze_tensor_memory_state(t->et, ZE_STATE_MASTER) != NULL :
	    ze_tensor_memory_raw(t->et, ZE_STATE_MASTER) != NULL &&
	    (req->format != ZK_STATE_FP32 || ze_tensor_state_format(t->et) == ZK_STATE_FP32))
		piece = 0;
	if (restore && piece == 0 && !ze_tensor_param_resident(t->et)) {
		zd_session_error(s, id, -EAGAIN, "tensor '%s': %s", t->name,
		    ze_strerror(-EAGAIN));
		return NULL;
	}
	w = calloc(1, sizeof(*w));
	if (w == NULL) {
		zd_session_error(s, id, -ENOMEM, "out of memory for a checkpoint transfer");
		return NULL;
	}
	w->uid = s->uid_usage;
	w->buf_elements = piece;
	w->nbufs = piece == 0 ? 0 : two ? 2 : 1;
	r = zd_ckpt_bufs_room(s->daemon, w, err, sizeof(err));
	if (r < 0) {
		free(w);
		zd_session_error(s, id, r, "tensor '%s': %s", t->name, err);
		return NULL;
	}
	w->waiting = r > 0;
	if (!w->waiting && zd_ckpt_bufs_take(w) < 0) {
		free(w);
		zd_session_error(s, id, -ENOMEM, "out of memory for a checkpoint transfer of %llu "
		    "elements", (unsigned long long)piece);
		return NULL;
	}
	w->lane = s->id;
	w->id = id;
	w->fd = fd;
	w->et = t->et;
	/* State in memory: no step may touch the arrays, nor a free take them, meanwhile. */
	if (piece == 0) {
		r = ze_tensor_hold(t->et);
		if (r < 0) {
			free(w);
			zd_session_error(s, id, r, "tensor '%s': in a step or transfer", t->name);
			return NULL;
		}
		w->held = t->et;
	}
	w->restore = restore;
	w->offset = req->offset;
	w->count = req->count;
	w->format = (enum zk_state_format)req->format;
	w->chunk = chunk;
	w->piece_most = most;
	memcpy(w->file_offset, req->file_offset, sizeof(w->file_offset));
	memcpy(w->crc, req->crc, sizeof(w->crc));
	snprintf(w->name, sizeof(w->name), "%s", t->name);
	/* Its descriptor is the uid's until the closer has closed it: the charge keeps uid. */
	zd_uid_hold_fd(s->daemon, w->uid);
	w->uid->ckpt_waiting += w->waiting;
	w->seq = ++ckpt_seq;
	return w;
}

void
zd_ckpt_release_held(struct zd_session *s)
{
	int fd = s->slot != NULL ? s->slot->released_fd : -1;

	if (fd < 0)
		return;
	s->slot->released_fd = -1;
	zd_closer_close(s->daemon, s->uid_usage, fd, ZD_CLOSE_RELEASED);
}

void
zd_ckpt_session_end(struct zd_session *s)
{
	zd_ckpt_release_held(s);
	free(s->slot);
	s->slot = NULL;
}

/*
 * CKPT_RELEASE: fd held by the session until its next message (zd_ckpt_release_held), and
 * OK.  A refusal hands it to the closer like any other: it may be the file's last
 * reference (the client need not wait for our answer to close its own).
 */
void
zd_ckpt_handle_release(struct zd_session *s, const struct zp_msg *msg, int fd)
{
	struct zd_daemon *d = s->daemon;
	struct zp_msg ok = { .hdr = { .type = ZP_OK, .request_id = msg->hdr.request_id } };
	char err[ZP_ERRMSG_MAX + 1];
	struct stat st;
	int r;

	if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
		zd_closer_close(d, s->uid_usage, fd, ZD_CLOSE_UNCHARGED);
		zd_session_error(s, msg->hdr.request_id, -EBADF, "CKPT_RELEASE: the descriptor "
		    "is not a regular file");
		return;
	}
	if (s->slot == NULL) {
		s->slot = malloc(sizeof(*s->slot));
		if (s->slot == NULL) {
			zd_closer_close(d, s->uid_usage, fd, ZD_CLOSE_UNCHARGED);
			zd_session_error(s, msg->hdr.request_id, -ENOMEM, "CKPT_RELEASE: out of "
			    "memory");
			return;
		}
		s->slot->released_fd = -1;
	}
	r = zd_uid_charge(d, s->uid_usage, 1, 0, 0, err, sizeof(err));
	if (r < 0) {
		zd_closer_close(d, s->uid_usage, fd, ZD_CLOSE_UNCHARGED);
		zd_session_error(s, msg->hdr.request_id, r, "CKPT_RELEASE: %s", err);
		return;
	}
	s->slot->released_fd = fd;
	d->ckpt_releasing++;
	(void)zd_session_send(s, &ok, NULL, 0);
}

void
zd_ckpt_handle_transfer(struct zd_session *s, const struct zp_msg *msg, int fd)
{
	struct zd_daemon *d = s->daemon;
	struct zd_ckpt_xfer *w;

	w = ckpt_new(s, msg, fd);
	if (w == NULL) {
		zd_closer_close(d, s->uid_usage, fd, ZD_CLOSE_UNCHARGED);
		return;
	}
	w->next = d->ckpt_xfers;
	d->ckpt_xfers = w;
	/* Waiting: begun once its uid's earlier transfers leave room (start_waiting). */
	if (!w->waiting)
		begin(d, s, w);
}

bool
zd_ckpt_in_transfer(const struct zd_daemon *d, const struct ze_tensor *et)
{
	for (const struct zd_ckpt_xfer *w = d->ckpt_xfers; w != NULL; w = w->next)
		if (w->et == et && !w->dead)
			return true;
	return false;
}

void
zd_ckpt_stats_json(struct cJSON *root, const struct zd_daemon *d)
{
	cJSON *c = cJSON_AddObjectToObject(root, "checkpoint");
	const struct zd_ckpt_xfer *w;
	unsigned n = 0, waiting = 0;
	uint64_t bufs = 0;

	if (c == NULL)
		return;
	for (w = d->ckpt_xfers; w != NULL; w = w->next) {
		n++;
		waiting += w->waiting;
		bufs += w->buf_charge;
	}
	cJSON_AddNumberToObject(c, "bytes_written", (double)d->ckpt_bytes);
	cJSON_AddNumberToObject(c, "bytes_read", (double)d->ckpt_bytes_read);
	/* Waiting ones included: accepted, their tensors refuse steps meanwhile. */
	cJSON_AddNumberToObject(c, "transfers_in_flight", n);
	cJSON_AddNumberToObject(c, "transfers_waiting", waiting);
	/* Piece buffers the transfers hold (each uid's within limits.uid_ckpt_buffer_budget). */
	cJSON_AddNumberToObject(c, "buffer_bytes", (double)bufs);
	cJSON_AddNumberToObject(c, "replaced_files_closing", d->ckpt_releasing);
	cJSON_AddNumberToObject(c, "replaced_files_closed", (double)d->ckpt_released);
}
