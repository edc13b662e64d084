/*
 * Compressed optimizer state through a real zoffloadd: a job's state_format
 * steps on either tier exactly as the kernel run directly on the same data,
 * shows in the stats with the bytes it saves, and bad names and optimizers
 * without a compressed kernel are refused by name.
 */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <unistd.h>

#include "itd.h"
#include "quant.h"

/* Several 4096-element NVMe chunks and a tail that is not a whole q8 block. */
#define N (3 * 4096 + 333)
#define STEPS 3

static struct itd daemon_;
static char swapdir[64];

static void
setup(void)
{
	char config[512];

	snprintf(swapdir, sizeof(swapdir), "/tmp/zoff-formats-XXXXXX");
	cr_assert_not_null(mkdtemp(swapdir));
	snprintf(config, sizeof(config), "{ \"compute\": { \"worker_threads\": 2 }, "
	    "\"memory\": { \"state_format\": \"bf16-moments\" }, "
	    "\"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"64M\" } ], "
	    "\"chunk_elements\": 4096 } }\n", swapdir);
	itd_start(&daemon_, config);
}

static void
teardown(void)
{
	itd_cleanup(&daemon_);
	rmdir(swapdir);
}

TestSuite(formats, .init = setup, .fini = teardown, .timeout = 60);

static struct zc_conn *
open_job(const char *name, enum zc_policy policy, const char *format)
{
	struct zc_conn *c = itd_connect(&daemon_);
	struct zc_job_options o = { .policy = policy, .state_format = format };

	cr_assert_eq(zc_job_open_opts(c, name, 0, 1, &o), 0, "%s", zc_errmsg(c));
	return c;
}

static void
fill(float *x, size_t n, uint64_t seed, float scale)
{
	struct itd_rng r = { seed };

	for (size_t i = 0; i < n; i++)
		x[i] = scale * (float)(itd_uniform(&r) - 0.5);
}

static struct zc_step_params
params(enum zc_optim o, uint64_t s)
{
	return (struct zc_step_params){ .optim = o, .step = s, .lr = 1e-2, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 };
}

/* The tensor steps as zk_qstep on the same initial state and gradients, bit for bit. */
static void
same_as_kernel(enum zc_policy policy, const char *format, enum zk_state_format f)
{
	static float init[N], g[N], m[N], v[N], got[N];
	static uint8_t qm[2 * N], qv[2 * N];
	static float ms[N / 256 + 1], vs[N / 256 + 1], master[N];
	static uint16_t param[N];
	struct zc_tensor_desc desc = { .name = "w", .numel = N, .grad_dtype = ZC_F32,
		.param_dtype = ZC_BF16 };
	struct zk_qtensor q = { .format = f, .master = master, .m = qm, .v = qv, .m_scale = ms,
		.v_scale = vs, .grad = g, .grad_dtype = ZK_DTYPE_F32, .param = param,
		.param_dtype = ZK_DTYPE_BF16, .n = N };
	struct zc_conn *c = open_job(format, policy, format);
	struct zc_step_result res;
	struct zc_tensor *t;

	fill(init, N, 1, 2.0f);
	memset(m, 0, sizeof(m));
	memset(v, 0, sizeof(v));
	/* Registration's initial master: bf16-master+q8 rounds it to nearest even. */
	cr_assert_eq(zk_qstate_master_encode(&q, init), 0);
	cr_assert_eq(zk_qstate_encode(&q, m, v), 0);
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	for (uint64_t s = 1; s <= STEPS; s++) {
		struct zc_step_params sp = params(ZC_ADAMW, s);
		struct zk_hparams hp = { .optim = ZK_OPTIM_ADAMW, .lr = sp.lr, .beta1 = sp.beta1,
			.beta2 = sp.beta2, .eps = sp.eps, .weight_decay = sp.weight_decay, .step = s,
			.bias_correction = true, .grad_scale = 1.0, .clip_coef = 1.0 };

		fill(g, N, 10 + s, 0.1f);
		memcpy(zc_tensor_grad_slot(t, NULL), g, sizeof(g));
		cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
		cr_assert_eq(zc_wait_all(c, &res), 0, "%s", zc_errmsg(c));
		cr_assert_eq(res.status, ZC_STEP_APPLIED, "%d", res.error);
		cr_assert_eq(zk_qstep(ZK_ISA_SCALAR, &hp, &q, 0, N), 0);
	}
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, N, got), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zk_qstate_master_decode(&q, init), 0);
	cr_assert_eq(memcmp(got, init, sizeof(got)), 0, "%s: master differs from the kernel's",
	    format);
	cr_assert_eq(memcmp(zc_tensor_param_slot(t, NULL), param, sizeof(param)), 0);
	cr_assert_eq(zk_qstate_decode(&q, m, v), 0);
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_EXP_AVG_SQ, 0, N, got), 0, "%s", zc_errmsg(c));
	cr_assert_eq(memcmp(got, v, sizeof(got)), 0, "%s: exp_avg_sq differs", format);
	/* The stats name the format and what it saves against fp32's 12 bytes a parameter. */
	cr_assert_eq(itd_stat(c, "jobs.0.state_bytes"), (double)zk_state_bytes(f, N));
	cr_assert_eq(itd_stat(c, "jobs.0.state_bytes_saved"),
	    (double)(12 * N - zk_state_bytes(f, N)));
	zc_disconnect(c);
}

Test(formats, q8_on_nvme_steps_as_the_kernel)
{
	same_as_kernel(ZC_POLICY_NVME, "q8-moments", ZK_STATE_Q8);
}

Test(formats, q8_pinned_steps_as_the_kernel)
{
	same_as_kernel(ZC_POLICY_CPU, "q8-moments", ZK_STATE_Q8);
}

Test(formats, bf16_on_nvme_steps_as_the_kernel)
{
	same_as_kernel(ZC_POLICY_NVME, "bf16-moments", ZK_STATE_BF16);
}

Test(formats, bf16_q8_on_nvme_steps_as_the_kernel)
{
	same_as_kernel(ZC_POLICY_NVME, "bf16-master+q8", ZK_STATE_BF16_Q8);
}

Test(formats, bf16_q8_pinned_steps_as_the_kernel)
{
	same_as_kernel(ZC_POLICY_CPU, "bf16-master+q8", ZK_STATE_BF16_Q8);
}

/* No state_format: memory.state_format of the configuration (bf16-moments here). */
Test(formats, default_from_the_configuration_and_stats)
{
	struct zc_conn *c = open_job("plain", ZC_POLICY_CPU, NULL);
	struct zc_tensor_desc desc = { .name = "w", .numel = 1000, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	static float init[1000];
	struct zc_tensor *t;
	cJSON *j, *job;
	char *text, cmd[256];
	static char out[16384];
	size_t len;
	FILE *p;

	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_stats_json(c, &text), 0, "%s", zc_errmsg(c));
	j = cJSON_Parse(text);
	cr_assert_not_null(j);
	job = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "jobs"), 0);
	cr_assert_str_eq(cJSON_GetStringValue(cJSON_GetObjectItem(job, "state_format")),
	    "bf16-moments");
	cJSON_Delete(j);
	free(text);
	cr_assert_not_null(getenv("ZOFFCTL"), "$ZOFFCTL is not set");
	snprintf(cmd, sizeof(cmd), "'%s' --socket '%s' stats", getenv("ZOFFCTL"), daemon_.socket);
	p = popen(cmd, "r");
	cr_assert_not_null(p);
	len = fread(out, 1, sizeof(out) - 1, p);
	out[len] = '\0';
	cr_assert_eq(pclose(p), 0, "%s", out);
	cr_assert(strstr(out, "STATE") && strstr(out, "bf16-moments"), "%s", out);
	zc_disconnect(c);
}

Test(formats, bad_name_and_mismatch_are_refused)
{
	struct zc_conn *c = itd_connect(&daemon_), *c2;
	struct zc_job_options o = { .state_format = "int4" };

	cr_assert_eq(zc_job_open_opts(c, "bad", 0, 1, &o), -EINVAL);
	cr_assert(strstr(zc_errmsg(c), "int4") && strstr(zc_errmsg(c), "q8-moments") &&
	    strstr(zc_errmsg(c), "fp32"), "%s", zc_errmsg(c));
	/* The first rank decides; a second naming another format is refused. */
	o = (struct zc_job_options){ .state_format = "q8" };
	cr_assert_eq(zc_job_open_opts(c, "two", 0, 2, &o), 0, "%s", zc_errmsg(c));
	c2 = itd_connect(&daemon_);
	o.state_format = "fp32";
	cr_assert_eq(zc_job_open_opts(c2, "two", 1, 2, &o), -EINVAL);
	cr_assert(strstr(zc_errmsg(c2), "q8-moments") && strstr(zc_errmsg(c2), "fp32"), "%s",
	    zc_errmsg(c2));
	o.state_format = NULL;
	cr_assert_eq(zc_job_open_opts(c2, "two", 1, 2, &o), 0, "%s", zc_errmsg(c2));
	zc_disconnect(c2);
	zc_disconnect(c);
}

Test(formats, optimizer_without_a_kernel_is_refused)
{
	struct zc_conn *c = open_job("lion", ZC_POLICY_CPU, "q8-moments");
	struct zc_tensor_desc desc = { .name = "w", .numel = 1000, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_step_params sp = params(ZC_LION, 1);
	static float init[1000];
	struct zc_step_result res;
	struct zc_tensor *t;
	int r;

	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	r = zc_step_submit(c, &sp, &t, 1);
	if (r == 0)
		r = zc_wait_all(c, &res);
	cr_assert_lt(r, 0, "a lion step on q8-moments state was accepted");
	cr_assert(strstr(zc_errmsg(c), "lion") && strstr(zc_errmsg(c), "q8-moments"), "%s",
	    zc_errmsg(c));
	sp = params(ZC_ADAM, 1);
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, &res), 0, "%s", zc_errmsg(c));
	cr_assert_eq(res.status, ZC_STEP_APPLIED);
	zc_disconnect(c);
}

/*
 * A checkpoint says each tensor's format; a restore into a job of the same format takes
 * it, one of another format is refused by name unless asked to convert.
 */
Test(formats, checkpoint_keeps_the_format_and_refuses_a_mismatch)
{
	enum { M = 5000 };
	static float init[M], g[M], m[M], got[M];
	struct zc_tensor_desc desc = { .name = "w", .numel = M, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_step_params sp = params(ZC_ADAMW, 1);
	struct zc_checkpoint_entry entry;
	struct zc_conn *c = open_job("save", ZC_POLICY_NVME, "q8-moments"), *c2, *c3, *c4;
	struct zc_checkpoint *ck;
	struct zc_tensor *t, *t2;
	char dir[] = "/tmp/zoff-formats-ckpt-XXXXXX", cmd[256], out[4096];
	size_t len;
	FILE *pipe;

	cr_assert_str_eq(zc_job_state_format(c), "q8-moments");
	cr_assert_not_null(mkdtemp(dir));
	fill(init, M, 5, 1.0f);
	fill(g, M, 6, 0.1f);
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	memcpy(zc_tensor_grad_slot(t, NULL), g, sizeof(g));
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, NULL), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_EXP_AVG, 0, M, m), 0, "%s", zc_errmsg(c));
	entry = (struct zc_checkpoint_entry){ .tensor = t };
	cr_assert_eq(zc_checkpoint_save(c, dir, &entry, 1, &sp), 0, "%s", zc_errmsg(c));
	/* zoffctl checkpoint inspect says the format. */
	snprintf(cmd, sizeof(cmd), "'%s' checkpoint inspect '%s'", getenv("ZOFFCTL"), dir);
	pipe = popen(cmd, "r");
	cr_assert_not_null(pipe);
	len = fread(out, 1, sizeof(out) - 1, pipe);
	out[len] = '\0';
	cr_assert_eq(pclose(pipe), 0, "%s", out);
	cr_assert(strstr(out, "step 1  q8-moments state"), "%s", out);

	cr_assert(strstr(out, "U8+scales arrays"), "%s", out);

	/* The same format: the moments come back as they were saved, raw, bit for bit. */
	c2 = open_job("same", ZC_POLICY_CPU, "q8-moments");
	cr_assert_eq(zc_checkpoint_open(c2, dir, &ck), 0, "%s", zc_errmsg(c2));
	cr_assert_eq(zc_tensor_register_checkpoint(c2, &desc, ck, NULL, ZC_ADAMW, &t2), 0, "%s",
	    zc_errmsg(c2));
	cr_assert_eq(zc_tensor_read(t2, ZC_STATE_EXP_AVG, 0, M, got), 0, "%s", zc_errmsg(c2));
	cr_assert_eq(memcmp(got, m, sizeof(got)), 0, "q8-moments took the saved moments changed");
	zc_checkpoint_close(ck);

	/* Another format: refused, naming the file, the tensor and both formats. */
	c3 = open_job("other", ZC_POLICY_CPU, "fp32");
	cr_assert_eq(zc_checkpoint_open(c3, dir, &ck), 0, "%s", zc_errmsg(c3));
	cr_assert_eq(zc_tensor_register_checkpoint(c3, &desc, ck, NULL, ZC_ADAMW, &t2), -EBADMSG);
	cr_assert(strstr(zc_errmsg(c3), "rank-00000-of-00001") && strstr(zc_errmsg(c3), "'w'") &&
	    strstr(zc_errmsg(c3), "q8-moments") && strstr(zc_errmsg(c3), "fp32"), "%s",
	    zc_errmsg(c3));
	zc_checkpoint_allow_convert(ck, true);
	cr_assert_eq(zc_tensor_register_checkpoint(c3, &desc, ck, NULL, ZC_ADAMW, &t2), 0, "%s",
	    zc_errmsg(c3));
	cr_assert_eq(zc_tensor_read(t2, ZC_STATE_EXP_AVG, 0, M, got), 0, "%s", zc_errmsg(c3));
	cr_assert_eq(memcmp(got, m, sizeof(got)), 0, "fp32 took the saved moments changed");
	zc_checkpoint_close(ck);

	/* Into bf16-moments, converting: the decoded codes rounded to bf16 (to nearest even). */
	c4 = open_job("other_bf16", ZC_POLICY_NVME, "bf16-moments");
	cr_assert_eq(zc_checkpoint_open(c4, dir, &ck), 0, "%s", zc_errmsg(c4));
	cr_assert_eq(zc_tensor_register_checkpoint(c4, &desc, ck, NULL, ZC_ADAMW, &t2), -EBADMSG);
	zc_checkpoint_allow_convert(ck, true);
	cr_assert_eq(zc_tensor_register_checkpoint(c4, &desc, ck, NULL, ZC_ADAMW, &t2), 0, "%s",
	    zc_errmsg(c4));
	cr_assert_eq(zc_tensor_read(t2, ZC_STATE_EXP_AVG, 0, M, got), 0, "%s", zc_errmsg(c4));
	for (size_t i = 0; i < M; i++) {
		uint32_t b, w;

		memcpy(&b, &m[i], 4);
		b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
		memcpy(&w, &got[i], 4);
		cr_assert_eq(w, b, "m[%zu]: %a, the saved %a in bf16 is %08x", i, got[i], m[i], b);
	}
	zc_checkpoint_close(ck);
	zc_disconnect(c4);
	zc_disconnect(c3);
	zc_disconnect(c2);
	zc_disconnect(c);
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_assert_eq(system(cmd), 0);
}

/*
 * An fp32 checkpoint (F32 arrays) into a q8-moments job on NVMe, converting: the daemon
 * encodes the saved moments, giving what zk_qstate_encode gives; master as saved.
 */
Test(formats, fp32_checkpoint_converts_into_q8)
{
	enum { M = 3000 };
	static float init[M], g[M], st[3][M], got[3][M], want_m[M], want_v[M], sc[2][(M + 255) / 256];
	static uint8_t qm[M], qv[M];
	struct zc_tensor_desc desc = { .name = "w", .numel = M, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_step_params sp = params(ZC_ADAMW, 1);
	struct zk_qtensor q = { .format = ZK_STATE_Q8, .master = got[0], .m = qm, .v = qv,
		.m_scale = sc[0], .v_scale = sc[1], .n = M };
	struct zc_checkpoint_entry entry;
	struct zc_conn *c = open_job("fp32save", ZC_POLICY_CPU, "fp32"), *c2;
	struct zc_checkpoint *ck;
	struct zc_tensor *t, *t2;
	char dir[] = "/tmp/zoff-formats-ckpt-XXXXXX", cmd[128];

	cr_assert_not_null(mkdtemp(dir));
	fill(init, M, 7, 1.0f);
	fill(g, M, 8, 0.1f);
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	memcpy(zc_tensor_grad_slot(t, NULL), g, sizeof(g));
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, NULL), 0, "%s", zc_errmsg(c));
	for (unsigned k = 0; k < 3; k++)
		cr_assert_eq(zc_tensor_read(t, (enum zc_state)k, 0, M, st[k]), 0, "%s", zc_errmsg(c));
	entry = (struct zc_checkpoint_entry){ .tensor = t };
	cr_assert_eq(zc_checkpoint_save(c, dir, &entry, 1, &sp), 0, "%s", zc_errmsg(c));

	c2 = open_job("q8conv", ZC_POLICY_NVME, "q8-moments");
	cr_assert_eq(zc_checkpoint_open(c2, dir, &ck), 0, "%s", zc_errmsg(c2));
	cr_assert_eq(zc_tensor_register_checkpoint(c2, &desc, ck, NULL, ZC_ADAMW, &t2), -EBADMSG);
	zc_checkpoint_allow_convert(ck, true);
	cr_assert_eq(zc_tensor_register_checkpoint(c2, &desc, ck, NULL, ZC_ADAMW, &t2), 0, "%s",
	    zc_errmsg(c2));
	for (unsigned k = 0; k < 3; k++)
		cr_assert_eq(zc_tensor_read(t2, (enum zc_state)k, 0, M, got[k]), 0, "%s",
		    zc_errmsg(c2));
	cr_assert_eq(memcmp(got[0], st[0], sizeof(got[0])), 0, "master changed");
	cr_assert_eq(zk_qstate_encode(&q, st[1], st[2]), 0);
	cr_assert_eq(zk_qstate_decode(&q, want_m, want_v), 0);
	cr_assert_eq(memcmp(got[1], want_m, sizeof(want_m)), 0, "m is not the saved m encoded");
	cr_assert_eq(memcmp(got[2], want_v, sizeof(want_v)), 0, "v is not the saved v encoded");
	zc_checkpoint_close(ck);
	zc_disconnect(c2);
	zc_disconnect(c);
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_assert_eq(system(cmd), 0);
}

/* memory.state_format reloads on SIGHUP, for jobs opened afterwards; a job open keeps its own. */
Test(formats, default_reloads_for_new_jobs)
{
	struct zc_conn *before = open_job("before", ZC_POLICY_CPU, NULL), *after = NULL;
	char config[512];
	FILE *f;
	bool ok = false;

	cr_assert_str_eq(zc_job_state_format(before), "bf16-moments");
	snprintf(config, sizeof(config), "{ \"compute\": { \"worker_threads\": 2 }, "
	    "\"memory\": { \"state_format\": \"q8-moments\" }, "
	    "\"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"64M\" } ], "
	    "\"chunk_elements\": 4096 } }\n", swapdir);
	f = fopen(daemon_.config, "w");
	cr_assert_not_null(f);
	fputs(config, f);
	cr_assert_eq(fclose(f), 0);
	cr_assert_eq(kill(daemon_.pid, SIGHUP), 0);
	/* The reload lands between requests: a job opened once it has says so. */
	for (int i = 0; i < 200 && !ok; i++) {
		char name[32];
		struct zc_job_options o = { .policy = ZC_POLICY_CPU };

		snprintf(name, sizeof(name), "after%d", i);
		after = itd_connect(&daemon_);
		cr_assert_eq(zc_job_open_opts(after, name, 0, 1, &o), 0, "%s", zc_errmsg(after));
		ok = strcmp(zc_job_state_format(after), "q8-moments") == 0;
		zc_disconnect(after);
		if (!ok)
			usleep(20000);
	}
	cr_assert(ok, "a job opened after SIGHUP is not q8-moments\n%s", itd_log_text(&daemon_));
	cr_assert(strstr(itd_log_text(&daemon_), "memory.state_format"), "%s",
	    itd_log_text(&daemon_));
	zc_disconnect(before);
}

/*
 * A program built against ZCLIENT_0.1 passes the struct without state_format and binds
 * zc_job_open_opts@ZCLIENT_0.1: that reads only its two fields (the job gets the daemon's
 * default), whatever lies past them.
 */
struct job_options_v01 {
	enum zc_policy policy;
	uint64_t pinned_budget;
};
int zc_job_open_opts_v01(struct zc_conn *conn, const char *job_name, uint32_t rank,
    uint32_t world_size, const struct job_options_v01 *options);
__asm__(".symver zc_job_open_opts_v01, zc_job_open_opts@ZCLIENT_0.1");

Test(formats, zclient_0_1_job_options)
{
	/* Past the 0.1 struct: what a newer library must not read as a format name. */
	struct { struct job_options_v01 o; uint64_t junk; } old = {
		{ .policy = ZC_POLICY_CPU, .pinned_budget = 1u << 20 }, 0x4141414141414141ull };
	struct zc_conn *c = itd_connect(&daemon_);

	cr_assert_eq(zc_job_open_opts_v01(c, "old", 0, 1, &old.o), 0, "%s", zc_errmsg(c));
	cr_assert_str_eq(zc_job_state_format(c), "bf16-moments");
	cr_assert_eq(itd_stat(c, "jobs.0.pinned_bytes"), 0);
	zc_disconnect(c);
}

/*
 * bf16-master+q8 through a checkpoint: saved from NVMe and restored pinned, the master comes
 * back bit for bit (its bf16 values written back round to themselves), the params with it,
 * and both jobs take the next step to the same bits.
 */
Test(formats, bf16_master_checkpoint_round_trip)
{
	enum { M = 5000 };
	static float init[M], g[M], a[M], b[M];
	struct zc_tensor_desc desc = { .name = "w", .numel = M, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_step_params sp = params(ZC_ADAMW, 1);
	struct zc_checkpoint_entry entry;
	struct zc_conn *c = open_job("bsave", ZC_POLICY_NVME, "bf16-master+q8"), *c2;
	struct zc_checkpoint *ck;
	struct zc_tensor *t, *t2;
	char dir[] = "/tmp/zoff-formats-ckpt-XXXXXX", cmd[256];

	cr_assert_not_null(mkdtemp(dir));
	fill(init, M, 7, 1.0f);
	fill(g, M, 8, 0.1f);
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	memcpy(zc_tensor_grad_slot(t, NULL), g, sizeof(g));
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, NULL), 0, "%s", zc_errmsg(c));
	entry = (struct zc_checkpoint_entry){ .tensor = t };
	cr_assert_eq(zc_checkpoint_save(c, dir, &entry, 1, &sp), 0, "%s", zc_errmsg(c));
	c2 = open_job("bload", ZC_POLICY_CPU, "bf16-master+q8");
	cr_assert_eq(zc_checkpoint_open(c2, dir, &ck), 0, "%s", zc_errmsg(c2));
	cr_assert_eq(zc_tensor_register_checkpoint(c2, &desc, ck, NULL, ZC_ADAMW, &t2), 0, "%s",
	    zc_errmsg(c2));
	zc_checkpoint_close(ck);
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, M, a), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_read(t2, ZC_STATE_MASTER, 0, M, b), 0, "%s", zc_errmsg(c2));
	cr_assert_eq(memcmp(a, b, sizeof(a)), 0, "the restored master differs");
	cr_assert_eq(memcmp(zc_tensor_param_slot(t2, NULL), b, sizeof(b)), 0);
	for (size_t i = 0; i < M; i++)
		cr_assert_eq(a[i], zk_bf16_to_f32(zk_f32_to_bf16(a[i])), "master[%zu] not bf16", i);
	/* The next step: the same bits from the saved job and the restored one. */
	sp = params(ZC_ADAMW, 2);
	memcpy(zc_tensor_grad_slot(t, NULL), g, sizeof(g));
	memcpy(zc_tensor_grad_slot(t2, NULL), g, sizeof(g));
	cr_assert_eq(zc_step_submit(c, &sp, &t, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_wait_all(c, NULL), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_step_submit(c2, &sp, &t2, 1), 0, "%s", zc_errmsg(c2));
	cr_assert_eq(zc_wait_all(c2, NULL), 0, "%s", zc_errmsg(c2));
	cr_assert_eq(memcmp(zc_tensor_param_slot(t, NULL), zc_tensor_param_slot(t2, NULL),
	    sizeof(a)), 0, "a step after the restore differs");
	zc_disconnect(c2);
	zc_disconnect(c);
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_assert_eq(system(cmd), 0);
}
