/* Service-test helpers on top of itd: a daemon's descriptors and memory from /proc, waiting on stats, child processes that report back. */
#ifndef SVC_H
#define SVC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "itd.h"

/* Open descriptors of pid (/proc/PID/fd); asserts it can read them. */
unsigned svc_fd_count(pid_t pid);
/* VmRSS of pid in KiB. */
uint64_t svc_rss_kib(pid_t pid);

/*
 * Polls the stat at path until it equals want or timeout_s passes; returns
 * the last value seen (the caller asserts, so the message can say more).
 */
double svc_wait_stat(struct zc_conn *c, const char *path, double want, double timeout_s);
/* Polls until pid has exactly want descriptors, bounded; returns the last count. */
unsigned svc_wait_fds(pid_t pid, unsigned want, double timeout_s);

/*
 * What a forked child tells the test: an errno-style result and the
 * message that came with it.  Children never assert: Criterion's asserts
 * belong to the test's own process.
 */
struct svc_report {
	int result;
	char text[320];
};

/* Runs fn(arg, &report) in a forked child (after setuid(uid) when uid != -1) and returns its report. */
void svc_in_child(uid_t uid, void (*fn)(void *arg, struct svc_report *out), void *arg,
    struct svc_report *ret);

/* Runs argv (NULL-terminated) to exit within timeout_s, stdout+stderr into out; returns the exit status or -1. */
int svc_run(const char *const *argv, char *out, size_t outlen, double timeout_s);

/* True when this build runs under AddressSanitizer (the daemon is built the same way). */
bool svc_asan(void);

#endif
