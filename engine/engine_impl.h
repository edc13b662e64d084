/* The engine's own structs, for its files only. */
#ifndef ZE_ENGINE_IMPL_H
#define ZE_ENGINE_IMPL_H

#include <sys/queue.h>

#include "arena.h"
#include "engine.h"
#include "recover.h"
#include "util.h"

struct zk_pool;
struct ze_stepper;
struct ze_task;
struct ze_batch;
struct nvme_lane;
struct nvme_work;

struct ze_account {
	unsigned refs;			/* the creator's plus one per tensor charged to it */
	struct ze_account_limits limits;
	uint64_t pinned_bytes;
	uint64_t swap_bytes;
};

/*
 * A tensor's one charge: the bytes it took and the accounts it took them
 * from, with a reference on each.  Made by tensor placement, refunded
 * exactly once, by tensor_destroy, to those same accounts.
 */
struct ze_charge {
	struct ze_account *job;
	struct ze_account *uid;
	uint64_t pinned_bytes;
	uint64_t swap_bytes;
};

/*
 * Owned by its creator until ze_tensor_free; then by the engine while
 * `busy` (a batch or a transfer holds it), destroyed when that ends.
 * `user` is NULL once the owner let go, so no callback names it.
 */
struct ze_tensor {
	struct ze_engine *e;
	void *user;
	bool freed;
	uint64_t id;			/* the engine's, never reused: names its kept descriptors */
	/*
	 * Its recovery record (record.c): a memfd holding what the tensor is
	 * rebuilt from, and the arrays below marked (rec) live in it, so every
	 * change to them is already kept.
	 */
	struct ze_record *rec;
	size_t rec_bytes;
	int rec_fd;
	int state_fd;			/* the pinned state's memfd; -1 on NVMe */
	uint64_t torn_step;		/* a step a crash left half applied here, 0: none */
	char name[ZE_NAME_MAX + 1];
	uint64_t numel;
	enum zk_dtype grad_dtype;
	enum zk_dtype param_dtype;
	struct ze_charge charge;
	/*
	 * pinned: master, m, v, the scales (and the param store) in one arena
	 * allocation, laid out by ze_layout_of for the format; m and v are
	 * float[] for fp32, uint16_t[] for bf16-moments, uint8_t[] for q8-moments
	 * and bf16-master+q8; master is float[] except for bf16-master+q8, whose
	 * uint16_t[] bf16 master is master_bf16 (never use master as floats then).
	 */
	enum zk_state_format format;
	/*
	 * The param slot is the master (master_in_slot): where the slot's dtype
	 * is the master's (fp32 params of fp32, bf16-moments and q8-moments
	 * state; bf16 params of bf16-master+q8), the tensor is pinned and the
	 * client only reads the slot (no param_offload), master points at the
	 * slot's mapping and the pinned allocation holds m, v and the scales
	 * only.  Ownership: the engine alone writes the slot then (the client's
	 * descriptor is read-only, shm.c), through master: the step updates it
	 * in place (one array read and written, no second stream of stores),
	 * and the writers of master (restores, initialization) are the
	 * writers of the params.  The slot's memfd is kept with the others, so
	 * the step journal's guarantee holds as for a master in the state's
	 * memfd (journal.c: it names elements, not files).  On NVMe the disk
	 * keeps m, v and the scales, master stays NULL, and a chunk's new master
	 * reaches the slot only once its m and v have landed (nvme_impl.h).
	 * Fixed at placement, kept in the record (record.c).  Elsewhere the slot
	 * is a mirror the step writes beside master.
	 */
	bool master_in_slot;
	void *state;
	size_t state_bytes;		/* pinned allocation, or the extent's bytes on NVMe */
	bool state_pinned;
	union {
		float *master;
		uint16_t *master_bf16;
	};
	void *m;
	void *v;
	float *m_scale;			/* q8-moments and bf16-master+q8, else NULL */
	float *v_scale;
	struct ze_shm grad_slot;
	struct ze_shm param_slot;
	bool param_offload;
	bool param_resident;		/* the param slot holds the current params */
	bool param_dirty;		/* ... newer than the store */
	void *param_store;		/* pinned store, or NULL on NVMe */
	size_t param_store_bytes;
	uint64_t param_store_offset;	/* in extent, on NVMe */
	/* NVMe: state chunk by chunk in extent */
	bool on_nvme;
	struct zs_extent *extent;
	uint64_t chunk_elements;
	uint8_t *chunks_written;	/* (rec) bit per chunk: written since placed (else zeros) */
	/*
	 * Exactly once: the step each unit (NVMe chunk, or pinned slice of
	 * ZE_QUANTUM_ELEMENTS) is at.  last_step is the step every unit is at.
	 */
	uint64_t *unit_step;		/* (rec) */
	uint64_t *unit_pend;		/* (rec) the step a unit was handed to compute for */
	uint64_t nunits;
	uint64_t unit_elements;
	uint64_t last_step;
	uint64_t partial_step;		/* a step that landed on some units only; 0: none */
	bool busy;
	/* (rec) Initialization: a bit per master element written; NULL once all are. */
	uint64_t *init_bits;
	uint64_t init_missing;
};

/* A pinned buffer that holds one NVMe chunk (master, m, v) while it is read, stepped, written. */
struct ze_staging {
	TAILQ_ENTRY(ze_staging) entry;
	unsigned index;			/* in e->staging, and in the journal */
	int fd;				/* its memfd: a computed chunk outlives the process */
	void *buf;
	size_t bytes;
	bool pinned;
};

/* One step: owned by the engine from ze_step_submit until step_done. */
struct ze_batch {
	uint32_t lane;
	uint64_t id;
	uint64_t seq;				/* submission order, for ze_runs_before */
	struct zk_hparams hp;
	struct zk_hparams hp_run;		/* hp with the clip coefficient applied */
	enum zk_isa isa;
	bool grad_only;				/* a gradient pass: grad_done, no step */
	bool check_finite;
	double max_grad_norm;
	uint64_t submit_ns;
	size_t count;
	struct ze_tensor **tensors;		/* NULL once that tensor is done */
	struct zk_tensor *views;		/* grads and params; state only when pinned */
	size_t *pending;			/* units (slices, chunks) not yet finished */
	int *errors;				/* first error per tensor */
	uint64_t *landed;			/* elements at hp.step, per tensor */
	size_t tensors_left;
	struct zk_grad_stats check;		/* written by the CHECK task */
	enum ze_step_status status;
	int error;
	double grad_norm;
	uint64_t compute_ns;
	uint64_t params;
};

/*
 * Two, not one: with one, the disk had no read to do from one read's end
 * until the loop saw it and started the next, and bench_step's step took
 * 1.20 times its I/O bound against 0.98 with two (medians of three runs
 * each, same rounds); bench_overlap's NVMe case, which the window is for,
 * gave 1.12 and 1.13 (noise).  The head shares the disk with one read.
 */
#define ZE_READ_WINDOW_CHUNKS 2

struct ze_engine {
	struct ze_config cfg;
	struct ze_callbacks cb;
	void *cb_arg;
	struct zt_arena *arena;
	struct zk_pool *pool;
	struct ze_stepper *stepper;
	struct zs_swap *swap;
	struct zt_arena *staging_arena;
	struct ze_staging *staging;
	unsigned nstaging;
	TAILQ_HEAD(, ze_staging) staging_free;
	TAILQ_HEAD(, nvme_lane) nvme_lanes;	/* lanes with chunks waiting for a buffer */
	TAILQ_HEAD(, nvme_work) xfer_works;	/* transfers not yet reported */
	/*
	 * Bytes being read into staging buffers.  The pump keeps at most
	 * ZE_READ_WINDOW_CHUNKS full chunks' worth (always at least one read)
	 * in flight: reads started together share the bandwidth and land
	 * together, so the head of the queue (the layer the trainer needs
	 * first) would wait for all the chunks behind it.
	 */
	uint64_t read_bytes_in_flight;
	bool pumping;				/* pump() is on the stack: loop, do not recurse */
	bool pump_again;
	unsigned tasks_outstanding;		/* on the stepper */
	uint64_t compute_idle_since;		/* when tasks_outstanding last fell to 0 */
	uint64_t io_blocked_since;		/* 0, or since when work waits for a buffer */
	unsigned batches;			/* steps not yet reported */
	uint64_t batch_seq;			/* the last batch's seq */
	unsigned xfers;				/* transfers and param I/O not yet reported */
	struct ze_stats stats;
	uint64_t next_tensor_id;
	/* journal.c: the slice being stepped and its workers' blocks, and staging buffers' chunks */
	struct ze_journal *journal;
	size_t journal_bytes;
	size_t journal_stride;			/* between the workers' rings (its version's) */
	int journal_fd;
	/*
	 * adopt.c: the swap extents ze_tensor_adopt_check took, held until
	 * ze_adopt_checks_done gives them back, so that two kept tensors claiming
	 * the same swap space are refused before either is adopted (and written).
	 */
	struct zs_extent *checked;
	size_t nchecked;
};

/* Byte offsets of a state's arrays in one region of `elements` elements each (state.c). */
struct ze_layout {
	size_t master;
	size_t m;
	size_t v;
	size_t m_scale;
	size_t v_scale;
	size_t bytes;
};

/* state.c */
/* pad: pinned (arrays apart by page + 4160 bytes); else an NVMe chunk (packed, 4 KiB rounded). */
void ze_layout_of(enum zk_state_format f, size_t elements, bool pad, struct ze_layout *ret);
void ze_state_view(enum zk_state_format f, void *base, const struct ze_layout *l, size_t n,
    struct zk_qtensor *ret);
/* The whole tensor in memory (pinned), with its grad and param slots. */
void ze_tensor_state_view(const struct ze_tensor *t, struct zk_qtensor *ret);
/*
 * Elements [from, from + count) of q's arrays picked by mask (1 master, 2 m,
 * 4 v) from or to fp32 buffers bufs[0..2]: copies for fp32, decode or
 * decode-patch-encode of the covering blocks for the compressed formats.
 */
int ze_state_rw(const struct zk_qtensor *q, bool write, unsigned mask, size_t from,
    size_t count, float *const bufs[3]);
/*
 * Raw copies (ze_tensor_read_raw): elements [from, from + count) of q's arrays from or to
 * the raw buffer buf of `total` elements (ze_raw_layout), at its element `at`.  For Q8
 * from and at are multiples of ZK_Q8_BLOCK and count is too unless it ends both q and buf.
 */
int ze_state_raw(const struct zk_qtensor *q, bool write, size_t from, size_t count, void *buf,
    size_t total, size_t at);
/* The format has a step kernel for optim. */
bool ze_format_supports(enum zk_state_format f, enum zk_optim optim);

/* tensor.c */
void ze_tensor_unbusy(struct ze_tensor *t);
void ze_tensor_destroy(struct ze_tensor *t);
void ze_tensor_charge(struct ze_tensor *t, struct ze_account *job, struct ze_account *uid,
    bool pinned, uint64_t bytes);
/* A tensor with nothing yet (no descriptors, no state), for a new one or one rebuilt. */
struct ze_tensor *ze_tensor_alloc(struct ze_engine *e, void *user);
/* master, m, v and the param store from t->state, as placement lays them out. */
void ze_tensor_point_state(struct ze_tensor *t);
/* master_in_slot: master is the param slot's mapping (again, once the slot is made or adopted). */
void ze_tensor_point_master(struct ze_tensor *t);
/* The slot can be the master: its dtype is the format's master's and the client only reads it. */
bool ze_slot_can_be_master(enum zk_state_format f, enum zk_dtype param_dtype, bool param_offload);
/* t's pinned layout: ze_layout_of's, less the master where master_in_slot. */
void ze_tensor_layout(const struct ze_tensor *t, struct ze_layout *ret);
uint64_t ze_tensor_pinned_bytes(const struct ze_tensor *t);
/* The param slot mirrors master: elements [offset, offset + count) from src. */
void ze_tensor_write_param(struct ze_tensor *t, uint64_t offset, uint64_t count,
    const float *src);
/*
 * The same from master in q's format, q's element at being the tensor's
 * element offset: fp32 masters through ze_tensor_write_param, a bf16 master
 * (bf16-master+q8) as its exact value in the param dtype.
 */
void ze_tensor_param_from_master(struct ze_tensor *t, uint64_t offset, uint64_t count,
    const struct zk_qtensor *q, size_t at);
/* The conversion alone, into a slot of dtype: touches nothing else (any thread). */
void ze_param_convert(void *slot, enum zk_dtype dtype, uint64_t offset, uint64_t count,
    const float *src);
/* Master elements [offset, offset + count) hold initial values now. */
void ze_tensor_mark_init(struct ze_tensor *t, uint64_t offset, uint64_t count);
/* Every element of [offset, offset + count) has been written since the tensor was made. */
bool ze_tensor_init_all(const struct ze_tensor *t, uint64_t offset, uint64_t count);
uint64_t ze_unit_len(const struct ze_tensor *t, uint64_t unit);

/* nvme.c */
int ze_nvme_start(struct ze_engine *e);
void ze_nvme_stop(struct ze_engine *e);
/* The extent t takes on the swap paths, its chunks laid out (chunk_elements set). */
uint64_t ze_nvme_bytes(struct ze_engine *e, struct ze_tensor *t);
int ze_nvme_place(struct ze_engine *e, struct ze_tensor *t);
void ze_nvme_release(struct ze_engine *e, struct ze_tensor *t);
/* Queues tensor i of b; reports through ze_step_unit_done. */
void ze_nvme_queue_step(struct ze_engine *e, struct ze_batch *b, size_t i);
void ze_nvme_step_computed(struct ze_engine *e, struct ze_task *task);
/* A ZE_TASK_PARAM of a chunk came back. */
void ze_nvme_param_done(struct ze_engine *e, struct ze_task *task);
int ze_nvme_xfer(struct ze_tensor *t, bool write, enum ze_state which, uint64_t offset,
    uint64_t count, void *buf, uint32_t lane, uint64_t id);
/* Every chunk [offset, offset + count) touches was written whole since t was placed. */
bool ze_nvme_written(const struct ze_tensor *t, uint64_t offset, uint64_t count);
void ze_nvme_cancel_lane(struct ze_engine *e, uint32_t lane);
/*
 * ze_tensor_read_all on NVMe: the three arrays from one read of each chunk, stride
 * elements apart in buf; raw: the arrays as kept (ze_tensor_read_raw, compressed formats
 * only; stride unused).
 */
int ze_nvme_read_all(struct ze_tensor *t, uint64_t offset, uint64_t count, uint64_t stride,
    void *buf, bool raw, uint32_t lane, uint64_t id);
int ze_nvme_write_all(struct ze_tensor *t, uint64_t offset, uint64_t count, uint64_t stride,
    const void *buf, bool raw, uint32_t lane, uint64_t id);

/* step.c */
void ze_step_unit_done(struct ze_engine *e, struct ze_batch *b, size_t i, uint64_t unit,
    int error);
void ze_step_post(struct ze_engine *e, struct ze_task *task);
void ze_step_completions(struct ze_engine *e);

/* param.c */
void ze_param_drop_pages(struct ze_tensor *t);
/* Sets both flags, kept in the tensor's record as they change. */
void ze_param_flags(struct ze_tensor *t, bool resident, bool dirty);

/* shm.c: a kept memfd of bytes (page-rounded) mapped as a slot again. */
int ze_shm_adopt(struct ze_engine *e, int fd, size_t bytes, bool client_read_only,
    struct ze_shm *ret);
/* ze_shm_create with src's first bytes copied in before it is sealed (src -1: zeros). */
int ze_shm_create_from(struct ze_engine *e, const char *name, size_t bytes,
    bool client_read_only, int src, struct ze_shm *ret);

/* record.c */
/* The record for a tensor just placed (units and chunks known); -errno. */
int ze_record_create(struct ze_tensor *t);
void ze_record_initialized(struct ze_tensor *t);
void ze_record_destroy(struct ze_tensor *t);
/*
 * A kept record (fd) mapped as t's and checked against the layout its fields
 * imply; err says why not.  adopt.c rebuilds the rest of t from it.
 */
int ze_record_adopt(struct ze_tensor *t, int fd, char *err, size_t errlen);
const struct zs_extent *ze_record_extent(const struct ze_tensor *t);
uint64_t ze_record_param_store_bytes(const struct ze_tensor *t);

/* journal.c */
/* A new journal (kept_fd -1) or the one an earlier process kept; -EPROTO: not one we know. */
int ze_journal_start(struct ze_engine *e, int kept_fd);
void ze_journal_stop(struct ze_engine *e);
/* The journal names the engine's staging buffers from now on. */
void ze_journal_set_staging(struct ze_engine *e);
/*
 * Stepper thread: a pinned slice stepped in place, block by block, each
 * block's before-image kept by the worker stepping it until its bit says
 * it is stepped (zk_pool_step's result, bit for bit).
 */
struct zk_pool;
int ze_journal_step(struct ze_engine *e, struct zk_pool *pool, enum zk_isa isa,
    const struct zk_hparams *hp, const struct ze_task *task);
/* An NVMe chunk computed in staging buffer i is about to be written / has landed. */
void ze_journal_staging(struct ze_engine *e, unsigned i, const struct ze_tensor *t,
    uint64_t chunk, uint64_t step);
void ze_journal_staging_clear(struct ze_engine *e, unsigned i);
/* Adoption: t's computed chunks that the kept staging buffers hold, written again. */
int ze_journal_rewrite_chunks(struct ze_engine *e, struct ze_tensor *t,
    struct ze_adopt_report *rep);
/*
 * Adoption: the slice of t the journal names, caught mid-step, finished and
 * stamped.  1: finished; 0: none of t's; -errno: it could not be.
 */
int ze_journal_finish(struct ze_engine *e, struct ze_tensor *t);
/* The step of the slice the journal names (0: none). */
uint64_t ze_journal_slice_step(const struct ze_engine *e);
/* nvme.c: a computed chunk from a kept staging buffer written again, synchronously. */
int ze_nvme_rewrite(struct ze_engine *e, struct ze_tensor *t, uint64_t chunk, const void *buf);

#endif
