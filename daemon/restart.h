/* A restart is a pause: the recovery table, keeping state in the fd store, rebuilding it at start. */
#ifndef ZD_RESTART_H
#define ZD_RESTART_H

#include <stddef.h>
#include <sys/types.h>

struct zd_daemon;
struct zd_job;
struct zd_tensor;
struct ze_tensor;

/*
 * Before the engine starts: takes what the store handed back (LISTEN_FDS)
 * and checks it whole (the table's version and checksum, every tensor
 * record's, the swap files' identity and size) before anything is touched.
 * 0: go on (d->kept_* filled, or nothing kept); < 0: refuse to start, the
 * reason logged, nothing overwritten (unless start_empty set it aside).
 */
int zd_recover_begin(struct zd_daemon *d);
/* After the engine starts: keeps its swap files, journal and staging; rebuilds every kept tensor. */
int zd_recover_finish(struct zd_daemon *d);
void zd_recover_end(struct zd_daemon *d);

/*
 * Whether a new job of uid can have a slot in the recovery table: 0, or -ENOSPC (full) or
 * -EDQUOT (uid holds its share, a quarter of the slots; root has no share) with err.
 */
int zd_table_room(struct zd_daemon *d, uid_t uid, char *err, size_t errlen);

/* Write-through of the recovery table and the store as jobs and tensors come and go. */
void zd_keep_job(struct zd_daemon *d, struct zd_job *job);
void zd_forget_job(struct zd_daemon *d, struct zd_job *job);
void zd_keep_tensor(struct zd_daemon *d, struct zd_tensor *t);
void zd_forget_tensor(struct zd_daemon *d, struct ze_tensor *et);

#endif
