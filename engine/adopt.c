/* Adoption at start-up: a tensor an earlier process kept, rebuilt from its record, state and the step journal. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine_impl.h"
#include "pool.h"
#include "recover.h"
#include "stepper.h"
#include "swap.h"

/* Every unit at a step it reached whole; then the tensor's steps from the stamps. */
static void
settle_steps(struct ze_engine *e, struct ze_tensor *t, bool journal_kept,
    struct ze_adopt_report *rep)
{
	uint64_t lo = UINT64_MAX, hi = 0, torn = 0;
	int r = journal_kept ? ze_journal_finish(e, t) : 0;

	if (r > 0) {
		rep->finished++;
	} else if (r < 0) {
		torn = ze_journal_slice_step(e);
		rep->finish_error = r;
	}
	for (uint64_t u = 0; u < t->nunits; u++) {
		/*
		 * Handed to compute and not stamped: with the journal kept, the one
		 * slice it caught was finished above and a chunk's disk copy is
		 * written only from a buffer it names, so the rest were not touched.
		 */
		if (t->unit_pend[u] > t->unit_step[u] && !journal_kept)
			torn = t->unit_pend[u] > torn ? t->unit_pend[u] : torn;
		t->unit_pend[u] = t->unit_step[u];
		lo = t->unit_step[u] < lo ? t->unit_step[u] : lo;
		hi = t->unit_step[u] > hi ? t->unit_step[u] : hi;
	}
	if (hi > lo + 1)
		torn = hi;
	/*
	 * The finish made the step whole: every unit's step wrote its params
	 * into the slot, as the step's end would have said (tensor_done).
	 */
	if (r > 0 && lo == hi && torn == 0)
		ze_param_flags(t, true, true);
	t->last_step = lo;
	t->partial_step = hi > lo ? hi : 0;
	t->torn_step = torn;
	rep->last_step = lo;
	rep->partial_step = t->partial_step;
	rep->torn_step = torn;
}

static uint64_t
count_init_missing(const struct ze_tensor *t)
{
	uint64_t set = 0;

	if (t->init_bits == NULL)
		return 0;
	for (uint64_t w = 0; w < (t->numel + 63) / 64; w++)
		set += (uint64_t)__builtin_popcountll(t->init_bits[w]);
	return t->numel - set;
}

/* A kept slot or state memfd of `bytes` (as made: whole pages), or -errno. */
static int
kept_bytes(int fd, uint64_t bytes)
{
	struct stat st;

	if (fd < 0)
		return -ENOENT;
	if (fstat(fd, &st) != 0)
		return -errno;
	return (uint64_t)st.st_size == bytes ? 0 : -EBADFD;
}

static uint64_t
page_round(uint64_t bytes)
{
	return (bytes + 4095) / 4096 * 4096;
}

/* Taken until ze_adopt_checks_done: the swap files' free space, in memory only. */
static int
hold_extent(struct ze_engine *e, const struct zs_extent *x)
{
	struct zs_extent *more = realloc(e->checked, (e->nchecked + 1) * sizeof(*more));
	int r;

	if (more == NULL)
		return -ENOMEM;
	e->checked = more;
	r = zs_extent_reserve(e->swap, x);
	if (r == 0)
		e->checked[e->nchecked++] = *x;
	return r;
}

void
ze_adopt_checks_done(struct ze_engine *e)
{
	for (size_t i = 0; i < e->nchecked; i++)
		zs_extent_free(e->swap, &e->checked[i]);
	free(e->checked);
	e->checked = NULL;
	e->nchecked = 0;
}

/* What of t's kept parts ze_tensor_adopt would refuse: 0, or -errno with *what. */
static int
check_parts(struct ze_engine *e, struct ze_tensor *t, const struct ze_tensor_fds *fds,
    const char **what)
{
	int r;

	if (t->on_nvme) {
		*what = "its extent on the swap paths";
		if (e->swap == NULL)
			return -ENODEV;
		r = hold_extent(e, ze_record_extent(t));
		if (r == -EEXIST)
			*what = "its extent on the swap paths, which another kept tensor's overlaps";
		if (r < 0)
			return r;
	} else {
		*what = "its state";
		if (fds->state < 0 || t->state_bytes != ze_tensor_pinned_bytes(t))
			return -ENOENT;
		r = kept_bytes(fds->state, zt_arena_fd_bytes(e->arena, t->state_bytes));
		if (r < 0)
			return r;
	}
	*what = "its grad slot";
	r = kept_bytes(fds->grad, page_round(t->numel * zk_dtype_size(t->grad_dtype)));
	if (r < 0)
		return r;
	*what = "its param slot";
	return kept_bytes(fds->param, page_round(t->numel * zk_dtype_size(t->param_dtype)));
}

int
ze_tensor_adopt_check(struct ze_engine *e, const struct ze_tensor_fds *fds, char *err,
    size_t errlen)
{
	struct ze_tensor *t = ze_tensor_alloc(e, NULL);
	const char *what = "";
	int r;

	if (t == NULL) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	/* Mapped and read: nothing in it is written until ze_tensor_adopt. */
	r = ze_record_adopt(t, fds->record, err, errlen);
	if (r == 0) {
		r = check_parts(e, t, fds, &what);
		if (r < 0)
			snprintf(err, errlen, "tensor '%s': cannot take back %s: %s", t->name, what,
			    ze_strerror(r));
	}
	if (t->rec != NULL)
		munmap(t->rec, t->rec_bytes);
	free(t);
	return r;
}

int
ze_tensor_adopt(struct ze_engine *e, const struct ze_tensor_fds *fds, struct ze_account *job,
    struct ze_account *uid, void *user, struct ze_tensor **ret, struct ze_adopt_report *rep,
    char *err, size_t errlen)
{
	bool journal_kept = e->journal != NULL && e->cfg.kept_journal_fd > 2;
	struct ze_tensor *t = ze_tensor_alloc(e, user);
	char what[64];
	int r;

	*rep = (struct ze_adopt_report){ 0 };
	if (t == NULL) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	r = ze_record_adopt(t, fds->record, err, errlen);
	if (r < 0) {
		t->rec_fd = -1;		/* still the caller's */
		goto fail;
	}
	snprintf(what, sizeof(what), "its state");
	if (t->on_nvme) {
		t->extent = calloc(1, sizeof(*t->extent));
		if (t->extent == NULL) {
			r = -ENOMEM;
			goto fail_fds;
		}
		*t->extent = *ze_record_extent(t);
		r = e->swap == NULL ? -ENODEV : zs_extent_reserve(e->swap, t->extent);
		if (r < 0) {
			free(t->extent);
			t->extent = NULL;
			t->on_nvme = false;
			snprintf(what, sizeof(what), "its extent on the swap paths");
			goto fail_fds;
		}
		if (t->param_offload)
			t->param_store_bytes = ze_record_param_store_bytes(t);
	} else {
		if (fds->state < 0 || t->state_bytes != ze_tensor_pinned_bytes(t)) {
			r = -ENOENT;
			goto fail_fds;
		}
		r = zt_arena_alloc_fd(e->arena, t->state_bytes, NULL, fds->state, &t->state,
		    &t->state_pinned, &t->state_fd);
		if (r < 0)
			goto fail_fds;
		ze_tensor_point_state(t);
	}
	snprintf(what, sizeof(what), "its grad slot");
	r = ze_shm_adopt(e, fds->grad, t->numel * zk_dtype_size(t->grad_dtype), false,
	    &t->grad_slot);
	if (r < 0)
		goto fail_fds;
	snprintf(what, sizeof(what), "its param slot");
	r = ze_shm_adopt(e, fds->param, t->numel * zk_dtype_size(t->param_dtype),
	    !t->param_offload, &t->param_slot);
	if (r == -EPERM) {
		/*
		 * Sealed against new writable mappings, not even ours: how an
		 * older daemon kept the params of a tensor without param_offload.
		 * A new slot takes over its contents; the old one goes once the
		 * caller has what it needs of it.
		 */
		r = ze_shm_create_from(e, "zoffload-param", t->numel * zk_dtype_size(t->param_dtype),
		    true, fds->param, &t->param_slot);
		if (r == 0) {
			close(fds->param);
			rep->param_replaced = true;
		}
	}
	if (r < 0)
		goto fail_fds;
	/* The kept slot, or its copy: the master the journal's slice is finished in. */
	ze_tensor_point_master(t);
	ze_tensor_charge(t, job, uid, !t->on_nvme, t->state_bytes);
	t->init_missing = count_init_missing(t);
	if (t->on_nvme) {
		snprintf(what, sizeof(what), "a computed chunk kept in a staging buffer");
		r = journal_kept ? ze_journal_rewrite_chunks(e, t, rep) : 0;
		if (r < 0) {
			/* Not written: the chunks it names count as torn below. */
			journal_kept = false;
		}
	}
	settle_steps(e, t, journal_kept, rep);
	if (t->id > e->next_tensor_id)
		e->next_tensor_id = t->id;
	*ret = t;
	return 0;
fail_fds:
	snprintf(err, errlen, "tensor '%s': cannot take back %s: %s", t->name, what,
	    ze_strerror(r));
	/* What was mapped goes; the descriptors stay the caller's. */
	t->rec_fd = -1;
	t->state_fd = -1;
	if (t->grad_slot.map != NULL)
		munmap(t->grad_slot.map, t->grad_slot.bytes);
	if (t->param_slot.map != NULL) {
		munmap(t->param_slot.map, t->param_slot.bytes);
		if (t->param_slot.client_read_only)
			close(t->param_slot.ro_fd);
	}
	t->grad_slot = t->param_slot = (struct ze_shm){ .fd = -1 };
	if (t->on_nvme)
		ze_nvme_release(e, t);
	else if (t->state != NULL)
		zt_arena_release(e->arena, t->state, t->state_bytes, t->state_pinned);
fail:
	if (t->rec != NULL)
		munmap(t->rec, t->rec_bytes);
	free(t);
	return r;
}
