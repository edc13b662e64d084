/* zoffctl: look at a running zoffloadd (stats, jobs, ping). */
#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "build_config.h"
#include "zclient.h"
#include "zoffctl.h"
#include "zoffctl_checkpoint.h"

static void
usage(FILE *f)
{
	fprintf(f,
	    "usage: zoffctl [--socket PATH] COMMAND [OPTIONS]\n"
	    "\n"
	    "commands:\n"
	    "  stats [--json] [--watch SECONDS]   tiers, jobs, sessions, step throughput and latency\n"
	    "  jobs [--json]                      jobs and their ranks, attached and detached\n"
	    "  drop JOB                           free a job (its ranks are disconnected)\n"
	    "  ping [--count N]                   control round trip\n"
	    "  tune [--quick] [--seconds S] [--size BYTES] [--json] DIR...\n"
	    "                                     measure swap directories and the CPU step\n"
	    "                                     rate, print a recommended swap config\n"
	    "  import-deepspeed [--json|--python] FILE\n"
	    "                                     a DeepSpeed config as zoffload config and\n"
	    "                                     job options (--python: the training\n"
	    "                                     script's zoffload.deepspeed call), naming\n"
	    "                                     what has no equivalent\n"
	    "  checkpoint inspect DIR             a checkpoint's ranks, tensors, steps, sizes;\n"
	    "                                     verifies every checksum (exit 1 if damaged)\n"
	    "\n"
	    "  -s, --socket PATH   the daemon's socket\n"
	    "  -V, --version       print the version and exit\n"
	    "\n"
	    "The socket is --socket, else $ZOFFLOAD_SOCKET, else %s.\n",
	    ZOFFLOAD_DEFAULT_SOCKET);
}

/* The socket this run talks to, as libzclient picks it, for every error message. */
static const char *socket_shown = ZOFFLOAD_DEFAULT_SOCKET;

static const char *
socket_to_show(const char *opt)
{
	const char *env = getenv("ZOFFLOAD_SOCKET");

	if (opt != NULL)
		return opt;
	return env != NULL && env[0] != '\0' ? env : ZOFFLOAD_DEFAULT_SOCKET;
}

static double
num(const cJSON *obj, const char *path)
{
	char buf[128], *save = NULL, *key;
	const cJSON *cur = obj;

	snprintf(buf, sizeof(buf), "%s", path);
	for (key = strtok_r(buf, ".", &save); key != NULL && cur != NULL;
	     key = strtok_r(NULL, ".", &save))
		cur = cJSON_GetObjectItemCaseSensitive(cur, key);
	return cJSON_IsNumber(cur) ? cur->valuedouble : 0;
}

static const char *
str(const cJSON *obj, const char *key)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);

	return cJSON_IsString(v) ? v->valuestring : "?";
}

static const char *
bytes(double v, char *buf, size_t len)
{
	static const char *const units[] = { "B", "KiB", "MiB", "GiB", "TiB", "PiB" };
	unsigned u = 0;

	if (v < 0) {
		snprintf(buf, len, "unlimited");
		return buf;
	}
	while (v >= 1024 && u < 5) {
		v /= 1024;
		u++;
	}
	snprintf(buf, len, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
	return buf;
}

static const char *
count(double v, char *buf, size_t len)
{
	if (v >= 1e9)
		snprintf(buf, len, "%.2f G", v / 1e9);
	else if (v >= 1e6)
		snprintf(buf, len, "%.2f M", v / 1e6);
	else if (v >= 1e3)
		snprintf(buf, len, "%.1f k", v / 1e3);
	else
		snprintf(buf, len, "%.0f", v);
	return buf;
}

/* Rows of the jobs table zoffctl stats shows; zoffctl jobs shows them all. */
#define STATS_JOB_ROWS 20

static void
print_jobs_table(const cJSON *jobs, int max_rows)
{
	const cJSON *j;
	char a[32], b[32], c[32], d[32];
	int rows = 0, n = cJSON_GetArraySize(jobs);

	printf("%-20s %4s %6s %7s %8s %7s %10s %10s %10s %8s %7s %6s %9s  %-12s %s\n", "JOB", "ID",
	    "UID", "RANKS", "DETACHED", "TENSORS", "PARAMS", "PINNED", "NVME", "APPLIED", "SKIPPED",
	    "FAILED", "LAST STEP", "STATE", "SAVED VS FP32");
	if (cJSON_GetArraySize(jobs) == 0) {
		printf("(no jobs)\n");
		return;
	}
	cJSON_ArrayForEach(j, jobs) {
		if (max_rows > 0 && rows++ == max_rows) {
			printf("... and %d more jobs (zoffctl jobs lists them all)\n", n - max_rows);
			break;
		}
		printf("%-20s %4.0f %6.0f %3.0f/%-3.0f %8.0f %7.0f %10s %10s %10s %8.0f %7.0f %6.0f "
		    "%9.0f  %-12s %s\n", str(j, "name"), num(j, "id"), num(j, "uid"),
		    num(j, "ranks_attached"), num(j, "world_size"), num(j, "ranks_detached"),
		    num(j, "tensors"), count(num(j, "params"), a, sizeof(a)),
		    bytes(num(j, "pinned_bytes"), b, sizeof(b)),
		    bytes(num(j, "nvme_bytes"), c, sizeof(c)), num(j, "steps_applied"),
		    num(j, "steps_skipped"), num(j, "steps_failed"), num(j, "last_step"),
		    str(j, "state_format"), bytes(num(j, "state_bytes_saved"), d, sizeof(d)));
	}
}

static void
print_nvme(const cJSON *s)
{
	const cJSON *nvme = cJSON_GetObjectItemCaseSensitive(
	    cJSON_GetObjectItemCaseSensitive(s, "tiers"), "nvme");
	const cJSON *p;
	char a[32], b[32], c[32], d[32];

	if (nvme == NULL || strcmp(str(nvme, "engine"), "off") == 0) {
		printf("nvme     off (no swap.paths)\n");
		return;
	}
	printf("nvme     engine %s, queue depth %.0f, %.0f in flight%s%s\n", str(nvme, "engine"),
	    num(nvme, "queue_depth"), num(nvme, "in_flight"),
	    cJSON_GetObjectItemCaseSensitive(nvme, "io_uring_unavailable") ?
	    ", io_uring unavailable: " : "",
	    cJSON_GetObjectItemCaseSensitive(nvme, "io_uring_unavailable") ?
	    str(nvme, "io_uring_unavailable") : "");
	cJSON_ArrayForEach(p, cJSON_GetObjectItemCaseSensitive(nvme, "paths")) {
		printf("  %-40s %10s of %-10s read %s/s write %s/s  errors eio %.0f enospc %.0f "
		    "other %.0f\n", str(p, "path"), bytes(num(p, "used_bytes"), a, sizeof(a)),
		    bytes(num(p, "capacity_bytes"), b, sizeof(b)),
		    bytes(num(p, "read_bps"), c, sizeof(c)), bytes(num(p, "write_bps"), d, sizeof(d)),
		    num(p, "errors_eio"), num(p, "errors_enospc"), num(p, "errors_other"));
	}
}

static void
print_stats(const cJSON *s)
{
	char a[32], b[32], c[32], d[32], e[32];
	const cJSON *lat = cJSON_GetObjectItemCaseSensitive(
	    cJSON_GetObjectItemCaseSensitive(s, "steps"), "latency_ms");

	printf("zoffloadd %s  pid %.0f  up %.0f s  kernels %s  %.0f worker threads\n",
	    str(s, "version"), num(s, "pid"), num(s, "uptime_s"), str(s, "kernel_isa"),
	    num(s, "worker_threads"));
	printf("\nTIER     %12s %12s %12s %12s\n", "USED", "BUDGET", "LOCKED", "UNLOCKED");
	printf("pinned   %12s %12s %12s %12s   (memlock limit %s)\n",
	    bytes(num(s, "tiers.pinned.used_bytes"), a, sizeof(a)),
	    bytes(num(s, "tiers.pinned.budget_bytes"), b, sizeof(b)),
	    bytes(num(s, "tiers.pinned.locked_bytes"), c, sizeof(c)),
	    bytes(num(s, "tiers.pinned.unlocked_bytes"), d, sizeof(d)),
	    bytes(num(s, "tiers.pinned.memlock_limit_bytes"), e, sizeof(e)));
	print_nvme(s);
	printf("shm      %12s %12s   (%.0f objects)\n",
	    bytes(num(s, "tiers.shm.used_bytes"), a, sizeof(a)),
	    bytes(num(s, "tiers.shm.budget_bytes"), b, sizeof(b)), num(s, "tiers.shm.objects"));
	printf("malloc   %12s resident (%s)\n", bytes(num(s, "malloc.resident_bytes"), a, sizeof(a)),
	    str(cJSON_GetObjectItemCaseSensitive(s, "malloc"), "allocator"));
	printf("\nsessions %.0f   tensors %.0f   params %s\n", num(s, "sessions"), num(s, "tensors"),
	    count(num(s, "params"), a, sizeof(a)));
	printf("steps    applied %.0f  skipped %.0f  failed %.0f  in flight %.0f\n",
	    num(s, "steps.applied"), num(s, "steps.skipped_nonfinite"), num(s, "steps.failed"),
	    num(s, "steps.in_flight"));
	/* The daemon averages over fewer seconds when it has not been up for the whole window. */
	printf("rate     %s params/s over the last %.0f s%s   (compute alone %s params/s)\n",
	    count(num(s, "steps.params_per_s"), a, sizeof(a)), num(s, "steps.rate_window_s"),
	    num(s, "steps.rate_window_s") < 10 ? " (all the daemon has: it started less than 10 s "
	    "ago)" : "", count(num(s, "steps.compute_params_per_s"), b, sizeof(b)));
	if (num(s, "pipeline.tensor_steps_nvme") > 0 || num(s, "pipeline.params.fetches") > 0) {
		/* A hit: served where it was, nothing read from a slower tier; by bytes, not tensors. */
		printf("pipeline state stepped pinned %s / nvme %s (pinned hit rate %.0f%% of bytes; "
		    "tensor steps %.0f / %.0f), chunks read %.0f written %.0f, io errors %.0f\n",
		    bytes(num(s, "pipeline.state_bytes_stepped_pinned"), a, sizeof(a)),
		    bytes(num(s, "pipeline.state_bytes_stepped_nvme"), b, sizeof(b)),
		    100 * num(s, "pipeline.pinned_hit_rate"), num(s, "pipeline.tensor_steps_pinned"),
		    num(s, "pipeline.tensor_steps_nvme"), num(s, "pipeline.chunks_read"),
		    num(s, "pipeline.chunks_written"), num(s, "pipeline.io_errors"));
		printf("stalls   compute waiting on I/O %.0f (%.1f ms), I/O waiting on compute %.0f "
		    "(%.1f ms)\n", num(s, "pipeline.compute_waiting_on_io"),
		    num(s, "pipeline.compute_waiting_on_io_ms"), num(s, "pipeline.io_waiting_on_compute"),
		    num(s, "pipeline.io_waiting_on_compute_ms"));
		/* Where the staging buffers' time went: a pipeline bound by I/O reads and writes. */
		printf("staging  reading %.1f ms  computing %.1f ms  writing %.1f ms (summed over %.0f "
		    "buffers)\n", num(s, "pipeline.staging_reading_ms"),
		    num(s, "pipeline.staging_computing_ms"), num(s, "pipeline.staging_writing_ms"),
		    num(s, "pipeline.staging_buffers"));
		printf("params   fetches %.0f  hits (in the slot) %.0f  misses (staged) %.0f  "
		    "staged %s  written back %s\n", num(s, "pipeline.params.fetches"),
		    num(s, "pipeline.params.hits"), num(s, "pipeline.params.misses"), bytes(num(s, "pipeline.params.bytes_staged"), a,
		    sizeof(a)), bytes(num(s, "pipeline.params.bytes_written_back"), b, sizeof(b)));
	}
	if (num(lat, "samples") > 0)
		printf("latency  last %.3f ms  mean %.3f  p50 %.3f  p99 %.3f  max %.3f  "
		    "(%.0f samples)\n", num(lat, "last"), num(lat, "mean"), num(lat, "p50"),
		    num(lat, "p99"), num(lat, "max"), num(lat, "samples"));
	printf("\n");
	print_jobs_table(cJSON_GetObjectItemCaseSensitive(s, "jobs"), STATS_JOB_ROWS);
}

static volatile sig_atomic_t interrupted;

static void
on_sigint(int sig)
{
	interrupted = 1;
}

static int
cmd_json(struct zc_conn *c, bool jobs, bool json, double watch)
{
	for (bool first = true;; first = false) {
		char *text;
		cJSON *root;
		int r = jobs ? zc_jobs_json(c, &text) : zc_stats_json(c, &text);

		if (r < 0) {
			fprintf(stderr, "zoffctl: zoffloadd at %s: %s\n", socket_shown, zc_errmsg(c));
			return 1;
		}
		if (json) {
			printf("%s\n", text);
		} else {
			root = cJSON_Parse(text);
			if (root == NULL) {
				fprintf(stderr, "zoffctl: zoffloadd sent malformed JSON\n");
				free(text);
				return 1;
			}
			/* Clear the screen on a terminal; a file or a pipe gets plain text. */
			if (watch > 0 && isatty(STDOUT_FILENO))
				printf("\033[H\033[2J");
			else if (watch > 0 && !first)
				printf("\n");
			if (jobs)
				print_jobs_table(cJSON_GetObjectItemCaseSensitive(root, "jobs"), 0);
			else
				print_stats(root);
			cJSON_Delete(root);
		}
		free(text);
		fflush(stdout);
		if (watch <= 0 || interrupted)
			return 0;
		struct timespec ts = { (time_t)watch, (long)((watch - (time_t)watch) * 1e9) };

		nanosleep(&ts, NULL);
		if (interrupted)
			return 0;
	}
}

static int
cmd_drop(struct zc_conn *c, const char *job)
{
	if (zc_job_drop(c, job) < 0) {
		fprintf(stderr, "zoffctl: drop %s (zoffloadd at %s): %s\n", job, socket_shown,
		    zc_errmsg(c));
		return 1;
	}
	printf("job '%s' dropped\n", job);
	return 0;
}

static int
cmd_ping(struct zc_conn *c, long n)
{
	for (long i = 0; i < n; i++) {
		uint64_t rtt;

		if (zc_ping(c, &rtt) < 0) {
			fprintf(stderr, "zoffctl: ping zoffloadd at %s: %s\n", socket_shown,
			    zc_errmsg(c));
			return 1;
		}
		printf("pong from zoffloadd: %.1f us\n", (double)rtt / 1e3);
	}
	return 0;
}

struct options {
	const char *socket_path;
	bool json;
	bool python;
	double watch;
	long count;
	struct zoffctl_tune_opts tune;
};

/* 0 handled, 1 help or version printed, 2 bad usage. */
static int
take_option(int opt, const char *arg, struct options *o)
{
	char *end;

	switch (opt) {
	case 's':
		o->socket_path = arg;
		return 0;
	case 'j':
		o->json = true;
		return 0;
	case 'w':
		o->watch = strtod(arg, &end);
		if (*end != '\0' || !(o->watch > 0)) {
			fprintf(stderr, "zoffctl: --watch: '%s' is not a positive number of seconds\n",
			    arg);
			return 2;
		}
		return 0;
	case 'n':
		o->count = strtol(arg, &end, 10);
		if (*end != '\0' || o->count < 1) {
			fprintf(stderr, "zoffctl: --count: '%s' is not a positive integer\n", arg);
			return 2;
		}
		return 0;
	case 'S':
		o->tune.seconds = strtod(arg, &end);
		if (*end != '\0' || !(o->tune.seconds > 0) || o->tune.seconds > 60) {
			fprintf(stderr, "zoffctl: --seconds: '%s' is not a number of seconds from 0 "
			    "to 60\n", arg);
			return 2;
		}
		return 0;
	case 'B':
		o->tune.size = strtoull(arg, &end, 10);
		if (*end == 'M' || *end == 'G')
			o->tune.size <<= *end++ == 'M' ? 20 : 30;
		if (*end != '\0' || o->tune.size < (4u << 20)) {
			fprintf(stderr, "zoffctl: --size: '%s' is not a size of at least 4M (bytes, "
			    "or a number with M or G)\n", arg);
			return 2;
		}
		return 0;
	case 'q':
		o->tune.quick = true;
		return 0;
	case 'P':
		o->python = true;
		return 0;
	case 'h':
		usage(stdout);
		return 1;
	case 'V':
		printf("zoffctl %s\n", ZOFFLOAD_VERSION);
		return 1;
	default:
		usage(stderr);
		return 2;
	}
}

int
main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "json", no_argument, NULL, 'j' },
		{ "watch", required_argument, NULL, 'w' },
		{ "count", required_argument, NULL, 'n' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ "seconds", required_argument, NULL, 'S' },
		{ "size", required_argument, NULL, 'B' },
		{ "quick", no_argument, NULL, 'q' },
		{ "python", no_argument, NULL, 'P' },
		{ NULL, 0, NULL, 0 },
	};
	struct options o = { .count = 1 };
	const char *cmd, *job = NULL;
	struct zc_conn *c;
	int opt, r;

	/* '+': stop at the command; its options are read after it. */
	while ((opt = getopt_long(argc, argv, "+s:jw:n:hVS:B:qP", opts, NULL)) != -1)
		if ((r = take_option(opt, optarg, &o)) != 0)
			return r == 1 ? 0 : r;
	if (optind >= argc) {
		usage(stderr);
		return 2;
	}
	cmd = argv[optind++];
	/* Files, not the daemon: its own arguments, no connection. */
	if (strcmp(cmd, "checkpoint") == 0)
		return zoffctl_checkpoint(argc - optind, argv + optind);
	while ((opt = getopt_long(argc, argv, "s:jw:n:hVS:B:qP", opts, NULL)) != -1)
		if ((r = take_option(opt, optarg, &o)) != 0)
			return r == 1 ? 0 : r;
	if (strcmp(cmd, "import-deepspeed") == 0) {
		if (optind + 1 != argc) {
			fprintf(stderr, "zoffctl: import-deepspeed needs one DeepSpeed config file "
			    "(- for stdin)\n");
			return 2;
		}
		if (o.json && o.python) {
			fprintf(stderr, "zoffctl: import-deepspeed: --json or --python, not both\n");
			return 2;
		}
		return zoffctl_import_deepspeed(argv[optind], o.json ? ZOFFCTL_JSON : o.python ?
		    ZOFFCTL_PYTHON : ZOFFCTL_TEXT, stdout);
	}
	if (strcmp(cmd, "tune") == 0) {
		o.tune.json = o.json;
		if (optind >= argc) {
			fprintf(stderr, "zoffctl: tune needs the swap directories to measure\n");
			return 2;
		}
		return zoffctl_tune((const char *const *)argv + optind, (unsigned)(argc - optind),
		    &o.tune, stdout);
	}
	if (strcmp(cmd, "drop") == 0) {
		if (optind >= argc) {
			fprintf(stderr, "zoffctl: drop needs a job name\n");
			return 2;
		}
		job = argv[optind++];
	}
	if (optind < argc) {
		fprintf(stderr, "zoffctl: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	if (strcmp(cmd, "stats") != 0 && strcmp(cmd, "jobs") != 0 && strcmp(cmd, "ping") != 0 &&
	    strcmp(cmd, "drop") != 0) {
		fprintf(stderr, "zoffctl: unknown command '%s'\n", cmd);
		usage(stderr);
		return 2;
	}
	socket_shown = socket_to_show(o.socket_path);
	r = zc_connect(o.socket_path, &c);
	if (r < 0) {
		/* libzclient's text names the socket and, when denied, the group it admits. */
		fprintf(stderr, "zoffctl: %s\n", zc_connect_errmsg());
		if (r == -ENOENT || r == -ECONNREFUSED)
			fprintf(stderr, "zoffctl: the socket comes from --socket, else "
			    "$ZOFFLOAD_SOCKET, else %s\n", ZOFFLOAD_DEFAULT_SOCKET);
		return 1;
	}
	signal(SIGINT, on_sigint);
	if (strcmp(cmd, "ping") == 0)
		r = cmd_ping(c, o.count);
	else if (job != NULL)
		r = cmd_drop(c, job);
	else
		r = cmd_json(c, strcmp(cmd, "jobs") == 0, o.json, o.watch);
	zc_disconnect(c);
	return r;
}
