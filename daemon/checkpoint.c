/*
 * Checkpoint writes: a tensor's state streamed into a file the client opened and passed
 * over the socket.  The daemon never opens a path for a client: the client's uid owns the
 * file and its permissions decide where it may go; the daemon only pwrites to the
 * descriptor.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"
#include "daemon.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "requests.h"
#include "session.h"

/*
 * One CKPT_WRITE whose state is being read from NVMe, or CKPT_READ whose state is being
 * written there (restore: the file was read already, crc holds its CRCs).  Owned by the
 * daemon's list from the engine's acceptance until its io_done; fd and
 * buf are this struct's.
 */
struct zd_ckpt_write {
	struct zd_ckpt_write *next;
	uint32_t lane;
	uint64_t id;
	int fd;
	uint64_t file_offset[ZP_STATE_COUNT];
	uint32_t crc[ZP_STATE_COUNT];
	float *buf;			/* master, m, v: count elements each */
	uint64_t count;
	bool restore;
	char name[ZP_NAME_MAX + 1];
};

static void
ckpt_free(struct zd_ckpt_write *w)
{
	close(w->fd);
	free(w->buf);
	free(w);
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

/* The state is in w->buf (result 0) or could not be read: write it and answer. */
static void
ckpt_finish(struct zd_daemon *d, struct zd_ckpt_write *w, uint64_t last_step, int result)
{
	struct zd_session *s = zd_session_by_id(d, w->lane);
	struct zp_msg m = { .hdr = { .type = ZP_CKPT_DONE, .request_id = w->id } };

	if (result < 0) {
		if (s != NULL)
			zd_session_error(s, w->id, ze_errno(result), "tensor '%s': %s its state "
			    "failed: %s", w->name, w->restore ? "restoring" : "reading for the "
			    "checkpoint", ze_strerror(result));
		ckpt_free(w);
		return;
	}
	if (s != NULL && w->restore) {
		memcpy(m.u.ckpt_done.crc, w->crc, sizeof(w->crc));
		m.u.ckpt_done.last_step = last_step;
		(void)zd_session_send(s, &m, NULL, 0);
	}
	if (s == NULL || w->restore) {
		/* The client is gone; so is the use of its file. */
		ckpt_free(w);
		return;
	}
	for (unsigned i = 0; i < ZP_STATE_COUNT && result == 0; i++) {
		const float *a = w->buf + i * w->count;

		result = write_all(w->fd, a, w->count * sizeof(float), w->file_offset[i]);
		if (result < 0)
			zd_session_error(s, w->id, result, "tensor '%s': writing the checkpoint file "
			    "failed at byte %llu: %s", w->name, (unsigned long long)w->file_offset[i],
			    strerror(-result));
		else
			m.u.ckpt_done.crc[i] = zp_crc32c(w->crc[i], a, w->count * sizeof(float));
	}
	if (result == 0) {
		d->ckpt_bytes += 3 * w->count * sizeof(float);
		m.u.ckpt_done.last_step = last_step;
		(void)zd_session_send(s, &m, NULL, 0);
	}
	ckpt_free(w);
}

bool
zd_ckpt_io_done(struct zd_daemon *d, uint32_t lane, uint64_t id, void *user, int result)
{
	struct zd_ckpt_write **pp, *w;
	struct zd_tensor *t = user;

	for (pp = &d->ckpt_writes; (w = *pp) != NULL; pp = &w->next)
		if (w->lane == lane && w->id == id)
			break;
	if (w == NULL)
		return false;
	*pp = w->next;
	ckpt_finish(d, w, t != NULL ? ze_tensor_last_step(t->et) : 0, result);
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

/* A restore: the pieces from the file, checksummed, then into the tensor. */
static int
restore_read(struct zd_ckpt_write *w, char *err, size_t errlen)
{
	for (unsigned i = 0; i < ZP_STATE_COUNT; i++) {
		float *a = w->buf + i * w->count;
		int r = read_all(w->fd, a, w->count * sizeof(float), w->file_offset[i]);

		if (r < 0) {
			snprintf(err, errlen, "tensor '%s': reading the checkpoint file at byte %llu: "
			    "%s", w->name, (unsigned long long)w->file_offset[i], r == -ENODATA ?
			    "the file ends there (truncated)" : strerror(-r));
			return r == -ENODATA ? -EBADMSG : r;
		}
		w->crc[i] = zp_crc32c(w->crc[i], a, w->count * sizeof(float));
	}
	return 0;
}

void
zd_handle_request_fd(struct zd_session *s, const struct zp_msg *msg, int fd)
{
	const struct zp_ckpt_write *req = &msg->u.ckpt_write;
	uint64_t id = msg->hdr.request_id;
	char err[ZP_ERRMSG_MAX + 1];
	struct zd_ckpt_write *w;
	struct zd_tensor *t;
	uint64_t numel;
	int r;

	bool restore = msg->hdr.type == ZP_CKPT_READ;

	if ((msg->hdr.type != ZP_CKPT_WRITE && !restore) || !s->hello_done) {
		close(fd);
		zd_handle_request(s, msg);	/* says what is wrong (no HELLO yet) */
		return;
	}
	r = check_fd(fd, !restore, err, sizeof(err));
	if (r < 0) {
		close(fd);
		zd_session_error(s, id, r, "%s", err);
		return;
	}
	t = zd_session_tensor(s, req->handle);
	if (t == NULL || ze_tensor_busy(t->et)) {
		close(fd);
		zd_session_error(s, id, t == NULL ? -ENOENT : -EBUSY, t == NULL ?
		    "no tensor with handle %u on this connection" : "tensor with handle %u is in "
		    "a step or transfer: checkpoint between steps", req->handle);
		return;
	}
	if (ze_tensor_step_partial(t->et)) {
		close(fd);
		zd_session_error(s, id, -EINPROGRESS, "tensor '%s': a step failed part-way on "
		    "it; retry that step before saving a checkpoint", t->name);
		return;
	}
	numel = ze_tensor_numel(t->et);
	if (req->offset > numel || req->count > numel - req->offset) {
		close(fd);
		zd_session_error(s, id, -ERANGE, "tensor '%s': elements %llu..%llu are outside "
		    "its %llu", t->name, (unsigned long long)req->offset,
		    (unsigned long long)(req->offset + req->count), (unsigned long long)numel);
		return;
	}
	w = calloc(1, sizeof(*w));
	if (w != NULL)
		w->buf = malloc(3 * req->count * sizeof(float));
	if (w == NULL || w->buf == NULL) {
		free(w);
		close(fd);
		zd_session_error(s, id, -ENOMEM, "out of memory for a %llu-element checkpoint "
		    "write", (unsigned long long)req->count);
		return;
	}
	w->lane = s->id;
	w->id = id;
	w->fd = fd;
	memcpy(w->file_offset, req->file_offset, sizeof(w->file_offset));
	memcpy(w->crc, req->crc, sizeof(w->crc));
	w->count = req->count;
	w->restore = restore;
	snprintf(w->name, sizeof(w->name), "%s", t->name);
	if (restore) {
		r = restore_read(w, err, sizeof(err));
		if (r < 0) {
			zd_session_error(s, id, r, "%s", err);
			ckpt_free(w);
			return;
		}
		r = ze_tensor_write_all(t->et, req->offset, req->count, w->buf, s->id, id);
		goto queued;
	}
	/*
	 * Through the engine, so NVMe state comes through the staging buffers
	 * chunk by chunk like a step's; pinned state is copied at once.
	 */
	r = ze_tensor_read_all(t->et, req->offset, req->count, w->buf, s->id, id);
queued:
	if (r > 0) {
		ckpt_finish(s->daemon, w, ze_tensor_last_step(t->et), 0);
	} else if (r == 0) {
		w->next = s->daemon->ckpt_writes;
		s->daemon->ckpt_writes = w;
	} else {
		zd_session_error(s, id, ze_errno(r), "tensor '%s': %s", t->name, ze_strerror(r));
		ckpt_free(w);
	}
}
