/* Each tensor's record: the memfd its placement and step stamps are written through to, so that they outlive the process. */
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

/*
 * Called when the last init bit is set: the bits are not looked at again (a record taken back
 * reads them only while initialized is 0), so their pages, a bit an element, go back.  Once
 * punched they read as zeros, which nothing reads; where the punch fails they are only kept.
 */
void
ze_record_initialized(struct ze_tensor *t)
{
	uint64_t from = ROUND(t->rec->off_init);

	DYN(t->rec)->initialized = 1;
	if (from < t->rec_bytes)
		(void)fallocate(t->rec_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)from,
		    (off_t)(t->rec_bytes - from));
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
int
ze_record_adopt(struct ze_tensor *t, int fd, char *err, size_t errlen)
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
	    layout.off_init != t->rec->off_init || (t->master_in_slot &&
	    !ze_slot_can_be_master(t->format, t->param_dtype, t->param_offload))) {
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

/* Where a kept record's tensor lay on the swap paths. */
const struct zs_extent *
ze_record_extent(const struct ze_tensor *t)
{
	return &t->rec->extent;
}

uint64_t
ze_record_param_store_bytes(const struct ze_tensor *t)
{
	return t->rec->param_store_bytes;
}
