/* zoffloadd's bookkeeping: the daemon, sessions, jobs, tensors and step batches. */
#ifndef ZD_DAEMON_H
#define ZD_DAEMON_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/queue.h>
#include <sys/types.h>

#include "arena.h"
#include "config.h"
#include "optim.h"
#include "proto.h"

struct event;
struct event_base;
struct zd_stepper;
struct zs_engine;
struct zs_extent;
struct zd_nvme_work;
struct zd_nvme_lane;
struct zd_task;
struct zd_session;
struct zk_pool;

/* A memfd the daemon created, sealed and mapped; passed to one client. */
struct zd_shm {
	int fd;
	void *map;
	size_t bytes;
};

struct zd_tensor {
	uint32_t handle;
	char name[ZP_NAME_MAX + 1];
	uint64_t numel;
	enum zk_dtype grad_dtype;
	enum zk_dtype param_dtype;
	struct zd_session *session;	/* NULL once orphaned by a session that went away */
	struct zd_job *job;
	void *state;			/* master, m, v in one arena allocation */
	size_t state_bytes;
	bool state_pinned;
	float *master;
	float *m;
	float *v;
	struct zd_shm grad_slot;
	struct zd_shm param_slot;
	bool param_offload;		/* low-precision params live on the tiers, slot staged on request */
	bool param_resident;		/* the param slot holds the current params */
	bool param_dirty;		/* ... newer than the store */
	void *param_store;		/* pinned store, or NULL when it is on NVMe */
	size_t param_store_bytes;
	bool param_store_pinned;
	uint64_t param_store_offset;	/* in extent, for NVMe tensors */
	bool on_nvme;			/* state lives in extent, chunk by chunk */
	struct zs_extent *extent;
	uint64_t chunk_elements;	/* elements per chunk on NVMe */
	uint8_t *chunks_written;	/* bit per chunk: written since placed (else it reads as zeros) */
	bool busy;			/* in a batch the stepper owns */
	uint64_t last_step;
	uint32_t rank;
	bool detached;			/* its rank died; kept for a reattach until the grace ends */
	uint64_t detached_ns;
	TAILQ_ENTRY(zd_tensor) detached_entry;
};

struct zd_job {
	TAILQ_ENTRY(zd_job) entry;
	uint64_t id;
	char name[ZP_NAME_MAX + 1];
	uid_t uid;
	uint32_t world_size;
	unsigned refs;			/* attached sessions plus orphaned tensors */
	unsigned ranks_attached;
	uint64_t tensors;
	uint64_t params;
	uint64_t steps_applied;
	uint64_t steps_skipped;
	uint64_t steps_failed;
	uint64_t last_step;
	bool dropping;			/* zoffctl drop: nothing is kept for a reattach */
	uint8_t policy;			/* enum zp_policy */
	uint64_t pinned_budget;		/* 0: only the daemon's */
	uint64_t pinned_bytes;
	uint64_t nvme_bytes;
	TAILQ_HEAD(, zd_tensor) detached;
	unsigned ndetached;
};

/* What one uid holds, against the per-uid limits. */
struct zd_uid {
	TAILQ_ENTRY(zd_uid) entry;
	uid_t uid;
	unsigned sessions;
	uint64_t pinned_bytes;
	uint64_t swap_bytes;
};

/* One STEP_SUBMIT: owned by the loop; its tasks run on the stepper. */
struct zd_batch {
	TAILQ_ENTRY(zd_batch) session_entry;	/* the session's in-flight list */
	struct zd_session *session;		/* NULL once the session went away */
	uint32_t lane;
	uint64_t request_id;
	struct zk_hparams hp;
	struct zk_hparams hp_run;		/* hp with the clip coefficient applied */
	enum zk_isa isa;
	bool check_finite;
	double max_grad_norm;
	uint64_t submit_ns;
	size_t count;
	struct zd_tensor **tensors;		/* NULL once that tensor is done */
	struct zk_tensor *views;		/* grads and params; state only when pinned */
	size_t *pending;			/* units (slices, chunks) not yet finished */
	int *errors;				/* first error per tensor */
	size_t tensors_left;
	struct zk_grad_stats check;		/* written by the CHECK task */
	enum zp_step_status status;
	int error;
	double grad_norm;
	uint64_t compute_ns;
};
TAILQ_HEAD(zd_batch_list, zd_batch);

struct zd_session {
	TAILQ_ENTRY(zd_session) entry;
	struct zd_daemon *daemon;
	uint32_t id;
	int fd;
	uid_t uid;
	gid_t gid;
	pid_t pid;
	char name[ZP_NAME_MAX + 1];
	bool hello_done;
	bool closing;			/* close once the output queue drains */
	struct event *ev_read;
	struct event *ev_write;
	TAILQ_HEAD(, zd_out) outq;
	unsigned outq_len;
	struct zd_job *job;
	uint32_t rank;
	struct zd_uid *uid_usage;
	struct zd_tensor **tensors;	/* indexed by handle - 1; NULL after unregister */
	uint32_t ntensor_slots;
	uint32_t tensor_cap;
	struct zd_batch_list inflight;
	struct zd_shm xfer;
	uint64_t connected_ns;
};

/* Rolling step statistics for zoffctl stats. */
#define ZD_RATE_BUCKETS 64
#define ZD_LATENCY_SAMPLES 256
struct zd_step_stats {
	uint64_t batches_applied;
	uint64_t batches_skipped;
	uint64_t batches_failed;
	uint64_t tensors_stepped;
	uint64_t params_stepped;
	uint64_t compute_ns;
	uint64_t rate_second[ZD_RATE_BUCKETS];	/* which second each bucket holds */
	uint64_t rate_params[ZD_RATE_BUCKETS];
	uint64_t latency_ns[ZD_LATENCY_SAMPLES];
	uint64_t latency_count;
};

/* A pinned buffer that holds one NVMe chunk (master, m, v) while it is read, stepped, written. */
struct zd_staging {
	TAILQ_ENTRY(zd_staging) entry;
	void *buf;
	size_t bytes;
	bool pinned;
};

/* Pipeline counters for zoffctl stats. */
struct zd_tier_stats {
	uint64_t pinned_steps;		/* tensor steps served from the pinned tier */
	uint64_t nvme_steps;		/* ... and from NVMe */
	uint64_t chunks_read;
	uint64_t chunks_written;
	uint64_t bytes_read;
	uint64_t bytes_written;
	uint64_t io_errors;
	uint64_t compute_waits;		/* compute idle while chunks were being read */
	uint64_t compute_wait_ns;
	uint64_t io_waits;		/* chunks ready to read, every staging buffer busy */
	uint64_t io_wait_ns;
	uint64_t param_fetches;		/* tensors asked for */
	uint64_t param_hits;		/* already in their slot */
	uint64_t param_misses;		/* staged from the store */
	uint64_t param_bytes_staged;
	uint64_t param_releases;
	uint64_t param_bytes_written;	/* dirty slots written back to the store */
};

/* Per swap path byte counters at the last housekeeping tick, for bandwidth. */
struct zd_swap_sample {
	uint64_t bytes_read;
	uint64_t bytes_written;
	double read_bps;
	double write_bps;
};

struct zd_daemon {
	struct zd_config cfg;
	const char *config_path;
	bool config_from_file;
	struct event_base *base;
	int listen_fd;
	struct event *ev_listen;
	struct event *ev_signals[4];
	struct event *ev_stepper;
	struct zt_arena *arena;
	struct zk_pool *pool;
	struct zd_stepper *stepper;
	struct zs_engine *swap;		/* NULL: no NVMe tier configured */
	struct event *ev_swap;
	struct event *ev_tick;		/* housekeeping, once a second */
	struct event *ev_watchdog;
	uint64_t last_tick_ns;
	struct zd_swap_sample swap_samples[ZD_MAX_SWAP_PATHS];
	struct zt_arena *staging_arena;
	struct zd_staging *staging;
	unsigned nstaging;
	TAILQ_HEAD(, zd_staging) staging_free;
	/* Sessions with chunks waiting for a staging buffer, served round robin. */
	TAILQ_HEAD(, zd_nvme_lane) nvme_lanes;
	unsigned tasks_outstanding;	/* on the stepper */
	uint64_t compute_idle_since;	/* when tasks_outstanding last fell to 0 */
	uint64_t io_blocked_since;	/* 0, or since when work waits for a buffer */
	struct zd_tier_stats tier;
	enum zk_isa isa;
	TAILQ_HEAD(, zd_session) sessions;
	unsigned nsessions;
	TAILQ_HEAD(, zd_job) jobs;
	TAILQ_HEAD(, zd_uid) uids;
	uint32_t next_session_id;
	uint64_t next_job_id;
	uint64_t shm_bytes;
	unsigned shm_objects;
	unsigned inflight_batches;
	unsigned inflight_xfers;	/* TENSOR_READ/WRITE on NVMe tensors; a drain waits for them */
	bool draining;
	uint64_t started_ns;
	struct zd_step_stats steps;
};

uint64_t zd_now_ns(void);

/* shm.c */
int zd_shm_create(struct zd_daemon *d, const char *name, size_t bytes, bool client_read_only,
    struct zd_shm *ret);
void zd_shm_destroy(struct zd_daemon *d, struct zd_shm *shm);

/* session.c */
void zd_session_accept(struct zd_daemon *d, int fd);
void zd_session_close(struct zd_session *s);
int zd_session_send(struct zd_session *s, const struct zp_msg *msg, const int *fds,
    unsigned nfds);
/* Error reply: code is a negative errno, the text says what was wrong. */
void zd_session_error(struct zd_session *s, uint64_t request_id, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void zd_session_verror(struct zd_session *s, uint64_t request_id, int code, const char *fmt,
    va_list ap) __attribute__((format(printf, 4, 0)));
struct zd_tensor *zd_session_tensor(struct zd_session *s, uint32_t handle);

/* requests.c */
void zd_handle_request(struct zd_session *s, const struct zp_msg *msg);

/* job.c */
int zd_job_attach(struct zd_session *s, const struct zp_job_open *req, char *err,
    size_t errlen);
/* keep: the rank died, its tensors wait detach_grace_s for a reattach. */
void zd_job_detach(struct zd_session *s, bool keep);
/* true when that was the last reference and the job is gone. */
bool zd_job_unref(struct zd_daemon *d, struct zd_job *job);
/* Frees detached tensors past the grace period, or all of them. */
void zd_job_expire_detached(struct zd_daemon *d, bool all);
int zd_job_drop(struct zd_session *s, const char *name, char *err, size_t errlen);
unsigned zd_job_detached_ranks(const struct zd_job *job);
struct zd_uid *zd_uid_get(struct zd_daemon *d, uid_t uid);
void zd_uid_put(struct zd_daemon *d, struct zd_uid *u);
/* *ret_resumed: an existing detached tensor of this rank was taken over. */
int zd_tensor_create(struct zd_session *s, const struct zp_tensor_register *req,
    struct zd_tensor **ret, bool *ret_resumed, char *err, size_t errlen);
/* Frees it now, or orphans it until its batch completes. */
void zd_tensor_release(struct zd_daemon *d, struct zd_tensor *t);
/* The param slot mirrors the master weights: elements [offset, offset + count) from src. */
void zd_tensor_write_param(struct zd_tensor *t, uint64_t offset, uint64_t count,
    const float *src);

/* step.c: the loop side of the step */
void zd_step_submit(struct zd_session *s, const struct zp_msg *msg);
void zd_step_completions(struct zd_daemon *d);
/* A unit of tensor i (slice or chunk) finished, with 0 or -errno. */
void zd_step_unit_done(struct zd_daemon *d, struct zd_batch *b, size_t i, int error);
void zd_step_post(struct zd_daemon *d, struct zd_task *task);
/* Clears busy; frees the tensor when its session went away and nobody keeps it. */
void zd_tensor_unbusy(struct zd_daemon *d, struct zd_tensor *t);

/* tier.c: where state lives, and the NVMe pipeline */
#define ZD_QUANTUM_ELEMENTS (4u << 20)
int zd_tier_start(struct zd_daemon *d);
void zd_tier_stop(struct zd_daemon *d);
int zd_tier_place(struct zd_session *s, struct zd_tensor *t, char *err, size_t errlen);
void zd_tier_release(struct zd_daemon *d, struct zd_tensor *t);
void zd_tier_queue_step(struct zd_daemon *d, struct zd_batch *b, size_t i);
void zd_tier_step_computed(struct zd_daemon *d, struct zd_task *task);
void zd_tier_xfer(struct zd_session *s, struct zd_tensor *t, const struct zp_msg *msg);
void zd_tier_param_fetch(struct zd_session *s, const struct zp_msg *msg);
void zd_tier_param_release(struct zd_session *s, const struct zp_msg *msg);

/* server.c */
void zd_tick(struct zd_daemon *d);

/* stats.c */
void zd_stats_record(struct zd_daemon *d, const struct zd_batch *b, uint64_t params);
char *zd_stats_json(struct zd_daemon *d);
char *zd_jobs_json(struct zd_daemon *d);

#endif
