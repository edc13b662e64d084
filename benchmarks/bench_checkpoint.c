/*
 * bench_checkpoint: zc_checkpoint_save and a restore of every tensor (zc_checkpoint_open and
 * zc_tensor_register_checkpoint) over state several times the pinned budget (the rest on
 * NVMe), against fio writing (buffered, fsync at the end, as the save does) and reading
 * (page cache dropped first, as before the restore) the same number of bytes in the same
 * directory, in the same run.
 */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench_common.h"
#include "bench_daemon.h"
#include "zclient.h"

#define MiB (1024.0 * 1024.0)

struct opts {
	bool json;
	const char *dir;
	const char *daemon;
	uint64_t pinned_budget;
	uint64_t state_bytes;
	unsigned tensors;
	unsigned reps;
};

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

static void
die(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fprintf(stderr, "bench_checkpoint: ");
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "\n");
	va_end(ap);
	exit(1);
}

/* fio's bandwidth in MiB/s: sequential 1 MiB blocks, buffered, as the checkpoint's I/O. */
static double
fio_pass(const char *path, uint64_t bytes, bool write)
{
	char cmd[1024], out[1 << 16];
	cJSON *root, *dir, *bw;
	double v = -1;
	size_t n;
	FILE *p;

	snprintf(cmd, sizeof(cmd), "fio --name=ckpt --filename=%s --rw=%s --bs=1M --size=%" PRIu64
	    " --ioengine=psync %s --output-format=json 2>/dev/null", path,
	    write ? "write" : "read", bytes, write ? "--end_fsync=1" : "--invalidate=1");
	p = popen(cmd, "r");
	if (p == NULL)
		return -1;
	n = fread(out, 1, sizeof(out) - 1, p);
	out[n] = '\0';
	if (pclose(p) != 0)
		return -1;
	root = cJSON_Parse(strchr(out, '{') != NULL ? strchr(out, '{') : out);
	dir = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(root, "jobs"), 0),
	    write ? "write" : "read");
	bw = cJSON_GetObjectItem(dir, "bw_bytes");
	if (cJSON_IsNumber(bw))
		v = bw->valuedouble / MiB;
	cJSON_Delete(root);
	return v;
}

/* Drops the directory's files from the page cache (they are clean: saved with fsync). */
static void
drop_cache(const char *dir)
{
	struct dirent *de;
	char path[1400];
	DIR *d = opendir(dir);

	if (d == NULL)
		return;
	while ((de = readdir(d)) != NULL) {
		int fd;

		snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
		fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		(void)fdatasync(fd);
		(void)posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
		close(fd);
	}
	closedir(d);
}

static void
rm_dir(const char *dir)
{
	struct dirent *de;
	char path[1400];
	DIR *d = opendir(dir);

	if (d == NULL)
		return;
	while ((de = readdir(d)) != NULL) {
		snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
		(void)unlink(path);
	}
	closedir(d);
	(void)rmdir(dir);
}

static void
usage(FILE *f)
{
	fprintf(f, "usage: bench_checkpoint [--json] [--dir DIR] [--daemon PATH] [--state MiB]\n"
	    "    [--pinned MiB] [--reps N]\n"
	    "Saves and restores a job's state (default 512 MiB, pinned budget 64 MiB: the rest on\n"
	    "NVMe swap in DIR) into DIR ($TMPDIR or /tmp) and runs fio there on as many bytes;\n"
	    "needs about 3x the state free there.  Exits 77 without fio.\n");
}

static void
parse(int argc, char **argv, struct opts *o)
{
	static const struct option lo[] = {
		{ "json", no_argument, NULL, 'j' }, { "dir", required_argument, NULL, 'd' },
		{ "daemon", required_argument, NULL, 'D' }, { "state", required_argument, NULL, 's' },
		{ "pinned", required_argument, NULL, 'p' }, { "reps", required_argument, NULL, 'r' },
		{ "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	int c;

	while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		switch (c) {
		case 'j': o->json = true; break;
		case 'd': o->dir = optarg; break;
		case 'D': o->daemon = optarg; break;
		case 's': o->state_bytes = strtoull(optarg, NULL, 10) << 20; break;
		case 'p': o->pinned_budget = strtoull(optarg, NULL, 10) << 20; break;
		case 'r': o->reps = (unsigned)strtoul(optarg, NULL, 10); break;
		case 'h': usage(stdout); exit(0);
		default: usage(stderr); exit(2);
		}
	}
	if (o->daemon == NULL || o->state_bytes < (12u << 20) || o->reps == 0) {
		usage(stderr);
		exit(2);
	}
}

static void
start_daemon(struct bench_daemon *bd, const struct opts *o)
{
	FILE *f;
	int r = bench_daemon_prepare(bd, o->dir, "zoff-bench-ckpt");

	if (r < 0)
		die("temporary directory in %s: %s", o->dir, strerror(-r));
	f = fopen(bd->config, "w");
	if (f == NULL)
		die("%s: %s", bd->config, strerror(errno));
	fprintf(f, "{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"info\" },\n"
	    "  \"memory\": { \"pinned_budget\": %" PRIu64 ", \"policy\": \"auto\" },\n"
	    "  \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": %" PRIu64 " } ] } }\n",
	    o->pinned_budget, bd->dir, 2 * o->state_bytes + (64u << 20));
	fclose(f);
	r = bench_daemon_start(bd, o->daemon, NULL, 60);
	if (r < 0)
		die("starting zoffloadd: %s (log: %s)", strerror(-r), bd->log);
}

static double
best(double a, double b)
{
	return a > b ? a : b;
}

int
main(int argc, char **argv)
{
	const char *tmp = getenv("TMPDIR");
	struct opts o = { .dir = tmp != NULL ? tmp : "/tmp", .daemon = getenv("ZOFFLOADD"),
		.pinned_budget = 64u << 20, .state_bytes = 512u << 20, .tensors = 8, .reps = 2 };
	struct zc_tensor **ts;
	struct zc_checkpoint_entry *es;
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 };
	struct bench_daemon bd;
	struct zc_conn *c;
	char ckdir[1100], fiofile[1100];
	uint64_t numel, bytes;
	double save = 0, restore = 0, fw = 0, fr = 0;
	float *init;

	parse(argc, argv, &o);
	if (system("fio --version >/dev/null 2>&1") != 0) {
		fprintf(stderr, "bench_checkpoint: no fio\n");
		return 77;
	}
	numel = o.state_bytes / 12 / o.tensors;
	bytes = numel * 12 * o.tensors;
	start_daemon(&bd, &o);
	snprintf(ckdir, sizeof(ckdir), "%s/ckpt", bd.dir);
	snprintf(fiofile, sizeof(fiofile), "%s/fio.dat", bd.dir);
	if (mkdir(ckdir, 0700) < 0)
		die("%s: %s", ckdir, strerror(errno));
	ts = calloc(o.tensors, sizeof(*ts));
	es = calloc(o.tensors, sizeof(*es));
	init = malloc(numel * sizeof(float));
	if (ts == NULL || es == NULL || init == NULL)
		die("out of memory");
	for (uint64_t i = 0; i < numel; i++)
		init[i] = (float)(i % 1000) * 1e-3f - 0.5f;
	if (zc_connect(bd.socket, &c) < 0 || zc_job_open(c, "save", 0, 1) < 0)
		die("job: %s", zc_errmsg(c));
	for (unsigned k = 0; k < o.tensors; k++) {
		char name[32];
		struct zc_tensor_desc d = { name, numel, ZC_BF16, ZC_BF16, false };

		snprintf(name, sizeof(name), "t%u", k);
		if (zc_tensor_register(c, &d, init, &ts[k]) < 0)
			die("register %s: %s", name, zc_errmsg(c));
		es[k] = (struct zc_checkpoint_entry){ ts[k], NULL, 0, 0 };
	}
	/* One step, so the moments are not zeros. */
	for (unsigned k = 0; k < o.tensors; k++)
		memset(zc_tensor_grad_slot(ts[k], NULL), 0x3c, numel * 2);
	if (zc_step_submit(c, &sp, ts, o.tensors) < 0 || zc_wait_all(c, NULL) < 0)
		die("step: %s", zc_errmsg(c));
	for (unsigned rep = 0; rep < o.reps; rep++) {
		struct zc_checkpoint *ck;
		struct zc_conn *c2;
		double t0;

		/* Alternating with fio, best of reps for each, so drift hits both alike. */
		t0 = bench_now();
		if (zc_checkpoint_save(c, ckdir, es, o.tensors, &sp) < 0)
			die("save: %s", zc_errmsg(c));
		save = best(save, bytes / MiB / (bench_now() - t0));
		fw = best(fw, fio_pass(fiofile, bytes, true));
		drop_cache(ckdir);
		if (zc_connect(bd.socket, &c2) < 0 || zc_job_open(c2, "restore", 0, 1) < 0)
			die("job: %s", zc_errmsg(c2));
		t0 = bench_now();
		if (zc_checkpoint_open(c2, ckdir, &ck) < 0)
			die("open: %s", zc_errmsg(c2));
		for (unsigned k = 0; k < o.tensors; k++) {
			char name[32];
			struct zc_tensor_desc d = { name, numel, ZC_BF16, ZC_BF16, false };
			struct zc_tensor *t;

			snprintf(name, sizeof(name), "t%u", k);
			if (zc_tensor_register_checkpoint(c2, &d, ck, NULL, ZC_ADAMW, &t) < 0)
				die("restore %s: %s", name, zc_errmsg(c2));
		}
		restore = best(restore, bytes / MiB / (bench_now() - t0));
		zc_checkpoint_close(ck);
		(void)zc_job_close(c2);
		zc_disconnect(c2);
		/* The same way as before the restore: fio's own invalidation may leave pages. */
		drop_cache(bd.dir);
		fr = best(fr, fio_pass(fiofile, bytes, false));
		unlink(fiofile);
	}
	if (fw <= 0 || fr <= 0)
		die("fio failed in %s", bd.dir);
	zc_job_close(c);
	zc_disconnect(c);
	rm_dir(ckdir);
	(void)bench_daemon_stop(&bd);
	if (o.json) {
		printf("[");
		bench_json_figure(0, "checkpoint_save", save, "MiB/s", fw, 1);
		bench_json_figure(1, "checkpoint_restore", restore, "MiB/s", fr, 1);
		printf("\n]\n");
	} else {
		printf("state %.0f MiB (pinned budget %.0f MiB, the rest on NVMe), best of %u\n",
		    bytes / MiB, o.pinned_budget / MiB, o.reps);
		printf("checkpoint_save     %8.1f MiB/s   fio write %8.1f MiB/s   ratio %.3f\n", save,
		    fw, save / fw);
		printf("checkpoint_restore  %8.1f MiB/s   fio read  %8.1f MiB/s   ratio %.3f\n",
		    restore, fr, restore / fr);
	}
	free(init);
	free(ts);
	free(es);
	return 0;
}
