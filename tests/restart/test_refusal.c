/* A kept state that does not add up is refused, by name, with nothing overwritten; --start-empty sets it aside. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "trainer.h"

static struct zrt run_;
/* The inodes of every tensor's grad and param slot mappings, before the daemon died. */
static unsigned long inodes[ZRT_JOBS][ZRT_TENSORS][2];

/* The inode of the file mapped at addr in this process (/proc/self/maps), 0 if none. */
static unsigned long
mapped_inode(const void *addr)
{
	unsigned long start, end, ino = 0, found = 0;
	char line[512];
	FILE *f = fopen("/proc/self/maps", "r");

	while (f != NULL && fgets(line, sizeof(line), f) != NULL)
		if (sscanf(line, "%lx-%lx %*s %*s %*s %lu", &start, &end, &ino) == 3 &&
		    (uintptr_t)addr >= start && (uintptr_t)addr < end)
			found = ino;
	if (f != NULL)
		fclose(f);
	return found;
}

static void
slot_inodes(unsigned long ret[ZRT_JOBS][ZRT_TENSORS][2])
{
	for (int j = 0; j < ZRT_JOBS; j++)
		for (int k = 0; k < ZRT_TENSORS; k++) {
			ret[j][k][0] = mapped_inode(zc_tensor_grad_slot(run_.j[j].t[k], NULL));
			ret[j][k][1] = mapped_inode(zc_tensor_param_slot(run_.j[j].t[k], NULL));
		}
}

static void
teardown(void)
{
	zrt_teardown(&run_);
}

TestSuite(refusal, .fini = teardown, .timeout = 120);

/* A few steps on a named swap file, then the daemon dies with its state in the store. */
static void
kept_state(void)
{
	char err[20000] = "";
	int status;

	cr_assert_eq(zrt_setup(&run_, true, err, sizeof(err)), 0, "%s", err);
	run_.steps = 3;
	cr_assert_eq(zrt_attach(&run_, false, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(zrt_train(&run_, ZRT_NONE, 0, 0, err, sizeof(err)), 0, "%s", err);
	slot_inodes(inodes);
	zrt_detach(&run_);
	kill(run_.st.pid, SIGKILL);
	status = zst_wait_exit(&run_.st, 30);
	cr_assert(WIFSIGNALED(status), "status 0x%x", status);
}

static uint64_t
digest(int fd)
{
	cr_assert_geq(fd, 0);
	return zst_digest(fd);
}

/*
 * The daemon refuses to start, saying `why`; the store and every descriptor in it (the
 * table, the journal, each record, state and slot, the swap file) are as they were.
 */
static void
expect_refusal(const char *why)
{
	static uint64_t kept[ZST_MAX_FDS];
	uint64_t table = digest(zst_fd(&run_.st, "table"));
	uint64_t swap = digest(zst_fd(&run_.st, "swap0"));
	unsigned removes = run_.st.removes, stores = run_.st.stores;
	size_t nfds = run_.st.nfds;
	int status;

	for (size_t i = 0; i < nfds; i++)
		kept[i] = digest(run_.st.fds[i].fd);
	cr_assert_eq(zst_start(&run_.st, run_.argv), 0);
	cr_assert_eq(zst_wait_ready(&run_.st, run_.st.readies + 1, 30), -ECHILD,
	    "zoffloadd started on a kept state that should be refused:\n%s", zst_log(&run_.st));
	zst_drain(&run_.st);
	(void)status;
	cr_assert(strstr(zst_log(&run_.st), "refusing to start") != NULL, "%s", zst_log(&run_.st));
	cr_assert(strstr(zst_log(&run_.st), why) != NULL, "wanted '%s' in:\n%s", why,
	    zst_log(&run_.st));
	cr_assert_eq(run_.st.removes, removes, "the refusing daemon dropped kept descriptors");
	cr_assert_eq(run_.st.stores, stores, "the refusing daemon stored descriptors");
	cr_assert_eq(run_.st.nfds, nfds);
	cr_assert_eq(digest(zst_fd(&run_.st, "table")), table, "the table was written");
	cr_assert_eq(digest(zst_fd(&run_.st, "swap0")), swap, "the swap file was written");
	for (size_t i = 0; i < nfds; i++)
		cr_assert_eq(digest(run_.st.fds[i].fd), kept[i], "the refusing daemon wrote %s",
		    run_.st.fds[i].name);
}

static void
poke(const char *name, off_t off, const void *bytes, size_t n)
{
	int fd = zst_fd(&run_.st, name);

	cr_assert_geq(fd, 0, "no %s kept", name);
	cr_assert_eq(pwrite(fd, bytes, n, off), (ssize_t)n, "%s", strerror(errno));
}

Test(refusal, intact_state_is_taken_back)
{
	unsigned long now[ZRT_JOBS][ZRT_TENSORS][2];
	char err[20000] = "";
	unsigned removes;

	kept_state();
	removes = run_.st.removes;
	cr_assert_eq(zst_start(&run_.st, run_.argv), 0);
	cr_assert_eq(zst_wait_ready(&run_.st, run_.st.readies + 1, 30), 0, "%s",
	    zst_log(&run_.st));
	/* Everything handed back is taken: nothing is dropped from the store. */
	cr_assert_eq(run_.st.removes, removes, "%u FDSTOREREMOVE sent taking an intact state back",
	    run_.st.removes - removes);
	cr_assert_eq(zrt_attach(&run_, true, err, sizeof(err)), 0, "%s", err);
	for (int j = 0; j < ZRT_JOBS; j++)
		for (int k = 0; k < ZRT_TENSORS; k++)
			cr_assert_eq(zc_tensor_last_step(run_.j[j].t[k]), 3, "%s", zst_log(&run_.st));
	cr_assert(strstr(zst_log(&run_.st), "recovered 2 job(s), 4 tensor(s)") != NULL, "%s",
	    zst_log(&run_.st));
	/*
	 * What a reconnecting client gets: the same grad slot memfd (gradients written before
	 * the death are there) and the same param slot, whether params are offloaded (tensor 1
	 * of each job) or not (tensor 0: the client holds it read-only, the daemon maps its own
	 * descriptor writable again): nothing copied, nothing remapped.
	 */
	slot_inodes(now);
	for (int j = 0; j < ZRT_JOBS; j++) {
		for (int k = 0; k < ZRT_TENSORS; k++) {
			cr_assert_neq(now[j][k][0], 0);
			cr_assert_eq(now[j][k][0], inodes[j][k][0], "job %d tensor %d: another grad slot",
			    j, k);
			cr_assert_eq(now[j][k][1], inodes[j][k][1], "job %d tensor %d: another "
			    "param slot", j, k);
		}
	}
	cr_assert(strstr(zst_log(&run_.st), "was copied into a new one") == NULL, "%s",
	    zst_log(&run_.st));
}

/*
 * A param slot an older zoffloadd sealed against writes (F_SEAL_FUTURE_WRITE, the seal
 * binding the daemon's own descriptor too) cannot be mapped writable again: it is copied
 * into a new memfd, said so in the log, and the training goes on from the same params.
 */
Test(refusal, param_slot_sealed_by_an_older_daemon_is_copied)
{
	struct { char name[64]; uint64_t digest; } was[ZRT_JOBS * ZRT_TENSORS];
	char err[20000] = "", name[80];
	unsigned sealed = 0, copied = 0;
	const char *log, *at;

	kept_state();
	for (size_t i = 0; i < run_.st.nfds; i++) {
		int fd = run_.st.fds[i].fd, old;
		struct stat st;
		off64_t in = 0, out = 0;
		size_t len = strlen(run_.st.fds[i].name);

		/* The read-only ones (mode 0400): the params of tensors without param offload. */
		if (len < 6 || strcmp(run_.st.fds[i].name + len - 6, ".param") != 0 ||
		    fstat(fd, &st) != 0 || (st.st_mode & 0777) != 0400)
			continue;
		old = memfd_create("zoffload-param", MFD_CLOEXEC | MFD_ALLOW_SEALING);
		cr_assert_geq(old, 0, "%s", strerror(errno));
		cr_assert_eq(ftruncate(old, st.st_size), 0);
		while (in < st.st_size)
			cr_assert_gt(copy_file_range(fd, &in, old, &out, (size_t)(st.st_size - in), 0),
			    0, "%s", strerror(errno));
		cr_assert_eq(fcntl(old, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW |
		    F_SEAL_FUTURE_WRITE | F_SEAL_SEAL), 0, "%s", strerror(errno));
		cr_assert_eq(dup2(old, fd), fd);
		close(old);
		cr_assert_lt(sealed, ZRT_JOBS * ZRT_TENSORS);
		snprintf(was[sealed].name, sizeof(was[sealed].name), "%s", run_.st.fds[i].name);
		was[sealed].digest = digest(fd);
		sealed++;
	}
	cr_assert_eq(sealed, ZRT_JOBS, "%u read-only param slots kept", sealed);
	cr_assert_eq(zst_start(&run_.st, run_.argv), 0);
	cr_assert_eq(zst_wait_ready(&run_.st, run_.st.readies + 1, 30), 0, "%s",
	    zst_log(&run_.st));
	cr_assert_eq(zrt_attach(&run_, true, err, sizeof(err)), 0, "%s", err);
	for (int j = 0; j < ZRT_JOBS; j++)
		for (int k = 0; k < ZRT_TENSORS; k++)
			cr_assert_eq(zc_tensor_last_step(run_.j[j].t[k]), 3, "%s", zst_log(&run_.st));
	log = zst_log(&run_.st);
	for (at = log; (at = strstr(at, "was copied into a new one")) != NULL; at++)
		copied++;
	cr_assert_eq(copied, ZRT_JOBS, "%s", log);
	/* Each copy is kept under the other name, with the sealed one's bytes. */
	for (unsigned i = 0; i < sealed; i++) {
		snprintf(name, sizeof(name), "%.64s2", was[i].name);
		cr_assert_eq(digest(zst_fd(&run_.st, name)), was[i].digest, "%s: other contents",
		    name);
	}
}

Test(refusal, corrupted_table)
{
	uint32_t x = 0xdeadbeef;

	kept_state();
	poke("table", 200, &x, sizeof(x));
	expect_refusal("the recovery table's checksum fails");
}

Test(refusal, unknown_table_version)
{
	uint32_t v = 99;

	kept_state();
	poke("table", 8, &v, sizeof(v));
	expect_refusal("the recovery table is version 99; this zoffloadd knows version 1");
}

Test(refusal, corrupted_tensor_record)
{
	uint32_t x = 0x12345678;

	kept_state();
	poke("zt1.rec", 100, &x, sizeof(x));
	expect_refusal("tensor record zt1.rec: checksum mismatch");
}

Test(refusal, missing_swap_file)
{
	char want[300];

	kept_state();
	cr_assert_eq(unlink(run_.swap), 0);
	snprintf(want, sizeof(want), "swap file %s is missing", run_.swap);
	expect_refusal(want);
}

Test(refusal, wrong_size_swap_file)
{
	char want[300];

	kept_state();
	cr_assert_eq(truncate(run_.swap, (64 << 20) + 4096), 0);
	snprintf(want, sizeof(want), "swap file %s is %u bytes, the state was kept in one of %u "
	    "bytes", run_.swap, (64u << 20) + 4096, 64u << 20);
	expect_refusal(want);
}

Test(refusal, replaced_swap_file)
{
	char want[300];
	int fd;

	kept_state();
	cr_assert_eq(unlink(run_.swap), 0);
	fd = open(run_.swap, O_WRONLY | O_CREAT, 0600);
	cr_assert_geq(fd, 0);
	cr_assert_eq(ftruncate(fd, 64 << 20), 0);
	close(fd);
	snprintf(want, sizeof(want), "swap file %s is not the one the state was kept in",
	    run_.swap);
	expect_refusal(want);
}

/*
 * The configuration the state was kept under, with one thing changed: the swap paths (a
 * JSON list's inside) and the chunk size.  What zrt_setup writes, otherwise.
 */
static void
reconfigure_with(const char *paths, unsigned chunk_elements, const char *block_size)
{
	FILE *f = fopen(run_.config, "w");

	cr_assert_not_null(f, "%s", strerror(errno));
	fprintf(f, "{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"info\" },\n"
	    "  \"recovery\": { \"journal\": true },\n"
	    "  \"swap\": { \"paths\": [ %s ], \"block_size\": \"%s\",\n"
	    "    \"chunk_elements\": %u, \"staging_buffers\": 2 } }\n", paths, block_size,
	    chunk_elements);
	cr_assert_eq(fclose(f), 0);
}

static void
reconfigure(const char *paths, unsigned chunk_elements)
{
	reconfigure_with(paths, chunk_elements, "1M");
}

/* The path the state was kept on, as a swap.paths entry of the given capacity. */
static void
kept_path(char *buf, size_t len, const char *capacity)
{
	snprintf(buf, len, "{ \"path\": \"%s\", \"capacity\": \"%s\" }", run_.swap, capacity);
}

/* The NVMe state is laid out in chunks of the size it was kept with: another is refused. */
Test(refusal, changed_chunk_elements)
{
	char paths[400];

	kept_state();
	kept_path(paths, sizeof(paths), "64M");
	reconfigure(paths, 131072);
	expect_refusal("swap.chunk_elements is 131072; the state was kept with 65536");
}

/* A swap path more: the stripes would land elsewhere. */
Test(refusal, added_swap_path)
{
	char paths[800], one[400], other[200];

	kept_state();
	kept_path(one, sizeof(one), "64M");
	snprintf(other, sizeof(other), "%s/other.img", run_.st.dir);
	snprintf(paths, sizeof(paths), "%s, { \"path\": \"%s\", \"capacity\": \"64M\" }", one,
	    other);
	reconfigure(paths, 65536);
	expect_refusal("the state was kept on 1 swap path(s), swap.paths names 2");
	cr_assert_eq(access(other, F_OK), -1, "the refusing daemon made %s", other);
}

/* The same count of paths, another one: the kept state is not there. */
Test(refusal, renamed_swap_path)
{
	char paths[400], other[200], want[600];

	kept_state();
	snprintf(other, sizeof(other), "%s/other.img", run_.st.dir);
	snprintf(paths, sizeof(paths), "{ \"path\": \"%s\", \"capacity\": \"64M\" }", other);
	reconfigure(paths, 65536);
	snprintf(want, sizeof(want), "swap path 0 was %s when the state was kept, it is %s now",
	    run_.swap, other);
	expect_refusal(want);
	cr_assert_eq(access(other, F_OK), -1, "the refusing daemon made %s", other);
}

Test(refusal, start_empty_sets_it_aside)
{
	const char *argv[8];
	uint32_t x = 0xdeadbeef;
	char err[20000] = "", pattern[200];
	glob_t g;

	kept_state();
	poke("table", 200, &x, sizeof(x));
	expect_refusal("checksum fails");
	memcpy(argv, run_.argv, sizeof(argv));
	argv[5] = "--start-empty";
	argv[6] = NULL;
	cr_assert_eq(zst_start(&run_.st, argv), 0);
	cr_assert_eq(zst_wait_ready(&run_.st, run_.st.readies + 1, 30), 0, "%s",
	    zst_log(&run_.st));
	cr_assert(strstr(zst_log(&run_.st), "starting empty") != NULL, "%s", zst_log(&run_.st));
	snprintf(pattern, sizeof(pattern), "%s.aside-*", run_.swap);
	cr_assert_eq(glob(pattern, 0, NULL, &g), 0, "the old swap file was not kept aside");
	globfree(&g);
	/* Fresh: the tensors are new, at step 0. */
	cr_assert_eq(zrt_attach(&run_, false, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(zc_tensor_last_step(run_.j[0].t[0]), 0);
}

/* A larger capacity than the kept file holds: the engine would hand out space past its end. */
Test(refusal, grown_swap_capacity)
{
	char paths[400], want[600];

	kept_state();
	kept_path(paths, sizeof(paths), "128M");
	reconfigure(paths, 65536);
	snprintf(want, sizeof(want), "swap path %s: swap.paths capacity is %u bytes, the state "
	    "was kept in a file of %u", run_.swap, 128u << 20, 64u << 20);
	expect_refusal(want);
}

/*
 * A smaller one is taken: the table does not keep the capacity (a file may have been larger
 * than asked for), and the tensors' extents must still lie inside it, which the engine
 * checks as it takes each back.
 */
Test(refusal, shrunk_swap_capacity_holding_the_state)
{
	char paths[400], err[20000] = "";

	kept_state();
	kept_path(paths, sizeof(paths), "32M");
	reconfigure(paths, 65536);
	cr_assert_eq(zst_start(&run_.st, run_.argv), 0);
	cr_assert_eq(zst_wait_ready(&run_.st, run_.st.readies + 1, 30), 0, "%s",
	    zst_log(&run_.st));
	cr_assert_eq(zrt_attach(&run_, true, err, sizeof(err)), 0, "%s", err);
	for (int j = 0; j < ZRT_JOBS; j++)
		for (int k = 0; k < ZRT_TENSORS; k++)
			cr_assert_eq(zc_tensor_last_step(run_.j[j].t[k]), 3, "%s", zst_log(&run_.st));
}

/*
 * Striped over two paths, the stripe unit (swap.block_size) says where each part of an
 * extent lies: another is refused.  (Over one path an extent is whole in its file.)
 */
Test(refusal, changed_block_size_over_two_paths)
{
	char paths[800], one[400], other[200], err[20000] = "";
	const char *argv[8];
	int status;

	kept_state();
	kept_path(one, sizeof(one), "64M");
	snprintf(other, sizeof(other), "%s/other.img", run_.st.dir);
	snprintf(paths, sizeof(paths), "%s, { \"path\": \"%s\", \"capacity\": \"64M\" }", one,
	    other);
	/* A state kept on the two paths: started empty on them, trained, killed. */
	reconfigure(paths, 65536);
	memcpy(argv, run_.argv, sizeof(argv));
	argv[5] = "--start-empty";
	argv[6] = NULL;
	cr_assert_eq(zst_start(&run_.st, argv), 0);
	cr_assert_eq(zst_wait_ready(&run_.st, run_.st.readies + 1, 30), 0, "%s",
	    zst_log(&run_.st));
	cr_assert_eq(zrt_attach(&run_, false, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(zrt_train(&run_, ZRT_NONE, 0, 0, err, sizeof(err)), 0, "%s", err);
	zrt_detach(&run_);
	kill(run_.st.pid, SIGKILL);
	status = zst_wait_exit(&run_.st, 30);
	cr_assert(WIFSIGNALED(status), "status 0x%x", status);
	reconfigure_with(paths, 65536, "64K");
	expect_refusal("swap.block_size is 65536; the state was striped over 2 swap paths with "
	    "1048576");
}

/*
 * After --start-empty the state made since is kept like any other: the next death and
 * restart take it back (the first table and swap file handed back were left in the store,
 * and the new table never sent, so that restart was refused).
 */
Test(refusal, state_after_start_empty_is_taken_back)
{
	const char *argv[8];
	uint32_t x = 0xdeadbeef;
	char err[20000] = "";
	int status;

	kept_state();
	poke("table", 200, &x, sizeof(x));
	memcpy(argv, run_.argv, sizeof(argv));
	argv[5] = "--start-empty";
	argv[6] = NULL;
	cr_assert_eq(zst_start(&run_.st, argv), 0);
	cr_assert_eq(zst_wait_ready(&run_.st, run_.st.readies + 1, 30), 0, "%s",
	    zst_log(&run_.st));
	cr_assert_eq(zrt_attach(&run_, false, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(zrt_train(&run_, ZRT_NONE, 0, 0, err, sizeof(err)), 0, "%s", err);
	zrt_detach(&run_);
	kill(run_.st.pid, SIGKILL);
	status = zst_wait_exit(&run_.st, 30);
	cr_assert(WIFSIGNALED(status), "status 0x%x", status);
	cr_assert_eq(zst_start(&run_.st, run_.argv), 0);
	cr_assert_eq(zst_wait_ready(&run_.st, run_.st.readies + 1, 30), 0, "%s",
	    zst_log(&run_.st));
	cr_assert_eq(zrt_attach(&run_, true, err, sizeof(err)), 0, "%s", err);
	for (int j = 0; j < ZRT_JOBS; j++)
		for (int k = 0; k < ZRT_TENSORS; k++)
			cr_assert_eq(zc_tensor_last_step(run_.j[j].t[k]), 3, "%s", zst_log(&run_.st));
}

/* A descriptor the state was kept in taken out of the store, as a crash of systemd could. */
static void
drop_kept(const char *name)
{
	for (size_t i = 0; i < run_.st.nfds; i++) {
		if (strcmp(run_.st.fds[i].name, name) != 0)
			continue;
		close(run_.st.fds[i].fd);
		run_.st.fds[i] = run_.st.fds[--run_.st.nfds];
		return;
	}
	cr_assert_fail("no %s kept", name);
}

Test(refusal, missing_grad_slot)
{
	kept_state();
	drop_kept("zt1.grad");
	expect_refusal("tensor zt1: its grad or param slot was not handed back");
}

Test(refusal, missing_param_slot)
{
	kept_state();
	drop_kept("zt1.param");
	expect_refusal("tensor zt1: its grad or param slot was not handed back");
}

/*
 * Two kept tensors claiming the same swap space: a second record of an NVMe tensor (its
 * slots alongside, as a store holding a stale copy would have it).  Refused while the
 * tensors are checked, naming the overlap, before either is adopted: adopting the first
 * settles its record and finishes the journal's slice in it.
 */
Test(refusal, overlapping_swap_extents)
{
	static const char *const parts[] = { "rec", "grad", "param", "param2" };
	char name[64], copy[64];
	unsigned id = 0;

	kept_state();
	zst_drain(&run_.st);
	/* An NVMe tensor's state is on the swap file: its record has no .state beside it. */
	for (unsigned t = 1; t <= ZRT_JOBS * ZRT_TENSORS && id == 0; t++) {
		snprintf(name, sizeof(name), "zt%u.state", t);
		if (zst_fd(&run_.st, name) < 0)
			id = t;
	}
	cr_assert_neq(id, 0, "no NVMe tensor kept");
	for (size_t k = 0; k < sizeof(parts) / sizeof(parts[0]); k++) {
		int fd;

		snprintf(name, sizeof(name), "zt%u.%s", id, parts[k]);
		snprintf(copy, sizeof(copy), "zt99.%s", parts[k]);
		if (zst_fd(&run_.st, name) < 0)
			continue;
		fd = dup(zst_fd(&run_.st, name));
		cr_assert_geq(fd, 0);
		cr_assert_lt(run_.st.nfds, ZST_MAX_FDS);
		snprintf(run_.st.fds[run_.st.nfds].name, sizeof(run_.st.fds[0].name), "%s", copy);
		run_.st.fds[run_.st.nfds++].fd = fd;
	}
	expect_refusal("cannot take back its extent on the swap paths, which another kept "
	    "tensor's overlaps");
}
