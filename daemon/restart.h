/* A restart is a pause: at start, what the store handed back checked, then jobs and tensors rebuilt. */
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
int zd_restart_begin(struct zd_daemon *d);
/* After the engine starts: keeps its swap files, journal and staging; rebuilds every kept tensor. */
int zd_restart_finish(struct zd_daemon *d);
void zd_restart_end(struct zd_daemon *d);

#endif
