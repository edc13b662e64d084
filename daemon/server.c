/* zoffloadd's life: the listening socket, signals, start-up checks and shutdown. */
#include <errno.h>
#include <fcntl.h>
#include <event2/event.h>
#include <grp.h>
#include <linux/capability.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "arena.h"
#include "checkpoint.h"
#include "closer.h"
#include "daemon.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "restart.h"
#include "metrics.h"
#include "msgio.h"
#include "requests.h"
#include "server.h"
#include "session.h"
#include "step_gate.h"
#include "swap.h"
#include "uid.h"

static bool
have_cap_ipc_lock(void)
{
	struct __user_cap_header_struct hdr = { .version = _LINUX_CAPABILITY_VERSION_3 };
	struct __user_cap_data_struct data[2];

	if (syscall(SYS_capget, &hdr, data) != 0)
		return false;
	return (data[CAP_TO_INDEX(CAP_IPC_LOCK)].effective & CAP_TO_MASK(CAP_IPC_LOCK)) != 0;
}

/* Says at start what can really be pinned, and why not more. */
static void
report_pinning(struct zd_daemon *d)
{
	struct zt_arena_stats as;
	char budget[32], limit[32];

	ze_engine_arena_stats(d->engine, &as);
	zd_fmt_bytes(as.budget_bytes, budget, sizeof(budget));
	if (as.memlock_limit == UINT64_MAX || have_cap_ipc_lock()) {
		log_info("pinned tier: budget %s, all of it can be locked (%s)", budget,
		    as.memlock_limit == UINT64_MAX ? "memlock unlimited" : "CAP_IPC_LOCK");
		return;
	}
	zd_fmt_bytes(as.memlock_limit, limit, sizeof(limit));
	if (as.memlock_limit >= as.budget_bytes) {
		log_info("pinned tier: budget %s within the memlock limit of %s", budget, limit);
		return;
	}
	if (d->cfg.require_pinned)
		log_warnx("pinned tier: budget %s but RLIMIT_MEMLOCK is %s: tensors beyond %s will "
		    "be refused (memory.require_pinned is true); raise LimitMEMLOCK= in the unit "
		    "or `ulimit -l`", budget, limit, limit);
	else
		log_warnx("pinned tier: budget %s but RLIMIT_MEMLOCK is %s: only %s can be locked, "
		    "the rest stays pageable (slower transfers, may be swapped); raise "
		    "LimitMEMLOCK= in the unit or `ulimit -l`", budget, limit, limit);
}

/* A socket file nobody answers on is left over from a crash; one that answers is a live daemon. */
static int
clear_stale_socket(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct stat st;
	int fd, r;

	if (lstat(path, &st) != 0)
		return errno == ENOENT ? 0 : -errno;
	if (!S_ISSOCK(st.st_mode))
		return -EEXIST;
	/*
	 * Without blocking: a listener whose daemon is stopped, its backlog
	 * full, would hold a blocking connect for ever.  EAGAIN is that
	 * listener, alive; only a refusal means nobody is there.
	 */
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	r = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 ? 0 : -errno;
	close(fd);
	if (r == 0 || r == -EAGAIN || r == -EINPROGRESS)
		return -EADDRINUSE;
	if (r != -ECONNREFUSED)
		return r;
	return unlink(path) == 0 ? 0 : -errno;
}

/* Removes the socket path if it is still the socket we bound, not a successor's. */
static void
unlink_own_socket(struct zd_daemon *d)
{
	struct stat st;

	if (lstat(d->cfg.socket_path, &st) != 0)
		return;
	if (st.st_dev != d->socket_st.st_dev || st.st_ino != d->socket_st.st_ino) {
		log_info("%s is no longer our socket: left in place", d->cfg.socket_path);
		return;
	}
	(void)unlink(d->cfg.socket_path);
}

static int
open_listener(struct zd_daemon *d)
{
	const struct zd_config *c = &d->cfg;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd, r;

	if (strlen(c->socket_path) >= sizeof(sa.sun_path)) {
		log_errorx("socket path %s is longer than %zu bytes", c->socket_path,
		    sizeof(sa.sun_path) - 1);
		return -ENAMETOOLONG;
	}
	r = clear_stale_socket(c->socket_path);
	if (r == -EADDRINUSE) {
		log_errorx("another zoffloadd is listening on %s", c->socket_path);
		return r;
	}
	if (r < 0) {
		log_error(r, "socket path %s is in the way", c->socket_path);
		return r;
	}
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", c->socket_path);
	if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
		r = -errno;
		log_error(r, "bind %s", c->socket_path);
		goto fail;
	}
	/* Ours is this inode: at exit the path is removed only while it still is. */
	if (lstat(c->socket_path, &d->socket_st) != 0) {
		r = -errno;
		log_error(r, "stat %s", c->socket_path);
		goto fail;
	}
	if (c->socket_group != NULL) {
		struct group *g = getgrnam(c->socket_group);

		if (g == NULL || chown(c->socket_path, (uid_t)-1, g->gr_gid) != 0) {
			r = g == NULL ? -ENOENT : -errno;
			log_error(r, "socket.group: cannot give %s to group '%s'", c->socket_path,
			    c->socket_group);
			goto fail_unlink;
		}
	}
	if (chmod(c->socket_path, c->socket_mode) != 0) {
		r = -errno;
		log_error(r, "chmod %s", c->socket_path);
		goto fail_unlink;
	}
	if (listen(fd, 128) != 0) {
		r = -errno;
		goto fail_unlink;
	}
	d->listen_fd = fd;
	return 0;
fail_unlink:
	unlink_own_socket(d);
fail:
	close(fd);
	return r;
}

/*
 * The session hooks: requests.c's, and after each message a look at whether a drain is
 * done (a request can end the last checkpoint transfer).
 */
static bool
session_message(struct zd_session *s, const struct zp_msg *msg, const int *fds, unsigned nfds)
{
	struct zd_daemon *d = s->daemon;
	bool end_burst = zd_request_message(s, msg, fds, nfds);

	zd_maybe_finish(d);
	return end_burst;
}

static const struct zd_session_hooks server_session_hooks = {
	.on_message = session_message,
	.on_close = zd_request_close,
};

/* The closer's hooks: a CKPT_RELEASE file is counted closed; a uid's sessions read again. */
static void
closer_uid_ready(struct zd_daemon *d, struct zd_uid *u)
{
	struct zd_session *s;

	TAILQ_FOREACH(s, &d->sessions, entry)
		if (s->uid_usage == u)
			zd_session_resume(s);
}

static const struct zd_closer_hooks server_closer_hooks = {
	.released = zd_ckpt_release_closed,
	.uid_ready = closer_uid_ready,
};

static void
accept_cb(evutil_socket_t lfd, short what, void *arg)
{
	struct zd_daemon *d = arg;
	int fd;

	for (int i = 0; i < 64; i++) {
		fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0 && (errno == EMFILE || errno == ENFILE) && d->spare_fd >= 0) {
			/*
			 * Out of descriptors (only root can take the daemon there):
			 * the spare one lets the client in to be told so, instead of
			 * leaving it in the backlog and this callback spinning.
			 */
			close(d->spare_fd);
			fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
			if (fd >= 0) {
				struct zp_msg m = { .hdr = { .type = ZP_ERROR } };

				m.u.error.code = -ENFILE;
				snprintf(m.u.error.message, sizeof(m.u.error.message),
				    "zoffloadd is out of descriptors");
				(void)zp_send(fd, &m, NULL, 0);
				zd_closer_close_socket(d, NULL, fd, ZD_CLOSE_CHARGED);
				log_warnx("refused a client: out of descriptors");
			}
			d->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
			return;
		}
		if (fd < 0) {
			if (errno != EAGAIN && errno != EINTR)
				log_warn(errno, "accept");
			return;
		}
		if (d->nsessions >= d->cfg.max_clients) {
			struct zp_msg m = { .hdr = { .type = ZP_ERROR } };

			m.u.error.code = -EUSERS;
			snprintf(m.u.error.message, sizeof(m.u.error.message),
			    "zoffloadd serves at most %u clients (limits.max_clients)",
			    d->cfg.max_clients);
			(void)zp_send(fd, &m, NULL, 0);
			/* What it sent before accept goes with the socket: off the loop. */
			zd_closer_close_socket(d, NULL, fd, ZD_CLOSE_CHARGED);
			log_warnx("refused a client: %u clients connected", d->nsessions);
			continue;
		}
		zd_session_accept(d, fd, &server_session_hooks);
	}
}

void
zd_maybe_finish(struct zd_daemon *d)
{
	if (d->draining && ze_engine_in_flight(d->engine) == 0 && zd_ckpt_idle(d))
		event_base_loopbreak(d->base);
}

/* The checkpoint I/O threads' eventfd: the pieces they finished. */
static void
ckpt_cb(evutil_socket_t fd, short what, void *arg)
{
	struct zd_daemon *d = arg;

	zd_ckpt_process(d);
	zd_maybe_finish(d);
}

/* The stepper's and the swap engine's fds both land here. */
static void
engine_cb(evutil_socket_t fd, short what, void *arg)
{
	struct zd_daemon *d = arg;
	int r = ze_engine_process(d->engine);

	if (r < 0)
		log_warn(r, "swap engine");
	zd_maybe_finish(d);
}

static bool
str_differ(const char *a, const char *b)
{
	return (a == NULL) != (b == NULL) || (a != NULL && strcmp(a, b) != 0);
}

static bool
swap_paths_differ(const struct zd_config *a, const struct zd_config *b)
{
	if (a->nswap_paths != b->nswap_paths)
		return true;
	for (unsigned i = 0; i < a->nswap_paths; i++)
		if (strcmp(a->swap_paths[i].path, b->swap_paths[i].path) != 0 ||
		    a->swap_paths[i].capacity != b->swap_paths[i].capacity)
			return true;
	return false;
}

/* Appends key to a ", "-separated list. */
static void
list_add(char *list, size_t len, const char *key)
{
	size_t used = strlen(list);

	snprintf(list + used, len - used, "%s%s", used > 0 ? ", " : "", key);
}

/*
 * SIGHUP: every key is compared with the running value.  What can change
 * live is applied (each is read where it is used, so it applies from its
 * next use on: new jobs, new windows, the next charge or accept; nothing
 * already admitted is undone); what was bound at start keeps its running
 * value until a restart.  The log names both kinds, key by key.
 */
static void
reload(struct zd_daemon *d)
{
	struct zd_config fresh, *c = &d->cfg;
	char err[512], live[1024] = "", restart[1024] = "";
	enum zk_isa isa;
	unsigned workers;
	int r;

	if (!d->config_from_file) {
		log_info("SIGHUP: running on built-in defaults, nothing to reload");
		return;
	}
	if (zd_config_defaults(&fresh) != 0)
		return;
	r = zd_config_load(d->config_path, false, &fresh, err, sizeof(err));
	if (r == 0 && (r = zk_isa_select(fresh.isa, &isa)) < 0)
		snprintf(err, sizeof(err), "%s: compute.isa: %s: %s", d->config_path, fresh.isa,
		    r == -ENOTSUP ? "this CPU lacks it" : "unknown");
	if (r < 0) {
		log_errorx("SIGHUP: keeping the running configuration: %s", err);
		zd_config_clear(&fresh);
		return;
	}
	/* 0 workers means one per CPU, as at start. */
	workers = fresh.worker_threads;
	if (workers == 0) {
		long n = sysconf(_SC_NPROCESSORS_ONLN);

		workers = n > 0 ? (unsigned)n : 1;
	}
#define LIVE(key, field) do {						\
		if (fresh.field != c->field) {				\
			c->field = fresh.field;				\
			list_add(live, sizeof(live), key);		\
		}							\
	} while (0)
#define RESTART(key, differ) do {					\
		if (differ)						\
			list_add(restart, sizeof(restart), key);	\
	} while (0)
	RESTART("socket.path", strcmp(fresh.socket_path, c->socket_path) != 0);
	RESTART("socket.mode", fresh.socket_mode != c->socket_mode);
	RESTART("socket.group", str_differ(fresh.socket_group, c->socket_group));
	LIVE("memory.pinned_budget", pinned_budget);
	RESTART("memory.numa_node", fresh.numa_node != c->numa_node);
	RESTART("memory.require_pinned", fresh.require_pinned != c->require_pinned);
	RESTART("memory.hugepages", fresh.hugepages != c->hugepages);
	LIVE("memory.shm_budget", shm_budget);
	LIVE("memory.xfer_window", xfer_window);
	LIVE("memory.policy", policy);
	LIVE("memory.job_pinned_budget", job_pinned_budget);
	LIVE("memory.state_format", state_format);
	RESTART("compute.worker_threads", workers != c->worker_threads);
	RESTART("compute.cpus", fresh.ncpus != c->ncpus ||
	    memcmp(fresh.cpus, c->cpus, fresh.ncpus * sizeof(fresh.cpus[0])) != 0);
	if (strcmp(fresh.isa, c->isa) != 0) {
		char *old = c->isa;

		c->isa = fresh.isa;
		fresh.isa = old;
		list_add(live, sizeof(live), "compute.isa");
	}
	RESTART("swap.paths", swap_paths_differ(&fresh, c));
	RESTART("swap.block_size", fresh.swap_block_size != c->swap_block_size);
	RESTART("swap.queue_depth", fresh.swap_queue_depth != c->swap_queue_depth);
	RESTART("swap.engine", strcmp(fresh.swap_engine, c->swap_engine) != 0);
	RESTART("swap.fallback", fresh.swap_fallback != c->swap_fallback);
	RESTART("swap.staging_buffers", fresh.staging_buffers != c->staging_buffers);
	RESTART("swap.chunk_elements", fresh.chunk_elements != c->chunk_elements);
	/* Read by --check-config alone. */
	LIVE("swap.allow_memory_fs", swap_allow_memory_fs);
	LIVE("limits.max_clients", max_clients);
	LIVE("limits.max_clients_per_uid", max_clients_per_uid);
	LIVE("limits.max_queued_messages", max_queued_messages);
	LIVE("limits.max_queued_bytes", max_queued_bytes);
	LIVE("limits.uid_queued_bytes", uid_queued_bytes);
	LIVE("limits.uid_pinned_budget", uid_pinned_budget);
	LIVE("limits.uid_swap_budget", uid_swap_budget);
	LIVE("limits.uid_max_tensors", uid_max_tensors);
	LIVE("limits.uid_max_fds", uid_max_fds);
	LIVE("limits.uid_shm_budget", uid_shm_budget);
	LIVE("limits.uid_ckpt_buffer_budget", uid_ckpt_buffer_budget);
	LIVE("limits.detach_grace_s", detach_grace_s);
	LIVE("log.level", log_level);
	RESTART("metrics.listen", str_differ(fresh.metrics_listen, c->metrics_listen));
	/* Read at each scrape. */
	LIVE("metrics.max_jobs", metrics_max_jobs);
#undef LIVE
#undef RESTART
	log_set_level(c->log_level);
	ze_engine_set_budgets(d->engine, c->pinned_budget, c->shm_budget);
	ze_engine_set_isa(d->engine, isa);
	d->isa = isa;
	zd_uid_reload_limits(d);
	zd_ckpt_budget_reloaded(d);
	zd_config_clear(&fresh);
	log_info("SIGHUP: reloaded %s (kernels %s): %s%s", d->config_path, zk_isa_name(d->isa),
	    live[0] != '\0' ? "changed live: " : "nothing changed live", live);
	if (restart[0] != '\0')
		log_warnx("SIGHUP: changed in %s but applied only at restart (the running values "
		    "stay): %s", d->config_path, restart);
}

static void
signal_cb(evutil_socket_t sig, short what, void *arg)
{
	struct zd_daemon *d = arg;

	if (sig == SIGHUP) {
		reload(d);
		return;
	}
	if (d->draining)
		return;
	if (sig == SIGUSR2) {
		if (d->exe[0] == '\0' || access(d->exe, X_OK) != 0) {
			log_errorx("SIGUSR2: cannot hand over to %s: %s", d->exe[0] ? d->exe :
			    "(unknown binary)", strerror(errno));
			return;
		}
		d->handoff = true;
	}
	log_info("%s: no new connections; finishing %u step(s) in flight%s%s",
	    sig == SIGTERM ? "SIGTERM" : sig == SIGUSR2 ? "SIGUSR2" : "SIGINT",
	    ze_engine_steps_in_flight(d->engine), d->handoff ? ", then handing the state to " :
	    "", d->handoff ? d->exe : "");
	d->draining = true;
	(void)zd_notify("STOPPING=1");
	if (d->ev_listen != NULL) {
		event_free(d->ev_listen);
		d->ev_listen = NULL;
	}
	zd_maybe_finish(d);
}

/*
 * SIGUSR2, drained: the binary at our path (a new one after an upgrade)
 * takes over in this process, with the store in LISTEN_FDS, and recovers
 * as it would from systemd's.  Returns only when that failed.
 */
static void
handoff(struct zd_daemon *d)
{
	int r;

	if (d->listen_fd >= 0) {
		close(d->listen_fd);
		unlink_own_socket(d);
		d->listen_fd = -1;
	}
	/*
	 * The closer's closes end first: one after the store's descriptors are moved into
	 * place (dup2 over numbers it may hold) would close one of them.
	 */
	zd_closer_stop(d);
	log_info("handing %zu descriptor(s) over to %s", d->store.nlive, d->exe);
	r = zd_fdstore_handoff(&d->store, d->exe, d->argv);
	log_errorx("cannot hand over to %s: %s; the state is lost", d->exe, strerror(-r));
	_exit(1);
}

/* The swap engine on the configured paths, or *ret NULL when none are. */
static int
start_swap(struct zd_daemon *d, struct zs_swap **ret)
{
	struct zs_path paths[ZD_MAX_SWAP_PATHS];
	struct zs_error_info info = { .path = -1 };
	struct zs_swap_stats es;
	struct zs_config zc = {
		.paths = paths,
		.npaths = d->cfg.nswap_paths,
		.stripe_unit = (uint32_t)d->cfg.swap_block_size,
		.queue_depth = d->cfg.swap_queue_depth,
		.allow_fallback = d->cfg.swap_fallback,
	};
	int r;

	*ret = NULL;
	if (d->cfg.nswap_paths == 0) {
		log_info("NVMe tier off: no swap.paths configured");
		return 0;
	}
	if (d->cfg.nswap_paths > ZS_MAX_PATHS) {
		log_errorx("swap.paths: %u paths, the engine takes at most %d", d->cfg.nswap_paths,
		    ZS_MAX_PATHS);
		return -EINVAL;
	}
	for (unsigned i = 0; i < d->cfg.nswap_paths; i++)
		paths[i] = (struct zs_path){ .path = d->cfg.swap_paths[i].path,
		    .capacity = d->cfg.swap_paths[i].capacity, .kept_fd = d->kept_swap[i],
		    .kept_lock_fd = d->kept_swaplock[i] };
	if (strcmp(d->cfg.swap_engine, "io_uring") == 0)
		zc.engine = ZS_SWAP_URING;
	else if (strcmp(d->cfg.swap_engine, "pthread") == 0)
		zc.engine = ZS_SWAP_PTHREAD;
	else
		zc.engine = ZS_SWAP_AUTO;
	r = zs_swap_new(&zc, ret, &info);
	if (r < 0) {
		if (info.path >= 0 && r == -EBUSY && info.step != NULL &&
		    strcmp(info.step, "lock") == 0 && info.holder_pid > 0)
			log_errorx("swap path %s is in use by pid %d (another zoffloadd?): two daemons "
			    "on one swap path would overwrite each other's state", paths[info.path].path,
			    info.holder_pid);
		else if (info.path >= 0 && r == -EBUSY && info.step != NULL &&
		    strcmp(info.step, "lock") == 0)
			log_errorx("swap path %s is locked by another process (another zoffloadd?): "
			    "two daemons on one swap path would overwrite each other's state",
			    paths[info.path].path);
		else if (info.path >= 0)
			log_errorx("swap path %s: %s failed: %s", paths[info.path].path,
			    info.step ? info.step : "setup", zs_strerror(info.cause ? info.cause : r));
		else
			log_errorx("swap engine: %s%s%s%s", zs_strerror(r),
			    info.step ? " (" : "", info.step ? info.step : "", info.step ? ")" : "");
		return r;
	}
	zs_swap_stats(*ret, &es);
	if (es.uring_error != 0)
		log_warnx("io_uring is unavailable (%s): swapping with the pthread fallback "
		    "(swap.fallback is true)", zs_strerror(es.uring_error));
	for (unsigned i = 0; i < d->cfg.nswap_paths; i++) {
		struct zs_path_stats ps;
		char cap[32];

		zs_swap_path_stats(*ret, i, &ps);
		zd_fmt_bytes(ps.capacity, cap, sizeof(cap));
		log_info("NVMe tier: %s, %s preallocated, O_DIRECT alignment %u", paths[i].path, cap,
		    ps.dio_offset_align);
	}
	log_info("NVMe tier: %s engine, queue depth %u, stripe unit %u KiB over %u path(s)",
	    zs_swap_name(*ret), es.queue_depth, es.stripe_unit >> 10, es.npaths);
	return 0;
}

static int
start_engine(struct zd_daemon *d)
{
	const char *names[ZD_MAX_SWAP_PATHS];
	struct zs_swap *swap;
	char err[256];
	int r;

	/* What a restart handed back is checked whole before anything is made. */
	r = zd_restart_begin(d);
	if (r < 0)
		return r;
	r = start_swap(d, &swap);
	/* The swap engine took the kept swap descriptors, or closed them failing. */
	for (unsigned i = 0; i < ZD_MAX_SWAP_PATHS; i++)
		d->kept_swap[i] = d->kept_swaplock[i] = 0;
	if (r < 0)
		return r;
	for (unsigned i = 0; i < d->cfg.nswap_paths; i++)
		names[i] = d->cfg.swap_paths[i].path;
	r = ze_engine_new(&(struct ze_config){
		.pinned_budget = d->cfg.pinned_budget,
		.numa_node = d->cfg.numa_node,
		.require_pinned = d->cfg.require_pinned,
		.hugepages = d->cfg.hugepages,
		.shm_budget = d->cfg.shm_budget,
		.worker_threads = d->cfg.worker_threads,
		.cpus = d->cfg.cpus,
		.ncpus = d->cfg.ncpus,
		.isa = d->isa,
		.staging_buffers = d->cfg.staging_buffers,
		.chunk_elements = d->cfg.chunk_elements,
		.swap_path_names = names,
		.nswap_paths = d->cfg.nswap_paths,
		.swap_paths_what = "swap.paths",
		.numa_node_what = "memory.numa_node",
		.memlock_hint = "raise LimitMEMLOCK= or set memory.require_pinned to false",
		.journal = d->cfg.recovery_journal,
		.kept_journal_fd = d->kept_journal > 2 ? d->kept_journal : 0,
		.kept_staging_fds = d->kept_staging,
		.nkept_staging = d->nkept_staging,
		.block_gate = zd_step_gate(),
	}, swap, &zd_engine_callbacks, d, &d->engine, err, sizeof(err));
	if (r < 0) {
		log_errorx("%s", err);
		return r;
	}
	r = zd_restart_finish(d);
	if (r < 0)
		return r;
	if (swap != NULL)
		log_info("NVMe tier: %u staging buffers of %llu MiB, chunks of %llu elements",
		    d->cfg.staging_buffers,
		    (unsigned long long)(3 * d->cfg.chunk_elements * sizeof(float)) >> 20,
		    (unsigned long long)d->cfg.chunk_elements);
	d->ev_stepper = event_new(d->base, ze_engine_step_fd(d->engine), EV_READ | EV_PERSIST,
	    engine_cb, d);
	if (d->ev_stepper == NULL || event_priority_set(d->ev_stepper, 0) != 0 ||
	    event_add(d->ev_stepper, NULL) != 0)
		return -ENOMEM;
	if (swap != NULL) {
		d->ev_swap = event_new(d->base, ze_engine_swap_fd(d->engine), EV_READ | EV_PERSIST,
		    engine_cb, d);
		if (d->ev_swap == NULL || event_priority_set(d->ev_swap, 0) != 0 ||
		    event_add(d->ev_swap, NULL) != 0)
			return -ENOMEM;
	}
	r = zd_ckpt_start(d);
	if (r < 0)
		return r;
	d->ev_ckpt = event_new(d->base, zd_ckpt_fd(d), EV_READ | EV_PERSIST, ckpt_cb, d);
	if (d->ev_ckpt == NULL || event_add(d->ev_ckpt, NULL) != 0)
		return -ENOMEM;
	r = zd_closer_start(d, &server_closer_hooks);
	if (r < 0)
		return r;
	report_pinning(d);
	return 0;
}

static void
tick_cb(evutil_socket_t fd, short what, void *arg)
{
	zd_tick(arg);
}

void
zd_tick(struct zd_daemon *d)
{
	struct zs_swap *swap = ze_engine_swap(d->engine);
	uint64_t now = zu_now_ns();
	double dt = (double)(now - d->last_tick_ns) / 1e9;
	struct zd_uid *u, *next;

	d->last_tick_ns = now;
	if (swap != NULL) {
		(void)zs_swap_check_paths(swap);
		for (unsigned i = 0; i < d->cfg.nswap_paths && i < ZD_MAX_SWAP_PATHS; i++) {
			struct zd_swap_sample *smp = &d->swap_samples[i];
			struct zs_path_stats ps;

			if (zs_swap_path_stats(swap, i, &ps) != 0)
				continue;
			if (ps.bad != 0 && smp->bad == 0)
				log_errorx("swap path %s is bad (%s): no new state goes there; state "
				    "already there fails its I/O until its job is dropped",
				    d->cfg.swap_paths[i].path, zs_strerror(ps.bad));
			smp->bad = ps.bad;
			if (dt > 0) {
				smp->read_bps = (double)(ps.bytes_read - smp->bytes_read) / dt;
				smp->write_bps = (double)(ps.bytes_written - smp->bytes_written) / dt;
			}
			smp->bytes_read = ps.bytes_read;
			smp->bytes_written = ps.bytes_written;
		}
	}
	zd_job_expire_detached(d, false);
	/* Uids whose last tensor went after their last session (its step was running then). */
	for (u = TAILQ_FIRST(&d->uids); u != NULL; u = next) {
		next = TAILQ_NEXT(u, entry);
		zd_uid_put(d, u);
	}
	/* systemctl status shows this line. */
	if (now / 1000000000ull % 10 == 0) {
		char status[160];

		snprintf(status, sizeof(status), "STATUS=%u sessions, %llu steps applied, kernels %s",
		    d->nsessions, (unsigned long long)d->steps.batches_applied, zk_isa_name(d->isa));
		(void)zd_notify(status);
	}
}

static void
watchdog_cb(evutil_socket_t fd, short what, void *arg)
{
	(void)zd_notify("WATCHDOG=1");
}

/* systemd's WatchdogSec=: ping at half the interval it asked for. */
static int
start_watchdog(struct zd_daemon *d)
{
	const char *usec = getenv("WATCHDOG_USEC"), *pid = getenv("WATCHDOG_PID");
	unsigned long long us;
	struct timeval tv;

	if (usec == NULL)
		return 0;
	if (pid != NULL && strtol(pid, NULL, 10) != (long)getpid())
		return 0;
	us = strtoull(usec, NULL, 10);
	if (us == 0)
		return 0;
	tv.tv_sec = (time_t)(us / 2 / 1000000);
	tv.tv_usec = (suseconds_t)(us / 2 % 1000000);
	d->ev_watchdog = event_new(d->base, -1, EV_PERSIST, watchdog_cb, d);
	if (d->ev_watchdog == NULL || event_add(d->ev_watchdog, &tv) != 0)
		return -ENOMEM;
	(void)zd_notify("WATCHDOG=1");
	log_info("systemd watchdog: pinging every %llu ms", us / 2000);
	return 0;
}

int
zd_server_run(struct zd_daemon *d)
{
	static const int sigs[] = { SIGTERM, SIGINT, SIGHUP, SIGUSR2 };
	struct zd_metrics *metrics = NULL;
	int r;

	TAILQ_INIT(&d->sessions);
	TAILQ_INIT(&d->jobs);
	TAILQ_INIT(&d->uids);
	d->listen_fd = -1;
	d->spare_fd = -1;
	d->started_ns = zu_now_ns();
	signal(SIGPIPE, SIG_IGN);

	r = zk_isa_select(d->cfg.isa, &d->isa);
	if (r < 0) {
		log_errorx("compute.isa \"%s\"%s: %s", d->cfg.isa,
		    getenv("ZOFFLOAD_ISA") ? " (or $ZOFFLOAD_ISA)" : "",
		    r == -ENOTSUP ? "this CPU lacks it" : "unknown instruction set");
		return r;
	}
	if (d->cfg.worker_threads == 0) {
		long n = sysconf(_SC_NPROCESSORS_ONLN);

		d->cfg.worker_threads = n > 0 ? (unsigned)n : 1;
	}
	d->base = event_base_new();
	/*
	 * Two priorities: the engine's completions (0) run before any client's
	 * request (1, the default), so that no flood of control requests
	 * delays the steps of others.
	 */
	if (d->base == NULL || event_base_priority_init(d->base, 2) != 0) {
		r = -ENOMEM;
		goto out;
	}
	r = start_engine(d);
	if (r < 0)
		goto out;
	/*
	 * Signals are caught before the socket answers: whoever sees it answer may
	 * send SIGTERM at once, which must drain and exit 0, not kill the daemon
	 * with the socket left behind (cli::start_stop caught this under ASan).
	 */
	for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
		d->ev_signals[i] = evsignal_new(d->base, sigs[i], signal_cb, d);
		if (d->ev_signals[i] == NULL || event_add(d->ev_signals[i], NULL) != 0) {
			r = -ENOMEM;
			goto out;
		}
	}
	r = open_listener(d);
	if (r < 0)
		goto out;
	d->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	zd_fd_init(d);
	d->ev_listen = event_new(d->base, d->listen_fd, EV_READ | EV_PERSIST, accept_cb, d);
	if (d->ev_listen == NULL || event_add(d->ev_listen, NULL)) {
		r = -ENOMEM;
		goto out;
	}
	r = zd_metrics_start(d, d->base, &metrics);
	if (r < 0)
		goto out;
	d->last_tick_ns = zu_now_ns();
	d->ev_tick = event_new(d->base, -1, EV_PERSIST, tick_cb, d);
	if (d->ev_tick == NULL || event_add(d->ev_tick, &(struct timeval){ 1, 0 }) != 0 ||
	    start_watchdog(d) != 0) {
		r = -ENOMEM;
		goto out;
	}
	log_info("zoffloadd listening on %s: %u worker threads, kernels %s, config %s",
	    d->cfg.socket_path, d->cfg.worker_threads, zk_isa_name(d->isa), d->cfg.source);
	zd_notify_ready(d);

	event_base_dispatch(d->base);

	log_info("shutting down: %u session(s) closed", d->nsessions);
	r = 0;
	if (d->handoff)
		handoff(d);
out:
	/* What is freed from here on is the process's, not the state: the store keeps it. */
	d->store.quiet = true;
	while (!TAILQ_EMPTY(&d->sessions))
		zd_session_close(TAILQ_FIRST(&d->sessions));
	/* Detached ranks' state goes with the daemon. */
	zd_job_expire_detached(d, true);
	zd_metrics_free(metrics);
	/* Checkpoint file I/O first: a save from memory holds its tensor's arrays. */
	if (d->ev_ckpt != NULL)
		event_free(d->ev_ckpt);
	d->ev_ckpt = NULL;
	zd_ckpt_stop(d);
	zd_closer_stop(d);
	/* Work still queued finishes first (none is left after a drain); then the tiers go. */
	ze_engine_free(d->engine);
	d->engine = NULL;
	while (!TAILQ_EMPTY(&d->uids)) {
		struct zd_uid *u = TAILQ_FIRST(&d->uids);

		TAILQ_REMOVE(&d->uids, u, entry);
		ze_account_unref(u->account);
		free(u);
	}
	for (size_t i = 0; i < sizeof(d->ev_signals) / sizeof(d->ev_signals[0]); i++)
		if (d->ev_signals[i] != NULL)
			event_free(d->ev_signals[i]);
	if (d->ev_listen != NULL)
		event_free(d->ev_listen);
	if (d->ev_stepper != NULL)
		event_free(d->ev_stepper);
	if (d->ev_tick != NULL)
		event_free(d->ev_tick);
	if (d->ev_watchdog != NULL)
		event_free(d->ev_watchdog);
	if (d->ev_swap != NULL)
		event_free(d->ev_swap);
	if (d->listen_fd >= 0) {
		close(d->listen_fd);
		unlink_own_socket(d);
	}
	if (d->spare_fd >= 0)
		close(d->spare_fd);
	if (d->base != NULL)
		event_base_free(d->base);
	zd_restart_end(d);
	return r;
}
