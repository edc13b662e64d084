/*
 * The Prometheus text exposition (format 0.0.4) of a zd_stats_tree: every
 * figure zoffctl stats shows, named with its unit in base units (seconds,
 * bytes), counters ending in _total.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"

/* One figure of a family: where it is in the tree (or in an array element) and its label value. */
struct entry {
	const char *key;		/* dotted path */
	const char *label_value;	/* NULL: the family has no extra label */
};

struct family {
	const char *name;
	const char *type;		/* "gauge" or "counter" */
	const char *help;
	double scale;			/* ms → s: 1e-3; 0 means 1 */
	const char *label;		/* name of the extra label the entries set, or NULL */
	struct entry e[5];
};

/* Figures of the whole daemon, from the root of the tree. */
static const struct family root_families[] = {
	{ "zoffload_uptime_seconds", "gauge", "Seconds since zoffloadd started.", 0, NULL,
	  { { "uptime_s", NULL } } },
	{ "zoffload_worker_threads", "gauge", "Optimizer threads, the step thread included.", 0,
	  NULL, { { "worker_threads", NULL } } },
	{ "zoffload_sessions", "gauge", "Client connections open.", 0, NULL,
	  { { "sessions", NULL } } },
	{ "zoffload_tensors", "gauge", "Tensors registered, all jobs.", 0, NULL,
	  { { "tensors", NULL } } },
	{ "zoffload_params", "gauge", "Parameters (elements) registered, all jobs.", 0, NULL,
	  { { "params", NULL } } },
	{ "zoffload_tier_used_bytes", "gauge", "Bytes held per tier.", 0, "tier",
	  { { "tiers.pinned.used_bytes", "pinned" }, { "tiers.nvme.used_bytes", "nvme" },
	    { "tiers.shm.used_bytes", "shm" } } },
	{ "zoffload_tier_capacity_bytes", "gauge",
	  "Budget (pinned, shm) or preallocated capacity (nvme) per tier.", 0, "tier",
	  { { "tiers.pinned.budget_bytes", "pinned" }, { "tiers.nvme.capacity_bytes", "nvme" },
	    { "tiers.shm.budget_bytes", "shm" } } },
	{ "zoffload_pinned_locked_bytes", "gauge", "Pinned-tier bytes locked in RAM.", 0, NULL,
	  { { "tiers.pinned.locked_bytes", NULL } } },
	{ "zoffload_pinned_unlocked_bytes", "gauge",
	  "Pinned-tier bytes that could not be locked (RLIMIT_MEMLOCK) and stay pageable.", 0,
	  NULL, { { "tiers.pinned.unlocked_bytes", NULL } } },
	{ "zoffload_pinned_allocations", "gauge", "Live allocations in the pinned tier.", 0, NULL,
	  { { "tiers.pinned.allocations", NULL } } },
	{ "zoffload_pinned_memlock_limit_bytes", "gauge",
	  "RLIMIT_MEMLOCK of the daemon (+Inf: unlimited).", 0, NULL,
	  { { "tiers.pinned.memlock_limit_bytes", NULL } } },
	{ "zoffload_pinned_numa_node", "gauge", "NUMA node of the pinned tier (-1: none).", 0,
	  NULL, { { "tiers.pinned.numa_node", NULL } } },
	{ "zoffload_shm_objects", "gauge", "Shared-memory slots and windows mapped.", 0, NULL,
	  { { "tiers.shm.objects", NULL } } },
	{ "zoffload_nvme_queue_depth", "gauge", "Swap I/O in flight at most.", 0, NULL,
	  { { "tiers.nvme.queue_depth", NULL } } },
	{ "zoffload_nvme_stripe_unit_bytes", "gauge", "Swap stripe unit.", 0, NULL,
	  { { "tiers.nvme.stripe_unit", NULL } } },
	{ "zoffload_nvme_in_flight_ios", "gauge", "Swap I/O in flight now.", 0, NULL,
	  { { "tiers.nvme.in_flight", NULL } } },
	{ "zoffload_nvme_in_flight_peak_ios", "gauge", "Most swap I/O ever in flight at once.", 0,
	  NULL, { { "tiers.nvme.in_flight_peak", NULL } } },
	{ "zoffload_nvme_retries_total", "counter", "Swap I/O resubmitted (EAGAIN, EINTR).", 0,
	  NULL, { { "tiers.nvme.retries", NULL } } },
	{ "zoffload_nvme_short_ios_total", "counter", "Swap I/O that moved fewer bytes than asked.",
	  0, NULL, { { "tiers.nvme.short_ios", NULL } } },
	{ "zoffload_malloc_resident_bytes", "gauge", "jemalloc's resident bytes.", 0, NULL,
	  { { "malloc.resident_bytes", NULL } } },
	{ "zoffload_malloc_allocated_bytes", "gauge", "jemalloc's allocated bytes.", 0, NULL,
	  { { "malloc.allocated_bytes", NULL } } },
	{ "zoffload_step_batches_total", "counter", "Step batches finished, by outcome.", 0,
	  "status", { { "steps.applied", "applied" },
	    { "steps.skipped_nonfinite", "skipped_nonfinite" }, { "steps.failed", "failed" } } },
	{ "zoffload_step_batches_in_flight", "gauge", "Step batches submitted and not finished.", 0,
	  NULL, { { "steps.in_flight", NULL } } },
	{ "zoffload_tensors_stepped_total", "counter", "Tensor steps applied.", 0, NULL,
	  { { "steps.tensors_stepped", NULL } } },
	{ "zoffload_params_stepped_total", "counter", "Parameters (elements) stepped.", 0, NULL,
	  { { "steps.params_stepped", NULL } } },
	{ "zoffload_step_params_per_second", "gauge",
	  "Parameters stepped per second over the last rate window.", 0, NULL,
	  { { "steps.params_per_s", NULL } } },
	{ "zoffload_step_rate_window_seconds", "gauge", "Window of the step rate.", 0, NULL,
	  { { "steps.rate_window_s", NULL } } },
	{ "zoffload_step_compute_params_per_second", "gauge",
	  "Parameters per second of kernel time (compute only).", 0, NULL,
	  { { "steps.compute_params_per_s", NULL } } },
	{ "zoffload_step_latency_recent_seconds", "gauge",
	  "Submit-to-done latency over the recent samples.", 1e-3, "stat",
	  { { "steps.latency_ms.last", "last" }, { "steps.latency_ms.mean", "mean" },
	    { "steps.latency_ms.p50", "p50" }, { "steps.latency_ms.p99", "p99" },
	    { "steps.latency_ms.max", "max" } } },
	{ "zoffload_step_latency_recent_samples", "gauge", "Samples behind the recent latency.", 0,
	  NULL, { { "steps.latency_ms.samples", NULL } } },
	{ "zoffload_tensor_steps_total", "counter",
	  "Tensor steps by where the state was when the step began.", 0, "tier",
	  { { "pipeline.tensor_steps_pinned", "pinned" },
	    { "pipeline.tensor_steps_nvme", "nvme" } } },
	{ "zoffload_stepped_state_bytes_total", "counter",
	  "Optimizer-state bytes stepped, by the tier that served them.", 0, "tier",
	  { { "pipeline.state_bytes_stepped_pinned", "pinned" },
	    { "pipeline.state_bytes_stepped_nvme", "nvme" } } },
	{ "zoffload_pipeline_pinned_hit_ratio", "gauge",
	  "Share of the optimizer-state bytes stepped that were served from pinned memory.", 0,
	  NULL, { { "pipeline.pinned_hit_rate", NULL } } },
	{ "zoffload_pipeline_staging_buffers", "gauge", "Staging buffers of the NVMe pipeline.", 0,
	  NULL, { { "pipeline.staging_buffers", NULL } } },
	{ "zoffload_pipeline_chunks_total", "counter", "NVMe chunks moved, by direction.", 0,
	  "direction", { { "pipeline.chunks_read", "read" },
	    { "pipeline.chunks_written", "write" } } },
	{ "zoffload_pipeline_bytes_total", "counter", "Optimizer-state bytes moved to and from NVMe.",
	  0, "direction", { { "pipeline.bytes_read", "read" },
	    { "pipeline.bytes_written", "write" } } },
	{ "zoffload_pipeline_io_errors_total", "counter", "Chunk I/O that failed.", 0, NULL,
	  { { "pipeline.io_errors", NULL } } },
	{ "zoffload_pipeline_stalls_total", "counter",
	  "Times compute waited on I/O, or I/O on compute.", 0, "waiting",
	  { { "pipeline.compute_waiting_on_io", "compute_on_io" },
	    { "pipeline.io_waiting_on_compute", "io_on_compute" } } },
	{ "zoffload_pipeline_stall_seconds_total", "counter",
	  "Time compute waited on I/O, or I/O on compute.", 1e-3, "waiting",
	  { { "pipeline.compute_waiting_on_io_ms", "compute_on_io" },
	    { "pipeline.io_waiting_on_compute_ms", "io_on_compute" } } },
	{ "zoffload_pipeline_staging_seconds_total", "counter",
	  "Time the staging buffers spent reading a chunk, being computed on, or writing it "
	  "back, summed over the buffers.", 1e-3, "phase",
	  { { "pipeline.staging_reading_ms", "reading" },
	    { "pipeline.staging_computing_ms", "computing" },
	    { "pipeline.staging_writing_ms", "writing" } } },
	{ "zoffload_param_fetches_total", "counter", "Offloaded-parameter fetches, by outcome.", 0,
	  "result", { { "pipeline.params.hits", "hit" }, { "pipeline.params.misses", "miss" } } },
	{ "zoffload_param_hit_ratio", "gauge",
	  "Share of parameter fetches that found the parameters already in the slot.", 0, NULL,
	  { { "pipeline.params.hit_rate", NULL } } },
	{ "zoffload_param_staged_bytes_total", "counter", "Parameter bytes staged for fetches.", 0,
	  NULL, { { "pipeline.params.bytes_staged", NULL } } },
	{ "zoffload_param_releases_total", "counter", "Parameter slots released.", 0, NULL,
	  { { "pipeline.params.releases", NULL } } },
	{ "zoffload_param_written_back_bytes_total", "counter",
	  "Parameter bytes written back to the tiers.", 0, NULL,
	  { { "pipeline.params.bytes_written_back", NULL } } },
	{ "zoffload_limit", "gauge", "Running limits.* values (0: none).", 0, "limit",
	  { { "limits.max_clients", "max_clients" },
	    { "limits.max_clients_per_uid", "max_clients_per_uid" },
	    { "limits.max_queued_messages", "max_queued_messages" },
	    { "limits.detach_grace_s", "detach_grace_seconds" } } },
	{ "zoffload_limit_bytes", "gauge", "Running per-uid byte budgets (0: none).", 0, "limit",
	  { { "limits.uid_pinned_budget", "uid_pinned_budget" },
	    { "limits.uid_swap_budget", "uid_swap_budget" } } },
};

/* Per swap path, label path. */
static const struct family path_families[] = {
	{ "zoffload_swap_path_capacity_bytes", "gauge", "Preallocated capacity of the swap path.",
	  0, NULL, { { "capacity_bytes", NULL } } },
	{ "zoffload_swap_path_used_bytes", "gauge", "Bytes in use on the swap path.", 0, NULL,
	  { { "used_bytes", NULL } } },
	{ "zoffload_swap_path_bytes_total", "counter", "Bytes moved on the swap path.", 0,
	  "direction", { { "read_bytes", "read" }, { "written_bytes", "write" } } },
	{ "zoffload_swap_path_bytes_per_second", "gauge",
	  "Swap path bandwidth over the last second.", 0, "direction",
	  { { "read_bps", "read" }, { "write_bps", "write" } } },
	{ "zoffload_swap_path_in_flight_ios", "gauge", "I/O in flight on the swap path.", 0, NULL,
	  { { "in_flight", NULL } } },
	{ "zoffload_swap_path_errors_total", "counter", "Failed I/O on the swap path, by errno.", 0,
	  "error", { { "errors_eio", "eio" }, { "errors_enospc", "enospc" },
	    { "errors_other", "other" } } },
};

/* Per job (bounded, see bound and put_jobs), labels job and uid. */
static const struct family job_families[] = {
	{ "zoffload_job_world_size", "gauge", "Ranks of the job.", 0, NULL,
	  { { "world_size", NULL } } },
	{ "zoffload_job_ranks", "gauge", "Ranks attached and detached (waiting to reattach).", 0,
	  "state", { { "ranks_attached", "attached" }, { "ranks_detached", "detached" } } },
	{ "zoffload_job_tensors_detached", "gauge", "Tensors of detached ranks.", 0, NULL,
	  { { "tensors_detached", NULL } } },
	{ "zoffload_job_state_bytes", "gauge", "Optimizer-state bytes of the job per tier.", 0,
	  "tier", { { "pinned_bytes", "pinned" }, { "nvme_bytes", "nvme" } } },
	{ "zoffload_job_state_saved_bytes", "gauge", "Optimizer-state bytes the job's state "
	  "format saves against fp32 state.", 0, NULL, { { "state_bytes_saved", NULL } } },
	{ "zoffload_job_tensors", "gauge", "Tensors of the job.", 0, NULL,
	  { { "tensors", NULL } } },
	{ "zoffload_job_params", "gauge", "Parameters (elements) of the job.", 0, NULL,
	  { { "params", NULL } } },
	{ "zoffload_job_steps_total", "counter", "Step batches of the job, by outcome.", 0,
	  "status", { { "steps_applied", "applied" }, { "steps_skipped", "skipped_nonfinite" },
	    { "steps_failed", "failed" } } },
	{ "zoffload_job_last_step", "gauge", "Highest optimizer step number applied.", 0, NULL,
	  { { "last_step", NULL } } },
};

/* Per uid, label uid. */
static const struct family uid_families[] = {
	{ "zoffload_uid_sessions", "gauge", "Connections of the uid.", 0, NULL,
	  { { "sessions", NULL } } },
	{ "zoffload_uid_state_bytes", "gauge", "Optimizer-state bytes of the uid per tier.", 0,
	  "tier", { { "pinned_bytes", "pinned" }, { "swap_bytes", "nvme" } } },
};

/* Most uids given their own label; the rest are summed under uid="other". */
#define MAX_UIDS 64

static const cJSON *
lookup(const cJSON *obj, const char *dotted)
{
	char part[64];

	while (obj != NULL && *dotted != '\0') {
		size_t n = strcspn(dotted, ".");

		if (n >= sizeof(part))
			return NULL;
		memcpy(part, dotted, n);
		part[n] = '\0';
		obj = cJSON_GetObjectItemCaseSensitive(obj, part);
		dotted += n + (dotted[n] == '.');
	}
	return obj;
}

static void
put_value(FILE *f, double v)
{
	if (isnan(v))
		fputs("NaN", f);
	else if (isinf(v))
		fputs(v > 0 ? "+Inf" : "-Inf", f);
	else if (v == floor(v) && fabs(v) < 1e15)
		fprintf(f, "%.0f", v);
	else
		fprintf(f, "%.9g", v);
}

/* A label value, escaped as the text format asks (backslash, quote, newline). */
static void
put_label(FILE *f, const char *name, const char *value, bool *first)
{
	fprintf(f, "%s%s=\"", *first ? "{" : ",", name);
	*first = false;
	for (const char *p = value; *p != '\0'; p++) {
		if (*p == '\\' || *p == '"')
			fputc('\\', f);
		if (*p == '\n')
			fputs("\\n", f);
		else
			fputc(*p, f);
	}
	fputc('"', f);
}

static void
put_header(FILE *f, const struct family *fam)
{
	fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", fam->name, fam->help, fam->name, fam->type);
}

/*
 * The samples of fam from obj.  fixed: labels every sample carries
 * (name/value pairs, NULL-terminated), or NULL.
 */
static void
put_samples(FILE *f, const struct family *fam, const cJSON *obj, const char *const *fixed)
{
	for (size_t i = 0; i < sizeof(fam->e) / sizeof(fam->e[0]) && fam->e[i].key != NULL; i++) {
		const cJSON *v = lookup(obj, fam->e[i].key);
		double x;
		bool first = true;

		if (!cJSON_IsNumber(v))
			continue;
		x = v->valuedouble * (fam->scale != 0 ? fam->scale : 1);
		/* The stats say -1 for "unlimited". */
		if (strcmp(fam->name, "zoffload_pinned_memlock_limit_bytes") == 0 && x < 0)
			x = INFINITY;
		fputs(fam->name, f);
		for (const char *const *l = fixed; l != NULL && *l != NULL; l += 2)
			put_label(f, l[0], l[1], &first);
		if (fam->label != NULL)
			put_label(f, fam->label, fam->e[i].label_value, &first);
		fputs(first ? " " : "} ", f);
		put_value(f, x);
		fputc('\n', f);
	}
}

static double
num(const cJSON *obj, const char *key)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);

	return cJSON_IsNumber(v) ? v->valuedouble : 0;
}

static void
set_num(cJSON *obj, const char *key, double v)
{
	cJSON *old = cJSON_GetObjectItemCaseSensitive(obj, key);

	if (old != NULL)
		cJSON_SetNumberValue(old, v);
	else
		cJSON_AddNumberToObject(obj, key, v);
}

/* Folds element src into the aggregate dst: sums, but the highest last_step. */
static void
fold_into(cJSON *dst, const cJSON *src)
{
	const cJSON *v;

	cJSON_ArrayForEach(v, src) {
		if (!cJSON_IsNumber(v) || strcmp(v->string, "id") == 0 || strcmp(v->string, "uid") == 0)
			continue;
		if (strcmp(v->string, "last_step") == 0)
			set_num(dst, v->string, fmax(num(dst, v->string), v->valuedouble));
		else
			set_num(dst, v->string, num(dst, v->string) + v->valuedouble);
	}
}

static double
weight(const cJSON *o)
{
	return num(o, "pinned_bytes") + num(o, "nvme_bytes") + num(o, "swap_bytes");
}

static int
cmp_weight(const void *a, const void *b)
{
	const cJSON *x = *(const cJSON *const *)a, *y = *(const cJSON *const *)b;
	double wx = weight(x), wy = weight(y);

	if (wx != wy)
		return wx < wy ? 1 : -1;
	/* Ties: stable by id, so the same jobs keep their labels from scrape to scrape. */
	return (num(x, "id") > num(y, "id")) - (num(x, "id") < num(y, "id"));
}

/*
 * The elements of arr that keep their own labels (the keep heaviest), in
 * *kept (malloc'd, *nkept), and the rest summed into *other (NULL when none).
 */
static int
bound(const cJSON *arr, unsigned keep, const cJSON ***kept, size_t *nkept, cJSON **other)
{
	size_t n = (size_t)cJSON_GetArraySize(arr), i = 0;
	const cJSON *e;

	*kept = NULL;
	*nkept = 0;
	*other = NULL;
	if (n == 0)
		return 0;
	*kept = calloc(n, sizeof(**kept));
	if (*kept == NULL)
		return -1;
	cJSON_ArrayForEach(e, arr)
		(*kept)[i++] = e;
	qsort(*kept, n, sizeof(**kept), cmp_weight);
	*nkept = n < keep ? n : keep;
	if (n > keep) {
		*other = cJSON_CreateObject();
		if (*other == NULL)
			return -1;
		for (i = keep; i < n; i++)
			fold_into(*other, (*kept)[i]);
	}
	return 0;
}

static void
put_jobs(FILE *f, const cJSON *stats, unsigned max_jobs)
{
	const cJSON *jobs = cJSON_GetObjectItemCaseSensitive(stats, "jobs");
	const cJSON **kept;
	cJSON *other;
	size_t nkept, njobs = (size_t)cJSON_GetArraySize(jobs);

	fputs("# HELP zoffload_jobs Jobs open, and how many are summed under job=\"other\".\n"
	    "# TYPE zoffload_jobs gauge\n", f);
	if (bound(jobs, max_jobs, &kept, &nkept, &other) != 0)
		goto out;
	fprintf(f, "zoffload_jobs{set=\"all\"} %zu\nzoffload_jobs{set=\"other\"} %zu\n", njobs,
	    njobs - nkept);
	fputs("# HELP zoffload_job_info Jobs with their own labels, with their tier policy and "
	    "state format.\n"
	    "# TYPE zoffload_job_info gauge\n", f);
	for (size_t i = 0; i < nkept; i++) {
		const cJSON *name = cJSON_GetObjectItemCaseSensitive(kept[i], "name");
		const cJSON *policy = cJSON_GetObjectItemCaseSensitive(kept[i], "policy");
		const cJSON *format = cJSON_GetObjectItemCaseSensitive(kept[i], "state_format");
		char uid[24];
		bool first = true;

		snprintf(uid, sizeof(uid), "%.0f", num(kept[i], "uid"));
		fputs("zoffload_job_info", f);
		put_label(f, "job", cJSON_IsString(name) ? name->valuestring : "", &first);
		put_label(f, "uid", uid, &first);
		put_label(f, "policy", cJSON_IsString(policy) ? policy->valuestring : "", &first);
		put_label(f, "state_format", cJSON_IsString(format) ? format->valuestring : "",
		    &first);
		fputs("} 1\n", f);
	}
	for (size_t k = 0; k < sizeof(job_families) / sizeof(job_families[0]); k++) {
		put_header(f, &job_families[k]);
		for (size_t i = 0; i < nkept; i++) {
			const cJSON *name = cJSON_GetObjectItemCaseSensitive(kept[i], "name");
			char uid[24];
			const char *labels[] = { "job", cJSON_IsString(name) ? name->valuestring : "",
				"uid", uid, NULL };

			snprintf(uid, sizeof(uid), "%.0f", num(kept[i], "uid"));
			put_samples(f, &job_families[k], kept[i], labels);
		}
		if (other != NULL) {
			const char *labels[] = { "job", "other", "uid", "", NULL };

			put_samples(f, &job_families[k], other, labels);
		}
	}
out:
	free(kept);
	cJSON_Delete(other);
}

static void
put_uids(FILE *f, const cJSON *stats)
{
	const cJSON *uids = cJSON_GetObjectItemCaseSensitive(stats, "uids");
	const cJSON **kept;
	cJSON *other;
	size_t nkept;

	if (bound(uids, MAX_UIDS, &kept, &nkept, &other) != 0)
		goto out;
	for (size_t k = 0; k < sizeof(uid_families) / sizeof(uid_families[0]); k++) {
		put_header(f, &uid_families[k]);
		for (size_t i = 0; i < nkept; i++) {
			char uid[24];
			const char *labels[] = { "uid", uid, NULL };

			snprintf(uid, sizeof(uid), "%.0f", num(kept[i], "uid"));
			put_samples(f, &uid_families[k], kept[i], labels);
		}
		if (other != NULL) {
			const char *labels[] = { "uid", "other", NULL };

			put_samples(f, &uid_families[k], other, labels);
		}
	}
out:
	free(kept);
	cJSON_Delete(other);
}

static void
put_paths(FILE *f, const cJSON *paths)
{
	for (size_t k = 0; k < sizeof(path_families) / sizeof(path_families[0]); k++) {
		const cJSON *p;

		put_header(f, &path_families[k]);
		cJSON_ArrayForEach(p, paths) {
			const cJSON *name = cJSON_GetObjectItemCaseSensitive(p, "path");
			const char *labels[] = { "path", cJSON_IsString(name) ? name->valuestring : "",
				NULL };

			put_samples(f, &path_families[k], p, labels);
		}
	}
}

static void
put_histogram(FILE *f, const cJSON *h)
{
	const cJSON *le = cJSON_GetObjectItemCaseSensitive(h, "le_s");
	const cJSON *counts = cJSON_GetObjectItemCaseSensitive(h, "counts");
	int n = cJSON_GetArraySize(le);

	if (h == NULL || n != cJSON_GetArraySize(counts))
		return;
	fputs("# HELP zoffload_step_latency_seconds Step batch latency, submit to done.\n"
	    "# TYPE zoffload_step_latency_seconds histogram\n", f);
	for (int i = 0; i < n; i++) {
		fputs("zoffload_step_latency_seconds_bucket{le=\"", f);
		put_value(f, cJSON_GetArrayItem(le, i)->valuedouble);
		fputs("\"} ", f);
		put_value(f, cJSON_GetArrayItem(counts, i)->valuedouble);
		fputc('\n', f);
	}
	fputs("zoffload_step_latency_seconds_bucket{le=\"+Inf\"} ", f);
	put_value(f, num(h, "count"));
	fputs("\nzoffload_step_latency_seconds_sum ", f);
	put_value(f, num(h, "sum_s"));
	fputs("\nzoffload_step_latency_seconds_count ", f);
	put_value(f, num(h, "count"));
	fputc('\n', f);
}

/* Strings of the tree, as labels of one info series. */
static void
put_info(FILE *f, const cJSON *stats)
{
	static const char *const keys[][2] = {
		{ "version", "version" }, { "kernel_isa", "kernel_isa" },
		{ "log_level", "log_level" }, { "tiers.nvme.engine", "swap_engine" },
		{ "tiers.nvme.io_uring_unavailable", "io_uring_unavailable" },
		{ "malloc.allocator", "allocator" },
	};
	bool first = true;

	fputs("# HELP zoffload_info Version, kernel variant, swap engine and allocator in use.\n"
	    "# TYPE zoffload_info gauge\nzoffload_info", f);
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
		const cJSON *v = lookup(stats, keys[i][0]);

		if (cJSON_IsString(v))
			put_label(f, keys[i][1], v->valuestring, &first);
	}
	fputs(first ? " 1\n" : "} 1\n", f);
}

char *
zd_metrics_render(const cJSON *stats, unsigned max_jobs, size_t *len)
{
	const cJSON *paths = lookup(stats, "tiers.nvme.paths"), *p;
	cJSON *root = NULL, *nvme;
	double used = 0, cap = 0;
	char *text = NULL;
	FILE *f;

	/* The NVMe tier's totals are the sums over its paths. */
	root = cJSON_Duplicate(stats, 1);
	if (root == NULL)
		return NULL;
	nvme = (cJSON *)lookup(root, "tiers.nvme");
	if (cJSON_IsArray(paths) && nvme != NULL) {
		cJSON_ArrayForEach(p, paths) {
			used += num(p, "used_bytes");
			cap += num(p, "capacity_bytes");
		}
		set_num(nvme, "used_bytes", used);
		set_num(nvme, "capacity_bytes", cap);
	}
	f = open_memstream(&text, len);
	if (f == NULL) {
		cJSON_Delete(root);
		return NULL;
	}
	put_info(f, root);
	for (size_t k = 0; k < sizeof(root_families) / sizeof(root_families[0]); k++) {
		put_header(f, &root_families[k]);
		put_samples(f, &root_families[k], root, NULL);
	}
	put_histogram(f, lookup(root, "steps.latency_histogram"));
	put_paths(f, lookup(root, "tiers.nvme.paths"));
	put_jobs(f, root, max_jobs);
	put_uids(f, root);
	cJSON_Delete(root);
	if (ferror(f)) {
		fclose(f);
		free(text);
		return NULL;
	}
	if (fclose(f) != 0) {
		free(text);
		return NULL;
	}
	return text;
}
