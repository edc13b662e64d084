/* What one uid holds against the per-uid limits, and the descriptors the daemon keeps for clients. */
#ifndef ZD_UID_H
#define ZD_UID_H

#include <stddef.h>
#include <stdint.h>
#include <sys/queue.h>
#include <sys/types.h>

struct zd_daemon;
struct zd_job;
struct ze_account;

/* Descriptors kept back from every uid but root, so that accept and root are never starved. */
#define ZD_FD_RESERVE 64

/*
 * One per uid that holds anything: sessions, tensors (a dead rank's
 * detached ones too), descriptors, shared memory, queued replies, jobs.
 * Forgotten by zd_uid_put once every count is back at zero.
 */
struct zd_uid {
	TAILQ_ENTRY(zd_uid) entry;
	uid_t uid;
	unsigned sessions;
	unsigned jobs;			/* jobs it owns (it named them) */
	TAILQ_HEAD(, zd_job) job_list;	/* the same, so that its stats need not look at others' */
	unsigned tensors;		/* registered by it and not yet freed */
	unsigned fds;			/* sockets, slots, windows and queued descriptors held for it */
	uint64_t shm_bytes;		/* its tensors' slots and its sessions' transfer windows */
	uint64_t queued_bytes;		/* replies its sessions have not read */
	unsigned closing;		/* of its fds, those waiting for a closer thread (closer.c) */
	unsigned metrics_conns;		/* its connections to the metrics endpoint (one fd each) */
	/*
	 * Its checkpoint transfers' piece buffers (limits.uid_ckpt_buffer_budget), and its
	 * transfers waiting for room there; each such transfer holds a descriptor, so the uid
	 * is not forgotten meanwhile.
	 */
	uint64_t ckpt_buffer_bytes;
	unsigned ckpt_waiting;
	struct ze_account *account;	/* the uid's budgets; tensors registered by it are charged here */
};

struct zd_uid *zd_uid_get(struct zd_daemon *d, uid_t uid);
/* Forgets u when it holds nothing. */
void zd_uid_put(struct zd_daemon *d, struct zd_uid *u);
/* After a reload: every uid's account takes the configured budgets. */
void zd_uid_reload_limits(struct zd_daemon *d);

/* At start: how many descriptors the daemon may open, and how many it holds already. */
void zd_fd_init(struct zd_daemon *d);
/* The per-uid descriptor cap in force: limits.uid_max_fds, or a quarter of what clients may hold. */
unsigned zd_uid_fd_cap(const struct zd_daemon *d);

/*
 * Takes n descriptors, shm bytes and tensors for u, or none of them: -EMFILE,
 * -ENFILE, -EDQUOT with err naming the limit.  Root passes the per-uid
 * limits and may use the reserve.
 */
int zd_uid_charge(struct zd_daemon *d, struct zd_uid *u, unsigned fds, uint64_t shm,
    unsigned tensors, char *err, size_t errlen);
/* A descriptor the daemon holds already (a client sent it): charged whatever the caps. */
void zd_uid_hold_fd(struct zd_daemon *d, struct zd_uid *u);
void zd_uid_refund(struct zd_daemon *d, struct zd_uid *u, unsigned fds, uint64_t shm,
    unsigned tensors);
/*
 * Counts what already exists whatever the limits are now (state a restart took back):
 * zd_uid_charge without its checks, undone by zd_uid_refund.
 */
void zd_uid_count(struct zd_daemon *d, struct zd_uid *u, unsigned fds, uint64_t shm,
    unsigned tensors);

#endif
