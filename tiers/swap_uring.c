/* Swap backend on io_uring: registered files and buffers, completions via eventfd. */
#include <errno.h>
#include <liburing.h>
#include <stdlib.h>

#include "swap_impl.h"

struct uring_state {
	struct io_uring ring;
	bool fixed_buffers;
	bool registered[ZS_MAX_BUFFERS];
};

static int
uring_init(struct zs_swap *e)
{
	struct uring_state *u;
	int fds[ZS_MAX_PATHS];
	unsigned i;
	int r;

	u = calloc(1, sizeof(*u));
	if (u == NULL)
		return -ENOMEM;
	/*
	 * SQ entries = queue depth and the default CQ twice that: the core never
	 * has more than queue_depth operations out, so neither ring can overflow.
	 * SUBMIT_ALL keeps one bad SQE from holding back the rest of a batch.
	 */
	r = io_uring_queue_init(e->qd, &u->ring, IORING_SETUP_SUBMIT_ALL);
	if (r == -EINVAL)
		r = io_uring_queue_init(e->qd, &u->ring, 0);
	if (r < 0)
		goto err_free;

	for (i = 0; i < e->npaths; i++)
		fds[i] = e->files[i].fd;
	r = io_uring_register_files(&u->ring, fds, e->npaths);
	if (r < 0)
		goto err_ring;
	r = io_uring_register_eventfd(&u->ring, e->efd);
	if (r < 0)
		goto err_ring;
	/* Slots filled one by one as the arena's buffers are registered. */
	u->fixed_buffers = io_uring_register_buffers_sparse(&u->ring, ZS_MAX_BUFFERS) == 0;
	e->bstate = u;
	return 0;

err_ring:
	io_uring_queue_exit(&u->ring);
err_free:
	free(u);
	return r;
}

static void
uring_fini(struct zs_swap *e)
{
	struct uring_state *u = e->bstate;

	if (u == NULL)
		return;
	io_uring_queue_exit(&u->ring);
	free(u);
	e->bstate = NULL;
}

static int
uring_register_buffer(struct zs_swap *e, unsigned index)
{
	struct uring_state *u = e->bstate;
	struct iovec iov = { e->buffers[index].ptr, e->buffers[index].len };
	__u64 tag = 0;
	int r;

	if (!u->fixed_buffers)
		return 0;
	r = io_uring_register_buffers_update_tag(&u->ring, index, &iov, &tag, 1);
	if (r < 0)
		return r;
	u->registered[index] = true;
	return 0;
}

static int
uring_unregister_buffer(struct zs_swap *e, unsigned index)
{
	struct uring_state *u = e->bstate;
	struct iovec iov = { NULL, 0 };
	__u64 tag = 0;
	int r;

	if (!u->registered[index])
		return 0;
	u->registered[index] = false;
	r = io_uring_register_buffers_update_tag(&u->ring, index, &iov, &tag, 1);
	return r < 0 ? r : 0;
}

static void
uring_queue(struct zs_swap *e, struct zs_op *op)
{
	struct uring_state *u = e->bstate;
	struct io_uring_sqe *sqe;
	char *buf = op->buf + op->done;
	unsigned len = op->len - op->done;
	uint64_t off = op->offset + op->done;
	bool fixed = op->buf_index != ZS_NO_BUFFER && u->registered[op->buf_index];

	/* One SQE per operation at most and SQ entries >= queue depth: never NULL. */
	sqe = io_uring_get_sqe(&u->ring);
	if (sqe == NULL) {
		(void)io_uring_submit(&u->ring);
		sqe = io_uring_get_sqe(&u->ring);
	}
	if (op->write && fixed)
		io_uring_prep_write_fixed(sqe, op->path, buf, len, off, op->buf_index);
	else if (op->write)
		io_uring_prep_write(sqe, op->path, buf, len, off);
	else if (fixed)
		io_uring_prep_read_fixed(sqe, op->path, buf, len, off, op->buf_index);
	else
		io_uring_prep_read(sqe, op->path, buf, len, off);
	sqe->flags |= IOSQE_FIXED_FILE;
	io_uring_sqe_set_data(sqe, op);
}

static int
uring_submit(struct zs_swap *e)
{
	struct uring_state *u = e->bstate;
	int r;

	if (io_uring_sq_ready(&u->ring) == 0)
		return 0;
	r = io_uring_submit(&u->ring);
	return r < 0 ? r : 0;
}

static int
uring_reap(struct zs_swap *e)
{
	struct uring_state *u = e->bstate;
	struct io_uring_cqe *cqe;
	unsigned head, n = 0;

	io_uring_for_each_cqe(&u->ring, head, cqe) {
		zs_op_complete(e, io_uring_cqe_get_data(cqe), cqe->res);
		n++;
	}
	io_uring_cq_advance(&u->ring, n);
	return 0;
}

const struct zs_backend zs_backend_uring = {
	.name = "io_uring",
	.init = uring_init,
	.fini = uring_fini,
	.register_buffer = uring_register_buffer,
	.unregister_buffer = uring_unregister_buffer,
	.queue = uring_queue,
	.submit = uring_submit,
	.reap = uring_reap,
};
