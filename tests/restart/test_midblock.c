/*
 * A SIGKILL half way through a block of a pinned slice: the journal finishes the step bit
 * for bit; without it the tensor is torn until set.  A start that refuses the kept state
 * writes none of it.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "recover.h"
#include "trainer.h"

/*
 * Where the daemon is held: step 3, the first slice of tensor 'w' (4 Mi
 * elements: 512 journal blocks, two workers), block 200, so the slice has
 * blocks stepped, one half stepped, blocks not begun and the other worker
 * somewhere in its own half.
 */
#define GATE_AT "3,0,200"
#define STEPS 4

static struct zrt ref_, run_;
static char dir_[64], fifo_[96];
/* 'w' with fp32 params: the run where its slot is its master (engine_impl.h, master_in_slot). */
static bool w_fp32_;
/* 'x' with bf16 params: its slot is bf16-master+q8's master. */
static bool x_bf16_;
/* Run between the kill and the restart (zrt's before_restart), set before gated_setup. */
static void (*before_restart_)(struct zrt *r);
/* Where gated_setup holds the daemon (STEP,UNIT,BLOCK), set before it. */
static const char *gate_at_ = GATE_AT;

static void
teardown(void)
{
	zrt_teardown(&ref_);
	zrt_teardown(&run_);
	unsetenv("ZOFFLOADD_TEST_STEP_GATE");
	unsetenv("ZOFFLOADD_TEST_STEP_GATE_AT");
	unsetenv("ZOFFLOADD_TEST_ADOPT_ENOMEM");
	if (fifo_[0] != '\0')
		unlink(fifo_);
	if (dir_[0] != '\0')
		rmdir(dir_);
	fifo_[0] = dir_[0] = '\0';
	w_fp32_ = false;
	x_bf16_ = false;
	before_restart_ = NULL;
	gate_at_ = GATE_AT;
}

TestSuite(midblock, .fini = teardown, .timeout = 300);

/* An uninterrupted run of steps 1..steps (no gate): its master, m, v and param slots. */
static void *
reference(const char *format, enum zc_optim optim, unsigned steps, size_t *bytes)
{
	char err[20000] = "";
	void *want;

	unsetenv("ZOFFLOADD_TEST_STEP_GATE");
	cr_assert_eq(zrt_setup(&ref_, false, err, sizeof(err)), 0, "%s", err);
	ref_.steps = steps;
	ref_.w_fp32_params = w_fp32_;
	ref_.x_bf16_params = x_bf16_;
	ref_.state_format = format;
	ref_.optim = optim;
	cr_assert_eq(zrt_attach(&ref_, false, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(zrt_train(&ref_, ZRT_NONE, 0, 0, err, sizeof(err)), 0, "%s", err);
	*bytes = zrt_snapshot(&ref_, NULL);
	want = malloc(*bytes);
	cr_assert(want != NULL);
	zrt_snapshot(&ref_, want);
	zrt_teardown(&ref_);
	return want;
}

/* The gated daemon: held at GATE_AT on its first pass there, with or without the journal. */
static void
gated_setup(const char *format, enum zc_optim optim, bool journal)
{
	struct zrt_options o = { .journal_off = !journal, .gate_fifo = fifo_ };
	char err[20000] = "";

	snprintf(dir_, sizeof(dir_), "/tmp/zoffload-midblock-XXXXXX");
	cr_assert(mkdtemp(dir_) != NULL);
	snprintf(fifo_, sizeof(fifo_), "%s/gate", dir_);
	cr_assert_eq(mkfifo(fifo_, 0600), 0, "mkfifo: %s", strerror(errno));
	setenv("ZOFFLOADD_TEST_STEP_GATE", fifo_, 1);
	setenv("ZOFFLOADD_TEST_STEP_GATE_AT", gate_at_, 1);
	cr_assert_eq(zrt_setup_with(&run_, false, &o, err, sizeof(err)), 0, "%s", err);
	run_.before_restart = before_restart_;
	run_.steps = STEPS;
	run_.w_fp32_params = w_fp32_;
	run_.x_bf16_params = x_bf16_;
	run_.state_format = format;
	run_.optim = optim;
	/* Reconnects by hand: the trainer sees the death and submits again. */
	cr_assert_eq(zrt_attach(&run_, false, err, sizeof(err)), 0, "%s", err);
}

static void
same_bytes(const void *got, const void *want, size_t bytes)
{
	for (size_t i = 0; i < bytes; i++)
		cr_assert_eq(((const unsigned char *)got)[i], ((const unsigned char *)want)[i],
		    "byte %zu of %zu differs (%u restarts, %u steps submitted again)\n%s", i, bytes,
		    run_.restarts, run_.resubmits, zst_log(&run_.st));
}

/* Held at the gate, killed, restarted: the log says `made_whole`, the bytes are the reference's. */
static void
whole_after_the_gate(const char *format, enum zc_optim optim, const char *made_whole)
{
	char err[20000] = "";
	size_t bytes;
	void *want = reference(format, optim, STEPS, &bytes), *got = malloc(bytes);

	cr_assert(got != NULL);
	gated_setup(format, optim, true);
	cr_assert_eq(zrt_train(&run_, ZRT_GATE, 1, 1, err, sizeof(err)), 0,
	    "%s\n--- daemon log ---\n%s", err, zst_log(&run_.st));
	cr_assert_eq(run_.restarts, 1);
	cr_assert(strstr(zst_log(&run_.st), made_whole) != NULL, "%s", zst_log(&run_.st));
	zrt_snapshot(&run_, got);
	same_bytes(got, want, bytes);
	free(want);
	free(got);
}

static void
finished_by_journal(const char *format, enum zc_optim optim)
{
	whole_after_the_gate(format, optim, "tensor 'w': a step cut short by the restart was made "
	    "whole (1 slice(s) finished from the journal");
}

Test(midblock, fp32_adamw) { finished_by_journal("fp32", ZC_ADAMW); }
Test(midblock, fp32_adam) { finished_by_journal("fp32", ZC_ADAM); }
Test(midblock, fp32_adagrad) { finished_by_journal("fp32", ZC_ADAGRAD); }
Test(midblock, fp32_lion) { finished_by_journal("fp32", ZC_LION); }
Test(midblock, bf16_moments_adamw) { finished_by_journal("bf16-moments", ZC_ADAMW); }
Test(midblock, bf16_moments_adam) { finished_by_journal("bf16-moments", ZC_ADAM); }
Test(midblock, q8_moments_adamw) { finished_by_journal("q8-moments", ZC_ADAMW); }
Test(midblock, q8_moments_adam) { finished_by_journal("q8-moments", ZC_ADAM); }
Test(midblock, bf16_master_q8_adamw) { finished_by_journal("bf16-master+q8", ZC_ADAMW); }
Test(midblock, bf16_master_q8_adam) { finished_by_journal("bf16-master+q8", ZC_ADAM); }

/*
 * A daemon before journal version 3 kept its workers' rings packed: the kept journal of
 * the killed daemon is rewritten in that layout (each ring moved, the version set, the file
 * cut to its size) before the restart, which must take it back and finish the step, then
 * go on stepping through it, bit for bit: an upgrade across the layout loses nothing.
 */
static void
journal_to_version_2(struct zrt *r)
{
	size_t h3, s3, b3, h2, s2, b2;
	uint32_t version = 2;
	static char ring[64 << 10];
	int fd = zst_fd(&r->st, "journal");

	cr_assert_geq(fd, 0, "no journal kept");
	cr_assert_eq(ze_journal_layout(ZE_JOURNAL_VERSION, &h3, &s3, &b3), 0);
	cr_assert_eq(ze_journal_layout(2, &h2, &s2, &b2), 0);
	cr_assert(h2 == h3 && s2 < s3 && s2 <= sizeof(ring) && b2 < b3);
	/* Ascending: version 2's ring w lands below version 3's ring w, on rings moved already. */
	for (unsigned w = 0; w < ZE_JOURNAL_WORKERS; w++) {
		cr_assert_eq(pread(fd, ring, s2, (off_t)(h3 + w * s3)), (ssize_t)s2);
		cr_assert_eq(pwrite(fd, ring, s2, (off_t)(h2 + w * s2)), (ssize_t)s2);
	}
	/* The header's version: after its 8-byte magic. */
	cr_assert_eq(pwrite(fd, &version, sizeof(version), 8), (ssize_t)sizeof(version));
	cr_assert_eq(ftruncate(fd, (off_t)b2), 0);
}

Test(midblock, fp32_adamw_from_a_version_2_journal)
{
	before_restart_ = journal_to_version_2;
	finished_by_journal("fp32", ZC_ADAMW);
}

Test(midblock, q8_moments_adamw_from_a_version_2_journal)
{
	before_restart_ = journal_to_version_2;
	finished_by_journal("q8-moments", ZC_ADAMW);
}

/*
 * The same with 'w''s params fp32: its slot is its master for the formats
 * with an fp32 master (the step writes one array, the slot, in place), so
 * the half-stepped block is in the client's slot itself and the journal
 * must finish it there, bit for bit.  bf16-master+q8 (bf16 master, fp32
 * slot) keeps its mirror, and is covered above by 'w''s bf16 params, where
 * its slot is its bf16 master.
 */
static void
finished_in_slot(const char *format, enum zc_optim optim)
{
	w_fp32_ = true;
	finished_by_journal(format, optim);
}

Test(midblock, slot_master_fp32_adamw) { finished_in_slot("fp32", ZC_ADAMW); }
Test(midblock, slot_master_fp32_adam) { finished_in_slot("fp32", ZC_ADAM); }
Test(midblock, slot_master_fp32_adagrad) { finished_in_slot("fp32", ZC_ADAGRAD); }
Test(midblock, slot_master_fp32_lion) { finished_in_slot("fp32", ZC_LION); }
Test(midblock, slot_master_bf16_moments_adamw) { finished_in_slot("bf16-moments", ZC_ADAMW); }
Test(midblock, slot_master_q8_moments_adamw) { finished_in_slot("q8-moments", ZC_ADAMW); }

/*
 * NVMe: tensor 'x' (fp32 params, or bf16 ones for bf16-master+q8; 5 chunks) keeps only
 * m, v (and the scales) on disk, its slot being its master (nvme_impl.h).  The daemon is
 * held where chunk 2 of step 3 has landed and the slot has not yet taken its new master: a
 * restart writes the chunk again from its kept staging buffer and copies that master into
 * the slot, bit for bit (with chunk 3 too where it was computed by then: two staging
 * buffers).
 */
static void
landed_before_the_slot(const char *format, enum zc_optim optim)
{
	static char at[64];

	snprintf(at, sizeof(at), "3,2,%" PRIu64, (uint64_t)ZE_GATE_LANDED);
	gate_at_ = at;
	whole_after_the_gate(format, optim, "tensor 'x': a step cut short by the restart was made "
	    "whole (0 slice(s) finished from the journal, ");
}

Test(midblock, nvme_slot_master_fp32_adamw) { landed_before_the_slot("fp32", ZC_ADAMW); }
Test(midblock, nvme_slot_master_q8_moments_adamw) { landed_before_the_slot("q8-moments", ZC_ADAMW); }

Test(midblock, nvme_slot_master_bf16_master_q8_adamw)
{
	x_bf16_ = true;
	landed_before_the_slot("bf16-master+q8", ZC_ADAMW);
}

/*
 * recovery.journal false: the half-stepped slice leaves 'w' torn (and any
 * tensor handed to compute and not stamped: nothing says it was not
 * touched).  Its steps are refused, naming the step, until its state is
 * written back (here every tensor's from an uninterrupted run's step 2, as
 * from a checkpoint) and its step set; then it trains on to the
 * uninterrupted run's bytes.
 */
Test(midblock, journal_off_torn_until_set)
{
	bool in[ZRT_JOBS] = { true, true };
	struct zc_step_result res;
	size_t bytes, b2;
	void *want = reference("fp32", ZC_ADAMW, STEPS, &bytes), *got = malloc(bytes);
	void *at2 = reference("fp32", ZC_ADAMW, 2, &b2);
	char err[20000] = "";

	cr_assert(got != NULL && b2 == bytes);
	gated_setup("fp32", ZC_ADAMW, false);
	run_.stop_after_restart = true;
	cr_assert_eq(zrt_train(&run_, ZRT_GATE, 1, 1, err, sizeof(err)), 0,
	    "%s\n--- daemon log ---\n%s", err, zst_log(&run_.st));
	cr_assert_eq(run_.restarts, 1);
	cr_assert(strstr(zst_log(&run_.st), "tensor 'w' is torn: step 3 was half applied") != NULL,
	    "%s", zst_log(&run_.st));
	cr_assert_eq(zc_tensor_last_step(run_.j[0].t[0]), 2);
	cr_assert_lt(zrt_step(&run_, 3, in), 0, "a torn tensor's step went through");
	cr_assert(strstr(zc_errmsg(run_.j[0].c), "left half way through step 3") != NULL, "%s",
	    zc_errmsg(run_.j[0].c));
	/* The other job's step may still be landing. */
	(void)zc_wait_all(run_.j[1].c, &res);
	cr_assert_eq(zrt_restore(&run_, at2, 2), 0, "%s / %s", zc_errmsg(run_.j[0].c),
	    zc_errmsg(run_.j[1].c));
	cr_assert_eq(zrt_step(&run_, 3, in), 0, "%s", zc_errmsg(run_.j[0].c));
	memset(in, 0, sizeof(in));
	cr_assert_eq(zrt_step(&run_, 4, in), 0, "%s", zc_errmsg(run_.j[0].c));
	zrt_snapshot(&run_, got);
	same_bytes(got, want, bytes);
	free(want);
	free(got);
	free(at2);
}

/* Steps 1..STEPS on a thread of their own, until one fails (the daemon killed at its gate). */
struct stepper {
	bool submitted[ZRT_JOBS];
	unsigned failed;		/* the step that failed, 0: none */
};

static void *
step_thread(void *arg)
{
	struct stepper *sp = arg;

	for (unsigned step = 1; step <= STEPS; step++) {
		if (zrt_step(&run_, step, sp->submitted) < 0) {
			sp->failed = step;
			break;
		}
		memset(sp->submitted, 0, sizeof(sp->submitted));
	}
	return NULL;
}


/*
 * The gated daemon SIGKILLed half way through step 3 of 'w', with the journal holding its
 * slice: the name of the record kept last, the tensor a restart adopts after 'w'.
 */
static void
killed_in_step3(struct stepper *sp, char *last_id, size_t len)
{
	struct pollfd p = { .events = POLLIN };
	pthread_t th;
	int status;
	char c;

	gated_setup("fp32", ZC_ADAMW, true);
	p.fd = open(fifo_, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
	cr_assert_geq(p.fd, 0, "%s", strerror(errno));
	cr_assert_eq(pthread_create(&th, NULL, step_thread, sp), 0);
	cr_assert(poll(&p, 1, 60000) == 1 && read(p.fd, &c, 1) == 1,
	    "the daemon never reached its step gate\n%s", zst_log(&run_.st));
	kill(run_.st.pid, SIGKILL);
	status = zst_wait_exit(&run_.st, 60);
	cr_assert(status >= 0 && WIFSIGNALED(status), "status 0x%x", status);
	pthread_join(th, NULL);
	close(p.fd);
	cr_assert_eq(sp->failed, 3, "step %u failed, not the gated one", sp->failed);
	last_id[0] = '\0';
	for (size_t i = 0; i < run_.st.nfds; i++) {
		const char *n = run_.st.fds[i].name;
		size_t nl = strlen(n);

		if (strncmp(n, "zt", 2) == 0 && nl > 6 && strcmp(n + nl - 4, ".rec") == 0)
			snprintf(last_id, len, "%.*s", (int)(nl - 6), n + 2);
	}
	cr_assert(last_id[0] != '\0', "no tensor record kept");
}

/* Started again with what the store holds: adopted, and steps 3.. to the uninterrupted bytes. */
static void
resumed_to(const void *want, size_t bytes, struct stepper *sp)
{
	char err[20000] = "";
	void *got = malloc(bytes);

	cr_assert(got != NULL);
	cr_assert_eq(zst_start(&run_.st, run_.argv), 0);
	cr_assert_eq(zst_wait_ready(&run_.st, run_.st.readies + 1, 30), 0, "%s",
	    zst_log(&run_.st));
	cr_assert_eq(zrt_attach(&run_, true, err, sizeof(err)), 0, "%s", err);
	for (unsigned step = 3; step <= STEPS; step++) {
		cr_assert_eq(zrt_step(&run_, step, sp->submitted), 0, "step %u: %s / %s\n%s", step,
		    zc_errmsg(run_.j[0].c), zc_errmsg(run_.j[1].c), zst_log(&run_.st));
		memset(sp->submitted, 0, sizeof(sp->submitted));
	}
	zrt_snapshot(&run_, got);
	same_bytes(got, want, bytes);
	free(got);
}

#define SLICE_FINISHED "tensor 'w': a step cut short by the restart was made whole (1 slice(s) " \
	"finished from the journal"

/*
 * A refusal found during adoption writes nothing.  The daemon dies half way through
 * step 3 of 'w'; the grad slot of the tensor kept last is kept back from the store.  The
 * start refuses, naming it, and every descriptor kept (the journal, each record, state and
 * slot, the table, the swap file) reads as before it.  Handed back, the next start adopts:
 * the journal finishes 'w''s slice and the steps go on to the uninterrupted run's bytes.
 */
Test(midblock, refusal_writes_nothing)
{
	static uint64_t before[ZST_MAX_FDS];
	struct stepper sp = { .failed = 0 };
	char id[24], grad[64], why[128];
	size_t bytes, nfds;
	void *want = reference("fp32", ZC_ADAMW, STEPS, &bytes);
	unsigned stores, removes;
	int held = -1;

	killed_in_step3(&sp, id, sizeof(id));
	snprintf(grad, sizeof(grad), "zt%s.grad", id);
	for (size_t i = 0; i < run_.st.nfds && held < 0; i++) {
		if (strcmp(run_.st.fds[i].name, grad) != 0)
			continue;
		held = run_.st.fds[i].fd;
		memmove(&run_.st.fds[i], &run_.st.fds[i + 1],
		    (run_.st.nfds - i - 1) * sizeof(run_.st.fds[0]));
		run_.st.nfds--;
	}
	cr_assert_geq(held, 0, "no %s kept", grad);
	for (size_t i = 0; i < run_.st.nfds; i++)
		before[i] = zst_digest(run_.st.fds[i].fd);
	nfds = run_.st.nfds;
	stores = run_.st.stores;
	removes = run_.st.removes;

	cr_assert_eq(zst_start(&run_.st, run_.argv), 0);
	cr_assert_eq(zst_wait_ready(&run_.st, run_.st.readies + 1, 30), -ECHILD,
	    "zoffloadd started with %s missing:\n%s", grad, zst_log(&run_.st));
	zst_drain(&run_.st);
	snprintf(why, sizeof(why), "refusing to start: tensor zt%s: its grad or param slot was "
	    "not handed back", id);
	cr_assert(strstr(zst_log(&run_.st), why) != NULL, "wanted '%s' in:\n%s", why,
	    zst_log(&run_.st));
	cr_assert_eq(run_.st.nfds, nfds);
	cr_assert_eq(run_.st.stores, stores, "the refusing daemon stored descriptors");
	cr_assert_eq(run_.st.removes, removes, "the refusing daemon dropped kept descriptors");
	for (size_t i = 0; i < run_.st.nfds; i++)
		cr_assert_eq(zst_digest(run_.st.fds[i].fd), before[i], "the refusing daemon wrote %s",
		    run_.st.fds[i].name);

	/* Handed back: adopted, the slice finished, the steps on to the same bytes. */
	snprintf(run_.st.fds[run_.st.nfds].name, sizeof(run_.st.fds[0].name), "%s", grad);
	run_.st.fds[run_.st.nfds++].fd = held;
	resumed_to(want, bytes, &sp);
	cr_assert(strstr(zst_log(&run_.st), SLICE_FINISHED) != NULL, "%s", zst_log(&run_.st));
	free(want);
}

/*
 * A start that fails for want of memory after it has adopted some tensors (a resource
 * failure, which no check before adoption can foresee) leaves what it wrote as a death at
 * that moment would: 'w''s slice finished from the journal, its record settled.  The next
 * start takes that back and the steps go on to the uninterrupted run's bytes: nothing is
 * stepped twice nor lost.
 */
Test(midblock, start_out_of_memory_part_way)
{
	struct stepper sp = { .failed = 0 };
	char id[24], why[128];
	size_t bytes;
	void *want = reference("fp32", ZC_ADAMW, STEPS, &bytes);

	killed_in_step3(&sp, id, sizeof(id));
	setenv("ZOFFLOADD_TEST_ADOPT_ENOMEM", id, 1);
	cr_assert_eq(zst_start(&run_.st, run_.argv), 0);
	cr_assert_eq(zst_wait_ready(&run_.st, run_.st.readies + 1, 30), -ECHILD,
	    "zoffloadd started though out of memory at tensor zt%s:\n%s", id, zst_log(&run_.st));
	zst_drain(&run_.st);
	unsetenv("ZOFFLOADD_TEST_ADOPT_ENOMEM");
	snprintf(why, sizeof(why), "cannot take back its state: Cannot allocate memory");
	cr_assert(strstr(zst_log(&run_.st), why) != NULL, "wanted '%s' in:\n%s", why,
	    zst_log(&run_.st));
	/* 'w' came first: the failed start finished its slice. */
	cr_assert(strstr(zst_log(&run_.st), SLICE_FINISHED) != NULL, "%s", zst_log(&run_.st));
	resumed_to(want, bytes, &sp);
	free(want);
}
