/* zoffloadd's configuration: built-in defaults, /etc/zoffload.conf (JSON), validation. */
#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <ctype.h>
#include <stdbool.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "config.h"
#include "build_config.h"
#include "engine.h"
#include "quant.h"
#include "swap.h"

_Static_assert(ZS_MAX_PATHS <= ZD_MAX_SWAP_PATHS, "the recovery table has a slot for "
    "every swap path the configuration takes");

struct parse_ctx {
	const char *source;
	char *err;
	size_t errlen;
	int status;
};

static int
perr(struct parse_ctx *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int
perr(struct parse_ctx *ctx, const char *fmt, ...)
{
	va_list ap;
	int n;

	if (ctx->status != 0)
		return ctx->status;
	n = snprintf(ctx->err, ctx->errlen, "%s: ", ctx->source);
	if (n >= 0 && (size_t)n < ctx->errlen) {
		va_start(ap, fmt);
		vsnprintf(ctx->err + n, ctx->errlen - (size_t)n, fmt, ap);
		va_end(ap);
	}
	ctx->status = -EINVAL;
	return ctx->status;
}

/*
 * "4G", "1.5T", "512M", "1048576": digits, an optional decimal part, an
 * optional unit.  Every unit is binary (K = 2^10 ... T = 2^40) whether written
 * K, KB or KiB.  allow_bytes_suffix: "KB"/"KiB" spellings are accepted (not
 * for counts of elements).  The result must be a whole number.
 */
/* Wide enough for a 19-digit fraction times 2^40. */
__extension__ typedef unsigned __int128 u128;

static int
parse_scaled(const char *text, bool allow_bytes_suffix, uint64_t *ret)
{
	const char *p = text;
	u128 whole = 0, frac = 0, denom = 1, v;
	uint64_t mult = 1;

	if (text == NULL || !isdigit((unsigned char)*p))
		return -EINVAL;
	for (; isdigit((unsigned char)*p); p++) {
		whole = whole * 10 + (unsigned)(*p - '0');
		if (whole > UINT64_MAX)
			return -ERANGE;
	}
	if (*p == '.') {
		p++;
		if (!isdigit((unsigned char)*p))
			return -EINVAL;
		for (; isdigit((unsigned char)*p); p++) {
			/* 19 places are below a byte of the largest unit. */
			if (denom >= 10000000000000000000ull)
				return -EINVAL;
			frac = frac * 10 + (unsigned)(*p - '0');
			denom *= 10;
		}
	}
	switch (toupper((unsigned char)*p)) {
	case '\0': break;
	case 'K': mult = 1ull << 10; p++; break;
	case 'M': mult = 1ull << 20; p++; break;
	case 'G': mult = 1ull << 30; p++; break;
	case 'T': mult = 1ull << 40; p++; break;
	default: return -EINVAL;
	}
	if (allow_bytes_suffix && mult != 1 && (strcasecmp(p, "iB") == 0 || strcasecmp(p, "B") == 0))
		p += strlen(p);
	if (*p != '\0')
		return -EINVAL;
	/* "1.5" bytes, "0.3K" (307.2 bytes): not a whole number. */
	if (frac * mult % denom != 0)
		return -EINVAL;
	v = whole * mult + frac * mult / denom;
	if (v > UINT64_MAX)
		return -ERANGE;
	*ret = (uint64_t)v;
	return 0;
}

int
zd_parse_size(const char *text, uint64_t *ret)
{
	return parse_scaled(text, true, ret);
}

int
zd_parse_count(const char *text, uint64_t *ret)
{
	return parse_scaled(text, false, ret);
}

int
zd_config_defaults(struct zd_config *cfg)
{
	long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
	uint64_t ram = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 8ull << 30;

	memset(cfg, 0, sizeof(*cfg));
	cfg->source = strdup("built-in defaults");
	cfg->socket_path = strdup(ZOFFLOAD_DEFAULT_SOCKET);
	cfg->socket_mode = 0660;
	cfg->pinned_budget = ram / 2;
	cfg->numa_node = -1;
	cfg->hugepages = true;
	cfg->shm_budget = ram / 2;
	cfg->xfer_window = 16ull << 20;
	cfg->isa = strdup("auto");
	cfg->swap_block_size = 1ull << 20;
	cfg->swap_queue_depth = 32;
	cfg->swap_engine = strdup("auto");
	cfg->swap_fallback = true;
	cfg->staging_buffers = 4;
	cfg->chunk_elements = 4u << 20;
	cfg->policy = 3;
	cfg->max_clients = 1024;
	/* A node's ranks and tools need a few each; one uid cannot take every connection. */
	cfg->max_clients_per_uid = 64;
	cfg->max_queued_messages = 8192;
	cfg->max_queued_bytes = 16ull << 20;
	cfg->uid_queued_bytes = 64ull << 20;
	cfg->uid_max_tensors = 16384;
	/*
	 * Three transfers at once (as a client saves) of state on NVMe in compressed form,
	 * two buffers each of a default chunk (48 MiB): no client that saves as libzclient
	 * does waits, and one uid's saves cannot take the node's memory.
	 */
	cfg->uid_ckpt_buffer_budget = 384ull << 20;
	cfg->detach_grace_s = 300;
	cfg->recovery_journal = true;
	cfg->log_level = ZD_LOG_INFO;
	cfg->metrics_max_jobs = 20;
	if (cfg->source == NULL || cfg->socket_path == NULL || cfg->isa == NULL ||
	    cfg->swap_engine == NULL) {
		zd_config_clear(cfg);
		return -ENOMEM;
	}
	return 0;
}

void
zd_config_clear(struct zd_config *cfg)
{
	free(cfg->source);
	free(cfg->socket_path);
	free(cfg->socket_group);
	free(cfg->isa);
	free(cfg->swap_engine);
	free(cfg->metrics_listen);
	for (unsigned i = 0; i < cfg->nswap_paths; i++)
		free(cfg->swap_paths[i].path);
	memset(cfg, 0, sizeof(*cfg));
}

/* Every key a section may hold; anything else is an error, so typos do not pass silently. */
static void
check_keys(struct parse_ctx *ctx, const cJSON *obj, const char *section,
    const char *const *allowed)
{
	const cJSON *item;

	cJSON_ArrayForEach(item, obj) {
		bool found = false;

		for (const char *const *a = allowed; *a != NULL; a++)
			if (strcmp(item->string, *a) == 0)
				found = true;
		if (!found) {
			perr(ctx, "unknown key '%s%s%s'", section, *section ? "." : "",
			    item->string);
			return;
		}
	}
}

/*
 * JSON allows a key twice and cJSON keeps both, but only the first is read:
 * the second would be silently ignored, so it is an error, named by its path.
 */
static void
check_duplicates(struct parse_ctx *ctx, const cJSON *node, const char *path)
{
	const cJSON *a, *b;

	for (a = node->child; a != NULL && ctx->status == 0; a = a->next) {
		char sub[256];

		if (cJSON_IsObject(node)) {
			for (b = a->next; b != NULL; b = b->next) {
				if (strcmp(a->string, b->string) == 0) {
					perr(ctx, "key '%s%s%s' appears twice", path, *path ? "." : "",
					    a->string);
					return;
				}
			}
			snprintf(sub, sizeof(sub), "%s%s%s", path, *path ? "." : "", a->string);
		} else {
			snprintf(sub, sizeof(sub), "%s[]", path);
		}
		if (cJSON_IsObject(a) || cJSON_IsArray(a))
			check_duplicates(ctx, a, sub);
	}
}

static const cJSON *
section(struct parse_ctx *ctx, const cJSON *root, const char *name)
{
	const cJSON *s = cJSON_GetObjectItemCaseSensitive(root, name);

	if (s != NULL && !cJSON_IsObject(s)) {
		perr(ctx, "'%s' must be an object", name);
		return NULL;
	}
	return s;
}

static char *
value_text(const cJSON *v)
{
	char *s = cJSON_PrintUnformatted(v);

	return s != NULL ? s : strdup("?");
}

static void
bad_value(struct parse_ctx *ctx, const char *sec, const cJSON *v, const char *expected)
{
	char *text = value_text(v);

	perr(ctx, "%s.%s: %s is not %s", sec, v->string, text, expected);
	free(text);
}

static void
get_string(struct parse_ctx *ctx, const cJSON *obj, const char *sec, const char *key,
    char **dst)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
	char *copy;

	if (v == NULL || ctx->status != 0)
		return;
	if (!cJSON_IsString(v) || v->valuestring[0] == '\0') {
		bad_value(ctx, sec, v, "a non-empty string");
		return;
	}
	copy = strdup(v->valuestring);
	if (copy == NULL) {
		ctx->status = -ENOMEM;
		return;
	}
	free(*dst);
	*dst = copy;
}

static void
get_bool(struct parse_ctx *ctx, const cJSON *obj, const char *sec, const char *key, bool *dst)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);

	if (v == NULL || ctx->status != 0)
		return;
	if (!cJSON_IsBool(v)) {
		bad_value(ctx, sec, v, "true or false");
		return;
	}
	*dst = cJSON_IsTrue(v);
}

static void
get_int(struct parse_ctx *ctx, const cJSON *obj, const char *sec, const char *key, long min,
    long max, long *dst)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
	char expected[96];

	if (v == NULL || ctx->status != 0)
		return;
	/* Range first: converting 1e300 to long is undefined behaviour (found by fuzz_config). */
	if (!cJSON_IsNumber(v) || v->valuedouble < (double)min || v->valuedouble > (double)max ||
	    v->valuedouble != (double)(long)v->valuedouble) {
		snprintf(expected, sizeof(expected), "an integer from %ld to %ld", min, max);
		bad_value(ctx, sec, v, expected);
		return;
	}
	*dst = (long)v->valuedouble;
}

static void
get_unsigned(struct parse_ctx *ctx, const cJSON *obj, const char *sec, const char *key,
    unsigned min, unsigned max, unsigned *dst)
{
	long v = *dst;

	get_int(ctx, obj, sec, key, min, max, &v);
	*dst = (unsigned)v;
}

static void
get_size(struct parse_ctx *ctx, const cJSON *obj, const char *sec, const char *key,
    uint64_t min, uint64_t *dst)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
	uint64_t size;

	if (v == NULL || ctx->status != 0)
		return;
	if (cJSON_IsNumber(v) && v->valuedouble >= 0 && v->valuedouble < 1.8e19 &&
	    v->valuedouble == (double)(uint64_t)v->valuedouble)
		size = (uint64_t)v->valuedouble;
	else if (!cJSON_IsString(v) || zd_parse_size(v->valuestring, &size) != 0) {
		bad_value(ctx, sec, v, "a size (bytes, or a number such as \"1.5G\" with K, M, G "
		    "or T: 2^10, 2^20, 2^30, 2^40 bytes)");
		return;
	}
	if (size < min) {
		char expected[64];

		snprintf(expected, sizeof(expected), "a size of at least %llu bytes",
		    (unsigned long long)min);
		bad_value(ctx, sec, v, expected);
		return;
	}
	*dst = size;
}

/* A count of things (elements): a number, or a string with K, M, G, T (powers of two). */
static void
get_count(struct parse_ctx *ctx, const cJSON *obj, const char *sec, const char *key,
    uint64_t min, const char *unit, uint64_t *dst)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
	char expected[128];
	uint64_t n;

	if (v == NULL || ctx->status != 0)
		return;
	if (cJSON_IsNumber(v) && v->valuedouble >= 0 && v->valuedouble < 1.8e19 &&
	    v->valuedouble == (double)(uint64_t)v->valuedouble)
		n = (uint64_t)v->valuedouble;
	else if (!cJSON_IsString(v) || zd_parse_count(v->valuestring, &n) != 0) {
		snprintf(expected, sizeof(expected), "a number of %s (a whole number, or one with K, "
		    "M, G: 2^10, 2^20, 2^30 %s)", unit, unit);
		bad_value(ctx, sec, v, expected);
		return;
	}
	if (n < min) {
		snprintf(expected, sizeof(expected), "at least %llu %s", (unsigned long long)min,
		    unit);
		bad_value(ctx, sec, v, expected);
		return;
	}
	*dst = n;
}

static void
parse_socket(struct parse_ctx *ctx, const cJSON *s, struct zd_config *cfg)
{
	static const char *const keys[] = { "path", "mode", "group", NULL };
	const cJSON *mode;

	check_keys(ctx, s, "socket", keys);
	get_string(ctx, s, "socket", "path", &cfg->socket_path);
	get_string(ctx, s, "socket", "group", &cfg->socket_group);
	mode = cJSON_GetObjectItemCaseSensitive(s, "mode");
	if (mode != NULL && ctx->status == 0) {
		char *end = NULL;
		unsigned long m = 0;

		if (cJSON_IsString(mode))
			m = strtoul(mode->valuestring, &end, 8);
		if (!cJSON_IsString(mode) || mode->valuestring[0] == '\0' || *end != '\0' ||
		    m > 0777)
			bad_value(ctx, "socket", mode, "an octal mode string such as \"0660\"");
		else
			cfg->socket_mode = (mode_t)m;
	}
}

static bool
is_loopback(int family, const char *host)
{
	unsigned char a[16];

	if (family == AF_INET)
		return inet_pton(AF_INET, host, a) == 1 && a[0] == 127;
	return inet_pton(AF_INET6, host, a) == 1 && memcmp(a, &in6addr_loopback, 16) == 0;
}

int
zd_metrics_parse_listen(const char *spec, struct zd_metrics_addr *ret, char *err,
    size_t errlen)
{
	const char *colon, *host = spec;
	size_t hostlen;
	char *end;
	unsigned long port;

	memset(ret, 0, sizeof(*ret));
	if (strncmp(spec, "unix:", 5) == 0) {
		if (spec[5] != '/' || strlen(spec + 5) >= sizeof(ret->path)) {
			snprintf(err, errlen, "\"%s\": a Unix socket needs an absolute path under %zu "
			    "bytes (\"unix:/run/zoffload/metrics.sock\")", spec, sizeof(ret->path));
			return -EINVAL;
		}
		ret->family = AF_UNIX;
		snprintf(ret->path, sizeof(ret->path), "%s", spec + 5);
		return 0;
	}
	colon = strrchr(spec, ':');
	if (colon == NULL || colon == spec || colon[1] == '\0')
		goto bad;
	if (spec[0] == '[') {
		if (colon[-1] != ']')
			goto bad;
		host = spec + 1;
		hostlen = (size_t)(colon - 1 - host);
		ret->family = AF_INET6;
	} else {
		hostlen = (size_t)(colon - spec);
		ret->family = AF_INET;
	}
	if (hostlen == 0 || hostlen >= sizeof(ret->host))
		goto bad;
	memcpy(ret->host, host, hostlen);
	errno = 0;
	port = strtoul(colon + 1, &end, 10);
	if (*end != '\0' || errno != 0 || port > 65535 || colon[1] == '-' || colon[1] == '+')
		goto bad;
	ret->port = (unsigned)port;
	if (ret->family == AF_INET && strcmp(ret->host, "localhost") == 0)
		snprintf(ret->host, sizeof(ret->host), "127.0.0.1");
	if (!is_loopback(ret->family, ret->host)) {
		snprintf(err, errlen, "\"%s\": %s is not a loopback address; the endpoint has no "
		    "authentication, so it listens on 127.0.0.0/8, [::1] or a Unix socket only",
		    spec, ret->host);
		return -EINVAL;
	}
	return 0;
bad:
	snprintf(err, errlen, "\"%s\" is not \"unix:/PATH\", \"127.0.0.1:PORT\" or \"[::1]:PORT\"",
	    spec);
	return -EINVAL;
}

static void
parse_memory(struct parse_ctx *ctx, const cJSON *s, struct zd_config *cfg)
{
	static const char *const keys[] = { "pinned_budget", "numa_node", "require_pinned",
		"hugepages", "shm_budget", "xfer_window", "policy", "job_pinned_budget",
		"state_format", NULL };
	const cJSON *policy, *format;
	long node = cfg->numa_node;

	check_keys(ctx, s, "memory", keys);
	get_size(ctx, s, "memory", "pinned_budget", 1 << 20, &cfg->pinned_budget);
	get_int(ctx, s, "memory", "numa_node", -1, 1023, &node);
	cfg->numa_node = (int)node;
	get_bool(ctx, s, "memory", "require_pinned", &cfg->require_pinned);
	get_bool(ctx, s, "memory", "hugepages", &cfg->hugepages);
	get_size(ctx, s, "memory", "shm_budget", 1 << 20, &cfg->shm_budget);
	get_size(ctx, s, "memory", "xfer_window", 64 << 10, &cfg->xfer_window);
	get_size(ctx, s, "memory", "job_pinned_budget", 0, &cfg->job_pinned_budget);
	policy = cJSON_GetObjectItemCaseSensitive(s, "policy");
	if (policy != NULL && ctx->status == 0) {
		if (cJSON_IsString(policy) && strcmp(policy->valuestring, "cpu") == 0)
			cfg->policy = 1;
		else if (cJSON_IsString(policy) && strcmp(policy->valuestring, "nvme") == 0)
			cfg->policy = 2;
		else if (cJSON_IsString(policy) && strcmp(policy->valuestring, "auto") == 0)
			cfg->policy = 3;
		else
			bad_value(ctx, "memory", policy, "one of \"cpu\", \"nvme\", \"auto\"");
	}
	format = cJSON_GetObjectItemCaseSensitive(s, "state_format");
	if (format != NULL && ctx->status == 0) {
		enum zk_state_format f;
		char list[128], expected[160];

		if (cJSON_IsString(format) && zk_state_format_parse(format->valuestring, &f) == 0) {
			cfg->state_format = (uint8_t)f;
		} else {
			zk_state_format_list(list, sizeof(list));
			snprintf(expected, sizeof(expected), "one of %s", list);
			bad_value(ctx, "memory", format, expected);
		}
	}
	if (ctx->status == 0 && cfg->xfer_window > (256ull << 20))
		perr(ctx, "memory.xfer_window: %llu bytes exceeds the 256 MiB protocol limit",
		    (unsigned long long)cfg->xfer_window);
}

static void
parse_compute(struct parse_ctx *ctx, const cJSON *s, struct zd_config *cfg)
{
	static const char *const keys[] = { "worker_threads", "cpus", "isa", NULL };
	const cJSON *cpus, *c;

	check_keys(ctx, s, "compute", keys);
	get_unsigned(ctx, s, "compute", "worker_threads", 0, 1024, &cfg->worker_threads);
	get_string(ctx, s, "compute", "isa", &cfg->isa);
	if (ctx->status == 0 && strcmp(cfg->isa, "auto") != 0 && strcmp(cfg->isa, "scalar") != 0 &&
	    strcmp(cfg->isa, "avx2") != 0 && strcmp(cfg->isa, "avx512") != 0)
		perr(ctx, "compute.isa: \"%s\" is not one of auto, scalar, avx2, avx512", cfg->isa);
	cpus = cJSON_GetObjectItemCaseSensitive(s, "cpus");
	if (cpus == NULL || ctx->status != 0)
		return;
	if (!cJSON_IsArray(cpus)) {
		bad_value(ctx, "compute", cpus, "a list of CPU numbers");
		return;
	}
	cfg->ncpus = 0;
	cJSON_ArrayForEach(c, cpus) {
		if (!cJSON_IsNumber(c) || c->valuedouble < 0 || c->valuedouble >= ZD_MAX_CPUS ||
		    c->valuedouble != (double)(int)c->valuedouble || cfg->ncpus == ZD_MAX_CPUS) {
			char *text = value_text(c);

			perr(ctx, "compute.cpus: %s is not a CPU number from 0 to %d", text,
			    ZD_MAX_CPUS - 1);
			free(text);
			return;
		}
		cfg->cpus[cfg->ncpus++] = (int)c->valuedouble;
	}
}

static void
parse_swap(struct parse_ctx *ctx, const cJSON *s, struct zd_config *cfg)
{
	static const char *const keys[] = { "paths", "block_size", "queue_depth", "engine",
		"fallback", "staging_buffers", "chunk_elements", "allow_memory_fs", NULL };
	static const char *const path_keys[] = { "path", "capacity", NULL };
	const cJSON *paths, *p;

	check_keys(ctx, s, "swap", keys);
	get_size(ctx, s, "swap", "block_size", 4096, &cfg->swap_block_size);
	if (ctx->status == 0 && (cfg->swap_block_size & (cfg->swap_block_size - 1)) != 0)
		perr(ctx, "swap.block_size: %llu is not a power of two",
		    (unsigned long long)cfg->swap_block_size);
	get_unsigned(ctx, s, "swap", "queue_depth", 1, 4096, &cfg->swap_queue_depth);
	get_string(ctx, s, "swap", "engine", &cfg->swap_engine);
	if (ctx->status == 0 && strcmp(cfg->swap_engine, "auto") != 0 &&
	    strcmp(cfg->swap_engine, "io_uring") != 0 && strcmp(cfg->swap_engine, "pthread") != 0)
		perr(ctx, "swap.engine: \"%s\" is not one of auto, io_uring, pthread",
		    cfg->swap_engine);
	get_bool(ctx, s, "swap", "fallback", &cfg->swap_fallback);
	get_unsigned(ctx, s, "swap", "staging_buffers", 2, 256, &cfg->staging_buffers);
	get_count(ctx, s, "swap", "chunk_elements", 1024, "elements", &cfg->chunk_elements);
	/* Whole 4 KiB pages per array keep every chunk's I/O aligned for O_DIRECT. */
	if (ctx->status == 0 && (cfg->chunk_elements % ZE_CHUNK_ALIGN != 0 ||
	    cfg->chunk_elements > (256u << 20)))
		perr(ctx, "swap.chunk_elements: %llu elements is not a multiple of 1024 elements "
		    "up to 268435456 (256M) elements", (unsigned long long)cfg->chunk_elements);
	get_bool(ctx, s, "swap", "allow_memory_fs", &cfg->swap_allow_memory_fs);
	paths = cJSON_GetObjectItemCaseSensitive(s, "paths");
	if (paths == NULL || ctx->status != 0)
		return;
	if (!cJSON_IsArray(paths)) {
		bad_value(ctx, "swap", paths, "a list of {\"path\", \"capacity\"} objects");
		return;
	}
	for (unsigned i = 0; i < cfg->nswap_paths; i++)
		free(cfg->swap_paths[i].path);
	cfg->nswap_paths = 0;
	cJSON_ArrayForEach(p, paths) {
		struct zd_swap_path *sp;

		/* The engine's limit, refused here by name rather than when the daemon starts. */
		if (cfg->nswap_paths == ZS_MAX_PATHS) {
			perr(ctx, "swap.paths: more than %d paths (the most the swap engine stripes "
			    "over)", ZS_MAX_PATHS);
			return;
		}
		if (!cJSON_IsObject(p)) {
			char *text = value_text(p);

			perr(ctx, "swap.paths[%u]: %s is not a {\"path\", \"capacity\"} object",
			    cfg->nswap_paths, text);
			free(text);
			return;
		}
		check_keys(ctx, p, "swap.paths[]", path_keys);
		sp = &cfg->swap_paths[cfg->nswap_paths];
		sp->path = NULL;
		get_string(ctx, p, "swap.paths[]", "path", &sp->path);
		get_size(ctx, p, "swap.paths[]", "capacity", 1 << 20, &sp->capacity);
		if (ctx->status != 0) {
			free(sp->path);
			return;
		}
		if (sp->path == NULL || sp->capacity == 0) {
			free(sp->path);
			perr(ctx, "swap.paths[%u]: needs both \"path\" and \"capacity\"",
			    cfg->nswap_paths);
			return;
		}
		cfg->nswap_paths++;
	}
}

static void
parse_limits(struct parse_ctx *ctx, const cJSON *s, struct zd_config *cfg)
{
	static const char *const keys[] = { "max_clients", "max_clients_per_uid",
		"max_queued_messages", "uid_pinned_budget", "uid_swap_budget", "detach_grace_s",
		"max_queued_bytes", "uid_queued_bytes", "uid_max_tensors", "uid_max_fds",
		"uid_shm_budget", "uid_ckpt_buffer_budget", NULL };

	check_keys(ctx, s, "limits", keys);
	get_unsigned(ctx, s, "limits", "max_clients", 1, 1000000, &cfg->max_clients);
	get_unsigned(ctx, s, "limits", "max_clients_per_uid", 0, 1000000,
	    &cfg->max_clients_per_uid);
	get_size(ctx, s, "limits", "uid_pinned_budget", 0, &cfg->uid_pinned_budget);
	get_size(ctx, s, "limits", "uid_swap_budget", 0, &cfg->uid_swap_budget);
	get_unsigned(ctx, s, "limits", "detach_grace_s", 0, 7 * 24 * 3600, &cfg->detach_grace_s);
	get_unsigned(ctx, s, "limits", "max_queued_messages", 16, 1000000,
	    &cfg->max_queued_messages);
	/* Below a few replies' worth a working client would be dropped. */
	get_size(ctx, s, "limits", "max_queued_bytes", 64 << 10, &cfg->max_queued_bytes);
	get_size(ctx, s, "limits", "uid_queued_bytes", 64 << 10, &cfg->uid_queued_bytes);
	get_unsigned(ctx, s, "limits", "uid_max_tensors", 0, 1u << 24, &cfg->uid_max_tensors);
	get_unsigned(ctx, s, "limits", "uid_max_fds", 0, 1u << 24, &cfg->uid_max_fds);
	get_size(ctx, s, "limits", "uid_shm_budget", 0, &cfg->uid_shm_budget);
	get_size(ctx, s, "limits", "uid_ckpt_buffer_budget", 0, &cfg->uid_ckpt_buffer_budget);
}

static void
parse_log(struct parse_ctx *ctx, const cJSON *s, struct zd_config *cfg)
{
	static const char *const keys[] = { "level", NULL };
	const cJSON *level;

	check_keys(ctx, s, "log", keys);
	level = cJSON_GetObjectItemCaseSensitive(s, "level");
	if (level != NULL && ctx->status == 0 &&
	    (!cJSON_IsString(level) || log_level_parse(level->valuestring, &cfg->log_level) != 0))
		bad_value(ctx, "log", level, "one of \"error\", \"warn\", \"info\", \"debug\"");
}

static void
parse_metrics(struct parse_ctx *ctx, const cJSON *s, struct zd_config *cfg)
{
	static const char *const keys[] = { "listen", "max_jobs", NULL };
	struct zd_metrics_addr addr;
	char why[256];

	check_keys(ctx, s, "metrics", keys);
	get_string(ctx, s, "metrics", "listen", &cfg->metrics_listen);
	get_unsigned(ctx, s, "metrics", "max_jobs", 1, 10000, &cfg->metrics_max_jobs);
	if (ctx->status == 0 && cfg->metrics_listen != NULL &&
	    zd_metrics_parse_listen(cfg->metrics_listen, &addr, why, sizeof(why)) != 0)
		perr(ctx, "metrics.listen: %s", why);
}

static void
parse_recovery(struct parse_ctx *ctx, const cJSON *s, struct zd_config *cfg)
{
	static const char *const keys[] = { "start_empty", "journal", NULL };

	check_keys(ctx, s, "recovery", keys);
	get_bool(ctx, s, "recovery", "start_empty", &cfg->recovery_start_empty);
	get_bool(ctx, s, "recovery", "journal", &cfg->recovery_journal);
}

int
zd_config_parse(const char *text, const char *source, struct zd_config *cfg, char *err,
    size_t errlen)
{
	static const char *const top_keys[] = { "socket", "memory", "compute", "swap", "limits",
		"log", "metrics", "recovery", NULL };
	struct parse_ctx ctx = { .source = source, .err = err, .errlen = errlen };
	struct {
		const char *name;
		void (*parse)(struct parse_ctx *, const cJSON *, struct zd_config *);
	} sections[] = {
		{ "socket", parse_socket }, { "memory", parse_memory },
		{ "compute", parse_compute }, { "swap", parse_swap },
		{ "limits", parse_limits }, { "log", parse_log }, { "metrics", parse_metrics },
		{ "recovery", parse_recovery },
	};
	const char *end = NULL;
	cJSON *root;
	char *src;

	root = cJSON_ParseWithOpts(text, &end, 1);
	if (root == NULL) {
		size_t line = 1;
		const char *where = cJSON_GetErrorPtr();

		for (const char *p = text; where != NULL && p < where; p++)
			line += *p == '\n';
		return perr(&ctx, "line %zu: not valid JSON", line);
	}
	if (!cJSON_IsObject(root)) {
		cJSON_Delete(root);
		return perr(&ctx, "the top level must be a JSON object");
	}
	check_duplicates(&ctx, root, "");
	check_keys(&ctx, root, "", top_keys);
	for (size_t i = 0; i < sizeof(sections) / sizeof(sections[0]) && ctx.status == 0; i++) {
		const cJSON *s = section(&ctx, root, sections[i].name);

		if (s != NULL)
			sections[i].parse(&ctx, s, cfg);
	}
	cJSON_Delete(root);
	if (ctx.status != 0)
		return ctx.status;
	src = strdup(source);
	if (src == NULL)
		return -ENOMEM;
	free(cfg->source);
	cfg->source = src;
	return 0;
}

int
zd_config_load(const char *path, bool missing_ok, struct zd_config *cfg, char *err,
    size_t errlen)
{
	FILE *f;
	char *text = NULL;
	size_t len = 0, cap = 0;
	int r;

	f = fopen(path, "re");
	if (f == NULL) {
		r = -errno;
		if (r == -ENOENT && missing_ok)
			return 0;
		snprintf(err, errlen, "%s: cannot open: %s", path, strerror(-r));
		return r;
	}
	for (;;) {
		if (cap - len < 4096) {
			char *bigger;

			if (cap > (16u << 20)) {
				snprintf(err, errlen, "%s: larger than 16 MiB", path);
				r = -EFBIG;
				goto out;
			}
			cap = cap ? cap * 2 : 8192;
			bigger = realloc(text, cap);
			if (bigger == NULL) {
				r = -ENOMEM;
				goto out;
			}
			text = bigger;
		}
		size_t n = fread(text + len, 1, cap - len - 1, f);

		len += n;
		if (n == 0)
			break;
	}
	if (ferror(f)) {
		r = -EIO;
		snprintf(err, errlen, "%s: read error", path);
		goto out;
	}
	text[len] = '\0';
	r = zd_config_parse(text, path, cfg, err, errlen);
out:
	free(text);
	fclose(f);
	return r;
}
