/* What zoffctl stats and zoffctl jobs show: tiers, jobs, sessions, step throughput and latency. */
#ifndef ZD_STATS_H
#define ZD_STATS_H

#include <stdint.h>

struct zd_daemon;
struct zd_uid;
struct cJSON;
struct ze_step_result;

/* Rolling step statistics for zoffctl stats. */
#define ZD_RATE_BUCKETS 64
#define ZD_LATENCY_SAMPLES 256
struct zd_step_stats {
	uint64_t batches_applied;
	uint64_t batches_skipped;
	uint64_t batches_failed;
	uint64_t tensors_stepped;
	uint64_t params_stepped;
	uint64_t compute_ns;
	uint64_t rate_second[ZD_RATE_BUCKETS];	/* which second each bucket holds */
	uint64_t rate_params[ZD_RATE_BUCKETS];
	uint64_t latency_ns[ZD_LATENCY_SAMPLES];
	uint64_t latency_count;
};

void zd_stats_record(struct zd_daemon *d, const struct ze_step_result *r);
/* As root sees them: every job and uid. */
char *zd_stats_json(struct zd_daemon *d);
char *zd_jobs_json(struct zd_daemon *d);
/*
 * As viewer sees them: a uid other than root gets its own jobs and uid, and
 * the node's totals; the cost grows with what viewer holds, not others.
 */
char *zd_stats_json_as(struct zd_daemon *d, const struct zd_uid *viewer);
struct cJSON *zd_stats_tree_as(struct zd_daemon *d, const struct zd_uid *viewer);
char *zd_jobs_json_as(struct zd_daemon *d, const struct zd_uid *viewer);

#endif
