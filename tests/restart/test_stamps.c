/*
 * A kept record's step stamps are outside its checksum (they change with every step): one
 * corrupted past what the engine could have written (a stamp past the step its unit was
 * given) is refused by name at the restart, not taken as the tensor's step (2^40 was).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "standin.h"
#include "zclient.h"

static struct zst st_;

static void
teardown(void)
{
	zst_fini(&st_);
}

TestSuite(stamps, .fini = teardown, .timeout = 120);

Test(stamps, a_corrupt_step_stamp_is_refused)
{
	static float init[4096];
	struct zc_tensor_desc desc = { .name = "w", .numel = 4096, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	const char *daemon = getenv("ZOFFLOADD");
	const char *argv[6];
	char sock[160], config[160];
	uint64_t stamp = 1ull << 40, was = 0;
	struct zc_conn *c = NULL;
	struct zc_tensor *t = NULL;
	int status, rec;
	FILE *f;

	cr_assert_not_null(daemon, "$ZOFFLOADD is not set");
	cr_assert_eq(zst_init(&st_), 0);
	snprintf(sock, sizeof(sock), "%s/sock", st_.dir);
	snprintf(config, sizeof(config), "%s/zoffload.conf", st_.dir);
	f = fopen(config, "w");
	cr_assert_not_null(f);
	fprintf(f, "{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"info\" } }\n");
	fclose(f);
	argv[0] = daemon;
	argv[1] = "--config";
	argv[2] = config;
	argv[3] = "--socket";
	argv[4] = sock;
	argv[5] = NULL;
	cr_assert_eq(zst_start(&st_, argv), 0);
	cr_assert_eq(zst_wait_ready(&st_, 1, 30), 0, "%s", zst_log(&st_));
	cr_assert_eq(zc_connect(sock, &c), 0);
	zc_set_reconnect(c, 0);
	cr_assert_eq(zc_job_open(c, "stamped", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_set_step(t, 21), 0, "%s", zc_errmsg(c));
	kill(st_.pid, SIGKILL);
	status = zst_wait_exit(&st_, 30);
	cr_assert(WIFSIGNALED(status), "status 0x%x", status);
	zc_disconnect(c);

	/* The first unit's stamp: the first array after the record's header page. */
	rec = zst_fd(&st_, "zt1.rec");
	cr_assert_geq(rec, 0, "no zt1.rec in the store");
	cr_assert_eq(pread(rec, &was, sizeof(was), 4096), (ssize_t)sizeof(was));
	cr_assert_eq(was, 21, "the first stamp is %llu, not the step set", (unsigned long long)was);
	cr_assert_eq(pwrite(rec, &stamp, sizeof(stamp), 4096), (ssize_t)sizeof(stamp));

	cr_assert_eq(zst_start(&st_, argv), 0);
	status = zst_wait_exit(&st_, 60);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0, "the daemon started with a "
	    "corrupt stamp (status 0x%x): %s", status, zst_log(&st_));
	cr_assert(strstr(zst_log(&st_), "step stamps are corrupt") != NULL &&
	    strstr(zst_log(&st_), "1099511627776") != NULL, "%s", zst_log(&st_));

	/* Put back, the state comes back as it was. */
	cr_assert_eq(pwrite(rec, &was, sizeof(was), 4096), (ssize_t)sizeof(was));
	cr_assert_eq(zst_start(&st_, argv), 0);
	cr_assert_eq(zst_wait_ready(&st_, 2, 60), 0, "%s", zst_log(&st_));
	cr_assert_eq(zc_connect(sock, &c), 0);
	cr_assert_eq(zc_job_open(c, "stamped", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_last_step(t), 21);
	zc_disconnect(c);
	kill(st_.pid, SIGTERM);
	(void)zst_wait_exit(&st_, 30);
}
