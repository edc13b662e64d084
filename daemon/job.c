/* Jobs (the ranks of one training run) and their tensors' state and slots. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "daemon.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "recover.h"
#include "restart_table.h"
#include "session.h"

/*
 * Job names live in their uid's namespace: "NAME" is the caller's own,
 * "UID:NAME" names uid UID's (a non-root caller may only name its own).
 * 0 with *ret_uid and *ret_name (into the caller's string), or -EACCES.
 */
static int
job_name_parse(const struct zd_session *s, const char *text, uid_t *ret_uid,
    const char **ret_name, char *err, size_t errlen)
{
	const char *colon = strchr(text, ':'), *p;
	unsigned long uid;

	*ret_uid = s->uid;
	*ret_name = text;
	if (colon == NULL || colon == text || colon[1] == '\0' || colon - text > 10)
		return 0;
	for (p = text; p < colon; p++)
		if (*p < '0' || *p > '9')
			return 0;
	uid = strtoul(text, NULL, 10);
	if (uid > UINT32_MAX - 1)
		return 0;
	if ((uid_t)uid != s->uid && s->uid != 0) {
		snprintf(err, errlen, "job '%s' is in uid %lu's names; uid %u sees only its own",
		    colon + 1, uid, (unsigned)s->uid);
		return -EACCES;
	}
	*ret_uid = (uid_t)uid;
	*ret_name = colon + 1;
	return 0;
}

static struct zd_job *
job_find(struct zd_daemon *d, uid_t uid, const char *name)
{
	struct zd_job *job;

	TAILQ_FOREACH(job, &d->jobs, entry)
		if (job->uid == uid && strcmp(job->name, name) == 0)
			return job;
	return NULL;
}

struct zd_job *
zd_job_new(struct zd_daemon *d, uid_t uid, const char *name, uint32_t world_size,
    uint8_t policy, uint64_t pinned_budget, uint8_t state_format, uint64_t id)
{
	struct zd_job *job = calloc(1, sizeof(*job));
	struct zd_uid *owner;

	if (job == NULL)
		return NULL;
	owner = zd_uid_get(d, uid);
	if (owner == NULL) {
		free(job);
		return NULL;
	}
	job->id = id != 0 ? id : ++d->next_job_id;
	if (job->id > d->next_job_id)
		d->next_job_id = job->id;
	snprintf(job->name, sizeof(job->name), "%s", name);
	job->uid = uid;
	job->owner = owner;
	job->world_size = world_size;
	TAILQ_INIT(&job->detached);
	TAILQ_INIT(&job->rank_groups);
	/* The first rank decides where the job's state goes. */
	job->policy = policy;
	job->state_format = state_format;
	job->pinned_budget = pinned_budget;
	if (ze_account_new(&(struct ze_account_limits){
		.pinned_budget = pinned_budget,
		.pinned_what = "pinned budget of job",
	}, &job->account) < 0) {
		zd_uid_put(d, owner);
		free(job);
		return NULL;
	}
	job->owner->jobs++;
	TAILQ_INSERT_TAIL(&job->owner->job_list, job, uid_entry);
	TAILQ_INSERT_TAIL(&d->jobs, job, entry);
	d->njobs++;
	zd_restart_keep_job(d, job);
	return job;
}

int
zd_job_attach(struct zd_session *s, const struct zp_job_open *req, char *err, size_t errlen)
{
	uint32_t rank = req->rank, world_size = req->world_size;
	struct zd_daemon *d = s->daemon;
	struct zd_session *other;
	struct zd_job *job;
	const char *name;
	uid_t uid;
	int r;

	if (s->job != NULL) {
		snprintf(err, errlen, "this connection already has job '%s' open", s->job->name);
		return -EISCONN;
	}
	r = job_name_parse(s, req->job_name, &uid, &name, err, errlen);
	if (r < 0)
		return r;
	job = job_find(d, uid, name);
	if (job == NULL && uid != s->uid) {
		/* Root joins another uid's job; it does not make one in that uid's name. */
		snprintf(err, errlen, "uid %u has no job '%s'", (unsigned)uid, name);
		return -ENOENT;
	}
	if (job != NULL) {
		enum zk_state_format f;

		/* A rank asking for another format would step a job in two: refuse it. */
		if (req->state_format[0] != '\0' &&
		    (zk_state_format_parse(req->state_format, &f) < 0 || f != job->state_format)) {
			snprintf(err, errlen, "job '%s' keeps its optimizer state as %s, not '%s'", name,
			    zk_state_format_name((enum zk_state_format)job->state_format),
			    req->state_format);
			return -EINVAL;
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
		enum zk_state_format format = (enum zk_state_format)d->cfg.state_format;

		/* The first rank decides how the job's state is kept, as it does where. */
		if (req->state_format[0] != '\0' &&
		    zk_state_format_parse(req->state_format, &format) < 0) {
			char list[128];

			zk_state_format_list(list, sizeof(list));
			snprintf(err, errlen, "job '%s': unknown state format '%s' (one of %s)", name,
			    req->state_format, list);
			return -EINVAL;
		}
		/* Its slot in the recovery table first: a restart must find every job kept. */
		r = zd_restart_room(d, s->uid, err, errlen);
		if (r < 0)
			return r;
		job = zd_job_new(d, s->uid, name, world_size,
		    req->policy != ZP_POLICY_DEFAULT ? req->policy : d->cfg.policy,
		    req->pinned_budget > 0 ? req->pinned_budget : d->cfg.job_pinned_budget,
		    (uint8_t)format, 0);
		if (job == NULL) {
			snprintf(err, errlen, "out of memory");
			return -ENOMEM;
		}
		log_info("job '%s' (id %llu) opened by uid %u, world size %u, state %s", name,
		    (unsigned long long)job->id, (unsigned)s->uid, world_size,
		    zk_state_format_name(format));
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
	zd_restart_forget_job(d, job);
	zd_job_discard(d, job);
	return true;
}

void
zd_job_discard(struct zd_daemon *d, struct zd_job *job)
{
	TAILQ_REMOVE(&d->jobs, job, entry);
	d->njobs--;
	ze_account_unref(job->account);
	job->owner->jobs--;
	TAILQ_REMOVE(&job->owner->job_list, job, uid_entry);
	zd_uid_put(d, job->owner);
	free(job);
}

static void tensor_free(struct zd_daemon *d, struct zd_tensor *t);
static bool free_detached(struct zd_daemon *d, struct zd_job *job, struct zd_tensor *t);

static struct zd_rank_group *
rank_group_get(struct zd_job *job, uint32_t rank)
{
	struct zd_rank_group *g;

	TAILQ_FOREACH(g, &job->rank_groups, entry)
		if (g->rank == rank)
			return g;
	g = calloc(1, sizeof(*g));
	if (g == NULL)
		return NULL;
	g->rank = rank;
	TAILQ_INSERT_TAIL(&job->rank_groups, g, entry);
	job->detached_ranks++;
	return g;
}

/* A tensor leaves the detached list (freed or taken back). */
static void
undetach(struct zd_job *job, struct zd_tensor *t)
{
	struct zd_rank_group *g = t->group;

	TAILQ_REMOVE(&job->detached, t, detached_entry);
	job->ndetached--;
	t->detached = false;
	t->group = NULL;
	if (--g->tensors == 0) {
		TAILQ_REMOVE(&job->rank_groups, g, entry);
		job->detached_ranks--;
		free(g);
	}
}

/* A dead rank's tensor waits for a new process of the same job and rank. */
static void
keep_detached(struct zd_job *job, struct zd_rank_group *g, struct zd_tensor *t)
{
	t->session = NULL;
	t->detached = true;
	t->detached_ns = zu_now_ns();
	t->group = g;
	g->tensors++;
	TAILQ_INSERT_TAIL(&job->detached, t, detached_entry);
	job->ndetached++;
	job->refs++;
}

void
zd_job_detach(struct zd_session *s, bool keep)
{
	struct zd_job *job = s->job;
	unsigned kept = 0;

	struct zd_rank_group *g = NULL;

	keep = keep && job != NULL && !job->dropping && s->daemon->cfg.detach_grace_s > 0 &&
	    !s->daemon->draining;
	if (keep && (g = rank_group_get(job, s->rank)) == NULL) {
		log_warnx("job '%s' rank %u: out of memory keeping its tensors; freed", job->name,
		    s->rank);
		keep = false;
	}
	for (uint32_t i = 0; i < s->ntensor_slots; i++) {
		struct zd_tensor *t = s->tensors[i];

		if (t == NULL)
			continue;
		s->tensors[i] = NULL;
		if (keep) {
			keep_detached(job, g, t);
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
	if (g != NULL && g->tensors == 0) {
		TAILQ_REMOVE(&job->rank_groups, g, entry);
		job->detached_ranks--;
		free(g);
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
	undetach(job, t);
	/* A step still running on it keeps the engine's tensor until it ends. */
	tensor_free(d, t);
	return zd_job_unref(d, job);
}

void
zd_job_expire_detached(struct zd_daemon *d, bool all)
{
	uint64_t now = zu_now_ns(), grace = (uint64_t)d->cfg.detach_grace_s * 1000000000ull;
	struct zd_job *job, *next_job;
	struct zd_tensor *t, *next;

	for (job = TAILQ_FIRST(&d->jobs); job != NULL; job = next_job) {
		next_job = TAILQ_NEXT(job, entry);
		for (t = TAILQ_FIRST(&job->detached); t != NULL; t = next) {
			next = TAILQ_NEXT(t, detached_entry);
			/* Oldest first: the rest are younger still. */
			if (!all && now - t->detached_ns < grace)
				break;
			if (!all)
				log_info("job '%s' rank %u: tensor '%s' not reattached within %u s, freed",
				    job->name, t->rank, t->name, d->cfg.detach_grace_s);
			if (free_detached(d, job, t))
				break;
		}
	}
}

/* Root's unqualified drop: its own job, else the one job of that name whatever its uid. */
static int
job_find_any(struct zd_daemon *d, const char *name, struct zd_job **ret, char *err,
    size_t errlen)
{
	struct zd_job *job, *found = NULL;
	unsigned n = 0;

	if ((found = job_find(d, 0, name)) != NULL) {
		*ret = found;
		return 0;
	}
	TAILQ_FOREACH(job, &d->jobs, entry) {
		if (strcmp(job->name, name) != 0)
			continue;
		found = job;
		n++;
	}
	if (n > 1) {
		size_t len = (size_t)snprintf(err, errlen, "%u uids have a job '%s'; name one as "
		    "UID:NAME:", n, name);

		TAILQ_FOREACH(job, &d->jobs, entry)
			if (strcmp(job->name, name) == 0 && len < errlen)
				len += (size_t)snprintf(err + len, errlen - len, " %u:%s",
				    (unsigned)job->uid, name);
		return -ENOTUNIQ;
	}
	if (found == NULL) {
		snprintf(err, errlen, "no job named '%s'", name);
		return -ENOENT;
	}
	*ret = found;
	return 0;
}

int
zd_job_drop(struct zd_session *s, const char *text, char *err, size_t errlen)
{
	struct zd_daemon *d = s->daemon;
	struct zd_session *other, *next_s;
	struct zd_job *job;
	unsigned closed = 0;
	const char *name;
	uid_t uid;
	int r;

	r = job_name_parse(s, text, &uid, &name, err, errlen);
	if (r < 0)
		return -EPERM;
	if (s->uid == 0 && name == text) {
		r = job_find_any(d, name, &job, err, errlen);
		if (r < 0)
			return r;
	} else {
		job = job_find(d, uid, name);
		if (job == NULL) {
			snprintf(err, errlen, "no job named '%s'", text);
			return -ENOENT;
		}
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
	log_info("job '%s' of uid %u dropped by uid %u (pid %d): %u rank(s) disconnected", name,
	    (unsigned)job->uid, (unsigned)s->uid, (int)s->pid, closed);
	zd_job_unref(d, job);
	return 0;
}

unsigned
zd_job_detached_ranks(const struct zd_job *job)
{
	return job->detached_ranks;
}

static void
tensor_free(struct zd_daemon *d, struct zd_tensor *t)
{
	if (t->et != NULL) {
		zd_restart_forget_tensor(d, t->et);
		t->job->tensors--;
		t->job->params -= ze_tensor_numel(t->et);
		t->job->state_bytes -= ze_tensor_state_bytes(t->et);
		d->tensors_total--;
		d->params_total -= ze_tensor_numel(t->et);
		zd_ckpt_tensor_gone(d, t->et);
		/* The engine refunds its charge, now or when the work it is in ends. */
		ze_tensor_free(t->et);
	}
	if (t->owner != NULL) {
		zd_uid_refund(d, t->owner, ZD_TENSOR_FDS, t->shm_bytes, 1);
		zd_uid_put(d, t->owner);
	}
	free(t);
}

/* Its two slots as ze_shm_create makes them (whole pages); saturates for absurd sizes. */
static uint64_t
slot_bytes(const struct zp_tensor_register *req)
{
	uint64_t g = zk_dtype_size((enum zk_dtype)req->grad_dtype);
	uint64_t p = zk_dtype_size((enum zk_dtype)req->param_dtype);

	if (req->numel > (UINT64_MAX / 16) / 4)
		return UINT64_MAX / 4;
	return (req->numel * g + 4095) / 4096 * 4096 + (req->numel * p + 4095) / 4096 * 4096;
}

void
zd_tensor_release(struct zd_daemon *d, struct zd_tensor *t)
{
	tensor_free(d, t);
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
	if (ze_tensor_numel(t->et) != req->numel ||
	    ze_tensor_grad_dtype(t->et) != (enum zk_dtype)req->grad_dtype ||
	    ze_tensor_param_dtype(t->et) != (enum zk_dtype)req->param_dtype ||
	    ze_tensor_param_offload(t->et) != ((req->flags & ZP_TENSOR_PARAM_OFFLOAD) != 0)) {
		snprintf(err, errlen, "tensor '%s' of rank %u is kept with %llu elements, grads %s, "
		    "params %s; it cannot be taken back as %llu elements, %s, %s", t->name, t->rank,
		    (unsigned long long)ze_tensor_numel(t->et),
		    zk_dtype_name(ze_tensor_grad_dtype(t->et)),
		    zk_dtype_name(ze_tensor_param_dtype(t->et)), (unsigned long long)req->numel,
		    zk_dtype_name((enum zk_dtype)req->grad_dtype),
		    zk_dtype_name((enum zk_dtype)req->param_dtype));
		return -EINVAL;
	}
	/*
	 * A step the dead rank submitted is still running on it: its last_step
	 * is about to change, and the client would resume from the wrong one.
	 */
	if (ze_tensor_busy(t->et)) {
		snprintf(err, errlen, "tensor '%s' of rank %u is finishing a step its previous "
		    "process submitted; register it again when that is done", t->name, t->rank);
		return -EAGAIN;
	}
	r = add_handle(s, t);
	if (r < 0) {
		snprintf(err, errlen, "too many tensors on this connection");
		return r;
	}
	undetach(job, t);
	t->session = s;
	/* The session's own reference to the job covers it now. */
	job->refs--;
	*ret = t;
	return 1;
}

static enum ze_policy
engine_policy(uint8_t policy)
{
	switch (policy) {
	case ZP_POLICY_NVME: return ZE_POLICY_NVME;
	case ZP_POLICY_AUTO: return ZE_POLICY_AUTO;
	default: return ZE_POLICY_CPU;
	}
}

int
zd_tensor_create(struct zd_session *s, const struct zp_tensor_register *req,
    struct zd_tensor **ret, bool *ret_resumed, char *err, size_t errlen)
{
	struct zd_daemon *d = s->daemon;
	struct zd_tensor *t;
	struct zd_uid *u;
	int r;

	if (s->job == NULL) {
		snprintf(err, errlen, "open a job before registering tensors");
		return -ENOTCONN;
	}
	r = resume_detached(s, req, ret, err, errlen);
	if (r != 0) {
		/* Taken back, but asked for its initial values again unless they were all in. */
		if (r > 0)
			*ret_resumed = ze_tensor_initialized((*ret)->et);
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
	u = s->uid_usage;
	t = calloc(1, sizeof(*t));
	if (t == NULL) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	/* Its two slot memfds and their pages, counted before they exist. */
	t->shm_bytes = slot_bytes(req);
	r = zd_uid_charge(d, u, ZD_TENSOR_FDS, t->shm_bytes, 1, err, errlen);
	if (r < 0) {
		char why[ZP_ERRMSG_MAX + 1];

		snprintf(why, sizeof(why), "tensor '%s': %s", req->name, err);
		snprintf(err, errlen, "%s", why);
		free(t);
		return r;
	}
	t->owner = u;
	snprintf(t->name, sizeof(t->name), "%s", req->name);
	t->job = s->job;
	/* Charged to the registering uid: whoever asked for the memory pays, and is refunded. */
	r = ze_tensor_new(d->engine, &(struct ze_tensor_desc){
		.name = t->name,
		.numel = req->numel,
		.grad_dtype = (enum zk_dtype)req->grad_dtype,
		.param_dtype = (enum zk_dtype)req->param_dtype,
		.param_offload = (req->flags & ZP_TENSOR_PARAM_OFFLOAD) != 0,
		.policy = engine_policy(s->job->policy),
		.state_format = (enum zk_state_format)s->job->state_format,
	}, s->job->account, u->account, t, &t->et, err, errlen);
	if (r < 0) {
		zd_uid_refund(d, u, ZD_TENSOR_FDS, t->shm_bytes, 1);
		free(t);
		return r;
	}
	s->job->tensors++;
	s->job->params += req->numel;
	s->job->state_bytes += ze_tensor_state_bytes(t->et);
	d->tensors_total++;
	d->params_total += req->numel;
	r = add_handle(s, t);
	if (r < 0) {
		snprintf(err, errlen, "too many tensors on this connection");
		tensor_free(d, t);
		return r;
	}
	t->session = s;
	t->rank = s->rank;
	/* Kept from here on: a restart of the daemon finds it as it left it. */
	zd_restart_keep_tensor(d, t);
	*ret = t;
	return 0;
}

int
zd_job_adopt_tensor(struct zd_daemon *d, struct zd_job *job, uint32_t rank, uid_t owner_uid,
    const struct ze_tensor_fds *fds, struct ze_adopt_report *rep, struct ze_tensor **ret_et,
    char *err, size_t errlen)
{
	struct ze_record_info info;
	struct zd_rank_group *g;
	struct zd_tensor *t;
	struct zd_uid *u;
	int r;

	r = ze_record_peek(fds->record, &info, err, errlen);
	if (r < 0)
		return r;
	u = zd_uid_get(d, owner_uid);
	t = calloc(1, sizeof(*t));
	/* Last: a rank group it made is the one thing not undone below. */
	g = u != NULL && t != NULL ? rank_group_get(job, rank) : NULL;
	if (g == NULL) {
		free(t);
		zd_uid_put(d, u);	/* forgotten again if made for this tensor */
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	t->shm_bytes = slot_bytes(&(struct zp_tensor_register){ .numel = info.numel,
		.grad_dtype = (uint8_t)info.grad_dtype, .param_dtype = (uint8_t)info.param_dtype });
	/* Whatever the limits are now: the state exists, it is only being counted again. */
	zd_uid_count(d, u, ZD_TENSOR_FDS, t->shm_bytes, 1);
	t->owner = u;
	snprintf(t->name, sizeof(t->name), "%s", info.name);
	t->job = job;
	t->rank = rank;
	r = ze_tensor_adopt(d->engine, fds, job->account, u->account, t, &t->et, rep, err, errlen);
	if (r < 0) {
		zd_uid_refund(d, u, ZD_TENSOR_FDS, t->shm_bytes, 1);
		zd_uid_put(d, u);
		if (g->tensors == 0) {
			TAILQ_REMOVE(&job->rank_groups, g, entry);
			job->detached_ranks--;
			free(g);
		}
		free(t);
		return r;
	}
	job->tensors++;
	job->params += info.numel;
	job->state_bytes += ze_tensor_state_bytes(t->et);
	d->tensors_total++;
	d->params_total += info.numel;
	if (rep->last_step > job->last_step)
		job->last_step = rep->last_step;
	keep_detached(job, g, t);
	zd_restart_keep_tensor(d, t);
	*ret_et = t->et;
	return 0;
}
