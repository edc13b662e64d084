/* Start-up after a restart: what the store handed back checked whole, then jobs and tensors rebuilt. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "daemon.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "recover.h"
#include "restart.h"
#include "restart_table.h"
#include "swap.h"

static int
table_create(struct zd_daemon *d)
{
	void *map;
	int fd = memfd_create("zoffload-table", MFD_CLOEXEC), r;

	if (fd < 0)
		return -errno;
	if (ftruncate(fd, sizeof(struct zd_table)) != 0) {
		r = -errno;
		close(fd);
		return r;
	}
	map = mmap(NULL, sizeof(struct zd_table), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED) {
		r = -errno;
		close(fd);
		return r;
	}
	d->table = map;
	d->table->magic = ZD_TABLE_MAGIC;
	d->table->version = ZD_TABLE_VERSION;
	d->table->chunk_elements = d->cfg.chunk_elements;
	d->table->block_size = (uint32_t)d->cfg.swap_block_size;
	zd_restart_table_seal(d);
	d->table_fd = fd;
	return 0;
}

/* A start that cannot make its table says so: the daemon's exit status alone would not. */
static int
table_new(struct zd_daemon *d)
{
	int r = table_create(d);

	if (r < 0)
		log_errorx("cannot make the recovery table: %s", strerror(-r));
	return r;
}

static void
close_kept(int *fd)
{
	if (*fd > 2)
		close(*fd);
	*fd = 0;
}

static void
kept_reset(struct zd_daemon *d)
{
	for (unsigned i = 0; i < ZD_MAX_SWAP_PATHS; i++) {
		close_kept(&d->kept_swap[i]);
		close_kept(&d->kept_swaplock[i]);
		d->swap_in_store[i] = d->swaplock_in_store[i] = false;
	}
	close_kept(&d->kept_journal);
	for (unsigned i = 0; i < d->nkept_staging; i++)
		close_kept(&d->kept_staging[i]);
	d->nkept_staging = 0;
}

/* Where swap path i is and what it is, for the table or to compare with it. */
static int
swap_identity(const char *path, int kept_fd, struct zd_table_swap *ret)
{
	struct stat st;

	memset(ret, 0, sizeof(*ret));
	snprintf(ret->path, sizeof(ret->path), "%s", path);
	if (kept_fd > 2 ? fstat(kept_fd, &st) != 0 : stat(path, &st) != 0)
		return -errno;
	if (S_ISDIR(st.st_mode))
		return -EISDIR;
	ret->kind = S_ISBLK(st.st_mode) ? SWAP_BLOCKDEV : SWAP_FILE;
	ret->dev = st.st_dev;
	ret->ino = st.st_ino;
	ret->size = S_ISBLK(st.st_mode) ? 0 : (uint64_t)st.st_size;
	return 0;
}

/* The kept swap files are the ones the state was written to; err says which is not. */
static int
check_swap(struct zd_daemon *d, const struct zd_table *tb, char *err, size_t errlen)
{
	if (tb->nswap != d->cfg.nswap_paths) {
		snprintf(err, errlen, "the state was kept on %u swap path(s), swap.paths names %u",
		    tb->nswap, d->cfg.nswap_paths);
		return -EINVAL;
	}
	for (unsigned i = 0; i < tb->nswap; i++) {
		const struct zd_table_swap *w = &tb->swap[i];
		struct zd_table_swap now;
		char name[32];
		struct stat st;
		int r;

		if (strcmp(w->path, d->cfg.swap_paths[i].path) != 0) {
			snprintf(err, errlen, "swap path %u was %s when the state was kept, it is %s now",
			    i, w->path, d->cfg.swap_paths[i].path);
			return -EINVAL;
		}
		/*
		 * The file was made that large (a file already larger is left so, hence not
		 * "equal"); more space than it holds would be handed out past its end.
		 */
		if (d->cfg.swap_paths[i].capacity > w->size) {
			snprintf(err, errlen, "swap path %s: swap.paths capacity is %" PRIu64 " bytes, "
			    "the state was kept in a file of %" PRIu64, w->path,
			    d->cfg.swap_paths[i].capacity, w->size);
			return -EINVAL;
		}
		snprintf(name, sizeof(name), "swap%u", i);
		d->kept_swap[i] = zd_fdstore_take(&d->store, name);
		snprintf(name, sizeof(name), "swaplock%u", i);
		d->kept_swaplock[i] = zd_fdstore_take(&d->store, name);
		d->swap_in_store[i] = d->kept_swap[i] > 2;
		d->swaplock_in_store[i] = d->kept_swaplock[i] > 2;
		if (w->kind == SWAP_UNNAMED) {
			/* An unnamed file in a directory: only the kept descriptor reaches it. */
			if (d->kept_swap[i] < 0) {
				snprintf(err, errlen, "swap file in %s (unnamed) was not handed back: the "
				    "NVMe state kept there is gone", w->path);
				return -ENOENT;
			}
			if (fstat(d->kept_swap[i], &st) != 0 || st.st_ino != w->ino ||
			    st.st_dev != w->dev || (uint64_t)st.st_size != w->size) {
				snprintf(err, errlen, "swap file in %s is not the one the state was kept "
				    "in (%" PRIu64 " bytes expected)", w->path, w->size);
				return -ESTALE;
			}
			continue;
		}
		r = swap_identity(w->path, -1, &now);
		if (r == -ENOENT) {
			snprintf(err, errlen, "swap file %s is missing: the NVMe state kept there is "
			    "gone", w->path);
			return r;
		}
		if (r < 0) {
			snprintf(err, errlen, "swap file %s: %s", w->path, strerror(-r));
			return r;
		}
		if (now.dev != w->dev || now.ino != w->ino) {
			snprintf(err, errlen, "swap file %s is not the one the state was kept in (it "
			    "was replaced: inode %" PRIu64 ", was %" PRIu64 ")", w->path, now.ino, w->ino);
			return -ESTALE;
		}
		if (now.size != w->size) {
			snprintf(err, errlen, "swap file %s is %" PRIu64 " bytes, the state was kept in "
			    "one of %" PRIu64 " bytes", w->path, now.size, w->size);
			return -ESTALE;
		}
		if (d->kept_swap[i] > 2 && (swap_identity(w->path, d->kept_swap[i], &now) != 0 ||
		    now.ino != w->ino || now.dev != w->dev)) {
			snprintf(err, errlen, "swap file %s: the descriptor handed back is another file",
			    w->path);
			return -ESTALE;
		}
	}
	return 0;
}

/* Every tensor record handed back reads whole, before any is used. */
static int
check_records(struct zd_daemon *d, const struct zd_table *tb, char *err, size_t errlen)
{
	for (size_t i = 0; i < d->store.nkept; i++) {
		const struct zd_fdstore_entry *k = &d->store.kept[i];
		struct ze_record_info info;
		char why[200];
		bool job = false;
		int r;

		if (k->fd < 0 || strncmp(k->name, "zt", 2) != 0 ||
		    strcmp(k->name + strlen(k->name) - 4, ".rec") != 0)
			continue;
		r = ze_record_peek(k->fd, &info, why, sizeof(why));
		if (r < 0) {
			snprintf(err, errlen, "tensor record %s: %s", k->name, why);
			return r;
		}
		for (unsigned j = 0; j < ZD_TABLE_JOBS && !job; j++)
			job = tb->jobs[j].id != 0 && tb->jobs[j].id == info.owner[OWNER_JOB];
		if (!job) {
			snprintf(err, errlen, "tensor record %s ('%s') names job id %" PRIu64 ", which "
			    "the recovery table does not list", k->name, info.name,
			    info.owner[OWNER_JOB]);
			return -EBADMSG;
		}
	}
	return 0;
}

static int
check_table(struct zd_daemon *d, int fd, char *err, size_t errlen)
{
	struct stat st;
	struct zd_table *tb;
	int r;

	if (fstat(fd, &st) != 0 || (size_t)st.st_size < offsetof(struct zd_table, nswap)) {
		snprintf(err, errlen, "the recovery table is truncated");
		return -EBADMSG;
	}
	tb = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (tb == MAP_FAILED) {
		r = -errno;
		snprintf(err, errlen, "the recovery table cannot be mapped: %s", strerror(-r));
		return r;
	}
	if (tb->magic != ZD_TABLE_MAGIC) {
		snprintf(err, errlen, "the descriptor named \"table\" is not a recovery table");
		r = -EBADMSG;
	} else if (tb->version != ZD_TABLE_VERSION) {
		snprintf(err, errlen, "the recovery table is version %u; this zoffloadd knows "
		    "version %u", tb->version, ZD_TABLE_VERSION);
		r = -EPROTONOSUPPORT;
	} else if ((size_t)st.st_size != sizeof(*tb)) {
		snprintf(err, errlen, "the recovery table is %lld bytes, version %u has %zu",
		    (long long)st.st_size, tb->version, sizeof(*tb));
		r = -EBADMSG;
	} else if (zd_restart_table_crc(tb) != tb->crc) {
		snprintf(err, errlen, "the recovery table's checksum fails (stored %08x, "
		    "computed %08x)", tb->crc, zd_restart_table_crc(tb));
		r = -EBADMSG;
	} else if (tb->chunk_elements != d->cfg.chunk_elements) {
		snprintf(err, errlen, "swap.chunk_elements is %" PRIu64 "; the state was kept with "
		    "%" PRIu64, d->cfg.chunk_elements, tb->chunk_elements);
		r = -EINVAL;
	} else if (tb->nswap > 1 && tb->block_size != 0 &&
	    tb->block_size != d->cfg.swap_block_size) {
		/* One path holds each extent whole; over several the unit says where it lies. */
		snprintf(err, errlen, "swap.block_size is %" PRIu64 "; the state was striped over %u "
		    "swap paths with %u", d->cfg.swap_block_size, tb->nswap, tb->block_size);
		r = -EINVAL;
	} else {
		r = check_swap(d, tb, err, errlen);
		if (r == 0)
			r = check_records(d, tb, err, errlen);
	}
	if (r < 0) {
		munmap(tb, (size_t)st.st_size);
		return r;
	}
	d->table = tb;
	d->table_fd = fd;
	return 0;
}

/* start_empty: the kept state goes; named swap files are moved aside, not reused. */
static void
set_aside(struct zd_daemon *d)
{
	char aside[4200];

	for (unsigned i = 0; i < d->cfg.nswap_paths; i++) {
		struct stat st;

		if (stat(d->cfg.swap_paths[i].path, &st) != 0 || !S_ISREG(st.st_mode))
			continue;
		snprintf(aside, sizeof(aside), "%s.aside-%lld", d->cfg.swap_paths[i].path,
		    (long long)time(NULL));
		if (rename(d->cfg.swap_paths[i].path, aside) == 0)
			log_warnx("recovery.start_empty: swap file %s moved aside to %s",
			    d->cfg.swap_paths[i].path, aside);
		else
			log_warn(-errno, "recovery.start_empty: cannot move swap file %s aside",
			    d->cfg.swap_paths[i].path);
	}
	kept_reset(d);
	/* Nothing kept: the table, the swap files and the rest start afresh, stored anew. */
	zd_fdstore_forget_kept(&d->store);
}

int
zd_restart_begin(struct zd_daemon *d)
{
	char err[512];
	bool records = false;
	int fd, r;

	d->table_fd = -1;
	r = zd_fdstore_init(&d->store, err, sizeof(err));
	if (r < 0) {
		log_errorx("%s", err);
		return r;
	}
	for (size_t i = 0; i < d->store.nkept; i++)
		records = records || strncmp(d->store.kept[i].name, "zt", 2) == 0;
	fd = zd_fdstore_take(&d->store, "table");
	if (fd < 0 && !records) {
		/* Nothing kept, or only engine buffers of a run that held no state: fresh. */
		zd_fdstore_drop_kept(&d->store, true);
		return table_new(d);
	}
	if (fd < 0) {
		snprintf(err, sizeof(err), "tensor records were handed back without the recovery "
		    "table");
		r = -EBADMSG;
	} else {
		r = check_table(d, fd, err, sizeof(err));
	}
	if (r == 0) {
		char name[32];

		d->kept_journal = zd_fdstore_take(&d->store, "journal");
		for (unsigned i = 0; i < 256; i++) {
			snprintf(name, sizeof(name), "staging%u", i);
			d->kept_staging[i] = zd_fdstore_take(&d->store, name);
			if (d->kept_staging[i] < 0)
				break;
			d->nkept_staging = i + 1;
		}
		return 0;
	}
	if (!d->start_empty) {
		log_errorx("refusing to start: %s.  The kept state is left as it is; to start "
		    "empty instead (setting it aside), run zoffloadd --start-empty or set "
		    "recovery.start_empty", err);
		kept_reset(d);
		if (fd >= 0)
			close(fd);
		zd_fdstore_drop_kept(&d->store, false);
		return r;
	}
	log_warnx("recovery: %s; starting empty (recovery.start_empty)", err);
	if (fd >= 0)
		close(fd);
	set_aside(d);
	return table_new(d);
}

/* The engine's and the swap files' descriptors, and the table's record of the swap files. */
static void
keep_engine(struct zd_daemon *d, bool recovering)
{
	struct zs_swap *swap = ze_engine_swap(d->engine);
	char name[32];

	zd_restart_keep_fd(d, "table", d->table_fd, recovering);
	zd_restart_keep_fd(d, "journal", ze_engine_journal_fd(d->engine), recovering &&
	    d->kept_journal > 2);
	for (unsigned i = 0; i < ze_engine_staging_count(d->engine); i++) {
		snprintf(name, sizeof(name), "staging%u", i);
		zd_restart_keep_fd(d, name, ze_engine_staging_fd(d->engine, i), recovering &&
		    i < d->nkept_staging);
	}
	d->table->nswap = swap != NULL ? d->cfg.nswap_paths : 0;
	for (unsigned i = 0; swap != NULL && i < d->cfg.nswap_paths; i++) {
		int fd, lock_fd;
		struct stat st;

		zs_swap_path_fds(swap, i, &fd, &lock_fd);
		snprintf(name, sizeof(name), "swap%u", i);
		zd_restart_keep_fd(d, name, fd, d->swap_in_store[i]);
		snprintf(name, sizeof(name), "swaplock%u", i);
		zd_restart_keep_fd(d, name, lock_fd, d->swaplock_in_store[i]);
		if (recovering)
			continue;
		(void)swap_identity(d->cfg.swap_paths[i].path, fd, &d->table->swap[i]);
		snprintf(d->table->swap[i].path, sizeof(d->table->swap[i].path), "%s",
		    d->cfg.swap_paths[i].path);
		if (stat(d->cfg.swap_paths[i].path, &st) == 0 && S_ISDIR(st.st_mode))
			d->table->swap[i].kind = SWAP_UNNAMED;
	}
	zd_restart_table_seal(d);
	/* Taken over by the engine and the swap engine now. */
	for (unsigned i = 0; i < ZD_MAX_SWAP_PATHS; i++) {
		d->kept_swap[i] = d->kept_swaplock[i] = 0;
		d->swap_in_store[i] = d->swaplock_in_store[i] = false;
	}
	d->kept_journal = 0;
	d->nkept_staging = 0;
}

static struct zd_job *
find_job(struct zd_daemon *d, uint64_t id)
{
	struct zd_job *job;

	TAILQ_FOREACH(job, &d->jobs, entry)
		if (job->id == id)
			return job;
	return NULL;
}

/* The tensor kept as zt<id>: its job rebuilt from the table first if need be. */
static int
adopt_one(struct zd_daemon *d, const char *id, uint64_t *pinned, uint64_t *nvme)
{
	struct ze_tensor_fds fds;
	struct ze_record_info info;
	struct ze_adopt_report rep;
	struct ze_tensor *et = NULL;
	struct zd_job *job;
	const char *test_enomem;
	char name[48], err[400];
	bool alt, made;
	int r, alt_fd;

	snprintf(name, sizeof(name), "zt%s.rec", id);
	fds.record = zd_fdstore_take(&d->store, name);
	snprintf(name, sizeof(name), "zt%s.state", id);
	fds.state = zd_fdstore_take(&d->store, name);
	snprintf(name, sizeof(name), "zt%s.grad", id);
	fds.grad = zd_fdstore_take(&d->store, name);
	/*
	 * A param slot an older zoffloadd sealed against writes is replaced (once: the new one
	 * is not sealed), its new memfd kept under the other of two names before the old one
	 * is dropped: a death in between leaves both, equal.
	 */
	snprintf(name, sizeof(name), "zt%s.param", id);
	fds.param = zd_fdstore_take(&d->store, name);
	snprintf(name, sizeof(name), "zt%s.param2", id);
	alt_fd = zd_fdstore_take(&d->store, name);
	alt = fds.param < 0;
	if (alt) {
		fds.param = alt_fd;
	} else if (alt_fd >= 0) {
		/* Both: a start died between keeping the new one and dropping the old. */
		close(alt_fd);
		zd_fdstore_forget(&d->store, name);
	}
	r = fds.grad < 0 || fds.param < 0 ? -ENOENT : ze_record_peek(fds.record, &info, err,
	    sizeof(err));
	if (r < 0) {
		log_errorx("refusing to start: tensor zt%s: %s", id, r == -ENOENT ?
		    "its grad or param slot was not handed back" : err);
		goto fail;
	}
	job = find_job(d, info.owner[OWNER_JOB]);
	made = job == NULL;
	for (unsigned j = 0; job == NULL && j < ZD_TABLE_JOBS; j++) {
		const struct zd_table_job *tj = &d->table->jobs[j];

		if (tj->id != info.owner[OWNER_JOB])
			continue;
		job = zd_job_new(d, (uid_t)tj->uid, tj->name, tj->world_size, (uint8_t)tj->policy,
		    tj->pinned_budget, (uint8_t)tj->state_format, tj->id);
		if (job == NULL) {
			r = -ENOMEM;
			log_errorx("refusing to start: out of memory rebuilding job '%s'", tj->name);
			goto fail;
		}
		d->recovered_jobs++;
	}
	/*
	 * Test only (tests/restart): this start runs out of memory at tensor zt<id>, after
	 * adopting those before it, as no check before adoption can foresee.
	 */
	test_enomem = getenv("ZOFFLOADD_TEST_ADOPT_ENOMEM");
	if (test_enomem != NULL && strcmp(test_enomem, id) == 0) {
		r = -ENOMEM;
		snprintf(err, sizeof(err), "tensor '%s': cannot take back its state: %s "
		    "(ZOFFLOADD_TEST_ADOPT_ENOMEM)", info.name, ze_strerror(r));
	} else {
		r = zd_job_adopt_tensor(d, job, (uint32_t)info.owner[OWNER_RANK],
		    (uid_t)info.owner[OWNER_UID], &fds, &rep, &et, err, sizeof(err));
	}
	if (r == 0) {
		struct ze_tensor_fds now;
		char kept[48], final[48];

		/*
		 * zd_restart_keep_tensor listed the param slot as "param"; it is under the name it was
		 * kept as, or, replaced, under the other one: kept there before the old one goes.
		 */
		ze_tensor_fds(et, &now);
		snprintf(kept, sizeof(kept), "zt%s.param%s", id, alt ? "2" : "");
		snprintf(final, sizeof(final), "zt%s.param%s", id, alt != rep.param_replaced ?
		    "2" : "");
		snprintf(name, sizeof(name), "zt%s.param", id);
		zd_fdstore_rename(&d->store, name, final);
		if (rep.param_replaced) {
			log_info("job '%s' rank %u: tensor '%s': its param slot, sealed against "
			    "writes, was copied into a new one", job->name,
			    (unsigned)info.owner[OWNER_RANK], info.name);
			if (zd_fdstore_send(&d->store, final, now.param) < 0)
				log_warnx("cannot keep %s in the file descriptor store", final);
			zd_fdstore_forget(&d->store, kept);
		}
	}
	if (r < 0) {
		log_errorx("refusing to start: job '%s' rank %u: %s", job->name,
		    (unsigned)info.owner[OWNER_RANK], err);
		/* Rebuilt for this tensor alone: it goes, and its slot stays as kept. */
		if (made)
			zd_job_discard(d, job);
		goto fail;
	}
	d->recovered_tensors++;
	*(info.on_nvme ? nvme : pinned) += info.numel * ZE_STATE_BYTES_PER_ELEMENT;
	if (rep.finished > 0 || rep.rewritten > 0)
		log_info("job '%s' rank %u: tensor '%s': a step cut short by the restart was made "
		    "whole (%u slice(s) finished from the journal, %u computed chunk(s) written "
		    "again)", job->name,
		    (unsigned)info.owner[OWNER_RANK], info.name, rep.finished, rep.rewritten);
	if (rep.torn_step != 0 && rep.finish_error < 0)
		log_errorx("job '%s' rank %u: tensor '%s' is torn: step %" PRIu64 " was half "
		    "applied when zoffloadd died and the journal could not finish it (%s); its "
		    "steps are refused until it is restored from a checkpoint", job->name,
		    (unsigned)info.owner[OWNER_RANK], info.name, rep.torn_step,
		    ze_strerror(rep.finish_error));
	else if (rep.torn_step != 0)
		log_errorx("job '%s' rank %u: tensor '%s' is torn: step %" PRIu64 " was half "
		    "applied when zoffloadd died (journal off); its steps are refused until it is "
		    "restored from a checkpoint", job->name, (unsigned)info.owner[OWNER_RANK],
		    info.name, rep.torn_step);
	else if (rep.partial_step != 0)
		log_info("job '%s' rank %u: tensor '%s': step %" PRIu64 " landed on part of it; "
		    "the rank's resubmission finishes it from the gradients in its slot", job->name,
		    (unsigned)info.owner[OWNER_RANK], info.name, rep.partial_step);
	return 0;
fail:
	if (fds.record >= 0)
		close(fds.record);
	if (fds.state >= 0)
		close(fds.state);
	if (fds.grad >= 0)
		close(fds.grad);
	if (fds.param >= 0)
		close(fds.param);
	return r;
}

/* A kept descriptor by name, left in the store (-1: none). */
static int
kept_fd(const struct zd_daemon *d, const char *name)
{
	for (size_t i = 0; i < d->store.nkept; i++)
		if (d->store.kept[i].fd >= 0 && strcmp(d->store.kept[i].name, name) == 0)
			return d->store.kept[i].fd;
	return -1;
}

/*
 * The kept tensor zt<id> could be adopted: what adopt_one would refuse, found with
 * nothing taken from the store and nothing written.  Adopting a tensor finishes the
 * journal's slice in it and settles its record: a refusal found at a later tensor
 * would leave those written, and a refused state is left as it was.
 */
static int
check_one(struct zd_daemon *d, const char *id)
{
	struct ze_tensor_fds fds;
	struct ze_record_info info;
	char name[48], err[400];
	int r;

	snprintf(name, sizeof(name), "zt%s.rec", id);
	fds.record = kept_fd(d, name);
	snprintf(name, sizeof(name), "zt%s.state", id);
	fds.state = kept_fd(d, name);
	snprintf(name, sizeof(name), "zt%s.grad", id);
	fds.grad = kept_fd(d, name);
	snprintf(name, sizeof(name), "zt%s.param", id);
	fds.param = kept_fd(d, name);
	if (fds.param < 0) {
		snprintf(name, sizeof(name), "zt%s.param2", id);
		fds.param = kept_fd(d, name);
	}
	r = fds.grad < 0 || fds.param < 0 ? -ENOENT : ze_record_peek(fds.record, &info, err,
	    sizeof(err));
	if (r < 0) {
		log_errorx("refusing to start: tensor zt%s: %s", id, r == -ENOENT ?
		    "its grad or param slot was not handed back" : err);
		return r;
	}
	r = ze_tensor_adopt_check(d->engine, &fds, err, sizeof(err));
	if (r < 0)
		log_errorx("refusing to start: tensor zt%s: %s", id, err);
	return r;
}

/* Calls fn for every kept tensor record, by its id, until one fails. */
static int
each_kept_tensor(struct zd_daemon *d, int (*fn)(struct zd_daemon *, const char *, void *),
    void *arg)
{
	int r = 0;

	for (size_t i = 0; i < d->store.nkept && r == 0; i++) {
		const struct zd_fdstore_entry *k = &d->store.kept[i];
		char id[24];
		size_t n = strlen(k->name);

		if (k->fd < 0 || n < 7 || n - 6 >= sizeof(id) || strncmp(k->name, "zt", 2) != 0 ||
		    strcmp(k->name + n - 4, ".rec") != 0)
			continue;
		memcpy(id, k->name + 2, n - 6);
		id[n - 6] = '\0';
		r = fn(d, id, arg);
	}
	return r;
}

static int
check_cb(struct zd_daemon *d, const char *id, void *arg)
{
	(void)arg;
	return check_one(d, id);
}

struct adopt_totals {
	uint64_t pinned, nvme;
};

static int
adopt_cb(struct zd_daemon *d, const char *id, void *arg)
{
	struct adopt_totals *tot = arg;

	return adopt_one(d, id, &tot->pinned, &tot->nvme);
}

int
zd_restart_finish(struct zd_daemon *d)
{
	uint64_t t0 = zu_now_ns(), pinned, nvme;
	bool recovering = d->store.nkept > 0 || d->kept_journal > 2;
	struct adopt_totals tot = { 0 };
	char a[32], b[32];
	int r;

	/* Two phases: every tensor checked with nothing written, then each adopted. */
	r = each_kept_tensor(d, check_cb, NULL);
	ze_adopt_checks_done(d->engine);
	if (r < 0)
		return r;
	d->adopting = true;
	r = each_kept_tensor(d, adopt_cb, &tot);
	d->adopting = false;
	pinned = tot.pinned;
	nvme = tot.nvme;
	if (r < 0)
		return r;
	ze_engine_recovered(d->engine);
	keep_engine(d, recovering);
	/* Jobs the table lists with no tensor left: nothing to wait for. */
	for (unsigned j = 0; j < ZD_TABLE_JOBS; j++)
		if (d->table->jobs[j].id != 0 && find_job(d, d->table->jobs[j].id) == NULL)
			d->table->jobs[j].id = 0;
	zd_restart_table_seal(d);
	/* Names this binary does not know (a newer one's): gone with this run. */
	zd_fdstore_drop_kept(&d->store, true);
	if (recovering) {
		zd_fmt_bytes(pinned, a, sizeof(a));
		zd_fmt_bytes(nvme, b, sizeof(b));
		log_info("recovered %u job(s), %u tensor(s) (%s of state pinned, %s on NVMe) in "
		    "%.1f ms; they wait %u s for their ranks to reattach", d->recovered_jobs,
		    d->recovered_tensors, a, b, (double)(zu_now_ns() - t0) / 1e6,
		    d->cfg.detach_grace_s);
	}
	return 0;
}

void
zd_restart_end(struct zd_daemon *d)
{
	kept_reset(d);
	zd_fdstore_fini(&d->store);
	if (d->table != NULL)
		munmap(d->table, sizeof(*d->table));
	if (d->table_fd >= 0)
		close(d->table_fd);
	d->table = NULL;
	d->table_fd = -1;
}
