/* What zoffctl stats and zoffctl jobs show: tiers, jobs, sessions, step throughput and latency. */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "arena.h"
#include "build_config.h"
#include "checkpoint.h"
#include "daemon.h"
#include "engine.h"
#include "job.h"
#include "stats.h"
#include "metrics.h"
#include "swap.h"
#include "uid.h"

#if HAVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

/* Throughput is averaged over this many whole seconds before now. */
#define RATE_WINDOW 10

/*
 * Cumulative step latency histogram for the metrics endpoint (the samples
 * ring above only keeps the recent ones).  Upper bounds in seconds.  Kept
 * here rather than in struct zd_daemon: one daemon per process, updated and
 * read on the event-loop thread only.
 */
static const double latency_le_s[] = { 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
	0.5, 1, 2.5, 5, 10, 30 };
#define LATENCY_BUCKETS (sizeof(latency_le_s) / sizeof(latency_le_s[0]))
static struct {
	uint64_t count[LATENCY_BUCKETS];	/* per bucket, not cumulative */
	uint64_t total;
	double sum_s;
} latency_hist;

static void
latency_hist_add(uint64_t ns)
{
	double s = (double)ns / 1e9;

	for (unsigned i = 0; i < LATENCY_BUCKETS; i++) {
		if (s <= latency_le_s[i]) {
			latency_hist.count[i]++;
			break;
		}
	}
	latency_hist.total++;
	latency_hist.sum_s += s;
}

void
zd_stats_record(struct zd_daemon *d, const struct ze_step_result *r)
{
	struct zd_step_stats *st = &d->steps;
	uint64_t now = zu_now_ns();
	uint64_t sec = now / 1000000000ull;
	unsigned slot = sec % ZD_RATE_BUCKETS;
	uint64_t params = r->status == ZE_STEP_APPLIED ? r->params : 0;

	switch (r->status) {
	case ZE_STEP_APPLIED:
		st->batches_applied++;
		st->tensors_stepped += r->count;
		st->params_stepped += params;
		break;
	case ZE_STEP_SKIPPED_NONFINITE:
		st->batches_skipped++;
		break;
	default:
		st->batches_failed++;
		break;
	}
	st->compute_ns += r->compute_ns;
	if (st->rate_second[slot] != sec) {
		st->rate_second[slot] = sec;
		st->rate_params[slot] = 0;
	}
	st->rate_params[slot] += params;
	st->latency_ns[st->latency_count % ZD_LATENCY_SAMPLES] = now - r->submit_ns;
	st->latency_count++;
	latency_hist_add(now - r->submit_ns);
}

/* {"le_s": [...], "counts": [...cumulative], "count": n, "sum_s": s} */
static void
add_latency_histogram(cJSON *steps)
{
	cJSON *h = cJSON_AddObjectToObject(steps, "latency_histogram");
	cJSON *le, *counts;
	uint64_t cum = 0;

	if (h == NULL)
		return;
	le = cJSON_AddArrayToObject(h, "le_s");
	counts = cJSON_AddArrayToObject(h, "counts");
	for (unsigned i = 0; le != NULL && counts != NULL && i < LATENCY_BUCKETS; i++) {
		cum += latency_hist.count[i];
		cJSON_AddItemToArray(le, cJSON_CreateNumber(latency_le_s[i]));
		cJSON_AddItemToArray(counts, cJSON_CreateNumber((double)cum));
	}
	cJSON_AddNumberToObject(h, "count", (double)latency_hist.total);
	cJSON_AddNumberToObject(h, "sum_s", latency_hist.sum_s);
}

static int
cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return (x > y) - (x < y);
}

static void
add_latency(cJSON *steps, const struct zd_step_stats *st)
{
	uint64_t sorted[ZD_LATENCY_SAMPLES];
	size_t n = st->latency_count < ZD_LATENCY_SAMPLES ? st->latency_count : ZD_LATENCY_SAMPLES;
	cJSON *lat = cJSON_AddObjectToObject(steps, "latency_ms");
	uint64_t last;
	double sum = 0;

	if (lat == NULL || n == 0)
		return;
	memcpy(sorted, st->latency_ns, n * sizeof(sorted[0]));
	last = st->latency_ns[(st->latency_count - 1) % ZD_LATENCY_SAMPLES];
	qsort(sorted, n, sizeof(sorted[0]), cmp_u64);
	for (size_t i = 0; i < n; i++)
		sum += (double)sorted[i];
	cJSON_AddNumberToObject(lat, "samples", (double)n);
	cJSON_AddNumberToObject(lat, "last", (double)last / 1e6);
	cJSON_AddNumberToObject(lat, "mean", sum / (double)n / 1e6);
	cJSON_AddNumberToObject(lat, "p50", (double)sorted[n / 2] / 1e6);
	cJSON_AddNumberToObject(lat, "p99", (double)sorted[(n * 99) / 100] / 1e6);
	cJSON_AddNumberToObject(lat, "max", (double)sorted[n - 1] / 1e6);
}

static void
add_steps(cJSON *root, const struct zd_daemon *d)
{
	const struct zd_step_stats *st = &d->steps;
	cJSON *steps = cJSON_AddObjectToObject(root, "steps");
	uint64_t now_sec = zu_now_ns() / 1000000000ull, recent = 0;
	uint64_t up = now_sec - d->started_ns / 1000000000ull;
	unsigned window = up < RATE_WINDOW ? (unsigned)up : RATE_WINDOW;

	if (steps == NULL)
		return;
	/* Whole seconds only: the current one is still filling. */
	for (unsigned i = 0; i < ZD_RATE_BUCKETS; i++) {
		uint64_t sec = st->rate_second[i];

		if (sec < now_sec && sec + RATE_WINDOW >= now_sec)
			recent += st->rate_params[i];
	}
	cJSON_AddNumberToObject(steps, "applied", (double)st->batches_applied);
	cJSON_AddNumberToObject(steps, "skipped_nonfinite", (double)st->batches_skipped);
	cJSON_AddNumberToObject(steps, "failed", (double)st->batches_failed);
	cJSON_AddNumberToObject(steps, "in_flight", ze_engine_steps_in_flight(d->engine));
	cJSON_AddNumberToObject(steps, "tensors_stepped", (double)st->tensors_stepped);
	cJSON_AddNumberToObject(steps, "params_stepped", (double)st->params_stepped);
	/* A daemon up for less than the window has only that many whole seconds to average. */
	cJSON_AddNumberToObject(steps, "params_per_s", window > 0 ? (double)recent / window : 0);
	cJSON_AddNumberToObject(steps, "rate_window_s", window);
	cJSON_AddNumberToObject(steps, "compute_params_per_s", st->compute_ns == 0 ? 0 :
	    (double)st->params_stepped / ((double)st->compute_ns / 1e9));
	add_latency(steps, st);
	add_latency_histogram(steps);
}

static void
add_nvme(cJSON *tiers, const struct zd_daemon *d)
{
	struct zs_swap *swap = ze_engine_swap(d->engine);
	struct zs_swap_stats es;
	cJSON *nvme, *paths;

	nvme = cJSON_AddObjectToObject(tiers, "nvme");
	if (nvme == NULL)
		return;
	if (swap == NULL) {
		cJSON_AddStringToObject(nvme, "engine", "off");
		return;
	}
	zs_swap_stats(swap, &es);
	cJSON_AddStringToObject(nvme, "engine", zs_swap_name(swap));
	if (es.uring_error != 0)
		cJSON_AddStringToObject(nvme, "io_uring_unavailable", zs_strerror(es.uring_error));
	cJSON_AddNumberToObject(nvme, "queue_depth", es.queue_depth);
	cJSON_AddNumberToObject(nvme, "stripe_unit", es.stripe_unit);
	cJSON_AddNumberToObject(nvme, "in_flight", es.in_flight);
	cJSON_AddNumberToObject(nvme, "in_flight_peak", es.in_flight_peak);
	cJSON_AddNumberToObject(nvme, "retries", (double)es.retries);
	cJSON_AddNumberToObject(nvme, "short_ios", (double)es.short_ios);
	paths = cJSON_AddArrayToObject(nvme, "paths");
	for (unsigned i = 0; paths != NULL && i < es.npaths && i < ZD_MAX_SWAP_PATHS; i++) {
		struct zs_path_stats ps;
		cJSON *p = cJSON_CreateObject();

		if (p == NULL || zs_swap_path_stats(swap, i, &ps) != 0) {
			cJSON_Delete(p);
			continue;
		}
		cJSON_AddStringToObject(p, "path", d->cfg.swap_paths[i].path);
		cJSON_AddNumberToObject(p, "capacity_bytes", (double)ps.capacity);
		cJSON_AddNumberToObject(p, "used_bytes", (double)ps.used_bytes);
		cJSON_AddNumberToObject(p, "read_bytes", (double)ps.bytes_read);
		cJSON_AddNumberToObject(p, "written_bytes", (double)ps.bytes_written);
		cJSON_AddNumberToObject(p, "read_bps", d->swap_samples[i].read_bps);
		cJSON_AddNumberToObject(p, "write_bps", d->swap_samples[i].write_bps);
		cJSON_AddNumberToObject(p, "in_flight", ps.in_flight);
		cJSON_AddNumberToObject(p, "errors_eio", (double)ps.errors_eio);
		cJSON_AddNumberToObject(p, "errors_enospc", (double)ps.errors_enospc);
		cJSON_AddNumberToObject(p, "errors_other", (double)ps.errors_other);
		cJSON_AddBoolToObject(p, "bad", ps.bad != 0);
		if (ps.bad != 0)
			cJSON_AddStringToObject(p, "bad_reason", zs_strerror(ps.bad));
		cJSON_AddItemToArray(paths, p);
	}
}

static void
add_pipeline(cJSON *root, const struct zd_daemon *d)
{
	struct ze_stats es, *t = &es;
	cJSON *p = cJSON_AddObjectToObject(root, "pipeline");
	cJSON *params;
	double stepped;

	if (p == NULL)
		return;
	ze_engine_stats(d->engine, &es);
	stepped = (double)t->pinned_step_bytes + (double)t->nvme_step_bytes;
	cJSON_AddNumberToObject(p, "tensor_steps_pinned", (double)t->pinned_steps);
	cJSON_AddNumberToObject(p, "tensor_steps_nvme", (double)t->nvme_steps);
	cJSON_AddNumberToObject(p, "state_bytes_stepped_pinned", (double)t->pinned_step_bytes);
	cJSON_AddNumberToObject(p, "state_bytes_stepped_nvme", (double)t->nvme_step_bytes);
	/*
	 * A hit: served from where it already was, nothing brought from a slower
	 * tier for it.  Weighted by bytes, not by tensors: a pinned bias and a
	 * 1 GiB matrix on NVMe are 99.9% miss, not 50%.
	 */
	cJSON_AddNumberToObject(p, "pinned_hit_rate", stepped > 0 ?
	    (double)t->pinned_step_bytes / stepped : 0);
	cJSON_AddNumberToObject(p, "staging_buffers", t->staging_buffers);
	cJSON_AddNumberToObject(p, "chunks_read", (double)t->chunks_read);
	cJSON_AddNumberToObject(p, "chunks_written", (double)t->chunks_written);
	cJSON_AddNumberToObject(p, "chunks_skipped", (double)t->chunks_skipped);
	cJSON_AddNumberToObject(p, "bytes_read", (double)t->bytes_read);
	cJSON_AddNumberToObject(p, "bytes_written", (double)t->bytes_written);
	cJSON_AddNumberToObject(p, "io_errors", (double)t->io_errors);
	cJSON_AddNumberToObject(p, "compute_waiting_on_io", (double)t->compute_waits);
	cJSON_AddNumberToObject(p, "compute_waiting_on_io_ms", (double)t->compute_wait_ns / 1e6);
	cJSON_AddNumberToObject(p, "io_waiting_on_compute", (double)t->io_waits);
	cJSON_AddNumberToObject(p, "io_waiting_on_compute_ms", (double)t->io_wait_ns / 1e6);
	cJSON_AddNumberToObject(p, "staging_reading_ms", (double)t->staging_read_ns / 1e6);
	cJSON_AddNumberToObject(p, "staging_computing_ms", (double)t->staging_compute_ns / 1e6);
	cJSON_AddNumberToObject(p, "staging_writing_ms", (double)t->staging_write_ns / 1e6);
	params = cJSON_AddObjectToObject(p, "params");
	if (params == NULL)
		return;
	cJSON_AddNumberToObject(params, "fetches", (double)t->param_fetches);
	cJSON_AddNumberToObject(params, "hits", (double)t->param_hits);
	cJSON_AddNumberToObject(params, "misses", (double)t->param_misses);
	cJSON_AddNumberToObject(params, "hit_rate", t->param_fetches > 0 ?
	    (double)t->param_hits / (double)t->param_fetches : 0);
	cJSON_AddNumberToObject(params, "bytes_staged", (double)t->param_bytes_staged);
	cJSON_AddNumberToObject(params, "releases", (double)t->param_releases);
	cJSON_AddNumberToObject(params, "bytes_written_back", (double)t->param_bytes_written);
}

/*
 * Root (viewer NULL or uid 0) sees everything; any other uid its own jobs
 * and holdings, and the node's totals, at a cost that does not grow with
 * what other uids hold.
 */
static bool
sees_all(const struct zd_uid *viewer)
{
	return viewer == NULL || viewer->uid == 0;
}

static void
add_uid(cJSON *uids, const struct zd_uid *u)
{
	cJSON *o = cJSON_CreateObject();
	uint64_t pinned, swap;

	if (o == NULL)
		return;
	ze_account_usage(u->account, &pinned, &swap);
	cJSON_AddNumberToObject(o, "uid", u->uid);
	cJSON_AddNumberToObject(o, "sessions", u->sessions);
	cJSON_AddNumberToObject(o, "pinned_bytes", (double)pinned);
	cJSON_AddNumberToObject(o, "swap_bytes", (double)swap);
	cJSON_AddNumberToObject(o, "tensors", u->tensors);
	cJSON_AddNumberToObject(o, "fds", u->fds);
	cJSON_AddNumberToObject(o, "shm_bytes", (double)u->shm_bytes);
	cJSON_AddNumberToObject(o, "queued_bytes", (double)u->queued_bytes);
	cJSON_AddNumberToObject(o, "ckpt_buffer_bytes", (double)u->ckpt_buffer_bytes);
	cJSON_AddNumberToObject(o, "ckpt_waiting", u->ckpt_waiting);
	cJSON_AddItemToArray(uids, o);
}

static void
add_uids(cJSON *root, const struct zd_daemon *d, const struct zd_uid *viewer)
{
	cJSON *uids = cJSON_AddArrayToObject(root, "uids");
	const struct zd_uid *u;

	if (uids == NULL)
		return;
	if (!sees_all(viewer)) {
		add_uid(uids, viewer);
		return;
	}
	TAILQ_FOREACH(u, &d->uids, entry)
		add_uid(uids, u);
}
/* The running limits, so that a SIGHUP reload can be seen from outside. */
static void
add_limits(cJSON *root, const struct zd_daemon *d)
{
	cJSON *l = cJSON_AddObjectToObject(root, "limits");

	if (l == NULL)
		return;
	cJSON_AddNumberToObject(l, "max_clients", d->cfg.max_clients);
	cJSON_AddNumberToObject(l, "max_clients_per_uid", d->cfg.max_clients_per_uid);
	cJSON_AddNumberToObject(l, "max_queued_messages", d->cfg.max_queued_messages);
	cJSON_AddNumberToObject(l, "uid_pinned_budget", (double)d->cfg.uid_pinned_budget);
	cJSON_AddNumberToObject(l, "uid_swap_budget", (double)d->cfg.uid_swap_budget);
	cJSON_AddNumberToObject(l, "detach_grace_s", d->cfg.detach_grace_s);
	cJSON_AddNumberToObject(l, "max_queued_bytes", (double)d->cfg.max_queued_bytes);
	cJSON_AddNumberToObject(l, "uid_queued_bytes", (double)d->cfg.uid_queued_bytes);
	cJSON_AddNumberToObject(l, "uid_max_tensors", d->cfg.uid_max_tensors);
	cJSON_AddNumberToObject(l, "uid_max_fds", zd_uid_fd_cap(d));
	cJSON_AddNumberToObject(l, "uid_shm_budget", (double)d->cfg.uid_shm_budget);
	cJSON_AddNumberToObject(l, "uid_ckpt_buffer_budget", (double)d->cfg.uid_ckpt_buffer_budget);
	cJSON_AddNumberToObject(l, "fd_limit", d->fd_limit);
	cJSON_AddNumberToObject(l, "client_fds", d->client_fds);
	/* Client descriptors closed by the closer's threads, not on the loop (closer.c). */
	cJSON_AddNumberToObject(l, "fds_closed_off_loop", (double)d->closed_off_loop);
}

static void
add_tiers(cJSON *root, const struct zd_daemon *d)
{
	struct zt_arena_stats as;
	struct ze_stats es;
	cJSON *tiers = cJSON_AddObjectToObject(root, "tiers");
	cJSON *pinned, *shm;

	if (tiers == NULL)
		return;
	ze_engine_arena_stats(d->engine, &as);
	ze_engine_stats(d->engine, &es);
	pinned = cJSON_AddObjectToObject(tiers, "pinned");
	if (pinned != NULL) {
		cJSON_AddNumberToObject(pinned, "budget_bytes", (double)as.budget_bytes);
		cJSON_AddNumberToObject(pinned, "used_bytes", (double)as.used_bytes);
		cJSON_AddNumberToObject(pinned, "locked_bytes", (double)as.pinned_bytes);
		cJSON_AddNumberToObject(pinned, "unlocked_bytes", (double)as.unpinned_bytes);
		cJSON_AddNumberToObject(pinned, "allocations", (double)as.allocations);
		cJSON_AddNumberToObject(pinned, "memlock_limit_bytes", as.memlock_limit == UINT64_MAX ?
		    -1 : (double)as.memlock_limit);
		cJSON_AddNumberToObject(pinned, "numa_node", as.numa_node);
	}
	add_nvme(tiers, d);
	shm = cJSON_AddObjectToObject(tiers, "shm");
	if (shm != NULL) {
		cJSON_AddNumberToObject(shm, "budget_bytes", (double)es.shm_budget);
		cJSON_AddNumberToObject(shm, "used_bytes", (double)es.shm_bytes);
		cJSON_AddNumberToObject(shm, "objects", es.shm_objects);
	}
}

static void
add_malloc(cJSON *root)
{
	cJSON *m = cJSON_AddObjectToObject(root, "malloc");

	if (m == NULL)
		return;
#if HAVE_JEMALLOC
	uint64_t epoch = 1;
	size_t resident = 0, allocated = 0, len = sizeof(size_t);

	/* jemalloc's statistics are a snapshot taken at the last epoch bump. */
	mallctl("epoch", &epoch, &(size_t){ sizeof(epoch) }, &epoch, sizeof(epoch));
	mallctl("stats.resident", &resident, &len, NULL, 0);
	len = sizeof(size_t);
	mallctl("stats.allocated", &allocated, &len, NULL, 0);
	cJSON_AddStringToObject(m, "allocator", "jemalloc");
	cJSON_AddNumberToObject(m, "resident_bytes", (double)resident);
	cJSON_AddNumberToObject(m, "allocated_bytes", (double)allocated);
#else
	cJSON_AddStringToObject(m, "allocator", "libc");
#endif
}

static cJSON *
job_json(const struct zd_job *job)
{
	cJSON *j = cJSON_CreateObject();
	uint64_t pinned, nvme;

	if (j == NULL)
		return NULL;
	ze_account_usage(job->account, &pinned, &nvme);
	cJSON_AddNumberToObject(j, "id", (double)job->id);
	cJSON_AddStringToObject(j, "name", job->name);
	cJSON_AddNumberToObject(j, "uid", job->uid);
	cJSON_AddNumberToObject(j, "world_size", job->world_size);
	cJSON_AddNumberToObject(j, "ranks_attached", job->ranks_attached);
	cJSON_AddNumberToObject(j, "ranks_detached", zd_job_detached_ranks(job));
	cJSON_AddNumberToObject(j, "tensors_detached", job->ndetached);
	cJSON_AddStringToObject(j, "policy", job->policy == ZP_POLICY_CPU ? "cpu" :
	    job->policy == ZP_POLICY_NVME ? "nvme" : "auto");
	cJSON_AddNumberToObject(j, "pinned_bytes", (double)pinned);
	cJSON_AddNumberToObject(j, "nvme_bytes", (double)nvme);
	cJSON_AddNumberToObject(j, "tensors", (double)job->tensors);
	cJSON_AddNumberToObject(j, "params", (double)job->params);
	/* What the format keeps per step, and what it saves against fp32's 12 bytes a parameter. */
	cJSON_AddStringToObject(j, "state_format",
	    zk_state_format_name((enum zk_state_format)job->state_format));
	cJSON_AddNumberToObject(j, "state_bytes", (double)job->state_bytes);
	cJSON_AddNumberToObject(j, "state_bytes_saved",
	    (double)(job->params * ZE_STATE_BYTES_PER_ELEMENT - job->state_bytes));
	cJSON_AddNumberToObject(j, "steps_applied", (double)job->steps_applied);
	cJSON_AddNumberToObject(j, "steps_skipped", (double)job->steps_skipped);
	cJSON_AddNumberToObject(j, "steps_failed", (double)job->steps_failed);
	cJSON_AddNumberToObject(j, "last_step", (double)job->last_step);
	return j;
}

static cJSON *
jobs_array(const struct zd_daemon *d, const struct zd_uid *viewer)
{
	cJSON *jobs = cJSON_CreateArray();
	const struct zd_job *job;

	if (jobs == NULL)
		return NULL;
	if (sees_all(viewer)) {
		TAILQ_FOREACH(job, &d->jobs, entry)
			cJSON_AddItemToArray(jobs, job_json(job));
	} else {
		TAILQ_FOREACH(job, &viewer->job_list, uid_entry)
			cJSON_AddItemToArray(jobs, job_json(job));
	}
	return jobs;
}

static char *
print_and_free(cJSON *root)
{
	char *text = cJSON_PrintUnformatted(root);

	cJSON_Delete(root);
	return text;
}

char *
zd_stats_json(struct zd_daemon *d)
{
	cJSON *root = zd_stats_tree(d);

	return root != NULL ? print_and_free(root) : NULL;
}

char *
zd_jobs_json(struct zd_daemon *d)
{
	return zd_jobs_json_as(d, NULL);
}

cJSON *
zd_stats_tree(struct zd_daemon *d)
{
	return zd_stats_tree_as(d, NULL);
}

char *
zd_stats_json_as(struct zd_daemon *d, const struct zd_uid *viewer)
{
	cJSON *root = zd_stats_tree_as(d, viewer);

	return root != NULL ? print_and_free(root) : NULL;
}

cJSON *
zd_stats_tree_as(struct zd_daemon *d, const struct zd_uid *viewer)
{
	cJSON *root = cJSON_CreateObject();

	if (root == NULL)
		return NULL;
	cJSON_AddStringToObject(root, "version", ZOFFLOAD_VERSION);
	cJSON_AddNumberToObject(root, "pid", (double)getpid());
	cJSON_AddNumberToObject(root, "uptime_s", (double)(zu_now_ns() - d->started_ns) / 1e9);
	cJSON_AddStringToObject(root, "kernel_isa", zk_isa_name(d->isa));
	cJSON_AddStringToObject(root, "log_level", log_level_name(d->cfg.log_level));
	cJSON_AddNumberToObject(root, "worker_threads", d->cfg.worker_threads);
	cJSON_AddNumberToObject(root, "sessions", d->nsessions);
	cJSON_AddNumberToObject(root, "tensors", (double)d->tensors_total);
	cJSON_AddNumberToObject(root, "params", (double)d->params_total);
	add_tiers(root, d);
	add_malloc(root);
	add_steps(root, d);
	add_pipeline(root, d);
	cJSON_AddNumberToObject(root, "jobs_total", d->njobs);
	zd_ckpt_stats_json(root, d);
	add_uids(root, d, viewer);
	add_limits(root, d);
	cJSON_AddItemToObject(root, "jobs", jobs_array(d, viewer));
	return root;
}

char *
zd_jobs_json_as(struct zd_daemon *d, const struct zd_uid *viewer)
{
	cJSON *root = cJSON_CreateObject();

	if (root == NULL)
		return NULL;
	cJSON_AddItemToObject(root, "jobs", jobs_array(d, viewer));
	return print_and_free(root);
}
