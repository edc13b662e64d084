/* Swap engine core: requests split into bounded operations, retries, completions. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE	/* statx, fallocate, O_DIRECT, strerrordesc_np */
#endif
#include <errno.h>
#include <sys/stat.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "swap_impl.h"

#define DEFAULT_UNIT (1u << 20)
#define DEFAULT_QD 32u
#define MAX_QD 4096u
#define MAX_THREADS 256u
/* The kernel caps one read/write near 2 GiB; stay well inside and inside int. */
#define MAX_OP_LEN (1u << 30)
/* -EAGAIN / -EINTR resubmissions of one range before the owner is told. */
#define MAX_RETRIES 64u
/* Completions that moved nothing (0 bytes, or less than the DIO alignment). */
#define MAX_STALLS 16u

struct zs_req {
	struct zs_req *next;
	zs_callback *cb;
	void *arg;
	char *buf;
	uint64_t offset;		/* in the extent */
	uint64_t len;
	uint64_t issued;		/* bytes handed to operations so far */
	unsigned outstanding;		/* operations in flight */
	int error;
	bool write;
	struct zs_extent extent;
};

const char *
zs_strerror(int code)
{
	const char *s;

	switch (-code) {
#define ZS_ERROR_CASE(name, value, errno_, text) case name: return text;
	ZS_ERROR_LIST(ZS_ERROR_CASE)
#undef ZS_ERROR_CASE
	default:
		break;
	}
	if (code == 0)
		return "success";
	s = strerrordesc_np(-code);
	return s != NULL ? s : "unknown error";
}

int
zs_errno(int code)
{
	switch (-code) {
#define ZS_ERRNO_CASE(name, value, errno_, text) case name: return -errno_;
	ZS_ERROR_LIST(ZS_ERRNO_CASE)
#undef ZS_ERRNO_CASE
	default:
		return code;
	}
}

void
zs_swap_wake(struct zs_swap *e)
{
	(void)eventfd_write(e->efd, 1);
}

static bool
uring_forced_off(const struct zs_config *c)
{
	const char *env = getenv("ZOFFLOAD_SWAP_NO_URING");

	return c->force_no_uring || (env != NULL && env[0] != '\0' && strcmp(env, "0") != 0);
}

static int
start_backend(struct zs_swap *e, const struct zs_config *c, struct zs_error_info *info)
{
	int r;

	if (c->engine != ZS_SWAP_PTHREAD) {
		e->backend = &zs_backend_uring;
		r = uring_forced_off(c) ? -ENOSYS : e->backend->init(e);
		if (r == 0)
			return 0;
		e->uring_error = r;
		if (c->engine == ZS_SWAP_URING || !c->allow_fallback) {
			if (info != NULL)
				*info = (struct zs_error_info){ .path = -1, .step = "io_uring_queue_init",
				    .cause = r };
			e->backend = NULL;
			return -ZS_E_NOURING;
		}
	}
	e->backend = &zs_backend_pthread;
	r = e->backend->init(e);
	if (r < 0) {
		if (info != NULL)
			*info = (struct zs_error_info){ .path = -1, .step = "pthread_create", .cause = r };
		e->backend = NULL;
	}
	return r;
}

static int
check_config(const struct zs_config *c)
{
	if (c->paths == NULL || c->npaths == 0 || c->npaths > ZS_MAX_PATHS)
		return -EINVAL;
	if (c->queue_depth > MAX_QD || c->threads > MAX_THREADS)
		return -EINVAL;
	if (c->engine != ZS_SWAP_AUTO && c->engine != ZS_SWAP_URING &&
	    c->engine != ZS_SWAP_PTHREAD)
		return -EINVAL;
	return 0;
}

int
zs_swap_new(const struct zs_config *c, struct zs_swap **ret, struct zs_error_info *info)
{
	struct zs_swap *e;
	unsigned i;
	int r;

	if (info != NULL)
		*info = (struct zs_error_info){ .path = -1, .step = "config", .cause = 0 };
	r = check_config(c);
	if (r < 0)
		return r;
	e = calloc(1, sizeof(*e));
	if (e == NULL)
		return -ENOMEM;
	e->efd = -1;
	for (i = 0; i < ZS_MAX_PATHS; i++) {
		e->files[i].fd = -1;
		e->files[i].lock_fd = -1;
	}
	e->unit = c->stripe_unit ? c->stripe_unit : DEFAULT_UNIT;
	e->qd = c->queue_depth ? c->queue_depth : DEFAULT_QD;
	e->threads = c->threads ? c->threads : (e->qd < MAX_THREADS ? e->qd : MAX_THREADS);
	e->inject = c->inject;
	e->offset_align = 512;
	e->mem_align = 1;

	for (i = 0; i < c->npaths; i++) {
		uint64_t cap = c->paths[i].capacity ? c->paths[i].capacity : c->capacity;

		r = zs_file_open(&c->paths[i], cap, &e->files[i], info);
		if (r < 0) {
			if (info != NULL)
				info->path = (int)i;
			goto err;
		}
		e->npaths = i + 1;
		if (e->files[i].dio_offset_align > e->offset_align)
			e->offset_align = e->files[i].dio_offset_align;
		if (e->files[i].dio_mem_align > e->mem_align)
			e->mem_align = e->files[i].dio_mem_align;
	}
	/* Page granularity at least: extents then suit any buffer and any drive. */
	e->granule = e->offset_align > 4096 ? e->offset_align : 4096;
	if (e->unit % e->granule != 0 || e->unit > MAX_OP_LEN) {
		r = -EINVAL;
		if (info != NULL)
			*info = (struct zs_error_info){ .path = -1, .step = "stripe_unit", .cause = r };
		goto err;
	}
	for (i = 0; i < e->npaths; i++) {
		struct zs_space *s = &e->files[i].space;
		uint64_t cap = s->capacity / e->granule * e->granule;

		/* A tail smaller than the granularity is never handed out. */
		if (cap != s->capacity) {
			zs_space_fini(s);
			r = zs_space_init(s, cap);
			if (r < 0)
				goto err;
		}
	}

	e->ops = calloc(e->qd, sizeof(*e->ops));
	if (e->ops == NULL) {
		r = -ENOMEM;
		goto err;
	}
	for (i = e->qd; i-- > 0;) {
		e->ops[i].next = e->free_ops;
		e->free_ops = &e->ops[i];
	}
	e->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (e->efd < 0) {
		r = -errno;
		if (info != NULL)
			*info = (struct zs_error_info){ .path = -1, .step = "eventfd", .cause = r };
		goto err;
	}
	r = start_backend(e, c, info);
	if (r < 0)
		goto err;
	*ret = e;
	return 0;

err:
	for (i = 0; i < ZS_MAX_PATHS; i++)
		zs_file_close(&e->files[i]);
	if (e->efd >= 0)
		close(e->efd);
	free(e->ops);
	free(e);
	return r;
}

static void run_callbacks(struct zs_swap *e);

void
zs_swap_free(struct zs_swap *e)
{
	struct zs_req *q;
	unsigned i;

	if (e == NULL)
		return;
	/* Nothing new starts; what the kernel holds must finish before buffers go. */
	while ((q = e->queue_head) != NULL) {
		if (q->error == 0)
			q->error = -ECANCELED;
		q->len = q->issued;
		e->queue_head = q->next;
		if (q->outstanding == 0) {
			q->next = NULL;
			if (e->done_tail != NULL)
				e->done_tail->next = q;
			else
				e->done_head = q;
			e->done_tail = q;
		}
	}
	e->queue_tail = NULL;
	e->closing = true;
	while (e->in_flight > 0 || e->done_head != NULL || e->injected != NULL) {
		/* Nothing in flight: no completion will ever make the fd readable. */
		if ((e->in_flight > 0 ? zs_swap_wait(e, -1) : zs_swap_process(e)) < 0)
			break;
	}
	run_callbacks(e);
	if (e->backend != NULL)
		e->backend->fini(e);
	while ((q = e->free_reqs) != NULL) {
		e->free_reqs = q->next;
		free(q);
	}
	for (i = 0; i < ZS_MAX_PATHS; i++)
		zs_file_close(&e->files[i]);
	close(e->efd);
	free(e->ops);
	free(e);
}

int
zs_swap_fd(const struct zs_swap *e)
{
	return e->efd;
}

uint32_t
zs_swap_offset_align(const struct zs_swap *e)
{
	return e->offset_align;
}

uint32_t
zs_swap_mem_align(const struct zs_swap *e)
{
	return e->mem_align;
}

const char *
zs_swap_name(const struct zs_swap *e)
{
	return e->backend->name;
}

int
zs_swap_register_buffer(struct zs_swap *e, void *ptr, size_t len)
{
	unsigned i;
	int r;

	if (ptr == NULL || len == 0)
		return -EINVAL;
	for (i = 0; i < ZS_MAX_BUFFERS; i++) {
		if (e->buffers[i].ptr == NULL)
			break;
	}
	if (i == ZS_MAX_BUFFERS)
		return -ENOSPC;
	e->buffers[i] = (struct zs_buffer){ ptr, len };
	if (e->backend->register_buffer != NULL) {
		r = e->backend->register_buffer(e, i);
		if (r < 0) {
			e->buffers[i] = (struct zs_buffer){ NULL, 0 };
			return r;
		}
	}
	e->buffers_registered++;
	return 0;
}

int
zs_swap_unregister_buffer(struct zs_swap *e, void *ptr)
{
	unsigned i;

	for (i = 0; i < ZS_MAX_BUFFERS; i++) {
		if (e->buffers[i].ptr == ptr && ptr != NULL)
			break;
	}
	if (i == ZS_MAX_BUFFERS)
		return -ENOENT;
	/* Operations in flight hold the kernel's reference, not this slot. */
	if (e->backend->unregister_buffer != NULL)
		(void)e->backend->unregister_buffer(e, i);
	e->buffers[i] = (struct zs_buffer){ NULL, 0 };
	e->buffers_registered--;
	return 0;
}

static uint16_t
find_buffer(const struct zs_swap *e, const char *p, size_t len)
{
	unsigned i;

	if (e->buffers_registered == 0)
		return ZS_NO_BUFFER;
	for (i = 0; i < ZS_MAX_BUFFERS; i++) {
		const struct zs_buffer *b = &e->buffers[i];

		if (b->ptr != NULL && p >= b->ptr && p + len <= b->ptr + b->len)
			return (uint16_t)i;
	}
	return ZS_NO_BUFFER;
}

static void
done_push(struct zs_swap *e, struct zs_req *q)
{
	q->next = NULL;
	if (e->done_tail != NULL)
		e->done_tail->next = q;
	else
		e->done_head = q;
	e->done_tail = q;
}

static void
queue_pop(struct zs_swap *e)
{
	e->queue_head = e->queue_head->next;
	if (e->queue_head == NULL)
		e->queue_tail = NULL;
}

static struct zs_inject_op
inject_op(const struct zs_op *op)
{
	return (struct zs_inject_op){
		.path = op->path,
		.write = op->write,
		.offset = op->offset + op->done,
		.len = op->len - op->done,
		.buf = op->buf + op->done,
		.attempt = op->attempt,
	};
}

/* (Re)submit the op's remaining range. */
static void
op_issue(struct zs_swap *e, struct zs_op *op)
{
	if (e->inject != NULL && e->inject->prepare != NULL) {
		struct zs_inject_op io = inject_op(op);
		int r = e->inject->prepare(e->inject->arg, &io);

		if (r < 0) {
			op->res = r;
			op->next = e->injected;
			e->injected = op;
			zs_swap_wake(e);
			return;
		}
	}
	e->backend->queue(e, op);
}

/* Hand free operation slots ranges of the queued requests, in order. */
static void
pump(struct zs_swap *e)
{
	while (e->free_ops != NULL && e->queue_head != NULL) {
		struct zs_req *q = e->queue_head;
		const struct zs_extent *x = &q->extent;
		struct zs_op *op;
		uint64_t pos = q->offset + q->issued, unit_index, within, len;
		unsigned path;

		if (q->error != 0 || q->issued == q->len) {
			/* A request whose part failed issues nothing more. */
			queue_pop(e);
			q->len = q->issued;
			if (q->outstanding == 0)
				done_push(e, q);
			continue;
		}
		unit_index = pos / e->unit;
		within = pos % e->unit;
		path = x->paths[(x->first_slot + unit_index) % x->nslots];
		len = q->len - q->issued;
		/* One path: the extent is contiguous in its file, no need to cut at units. */
		if (x->nslots > 1 && len > e->unit - within)
			len = e->unit - within;
		if (len > MAX_OP_LEN)
			len = MAX_OP_LEN;

		op = e->free_ops;
		e->free_ops = op->next;
		*op = (struct zs_op){
			.req = q,
			.buf = q->buf + q->issued,
			.offset = x->offset[path] + unit_index / x->nslots * e->unit + within,
			.len = (uint32_t)len,
			.path = (uint16_t)path,
			.write = q->write,
		};
		op->buf_index = find_buffer(e, op->buf, len);
		q->issued += len;
		q->outstanding++;
		if (q->issued == q->len)
			queue_pop(e);
		e->in_flight++;
		e->files[path].in_flight++;
		if (e->in_flight > e->in_flight_peak)
			e->in_flight_peak = e->in_flight;
		op_issue(e, op);
	}
}

static void
count_error(struct zs_file *f, int res)
{
	if (res == -EIO)
		f->errors_eio++;
	else if (res == -ENOSPC)
		f->errors_enospc++;
	else
		f->errors_other++;
}

/*
 * A path whose I/O fails takes no new extents: what it holds is read and
 * written as before (and fails as before), but nothing new lands there.
 * Cancellation, shutdown and lack of memory say nothing about the path.
 */
static void
mark_bad(struct zs_file *f, int res)
{
	if (f->bad == 0 && res != -ECANCELED && res != -ESHUTDOWN && res != -ENOMEM &&
	    res != -EAGAIN && res != -EINTR)
		f->bad = res;
}

static void
op_finish(struct zs_swap *e, struct zs_op *op, int res)
{
	struct zs_req *q = op->req;

	if (res < 0) {
		count_error(&e->files[op->path], res);
		mark_bad(&e->files[op->path], res);
		if (q->error == 0)
			q->error = res;
	}
	e->in_flight--;
	e->files[op->path].in_flight--;
	op->req = NULL;
	op->next = e->free_ops;
	e->free_ops = op;
	q->outstanding--;
	/* Only the head can still have ranges left to issue. */
	if (q->error != 0 && q == e->queue_head) {
		queue_pop(e);
		q->len = q->issued;
	}
	if (q->outstanding == 0 && q->issued == q->len && q != e->queue_head)
		done_push(e, q);
}

void
zs_op_complete(struct zs_swap *e, struct zs_op *op, int res)
{
	struct zs_file *f = &e->files[op->path];
	uint32_t left = op->len - op->done, moved;

	if (e->inject != NULL && e->inject->complete != NULL) {
		struct zs_inject_op io = inject_op(op);

		res = e->inject->complete(e->inject->arg, &io, res);
	}
	op->attempt++;
	if (res == -EAGAIN || res == -EINTR) {
		if (++op->retries > MAX_RETRIES) {
			op_finish(e, op, res);
			return;
		}
		e->retries++;
		op_issue(e, op);
		return;
	}
	if (res < 0) {
		op_finish(e, op, res);
		return;
	}
	moved = (uint32_t)res > left ? left : (uint32_t)res;
	/*
	 * O_DIRECT resubmission must start aligned; redo the unaligned tail of
	 * a short transfer (rewriting or rereading the same bytes is harmless).
	 */
	if (moved < left)
		moved -= moved % e->offset_align;
	if (op->write)
		f->bytes_written += moved;
	else
		f->bytes_read += moved;
	op->done += moved;
	if (op->done == op->len) {
		op_finish(e, op, 0);
		return;
	}
	if (moved == 0 && ++op->stalls > MAX_STALLS) {
		op_finish(e, op, -ZS_E_STALLED);
		return;
	}
	if (moved != 0)
		op->stalls = 0;
	e->short_ios++;
	op_issue(e, op);
}

static int
submit(struct zs_swap *e, const struct zs_extent *x, uint64_t offset, void *buf,
    size_t len, bool write, zs_callback *cb, void *arg)
{
	struct zs_req *q;

	if (e->closing)
		return -ESHUTDOWN;
	if (x == NULL || cb == NULL || buf == NULL || len == 0)
		return -EINVAL;
	if (x->npaths != e->npaths || x->size == 0 || x->nslots == 0 || x->nslots > e->npaths ||
	    x->first_slot >= x->nslots)
		return -EINVAL;
	for (unsigned i = 0; i < x->nslots; i++)
		if (x->paths[i] >= e->npaths)
			return -EINVAL;
	if (offset > x->size || len > x->size - offset)
		return -ERANGE;
	if (offset % e->offset_align || len % e->offset_align ||
	    (uintptr_t)buf % e->mem_align)
		return -EINVAL;

	q = e->free_reqs;
	if (q != NULL)
		e->free_reqs = q->next;
	else if ((q = malloc(sizeof(*q))) == NULL)
		return -ENOMEM;
	*q = (struct zs_req){
		.cb = cb,
		.arg = arg,
		.buf = buf,
		.offset = offset,
		.len = len,
		.write = write,
		.extent = *x,
	};
	if (e->queue_tail != NULL)
		e->queue_tail->next = q;
	else
		e->queue_head = q;
	e->queue_tail = q;
	e->requests_queued++;
	pump(e);
	/*
	 * Inside process the flush comes once, after all callbacks.  The request
	 * is accepted now whatever the flush says: a refused flush is retried
	 * by the next process, which the wake-up brings.
	 */
	if (!e->in_process && e->backend->submit(e) < 0)
		zs_swap_wake(e);
	return 0;
}

int
zs_read(struct zs_swap *e, const struct zs_extent *x, uint64_t offset, void *buf,
    size_t len, zs_callback *cb, void *arg)
{
	return submit(e, x, offset, buf, len, false, cb, arg);
}

int
zs_write(struct zs_swap *e, const struct zs_extent *x, uint64_t offset, const void *buf,
    size_t len, zs_callback *cb, void *arg)
{
	/* The buffer is only read from; the cast keeps one request type. */
	return submit(e, x, offset, (void *)(uintptr_t)buf, len, true, cb, arg);
}

static int
run_one_callback(struct zs_swap *e)
{
	struct zs_req *q = e->done_head;
	zs_callback *cb;
	void *arg;
	int error;

	if (q == NULL)
		return 0;
	e->done_head = q->next;
	if (e->done_head == NULL)
		e->done_tail = NULL;
	cb = q->cb;
	arg = q->arg;
	error = q->error;
	/* Free first: the callback may submit again and reuse it. */
	q->next = e->free_reqs;
	e->free_reqs = q;
	e->requests_queued--;
	e->requests_done++;
	cb(error, arg);
	return 1;
}

static void
run_callbacks(struct zs_swap *e)
{
	while (run_one_callback(e))
		;
}

int
zs_swap_process(struct zs_swap *e)
{
	eventfd_t v;
	struct zs_op *op;
	int r, n = 0;

	/* Clear before reaping: a completion after this read wakes the next poll. */
	(void)eventfd_read(e->efd, &v);
	e->in_process = true;
	r = e->backend->reap(e);
	while ((op = e->injected) != NULL) {
		e->injected = op->next;
		zs_op_complete(e, op, op->res);
	}
	pump(e);
	while (run_one_callback(e))
		n++;
	e->in_process = false;
	if (r >= 0)
		r = e->backend->submit(e);
	if (r == -EBUSY || r == -EAGAIN || r == -EINTR) {
		/* The kernel kept some staged ops; come back for them. */
		zs_swap_wake(e);
		r = 0;
	}
	return r < 0 ? r : n;
}

int
zs_swap_wait(struct zs_swap *e, int timeout_ms)
{
	struct pollfd pfd = { .fd = e->efd, .events = POLLIN };
	int r;

	r = poll(&pfd, 1, timeout_ms);
	if (r < 0 && errno != EINTR)
		return -errno;
	return zs_swap_process(e);
}

int
zs_swap_path_stats(const struct zs_swap *e, unsigned path, struct zs_path_stats *ret)
{
	const struct zs_file *f;

	if (path >= e->npaths)
		return -EINVAL;
	f = &e->files[path];
	*ret = (struct zs_path_stats){
		.engine = e->backend->name,
		.capacity = f->space.capacity,
		.used_bytes = f->space.used,
		.bytes_read = f->bytes_read,
		.bytes_written = f->bytes_written,
		.in_flight = f->in_flight,
		.errors_eio = f->errors_eio,
		.errors_enospc = f->errors_enospc,
		.errors_other = f->errors_other,
		.dio_offset_align = f->dio_offset_align,
		.dio_mem_align = f->dio_mem_align,
		.bad = f->bad,
	};
	return 0;
}

unsigned
zs_swap_check_paths(struct zs_swap *e)
{
	unsigned bad = 0;

	for (unsigned i = 0; i < e->npaths; i++) {
		struct zs_file *f = &e->files[i];
		struct stat st;

		if (f->bad == 0 && f->regular && fstat(f->fd, &st) == 0 &&
		    (uint64_t)st.st_size < f->space.capacity)
			f->bad = -ZS_E_TRUNCATED;
		bad += f->bad != 0;
	}
	return bad;
}

void
zs_swap_stats(const struct zs_swap *e, struct zs_swap_stats *ret)
{
	*ret = (struct zs_swap_stats){
		.engine = e->backend->name,
		.uring_error = e->uring_error,
		.npaths = e->npaths,
		.queue_depth = e->qd,
		.stripe_unit = e->unit,
		.in_flight = e->in_flight,
		.in_flight_peak = e->in_flight_peak,
		.requests_queued = e->requests_queued,
		.requests_done = e->requests_done,
		.retries = e->retries,
		.short_ios = e->short_ios,
		.buffers_registered = e->buffers_registered,
	};
}

void
zs_swap_path_fds(const struct zs_swap *e, unsigned i, int *ret_fd, int *ret_lock_fd)
{
	*ret_fd = i < e->npaths ? e->files[i].fd : -1;
	*ret_lock_fd = i < e->npaths ? e->files[i].lock_fd : -1;
}
