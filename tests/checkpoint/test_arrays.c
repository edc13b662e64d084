/*
 * One flipped byte in any array a checkpoint file holds (master, the moments, the q8 scales)
 * refuses the restore, naming the file, the tensor and the array, in every state format and
 * every way a restore moves the arrays: F32 arrays as they are, compressed ones raw into a
 * job of their format, or decoded first (allow_convert into another format).  The arrays
 * are found from the file's own header (client/ckpt_index.c, compiled in).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ck.h"
#include "ckpt_index.h"

#define K 3
#define P 0		/* layers.0.w: each rank's shard spans many 256-element blocks */

static struct itd d;
static char swapdir[64], ckdir[64];
static struct ck_job job;

static void
teardown(void)
{
	ck_job_close(&job);
	itd_cleanup(&d);
	ck_opts = (struct ck_opts){ 0 };
	ck_rmdir(ckdir);
	ck_rmdir(swapdir);
}

TestSuite(arrays, .fini = teardown, .timeout = 300);

/* A job of 2 ranks in format, at step K, saved into ckdir (shards on 256-element blocks). */
static void
saved_job(const char *format)
{
	char config[512];

	ck_opts.format = format;
	ck_opts.align = 256;
	ck_tmpdir(swapdir, sizeof(swapdir), "swap");
	ck_config(config, sizeof(config), swapdir);
	itd_start(&d, config);
	ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
	ck_job_start(&job, &d, "running", 2, ZC_ADAMW, ZC_POLICY_AUTO);
	ck_job_steps(&job, 1, K);
	ck_job_save(&job, ckdir, K);
}

/*
 * Restores parameter P whole into a new job of one rank in format (convert: allowed to
 * convert); 0, or the error with its message in msg.  A refused tensor is not left
 * registered: the same name registers from fresh values afterwards.
 */
static int
restore(const char *format, bool convert, char *msg, size_t len)
{
	struct zc_conn *c = itd_connect(&d);
	struct zc_tensor_desc desc = { ck_param_name[P], ck_param_numel[P], ZC_F32, ZC_F32,
		false };
	struct zc_job_options o = { .policy = ZC_POLICY_AUTO, .state_format = format };
	float *init = calloc(ck_param_numel[P], sizeof(float));
	struct zc_checkpoint *ck;
	struct zc_tensor *t = NULL;
	int r;

	cr_assert_not_null(init);
	cr_assert_eq(zc_job_open_opts(c, "resume", 0, 1, &o), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_checkpoint_open(c, ckdir, &ck), 0, "%s", zc_errmsg(c));
	zc_checkpoint_allow_convert(ck, convert);
	r = zc_tensor_register_checkpoint(c, &desc, ck, NULL, ZC_ADAMW, &t);
	snprintf(msg, len, "%s", r < 0 ? zc_errmsg(c) : "");
	if (r < 0)
		cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "the refused tensor stayed: "
		    "%s", zc_errmsg(c));
	zc_checkpoint_close(ck);
	cr_assert_eq(zc_job_close(c), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
	free(init);
	return r;
}

static void
flip_byte(const char *path, uint64_t at)
{
	int fd = open(path, O_RDWR);
	uint8_t b;

	cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
	cr_assert_eq(pread(fd, &b, 1, (off_t)at), 1);
	b ^= 0x10;
	cr_assert_eq(pwrite(fd, &b, 1, (off_t)at), 1);
	close(fd);
}

/*
 * Every array of rank 1's shard of P damaged in turn (a byte in its middle flipped, then
 * put back): each restore in format (and convert) is refused naming the file, the tensor
 * and that array; the undamaged file restores.  want_arrays: how many the shard must hold.
 */
static void
each_array_damaged(const char *format, bool convert, unsigned want_arrays)
{
	struct zck_index *ix;
	const struct zck_file *f;
	const struct zck_entry *e = NULL;
	char err[512], msg[1024], name[300];
	unsigned arrays = 0;

	cr_assert_eq(restore(format, convert, msg, sizeof(msg)), 0, "the undamaged checkpoint: %s",
	    msg);
	cr_assert_eq(zck_open(ckdir, &ix, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(ix->nfiles, 2);
	f = &ix->files[1];
	for (size_t i = 0; i < f->nentries; i++)
		if (strcmp(f->entries[i].global_name, ck_param_name[P]) == 0)
			e = &f->entries[i];
	cr_assert_not_null(e, "%s holds no shard of %s", f->path, ck_param_name[P]);
	for (unsigned k = 0; k < ZCK_ARRAYS; k++) {
		uint64_t bytes = zck_array_bytes(e->arrays, k, e->numel);
		int r;

		if (bytes == 0)
			continue;
		arrays++;
		flip_byte(f->path, e->begin[k] + bytes / 2);
		r = restore(format, convert, msg, sizeof(msg));
		flip_byte(f->path, e->begin[k] + bytes / 2);
		cr_assert_eq(r, -EBADMSG, "%s restore into %s%s with %s damaged: %d (%s)",
		    e->state_format, format, convert ? " (convert)" : "", zck_state_names[k], r, msg);
		snprintf(name, sizeof(name), "'%s/%s'", e->name, zck_state_names[k]);
		cr_assert(strstr(msg, "rank-00001-of-00002.safetensors") != NULL, "no file in: %s",
		    msg);
		cr_assert(strstr(msg, name) != NULL, "%s not in: %s", name, msg);
		cr_assert(strstr(msg, "CRC-32C") != NULL, "%s", msg);
	}
	cr_assert_eq(arrays, want_arrays, "%u arrays in %s's shard", arrays, e->state_format);
	zck_close(ix);
	cr_assert_eq(restore(format, convert, msg, sizeof(msg)), 0, "put back: %s", msg);
}

/* fp32: three F32 arrays, restored as they are. */
Test(arrays, fp32)
{
	saved_job("fp32");
	each_array_damaged("fp32", false, 3);
}

/* bf16-moments: the F32 master and two BF16 moments, raw or decoded. */
Test(arrays, bf16_moments_raw)
{
	saved_job("bf16-moments");
	each_array_damaged("bf16-moments", false, 3);
}

Test(arrays, bf16_moments_converted)
{
	saved_job("bf16-moments");
	each_array_damaged("fp32", true, 3);
}

/* q8-moments: the master, two U8 code arrays and their two F32 scale arrays. */
Test(arrays, q8_moments_raw)
{
	saved_job("q8-moments");
	each_array_damaged("q8-moments", false, 5);
}

Test(arrays, q8_moments_converted)
{
	saved_job("q8-moments");
	each_array_damaged("fp32", true, 5);
}

/* bf16-master+q8 is saved decoded, as three F32 arrays. */
Test(arrays, bf16_master_q8)
{
	saved_job("bf16-master+q8");
	each_array_damaged("bf16-master+q8", false, 3);
}
