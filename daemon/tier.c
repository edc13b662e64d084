/* Where optimizer state lives (pinned or NVMe), and the read → step → write pipeline for NVMe. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "log.h"
#include "msgio.h"
#include "stepper.h"
#include "swap.h"

/*
 * On NVMe a tensor is a run of chunks; chunk c holds elements
 * [c*C, (c+1)*C) as master, m, v back to back, each C*4 bytes (C a
 * multiple of 1024, so every array and chunk is 4 KiB aligned).  One chunk
 * is one sequential read and one sequential write.  The last chunk holds
 * only the rest, each array rounded up to 1024 elements: moving a whole
 * chunk there cost a 4M-element chunk's worth of padding per tensor and
 * step, 12% of the I/O of bench_step's tensors.
 */

enum work_kind { WORK_STEP, WORK_READ, WORK_WRITE };

/* Chunks of one tensor waiting for staging buffers: a step, or a TENSOR_READ/WRITE. */
struct zd_nvme_work {
	TAILQ_ENTRY(zd_nvme_work) entry;
	enum work_kind kind;
	struct zd_tensor *tensor;
	struct zd_batch *batch;		/* WORK_STEP */
	size_t index;
	uint64_t next_chunk;
	uint64_t end_chunk;
	unsigned outstanding;		/* chunks in flight */
	int error;
	/* TENSOR_READ / TENSOR_WRITE */
	uint32_t session_id;
	uint64_t request_id;
	uint8_t state;
	uint64_t offset;
	uint64_t count;
};

/*
 * One session's waiting work.  Staging buffers go to the sessions in turn,
 * a chunk each, so a job with a terabyte on NVMe cannot hold back a small
 * one's step for longer than a few chunks.
 */
struct zd_nvme_lane {
	TAILQ_ENTRY(zd_nvme_lane) entry;
	uint32_t key;
	TAILQ_HEAD(, zd_nvme_work) works;
};

/* One chunk in flight through a staging buffer. */
struct chunk_io {
	struct zd_daemon *d;
	struct zd_nvme_work *work;
	struct zd_staging *staging;
	uint64_t chunk;
	uint64_t start_ns;
	struct zd_task task;
};

static uint64_t
chunk_bytes(const struct zd_tensor *t)
{
	return 3 * t->chunk_elements * sizeof(float);
}

static uint64_t
chunk_count(const struct zd_tensor *t)
{
	return (t->numel + t->chunk_elements - 1) / t->chunk_elements;
}

static uint64_t
chunk_len(const struct zd_tensor *t, uint64_t c)
{
	uint64_t left = t->numel - c * t->chunk_elements;

	return left < t->chunk_elements ? left : t->chunk_elements;
}

/* Elements per array in chunk c (C, or less in the last): 4 KiB multiples. */
static uint64_t
chunk_stride(const struct zd_tensor *t, uint64_t c)
{
	return (chunk_len(t, c) + 1023) / 1024 * 1024;
}

/* Bytes chunk c takes on disk and moves; it starts at c * chunk_bytes(t). */
static uint64_t
chunk_io_bytes(const struct zd_tensor *t, uint64_t c)
{
	return 3 * chunk_stride(t, c) * sizeof(float);
}

int
zd_tier_start(struct zd_daemon *d)
{
	size_t bytes = (size_t)(3 * d->cfg.chunk_elements * sizeof(float));
	int r;

	TAILQ_INIT(&d->staging_free);
	TAILQ_INIT(&d->nvme_lanes);
	if (d->swap == NULL)
		return 0;
	/* Staging is pinned like the state, but outside the state's budget. */
	r = zt_arena_new(&(struct zt_arena_config){
		.budget_bytes = (uint64_t)bytes * d->cfg.staging_buffers,
		.numa_node = d->cfg.numa_node,
		.hugepages = true,
	}, &d->staging_arena);
	if (r < 0)
		return r;
	d->staging = calloc(d->cfg.staging_buffers, sizeof(*d->staging));
	if (d->staging == NULL)
		return -ENOMEM;
	for (unsigned i = 0; i < d->cfg.staging_buffers; i++) {
		struct zd_staging *sb = &d->staging[i];

		r = zt_arena_alloc(d->staging_arena, bytes, &sb->buf, &sb->pinned);
		if (r < 0)
			return r;
		sb->bytes = bytes;
		d->nstaging++;
		/* Fixed buffers spare the kernel a page walk per I/O; not having them is fine. */
		(void)zs_engine_register_buffer(d->swap, sb->buf, bytes);
		TAILQ_INSERT_TAIL(&d->staging_free, sb, entry);
	}
	log_info("NVMe tier: %u staging buffers of %zu MiB, chunks of %llu elements",
	    d->nstaging, bytes >> 20, (unsigned long long)d->cfg.chunk_elements);
	return 0;
}

void
zd_tier_stop(struct zd_daemon *d)
{
	for (unsigned i = 0; i < d->nstaging; i++) {
		if (d->swap != NULL)
			(void)zs_engine_unregister_buffer(d->swap, d->staging[i].buf);
		zt_arena_release(d->staging_arena, d->staging[i].buf, d->staging[i].bytes,
		    d->staging[i].pinned);
	}
	free(d->staging);
	d->staging = NULL;
	d->nstaging = 0;
	zt_arena_free(d->staging_arena);
	d->staging_arena = NULL;
}

static size_t
param_store_bytes(const struct zd_tensor *t)
{
	return ((size_t)t->numel * zk_dtype_size(t->param_dtype) + 4095) / 4096 * 4096;
}

static int
place_nvme(struct zd_daemon *d, struct zd_tensor *t)
{
	uint64_t c = d->cfg.chunk_elements, bytes;
	int r;

	/* Small tensors get small chunks, so they do not take a whole chunk of disk. */
	if (t->numel < c)
		c = (t->numel + 1023) / 1024 * 1024;
	t->chunk_elements = c;
	t->extent = calloc(1, sizeof(*t->extent));
	t->chunks_written = calloc((chunk_count(t) + 7) / 8, 1);
	if (t->extent == NULL || t->chunks_written == NULL) {
		free(t->extent);
		free(t->chunks_written);
		t->extent = NULL;
		t->chunks_written = NULL;
		return -ENOMEM;
	}
	/* Offloaded params follow the state chunks in the same extent. */
	bytes = (chunk_count(t) - 1) * chunk_bytes(t) + chunk_io_bytes(t, chunk_count(t) - 1);
	if (t->param_offload) {
		t->param_store_offset = bytes;
		t->param_store_bytes = param_store_bytes(t);
		bytes += t->param_store_bytes;
	}
	r = zs_extent_alloc(d->swap, bytes, t->extent);
	if (r < 0) {
		free(t->extent);
		free(t->chunks_written);
		t->extent = NULL;
		t->chunks_written = NULL;
		return r;
	}
	t->on_nvme = true;
	t->state_bytes = bytes;
	/* The store holds another tensor's bytes until written: the first release must write. */
	t->param_dirty = t->param_offload;
	return 0;
}

/* "path (used of capacity), ..." for a full swap's message: which disk to grow or clean. */
static void
swap_paths_text(struct zd_daemon *d, char *buf, size_t len)
{
	size_t off = 0;

	buf[0] = '\0';
	for (unsigned i = 0; i < d->cfg.nswap_paths && off < len; i++) {
		struct zs_path_stats ps;
		char used[32], cap[32];
		int n;

		if (zs_engine_path_stats(d->swap, i, &ps) != 0)
			continue;
		zd_fmt_bytes(ps.used_bytes, used, sizeof(used));
		zd_fmt_bytes(ps.capacity, cap, sizeof(cap));
		n = snprintf(buf + off, len - off, "%s%s (%s of %s used)", i > 0 ? ", " : "",
		    d->cfg.swap_paths[i].path, used, cap);
		if (n < 0)
			break;
		off += (size_t)n;
	}
}

/*
 * Pinned when the policy and the budgets (daemon, job, uid) allow it, else
 * NVMe for auto and nvme jobs.  master, m and v sit in one allocation; each
 * array is padded a few KiB past its page-rounded size, because an exact
 * power-of-two distance between them aliases in the cache and halved
 * bandwidth when measured.
 */
int
zd_tier_place(struct zd_session *s, struct zd_tensor *t, char *err, size_t errlen)
{
	struct zd_daemon *d = s->daemon;
	struct zd_job *job = s->job;
	struct zd_uid *u = s->uid_usage;
	uint8_t policy = job->policy;
	size_t stride = ((size_t)t->numel * sizeof(float) + 4095) / 4096 * 4096 + 4160;
	uint64_t pinned = 3 * stride + (t->param_offload ? param_store_bytes(t) : 0);
	uint64_t job_budget = job->pinned_budget;
	bool over_job, over_uid;
	char a[32], b[32], paths[160];
	int r;

	if (policy == ZP_POLICY_AUTO && d->swap == NULL)
		policy = ZP_POLICY_CPU;
	over_job = job_budget > 0 && job->pinned_bytes + pinned > job_budget;
	over_uid = d->cfg.uid_pinned_budget > 0 && u != NULL &&
	    u->pinned_bytes + pinned > d->cfg.uid_pinned_budget;
	if (policy == ZP_POLICY_NVME || (policy == ZP_POLICY_AUTO && (over_job || over_uid)))
		goto nvme;
	if (over_job || over_uid) {
		zd_fmt_bytes(pinned, a, sizeof(a));
		zd_fmt_bytes(over_job ? job_budget : d->cfg.uid_pinned_budget, b, sizeof(b));
		snprintf(err, errlen, "tensor '%s' needs %s of optimizer state, past the %s %s "
		    "(the job's policy is cpu)", t->name, a, b, over_job ? "pinned budget of job" :
		    "limits.uid_pinned_budget of its uid");
		return -EDQUOT;
	}
	/* Offloaded params of a pinned tensor are kept pinned after its state. */
	t->state_bytes = pinned;
	r = zt_arena_alloc(d->arena, t->state_bytes, &t->state, &t->state_pinned);
	if (r == 0) {
		if (t->param_offload) {
			t->param_store = (char *)t->state + 3 * stride;
			t->param_store_bytes = param_store_bytes(t);
		}
		t->master = t->state;
		t->m = (float *)((char *)t->state + stride);
		t->v = (float *)((char *)t->state + 2 * stride);
		job->pinned_bytes += t->state_bytes;
		return 0;
	}
	t->state = NULL;
	if (policy == ZP_POLICY_CPU || r != -ENOSPC)
		return r;
nvme:
	if (d->swap == NULL) {
		snprintf(err, errlen, "tensor '%s': the job keeps state on NVMe but no swap.paths "
		    "are configured", t->name);
		return -ENODEV;
	}
	r = place_nvme(d, t);
	if (r == 0)
		job->nvme_bytes += t->state_bytes;
	if (r == 0 && d->cfg.uid_swap_budget > 0 && u != NULL &&
	    u->swap_bytes + t->state_bytes > d->cfg.uid_swap_budget) {
		zd_tier_release(d, t);
		zd_fmt_bytes(t->state_bytes, a, sizeof(a));
		zd_fmt_bytes(d->cfg.uid_swap_budget, b, sizeof(b));
		snprintf(err, errlen, "tensor '%s' needs %s of swap, past the %s "
		    "limits.uid_swap_budget of its uid", t->name, a, b);
		return -EDQUOT;
	}
	if (r < 0) {
		zd_fmt_bytes(3 * t->numel * sizeof(float), a, sizeof(a));
		swap_paths_text(d, paths, sizeof(paths));
		snprintf(err, errlen, "tensor '%s': no room for %s of state on swap.paths %s: %s",
		    t->name, a, paths, zs_strerror(r));
		return r;
	}
	return 0;
}

void
zd_tier_release(struct zd_daemon *d, struct zd_tensor *t)
{
	if (t->on_nvme) {
		zs_extent_free(d->swap, t->extent);
		free(t->extent);
		free(t->chunks_written);
		t->extent = NULL;
		t->chunks_written = NULL;
		t->on_nvme = false;
		if (t->job != NULL)
			t->job->nvme_bytes -= t->state_bytes;
	} else if (t->state != NULL) {
		zt_arena_release(d->arena, t->state, t->state_bytes, t->state_pinned);
		if (t->job != NULL)
			t->job->pinned_bytes -= t->state_bytes;
	}
	t->state = NULL;
}

static void pump(struct zd_daemon *d);

static int
enqueue(struct zd_daemon *d, uint32_t key, struct zd_nvme_work *w)
{
	struct zd_nvme_lane *lane;

	TAILQ_FOREACH(lane, &d->nvme_lanes, entry)
		if (lane->key == key)
			break;
	if (lane == NULL) {
		lane = calloc(1, sizeof(*lane));
		if (lane == NULL)
			return -ENOMEM;
		lane->key = key;
		TAILQ_INIT(&lane->works);
		TAILQ_INSERT_TAIL(&d->nvme_lanes, lane, entry);
	}
	TAILQ_INSERT_TAIL(&lane->works, w, entry);
	return 0;
}

static void
work_chunk_finished(struct zd_daemon *d, struct chunk_io *io, int error)
{
	struct zd_nvme_work *w = io->work;

	if (error < 0) {
		d->tier.io_errors++;
		if (w->error == 0)
			w->error = error;
	}
	TAILQ_INSERT_TAIL(&d->staging_free, io->staging, entry);
	free(io);
	w->outstanding--;
	if (w->kind == WORK_STEP) {
		zd_step_unit_done(d, w->batch, w->index, error);
		if (w->outstanding == 0 && w->next_chunk == w->end_chunk)
			free(w);
	} else if (w->outstanding == 0 && w->next_chunk == w->end_chunk) {
		struct zd_session *s;
		struct zd_tensor *t = w->tensor;

		TAILQ_FOREACH(s, &d->sessions, entry)
			if (s->id == w->session_id)
				break;
		if (s != NULL && w->error == 0) {
			struct zp_msg m = { .hdr = { .type = ZP_OK, .request_id = w->request_id } };

			(void)zd_session_send(s, &m, NULL, 0);
		} else if (s != NULL) {
			zd_session_error(s, w->request_id, w->error, "tensor '%s': NVMe %s failed: %s",
			    t->name, w->kind == WORK_READ ? "read" : "write", zs_strerror(w->error));
		}
		zd_tensor_unbusy(d, t);
		d->inflight_xfers--;
		free(w);
	}
	pump(d);
}

static void
write_done(int result, void *arg)
{
	struct chunk_io *io = arg;

	if (result == 0) {
		struct zd_tensor *t = io->work->tensor;

		t->chunks_written[io->chunk / 8] |= (uint8_t)(1u << (io->chunk % 8));
		io->d->tier.chunks_written++;
		io->d->tier.bytes_written += chunk_io_bytes(t, io->chunk);
	}
	work_chunk_finished(io->d, io, result);
}

static void
write_back(struct zd_daemon *d, struct chunk_io *io)
{
	struct zd_tensor *t = io->work->tensor;
	int r = zs_write(d->swap, t->extent, io->chunk * chunk_bytes(t), io->staging->buf,
	    chunk_io_bytes(t, io->chunk), write_done, io);

	if (r < 0)
		work_chunk_finished(d, io, r);
}

/* TENSOR_READ / TENSOR_WRITE: copy the part of this chunk the request covers. */
static void
xfer_chunk(struct zd_daemon *d, struct chunk_io *io)
{
	struct zd_nvme_work *w = io->work;
	struct zd_tensor *t = w->tensor;
	struct zd_session *s;
	uint64_t first = io->chunk * t->chunk_elements, last = first + chunk_len(t, io->chunk);
	uint64_t from = w->offset > first ? w->offset : first;
	uint64_t to = w->offset + w->count < last ? w->offset + w->count : last;
	float *array = (float *)io->staging->buf + (size_t)w->state * chunk_stride(t, io->chunk);
	float *window;

	TAILQ_FOREACH(s, &d->sessions, entry)
		if (s->id == w->session_id)
			break;
	if (s == NULL || s->xfer.map == NULL) {
		work_chunk_finished(d, io, -ECONNRESET);
		return;
	}
	window = (float *)s->xfer.map + (from - w->offset);
	if (w->kind == WORK_READ) {
		memcpy(window, array + (from - first), (to - from) * sizeof(float));
		work_chunk_finished(d, io, 0);
		return;
	}
	memcpy(array + (from - first), window, (to - from) * sizeof(float));
	if (w->state == ZP_STATE_MASTER)
		zd_tensor_write_param(t, from, to - from, array + (from - first));
	write_back(d, io);
}

static void
read_done(int result, void *arg)
{
	struct chunk_io *io = arg;
	struct zd_daemon *d = io->d;
	struct zd_nvme_work *w = io->work;
	struct zd_tensor *t = w->tensor;
	struct zd_batch *b = w->batch;
	uint64_t off, n;
	float *buf;

	if (result < 0) {
		work_chunk_finished(d, io, result);
		return;
	}
	d->tier.chunks_read++;
	d->tier.bytes_read += chunk_io_bytes(t, io->chunk);
	/*
	 * Swap space comes back from freed tensors as they left it: until this
	 * tensor writes a chunk, the chunk is zeros (m and v start at 0, and no
	 * job reads another's state).
	 */
	if ((t->chunks_written[io->chunk / 8] & (1u << (io->chunk % 8))) == 0)
		memset(io->staging->buf, 0, chunk_io_bytes(t, io->chunk));
	if (w->kind != WORK_STEP) {
		xfer_chunk(d, io);
		return;
	}
	buf = io->staging->buf;
	off = io->chunk * t->chunk_elements;
	n = chunk_len(t, io->chunk);
	io->task = (struct zd_task){
		.kind = ZD_TASK_STEP,
		.lane = b->lane,
		.batch = b,
		.index = w->index,
		.staging = io->staging,
		.chunk = io->chunk,
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
	zd_step_post(d, &io->task);
}

void
zd_tier_step_computed(struct zd_daemon *d, struct zd_task *task)
{
	struct chunk_io *io = (struct chunk_io *)((char *)task - offsetof(struct chunk_io, task));

	if (task->result < 0) {
		work_chunk_finished(d, io, task->result);
		return;
	}
	write_back(d, io);
}

/* Starts reads while staging buffers are free; counts the time work waits for one. */
static void
pump(struct zd_daemon *d)
{
	struct zd_nvme_lane *lane;
	struct zd_nvme_work *w;
	struct zd_staging *sb;
	struct chunk_io *io;
	uint64_t now = zd_now_ns();
	int r;

	while ((lane = TAILQ_FIRST(&d->nvme_lanes)) != NULL) {
		w = TAILQ_FIRST(&lane->works);
		sb = TAILQ_FIRST(&d->staging_free);
		if (sb == NULL) {
			if (d->io_blocked_since == 0) {
				d->io_blocked_since = now;
				d->tier.io_waits++;
			}
			return;
		}
		io = calloc(1, sizeof(*io));
		if (io == NULL)
			return;
		TAILQ_REMOVE(&d->staging_free, sb, entry);
		io->d = d;
		io->work = w;
		io->staging = sb;
		io->chunk = w->next_chunk++;
		io->start_ns = now;
		w->outstanding++;
		if (w->next_chunk == w->end_chunk)
			TAILQ_REMOVE(&lane->works, w, entry);
		TAILQ_REMOVE(&d->nvme_lanes, lane, entry);
		if (TAILQ_EMPTY(&lane->works))
			free(lane);
		else
			TAILQ_INSERT_TAIL(&d->nvme_lanes, lane, entry);
		r = zs_read(d->swap, w->tensor->extent, io->chunk * chunk_bytes(w->tensor), sb->buf,
		    chunk_io_bytes(w->tensor, io->chunk), read_done, io);
		if (r < 0)
			work_chunk_finished(d, io, r);
	}
	if (d->io_blocked_since != 0) {
		d->tier.io_wait_ns += now - d->io_blocked_since;
		d->io_blocked_since = 0;
	}
}

void
zd_tier_queue_step(struct zd_daemon *d, struct zd_batch *b, size_t i)
{
	struct zd_tensor *t = b->tensors[i];
	struct zd_nvme_work *w = calloc(1, sizeof(*w));

	if (w == NULL) {
		zd_step_unit_done(d, b, i, -ENOMEM);
		return;
	}
	w->kind = WORK_STEP;
	w->tensor = t;
	w->batch = b;
	w->index = i;
	w->end_chunk = chunk_count(t);
	b->pending[i] = w->end_chunk;
	if (enqueue(d, b->lane, w) < 0) {
		free(w);
		b->pending[i] = 1;
		zd_step_unit_done(d, b, i, -ENOMEM);
		return;
	}
	pump(d);
}

void
zd_tier_xfer(struct zd_session *s, struct zd_tensor *t, const struct zp_msg *msg)
{
	const struct zp_tensor_io *req = &msg->u.tensor_io;
	struct zd_nvme_work *w = calloc(1, sizeof(*w));

	if (w == NULL) {
		zd_session_error(s, msg->hdr.request_id, -ENOMEM, "out of memory");
		return;
	}
	w->kind = msg->hdr.type == ZP_TENSOR_READ ? WORK_READ : WORK_WRITE;
	w->tensor = t;
	w->session_id = s->id;
	w->request_id = msg->hdr.request_id;
	w->state = req->state;
	w->offset = req->offset;
	w->count = req->count;
	w->next_chunk = req->offset / t->chunk_elements;
	w->end_chunk = (req->offset + req->count + t->chunk_elements - 1) / t->chunk_elements;
	/* No step may touch the chunks while they are read and patched. */
	if (enqueue(s->daemon, s->id, w) < 0) {
		free(w);
		zd_session_error(s, msg->hdr.request_id, -ENOMEM, "out of memory");
		return;
	}
	t->busy = true;
	s->daemon->inflight_xfers++;
	pump(s->daemon);
}

/* PARAM_FETCH and PARAM_RELEASE on NVMe tensors: one reply (or READY) per tensor when its I/O ends. */
struct param_io {
	struct zd_daemon *d;
	struct zd_tensor *tensor;
	uint32_t session_id;
	uint64_t request_id;
	bool fetch;
	struct param_release *release;	/* the release this write belongs to */
};

/* One PARAM_RELEASE, answered when its last write-back lands. */
struct param_release {
	uint32_t session_id;
	uint64_t request_id;
	unsigned outstanding;
	int error;
};

static struct zd_session *
session_by_id(struct zd_daemon *d, uint32_t id)
{
	struct zd_session *s;

	TAILQ_FOREACH(s, &d->sessions, entry)
		if (s->id == id)
			return s;
	return NULL;
}

static void
send_param_ready(struct zd_session *s, uint64_t request_id, uint32_t handle, int error)
{
	struct zp_msg m = { .hdr = { .type = ZP_PARAM_READY, .request_id = request_id } };

	m.u.param_ready.handle = handle;
	m.u.param_ready.error = error;
	(void)zd_session_send(s, &m, NULL, 0);
}

/* The slot's pages go back to the kernel; the next fetch refills them. */
static void
evict_slot(struct zd_tensor *t)
{
	(void)fallocate(t->param_slot.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
	    (off_t)t->param_slot.bytes);
	t->param_resident = false;
}

static void
release_answer(struct zd_daemon *d, struct param_release *rel)
{
	struct zd_session *s = session_by_id(d, rel->session_id);

	if (s != NULL && rel->error == 0) {
		struct zp_msg m = { .hdr = { .type = ZP_OK, .request_id = rel->request_id } };

		(void)zd_session_send(s, &m, NULL, 0);
	} else if (s != NULL) {
		zd_session_error(s, rel->request_id, rel->error, "writing released params to NVMe "
		    "failed: %s", zs_strerror(rel->error));
	}
	free(rel);
}

static void
param_io_done(int result, void *arg)
{
	struct param_io *io = arg;
	struct zd_daemon *d = io->d;
	struct zd_tensor *t = io->tensor;
	struct zd_session *s = session_by_id(d, io->session_id);
	uint32_t handle = t->session == s ? t->handle : 0;

	if (result < 0)
		d->tier.io_errors++;
	if (io->fetch) {
		if (result == 0) {
			t->param_resident = true;
			t->param_dirty = false;
			d->tier.param_bytes_staged += t->param_store_bytes;
		}
		if (s != NULL && handle != 0)
			send_param_ready(s, io->request_id, handle, result);
	} else {
		if (result == 0) {
			d->tier.param_bytes_written += t->param_store_bytes;
			t->param_dirty = false;
			evict_slot(t);
		} else if (io->release->error == 0) {
			io->release->error = result;
		}
		if (--io->release->outstanding == 0)
			release_answer(d, io->release);
	}
	zd_tensor_unbusy(d, t);
	d->inflight_xfers--;
	free(io);
}

static struct zd_tensor *
param_tensor(struct zd_session *s, uint32_t handle, int *error)
{
	struct zd_tensor *t = zd_session_tensor(s, handle);

	*error = t == NULL ? -ENOENT : t->busy ? -EBUSY : 0;
	return *error == 0 ? t : NULL;
}

static int
start_param_io(struct zd_session *s, struct zd_tensor *t, uint64_t request_id, bool fetch,
    struct param_release *rel)
{
	struct zd_daemon *d = s->daemon;
	struct param_io *io = calloc(1, sizeof(*io));
	int r;

	if (io == NULL)
		return -ENOMEM;
	*io = (struct param_io){ .d = d, .tensor = t, .session_id = s->id,
		.request_id = request_id, .fetch = fetch, .release = rel };
	t->busy = true;
	d->inflight_xfers++;
	if (fetch)
		r = zs_read(d->swap, t->extent, t->param_store_offset, t->param_slot.map,
		    t->param_store_bytes, param_io_done, io);
	else
		r = zs_write(d->swap, t->extent, t->param_store_offset, t->param_slot.map,
		    t->param_store_bytes, param_io_done, io);
	if (r < 0) {
		t->busy = false;
		d->inflight_xfers--;
		free(io);
	}
	return r;
}

void
zd_tier_param_fetch(struct zd_session *s, const struct zp_msg *msg)
{
	const struct zp_handles *h = &msg->u.handles;
	struct zd_daemon *d = s->daemon;

	for (uint32_t i = 0; i < h->count; i++) {
		struct zd_tensor *t;
		int error;

		t = param_tensor(s, h->handles[i], &error);
		if (t == NULL) {
			send_param_ready(s, msg->hdr.request_id, h->handles[i], error);
			continue;
		}
		d->tier.param_fetches++;
		if (!t->param_offload || t->param_resident) {
			d->tier.param_hits++;
			send_param_ready(s, msg->hdr.request_id, t->handle, 0);
			continue;
		}
		d->tier.param_misses++;
		if (!t->on_nvme) {
			memcpy(t->param_slot.map, t->param_store, t->param_store_bytes);
			t->param_resident = true;
			t->param_dirty = false;
			d->tier.param_bytes_staged += t->param_store_bytes;
			send_param_ready(s, msg->hdr.request_id, t->handle, 0);
			continue;
		}
		error = start_param_io(s, t, msg->hdr.request_id, true, NULL);
		if (error < 0)
			send_param_ready(s, msg->hdr.request_id, t->handle, error);
	}
}

void
zd_tier_param_release(struct zd_session *s, const struct zp_msg *msg)
{
	const struct zp_handles *h = &msg->u.handles;
	struct zd_daemon *d = s->daemon;
	struct param_release *rel;
	int error;

	/* Check every handle first: a release is all or nothing. */
	for (uint32_t i = 0; i < h->count; i++) {
		if (param_tensor(s, h->handles[i], &error) == NULL) {
			zd_session_error(s, msg->hdr.request_id, error, "PARAM_RELEASE: tensor handle "
			    "%u %s", h->handles[i], error == -EBUSY ? "is in a step or transfer" :
			    "is not on this connection");
			return;
		}
	}
	rel = calloc(1, sizeof(*rel));
	if (rel == NULL) {
		zd_session_error(s, msg->hdr.request_id, -ENOMEM, "out of memory");
		return;
	}
	rel->session_id = s->id;
	rel->request_id = msg->hdr.request_id;
	/* Held until every write is queued, so an immediate failure cannot answer early. */
	rel->outstanding = 1;
	for (uint32_t i = 0; i < h->count; i++) {
		struct zd_tensor *t = zd_session_tensor(s, h->handles[i]);

		if (!t->param_offload || !t->param_resident || t->busy)
			continue;
		d->tier.param_releases++;
		if (!t->param_dirty) {
			evict_slot(t);
		} else if (!t->on_nvme) {
			memcpy(t->param_store, t->param_slot.map, t->param_store_bytes);
			d->tier.param_bytes_written += t->param_store_bytes;
			t->param_dirty = false;
			evict_slot(t);
		} else {
			rel->outstanding++;
			error = start_param_io(s, t, msg->hdr.request_id, false, rel);
			if (error < 0) {
				rel->outstanding--;
				if (rel->error == 0)
					rel->error = error;
			}
		}
	}
	if (--rel->outstanding == 0)
		release_answer(d, rel);
}
