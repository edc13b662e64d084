/*
 * The restart table's write-through: the recovery table and the fd store kept up to date
 * as jobs and tensors come and go (job.c calls it), so that a restart finds them.  A leaf:
 * it calls nothing above it; restart.c reads what it wrote back at start-up.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#include "crc32c.h"
#include "daemon.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "recover.h"
#include "restart_table.h"

uint32_t
zd_restart_table_crc(const struct zd_table *t)
{
	return zu_crc32c(0, &t->nswap, sizeof(*t) - offsetof(struct zd_table, nswap));
}

void
zd_restart_table_seal(struct zd_daemon *d)
{
	if (d->table != NULL)
		d->table->crc = zd_restart_table_crc(d->table);
}

int
zd_restart_keep_fd(struct zd_daemon *d, const char *name, int fd, bool kept)
{
	int r;

	if (fd < 0)
		return 0;
	/* Kept ones are in systemd's store still: listed for a successor, not sent again. */
	r = zd_fdstore_add(&d->store, name, fd, !kept);
	if (r < 0)
		log_warn(r, "cannot keep %s in the file descriptor store", name);
	return r;
}

int
zd_restart_room(struct zd_daemon *d, uid_t uid, char *err, size_t errlen)
{
	unsigned used = 0, mine = 0;

	if (d->table == NULL)
		return 0;
	for (unsigned j = 0; j < ZD_TABLE_JOBS; j++) {
		used += d->table->jobs[j].id != 0;
		mine += d->table->jobs[j].id != 0 && d->table->jobs[j].uid == (uint32_t)uid;
	}
	if (used >= ZD_TABLE_JOBS) {
		snprintf(err, errlen, "the recovery table is full (%d jobs, detached ones "
		    "included): a job can be opened once another ends", ZD_TABLE_JOBS);
		return -ENOSPC;
	}
	if (uid != 0 && mine >= ZD_TABLE_UID_JOBS) {
		snprintf(err, errlen, "uid %u holds %u jobs (detached ones included), the most "
		    "one uid may keep in the recovery table", (unsigned)uid, mine);
		return -EDQUOT;
	}
	return 0;
}

void
zd_restart_keep_job(struct zd_daemon *d, struct zd_job *job)
{
	struct zd_table_job *free_slot = NULL;

	if (d->table == NULL)
		return;
	for (unsigned j = 0; j < ZD_TABLE_JOBS; j++) {
		if (d->table->jobs[j].id == job->id) {
			job->table_slot = j + 1;
			return;
		}
		if (free_slot == NULL && d->table->jobs[j].id == 0)
			free_slot = &d->table->jobs[j];
	}
	if (free_slot == NULL) {
		log_warnx("job '%s': the recovery table is full (%d jobs); a restart will not "
		    "find its state", job->name, ZD_TABLE_JOBS);
		return;
	}
	*free_slot = (struct zd_table_job){ .id = job->id, .uid = (uint32_t)job->uid,
		.world_size = job->world_size, .pinned_budget = job->pinned_budget,
		.policy = job->policy, .state_format = job->state_format };
	snprintf(free_slot->name, sizeof(free_slot->name), "%s", job->name);
	job->table_slot = (unsigned)(free_slot - d->table->jobs) + 1;
	zd_restart_table_seal(d);
}

void
zd_restart_forget_job(struct zd_daemon *d, struct zd_job *job)
{
	/* Shutting down: the job is kept for the next start. */
	if (d->table == NULL || job->table_slot == 0 || d->store.quiet)
		return;
	d->table->jobs[job->table_slot - 1].id = 0;
	job->table_slot = 0;
	zd_restart_table_seal(d);
}

void
zd_restart_keep_tensor(struct zd_daemon *d, struct zd_tensor *t)
{
	uint64_t owner[ZE_OWNER_WORDS] = { [OWNER_JOB] = t->job->id, [OWNER_RANK] = t->rank,
		[OWNER_UID] = t->owner->uid };
	struct ze_tensor_fds fds;
	unsigned long long id = (unsigned long long)ze_tensor_id(t->et);
	char name[48];

	ze_tensor_set_owner(t->et, owner);
	ze_tensor_fds(t->et, &fds);
	snprintf(name, sizeof(name), "zt%llu.rec", id);
	zd_restart_keep_fd(d, name, fds.record, d->adopting);
	snprintf(name, sizeof(name), "zt%llu.state", id);
	zd_restart_keep_fd(d, name, fds.state, d->adopting);
	snprintf(name, sizeof(name), "zt%llu.grad", id);
	zd_restart_keep_fd(d, name, fds.grad, d->adopting);
	snprintf(name, sizeof(name), "zt%llu.param", id);
	zd_restart_keep_fd(d, name, fds.param, d->adopting);
}

void
zd_restart_forget_tensor(struct zd_daemon *d, struct ze_tensor *et)
{
	static const char *const parts[] = { "rec", "state", "grad", "param", "param2" };
	unsigned long long id = (unsigned long long)ze_tensor_id(et);
	char name[48];

	for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
		snprintf(name, sizeof(name), "zt%llu.%s", id, parts[i]);
		zd_fdstore_remove(&d->store, name);
	}
}
