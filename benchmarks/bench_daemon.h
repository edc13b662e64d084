/* What the benchmarks that drive a real zoffloadd share: their own daemon on a temp socket, its stats. */
#ifndef BENCH_DAEMON_H
#define BENCH_DAEMON_H

#include <sched.h>
#include <stddef.h>
#include <sys/types.h>

struct zc_conn;

/*
 * One zoffloadd of the benchmark's own, everything it has in one temporary
 * directory: socket, config, log, and the swap file when the config puts
 * swap.paths there.  The benchmark writes the config between prepare and
 * start.
 */
struct bench_daemon {
	pid_t pid;
	char dir[512];
	char socket[600];
	char config[600];
	char log[600];
};

/* Makes parent/prefix-XXXXXX and names the files in it.  0 or -errno. */
int bench_daemon_prepare(struct bench_daemon *bd, const char *parent, const char *prefix);

/*
 * Runs exe --config --socket as a child that dies with us, on the CPUs in
 * cpus (NULL: ours), and waits up to timeout_s for it to accept
 * (preallocating a big swap file takes a moment).  0; -ECHILD when it
 * exited (its log says why); -ETIMEDOUT; or -errno.
 */
int bench_daemon_start(struct bench_daemon *bd, const char *exe, const cpu_set_t *cpus,
    double timeout_s);

/*
 * SIGTERM, reaps it and removes the directory.  0 when it exited cleanly,
 * else its wait status (the log is kept then, for the reader).
 */
int bench_daemon_stop(struct bench_daemon *bd);

/* The number at a dotted path of the daemon's stats ("jobs.0.nvme_bytes").  0 or -errno. */
int bench_stat_number(struct zc_conn *c, const char *path, double *ret);

/* The string at a dotted path, "?" when there is none. */
void bench_stat_string(struct zc_conn *c, const char *path, char *out, size_t len);

#endif
