/*
 * zoffctl's offline tools: import-deepspeed on real-looking DeepSpeed configs
 * (what maps, what is named as having no equivalent, and that the config it
 * prints is one zoffloadd accepts), and tune on a temp directory with a tiny
 * sweep.
 */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "itd.h"

static char tmpdir[] = "/tmp/zoff-tools-XXXXXX";
static char output[65536];

static void
setup(void)
{
	cr_assert_not_null(mkdtemp(tmpdir));
}

static void
teardown(void)
{
	char cmd[128];

	snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
	if (system(cmd) != 0)
		fprintf(stderr, "teardown: %s failed\n", cmd);
}

TestSuite(tools, .init = setup, .fini = teardown, .timeout = 120);

/* Runs "$ZOFFCTL args" (a shell line), stdout into output; returns the exit status. */
static int
run(const char *args)
{
	const char *prog = getenv("ZOFFCTL");
	char cmd[1024];
	FILE *p;
	size_t n;
	int st;

	cr_assert_not_null(prog, "$ZOFFCTL is not set");
	snprintf(cmd, sizeof(cmd), "'%s' %s", prog, args);
	p = popen(cmd, "r");
	cr_assert_not_null(p);
	n = fread(output, 1, sizeof(output) - 1, p);
	output[n] = '\0';
	st = pclose(p);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The DeepSpeed config from the source tree with @NVME@ replaced by the temp dir. */
static const char *
ds_config(const char *name)
{
	static char path[256];
	char src[512], line[512];
	FILE *in, *out;

	snprintf(src, sizeof(src), "%s/%s", getenv("DEEPSPEED_CONFIGS"), name);
	snprintf(path, sizeof(path), "%s/%s", tmpdir, name);
	in = fopen(src, "r");
	cr_assert_not_null(in, "%s", src);
	out = fopen(path, "w");
	cr_assert_not_null(out);
	while (fgets(line, sizeof(line), in) != NULL) {
		char *at = strstr(line, "@NVME@");

		if (at != NULL)
			fprintf(out, "%.*s%s%s", (int)(at - line), line, tmpdir, at + 6);
		else
			fputs(line, out);
	}
	fclose(in);
	fclose(out);
	return path;
}

static cJSON *
import(const char *name)
{
	char args[512];
	cJSON *j;

	snprintf(args, sizeof(args), "import-deepspeed --json '%s'", ds_config(name));
	cr_assert_eq(run(args), 0, "%s", output);
	j = cJSON_Parse(output);
	cr_assert_not_null(j, "not JSON: %s", output);
	return j;
}

static const cJSON *
at(const cJSON *j, const char *dotted)
{
	char buf[128], *save = NULL;

	snprintf(buf, sizeof(buf), "%s", dotted);
	for (char *k = strtok_r(buf, ".", &save); k != NULL && j != NULL; k = strtok_r(NULL, ".", &save))
		j = cJSON_IsArray(j) ? cJSON_GetArrayItem(j, atoi(k)) :
		    cJSON_GetObjectItemCaseSensitive(j, k);
	return j;
}

static double
num(const cJSON *j, const char *dotted)
{
	const cJSON *v = at(j, dotted);

	cr_assert(cJSON_IsNumber(v), "%s is not a number", dotted);
	return v->valuedouble;
}

static const char *
str(const cJSON *j, const char *dotted)
{
	const cJSON *v = at(j, dotted);

	cr_assert(cJSON_IsString(v), "%s is not a string", dotted);
	return v->valuestring;
}

/* The "why" given for key among the unsupported ones, or NULL. */
static const char *
why_unsupported(const cJSON *j, const char *key)
{
	const cJSON *u;

	cJSON_ArrayForEach(u, at(j, "unsupported"))
		if (strcmp(str(u, "key"), key) == 0)
			return str(u, "why");
	return NULL;
}

/* The config block printed is one zoffloadd --check-config accepts on this machine. */
static void
daemon_accepts(const cJSON *config)
{
	char path[128], out[4096];
	char *text = cJSON_Print(config);
	const char *argv[] = { "--config", path, "--check-config", NULL };
	FILE *f;
	int st;

	snprintf(path, sizeof(path), "%s/zoffload.conf", tmpdir);
	f = fopen(path, "w");
	cr_assert_not_null(f);
	fputs(text, f);
	fclose(f);
	st = itd_run(argv, out, sizeof(out), 20);
	cr_assert(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
	    "zoffloadd --check-config refuses what was printed:\n%s\n%s", text, out);
	free(text);
}

Test(tools, deepspeed_zero3_infinity_nvme)
{
	cJSON *j = import("zero3_infinity_nvme.json");

	cr_assert_str_eq(str(j, "config.swap.paths.0.path"), tmpdir);
	cr_assert_null(at(j, "config.swap.paths.1"), "the same nvme_path twice");
	cr_assert_eq(num(j, "config.swap.staging_buffers"), 4);
	cr_assert_eq(num(j, "config.swap.block_size"), 1048576);
	cr_assert_eq(num(j, "config.swap.queue_depth"), 8);
	cr_assert_str_eq(str(j, "job.policy"), "nvme");
	cr_assert(cJSON_IsTrue(at(j, "job.param_offload")));
	cr_assert_str_eq(str(j, "job.grad_dtype"), "f16");
	/* DeepSpeed's "Adam" is AdamW (adam_w_mode defaults to true). */
	cr_assert_str_eq(str(j, "step.optim"), "adamw");
	cr_assert_float_eq(num(j, "step.lr"), 1e-4, 1e-12);
	cr_assert_float_eq(num(j, "step.beta2"), 0.999, 1e-12);
	cr_assert_float_eq(num(j, "step.eps"), 1e-8, 1e-15);
	cr_assert_float_eq(num(j, "step.weight_decay"), 0.01, 1e-12);
	cr_assert_eq(num(j, "step.max_grad_norm"), 1.0);
	cr_assert(cJSON_IsTrue(at(j, "step.check_finite")), "fp16 needs check_finite");
	for (const char *const *k = (const char *const[]){
	    "zero_optimization.offload_param.buffer_count",
	    "zero_optimization.offload_param.buffer_size",
	    "zero_optimization.offload_param.max_in_cpu",
	    "zero_optimization.offload_optimizer.fast_init", "aio.single_submit", NULL }; *k; k++)
		cr_assert_not_null(why_unsupported(j, *k), "%s not named as unsupported", *k);
	/* What maps is not also listed as unsupported. */
	cr_assert_null(why_unsupported(j, "aio.block_size"));
	cr_assert_null(why_unsupported(j, "zero_optimization.offload_optimizer.buffer_count"));
	daemon_accepts(at(j, "config"));
	cJSON_Delete(j);
}

Test(tools, deepspeed_zero2_cpu_hf_auto_values)
{
	cJSON *j = import("zero2_cpu_bf16_hf.json");
	const char *why;

	cr_assert_str_eq(str(j, "job.policy"), "cpu");
	cr_assert_null(at(j, "config.swap"), "no NVMe, no swap block");
	cr_assert_str_eq(str(j, "step.optim"), "adamw");
	cr_assert_null(at(j, "step.lr"));
	why = why_unsupported(j, "optimizer.params.lr");
	cr_assert(why != NULL && strstr(why, "auto") != NULL, "lr \"auto\" not explained");
	cr_assert_not_null(why_unsupported(j, "optimizer.params.betas"));
	cr_assert_not_null(why_unsupported(j, "gradient_clipping"));
	cr_assert_not_null(why_unsupported(j, "bf16.enabled"));
	cr_assert_not_null(why_unsupported(j, "scheduler"));
	daemon_accepts(at(j, "config"));
	cJSON_Delete(j);
}

Test(tools, deepspeed_zero3_cpu_lion)
{
	cJSON *j = import("zero3_cpu_lion_bf16.json");

	cr_assert_str_eq(str(j, "step.optim"), "lion");
	cr_assert_float_eq(num(j, "step.beta1"), 0.95, 1e-12);
	cr_assert_float_eq(num(j, "step.beta2"), 0.98, 1e-12);
	cr_assert_eq(num(j, "step.max_grad_norm"), 0.5);
	cr_assert_str_eq(str(j, "job.grad_dtype"), "bf16");
	cr_assert(cJSON_IsTrue(at(j, "job.param_offload")));
	/* Four aio threads of 16 each: one queue of 64. */
	cr_assert_eq(num(j, "config.swap.queue_depth"), 64);
	cr_assert_eq(num(j, "config.swap.block_size"), 262144);
	cr_assert_not_null(why_unsupported(j, "aio.single_submit"));
	cr_assert_not_null(why_unsupported(j, "zero_optimization.offload_optimizer.ratio"));
	cr_assert_not_null(why_unsupported(j, "zero_optimization.offload_param.pin_memory"));
	daemon_accepts(at(j, "config"));
	cJSON_Delete(j);
}

Test(tools, deepspeed_unsupported_optimizer)
{
	cJSON *j = import("zero1_onebit.json");
	const char *why = why_unsupported(j, "optimizer.type");

	cr_assert(why != NULL && strstr(why, "AdamW") != NULL, "OneBitAdam not named");
	cr_assert_null(at(j, "step.optim"));
	cJSON_Delete(j);
}

/* The text form names what has no equivalent too. */
Test(tools, deepspeed_text_output)
{
	char args[512];

	snprintf(args, sizeof(args), "import-deepspeed '%s'",
	    ds_config("zero3_infinity_nvme.json"));
	cr_assert_eq(run(args), 0, "%s", output);
	cr_assert(strstr(output, "# zoffload.conf") != NULL, "%s", output);
	cr_assert(strstr(output, ".policy = ZC_POLICY_NVME") != NULL, "%s", output);
	cr_assert(strstr(output, ".optim = ZC_ADAMW") != NULL, "%s", output);
	cr_assert(strstr(output, "# no equivalent in zoffload") != NULL, "%s", output);
	cr_assert(strstr(output, "- zero_optimization.offload_param.max_in_cpu = 1") != NULL,
	    "%s", output);
}

/* --python: the training script's zoffload.deepspeed call and what it builds. */
Test(tools, deepspeed_python_output)
{
	char args[512];

	snprintf(args, sizeof(args), "import-deepspeed --python '%s'",
	    ds_config("zero3_infinity_nvme.json"));
	cr_assert_eq(run(args), 0, "%s", output);
	cr_assert(strstr(output, "import zoffload.deepspeed as deepspeed") != NULL, "%s", output);
	cr_assert(strstr(output, "deepspeed.initialize(") != NULL, "%s", output);
	cr_assert(strstr(output, "zoffload.torch.AdamW(model.parameters(), lr=0.0001, eps=1e-08, "
	    "weight_decay=0.01, betas=(0.9, 0.999), policy=\"nvme\")") != NULL, "%s", output);
	cr_assert(strstr(output, "#   \t\"swap\":") != NULL, "%s", output);
	cr_assert(strstr(output, "# no equivalent: aio.single_submit = false") != NULL, "%s",
	    output);
	/* No C structs, nor libzclient's notes. */
	cr_assert(strstr(output, "struct zc_") == NULL, "%s", output);
	cr_assert(strstr(output, "grad_scale") == NULL, "%s", output);
	snprintf(args, sizeof(args), "import-deepspeed --python '%s'",
	    ds_config("zero1_onebit.json"));
	cr_assert_eq(run(args), 0, "%s", output);
	cr_assert(strstr(output, "names no optimizer zoffload steps") != NULL, "%s", output);
	snprintf(args, sizeof(args), "import-deepspeed --python --json '%s' 2>&1",
	    ds_config("zero1_onebit.json"));
	cr_assert_eq(run(args), 2, "%s", output);
	cr_assert(strstr(output, "--json or --python, not both") != NULL, "%s", output);
}

Test(tools, deepspeed_bad_input)
{
	char args[512], path[128];
	FILE *f;

	cr_assert_eq(run("import-deepspeed /nonexistent/ds.json 2>&1"), 1);
	cr_assert(strstr(output, "/nonexistent/ds.json") != NULL, "%s", output);
	snprintf(path, sizeof(path), "%s/broken.json", tmpdir);
	f = fopen(path, "w");
	fputs("{ \"zero_optimization\": ", f);
	fclose(f);
	snprintf(args, sizeof(args), "import-deepspeed '%s' 2>&1", path);
	cr_assert_eq(run(args), 1);
	cr_assert(strstr(output, "not a JSON object") != NULL, "%s", output);
}

Test(tools, tune_quick_sweep)
{
	char args[512];
	const cJSON *p;
	cJSON *j;
	unsigned npoints = 0;

	snprintf(args, sizeof(args), "tune --quick --seconds 0.1 --json '%s'", tmpdir);
	cr_assert_eq(run(args), 0, "%s", output);
	j = cJSON_Parse(output);
	cr_assert_not_null(j, "%s", output);
	cJSON_ArrayForEach(p, at(j, "measured.points")) {
		cr_assert_null(at(p, "error"), "a point failed: %s", output);
		cr_assert_gt(num(p, "mib_per_s"), 0);
		npoints++;
	}
	/* 2 block sizes x 2 depths, then the other buffer count. */
	cr_assert_eq(npoints, 5, "%s", output);
	cr_assert_gt(num(j, "measured.cpu_params_per_s"), 0);
	cr_assert_gt(num(j, "measured.nvme_bound_params_per_s"), 0);
	/* m and v alone move where the slot is the master: 16 bytes a parameter, not 24. */
	cr_assert_float_eq(num(j, "measured.nvme_bound_params_per_s_fp32_params"),
	    num(j, "measured.nvme_bound_params_per_s") * 1.5, 1e-6 *
	    num(j, "measured.nvme_bound_params_per_s"));
	cr_assert_str_eq(str(j, "config.swap.paths.0.path"), tmpdir);
	cr_assert(num(j, "config.swap.block_size") == 65536 ||
	    num(j, "config.swap.block_size") == 262144);
	cr_assert(num(j, "config.swap.staging_buffers") == 2 ||
	    num(j, "config.swap.staging_buffers") == 4);
	daemon_accepts(at(j, "config"));
	/* The engine's file was unnamed: nothing is left in the directory but the config. */
	snprintf(args, sizeof(args), "ls -A '%s' | grep -v zoffload.conf | wc -l", tmpdir);
	{
		FILE *ls = popen(args, "r");
		int left = -1;

		cr_assert_eq(fscanf(ls, "%d", &left), 1);
		pclose(ls);
		cr_assert_eq(left, 0, "tune left files in %s", tmpdir);
	}
	cJSON_Delete(j);
}

Test(tools, tune_refuses_files_and_missing)
{
	char args[512], path[128];
	FILE *f;

	snprintf(path, sizeof(path), "%s/afile", tmpdir);
	f = fopen(path, "w");
	fclose(f);
	snprintf(args, sizeof(args), "tune --quick '%s' 2>&1", path);
	cr_assert_eq(run(args), 1);
	cr_assert(strstr(output, "not a directory") != NULL, "%s", output);
	cr_assert_eq(run("tune --quick /nonexistent/dir 2>&1"), 1);
	cr_assert(strstr(output, "/nonexistent/dir") != NULL, "%s", output);
	cr_assert_eq(run("tune 2>&1"), 2);
}
