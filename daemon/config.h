/* zoffloadd's configuration: built-in defaults, /etc/zoffload.conf (JSON), validation. */
#ifndef ZD_CONFIG_H
#define ZD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "log.h"

/*
 * Slots for swap paths in the recovery table (its layout, so fixed by its version) and the
 * arrays beside it; the configuration takes at most the engine's ZS_MAX_PATHS of them.
 */
#define ZD_MAX_SWAP_PATHS 16
#define ZD_MAX_CPUS 1024

struct zd_swap_path {
	char *path;
	uint64_t capacity;
};

struct zd_config {
	char *source;			/* file it came from, or "built-in defaults" */

	char *socket_path;
	mode_t socket_mode;
	char *socket_group;		/* NULL: the daemon's group */

	uint64_t pinned_budget;
	int numa_node;			/* -1: none */
	bool require_pinned;
	bool hugepages;
	uint64_t shm_budget;		/* grad/param slots and transfer windows */
	uint64_t xfer_window;
	uint8_t policy;			/* enum zp_policy: where jobs' state goes by default */
	uint64_t job_pinned_budget;	/* 0: no per-job cap */
	uint8_t state_format;		/* enum zk_state_format: jobs' optimizer state by default */

	unsigned worker_threads;	/* 0: one per online CPU */
	int cpus[ZD_MAX_CPUS];
	unsigned ncpus;
	char *isa;			/* "auto", "scalar", "avx2", "avx512" */

	struct zd_swap_path swap_paths[ZD_MAX_SWAP_PATHS];
	unsigned nswap_paths;
	uint64_t swap_block_size;
	unsigned swap_queue_depth;
	char *swap_engine;		/* "auto", "io_uring", "pthread" */
	bool swap_fallback;
	unsigned staging_buffers;	/* NVMe chunks in flight at once (read, step, write) */
	uint64_t chunk_elements;	/* elements of one tensor per NVMe chunk */
	bool swap_allow_memory_fs;	/* --check-config accepts tmpfs/ramfs swap paths */

	unsigned max_clients;
	unsigned max_clients_per_uid;	/* 0: no per-uid cap */
	unsigned max_queued_messages;	/* per session, before it is dropped as not reading */
	uint64_t uid_pinned_budget;	/* 0: no per-uid cap */
	uint64_t uid_swap_budget;	/* 0: no per-uid cap */
	unsigned detach_grace_s;	/* how long a dead rank's state waits for it; 0: freed at once */
	uint64_t max_queued_bytes;	/* replies queued for one session, before it is dropped */
	uint64_t uid_queued_bytes;	/* ... for all sessions of one uid */
	unsigned uid_max_tensors;	/* tensors a uid holds, detached ones included; 0: none */
	unsigned uid_max_fds;		/* descriptors held for a uid; 0: a quarter of what the daemon may open */
	uint64_t uid_shm_budget;	/* slots and transfer windows per uid; 0: no per-uid cap */
	uint64_t uid_ckpt_buffer_budget;	/* checkpoint transfer buffers per uid; 0: no cap */

	enum zd_log_level log_level;

	/*
	 * A restart finds the state kept (systemd's fd store or the daemon's own
	 * successor): start_empty sets an unusable kept state aside instead of
	 * refusing to start; journal keeps the step journal (engine/journal.c),
	 * so a crash mid-slice is finished exactly at the next start (off: torn).
	 */
	bool recovery_start_empty;
	bool recovery_journal;

	char *metrics_listen;		/* NULL: no metrics endpoint */
	unsigned metrics_max_jobs;	/* jobs with their own labels; the rest are "other" */
};

/* Built-in defaults, sized from this machine (half of RAM pinned at most). */
int zd_config_defaults(struct zd_config *cfg);

/*
 * Loads path over the defaults.  missing_ok: an absent file gives the
 * defaults.  On error, err (size errlen) names the file, the key and the value.
 */
int zd_config_load(const char *path, bool missing_ok, struct zd_config *cfg, char *err,
    size_t errlen);
int zd_config_parse(const char *text, const char *source, struct zd_config *cfg, char *err,
    size_t errlen);
void zd_config_clear(struct zd_config *cfg);

/*
 * "4G", "1.5T", "512M", "4GiB", "1048576": bytes; K, M, G, T are 2^10 .. 2^40
 * however spelt, decimals allowed, the result a whole number of bytes.
 */
int zd_parse_size(const char *text, uint64_t *ret);
/* The same for counts ("4M" elements): no B/iB spelling. */
int zd_parse_count(const char *text, uint64_t *ret);

/* metrics.listen parsed: "unix:/path", "127.0.0.1:PORT", "[::1]:PORT", "localhost:PORT". */
struct zd_metrics_addr {
	int family;		/* AF_UNIX, AF_INET or AF_INET6 */
	char host[64];		/* numeric loopback address (AF_INET, AF_INET6) */
	char path[108];		/* AF_UNIX */
	unsigned port;		/* 0: any free port (logged) */
};

/*
 * 0, or -EINVAL with why in err: not one of the forms above, or a TCP
 * address that is not loopback (the endpoint has no authentication).
 */
int zd_metrics_parse_listen(const char *spec, struct zd_metrics_addr *ret, char *err,
    size_t errlen);

#endif
