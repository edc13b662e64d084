/* Jobs (the ranks of one training run), uids, and the daemon's side of each tensor. */
#ifndef ZD_JOB_H
#define ZD_JOB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/queue.h>
#include <sys/types.h>

#include "proto.h"
#include "uid.h"

struct zd_daemon;
struct zd_session;
struct ze_account;
struct ze_tensor;

/*
 * Descriptors a tensor holds in the daemon: its grad and param slots, the
 * read-only reopening of the param slot its client gets, and, so that it
 * outlives the process, its record and its pinned state's memfd (one fewer
 * on NVMe, one fewer with param offload; counted the same).
 */
#define ZD_TENSOR_FDS 5

/*
 * A client's name for one engine tensor.  Owned by its session (in
 * s->tensors) or, detached, by its job's list; zd_tensor_release frees it
 * and lets the engine tensor go (the engine keeps that while work holds it).
 */
struct zd_tensor {
	uint32_t handle;
	char name[ZP_NAME_MAX + 1];
	struct ze_tensor *et;
	struct zd_session *session;	/* NULL while detached */
	struct zd_uid *owner;		/* who registered it: holds its descriptors, slots and count */
	uint64_t shm_bytes;		/* its slots, as charged to owner */
	struct zd_job *job;
	uint32_t rank;
	bool detached;			/* its rank died; kept for a reattach until the grace ends */
	uint64_t detached_ns;
	struct zd_rank_group *group;	/* while detached: its rank's */
	TAILQ_ENTRY(zd_tensor) detached_entry;
};

/* A dead rank's detached tensors in a job, counted so that stats need not pair them up. */
struct zd_rank_group {
	TAILQ_ENTRY(zd_rank_group) entry;
	uint32_t rank;
	unsigned tensors;
};

/*
 * refs: one per attached session plus one per detached tensor; the job is
 * freed when the last goes.  Its account (the job's pinned budget) lives on
 * while tensors charged to it wait for their work to end.
 */
struct zd_job {
	TAILQ_ENTRY(zd_job) entry;
	TAILQ_ENTRY(zd_job) uid_entry;	/* in owner->job_list */
	uint64_t id;
	char name[ZP_NAME_MAX + 1];
	uid_t uid;
	struct zd_uid *owner;		/* counts the job in its jobs while it lives */
	uint32_t world_size;
	unsigned refs;
	unsigned ranks_attached;
	uint64_t tensors;
	uint64_t params;
	uint64_t state_bytes;		/* zk_state_bytes of its tensors, in its state_format */
	uint64_t steps_applied;
	uint64_t steps_skipped;
	uint64_t steps_failed;
	uint64_t last_step;
	bool dropping;			/* zoffctl drop: nothing is kept for a reattach */
	uint8_t policy;			/* enum zp_policy */
	uint8_t state_format;		/* enum zk_state_format of its tensors */
	uint64_t pinned_budget;		/* its account's, as opened (kept for a restart) */
	unsigned table_slot;		/* restart_table.c: its record in the recovery table, +1 (0: none) */
	struct ze_account *account;
	TAILQ_HEAD(, zd_tensor) detached;	/* oldest first */
	unsigned ndetached;
	TAILQ_HEAD(, zd_rank_group) rank_groups;
	unsigned detached_ranks;	/* groups in rank_groups */
};

struct ze_tensor_fds;
struct ze_adopt_report;

/* A job as a first rank opens it (id 0: the next) or as a restart finds it kept; NULL: no memory. */
struct zd_job *zd_job_new(struct zd_daemon *d, uid_t uid, const char *name,
    uint32_t world_size, uint8_t policy, uint64_t pinned_budget, uint8_t state_format,
    uint64_t id);
/*
 * A tensor kept across a restart, rebuilt detached in job for rank (its
 * process reattaches with the same name and takes it back, resumed).
 */
int zd_job_adopt_tensor(struct zd_daemon *d, struct zd_job *job, uint32_t rank,
    uid_t owner_uid, const struct ze_tensor_fds *fds, struct ze_adopt_report *rep,
    struct ze_tensor **ret_et, char *err, size_t errlen);
int zd_job_attach(struct zd_session *s, const struct zp_job_open *req, char *err,
    size_t errlen);
/* keep: the rank died, its tensors wait detach_grace_s for a reattach. */
void zd_job_detach(struct zd_session *s, bool keep);
/* true when that was the last reference and the job is gone. */
bool zd_job_unref(struct zd_daemon *d, struct zd_job *job);
/* Frees a job that holds nothing, its recovery-table slot left as it is (a refused start). */
void zd_job_discard(struct zd_daemon *d, struct zd_job *job);
/* Frees detached tensors past the grace period, or all of them. */
void zd_job_expire_detached(struct zd_daemon *d, bool all);
int zd_job_drop(struct zd_session *s, const char *name, char *err, size_t errlen);
unsigned zd_job_detached_ranks(const struct zd_job *job);
/*
 * *ret_resumed: an existing detached tensor of this rank was taken over and
 * holds all its initial values (else the client must write them again).
 */
int zd_tensor_create(struct zd_session *s, const struct zp_tensor_register *req,
    struct zd_tensor **ret, bool *ret_resumed, char *err, size_t errlen);
void zd_tensor_release(struct zd_daemon *d, struct zd_tensor *t);

#endif
