/*
 * Checkpoint buffers are charged to the uid that asks (limits.uid_ckpt_buffer_budget).
 * An fp32 save of a q8-moments tensor on NVMe decodes a whole chunk at a time into a
 * buffer of its own: many such saves at once from one uid took one buffer each, charged
 * to nobody, and the daemon's memory grew with their number.  Now a save (or restore)
 * without room waits its turn, and one that alone needs more than the budget is refused
 * by name.
 *
 * The saves are held with the checkpoint I/O threads' gate (ZOFFLOADD_TEST_CKPT_GATE):
 * each, its first piece read from the tiers into its buffer, waits there to be written,
 * so that every buffer taken is taken at once when the daemon's memory is read.
 */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ck.h"
#include "msgio.h"

#define CHUNK (1u << 20)	/* elements of an NVMe chunk, and of each tensor: one piece */
#define SAVES 16
#define BUDGET (48ull << 20)
/*
 * A piece's buffer: three fp32 arrays of a chunk and room for q8's scales
 * (checkpoint_piece.c); three fit in BUDGET, four do not.
 */
#define BUF_BYTES (3ull * CHUNK * 4 + 2 * 4 * (CHUNK / 256))
/*
 * What the daemon's memory may grow by besides the buffers the budget allows: the
 * engine's and the allocator's own (a few MiB, measured), with room to spare.  The
 * buffers of SAVES saves at once are 192 MiB, far past BUDGET + SLACK.
 */
#define SLACK (24ull << 20)
/* The buffers a daemon keeps for the next transfers, charged to nobody (SPARE_BUFS). */
#define SPARE 4

static struct itd d;
static struct ck_gated g = { .fd = -1 };
static char swapdir[64];

static void
teardown(void)
{
	bool started = g.gate[0] != '\0';

	if (started && g.fd < 0)
		g.fd = open(g.gate, O_RDWR);
	itd_cleanup(&d);
	if (g.fd >= 0)
		close(g.fd);
	g.fd = -1;
	ck_rmdir(swapdir);
	if (started)
		ck_rmdir(g.gatedir);
	unsetenv("ZOFFLOADD_TEST_CKPT_GATE");
}

TestSuite(budget, .fini = teardown, .timeout = 300);

/* The daemon's config: 1 Mi-element chunks and the budget given (NULL: the default). */
static void
config_with(const char *budget, char *config, size_t len)
{
	char limits[128] = "";

	if (budget != NULL)
		snprintf(limits, sizeof(limits), ", \"limits\": { \"uid_ckpt_buffer_budget\": "
		    "\"%s\" }", budget);
	snprintf(config, len, "{ \"compute\": { \"worker_threads\": 2 }, \"log\": "
	    "{ \"level\": \"info\" }, \"swap\": { \"paths\": [ { \"path\": \"%s\", "
	    "\"capacity\": \"512M\" } ], \"chunk_elements\": %u, \"staging_buffers\": 2 }%s }\n",
	    swapdir, CHUNK, limits);
}

/* A daemon with config_with's config, gated. */
static void
start(const char *budget)
{
	char config[1024];

	ck_tmpdir(swapdir, sizeof(swapdir), "swap");
	ck_tmpdir(g.gatedir, sizeof(g.gatedir), "gate");
	snprintf(g.gate, sizeof(g.gate), "%s/gate", g.gatedir);
	cr_assert_eq(mkfifo(g.gate, 0600), 0, "mkfifo %s: %s", g.gate, strerror(errno));
	config_with(budget, config, sizeof(config));
	cr_assert_eq(setenv("ZOFFLOADD_TEST_CKPT_GATE", g.gate, 1), 0);
	itd_start(&d, config);
	cr_assert_eq(unsetenv("ZOFFLOADD_TEST_CKPT_GATE"), 0);
}

static void
recv_type(int sock, uint16_t type, struct zp_msg *m)
{
	cr_assert(itd_raw_recv(sock, m, 60), "no answer\n%s", itd_log_text(&d));
	cr_assert_eq(m->hdr.type, type, "answered %s (%s), not %s", zp_type_name(m->hdr.type),
	    m->hdr.type == ZP_ERROR ? m->u.error.message : "", zp_type_name(type));
}

/* A raw connection with a q8-moments NVMe job and n tensors of CHUNK elements (handles 1..n). */
static int
job_with(unsigned n)
{
	static struct zp_msg m;
	int sock = itd_raw_connect(&d);

	itd_raw_hello(sock);
	memset(&m, 0, sizeof(m));
	strcpy(m.u.job_open.job_name, "budget");
	m.u.job_open.world_size = 1;
	m.u.job_open.policy = ZP_POLICY_NVME;
	strcpy(m.u.job_open.state_format, "q8-moments");
	itd_raw_send(sock, ZP_JOB_OPEN, 1, &m);
	recv_type(sock, ZP_JOB_OK, &m);
	for (unsigned i = 0; i < n; i++) {
		memset(&m, 0, sizeof(m));
		snprintf(m.u.tensor_register.name, sizeof(m.u.tensor_register.name), "t%u", i);
		m.u.tensor_register.numel = CHUNK;
		m.u.tensor_register.grad_dtype = ZP_DTYPE_F32;
		m.u.tensor_register.param_dtype = ZP_DTYPE_F32;
		itd_raw_send(sock, ZP_TENSOR_REGISTER, 100 + i, &m);
		recv_type(sock, ZP_TENSOR_OK, &m);
		cr_assert_eq(m.u.tensor_ok.handle, i + 1);
	}
	return sock;
}

/* An fp32 save (or restore) of tensor `handle` into (from) file, its arrays at slot's place. */
static void
send_xfer(int sock, bool restore, uint32_t handle, unsigned slot, uint64_t id, int file)
{
	static struct zp_msg m;

	memset(&m, 0, sizeof(m));
	m.hdr.type = restore ? ZP_CKPT_READ : ZP_CKPT_WRITE;
	m.hdr.request_id = id;
	m.u.ckpt_write.handle = handle;
	m.u.ckpt_write.count = CHUNK;
	m.u.ckpt_write.format = 0;	/* fp32 */
	for (unsigned i = 0; i < 3; i++)
		m.u.ckpt_write.file_offset[i] = ((uint64_t)slot * 3 + i) * CHUNK * sizeof(float);
	cr_assert_eq(zp_send(sock, &m, &file, 1), 0);
}

static void
send_save(int sock, uint32_t handle, unsigned slot, uint64_t id, int file)
{
	send_xfer(sock, false, handle, slot, id, file);
}

/* The daemon's VmRSS or VmHWM, bytes. */
static uint64_t
daemon_mem(const char *field)
{
	char path[64], line[256];
	unsigned long long kb = 0;
	bool found = false;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)d.pid);
	f = fopen(path, "r");
	cr_assert(f != NULL, "%s: %s", path, strerror(errno));
	while (fgets(line, sizeof(line), f) != NULL)
		if (strncmp(line, field, strlen(field)) == 0 && line[strlen(field)] == ':')
			found = sscanf(line + strlen(field) + 1, "%llu", &kb) == 1;
	fclose(f);
	cr_assert(found, "no %s in %s", field, path);
	return (uint64_t)kb << 10;
}

/* A number in the daemon's stats (NULL path parts: 0 when absent, as before it existed). */
static double
stat_or_zero(struct zc_conn *c, const char *section, const char *key)
{
	char *text = NULL;
	cJSON *root, *o, *v;
	double r = 0;

	cr_assert_eq(zc_stats_json(c, &text), 0, "%s", zc_errmsg(c));
	root = cJSON_Parse(text);
	cr_assert(root != NULL);
	o = cJSON_GetObjectItemCaseSensitive(root, section);
	v = o != NULL ? cJSON_GetObjectItemCaseSensitive(o, key) : NULL;
	if (cJSON_IsNumber(v))
		r = v->valuedouble;
	cJSON_Delete(root);
	free(text);
	return r;
}

static int
scratch_file(void)
{
	char path[] = "/tmp/zoff-budget-XXXXXX";
	int file = mkstemp(path);

	cr_assert_geq(file, 0, "%s", strerror(errno));
	cr_assert_eq(unlink(path), 0);
	return file;
}

/* The answers to SAVES restores asked for as request ids 100 on: each read what its save wrote. */
static void
restores_read_back(int sock, uint32_t crc[SAVES][ZP_CKPT_ARRAYS])
{
	static struct zp_msg m;

	for (unsigned done = 0; done < SAVES; done++) {
		recv_type(sock, ZP_CKPT_DONE, &m);
		cr_assert(m.hdr.request_id >= 100 && m.hdr.request_id < 100 + SAVES);
		cr_assert_arr_eq(m.u.ckpt_done.crc, crc[m.hdr.request_id - 100], sizeof(crc[0]),
		    "restore %llu read other bytes than its save wrote",
		    (unsigned long long)m.hdr.request_id);
	}
}

Test(budget, many_saves_of_one_uid_stay_within_its_budget)
{
	static struct zp_msg m;
	static uint32_t crc[SAVES][ZP_CKPT_ARRAYS];
	struct zc_conn *c;
	uint64_t rss0, rss1, hwm, read0, read1, per_save, want;
	unsigned started, done = 0;
	double bufs, waiting;
	int sock, file;
	char b[32];

	snprintf(b, sizeof(b), "%lluM", BUDGET >> 20);
	start(b);
	sock = job_with(SAVES + 1);
	file = scratch_file();
	c = itd_connect(&d);

	/* One save let through: what a save reads from the tiers (the last tensor's chunk). */
	read0 = (uint64_t)itd_stat(c, "tiers.nvme.paths.0.read_bytes");
	g.fd = open(g.gate, O_RDWR);
	cr_assert_geq(g.fd, 0);
	send_save(sock, SAVES + 1, SAVES, 1, file);
	recv_type(sock, ZP_CKPT_DONE, &m);
	close(g.fd);
	g.fd = -1;
	per_save = (uint64_t)itd_stat(c, "tiers.nvme.paths.0.read_bytes") - read0;
	cr_assert_gt(per_save, 0);

	/* Every save asked for at once; the PING's answer says each was taken in. */
	rss0 = daemon_mem("VmRSS");
	read1 = (uint64_t)itd_stat(c, "tiers.nvme.paths.0.read_bytes");
	for (unsigned i = 0; i < SAVES; i++)
		send_save(sock, i + 1, i, 10 + i, file);
	itd_raw_send(sock, ZP_PING, 2, NULL);
	recv_type(sock, ZP_PONG, &m);
	/* Those begun have their piece read into their buffers: then they wait at the gate. */
	waiting = stat_or_zero(c, "checkpoint", "transfers_waiting");
	started = SAVES - (unsigned)waiting;
	want = read1 + started * per_save;
	for (int i = 0; i < 6000 && (uint64_t)itd_stat(c, "tiers.nvme.paths.0.read_bytes") < want;
	    i++)
		usleep(10000);
	cr_assert_geq((uint64_t)itd_stat(c, "tiers.nvme.paths.0.read_bytes"), want,
	    "the %u saves begun never read their pieces\n%s", started, itd_log_text(&d));
	rss1 = daemon_mem("VmRSS");
	cr_log_info("%u saves held, %u begun: VmRSS +%.1f MiB (budget %llu MiB)", SAVES, started,
	    (double)(rss1 - rss0) / (1 << 20), (unsigned long long)BUDGET >> 20);
	cr_assert_leq(rss1 - rss0, BUDGET + SLACK, "%u saves at once took the daemon's memory from "
	    "%llu to %llu MiB (%u begun), past the budget of %llu MiB", SAVES,
	    (unsigned long long)rss0 >> 20, (unsigned long long)rss1 >> 20, started,
	    (unsigned long long)BUDGET >> 20);
	bufs = stat_or_zero(c, "checkpoint", "buffer_bytes");
	cr_assert_eq((uint64_t)bufs, started * BUF_BYTES, "%u begun hold %.0f bytes", started, bufs);
	cr_assert_leq((uint64_t)bufs, BUDGET);
	cr_assert_eq(started, BUDGET / BUF_BYTES, "%u begun", started);
	cr_assert_eq(itd_stat(c, "limits.uid_ckpt_buffer_budget"), (double)BUDGET);

	/* Let through, every save is answered: the waiting ones in turn. */
	g.fd = open(g.gate, O_RDWR);
	cr_assert_geq(g.fd, 0);
	while (done < SAVES) {
		recv_type(sock, ZP_CKPT_DONE, &m);
		cr_assert(m.hdr.request_id >= 10 && m.hdr.request_id < 10 + SAVES);
		memcpy(crc[m.hdr.request_id - 10], m.u.ckpt_done.crc, sizeof(crc[0]));
		done++;
	}
	hwm = daemon_mem("VmHWM");
	cr_log_info("all %u answered: VmHWM %.1f MiB over the VmRSS before them", SAVES,
	    (double)(hwm - rss0) / (1 << 20));
	/* The kept spare buffers come on top, once saves end while others begin. */
	cr_assert_leq(hwm - rss0, BUDGET + SPARE * BUF_BYTES + SLACK, "the daemon peaked at %llu "
	    "MiB, from %llu", (unsigned long long)hwm >> 20, (unsigned long long)rss0 >> 20);
	cr_assert_eq(stat_or_zero(c, "checkpoint", "buffer_bytes"), 0);
	cr_assert_eq(stat_or_zero(c, "checkpoint", "transfers_waiting"), 0);
	cr_assert_eq(itd_stat(c, "checkpoint.transfers_in_flight"), 0);

	/* Restores take the same buffers and turns: each reads back what its save wrote. */
	close(g.fd);
	g.fd = -1;
	for (unsigned i = 0; i < SAVES; i++)
		send_xfer(sock, true, i + 1, i, 100 + i, file);
	itd_raw_send(sock, ZP_PING, 3, NULL);
	recv_type(sock, ZP_PONG, &m);
	cr_assert_eq(stat_or_zero(c, "checkpoint", "transfers_waiting"), SAVES - started);
	g.fd = open(g.gate, O_RDWR);
	cr_assert_geq(g.fd, 0);
	restores_read_back(sock, crc);
	cr_assert_eq(stat_or_zero(c, "checkpoint", "buffer_bytes"), 0);
	zc_disconnect(c);
	close(file);
	close(sock);
	cr_assert_eq(itd_stop(&d, 30), 0, "%s", itd_log_text(&d));
}

/* A save that alone needs more than the budget is refused, naming the limit; the rest goes on. */
Test(budget, a_save_past_the_budget_is_refused_by_name)
{
	static struct zp_msg m;
	int sock, file;

	start("8M");
	g.fd = open(g.gate, O_RDWR);
	cr_assert_geq(g.fd, 0);
	sock = job_with(1);
	file = scratch_file();
	send_save(sock, 1, 0, 5, file);
	recv_type(sock, ZP_ERROR, &m);
	cr_assert_eq(m.u.error.code, -EDQUOT);
	cr_assert(strstr(m.u.error.message, "tensor 't0': a checkpoint transfer of it needs") !=
	    NULL && strstr(m.u.error.message, "limits.uid_ckpt_buffer_budget (8.0 MiB)") != NULL,
	    "%s", m.u.error.message);
	itd_raw_send(sock, ZP_PING, 6, NULL);
	recv_type(sock, ZP_PONG, &m);
	close(file);
	close(sock);
	cr_assert_eq(itd_stop(&d, 30), 0, "%s", itd_log_text(&d));
}

/*
 * Saves waiting their turn when their client goes away end as their turn comes: nothing
 * of them is left (transfers, buffers, the descriptors they were sent; its tensors stay
 * kept for a new process of the rank, their descriptors too).
 */
Test(budget, waiting_saves_of_a_client_gone_end)
{
	static struct zp_msg m;
	struct zc_conn *c;
	double fds0;
	int sock, file, i;
	char b[32];

	snprintf(b, sizeof(b), "%lluM", BUDGET >> 20);
	start(b);
	c = itd_connect(&d);
	sock = job_with(SAVES);
	/* Less the connection that goes: what its kept tensors hold. */
	fds0 = itd_stat(c, "limits.client_fds") - 1;
	file = scratch_file();
	for (unsigned k = 0; k < SAVES; k++)
		send_save(sock, k + 1, k, 10 + k, file);
	itd_raw_send(sock, ZP_PING, 2, NULL);
	recv_type(sock, ZP_PONG, &m);
	cr_assert_eq(stat_or_zero(c, "checkpoint", "transfers_waiting"), SAVES - BUDGET / BUF_BYTES);
	close(sock);
	close(file);
	g.fd = open(g.gate, O_RDWR);
	cr_assert_geq(g.fd, 0);
	for (i = 0; i < 3000 && (itd_stat(c, "checkpoint.transfers_in_flight") > 0 ||
	    itd_stat(c, "limits.client_fds") > fds0); i++)
		usleep(10000);
	cr_assert_eq(itd_stat(c, "checkpoint.transfers_in_flight"), 0, "%s", itd_log_text(&d));
	cr_assert_eq(stat_or_zero(c, "checkpoint", "buffer_bytes"), 0);
	cr_assert_eq(stat_or_zero(c, "checkpoint", "transfers_waiting"), 0);
	cr_assert_eq(itd_stat(c, "limits.client_fds"), fds0, "descriptors left behind");
	zc_disconnect(c);
	cr_assert_eq(itd_stop(&d, 30), 0, "%s", itd_log_text(&d));
}

/* SIGHUP with budget in the config; returns once the stats show it (the loop reloads). */
static void
reload_budget(struct zc_conn *c, const char *budget, uint64_t bytes)
{
	char config[1024];
	FILE *f;
	int i;

	config_with(budget, config, sizeof(config));
	f = fopen(d.config, "w");
	cr_assert_not_null(f);
	fputs(config, f);
	cr_assert_eq(fclose(f), 0);
	cr_assert_eq(kill(d.pid, SIGHUP), 0);
	for (i = 0; i < 500 && itd_stat(c, "limits.uid_ckpt_buffer_budget") != (double)bytes; i++)
		usleep(10000);
	cr_assert_eq(itd_stat(c, "limits.uid_ckpt_buffer_budget"), (double)bytes, "%s",
	    itd_log_text(&d));
}

/*
 * The budget changed by SIGHUP while saves wait their turn.  Raised, the waiting ones
 * begin at once, not when a running one ends (here they never would: the gate holds them).
 * Lowered under what one save needs, a new save is refused by name, and the saves already
 * taken in all end, reading back as written.
 */
Test(budget, a_reloaded_budget_applies_to_the_saves_waiting)
{
	static struct zp_msg m;
	static uint32_t crc[SAVES][ZP_CKPT_ARRAYS];
	struct zc_conn *c;
	unsigned done;
	int sock, file, i;
	char b[32];

	snprintf(b, sizeof(b), "%lluM", BUDGET >> 20);
	start(b);
	c = itd_connect(&d);
	sock = job_with(SAVES + 1);
	file = scratch_file();
	for (unsigned k = 0; k < SAVES; k++)
		send_save(sock, k + 1, k, 10 + k, file);
	itd_raw_send(sock, ZP_PING, 2, NULL);
	recv_type(sock, ZP_PONG, &m);
	cr_assert_eq(stat_or_zero(c, "checkpoint", "transfers_waiting"), SAVES - BUDGET / BUF_BYTES);

	/* Room for them all now: the gate still holds the first three. */
	reload_budget(c, "1G", 1ull << 30);
	for (i = 0; i < 500 && stat_or_zero(c, "checkpoint", "transfers_waiting") > 0; i++)
		usleep(10000);
	cr_assert_eq(stat_or_zero(c, "checkpoint", "transfers_waiting"), 0, "the budget was "
	    "raised, and saves still wait for one that ends\n%s", itd_log_text(&d));
	cr_assert_eq(stat_or_zero(c, "checkpoint", "buffer_bytes"), SAVES * BUF_BYTES);

	/* Lowered under one save's buffers: a new one is refused, the rest go on. */
	reload_budget(c, "8M", 8ull << 20);
	send_save(sock, SAVES + 1, SAVES, 5, file);
	recv_type(sock, ZP_ERROR, &m);
	cr_assert_eq(m.u.error.code, -EDQUOT);
	cr_assert(strstr(m.u.error.message, "limits.uid_ckpt_buffer_budget (8.0 MiB)") != NULL,
	    "%s", m.u.error.message);
	g.fd = open(g.gate, O_RDWR);
	cr_assert_geq(g.fd, 0);
	for (done = 0; done < SAVES; done++) {
		recv_type(sock, ZP_CKPT_DONE, &m);
		cr_assert(m.hdr.request_id >= 10 && m.hdr.request_id < 10 + SAVES);
		memcpy(crc[m.hdr.request_id - 10], m.u.ckpt_done.crc, sizeof(crc[0]));
	}
	cr_assert_eq(stat_or_zero(c, "checkpoint", "buffer_bytes"), 0);

	/* A restore asked for under the lowered budget is refused as a save is. */
	send_xfer(sock, true, 1, 0, 100, file);
	recv_type(sock, ZP_ERROR, &m);
	cr_assert_eq(m.u.error.code, -EDQUOT, "%s", m.u.error.message);

	/* Raised again, each reads back what its save wrote. */
	reload_budget(c, b, BUDGET);
	for (unsigned k = 0; k < SAVES; k++)
		send_xfer(sock, true, k + 1, k, 100 + k, file);
	restores_read_back(sock, crc);
	cr_assert_eq(stat_or_zero(c, "checkpoint", "buffer_bytes"), 0);
	cr_assert_eq(stat_or_zero(c, "checkpoint", "transfers_waiting"), 0);
	zc_disconnect(c);
	close(file);
	close(sock);
	cr_assert_eq(itd_stop(&d, 30), 0, "%s", itd_log_text(&d));
}
