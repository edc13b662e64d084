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
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "crc32c.h"
#include "engine_impl.h"
#include "pool.h"
#include "recover.h"
#include "stepper.h"
#include "swap.h"

#define PAGE 4096u
/*
 * The undo copy is made a block at a time, just before the block is
 * stepped, by the thread that steps it: the block is then in its cache
 * for the step, and the copy costs about its writes alone.
 */
#define JOURNAL_BLOCK 16384u
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
	uint32_t reserved;
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
	return zp_crc32c(0, &r->id, (size_t)(offsetof(struct ze_record, fixed_end) -
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

/*
 * The journal: a header page, then the undo copy of the one slice the
 * stepper is stepping in place (master, m, v of ZE_QUANTUM_ELEMENTS).
 * Staging buffers are kept memfds of their own; the header says which
 * chunk each one holds computed and not yet known to have landed.
 */
struct ze_journal {
	uint64_t magic;
	uint32_t version;
	uint32_t nstaging;
	uint64_t slice_tensor;
	uint64_t slice_unit;
	uint64_t slice_step;		/* 0: no copy */
	uint64_t slice_elements;
	/* Blocks of the slice copied (and so perhaps stepped): only those are put back. */
	uint64_t copied[(ZE_QUANTUM_ELEMENTS / JOURNAL_BLOCK + 63) / 64];
	struct {
		uint64_t tensor;
		uint64_t chunk;
		uint64_t step;		/* 0: holds nothing to write */
	} staging[ZE_MAX_STAGING];
};

/*
 * The header's pages, then the undo copy: master, m and v of the slice at
 * fp32 size each (a compressed format's arrays are smaller and sit at the
 * start of theirs), then the two scale arrays of a q8 slice.
 */
#define JOURNAL_HEADER ROUND(sizeof(struct ze_journal))
#define JOURNAL_ARRAY ((size_t)ZE_QUANTUM_ELEMENTS * sizeof(float))
#define JOURNAL_SCALES ((size_t)ZE_QUANTUM_ELEMENTS / ZK_Q8_BLOCK * sizeof(float))
#define JOURNAL_BYTES (JOURNAL_HEADER + 3 * JOURNAL_ARRAY + 2 * JOURNAL_SCALES)

enum { J_MASTER, J_M, J_V, J_M_SCALE, J_V_SCALE, J_ARRAYS };

/* One array's bytes for a block of a slice, and where their copy sits in the journal. */
struct jspan {
	char *at;
	size_t copy;		/* from the journal's start */
	size_t bytes;
};

/*
 * Elements [begin, end) of the slice at element slice_off of q (any
 * format; begin on a q8 block) as the byte ranges of its arrays.
 */
static void
block_spans(const struct zk_qtensor *q, size_t slice_off, size_t begin, size_t end,
    struct jspan s[J_ARRAYS])
{
	size_t ms = zk_state_moment_bytes(q->format, 1), n = end - begin;
	size_t mas = zk_state_master_bytes(q->format, 1);
	size_t b0 = begin / ZK_Q8_BLOCK, nb = zk_state_blocks(q->format, n);
	size_t e0 = slice_off + begin, sb0 = e0 / ZK_Q8_BLOCK;

	/* bf16-master+q8's master is 2 bytes an element (its copy sits at the array's start). */
	s[J_MASTER] = (struct jspan){ (char *)q->master + e0 * mas,
		JOURNAL_HEADER + begin * mas, n * mas };
	s[J_M] = (struct jspan){ (char *)q->m + e0 * ms,
		JOURNAL_HEADER + JOURNAL_ARRAY + begin * ms, n * ms };
	s[J_V] = (struct jspan){ (char *)q->v + e0 * ms,
		JOURNAL_HEADER + 2 * JOURNAL_ARRAY + begin * ms, n * ms };
	s[J_M_SCALE] = (struct jspan){ nb > 0 ? (char *)(q->m_scale + sb0) : NULL,
		JOURNAL_HEADER + 3 * JOURNAL_ARRAY + b0 * sizeof(float), nb * sizeof(float) };
	s[J_V_SCALE] = (struct jspan){ nb > 0 ? (char *)(q->v_scale + sb0) : NULL,
		JOURNAL_HEADER + 3 * JOURNAL_ARRAY + JOURNAL_SCALES + b0 * sizeof(float),
		nb * sizeof(float) };
}

int
ze_journal_start(struct ze_engine *e, int kept_fd)
{
	struct stat st;
	void *map;
	int fd = kept_fd, r;

	e->journal_fd = -1;
	if (fd < 0) {
		fd = memfd_create("zoffload-journal", MFD_CLOEXEC);
		if (fd < 0)
			return -errno;
		/* Sparse: pages appear as slices are copied. */
		if (ftruncate(fd, (off_t)JOURNAL_BYTES) != 0) {
			r = -errno;
			close(fd);
			return r;
		}
	} else if (fstat(fd, &st) != 0 || (size_t)st.st_size != JOURNAL_BYTES) {
		return -EBADFD;
	}
	map = mmap(NULL, JOURNAL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED) {
		r = -errno;
		if (kept_fd < 0)
			close(fd);
		return r;
	}
	e->journal = map;
	e->journal_bytes = JOURNAL_BYTES;
	e->journal_fd = fd;
	if (kept_fd < 0) {
		e->journal->magic = ZE_JOURNAL_MAGIC;
		e->journal->version = ZE_RECORD_VERSION;
	} else if (e->journal->magic != ZE_JOURNAL_MAGIC ||
	    e->journal->version != ZE_RECORD_VERSION) {
		return -EPROTO;
	}
	return 0;
}

void
ze_journal_stop(struct ze_engine *e)
{
	if (e->journal != NULL)
		munmap(e->journal, e->journal_bytes);
	if (e->journal_fd >= 0)
		close(e->journal_fd);
	e->journal = NULL;
	e->journal_fd = -1;
}

int
ze_engine_journal_fd(const struct ze_engine *e)
{
	return e->journal_fd;
}

struct journal_run {
	struct ze_journal *j;
	const struct ze_task *task;
	struct zk_qtensor q;		/* the slice's arrays, whatever the format */
	enum zk_isa isa;
	const struct zk_hparams *hp;
	int error;
};

/*
 * The undo copy, with stores that bypass the caches where the ISA has them:
 * a slice's copy (48 MiB at fp32) is larger than the caches and is not read
 * again unless the daemon dies, so ordinary stores would first read every
 * line of it from memory.  The step that follows reads the state from the
 * cache the copy's loads warmed.  Ordered before what follows by the fence
 * in journal_run.
 */
static void
copy_stream(void *dst, const void *src, size_t bytes)
{
	size_t done = 0;

#if defined(__SSE2__)
	if (((uintptr_t)dst & 15) == 0) {
		for (; done + 64 <= bytes; done += 64) {
			const __m128i *s = (const __m128i *)((const char *)src + done);
			__m128i *d = (__m128i *)((char *)dst + done);
			__m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
			__m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);

			_mm_stream_si128(d, a);
			_mm_stream_si128(d + 1, b);
			_mm_stream_si128(d + 2, c);
			_mm_stream_si128(d + 3, e);
		}
	}
#endif
	memcpy((char *)dst + done, (const char *)src + done, bytes - done);
}

static void
journal_run(void *arg, unsigned idx, unsigned nthreads)
{
	struct journal_run *jr = arg;
	size_t n = jr->q.n, nblocks = (n + JOURNAL_BLOCK - 1) / JOURNAL_BLOCK;
	size_t first = nblocks * idx / nthreads, last = nblocks * (idx + 1) / nthreads;

	for (size_t b = first; b < last; b++) {
		size_t begin = b * JOURNAL_BLOCK, end = begin + JOURNAL_BLOCK < n ?
		    begin + JOURNAL_BLOCK : n;
		struct jspan sp[J_ARRAYS];
		int r;

		block_spans(&jr->q, 0, begin, end, sp);
		for (unsigned k = 0; k < J_ARRAYS; k++)
			if (sp[k].bytes > 0)
				copy_stream((char *)jr->j + sp[k].copy, sp[k].at, sp[k].bytes);
#if defined(__SSE2__)
		/* The streamed copy is in the journal before the bit says so. */
		_mm_sfence();
#endif
		/* Counted only once copied whole: a crash before leaves the block untouched. */
		__atomic_or_fetch(&jr->j->copied[b / 64], 1ull << (b % 64), __ATOMIC_RELEASE);
		r = jr->q.format == ZK_STATE_FP32 ?
		    zk_step(jr->isa, jr->hp, &jr->task->view, begin, end) :
		    zk_qstep(jr->isa, jr->hp, &jr->task->qview, begin, end);
		if (r < 0)
			__atomic_store_n(&jr->error, r, __ATOMIC_RELAXED);
	}
}

int
ze_journal_step(struct ze_engine *e, struct zk_pool *pool, enum zk_isa isa,
    const struct zk_hparams *hp, const struct ze_task *task)
{
	struct ze_journal *j = e->journal;
	bool fp32 = task->qview.format == ZK_STATE_FP32;
	struct journal_run jr = { .j = j, .task = task, .isa = isa, .hp = hp };
	size_t n = fp32 ? task->view.n : task->qview.n;
	int r;

	if (j == NULL || n > ZE_QUANTUM_ELEMENTS)
		return fp32 ? zk_pool_step(pool, isa, hp, &task->view, 1) :
		    zk_pool_qstep(pool, isa, hp, &task->qview, 1);
	if (fp32)
		jr.q = (struct zk_qtensor){ .format = ZK_STATE_FP32, .master = task->view.master,
			.m = task->view.m, .v = task->view.v, .n = n };
	else
		jr.q = task->qview;
	r = fp32 ? zk_step(isa, hp, &task->view, 0, 0) : zk_qstep(isa, hp, &task->qview, 0, 0);
	if (r == 0)
		r = zk_hparams_validate(hp);
	if (r < 0)
		return r;
	/* The old copy is void first, then the new one is described, then it counts. */
	__atomic_store_n(&j->slice_step, 0, __ATOMIC_RELEASE);
	memset(j->copied, 0, sizeof(j->copied));
	j->slice_tensor = task->tensor_id;
	j->slice_unit = task->unit;
	j->slice_elements = n;
	__atomic_store_n(&j->slice_step, task->step, __ATOMIC_RELEASE);
	r = zk_pool_run(pool, journal_run, &jr);
	return r < 0 ? r : jr.error;
}

void
ze_journal_staging(struct ze_engine *e, unsigned i, const struct ze_tensor *t, uint64_t chunk,
    uint64_t step)
{
	if (e->journal == NULL || i >= ZE_MAX_STAGING)
		return;
	e->journal->staging[i].tensor = t->id;
	e->journal->staging[i].chunk = chunk;
	__atomic_store_n(&e->journal->staging[i].step, step, __ATOMIC_RELEASE);
}

void
ze_journal_staging_clear(struct ze_engine *e, unsigned i)
{
	if (e->journal != NULL && i < ZE_MAX_STAGING)
		__atomic_store_n(&e->journal->staging[i].step, 0, __ATOMIC_RELEASE);
}

int
ze_record_peek(int fd, struct ze_record_info *ret, char *err, size_t errlen)
{
	struct ze_record r;
	ssize_t n = pread(fd, &r, sizeof(r), 0);

	if (n != (ssize_t)sizeof(r)) {
		snprintf(err, errlen, "too short (%zd bytes)", n);
		return -EPROTO;
	}
	if (r.magic != ZE_RECORD_MAGIC) {
		snprintf(err, errlen, "not a tensor record (magic %016llx)",
		    (unsigned long long)r.magic);
		return -EPROTO;
	}
	if (r.version != ZE_RECORD_VERSION) {
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
	if (fstat(fd, &st) != 0)
		return -errno;
	map = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED)
		return -errno;
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
	    layout.off_init != t->rec->off_init) {
		snprintf(err, errlen, "record of tensor '%s' has an impossible layout", t->name);
		return -EBADMSG;
	}
	record_point(t);
	t->param_resident = DYN(t->rec)->param_resident != 0;
	t->param_dirty = DYN(t->rec)->param_dirty != 0;
	return 0;
}

/* A staging buffer holds chunk c of t computed at step s and not known to have landed. */
static int
rewrite_chunks(struct ze_engine *e, struct ze_tensor *t, struct ze_adopt_report *rep)
{
	struct ze_journal *j = e->journal;

	for (unsigned i = 0; j != NULL && i < ZE_MAX_STAGING && i < j->nstaging; i++) {
		uint64_t c = j->staging[i].chunk, s = j->staging[i].step;
		int r;

		if (s == 0 || j->staging[i].tensor != t->id || c >= t->nunits || t->unit_step[c] >= s)
			continue;
		if (i >= e->nstaging)
			return -ENOENT;
		r = ze_nvme_rewrite(e, t, c, e->staging[i].buf);
		if (r < 0)
			return r;
		t->unit_step[c] = s;
		j->staging[i].step = 0;
		rep->rewritten++;
	}
	return 0;
}

/* Every unit at a step it reached whole; then the tensor's steps from the stamps. */
static void
settle_steps(struct ze_engine *e, struct ze_tensor *t, bool journal_kept,
    struct ze_adopt_report *rep)
{
	struct ze_journal *j = e->journal;
	uint64_t lo = UINT64_MAX, hi = 0, torn = 0;

	if (j != NULL && journal_kept && !t->on_nvme && j->slice_step != 0 &&
	    j->slice_tensor == t->id && j->slice_unit < t->nunits &&
	    t->unit_step[j->slice_unit] < j->slice_step &&
	    j->slice_elements == ze_unit_len(t, j->slice_unit)) {
		uint64_t off = j->slice_unit * t->unit_elements, n = j->slice_elements;
		struct zk_qtensor q;

		ze_tensor_state_view(t, &q);
		for (uint64_t b = 0; b * JOURNAL_BLOCK < n; b++) {
			uint64_t begin = b * JOURNAL_BLOCK, end = begin + JOURNAL_BLOCK < n ?
			    begin + JOURNAL_BLOCK : n;
			struct jspan sp[J_ARRAYS];

			if ((j->copied[b / 64] & (1ull << (b % 64))) == 0)
				continue;
			block_spans(&q, off, begin, end, sp);
			for (unsigned k = 0; k < J_ARRAYS; k++)
				if (sp[k].bytes > 0)
					memcpy(sp[k].at, (char *)j + sp[k].copy, sp[k].bytes);
		}
		t->unit_pend[j->slice_unit] = t->unit_step[j->slice_unit];
		j->slice_step = 0;
		rep->undone++;
	}
	for (uint64_t u = 0; u < t->nunits; u++) {
		/*
		 * Handed to compute and not stamped: with the journal kept, the one
		 * slice it caught was put back above and a chunk's disk copy is
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
	ze_tensor_charge(t, job, uid, !t->on_nvme, t->state_bytes);
	t->init_missing = count_init_missing(t);
	if (t->on_nvme) {
		snprintf(what, sizeof(what), "a computed chunk kept in a staging buffer");
		r = journal_kept ? rewrite_chunks(e, t, rep) : 0;
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

void
ze_journal_set_staging(struct ze_engine *e)
{
	if (e->journal != NULL)
		e->journal->nstaging = e->nstaging;
}

void
ze_engine_recovered(struct ze_engine *e)
{
	if (e->journal == NULL)
		return;
	e->journal->slice_step = 0;
	for (unsigned i = 0; i < ZE_MAX_STAGING; i++)
		e->journal->staging[i].step = 0;
	ze_journal_set_staging(e);
}
