/* zoffloadd's shell: the loop, the listening socket, sessions, jobs and uids around one engine. */
#ifndef ZD_DAEMON_H
#define ZD_DAEMON_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>
#include <sys/stat.h>

#include "config.h"
#include "fdstore.h"
#include "optim.h"
#include "stats.h"
#include "util.h"

struct event;
struct event_base;
struct ze_engine;
struct zd_session;
struct zd_job;
struct zd_uid;

/* Per swap path byte counters at the last housekeeping tick, for bandwidth. */
struct zd_swap_sample {
	uint64_t bytes_read;
	uint64_t bytes_written;
	double read_bps;
	double write_bps;
	int bad;			/* as last logged: 0, or why the path takes no new state */
};

struct zd_ckpt_io;
struct zd_ckpt_xfer;
struct zd_closer;
struct zd_closer_hooks;

/*
 * One per process.  Owns the engine (and through it every tensor's state),
 * the sessions, the jobs and the uids; server.c makes and ends it.
 */
struct zd_daemon {
	struct zd_config cfg;
	const char *config_path;
	bool config_from_file;
	struct event_base *base;
	int listen_fd;
	struct stat socket_st;		/* the socket we bound: only it is unlinked at exit */
	struct event *ev_listen;
	struct event *ev_signals[4];
	struct event *ev_stepper;
	struct event *ev_swap;
	struct event *ev_tick;		/* housekeeping, once a second */
	struct event *ev_watchdog;
	uint64_t last_tick_ns;
	struct zd_swap_sample swap_samples[ZD_MAX_SWAP_PATHS];
	struct ze_engine *engine;
	enum zk_isa isa;
	TAILQ_HEAD(, zd_session) sessions;
	unsigned nsessions;
	TAILQ_HEAD(, zd_job) jobs;
	unsigned njobs;
	uint64_t tensors_total;		/* every job's tensors and params, kept as they change */
	uint64_t params_total;
	TAILQ_HEAD(, zd_uid) uids;
	uint32_t next_session_id;	/* never reused: the engine's lanes are session ids */
	uint64_t next_job_id;
	unsigned fd_limit;		/* RLIMIT_NOFILE, raised to the hard limit at start */
	unsigned fd_base;		/* held by the daemon itself at start */
	unsigned client_fds;		/* held for clients: every uid's zd_uid.fds */
	int spare_fd;			/* closed to accept and refuse a client at EMFILE */
	bool draining;
	uint64_t started_ns;
	struct zd_step_stats steps;
	struct zd_ckpt_xfer *ckpt_xfers;	/* checkpoint.c: transfers (saves, restores) in flight */
	struct zd_ckpt_io *ckpt_io;		/* their file I/O threads */
	struct event *ev_ckpt;			/* those threads' eventfd */
	uint64_t ckpt_bytes;			/* written into checkpoint files */
	uint64_t ckpt_bytes_read;		/* read from them (restores) */
	unsigned ckpt_releasing;		/* CKPT_RELEASE files held or queued to close */
	uint64_t ckpt_released;			/* and closed */
	struct zd_closer *closer;		/* closer.c: client descriptors, closed off the loop */
	const struct zd_closer_hooks *closer_hooks;	/* what the loop does as they close */
	uint64_t closed_off_loop;		/* by it */
	/* restart.c, restart_table.c: what outlives the process, and what a restart found of it */
	struct zd_fdstore store;
	struct zd_table *table;
	int table_fd;
	bool adopting;				/* rebuilding: descriptors are in the store already */
	bool start_empty;			/* --start-empty, or recovery.start_empty */
	char *const *argv;			/* for a successor (SIGUSR2) */
	char exe[4096];				/* the binary's path, as started */
	bool handoff;				/* drain, then exec exe with the store */
	int kept_swap[ZD_MAX_SWAP_PATHS];	/* > 2: taken from the store for start_swap */
	int kept_swaplock[ZD_MAX_SWAP_PATHS];
	/*
	 * The store still lists them: start_swap takes the descriptors above (and zeroes
	 * them), so whether to send them again is remembered apart.
	 */
	bool swap_in_store[ZD_MAX_SWAP_PATHS];
	bool swaplock_in_store[ZD_MAX_SWAP_PATHS];
	int kept_journal;
	int kept_staging[256];
	unsigned nkept_staging;
	unsigned recovered_tensors;
	unsigned recovered_jobs;
};

/* server.c */
void zd_tick(struct zd_daemon *d);
/* A drain ends once the engine holds nothing more. */
void zd_maybe_finish(struct zd_daemon *d);

#endif
