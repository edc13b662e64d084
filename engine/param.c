/* Param offload: staging a tensor's params into its slot on request, writing them back on release. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>

#include "engine_impl.h"
#include "swap.h"

/* One PARAM_RELEASE-style request, answered when its last write-back lands. */
struct param_release {
	uint32_t lane;
	uint64_t id;
	unsigned outstanding;		/* writes in flight, plus one while they are queued */
	int error;
};

/* One tensor's fetch or write-back on NVMe; the tensor is busy until it ends. */
struct param_io {
	struct ze_engine *e;
	struct ze_tensor *tensor;
	uint32_t lane;
	uint64_t id;
	bool fetch;
	struct param_release *release;	/* the release this write belongs to */
};

/* The slot's pages go back to the kernel; the next fetch refills them. */
void
ze_param_drop_pages(struct ze_tensor *t)
{
	/* Not resident before the pages go: a crash in between must not trust them. */
	ze_param_flags(t, false, t->param_dirty);
	(void)fallocate(t->param_slot.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
	    (off_t)t->param_slot.bytes);
}

static void
release_put(struct ze_engine *e, struct param_release *rel)
{
	uint32_t lane = rel->lane;
	uint64_t id = rel->id;
	int error = rel->error;

	if (--rel->outstanding > 0)
		return;
	free(rel);
	e->xfers--;
	e->cb.io_done(e->cb_arg, lane, id, ZE_IO_PARAM_RELEASE, NULL, error);
}

static void
param_io_done(int result, void *arg)
{
	struct param_io *io = arg;
	struct ze_engine *e = io->e;
	struct ze_tensor *t = io->tensor;
	void *user = t->user;

	if (result < 0)
		e->stats.io_errors++;
	if (io->fetch) {
		if (result == 0) {
			ze_param_flags(t, true, false);
			e->stats.param_bytes_staged += t->param_store_bytes;
		}
		e->xfers--;
		ze_tensor_unbusy(t);
		e->cb.param_ready(e->cb_arg, io->lane, io->id, user, result);
	} else {
		if (result == 0) {
			e->stats.param_bytes_written += t->param_store_bytes;
			ze_param_flags(t, t->param_resident, false);
			ze_param_drop_pages(t);
		} else if (io->release->error == 0) {
			io->release->error = result;
		}
		ze_tensor_unbusy(t);
		release_put(e, io->release);
	}
	free(io);
}

static int
start_io(struct ze_tensor *t, uint32_t lane, uint64_t id, bool fetch, struct param_release *rel)
{
	struct ze_engine *e = t->e;
	struct param_io *io = calloc(1, sizeof(*io));
	int r;

	if (io == NULL)
		return -ENOMEM;
	*io = (struct param_io){ .e = e, .tensor = t, .lane = lane, .id = id, .fetch = fetch,
		.release = rel };
	if (fetch)
		r = zs_read(e->swap, t->extent, t->param_store_offset, t->param_slot.map,
		    t->param_store_bytes, param_io_done, io);
	else
		r = zs_write(e->swap, t->extent, t->param_store_offset, t->param_slot.map,
		    t->param_store_bytes, param_io_done, io);
	if (r < 0) {
		free(io);
		return r;
	}
	t->busy = true;
	return 0;
}

int
ze_param_fetch(struct ze_tensor *t, uint32_t lane, uint64_t id)
{
	struct ze_engine *e = t->e;
	int r;

	if (t->busy)
		return -EBUSY;
	e->stats.param_fetches++;
	if (!t->param_offload || t->param_resident) {
		e->stats.param_hits++;
		return 1;
	}
	e->stats.param_misses++;
	if (!t->on_nvme) {
		memcpy(t->param_slot.map, t->param_store, t->param_store_bytes);
		ze_param_flags(t, true, false);
		e->stats.param_bytes_staged += t->param_store_bytes;
		return 1;
	}
	r = start_io(t, lane, id, true, NULL);
	if (r == 0)
		e->xfers++;
	return r;
}

int
ze_param_release(struct ze_engine *e, struct ze_tensor *const *ts, size_t n, uint32_t lane,
    uint64_t id)
{
	struct param_release *rel;
	int r;

	/* All or nothing: every tensor is free to release before any is touched. */
	for (size_t i = 0; i < n; i++)
		if (ts[i]->busy)
			return -EBUSY;
	rel = calloc(1, sizeof(*rel));
	if (rel == NULL)
		return -ENOMEM;
	rel->lane = lane;
	rel->id = id;
	/* Held until every write is queued, so an immediate failure cannot answer early. */
	rel->outstanding = 1;
	for (size_t i = 0; i < n; i++) {
		struct ze_tensor *t = ts[i];

		if (!t->param_offload || !t->param_resident || t->busy)
			continue;
		e->stats.param_releases++;
		if (!t->param_dirty) {
			ze_param_drop_pages(t);
		} else if (!t->on_nvme) {
			memcpy(t->param_store, t->param_slot.map, t->param_store_bytes);
			e->stats.param_bytes_written += t->param_store_bytes;
			ze_param_flags(t, t->param_resident, false);
			ze_param_drop_pages(t);
		} else {
			r = start_io(t, lane, id, false, rel);
			if (r == 0)
				rel->outstanding++;
			else if (rel->error == 0)
				rel->error = r;
		}
	}
	if (rel->outstanding == 1) {
		r = rel->error;
		free(rel);
		return r < 0 ? r : 1;
	}
	e->xfers++;
	release_put(e, rel);
	return 0;
}
