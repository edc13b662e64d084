/* Jobs (the ranks of one training run) and their tensors' state and slots. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "log.h"

int
zd_job_attach(struct zd_session *s, const struct zp_job_open *req, char *err, size_t errlen)
{
	const char *name = req->job_name;
	uint32_t rank = req->rank, world_size = req->world_size;
	struct zd_daemon *d = s->daemon;
	struct zd_session *other;
	struct zd_job *job;

	if (s->job != NULL) {
		snprintf(err, errlen, "this connection already has job '%s' open", s->job->name);
		return -EISCONN;
	}
	TAILQ_FOREACH(job, &d->jobs, entry)
		if (strcmp(job->name, name) == 0)
			break;
	if (job != NULL) {
		if (job->uid != s->uid && s->uid != 0) {
			snprintf(err, errlen, "job '%s' belongs to uid %u", name, (unsigned)job->uid);
			return -EACCES;
		}
		if (job->world_size != world_size) {
			snprintf(err, errlen, "job '%s' has world size %u, not %u", name,
			    job->world_size, world_size);
			return -EINVAL;
		}
		TAILQ_FOREACH(other, &d->sessions, entry) {
			if (other->job == job && other->rank == rank) {
				snprintf(err, errlen, "rank %u of job '%s' is already attached (pid %d)",
				    rank, name, (int)other->pid);
				return -EADDRINUSE;
			}
		}
	} else {
		job = calloc(1, sizeof(*job));
		if (job == NULL) {
			snprintf(err, errlen, "out of memory");
			return -ENOMEM;
		}
		job->id = ++d->next_job_id;
		snprintf(job->name, sizeof(job->name), "%s", name);
		job->uid = s->uid;
		job->world_size = world_size;
		TAILQ_INIT(&job->detached);
		/* The first rank decides where the job's state goes. */
		job->policy = req->policy != ZP_POLICY_DEFAULT ? req->policy : d->cfg.policy;
		job->pinned_budget = req->pinned_budget > 0 ? req->pinned_budget :
		    d->cfg.job_pinned_budget;
		TAILQ_INSERT_TAIL(&d->jobs, job, entry);
		log_info("job '%s' (id %llu) opened by uid %u, world size %u", name,
		    (unsigned long long)job->id, (unsigned)s->uid, world_size);
	}
	job->refs++;
	job->ranks_attached++;
	s->job = job;
	s->rank = rank;
	return 0;
}

bool
zd_job_unref(struct zd_daemon *d, struct zd_job *job)
{
	if (--job->refs > 0)
		return false;
	log_info("job '%s' (id %llu) closed after %llu steps", job->name,
	    (unsigned long long)job->id, (unsigned long long)job->steps_applied);
	TAILQ_REMOVE(&d->jobs, job, entry);
	free(job);
	return true;
}

struct zd_uid *
zd_uid_get(struct zd_daemon *d, uid_t uid)
{
	struct zd_uid *u;

	TAILQ_FOREACH(u, &d->uids, entry)
		if (u->uid == uid)
			return u;
	u = calloc(1, sizeof(*u));
	if (u == NULL)
		return NULL;
	u->uid = uid;
	TAILQ_INSERT_TAIL(&d->uids, u, entry);
	return u;
}

/* Forgets a uid that holds nothing any more. */
void
zd_uid_put(struct zd_daemon *d, struct zd_uid *u)
{
	if (u == NULL || u->sessions > 0 || u->pinned_bytes > 0 || u->swap_bytes > 0)
		return;
	TAILQ_REMOVE(&d->uids, u, entry);
	free(u);
}

static void tensor_free(struct zd_daemon *d, struct zd_tensor *t);
static bool free_detached(struct zd_daemon *d, struct zd_job *job, struct zd_tensor *t);

/* A dead rank's tensor waits for a new process of the same job and rank. */
static void
keep_detached(struct zd_job *job, struct zd_tensor *t)
{
	t->session = NULL;
	t->detached = true;
	t->detached_ns = zd_now_ns();
	TAILQ_INSERT_TAIL(&job->detached, t, detached_entry);
	job->ndetached++;
	job->refs++;
}

void
zd_job_detach(struct zd_session *s, bool keep)
{
	struct zd_job *job = s->job;
	unsigned kept = 0;

	keep = keep && job != NULL && !job->dropping && s->daemon->cfg.detach_grace_s > 0 &&
	    !s->daemon->draining;
	for (uint32_t i = 0; i < s->ntensor_slots; i++) {
		struct zd_tensor *t = s->tensors[i];

		if (t == NULL)
			continue;
		s->tensors[i] = NULL;
		if (keep) {
			keep_detached(job, t);
			kept++;
		} else {
			zd_tensor_release(s->daemon, t);
		}
	}
	if (job == NULL)
		return;
	/*
	 * Not kept (JOB_CLOSE, no grace, a drop, shutdown): all of this rank's
	 * state goes now, tensors an earlier process of the rank left and this
	 * one did not take back included.  The session's reference holds the job.
	 */
	if (!keep) {
		struct zd_tensor *t, *next;

		for (t = TAILQ_FIRST(&job->detached); t != NULL; t = next) {
			next = TAILQ_NEXT(t, detached_entry);
			if (t->rank == s->rank)
				(void)free_detached(s->daemon, job, t);
		}
	}
	if (kept > 0)
		log_info("job '%s' rank %u detached (pid %d): %u tensor(s) wait %u s for a reattach",
		    job->name, s->rank, (int)s->pid, kept, s->daemon->cfg.detach_grace_s);
	job->ranks_attached--;
	s->job = NULL;
	zd_job_unref(s->daemon, job);
}

/* Frees one detached tensor; true when the job went with it. */
static bool
free_detached(struct zd_daemon *d, struct zd_job *job, struct zd_tensor *t)
{
	TAILQ_REMOVE(&job->detached, t, detached_entry);
	job->ndetached--;
	t->detached = false;
	/* Busy: freed when its batch completes, which drops this reference then. */
	if (t->busy) {
		t->session = NULL;
		return false;
	}
	tensor_free(d, t);
	return zd_job_unref(d, job);
}

void
zd_job_expire_detached(struct zd_daemon *d, bool all)
{
	uint64_t now = zd_now_ns(), grace = (uint64_t)d->cfg.detach_grace_s * 1000000000ull;
	struct zd_job *job, *next_job;
	struct zd_tensor *t, *next;

	for (job = TAILQ_FIRST(&d->jobs); job != NULL; job = next_job) {
		next_job = TAILQ_NEXT(job, entry);
		for (t = TAILQ_FIRST(&job->detached); t != NULL; t = next) {
			next = TAILQ_NEXT(t, detached_entry);
			if (!all && now - t->detached_ns < grace)
				continue;
			if (!all)
				log_info("job '%s' rank %u: tensor '%s' not reattached within %u s, freed",
				    job->name, t->rank, t->name, d->cfg.detach_grace_s);
			if (free_detached(d, job, t))
				break;
		}
	}
}

int
zd_job_drop(struct zd_session *s, const char *name, char *err, size_t errlen)
{
	struct zd_daemon *d = s->daemon;
	struct zd_session *other, *next_s;
	struct zd_job *job;
	unsigned closed = 0;

	TAILQ_FOREACH(job, &d->jobs, entry)
		if (strcmp(job->name, name) == 0)
			break;
	if (job == NULL) {
		snprintf(err, errlen, "no job named '%s'", name);
		return -ENOENT;
	}
	if (job->uid != s->uid && s->uid != 0) {
		snprintf(err, errlen, "job '%s' belongs to uid %u", name, (unsigned)job->uid);
		return -EPERM;
	}
	if (s->job == job) {
		snprintf(err, errlen, "this connection is a rank of job '%s'; close it instead", name);
		return -EBUSY;
	}
	job->dropping = true;
	/* Hold the job across the clean-up: its last reference may go in the middle. */
	job->refs++;
	for (other = TAILQ_FIRST(&d->sessions); other != NULL; other = next_s) {
		next_s = TAILQ_NEXT(other, entry);
		if (other->job == job) {
			zd_session_error(other, 0, -ECONNABORTED, "job '%s' was dropped", name);
			zd_session_close(other);
			closed++;
		}
	}
	while (!TAILQ_EMPTY(&job->detached))
		(void)free_detached(d, job, TAILQ_FIRST(&job->detached));
	log_info("job '%s' dropped by uid %u (pid %d): %u rank(s) disconnected", name,
	    (unsigned)s->uid, (int)s->pid, closed);
	zd_job_unref(d, job);
	return 0;
}

unsigned
zd_job_detached_ranks(const struct zd_job *job)
{
	const struct zd_tensor *t, *u;
	unsigned ranks = 0;

	/* Distinct ranks; the list holds only dead ranks' tensors. */
	TAILQ_FOREACH(t, &job->detached, detached_entry) {
		bool seen = false;

		TAILQ_FOREACH(u, &job->detached, detached_entry) {
			if (u == t)
				break;
			if (u->rank == t->rank)
				seen = true;
		}
		ranks += !seen;
	}
	return ranks;
}

static void
tensor_free(struct zd_daemon *d, struct zd_tensor *t)
{
	zd_shm_destroy(d, &t->grad_slot);
	zd_shm_destroy(d, &t->param_slot);
	if (t->state != NULL || t->on_nvme) {
		struct zd_uid *u = t->job != NULL ? zd_uid_get(d, t->job->uid) : NULL;

		if (u != NULL) {
			if (t->on_nvme)
				u->swap_bytes -= t->state_bytes;
			else
				u->pinned_bytes -= t->state_bytes;
		}
		zd_tier_release(d, t);
		zd_uid_put(d, u);
	}
	if (t->job != NULL) {
		t->job->tensors--;
		t->job->params -= t->numel;
	}
	free(t);
}

void
zd_tensor_release(struct zd_daemon *d, struct zd_tensor *t)
{
	struct zd_job *job = t->job;

	if (!t->busy) {
		tensor_free(d, t);
		return;
	}
	/* The stepper still reads and writes its state: free it when the batch is done. */
	t->session = NULL;
	job->refs++;
}

static int
add_handle(struct zd_session *s, struct zd_tensor *t)
{
	if (s->ntensor_slots == s->tensor_cap) {
		uint32_t cap = s->tensor_cap ? s->tensor_cap * 2 : 64;
		struct zd_tensor **bigger;

		if (cap > (1u << 24))
			return -EMFILE;
		bigger = realloc(s->tensors, cap * sizeof(*bigger));
		if (bigger == NULL)
			return -ENOMEM;
		s->tensors = bigger;
		s->tensor_cap = cap;
	}
	s->tensors[s->ntensor_slots++] = t;
	/* Handles are never reused on a connection, so a stale one cannot hit another tensor. */
	t->handle = s->ntensor_slots;
	return 0;
}

/* A new process of a dead rank takes its tensor back, state and slots as they were. */
static int
resume_detached(struct zd_session *s, const struct zp_tensor_register *req,
    struct zd_tensor **ret, char *err, size_t errlen)
{
	struct zd_job *job = s->job;
	struct zd_tensor *t;
	int r;

	TAILQ_FOREACH(t, &job->detached, detached_entry)
		if (t->rank == s->rank && strcmp(t->name, req->name) == 0)
			break;
	if (t == NULL)
		return 0;
	if (t->numel != req->numel || t->grad_dtype != (enum zk_dtype)req->grad_dtype ||
	    t->param_dtype != (enum zk_dtype)req->param_dtype ||
	    t->param_offload != ((req->flags & ZP_TENSOR_PARAM_OFFLOAD) != 0)) {
		snprintf(err, errlen, "tensor '%s' of rank %u is kept with %llu elements, grads %s, "
		    "params %s; it cannot be taken back as %llu elements, %s, %s", t->name, t->rank,
		    (unsigned long long)t->numel, zk_dtype_name(t->grad_dtype),
		    zk_dtype_name(t->param_dtype), (unsigned long long)req->numel,
		    zk_dtype_name((enum zk_dtype)req->grad_dtype),
		    zk_dtype_name((enum zk_dtype)req->param_dtype));
		return -EINVAL;
	}
	/*
	 * A step the dead rank submitted is still running on it: its last_step
	 * is about to change, and the client would resume from the wrong one.
	 */
	if (t->busy) {
		snprintf(err, errlen, "tensor '%s' of rank %u is finishing a step its previous "
		    "process submitted; register it again when that is done", t->name, t->rank);
		return -EAGAIN;
	}
	r = add_handle(s, t);
	if (r < 0) {
		snprintf(err, errlen, "too many tensors on this connection");
		return r;
	}
	TAILQ_REMOVE(&job->detached, t, detached_entry);
	job->ndetached--;
	t->detached = false;
	t->session = s;
	/* The session's own reference to the job covers it now. */
	job->refs--;
	*ret = t;
	return 1;
}

int
zd_tensor_create(struct zd_session *s, const struct zp_tensor_register *req,
    struct zd_tensor **ret, bool *ret_resumed, char *err, size_t errlen)
{
	struct zd_daemon *d = s->daemon;
	struct zd_tensor *t;
	struct zt_arena_stats as;
	struct zd_uid *u;
	char a[32], b[32], c[32];
	int r;

	if (s->job == NULL) {
		snprintf(err, errlen, "open a job before registering tensors");
		return -ENOTCONN;
	}
	r = resume_detached(s, req, ret, err, errlen);
	if (r != 0) {
		if (r > 0)
			*ret_resumed = true;
		return r < 0 ? r : 0;
	}
	*ret_resumed = false;
	for (uint32_t i = 0; i < s->ntensor_slots; i++) {
		if (s->tensors[i] != NULL && strcmp(s->tensors[i]->name, req->name) == 0) {
			snprintf(err, errlen, "tensor '%s' is already registered on this rank",
			    req->name);
			return -EEXIST;
		}
	}
	if (req->numel > SIZE_MAX / 16) {
		snprintf(err, errlen, "tensor '%s': %llu elements is too many", req->name,
		    (unsigned long long)req->numel);
		return -EFBIG;
	}
	t = calloc(1, sizeof(*t));
	if (t == NULL) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	t->grad_slot.fd = t->param_slot.fd = -1;
	snprintf(t->name, sizeof(t->name), "%s", req->name);
	t->numel = req->numel;
	t->grad_dtype = (enum zk_dtype)req->grad_dtype;
	t->param_dtype = (enum zk_dtype)req->param_dtype;
	t->param_offload = (req->flags & ZP_TENSOR_PARAM_OFFLOAD) != 0;
	t->param_resident = true;

	u = zd_uid_get(d, s->uid);
	if (u == NULL) {
		snprintf(err, errlen, "out of memory");
		r = -ENOMEM;
		goto fail;
	}
	err[0] = '\0';
	/* From here tensor_free undoes the job's counts. */
	t->job = s->job;
	s->job->tensors++;
	s->job->params += t->numel;
	r = zd_tier_place(s, t, err, errlen);
	if (r < 0 && err[0] == '\0') {
		if (r == -ENOSPC || r == -ENOMEM) {
			zt_arena_get_stats(d->arena, &as);
			zd_fmt_bytes(t->state_bytes, a, sizeof(a));
			zd_fmt_bytes(as.used_bytes, b, sizeof(b));
			zd_fmt_bytes(as.budget_bytes, c, sizeof(c));
		}
		if (r == -ENOSPC && d->swap == NULL)
			snprintf(err, errlen, "tensor '%s' needs %s of optimizer state; the pinned "
			    "budget has %s of %s in use and no swap.paths are configured", t->name, a,
			    b, c);
		else if (r == -ENOSPC && s->job->policy == ZP_POLICY_CPU)
			snprintf(err, errlen, "tensor '%s' needs %s of optimizer state; the pinned "
			    "budget has %s of %s in use (the job's policy is cpu)", t->name, a, b, c);
		else if (r == -ENOMEM)
			snprintf(err, errlen, "tensor '%s': cannot pin %s: the memlock limit is "
			    "exhausted (raise LimitMEMLOCK= or set memory.require_pinned to false)",
			    t->name, a);
		else
			snprintf(err, errlen, "tensor '%s': cannot allocate its state: %s", t->name,
			    strerror(-r));
	}
	if (r < 0)
		goto fail;
	if (t->on_nvme)
		u->swap_bytes += t->state_bytes;
	else
		u->pinned_bytes += t->state_bytes;
	r = zd_shm_create(d, "zoffload-grad", t->numel * zk_dtype_size(t->grad_dtype), false,
	    &t->grad_slot);
	if (r == 0)
		r = zd_shm_create(d, "zoffload-param", t->numel * zk_dtype_size(t->param_dtype),
		    !t->param_offload, &t->param_slot);
	if (r < 0) {
		zd_fmt_bytes(d->shm_bytes, a, sizeof(a));
		zd_fmt_bytes(d->cfg.shm_budget, b, sizeof(b));
		if (r == -ENOSPC)
			snprintf(err, errlen, "tensor '%s': its slots exceed the shared-memory budget "
			    "(%s of %s in use)", t->name, a, b);
		else
			snprintf(err, errlen, "tensor '%s': cannot create its slots: %s", t->name,
			    strerror(-r));
		goto fail;
	}
	r = add_handle(s, t);
	if (r < 0) {
		snprintf(err, errlen, "too many tensors on this connection");
		goto fail;
	}
	t->session = s;
	t->rank = s->rank;
	*ret = t;
	return 0;
fail:
	tensor_free(d, t);
	return r;
}

void
zd_tensor_write_param(struct zd_tensor *t, uint64_t offset, uint64_t count, const float *src)
{
	t->param_dirty = true;
	switch (t->param_dtype) {
	case ZK_DTYPE_F32:
		memcpy((float *)t->param_slot.map + offset, src, count * sizeof(float));
		break;
	case ZK_DTYPE_BF16:
		for (uint64_t i = 0; i < count; i++)
			((uint16_t *)t->param_slot.map)[offset + i] = zk_f32_to_bf16(src[i]);
		break;
	case ZK_DTYPE_F16:
		for (uint64_t i = 0; i < count; i++)
			((uint16_t *)t->param_slot.map)[offset + i] = zk_f32_to_f16(src[i]);
		break;
	default:
		break;
	}
}
