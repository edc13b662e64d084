/* The metrics exposition from a stats tree: names, units, labels, bounded jobs; the listen address. */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "config.h"
#include "metrics.h"

/* A tree shaped like zd_stats_tree's, with figures easy to recognise. */
static const char *const stats_text =
    "{\"version\":\"0.1.0\",\"pid\":1,\"uptime_s\":12.5,\"kernel_isa\":\"avx2\","
    "\"log_level\":\"info\",\"worker_threads\":2,\"sessions\":3,\"tensors\":4,\"params\":5,"
    "\"tiers\":{\"pinned\":{\"budget_bytes\":1048576,\"used_bytes\":4096,\"locked_bytes\":4096,"
    "\"unlocked_bytes\":0,\"allocations\":1,\"memlock_limit_bytes\":-1,\"numa_node\":-1},"
    "\"nvme\":{\"engine\":\"io_uring\",\"queue_depth\":32,\"stripe_unit\":1048576,"
    "\"in_flight\":0,\"in_flight_peak\":7,\"retries\":0,\"short_ios\":0,\"paths\":["
    "{\"path\":\"/a \\\"q\\\"\",\"capacity_bytes\":1000,\"used_bytes\":100,\"read_bytes\":11,"
    "\"written_bytes\":22,\"read_bps\":1.5,\"write_bps\":2.5,\"in_flight\":0,\"errors_eio\":1,"
    "\"errors_enospc\":0,\"errors_other\":0},"
    "{\"path\":\"/b\",\"capacity_bytes\":3000,\"used_bytes\":200,\"read_bytes\":0,"
    "\"written_bytes\":0,\"read_bps\":0,\"write_bps\":0,\"in_flight\":0,\"errors_eio\":0,"
    "\"errors_enospc\":0,\"errors_other\":0}]},"
    "\"shm\":{\"budget_bytes\":2048,\"used_bytes\":1024,\"objects\":2}},"
    "\"malloc\":{\"allocator\":\"libc\"},"
    "\"steps\":{\"applied\":9,\"skipped_nonfinite\":1,\"failed\":0,\"in_flight\":0,"
    "\"tensors_stepped\":18,\"params_stepped\":900,\"params_per_s\":90,\"rate_window_s\":10,"
    "\"compute_params_per_s\":1000,\"latency_ms\":{\"samples\":10,\"last\":2,\"mean\":3,"
    "\"p50\":2,\"p99\":7,\"max\":8},\"latency_histogram\":{\"le_s\":[0.001,0.01],"
    "\"counts\":[2,9],\"count\":10,\"sum_s\":0.03}},"
    "\"pipeline\":{\"tensor_steps_pinned\":6,\"tensor_steps_nvme\":12,"
    "\"state_bytes_stepped_pinned\":1200,\"state_bytes_stepped_nvme\":3600,\"pinned_hit_rate\":0.25,"
    "\"staging_buffers\":4,\"chunks_read\":3,\"chunks_written\":3,\"bytes_read\":300,"
    "\"bytes_written\":300,\"io_errors\":0,\"compute_waiting_on_io\":2,"
    "\"compute_waiting_on_io_ms\":1500,\"io_waiting_on_compute\":1,"
    "\"io_waiting_on_compute_ms\":250,\"staging_reading_ms\":40,"
    "\"staging_computing_ms\":5,\"staging_writing_ms\":2250,\"params\":{\"fetches\":4,\"hits\":3,\"misses\":1,"
    "\"hit_rate\":0.75,\"bytes_staged\":64,\"releases\":2,\"bytes_written_back\":32}},"
    "\"uids\":[{\"uid\":1000,\"sessions\":3,\"pinned_bytes\":4096,\"swap_bytes\":300}],"
    "\"limits\":{\"max_clients\":1024,\"max_clients_per_uid\":0,\"max_queued_messages\":8192,"
    "\"uid_pinned_budget\":0,\"uid_swap_budget\":0,\"detach_grace_s\":300},"
    "\"jobs\":[]}";

static char *
render(const char *jobs_json, unsigned max_jobs)
{
	cJSON *tree = cJSON_Parse(stats_text);
	size_t len = 0;
	char *text;

	cr_assert_not_null(tree);
	if (jobs_json != NULL) {
		cJSON *jobs = cJSON_Parse(jobs_json);

		cr_assert_not_null(jobs);
		cJSON_ReplaceItemInObjectCaseSensitive(tree, "jobs", jobs);
	}
	text = zd_metrics_render(tree, max_jobs, &len);
	cJSON_Delete(tree);
	cr_assert_not_null(text);
	cr_assert_eq(strlen(text), len);
	return text;
}

static void
expect_line(const char *text, const char *line)
{
	char *want;

	cr_assert(asprintf(&want, "\n%s\n", line) > 0);
	cr_assert(strstr(text, want) != NULL, "no line '%s' in:\n%s", line, text);
	free(want);
}

Test(metrics, figures_in_base_units)
{
	char *t = render(NULL, 20);

	expect_line(t, "zoffload_uptime_seconds 12.5");
	expect_line(t, "# TYPE zoffload_step_batches_total counter");
	expect_line(t, "zoffload_step_batches_total{status=\"applied\"} 9");
	expect_line(t, "zoffload_step_batches_total{status=\"skipped_nonfinite\"} 1");
	/* Milliseconds in the stats, seconds in the metrics. */
	expect_line(t, "zoffload_step_latency_recent_seconds{stat=\"p99\"} 0.007");
	expect_line(t, "zoffload_pipeline_stall_seconds_total{waiting=\"compute_on_io\"} 1.5");
	expect_line(t, "zoffload_pipeline_staging_seconds_total{phase=\"reading\"} 0.04");
	expect_line(t, "zoffload_pipeline_staging_seconds_total{phase=\"computing\"} 0.005");
	expect_line(t, "zoffload_pipeline_staging_seconds_total{phase=\"writing\"} 2.25");
	expect_line(t, "zoffload_pinned_memlock_limit_bytes +Inf");
	expect_line(t, "zoffload_tier_used_bytes{tier=\"pinned\"} 4096");
	/* The NVMe tier's totals are summed over its paths. */
	expect_line(t, "zoffload_tier_used_bytes{tier=\"nvme\"} 300");
	expect_line(t, "zoffload_tier_capacity_bytes{tier=\"nvme\"} 4000");
	expect_line(t, "zoffload_param_fetches_total{result=\"miss\"} 1");
	expect_line(t, "zoffload_stepped_state_bytes_total{tier=\"nvme\"} 3600");
	expect_line(t, "zoffload_pipeline_pinned_hit_ratio 0.25");
	expect_line(t, "zoffload_uid_state_bytes{uid=\"1000\",tier=\"nvme\"} 300");
	expect_line(t, "zoffload_info{version=\"0.1.0\",kernel_isa=\"avx2\",log_level=\"info\","
	    "swap_engine=\"io_uring\",allocator=\"libc\"} 1");
	/* Absent figures (jemalloc's, with libc) are left out, not reported as 0. */
	cr_assert(strstr(t, "\nzoffload_malloc_resident_bytes ") == NULL);
	free(t);
}

Test(metrics, histogram_is_cumulative_with_inf)
{
	char *t = render(NULL, 20);

	expect_line(t, "# TYPE zoffload_step_latency_seconds histogram");
	expect_line(t, "zoffload_step_latency_seconds_bucket{le=\"0.001\"} 2");
	expect_line(t, "zoffload_step_latency_seconds_bucket{le=\"0.01\"} 9");
	expect_line(t, "zoffload_step_latency_seconds_bucket{le=\"+Inf\"} 10");
	expect_line(t, "zoffload_step_latency_seconds_sum 0.03");
	expect_line(t, "zoffload_step_latency_seconds_count 10");
	free(t);
}

Test(metrics, label_values_escaped)
{
	char *t = render(NULL, 20);

	expect_line(t, "zoffload_swap_path_errors_total{path=\"/a \\\"q\\\"\",error=\"eio\"} 1");
	expect_line(t, "zoffload_swap_path_bytes_per_second{path=\"/b\",direction=\"write\"} 0");
	free(t);
}

static char *
jobs_json(unsigned n)
{
	size_t cap = 320 * n + 16, off = 0;
	char *s = malloc(cap);

	cr_assert_not_null(s);
	off += (size_t)snprintf(s + off, cap - off, "[");
	for (unsigned i = 0; i < n; i++)
		off += (size_t)snprintf(s + off, cap - off,
		    "%s{\"id\":%u,\"name\":\"job%u\",\"uid\":%u,\"world_size\":2,"
		    "\"ranks_attached\":2,\"ranks_detached\":0,\"tensors_detached\":0,"
		    "\"policy\":\"auto\",\"pinned_bytes\":%u,\"nvme_bytes\":0,\"tensors\":1,"
		    "\"params\":10,\"state_format\":\"%s\",\"state_bytes_saved\":%u,"
		    "\"steps_applied\":%u,\"steps_skipped\":0,\"steps_failed\":0,"
		    "\"last_step\":%u}", i ? "," : "", i + 1, i, 1000 + i, (i + 1) * 4096,
		    i % 2 ? "q8-moments" : "fp32", i % 2 ? 59 : 0, i, i * 10);
	snprintf(s + off, cap - off, "]");
	return s;
}

static unsigned
count_lines(const char *text, const char *prefix)
{
	unsigned n = 0;
	size_t len = strlen(prefix);

	for (const char *p = text; p != NULL && *p != '\0'; p = strchr(p, '\n'), p = p ? p + 1 : p)
		n += strncmp(p, prefix, len) == 0;
	return n;
}

Test(metrics, jobs_bounded_heaviest_kept_rest_other)
{
	char *j = jobs_json(30), *t = render(j, 5);

	/* Five own series plus "other", whatever the number of jobs. */
	cr_assert_eq(count_lines(t, "zoffload_job_params{"), 6, "%s", t);
	cr_assert_eq(count_lines(t, "zoffload_job_info{"), 5);
	/* The heaviest (most pinned bytes) keep their names. */
	expect_line(t, "zoffload_job_params{job=\"job29\",uid=\"1029\"} 10");
	cr_assert(strstr(t, "job=\"job0\"") == NULL);
	/* 25 jobs folded: sums, but the highest last step. */
	expect_line(t, "zoffload_job_params{job=\"other\",uid=\"\"} 250");
	expect_line(t, "zoffload_job_last_step{job=\"other\",uid=\"\"} 240");
	expect_line(t, "zoffload_job_steps_total{job=\"other\",uid=\"\",status=\"applied\"} 300");
	expect_line(t, "zoffload_jobs{set=\"all\"} 30");
	expect_line(t, "zoffload_jobs{set=\"other\"} 25");
	free(t);
	free(j);
}

Test(metrics, few_jobs_no_other)
{
	char *j = jobs_json(2), *t = render(j, 5);

	cr_assert_eq(count_lines(t, "zoffload_job_params{"), 2);
	cr_assert(strstr(t, "{job=\"other\"") == NULL);
	expect_line(t, "zoffload_job_info{job=\"job1\",uid=\"1001\",policy=\"auto\","
	    "state_format=\"q8-moments\"} 1");
	expect_line(t, "zoffload_job_info{job=\"job0\",uid=\"1000\",policy=\"auto\","
	    "state_format=\"fp32\"} 1");
	expect_line(t, "zoffload_job_state_saved_bytes{job=\"job1\",uid=\"1001\"} 59");
	expect_line(t, "zoffload_job_state_bytes{job=\"job1\",uid=\"1001\",tier=\"pinned\"} 8192");
	free(t);
	free(j);
}

/* Every family has HELP and TYPE once, and each sample's family was declared before it. */
Test(metrics, every_sample_declared_once)
{
	char *j = jobs_json(3), *t = render(j, 2), *save = NULL, *copy = strdup(t);
	char declared[256][80];
	unsigned ndeclared = 0;

	for (char *line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char name[80];

		if (sscanf(line, "# TYPE %79s", name) == 1) {
			for (unsigned i = 0; i < ndeclared; i++)
				cr_assert_str_neq(declared[i], name, "%s declared twice", name);
			cr_assert_lt(ndeclared, 256);
			snprintf(declared[ndeclared++], sizeof(declared[0]), "%s", name);
			continue;
		}
		if (line[0] == '#')
			continue;
		sscanf(line, "%79[^{ ]", name);
		cr_assert_gt(ndeclared, 0);
		cr_assert(strncmp(name, declared[ndeclared - 1], strlen(declared[ndeclared - 1])) == 0,
		    "sample %s outside its family %s", name, declared[ndeclared - 1]);
	}
	free(copy);
	free(t);
	free(j);
}

Test(metrics, listen_forms)
{
	struct zd_metrics_addr a;
	char err[256];

	cr_assert_eq(zd_metrics_parse_listen("unix:/run/zoffload/metrics.sock", &a, err,
	    sizeof(err)), 0);
	cr_assert_eq(a.family, AF_UNIX);
	cr_assert_str_eq(a.path, "/run/zoffload/metrics.sock");
	cr_assert_eq(zd_metrics_parse_listen("127.0.0.1:9464", &a, err, sizeof(err)), 0);
	cr_assert_eq(a.family, AF_INET);
	cr_assert_eq(a.port, 9464);
	cr_assert_eq(zd_metrics_parse_listen("[::1]:9464", &a, err, sizeof(err)), 0);
	cr_assert_eq(a.family, AF_INET6);
	cr_assert_str_eq(a.host, "::1");
	cr_assert_eq(zd_metrics_parse_listen("localhost:0", &a, err, sizeof(err)), 0);
	cr_assert_str_eq(a.host, "127.0.0.1");
}

Test(metrics, listen_refuses_non_loopback_and_junk)
{
	static const char *const bad[] = { "0.0.0.0:9464", "10.1.2.3:9464", "[::]:9464",
		"9464", "127.0.0.1:", "127.0.0.1:70000", "127.0.0.1:-1", "unix:relative.sock",
		"[::1:9464", "example.com:9464" };
	struct zd_metrics_addr a;
	char err[256];

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		err[0] = '\0';
		cr_assert_eq(zd_metrics_parse_listen(bad[i], &a, err, sizeof(err)), -EINVAL,
		    "accepted %s", bad[i]);
		cr_assert(strstr(err, bad[i]) != NULL, "'%s' does not name '%s'", err, bad[i]);
	}
	zd_metrics_parse_listen("0.0.0.0:1", &a, err, sizeof(err));
	cr_assert(strstr(err, "loopback") != NULL, "%s", err);
}

Test(metrics, config_keys)
{
	struct zd_config cfg;
	char err[512];

	cr_assert_eq(zd_config_defaults(&cfg), 0);
	cr_assert_null(cfg.metrics_listen, "metrics must be off by default");
	cr_assert_eq(zd_config_parse("{\"metrics\":{\"listen\":\"127.0.0.1:9464\",\"max_jobs\":3}}",
	    "t.conf", &cfg, err, sizeof(err)), 0, "%s", err);
	cr_assert_str_eq(cfg.metrics_listen, "127.0.0.1:9464");
	cr_assert_eq(cfg.metrics_max_jobs, 3);
	cr_assert_eq(zd_config_parse("{\"metrics\":{\"listen\":\"0.0.0.0:9464\"}}", "t.conf", &cfg,
	    err, sizeof(err)), -EINVAL);
	cr_assert(strstr(err, "t.conf: metrics.listen") != NULL, "%s", err);
	zd_config_clear(&cfg);
}
