/*
 * Restores of many tensors at once (zc_tensors_register_checkpoint: several in flight) give
 * back exactly what was saved, or, when one tensor fails, an error naming its file and
 * tensor with none of them left registered; temporaries of dead saves are removed by the
 * next save, restore or inspect, never one a live writer holds.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ck.h"

/* More tensors than the library restores at once; one of five daemon pieces (1 Mi elements). */
#define NT 7
static const uint64_t numel[NT] = { 1000, 40000, 16384, (4u << 20) + 1000, 3, 70000, 5 };

static struct itd d;
static char swapdir[64], ckdir[64];

static void
teardown(void)
{
	itd_cleanup(&d);
	ck_rmdir(ckdir);
	ck_rmdir(swapdir);
}

TestSuite(pipeline, .fini = teardown, .timeout = 120);

static void
start(void)
{
	char config[512];

	ck_tmpdir(swapdir, sizeof(swapdir), "swap");
	ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
	ck_config(config, sizeof(config), swapdir);
	itd_start(&d, config);
}

static void
desc_of(unsigned k, char *name, size_t len, struct zc_tensor_desc *desc)
{
	snprintf(name, len, "p%u", k);
	*desc = (struct zc_tensor_desc){ name, numel[k], ZC_F32, ZC_F32, false };
}

/* A job (policy) of NT tensors stepped twice and saved into ckdir; its states in s[k][state]. */
static void
save_job(enum zc_policy policy, float *s[NT][3])
{
	struct zc_conn *c = itd_connect(&d);
	struct zc_job_options o = { .policy = policy };
	struct zc_checkpoint_entry es[NT];
	struct zc_tensor *ts[NT];
	struct zc_step_params sp = ck_params(ZC_ADAMW, 1);

	cr_assert_eq(zc_job_open_opts(c, "saved", 0, 1, &o), 0, "%s", zc_errmsg(c));
	for (unsigned k = 0; k < NT; k++) {
		struct zc_tensor_desc desc;
		char name[16];
		float *init = malloc(numel[k] * sizeof(float));

		desc_of(k, name, sizeof(name), &desc);
		for (uint64_t i = 0; i < numel[k]; i++)
			init[i] = (float)((i * 7 + k) % 1013) * 1e-3f - 0.4f;
		cr_assert_eq(zc_tensor_register(c, &desc, init, &ts[k]), 0, "%s", zc_errmsg(c));
		free(init);
		es[k] = (struct zc_checkpoint_entry){ ts[k], NULL, 0, 0 };
	}
	for (sp.step = 1; sp.step <= 2; sp.step++) {
		for (unsigned k = 0; k < NT; k++) {
			float *g = zc_tensor_grad_slot(ts[k], NULL);

			for (uint64_t i = 0; i < numel[k]; i++)
				g[i] = (float)((i * 3 + k + sp.step) % 101) * 1e-2f - 0.5f;
		}
		cr_assert_eq(zc_step_submit(c, &sp, ts, NT), 0, "%s", zc_errmsg(c));
		cr_assert_eq(zc_wait_all(c, NULL), 0, "%s", zc_errmsg(c));
	}
	sp.step = 2;
	cr_assert_eq(zc_checkpoint_save(c, ckdir, es, NT, &sp), 0, "%s", zc_errmsg(c));
	for (unsigned k = 0; k < NT; k++)
		for (unsigned st = 0; st < 3; st++) {
			s[k][st] = malloc(numel[k] * sizeof(float));
			cr_assert_eq(zc_tensor_read(ts[k], (enum zc_state)st, 0, numel[k], s[k][st]),
			    0, "%s", zc_errmsg(c));
		}
	cr_assert_eq(zc_job_close(c), 0);
	zc_disconnect(c);
}

/* The whole batch restored into a job of policy: every element of every state as saved. */
static void
restores_exactly(enum zc_policy policy, float *s[NT][3])
{
	struct zc_conn *c = itd_connect(&d);
	struct zc_job_options o = { .policy = policy };
	struct zc_tensor_desc descs[NT];
	struct zc_tensor *ts[NT];
	struct zc_checkpoint *ck;
	char names[NT][16];

	cr_assert_eq(zc_job_open_opts(c, "restored", 0, 1, &o), 0, "%s", zc_errmsg(c));
	for (unsigned k = 0; k < NT; k++)
		desc_of(k, names[k], sizeof(names[k]), &descs[k]);
	cr_assert_eq(zc_checkpoint_open(c, ckdir, &ck), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensors_register_checkpoint(c, NT, descs, ck, NULL, ZC_ADAMW, ts), 0,
	    "%s", zc_errmsg(c));
	zc_checkpoint_close(ck);
	for (unsigned k = 0; k < NT; k++) {
		float *got = malloc(numel[k] * sizeof(float));

		cr_assert_eq(zc_tensor_last_step(ts[k]), 2, "%s", names[k]);
		for (unsigned st = 0; st < 3; st++) {
			cr_assert_eq(zc_tensor_read(ts[k], (enum zc_state)st, 0, numel[k], got), 0,
			    "%s", zc_errmsg(c));
			cr_assert(memcmp(got, s[k][st], numel[k] * sizeof(float)) == 0,
			    "%s state %u differs", names[k], st);
		}
		free(got);
	}
	cr_assert_eq(zc_job_close(c), 0);
	zc_disconnect(c);
}

static void
free_states(float *s[NT][3])
{
	for (unsigned k = 0; k < NT; k++)
		for (unsigned st = 0; st < 3; st++)
			free(s[k][st]);
}

Test(pipeline, batch_restores_exactly)
{
	float *s[NT][3];

	start();
	save_job(ZC_POLICY_AUTO, s);
	restores_exactly(ZC_POLICY_NVME, s);
	restores_exactly(ZC_POLICY_CPU, s);
	free_states(s);
}

/* The byte at `at` of the file flipped. */
static void
flip(const char *path, uint64_t at)
{
	int fd = open(path, O_RDWR);
	uint8_t b;

	cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
	cr_assert_eq(pread(fd, &b, 1, (off_t)at), 1);
	b ^= 0x01;
	cr_assert_eq(pwrite(fd, &b, 1, (off_t)at), 1);
	close(fd);
}

Test(pipeline, one_damaged_tensor_refuses_the_batch)
{
	struct zc_tensor_desc descs[NT];
	struct zc_tensor *ts[NT];
	struct zc_checkpoint *ck;
	char names[NT][16], path[128];
	float *s[NT][3];
	struct zc_conn *c;
	uint64_t data = 0, hlen = 0;
	int fd, r;

	start();
	save_job(ZC_POLICY_AUTO, s);
	free_states(s);
	/* p5's exp_avg: tensors lie in order, master, exp_avg and exp_avg_sq each. */
	snprintf(path, sizeof(path), "%s/rank-00000-of-00001.safetensors", ckdir);
	fd = open(path, O_RDONLY);
	cr_assert_geq(fd, 0);
	cr_assert_eq(pread(fd, &hlen, 8, 0), 8);
	close(fd);
	for (unsigned k = 0; k < 5; k++)
		data += 12 * numel[k];
	flip(path, 8 + hlen + data + 4 * numel[5] + 40);

	c = itd_connect(&d);
	cr_assert_eq(zc_job_open(c, "restored", 0, 1), 0, "%s", zc_errmsg(c));
	for (unsigned k = 0; k < NT; k++)
		desc_of(k, names[k], sizeof(names[k]), &descs[k]);
	cr_assert_eq(zc_checkpoint_open(c, ckdir, &ck), 0, "%s", zc_errmsg(c));
	r = zc_tensors_register_checkpoint(c, NT, descs, ck, NULL, ZC_ADAMW, ts);
	cr_assert_eq(r, -EBADMSG, "%d: %s", r, zc_errmsg(c));
	cr_assert(strstr(zc_errmsg(c), "rank-00000-of-00001") != NULL &&
	    strstr(zc_errmsg(c), "'p5/exp_avg'") != NULL && strstr(zc_errmsg(c), "CRC-32C"),
	    "%s", zc_errmsg(c));
	/* None of the seven stayed: each name registers afresh. */
	for (unsigned k = 0; k < NT; k++) {
		float *init = calloc(numel[k], sizeof(float));

		cr_assert_eq(zc_tensor_register(c, &descs[k], init, &ts[k]), 0, "%s stayed: %s",
		    names[k], zc_errmsg(c));
		free(init);
	}
	zc_checkpoint_close(ck);
	cr_assert_eq(zc_job_close(c), 0);
	zc_disconnect(c);
}

/* A temporary as a save makes it, in ckdir; its descriptor (locked: a live writer) or -1. */
static int
make_tmp(const char *name, bool live)
{
	char path[160];
	int fd;

	snprintf(path, sizeof(path), "%s/%s", ckdir, name);
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
	cr_assert_eq(write(fd, "partial", 7), 7);
	if (!live) {
		close(fd);
		return -1;
	}
	cr_assert_eq(flock(fd, LOCK_EX), 0);
	return fd;
}

static bool
exists(const char *name)
{
	char path[160];
	struct stat st;

	snprintf(path, sizeof(path), "%s/%s", ckdir, name);
	return lstat(path, &st) == 0;
}

#define DEAD ".rank-00000-of-00001.safetensors.999999.tmp"
#define LIVE ".rank-00001-of-00002.safetensors.999998.tmp"
#define OTHER ".rank-00000-of-00001.safetensors.tmp"

Test(pipeline, stale_temporaries_removed_live_ones_kept)
{
	struct zc_checkpoint *ck;
	struct zc_conn *c;
	float *s[NT][3];
	char out[4096], cmd[256];
	int live;
	FILE *p;

	start();
	make_tmp(DEAD, false);
	make_tmp(OTHER, false);
	live = make_tmp(LIVE, true);
	/* The next save into the directory: the dead writer's goes, the live one's stays. */
	save_job(ZC_POLICY_AUTO, s);
	free_states(s);
	cr_assert(!exists(DEAD), "the dead save's temporary is still there");
	cr_assert(exists(LIVE), "a live save's temporary was removed");
	cr_assert(exists(OTHER), "a file not named as a save's temporary was removed");

	/* A restore's open: the live one stays while locked, goes once its writer is gone. */
	c = itd_connect(&d);
	cr_assert_eq(zc_job_open(c, "restored", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_checkpoint_open(c, ckdir, &ck), 0, "%s", zc_errmsg(c));
	zc_checkpoint_close(ck);
	cr_assert(exists(LIVE), "a live save's temporary was removed by a restore");
	close(live);
	cr_assert_eq(zc_checkpoint_open(c, ckdir, &ck), 0, "%s", zc_errmsg(c));
	zc_checkpoint_close(ck);
	cr_assert(!exists(LIVE), "a dead save's temporary stayed after a restore");
	cr_assert_eq(zc_job_close(c), 0);
	zc_disconnect(c);

	/* zoffctl checkpoint inspect too. */
	make_tmp(DEAD, false);
	snprintf(cmd, sizeof(cmd), "'%s' checkpoint inspect '%s' 2>&1", getenv("ZOFFCTL"), ckdir);
	p = popen(cmd, "r");
	cr_assert_not_null(p);
	out[fread(out, 1, sizeof(out) - 1, p)] = '\0';
	cr_assert_eq(pclose(p), 0, "%s", out);
	cr_assert(!exists(DEAD), "a dead save's temporary stayed after inspect");
}
