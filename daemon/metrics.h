/*
 * Prometheus text exposition of the daemon's statistics, served over HTTP
 * (libevent's evhttp) on metrics.listen: a Unix socket or a loopback TCP port.
 *
 * The exposition is built from the same cJSON tree zoffctl stats prints
 * (zd_stats_tree), never from the daemon's structs, so the two always agree.
 */
#ifndef ZD_METRICS_H
#define ZD_METRICS_H

#include <stddef.h>

#include "config.h"	/* struct zd_metrics_addr */

struct cJSON;
struct event_base;
struct zd_daemon;
struct zd_metrics;

/* stats.c: the tree zd_stats_json prints; the caller frees it (cJSON_Delete). */
struct cJSON *zd_stats_tree(struct zd_daemon *d);

/*
 * Renders stats (a zd_stats_tree) as Prometheus text format 0.0.4.  Per-job
 * series are bounded: the max_jobs jobs holding the most state keep their own
 * labels, the rest are summed under job="other".  Returns a malloc'd string
 * (length in *len), or NULL when out of memory.
 */
char *zd_metrics_render(const struct cJSON *stats, unsigned max_jobs, size_t *len);

/*
 * Starts serving GET /metrics on d->cfg.metrics_listen in base.  *ret stays
 * NULL when metrics are off.  -errno (logged) when the address cannot be bound.
 */
int zd_metrics_start(struct zd_daemon *d, struct event_base *base, struct zd_metrics **ret);
/* Stops serving and removes a Unix socket it made; NULL is fine. */
void zd_metrics_free(struct zd_metrics *m);

#endif
