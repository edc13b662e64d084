/*
 * Checkpoints: a tensor's state streamed into a file the client opened and passed over the
 * socket (CKPT_WRITE), or back from one (CKPT_READ).  The daemon never opens a path for a
 * client: the client's uid owns the file and its permissions decide where it may go; the
 * daemon only pwrites to, or preads from, the descriptor it was given.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "crc32c.h"
#include "daemon.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "requests.h"
#include "session.h"

/*
 * Elements per piece: a transfer moves a request's range a piece at a time through two
 * buffers.  A save reads the next piece from the tiers (NVMe: through the staging
 * buffers) while it writes this one to the file; a restore reads the next piece from the
 * file while the engine writes this one into the tiers.
 */
#define PIECE (4u << 20)

/*
 * One CKPT_WRITE or CKPT_READ.  Owned by the daemon's list while a piece is in the
 * engine, else by the handler on the stack; fd and bufs are this struct's.  et is used
 * only from the handler and from an io_done that names the tensor (so it is alive).
 */
struct zd_ckpt_write {
	struct zd_ckpt_write *next;
	uint32_t lane;
	uint64_t id;			/* the request's */
	int fd;
	struct ze_tensor *et;
	bool restore;
	bool failed;			/* answered with an error; a piece is still in the engine */
	uint64_t offset;		/* in the tensor */
	uint64_t count;
	uint64_t file_offset[ZP_STATE_COUNT];	/* of element offset, per state */
	uint32_t crc[ZP_STATE_COUNT];
	float *buf[2];			/* master, m, v of one piece each */
	uint64_t buf_elements;		/* per array in each */
	unsigned cur;			/* buf[cur]: the piece being read (or just read) */
	uint64_t piece_off;		/* that piece, from offset */
	uint64_t piece_n;
	uint64_t issued;		/* save: elements asked of the engine; restore: read from the file */
	bool have_next;			/* restore: buf[cur ^ 1] holds the piece after this one */
	uint64_t next_off, next_n;
	uint64_t last_step;
	char name[ZP_NAME_MAX + 1];
};

/*
 * Whole-piece buffers (48 MiB) kept for the next transfer: a fresh one costs a page
 * fault and a page of zeros per 4 KiB, which was a quarter of a restore's time.  Two
 * are kept, one transfer's worth; the process has one daemon, and they live as long.
 */
static float *spare[2];

static float *
piece_buf(uint64_t elements)
{
	for (unsigned i = 0; elements == PIECE && i < 2; i++) {
		if (spare[i] != NULL) {
			float *b = spare[i];

			spare[i] = NULL;
			return b;
		}
	}
	return malloc(3 * elements * sizeof(float));
}

static void
piece_buf_free(float *b, uint64_t elements)
{
	for (unsigned i = 0; b != NULL && elements == PIECE && i < 2; i++) {
		if (spare[i] == NULL) {
			spare[i] = b;
			return;
		}
	}
	free(b);
}

static void
ckpt_free(struct zd_ckpt_write *w)
{
	close(w->fd);
	piece_buf_free(w->buf[0], w->buf_elements);
	piece_buf_free(w->buf[1], w->buf_elements);
	free(w);
}

/* The engine's id for w's transfers: not a request id (bit 63), unique while w lives. */
static uint64_t
engine_id(const struct zd_ckpt_write *w)
{
	return (uint64_t)(uintptr_t)w | (1ull << 63);
}

static int
write_all(int fd, const void *buf, size_t len, uint64_t offset)
{
	const char *p = buf;

	while (len > 0) {
		ssize_t n = pwrite(fd, p, len, (off_t)offset);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		if (n == 0)
			return -EIO;
		p += n;
		len -= (size_t)n;
		offset += (uint64_t)n;
	}
	return 0;
}

static int
read_all(int fd, void *buf, size_t len, uint64_t offset)
{
	char *p = buf;

	while (len > 0) {
		ssize_t n = pread(fd, p, len, (off_t)offset);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		if (n == 0)
			return -ENODATA;
		p += n;
		len -= (size_t)n;
		offset += (uint64_t)n;
	}
	return 0;
}

static void
reply_done(struct zd_session *s, struct zd_ckpt_write *w)
{
	struct zp_msg m = { .hdr = { .type = ZP_CKPT_DONE, .request_id = w->id } };

	memcpy(m.u.ckpt_done.crc, w->crc, sizeof(w->crc));
	m.u.ckpt_done.last_step = w->last_step;
	(void)zd_session_send(s, &m, NULL, 0);
}

/*
 * Asks the engine for the next piece into buf[cur]: 1 there now, 0 queued, < 0 refused.
 * State in memory is written to the file from where it is: nothing to ask.
 */
static int
issue(struct zd_ckpt_write *w)
{
	uint64_t n = w->count - w->issued < PIECE ? w->count - w->issued : PIECE;

	w->piece_off = w->issued;
	w->piece_n = n;
	w->issued += n;
	if (ze_tensor_memory_state(w->et, ZE_STATE_MASTER) != NULL)
		return 1;
	return ze_tensor_read_all(w->et, w->offset + w->piece_off, n, w->buf[w->cur], w->lane,
	    engine_id(w));
}

/* Elements [off, off + n) of the range: from the tensor in memory, or from buf. */
static int
write_piece(struct zd_daemon *d, struct zd_ckpt_write *w, const float *buf, uint64_t off,
    uint64_t n, char *err, size_t errlen)
{
	for (unsigned i = 0; i < ZP_STATE_COUNT; i++) {
		const float *mem = ze_tensor_memory_state(w->et, (enum ze_state)i);
		const float *a = mem != NULL ? mem + w->offset + off : buf + i * n;
		uint64_t at = w->file_offset[i] + off * sizeof(float);
		int r = write_all(w->fd, a, n * sizeof(float), at);

		if (r < 0) {
			snprintf(err, errlen, "tensor '%s': writing the checkpoint file failed at "
			    "byte %llu: %s", w->name, (unsigned long long)at, strerror(-r));
			return r;
		}
		w->crc[i] = zp_crc32c(w->crc[i], a, n * sizeof(float));
	}
	d->ckpt_bytes += 3 * n * sizeof(float);
	return 0;
}

/*
 * A save's piece is in buf[cur]: ask for the next one into the other buffer first (on
 * NVMe it is read while this one is written), then write this one.  Ends w (answered,
 * freed) or leaves it on the list waiting for the engine.
 */
static void
save_advance(struct zd_daemon *d, struct zd_session *s, struct zd_ckpt_write *w)
{
	char err[ZP_ERRMSG_MAX + 1];
	int r;

	for (;;) {
		const float *ready = w->buf[w->cur];
		uint64_t off = w->piece_off, n = w->piece_n;
		int next = 0;

		w->last_step = ze_tensor_last_step(w->et);
		if (w->issued < w->count) {
			w->cur ^= 1;
			next = issue(w);
			if (next < 0) {
				zd_session_error(s, w->id, ze_errno(next), "tensor '%s': %s", w->name,
				    ze_strerror(next));
				ckpt_free(w);
				return;
			}
		}
		r = write_piece(d, w, ready, off, n, err, sizeof(err));
		if (r < 0) {
			zd_session_error(s, w->id, r, "%s", err);
			if (w->piece_off != off && next == 0) {
				/* The next piece is in the engine: w goes when it comes back. */
				w->failed = true;
				w->next = d->ckpt_writes;
				d->ckpt_writes = w;
			} else {
				ckpt_free(w);
			}
			return;
		}
		if (w->piece_off == off) {
			/* Nothing more was asked for: that was the last piece. */
			reply_done(s, w);
			ckpt_free(w);
			return;
		}
		if (next == 0) {
			w->next = d->ckpt_writes;
			d->ckpt_writes = w;
			return;
		}
	}
}

static void restore_advance(struct zd_daemon *d, struct zd_session *s, struct zd_ckpt_write *w);

bool
zd_ckpt_io_done(struct zd_daemon *d, uint32_t lane, uint64_t id, void *user, int result)
{
	struct zd_ckpt_write **pp, *w;
	struct zd_tensor *t = user;
	struct zd_session *s;

	for (pp = &d->ckpt_writes; (w = *pp) != NULL; pp = &w->next)
		if (w->lane == lane && engine_id(w) == id)
			break;
	if (w == NULL)
		return false;
	*pp = w->next;
	s = zd_session_by_id(d, lane);
	/* The client went away, or its tensor did, or it was answered: the file is of no use. */
	if (s == NULL || t == NULL || t->session != s || w->failed) {
		ckpt_free(w);
		return true;
	}
	if (result < 0) {
		zd_session_error(s, w->id, ze_errno(result), "tensor '%s': %s its state failed: %s",
		    w->name, w->restore ? "restoring" : "reading for the checkpoint",
		    ze_strerror(result));
		ckpt_free(w);
		return true;
	}
	if (w->restore)
		restore_advance(d, s, w);
	else
		save_advance(d, s, w);
	return true;
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

/*
 * Three arrays read in turn are three interleaved streams, which the kernel's readahead
 * does not follow: ask for the piece from element `from` of each, so that the disk reads
 * it while the one before goes into the tiers.
 */
static void
prefetch(const struct zd_ckpt_write *w, uint64_t from)
{
	uint64_t n = w->count - from < PIECE ? w->count - from : PIECE;

	for (unsigned i = 0; i < ZP_STATE_COUNT && n > 0; i++)
		(void)posix_fadvise(w->fd, (off_t)(w->file_offset[i] + from * sizeof(float)),
		    (off_t)(n * sizeof(float)), POSIX_FADV_WILLNEED);
}

/* A restore's next piece from the file into buf[cur ^ 1], checksummed. */
static int
restore_read(struct zd_daemon *d, struct zd_ckpt_write *w, char *err, size_t errlen)
{
	uint64_t n = w->count - w->issued < PIECE ? w->count - w->issued : PIECE;
	float *buf = w->buf[w->cur ^ 1];

	if (w->issued == 0)
		prefetch(w, 0);

	for (unsigned i = 0; i < ZP_STATE_COUNT; i++) {
		uint64_t at = w->file_offset[i] + w->issued * sizeof(float);
		float *a = buf + i * n;
		int r = read_all(w->fd, a, n * sizeof(float), at);

		if (r < 0) {
			snprintf(err, errlen, "tensor '%s': reading the checkpoint file at byte %llu: "
			    "%s", w->name, (unsigned long long)at, r == -ENODATA ?
			    "the file ends there (truncated)" : strerror(-r));
			return r == -ENODATA ? -EBADMSG : r;
		}
		w->crc[i] = zp_crc32c(w->crc[i], a, n * sizeof(float));
	}
	d->ckpt_bytes_read += 3 * n * sizeof(float);
	w->next_off = w->issued;
	w->next_n = n;
	w->issued += n;
	w->have_next = true;
	prefetch(w, w->issued);
	return 0;
}

/*
 * A restore's next piece was read: hand it to the engine, and read the one after from
 * the file while the engine writes.  Ends w or leaves it on the list.
 */
static void
restore_advance(struct zd_daemon *d, struct zd_session *s, struct zd_ckpt_write *w)
{
	char err[ZP_ERRMSG_MAX + 1];
	int r, wr;

	for (;;) {
		if (!w->have_next) {
			w->last_step = ze_tensor_last_step(w->et);
			reply_done(s, w);
			ckpt_free(w);
			return;
		}
		w->cur ^= 1;
		w->have_next = false;
		w->piece_off = w->next_off;
		w->piece_n = w->next_n;
		wr = ze_tensor_write_all(w->et, w->offset + w->piece_off, w->piece_n, w->buf[w->cur],
		    w->lane, engine_id(w));
		if (wr < 0) {
			zd_session_error(s, w->id, ze_errno(wr), "tensor '%s': %s", w->name,
			    ze_strerror(wr));
			ckpt_free(w);
			return;
		}
		r = w->issued < w->count ? restore_read(d, w, err, sizeof(err)) : 0;
		if (r < 0) {
			zd_session_error(s, w->id, r, "%s", err);
			if (wr == 0) {
				w->failed = true;
				w->next = d->ckpt_writes;
				d->ckpt_writes = w;
			} else {
				ckpt_free(w);
			}
			return;
		}
		if (wr == 0) {
			w->next = d->ckpt_writes;
			d->ckpt_writes = w;
			return;
		}
	}
}

/* Validates the request; a new w, or NULL after answering why not. */
static struct zd_ckpt_write *
ckpt_new(struct zd_session *s, const struct zp_msg *msg, int fd)
{
	const struct zp_ckpt_write *req = &msg->u.ckpt_write;
	bool restore = msg->hdr.type == ZP_CKPT_READ;
	uint64_t id = msg->hdr.request_id, numel, piece;
	char err[ZP_ERRMSG_MAX + 1];
	struct zd_ckpt_write *w;
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
	/* A save of state in memory writes it from where it is: no buffers. */
	piece = req->count < PIECE ? req->count : PIECE;
	if (!restore && ze_tensor_memory_state(t->et, ZE_STATE_MASTER) != NULL)
		piece = 0;
	w = calloc(1, sizeof(*w));
	if (w != NULL && piece > 0) {
		w->buf_elements = piece;
		w->buf[0] = piece_buf(piece);
		w->buf[1] = req->count <= PIECE ? NULL : piece_buf(piece);
	}
	if (w == NULL || (piece > 0 && (w->buf[0] == NULL ||
	    (req->count > PIECE && w->buf[1] == NULL)))) {
		if (w != NULL) {
			piece_buf_free(w->buf[0], piece);
			piece_buf_free(w->buf[1], piece);
		}
		free(w);
		zd_session_error(s, id, -ENOMEM, "out of memory for a checkpoint transfer of %llu "
		    "elements", (unsigned long long)piece);
		return NULL;
	}
	w->lane = s->id;
	w->id = id;
	w->fd = fd;
	w->et = t->et;
	w->restore = restore;
	w->offset = req->offset;
	w->count = req->count;
	memcpy(w->file_offset, req->file_offset, sizeof(w->file_offset));
	memcpy(w->crc, req->crc, sizeof(w->crc));
	snprintf(w->name, sizeof(w->name), "%s", t->name);
	return w;
}

void
zd_handle_request_fd(struct zd_session *s, const struct zp_msg *msg, int fd)
{
	char err[ZP_ERRMSG_MAX + 1];
	struct zd_ckpt_write *w;
	int r;

	if ((msg->hdr.type != ZP_CKPT_WRITE && msg->hdr.type != ZP_CKPT_READ) ||
	    !s->hello_done) {
		close(fd);
		zd_handle_request(s, msg);	/* says what is wrong (no HELLO yet) */
		return;
	}
	w = ckpt_new(s, msg, fd);
	if (w == NULL) {
		close(fd);
		return;
	}
	if (w->restore) {
		/* The first piece into buf[0] (cur ^ 1 with cur 1): restore_advance takes it on. */
		w->cur = 1;
		r = restore_read(s->daemon, w, err, sizeof(err));
		if (r < 0) {
			zd_session_error(s, w->id, r, "%s", err);
			ckpt_free(w);
		} else {
			restore_advance(s->daemon, s, w);
		}
		return;
	}
	r = issue(w);
	if (r < 0) {
		zd_session_error(s, w->id, ze_errno(r), "tensor '%s': %s", w->name, ze_strerror(r));
		ckpt_free(w);
	} else if (r == 0) {
		w->next = s->daemon->ckpt_writes;
		s->daemon->ckpt_writes = w;
	} else {
		save_advance(s->daemon, s, w);
	}
}

void
zd_ckpt_stats_json(struct cJSON *root, const struct zd_daemon *d)
{
	cJSON *c = cJSON_AddObjectToObject(root, "checkpoint");
	const struct zd_ckpt_write *w;
	unsigned n = 0;

	if (c == NULL)
		return;
	for (w = d->ckpt_writes; w != NULL; w = w->next)
		n++;
	cJSON_AddNumberToObject(c, "bytes_written", (double)d->ckpt_bytes);
	cJSON_AddNumberToObject(c, "bytes_read", (double)d->ckpt_bytes_read);
	cJSON_AddNumberToObject(c, "transfers_in_flight", n);
}
