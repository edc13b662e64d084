/*
 * A save over an earlier checkpoint leaves freeing the replaced file to the daemon: the
 * library holds the old file open across its rename and hands that descriptor over
 * (CKPT_RELEASE); the daemon holds it until the connection's next message, which the
 * client sends after closing its own copy, and then closes it on a closer thread.
 * Whoever drops the last reference to an unlinked file pays for freeing its blocks, so
 * the rank that saved does not.  (That the library closes its copy before its next
 * message is tested against the fake daemon in tests/client.)
 *
 * The daemon's closer threads open ZOFFLOADD_TEST_CLOSE_GATE (a FIFO, here the same as the
 * I/O threads' ZOFFLOADD_TEST_CKPT_GATE) for reading before each close; with no writer
 * holding it, a queued close waits there.  That shows, with no clock,
 * that the daemon holds the last reference after the client has let go of its own.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ck.h"
#include "msgio.h"

static struct itd d;
static struct ck_gated g = { .fd = -1, .closes = true };
static struct ck_job job, restored;

static void
teardown(void)
{
	ck_job_close(&restored);
	ck_job_close(&job);
	ck_gated_cleanup(&d, &g);
}

TestSuite(release, .fini = teardown, .timeout = 120);

/* Whether process pid (0: this one) has a descriptor open on inode ino of device dev. */
static bool
holds(pid_t pid, dev_t dev, ino_t ino)
{
	char dir[64], path[400];
	struct dirent *de;
	struct stat st;
	bool found = false;
	DIR *dp;

	snprintf(dir, sizeof(dir), pid == 0 ? "/proc/self/fd" : "/proc/%d/fd", (int)pid);
	dp = opendir(dir);
	cr_assert_not_null(dp, "%s: %s", dir, strerror(errno));
	while (!found && (de = readdir(dp)) != NULL) {
		snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
		found = de->d_name[0] != '.' && stat(path, &st) == 0 && st.st_dev == dev &&
		    st.st_ino == ino;
	}
	closedir(dp);
	return found;
}

/* Until the daemon has closed `want` replaced files; a minute is only a bound for a hang. */
static void
wait_closed(struct zc_conn *c, double want)
{
	double t0 = itd_now();

	while (itd_stat(c, "checkpoint.replaced_files_closed") < want && itd_now() - t0 < 60)
		usleep(1000);
	cr_assert_eq(itd_stat(c, "checkpoint.replaced_files_closed"), want, "the daemon closed "
	    "%.0f replaced files, not %.0f", itd_stat(c, "checkpoint.replaced_files_closed"),
	    want);
	cr_assert_eq(itd_stat(c, "checkpoint.replaced_files_closing"), 0);
}

static void
start(void)
{
	ck_gated_start(&d, &g);
	/* Held open (read-write: it does not wait for a reader), the gate lets jobs pass. */
	g.fd = open(g.gate, O_RDWR);
	cr_assert_geq(g.fd, 0, "open %s: %s", g.gate, strerror(errno));
}

Test(release, a_save_over_a_checkpoint_leaves_freeing_the_old_file_to_the_daemon)
{
	struct ck_state want, got;
	struct zc_conn *c;
	struct stat old, now;
	char rankfile[128];

	start();
	c = itd_connect(&d);
	ck_job_start(&job, &d, "job", 1, ZC_ADAMW, ZC_POLICY_NVME);
	ck_job_steps(&job, 1, 2);
	ck_job_save(&job, g.ckdir, 2);
	/* A first save replaces nothing. */
	cr_assert_eq(itd_stat(c, "checkpoint.replaced_files_closed"), 0);
	snprintf(rankfile, sizeof(rankfile), "%s/rank-00000-of-00001.safetensors", g.ckdir);
	cr_assert_eq(stat(rankfile, &old), 0, "%s: %s", rankfile, strerror(errno));

	ck_job_steps(&job, 3, 3);
	ck_job_save(&job, g.ckdir, 3);
	cr_assert_eq(stat(rankfile, &now), 0);
	cr_assert_neq(now.st_ino, old.st_ino, "the save did not replace the file");
	/* The client kept nothing of the old file; the daemon closes it, and keeps nothing. */
	cr_assert(!holds(0, old.st_dev, old.st_ino), "the client still holds the old file");
	wait_closed(c, 1);
	cr_assert(!holds(d.pid, old.st_dev, old.st_ino), "the daemon still holds the old file");

	/* What was saved is the new state, whole. */
	ck_job_gather(&job, &want);
	ck_job_restore(&restored, &d, "restored", 1, ZC_ADAMW, ZC_POLICY_NVME, g.ckdir, 3);
	ck_job_gather(&restored, &got);
	ck_assert_same(&want, &got, "restored after a save over a checkpoint");
	ck_state_free(&want);
	ck_state_free(&got);
	zc_disconnect(c);
}

Test(release, the_daemon_drops_the_last_reference_on_its_io_thread)
{
	static char bytes[1 << 20];
	struct zp_msg m = { .hdr = { .type = ZP_CKPT_RELEASE, .request_id = 7 } };
	struct zc_conn *c;
	char path[128];
	struct stat st;
	int raw, fd, pipefd[2];

	start();
	c = itd_connect(&d);
	snprintf(path, sizeof(path), "%s/replaced", g.ckdir);
	fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
	memset(bytes, 0x5a, sizeof(bytes));
	cr_assert_eq(write(fd, bytes, sizeof(bytes)), (ssize_t)sizeof(bytes));
	cr_assert_eq(fstat(fd, &st), 0);
	cr_assert_eq(unlink(path), 0);

	/* The gate shut: a queued close waits on its closer thread. */
	close(g.fd);
	g.fd = -1;
	raw = itd_raw_connect(&d);
	itd_raw_hello(raw);
	cr_assert_eq(zp_send(raw, &m, &fd, 1), 0);
	cr_assert(itd_raw_recv(raw, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_OK, "CKPT_RELEASE answered with %s", zp_type_name(m.hdr.type));
	cr_assert_eq(m.hdr.request_id, 7);
	close(fd);
	/* Ours is closed; the daemon's is the last, held until this connection's next message. */
	cr_assert(holds(d.pid, st.st_dev, st.st_ino), "the daemon does not hold the file");
	cr_assert_eq(itd_stat(c, "checkpoint.replaced_files_closing"), 1);
	itd_raw_send(raw, ZP_PING, 8, NULL);
	cr_assert(itd_raw_recv(raw, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_PONG, "PING answered with %s", zp_type_name(m.hdr.type));
	/* Now queued, at the shut gate: still the daemon's. */
	cr_assert(holds(d.pid, st.st_dev, st.st_ino), "the daemon does not hold the file");
	cr_assert_eq(itd_stat(c, "checkpoint.replaced_files_closing"), 1);
	cr_assert_eq(itd_stat(c, "checkpoint.replaced_files_closed"), 0);

	g.fd = open(g.gate, O_RDWR);
	cr_assert_geq(g.fd, 0);
	wait_closed(c, 1);
	cr_assert(!holds(d.pid, st.st_dev, st.st_ino), "the daemon still holds the file");

	/* Not a regular file: refused by name, and the connection goes on. */
	cr_assert_eq(pipe2(pipefd, O_CLOEXEC), 0);
	m = (struct zp_msg){ .hdr = { .type = ZP_CKPT_RELEASE, .request_id = 9 } };
	cr_assert_eq(zp_send(raw, &m, &pipefd[0], 1), 0);
	cr_assert(itd_raw_recv(raw, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_ERROR, "a pipe answered with %s", zp_type_name(m.hdr.type));
	cr_assert_eq(m.u.error.code, -EBADF);
	cr_assert(strstr(m.u.error.message, "not a regular file") != NULL, "%s",
	    m.u.error.message);
	itd_raw_send(raw, ZP_PING, 10, NULL);
	cr_assert(itd_raw_recv(raw, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_PONG, "PING answered with %s", zp_type_name(m.hdr.type));
	close(pipefd[0]);
	close(pipefd[1]);
	cr_assert_eq(itd_stat(c, "checkpoint.replaced_files_closed"), 1);

	/* A connection that ends after a release, with no message more: closed all the same. */
	fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
	cr_assert_eq(fstat(fd, &st), 0);
	cr_assert_eq(unlink(path), 0);
	m = (struct zp_msg){ .hdr = { .type = ZP_CKPT_RELEASE, .request_id = 11 } };
	cr_assert_eq(zp_send(raw, &m, &fd, 1), 0);
	cr_assert(itd_raw_recv(raw, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_OK, "CKPT_RELEASE answered with %s", zp_type_name(m.hdr.type));
	close(fd);
	close(raw);
	wait_closed(c, 2);
	cr_assert(!holds(d.pid, st.st_dev, st.st_ino), "the daemon still holds the file");
	zc_disconnect(c);
}
