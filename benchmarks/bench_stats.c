/* What a STATS request costs with thousands of a dead rank's tensors kept, vs with none. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "bench_common.h"
#include "bench_daemon.h"
#include "zclient.h"

#define CONFIG "{ \"compute\": { \"worker_threads\": 1 }, \"log\": { \"level\": \"warn\" } }\n"

/* Mean seconds of one STATS, over n of them. */
static int
time_stats(struct zc_conn *c, unsigned n, double *ret)
{
	double t0 = bench_now();

	for (unsigned i = 0; i < n; i++) {
		char *json = NULL;
		int r = zc_stats_json(c, &json);

		if (r < 0)
			return r;
		free(json);
	}
	*ret = (bench_now() - t0) / n;
	return 0;
}

/* A rank of job "kept" registers n one-element tensors and dies: its tensors wait detached. */
static int
leave_detached(const char *sock, unsigned n)
{
	static float one[1];
	struct zc_conn *c;
	int r;

	r = zc_connect(sock, &c);
	if (r < 0)
		return r;
	r = zc_job_open(c, "kept", 0, 1);
	for (unsigned i = 0; r == 0 && i < n; i++) {
		char name[32];
		struct zc_tensor *t;

		snprintf(name, sizeof(name), "t%u", i);
		r = zc_tensor_register(c, &(struct zc_tensor_desc){ .name = name, .numel = 1,
		    .grad_dtype = ZC_F32, .param_dtype = ZC_F32 }, one, &t);
	}
	if (r < 0)
		fprintf(stderr, "bench_stats: registering: %s\n", zc_errmsg(c));
	zc_disconnect(c);
	return r;
}

int
main(int argc, char **argv)
{
	const char *exe = getenv("ZOFFLOADD"), *tmp = getenv("TMPDIR");
	bool json = argc > 1 && strcmp(argv[1], "--json") == 0;
	unsigned tensors = 6000, requests = 200;
	struct bench_daemon bd;
	struct rlimit rl;
	struct zc_conn *c;
	double none, kept, v;
	FILE *f;
	int r;

	if (exe == NULL) {
		fprintf(stderr, "bench_stats: set $ZOFFLOADD\n");
		return 77;
	}
	/* Each tensor's two slots are mapped here too. */
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		(void)setrlimit(RLIMIT_NOFILE, &rl);
	}
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 3 * tensors) {
		fprintf(stderr, "bench_stats: needs %u descriptors, RLIMIT_NOFILE is %llu\n",
		    3 * tensors, (unsigned long long)rl.rlim_cur);
		return 77;
	}
	r = bench_daemon_prepare(&bd, tmp != NULL ? tmp : "/tmp", "bench-stats");
	if (r < 0)
		return 1;
	f = fopen(bd.config, "w");
	if (f == NULL || fputs(CONFIG, f) < 0 || fclose(f) != 0)
		return 1;
	if (bench_daemon_start(&bd, exe, NULL, 30) != 0 || zc_connect(bd.socket, &c) < 0) {
		fprintf(stderr, "bench_stats: no daemon (log in %s)\n", bd.log);
		return 1;
	}
	r = time_stats(c, requests, &none);
	if (r == 0)
		r = leave_detached(bd.socket, tensors);
	/* The daemon sees the rank's end asynchronously: wait until every tensor is kept. */
	for (int i = 0; r == 0 && i < 500; i++) {
		if (bench_stat_number(c, "jobs.0.tensors_detached", &v) == 0 && v == tensors)
			break;
		usleep(10000);
	}
	if (r == 0)
		r = time_stats(c, requests, &kept);
	zc_disconnect(c);
	(void)bench_daemon_stop(&bd);
	if (r < 0) {
		fprintf(stderr, "bench_stats: %s\n", strerror(-r));
		return 1;
	}
	if (json) {
		printf("[");
		bench_json_figure(0, "stats_ms_with_6000_detached", kept * 1e3, "ms",
		    4 * none * 1e3, 3);
		printf("\n]\n");
	} else {
		printf("STATS: %.3f ms with %u detached tensors, %.3f ms with none (ratio %.2f; "
		    "limit 4)\n", kept * 1e3, tensors, none * 1e3, kept / none);
	}
	return 0;
}
