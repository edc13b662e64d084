/* State that outlives the process: each tensor's record, the step journal, and rebuilding from them. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"
#include "engine_impl.h"
#include "pool.h"
#include "recover.h"
#include "stepper.h"
#include "swap.h"

#define PAGE 4096u
#define ROUND(x) (((x) + PAGE - 1) / PAGE * PAGE)

/*
 * A tensor's record: one memfd, a header page and then its arrays.  The
 * header's first part is fixed once the tensor is placed and named (under
 * crc); param_resident and param_dirty follow as they change, and the
 * arrays are the engine's own (stamps, bits), so keeping them costs nothing.
 */
struct ze_record {
	uint64_t magic;
	uint32_t version;
	uint32_t crc;			/* crc32c of [id, fixed_end) */
	uint64_t id;
	uint64_t owner[ZE_OWNER_WORDS];
	char name[ZE_NAME_MAX + 1];
	uint64_t numel;
	uint32_t grad_dtype;
	uint32_t param_dtype;
	uint32_t param_offload;
	uint32_t on_nvme;
	uint32_t format;		/* enum zk_state_format: the arrays' and chunks' layout */
	uint32_t master_in_slot;	/* version 2: the param slot is the master (0 in version 1) */
	uint64_t chunk_elements;
	uint64_t unit_elements;
	uint64_t nunits;
	uint64_t state_bytes;
	uint64_t param_store_offset;
	uint64_t param_store_bytes;
	uint64_t charge_pinned;
	uint64_t charge_swap;
	struct zs_extent extent;
	uint64_t off_step, off_pend, off_written, off_init;	/* of the arrays in the file */
	char fixed_end[];
	/* then, written through: */
};

struct ze_record_dyn {
	uint32_t param_resident;
	uint32_t param_dirty;
	uint32_t initialized;
};

#define DYN(rec) ((struct ze_record_dyn *)((char *)(rec) + 2048))
_Static_assert(sizeof(struct ze_record) <= 2048, "the record's fixed part overlaps its flags");

/*
 * Every field a tensor is rebuilt from, one line each, both ways: save
 * fills the record from the tensor, !save the tensor from the record.
 * A new field of struct ze_tensor that must survive a restart is one line
 * here (and its place in struct ze_record).
 */
static void
tensor_record(struct ze_tensor *t, struct ze_record *r, bool save)
{
#define F(field, member) do { \
		if (save) \
			r->field = (__typeof__(r->field))(member); \
		else \
			(member) = (__typeof__(member))r->field; \
	} while (0)
	F(id, t->id);
	F(numel, t->numel);
	F(grad_dtype, t->grad_dtype);
	F(param_dtype, t->param_dtype);
	F(param_offload, t->param_offload);
	F(on_nvme, t->on_nvme);
	F(format, t->format);
	F(master_in_slot, t->master_in_slot);
	F(chunk_elements, t->chunk_elements);
	F(unit_elements, t->unit_elements);
	F(nunits, t->nunits);
	F(state_bytes, t->state_bytes);
	F(param_store_offset, t->param_store_offset);
	F(param_store_bytes, t->param_store_bytes);
	F(charge_pinned, t->charge.pinned_bytes);
	F(charge_swap, t->charge.swap_bytes);
#undef F
	if (save) {
		snprintf(r->name, sizeof(r->name), "%s", t->name);
		if (t->extent != NULL)
			r->extent = *t->extent;
	} else {
		snprintf(t->name, sizeof(t->name), "%s", r->name);
	}
}

static uint32_t
record_crc(const struct ze_record *r)
{
	return zu_crc32c(0, &r->id, (size_t)(offsetof(struct ze_record, fixed_end) -
	    offsetof(struct ze_record, id)));
}

static void
record_seal(struct ze_tensor *t)
{
	t->rec->crc = record_crc(t->rec);
}

/* Where the arrays go: after the header page, each 8-byte aligned. */
static size_t
record_layout(const struct ze_tensor *t, struct ze_record *r)
{
	uint64_t nchunks = t->on_nvme ? t->nunits : 0;
	size_t off = PAGE;

	r->off_step = off;
	off += t->nunits * sizeof(uint64_t);
	r->off_pend = off;
	off += t->nunits * sizeof(uint64_t);
	r->off_written = off;
	off += (nchunks + 63) / 64 * 8;
	r->off_init = off;
	off += (t->numel + 63) / 64 * sizeof(uint64_t);
	return ROUND(off);
}

static void
record_point(struct ze_tensor *t)
{
	char *base = (char *)t->rec;

	t->unit_step = (uint64_t *)(base + t->rec->off_step);
	t->unit_pend = (uint64_t *)(base + t->rec->off_pend);
	t->chunks_written = t->on_nvme ? (uint8_t *)(base + t->rec->off_written) : NULL;
	t->init_bits = DYN(t->rec)->initialized ? NULL : (uint64_t *)(base + t->rec->off_init);
}

int
ze_record_create(struct ze_tensor *t)
{
	struct ze_record layout = { 0 };
	size_t bytes = record_layout(t, &layout);
	void *map;
	int fd, r;

	fd = memfd_create("zoffload-record", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)bytes) != 0) {
		r = -errno;
		close(fd);
		return r;
	}
	(void)fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
	map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED) {
		r = -errno;
		close(fd);
		return r;
	}
	t->rec = map;
	t->rec_bytes = bytes;
	t->rec_fd = fd;
	*t->rec = layout;
	t->rec->magic = ZE_RECORD_MAGIC;
	t->rec->version = ZE_RECORD_VERSION;
	tensor_record(t, t->rec, true);
	DYN(t->rec)->param_resident = t->param_resident;
	DYN(t->rec)->param_dirty = t->param_dirty;
	record_point(t);
	record_seal(t);
	return 0;
}

void
ze_record_destroy(struct ze_tensor *t)
{
	if (t->rec != NULL)
		munmap(t->rec, t->rec_bytes);
	if (t->rec_fd >= 0)
		close(t->rec_fd);
	t->rec = NULL;
	t->rec_fd = -1;
	t->unit_step = t->unit_pend = t->init_bits = NULL;
	t->chunks_written = NULL;
}

void
ze_tensor_set_owner(struct ze_tensor *t, const uint64_t owner[ZE_OWNER_WORDS])
{
	memcpy(t->rec->owner, owner, sizeof(t->rec->owner));
	record_seal(t);
}

void
ze_param_flags(struct ze_tensor *t, bool resident, bool dirty)
{
	t->param_resident = resident;
	t->param_dirty = dirty;
	if (t->rec != NULL) {
		DYN(t->rec)->param_resident = resident;
		DYN(t->rec)->param_dirty = dirty;
	}
}

/* Called when the last init bit is set: the bits are not looked at again. */
void
ze_record_initialized(struct ze_tensor *t)
{
	DYN(t->rec)->initialized = 1;
}

uint64_t ze_tensor_id(const struct ze_tensor *t) { return t->id; }

void
ze_tensor_fds(const struct ze_tensor *t, struct ze_tensor_fds *ret)
{
	*ret = (struct ze_tensor_fds){ .record = t->rec_fd, .state = t->state_fd,
		.grad = t->grad_slot.fd, .param = t->param_slot.fd };
}

int
ze_record_peek(int fd, struct ze_record_info *ret, char *err, size_t errlen)
{
	struct ze_record r;
	int fl = fcntl(fd, F_GETFL);
	ssize_t n;

	/*
	 * A record is mapped for writing: the descriptor handed back must be the one kept
	 * (systemd's store passes that very open file), not a reopening of it (a supervisor's
	 * "3</proc/PID/fd/N" is read-only, "3>" write-only).  Only its access mode and its
	 * contents count: it is read with pread at offset 0, whatever its offset.
	 */
	if (fl < 0) {
		snprintf(err, errlen, "the descriptor handed back is not open: %s", strerror(errno));
		return -EBADF;
	}
	if ((fl & O_ACCMODE) != O_RDWR) {
		snprintf(err, errlen, "the descriptor handed back is open %s, not read-write: a "
		    "supervisor must pass the stored descriptor itself, not a reopening of it",
		    (fl & O_ACCMODE) == O_RDONLY ? "read-only" : "write-only");
		return -EBADF;
	}
	n = pread(fd, &r, sizeof(r), 0);
	if (n < 0) {
		int e = errno;

		snprintf(err, errlen, "cannot be read: pread: %s", strerror(e));
		return -e;
	}
	if (n != (ssize_t)sizeof(r)) {
		snprintf(err, errlen, "too short (%zd of %zu bytes)", n, sizeof(r));
		return -EPROTO;
	}
	if (r.magic != ZE_RECORD_MAGIC) {
		snprintf(err, errlen, "not a tensor record (magic %016llx)",
		    (unsigned long long)r.magic);
		return -EPROTO;
	}
	/* Version 1 is version 2 with master_in_slot 0 (the field was reserved, zero). */
	if (r.version != ZE_RECORD_VERSION && r.version != 1) {
		snprintf(err, errlen, "record version %u, this zoffloadd knows version %u",
		    r.version, ZE_RECORD_VERSION);
		return -EPROTONOSUPPORT;
	}
	if (record_crc(&r) != r.crc) {
		snprintf(err, errlen, "checksum mismatch (stored %08x, computed %08x)", r.crc,
		    record_crc(&r));
		return -EBADMSG;
	}
	ret->id = r.id;
	memcpy(ret->owner, r.owner, sizeof(ret->owner));
	snprintf(ret->name, sizeof(ret->name), "%s", r.name);
	ret->numel = r.numel;
	ret->on_nvme = r.on_nvme != 0;
	ret->grad_dtype = (enum zk_dtype)r.grad_dtype;
	ret->param_dtype = (enum zk_dtype)r.param_dtype;
	return 0;
}

/* The kept record, mapped and checked against what its layout must be. */
static int
adopt_record(struct ze_tensor *t, int fd, char *err, size_t errlen)
{
	struct ze_record_info info;
	struct ze_record layout = { 0 };
	struct stat st;
	size_t bytes;
	void *map;
	int r;

	r = ze_record_peek(fd, &info, err, errlen);
	if (r < 0)
		return r;
	if (fstat(fd, &st) != 0 || (map = mmap(NULL, (size_t)st.st_size, PROT_READ |
	    PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
		r = -errno;
		snprintf(err, errlen, "record of tensor '%s' cannot be mapped: %s", info.name,
		    strerror(-r));
		return r;
	}
	t->rec = map;
	t->rec_bytes = (size_t)st.st_size;
	t->rec_fd = fd;
	tensor_record(t, t->rec, false);
	bytes = record_layout(t, &layout);
	if ((unsigned)t->format >= ZK_STATE_COUNT) {
		snprintf(err, errlen, "record of tensor '%s' keeps its state in format %u, which "
		    "this zoffloadd does not know", t->name, (unsigned)t->format);
		return -EPROTONOSUPPORT;
	}
	if (t->numel == 0 || t->unit_elements == 0 || t->nunits != (t->numel +
	    t->unit_elements - 1) / t->unit_elements || bytes != t->rec_bytes ||
	    layout.off_init != t->rec->off_init || (t->master_in_slot && (t->on_nvme ||
	    !ze_slot_can_be_master(t->format, t->param_dtype, t->param_offload)))) {
		snprintf(err, errlen, "record of tensor '%s' has an impossible layout", t->name);
		return -EBADMSG;
	}
	record_point(t);
	/*
	 * The stamps are outside the crc (they change with every step), but a unit is handed
	 * its step (pend) before it is stamped with it: a stamp past its pend is not one the
	 * engine wrote.
	 */
	for (uint64_t u = 0; u < t->nunits; u++)
		if (t->unit_step[u] > t->unit_pend[u]) {
			snprintf(err, errlen, "record of tensor '%s': unit %llu is stamped step %llu, "
			    "past step %llu, the last it was given: its step stamps are corrupt",
			    t->name, (unsigned long long)u, (unsigned long long)t->unit_step[u],
			    (unsigned long long)t->unit_pend[u]);
			return -EBADMSG;
		}
	t->param_resident = DYN(t->rec)->param_resident != 0;
	t->param_dirty = DYN(t->rec)->param_dirty != 0;
	return 0;
}

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
		/* Taken and given back: the swap files' free space, in memory only. */
		r = zs_extent_reserve(e->swap, &t->rec->extent);
		if (r < 0)
			return r;
		zs_extent_free(e->swap, &t->rec->extent);
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
	r = adopt_record(t, fds->record, err, errlen);
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
	r = adopt_record(t, fds->record, err, errlen);
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
		*t->extent = t->rec->extent;
		r = e->swap == NULL ? -ENODEV : zs_extent_reserve(e->swap, t->extent);
		if (r < 0) {
			free(t->extent);
			t->extent = NULL;
			t->on_nvme = false;
			snprintf(what, sizeof(what), "its extent on the swap paths");
			goto fail_fds;
		}
		if (t->param_offload)
			t->param_store_bytes = t->rec->param_store_bytes;
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
