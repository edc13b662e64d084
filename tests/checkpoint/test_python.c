/*
 * The rank files open with the Python safetensors package (from PyPI, in a venv of the
 * build tree made on first use) and hold what zc_tensor_read returns, CRCs included.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ck.h"

static struct itd d;
static char swapdir[64], ckdir[64], rawdir[64];
static struct ck_job job;

static void
teardown(void)
{
	ck_job_close(&job);
	itd_cleanup(&d);
	ck_rmdir(ckdir);
	ck_rmdir(rawdir);
	ck_rmdir(swapdir);
}

TestSuite(python, .fini = teardown, .timeout = 300);

/* Skipped as a whole (no PyPI): exit 77, so that meson says SKIP rather than OK. */
ReportHook(POST_ALL)(struct criterion_global_stats *stats)
{
	if (stats->nb_tests > 0 && stats->tests_skipped == stats->nb_tests)
		_exit(77);
}

/* The venv's python, made when missing; NULL when PyPI cannot be reached. */
static const char *
python(void)
{
	static char py[512];
	const char *venv = getenv("CK_PYVENV");
	char cmd[2048];

	cr_assert_not_null(venv, "$CK_PYVENV is not set");
	snprintf(py, sizeof(py), "%s/bin/python", venv);
	snprintf(cmd, sizeof(cmd), "%s -c 'import safetensors, numpy' 2>/dev/null", py);
	if (access(py, X_OK) == 0 && system(cmd) == 0)
		return py;
	snprintf(cmd, sizeof(cmd), "rm -rf '%s' && /usr/bin/python3 -m venv --system-site-packages "
	    "'%s' && '%s/bin/pip' install -q --disable-pip-version-check --timeout 30 "
	    "safetensors >&2", venv, venv, venv);
	if (system(cmd) != 0)
		return NULL;
	return py;
}

/*
 * A job of format fmt saved, each rank's arrays as zc_tensor_read returns them (fp32,
 * decoded) put next to it, and the script run: it reads the files with safetensors and
 * decodes compressed moments itself (the formulas of quant.h, in float32 numpy).
 */
static void
check_format(const char *py, const char *fmt, enum zc_optim optim, const char *name)
{
	char cmd[1024];

	ck_opts.format = fmt;
	ck_tmpdir(ckdir, sizeof(ckdir), "ckpt");
	ck_tmpdir(rawdir, sizeof(rawdir), "raw");
	ck_job_start(&job, &d, name, 2, optim, ZC_POLICY_AUTO);
	ck_job_steps(&job, 1, 2);
	ck_job_save(&job, ckdir, 2);
	for (unsigned r = 0; r < job.world; r++)
		for (unsigned p = 0; p < CK_PARAMS; p++)
			for (unsigned st = 0; st < 3; st++) {
				static const char *const sn[3] = { "master", "exp_avg", "exp_avg_sq" };
				uint64_t n = job.r[r].numel[p];
				float *buf = malloc(n * sizeof(float));
				char path[256];
				FILE *f;

				cr_assert_eq(zc_tensor_read(job.r[r].t[p], (enum zc_state)st, 0, n, buf), 0);
				snprintf(path, sizeof(path), "%s/%s#%u.%s.f32", rawdir, ck_param_name[p], r,
				    sn[st]);
				f = fopen(path, "wb");
				cr_assert_not_null(f);
				cr_assert_eq(fwrite(buf, sizeof(float), n, f), n);
				fclose(f);
				free(buf);
			}
	snprintf(cmd, sizeof(cmd), "'%s' '%s/read_safetensors.py' '%s' '%s' '%s' >&2", py,
	    getenv("CK_SCRIPTS"), ckdir, rawdir, fmt != NULL ? fmt : "fp32");
	cr_assert_eq(system(cmd), 0, "%s failed", cmd);
	ck_job_close(&job);
	ck_rmdir(ckdir);
	ck_rmdir(rawdir);
	ckdir[0] = rawdir[0] = '\0';
	ck_opts = (struct ck_opts){ 0 };
}

Test(python, safetensors_reads_what_zc_tensor_read_returns)
{
	const char *py = python();

	if (py == NULL)
		cr_skip_test("safetensors could not be installed from PyPI");
	{
		char config[512];

		ck_tmpdir(swapdir, sizeof(swapdir), "swap");
		ck_config(config, sizeof(config), swapdir);
		itd_start(&d, config);
	}
	check_format(py, NULL, ZC_LION, "py");
	/* Compressed: BF16 moments; U8 codes with their F32 scale arrays. */
	check_format(py, "bf16-moments", ZC_ADAMW, "py_bf16");
	check_format(py, "q8-moments", ZC_ADAM, "py_q8");
}
