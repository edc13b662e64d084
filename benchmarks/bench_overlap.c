/* A simulated trainer overlapping the step with its backward and forward, vs max(GPU time, step alone). */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "bench_common.h"
#include "bench_daemon.h"
#include "zclient.h"

#define MiB (1024.0 * 1024.0)

enum which { CASE_PINNED = 1, CASE_NVME = 2 };

struct opts {
	const char *daemon;		/* zoffloadd; $ZOFFLOADD by default */
	const char *dir;		/* sockets and swap; $TMPDIR or /tmp */
	unsigned layers;
	uint64_t layer_params;		/* elements of each layer's one tensor */
	double fwd_s, bwd_s;		/* simulated GPU time per layer */
	unsigned iterations;		/* timed rounds, after the warm-up ones */
	unsigned warmup;
	unsigned threads;		/* daemon worker threads */
	uint64_t nvme_pinned_budget;	/* the NVMe case's pinned budget: the rest spills */
	unsigned cases;			/* CASE_* bits */
	bool busy;			/* spin through simulated compute instead of sleeping */
	bool pin;			/* the trainer on one CPU, the daemon on the others */
	cpu_set_t daemon_cpus;		/* when pinned */
	bool trace;			/* per layer times of the last iteration, on stderr */
	bool json;
};

/* What one case measured: medians over the timed rounds, seconds. */
struct result {
	double iter_s;			/* one overlapped iteration, backward + forward */
	double step_set_s;		/* every layer's tensor in one submitted set */
	double step_layers_s;		/* a set per layer, submitted back to back */
	double gpu_s;			/* the simulated compute the iteration asked for */
	double wait_s;			/* in the iteration: forward waiting for params */
	double submit_s;		/* in the iteration: zc_step_submit calls */
	double late_s;			/* in the iteration: simulated compute running late */
	double alone_s;			/* the same iteration with no steps: the trainer alone */
	double pinned_bytes, nvme_bytes;	/* where the daemon placed the state */
	struct pipe {			/* the daemon's NVMe pipeline, per iteration (mean) */
		double read, written;		/* bytes through swap */
		double compute_wait_ms;		/* the stepper idle, waiting for a read */
		double io_wait_ms;		/* a chunk waiting for a free staging buffer */
	} pipe;
	char engine[32], isa[16];
};

/* A sample per timed round, for the medians. */
struct samples {
	double *iter, *step_set, *step_layers, *alone, *wait, *submit, *late;
};

struct trainer {
	const struct opts *o;
	struct zc_conn *c;
	struct zc_tensor **t;		/* t[l]: layer l's tensor */
	uint16_t *grads;		/* what every backward copies into the grad slots */
	struct zc_step_params sp;
	/* Per layer, in the last iteration, from its start: submission, its end, forward's wait. */
	double *submitted, *submit_end, *wait_from, *wait_to;
};

static void
die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

static void
die(const char *fmt, ...)
{
	va_list ap;

	fputs("bench_overlap: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(1);
}

/* Sizes as "256M", "2M" or plain numbers. */
static bool
parse_size(const char *s, uint64_t *ret)
{
	char *end;
	uint64_t v;

	errno = 0;
	v = strtoull(s, &end, 0);
	if (errno != 0 || end == s)
		return false;
	switch (*end) {
	case 'k': case 'K': v <<= 10; end++; break;
	case 'm': case 'M': v <<= 20; end++; break;
	case 'g': case 'G': v <<= 30; end++; break;
	default: break;
	}
	if (*end != '\0')
		return false;
	*ret = v;
	return true;
}

static bool
parse_ms(const char *s, double *ret)
{
	char *end;
	double v = strtod(s, &end);

	if (end == s || *end != '\0' || !(v >= 0 && v <= 10000))
		return false;
	*ret = v * 1e-3;
	return true;
}

static bool
parse_uint(const char *s, unsigned lo, unsigned hi, unsigned *ret)
{
	char *end;
	unsigned long v = strtoul(s, &end, 0);

	if (end == s || *end != '\0' || v < lo || v > hi)
		return false;
	*ret = (unsigned)v;
	return true;
}

static void
usage(void)
{
	fprintf(stderr,
	    "usage: bench_overlap [--daemon PATH] [--dir DIR] [--layers N] [--layer-params N]\n"
	    "                     [--fwd-ms MS] [--bwd-ms MS] [--iterations N] [--warmup N]\n"
	    "                     [--threads N] [--nvme-pinned-budget SIZE]\n"
	    "                     [--case pinned|nvme|both] [--busy-wait] [--no-pin] [--trace]\n"
	    "                     [--json]\n"
	    "  Simulated compute: --fwd-ms and --bwd-ms per layer (sleeping, or spinning with\n"
	    "  --busy-wait); each layer is one tensor of --layer-params elements (bf16 grads and\n"
	    "  params, AdamW).  The trainer runs on the first CPU it may use and the daemon on\n"
	    "  the others (--no-pin: anywhere), with --threads workers (default: one per CPU it\n"
	    "  has).  Needs 2x the state free in --dir for the NVMe case.\n"
	    "  --trace: when each layer was submitted and waited for in the last iteration, on\n"
	    "  stderr.\n");
}

/* 0, or -1 after saying which argument was wrong. */
static int
parse(int argc, char **argv, struct opts *o)
{
	static const struct option longopts[] = {
		{ "daemon", required_argument, NULL, 'd' },
		{ "dir", required_argument, NULL, 'D' },
		{ "layers", required_argument, NULL, 'L' },
		{ "layer-params", required_argument, NULL, 'P' },
		{ "fwd-ms", required_argument, NULL, 'f' },
		{ "bwd-ms", required_argument, NULL, 'b' },
		{ "iterations", required_argument, NULL, 'n' },
		{ "warmup", required_argument, NULL, 'w' },
		{ "threads", required_argument, NULL, 'T' },
		{ "nvme-pinned-budget", required_argument, NULL, 'p' },
		{ "case", required_argument, NULL, 'c' },
		{ "busy-wait", no_argument, NULL, 'B' },
		{ "no-pin", no_argument, NULL, 'N' },
		{ "trace", no_argument, NULL, 't' },
		{ "json", no_argument, NULL, 'j' },
		{ NULL, 0, NULL, 0 },
	};
	bool ok = true;
	int ch, li = 0;

	while ((ch = getopt_long(argc, argv, "", longopts, &li)) != -1) {
		switch (ch) {
		case 'd': o->daemon = optarg; break;
		case 'D': o->dir = optarg; break;
		case 'L': ok = parse_uint(optarg, 1, 4096, &o->layers); break;
		case 'P': ok = parse_size(optarg, &o->layer_params) && o->layer_params >= 1 &&
			    o->layer_params <= (1ull << 32); break;
		case 'f': ok = parse_ms(optarg, &o->fwd_s); break;
		case 'b': ok = parse_ms(optarg, &o->bwd_s); break;
		case 'n': ok = parse_uint(optarg, 1, 1000, &o->iterations); break;
		case 'w': ok = parse_uint(optarg, 0, 1000, &o->warmup); break;
		case 'T': ok = parse_uint(optarg, 1, 1024, &o->threads); break;
		case 'p': ok = parse_size(optarg, &o->nvme_pinned_budget) &&
			    o->nvme_pinned_budget >= (1u << 20); break;
		case 'c':
			o->cases = strcmp(optarg, "pinned") == 0 ? CASE_PINNED :
			    strcmp(optarg, "nvme") == 0 ? CASE_NVME :
			    strcmp(optarg, "both") == 0 ? CASE_PINNED | CASE_NVME : 0;
			ok = o->cases != 0;
			break;
		case 'B': o->busy = true; break;
		case 'N': o->pin = false; break;
		case 't': o->trace = true; break;
		case 'j': o->json = true; break;
		default: return -1;
		}
		if (!ok) {
			fprintf(stderr, "bench_overlap: bad value '%s' for --%s\n", optarg,
			    longopts[li].name);
			return -1;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "bench_overlap: unexpected argument '%s'\n", argv[optind]);
		return -1;
	}
	return 0;
}

static double
median(double *v, unsigned n)
{
	/* Insertion sort: a few dozen samples. */
	for (unsigned i = 1; i < n; i++)
		for (unsigned j = i; j > 0 && v[j - 1] > v[j]; j--) {
			double x = v[j];

			v[j] = v[j - 1];
			v[j - 1] = x;
		}
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/*
 * The simulated GPU is busy until `until`; it needs no CPU, so the default
 * sleeps (leaving the CPU to the daemon) and spins only the last 100 us,
 * where a sleep's wake-up is late by about that much.
 */
static double
compute_until(const struct opts *o, double until)
{
	double left = until - bench_now(), now;

	if (!o->busy && left > 200e-6) {
		struct timespec ts;
		double at = until - 100e-6;

		ts.tv_sec = (time_t)at;
		ts.tv_nsec = (long)((at - (double)ts.tv_sec) * 1e9);
		while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
			;
	}
	while ((now = bench_now()) < until)
		;
	/* Late: the copy took longer, or the wake-up came late (a busy machine). */
	return now - until;
}

static void
step_or_die(struct trainer *tr, struct zc_tensor *const *t, size_t n)
{
	if (zc_step_submit(tr->c, &tr->sp, t, n) < 0)
		die("step %" PRIu64 ": %s", tr->sp.step, zc_errmsg(tr->c));
}

/*
 * The step alone, nothing else running: every layer's tensor in one set, or
 * (per_layer) one set per layer in backward order as the trainer submits
 * them, back to back.  Seconds from the first submission to the last done.
 */
static double
step_alone(struct trainer *tr, bool per_layer)
{
	unsigned L = tr->o->layers;
	double t0;

	tr->sp.step++;
	t0 = bench_now();
	if (per_layer)
		for (unsigned l = L; l-- > 0;)
			step_or_die(tr, &tr->t[l], 1);
	else
		step_or_die(tr, tr->t, L);
	if (zc_wait_all(tr->c, NULL) < 0)
		die("step %" PRIu64 ": %s", tr->sp.step, zc_errmsg(tr->c));
	return bench_now() - t0;
}

/* Where an iteration's time went besides the simulated compute. */
struct iter_times {
	double wait;			/* forward waiting for params */
	double submit;			/* in zc_step_submit */
	double late;			/* simulated compute overrunning its time */
};

/*
 * One training iteration.  Backward, last layer first: its compute (the
 * gradients' copy into the grad slot is part of it, as a GPU's
 * device-to-host copy is), then that layer's step is submitted at once.
 * Forward, first layer first: wait for the layer's step, then its compute
 * (its host-to-device copy of the params is the GPU's DMA: no CPU work to
 * simulate).  Every step is waited for by the end, so iterations are
 * independent.  Without steps: the trainer alone, what this machine makes
 * of the simulated compute.
 */
static double
iteration(struct trainer *tr, bool steps, struct iter_times *ret)
{
	const struct opts *o = tr->o;
	size_t bytes = (size_t)o->layer_params * 2;
	struct iter_times it = { 0 };
	double t0, t;

	if (steps)
		tr->sp.step++;
	t0 = bench_now();
	for (unsigned l = o->layers; l-- > 0;) {
		double start = bench_now();

		memcpy(zc_tensor_grad_slot(tr->t[l], NULL), tr->grads, bytes);
		it.late += compute_until(o, start + o->bwd_s);
		if (!steps)
			continue;
		t = bench_now();
		step_or_die(tr, &tr->t[l], 1);
		tr->submitted[l] = t - t0;
		tr->submit_end[l] = bench_now() - t0;
		it.submit += tr->submit_end[l] - tr->submitted[l];
	}
	for (unsigned l = 0; l < o->layers; l++) {
		double start;

		t = bench_now();
		if (steps && zc_wait_tensor(tr->t[l], NULL) < 0)
			die("step %" PRIu64 ", layer %u: %s", tr->sp.step, l, zc_errmsg(tr->c));
		start = bench_now();
		if (steps) {
			it.wait += start - t;
			tr->wait_from[l] = t - t0;
			tr->wait_to[l] = start - t0;
		}
		it.late += compute_until(o, start + o->fwd_s);
	}
	t = bench_now() - t0;
	/* The sets' STEP_DONEs, so none is left to the next measurement. */
	if (steps && zc_wait_all(tr->c, NULL) < 0)
		die("step %" PRIu64 ": %s", tr->sp.step, zc_errmsg(tr->c));
	if (ret != NULL)
		*ret = it;
	return t;
}

static void
daemon_start(struct bench_daemon *bd, const struct opts *o, enum which w, uint64_t state)
{
	FILE *f;
	int r;

	r = bench_daemon_prepare(bd, o->dir, w == CASE_PINNED ? "zoff-overlap-pinned" :
	    "zoff-overlap-nvme");
	if (r < 0)
		die("temporary directory in %s: %s", o->dir, strerror(-r));
	f = fopen(bd->config, "w");
	if (f == NULL)
		die("%s: %s", bd->config, strerror(errno));
	/*
	 * Pinned: room for all of the state and its padding.  NVMe: a small
	 * budget and the rest in a swap file beside the socket, twice the state
	 * so placement never fails on rounding.  Chunks, staging buffers and
	 * queue depth at the daemon's defaults, as bench_step has them.
	 */
	fprintf(f, "{ \"compute\": { \"worker_threads\": %u },\n"
	    "  \"log\": { \"level\": \"info\" },\n", o->threads);
	if (w == CASE_PINNED)
		fprintf(f, "  \"memory\": { \"pinned_budget\": %" PRIu64 ", "
		    "\"policy\": \"cpu\" } }\n", state + state / 4 + (64u << 20));
	else
		fprintf(f, "  \"memory\": { \"pinned_budget\": %" PRIu64 ", "
		    "\"policy\": \"auto\" },\n"
		    "  \"swap\": { \"paths\": [ { \"path\": \"%s\", "
		    "\"capacity\": %" PRIu64 " } ] } }\n", o->nvme_pinned_budget, bd->dir,
		    2 * state + (64u << 20));
	fclose(f);
	r = bench_daemon_start(bd, o->daemon, o->pin ? &o->daemon_cpus : NULL, 60);
	if (r == -ECHILD)
		die("zoffloadd exited at start; see %s", bd->log);
	if (r == -ETIMEDOUT)
		die("zoffloadd did not listen within 60 s; see %s", bd->log);
	if (r < 0)
		die("starting zoffloadd: %s", strerror(-r));
}

static double
stat_or_die(struct zc_conn *c, const char *path)
{
	double v = 0;
	int r = bench_stat_number(c, path, &v);

	if (r < 0)
		die("stats at %s: %s", path, r == -ENOENT ? "no number there" : zc_errmsg(c));
	return v;
}

/* Adds the pipeline counters, times sign (-1 before a measurement, +1 after). */
static void
pipe_add(struct zc_conn *c, struct pipe *p, double sign)
{
	p->read += sign * stat_or_die(c, "pipeline.bytes_read");
	p->written += sign * stat_or_die(c, "pipeline.bytes_written");
	p->compute_wait_ms += sign * stat_or_die(c, "pipeline.compute_waiting_on_io_ms");
	p->io_wait_ms += sign * stat_or_die(c, "pipeline.io_waiting_on_compute_ms");
}

/* Registers the layers, small gradients of both signs ready to copy in. */
static void
trainer_setup(struct trainer *tr, const struct opts *o, const char *socket)
{
	uint64_t n = o->layer_params, x = 0x9e3779b97f4a7c15ull;
	float *init = malloc(n * sizeof(float));

	tr->o = o;
	tr->t = calloc(o->layers, sizeof(*tr->t));
	tr->grads = malloc(n * 2);
	tr->submitted = calloc(4 * (size_t)o->layers, sizeof(double));
	tr->submit_end = tr->submitted + o->layers;
	tr->wait_from = tr->submit_end + o->layers;
	tr->wait_to = tr->wait_from + o->layers;
	if (init == NULL || tr->t == NULL || tr->grads == NULL || tr->submitted == NULL)
		die("out of memory for %u layers of %" PRIu64 " elements", o->layers, n);
	for (uint64_t i = 0; i < n; i++) {
		x ^= x >> 12;
		x ^= x << 25;
		x ^= x >> 27;
		tr->grads[i] = zc_f32_to_bf16((float)((double)(x >> 40) / (double)(1 << 24) - 0.5) *
		    1e-2f);
		init[i] = (float)((int)(i % 2001) - 1000) * 1e-3f;
	}
	if (zc_connect(socket, &tr->c) < 0 || zc_job_open(tr->c, "bench_overlap", 0, 1) < 0)
		die("job: %s", zc_errmsg(tr->c));
	for (unsigned l = 0; l < o->layers; l++) {
		char name[32];
		struct zc_tensor_desc desc = { .name = name, .numel = n, .grad_dtype = ZC_BF16,
			.param_dtype = ZC_BF16 };

		snprintf(name, sizeof(name), "layer%u.weight", l);
		if (zc_tensor_register(tr->c, &desc, init, &tr->t[l]) < 0)
			die("register %s: %s", name, zc_errmsg(tr->c));
	}
	free(init);
	tr->sp = (struct zc_step_params){ .optim = ZC_ADAMW, .lr = 1e-4, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 };
}

static void
trainer_free(struct trainer *tr)
{
	if (zc_job_close(tr->c) < 0)
		die("job close: %s", zc_errmsg(tr->c));
	zc_disconnect(tr->c);
	free(tr->t);
	free(tr->grads);
	free(tr->submitted);
}

/* Milliseconds from the iteration's start: a layer's submission, and its forward's wait. */
static void
print_trace(const struct trainer *tr, const char *name)
{
	fprintf(stderr, "%s, last iteration (ms from its start):\n  layer  submitted  "
	    "to      forward waits from  to\n", name);
	for (unsigned l = 0; l < tr->o->layers; l++)
		fprintf(stderr, "  %5u  %9.1f  %6.1f  %18.1f  %6.1f\n", l, tr->submitted[l] * 1e3,
		    tr->submit_end[l] * 1e3, tr->wait_from[l] * 1e3, tr->wait_to[l] * 1e3);
}

/*
 * One case on a daemon of its own.  The measurements (the step alone two
 * ways, the trainer alone, the overlapped iteration) take turns round by
 * round, so a burst of load on a shared machine falls on all of them alike
 * rather than on whichever ran then.
 */
static void
run_case(const struct opts *o, enum which w, struct result *res)
{
	uint64_t state = 12 * o->layer_params * o->layers;
	unsigned n = o->iterations;
	double *buf = calloc(7 * (size_t)n, sizeof(double));
	struct samples s = { buf, buf + n, buf + 2 * n, buf + 3 * n, buf + 4 * n, buf + 5 * n,
		buf + 6 * n };
	struct pipe *p = &res->pipe;
	struct bench_daemon bd;
	struct trainer tr = { 0 };
	int status;

	if (buf == NULL)
		die("out of memory");
	daemon_start(&bd, o, w, state);
	trainer_setup(&tr, o, bd.socket);
	res->pinned_bytes = stat_or_die(tr.c, "jobs.0.pinned_bytes");
	res->nvme_bytes = stat_or_die(tr.c, "jobs.0.nvme_bytes");
	bench_stat_string(tr.c, "tiers.nvme.engine", res->engine, sizeof(res->engine));
	bench_stat_string(tr.c, "kernel_isa", res->isa, sizeof(res->isa));
	if (w == CASE_NVME && res->nvme_bytes <= 0)
		die("no state went to NVMe: raise --layer-params or lower --nvme-pinned-budget");
	for (unsigned i = 0; i < o->warmup; i++) {
		(void)step_alone(&tr, false);
		(void)step_alone(&tr, true);
		(void)iteration(&tr, false, NULL);
		(void)iteration(&tr, true, NULL);
	}
	for (unsigned i = 0; i < n; i++) {
		struct iter_times it;

		s.step_set[i] = step_alone(&tr, false);
		s.step_layers[i] = step_alone(&tr, true);
		s.alone[i] = iteration(&tr, false, NULL);
		pipe_add(tr.c, p, -1);
		s.iter[i] = iteration(&tr, true, &it);
		pipe_add(tr.c, p, 1);
		s.wait[i] = it.wait;
		s.submit[i] = it.submit;
		s.late[i] = it.late;
	}
	p->read /= n;
	p->written /= n;
	p->compute_wait_ms /= n;
	p->io_wait_ms /= n;
	if (w == CASE_NVME && (p->read <= 0 || p->written <= 0))
		die("the NVMe case's steps moved no bytes through swap");
	if (o->trace)
		print_trace(&tr, w == CASE_PINNED ? "pinned" : "nvme");
	res->iter_s = median(s.iter, n);
	res->step_set_s = median(s.step_set, n);
	res->step_layers_s = median(s.step_layers, n);
	res->wait_s = median(s.wait, n);
	res->submit_s = median(s.submit, n);
	res->late_s = median(s.late, n);
	res->alone_s = median(s.alone, n);
	res->gpu_s = o->layers * (o->fwd_s + o->bwd_s);
	trainer_free(&tr);
	free(buf);
	status = bench_daemon_stop(&bd);
	if (status != 0)
		die("zoffloadd exited with status 0x%x; see %s", status, bd.log);
}

/* The step's own time: the faster way of stepping the same tensors with nothing else running. */
static double
step_bound(const struct result *r)
{
	return r->step_set_s < r->step_layers_s ? r->step_set_s : r->step_layers_s;
}

/* max(GPU time, step alone), the GPU time as simulated or as this machine delivered it. */
static double
bound(const struct result *r, bool measured)
{
	double s = step_bound(r), g = measured ? r->alone_s : r->gpu_s;

	return g > s ? g : s;
}

static unsigned
json_case(unsigned k, const char *name, const struct result *r)
{
	char n[64];

	bench_json_figure(k++, name, r->iter_s, "s", bound(r, false), 4);
	/* The same with the trainer alone's time: the machine's own lateness taken out. */
	snprintf(n, sizeof(n), "%s_vs_measured_bound", name);
	bench_json_figure(k++, n, r->iter_s, "s", bound(r, true), 4);
	/* How well this machine keeps the simulated time, with no steps at all. */
	snprintf(n, sizeof(n), "%s_trainer_alone", name);
	bench_json_figure(k++, n, r->alone_s, "s", r->gpu_s, 4);
	/* The price of a set per layer over one set, with nothing to overlap. */
	snprintf(n, sizeof(n), "%s_step_per_layer", name);
	bench_json_figure(k++, n, r->step_layers_s, "s", r->step_set_s, 4);
	/* The share of the iteration the trainer sat waiting for parameters. */
	snprintf(n, sizeof(n), "%s_forward_wait", name);
	bench_json_figure(k++, n, r->wait_s, "s", r->iter_s, 4);
	/* The trainer's compute overrunning its time in the iteration (wake-ups, copies). */
	snprintf(n, sizeof(n), "%s_compute_overrun", name);
	bench_json_figure(k++, n, r->late_s, "s", r->gpu_s, 4);
	return k;
}

static void
print_case(const char *name, const struct opts *o, const struct result *r)
{
	printf("%s: %.0f MiB of state pinned, %.0f MiB on NVMe (engine %s), %s kernels\n", name,
	    r->pinned_bytes / MiB, r->nvme_bytes / MiB, r->engine, r->isa);
	printf("  iteration           %8.1f ms   (median of %u)\n", r->iter_s * 1e3,
	    o->iterations);
	printf("    waiting in forward%8.1f ms   submitting %.1f ms   compute running late "
	    "%.1f ms\n", r->wait_s * 1e3, r->submit_s * 1e3, r->late_s * 1e3);
	printf("  simulated GPU time  %8.1f ms   the trainer alone (no steps) took %.1f ms\n",
	    r->gpu_s * 1e3, r->alone_s * 1e3);
	printf("  step alone, one set %8.1f ms   a set per layer %.1f ms\n", r->step_set_s * 1e3,
	    r->step_layers_s * 1e3);
	if (r->nvme_bytes > 0)
		printf("  per iteration: swap %.0f MiB read, %.0f MiB written; stepper idle "
		    "waiting on reads %.1f ms, reads waiting for a staging buffer %.1f ms (mean)\n",
		    r->pipe.read / MiB, r->pipe.written / MiB, r->pipe.compute_wait_ms,
		    r->pipe.io_wait_ms);
	printf("  iteration / bound   %8.3f     (max(GPU time, step alone); target <= 1.10)\n",
	    r->iter_s / bound(r, false));
	printf("  ... measured bound  %8.3f     (the trainer alone's time for the GPU time)\n",
	    r->iter_s / bound(r, true));
}

int
main(int argc, char **argv)
{
	const char *tmp = getenv("TMPDIR");
	cpu_set_t mine, trainer;
	unsigned ncpu;
	struct opts o = {
		.daemon = getenv("ZOFFLOADD"),
		.dir = tmp != NULL && *tmp != '\0' ? tmp : "/tmp",
		.layers = 24,
		.layer_params = 2u << 20,
		.fwd_s = 1e-3,
		.bwd_s = 2e-3,
		.iterations = 9,
		.warmup = 3,
		.pin = true,
		.nvme_pinned_budget = 128u << 20,
		.cases = CASE_PINNED | CASE_NVME,
	};
	struct result pinned = { 0 }, nvme = { 0 };
	unsigned k = 0;

	if (sched_getaffinity(0, sizeof(mine), &mine) != 0)
		die("sched_getaffinity: %s", strerror(errno));
	ncpu = (unsigned)CPU_COUNT(&mine);
	if (parse(argc, argv, &o) < 0) {
		usage();
		return 2;
	}
	/*
	 * On a node the trainer's thread has a core of its own to drive its GPU.
	 * Sharing one with the daemon's workers, each submission that wakes the
	 * stepper can stall it for a whole slice of the step (about 1 ms
	 * measured here on 2 CPUs): that is the machine's scheduling, not
	 * overlap.
	 */
	if (ncpu < 2)
		o.pin = false;
	if (o.pin) {
		int first = -1;

		CPU_ZERO(&trainer);
		o.daemon_cpus = mine;
		for (int i = 0; i < CPU_SETSIZE && first < 0; i++)
			if (CPU_ISSET(i, &mine))
				first = i;
		CPU_SET(first, &trainer);
		CPU_CLR(first, &o.daemon_cpus);
		if (sched_setaffinity(0, sizeof(trainer), &trainer) != 0)
			die("sched_setaffinity: %s", strerror(errno));
	}
	if (o.threads == 0)
		o.threads = o.pin ? ncpu - 1 : ncpu;
	if (o.daemon == NULL || o.daemon[0] == '\0' || access(o.daemon, X_OK) != 0) {
		fprintf(stderr, "bench_overlap: no zoffloadd: pass --daemon PATH or set "
		    "$ZOFFLOADD\n");
		return 2;
	}
	/* Wake-ups on time: the default slack (50 us) would add up over 2 x 24 sleeps. */
	(void)prctl(PR_SET_TIMERSLACK, 1UL);
	if (o.cases & CASE_PINNED)
		run_case(&o, CASE_PINNED, &pinned);
	if (o.cases & CASE_NVME)
		run_case(&o, CASE_NVME, &nvme);
	if (o.json) {
		printf("[");
		if (o.cases & CASE_PINNED)
			k = json_case(k, "overlap_pinned", &pinned);
		if (o.cases & CASE_NVME)
			k = json_case(k, "overlap_nvme", &nvme);
		printf("\n]\n");
		return 0;
	}
	printf("simulated trainer: %u layers of %.2fM params (bf16 grads and params, AdamW), "
	    "%.2f ms forward and %.2f ms backward per layer (%s), %u daemon threads%s\n",
	    o.layers, (double)o.layer_params / 1e6, o.fwd_s * 1e3, o.bwd_s * 1e3,
	    o.busy ? "spinning" : "sleeping", o.threads,
	    o.pin ? ", trainer and daemon on CPUs of their own" : "");
	if (o.cases & CASE_PINNED)
		print_case("pinned", &o, &pinned);
	if (o.cases & CASE_NVME)
		print_case("nvme", &o, &nvme);
	return 0;
}
