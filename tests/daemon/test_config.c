/* zoffloadd's configuration: defaults, a full file, and errors that name the file, the key and the value. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include "build_config.h"
#include "config.h"
#include "swap.h"

static struct zd_config cfg;
static char err[512];
static char tmpdir[] = "/tmp/zoff-config-XXXXXX";
static char path[64];

static void
setup(void)
{
	cr_assert_eq(zd_config_defaults(&cfg), 0);
	err[0] = '\0';
	cr_assert_not_null(mkdtemp(tmpdir));
	snprintf(path, sizeof(path), "%s/zoffload.conf", tmpdir);
}

static void
teardown(void)
{
	zd_config_clear(&cfg);
	unlink(path);
	rmdir(tmpdir);
}

TestSuite(config, .init = setup, .fini = teardown);

static void
write_file(const char *text)
{
	FILE *f = fopen(path, "w");

	cr_assert_not_null(f);
	cr_assert_eq(fputs(text, f) >= 0, 1);
	cr_assert_eq(fclose(f), 0);
}

/* Parsing text must fail, and the message must contain every one of the NULL-terminated words. */
static void
expect_error(const char *text, ...)
{
	va_list ap;
	const char *word;
	int r;

	/* A refused file may leave cfg half-applied (main exits then): start each case afresh. */
	zd_config_clear(&cfg);
	cr_assert_eq(zd_config_defaults(&cfg), 0);
	r = zd_config_parse(text, "/etc/zoffload-test.conf", &cfg, err, sizeof(err));
	cr_assert_eq(r, -EINVAL, "accepted: %s", text);
	cr_assert(strstr(err, "/etc/zoffload-test.conf") != NULL, "'%s' does not name the file", err);
	va_start(ap, text);
	while ((word = va_arg(ap, const char *)) != NULL)
		cr_assert(strstr(err, word) != NULL, "'%s' does not mention %s", err, word);
	va_end(ap);
}

Test(config, defaults)
{
	struct sysinfo si;
	uint64_t ram;

	cr_assert_eq(sysinfo(&si), 0);
	ram = (uint64_t)si.totalram * si.mem_unit;
	cr_assert_str_eq(cfg.source, "built-in defaults");
	cr_assert_str_eq(cfg.socket_path, ZOFFLOAD_DEFAULT_SOCKET);
	cr_assert_eq(cfg.socket_mode, 0660);
	cr_assert_null(cfg.socket_group);
	/* Half of RAM, measured here independently (sysinfo, not sysconf). */
	cr_assert_eq(cfg.pinned_budget, ram / 2, "%llu vs %llu",
	    (unsigned long long)cfg.pinned_budget, (unsigned long long)(ram / 2));
	cr_assert_eq(cfg.shm_budget, ram / 2);
	cr_assert_eq(cfg.numa_node, -1);
	cr_assert_not(cfg.require_pinned);
	cr_assert(cfg.hugepages);
	cr_assert_eq(cfg.xfer_window, 16u << 20);
	cr_assert_eq(cfg.worker_threads, 0);
	cr_assert_eq(cfg.ncpus, 0);
	cr_assert_str_eq(cfg.isa, "auto");
	cr_assert_eq(cfg.nswap_paths, 0);
	cr_assert_eq(cfg.swap_block_size, 1u << 20);
	cr_assert_eq(cfg.swap_queue_depth, 32);
	cr_assert_str_eq(cfg.swap_engine, "auto");
	cr_assert(cfg.swap_fallback);
	cr_assert_eq(cfg.max_clients, 1024);
	cr_assert_eq(cfg.max_queued_messages, 8192);
	cr_assert_eq(cfg.max_queued_bytes, 16u << 20);
	cr_assert_eq(cfg.uid_queued_bytes, 64u << 20);
	cr_assert_eq(cfg.uid_max_tensors, 16384);
	cr_assert_eq(cfg.uid_max_fds, 0);
	cr_assert_eq(cfg.uid_shm_budget, 0);
	cr_assert_eq(cfg.uid_ckpt_buffer_budget, 384u << 20);
	cr_assert_eq(cfg.log_level, ZD_LOG_INFO);
}

/* The per-uid limits: sizes, counts, and a queue bound below 64 KiB refused by name. */
Test(config, per_uid_limits)
{
	cr_assert_eq(zd_config_parse("{\"limits\": {\"max_queued_bytes\": \"1M\", "
	    "\"uid_queued_bytes\": \"8M\", \"uid_max_tensors\": 7, \"uid_max_fds\": 300, "
	    "\"uid_shm_budget\": \"2G\", \"uid_ckpt_buffer_budget\": 0}}", "x.conf", &cfg, err,
	    sizeof(err)), 0, "%s", err);
	cr_assert_eq(cfg.max_queued_bytes, 1u << 20);
	cr_assert_eq(cfg.uid_queued_bytes, 8u << 20);
	cr_assert_eq(cfg.uid_max_tensors, 7);
	cr_assert_eq(cfg.uid_max_fds, 300);
	cr_assert_eq(cfg.uid_shm_budget, 2ull << 30);
	cr_assert_eq(cfg.uid_ckpt_buffer_budget, 0);
	expect_error("{\"limits\": {\"max_queued_bytes\": 1000}}", "limits.max_queued_bytes",
	    "1000", NULL);
	expect_error("{\"limits\": {\"uid_queued_bytes\": \"1K\"}}", "limits.uid_queued_bytes",
	    NULL);
	expect_error("{\"limits\": {\"uid_max_tensors\": -1}}", "limits.uid_max_tensors", NULL);
	expect_error("{\"limits\": {\"uid_max_fds\": \"many\"}}", "limits.uid_max_fds", "many",
	    NULL);
	expect_error("{\"limits\": {\"uid_shm_budget\": \"12Q\"}}", "limits.uid_shm_budget", "12Q",
	    NULL);
	expect_error("{\"limits\": {\"uid_ckpt_buffer_budget\": \"lots\"}}",
	    "limits.uid_ckpt_buffer_budget", "lots", NULL);
}

Test(config, full_file)
{
	write_file(
	    "{\n"
	    "  \"socket\": { \"path\": \"/run/zoff/test.sock\", \"mode\": \"0600\", \"group\": \"train\" },\n"
	    "  \"memory\": { \"pinned_budget\": \"12G\", \"numa_node\": 1, \"require_pinned\": true,\n"
	    "              \"hugepages\": false, \"shm_budget\": 1073741824, \"xfer_window\": \"64MiB\" },\n"
	    "  \"compute\": { \"worker_threads\": 6, \"cpus\": [0, 2, 4, 1023], \"isa\": \"scalar\" },\n"
	    "  \"swap\": { \"paths\": [ { \"path\": \"/nvme0/swap\", \"capacity\": \"100G\" },\n"
	    "                        { \"path\": \"/nvme1/swap\", \"capacity\": \"1T\" } ],\n"
	    "            \"block_size\": \"4M\", \"queue_depth\": 128, \"engine\": \"pthread\",\n"
	    "            \"fallback\": false },\n"
	    "  \"limits\": { \"max_clients\": 64, \"max_queued_messages\": 16 },\n"
	    "  \"log\": { \"level\": \"debug\" }\n"
	    "}\n");
	cr_assert_eq(zd_config_load(path, false, &cfg, err, sizeof(err)), 0, "%s", err);
	cr_assert_str_eq(cfg.source, path);
	cr_assert_str_eq(cfg.socket_path, "/run/zoff/test.sock");
	cr_assert_eq(cfg.socket_mode, 0600);
	cr_assert_str_eq(cfg.socket_group, "train");
	cr_assert_eq(cfg.pinned_budget, 12ull << 30);
	cr_assert_eq(cfg.numa_node, 1);
	cr_assert(cfg.require_pinned);
	cr_assert_not(cfg.hugepages);
	cr_assert_eq(cfg.shm_budget, 1ull << 30);
	cr_assert_eq(cfg.xfer_window, 64u << 20);
	cr_assert_eq(cfg.worker_threads, 6);
	cr_assert_eq(cfg.ncpus, 4);
	cr_assert_eq(cfg.cpus[0], 0);
	cr_assert_eq(cfg.cpus[1], 2);
	cr_assert_eq(cfg.cpus[2], 4);
	cr_assert_eq(cfg.cpus[3], 1023);
	cr_assert_str_eq(cfg.isa, "scalar");
	cr_assert_eq(cfg.nswap_paths, 2);
	cr_assert_str_eq(cfg.swap_paths[0].path, "/nvme0/swap");
	cr_assert_eq(cfg.swap_paths[0].capacity, 100ull << 30);
	cr_assert_str_eq(cfg.swap_paths[1].path, "/nvme1/swap");
	cr_assert_eq(cfg.swap_paths[1].capacity, 1ull << 40);
	cr_assert_eq(cfg.swap_block_size, 4u << 20);
	cr_assert_eq(cfg.swap_queue_depth, 128);
	cr_assert_str_eq(cfg.swap_engine, "pthread");
	cr_assert_not(cfg.swap_fallback);
	cr_assert_eq(cfg.max_clients, 64);
	cr_assert_eq(cfg.max_queued_messages, 16);
	cr_assert_eq(cfg.log_level, ZD_LOG_DEBUG);
}

/* A partial file changes only what it names. */
Test(config, partial_file_keeps_defaults)
{
	cr_assert_eq(zd_config_parse("{\"memory\": {\"numa_node\": 0}}", "x.conf", &cfg, err,
	    sizeof(err)), 0, "%s", err);
	cr_assert_eq(cfg.numa_node, 0);
	cr_assert_eq(cfg.socket_mode, 0660);
	cr_assert_str_eq(cfg.isa, "auto");
	cr_assert_eq(cfg.max_clients, 1024);
	cr_assert_str_eq(cfg.source, "x.conf");
	cr_assert_eq(zd_config_parse("{}", "empty.conf", &cfg, err, sizeof(err)), 0, "%s", err);
}

/* memory.state_format: fp32 unless set; a name the kernels do not know is refused with the list. */
Test(config, state_format)
{
	cr_assert_eq(cfg.state_format, 0, "the default is not fp32");
	cr_assert_eq(zd_config_parse("{\"memory\": {\"state_format\": \"q8-moments\"}}", "x.conf",
	    &cfg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(cfg.state_format, 2);
	cr_assert_eq(zd_config_parse("{\"memory\": {\"state_format\": \"bf16-moments\"}}",
	    "x.conf", &cfg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(cfg.state_format, 1);
	expect_error("{\"memory\": {\"state_format\": \"int4\"}}", "memory.state_format", "int4",
	    "\"fp32\", \"bf16-moments\", \"q8-moments\"", NULL);
	expect_error("{\"memory\": {\"state_format\": 8}}", "memory.state_format", NULL);
}

Test(config, missing_file)
{
	char missing[96];

	snprintf(missing, sizeof(missing), "%s/does-not-exist.conf", tmpdir);
	cr_assert_eq(zd_config_load(missing, false, &cfg, err, sizeof(err)), -ENOENT);
	cr_assert(strstr(err, missing) != NULL, "'%s' does not name the path", err);
	/* The default path may be absent: then the defaults stand. */
	err[0] = '\0';
	cr_assert_eq(zd_config_load(missing, true, &cfg, err, sizeof(err)), 0);
	cr_assert_str_eq(cfg.source, "built-in defaults");
	/* Other errors than absence are not excused by missing_ok. */
	cr_assert_lt(zd_config_load(tmpdir, true, &cfg, err, sizeof(err)), 0,
	    "a directory loaded as a config");
	cr_assert(strstr(err, tmpdir) != NULL, "'%s' does not name the path", err);
}

Test(config, unknown_keys)
{
	expect_error("{\"sockets\": {}}", "'sockets'", NULL);
	expect_error("{\"socket\": {\"pth\": \"/x\"}}", "socket.pth", NULL);
	expect_error("{\"memory\": {\"pinned\": \"1G\"}}", "memory.pinned", NULL);
	expect_error("{\"compute\": {\"threads\": 2}}", "compute.threads", NULL);
	expect_error("{\"swap\": {\"paths\": [{\"path\": \"/a\", \"capacity\": \"1G\", \"size\": 1}]}}",
	    "swap.paths[].size", NULL);
	expect_error("{\"log\": {\"lvl\": \"info\"}}", "log.lvl", NULL);
	/* Keys are case-sensitive: a misspelt case is a typo too. */
	expect_error("{\"Socket\": {}}", "Socket", NULL);
}

/* Through the file loader, the message names the file it read. */
Test(config, unknown_key_names_file)
{
	write_file("{\"socket\": {\"pth\": \"/x\"}}");
	cr_assert_eq(zd_config_load(path, false, &cfg, err, sizeof(err)), -EINVAL);
	cr_assert(strstr(err, path) != NULL, "'%s' does not name %s", err, path);
	cr_assert(strstr(err, "socket.pth") != NULL, "'%s'", err);
}

Test(config, bad_values)
{
	expect_error("{\"socket\": {\"mode\": \"0999\"}}", "socket.mode", "0999", NULL);
	expect_error("{\"socket\": {\"mode\": \"01000\"}}", "socket.mode", "01000", NULL);
	expect_error("{\"socket\": {\"mode\": 660}}", "socket.mode", "660", NULL);
	expect_error("{\"socket\": {\"path\": \"\"}}", "socket.path", NULL);
	expect_error("{\"memory\": {\"numa_node\": -2}}", "memory.numa_node", "-2", NULL);
	expect_error("{\"memory\": {\"numa_node\": 1.5}}", "memory.numa_node", "1.5", NULL);
	expect_error("{\"memory\": {\"pinned_budget\": \"12Q\"}}", "memory.pinned_budget", "12Q",
	    NULL);
	expect_error("{\"memory\": {\"pinned_budget\": \"512K\"}}", "memory.pinned_budget",
	    "512K", NULL);
	expect_error("{\"memory\": {\"shm_budget\": -1}}", "memory.shm_budget", "-1", NULL);
	expect_error("{\"memory\": {\"xfer_window\": \"1G\"}}", "memory.xfer_window", NULL);
	expect_error("{\"memory\": {\"hugepages\": \"yes\"}}", "memory.hugepages", "yes", NULL);
	expect_error("{\"compute\": {\"isa\": \"sse9\"}}", "compute.isa", "sse9", NULL);
	expect_error("{\"compute\": {\"worker_threads\": 5000}}", "compute.worker_threads", "5000",
	    NULL);
	expect_error("{\"compute\": {\"cpus\": [0, 1024]}}", "compute.cpus", "1024", NULL);
	expect_error("{\"compute\": {\"cpus\": \"0-3\"}}", "compute.cpus", "0-3", NULL);
	expect_error("{\"swap\": {\"paths\": [{\"path\": \"/nvme0/swap\"}]}}", "swap.paths[0]",
	    "capacity", NULL);
	expect_error("{\"swap\": {\"paths\": [{\"capacity\": \"1G\"}]}}", "swap.paths[0]", "path",
	    NULL);
	expect_error("{\"swap\": {\"block_size\": 12288}}", "swap.block_size", "12288", NULL);
	expect_error("{\"swap\": {\"engine\": \"aio\"}}", "swap.engine", "aio", NULL);
	expect_error("{\"limits\": {\"max_clients\": 0}}", "limits.max_clients", "0", NULL);
	expect_error("{\"log\": {\"level\": \"loud\"}}", "log.level", "loud", NULL);
	expect_error("{\"memory\": 5}", "'memory'", NULL);
	expect_error("[1, 2]", "top level", NULL);
}

Test(config, not_json_names_line)
{
	expect_error("{\n  \"socket\": {\n    \"path\": \"/x\",\n  }\n}\n", "line 4", "JSON", NULL);
	expect_error("socket = /x\n", "line 1", NULL);
	/* Something after the object is not JSON either. */
	expect_error("{}\n\n{}", "line 3", NULL);
}

Test(config, parse_size)
{
	static const struct { const char *text; uint64_t value; } good[] = {
		{ "0", 0 }, { "1024", 1024 }, { "4K", 4096 }, { "4k", 4096 },
		{ "512M", 512ull << 20 }, { "4G", 4ull << 30 }, { "4GB", 4ull << 30 },
		{ "4GiB", 4ull << 30 }, { "4gib", 4ull << 30 }, { "2T", 2ull << 40 },
		{ "16777215T", 16777215ull << 40 },
		{ "18446744073709551615", UINT64_MAX },
		/* Decimals: binary units, a whole number of bytes. */
		{ "4.5G", 9ull << 29 }, { "1.5G", 3ull << 29 }, { "0.5K", 512 },
		{ "1.25M", 5ull << 18 }, { "2.0", 2 }, { "1.5TiB", 3ull << 39 },
	};
	static const struct { const char *text; int error; } bad[] = {
		{ "", -EINVAL }, { "-1", -EINVAL }, { " 4G", -EINVAL }, { "G", -EINVAL },
		{ "4X", -EINVAL }, { "4 G", -EINVAL }, { "4GiBs", -EINVAL }, { "4B", -EINVAL },
		{ "12Q", -EINVAL }, { "0x10", -EINVAL },
		{ "1.5", -EINVAL }, { "0.3K", -EINVAL }, { "1.", -EINVAL }, { ".5G", -EINVAL },
		{ "1.5.0G", -EINVAL }, { "1,5G", -EINVAL }, { "0.00000000000000000001T", -EINVAL },
		{ "18446744073709551616", -ERANGE }, { "16777216T", -ERANGE },
	};
	uint64_t v;

	for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
		v = 12345;
		cr_assert_eq(zd_parse_size(good[i].text, &v), 0, "'%s' refused", good[i].text);
		cr_assert_eq(v, good[i].value, "'%s' gave %llu", good[i].text, (unsigned long long)v);
	}
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		v = 12345;
		cr_assert_eq(zd_parse_size(bad[i].text, &v), bad[i].error, "'%s'", bad[i].text);
		cr_assert_eq(v, 12345, "'%s' wrote the result on failure", bad[i].text);
	}
	cr_assert_eq(zd_parse_size(NULL, &v), -EINVAL);
}

Test(config, parse_count_has_no_byte_units)
{
	uint64_t v = 0;

	cr_assert_eq(zd_parse_count("4M", &v), 0);
	cr_assert_eq(v, 4ull << 20);
	cr_assert_eq(zd_parse_count("1.5K", &v), 0);
	cr_assert_eq(v, 1536);
	cr_assert_eq(zd_parse_count("4MiB", &v), -EINVAL);
	cr_assert_eq(zd_parse_count("4MB", &v), -EINVAL);
}

Test(config, decimal_sizes_in_a_file)
{
	cr_assert_eq(zd_config_parse("{\"memory\": {\"pinned_budget\": \"1.5G\"}}", "t.conf", &cfg,
	    err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(cfg.pinned_budget, 3ull << 29);
	expect_error("{\"memory\": {\"pinned_budget\": \"1.1\"}}", "memory.pinned_budget", "\"1.1\"",
	    "2^30", NULL);
}

/* A key given twice would have its second value silently ignored. */
Test(config, duplicate_keys)
{
	expect_error("{\"log\": {\"level\": \"info\"}, \"log\": {\"level\": \"debug\"}}", "'log'",
	    "twice", NULL);
	expect_error("{\"memory\": {\"pinned_budget\": \"1G\", \"pinned_budget\": \"2G\"}}",
	    "'memory.pinned_budget'", "twice", NULL);
	expect_error("{\"swap\": {\"paths\": [{\"path\": \"/a\", \"capacity\": \"1G\", "
	    "\"path\": \"/b\"}]}}", "'swap.paths[].path'", "twice", NULL);
	/* The same key in two different objects is fine. */
	cr_assert_eq(zd_config_parse("{\"swap\": {\"paths\": [{\"path\": \"/a\", \"capacity\": "
	    "\"1G\"}, {\"path\": \"/b\", \"capacity\": \"1G\"}]}}", "t.conf", &cfg, err,
	    sizeof(err)), 0, "%s", err);
}

Test(config, chunk_elements_speaks_of_elements)
{
	expect_error("{\"swap\": {\"chunk_elements\": 1500}}", "swap.chunk_elements",
	    "1500 elements", "multiple of 1024 elements", NULL);
	cr_assert(strstr(err, "bytes") == NULL, "'%s' speaks of bytes", err);
	expect_error("{\"swap\": {\"chunk_elements\": \"4MiB\"}}", "swap.chunk_elements",
	    "number of elements", NULL);
	expect_error("{\"swap\": {\"chunk_elements\": 512}}", "at least 1024 elements", NULL);
	cr_assert(strstr(err, "bytes") == NULL, "'%s' speaks of bytes", err);
	cr_assert_eq(zd_config_parse("{\"swap\": {\"chunk_elements\": \"1M\"}}", "t.conf", &cfg,
	    err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(cfg.chunk_elements, 1u << 20);
}

Test(config, allow_memory_fs)
{
	cr_assert_eq(cfg.swap_allow_memory_fs, false);
	cr_assert_eq(zd_config_parse("{\"swap\": {\"allow_memory_fs\": true}}", "t.conf", &cfg,
	    err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(cfg.swap_allow_memory_fs, true);
	expect_error("{\"swap\": {\"allow_memory_fs\": 1}}", "swap.allow_memory_fs", NULL);
}

/* swap.paths of n paths /nvmeI/swap. */
static void
swap_paths_text(char *buf, size_t len, unsigned n)
{
	size_t at = (size_t)snprintf(buf, len, "{\"swap\": {\"paths\": [");

	for (unsigned i = 0; i < n; i++)
		at += (size_t)snprintf(buf + at, len - at, "%s{\"path\": \"/nvme%u/swap\", "
		    "\"capacity\": \"1G\"}", i > 0 ? ", " : "", i);
	snprintf(buf + at, len - at, "]}}");
}

/*
 * As many swap paths as the swap engine stripes over parse; one more is refused here, by
 * name, rather than accepted and then failing the daemon's start.
 */
Test(config, swap_paths_up_to_the_engines_limit)
{
	char text[4096], want[64];

	swap_paths_text(text, sizeof(text), ZS_MAX_PATHS);
	cr_assert_eq(zd_config_parse(text, "t.conf", &cfg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(cfg.nswap_paths, ZS_MAX_PATHS);
	swap_paths_text(text, sizeof(text), ZS_MAX_PATHS + 1);
	snprintf(want, sizeof(want), "more than %d paths", ZS_MAX_PATHS);
	expect_error(text, "swap.paths", want, NULL);
}
