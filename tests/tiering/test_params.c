/* Parameter offload: release, prefetch and wait on pinned and NVMe tensors, counted on both sides. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>

#include "th.h"

#define NVME_CONFIG \
	"{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"info\" }," \
	" \"memory\": { \"pinned_budget\": \"64M\" }," \
	" \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"128M\" } ]," \
	" \"chunk_elements\": 65536, \"staging_buffers\": 3 } }\n"

/* Odd sizes: the bf16 slots end mid-page, the stores are page-rounded. */
static const size_t sizes[] = { 300007, 65537, 1023 };
#define NT (sizeof(sizes) / sizeof(sizes[0]))
static const struct th_layout plain = { sizes, NT, ZC_BF16, ZC_BF16, false };
static const struct th_layout offload = { sizes, NT, ZC_BF16, ZC_BF16, true };

static struct itd daemon_;
static struct th_job ref, pin, nvme;
static char swapdir[64];

static void
setup(void)
{
	char config[512];

	th_swapdir(swapdir, sizeof(swapdir));
	snprintf(config, sizeof(config), NVME_CONFIG, swapdir);
	itd_start(&daemon_, config);
	/* The reference keeps its params in the slot; the other two offload them. */
	th_job_open(&ref, &daemon_, "reference", ZC_POLICY_CPU, 0);
	th_job_open(&pin, &daemon_, "pinned", ZC_POLICY_CPU, 0);
	th_job_open(&nvme, &daemon_, "nvme", ZC_POLICY_NVME, 0);
	th_register(&ref, &plain);
	th_register(&pin, &offload);
	th_register(&nvme, &offload);
}

static void
teardown(void)
{
	th_job_close(&ref);
	th_job_close(&pin);
	th_job_close(&nvme);
	itd_cleanup(&daemon_);
	th_swapdir_remove(swapdir);
}

TestSuite(params, .init = setup, .fini = teardown, .timeout = 60);

static void
step_all(uint64_t step)
{
	struct th_job *jobs[] = { &ref, &pin, &nvme };
	struct zc_step_params p = th_params(ZC_ADAMW, step);

	for (size_t i = 0; i < 3; i++) {
		for (size_t k = 0; k < NT; k++)
			th_fill_grads(jobs[i], k, step);
		cr_assert_eq(zc_step_submit(jobs[i]->c, &p, jobs[i]->t, NT), 0, "%s",
		    zc_errmsg(jobs[i]->c));
	}
	for (size_t i = 0; i < 3; i++)
		cr_assert_eq(zc_wait_all(jobs[i]->c, NULL), 0, "%s", zc_errmsg(jobs[i]->c));
}

/* What the daemon keeps per offloaded tensor: the slot's bytes in whole pages. */
static double
store_bytes(void)
{
	double sum = 0;

	for (size_t k = 0; k < NT; k++)
		sum += (double)((sizes[k] * 2 + 4095) / 4096 * 4096);
	return sum;
}

struct pstats {
	double fetches, hits, misses, staged, releases, written_back, shm, nvme_read;
};

static struct pstats
pstats(struct zc_conn *c)
{
	return (struct pstats){
		.fetches = itd_stat(c, "pipeline.params.fetches"),
		.hits = itd_stat(c, "pipeline.params.hits"),
		.misses = itd_stat(c, "pipeline.params.misses"),
		.staged = itd_stat(c, "pipeline.params.bytes_staged"),
		.releases = itd_stat(c, "pipeline.params.releases"),
		.written_back = itd_stat(c, "pipeline.params.bytes_written_back"),
		.shm = itd_stat(c, "tiers.shm.used_bytes"),
		.nvme_read = itd_stat(c, "tiers.nvme.paths.0.read_bytes"),
	};
}

/* Copies of the param slots, to compare against after a round trip through the store. */
static void
save_params(struct th_job *j, void **saved)
{
	for (size_t k = 0; k < NT; k++) {
		size_t bytes;
		const void *slot = zc_tensor_param_slot(j->t[k], &bytes);

		saved[k] = malloc(bytes);
		cr_assert_not_null(saved[k]);
		memcpy(saved[k], slot, bytes);
	}
}

static void
assert_params(struct th_job *j, void *const *want, const char *what)
{
	for (size_t k = 0; k < NT; k++) {
		size_t bytes;
		const uint8_t *slot = zc_tensor_param_slot(j->t[k], &bytes);

		if (memcmp(slot, want[k], bytes) == 0)
			continue;
		for (size_t i = 0; i < bytes; i++)
			cr_assert_eq(slot[i], ((const uint8_t *)want[k])[i],
			    "%s: tensor %zu param byte %zu is 0x%02x, want 0x%02x", what, k, i,
			    slot[i], ((const uint8_t *)want[k])[i]);
	}
}

static void
free_params(void **saved)
{
	for (size_t k = 0; k < NT; k++)
		free(saved[k]);
}

Test(params, release_prefetch_wait_and_step)
{
	struct th_job *off[] = { &pin, &nvme };
	void *want[NT], *saved[2][NT];
	struct zc_param_stats cs;
	struct th_snap a, b;
	struct pstats s0, s1;
	double deadline;

	step_all(1);
	/* The step wrote the same params everywhere; keep them to compare after the trip. */
	save_params(&ref, want);
	for (size_t i = 0; i < 2; i++) {
		assert_params(off[i], want, "after step 1");
		save_params(off[i], saved[i]);
	}

	/* Release: dirty slots go to the store (pinned memcpy, NVMe write), shm stays as it is. */
	s0 = pstats(ref.c);
	for (size_t i = 0; i < 2; i++)
		cr_assert_eq(zc_param_release(off[i]->c, off[i]->t, NT), 0, "%s",
		    zc_errmsg(off[i]->c));
	s1 = pstats(ref.c);
	cr_assert_eq(s1.shm, s0.shm, "release changed the shared memory in use");
	cr_assert_eq(s1.releases, s0.releases + 2 * NT);
	cr_assert_eq(s1.written_back, s0.written_back + 2 * store_bytes(),
	    "written back %.0f, want %.0f", s1.written_back - s0.written_back, 2 * store_bytes());
	cr_assert_eq(s1.fetches, s0.fetches);

	/*
	 * Prefetch all, let the READYs arrive, then wait: every wait is ready in
	 * the client, while every fetch was a miss in the daemon (it staged them).
	 */
	for (size_t i = 0; i < 2; i++)
		cr_assert_eq(zc_param_prefetch(off[i]->c, off[i]->t, NT), 0, "%s",
		    zc_errmsg(off[i]->c));
	deadline = itd_now() + 10;
	while (itd_stat(ref.c, "pipeline.params.bytes_staged") < s1.staged + 2 * store_bytes()) {
		cr_assert_lt(itd_now(), deadline, "the prefetch did not complete");
		usleep(10000);
	}
	/*
	 * Until every READY sits in its socket, unread: counted in the socket's
	 * queue (SIOCINQ adds up a SEQPACKET socket's datagrams), not guessed
	 * from a sleep that a loaded machine outlasts.
	 */
	for (size_t i = 0; i < 2; i++) {
		int queued = 0;

		deadline = itd_now() + 10;
		while (ioctl(zc_conn_fd(off[i]->c), SIOCINQ, &queued) == 0 &&
		    (size_t)queued < NT * (ZP_HEADER_SIZE + 8)) {
			cr_assert_lt(itd_now(), deadline, "job %zu: %d bytes of READYs queued", i,
			    queued);
			usleep(1000);
		}
	}
	for (size_t i = 0; i < 2; i++) {
		for (size_t k = 0; k < NT; k++)
			cr_assert_eq(zc_param_wait(off[i]->t[k]), 0, "%s", zc_errmsg(off[i]->c));
		zc_param_stats(off[i]->c, &cs);
		cr_assert_eq(cs.ready, NT, "job %zu: %llu waits ready after the READYs arrived", i,
		    (unsigned long long)cs.ready);
		cr_assert_eq(cs.waited, 0);
		assert_params(off[i], saved[i], "after release and prefetch");
	}
	s0 = pstats(ref.c);
	cr_assert_eq(s0.fetches, s1.fetches + 2 * NT);
	cr_assert_eq(s0.misses, s1.misses + 2 * NT, "every fetch had to stage from the store");
	cr_assert_eq(s0.hits, s1.hits, "a fetch of released params counted as a daemon hit");
	cr_assert_eq(s0.staged, s1.staged + 2 * store_bytes());
	cr_assert_geq(s0.nvme_read, s1.nvme_read + store_bytes(), "NVMe params were not read");

	/* Clean now: a second release writes nothing back. */
	for (size_t i = 0; i < 2; i++)
		cr_assert_eq(zc_param_release(off[i]->c, off[i]->t, NT), 0, "%s",
		    zc_errmsg(off[i]->c));
	s1 = pstats(ref.c);
	cr_assert_eq(s1.written_back, s0.written_back, "clean params were written back");
	cr_assert_eq(s1.releases, s0.releases + 2 * NT);

	/* A wait without a prefetch fetches on its own: it waited, and the daemon missed. */
	for (size_t i = 0; i < 2; i++) {
		cr_assert_eq(zc_param_wait(off[i]->t[0]), 0, "%s", zc_errmsg(off[i]->c));
		zc_param_stats(off[i]->c, &cs);
		cr_assert_eq(cs.waited, 1);
		cr_assert_eq(cs.ready, NT);
		cr_assert_eq(memcmp(zc_tensor_param_slot(off[i]->t[0], NULL), saved[i][0],
		    sizes[0] * 2), 0, "job %zu: a wait without prefetch staged other params", i);
		cr_assert_eq(zc_param_release(off[i]->c, off[i]->t, 1), 0, "%s",
		    zc_errmsg(off[i]->c));
	}
	s0 = pstats(ref.c);
	cr_assert_eq(s0.fetches, s1.fetches + 2);
	cr_assert_eq(s0.misses, s1.misses + 2);

	/* Stepping released tensors refills their slots: same params as the reference's. */
	step_all(2);
	free_params(want);
	save_params(&ref, want);
	th_snapshot(&ref, &a);
	for (size_t i = 0; i < 2; i++) {
		for (size_t k = 0; k < NT; k++)
			cr_assert_eq(zc_param_wait(off[i]->t[k]), 0, "%s", zc_errmsg(off[i]->c));
		zc_param_stats(off[i]->c, &cs);
		cr_assert_eq(cs.ready, 2 * NT, "a stepped tensor's params are in its slot");
		assert_params(off[i], want, "step 2 on released params against the reference");
		th_snapshot(off[i], &b);
		th_assert_same(&b, &a, "step 2 on released params against the reference");
		th_snap_free(&b);
	}
	s1 = pstats(ref.c);
	cr_assert_eq(s1.fetches, s0.fetches, "a step went through a fetch");
	cr_assert_eq(s1.shm, s0.shm);
	th_snap_free(&a);
	free_params(want);
	for (size_t i = 0; i < 2; i++)
		free_params(saved[i]);
}
