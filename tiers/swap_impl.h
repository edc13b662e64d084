/* Swap engine internals shared by the core, the extent allocator and the backends. */
#ifndef ZT_SWAP_IMPL_H
#define ZT_SWAP_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "swap.h"

#define ZS_NO_BUFFER UINT16_MAX

/* One path's free space, in sorted, coalesced ranges. */
struct zs_range {
	uint64_t off;
	uint64_t len;
};

struct zs_space {
	struct zs_range *free;
	unsigned nfree;
	unsigned cap;
	uint64_t capacity;
	uint64_t used;
};

struct zs_file {
	int fd;
	int lock_fd;			/* a directory path's: holds its flock; -1 for a file */
	bool regular;			/* a regular file, whose size can be checked */
	int bad;			/* 0, or why it takes no new extents */
	uint32_t dio_offset_align;
	uint32_t dio_mem_align;
	struct zs_space space;
	uint32_t in_flight;
	uint64_t bytes_read;
	uint64_t bytes_written;
	uint64_t errors_eio;
	uint64_t errors_enospc;
	uint64_t errors_other;
};

struct zs_req;

/* One contiguous transfer on one path; at most queue_depth exist. */
struct zs_op {
	struct zs_req *req;
	struct zs_op *next;		/* free list, or a backend's queues */
	char *buf;
	uint64_t offset;		/* in the file */
	uint32_t len;
	uint32_t done;
	uint16_t path;
	uint16_t buf_index;		/* registered buffer or ZS_NO_BUFFER */
	bool write;
	unsigned attempt;
	unsigned retries;
	unsigned stalls;
	int res;			/* pthread backend: result handed back by a worker */
};

struct zs_buffer {
	char *ptr;
	size_t len;
};

struct zs_backend {
	const char *name;
	int (*init)(struct zs_swap *e);
	/* Only with no operation in flight. */
	void (*fini)(struct zs_swap *e);
	/* Optional; the backend may ignore registered buffers. */
	int (*register_buffer)(struct zs_swap *e, unsigned index);
	int (*unregister_buffer)(struct zs_swap *e, unsigned index);
	/* Stage one operation (its remaining range); cannot fail: slots bound the queue. */
	void (*queue)(struct zs_swap *e, struct zs_op *op);
	/* Hand staged operations to the kernel or the workers. */
	int (*submit)(struct zs_swap *e);
	/* zs_op_complete() for every finished operation; never runs callbacks. */
	int (*reap)(struct zs_swap *e);
};

extern const struct zs_backend zs_backend_uring;
extern const struct zs_backend zs_backend_pthread;

struct zs_swap {
	const struct zs_backend *backend;
	void *bstate;
	int efd;
	int uring_error;

	struct zs_file files[ZS_MAX_PATHS];
	unsigned npaths;
	uint32_t unit;
	uint32_t offset_align;
	uint32_t mem_align;
	uint32_t granule;		/* allocation granularity */
	unsigned qd;
	unsigned threads;
	unsigned rr;			/* tie-break for where extents start */

	struct zs_op *ops;
	struct zs_op *free_ops;
	uint32_t in_flight;
	uint32_t in_flight_peak;

	struct zs_req *queue_head;	/* requests with ranges not yet issued */
	struct zs_req *queue_tail;
	struct zs_req *done_head;	/* finished, callback not yet run */
	struct zs_req *done_tail;
	struct zs_req *free_reqs;
	struct zs_op *injected;		/* failed by inject->prepare, completed in process */

	struct zs_buffer buffers[ZS_MAX_BUFFERS];
	uint64_t buffers_registered;

	const struct zs_inject *inject;
	uint64_t requests_queued;
	uint64_t requests_done;
	uint64_t retries;
	uint64_t short_ios;
	bool in_process;
	bool closing;			/* in zs_swap_free: no new requests */
};

/* Called by backends from reap(). */
void zs_op_complete(struct zs_swap *e, struct zs_op *op, int res);
/* Make the next poll of the fd return at once. */
void zs_swap_wake(struct zs_swap *e);

/* swap_file.c */
int zs_file_open(const struct zs_path *path, uint64_t capacity, struct zs_file *f,
    struct zs_error_info *info);
void zs_file_close(struct zs_file *f);

/* swap_extent.c */
int zs_space_init(struct zs_space *s, uint64_t capacity);
void zs_space_fini(struct zs_space *s);
int zs_space_alloc(struct zs_space *s, uint64_t len, uint64_t *ret);
void zs_space_release(struct zs_space *s, uint64_t off, uint64_t len);

#endif
