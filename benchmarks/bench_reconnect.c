/*
 * What a lost connection costs a rank: from the cut to the job reattached (every tensor
 * registered again, its slots kept) and a step done, vs starting that rank over (connect,
 * open the job, register the same tensors with their initial values, the same step).
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bench_common.h"
#include "bench_daemon.h"
#include "zclient.h"

#define CONFIG "{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"warn\" } }\n"
#define TENSORS 256
#define NUMEL (64u << 10)

static int
fail(struct zc_conn *c, const char *what, int r)
{
	fprintf(stderr, "bench_reconnect: %s: %s\n", what, c != NULL ? zc_errmsg(c) : strerror(-r));
	return r;
}

/* Opens job and registers its TENSORS tensors (init values when fresh). */
static int
attach(struct zc_conn *c, const char *job, const float *init, struct zc_tensor **t)
{
	int r = zc_job_open(c, job, 0, 1);

	for (unsigned i = 0; r == 0 && i < TENSORS; i++) {
		char name[32];

		snprintf(name, sizeof(name), "t%u", i);
		r = zc_tensor_register(c, &(struct zc_tensor_desc){ .name = name, .numel = NUMEL,
		    .grad_dtype = ZC_F32, .param_dtype = ZC_F32 }, init, &t[i]);
	}
	return r < 0 ? fail(c, "attach", r) : 0;
}

static int
step(struct zc_conn *c, struct zc_tensor **t, uint64_t n)
{
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = n, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	int r = zc_step_submit(c, &sp, t, TENSORS);

	if (r == 0)
		r = zc_wait_all(c, NULL);
	return r < 0 ? fail(c, "step", r) : 0;
}

int
main(int argc, char **argv)
{
	const char *exe = getenv("ZOFFLOADD"), *tmp = getenv("TMPDIR");
	bool json = argc > 1 && strcmp(argv[1], "--json") == 0;
	static struct zc_tensor *t[TENSORS], *fresh_t[TENSORS];
	struct zc_conn *c = NULL, *fresh = NULL;
	struct zc_conn_stats cs;
	struct bench_daemon bd;
	struct rlimit rl;
	double t0, again, anew;
	float *init;
	FILE *f;
	int r;

	if (exe == NULL) {
		fprintf(stderr, "bench_reconnect: set $ZOFFLOADD\n");
		return 77;
	}
	/* Each tensor's two slots come as descriptors. */
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		(void)setrlimit(RLIMIT_NOFILE, &rl);
	}
	init = calloc(NUMEL, sizeof(float));
	if (init == NULL || bench_daemon_prepare(&bd, tmp != NULL ? tmp : "/tmp",
	    "bench-reconnect") < 0)
		return 1;
	f = fopen(bd.config, "w");
	if (f == NULL || fputs(CONFIG, f) < 0 || fclose(f) != 0)
		return 1;
	if (bench_daemon_start(&bd, exe, NULL, 30) != 0 || zc_connect(bd.socket, &c) < 0) {
		fprintf(stderr, "bench_reconnect: no daemon (log in %s)\n", bd.log);
		return 1;
	}
	r = attach(c, "again", init, t);
	if (r == 0)
		r = step(c, t, 1);
	/* The cut: the daemon sees this session end, the library finds its socket gone. */
	t0 = bench_now();
	if (r == 0)
		(void)shutdown(zc_conn_fd(c), SHUT_RDWR);
	if (r == 0)
		r = step(c, t, 2);
	again = bench_now() - t0;
	zc_conn_stats(c, &cs);
	if (r == 0 && (cs.reconnects != 1 || cs.slots_remapped != 0)) {
		fprintf(stderr, "bench_reconnect: %llu reconnects, %llu slots remapped\n",
		    (unsigned long long)cs.reconnects, (unsigned long long)cs.slots_remapped);
		r = -EPROTO;
	}
	/* Starting the rank over instead. */
	t0 = bench_now();
	if (r == 0 && (r = zc_connect(bd.socket, &fresh)) < 0)
		fprintf(stderr, "bench_reconnect: %s\n", zc_connect_errmsg());
	if (r == 0)
		r = attach(fresh, "anew", init, fresh_t);
	if (r == 0)
		r = step(fresh, fresh_t, 1);
	anew = bench_now() - t0;
	zc_disconnect(fresh);
	zc_disconnect(c);
	(void)bench_daemon_stop(&bd);
	free(init);
	if (r < 0)
		return 1;
	if (json) {
		printf("[");
		bench_json_figure(0, "reconnect_ms_256_tensors_16Mi_elements", again * 1e3, "ms",
		    anew * 1e3, 3);
		printf("\n]\n");
	} else {
		printf("cut to a step done again: %.3f ms (reattach %.3f ms); starting the rank over: "
		    "%.3f ms (ratio %.2f; limit 1)\n", again * 1e3, cs.reconnect_ns / 1e6, anew * 1e3,
		    again / anew);
	}
	return 0;
}
