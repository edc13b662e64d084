/* Per-uid holdings against the per-uid limits; the descriptors the daemon keeps for its clients. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>

#include "daemon.h"
#include "engine.h"
#include "log.h"
#include "uid.h"

static struct ze_account_limits
uid_limits(const struct zd_daemon *d)
{
	return (struct ze_account_limits){
		.pinned_budget = d->cfg.uid_pinned_budget,
		.swap_budget = d->cfg.uid_swap_budget,
		.pinned_what = "limits.uid_pinned_budget of its uid",
		.swap_what = "limits.uid_swap_budget of its uid",
	};
}

void
zd_uid_reload_limits(struct zd_daemon *d)
{
	struct ze_account_limits l = uid_limits(d);
	struct zd_uid *u;

	TAILQ_FOREACH(u, &d->uids, entry)
		ze_account_set_limits(u->account, &l);
}

struct zd_uid *
zd_uid_get(struct zd_daemon *d, uid_t uid)
{
	struct ze_account_limits limits = uid_limits(d);
	struct zd_uid *u;

	TAILQ_FOREACH(u, &d->uids, entry)
		if (u->uid == uid)
			return u;
	u = calloc(1, sizeof(*u));
	if (u == NULL)
		return NULL;
	if (ze_account_new(&limits, &u->account) < 0) {
		free(u);
		return NULL;
	}
	u->uid = uid;
	TAILQ_INIT(&u->job_list);
	TAILQ_INSERT_TAIL(&d->uids, u, entry);
	return u;
}

void
zd_uid_put(struct zd_daemon *d, struct zd_uid *u)
{
	uint64_t pinned, swap;

	if (u == NULL || u->sessions > 0 || u->jobs > 0 || u->tensors > 0 || u->fds > 0 ||
	    u->shm_bytes > 0 || u->queued_bytes > 0 || u->ckpt_buffer_bytes > 0 ||
	    u->ckpt_waiting > 0)
		return;
	ze_account_usage(u->account, &pinned, &swap);
	if (pinned > 0 || swap > 0)
		return;
	TAILQ_REMOVE(&d->uids, u, entry);
	ze_account_unref(u->account);
	free(u);
}


void
zd_fd_init(struct zd_daemon *d)
{
	struct rlimit rl;
	struct dirent *e;
	unsigned open_fds = 0;
	DIR *dir;

	/* Descriptors are what clients cost the daemon most: take all the hard limit allows. */
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
		if (rl.rlim_cur < rl.rlim_max) {
			rl.rlim_cur = rl.rlim_max;
			(void)setrlimit(RLIMIT_NOFILE, &rl);
			(void)getrlimit(RLIMIT_NOFILE, &rl);
		}
		d->fd_limit = rl.rlim_cur > (1u << 24) ? 1u << 24 : (unsigned)rl.rlim_cur;
	} else {
		d->fd_limit = 1024;
	}
	dir = opendir("/proc/self/fd");
	if (dir != NULL) {
		while ((e = readdir(dir)) != NULL)
			open_fds += e->d_name[0] != '.';
		closedir(dir);
		open_fds--;	/* the directory's own */
	} else {
		open_fds = 64;
	}
	d->fd_base = open_fds;
	log_info("descriptors: limit %u, %u held at start, %u per uid (limits.uid_max_fds), "
	    "%u kept for accept and root", d->fd_limit, d->fd_base, zd_uid_fd_cap(d),
	    ZD_FD_RESERVE);
}

/* What clients may hold in all: the limit less what the daemon holds for itself. */
static unsigned
client_fd_budget(const struct zd_daemon *d)
{
	return d->fd_limit > d->fd_base ? d->fd_limit - d->fd_base : 0;
}

unsigned
zd_uid_fd_cap(const struct zd_daemon *d)
{
	unsigned budget = client_fd_budget(d), cap;

	if (d->cfg.uid_max_fds > 0)
		return d->cfg.uid_max_fds;
	cap = budget > ZD_FD_RESERVE ? (budget - ZD_FD_RESERVE) / 4 : 0;
	return cap < 16 ? 16 : cap;
}

int
zd_uid_charge(struct zd_daemon *d, struct zd_uid *u, unsigned fds, uint64_t shm,
    unsigned tensors, char *err, size_t errlen)
{
	unsigned budget = client_fd_budget(d);
	bool root = u->uid == 0;
	/* Root keeps a few for accept itself and the spare descriptor. */
	unsigned room = root ? (budget > 8 ? budget - 8 : 0) :
	    (budget > ZD_FD_RESERVE ? budget - ZD_FD_RESERVE : 0);

	if (!root && d->cfg.uid_max_tensors > 0 && tensors > 0 &&
	    u->tensors + tensors > d->cfg.uid_max_tensors) {
		snprintf(err, errlen, "uid %u holds %u tensors, limits.uid_max_tensors is %u",
		    (unsigned)u->uid, u->tensors, d->cfg.uid_max_tensors);
		return -EDQUOT;
	}
	if (!root && fds > 0 && u->fds + fds > zd_uid_fd_cap(d)) {
		snprintf(err, errlen, "uid %u holds %u descriptors in the daemon, "
		    "limits.uid_max_fds is %u", (unsigned)u->uid, u->fds, zd_uid_fd_cap(d));
		return -EMFILE;
	}
	if (fds > 0 && d->client_fds + fds > room) {
		snprintf(err, errlen, "the daemon holds %u of its %u descriptors for clients%s",
		    d->client_fds, budget, root ? "" : "; the rest is kept for accept and root");
		return -ENFILE;
	}
	if (!root && d->cfg.uid_shm_budget > 0 && shm > 0 &&
	    u->shm_bytes + shm > d->cfg.uid_shm_budget) {
		char used[32], limit[32];

		zd_fmt_bytes(u->shm_bytes, used, sizeof(used));
		zd_fmt_bytes(d->cfg.uid_shm_budget, limit, sizeof(limit));
		snprintf(err, errlen, "uid %u holds %s of shared memory, limits.uid_shm_budget is "
		    "%s", (unsigned)u->uid, used, limit);
		return -EDQUOT;
	}
	zd_uid_count(d, u, fds, shm, tensors);
	return 0;
}

void
zd_uid_count(struct zd_daemon *d, struct zd_uid *u, unsigned fds, uint64_t shm,
    unsigned tensors)
{
	u->fds += fds;
	u->shm_bytes += shm;
	u->tensors += tensors;
	d->client_fds += fds;
}

void
zd_uid_hold_fd(struct zd_daemon *d, struct zd_uid *u)
{
	u->fds++;
	d->client_fds++;
}

void
zd_uid_refund(struct zd_daemon *d, struct zd_uid *u, unsigned fds, uint64_t shm,
    unsigned tensors)
{
	u->fds -= fds;
	u->shm_bytes -= shm;
	u->tensors -= tensors;
	d->client_fds -= fds;
}
