/* Descriptors that outlive the process: systemd's fd store, or the daemon's own successor. */
#ifndef ZD_FDSTORE_H
#define ZD_FDSTORE_H

#include <stdbool.h>
#include <stddef.h>

/*
 * Every memfd and swap file that holds state is kept under a name
 * (FDSTORE=1 with FDNAME= on $NOTIFY_SOCKET as it is made, FDSTOREREMOVE=1
 * when it is freed), and comes back at the next start in LISTEN_FDS /
 * LISTEN_FDNAMES, from systemd or from zd_fdstore_handoff.
 */
#define ZD_FDNAME_MAX 64

struct zd_fdstore_entry {
	char name[ZD_FDNAME_MAX];
	int fd;
};

/*
 * kept: what this process was given at start (it owns those descriptors
 * until taken); live: what it keeps now (descriptors owned by whoever made
 * them, listed so a successor can be handed them).
 */
struct zd_fdstore {
	struct zd_fdstore_entry *kept;
	size_t nkept;
	struct zd_fdstore_entry *live;
	size_t nlive, live_cap;
	bool quiet;			/* shutting down: freed state stays in the store */
	unsigned send_errors;
};

/* Reads and clears LISTEN_FDS, LISTEN_PID and LISTEN_FDNAMES.  -errno, err says why. */
int zd_fdstore_init(struct zd_fdstore *st, char *err, size_t errlen);
void zd_fdstore_fini(struct zd_fdstore *st);
/* A kept descriptor by name, now the caller's; -1 when none was given. */
int zd_fdstore_take(struct zd_fdstore *st, const char *name);
/* Kept descriptors not taken: closed, and dropped from the store when forget. */
void zd_fdstore_drop_kept(struct zd_fdstore *st, bool forget);
/*
 * Everything handed back given up (a start from empty): every name dropped from the store,
 * taken ones too (their successors are stored under the same names), the rest closed, and
 * none listed as kept any more.
 */
void zd_fdstore_forget_kept(struct zd_fdstore *st);
/* fd (still the caller's) is kept under name; send: tell systemd (a taken one it holds). */
int zd_fdstore_add(struct zd_fdstore *st, const char *name, int fd, bool send);
void zd_fdstore_remove(struct zd_fdstore *st, const char *name);
/* Tells the store alone: keep fd under name / drop what it keeps under name. */
int zd_fdstore_send(struct zd_fdstore *st, const char *name, int fd);
void zd_fdstore_forget(struct zd_fdstore *st, const char *name);
/* A listed descriptor goes by another name from now on (the list only). */
void zd_fdstore_rename(struct zd_fdstore *st, const char *from, const char *to);
/*
 * Replaces this process with path (argv as given), handing it every live
 * descriptor as LISTEN_FDS.  Returns only on failure, -errno.
 */
int zd_fdstore_handoff(struct zd_fdstore *st, const char *path, char *const argv[]);

#endif
