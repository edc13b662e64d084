/*
 * Save at step K with N ranks, resume with M ranks (same or another shard layout), go on to
 * step END: the state is bit for bit that of a run never interrupted, for every optimizer,
 * with the state pinned or on NVMe.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ck.h"

#define K 3
#define END 6

static struct itd d;
static char swapdir[64], ckdir[64];

static void
teardown(void)
{
	itd_cleanup(&d);
	ck_opts = (struct ck_opts){ 0 };
	ck_rmdir(ckdir);
	ck_rmdir(swapdir);
}

TestSuite(reshard, .fini = teardown, .timeout = 240);

static const unsigned pairs[][2] = { { 2, 2 }, { 2, 3 }, { 3, 1 }, { 1, 4 } };

/* The uninterrupted run of world ranks, to END. */
static void
reference(enum zc_optim optim, enum zc_policy policy, unsigned world, const char *name,
    struct ck_state *want)
{
	struct ck_job ref;

	ck_job_start(&ref, &d, name, world, optim, policy);
	ck_job_steps(&ref, 1, END);
	/* The NVMe runs really go through the chunk pipeline. */
	if (policy == ZC_POLICY_NVME)
		cr_assert_gt(itd_stat(ref.r[0].c, "pipeline.tensor_steps_nvme"), 0);
	else
		cr_assert_eq(itd_stat(ref.r[0].c, "pipeline.tensor_steps_nvme"), 0);
	ck_job_gather(&ref, want);
	ck_job_close(&ref);
}

/*
 * Each pair saves at K with N ranks, resumes with M and goes on to END; compared with one
 * rank's uninterrupted run, or (same_world) with an uninterrupted run of N ranks.
 */
static void
run_pairs(enum zc_optim optim, const unsigned (*pairs_)[2], size_t npairs, bool same_world)
{
	static const enum zc_policy policies[] = { ZC_POLICY_CPU, ZC_POLICY_NVME };
	static const char *const policy_names[] = { "pinned", "nvme" };
	char config[512], what[128];
	unsigned job = 0;

	ck_tmpdir(swapdir, sizeof(swapdir), "swap");
	ck_config_chunks(config, sizeof(config), swapdir, 4u << 20);
	itd_start(&d, config);
	for (unsigned pi = 0; pi < 2; pi++) {
		struct ck_job a, b;
		struct ck_state want, got;
		char name[32];

		snprintf(name, sizeof(name), "ref%u", job++);
		if (!same_world)
			reference(optim, policies[pi], 1, name, &want);
		for (size_t k = 0; k < npairs; k++) {
			if (same_world) {
				snprintf(name, sizeof(name), "ref%u", job++);
				reference(optim, policies[pi], pairs_[k][0], name, &want);
			}
			ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
			snprintf(name, sizeof(name), "a%u", job++);
			ck_job_start(&a, &d, name, pairs_[k][0], optim, policies[pi]);
			ck_job_steps(&a, 1, K);
			ck_job_save(&a, ckdir, K);
			ck_job_close(&a);
			snprintf(name, sizeof(name), "b%u", job++);
			ck_job_restore(&b, &d, name, pairs_[k][1], optim, policies[pi], ckdir, K);
			ck_job_steps(&b, K + 1, END);
			ck_job_gather(&b, &got);
			ck_job_close(&b);
			snprintf(what, sizeof(what), "%s %s, %u -> %u ranks", policy_names[pi],
			    ck_opts.format != NULL ? ck_opts.format : "fp32", pairs_[k][0], pairs_[k][1]);
			ck_assert_same(&want, &got, what);
			ck_state_free(&got);
			ck_rmdir(ckdir);
			ckdir[0] = '\0';
			if (same_world)
				ck_state_free(&want);
		}
		if (!same_world)
			ck_state_free(&want);
	}
}

static void
run(enum zc_optim optim)
{
	run_pairs(optim, pairs, sizeof(pairs) / sizeof(pairs[0]), false);
}

Test(reshard, adamw) { run(ZC_ADAMW); }
Test(reshard, adam) { run(ZC_ADAM); }
Test(reshard, adagrad) { run(ZC_ADAGRAD); }
Test(reshard, lion) { run(ZC_LION); }

/*
 * Compressed state is saved as kept (bf16 moments; 8-bit codes and their scales) and
 * restored raw: bit for bit the uninterrupted run, resharded.  bf16 shards anywhere;
 * q8-moments shards on multiples of its 256-element blocks (the 1 -> 4 and 3 -> 1 pairs
 * also take the short last block of a parameter as it was).
 */
Test(reshard, bf16_moments_raw)
{
	ck_opts.format = "bf16-moments";
	run_pairs(ZC_ADAMW, pairs, sizeof(pairs) / sizeof(pairs[0]), false);
}

Test(reshard, q8_moments_raw_on_blocks)
{
	ck_opts.format = "q8-moments";
	ck_opts.align = 256;
	run_pairs(ZC_ADAM, pairs, sizeof(pairs) / sizeof(pairs[0]), false);
}

/*
 * The same layout needs no alignment: every shard's blocks start where its own do (and
 * differ from one rank's, so the reference is a run of as many ranks).
 */
Test(reshard, q8_moments_raw_same_layout)
{
	static const unsigned same[][2] = { { 2, 2 }, { 3, 3 } };

	ck_opts.format = "q8-moments";
	run_pairs(ZC_ADAMW, same, 2, true);
}

/*
 * A tensor longer than the daemon's piece (1 Mi elements) is saved through both of its
 * buffers in turn, the next piece read while one is written; restored onto two ranks.
 * The NVMe chunks are the default 4 Mi elements: an fp32 piece is part of a chunk, moved
 * straight between the disk and the piece's buffer, and a q8-moments piece a whole
 * chunk; neither restore reads the swap (a part of a chunk read, patched and written
 * back would), and their chunks land on swap space the saved tensor left its state in.
 */
#define LONG ((9u << 20) + 12345)

static void
read_state(struct zc_tensor *t, uint64_t n, float *out[3])
{
	for (unsigned st = 0; st < 3; st++)
		cr_assert_eq(zc_tensor_read(t, (enum zc_state)st, 0, n, out[st]), 0);
}

Test(reshard, longer_than_a_piece)
{
	static const struct {
		enum zc_policy policy;
		const char *format;
	} passes[] = { { ZC_POLICY_CPU, "fp32" }, { ZC_POLICY_NVME, "fp32" },
		{ ZC_POLICY_NVME, "q8-moments" } };
	double saved = 0;
	char config[512];

	ck_tmpdir(swapdir, sizeof(swapdir), "swap");
	ck_config_chunks(config, sizeof(config), swapdir, 4u << 20);
	itd_start(&d, config);
	for (unsigned pi = 0; pi < sizeof(passes) / sizeof(passes[0]); pi++) {
		struct zc_job_options o = { .policy = passes[pi].policy,
			.state_format = passes[pi].format };
		bool fp32 = strcmp(passes[pi].format, "fp32") == 0;
		struct zc_step_params sp = ck_params(ZC_ADAMW, 1);
		struct zc_tensor_desc desc = { "long", LONG, ZC_F32, ZC_F32, false };
		struct zc_conn *c = itd_connect(&d);
		struct zc_checkpoint_entry e;
		struct zc_tensor *t;
		float *want[3], *got[3], *g;
		char job[16];

		for (unsigned st = 0; st < 3; st++) {
			want[st] = malloc((size_t)LONG * sizeof(float));
			got[st] = malloc((size_t)LONG * sizeof(float));
		}
		for (uint32_t i = 0; i < LONG; i++)
			want[0][i] = (float)(i % 7919) * 1e-4f;
		snprintf(job, sizeof(job), "long%u", pi);
		cr_assert_eq(zc_job_open_opts(c, job, 0, 1, &o), 0, "%s", zc_errmsg(c));
		cr_assert_eq(zc_tensor_register(c, &desc, want[0], &t), 0, "%s", zc_errmsg(c));
		g = zc_tensor_grad_slot(t, NULL);
		for (uint32_t i = 0; i < LONG; i++)
			g[i] = (float)(i % 101) * 1e-3f - 0.05f;
		cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
		cr_assert_eq(zc_wait_all(c, NULL), 0, "%s", zc_errmsg(c));
		ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
		e = (struct zc_checkpoint_entry){ t, NULL, 0, 0 };
		cr_assert_eq(zc_checkpoint_save(c, ckdir, &e, 1, &sp), 0, "%s", zc_errmsg(c));
		/* zoffctl stats counts what was saved (each pass: the ones before too). */
		if (fp32)
			cr_assert_eq(itd_stat(c, "checkpoint.bytes_written") - saved, 12.0 * LONG);
		saved = itd_stat(c, "checkpoint.bytes_written");
		read_state(t, LONG, want);
		cr_assert_eq(zc_job_close(c), 0);
		zc_disconnect(c);
		for (unsigned r = 0; r < 2; r++) {
			/* Split on a 1024-element boundary: whole q8 blocks, aligned fp32 pieces. */
			uint64_t half = LONG / 2 / 1024 * 1024;
			uint64_t lo = r == 0 ? 0 : half, n = r == 0 ? half : LONG - half;
			struct zc_tensor_desc desc_half = { "long-half", n, ZC_F32, ZC_F32, false };
			struct zc_checkpoint_place place = { "long", lo, LONG };
			struct zc_checkpoint *ck;
			double swap_read;
			float *part[3] = { got[0] + lo, got[1] + lo, got[2] + lo };

			c = itd_connect(&d);
			snprintf(job, sizeof(job), "back%u", pi);
			cr_assert_eq(zc_job_open_opts(c, job, r, 2, &o), 0, "%s", zc_errmsg(c));
			cr_assert_eq(zc_checkpoint_open(c, ckdir, &ck), 0, "%s", zc_errmsg(c));
			swap_read = itd_stat(c, "pipeline.bytes_read");
			cr_assert_eq(zc_tensor_register_checkpoint(c, &desc_half, ck, &place, ZC_ADAMW,
			    &t), 0, "%s", zc_errmsg(c));
			cr_assert_eq(itd_stat(c, "pipeline.bytes_read"), swap_read,
			    "pass %u, rank %u: the restore read the swap", pi, r);
			cr_assert_eq(zc_tensor_last_step(t), 1);
			read_state(t, n, part);
			/* The params mirror the restored master (f32: bit for bit). */
			cr_assert_eq(memcmp(zc_tensor_param_slot(t, NULL), part[0], n * sizeof(float)),
			    0, "pass %u, rank %u: the param slot is not the restored master", pi, r);
			cr_assert_geq(itd_stat(c, "checkpoint.bytes_read"), 12.0 * n);
			zc_checkpoint_close(ck);
			cr_assert_eq(zc_job_close(c), 0);
			zc_disconnect(c);
		}
		for (unsigned st = 0; st < 3; st++) {
			cr_assert_eq(memcmp(want[st], got[st], (size_t)LONG * sizeof(float)), 0,
			    "pass %u, state %u differs", pi, st);
			free(want[st]);
			free(got[st]);
		}
		ck_rmdir(ckdir);
		ckdir[0] = '\0';
	}
}

/*
 * q8-moments resharded across a block: 2 ranks (layers.0.w split at 35001) onto 3 (at
 * 23334).  Refused, naming tensor and elements, unless the restore may convert; then the
 * blocks are decoded and encoded again: master exact, the moments within the 8-bit
 * codes' error (3 and 4 mantissa bits: 2^-4 of each value), and the job steps on.
 */
Test(reshard, q8_moments_split_block_refused_unless_converting)
{
	struct zc_tensor_desc desc = { "layers.0.w#0", 23334, ZC_F32, ZC_F32, false };
	struct zc_checkpoint_place place = { ck_param_name[0], 0, ck_param_numel[0] };
	struct zc_job_options o = { .policy = ZC_POLICY_CPU, .state_format = "q8-moments" };
	struct ck_job a, b;
	struct ck_state want, got;
	struct zc_checkpoint *ck;
	struct zc_tensor *t = NULL;
	struct zc_conn *c;
	char config[512];

	ck_tmpdir(swapdir, sizeof(swapdir), "swap");
	ck_config(config, sizeof(config), swapdir);
	itd_start(&d, config);
	ck_opts.format = "q8-moments";
	ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
	ck_job_start(&a, &d, "split_a", 2, ZC_ADAMW, ZC_POLICY_CPU);
	ck_job_steps(&a, 1, K);
	ck_job_gather(&a, &want);
	ck_job_save(&a, ckdir, K);
	ck_job_close(&a);

	c = itd_connect(&d);
	cr_assert_eq(zc_job_open_opts(c, "split_refused", 0, 3, &o), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_checkpoint_open(c, ckdir, &ck), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register_checkpoint(c, &desc, ck, &place, ZC_ADAMW, &t), -EINVAL);
	cr_assert(strstr(zc_errmsg(c), "'layers.0.w#0'") && strstr(zc_errmsg(c), "0..23334") &&
	    strstr(zc_errmsg(c), "256-element block") &&
	    strstr(zc_errmsg(c), "zc_checkpoint_allow_convert"), "%s", zc_errmsg(c));
	zc_checkpoint_close(ck);
	zc_disconnect(c);

	ck_opts.convert = true;
	ck_job_restore(&b, &d, "split_b", 3, ZC_ADAMW, ZC_POLICY_CPU, ckdir, K);
	ck_job_gather(&b, &got);
	for (unsigned p = 0; p < CK_PARAMS; p++) {
		cr_assert_eq(memcmp(got.a[p][0], want.a[p][0], ck_param_numel[p] * sizeof(float)), 0,
		    "%s: master changed", ck_param_name[p]);
		for (unsigned st = 1; st < 3; st++) {
			float max = 0;

			for (uint64_t i = 0; i < ck_param_numel[p]; i++)
				max = fabsf(want.a[p][st][i]) > max ? fabsf(want.a[p][st][i]) : max;
			cr_assert_gt(max, 0);
			for (uint64_t i = 0; i < ck_param_numel[p]; i++) {
				float w = want.a[p][st][i], g = got.a[p][st][i];

				cr_assert(fabsf(g - w) <= 0.07f * fabsf(w) + 1e-4f * max, "%s state %u "
				    "[%llu]: %a, saved %a", ck_param_name[p], st, (unsigned long long)i,
				    g, w);
			}
		}
	}
	ck_job_steps(&b, K + 1, END);
	ck_job_close(&b);
	ck_state_free(&got);
	ck_state_free(&want);
}

/*
 * The same model saved in each format: the arrays take 12, 8 and 6 + 8/256 bytes a
 * parameter (exactly: master fp32, the moments as kept, q8's two scales per block of each
 * tensor); the header is the rest of the file.
 */
Test(reshard, file_bytes_per_format)
{
	static const char *const formats[] = { "fp32", "bf16-moments", "q8-moments" };
	char config[512], path[128];

	ck_tmpdir(swapdir, sizeof(swapdir), "swap");
	ck_config(config, sizeof(config), swapdir);
	itd_start(&d, config);
	for (unsigned f = 0; f < 3; f++) {
		uint64_t params = 0, want = 0, header = 0;
		struct ck_job a;
		struct stat st;
		char name[16];
		FILE *fp;

		ck_opts.format = formats[f];
		ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
		snprintf(name, sizeof(name), "size%u", f);
		ck_job_start(&a, &d, name, 1, ZC_ADAMW, ZC_POLICY_CPU);
		ck_job_steps(&a, 1, K);
		ck_job_save(&a, ckdir, K);
		ck_job_close(&a);
		for (unsigned p = 0; p < CK_PARAMS; p++) {
			uint64_t n = ck_param_numel[p];

			params += n;
			want += f == 0 ? 12 * n : f == 1 ? 8 * n : 6 * n + 8 * ((n + 255) / 256);
		}
		snprintf(path, sizeof(path), "%s/rank-00000-of-00001.safetensors", ckdir);
		fp = fopen(path, "rb");
		cr_assert_not_null(fp);
		cr_assert_eq(fread(&header, 8, 1, fp), 1);
		fclose(fp);
		cr_assert_eq(stat(path, &st), 0);
		cr_assert_eq((uint64_t)st.st_size - 8 - header, want, "%s: %llu bytes of arrays, "
		    "not %llu", formats[f], (unsigned long long)(st.st_size - 8 - header),
		    (unsigned long long)want);
		fprintf(stderr, "%s: %llu bytes for %llu parameters: %.3f B/param (arrays %.3f)\n",
		    formats[f], (unsigned long long)st.st_size, (unsigned long long)params,
		    (double)st.st_size / (double)params, (double)want / (double)params);
		ck_rmdir(ckdir);
		ckdir[0] = '\0';
	}
}
