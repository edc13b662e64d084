/* The NVMe swap engine: async O_DIRECT I/O on extents striped over swap paths. */
#ifndef ZT_SWAP_H
#define ZT_SWAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/*
 * Everything here is driven by one thread (the daemon's loop): submission,
 * zs_swap_process() and the callbacks it runs.  Functions return 0 or a
 * negative code: -errno, or one of the -ZS_E_* codes below.
 */

#define ZS_MAX_PATHS 8
/* Buffers that can be registered with the ring at once. */
#define ZS_MAX_BUFFERS 64

/*
 * Codes beyond errno, returned negated; zs_strerror() names both kinds and
 * zs_errno() gives the nearest errno, for peers that know only errno.
 */
#define ZS_ERROR_LIST(X) \
	X(ZS_E_NOURING, 4096, ENOSYS, "io_uring is unavailable and the configuration does not allow the pthread fallback") \
	X(ZS_E_NODIRECT, 4097, EINVAL, "the swap path's filesystem does not support O_DIRECT") \
	X(ZS_E_STALLED, 4098, EIO, "the kernel kept returning no progress for an I/O") \
	X(ZS_E_TRUNCATED, 4099, EIO, "the swap file was truncated under the engine")

enum zs_error {
#define ZS_ERROR_ENUM(name, value, errno_, text) name = value,
	ZS_ERROR_LIST(ZS_ERROR_ENUM)
#undef ZS_ERROR_ENUM
};

/* Never NULL; for 0, -errno and -ZS_E_*. */
const char *zs_strerror(int code);
/* -errno for a -ZS_E_* code; any other code as it is. */
int zs_errno(int code);

enum zs_swap_kind {
	ZS_SWAP_AUTO,		/* io_uring; pthread only when allow_fallback */
	ZS_SWAP_URING,
	ZS_SWAP_PTHREAD,
};

struct zs_path {
	/*
	 * A directory: an unnamed O_TMPFILE is created there and vanishes with
	 * the engine.  Anything else: that file (created if missing, kept on
	 * close) or block device.
	 */
	const char *path;
	uint64_t capacity;	/* bytes; 0: the config's default (a block device: all of it) */
	/*
	 * Descriptors kept from an earlier process (> 2; 0: none): the swap file
	 * (and a directory's lock) as it left them, taken over as they are:
	 * neither created, preallocated nor locked again (its lock is theirs).
	 */
	int kept_fd;
	int kept_lock_fd;
};

/*
 * Fault injection below the engine, for tests: consulted for every operation
 * the engine hands to the kernel (or to a worker thread), retries included.
 */
struct zs_inject_op {
	unsigned path;
	bool write;
	uint64_t offset;	/* in the swap file */
	uint32_t len;
	void *buf;		/* where the range's bytes come from or go */
	unsigned attempt;	/* 0 for the first try of this operation */
};

struct zs_inject {
	/* 0: submit; negative: complete with this result without doing the I/O. */
	int (*prepare)(void *arg, const struct zs_inject_op *op);
	/* The result the engine sees instead of res (bytes or -errno). */
	int (*complete)(void *arg, const struct zs_inject_op *op, int res);
	void *arg;
};

struct zs_config {
	const struct zs_path *paths;
	unsigned npaths;		/* 1 .. ZS_MAX_PATHS */
	uint64_t capacity;		/* default per path */
	uint32_t stripe_unit;		/* 0: 1 MiB; a multiple of the allocation granularity */
	unsigned queue_depth;		/* operations in flight at most; 0: 32 */
	unsigned threads;		/* pthread engine workers; 0: queue_depth */
	enum zs_swap_kind engine;
	bool allow_fallback;		/* AUTO may fall back to pthread */
	/* Behave as if io_uring_queue_init() failed (also: env ZOFFLOAD_SWAP_NO_URING=1). */
	bool force_no_uring;
	const struct zs_inject *inject;	/* NULL in production */
};

/* Why zs_swap_new() failed, for the daemon's message. */
struct zs_error_info {
	int path;		/* index into config->paths, -1: not about one path */
	const char *step;	/* "open", "fallocate", "io_uring_queue_init", ... */
	int cause;		/* -errno of that step */
	int holder_pid;		/* step "lock": the process holding the path (0: not found) */
};

struct zs_swap;

/*
 * Opens and preallocates every path (so a full disk shows here, not during
 * training) and starts the engine.  info, when not NULL, is filled on failure.
 */
int zs_swap_new(const struct zs_config *config, struct zs_swap **ret,
    struct zs_error_info *info);
/*
 * Completes requests not yet started with -ECANCELED, waits for those in
 * flight, runs their callbacks (where new requests get -ESHUTDOWN), then
 * frees.  NULL is fine.
 */
void zs_swap_free(struct zs_swap *engine);

/* Readable when zs_swap_process() has work; level-triggered. */
int zs_swap_fd(const struct zs_swap *engine);
/* Reaps completions, runs their callbacks here; number of callbacks run or -errno. */
int zs_swap_process(struct zs_swap *engine);
/* Polls the fd up to timeout_ms (-1: forever), then processes.  For tools and tests. */
int zs_swap_wait(struct zs_swap *engine, int timeout_ms);

/*
 * Registers memory (from the pinned arena) with the kernel so I/O into it
 * skips the per-request page pinning.  I/O into unregistered memory works
 * too, only slower.  -ENOSPC when ZS_MAX_BUFFERS are registered.
 */
int zs_swap_register_buffer(struct zs_swap *engine, void *ptr, size_t len);
int zs_swap_unregister_buffer(struct zs_swap *engine, void *ptr);

/* Offsets, lengths and buffer addresses of I/O must be multiples of these. */
uint32_t zs_swap_offset_align(const struct zs_swap *engine);
uint32_t zs_swap_mem_align(const struct zs_swap *engine);
/* "io_uring" or "pthread". */
const char *zs_swap_name(const struct zs_swap *engine);

/* Space on the swap paths; striped over all of them in stripe units. */
/*
 * Striped over the paths that were good when it was made: stripe unit k is
 * on path paths[(first_slot + k) % nslots].  With every path good, paths is
 * 0, 1, ... and first_slot == first_path.
 */
struct zs_extent {
	uint64_t size;			/* rounded up to the allocation granularity */
	uint32_t first_path;		/* holds the extent's first stripe unit */
	uint32_t npaths;		/* the engine's */
	uint64_t offset[ZS_MAX_PATHS];	/* of this extent's run in each path's file (by path) */
	uint32_t nslots;		/* paths it is striped over */
	uint32_t first_slot;
	uint8_t paths[ZS_MAX_PATHS];
};

int zs_extent_alloc(struct zs_swap *engine, uint64_t size, struct zs_extent *ret);
/*
 * Takes an extent an earlier engine on the same files handed out (kept in
 * a record) back out of the free space: -EINVAL when it does not fit this
 * engine's paths, -EEXIST when part of it is taken already.
 */
int zs_extent_reserve(struct zs_swap *engine, const struct zs_extent *extent);
/* Path i's swap file descriptor and its lock's (-1: none), for keeping them. */
void zs_swap_path_fds(const struct zs_swap *engine, unsigned i, int *ret_fd,
    int *ret_lock_fd);
/* No I/O on it may be in flight. */
void zs_extent_free(struct zs_swap *engine, const struct zs_extent *extent);

/* result: 0 when all of len was transferred, else -errno / -ZS_E_*. */
typedef void zs_callback(int result, void *arg);

/*
 * Queue I/O of [offset, offset + len) of the extent.  0: cb runs exactly once,
 * from a later zs_swap_process(); negative: rejected, cb never runs.  The
 * extent may be reused once this returns; buf must stay until cb.
 */
int zs_read(struct zs_swap *engine, const struct zs_extent *extent,
    uint64_t offset, void *buf, size_t len, zs_callback *cb, void *arg);
int zs_write(struct zs_swap *engine, const struct zs_extent *extent,
    uint64_t offset, const void *buf, size_t len, zs_callback *cb, void *arg);

struct zs_path_stats {
	const char *engine;
	uint64_t capacity;
	uint64_t used_bytes;
	uint64_t bytes_read;
	uint64_t bytes_written;
	uint32_t in_flight;		/* operations */
	uint64_t errors_eio;
	uint64_t errors_enospc;
	uint64_t errors_other;
	uint32_t dio_offset_align;
	uint32_t dio_mem_align;
	int bad;			/* 0, or why no new extent goes there (-errno / -ZS_E_*) */
};

struct zs_swap_stats {
	const char *engine;
	int uring_error;		/* why io_uring is not used (-errno), 0 if it is */
	unsigned npaths;
	unsigned queue_depth;
	uint32_t stripe_unit;
	uint32_t in_flight;		/* operations, never above queue_depth */
	uint32_t in_flight_peak;
	uint64_t requests_queued;	/* accepted, callback not yet run */
	uint64_t requests_done;
	uint64_t retries;		/* -EAGAIN / -EINTR resubmitted */
	uint64_t short_ios;		/* partial transfers resubmitted for the rest */
	uint64_t buffers_registered;
};

int zs_swap_path_stats(const struct zs_swap *engine, unsigned path,
    struct zs_path_stats *ret);
void zs_swap_stats(const struct zs_swap *engine, struct zs_swap_stats *ret);
/*
 * Looks for paths gone bad under the engine (a swap file truncated below
 * its capacity); such a path, like one whose I/O failed, takes no new
 * extent.  Returns how many paths are bad.
 */
unsigned zs_swap_check_paths(struct zs_swap *engine);

#endif
