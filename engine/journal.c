/* The step journal: how a pinned slice caught mid-step is finished, and what staging buffers hold. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine_impl.h"
#include "pool.h"
#include "recover.h"
#include "stepper.h"

#define PAGE 4096u
#define ROUND(x) (((x) + PAGE - 1) / PAGE * PAGE)

/*
 * Roll forward, not undo.  A slice is stepped in place by the pool's
 * workers, each over its own range, and each keeps one word in the
 * journal, a zk_undo record: (at, count, slot) says that every element of
 * its range before `at` is stepped, every one from at + count on is
 * untouched, and the old values of [at, at + count) are whole in the
 * worker's own area of the journal.  A crash at any instant leaves that
 * true.  At adoption the engine puts [at, at + count) back and steps the
 * rest of each range itself, from the journaled hyperparameters and ISA
 * and the gradients still in the grad slot, keeping the same records as
 * it goes, then stamps the slice: it comes back whole at its step.
 *
 * The kernel keeps the record itself (zk_step_undo, zk_qstep_undo), a unit
 * at a time (a vector; a q8 block for the 8-bit formats), storing each
 * unit's old values to a two-slot ring that stays in L1, from the
 * registers or cache lines the step loads anyway.  No extra memory
 * traffic: measured at the noise of the step.  The undo journal this
 * replaces copied the whole slice first, with streaming stores, 12 B an
 * element to memory, and doubled the step; a separate copy of each block
 * of 8 Ki elements into a cache-resident image, the first version of this
 * journal, still cost 30-50% of a pinned step on the test machine, fp32
 * and compressed alike (the copy's loads stall where the step's overlap).
 *
 * Why finish at adoption rather than leave the unstepped part to the
 * resubmitted step: the stamps stay per unit (no partial-slice state to
 * keep in the tensor's record between adoption and a resubmission that
 * may never come, a checkpoint taken in between, or a second crash), and
 * every path after adoption sees slices at whole steps only, as before.
 * The gradients it reads are those the resubmission would read: a client
 * does not touch the grad slot of a step it has not seen answered.
 *
 * What a SIGKILL leaves: every store the process executed reaches memory
 * (store and write-combining buffers drain whatever happens to the
 * process), in program order for ordinary stores, and a memfd's pages
 * outlive the process; so program order is the only order that matters
 * (the old values before the record that names them, the record before
 * the new values).  A power loss is not covered (nor is the state).
 */
/*
 * Workers' ranges are whole blocks of this many elements (q8 blocks and
 * cache lines stay whole), and the test gate holds a worker half way
 * through one.
 */
#define JOURNAL_BLOCK 8192u
_Static_assert(JOURNAL_BLOCK % ZK_Q8_BLOCK == 0 && JOURNAL_BLOCK % 32 == 0,
    "a journal block is whole q8 blocks and vectors");

/* Hyperparameters as stepped (with the clip coefficient applied), in fixed-width fields. */
struct journal_hp {
	uint32_t optim;
	uint32_t bias_correction;
	uint64_t step;
	double lr, beta1, beta2, eps, weight_decay, lr_decay, grad_scale, clip_coef;
};

/* A worker's range and record, alone on its cache line (the record changes a vector at a time). */
struct journal_worker {
	uint64_t record;		/* zk_undo_pack(at, count, slot); 0: no range */
	uint64_t last;			/* its range ends here */
	uint64_t pad[6];
};

/*
 * The header, then ZE_JOURNAL_WORKERS rings.  The slice's fields
 * are valid while slice_step is not 0 (set last, cleared first).
 */
struct ze_journal {
	uint64_t magic;
	uint32_t version;
	uint32_t nstaging;
	uint64_t slice_tensor;
	uint64_t slice_unit;
	uint64_t slice_step;		/* 0: no slice */
	uint64_t slice_elements;
	uint32_t slice_format;		/* enum zk_state_format */
	uint32_t slice_isa;		/* enum zk_isa: the roll forward gets the same bits */
	struct journal_hp hp;
	struct {
		uint64_t tensor;
		uint64_t chunk;
		uint64_t step;		/* 0: holds nothing to write */
	} staging[ZE_MAX_STAGING];
	struct journal_worker worker[ZE_JOURNAL_WORKERS] __attribute__((aligned(64)));
};

/* A worker's area: the kernel's ring. */
#define AREA_BYTES (2 * (size_t)ZK_UNDO_SLOT)
#define JOURNAL_HEADER ROUND(sizeof(struct ze_journal))
/*
 * Where worker w's area starts: w strides of its own apart.  Version 2 packed
 * them (one AREA_BYTES after the other); with the two workers' rings 8 KiB
 * apart, a pinned fp32 step with the journal took 1.22 times the step
 * without it (bench_torch_c, 100 M params, 2 threads, AMD EPYC), with them
 * 256 KiB apart 1.11 (the kernel alone over 100 M elements: 1.20 at 8 KiB,
 * 1.00 at 256 KiB or more).  Sparse: only a worker's two slots get pages.
 */
#define RING_STRIDE_V2 AREA_BYTES
#define RING_STRIDE ((size_t)256 << 10)
_Static_assert(RING_STRIDE >= AREA_BYTES && RING_STRIDE % PAGE == 0, "a ring's stride holds it");
#define JOURNAL_BYTES(stride) (JOURNAL_HEADER + (size_t)ZE_JOURNAL_WORKERS * (stride))

/* No worker has a range. */
static void
workers_clear(struct ze_journal *j)
{
	for (unsigned w = 0; w < ZE_JOURNAL_WORKERS; w++)
		__atomic_store_n(&j->worker[w].record, 0, __ATOMIC_RELEASE);
}

static char *
ring_of(struct ze_journal *j, size_t stride, unsigned w)
{
	return (char *)j + JOURNAL_HEADER + (size_t)w * stride;
}

int
ze_journal_layout(unsigned version, size_t *header, size_t *ring_stride, size_t *bytes)
{
	size_t stride;

	if (version == 2)
		stride = RING_STRIDE_V2;
	else if (version == ZE_JOURNAL_VERSION)
		stride = RING_STRIDE;
	else
		return -EINVAL;
	*header = JOURNAL_HEADER;
	*ring_stride = stride;
	*bytes = JOURNAL_BYTES(stride);
	return 0;
}

int
ze_journal_start(struct ze_engine *e, int kept_fd)
{
	unsigned version = ZE_JOURNAL_VERSION;
	size_t header, stride, bytes;
	struct stat st;
	void *map;
	int fd = kept_fd, r;

	e->journal_fd = -1;
	if (zk_pool_threads(e->pool) > ZE_JOURNAL_WORKERS)
		return -E2BIG;
	(void)ze_journal_layout(version, &header, &stride, &bytes);
	if (fd < 0) {
		fd = memfd_create("zoffload-journal", MFD_CLOEXEC);
		if (fd < 0)
			return -errno;
		/* Sparse: a worker's ring has pages once it has stepped. */
		if (ftruncate(fd, (off_t)bytes) != 0) {
			r = -errno;
			close(fd);
			return r;
		}
	} else if (fstat(fd, &st) != 0) {
		return -EPROTO;
	} else if ((size_t)st.st_size != bytes) {
		/* An earlier daemon's (version 2: the rings packed), taken back as it was made. */
		version = 2;
		(void)ze_journal_layout(version, &header, &stride, &bytes);
		if ((size_t)st.st_size != bytes)
			return -EPROTO;
	}
	map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED) {
		r = -errno;
		if (kept_fd < 0)
			close(fd);
		return r;
	}
	e->journal = map;
	e->journal_bytes = bytes;
	e->journal_stride = stride;
	e->journal_fd = fd;
	if (kept_fd < 0) {
		e->journal->magic = ZE_JOURNAL_MAGIC;
		e->journal->version = version;
		workers_clear(e->journal);
	} else if (e->journal->magic != ZE_JOURNAL_MAGIC || e->journal->version != version) {
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

/* One slice stepped on the pool (j NULL: no journal, the test gate only). */
struct slice_run {
	struct ze_journal *j;
	size_t stride;			/* between the workers' rings in j */
	const struct zk_qtensor *q;	/* the slice's arrays, whatever the format */
	const struct zk_tensor *view;	/* fp32: the same as the kernel takes it */
	enum zk_isa isa;
	const struct zk_hparams *hp;
	uint64_t step;
	uint64_t unit;
	const struct ze_block_gate *gate;
	int error;
};

/* Worker idx's range of n elements: whole journal blocks, as the pool would split them. */
static void
worker_range(size_t n, unsigned idx, unsigned nthreads, size_t *first, size_t *last)
{
	size_t nblocks = (n + JOURNAL_BLOCK - 1) / JOURNAL_BLOCK;
	size_t f = nblocks * idx / nthreads * JOURNAL_BLOCK;
	size_t l = nblocks * (idx + 1) / nthreads * JOURNAL_BLOCK;

	*first = f < n ? f : n;
	*last = l < n ? l : n;
}

static int
step_range(const struct slice_run *sr, size_t begin, size_t end, struct zk_undo *u)
{
	if (sr->q->format == ZK_STATE_FP32)
		return zk_step_undo(sr->isa, sr->hp, sr->view, begin, end, u);
	return zk_qstep_undo(sr->isa, sr->hp, sr->q, begin, end, u);
}

/*
 * [begin, end), or with the test gate block by block, each held half way:
 * the gate's worker stops there with the record naming a unit in the block.
 */
static int
step_gated(const struct slice_run *sr, size_t begin, size_t end, struct zk_undo *u)
{
	int r = 0;

	if (sr->gate == NULL)
		return step_range(sr, begin, end, u);
	for (size_t x = begin; x < end && r == 0; x += JOURNAL_BLOCK) {
		size_t y = x + JOURNAL_BLOCK < end ? x + JOURNAL_BLOCK : end;
		size_t mid = x + (y - x) / 2 / ZK_Q8_BLOCK * ZK_Q8_BLOCK;

		r = step_range(sr, x, mid, u);
		if (r == 0 && mid > x)
			sr->gate->fn(sr->gate->arg, sr->step, sr->unit, x / JOURNAL_BLOCK);
		if (r == 0)
			r = step_range(sr, mid, y, u);
	}
	return r;
}

/* Worker w steps its range from `from` on, its record kept (j NULL: plainly) from ring slot `slot`. */
static int
step_worker(const struct slice_run *sr, unsigned w, size_t from, size_t last, unsigned slot)
{
	struct ze_journal *j = sr->j;
	struct zk_undo u;
	int r;

	if (j == NULL)
		return step_gated(sr, from, last, NULL);
	u = (struct zk_undo){ .ring = ring_of(j, sr->stride, w), .record = &j->worker[w].record,
		.slot = slot };
	r = step_gated(sr, from, last, &u);
	/* All stepped: nothing to put back, nothing left (the last unit need not be stepped again). */
	if (r == 0)
		__atomic_store_n(&j->worker[w].record, zk_undo_pack(last, 0, u.slot), __ATOMIC_RELEASE);
	return r;
}

static void
slice_worker(void *arg, unsigned idx, unsigned nthreads)
{
	struct slice_run *sr = arg;
	size_t first, last;
	int r;

	worker_range(sr->q->n, idx, nthreads, &first, &last);
	r = step_worker(sr, idx, first, last, 0);
	if (r < 0)
		__atomic_store_n(&sr->error, r, __ATOMIC_RELAXED);
}

static void
hp_save(struct journal_hp *d, const struct zk_hparams *hp)
{
	*d = (struct journal_hp){ .optim = (uint32_t)hp->optim,
		.bias_correction = hp->bias_correction, .step = hp->step, .lr = hp->lr,
		.beta1 = hp->beta1, .beta2 = hp->beta2, .eps = hp->eps,
		.weight_decay = hp->weight_decay, .lr_decay = hp->lr_decay,
		.grad_scale = hp->grad_scale, .clip_coef = hp->clip_coef };
}

static void
hp_load(struct zk_hparams *d, const struct journal_hp *hp)
{
	*d = (struct zk_hparams){ .optim = (enum zk_optim)hp->optim,
		.bias_correction = hp->bias_correction != 0, .step = hp->step, .lr = hp->lr,
		.beta1 = hp->beta1, .beta2 = hp->beta2, .eps = hp->eps,
		.weight_decay = hp->weight_decay, .lr_decay = hp->lr_decay,
		.grad_scale = hp->grad_scale, .clip_coef = hp->clip_coef };
}

/* The slice's arrays as a zk_qtensor, and as a zk_tensor for fp32. */
static void
task_views(const struct ze_task *task, struct zk_qtensor *q)
{
	if (task->qview.format != ZK_STATE_FP32) {
		*q = task->qview;
		return;
	}
	*q = (struct zk_qtensor){ .format = ZK_STATE_FP32, .master = task->view.master,
		.m = task->view.m, .v = task->view.v, .grad = task->view.grad,
		.grad_dtype = task->view.grad_dtype, .param = task->view.param,
		.param_dtype = task->view.param_dtype, .n = task->view.n };
}

int
ze_journal_step(struct ze_engine *e, struct zk_pool *pool, enum zk_isa isa,
    const struct zk_hparams *hp, const struct ze_task *task)
{
	struct ze_journal *j = e->journal;
	bool fp32 = task->qview.format == ZK_STATE_FP32;
	const struct ze_block_gate *gate = e->cfg.block_gate.fn != NULL ? &e->cfg.block_gate : NULL;
	unsigned nthreads = zk_pool_threads(pool);
	struct zk_qtensor q;
	struct slice_run sr = { .j = j, .stride = e->journal_stride, .q = &q, .view = &task->view,
		.isa = isa, .hp = hp,
		.step = task->step, .unit = task->unit, .gate = gate };
	int r;

	task_views(task, &q);
	if ((j == NULL && gate == NULL) || q.n > ZE_QUANTUM_ELEMENTS)
		return fp32 ? zk_pool_step(pool, isa, hp, &task->view, 1) :
		    zk_pool_qstep(pool, isa, hp, &task->qview, 1);
	r = step_range(&sr, 0, 0, NULL);
	if (r < 0)
		return r;
	if (j != NULL) {
		/* The last slice's record is void first, then this one is written, then it counts. */
		__atomic_store_n(&j->slice_step, 0, __ATOMIC_RELEASE);
		/* Workers past the pool's have no range since the journal was made or adopted. */
		for (unsigned w = 0; w < nthreads; w++) {
			size_t first, last;

			worker_range(q.n, w, nthreads, &first, &last);
			j->worker[w].last = last;
			j->worker[w].record = zk_undo_pack(first, 0, 0);
		}
		j->slice_tensor = task->tensor_id;
		j->slice_unit = task->unit;
		j->slice_elements = q.n;
		j->slice_format = (uint32_t)q.format;
		j->slice_isa = (uint32_t)isa;
		hp_save(&j->hp, hp);
		__atomic_store_n(&j->slice_step, task->step, __ATOMIC_RELEASE);
	}
	r = zk_pool_run(pool, slice_worker, &sr);
	return r < 0 ? r : sr.error;
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
ze_journal_rewrite_chunks(struct ze_engine *e, struct ze_tensor *t, struct ze_adopt_report *rep)
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

/* Puts back the unit worker w's record names (count 0: none, the range is stepped up to at). */
static int
put_back(const struct slice_run *sr, unsigned w, uint64_t rec)
{
	struct zk_undo u = { .ring = ring_of(sr->j, sr->stride, w) };

	if (zk_undo_count(rec) == 0)
		return 0;
	if (sr->q->format == ZK_STATE_FP32)
		return zk_undo_restore(sr->hp->optim, sr->view, &u, rec);
	return zk_qundo_restore(sr->q, &u, rec);
}

/*
 * The slice the journal names, if it is t's and not stamped: each worker's
 * half-stepped part put back, the rest of its range stepped, the unit
 * stamped.  1: finished; 0: nothing of t's; -errno: could not be (torn).
 */
int
ze_journal_finish(struct ze_engine *e, struct ze_tensor *t)
{
	struct ze_journal *j = e->journal;
	uint64_t u = j != NULL ? j->slice_unit : 0, s = j != NULL ? j->slice_step : 0;
	struct zk_qtensor whole, q;
	struct zk_tensor view;
	struct zk_hparams hp;
	struct slice_run sr;
	enum zk_isa isa;
	uint64_t off;
	int r;

	if (j == NULL || s == 0 || t->on_nvme || j->slice_tensor != t->id || u >= t->nunits ||
	    t->unit_step[u] >= s)
		return 0;
	if (j->slice_elements != ze_unit_len(t, u) || j->slice_format != (uint32_t)t->format)
		return -EBADMSG;
	hp_load(&hp, &j->hp);
	/* The same ISA gives the same bits; one this CPU lacks cannot have been used here. */
	isa = j->slice_isa < ZK_ISA_COUNT && zk_isa_supported((enum zk_isa)j->slice_isa) ?
	    (enum zk_isa)j->slice_isa : e->cfg.isa;
	ze_tensor_state_view(t, &whole);
	off = u * t->unit_elements;
	if (t->format != ZK_STATE_FP32) {
		r = zk_qtensor_slice(&whole, off, ze_unit_len(t, u), &q);
		if (r < 0)
			return r;
	} else {
		/* As batch_run cuts an fp32 slice (zk_qtensor_slice knows compressed formats only). */
		q = whole;
		q.master = t->master + off;
		q.m = (float *)t->m + off;
		q.v = (float *)t->v + off;
		q.grad = (const char *)whole.grad + off * zk_dtype_size(t->grad_dtype);
		if (whole.param != NULL)
			q.param = (char *)whole.param + off * zk_dtype_size(t->param_dtype);
		q.n = ze_unit_len(t, u);
	}
	view = (struct zk_tensor){ .master = q.master, .m = q.m, .v = q.v, .grad = q.grad,
		.grad_dtype = q.grad_dtype, .param = q.param, .param_dtype = q.param_dtype,
		.n = q.n };
	sr = (struct slice_run){ .j = j, .stride = e->journal_stride, .q = &q, .view = &view,
		.isa = isa, .hp = &hp, .step = s, .unit = u };
	r = step_range(&sr, 0, 0, NULL);
	if (r < 0)
		return r;
	/*
	 * Range by range, on this thread, through the same records: a crash in
	 * here leaves them as true as a crash in the step did.  The ring goes
	 * on in the other slot, so the one the record names stays whole.
	 */
	for (unsigned w = 0; w < ZE_JOURNAL_WORKERS; w++) {
		uint64_t rec = j->worker[w].record, last = j->worker[w].last;

		if (rec == 0)
			continue;
		if (last > q.n || zk_undo_at(rec) > last)
			return -EBADMSG;
		r = put_back(&sr, w, rec);
		/*
		 * A worker that finished its range has nothing left: its record is
		 * (last, 0), and a range that ends on the tensor's short last q8
		 * block cannot even be named empty from there (a q8 range starts
		 * on a block), so it is not stepped again.
		 */
		if (r == 0 && zk_undo_at(rec) < last)
			r = step_worker(&sr, w, zk_undo_at(rec), last, zk_undo_slot(rec) ^ 1);
		if (r < 0)
			return r;
	}
	__atomic_store_n(&t->unit_step[u], s, __ATOMIC_RELEASE);
	t->unit_pend[u] = s;
	j->slice_step = 0;
	return 1;
}

uint64_t
ze_journal_slice_step(const struct ze_engine *e)
{
	return e->journal != NULL ? e->journal->slice_step : 0;
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
	workers_clear(e->journal);
	for (unsigned i = 0; i < ZE_MAX_STAGING; i++)
		e->journal->staging[i].step = 0;
	ze_journal_set_staging(e);
}
