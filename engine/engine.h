/* The step and tier engine: optimizer state on the tiers, steps, transfers; no sessions, no wire. */
#ifndef ZE_ENGINE_H
#define ZE_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "optim.h"
#include "quant.h"

/*
 * Everything here runs on one thread (the caller's loop): submissions,
 * ze_engine_process() and the callbacks it runs.  Work is keyed by a lane
 * (the fairness key: one per client) and an id, both opaque to the engine;
 * results come back as (lane, id, result) through struct ze_callbacks.
 * Functions return 0 or -errno / -ZS_E_* (ze_strerror names both).
 */

struct ze_engine;
struct ze_tensor;
struct ze_account;
struct zs_swap;

/* Elements per pinned slice: one stepper task, the unit of fairness and of exactly-once. */
#define ZE_QUANTUM_ELEMENTS (4u << 20)
#define ZE_NAME_MAX 127
/* Optimizer state per element in the fp32 format: master, m and v, on either tier. */
#define ZE_STATE_BYTES_PER_ELEMENT (3 * sizeof(float))

enum ze_policy { ZE_POLICY_CPU, ZE_POLICY_NVME, ZE_POLICY_AUTO };
enum ze_state { ZE_STATE_MASTER, ZE_STATE_EXP_AVG, ZE_STATE_EXP_AVG_SQ };
enum ze_step_status { ZE_STEP_APPLIED, ZE_STEP_SKIPPED_NONFINITE, ZE_STEP_FAILED };
enum ze_io { ZE_IO_READ, ZE_IO_WRITE, ZE_IO_PARAM_RELEASE };

/*
 * Tests only: called by the worker stepping a block of a pinned slice with
 * half of the block stepped (the daemon's $ZOFFLOADD_TEST_STEP_GATE), so a
 * test can kill the daemon there.  Steps go block by block while it is set.
 * Called on the loop as well, with block ZE_GATE_LANDED and unit the chunk,
 * when a step's NVMe chunk whose slot is its master has landed (its m and v
 * on disk) and the slot has not yet taken the new master (nvme_impl.h).
 */
#define ZE_GATE_LANDED UINT64_MAX
struct ze_block_gate {
	void (*fn)(void *arg, uint64_t step, uint64_t unit, uint64_t block);
	void *arg;
};

struct ze_config {
	uint64_t pinned_budget;
	int numa_node;			/* -1: none */
	bool require_pinned;
	bool hugepages;
	uint64_t shm_budget;		/* slots and anything else made with ze_shm_create */
	unsigned worker_threads;	/* >= 1 */
	const int *cpus;		/* NULL: not bound */
	unsigned ncpus;
	enum zk_isa isa;
	unsigned staging_buffers;	/* NVMe chunks in flight at once */
	uint64_t chunk_elements;	/* elements per NVMe chunk, a multiple of 1024 */
	const char *const *swap_path_names;	/* for messages about a full swap */
	unsigned nswap_paths;
	/*
	 * The shell's names for what its user sets, in the engine's messages (as
	 * ze_account_limits.pinned_what does for budgets): static text, NULL for a plain
	 * wording.  The daemon's: "swap.paths", "memory.numa_node", and what to do when the
	 * memlock limit runs out ("raise LimitMEMLOCK= or set memory.require_pinned to false").
	 */
	const char *swap_paths_what;
	const char *numa_node_what;
	const char *memlock_hint;
	/*
	 * Keep the step journal (journal.c): the slice being stepped in place,
	 * its hyperparameters, a bit per block stepped and each worker's
	 * before-image of its block, so that a crash mid-slice is finished at
	 * adoption exactly (recover.h); a few percent of a pinned step.  Off:
	 * such a slice is reported torn.
	 */
	bool journal;
	/*
	 * Kept from an earlier process (recover.h): its journal (0: none; a kept
	 * descriptor is never 0..2) and staging memfds.
	 */
	int kept_journal_fd;
	const int *kept_staging_fds;
	unsigned nkept_staging;
	struct ze_block_gate block_gate;	/* fn NULL: none */
};

/* What the engine reports.  Every callback runs from an engine call on the loop. */
struct ze_tensor_result {
	uint64_t step;
	enum ze_step_status status;
	int error;
	uint64_t landed;		/* elements now at this step (all of them when applied) */
	uint64_t numel;
};

struct ze_step_result {
	uint64_t step;
	enum ze_step_status status;
	int error;			/* first error, 0 unless failed */
	double grad_norm;		/* NaN unless the set was checked */
	size_t count;			/* tensors in the set */
	uint64_t params;		/* elements in the set */
	uint64_t landed;		/* elements now at this step */
	uint64_t submit_ns;
	uint64_t compute_ns;
};

/* One set's share of a norm over many sets (ranks, nodes): sums combine by adding. */
struct ze_grad_partial {
	double sumsq;			/* of the unscaled gradients, accumulated in double */
	uint64_t nonfinite;		/* inf or NaN gradients */
	uint64_t elements;
};

struct ze_callbacks {
	/* One tensor of step `id` is done.  Not called for a tensor its owner freed meanwhile. */
	void (*tensor_done)(void *arg, uint32_t lane, uint64_t id, void *user,
	    const struct ze_tensor_result *r);
	/* The whole step `id` is done, after its last tensor_done. */
	void (*step_done)(void *arg, uint32_t lane, uint64_t id, const struct ze_step_result *r);
	/* A queued state transfer or param release finished; user: the transfer's tensor's. */
	void (*io_done)(void *arg, uint32_t lane, uint64_t id, enum ze_io kind, void *user,
	    int result);
	/* A queued param fetch finished; user NULL when the tensor was freed meanwhile. */
	void (*param_ready)(void *arg, uint32_t lane, uint64_t id, void *user, int result);
	/* A gradient pass (ze_grad_pass) finished: 0 and the set's partial, or -errno. */
	void (*grad_done)(void *arg, uint32_t lane, uint64_t id, int result,
	    const struct ze_grad_partial *p);
};

/*
 * Takes swap (NULL: no NVMe tier), whether this fails or not; it is freed
 * with the engine.  err names what failed.
 */
int ze_engine_new(const struct ze_config *cfg, struct zs_swap *swap,
    const struct ze_callbacks *cb, void *cb_arg, struct ze_engine **ret, char *err,
    size_t errlen);
/* Finishes what the stepper and the swap engine hold (their callbacks run), then frees. */
void ze_engine_free(struct ze_engine *e);
/* Readable when ze_engine_process() has work: the stepper's and the swap engine's (-1: none). */
int ze_engine_step_fd(const struct ze_engine *e);
int ze_engine_swap_fd(const struct ze_engine *e);
/* Runs finished compute and I/O on; callbacks run here.  0 or the swap engine's -errno. */
int ze_engine_process(struct ze_engine *e);
/* Polls both fds up to timeout_ms, then processes.  For tests and tools. */
int ze_engine_wait(struct ze_engine *e, int timeout_ms);
/* Steps, transfers and param I/O not yet reported. */
unsigned ze_engine_in_flight(const struct ze_engine *e);
unsigned ze_engine_steps_in_flight(const struct ze_engine *e);
void ze_engine_set_isa(struct ze_engine *e, enum zk_isa isa);
void ze_engine_set_budgets(struct ze_engine *e, uint64_t pinned_budget, uint64_t shm_budget);
/* The swap engine (tiers/swap.h) the NVMe tier runs on, NULL without one: not this engine. */
struct zs_swap *ze_engine_swap(const struct ze_engine *e);

/* Never NULL; for 0, -errno and the swap engine's -ZS_E_* codes. */
const char *ze_strerror(int code);
/* The errno a client is told for code: -ZS_E_* codes have one; -errno stays. */
int ze_errno(int code);

/*
 * A budget holder (a job, a uid).  Each tensor charged to it holds a
 * reference, so an account outlives the job or uid that made it while its
 * tensors wait for work to end.
 */
struct ze_account_limits {
	uint64_t pinned_budget;		/* 0: none */
	uint64_t swap_budget;		/* 0: none */
	const char *pinned_what;	/* "limits.uid_pinned_budget of its uid": static text */
	const char *swap_what;
};
int ze_account_new(const struct ze_account_limits *l, struct ze_account **ret);
struct ze_account *ze_account_ref(struct ze_account *a);
void ze_account_unref(struct ze_account *a);	/* NULL is fine */
/* New limits apply to the next charge; what is charged stays. */
void ze_account_set_limits(struct ze_account *a, const struct ze_account_limits *l);
void ze_account_usage(const struct ze_account *a, uint64_t *ret_pinned, uint64_t *ret_swap);

/* A tensor: master, m and v on a tier, a grad slot and a param slot shared with a client. */
struct ze_tensor_desc {
	const char *name;		/* for messages */
	uint64_t numel;
	enum zk_dtype grad_dtype;
	enum zk_dtype param_dtype;
	bool param_offload;		/* params live on the tiers; the slot is staged on request */
	enum ze_policy policy;
	/*
	 * How master, m and v are stored on the tiers (quant.h); 0 is fp32.
	 * Compressed formats step with AdamW and Adam only (ze_step_submit
	 * refuses others); their state moves and is charged compressed.
	 */
	enum zk_state_format state_format;
};

/*
 * Places the state (pinned if the policy and the budgets of both accounts
 * allow, else NVMe) and charges it to job and uid (either may be NULL).
 * user comes back in callbacks.  err says what was wrong.
 */
int ze_tensor_new(struct ze_engine *e, const struct ze_tensor_desc *desc,
    struct ze_account *job, struct ze_account *uid, void *user, struct ze_tensor **ret,
    char *err, size_t errlen);
/* The owner lets go: freed now, or when the work it is in ends (no callbacks name it). */
void ze_tensor_free(struct ze_tensor *t);
void ze_tensor_set_user(struct ze_tensor *t, void *user);
uint64_t ze_tensor_numel(const struct ze_tensor *t);
enum zk_dtype ze_tensor_grad_dtype(const struct ze_tensor *t);
enum zk_dtype ze_tensor_param_dtype(const struct ze_tensor *t);
bool ze_tensor_param_offload(const struct ze_tensor *t);
enum zk_state_format ze_tensor_state_format(const struct ze_tensor *t);
/* Bytes of master, m, v and scales (zk_state_bytes), what the format keeps per step. */
uint64_t ze_tensor_state_bytes(const struct ze_tensor *t);
/* The memfds of the grad and param slots (page-rounded), for the client to map. */
int ze_tensor_grad_fd(const struct ze_tensor *t);
int ze_tensor_param_fd(const struct ze_tensor *t);
void *ze_tensor_grad_slot(const struct ze_tensor *t);
void *ze_tensor_param_slot(const struct ze_tensor *t);
/* In a step or a transfer: no other work and no reattach may start. */
bool ze_tensor_busy(const struct ze_tensor *t);
/*
 * Busy for a caller that reads its state in memory from another thread (a checkpoint):
 * no step, transfer or free takes it until ze_tensor_release.  -EBUSY if it is busy.
 */
int ze_tensor_hold(struct ze_tensor *t);
void ze_tensor_release(struct ze_tensor *t);
/*
 * A restore straight into a tensor in memory (a checkpoint's I/O thread reading into it):
 * while the caller holds it, it may write the arrays ze_tensor_memory_state gives (they
 * are the tensor's own) and refresh the param slot from master with
 * ze_tensor_param_refresh, which touches the slot alone (any thread); then, back on the
 * loop, ze_tensor_restored records those elements as written.  Both -ERANGE outside the
 * tensor; the params must be resident (ze_tensor_param_resident), as for a write.
 */
int ze_tensor_param_refresh(struct ze_tensor *t, uint64_t offset, uint64_t count);
int ze_tensor_restored(struct ze_tensor *t, uint64_t offset, uint64_t count);
bool ze_tensor_on_nvme(const struct ze_tensor *t);
/* Every element of master was written since it was placed. */
bool ze_tensor_initialized(const struct ze_tensor *t);
/* The last step applied to every element. */
uint64_t ze_tensor_last_step(const struct ze_tensor *t);
/* A step landed on part of the tensor only (it failed there): its state is of two steps. */
bool ze_tensor_step_partial(const struct ze_tensor *t);
/* State written back from a checkpoint is at `step`: every element is, from now on. */
int ze_tensor_set_step(struct ze_tensor *t, uint64_t step);

/*
 * Copies elements [offset, offset + count) of one state array from or to buf
 * (which must stay until the result), always as fp32: a compressed format's
 * moments are decoded on a read and encoded on a write, so a write of m or v
 * is quantized (and re-encodes the rest of the 256-element blocks it
 * touches).  1: done now; 0: queued, io_done reports; < 0: refused.
 * Writing master also writes the param slot; a bf16 master (bf16-master+q8)
 * is written rounded to nearest even (a conversion: only steps round
 * stochastically), and the param slot gets the rounded value.
 */
int ze_tensor_io(struct ze_tensor *t, bool write, enum ze_state which, uint64_t offset,
    uint64_t count, void *buf, uint32_t lane, uint64_t id);
/*
 * A state array of a tensor in memory (pinned or not), for writing it out as it is
 * while the tensor is not busy (no step can change it meanwhile); NULL on NVMe and
 * for any array of a compressed format (read those with ze_tensor_read_all).
 */
const float *ze_tensor_memory_state(const struct ze_tensor *t, enum ze_state which);
/*
 * Reads elements [offset, offset + count) of master, m and v at once into buf (master's
 * count floats at buf, m's at buf + stride, v's at buf + 2 * stride; stride >= count),
 * decoded from a compressed format, from one pass over the state (a checkpoint).
 * As ze_tensor_io: 1 done now, 0 queued (io_done reports ZE_IO_READ), < 0 refused.
 *
 * On NVMe, fp32, a range that is one whole chunk (ze_tensor_chunk_elements) with stride
 * the chunk's length rounded up to 1024 elements, and buf aligned for direct I/O (4 KiB
 * does): the disk reads into buf itself, no copy through a staging buffer; the padding
 * between the arrays is overwritten.  buf must then stay until io_done even after
 * ze_engine_cancel_lane, since the disk may still be filling it.
 */
int ze_tensor_read_all(struct ze_tensor *t, uint64_t offset, uint64_t count, uint64_t stride,
    float *buf, uint32_t lane, uint64_t id);
/*
 * The other way (a restore): buf's three arrays (as ze_tensor_read_all lays them) into
 * master, m and v, the param slot refreshed; on NVMe a chunk the range covers whole is
 * written without being read, and in the case read_all names written from buf itself:
 * the padding between the arrays goes to the disk as it is (zeros, say), and buf must
 * stay until io_done even after ze_engine_cancel_lane.
 */
int ze_tensor_write_all(struct ze_tensor *t, uint64_t offset, uint64_t count, uint64_t stride,
    const float *buf, uint32_t lane, uint64_t id);
/* Elements per NVMe chunk of t (0 in memory): whole-state transfers of one go direct. */
uint64_t ze_tensor_chunk_elements(const struct ze_tensor *t);
/*
 * The chunk layout's unit: every NVMe chunk's arrays (and the chunk length,
 * swap.chunk_elements) are whole multiples of ZE_CHUNK_ALIGN elements, 4 KiB of fp32, as
 * the swap's direct I/O moves them.  ze_chunk_round(n): n rounded up to one; a caller's
 * buffer for a direct transfer (ze_tensor_read_all's stride) is laid out with it.
 */
#define ZE_CHUNK_ALIGN 1024u
static inline uint64_t
ze_chunk_round(uint64_t n)
{
	return (n + ZE_CHUNK_ALIGN - 1) / ZE_CHUNK_ALIGN * ZE_CHUNK_ALIGN;
}
/*
 * A checkpoint's raw form of a range of count elements: the arrays master (as kept), m and
 * v (as the format keeps them: 4, 2 or 1 byte an element) and, for q8-moments, m's and
 * v's scales (fp32, one per 256-element block, the last block possibly short), back to
 * back in that order.  For fp32 state it is ze_tensor_read_all's buffer, stride count.
 */
#define ZE_RAW_ARRAYS 5
/* Bytes of raw array k (0..4) over count elements (0 for a scale array of fp32 or bf16). */
uint64_t ze_raw_array_bytes(enum zk_state_format f, unsigned k, uint64_t count);
/* Byte offsets of the five arrays in a raw buffer of count elements; returns its size. */
uint64_t ze_raw_layout(enum zk_state_format f, uint64_t count, uint64_t off[ZE_RAW_ARRAYS]);
/*
 * Raw array k of a tensor in memory (pinned or not), whole, for writing it out as it is
 * while the tensor is held (ze_tensor_hold); NULL on NVMe or where the format has no such
 * array (the scales of fp32 and bf16 state).
 */
const void *ze_tensor_memory_raw(const struct ze_tensor *t, unsigned k);
/*
 * A raw range [from, from + count) of a tensor of n elements: -ERANGE if it is not in
 * them, -EINVAL if it splits a 256-element block (q8-moments), else 0.
 */
int ze_raw_check(enum zk_state_format f, uint64_t n, uint64_t from, uint64_t count);
/*
 * As ze_tensor_read_all and ze_tensor_write_all, but buf holds the raw form: the bytes
 * the tiers keep, copied with no decode or encode (a compressed checkpoint; a restore
 * into the same format gives back the same bits).  For q8-moments offset must be a
 * multiple of 256 and count too unless the range runs to the tensor's end (-EINVAL).
 */
int ze_tensor_read_raw(struct ze_tensor *t, uint64_t offset, uint64_t count, void *buf,
    uint32_t lane, uint64_t id);
int ze_tensor_write_raw(struct ze_tensor *t, uint64_t offset, uint64_t count, const void *buf,
    uint32_t lane, uint64_t id);
/* Queued transfers of lane stop touching their buffers; they end with -ECANCELED. */
void ze_engine_cancel_lane(struct ze_engine *e, uint32_t lane);

/* A step over a set of tensors, all at one step number. */
struct ze_step {
	uint32_t lane;
	uint64_t id;
	struct zk_hparams hp;		/* hp.step is the step number */
	bool check_finite;		/* skip the whole set on a non-finite gradient */
	double max_grad_norm;		/* > 0: clip by the set's global norm */
	/*
	 * > 0: the clip coefficient, in (0, 1], computed by the client from
	 * the partials of every set (ze_grad_pass); max_grad_norm is not used.
	 */
	double clip_coef;
	size_t count;
	struct ze_tensor *const *tensors;
};
/*
 * 0: accepted; tensor_done and step_done report (possibly before this
 * returns).  < 0: refused, nothing started; err says why.  A step number
 * at or below a tensor's last step is refused (-EALREADY); a retry of a
 * step that failed part-way applies only to the elements it did not reach,
 * and until it is retried (or the step set) other steps are refused
 * (-EINPROGRESS).
 */
int ze_step_submit(struct ze_engine *e, const struct ze_step *s, char *err, size_t errlen);

/*
 * The first phase of a step clipped by a norm over many sets: the gradient
 * pass over this set alone, reported through grad_done.  The tensors are
 * busy until then.  The step itself follows with ze_step.clip_coef (or is
 * not submitted at all when a set anywhere had a non-finite gradient).
 */
int ze_grad_pass(struct ze_engine *e, uint32_t lane, uint64_t id, double grad_scale,
    struct ze_tensor *const *ts, size_t n, char *err, size_t errlen);
/* torch.nn.utils.clip_grad_norm_'s coefficient for a total squared norm: 1 when not clipping. */
double ze_clip_coef(double max_norm, double sumsq);

/*
 * Param offload.  Fetch: 1 when the slot holds the params now, 0 queued
 * (param_ready reports), < 0 refused.  Release: writes dirty slots back and
 * drops their pages; 1 done now, 0 queued (io_done reports), < 0 refused.
 */
int ze_param_fetch(struct ze_tensor *t, uint32_t lane, uint64_t id);
int ze_param_release(struct ze_engine *e, struct ze_tensor *const *ts, size_t n,
    uint32_t lane, uint64_t id);
bool ze_tensor_param_resident(const struct ze_tensor *t);

/*
 * Shared memory for clients: a memfd sealed against resizing, mapped here
 * writable, counted against shm_budget.  fd is ours (and the fd store's);
 * a slot the client only reads goes to it as ro_fd, a read-only reopening
 * owned here too (valid only when client_read_only).
 */
struct ze_shm {
	int fd;
	void *map;
	size_t bytes;
	bool client_read_only;
	int ro_fd;
};
int ze_shm_create(struct ze_engine *e, const char *name, size_t bytes, bool client_read_only,
    struct ze_shm *ret);
void ze_shm_destroy(struct ze_engine *e, struct ze_shm *shm);

struct ze_stats {
	uint64_t pinned_steps;		/* tensor steps served from the pinned tier */
	uint64_t nvme_steps;
	/*
	 * Optimizer state stepped, in bytes (zk_state_bytes of the format: for
	 * fp32 master, m and v, 12 per element, whatever the optimizer uses of
	 * them), by the tier that served it: the
	 * pinned hit rate is their share, so a 1 GiB tensor on NVMe weighs more
	 * than a pinned bias.
	 */
	uint64_t pinned_step_bytes;
	uint64_t nvme_step_bytes;
	uint64_t chunks_read;
	uint64_t chunks_written;
	uint64_t chunks_skipped;	/* already at the step: a retry's landed part */
	uint64_t bytes_read;
	uint64_t bytes_written;
	uint64_t io_errors;
	uint64_t compute_waits;		/* compute idle while chunks were being read */
	uint64_t compute_wait_ns;
	uint64_t io_waits;		/* chunks ready to read, every staging buffer busy */
	uint64_t io_wait_ns;
	/*
	 * Where the staging buffers' time goes in a step's chunks, summed over
	 * buffers: from the read's start until it landed, from then until the
	 * step computed it (waiting on the stepper included), and from then
	 * until its write landed (the buffer cannot be reused before: the write
	 * is from it, and it is the chunk's copy if the process dies meanwhile).
	 */
	uint64_t staging_read_ns;
	uint64_t staging_compute_ns;
	uint64_t staging_write_ns;
	uint64_t param_fetches;
	uint64_t param_hits;
	uint64_t param_misses;
	uint64_t param_bytes_staged;
	uint64_t param_releases;
	uint64_t param_bytes_written;
	unsigned staging_buffers;
	uint64_t shm_bytes;
	unsigned shm_objects;
	uint64_t shm_budget;
};
void ze_engine_stats(const struct ze_engine *e, struct ze_stats *ret);
struct zt_arena_stats;
void ze_engine_arena_stats(const struct ze_engine *e, struct zt_arena_stats *ret);

#endif
