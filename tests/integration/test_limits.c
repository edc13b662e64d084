/* Every admission limit of the configuration at its boundary: state exactly at the budget fits, one accounting unit more is refused with its errno and a message naming the limit. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "itd.h"

/*
 * The accounting units, from daemon/tier.c, job.c, shm.c and tiers/:
 *
 * - Pinned state (job and uid budgets): master, m and v are each rounded up
 *   to whole 4 KiB pages and padded by 4160 bytes (against cache aliasing).
 *   The tensors here have fp32 params, so their param slot is their master
 *   (docs/tiers.md) and the pinned state is m and v: a tensor of n elements,
 *   n a multiple of 1024, is charged 2 * (4n + 4160) bytes, and one element
 *   more adds one page to each array.
 * - The pinned tier itself (memory.pinned_budget) rounds that up to a page.
 * - Swap (limits.uid_swap_budget, swap.paths capacity): 8 bytes per element
 *   with fp32 params (m and v: the slot is the master on NVMe too), the
 *   element count rounded up to 1024 (a tensor below chunk_elements is one
 *   chunk of whole pages).
 * - Shared memory (memory.shm_budget): each slot and each connection's
 *   transfer window rounded up to a page.
 * - Connections (limits.max_clients, max_clients_per_uid) are checked at
 *   the boundary in tests/service/test_hostile.c.
 *
 * The smallest step one tensor can add is several pages (two arrays, two
 * slots), so every budget is also run one byte short, where the exact
 * tensor must be refused: a check that allowed any slack fails there.
 */
#define PAGE 4096ull
/* A multiple of 1024 (every array ends on a page) whose m and v pass the pinned tier's 1 MiB floor. */
#define N0 (160ull * 1024)

static struct itd daemon_;
static struct zc_conn *conn;
static char swapdir[64];

static void
teardown(void)
{
	if (conn != NULL)
		zc_disconnect(conn);
	conn = NULL;
	itd_cleanup(&daemon_);
	if (swapdir[0] != '\0')
		rmdir(swapdir);
	swapdir[0] = '\0';
}

TestSuite(limits, .fini = teardown, .timeout = 60);

static uint64_t
round_up(uint64_t x, uint64_t to)
{
	return (x + to - 1) / to * to;
}

/* What a pinned tensor of n elements (fp32 params: no master apart) counts against the budgets. */
static uint64_t
pinned_charge(uint64_t n)
{
	return 2 * (round_up(4 * n, PAGE) + 4160);
}

static void
start(const char *memory, const char *limits, enum zc_policy policy, uint64_t job_budget)
{
	struct zc_job_options opts = { .policy = policy, .pinned_budget = job_budget };
	char config[1024];

	snprintf(config, sizeof(config), "{ \"compute\": { \"worker_threads\": 2 }, "
	    "\"memory\": { %s }, \"limits\": { %s } }\n", memory, limits);
	itd_start(&daemon_, config);
	conn = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open_opts(conn, "limits", 0, 1, &opts), 0, "%s", zc_errmsg(conn));
}

/* The same with one swap directory of this capacity under /tmp. */
static void
start_with_swap(const char *capacity, const char *limits, enum zc_policy policy)
{
	struct zc_job_options opts = { .policy = policy };
	char config[1024];

	snprintf(swapdir, sizeof(swapdir), "/tmp/zoff-limits-XXXXXX");
	cr_assert_not_null(mkdtemp(swapdir));
	snprintf(config, sizeof(config), "{ \"compute\": { \"worker_threads\": 2 }, "
	    "\"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"%s\" } ] }, "
	    "\"limits\": { %s } }\n", swapdir, capacity, limits);
	itd_start(&daemon_, config);
	conn = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open_opts(conn, "limits", 0, 1, &opts), 0, "%s", zc_errmsg(conn));
}

static int
reg_on(struct zc_conn *c, const char *name, uint64_t n, enum zc_dtype gdt, enum zc_dtype pdt,
    struct zc_tensor **ret)
{
	struct zc_tensor_desc desc = { .name = name, .numel = n, .grad_dtype = gdt,
		.param_dtype = pdt };
	float *init = calloc(n, sizeof(float));
	int r;

	cr_assert_not_null(init);
	r = zc_tensor_register(c, &desc, init, ret);
	free(init);
	return r;
}

static int
reg(const char *name, uint64_t n, enum zc_dtype gdt, enum zc_dtype pdt, struct zc_tensor **ret)
{
	return reg_on(conn, name, n, gdt, pdt, ret);
}

/* Refused with code, and the message names the limit and the tensor. */
static void
expect_refused_on(struct zc_conn *c, const char *name, uint64_t n, int code, const char *limit)
{
	struct zc_tensor *t = NULL;
	char quoted[160];
	int r = reg_on(c, name, n, ZC_F32, ZC_F32, &t);

	cr_assert_eq(r, code, "'%s' (%llu elements): %d (%s), want %d (%s)", name,
	    (unsigned long long)n, r, r < 0 ? strerror(-r) : "accepted", code, strerror(-code));
	cr_assert_not_null(strstr(zc_errmsg(c), limit), "'%s' does not name %s", zc_errmsg(c),
	    limit);
	snprintf(quoted, sizeof(quoted), "'%s'", name);
	cr_assert_not_null(strstr(zc_errmsg(c), quoted), "'%s' does not name the tensor",
	    zc_errmsg(c));
}

static void
expect_refused(const char *name, uint64_t n, int code, const char *limit)
{
	expect_refused_on(conn, name, n, code, limit);
}

static void
expect_fits(const char *name, uint64_t n)
{
	struct zc_tensor *t = NULL;

	cr_assert_eq(reg(name, n, ZC_F32, ZC_F32, &t), 0, "'%s' (%llu elements, exactly the "
	    "budget) refused: %s", name, (unsigned long long)n, zc_errmsg(conn));
}

/* memory.pinned_budget: the pinned tier counts whole pages of the tensor's allocation. */
static void
pinned_budget(uint64_t short_by)
{
	uint64_t budget = round_up(pinned_charge(N0), PAGE) - short_by;
	char memory[128];

	snprintf(memory, sizeof(memory), "\"pinned_budget\": %llu", (unsigned long long)budget);
	start(memory, "", ZC_POLICY_CPU, 0);
	if (short_by > 0) {
		expect_refused("exact", N0, -ENOSPC, "pinned budget");
		return;
	}
	expect_refused("one-page-more", N0 + 1, -ENOSPC, "pinned budget");
	expect_fits("exact", N0);
	cr_assert_eq(itd_stat(conn, "tiers.pinned.used_bytes"), budget);
	cr_assert_eq(itd_stat(conn, "tiers.pinned.budget_bytes"), budget);
	expect_refused("one-more", 1, -ENOSPC, "pinned budget");
}

Test(limits, pinned_budget) { pinned_budget(0); }
Test(limits, pinned_budget_one_byte_short) { pinned_budget(1); }

/* memory.job_pinned_budget (the daemon's default for every job), with policy cpu. */
static void
job_pinned_budget(uint64_t short_by)
{
	uint64_t budget = pinned_charge(N0) - short_by;
	char memory[128];

	snprintf(memory, sizeof(memory), "\"job_pinned_budget\": %llu", (unsigned long long)budget);
	start(memory, "", ZC_POLICY_CPU, 0);
	if (short_by > 0) {
		expect_refused("exact", N0, -EDQUOT, "pinned budget of job");
		return;
	}
	expect_refused("one-page-more", N0 + 1, -EDQUOT, "pinned budget of job");
	expect_fits("exact", N0);
	cr_assert_eq(itd_stat(conn, "jobs.0.pinned_bytes"), budget);
	expect_refused("one-more", 1, -EDQUOT, "pinned budget of job");
}

Test(limits, job_pinned_budget) { job_pinned_budget(0); }
Test(limits, job_pinned_budget_one_byte_short) { job_pinned_budget(1); }

/* zc_job_options.pinned_budget overrides memory.job_pinned_budget for its job. */
Test(limits, job_option_pinned_budget)
{
	uint64_t budget = pinned_charge(2 * N0);
	struct zc_job_options short_opts = { .policy = ZC_POLICY_CPU, .pinned_budget = budget - 1 };
	struct zc_conn *c2;

	start("\"job_pinned_budget\": \"1M\"", "", ZC_POLICY_CPU, budget);
	/* Another job, one byte short. */
	c2 = itd_connect(&daemon_);
	cr_assert_eq(zc_job_open_opts(c2, "short", 0, 1, &short_opts), 0, "%s", zc_errmsg(c2));
	expect_refused_on(c2, "exact", 2 * N0, -EDQUOT, "pinned budget of job");
	zc_disconnect(c2);
	expect_refused("one-page-more", 2 * N0 + 1, -EDQUOT, "pinned budget of job");
	expect_fits("exact", 2 * N0);
	cr_assert_eq(itd_stat(conn, "jobs.0.pinned_bytes"), budget);
	expect_refused("one-more", 1, -EDQUOT, "pinned budget of job");
}

/* limits.uid_pinned_budget; with no swap the job cannot spill, so the uid's budget refuses. */
static void
uid_pinned_budget(uint64_t short_by)
{
	uint64_t budget = pinned_charge(N0) - short_by;
	char limits[128];

	snprintf(limits, sizeof(limits), "\"uid_pinned_budget\": %llu", (unsigned long long)budget);
	start("", limits, ZC_POLICY_DEFAULT, 0);
	if (short_by > 0) {
		expect_refused("exact", N0, -EDQUOT, "limits.uid_pinned_budget");
		return;
	}
	expect_refused("one-page-more", N0 + 1, -EDQUOT, "limits.uid_pinned_budget");
	expect_fits("exact", N0);
	cr_assert_eq(itd_stat(conn, "uids.0.pinned_bytes"), budget);
	expect_refused("one-more", 1, -EDQUOT, "limits.uid_pinned_budget");
}

Test(limits, uid_pinned_budget) { uid_pinned_budget(0); }
Test(limits, uid_pinned_budget_one_byte_short) { uid_pinned_budget(1); }

/* limits.uid_swap_budget, for a job that keeps its state on NVMe. */
static void
uid_swap_budget(uint64_t short_by)
{
	uint64_t budget = 8 * N0 - short_by;
	char limits[128];

	snprintf(limits, sizeof(limits), "\"uid_swap_budget\": %llu", (unsigned long long)budget);
	start_with_swap("64M", limits, ZC_POLICY_NVME);
	if (short_by > 0) {
		expect_refused("exact", N0, -EDQUOT, "limits.uid_swap_budget");
		return;
	}
	expect_refused("one-page-more", N0 + 1, -EDQUOT, "limits.uid_swap_budget");
	cr_assert_eq(itd_stat(conn, "tiers.nvme.paths.0.used_bytes"), 0,
	    "the refused tensor kept its swap space");
	expect_fits("exact", N0);
	cr_assert_eq(itd_stat(conn, "uids.0.swap_bytes"), budget);
	expect_refused("one-more", 1, -EDQUOT, "limits.uid_swap_budget");
}

Test(limits, uid_swap_budget) { uid_swap_budget(0); }
Test(limits, uid_swap_budget_one_byte_short) { uid_swap_budget(1); }

/* A swap path's capacity: 3 MiB hold exactly 384 Ki elements of state. */
static void
swap_capacity(uint64_t short_by)
{
	const uint64_t n = 3ull * 1024 * 1024 / 8;
	char capacity[32];

	snprintf(capacity, sizeof(capacity), "%llu", 3ull * 1024 * 1024 - short_by);
	start_with_swap(capacity, "", ZC_POLICY_NVME);
	if (short_by > 0) {
		expect_refused("exact", n, -ENOSPC, "swap.paths");
		return;
	}
	expect_refused("one-page-more", n + 1, -ENOSPC, swapdir);
	expect_fits("exact", n);
	cr_assert_eq(itd_stat(conn, "tiers.nvme.paths.0.used_bytes"), 8 * n);
	expect_refused("one-more", 1, -ENOSPC, "swap.paths");
}

Test(limits, swap_capacity) { swap_capacity(0); }
Test(limits, swap_capacity_one_byte_short) { swap_capacity(1); }

/*
 * memory.shm_budget counts both slots of every tensor and each connection's
 * transfer window (memory.xfer_window, opened by the first register).  A
 * first small tensor opens the window; the rest of the budget then holds
 * exactly one tensor of f32 grads and params.
 */
static void
shm_budget(uint64_t short_by)
{
	const uint64_t window = 64 << 10, small = 1024, n = 128 * 1024;
	const uint64_t budget = window + 8 * small + 8 * n - short_by;
	char memory[128];
	struct zc_tensor *t;

	snprintf(memory, sizeof(memory), "\"shm_budget\": %llu, \"xfer_window\": \"64K\"",
	    (unsigned long long)budget);
	start(memory, "", ZC_POLICY_CPU, 0);
	cr_assert_eq(reg("small", small, ZC_F32, ZC_F32, &t), 0, "%s", zc_errmsg(conn));
	cr_assert_eq(itd_stat(conn, "tiers.shm.used_bytes"), window + 8 * small);
	if (short_by > 0) {
		expect_refused("exact", n, -ENOSPC, "shared-memory budget");
		return;
	}
	expect_refused("one-page-more", n + 1, -ENOSPC, "shared-memory budget");
	expect_fits("exact", n);
	cr_assert_eq(itd_stat(conn, "tiers.shm.used_bytes"), budget);
	expect_refused("one-more", 1, -ENOSPC, "shared-memory budget");
}

Test(limits, shm_budget) { shm_budget(0); }
Test(limits, shm_budget_one_byte_short) { shm_budget(1); }

/* One raw request and its reply (descriptors closed by itd_raw_recv). */
static void
raw_rpc(int fd, uint16_t type, uint64_t id, struct zp_msg *m, uint16_t want)
{
	itd_raw_send(fd, type, id, m);
	cr_assert(itd_raw_recv(fd, m, 5), "closed after %s", zp_type_name(type));
	cr_assert_eq(m->hdr.type, want, "%s answered with %s (%s)", zp_type_name(type),
	    zp_type_name(m->hdr.type), m->hdr.type == ZP_ERROR ? m->u.error.message : "");
	cr_assert_eq(m->hdr.request_id, id);
}

/*
 * memory.xfer_window: one TENSOR_READ moves at most the window (libzclient
 * splits larger reads, so this speaks the protocol itself): exactly the
 * window's worth of fp32 elements goes, one element more is refused with
 * -EMSGSIZE naming the window.
 */
Test(limits, xfer_window)
{
	static struct zp_msg m;
	const uint64_t window = 64 << 10, n = window / 4;
	int fd;

	itd_start(&daemon_, "{ \"compute\": { \"worker_threads\": 2 }, "
	    "\"memory\": { \"xfer_window\": \"64K\" } }\n");
	fd = itd_raw_connect(&daemon_);
	itd_raw_hello(fd);
	memset(&m, 0, sizeof(m));
	strcpy(m.u.job_open.job_name, "window");
	m.u.job_open.world_size = 1;
	raw_rpc(fd, ZP_JOB_OPEN, 2, &m, ZP_JOB_OK);
	memset(&m, 0, sizeof(m));
	strcpy(m.u.tensor_register.name, "w");
	m.u.tensor_register.numel = n + 1;
	raw_rpc(fd, ZP_TENSOR_REGISTER, 3, &m, ZP_TENSOR_OK);
	memset(&m, 0, sizeof(m));
	raw_rpc(fd, ZP_XFER_OPEN, 4, &m, ZP_XFER_OK);
	cr_assert_eq(m.u.xfer_ok.bytes, window);

	m = (struct zp_msg){ .u.tensor_io = { .handle = 1, .state = ZP_STATE_MASTER, .count = n } };
	raw_rpc(fd, ZP_TENSOR_READ, 5, &m, ZP_OK);
	m = (struct zp_msg){ .u.tensor_io = { .handle = 1, .state = ZP_STATE_MASTER,
		.count = n + 1 } };
	raw_rpc(fd, ZP_TENSOR_READ, 6, &m, ZP_ERROR);
	cr_assert_eq(m.u.error.code, -EMSGSIZE, "code %d: %s", m.u.error.code, m.u.error.message);
	cr_assert_not_null(strstr(m.u.error.message, "transfer window"), "'%s'",
	    m.u.error.message);
	close(fd);
}

/* Names: ZP_NAME_MAX (127) bytes go, 128 are refused before anything is sent. */
Test(limits, tensor_name_length)
{
	char name[ZP_NAME_MAX + 2];
	struct zc_tensor *t;

	start("", "", ZC_POLICY_CPU, 0);
	memset(name, 'n', sizeof(name));
	name[ZP_NAME_MAX] = '\0';
	cr_assert_eq(reg(name, 1, ZC_F32, ZC_F32, &t), 0, "%s", zc_errmsg(conn));
	name[ZP_NAME_MAX] = 'n';
	name[ZP_NAME_MAX + 1] = '\0';
	cr_assert_eq(reg(name, 1, ZC_F32, ZC_F32, &t), -EINVAL);
	cr_assert_not_null(strstr(zc_errmsg(conn), "1 to 127 bytes"), "%s", zc_errmsg(conn));
}
