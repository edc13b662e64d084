/* A stand-in for systemd's service manager: $NOTIFY_SOCKET, the fd store, restarting with LISTEN_FDS. */
#ifndef ZST_STANDIN_H
#define ZST_STANDIN_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define ZST_MAX_FDS 4096

/*
 * What systemd does for a Type=notify service with FileDescriptorStoreMax=:
 * binds the datagram socket named in $NOTIFY_SOCKET, keeps every descriptor
 * sent with FDSTORE=1 under its FDNAME=, closes those named by
 * FDSTOREREMOVE=1, and starts the service with the store in LISTEN_FDS,
 * LISTEN_PID and LISTEN_FDNAMES (descriptors 3 and up).  A thread reads the
 * socket, so a daemon that keeps many descriptors at once never blocks.
 */
struct zst {
	char dir[64];
	char notify_path[108];
	char log_path[128];
	int notify_fd;
	pthread_t thread;
	bool thread_running;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool stopping;
	pid_t pid;			/* the service's, 0 when not running */
	unsigned readies;		/* READY=1 seen */
	unsigned stores;		/* FDSTORE=1 taken */
	unsigned removes;		/* FDSTOREREMOVE=1 done */
	size_t nfds;
	struct { char name[64]; int fd; } fds[ZST_MAX_FDS];
	/* How many times each name was sent with FDSTORE=1, replacements included. */
	size_t nnames;
	struct { char name[64]; unsigned stores; } names[ZST_MAX_FDS];
};

/*
 * A fresh directory holds the socket and the service's log.  0 or -errno.
 * $ZRT_KEEP set: zst_fini leaves the directory (the log) for a look afterwards.
 */
int zst_init(struct zst *s);
void zst_fini(struct zst *s);
/* Starts argv[0] (absolute) with the store; 0 or -errno.  Its output goes to the log. */
int zst_start(struct zst *s, const char *const *argv);
/* Waits until READY=1 has come `readies` times in all, or the service exited (-ECHILD), or -ETIMEDOUT. */
int zst_wait_ready(struct zst *s, unsigned readies, double timeout_s);
/* Every datagram already sent is handled. */
void zst_drain(struct zst *s);
/* Waits for the service to exit (then drains): its wait status, or -1 on timeout. */
int zst_wait_exit(struct zst *s, double timeout_s);
/* The descriptor kept under name (still the stand-in's), or -1. */
int zst_fd(struct zst *s, const char *name);
/* How many times a descriptor was stored under name since zst_init. */
unsigned zst_times_stored(struct zst *s, const char *name);
/* The log so far (static buffer). */
const char *zst_log(const struct zst *s);
/*
 * FNV-1a over fd's 8-byte words (kept memfds and swap files are large and mostly holes),
 * its length mixed in: any byte changed changes it.  For "left as it was" checks.
 */
uint64_t zst_digest(int fd);

#endif
