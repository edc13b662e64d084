/* The step journal: what finishes a pinned slice's step after a crash, and which chunks the staging buffers hold. */
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
 * Roll forward, not undo.  A slice is stepped in place a block at a time;
 * each worker copies the block it is about to step (the arrays the
 * optimizer writes) into its own before-image in the journal, names the
 * block, steps it and sets the block's bit.  A crash at any instant leaves
 * every block at step s (bit set), untouched at s - 1, or half stepped with
 * a whole before-image naming it.  At adoption the half-stepped blocks are
 * put back from their images and the engine steps every block without its
 * bit itself, from the journaled hyperparameters, ISA and the gradients
 * still in the grad slot, then stamps the slice: it comes back whole at s.
 *
 * Why finish at adoption rather than leave the unstepped blocks to the
 * resubmitted step: the stamps stay per unit (no block bits to keep in the
 * tensor's record between adoption and a resubmission that may never come,
 * or a checkpoint taken in between, or a second crash), and every path
 * after adoption sees units at whole steps only, exactly as before.  The
 * gradients it reads are those the resubmission would read: a client does
 * not write the grad slot of a step it has not seen answered.
 *
 * Why a block of 8 Ki elements: its before-image (96 KiB at fp32) and its
 * state stay in the worker's L2 between the copy and the step, so the copy
 * costs cache bandwidth, not memory bandwidth: the step's own loads are
 * only moved earlier, and the image, written again for every block, is not
 * evicted to memory.  (The undo journal this replaces copied the whole
 * slice with streaming stores, 12 B an element to memory, which doubled a
 * memory-bound step.)  Smaller blocks pay the kernel's per-call set-up
 * more often; a multiple of ZK_Q8_BLOCK and of the pool's 32-element
 * alignment keeps q8 blocks and cache lines whole.
 *
 * What a SIGKILL leaves: every store the process executed reaches memory
 * (the store buffers and write-combining buffers drain whatever happens
 * to the process), and a memfd's pages outlive it, so program order is the
 * only order that matters: the image before the name (release), the step
 * before the bit (release).  A power loss is not covered (nor is the state).
 */
#define JOURNAL_BLOCK 8192u
#define JOURNAL_NBLOCKS (ZE_QUANTUM_ELEMENTS / JOURNAL_BLOCK)
#define NO_BLOCK UINT64_MAX
_Static_assert(JOURNAL_BLOCK % ZK_Q8_BLOCK == 0 && JOURNAL_BLOCK % 32 == 0,
    "a journal block is whole q8 blocks and vectors");
_Static_assert(ZE_QUANTUM_ELEMENTS % JOURNAL_BLOCK == 0, "a slice is whole journal blocks");

/* Hyperparameters as stepped (with the clip coefficient applied), in fixed-width fields. */
struct journal_hp {
	uint32_t optim;
	uint32_t bias_correction;
	uint64_t step;
	double lr, beta1, beta2, eps, weight_decay, lr_decay, grad_scale, clip_coef;
};

/* A worker's current block, alone on its cache line (written once a block). */
struct journal_worker {
	uint64_t block;			/* in the slice; NO_BLOCK: none */
	uint64_t pad[7];
};

/*
 * The header, then ZE_JOURNAL_WORKERS before-images.  The slice's fields
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
	uint32_t slice_arrays;		/* the arrays each image holds (1 << J_MASTER, ...) */
	uint32_t reserved;
	struct journal_hp hp;
	uint64_t stepped[JOURNAL_NBLOCKS / 64];	/* a bit per block at slice_step */
	struct {
		uint64_t tensor;
		uint64_t chunk;
		uint64_t step;		/* 0: holds nothing to write */
	} staging[ZE_MAX_STAGING];
	struct journal_worker worker[ZE_JOURNAL_WORKERS] __attribute__((aligned(64)));
};

enum { J_MASTER, J_M, J_V, J_M_SCALE, J_V_SCALE, J_ARRAYS };

/*
 * A before-image: master, m and v of a block at fp32 size each (a
 * compressed format's arrays are smaller and sit at the start of theirs),
 * then the two scale arrays of a q8 block; a page apart from the next.
 */
#define IMAGE_ARRAY ((size_t)JOURNAL_BLOCK * sizeof(float))
#define IMAGE_SCALES ((size_t)JOURNAL_BLOCK / ZK_Q8_BLOCK * sizeof(float))
#define IMAGE_BYTES ROUND(3 * IMAGE_ARRAY + 2 * IMAGE_SCALES)
#define JOURNAL_HEADER ROUND(sizeof(struct ze_journal))
#define JOURNAL_BYTES (JOURNAL_HEADER + (size_t)ZE_JOURNAL_WORKERS * IMAGE_BYTES)

/* One array's bytes for a block, and where their copy sits in an image. */
struct jspan {
	char *at;
	size_t image;			/* from the image's start */
	size_t bytes;
};

/* Elements [begin, end) of q (any format; begin on a q8 block) as the byte ranges of its arrays. */
static void
block_spans(const struct zk_qtensor *q, size_t begin, size_t end, struct jspan s[J_ARRAYS])
{
	size_t ms = zk_state_moment_bytes(q->format, 1), n = end - begin;
	size_t mas = zk_state_master_bytes(q->format, 1);
	size_t nb = zk_state_blocks(q->format, n), sb0 = begin / ZK_Q8_BLOCK;

	s[J_MASTER] = (struct jspan){ (char *)q->master + begin * mas, 0, n * mas };
	s[J_M] = (struct jspan){ (char *)q->m + begin * ms, IMAGE_ARRAY, n * ms };
	s[J_V] = (struct jspan){ (char *)q->v + begin * ms, 2 * IMAGE_ARRAY, n * ms };
	s[J_M_SCALE] = (struct jspan){ nb > 0 ? (char *)(q->m_scale + sb0) : NULL,
		3 * IMAGE_ARRAY, nb * sizeof(float) };
	s[J_V_SCALE] = (struct jspan){ nb > 0 ? (char *)(q->v_scale + sb0) : NULL,
		3 * IMAGE_ARRAY + IMAGE_SCALES, nb * sizeof(float) };
}

/* What the optimizer writes: Adagrad and Lion keep one moment (m), Adam and AdamW two. */
static uint32_t
arrays_written(enum zk_state_format f, enum zk_optim optim)
{
	bool two = optim == ZK_OPTIM_ADAM || optim == ZK_OPTIM_ADAMW;
	uint32_t a = 1u << J_MASTER | 1u << J_M | (two ? 1u << J_V : 0);

	if (f == ZK_STATE_Q8 || f == ZK_STATE_BF16_Q8)
		a |= 1u << J_M_SCALE | (two ? 1u << J_V_SCALE : 0);
	return a;
}

/* No worker names a block (a fresh memfd's zeros would name block 0). */
static void
workers_clear(struct ze_journal *j)
{
	for (unsigned w = 0; w < ZE_JOURNAL_WORKERS; w++)
		__atomic_store_n(&j->worker[w].block, NO_BLOCK, __ATOMIC_RELEASE);
}

static char *
image_of(struct ze_journal *j, unsigned w)
{
	return (char *)j + JOURNAL_HEADER + (size_t)w * IMAGE_BYTES;
}

int
ze_journal_start(struct ze_engine *e, int kept_fd)
{
	struct stat st;
	void *map;
	int fd = kept_fd, r;

	e->journal_fd = -1;
	if (zk_pool_threads(e->pool) > ZE_JOURNAL_WORKERS)
		return -E2BIG;
	if (fd < 0) {
		fd = memfd_create("zoffload-journal", MFD_CLOEXEC);
		if (fd < 0)
			return -errno;
		/* Sparse: a worker's image has pages once it has stepped a block. */
		if (ftruncate(fd, (off_t)JOURNAL_BYTES) != 0) {
			r = -errno;
			close(fd);
			return r;
		}
	} else if (fstat(fd, &st) != 0 || (size_t)st.st_size != JOURNAL_BYTES) {
		return -EPROTO;
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
		e->journal->version = ZE_JOURNAL_VERSION;
		workers_clear(e->journal);
	} else if (e->journal->magic != ZE_JOURNAL_MAGIC ||
	    e->journal->version != ZE_JOURNAL_VERSION) {
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

/* One slice stepped block by block on the pool (j NULL: no journal, the test gate only). */
struct slice_run {
	struct ze_journal *j;
	const struct zk_qtensor *q;	/* the slice's arrays, whatever the format */
	const struct zk_tensor *view;	/* fp32: the same as the kernel takes it */
	enum zk_isa isa;
	const struct zk_hparams *hp;
	uint32_t arrays;
	uint64_t step;
	uint64_t unit;
	const struct ze_block_gate *gate;
	int error;
};

static int
step_range(const struct slice_run *sr, size_t begin, size_t end)
{
	if (sr->q->format == ZK_STATE_FP32)
		return zk_step(sr->isa, sr->hp, sr->view, begin, end);
	return zk_qstep(sr->isa, sr->hp, sr->q, begin, end);
}

static int
step_block(const struct slice_run *sr, uint64_t b, size_t begin, size_t end)
{
	size_t mid = begin + (end - begin) / 2 / ZK_Q8_BLOCK * ZK_Q8_BLOCK;
	int r;

	if (sr->gate == NULL || mid == begin)
		return step_range(sr, begin, end);
	/* Tests: the gate holds the worker with half the block stepped. */
	r = step_range(sr, begin, mid);
	if (r == 0)
		sr->gate->fn(sr->gate->arg, sr->step, sr->unit, b);
	return r < 0 ? r : step_range(sr, mid, end);
}

static void
slice_worker(void *arg, unsigned idx, unsigned nthreads)
{
	struct slice_run *sr = arg;
	struct ze_journal *j = sr->j;
	size_t n = sr->q->n, nblocks = (n + JOURNAL_BLOCK - 1) / JOURNAL_BLOCK;
	size_t first = nblocks * idx / nthreads, last = nblocks * (idx + 1) / nthreads;
	char *image = j != NULL ? image_of(j, idx) : NULL;

	for (size_t b = first; b < last; b++) {
		size_t begin = b * JOURNAL_BLOCK, end = begin + JOURNAL_BLOCK < n ?
		    begin + JOURNAL_BLOCK : n;
		uint64_t bit = 1ull << (b % 64);
		struct jspan sp[J_ARRAYS];
		int r;

		if (j != NULL) {
			/* At adoption: a block stepped before the crash is not stepped again. */
			if (__atomic_load_n(&j->stepped[b / 64], __ATOMIC_RELAXED) & bit)
				continue;
			block_spans(sr->q, begin, end, sp);
			for (unsigned k = 0; k < J_ARRAYS; k++)
				if ((sr->arrays & (1u << k)) && sp[k].bytes > 0)
					memcpy(image + sp[k].image, sp[k].at, sp[k].bytes);
			/* The image is whole before it names the block. */
			__atomic_store_n(&j->worker[idx].block, b, __ATOMIC_RELEASE);
		}
		r = step_block(sr, b, begin, end);
		if (r < 0) {
			__atomic_store_n(&sr->error, r, __ATOMIC_RELAXED);
			continue;
		}
		/* The block's stores come before its bit; its image is void from here. */
		if (j != NULL)
			__atomic_or_fetch(&j->stepped[b / 64], bit, __ATOMIC_RELEASE);
	}
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
	struct zk_qtensor q;
	struct slice_run sr = { .j = j, .q = &q, .view = &task->view, .isa = isa, .hp = hp,
		.arrays = arrays_written(task->qview.format, hp->optim), .step = task->step,
		.unit = task->unit, .gate = gate };
	int r;

	task_views(task, &q);
	if ((j == NULL && gate == NULL) || q.n > ZE_QUANTUM_ELEMENTS)
		return fp32 ? zk_pool_step(pool, isa, hp, &task->view, 1) :
		    zk_pool_qstep(pool, isa, hp, &task->qview, 1);
	r = step_range(&sr, 0, 0);
	if (r < 0)
		return r;
	if (j != NULL) {
		/* The last slice's record is void first, then this one is written, then it counts. */
		__atomic_store_n(&j->slice_step, 0, __ATOMIC_RELEASE);
		memset(j->stepped, 0, sizeof(j->stepped));
		/* Workers past the pool's were cleared when the journal was made or adopted. */
		for (unsigned w = 0; w < zk_pool_threads(pool); w++)
			j->worker[w].block = NO_BLOCK;
		j->slice_tensor = task->tensor_id;
		j->slice_unit = task->unit;
		j->slice_elements = q.n;
		j->slice_format = (uint32_t)q.format;
		j->slice_isa = (uint32_t)isa;
		j->slice_arrays = sr.arrays;
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

/*
 * The slice the journal names, if it is t's and not stamped: its half
 * stepped blocks put back, the rest of the step applied, the unit stamped.
 * 1: finished; 0: nothing of t's; -errno: could not be (the slice may be torn).
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
	if (j->slice_elements != ze_unit_len(t, u) || j->slice_format != (uint32_t)t->format ||
	    j->slice_arrays != arrays_written(t->format, (enum zk_optim)j->hp.optim))
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
		q.param = (char *)whole.param + off * zk_dtype_size(t->param_dtype);
		q.n = ze_unit_len(t, u);
	}
	view = (struct zk_tensor){ .master = q.master, .m = q.m, .v = q.v, .grad = q.grad,
		.grad_dtype = q.grad_dtype, .param = q.param, .param_dtype = q.param_dtype,
		.n = q.n };
	sr = (struct slice_run){ .j = j, .q = &q, .view = &view, .isa = isa, .hp = &hp,
		.arrays = j->slice_arrays, .step = s, .unit = u };
	r = step_range(&sr, 0, 0);
	if (r < 0)
		return r;
	for (unsigned w = 0; w < ZE_JOURNAL_WORKERS; w++) {
		uint64_t b = j->worker[w].block, begin, end;
		struct jspan sp[J_ARRAYS];

		if (b >= (q.n + JOURNAL_BLOCK - 1) / JOURNAL_BLOCK ||
		    (j->stepped[b / 64] & (1ull << (b % 64))) != 0)
			continue;
		begin = b * JOURNAL_BLOCK;
		end = begin + JOURNAL_BLOCK < q.n ? begin + JOURNAL_BLOCK : q.n;
		block_spans(&q, begin, end, sp);
		for (unsigned k = 0; k < J_ARRAYS; k++)
			if ((sr.arrays & (1u << k)) && sp[k].bytes > 0)
				memcpy(sp[k].at, image_of(j, w) + sp[k].image, sp[k].bytes);
	}
	/*
	 * Put back, and only then unnamed: a crash before puts them back again
	 * from the same images, and the roll forward overwrites images that no
	 * longer name anything.
	 */
	workers_clear(j);
	/* The rest of the step, as the workers would have gone on, journaled the same way. */
	r = zk_pool_run(e->pool, slice_worker, &sr);
	if (r == 0)
		r = sr.error;
	if (r < 0)
		return r;
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
