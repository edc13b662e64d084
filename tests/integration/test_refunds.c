/*
 * Every way a tensor registration is refused leaves what the uid and the job hold exactly as
 * it was: the uid's tensors, descriptors, shared memory, pinned and swap bytes, the job's
 * tensors, params and state, the tiers' use, as `zoffctl stats --json` shows them.  A
 * charge taken before the refusal and not given back would stay for ever (daemon/job.c
 * zd_tensor_create charges the uid before the engine may refuse the tensor).  A count of 0
 * elements or one past the protocol's range never gets that far: the codec refuses the
 * message (tests/proto), and the connection with it.
 */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "itd.h"

/* The uid limits spare root: those cases register as this one. */
#define NOBODY 65534u
#define N 16384ull		/* the tensor already there: whole pages everywhere */

static struct itd daemon_;
static char swapdir[64];

static void
teardown(void)
{
	/* Back to root for the cleanup; a test that failed may have left us as another uid. */
	if (seteuid(0) != 0)
		perror("seteuid(0)");
	itd_cleanup(&daemon_);
	if (swapdir[0] != '\0')
		rmdir(swapdir);
	swapdir[0] = '\0';
}

TestSuite(refunds, .fini = teardown, .timeout = 60);

struct refusal {
	const char *memory;		/* the configuration's "memory" and "limits" members */
	const char *limits;
	const char *swap_capacity;	/* a swap directory of this capacity (NULL: none) */
	uint8_t policy;
	uint64_t job_budget;
	bool nobody;			/* registers as NOBODY, not as root */
	bool no_job;			/* registers with no job open */
	bool reattach;			/* registers as the rank again, after its death */
	const char *name;		/* of the refused tensor ("kept": the one there) */
	uint64_t numel;
	int code;
	const char *text;		/* in the refusal */
};

static void
start(const struct refusal *c)
{
	char config[1024], swap[256] = "";

	if (c->swap_capacity != NULL) {
		snprintf(swapdir, sizeof(swapdir), "/tmp/zoff-refunds-XXXXXX");
		cr_assert_not_null(mkdtemp(swapdir));
		snprintf(swap, sizeof(swap), ", \"swap\": { \"paths\": [ { \"path\": \"%s\", "
		    "\"capacity\": \"%s\" } ], \"chunk_elements\": 65536, \"staging_buffers\": 2 }",
		    swapdir, c->swap_capacity);
	}
	snprintf(config, sizeof(config), "{ \"compute\": { \"worker_threads\": 2 }, "
	    "\"socket\": { \"mode\": \"0666\" }, \"memory\": { %s }, \"limits\": { %s }%s }\n",
	    c->memory != NULL ? c->memory : "", c->limits != NULL ? c->limits : "", swap);
	itd_start(&daemon_, config);
	/* NOBODY reaches the socket through the test's directory. */
	cr_assert_eq(chmod(daemon_.dir, 0711), 0);
}

/*
 * What the uids, the jobs and the tiers hold, from `zoffctl stats --json` run as root (it
 * sees every uid), as one line of JSON to compare.
 */
static char *
holdings(void)
{
	static const char *const tiers[] = { "pinned", "shm", "nvme" };
	static char out[1 << 20];
	char cmd[512];
	cJSON *root, *keep, *t;
	size_t n;
	FILE *p;
	char *s;

	cr_assert_eq(seteuid(0), 0);
	snprintf(cmd, sizeof(cmd), "'%s' --socket '%s' stats --json", getenv("ZOFFCTL"),
	    daemon_.socket);
	p = popen(cmd, "r");
	cr_assert_not_null(p);
	n = fread(out, 1, sizeof(out) - 1, p);
	out[n] = '\0';
	cr_assert_eq(pclose(p), 0, "zoffctl stats --json failed: %s", out);
	root = cJSON_Parse(out);
	cr_assert_not_null(root, "not JSON: %s", out);
	keep = cJSON_CreateObject();
	cr_assert_not_null(cJSON_GetObjectItem(root, "uids"), "%s", out);
	cr_assert_not_null(cJSON_GetObjectItem(root, "jobs"), "%s", out);
	cJSON_AddItemToObject(keep, "uids", cJSON_DetachItemFromObject(root, "uids"));
	cJSON_AddItemToObject(keep, "jobs", cJSON_DetachItemFromObject(root, "jobs"));
	t = cJSON_GetObjectItem(root, "tiers");
	cr_assert_not_null(t, "%s", out);
	for (size_t i = 0; i < sizeof(tiers) / sizeof(tiers[0]); i++) {
		cJSON *tier = cJSON_GetObjectItem(t, tiers[i]), *used;

		used = tier != NULL ? cJSON_GetObjectItem(tier, "used_bytes") : NULL;
		if (used != NULL)
			cJSON_AddNumberToObject(keep, tiers[i], used->valuedouble);
	}
	t = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "limits"), "client_fds");
	cr_assert_not_null(t, "no limits.client_fds in %s", out);
	cJSON_AddNumberToObject(keep, "client_fds", t->valuedouble);
	s = cJSON_PrintUnformatted(keep);
	cJSON_Delete(keep);
	cJSON_Delete(root);
	return s;
}

static void
as(const struct refusal *c)
{
	cr_assert_eq(seteuid(c->nobody ? NOBODY : 0), 0);
}

/* A TENSOR_REGISTER on the raw connection fd; its answer (descriptors closed). */
static void
reg(int fd, uint64_t id, const char *name, uint64_t numel, struct zp_msg *m)
{
	memset(m, 0, sizeof(*m));
	snprintf(m->u.tensor_register.name, sizeof(m->u.tensor_register.name), "%s", name);
	m->u.tensor_register.numel = numel;
	m->u.tensor_register.grad_dtype = ZP_DTYPE_F32;
	m->u.tensor_register.param_dtype = ZP_DTYPE_F32;
	itd_raw_send(fd, ZP_TENSOR_REGISTER, id, m);
	cr_assert(itd_raw_recv(fd, m, 10), "closed after TENSOR_REGISTER of '%s'", name);
}

/*
 * A job with one tensor of N elements; then c's registration, refused with c's code and
 * text; the holdings before and after are the same, and the refused tensor is not there.
 */
static void
job_open(int fd, const struct refusal *c)
{
	struct zp_msg m;

	memset(&m, 0, sizeof(m));
	strcpy(m.u.job_open.job_name, "refunds");
	m.u.job_open.world_size = 1;
	m.u.job_open.policy = c->policy;
	m.u.job_open.pinned_budget = c->job_budget;
	itd_raw_send(fd, ZP_JOB_OPEN, 2, &m);
	cr_assert(itd_raw_recv(fd, &m, 10));
	cr_assert_eq(m.hdr.type, ZP_JOB_OK, "JOB_OPEN: %s %s", zp_type_name(m.hdr.type),
	    m.hdr.type == ZP_ERROR ? m.u.error.message : "");
}

static void
refused(const struct refusal *c)
{
	struct zp_msg m;
	char *before, *after;
	int fd;

	start(c);
	as(c);
	fd = itd_raw_connect(&daemon_);
	itd_raw_hello(fd);
	if (!c->no_job) {
		job_open(fd, c);
		reg(fd, 3, "kept", N, &m);
		cr_assert_eq(m.hdr.type, ZP_TENSOR_OK, "'kept': %s %s", zp_type_name(m.hdr.type),
		    m.hdr.type == ZP_ERROR ? m.u.error.message : "");
	}
	if (c->reattach) {
		/* The rank dies; its tensor waits for it, detached; it comes back. */
		close(fd);
		for (int i = 0; i < 500; i++) {
			char *h = holdings();
			bool detached = strstr(h, "\"tensors_detached\":1") != NULL;

			free(h);
			if (detached)
				break;
			usleep(10000);
		}
		as(c);
		fd = itd_raw_connect(&daemon_);
		itd_raw_hello(fd);
		job_open(fd, c);
	}
	before = holdings();
	as(c);
	reg(fd, 4, c->name, c->numel, &m);
	cr_assert_eq(m.hdr.type, ZP_ERROR, "'%s' (%llu elements) was not refused", c->name,
	    (unsigned long long)c->numel);
	cr_assert_eq(m.u.error.code, c->code, "code %d (%s), expected %d", m.u.error.code,
	    m.u.error.message, c->code);
	cr_assert(strstr(m.u.error.message, c->text) != NULL, "'%s' not in: %s", c->text,
	    m.u.error.message);
	after = holdings();
	cr_assert_str_eq(after, before, "the refusal changed what is held:\nbefore %s\nafter  %s\n"
	    "(%s)", before, after, m.u.error.message);
	if (!c->no_job && !c->nobody) {
		cr_assert(strstr(before, "\"tensors\":1") != NULL, "%s", before);
		cr_assert(strstr(before, "\"fds\":0") == NULL, "the kept tensor holds no "
		    "descriptors: %s", before);
	}
	free(before);
	free(after);
	close(fd);
}

Test(refunds, no_job_open)
{
	refused(&(struct refusal){ .no_job = true, .name = "t", .numel = N, .code = -ENOTCONN,
	    .text = "open a job" });
}

Test(refunds, same_name_again)
{
	refused(&(struct refusal){ .name = "kept", .numel = N, .code = -EEXIST,
	    .text = "already registered" });
}

/* The rank's kept tensor asked for with another size: not taken back, nothing charged. */
Test(refunds, kept_tensor_of_another_size)
{
	refused(&(struct refusal){ .reattach = true, .name = "kept", .numel = N + 1024,
	    .code = -EINVAL, .text = "is kept with" });
}

Test(refunds, pinned_budget)
{
	refused(&(struct refusal){ .memory = "\"pinned_budget\": \"1M\"", .policy = ZP_POLICY_CPU,
	    .name = "big", .numel = 8 * N, .code = -ENOSPC, .text = "pinned budget" });
}

Test(refunds, job_pinned_budget)
{
	refused(&(struct refusal){ .policy = ZP_POLICY_CPU, .job_budget = 512 << 10,
	    .name = "big", .numel = 4 * N, .code = -EDQUOT, .text = "pinned budget of job" });
}

Test(refunds, uid_pinned_budget)
{
	refused(&(struct refusal){ .limits = "\"uid_pinned_budget\": \"512K\"", .name = "big",
	    .numel = 4 * N, .code = -EDQUOT, .text = "limits.uid_pinned_budget" });
}

Test(refunds, uid_swap_budget)
{
	refused(&(struct refusal){ .limits = "\"uid_swap_budget\": \"1M\"", .swap_capacity = "64M",
	    .policy = ZP_POLICY_NVME, .name = "big", .numel = 8 * N, .code = -EDQUOT,
	    .text = "limits.uid_swap_budget" });
}

Test(refunds, swap_capacity)
{
	refused(&(struct refusal){ .swap_capacity = "1M", .policy = ZP_POLICY_NVME,
	    .name = "big", .numel = 8 * N, .code = -ENOSPC, .text = "swap.paths" });
}

Test(refunds, shm_budget)
{
	refused(&(struct refusal){ .memory = "\"shm_budget\": \"1M\"", .name = "big",
	    .numel = 8 * N, .code = -ENOSPC, .text = "shared-memory budget" });
}

Test(refunds, uid_max_tensors)
{
	refused(&(struct refusal){ .limits = "\"uid_max_tensors\": 1", .nobody = true,
	    .name = "second", .numel = N, .code = -EDQUOT, .text = "limits.uid_max_tensors" });
}

Test(refunds, uid_max_fds)
{
	refused(&(struct refusal){ .limits = "\"uid_max_fds\": 8", .nobody = true,
	    .name = "second", .numel = N, .code = -EMFILE, .text = "limits.uid_max_fds" });
}

Test(refunds, uid_shm_budget)
{
	refused(&(struct refusal){ .limits = "\"uid_shm_budget\": \"200K\"", .nobody = true,
	    .name = "second", .numel = N, .code = -EDQUOT, .text = "limits.uid_shm_budget" });
}
