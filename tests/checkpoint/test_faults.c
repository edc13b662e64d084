/*
 * A checkpoint that is damaged, incomplete or of another optimizer is refused with an error
 * naming file and tensor, and nothing is registered; a save cut short (client or daemon
 * killed, disk full) leaves the earlier checkpoint in the directory whole; the running job
 * goes on.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ck.h"

#define K 3

static struct itd d;
static char swapdir[64], ckdir[64], mnt[64];
static struct ck_job job;

static void
teardown(void)
{
	ck_job_close(&job);
	itd_cleanup(&d);
	ck_opts = (struct ck_opts){ 0 };
	if (mnt[0] != '\0') {
		(void)umount(mnt);
		(void)rmdir(mnt);
	}
	ck_rmdir(ckdir);
	ck_rmdir(swapdir);
}

TestSuite(faults, .fini = teardown, .timeout = 120);

static void
start(void)
{
	char config[512];

	ck_tmpdir(swapdir, sizeof(swapdir), "swap");
	ck_config(config, sizeof(config), swapdir);
	itd_start(&d, config);
}

/* A job of 2 ranks at step K saved into ckdir; it stays open (the "running job"). */
static void
saved_job(void)
{
	start();
	ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
	ck_job_start(&job, &d, "running", 2, ZC_ADAMW, ZC_POLICY_AUTO);
	ck_job_steps(&job, 1, K);
	ck_job_save(&job, ckdir, K);
}

static void
rank_file(char *path, size_t len, const char *dir, unsigned rank, unsigned world)
{
	snprintf(path, len, "%s/rank-%05u-of-%05u.safetensors", dir, rank, world);
}

/*
 * Restores parameter p whole into a new job of one rank, expecting refusal: code, and a
 * message with each of the texts; then registers the same name from fresh values, which
 * only works if the refused tensor was not left registered.
 */
static void
expect_refused(unsigned p, enum zc_optim optim, int code, const char *const *texts)
{
	struct zc_conn *c = itd_connect(&d);
	struct zc_tensor_desc desc = { ck_param_name[p], ck_param_numel[p], ZC_F32, ZC_F32,
		false };
	struct zc_checkpoint *ck;
	struct zc_tensor *t = NULL;
	float *init = calloc(ck_param_numel[p], sizeof(float));
	int r;

	struct zc_job_options o = { .policy = ZC_POLICY_AUTO, .state_format = ck_opts.format };

	cr_assert_eq(zc_job_open_opts(c, "resume", 0, 1, &o), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_checkpoint_open(c, ckdir, &ck), 0, "%s", zc_errmsg(c));
	r = zc_tensor_register_checkpoint(c, &desc, ck, NULL, optim, &t);
	cr_assert_eq(r, code, "restore of %s: %d (%s), expected %d", ck_param_name[p], r,
	    zc_errmsg(c), code);
	for (; *texts != NULL; texts++)
		cr_assert(strstr(zc_errmsg(c), *texts) != NULL, "'%s' not in: %s", *texts,
		    zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "the refused tensor stayed: %s",
	    zc_errmsg(c));
	zc_checkpoint_close(ck);
	cr_assert_eq(zc_job_close(c), 0);
	zc_disconnect(c);
	free(init);
}

/* The job that was saved steps on as if nothing happened. */
static void
running_job_unharmed(void)
{
	ck_job_steps(&job, K + 1, K + 2);
}

static void
flip_bit(const char *path, uint64_t offset_from_end)
{
	struct stat st;
	uint8_t b;
	int fd = open(path, O_RDWR);

	cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
	cr_assert_eq(fstat(fd, &st), 0);
	cr_assert_eq(pread(fd, &b, 1, st.st_size - (off_t)offset_from_end), 1);
	b ^= 0x10;
	cr_assert_eq(pwrite(fd, &b, 1, st.st_size - (off_t)offset_from_end), 1);
	close(fd);
}

Test(faults, one_bit_flipped)
{
	char path[128];

	saved_job();
	/* The last bytes of rank 1's file: the end of layers.0.b's exp_avg_sq. */
	rank_file(path, sizeof(path), ckdir, 1, 2);
	flip_bit(path, 5);
	expect_refused(1, ZC_ADAMW, -EBADMSG, (const char *const[]){ "rank-00001-of-00002",
	    "layers.0.b", "exp_avg_sq", "CRC-32C", NULL });
	running_job_unharmed();
}

/* zoffctl checkpoint inspect: the whole directory passes, a flipped bit is named. */
static int
inspect(char *out, size_t len)
{
	char cmd[256];
	FILE *p;
	size_t n;
	int status;

	snprintf(cmd, sizeof(cmd), "'%s' checkpoint inspect '%s' 2>&1", getenv("ZOFFCTL"), ckdir);
	p = popen(cmd, "r");
	cr_assert_not_null(p);
	n = fread(out, 1, len - 1, p);
	out[n] = '\0';
	status = pclose(p);
	cr_assert(WIFEXITED(status), "%s", out);
	return WEXITSTATUS(status);
}

Test(faults, zoffctl_inspect)
{
	static char out[16384];
	char path[128];

	saved_job();
	cr_assert_eq(inspect(out, sizeof(out)), 0, "%s", out);
	cr_assert(strstr(out, "2 rank files of world size 2, optimizer adamw") != NULL, "%s", out);
	cr_assert(strstr(out, "layers.0.w#1") != NULL && strstr(out, "[35001, 70001) of 70001  "
	    "step 3") != NULL, "%s", out);
	cr_assert(strstr(out, "12 arrays verified, 0 damaged") != NULL, "%s", out);
	rank_file(path, sizeof(path), ckdir, 1, 2);
	flip_bit(path, 5);
	cr_assert_eq(inspect(out, sizeof(out)), 1, "%s", out);
	cr_assert(strstr(out, "rank-00001-of-00002.safetensors: tensor 'layers.0.b#1/exp_avg_sq': "
	    "CRC-32C") != NULL, "%s", out);
	cr_assert(strstr(out, "12 arrays verified, 1 damaged") != NULL, "%s", out);
	rank_file(path, sizeof(path), ckdir, 0, 2);
	cr_assert_eq(unlink(path), 0);
	cr_assert_eq(inspect(out, sizeof(out)), 1, "%s", out);
	cr_assert(strstr(out, "MISSING RANKS: 1 of 2") != NULL, "%s", out);
	cr_assert(strstr(out, "INCOMPLETE") != NULL, "%s", out);
}

/*
 * q8-moments: five arrays a tensor (the U8 codes and the F32 scales too) verified by
 * inspect; a flipped bit in the codes is named there and refuses the restore.
 */
Test(faults, q8_arrays_verified_and_a_flipped_code_named)
{
	static char out[16384];
	char path[128];

	ck_opts.format = "q8-moments";
	ck_opts.align = 256;	/* restored onto one rank: raw, no block split */
	saved_job();
	cr_assert_eq(inspect(out, sizeof(out)), 0, "%s", out);
	cr_assert(strstr(out, "U8+scales arrays  checksums ok") != NULL, "%s", out);
	cr_assert(strstr(out, "20 arrays verified, 0 damaged") != NULL, "%s", out);
	/* The last bytes of rank 1's file: the end of layers.0.b's exp_avg_sq codes. */
	rank_file(path, sizeof(path), ckdir, 1, 2);
	flip_bit(path, 5);
	cr_assert_eq(inspect(out, sizeof(out)), 1, "%s", out);
	cr_assert(strstr(out, "rank-00001-of-00002.safetensors: tensor 'layers.0.b#1/exp_avg_sq': "
	    "CRC-32C") != NULL, "%s", out);
	cr_assert(strstr(out, "20 arrays verified, 1 damaged") != NULL, "%s", out);
	expect_refused(1, ZC_ADAMW, -EBADMSG, (const char *const[]){ "rank-00001-of-00002",
	    "layers.0.b", "exp_avg_sq", "CRC-32C", NULL });
	running_job_unharmed();
}

Test(faults, truncated_file)
{
	char path[128];

	saved_job();
	rank_file(path, sizeof(path), ckdir, 1, 2);
	cr_assert_eq(truncate(path, 300000), 0);
	expect_refused(0, ZC_ADAMW, -EBADMSG, (const char *const[]){ "rank-00001-of-00002",
	    "layers.0.w", "truncated", NULL });
	running_job_unharmed();
}

Test(faults, missing_rank_file)
{
	char path[128];

	saved_job();
	rank_file(path, sizeof(path), ckdir, 0, 2);
	cr_assert_eq(unlink(path), 0);
	expect_refused(0, ZC_ADAMW, -ENOENT, (const char *const[]){ "elements 0..35001",
	    "layers.0.w", "none of its 1 rank files", NULL });
	running_job_unharmed();
}

/* A save that cannot be right is refused before any file is made. */
Test(faults, save_refused)
{
	struct zc_step_params sp = ck_params(ZC_ADAMW, K);
	struct zc_checkpoint_entry es[2];
	struct zc_conn *c;
	char cmd[160];

	saved_job();
	c = job.r[0].c;
	es[0] = (struct zc_checkpoint_entry){ job.r[0].t[0], NULL, 0, 0 };
	es[1] = es[0];
	cr_assert_eq(zc_checkpoint_save(c, "/tmp", es, 2, &sp), -EINVAL);
	cr_assert(strstr(zc_errmsg(c), "listed twice") != NULL, "%s", zc_errmsg(c));
	es[0].global_numel = 10;
	cr_assert_eq(zc_checkpoint_save(c, ckdir, es, 1, &sp), -EINVAL);
	cr_assert(strstr(zc_errmsg(c), "does not fit at 0 in 'layers.0.w#0' of 10") != NULL, "%s",
	    zc_errmsg(c));
	cr_assert_eq(zc_checkpoint_save(c, "/nonexistent-dir", es, 0, &sp), -EINVAL);
	es[0].global_numel = 0;
	cr_assert_eq(zc_checkpoint_save(c, "/nonexistent-dir", es, 1, &sp), -ENOENT);
	cr_assert(strstr(zc_errmsg(c), "cannot create /nonexistent-dir/.rank-00000-of-00002") !=
	    NULL, "%s", zc_errmsg(c));
	/* Only the two rank files saved before are there. */
	snprintf(cmd, sizeof(cmd), "test $(ls -A %s | wc -l) = 2", ckdir);
	cr_assert_eq(system(cmd), 0);
	running_job_unharmed();
}

/* Every array of rank 0's file says F16: the same length of header, another dtype. */
Test(faults, other_dtype)
{
	static char head[65536];
	char path[128], *p;
	ssize_t n;
	int fd;

	saved_job();
	rank_file(path, sizeof(path), ckdir, 0, 2);
	fd = open(path, O_RDWR);
	cr_assert_geq(fd, 0);
	n = pread(fd, head, sizeof(head) - 1, 0);
	cr_assert_gt(n, 8);
	head[n] = '\0';
	for (p = head + 8; (p = strstr(p, "\"F32\"")) != NULL; p += 5)
		memcpy(p, "\"F16\"", 5);
	cr_assert_eq(pwrite(fd, head, (size_t)n, 0), n);
	close(fd);
	expect_refused(0, ZC_ADAMW, -EBADMSG, (const char *const[]){ "rank-00000-of-00002",
	    "layers.0.w#0", "not F32", NULL });
	running_job_unharmed();
}

Test(faults, other_optimizer)
{
	saved_job();
	expect_refused(0, ZC_LION, -EBADMSG, (const char *const[]){ "rank-00000-of-00002",
	    "saved by adamw, not lion", NULL });
	running_job_unharmed();
}

/*
 * The disk fills during a save: the save fails saying so, its temporary file is gone,
 * the checkpoint saved before in the same directory restores to its step, bit for bit.
 */
Test(faults, disk_full_mid_save)
{
	struct ck_state before, got;
	struct ck_job back;
	char opts[32], path[128];
	struct zc_checkpoint_entry es[CK_PARAMS];
	struct zc_step_params sp = ck_params(ZC_ADAMW, K + 1);
	int r;

	start();
	snprintf(mnt, sizeof(mnt), "/tmp/zoff-full-XXXXXX");
	cr_assert_not_null(mkdtemp(mnt));
	/* One checkpoint (889 KB) fits, a second beside it does not. */
	snprintf(opts, sizeof(opts), "size=%u", 1400u << 10);
	if (mount("tmpfs", mnt, "tmpfs", 0, opts) < 0) {
		(void)rmdir(mnt);
		mnt[0] = '\0';
		cr_skip_test("cannot mount a small tmpfs here (%s)", strerror(errno));
	}
	ck_job_start(&job, &d, "running", 1, ZC_ADAMW, ZC_POLICY_NVME);
	ck_job_steps(&job, 1, K);
	ck_job_save(&job, mnt, K);
	ck_job_gather(&job, &before);
	ck_job_steps(&job, K + 1, K + 1);
	for (unsigned p = 0; p < CK_PARAMS; p++)
		es[p] = (struct zc_checkpoint_entry){ job.r[0].t[p], ck_param_name[p], 0,
			ck_param_numel[p] };
	r = zc_checkpoint_save(job.r[0].c, mnt, es, CK_PARAMS, &sp);
	cr_assert_eq(r, -ENOSPC, "%d: %s", r, zc_errmsg(job.r[0].c));
	cr_assert(strstr(zc_errmsg(job.r[0].c), "No space left on device") != NULL, "%s",
	    zc_errmsg(job.r[0].c));
	cr_assert(strstr(zc_errmsg(job.r[0].c), "rank-00000-of-00001") != NULL, "%s",
	    zc_errmsg(job.r[0].c));
	/* Only the earlier file is left. */
	rank_file(path, sizeof(path), mnt, 0, 1);
	{
		char cmd[160];

		snprintf(cmd, sizeof(cmd), "test \"$(ls -A %s)\" = rank-00000-of-00001.safetensors",
		    mnt);
		cr_assert_eq(system(cmd), 0, "the failed save left files in %s", mnt);
	}
	ck_job_restore(&back, &d, "back", 3, ZC_ADAMW, ZC_POLICY_CPU, mnt, K);
	ck_job_gather(&back, &got);
	ck_assert_same(&before, &got, "the checkpoint saved before the disk filled");
	ck_job_close(&back);
	/* And the job goes on, and saves where there is room. */
	ck_job_steps(&job, K + 2, K + 3);
	ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
	ck_job_save(&job, ckdir, K + 3);
	ck_state_free(&before);
	ck_state_free(&got);
}

/* A rank with one big tensor on NVMe saving again and again: each save takes a while. */
#define BIG (6u << 20)

static const struct itd *victim_daemon;
static const char *victim_dir;

static void
saver(int report)
{
	struct zc_conn *c = itd_connect(victim_daemon);
	struct zc_tensor_desc desc = { "big", BIG, ZC_F32, ZC_F32, false };
	struct zc_job_options o = { .policy = ZC_POLICY_NVME };
	struct zc_step_params sp = ck_params(ZC_ADAMW, 1);
	struct zc_checkpoint_entry e;
	struct zc_tensor *t;
	float *v = malloc(BIG * sizeof(float));

	for (uint32_t i = 0; i < BIG; i++)
		v[i] = (float)i * 1e-7f;
	/* A killed daemon does not come back here: the save fails once this is over. */
	(void)zc_set_reconnect(c, 200);
	if (zc_job_open_opts(c, "victim", 0, 1, &o) < 0 || zc_tensor_register(c, &desc, v, &t) < 0)
		_exit(2);
	memcpy(zc_tensor_grad_slot(t, NULL), v, BIG * sizeof(float));
	e = (struct zc_checkpoint_entry){ t, NULL, 0, 0 };
	if (zc_step_submit(c, &sp, &t, 1) < 0 || zc_wait_all(c, NULL) < 0 ||
	    zc_checkpoint_save(c, victim_dir, &e, 1, &sp) < 0)
		_exit(3);
	sp.step = 2;
	if (zc_step_submit(c, &sp, &t, 1) < 0 || zc_wait_all(c, NULL) < 0)
		_exit(4);
	(void)!write(report, "s", 1);
	for (;;)
		if (zc_checkpoint_save(c, victim_dir, &e, 1, &sp) < 0)
			_exit(5);
}

/* Whatever the moment of the kill, the directory restores: a whole file, at step 1 or 2. */
static void
restores_whole(void)
{
	struct zc_conn *c = itd_connect(&d);
	struct zc_tensor_desc desc = { "big", BIG, ZC_F32, ZC_F32, false };
	struct zc_checkpoint *ck;
	struct zc_tensor *t;

	cr_assert_eq(zc_job_open(c, "after", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_checkpoint_open(c, ckdir, &ck), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register_checkpoint(c, &desc, ck, NULL, ZC_ADAMW, &t), 0, "%s",
	    zc_errmsg(c));
	cr_assert(zc_tensor_last_step(t) == 1 || zc_tensor_last_step(t) == 2, "step %llu",
	    (unsigned long long)zc_tensor_last_step(t));
	zc_checkpoint_close(ck);
	cr_assert_eq(zc_job_close(c), 0);
	zc_disconnect(c);
}

Test(faults, client_killed_mid_save)
{
	start();
	ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
	ck_job_start(&job, &d, "running", 1, ZC_ADAMW, ZC_POLICY_CPU);
	victim_daemon = &d;
	victim_dir = ckdir;
	itd_fork_client(&d, saver, 60, "the saving client", "its second save");
	usleep(60000);
	cr_assert_eq(itd_kill_client(&d, NULL), 0);
	restores_whole();
	running_job_unharmed();
}

Test(faults, daemon_killed_mid_save)
{
	int status;

	start();
	ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
	victim_daemon = &d;
	victim_dir = ckdir;
	itd_fork_client(&d, saver, 60, "the saving client", "its second save");
	usleep(60000);
	cr_assert_eq(kill(d.pid, SIGKILL), 0);
	(void)itd_wait(&d, 10);
	/* The client's save fails (the daemon is gone): it exits 5, never crashes. */
	cr_assert_eq(waitpid(d.client, &status, 0), d.client);
	d.client = 0;
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 5, "client status %#x", status);
	itd_cleanup(&d);
	ck_rmdir(swapdir);
	start();
	restores_whole();
}

/*
 * A restore without a checkpoint, with one opened on another connection, or with an
 * unknown optimizer is refused with -EINVAL before anything is asked of the daemon.
 */
Test(faults, restore_arguments)
{
	struct zc_tensor_desc desc = { ck_param_name[1], ck_param_numel[1], ZC_F32, ZC_F32,
		false };
	struct zc_conn *c, *other;
	struct zc_checkpoint *ck;
	struct zc_tensor *t = NULL;

	saved_job();
	c = itd_connect(&d);
	other = itd_connect(&d);
	cr_assert_eq(zc_job_open(c, "resume", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_checkpoint_open(other, ckdir, &ck), 0, "%s", zc_errmsg(other));
	cr_assert_eq(zc_tensor_register_checkpoint(c, &desc, NULL, NULL, ZC_ADAMW, &t), -EINVAL);
	cr_assert(strstr(zc_errmsg(c), "a checkpoint opened on this connection") != NULL, "%s",
	    zc_errmsg(c));
	cr_assert_eq(zc_tensor_register_checkpoint(c, &desc, ck, NULL, ZC_ADAMW, &t), -EINVAL);
	zc_checkpoint_close(ck);
	cr_assert_eq(zc_checkpoint_open(c, ckdir, &ck), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register_checkpoint(c, &desc, ck, NULL, (enum zc_optim)99, &t),
	    -EINVAL);
	cr_assert_null(t);
	/* Nothing was registered: the same name restores now. */
	cr_assert_eq(zc_tensor_register_checkpoint(c, &desc, ck, NULL, ZC_ADAMW, &t), 0, "%s",
	    zc_errmsg(c));
	zc_checkpoint_close(ck);
	zc_disconnect(other);
	zc_disconnect(c);
}
