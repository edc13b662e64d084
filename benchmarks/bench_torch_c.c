/* The C side of bench_torch.py: the work zoffload.torch.AdamW does per step, done straight through libzclient. */
#include <errno.h>
#include <stdbool.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "zclient.h"

static double
now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int
cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

static void
usage(void)
{
	fprintf(stderr, "usage: bench_torch_c --socket PATH [--tensors N] [--numel N] [--steps N]\n"
	    "Registers N fp32 tensors with param views and fills their grad slots, then per\n"
	    "step checks each param view for pages written outside the step, submits one\n"
	    "AdamW step over all and waits: what zoffload.torch.AdamW.step() does once p.grad\n"
	    "is its grad slot and p its param view.  Prints the median seconds per step over\n"
	    "the timed steps (one warm-up step first).\n");
	exit(2);
}

static int
fail(struct zc_conn *c, const char *what, int r)
{
	fprintf(stderr, "bench_torch_c: %s: %s (%s)\n", what, c != NULL ? zc_errmsg(c) : "",
	    strerror(-r));
	return 1;
}

int
main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "tensors", required_argument, NULL, 't' },
		{ "numel", required_argument, NULL, 'n' },
		{ "steps", required_argument, NULL, 'k' },
		{ NULL, 0, NULL, 0 },
	};
	const char *socket_path = NULL;
	unsigned ntensors = 24, steps = 5;
	uint64_t numel = 4194304;
	struct zc_step_params sp = { .optim = ZC_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
		.eps = 1e-8, .weight_decay = 0.01 };
	struct zc_tensor_desc d = { .grad_dtype = ZC_F32, .param_dtype = ZC_F32 };
	struct zc_tensor **ts;
	struct zc_conn *c = NULL;
	float **grads, **params;
	char name[64], job[64];
	double *times, *waits, *checks;
	int opt, r;

	while ((opt = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (opt) {
		case 's': socket_path = optarg; break;
		case 't': ntensors = (unsigned)strtoul(optarg, NULL, 10); break;
		case 'n': numel = strtoull(optarg, NULL, 10); break;
		case 'k': steps = (unsigned)strtoul(optarg, NULL, 10); break;
		default: usage();
		}
	}
	if (ntensors == 0 || numel == 0 || steps == 0)
		usage();
	ts = calloc(ntensors, sizeof(*ts));
	times = calloc(steps, sizeof(*times));
	waits = calloc(steps, sizeof(*waits));
	checks = calloc(steps, sizeof(*checks));
	grads = calloc(ntensors, sizeof(*grads));
	params = calloc(ntensors, sizeof(*params));
	if (ts == NULL || times == NULL || waits == NULL || checks == NULL || grads == NULL ||
	    params == NULL)
		return fail(NULL, "out of memory", -ENOMEM);
	r = zc_connect(socket_path, &c);
	if (r < 0)
		return fail(NULL, "connect", r);
	snprintf(job, sizeof(job), "bench-torch-c-%d", (int)getpid());
	r = zc_job_open(c, job, 0, 1);
	if (r < 0)
		return fail(c, "job_open", r);
	zc_conn_set_param_views(c, true);
	for (unsigned i = 0; i < ntensors; i++) {
		grads[i] = malloc(numel * sizeof(float));
		params[i] = malloc(numel * sizeof(float));
		if (grads[i] == NULL || params[i] == NULL)
			return fail(c, "out of memory", -ENOMEM);
		for (uint64_t j = 0; j < numel; j++) {
			params[i][j] = (float)((j * 2654435761u) % 2001) / 1000.0f - 1.0f;
			grads[i][j] = (float)((j * 40503u + i) % 2001) / 10000.0f - 0.1f;
		}
		snprintf(name, sizeof(name), "p%u", i);
		d.name = name;
		d.numel = numel;
		r = zc_tensor_register(c, &d, params[i], &ts[i]);
		if (r < 0)
			return fail(c, "register", r);
	}
	/*
	 * The gradients go into the slots once: zoffload.torch leaves p.grad a view of its
	 * slot after a step, so backward writes there and later steps copy none in.
	 */
	for (unsigned i = 0; i < ntensors; i++)
		memcpy(zc_tensor_grad_slot(ts[i], NULL), grads[i], numel * sizeof(float));
	for (unsigned s = 0; s <= steps; s++) {
		double t = now_s(), tc;

		for (unsigned i = 0; i < ntensors; i++) {
			uint64_t written;

			r = zc_tensor_param_view_written(ts[i], &written);
			if (r < 0)
				return fail(c, "param view check", r);
			if (written != 0)
				return fail(c, "param view written by nobody", -EIO);
		}
		tc = now_s();
		sp.step = s + 1;
		r = zc_step_submit(c, &sp, ts, ntensors);
		if (r < 0)
			return fail(c, "submit", r);
		r = zc_wait_all(c, NULL);
		if (r < 0)
			return fail(c, "wait", r);
		/* Step 0 warms the pages and the daemon up. */
		if (s > 0) {
			times[s - 1] = now_s() - t;
			waits[s - 1] = now_s() - tc;
			checks[s - 1] = tc - t;
		}
	}
	qsort(times, steps, sizeof(*times), cmp_double);
	qsort(waits, steps, sizeof(*waits), cmp_double);
	qsort(checks, steps, sizeof(*checks), cmp_double);
	printf("%.6f\n", times[steps / 2]);
	/* Where it goes (stderr: stdout is the figure bench_torch.py reads). */
	fprintf(stderr, "bench_torch_c: median of %u steps: %.4f s, of which submit to answer "
	    "%.4f s, the param views checked for writes %.4f s\n", steps, times[steps / 2],
	    waits[steps / 2], checks[steps / 2]);
	r = zc_job_close(c);
	zc_disconnect(c);
	for (unsigned i = 0; i < ntensors; i++) {
		free(grads[i]);
		free(params[i]);
	}
	free(grads);
	free(params);
	free(ts);
	free(times);
	free(waits);
	free(checks);
	return r < 0;
}
