/* libzclient: a training process's connection to zoffloadd. */
#ifndef ZCLIENT_H
#define ZCLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ZC_API __attribute__((visibility("default")))

/*
 * Every call returns 0 (or a count) on success and a negative errno on
 * failure; zc_errmsg() then says what went wrong.  One connection must not be
 * used by two threads at once; separate connections are independent.
 */
struct zc_conn;
struct zc_tensor;

enum zc_dtype { ZC_F32 = 0, ZC_BF16 = 1, ZC_F16 = 2 };
enum zc_optim { ZC_ADAMW = 0, ZC_ADAM = 1, ZC_ADAGRAD = 2, ZC_LION = 3 };
enum zc_state { ZC_STATE_MASTER = 0, ZC_STATE_EXP_AVG = 1, ZC_STATE_EXP_AVG_SQ = 2 };

/* Step outcome, per tensor and per submitted set. */
enum zc_step_status {
	ZC_STEP_APPLIED = 0,
	ZC_STEP_SKIPPED_NONFINITE = 1,	/* inf/NaN gradient somewhere in the set: nothing applied */
	ZC_STEP_FAILED = 2,		/* see error */
};

/*
 * NULL socket path: $ZOFFLOAD_SOCKET, else the built-in default.  On failure
 * *ret is left as it was and zc_connect_errmsg() says why.
 */
ZC_API int zc_connect(const char *socket_path, struct zc_conn **ret);
/*
 * Why this thread's last zc_connect or zc_connect_timeout failed ("no error"
 * after one that succeeded, or none yet): a failed connect has no connection
 * to carry its message.  Kept per thread, valid until the thread's next
 * connect.  It names the socket path tried; -EACCES names the group the
 * socket admits ("permission denied on /run/zoffload/zoffload.sock: add your
 * user to group zoffload ..."), and a refusal by the daemon (-EUSERS at
 * limits.max_clients) carries the daemon's reason.  zc_errmsg(NULL) gives
 * the same text.
 */
ZC_API const char *zc_connect_errmsg(void);
/*
 * Closes the connection and unmaps its tensors' slots.  Without zc_job_close
 * first the daemon treats it as a rank that died: it keeps this rank's
 * tensors (state and slots) detached for limits.detach_grace_s, for a new
 * process of the same job and rank to take back, then frees them.
 */
ZC_API void zc_disconnect(struct zc_conn *conn);
/* Text of the last error on this connection (never NULL; NULL: zc_connect_errmsg()'s). */
ZC_API const char *zc_errmsg(const struct zc_conn *conn);

/*
 * Timeouts.  Nothing waits for ever unless asked to: each call that waits
 * for the daemon has a bound.
 *
 * - Requests (every call that sends one and waits for its reply: register,
 *   read, write, job calls, ping, stats...) wait at most the connection's
 *   timeout: zc_connect_timeout sets it, HELLO included; zc_set_timeout
 *   changes it; -1 (zc_connect's default) means none; 0 is refused.  On
 *   expiry they return -ETIMEDOUT.  A request that only reads (zc_ping,
 *   zc_stats_json, zc_jobs_json) leaves the connection usable: its late
 *   reply is skipped.  Any other request may still be carried out by the
 *   daemon after it timed out, so the client no longer knows what the
 *   daemon holds for it: the connection is then unusable, every later
 *   request fails with -ENOTCONN (zc_errmsg says why) and the caller
 *   disconnects and connects again.  A send that finds no room in time
 *   (a stopped daemon does not read) sends nothing and breaks nothing;
 *   zc_step_submit and zc_param_prefetch, which only send, are bounded so.
 * - Waits (zc_wait_tensor_timeout, zc_wait_all_timeout,
 *   zc_param_wait_timeout) take their own timeout_ms: -1 none, 0 only
 *   apply what has already arrived.  On expiry they return -ETIMEDOUT and
 *   nothing is lost: the step or fetch goes on, and a later wait picks up
 *   its result.  Their timeout does not break the connection.
 * - zc_conn_fd is the connection's socket, for poll/epoll (POLLIN: a
 *   message has arrived).  Never read, write or close it; it is
 *   non-blocking.  When it polls readable, a wait with timeout 0 applies
 *   what arrived and says whether what it waits for is done.
 */
ZC_API int zc_connect_timeout(const char *socket_path, int timeout_ms, struct zc_conn **ret);
ZC_API int zc_set_timeout(struct zc_conn *conn, int timeout_ms);
ZC_API int zc_conn_fd(const struct zc_conn *conn);

/*
 * Reconnects.  When the connection goes away (zoffloadd restarted or
 * crashed, the socket was cut: EOF, ECONNRESET, EPIPE, or "zoffloadd is
 * shutting down"), the next call, or the one under way, connects again to
 * the same socket path, retrying with backoff for the reconnect timeout;
 * reopens the job (same name, rank, world size, options); registers every
 * tensor again with the same descriptor, which must come back as taken back
 * (TENSOR_OK resumed, see zc_tensor_register) with its state; keeps the slot
 * mappings when the daemon hands back the same files, or else maps the new
 * files at the same addresses (the grads already written are copied across),
 * so pointers from zc_tensor_grad_slot/param_slot stay valid; and sends
 * again what had no answer: the request under way, the steps submitted and
 * not done, the parameter fetches.  A step the daemon had already applied
 * (the tensor's last step says so) is not submitted again: it ends as
 * applied, with grad_norm NaN as its result was lost.  The caller sees a
 * delay, and a count in zc_conn_stats.
 *
 * - timeout_ms: how long to keep trying, from when the connection was found
 *   gone; -1 without bound; 0: no reconnects, a call that finds the
 *   connection gone fails with -ECONNRESET ("zoffloadd closed the
 *   connection"), the behaviour before reconnects.  The default comes from
 *   $ZOFFLOAD_RECONNECT_MS at connect (the same meaning; zc_connect fails
 *   with -EINVAL when it is not an integer >= -1), else 60000.
 * - When the timeout passes, the call fails with -ECONNRESET and a message
 *   naming the socket and the last reason it could not connect.
 * - When the daemon answers but no longer has the job's state (a tensor
 *   comes back new: it restarted without keeping it), nothing is
 *   re-initialized: the call fails with -ESTALE, "zoffloadd lost the state of
 *   job ...".
 * - Either way the connection is then dead: every later call fails the same
 *   way; the caller disconnects.
 * - A wait with a timeout (zc_wait_*_timeout, zc_param_wait_timeout) stops
 *   trying to connect at its own timeout (-ETIMEDOUT, nothing lost: a later
 *   call goes on from there); every other call rides the reconnect through.
 * - zc_conn_fd keeps its number across a reconnect (the new socket takes the
 *   old one's place), so poll() goes on; an epoll set must add it again.
 *   While the connection is gone it polls readable (hung up): a wait with
 *   timeout 0 then reconnects.
 * - A slot whose mapping was replaced (other files) has new pages: a driver
 *   that registered the old ones (libzclient_cuda) lets go of them first
 *   (zc_tensor_set_param_pin's unpin, then the slots hook with
 *   ZC_SLOTS_REMAP, which stays installed for the unmap), so its copies go
 *   on through pageable memory.  The daemon hands back the same files when
 *   it keeps the state, so this is rare.
 */
ZC_API int zc_set_reconnect(struct zc_conn *conn, int timeout_ms);

struct zc_conn_stats {
	uint64_t reconnects;		/* times the connection came back */
	uint64_t reconnect_ns;		/* time from finding it gone to reattached, summed */
	uint64_t steps_resubmitted;	/* sets submitted again after a reconnect */
	uint64_t steps_completed_away;	/* sets the daemon finished while the connection was gone */
	uint64_t slots_remapped;	/* slots that came back in other files, mapped in place */
};
ZC_API void zc_conn_stats(const struct zc_conn *conn, struct zc_conn_stats *ret);

/*
 * One job per connection: the ranks of one training run share a name.  Names
 * are per uid: "NAME" is the caller's own job (no other uid can take or join
 * it), "UID:NAME" another uid's, which only root may join.  A
 * rank whose process died (no zc_job_close) keeps its state in the daemon for
 * limits.detach_grace_s; a new process opening the same job and rank and
 * registering the same tensors gets that state back (zc_tensor_last_step).
 */
ZC_API int zc_job_open(struct zc_conn *conn, const char *job_name, uint32_t rank,
    uint32_t world_size);

/* Where the job's optimizer state lives; decided by the job's first rank. */
enum zc_policy {
	ZC_POLICY_DEFAULT = 0,	/* the daemon's memory.policy */
	ZC_POLICY_CPU = 1,	/* pinned host memory only */
	ZC_POLICY_NVME = 2,	/* NVMe swap, stepped through pinned staging buffers */
	ZC_POLICY_AUTO = 3,	/* pinned while it fits the job's budget, the rest on NVMe */
};

struct zc_job_options {
	enum zc_policy policy;
	uint64_t pinned_budget;	/* bytes of pinned state for the job; 0: the daemon's default */
	/*
	 * How the job's optimizer state is kept, decided by its first rank (a
	 * later rank naming another is refused): NULL or "" for the daemon's
	 * memory.state_format; "fp32"; "bf16-moments" (m and v in bf16) or
	 * "q8-moments" (m and v in 8 bits per 256-element block), both with an
	 * fp32 master, or "bf16-master+q8" (q8 m and v, master in bf16 rounded
	 * stochastically by the step), stepping AdamW and Adam only, in about
	 * 20, 16 or 12 bytes moved per parameter where fp32 moves 28.
	 * zc_tensor_read/write stay fp32: a write of exp_avg or exp_avg_sq is
	 * quantized, one of a bf16 master rounded to nearest even.  An unknown
	 * name is refused with the list.  Since ZCLIENT_0.2 (zc_job_open_opts
	 * of ZCLIENT_0.1 takes the struct without it).
	 */
	const char *state_format;
};

ZC_API int zc_job_open_opts(struct zc_conn *conn, const char *job_name, uint32_t rank,
    uint32_t world_size, const struct zc_job_options *options);
/* The open job's state format as the daemon keeps it ("fp32", "q8-moments", ...); "" with no job. */
ZC_API const char *zc_job_state_format(const struct zc_conn *conn);
/* Highest step any rank of the open job has completed (0 for a new job). */
ZC_API uint64_t zc_job_last_step(const struct zc_conn *conn);
/*
 * Frees this rank's state in the daemon now: the tensors registered on this
 * connection, and those an earlier process of this rank left detached that
 * this one did not take back.  Other ranks keep theirs; the job ends when no
 * rank has any left.  -EBUSY while steps are in flight.  The connection may
 * open a job again.
 */
ZC_API int zc_job_close(struct zc_conn *conn);
/*
 * Frees a whole job of this uid (root: any, as "UID:NAME"; a plain name is
 * root's own job, else the one job of that name, -ENOTUNIQ when several uids
 * have one): every rank's state, attached or detached.  Its connected ranks
 * are disconnected (their next call fails with -ECONNABORTED).  -EBUSY on a
 * rank of that job: zc_job_close there.
 */
ZC_API int zc_job_drop(struct zc_conn *conn, const char *job_name);

struct zc_tensor_desc {
	const char *name;		/* unique within the job and rank, <= 127 bytes */
	uint64_t numel;
	enum zc_dtype grad_dtype;	/* what the client writes into the grad slot */
	enum zc_dtype param_dtype;	/* what the daemon writes into the param slot */
	bool param_offload;		/* params live on the daemon's tiers between uses */
};

/*
 * init: numel fp32 initial master values (copied; the call returns when they
 * are in).  When the tensor is taken back from a rank that died, init is not
 * used and zc_tensor_last_step() says which step its state is at; -EAGAIN
 * means a step the dead process submitted is still running on it: register
 * again shortly.  Past a limit: -ENOSPC when memory.pinned_budget (no swap
 * to spill to, or policy cpu), memory.shm_budget or the swap.paths are
 * full; -EDQUOT past the job's pinned budget (policy cpu) or
 * limits.uid_pinned_budget / limits.uid_swap_budget; zc_errmsg() names the
 * limit.  zc_connect returns -EUSERS past limits.max_clients or
 * limits.max_clients_per_uid.
 */
ZC_API int zc_tensor_register(struct zc_conn *conn, const struct zc_tensor_desc *desc,
    const float *init, struct zc_tensor **ret);
ZC_API int zc_tensor_unregister(struct zc_tensor *tensor);
ZC_API uint64_t zc_tensor_numel(const struct zc_tensor *tensor);
/* Last step applied to this tensor: 0 when new, the step to resume after when taken back. */
ZC_API uint64_t zc_tensor_last_step(const struct zc_tensor *tensor);
/* Shared memory the client writes gradients into and reads parameters from. */
ZC_API void *zc_tensor_grad_slot(struct zc_tensor *tensor, size_t *ret_bytes);
ZC_API const void *zc_tensor_param_slot(struct zc_tensor *tensor, size_t *ret_bytes);
/*
 * Param views, for a framework whose parameters should live in the param slot
 * with no copy out after each step.  With views on, each tensor the connection
 * registers also gets a private writable mapping of its param slot:
 * - it reads the daemon's values (each step's new params show through) on
 *   every page the process has not written;
 * - a page the process writes becomes its own copy, which the daemon never
 *   sees and which no longer follows the steps.
 *   zc_tensor_param_view_written counts such pages (from /proc/self/pagemap);
 *   the caller hands their values to the daemon (zc_tensor_write of the
 *   master) and then zc_tensor_param_view_reset drops the copies, so that the
 *   view follows the slot again.
 * - a reconnect that brings the slot back in another file moves the view onto
 *   it at the same address, carrying the pages the process wrote.
 * zc_tensor_param_view is NULL (and *ret_bytes 0) for a tensor without one;
 * the other two then return -ENOENT.  Writes are found from userfaultfd's
 * asynchronous write protection where the kernel allows it (Linux 6.7 and no
 * seccomp filter refusing userfaultfd: a fraction of a millisecond per 400 MB
 * of view), else from /proc/self/pagemap page by page (tens of milliseconds);
 * zc_tensor_param_view_tracking says which: "userfaultfd", "pagemap" or "none"
 * ($ZOFFLOAD_PARAM_VIEW_TRACKING=pagemap forces pagemap).
 */
ZC_API int zc_conn_set_param_views(struct zc_conn *conn, bool on);
ZC_API void *zc_tensor_param_view(struct zc_tensor *tensor, size_t *ret_bytes);
ZC_API int zc_tensor_param_view_written(struct zc_tensor *tensor, uint64_t *ret_pages);
ZC_API int zc_tensor_param_view_reset(struct zc_tensor *tensor);
ZC_API const char *zc_tensor_param_view_tracking(const struct zc_tensor *tensor);
/*
 * A layer that registered the slots with a driver (libzclient_cuda:
 * cudaHostRegister) must let go of their pages before they change; the slots
 * hook says when, and why:
 * - ZC_SLOTS_UNMAP: just before the slots are unmapped (zc_tensor_unregister,
 *   zc_job_close, zc_disconnect).  The last call: the tensor goes with it.
 * - ZC_SLOTS_REMAP: a reconnect is about to map other files over the slots
 *   at the same addresses.  The tensor lives on, and so does the hook: it runs
 *   again (ZC_SLOTS_UNMAP at the latest).  What the layer holds for the
 *   tensor must survive this call; only the old pages go.
 * One hook per tensor (zc_tensor_set_release_hook's included: setting either
 * replaces the other); fn NULL removes it.
 */
enum zc_slots_event {
	ZC_SLOTS_UNMAP = 0,
	ZC_SLOTS_REMAP = 1,
};
typedef void zc_slots_fn(struct zc_tensor *tensor, enum zc_slots_event why, void *arg);
ZC_API void zc_tensor_set_slots_hook(struct zc_tensor *tensor, zc_slots_fn *fn, void *arg);
/*
 * The older form, not told why: called once, before an unmap or before a
 * remap, and removed after a remap (so a layer using it must not free what
 * the tensor's other users still hold; prefer zc_tensor_set_slots_hook).
 */
typedef void zc_release_fn(struct zc_tensor *tensor, void *arg);
ZC_API void zc_tensor_set_release_hook(struct zc_tensor *tensor, zc_release_fn *fn, void *arg);
/*
 * Pointers into a tensor's slots that outlive it: a binding whose user may
 * still hold views of them (torch.frombuffer of a slot, a parameter's storage
 * that a framework's thread still references) cannot take them back.  With
 * kept set, the tensor's going (zc_tensor_unregister, zc_job_close,
 * zc_disconnect) leaves its slots mapped where they are, holding what they
 * held, fills *kept with their ranges and does not unmap them: the caller
 * munmaps each range when the last pointer into it is gone.  The daemon has
 * let go of the files then and no longer counts their pages; they are the
 * process's memory until that munmap.  *kept must stay valid until the
 * tensor goes or kept is set back to NULL (the default: the slots are
 * unmapped with the tensor).  The slots hook still runs (ZC_SLOTS_UNMAP):
 * a driver's registration of the pages ends with the tensor.
 */
struct zc_kept_slots {
	struct { void *addr; size_t bytes; } grad, param, param_view;	/* addr NULL: none */
};
ZC_API void zc_tensor_keep_slots(struct zc_tensor *tensor, struct zc_kept_slots *kept);
/*
 * A param slot pinned by a driver.  zc_param_release makes the daemon drop
 * the pages of a param_offload tensor's slot, and the next fetch refills it
 * with new ones: a driver that pinned the old pages (cudaHostRegister) would
 * go on copying stale parameters from them.  So a layer that pins a param
 * slot says so with the function that unpins it (waiting for its copies);
 * zc_param_release calls it for each such tensor it is about to release,
 * before asking the daemon, after which the slot is no longer pinned.  When
 * an unpin fails (its negative errno) nothing is released and that error
 * comes back.  Tensors without param_offload are never released, so never
 * unpinned.  unpin NULL: the slot is no longer pinned.
 */
typedef int zc_unpin_fn(struct zc_tensor *tensor, void *arg);
ZC_API void zc_tensor_set_param_pin(struct zc_tensor *tensor, zc_unpin_fn *unpin, void *arg);
ZC_API bool zc_tensor_param_pinned(const struct zc_tensor *tensor);
/* Copy out count fp32 values of master weights or moments starting at offset. */
ZC_API int zc_tensor_read(struct zc_tensor *tensor, enum zc_state which, uint64_t offset,
    uint64_t count, float *dst);

/*
 * Write count fp32 values of master weights or moments starting at offset
 * (loading saved state; master also refreshes the param slot), then say with
 * zc_tensor_set_step which step that state is at: the next step submitted
 * must be above it.  Adagrad keeps its sum of squares in ZC_STATE_EXP_AVG:
 * torch's initial_accumulator_value is that array written before step 1.
 */
ZC_API int zc_tensor_write(struct zc_tensor *tensor, enum zc_state which, uint64_t offset,
    uint64_t count, const float *src);
ZC_API int zc_tensor_set_step(struct zc_tensor *tensor, uint64_t step);

struct zc_step_params {
	enum zc_optim optim;
	uint64_t step;			/* 1-based; PyTorch's state['step'] after its increment */
	double lr;
	double beta1;
	double beta2;
	double eps;
	double weight_decay;
	double lr_decay;		/* Adagrad */
	double grad_scale;		/* fp16 loss scale the gradients carry; 0 or 1 = none */
	double max_grad_norm;		/* > 0: clip the set's global norm to this */
	bool no_bias_correction;	/* Adam/AdamW: skip bias correction */
	bool check_finite;		/* skip the whole set if any gradient is inf/NaN */
	/*
	 * > 0: multiply the gradients by this, in (0, 1] (zc_clip_coef of the
	 * norm over every rank's zc_grad_pass); max_grad_norm is then unused.
	 */
	double clip_coef;
};

struct zc_step_result {
	uint64_t step;
	enum zc_step_status status;
	int error;			/* negative errno when status is ZC_STEP_FAILED */
	double grad_norm;		/* global L2 norm of the set's unscaled gradients, when computed */
	uint64_t latency_ns;		/* daemon-side, submit to done */
};

/*
 * Queue a step over tensors; returns without waiting.  The grad slots must
 * hold the gradients; the param slots are written when each tensor is done.
 * Until then the client must not touch those slots.
 */
ZC_API int zc_step_submit(struct zc_conn *conn, const struct zc_step_params *params,
    struct zc_tensor *const *tensors, size_t ntensors);
ZC_API int zc_wait_tensor(struct zc_tensor *tensor, struct zc_step_result *ret);
/* Waits for every submitted step; ret (nullable) gets the last set's result. */
ZC_API int zc_wait_all(struct zc_conn *conn, struct zc_step_result *ret);
/* The same, at most timeout_ms (see Timeouts above): -ETIMEDOUT when not done by then. */
ZC_API int zc_wait_tensor_timeout(struct zc_tensor *tensor, struct zc_step_result *ret,
    int timeout_ms);
ZC_API int zc_wait_all_timeout(struct zc_conn *conn, struct zc_step_result *ret,
    int timeout_ms);

/*
 * Clipping and overflow skip over the whole model, across ranks and nodes,
 * in two phases.  zc_grad_pass returns this set's share (waits for it); the
 * ranks add their shares (sumsq and nonfinite: an all-reduce sum, in double
 * for the norm); then every rank either skips the step (nonfinite > 0) or
 * submits it with clip_coef = zc_clip_coef(max_norm, total sumsq), which is
 * torch.nn.utils.clip_grad_norm_'s max_norm / (norm + 1e-6) capped at 1.
 */
struct zc_grad_partial {
	double sumsq;			/* squared L2 norm of the unscaled gradients */
	uint64_t nonfinite;		/* inf/NaN gradients */
	uint64_t elements;
};
ZC_API int zc_grad_pass(struct zc_conn *conn, struct zc_tensor *const *tensors,
    size_t ntensors, double grad_scale, struct zc_grad_partial *ret);
ZC_API double zc_clip_coef(double max_norm, double total_sumsq);

/*
 * Parameter offload (ZeRO-Infinity offload_param), for tensors registered
 * with param_offload: after zc_param_release the param slot's memory goes
 * back to the system and the parameters live on the daemon's tiers (pinned
 * or NVMe, beside the tensor's state).  zc_param_prefetch asks for a list of
 * tensors ahead of use without waiting; zc_param_wait returns once that
 * tensor's slot holds its parameters again, waiting only if they have not
 * arrived.  Release only what the GPU has copied; a step refills the slot.
 * A slot pinned by a driver is unpinned first (zc_tensor_set_param_pin).
 */
ZC_API int zc_param_prefetch(struct zc_conn *conn, struct zc_tensor *const *tensors,
    size_t ntensors);
ZC_API int zc_param_wait(struct zc_tensor *tensor);
ZC_API int zc_param_wait_timeout(struct zc_tensor *tensor, int timeout_ms);
ZC_API int zc_param_release(struct zc_conn *conn, struct zc_tensor *const *tensors,
    size_t ntensors);

/*
 * What zc_param_wait found, counted in this process.  These are not hits: a
 * hit is the daemon's word (pipeline.params.hits in zoffctl stats: a fetch
 * that found the parameters already in the slot, nothing staged).  A
 * prefetch the daemon had to stage (its miss) that lands before the wait is
 * `ready` here: the prefetch hid the staging.
 */
struct zc_param_stats {
	uint64_t ready;		/* waits that found the params there: no waiting */
	uint64_t waited;	/* waits that had to wait for them (or fetch them itself) */
	uint64_t wait_ns;	/* time spent waiting in zc_param_wait */
};
ZC_API void zc_param_stats(const struct zc_conn *conn, struct zc_param_stats *ret);

/*
 * Control: round trip time; daemon stats and jobs as JSON (free() the string),
 * of any size.  A uid other than root is shown its own jobs and uid and the
 * node's totals; root everything.
 */
ZC_API int zc_ping(struct zc_conn *conn, uint64_t *ret_rtt_ns);
ZC_API int zc_stats_json(struct zc_conn *conn, char **ret_json);
ZC_API int zc_jobs_json(struct zc_conn *conn, char **ret_json);

/*
 * Checkpoints: a rank's optimizer state saved into a directory, one safetensors file per
 * rank (rank-RRRRR-of-WWWWW.safetensors: NAME/master F32, NAME/exp_avg and NAME/exp_avg_sq
 * as the job's state format keeps them (F32, BF16, or U8 codes with NAME/exp_avg_scale and
 * NAME/exp_avg_sq_scale, F32 per 256-element block), and in the header's __metadata__ the optimizer, the last hyperparameters, rank, world
 * size, and per tensor its step, its state format, its place in its logical parameter and
 * a CRC-32C per array).  Any rank layout can be restored into any other.
 *
 * Each entry names a registered tensor and where it sits in its logical parameter:
 * global_name (NULL: the tensor's own name), global_offset and global_numel (0: the
 * tensor's numel, a parameter that is not sharded).
 */
struct zc_checkpoint_entry {
	struct zc_tensor *tensor;
	const char *global_name;
	uint64_t global_offset;
	uint64_t global_numel;
};

/*
 * Saves this rank's tensors into dir, between steps (no step of theirs in flight; the
 * call returns when the file is whole, so this rank's next step waits for it).  The
 * library creates the file under a temporary name in dir with the caller's permissions
 * and passes its descriptor to zoffloadd, which writes the state from wherever it lives
 * (pinned or NVMe); then fsync, rename into place, fsync of dir.  The file is whole or
 * absent: a rank file saved earlier under the same name stays readable until then, and
 * the daemon frees it after (the call does not wait for that).
 * last: the hyperparameters of the last step (saved for the resume, optim checked by it).
 * Each request of a save or a restore moves up to 64 Mi elements of a tensor (768 MiB of
 * state): a connection timeout (zc_set_timeout) must leave time for that.
 */
ZC_API int zc_checkpoint_save(struct zc_conn *conn, const char *dir,
    const struct zc_checkpoint_entry *entries, size_t nentries, const struct zc_step_params *last);

/*
 * Where a part of a tensor sits in its logical parameter: elements [offset, offset + count)
 * of the tensor are elements [global_offset, global_offset + count) of global_name, a
 * parameter of global_numel elements.  A framework's flat buffer (DeepSpeed's ZeRO
 * partition) holds parts of several parameters and padding that belongs to none: it is
 * saved and restored as one range per part, by the parameters' own names, so that any
 * other layout of them restores it.
 */
struct zc_checkpoint_range {
	uint64_t offset;		/* in the tensor */
	uint64_t count;			/* > 0 */
	const char *global_name;	/* not NULL */
	uint64_t global_offset;
	uint64_t global_numel;		/* > 0 */
};
struct zc_checkpoint_piece {
	struct zc_tensor *tensor;
	struct zc_checkpoint_range range;
};

/*
 * zc_checkpoint_save of pieces of tensors: each piece's range is saved as a tensor of the
 * file of its own (named TENSOR@OFFSET when it is not the whole tensor); elements in no
 * piece are not saved.  The pieces of a tensor must not overlap (-EINVAL); for q8-moments
 * state each starts on a 256-element block and ends on one or at the tensor's end.
 */
ZC_API int zc_checkpoint_save_pieces(struct zc_conn *conn, const char *dir,
    const struct zc_checkpoint_piece *pieces, size_t npieces, const struct zc_step_params *last);

/* A checkpoint directory opened for restoring: every rank file's header read and checked. */
struct zc_checkpoint;
ZC_API int zc_checkpoint_open(struct zc_conn *conn, const char *dir, struct zc_checkpoint **ret);
ZC_API void zc_checkpoint_close(struct zc_checkpoint *ckpt);
/* The hyperparameters saved with rank 0's file (step: the highest saved step). */
ZC_API int zc_checkpoint_step_params(struct zc_checkpoint *ckpt, struct zc_step_params *ret);

struct zc_checkpoint_place {
	const char *global_name;	/* NULL: desc->name */
	uint64_t global_offset;
	uint64_t global_numel;		/* 0: desc->numel */
};

/*
 * Registers a tensor whose state (master, both moments, step) comes from the checkpoint:
 * elements [global_offset, global_offset + desc->numel) of parameter global_name, taken
 * from whichever rank files hold them, whatever the world size and shard layout they were
 * saved with.  Every array read is checked against its CRC-32C.  A checksum mismatch, a
 * range no file holds, a truncated file, another optimizer than optim, an unknown dtype,
 * pieces at different steps: -EBADMSG (-ENOENT for a missing range), zc_errmsg names
 * the file and the tensor, and no tensor is left registered.
 */
ZC_API int zc_tensor_register_checkpoint(struct zc_conn *conn, const struct zc_tensor_desc *desc,
    struct zc_checkpoint *ckpt, const struct zc_checkpoint_place *place, enum zc_optim optim,
    struct zc_tensor **ret);
/*
 * State formats (zc_job_options.state_format): each tensor's is in the file's metadata
 * (NAME/state_format) and its arrays are as the format keeps them, restored raw (bit for
 * bit) into a job of that format.  zc_tensor_register_checkpoint refuses a tensor saved in
 * another format than the job's (-EBADMSG naming the file, the tensor and both formats),
 * and a q8-moments restore whose shards would split a 256-element block (-EINVAL naming
 * tensor and elements), unless allowed here: then the saved moments are decoded and
 * encoded into the job's format (quantized to 8 or 16 bits again, or widened to fp32).
 */
ZC_API void zc_checkpoint_allow_convert(struct zc_checkpoint *ckpt, bool allow);
/*
 * zc_tensor_register_checkpoint for n tensors (descs[i] at places[i]; places NULL: none
 * is a shard) into ret[i], faster: their restores overlap, so that zoffloadd reads one
 * tensor's file while it stores another's.  All or nothing: on an error (zc_errmsg names
 * the file and the tensor) none of the n is left registered.
 */
ZC_API int zc_tensors_register_checkpoint(struct zc_conn *conn, size_t n,
    const struct zc_tensor_desc *descs, struct zc_checkpoint *ckpt,
    const struct zc_checkpoint_place *places, enum zc_optim optim, struct zc_tensor **ret);

/*
 * zc_tensors_register_checkpoint with tensor i's state taken from nranges[i] ranges (the
 * next nranges[i] of ranges, in turn): each range from whichever rank files hold it, as a
 * place's.  Elements of a tensor in none of its ranges (a flat buffer's padding) start
 * with a zero master and zero moments.  Ranges of a tensor that overlap or reach past its
 * end: -EINVAL naming the tensor.
 */
ZC_API int zc_tensors_register_checkpoint_ranges(struct zc_conn *conn, size_t n,
    const struct zc_tensor_desc *descs, struct zc_checkpoint *ckpt,
    const struct zc_checkpoint_range *ranges, const size_t *nranges, enum zc_optim optim,
    struct zc_tensor **ret);

/* Conversions for clients that fill bf16/fp16 grad slots on the CPU. */
ZC_API uint16_t zc_f32_to_bf16(float f);
ZC_API float zc_bf16_to_f32(uint16_t h);
ZC_API uint16_t zc_f32_to_f16(float f);
ZC_API float zc_f16_to_f32(uint16_t h);

#ifdef __cplusplus
}
#endif

#endif
