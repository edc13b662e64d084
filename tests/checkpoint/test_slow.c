/*
 * A checkpoint's file I/O runs off the daemon's loop: a save to a file that does not take
 * its bytes (here: the daemon's checkpoint I/O held at a gate, as a stalled disk would
 * hold it) delays only that save, and another client's steps are served meanwhile.
 *
 * The daemon's I/O threads open ZOFFLOADD_TEST_CKPT_GATE (a FIFO) for reading before each
 * piece of file work, which blocks until a writer holds it open.  The test opens it only
 * after it has seen another client's steps complete and read back while the save is still
 * in flight: were the file work on the loop, those steps would never be answered and the
 * test would hang until its timeout.  No clock decides anything.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ck.h"

#define K 3

static struct itd d;
static struct ck_gated g = { .fd = -1 };
static struct ck_job saver, other, restored;

static void
teardown(void)
{
	ck_job_close(&restored);
	ck_job_close(&other);
	ck_job_close(&saver);
	ck_gated_cleanup(&d, &g);
}

TestSuite(slow, .fini = teardown, .timeout = 240);

struct save_arg {
	struct ck_job *j;
	atomic_bool done;
	int result;
	char err[512];
};

/* The save of rank 0, on its own thread: no criterion assertion here, the main thread checks. */
static void *
save_main(void *p)
{
	struct save_arg *a = p;
	struct zc_step_params sp = ck_params(a->j->optim, K);
	struct zc_checkpoint_entry es[CK_PARAMS];

	for (unsigned q = 0; q < CK_PARAMS; q++)
		es[q] = (struct zc_checkpoint_entry){ a->j->r[0].t[q], ck_param_name[q],
			a->j->r[0].off[q], ck_param_numel[q] };
	a->result = zc_checkpoint_save(a->j->r[0].c, g.ckdir, es, CK_PARAMS, &sp);
	if (a->result < 0)
		snprintf(a->err, sizeof(a->err), "%s", zc_errmsg(a->j->r[0].c));
	atomic_store(&a->done, true);
	return NULL;
}

static void
held_save(enum zc_policy policy)
{
	struct save_arg a = { .j = &saver };
	struct ck_state want, got;
	struct zc_conn *c;
	pthread_t th;

	ck_gated_start(&d, &g);

	ck_job_start(&saver, &d, "saver", 1, ZC_ADAMW, policy);
	ck_job_steps(&saver, 1, K);
	ck_job_gather(&saver, &want);
	ck_job_start(&other, &d, "other", 1, ZC_LION, policy);
	c = itd_connect(&d);

	cr_assert_eq(pthread_create(&th, NULL, save_main, &a), 0);
	/* The save is in the daemon, and held there: its pieces cannot pass the gate. */
	while (itd_stat(c, "checkpoint.transfers_in_flight") < 1 && !atomic_load(&a.done))
		usleep(1000);
	cr_assert(!atomic_load(&a.done), "the save ended with the gate closed: %d %s", a.result,
	    a.err);

	/* Another client's steps and reads are answered while the save waits on its file. */
	ck_job_steps(&other, 1, 2);
	ck_job_gather(&other, &got);
	ck_state_free(&got);
	cr_assert_geq(itd_stat(c, "checkpoint.transfers_in_flight"), 1);
	cr_assert(!atomic_load(&a.done), "the save ended with the gate closed: %d %s", a.result,
	    a.err);

	/* Open the gate (kept open); the save finishes, whole and equal to the state. */
	g.fd = open(g.gate, O_WRONLY);
	cr_assert_geq(g.fd, 0, "open %s: %s", g.gate, strerror(errno));
	cr_assert_eq(pthread_join(th, NULL), 0);
	cr_assert_eq(a.result, 0, "save: %s", a.err);
	zc_disconnect(c);

	ck_job_restore(&restored, &d, "restored", 1, ZC_ADAMW, policy, g.ckdir, K);
	ck_job_gather(&restored, &got);
	ck_assert_same(&want, &got, "restored after a held save");
	ck_state_free(&want);
	ck_state_free(&got);
}

Test(slow, a_held_save_from_pinned_does_not_stall_other_clients)
{
	held_save(ZC_POLICY_CPU);
}

Test(slow, a_held_save_from_nvme_does_not_stall_other_clients)
{
	held_save(ZC_POLICY_NVME);
}
