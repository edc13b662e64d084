/*
 * bench_checkpoint: zc_checkpoint_save and a restore of every tensor (zc_checkpoint_open and
 * zc_tensors_register_checkpoint) over state several times the pinned budget (the rest on
 * NVMe swap in the same directory), against fio moving the same bytes the same way in the
 * same run.  The checkpoint's I/O is two streams at once, and so is fio's limit: a save
 * writes the file (buffered, fsync at the end) while the tiers read the swapped state
 * (O_DIRECT); a restore reads the file (out of the page cache first) while the tiers write
 * the swap.  fio's read reads the checkpoint's own rank file, taking turns with the
 * restore, so that a cache below ours (a virtual disk's host) favours neither.  Each save
 * after the first replaces the last rep's checkpoint, as a job saving into one directory
 * does: the daemon frees the old file after the save returns (CKPT_RELEASE), and the bench
 * waits for that, untimed, before the next pass.  fio writes a new file each pass, the
 * last one's removed before, untimed.  fio's swap side moves as many bytes as the tiers
 * did, by the daemon's own counters of the swap's reads and writes during the save and
 * the restore.  fio on the file alone is printed beside (text output): the disk's speed
 * with nothing else on it.
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

/*
 * One fio run of two jobs at once, as the checkpoint moves its bytes: the checkpoint file's
 * side (sequential 1 MiB blocks, buffered as ours: a write ends with fsync, a read starts
 * with the file out of the page cache) and the NVMe swap's side (what the tiers move
 * meanwhile: O_DIRECT, 1 MiB blocks, 32 in flight, as the swap engine).  The file side's
 * bytes over the run's time (the slower job's), in MiB/s; swap_bytes 0: the file alone.
 */
static double
fio_pass(const char *file, uint64_t bytes, bool write, const char *swapfile,
    uint64_t swap_bytes)
{
	char cmd[2048], swapjob[1200] = "", out[1 << 17];
	cJSON *root, *jobs;
	double ms = 0, v = -1;
	size_t n;
	FILE *p;

	if (swap_bytes > 0)
		snprintf(swapjob, sizeof(swapjob), " --name=swap --filename=%s --rw=%s "
		    "--size=%" PRIu64 " --direct=1 --ioengine=libaio --iodepth=32", swapfile,
		    write ? "read" : "write", swap_bytes);
	snprintf(cmd, sizeof(cmd), "fio --bs=1M --output-format=json --name=ckpt --filename=%s "
	    "--rw=%s --size=%" PRIu64 " --ioengine=psync %s%s 2>/dev/null", file,
	    write ? "write" : "read", bytes, write ? "--end_fsync=1" : "--invalidate=1", swapjob);
	p = popen(cmd, "r");
	if (p == NULL)
		return -1;
	n = fread(out, 1, sizeof(out) - 1, p);
	out[n] = '\0';
	if (pclose(p) != 0)
		return -1;
	root = cJSON_Parse(strchr(out, '{') != NULL ? strchr(out, '{') : out);
	jobs = cJSON_GetObjectItem(root, "jobs");
	for (int i = 0; i < cJSON_GetArraySize(jobs); i++) {
		cJSON *j = cJSON_GetArrayItem(jobs, i);
		cJSON *rt = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "read"), "runtime");
		cJSON *wt = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "write"), "runtime");

		/* A job's runtime counts its end_fsync; the other direction's is 0. */
		if (cJSON_IsNumber(rt) && rt->valuedouble > ms)
			ms = rt->valuedouble;
		if (cJSON_IsNumber(wt) && wt->valuedouble > ms)
			ms = wt->valuedouble;
	}
	if (ms > 0)
		v = bytes / MiB / (ms / 1000.0);
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

/* Has the filesystem commit what the last pass left it (a file freed), before the next. */
static void
sync_untimed(const char *dir)
{
	int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);

	if (fd < 0 || syncfs(fd) < 0)
		die("syncing %s: %s", dir, strerror(errno));
	close(fd);
}

/*
 * Removes a file the last pass wrote, untimed: freeing a 512 MiB file took 90-170 ms here
 * (in the syscall that drops its last link, and at the journal's next commit), which no
 * pass is to pay for another.
 */
static void
remove_untimed(const char *path, const char *dir)
{
	if (unlink(path) < 0 && errno != ENOENT)
		die("removing %s: %s", path, strerror(errno));
	sync_untimed(dir);
}

/* The checkpoint a save replaced, closed by the daemon (on its I/O threads), and committed. */
static void
released_untimed(struct zc_conn *c, const char *dir)
{
	double closing;

	for (;;) {
		if (bench_stat_number(c, "checkpoint.replaced_files_closing", &closing) < 0)
			die("stats: no checkpoint.replaced_files_closing");
		if (closing == 0)
			break;
		usleep(1000);
	}
	sync_untimed(dir);
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
	    "Saves and restores a job's state (default 512 MiB in 8 tensors; each job's pinned\n"
	    "budget 96 MiB, which holds one: the rest on NVMe swap in DIR) into DIR ($TMPDIR or\n"
	    "/tmp) and runs fio there on as many bytes, the checkpoint file's and the swap's at\n"
	    "once; best of N (5) each.  Needs about 4x the state free there.  Exits 77 without\n"
	    "fio.\n");
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
	/* Room for both jobs' budgets: the saved one's and its restore's, which live at once. */
	fprintf(f, "{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"info\" },\n"
	    "  \"memory\": { \"pinned_budget\": %" PRIu64 ", \"job_pinned_budget\": %" PRIu64
	    ", \"policy\": \"auto\" },\n"
	    "  \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": %" PRIu64 " } ] } }\n",
	    2 * o->pinned_budget, o->pinned_budget, bd->dir, 2 * o->state_bytes + (64u << 20));
	fclose(f);
	r = bench_daemon_start(bd, o->daemon, NULL, 60);
	if (r < 0)
		die("starting zoffloadd: %s (log: %s)", strerror(-r), bd->log);
}

/* A counter of the daemon's swap (its one path): "read_bytes" or "written_bytes". */
static uint64_t
swap_counter(struct zc_conn *c, const char *name)
{
	char path[64];
	double v;

	snprintf(path, sizeof(path), "tiers.nvme.paths.0.%s", name);
	if (bench_stat_number(c, path, &v) < 0)
		die("stats: no %s", path);
	return (uint64_t)v;
}

/*
 * Every tensor of the checkpoint in ckdir registered from it on a new connection: MiB/s,
 * and in swap_written what the tiers wrote of it to the swap meanwhile.
 */
static double
time_restore(const struct bench_daemon *bd, const char *ckdir, uint64_t numel, unsigned n,
    uint64_t *swap_written)
{
	struct zc_tensor_desc *ds = calloc(n, sizeof(*ds));
	struct zc_tensor **ts = calloc(n, sizeof(*ts));
	char (*names)[32] = calloc(n, sizeof(*names));
	struct zc_checkpoint *ck;
	struct zc_conn *c;
	double t0, rate;

	if (ds == NULL || ts == NULL || names == NULL)
		die("out of memory");
	for (unsigned k = 0; k < n; k++) {
		snprintf(names[k], sizeof(names[k]), "t%u", k);
		ds[k] = (struct zc_tensor_desc){ names[k], numel, ZC_BF16, ZC_BF16, false };
	}
	if (zc_connect(bd->socket, &c) < 0 || zc_job_open(c, "restore", 0, 1) < 0)
		die("job: %s", zc_errmsg(c));
	*swap_written = swap_counter(c, "written_bytes");
	t0 = bench_now();
	if (zc_checkpoint_open(c, ckdir, &ck) < 0)
		die("open: %s", zc_errmsg(c));
	if (zc_tensors_register_checkpoint(c, n, ds, ck, NULL, ZC_ADAMW, ts) < 0)
		die("restore: %s", zc_errmsg(c));
	rate = numel * 12.0 * n / MiB / (bench_now() - t0);
	*swap_written = swap_counter(c, "written_bytes") - *swap_written;
	zc_checkpoint_close(ck);
	(void)zc_job_close(c);
	zc_disconnect(c);
	free(names);
	free(ts);
	free(ds);
	return rate;
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
		.pinned_budget = 96u << 20, .state_bytes = 512u << 20, .tensors = 8, .reps = 5 };
	struct zc_tensor **ts;
	struct zc_checkpoint_entry *es;
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 };
	struct bench_daemon bd;
	struct zc_conn *c;
	char ckdir[1100], fiofile[1100], swapfile[1100], rankfile[1200];
	uint64_t numel, bytes;
	double save = 0, restore = 0, fw = 0, fr = 0, fr_alone = 0, fw_alone = 0;
	uint64_t swap_read = 0, swap_written = 0;
	double pinned = 0, on_nvme = 0;
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
	snprintf(swapfile, sizeof(swapfile), "%s/fio.swap", bd.dir);
	snprintf(rankfile, sizeof(rankfile), "%s/rank-00000-of-00001.safetensors", ckdir);
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
	if (bench_stat_number(c, "jobs.0.pinned_bytes", &pinned) < 0 ||
	    bench_stat_number(c, "jobs.0.nvme_bytes", &on_nvme) < 0)
		die("stats: no jobs.0.pinned_bytes or nvme_bytes");
	/*
	 * The swap side of fio's save run reads this file, as the save reads the tiers: as
	 * much as the save read there, at most all of the state.
	 */
	if (fio_pass(swapfile, bytes, true, NULL, 0) <= 0)
		die("fio failed in %s", bd.dir);
	for (unsigned rep = 0; rep < o.reps; rep++) {
		/*
		 * Each against fio right after it, best of reps for each, so drift hits both
		 * alike.  The restore and fio's read read the same file, each with it out of
		 * the page cache first, in turns, so neither always finds the other's reads
		 * in a cache below ours (a virtual disk's host).
		 */
		double t0;

		swap_read = swap_counter(c, "read_bytes");
		t0 = bench_now();
		if (zc_checkpoint_save(c, ckdir, es, o.tensors, &sp) < 0)
			die("save: %s", zc_errmsg(c));
		save = best(save, bytes / MiB / (bench_now() - t0));
		swap_read = swap_counter(c, "read_bytes") - swap_read;
		released_untimed(c, ckdir);
		if (swap_read > bytes)
			die("the save read %" PRIu64 " bytes of swap for %" PRIu64 " of state",
			    swap_read, bytes);
		fw = best(fw, fio_pass(fiofile, bytes, true, swapfile, swap_read));
		remove_untimed(fiofile, bd.dir);
		fw_alone = best(fw_alone, fio_pass(fiofile, bytes, true, NULL, 0));
		remove_untimed(fiofile, bd.dir);
		for (unsigned turn = 0; turn < 2; turn++) {
			drop_cache(ckdir);
			if ((turn == 0) == (rep % 2 == 0)) {
				restore = best(restore, time_restore(&bd, ckdir, numel, o.tensors,
				    &swap_written));
				continue;
			}
			/* Rep 0 restores first: swap_written is the last restore's. */
			fr = best(fr, fio_pass(rankfile, bytes, false, swapfile, swap_written));
			drop_cache(ckdir);
			fr_alone = best(fr_alone, fio_pass(rankfile, bytes, false, NULL, 0));
		}
	}
	if (fw <= 0 || fr <= 0)
		die("fio failed in %s", bd.dir);
	zc_job_close(c);
	zc_disconnect(c);
	unlink(swapfile);
	rm_dir(ckdir);
	(void)bench_daemon_stop(&bd);
	if (o.json) {
		printf("[");
		bench_json_figure(0, "checkpoint_save", save, "MiB/s", fw, 1);
		bench_json_figure(1, "checkpoint_restore", restore, "MiB/s", fr, 1);
		printf("\n]\n");
	} else {
		printf("state %.0f MiB (job pinned budget %.0f MiB: %.0f MiB pinned, %.0f MiB on NVMe),"
		    " best of %u\n", bytes / MiB, o.pinned_budget / MiB, pinned / MiB, on_nvme / MiB,
		    o.reps);
		printf("swap moved by the tiers (and by fio's swap side): save read %.0f MiB, "
		    "restore wrote %.0f MiB\n", swap_read / MiB, swap_written / MiB);
		printf("checkpoint_save     %8.1f MiB/s   fio write %8.1f MiB/s   ratio %.3f\n", save,
		    fw, save / fw);
		printf("checkpoint_restore  %8.1f MiB/s   fio read  %8.1f MiB/s   ratio %.3f\n",
		    restore, fr, restore / fr);
		printf("(fio without the swap's side: write %.1f MiB/s, read %.1f MiB/s)\n",
		    fw_alone, fr_alone);
	}
	free(init);
	free(ts);
	free(es);
	return 0;
}
