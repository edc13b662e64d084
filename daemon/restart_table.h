/*
 * The restart table's layout and write-through (restart_table.c).  Job code calls only
 * the five zd_restart_room / keep / forget functions at the end; the layout above them is
 * restart.c's and restart_table.c's, which write and read the table.
 */
#ifndef ZD_RESTART_TABLE_H
#define ZD_RESTART_TABLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "config.h"

struct zd_daemon;
struct zd_job;
struct zd_tensor;
struct ze_tensor;

#define ZD_TABLE_MAGIC 0x316c6274666f7a7aull	/* "zzoftbl1" */
#define ZD_TABLE_VERSION 1u
#define ZD_TABLE_JOBS 1024
/*
 * A uid's share of the table: the jobs one uid (but root) may hold at once, so that one
 * uid cannot take every slot.  A job is refused when its slot cannot be had, never made
 * without one: a tensor kept for a job the table does not list makes a restart refuse.
 */
#define ZD_TABLE_UID_JOBS (ZD_TABLE_JOBS / 4)

enum { SWAP_FILE = 1, SWAP_UNNAMED = 2, SWAP_BLOCKDEV = 3 };

/* A swap path as the state was written to it: a restart must find this very file. */
struct zd_table_swap {
	char path[256];
	uint64_t dev;
	uint64_t ino;
	uint64_t size;
	uint32_t kind;
	uint32_t pad;
};

struct zd_table_job {
	uint64_t id;			/* 0: a free slot */
	uint32_t uid;
	uint32_t world_size;
	uint64_t pinned_budget;
	uint32_t policy;
	uint32_t state_format;		/* enum zk_state_format */
	char name[128];
};

/*
 * One memfd, kept as "table": what the engine's records do not say (the
 * swap files, the jobs).  Tensors are their own records (engine/record.c);
 * their owner words name the job by id.  crc covers everything after it.
 */
struct zd_table {
	uint64_t magic;
	uint32_t version;
	uint32_t crc;
	uint32_t nswap;
	uint32_t block_size;		/* swap.block_size the stripes were laid with (0: not kept) */
	uint64_t chunk_elements;
	struct zd_table_swap swap[ZD_MAX_SWAP_PATHS];
	struct zd_table_job jobs[ZD_TABLE_JOBS];
};

enum { OWNER_JOB, OWNER_RANK, OWNER_UID };

/* Seals the table after a change: crc covers everything after it. */
uint32_t zd_restart_table_crc(const struct zd_table *t);
void zd_restart_table_seal(struct zd_daemon *d);
/* fd into the store as name (kept: in systemd's store already, listed, not sent again). */
int zd_restart_keep_fd(struct zd_daemon *d, const char *name, int fd, bool kept);

/*
 * Whether a new job of uid can have a slot in the recovery table: 0, or -ENOSPC (full) or
 * -EDQUOT (uid holds its share, a quarter of the slots; root has no share) with err.
 */
int zd_restart_room(struct zd_daemon *d, uid_t uid, char *err, size_t errlen);
/* Write-through of the recovery table and the store as jobs and tensors come and go. */
void zd_restart_keep_job(struct zd_daemon *d, struct zd_job *job);
void zd_restart_forget_job(struct zd_daemon *d, struct zd_job *job);
void zd_restart_keep_tensor(struct zd_daemon *d, struct zd_tensor *t);
void zd_restart_forget_tensor(struct zd_daemon *d, struct ze_tensor *et);

#endif
