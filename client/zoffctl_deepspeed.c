/*
 * zoffctl import-deepspeed: a DeepSpeed config's offload, aio and optimizer
 * settings as zoffload configuration and job options, with what has no
 * equivalent named.  Nothing is guessed silently: every key read either maps
 * somewhere or is listed with why not.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/statvfs.h>

#include "zoffctl.h"

struct import {
	cJSON *config;		/* zoffload.conf keys */
	cJSON *job;		/* zc_job_options and tensor flags */
	cJSON *step;		/* zc_step_params */
	cJSON *unsupported;	/* [{key, value, why}] */
	cJSON *notes;		/* [text] */
};

static cJSON *
section(cJSON *root, const char *name)
{
	cJSON *s = cJSON_GetObjectItemCaseSensitive(root, name);

	return s != NULL ? s : cJSON_AddObjectToObject(root, name);
}

static void
unsupported(struct import *im, const char *key, const cJSON *value, const char *why)
{
	cJSON *u = cJSON_CreateObject();

	cJSON_AddStringToObject(u, "key", key);
	cJSON_AddItemToObject(u, "value", value != NULL ? cJSON_Duplicate(value, 1) :
	    cJSON_CreateNull());
	cJSON_AddStringToObject(u, "why", why);
	cJSON_AddItemToArray(im->unsupported, u);
}

static void
note(struct import *im, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void
note(struct import *im, const char *fmt, ...)
{
	char text[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	cJSON_AddItemToArray(im->notes, cJSON_CreateString(text));
}

/* "auto" is the HF Trainer's placeholder, filled in at run time: nothing to translate. */
static bool
is_auto(const cJSON *v)
{
	return cJSON_IsString(v) && strcmp(v->valuestring, "auto") == 0;
}

/* A number, or NAN (with the key named as unsupported) when it is not one. */
static double
number(struct import *im, const char *key, const cJSON *v)
{
	if (cJSON_IsNumber(v))
		return v->valuedouble;
	unsupported(im, key, v, is_auto(v) ? "\"auto\" is filled in by the HF Trainer at run "
	    "time; set the value the run used" : "not a number");
	return NAN;
}

/* Free space where a path is or would be: the nearest existing directory. */
static unsigned long long
free_bytes_at(const char *path, char *found, size_t len)
{
	char buf[4096];
	struct statvfs vfs;

	snprintf(buf, sizeof(buf), "%s", path);
	for (;;) {
		if (statvfs(buf, &vfs) == 0) {
			snprintf(found, len, "%s", buf);
			return (unsigned long long)vfs.f_bavail * vfs.f_frsize;
		}
		if (strcmp(buf, "/") == 0 || strcmp(buf, ".") == 0)
			return 0;
		snprintf(buf, sizeof(buf), "%s", dirname(buf));
	}
}

/* swap.paths gets nvme_path once, with a capacity from the free space there. */
static void
add_swap_path(struct import *im, const char *key, const cJSON *v)
{
	cJSON *swap = section(im->config, "swap");
	cJSON *paths = cJSON_GetObjectItemCaseSensitive(swap, "paths"), *p;
	unsigned long long free_b, cap;
	char where[4096], text[32];

	if (!cJSON_IsString(v) || v->valuestring[0] == '\0') {
		unsupported(im, key, v, "not a path");
		return;
	}
	if (paths == NULL)
		paths = cJSON_AddArrayToObject(swap, "paths");
	cJSON_ArrayForEach(p, paths)
		if (strcmp(cJSON_GetObjectItemCaseSensitive(p, "path")->valuestring,
		    v->valuestring) == 0)
			return;
	free_b = free_bytes_at(v->valuestring, where, sizeof(where));
	/* 90% of what is free now, whole GiB: DeepSpeed needs no capacity, zoffload preallocates. */
	cap = free_b / 10 * 9 >> 30;
	if (cap == 0)
		cap = 1;
	snprintf(text, sizeof(text), "%lluG", cap);
	p = cJSON_CreateObject();
	cJSON_AddStringToObject(p, "path", v->valuestring);
	cJSON_AddStringToObject(p, "capacity", text);
	cJSON_AddItemToArray(paths, p);
	note(im, "swap.paths %s: capacity %s is 90%% of the %.1f GiB free at %s now; DeepSpeed "
	    "sizes its swap files as it goes, zoffload preallocates, so set what it may use",
	    v->valuestring, text, (double)free_b / (1ull << 30), where);
}

static void
set_policy(struct import *im, const char *policy)
{
	cJSON_DeleteItemFromObjectCaseSensitive(im->job, "policy");
	cJSON_AddStringToObject(im->job, "policy", policy);
}

static void
import_offload_optimizer(struct import *im, const cJSON *o)
{
	const cJSON *v;
	char key[128];

	cJSON_ArrayForEach(v, o) {
		snprintf(key, sizeof(key), "zero_optimization.offload_optimizer.%s", v->string);
		if (strcmp(v->string, "device") == 0) {
			if (cJSON_IsString(v) && strcmp(v->valuestring, "cpu") == 0) {
				set_policy(im, "cpu");
			} else if (cJSON_IsString(v) && strcmp(v->valuestring, "nvme") == 0) {
				set_policy(im, "nvme");
			} else if (cJSON_IsString(v) && strcmp(v->valuestring, "none") == 0) {
				set_policy(im, "cpu");
				unsupported(im, key, v, "DeepSpeed keeps the optimizer on the GPU; "
				    "zoffload exists to take it off: policy cpu below");
			} else {
				unsupported(im, key, v, "not cpu, nvme or none");
			}
		} else if (strcmp(v->string, "nvme_path") == 0) {
			add_swap_path(im, key, v);
		} else if (strcmp(v->string, "pin_memory") == 0) {
			if (cJSON_IsFalse(v))
				unsupported(im, key, v, "zoffload always locks the optimizer state it "
				    "can (memory.require_pinned only makes that strict)");
		} else if (strcmp(v->string, "buffer_count") == 0) {
			double n = number(im, key, v);

			if (!isnan(n))
				cJSON_AddNumberToObject(section(im->config, "swap"), "staging_buffers",
				    n < 2 ? 2 : n > 256 ? 256 : floor(n));
		} else if (strcmp(v->string, "fast_init") == 0) {
			unsupported(im, key, v, "zoffload preallocates the swap paths at start");
		} else if (strcmp(v->string, "pipeline") == 0 ||
		    strcmp(v->string, "pipeline_read") == 0 ||
		    strcmp(v->string, "pipeline_write") == 0) {
			if (cJSON_IsFalse(v))
				unsupported(im, key, v, "zoffload always overlaps NVMe reads and writes "
				    "with the step; it cannot be turned off");
		} else if (strcmp(v->string, "ratio") == 0) {
			unsupported(im, key, v, "partial offload: zoffload holds all of the "
			    "optimizer state (policy auto splits it between pinned memory and NVMe "
			    "instead)");
		} else {
			unsupported(im, key, v, "not known to this importer");
		}
	}
}

static void
import_offload_param(struct import *im, const cJSON *o)
{
	const cJSON *v;
	char key[128];

	cJSON_ArrayForEach(v, o) {
		snprintf(key, sizeof(key), "zero_optimization.offload_param.%s", v->string);
		if (strcmp(v->string, "device") == 0) {
			if (cJSON_IsString(v) && (strcmp(v->valuestring, "cpu") == 0 ||
			    strcmp(v->valuestring, "nvme") == 0)) {
				cJSON_AddBoolToObject(im->job, "param_offload", true);
				note(im, "offload_param: register tensors with param_offload = true; "
				    "zoffload keeps a tensor's parameters on the tier of its optimizer "
				    "state, so device \"%s\" follows the job's policy", v->valuestring);
			} else if (!(cJSON_IsString(v) && strcmp(v->valuestring, "none") == 0)) {
				unsupported(im, key, v, "not cpu, nvme or none");
			}
		} else if (strcmp(v->string, "nvme_path") == 0) {
			add_swap_path(im, key, v);
		} else if (strcmp(v->string, "pin_memory") == 0) {
			if (cJSON_IsFalse(v))
				unsupported(im, key, v, "param slots and stores are always locked when "
				    "the memlock limit allows");
		} else if (strcmp(v->string, "buffer_count") == 0 ||
		    strcmp(v->string, "buffer_size") == 0) {
			unsupported(im, key, v, "no buffer pool: each tensor's parameters are staged "
			    "whole into its own param slot (zc_param_prefetch)");
		} else if (strcmp(v->string, "max_in_cpu") == 0) {
			unsupported(im, key, v, "parameters stay in pinned memory while the job's "
			    "pinned budget allows (policy auto): set memory.job_pinned_budget or the "
			    "job's pinned_budget in bytes instead of a count of elements");
		} else {
			unsupported(im, key, v, "not known to this importer");
		}
	}
}

static void
import_aio(struct import *im, const cJSON *aio)
{
	const cJSON *v;
	double qd = 8, threads = 1;	/* DeepSpeed's defaults */
	bool have_qd = false;
	char key[64];

	cJSON_ArrayForEach(v, aio) {
		snprintf(key, sizeof(key), "aio.%s", v->string);
		if (strcmp(v->string, "block_size") == 0) {
			double b = number(im, key, v);
			unsigned long long u = isnan(b) || b < 0 ? 0 : (unsigned long long)b;

			if (isnan(b))
				continue;
			if (u < 4096 || (u & (u - 1)) != 0 || (double)u != b)
				unsupported(im, key, v, "swap.block_size must be a power of two of at "
				    "least 4096 bytes");
			else
				cJSON_AddNumberToObject(section(im->config, "swap"), "block_size", b);
		} else if (strcmp(v->string, "queue_depth") == 0) {
			qd = number(im, key, v);
			have_qd = !isnan(qd);
		} else if (strcmp(v->string, "thread_count") == 0) {
			threads = number(im, key, v);
			if (isnan(threads))
				threads = 1;
		} else if (strcmp(v->string, "single_submit") == 0) {
			unsupported(im, key, v, "io_uring submits in batches; there is no setting");
		} else if (strcmp(v->string, "overlap_events") == 0) {
			if (cJSON_IsFalse(v))
				unsupported(im, key, v, "zoffload always overlaps I/O; there is no "
				    "setting");
		} else if (strcmp(v->string, "use_gds") == 0) {
			if (cJSON_IsTrue(v))
				unsupported(im, key, v, "no GPUDirect Storage: state moves through "
				    "pinned host memory");
		} else if (strcmp(v->string, "intra_op_parallelism") == 0) {
			unsupported(im, key, v, "one engine serves every path; there is no setting");
		} else {
			unsupported(im, key, v, "not known to this importer");
		}
	}
	if (have_qd || threads != 1) {
		double total = qd * (threads >= 1 ? floor(threads) : 1);

		/* Each DeepSpeed aio thread has its own queue; the engine has one for all. */
		cJSON_AddNumberToObject(section(im->config, "swap"), "queue_depth",
		    total < 1 ? 1 : total > 4096 ? 4096 : total);
		if (threads > 1)
			note(im, "swap.queue_depth %.0f is aio.queue_depth %.0f times aio.thread_count "
			    "%.0f: one io_uring queue does what DeepSpeed's threads did", total, qd,
			    floor(threads));
	}
}

static void
import_optimizer(struct import *im, const cJSON *opt)
{
	const cJSON *type = cJSON_GetObjectItemCaseSensitive(opt, "type");
	const cJSON *params = cJSON_GetObjectItemCaseSensitive(opt, "params"), *v;
	const cJSON *wmode = cJSON_GetObjectItemCaseSensitive(params, "adam_w_mode");
	const char *optim = NULL;
	char key[96];

	if (!cJSON_IsString(type)) {
		unsupported(im, "optimizer.type", type, "not a string");
		return;
	}
	/* DeepSpeed's "Adam" is AdamW unless adam_w_mode is false. */
	if (strcasecmp(type->valuestring, "Adam") == 0)
		optim = cJSON_IsFalse(wmode) ? "adam" : "adamw";
	else if (strcasecmp(type->valuestring, "AdamW") == 0)
		optim = "adamw";
	else if (strcasecmp(type->valuestring, "Adagrad") == 0)
		optim = "adagrad";
	else if (strcasecmp(type->valuestring, "Lion") == 0)
		optim = "lion";
	if (optim == NULL) {
		unsupported(im, "optimizer.type", type, "zoffload steps AdamW, Adam, Adagrad and "
		    "Lion only");
		return;
	}
	cJSON_AddStringToObject(im->step, "optim", optim);
	cJSON_ArrayForEach(v, params) {
		double x;

		snprintf(key, sizeof(key), "optimizer.params.%s", v->string);
		if (strcmp(v->string, "lr") == 0 || strcmp(v->string, "eps") == 0 ||
		    strcmp(v->string, "weight_decay") == 0) {
			if (!isnan(x = number(im, key, v)))
				cJSON_AddNumberToObject(im->step, v->string, x);
		} else if (strcmp(v->string, "betas") == 0) {
			if (cJSON_GetArraySize(v) != 2 || !cJSON_IsNumber(cJSON_GetArrayItem(v, 0)) ||
			    !cJSON_IsNumber(cJSON_GetArrayItem(v, 1))) {
				if (is_auto(v))
					(void)number(im, key, v);
				else
					unsupported(im, key, v, "not two numbers");
				continue;
			}
			cJSON_AddNumberToObject(im->step, "beta1", cJSON_GetArrayItem(v, 0)->valuedouble);
			cJSON_AddNumberToObject(im->step, "beta2", cJSON_GetArrayItem(v, 1)->valuedouble);
		} else if (strcmp(v->string, "bias_correction") == 0) {
			if (cJSON_IsFalse(v))
				cJSON_AddBoolToObject(im->step, "no_bias_correction", true);
		} else if (strcmp(v->string, "adam_w_mode") == 0 ||
		    strcmp(v->string, "torch_adam") == 0 || strcmp(v->string, "fused") == 0) {
			continue;	/* which implementation: read above, or irrelevant here */
		} else if (strcmp(v->string, "amsgrad") == 0 && !cJSON_IsTrue(v)) {
			continue;
		} else if (strcmp(v->string, "lr_decay") == 0 && strcmp(optim, "adagrad") == 0) {
			if (!isnan(x = number(im, key, v)))
				cJSON_AddNumberToObject(im->step, "lr_decay", x);
		} else {
			unsupported(im, key, v, "the zoffload step has no such parameter");
		}
	}
}

static void
import_precision(struct import *im, const cJSON *root)
{
	const cJSON *fp16 = cJSON_GetObjectItemCaseSensitive(root, "fp16");
	const cJSON *bf16 = cJSON_GetObjectItemCaseSensitive(root, "bf16");
	const cJSON *clip = cJSON_GetObjectItemCaseSensitive(root, "gradient_clipping");
	const char *dtype = "f32";

	if (is_auto(cJSON_GetObjectItemCaseSensitive(fp16, "enabled")))
		(void)number(im, "fp16.enabled", cJSON_GetObjectItemCaseSensitive(fp16, "enabled"));
	if (is_auto(cJSON_GetObjectItemCaseSensitive(bf16, "enabled")))
		(void)number(im, "bf16.enabled", cJSON_GetObjectItemCaseSensitive(bf16, "enabled"));

	if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(fp16, "enabled"))) {
		dtype = "f16";
		cJSON_AddBoolToObject(im->step, "check_finite", true);
		note(im, "fp16: pass the current loss scale as grad_scale each step; the dynamic "
		    "loss scaler stays in the training loop (a skipped set reports "
		    "ZC_STEP_SKIPPED_NONFINITE: lower the scale)");
	} else if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(bf16, "enabled"))) {
		dtype = "bf16";
	}
	cJSON_AddStringToObject(im->job, "grad_dtype", dtype);
	cJSON_AddStringToObject(im->job, "param_dtype", dtype);
	if (clip != NULL) {
		double c = number(im, "gradient_clipping", clip);

		if (!isnan(c) && c > 0)
			cJSON_AddNumberToObject(im->step, "max_grad_norm", c);
	}
	if (cJSON_GetObjectItemCaseSensitive(root, "scheduler") != NULL)
		unsupported(im, "scheduler", cJSON_GetObjectItemCaseSensitive(
		    cJSON_GetObjectItemCaseSensitive(root, "scheduler"), "type"),
		    "the training loop passes the learning rate with each step");
}

static void
print_text(const struct import *im, FILE *out)
{
	static const char *const dtypes[][2] = { { "f32", "ZC_F32" }, { "bf16", "ZC_BF16" },
		{ "f16", "ZC_F16" } };
	const cJSON *v;
	char *conf = cJSON_Print(im->config);
	const char *dt = cJSON_GetObjectItemCaseSensitive(im->job, "grad_dtype")->valuestring;
	const char *cdt = "ZC_F32";

	for (size_t i = 0; i < 3; i++)
		if (strcmp(dt, dtypes[i][0]) == 0)
			cdt = dtypes[i][1];
	fprintf(out, "# zoffload.conf: merge into the daemon's configuration\n%s\n\n",
	    conf != NULL ? conf : "{}");
	free(conf);
	fprintf(out, "# job and step options (libzclient)\n");
	v = cJSON_GetObjectItemCaseSensitive(im->job, "policy");
	fprintf(out, "struct zc_job_options job = { .policy = ZC_POLICY_%s };\n",
	    v != NULL ? (strcmp(v->valuestring, "cpu") == 0 ? "CPU" : "NVME") : "DEFAULT");
	fprintf(out, "struct zc_tensor_desc desc = { .grad_dtype = %s, .param_dtype = %s, "
	    ".param_offload = %s };\n", cdt, cdt,
	    cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(im->job, "param_offload")) ?
	    "true" : "false");
	fprintf(out, "struct zc_step_params step = {");
	cJSON_ArrayForEach(v, im->step) {
		if (strcmp(v->string, "optim") == 0)
			fprintf(out, " .optim = ZC_%s,", strcmp(v->valuestring, "adamw") == 0 ?
			    "ADAMW" : strcmp(v->valuestring, "adam") == 0 ? "ADAM" :
			    strcmp(v->valuestring, "adagrad") == 0 ? "ADAGRAD" : "LION");
		else if (cJSON_IsBool(v))
			fprintf(out, " .%s = %s,", v->string, cJSON_IsTrue(v) ? "true" : "false");
		else
			fprintf(out, " .%s = %.10g,", v->string, v->valuedouble);
	}
	fprintf(out, " };\n");
	if (cJSON_GetArraySize(im->notes) > 0)
		fprintf(out, "\n# notes\n");
	cJSON_ArrayForEach(v, im->notes)
		fprintf(out, "- %s\n", v->valuestring);
	fprintf(out, "\n# no equivalent in zoffload\n");
	if (cJSON_GetArraySize(im->unsupported) == 0)
		fprintf(out, "(none)\n");
	cJSON_ArrayForEach(v, im->unsupported) {
		char *val = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(v, "value"));

		fprintf(out, "- %s = %s: %s\n", cJSON_GetObjectItemCaseSensitive(v, "key")->valuestring,
		    val != NULL ? val : "?", cJSON_GetObjectItemCaseSensitive(v, "why")->valuestring);
		free(val);
	}
}

/* A comment block of the lines of text (the zoffload.conf JSON). */
static void
print_commented(const char *text, FILE *out)
{
	for (const char *p = text, *nl; *p != '\0'; p = nl + (*nl != '\0')) {
		nl = strchr(p, '\n');
		if (nl == NULL)
			nl = p + strlen(p);
		fprintf(out, "#   %.*s\n", (int)(nl - p), p);
	}
}

/*
 * The training script's side in Python: zoffload.deepspeed.initialize reads
 * the same config itself (optimizer block, offload_optimizer device), so the
 * script changes one import; the optimizer it builds is spelled out.
 */
static void
print_python(const struct import *im, const char *path, FILE *out)
{
	static const char *const classes[][2] = { { "adamw", "AdamW" }, { "adam", "Adam" },
		{ "adagrad", "Adagrad" }, { "lion", "Lion" } };
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(im->step, "optim");
	const cJSON *b1 = cJSON_GetObjectItemCaseSensitive(im->step, "beta1");
	const cJSON *b2 = cJSON_GetObjectItemCaseSensitive(im->step, "beta2");
	const cJSON *policy = cJSON_GetObjectItemCaseSensitive(im->job, "policy");
	const char *cls = NULL;
	char *conf = cJSON_Print(im->config);

	for (size_t i = 0; v != NULL && i < 4; i++)
		if (strcmp(v->valuestring, classes[i][0]) == 0)
			cls = classes[i][1];
	fprintf(out, "# zoffload.conf: merge into the daemon's configuration\n");
	print_commented(conf != NULL ? conf : "{}", out);
	free(conf);
	fprintf(out, "\n# The training script: one changed import.  zoffload.deepspeed.initialize "
	    "reads this\n# config's optimizer block and offload_optimizer itself.\n");
	fprintf(out, "import zoffload.deepspeed as deepspeed    # was: import deepspeed\n\n");
	fprintf(out, "engine, optimizer, _, _ = deepspeed.initialize(\n"
	    "    args=args, model=model, model_parameters=model.parameters(),\n"
	    "    config=\"%s\")\n", path);
	if (cls == NULL) {
		fprintf(out, "\n# The config names no optimizer zoffload steps: pass "
		    "optimizer=zoffload.torch.AdamW(...)\n# (or Adam, Adagrad, Lion) to "
		    "initialize instead.\n");
	} else {
		fprintf(out, "\n# What it builds and hands DeepSpeed (zero_allow_untested_optimizer "
		    "and\n# zero_force_ds_cpu_optimizer: false set for it):\n");
		fprintf(out, "#   optimizer = zoffload.torch.%s(model.parameters()", cls);
		cJSON_ArrayForEach(v, im->step) {
			if (strcmp(v->string, "lr") == 0 || strcmp(v->string, "eps") == 0 ||
			    strcmp(v->string, "weight_decay") == 0 ||
			    strcmp(v->string, "lr_decay") == 0)
				fprintf(out, ", %s=%.10g", v->string, v->valuedouble);
		}
		if (b1 != NULL && b2 != NULL)
			fprintf(out, ", betas=(%.10g, %.10g)", b1->valuedouble, b2->valuedouble);
		if (policy != NULL)
			fprintf(out, ", policy=\"%s\"", policy->valuestring);
		fprintf(out, ")\n");
	}
	if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(im->step, "no_bias_correction")))
		fprintf(out, "# bias_correction false: zoffload.deepspeed refuses it (the step always "
		    "corrects)\n");
	if (cJSON_GetObjectItemCaseSensitive(im->step, "max_grad_norm") != NULL)
		fprintf(out, "# gradient_clipping stays DeepSpeed's: it clips across the ranks "
		    "before the step\n");
	if (policy != NULL && strcmp(policy->valuestring, "nvme") == 0)
		fprintf(out, "# device nvme: the state lives on the daemon's swap paths; "
		    "DeepSpeed's own swapper\n# does not run (it is given device cpu), and "
		    "nvme_path must be one of swap.paths\n");
	if (cJSON_GetObjectItemCaseSensitive(im->job, "param_offload") != NULL ||
	    strcmp(cJSON_GetObjectItemCaseSensitive(im->job, "grad_dtype")->valuestring, "f32") != 0)
		fprintf(out, "# fp16/bf16 (loss scaling) and offload_param stay DeepSpeed's\n");
	cJSON_ArrayForEach(v, im->notes)
		/* The libzclient notes on precision and param offload are DeepSpeed's here. */
		if (strncmp(v->valuestring, "fp16:", 5) != 0 &&
		    strncmp(v->valuestring, "offload_param:", 14) != 0)
			fprintf(out, "# note: %s\n", v->valuestring);
	cJSON_ArrayForEach(v, im->unsupported) {
		char *val = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(v, "value"));

		fprintf(out, "# no equivalent: %s = %s: %s\n",
		    cJSON_GetObjectItemCaseSensitive(v, "key")->valuestring, val != NULL ? val : "?",
		    cJSON_GetObjectItemCaseSensitive(v, "why")->valuestring);
		free(val);
	}
}

int
zoffctl_import_deepspeed(const char *path, enum zoffctl_format fmt, FILE *out)
{
	struct import im = { 0 };
	cJSON *root = NULL, *all = NULL, *zero, *o;
	char *text = NULL;
	size_t len = 0;
	FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "re");
	int rc = 1;

	if (f == NULL) {
		fprintf(stderr, "zoffctl: import-deepspeed: %s: %s\n", path, strerror(errno));
		return 1;
	}
	{
		FILE *m = open_memstream(&text, &len);
		char buf[65536];
		size_t n;

		while (m != NULL && (n = fread(buf, 1, sizeof(buf), f)) > 0)
			fwrite(buf, 1, n, m);
		if (m != NULL)
			fclose(m);
	}
	if (f != stdin)
		fclose(f);
	root = text != NULL ? cJSON_Parse(text) : NULL;
	if (!cJSON_IsObject(root)) {
		fprintf(stderr, "zoffctl: import-deepspeed: %s is not a JSON object (DeepSpeed "
		    "config)\n", path);
		goto out;
	}
	all = cJSON_CreateObject();
	im.config = cJSON_AddObjectToObject(all, "config");
	im.job = cJSON_AddObjectToObject(all, "job");
	im.step = cJSON_AddObjectToObject(all, "step");
	im.notes = cJSON_AddArrayToObject(all, "notes");
	im.unsupported = cJSON_AddArrayToObject(all, "unsupported");
	zero = cJSON_GetObjectItemCaseSensitive(root, "zero_optimization");
	if (zero == NULL)
		note(&im, "no zero_optimization block: DeepSpeed offloads nothing here");
	o = cJSON_GetObjectItemCaseSensitive(zero, "stage");
	if (cJSON_IsNumber(o) && o->valueint < 3 &&
	    cJSON_GetObjectItemCaseSensitive(zero, "offload_param") != NULL)
		note(&im, "offload_param needs ZeRO stage 3 in DeepSpeed (stage is %d); it is "
		    "translated anyway", o->valueint);
	if ((o = cJSON_GetObjectItemCaseSensitive(zero, "offload_optimizer")) != NULL)
		import_offload_optimizer(&im, o);
	else if (zero != NULL)
		note(&im, "no offload_optimizer: DeepSpeed keeps the optimizer on the GPU");
	if ((o = cJSON_GetObjectItemCaseSensitive(zero, "offload_param")) != NULL)
		import_offload_param(&im, o);
	if ((o = cJSON_GetObjectItemCaseSensitive(root, "aio")) != NULL)
		import_aio(&im, o);
	if ((o = cJSON_GetObjectItemCaseSensitive(root, "optimizer")) != NULL)
		import_optimizer(&im, o);
	else
		note(&im, "no optimizer block: the step options below need optim and its "
		    "hyperparameters from the training script");
	import_precision(&im, root);
	if (cJSON_GetObjectItemCaseSensitive(im.job, "policy") != NULL &&
	    strcmp(cJSON_GetObjectItemCaseSensitive(im.job, "policy")->valuestring, "nvme") == 0 &&
	    cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(im.config, "swap"),
	    "paths") == NULL)
		note(&im, "device nvme without nvme_path: add swap.paths");
	if (fmt == ZOFFCTL_JSON) {
		char *s = cJSON_Print(all);

		fprintf(out, "%s\n", s != NULL ? s : "{}");
		free(s);
	} else if (fmt == ZOFFCTL_PYTHON) {
		print_python(&im, path, out);
	} else {
		print_text(&im, out);
	}
	rc = 0;
out:
	cJSON_Delete(all);
	cJSON_Delete(root);
	free(text);
	return rc;
}
