/*
 * bench_restart: time from zoffloadd's death (SIGKILL) to a step completed again, with
 * 1 GiB and 8 GiB of pinned state kept in systemd's fd store (a stand-in here), and the
 * bytes the new daemon read from disk doing it (/proc/PID/io read_bytes): none of the
 * pinned state (the limit, 1 MiB, leaves room for a page of its binary or configuration).  The limit is 1 s.  Sizes that do not fit in MemAvailable are skipped
 * and said so.  Then what recovery.journal costs a step over 1 GiB of pinned state (the
 * limit: the same step without it; journal/pinned_step_cost is their ratio, limit 1.05).
 * usage: bench_restart [--json] [--sizes GIB,GIB...] [--param-offload]
 */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_common.h"
#include "standin.h"
#include "zclient.h"

static bool param_offload;

/* Elements per tensor: a model's big layer. */
#define CHUNK (64ull << 20)
/* The tensor a trainer steps first after the restart (its last layer): 1 Mi elements. */
#define FIRST (1ull << 20)

struct result {
	double gib;
	double exit_s;		/* the kill to the dead daemon reaped: the kernel's teardown */
	double ready_s;		/* death to the new daemon listening, state rebuilt */
	double first_s;		/* death to the first tensor's step completed */
	double all_s;		/* death to the step over every tensor completed */
	double step_s;		/* that step alone, before the death: the compute in all_s */
	double best_step_s;	/* measure(steps > 1): the best of steps 2..steps, no restart */
	unsigned long long read_bytes;
	unsigned tensors;
};

static uint64_t
mem_available(void)
{
	char line[256];
	unsigned long long kb = 0;
	FILE *f = fopen("/proc/meminfo", "r");

	while (f != NULL && fgets(line, sizeof(line), f) != NULL)
		if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
			break;
	if (f != NULL)
		fclose(f);
	return kb * 1024;
}

static unsigned long long
read_bytes(pid_t pid)
{
	char path[64], line[128];
	unsigned long long v = 0;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/io", (int)pid);
	f = fopen(path, "r");
	while (f != NULL && fgets(line, sizeof(line), f) != NULL)
		if (sscanf(line, "read_bytes: %llu", &v) == 1)
			break;
	if (f != NULL)
		fclose(f);
	return v;
}

static int
fail(const char *what, struct zc_conn *c, int r)
{
	fprintf(stderr, "bench_restart: %s: %s\n", what, c != NULL ? zc_errmsg(c) : strerror(-r));
	return r < 0 ? r : -EIO;
}

/* Connects (retrying while the daemon comes back) and registers every tensor. */
static int
attach(const char *sock, uint64_t numel_total, struct zc_conn **ret_c, struct zc_tensor **ts,
    unsigned *ret_n, const float *init)
{
	double deadline = bench_now() + 60;
	struct zc_job_options o = { .policy = ZC_POLICY_CPU };
	struct zc_conn *c = NULL;
	uint64_t left = numel_total;
	unsigned n = 0;
	int r;

	while ((r = zc_connect(sock, &c)) < 0 && bench_now() < deadline)
		usleep(1000);
	if (r < 0)
		return fail("connect", NULL, r);
	*ret_c = c;
	r = zc_job_open_opts(c, "bench", 0, 1, &o);
	if (r < 0)
		return fail("job_open", c, r);
	/* The small one first: the trainer's last layer, whose step it waits for first. */
	for (uint64_t numel = FIRST; left > 0; numel = left < CHUNK ? left : CHUNK) {
		char name[32];

		if (numel > left)
			numel = left;
		snprintf(name, sizeof(name), "t%u", n);
		/*
		 * --param-offload: params on the tiers too.  Either way the restarted
		 * daemon takes back the very param slots (nothing copied).
		 */
		r = zc_tensor_register(c, &(struct zc_tensor_desc){ .name = name, .numel = numel,
		    .grad_dtype = ZC_BF16, .param_dtype = ZC_BF16,
		    .param_offload = param_offload }, init, &ts[n]);
		if (r < 0)
			return fail("register", c, r);
		left -= numel;
		n++;
	}
	*ret_n = n;
	return 0;
}

static int
step(struct zc_conn *c, struct zc_tensor **ts, unsigned n, uint64_t s, double *ret_first)
{
	struct zc_step_params p = { .optim = ZC_ADAMW, .step = s, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8 };
	int r;

	r = zc_step_submit(c, &p, ts, 1);
	if (r == 0)
		r = zc_wait_all(c, NULL);
	if (ret_first != NULL)
		*ret_first = bench_now();
	if (r == 0 && n > 1)
		r = zc_step_submit(c, &p, ts + 1, n - 1);
	if (r == 0)
		r = zc_wait_all(c, NULL);
	return r < 0 ? fail("step", c, r) : 0;
}

static int
measure(const char *daemon, double gib, bool journal, unsigned steps, struct result *res)
{
	uint64_t numel = (uint64_t)(gib * (double)(1ull << 30)) / 12;
	struct zc_tensor *ts[256];
	struct zc_conn *c = NULL;
	const char *argv[8];
	char sock[160], conf[160];
	struct zst st;
	float *init;
	unsigned n = 0;
	double t0, t1 = 0;
	FILE *f;
	int r;

	memset(res, 0, sizeof(*res));
	res->gib = gib;
	init = calloc(CHUNK, sizeof(float));
	r = zst_init(&st);
	if (r < 0 || init == NULL) {
		free(init);
		return fail("stand-in", NULL, r < 0 ? r : -ENOMEM);
	}
	snprintf(sock, sizeof(sock), "%s/sock", st.dir);
	snprintf(conf, sizeof(conf), "%s/zoffload.conf", st.dir);
	f = fopen(conf, "w");
	fprintf(f, "{ \"memory\": { \"pinned_budget\": \"%.0fG\", \"shm_budget\": \"%.0fG\" },"
	    " \"log\": { \"level\": \"%s\" }, \"recovery\": { \"journal\": %s } }\n",
	    gib + 2, gib + 2, getenv("BENCH_RESTART_LOG") != NULL ? "info" : "warn",
	    journal ? "true" : "false");
	fclose(f);
	argv[0] = daemon;
	argv[1] = "--config";
	argv[2] = conf;
	argv[3] = "--socket";
	argv[4] = sock;
	argv[5] = NULL;
	r = zst_start(&st, argv);
	if (r == 0)
		r = zst_wait_ready(&st, 1, 60);
	if (r == 0)
		r = attach(sock, numel, &c, ts, &n, init);
	res->tensors = n;
	t0 = bench_now();
	if (r == 0)
		r = step(c, ts, n, 1, NULL);
	res->step_s = bench_now() - t0;
	if (r < 0)
		goto out;
	if (steps > 1) {
		/* Steady steps (the first pays for cold caches), and no restart. */
		res->best_step_s = 1e9;
		for (unsigned s = 2; s <= steps && r == 0; s++) {
			t0 = bench_now();
			r = step(c, ts, n, s, NULL);
			t1 = bench_now() - t0;
			if (t1 < res->best_step_s)
				res->best_step_s = t1;
		}
		goto out;
	}
	zc_disconnect(c);
	c = NULL;

	kill(st.pid, SIGKILL);
	t0 = bench_now();
	zst_wait_exit(&st, 60);
	res->exit_s = bench_now() - t0;
	r = zst_start(&st, argv);
	if (r == 0)
		r = zst_wait_ready(&st, 2, 60);
	res->ready_s = bench_now() - t0;
	if (r == 0)
		r = attach(sock, numel, &c, ts, &n, init);
	if (r == 0)
		r = step(c, ts, n, 2, &t1);
	res->all_s = bench_now() - t0;
	res->first_s = t1 - t0;
	res->read_bytes = read_bytes(st.pid);
	if (r == 0 && zc_tensor_last_step(ts[0]) != 2)
		r = fail("the state was not kept", NULL, -ESTALE);
out:
	if (c != NULL)
		zc_disconnect(c);
	if (r < 0 || getenv("BENCH_RESTART_LOG") != NULL)
		fprintf(stderr, "%s\n", zst_log(&st));
	zst_fini(&st);
	free(init);
	return r;
}

static void
figure(unsigned *i, const char *name, double value, const char *unit, double limit, int dec)
{
	printf("%s\n  {\"name\": \"%s\", \"value\": %.*f, \"unit\": \"%s\", \"limit\": %.*f, "
	    "\"ratio\": %.3f}", *i > 0 ? "," : "", name, dec, value, unit, dec, limit,
	    limit > 0 ? value / limit : value > 0 ? 1e9 : 0.0);
	(*i)++;
}

int
main(int argc, char **argv)
{
	const char *daemon = getenv("ZOFFLOADD"), *sizes = "1,8";
	bool json = false;
	struct result res[8];
	unsigned nres = 0, idx = 0;
	double journal_with = 0, journal_without = 0;
	char *list, *tok, *save = NULL;

	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--json") == 0)
			json = true;
		else if (strcmp(argv[i], "--param-offload") == 0)
			param_offload = true;
		else if (strcmp(argv[i], "--sizes") == 0 && i + 1 < argc)
			sizes = argv[++i];
		else {
			fprintf(stderr, "usage: bench_restart [--json] [--sizes GIB,GIB...] "
			    "[--param-offload]\n");
			return 2;
		}
	}
	if (daemon == NULL) {
		fprintf(stderr, "bench_restart: set $ZOFFLOADD to the zoffloadd to measure\n");
		return 77;
	}
	list = strdup(sizes);
	for (tok = strtok_r(list, ",", &save); tok != NULL && nres < 8;
	    tok = strtok_r(NULL, ",", &save)) {
		double gib = atof(tok);
		/* State, bf16 grad and param slots (4 of 12 bytes), the trainer's init buffer. */
		uint64_t need = (uint64_t)(gib * 1.5 * (double)(1ull << 30)) + (1ull << 30);

		if (mem_available() < need) {
			fprintf(stderr, "bench_restart: %g GiB skipped: needs %.1f GiB, MemAvailable "
			    "is %.1f GiB\n", gib, (double)need / (1 << 30),
			    (double)mem_available() / (1 << 30));
			continue;
		}
		if (measure(daemon, gib, true, 1, &res[nres]) < 0) {
			free(list);
			return 1;
		}
		fprintf(stderr, "bench_restart: %g GiB in %u tensors: the dead daemon reaped %.3f s "
		    "after the kill, the new one ready at %.3f s, first step at %.3f s, every "
		    "tensor stepped %.3f s (that step alone: %.3f s), %llu bytes read from disk\n",
		    gib, res[nres].tensors, res[nres].exit_s, res[nres].ready_s,
		    res[nres].first_s, res[nres].all_s, res[nres].step_s, res[nres].read_bytes);
		nres++;
	}
	free(list);
	/*
	 * What recovery.journal costs: the step over 1 GiB of pinned state with the journal
	 * (each vector's old values kept by the kernel as it steps) and without, daemons
	 * with and without taking turns (so that both see the same machine), the best of
	 * their steady steps each.
	 */
	if (nres > 0 && mem_available() > (3ull << 30)) {
		double with = 1e9, without = 1e9;

		for (int k = 0; k < 8; k++) {
			struct result jr;

			if (measure(daemon, 1, k % 2 == 0, 6, &jr) < 0)
				return 1;
			if (k % 2 == 0)
				with = jr.best_step_s < with ? jr.best_step_s : with;
			else
				without = jr.best_step_s < without ? jr.best_step_s : without;
		}
		journal_with = with;
		journal_without = without;
		fprintf(stderr, "bench_restart: a step over 1 GiB of pinned state takes %.3f s with "
		    "recovery.journal, %.3f s without\n", with, without);
	}
	if (json) {
		printf("[");
		for (unsigned i = 0; i < nres; i++) {
			char name[96];
			double g = res[i].gib;

			snprintf(name, sizeof(name), "restart_%gGiB_death_to_first_step", g);
			figure(&idx, name, res[i].first_s, "s", 1.0, 3);
			snprintf(name, sizeof(name), "restart_%gGiB_death_to_ready", g);
			figure(&idx, name, res[i].ready_s, "s", 1.0, 3);
			/* Its limit: the restart's second and the step's compute, measured before. */
			snprintf(name, sizeof(name), "restart_%gGiB_death_to_every_tensor_stepped", g);
			figure(&idx, name, res[i].all_s, "s", 1.0 + res[i].step_s, 3);
			/* A page of the binary or the configuration may be read; GiBs of state not. */
			snprintf(name, sizeof(name), "restart_%gGiB_disk_bytes_read", g);
			figure(&idx, name, (double)res[i].read_bytes, "bytes", 1 << 20, 0);
		}
		if (journal_with > 0) {
			figure(&idx, "step_1GiB_pinned_with_journal", journal_with, "s", journal_without,
			    3);
			/* The journal's cost as a factor: 5% more than the step without it at most. */
			figure(&idx, "journal/pinned_step_cost", journal_with / journal_without, "x",
			    1.05, 3);
		}
		printf("\n]\n");
	}
	return 0;
}
