/* A tensor's life: placement against the budgets, its one charge, slots, steps and initialization. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "convert.h"
#include "engine_impl.h"
#include "swap.h"

static size_t
param_store_bytes(const struct ze_tensor *t)
{
	return ((size_t)t->numel * zk_dtype_size(t->param_dtype) + 4095) / 4096 * 4096;
}

static bool
over(const struct ze_account *a, bool pinned, uint64_t bytes)
{
	uint64_t budget, used;

	if (a == NULL)
		return false;
	budget = pinned ? a->limits.pinned_budget : a->limits.swap_budget;
	used = pinned ? a->pinned_bytes : a->swap_bytes;
	return budget > 0 && used + bytes > budget;
}

/* The charge: taken from both accounts here, given back by tensor_destroy alone. */
void
ze_tensor_charge(struct ze_tensor *t, struct ze_account *job, struct ze_account *uid, bool pinned,
    uint64_t bytes)
{
	struct ze_account *acc[2] = { job, uid };

	t->charge = (struct ze_charge){ .job = job != NULL ? ze_account_ref(job) : NULL,
		.uid = uid != NULL ? ze_account_ref(uid) : NULL };
	if (pinned)
		t->charge.pinned_bytes = bytes;
	else
		t->charge.swap_bytes = bytes;
	for (int i = 0; i < 2; i++) {
		if (acc[i] == NULL)
			continue;
		acc[i]->pinned_bytes += t->charge.pinned_bytes;
		acc[i]->swap_bytes += t->charge.swap_bytes;
	}
}

static void
refund(struct ze_tensor *t)
{
	struct ze_account *acc[2] = { t->charge.job, t->charge.uid };

	for (int i = 0; i < 2; i++) {
		if (acc[i] == NULL)
			continue;
		acc[i]->pinned_bytes -= t->charge.pinned_bytes;
		acc[i]->swap_bytes -= t->charge.swap_bytes;
		ze_account_unref(acc[i]);
	}
	t->charge = (struct ze_charge){ 0 };
}

/* The shell's name for its swap paths (ze_config.swap_paths_what), for messages. */
static const char *
swap_paths_what(const struct ze_engine *e)
{
	return e->cfg.swap_paths_what != NULL ? e->cfg.swap_paths_what : "swap paths";
}

/* "path (used of capacity), ..." for a full swap's message: which disk to grow or clean. */
static void
swap_paths_text(struct ze_engine *e, char *buf, size_t len)
{
	size_t off = 0;

	buf[0] = '\0';
	for (unsigned i = 0; i < e->cfg.nswap_paths && off < len; i++) {
		struct zs_path_stats ps;
		char used[32], cap[32];
		int n;

		if (zs_swap_path_stats(e->swap, i, &ps) != 0)
			continue;
		zu_fmt_bytes(ps.used_bytes, used, sizeof(used));
		zu_fmt_bytes(ps.capacity, cap, sizeof(cap));
		n = snprintf(buf + off, len - off, "%s%s (%s of %s used)", i > 0 ? ", " : "",
		    e->cfg.swap_path_names != NULL && e->cfg.swap_path_names[i] != NULL ?
		    e->cfg.swap_path_names[i] : "?", used, cap);
		if (n < 0)
			break;
		off += (size_t)n;
	}
}

static int
place_nvme(struct ze_engine *e, struct ze_tensor *t, struct ze_account *job,
    struct ze_account *uid, char *err, size_t errlen)
{
	char a[32], b[32], paths[160];
	const struct ze_account *full;
	int r;

	if (e->swap == NULL) {
		snprintf(err, errlen, "tensor '%s': the job keeps state on NVMe but no %s are "
		    "configured", t->name, swap_paths_what(e));
		return -ENODEV;
	}
	r = ze_nvme_place(e, t);
	if (r < 0) {
		zu_fmt_bytes(ze_nvme_bytes(e, t), a, sizeof(a));
		swap_paths_text(e, paths, sizeof(paths));
		snprintf(err, errlen, "tensor '%s': no room for %s of state on %s %s: %s",
		    t->name, a, swap_paths_what(e), paths, ze_strerror(r));
		return r;
	}
	full = over(uid, false, t->state_bytes) ? uid : over(job, false, t->state_bytes) ? job :
	    NULL;
	if (full != NULL) {
		ze_nvme_release(e, t);
		zu_fmt_bytes(t->state_bytes, a, sizeof(a));
		zu_fmt_bytes(full->limits.swap_budget, b, sizeof(b));
		snprintf(err, errlen, "tensor '%s' needs %s of swap, past the %s %s", t->name, a, b,
		    full->limits.swap_what != NULL ? full->limits.swap_what : "swap budget");
		return -EDQUOT;
	}
	ze_tensor_charge(t, job, uid, false, t->state_bytes);
	return 0;
}

/* Points t's arrays into its pinned allocation, laid out for its format. */
void
ze_tensor_point_state(struct ze_tensor *t)
{
	struct zk_qtensor q;
	struct ze_layout l;

	ze_tensor_layout(t, &l);
	if (t->param_offload) {
		t->param_store = (char *)t->state + l.bytes;
		t->param_store_bytes = param_store_bytes(t);
	}
	ze_state_view(t->format, t->state, &l, t->numel, &q);
	t->master = q.master;
	t->m = q.m;
	t->v = q.v;
	t->m_scale = q.m_scale;
	t->v_scale = q.v_scale;
	ze_tensor_point_master(t);
}

void
ze_tensor_point_master(struct ze_tensor *t)
{
	/* On NVMe master stays NULL: chunks read it from the slot (nvme_impl.h). */
	if (!t->master_in_slot || t->on_nvme)
		return;
	/* NULL until the slot exists: nothing reads master before it does. */
	t->master = t->param_slot.map;
	/*
	 * Locked like the state it replaces, where it can be (best effort: the
	 * slot is charged to shm.budget, not the pinned budget, and a refused
	 * lock leaves it as every slot is).  On fault: a kept slot's pages are
	 * there already, a new one's come as the master is written.
	 */
	if (t->master != NULL && t->state_pinned)
		(void)mlock2(t->param_slot.map, t->param_slot.bytes, MLOCK_ONFAULT);
}

uint64_t
ze_tensor_pinned_bytes(const struct ze_tensor *t)
{
	struct ze_layout l;

	ze_tensor_layout(t, &l);
	return l.bytes + (t->param_offload ? param_store_bytes(t) : 0);
}

/*
 * Pinned when the policy and the budgets (engine, job, uid) allow it, else
 * NVMe for auto and nvme jobs.  master, m, v (and the scales) sit in one
 * allocation laid out by ze_layout_of: each array is padded a few KiB past
 * its page-rounded size, because an exact power-of-two distance between
 * them aliases in the cache and halved bandwidth when measured.
 */
static int
place(struct ze_engine *e, struct ze_tensor *t, enum ze_policy policy, struct ze_account *job,
    struct ze_account *uid, char *err, size_t errlen)
{
	uint64_t pinned = ze_tensor_pinned_bytes(t);
	const struct ze_account *full;
	struct zt_arena_stats as;
	char a[32], b[32], c[32];
	int r;

	if (policy == ZE_POLICY_AUTO && e->swap == NULL)
		policy = ZE_POLICY_CPU;
	full = over(job, true, pinned) ? job : over(uid, true, pinned) ? uid : NULL;
	if (policy == ZE_POLICY_NVME || (policy == ZE_POLICY_AUTO && full != NULL))
		return place_nvme(e, t, job, uid, err, errlen);
	if (full != NULL) {
		zu_fmt_bytes(pinned, a, sizeof(a));
		zu_fmt_bytes(full->limits.pinned_budget, b, sizeof(b));
		snprintf(err, errlen, "tensor '%s' needs %s of optimizer state, past the %s %s "
		    "(the job's policy is cpu)", t->name, a, b, full->limits.pinned_what != NULL ?
		    full->limits.pinned_what : "pinned budget");
		return -EDQUOT;
	}
	/* Offloaded params of a pinned tensor are kept pinned after its state; in a memfd, kept. */
	r = zt_arena_alloc_fd(e->arena, pinned, "zoffload-state", -1, &t->state, &t->state_pinned,
	    &t->state_fd);
	if (r == 0) {
		t->state_bytes = pinned;
		ze_tensor_point_state(t);
		ze_tensor_charge(t, job, uid, true, pinned);
		return 0;
	}
	t->state = NULL;
	if (policy == ZE_POLICY_AUTO && r == -ENOSPC)
		return place_nvme(e, t, job, uid, err, errlen);
	zt_arena_get_stats(e->arena, &as);
	zu_fmt_bytes(pinned, a, sizeof(a));
	zu_fmt_bytes(as.used_bytes, b, sizeof(b));
	zu_fmt_bytes(as.budget_bytes, c, sizeof(c));
	if (r == -ENOSPC && e->swap == NULL)
		snprintf(err, errlen, "tensor '%s' needs %s of optimizer state; the pinned budget "
		    "has %s of %s in use and no %s are configured", t->name, a, b, c,
		    swap_paths_what(e));
	else if (r == -ENOSPC)
		snprintf(err, errlen, "tensor '%s' needs %s of optimizer state; the pinned budget "
		    "has %s of %s in use (the job's policy is cpu)", t->name, a, b, c);
	else if (r == -ENOMEM)
		snprintf(err, errlen, "tensor '%s': cannot pin %s: the memlock limit is exhausted "
		    "(%s)", t->name, a, e->cfg.memlock_hint != NULL ? e->cfg.memlock_hint :
		    "raise it, or let the state be pageable");
	else
		snprintf(err, errlen, "tensor '%s': cannot allocate its state: %s", t->name,
		    ze_strerror(r));
	return r;
}

void
ze_tensor_destroy(struct ze_tensor *t)
{
	struct ze_engine *e = t->e;

	ze_shm_destroy(e, &t->grad_slot);
	ze_shm_destroy(e, &t->param_slot);
	if (t->on_nvme)
		ze_nvme_release(e, t);
	else if (t->state != NULL)
		zt_arena_release(e->arena, t->state, t->state_bytes, t->state_pinned);
	if (t->state_fd >= 0)
		close(t->state_fd);
	refund(t);
	ze_record_destroy(t);
	free(t);
}


/* A tensor with nothing yet: no descriptors, no state. */
struct ze_tensor *
ze_tensor_alloc(struct ze_engine *e, void *user)
{
	struct ze_tensor *t = calloc(1, sizeof(*t));

	if (t == NULL)
		return NULL;
	t->e = e;
	t->user = user;
	t->grad_slot.fd = t->param_slot.fd = -1;
	t->state_fd = t->rec_fd = -1;
	return t;
}

int
ze_tensor_new(struct ze_engine *e, const struct ze_tensor_desc *desc,
    struct ze_account *job, struct ze_account *uid, void *user, struct ze_tensor **ret,
    char *err, size_t errlen)
{
	struct ze_tensor *t;
	char a[32], b[32];
	int r;

	if (desc->numel == 0 || desc->numel > SIZE_MAX / 16) {
		snprintf(err, errlen, "tensor '%s': %llu elements is %s", desc->name,
		    (unsigned long long)desc->numel, desc->numel == 0 ? "none" : "too many");
		return desc->numel == 0 ? -EINVAL : -EFBIG;
	}
	t = ze_tensor_alloc(e, user);
	if (t == NULL) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	t->id = ++e->next_tensor_id;
	snprintf(t->name, sizeof(t->name), "%s", desc->name);
	t->numel = desc->numel;
	t->grad_dtype = desc->grad_dtype;
	t->param_dtype = desc->param_dtype;
	t->param_offload = desc->param_offload;
	t->param_resident = true;
	if ((unsigned)desc->state_format >= ZK_STATE_COUNT) {
		snprintf(err, errlen, "tensor '%s': unknown state format %d", t->name,
		    (int)desc->state_format);
		r = -EINVAL;
		goto fail;
	}
	t->format = desc->state_format;
	/* Both tiers keep it (on NVMe, nvme_impl.h). */
	t->master_in_slot = ze_slot_can_be_master(t->format, t->param_dtype, t->param_offload);
	r = place(e, t, desc->policy, job, uid, err, errlen);
	if (r < 0)
		goto fail;
	r = ze_shm_create(e, "zoffload-grad", t->numel * zk_dtype_size(t->grad_dtype), false,
	    &t->grad_slot);
	if (r == 0)
		r = ze_shm_create(e, "zoffload-param", t->numel * zk_dtype_size(t->param_dtype),
		    !t->param_offload, &t->param_slot);
	if (r < 0) {
		zu_fmt_bytes(e->stats.shm_bytes, a, sizeof(a));
		zu_fmt_bytes(e->cfg.shm_budget, b, sizeof(b));
		if (r == -ENOSPC)
			snprintf(err, errlen, "tensor '%s': its slots exceed the shared-memory budget "
			    "(%s of %s in use)", t->name, a, b);
		else
			snprintf(err, errlen, "tensor '%s': cannot create its slots: %s", t->name,
			    ze_strerror(r));
		goto fail;
	}
	ze_tensor_point_master(t);
	/* Units: NVMe chunks as placed, else pinned slices. */
	t->unit_elements = t->on_nvme ? t->chunk_elements : ZE_QUANTUM_ELEMENTS;
	t->nunits = (t->numel + t->unit_elements - 1) / t->unit_elements;
	t->init_missing = t->numel;
	/* Stamps and bits live in the record, so that they outlive the process. */
	r = ze_record_create(t);
	if (r < 0) {
		snprintf(err, errlen, "tensor '%s': cannot create its record: %s", t->name,
		    ze_strerror(r));
		goto fail;
	}
	*ret = t;
	return 0;
fail:
	ze_tensor_destroy(t);
	return r;
}

void
ze_tensor_free(struct ze_tensor *t)
{
	if (t == NULL)
		return;
	t->user = NULL;
	t->freed = true;
	if (!t->busy)
		ze_tensor_destroy(t);
}

void
ze_tensor_unbusy(struct ze_tensor *t)
{
	t->busy = false;
	if (t->freed)
		ze_tensor_destroy(t);
}

void
ze_tensor_set_user(struct ze_tensor *t, void *user)
{
	t->user = user;
}

uint64_t ze_tensor_numel(const struct ze_tensor *t) { return t->numel; }
enum zk_dtype ze_tensor_grad_dtype(const struct ze_tensor *t) { return t->grad_dtype; }
enum zk_dtype ze_tensor_param_dtype(const struct ze_tensor *t) { return t->param_dtype; }
bool ze_tensor_param_offload(const struct ze_tensor *t) { return t->param_offload; }
enum zk_state_format ze_tensor_state_format(const struct ze_tensor *t) { return t->format; }

uint64_t
ze_tensor_state_bytes(const struct ze_tensor *t)
{
	return zk_state_bytes(t->format, t->numel);
}
int ze_tensor_grad_fd(const struct ze_tensor *t) { return t->grad_slot.fd; }
/* What the client gets: read-only unless it writes the params itself. */
int
ze_tensor_param_fd(const struct ze_tensor *t)
{
	return t->param_slot.client_read_only ? t->param_slot.ro_fd : t->param_slot.fd;
}
void *ze_tensor_grad_slot(const struct ze_tensor *t) { return t->grad_slot.map; }
void *ze_tensor_param_slot(const struct ze_tensor *t) { return t->param_slot.map; }
bool ze_tensor_busy(const struct ze_tensor *t) { return t->busy; }

int
ze_tensor_hold(struct ze_tensor *t)
{
	if (t->busy)
		return -EBUSY;
	t->busy = true;
	return 0;
}

void
ze_tensor_release(struct ze_tensor *t)
{
	ze_tensor_unbusy(t);
}

int
ze_tensor_param_refresh(struct ze_tensor *t, uint64_t offset, uint64_t count)
{
	if (offset > t->numel || count > t->numel - offset)
		return -ERANGE;
	/* The restore wrote the slot itself. */
	if (!t->master_in_slot)
		ze_param_convert(t->param_slot.map, t->param_dtype, offset, count,
		    t->master + offset);
	return 0;
}

int
ze_tensor_restored(struct ze_tensor *t, uint64_t offset, uint64_t count)
{
	if (offset > t->numel || count > t->numel - offset)
		return -ERANGE;
	ze_param_flags(t, t->param_resident, true);
	ze_tensor_mark_init(t, offset, count);
	return 0;
}
bool ze_tensor_on_nvme(const struct ze_tensor *t) { return t->on_nvme; }
bool ze_tensor_initialized(const struct ze_tensor *t) { return t->init_missing == 0; }
uint64_t ze_tensor_last_step(const struct ze_tensor *t) { return t->last_step; }
bool ze_tensor_param_resident(const struct ze_tensor *t) { return t->param_resident; }

int
ze_tensor_set_step(struct ze_tensor *t, uint64_t step)
{
	if (t->busy)
		return -EBUSY;
	t->last_step = step;
	t->partial_step = 0;
	t->torn_step = 0;
	for (uint64_t u = 0; u < t->nunits; u++)
		t->unit_step[u] = t->unit_pend[u] = step;
	return 0;
}

uint64_t
ze_unit_len(const struct ze_tensor *t, uint64_t unit)
{
	uint64_t left = t->numel - unit * t->unit_elements;

	return left < t->unit_elements ? left : t->unit_elements;
}

void
ze_tensor_mark_init(struct ze_tensor *t, uint64_t offset, uint64_t count)
{
	uint64_t i = offset, end = offset + count;

	if (t->init_missing == 0)
		return;
	while (i < end) {
		uint64_t word = i / 64, bit = i % 64, n = 64 - bit, mask;

		if (n > end - i)
			n = end - i;
		mask = (n == 64 ? ~0ull : ((1ull << n) - 1)) << bit;
		t->init_missing -= (uint64_t)__builtin_popcountll(mask & ~t->init_bits[word]);
		t->init_bits[word] |= mask;
		i += n;
	}
	if (t->init_missing == 0) {
		ze_record_initialized(t);
		t->init_bits = NULL;
	}
}

bool
ze_tensor_init_all(const struct ze_tensor *t, uint64_t offset, uint64_t count)
{
	uint64_t i = offset, end = offset + count;

	if (t->init_bits == NULL)
		return true;
	while (i < end) {
		if (i % 64 == 0 && end - i >= 64) {
			if (t->init_bits[i / 64] != ~0ull)
				return false;
			i += 64;
			continue;
		}
		if ((t->init_bits[i / 64] & (1ull << (i % 64))) == 0)
			return false;
		i++;
	}
	return true;
}

void
ze_tensor_write_param(struct ze_tensor *t, uint64_t offset, uint64_t count, const float *src)
{
	ze_param_flags(t, t->param_resident, true);
	/* From master that is the slot: written already (a copy onto itself is no copy). */
	if (t->master_in_slot && src == (const float *)t->param_slot.map + offset)
		return;
	ze_param_convert(t->param_slot.map, t->param_dtype, offset, count, src);
}

void
ze_tensor_param_from_master(struct ze_tensor *t, uint64_t offset, uint64_t count,
    const struct zk_qtensor *q, size_t at)
{
	const uint16_t *src;

	if (q->format != ZK_STATE_BF16_Q8) {
		ze_tensor_write_param(t, offset, count, q->master + at);
		return;
	}
	/* The step writes param as the bf16 master's value: the same here, exactly. */
	ze_param_flags(t, t->param_resident, true);
	src = q->master_bf16 + at;
	if (t->master_in_slot && src == (const uint16_t *)t->param_slot.map + offset)
		return;
	switch (t->param_dtype) {
	case ZK_DTYPE_F32:
		for (uint64_t i = 0; i < count; i++)
			((float *)t->param_slot.map)[offset + i] = zk__bf16_to_f32(src[i]);
		break;
	case ZK_DTYPE_BF16:
		memcpy((uint16_t *)t->param_slot.map + offset, src, count * sizeof(uint16_t));
		break;
	case ZK_DTYPE_F16:
		for (uint64_t i = 0; i < count; i++)
			((uint16_t *)t->param_slot.map)[offset + i] =
			    zk__f32_to_f16(zk__bf16_to_f32(src[i]));
		break;
	default:
		break;
	}
}

int
ze_tensor_io(struct ze_tensor *t, bool write, enum ze_state which, uint64_t offset,
    uint64_t count, void *buf, uint32_t lane, uint64_t id)
{
	float *bufs[3] = { NULL, NULL, NULL };
	struct zk_qtensor q;
	int r;

	if (t->busy)
		return -EBUSY;
	if (offset > t->numel || count > t->numel - offset)
		return -ERANGE;
	if (write && which == ZE_STATE_MASTER && !t->param_resident)
		return -EAGAIN;
	/*
	 * On NVMe: chunk by chunk through staging buffers; io_done reports.  But for the master
	 * where the slot is it: read and written where it lies, with no chunk moved for it.  A
	 * write goes through the chunks where one was never written whole: that write is what
	 * puts its m and v (zeros, or what a split part left) on the disk, where until then a
	 * freed tensor's bytes may lie (nvme.c, zero_unwritten).
	 */
	if (t->on_nvme && !(t->master_in_slot && which == ZE_STATE_MASTER &&
	    (!write || ze_nvme_written(t, offset, count))))
		return ze_nvme_xfer(t, write, which, offset, count, buf, lane, id);
	bufs[which] = buf;
	if (t->on_nvme)
		q = (struct zk_qtensor){ .format = t->format, .master = t->param_slot.map,
			.n = t->numel };
	else
		ze_tensor_state_view(t, &q);
	r = ze_state_rw(&q, write, 1u << which, offset, count, bufs);
	if (r < 0)
		return r;
	/* The param slot always mirrors the master weights. */
	if (write && which == ZE_STATE_MASTER) {
		ze_tensor_param_from_master(t, offset, count, &q, offset);
		ze_tensor_mark_init(t, offset, count);
	}
	return 1;
}

const float *
ze_tensor_memory_state(const struct ze_tensor *t, enum ze_state which)
{
	if (t->on_nvme || t->format != ZK_STATE_FP32)
		return NULL;
	return which == ZE_STATE_MASTER ? t->master : which == ZE_STATE_EXP_AVG ? t->m : t->v;
}

const void *
ze_tensor_memory_raw(const struct ze_tensor *t, unsigned k)
{
	const void *a[ZE_RAW_ARRAYS] = { t->master, t->m, t->v, t->m_scale, t->v_scale };

	if (t->on_nvme || k >= ZE_RAW_ARRAYS || ze_raw_array_bytes(t->format, k, t->numel) == 0)
		return NULL;
	return a[k];
}

uint64_t
ze_tensor_chunk_elements(const struct ze_tensor *t)
{
	return t->on_nvme ? t->chunk_elements : 0;
}

int
ze_tensor_read_all(struct ze_tensor *t, uint64_t offset, uint64_t count, uint64_t stride,
    float *buf, uint32_t lane, uint64_t id)
{
	float *bufs[3] = { buf, buf + stride, buf + 2 * stride };
	struct zk_qtensor q;
	int r;

	if (t->busy)
		return -EBUSY;
	if (offset > t->numel || count > t->numel - offset)
		return -ERANGE;
	if (stride < count)
		return -EINVAL;
	if (t->on_nvme)
		return ze_nvme_read_all(t, offset, count, stride, buf, false, lane, id);
	ze_tensor_state_view(t, &q);
	r = ze_state_rw(&q, false, 7u, offset, count, bufs);
	return r < 0 ? r : 1;
}

int
ze_tensor_write_all(struct ze_tensor *t, uint64_t offset, uint64_t count, uint64_t stride,
    const float *buf, uint32_t lane, uint64_t id)
{
	/* Only read from: a write's source. */
	float *src = (float *)(uintptr_t)buf;
	float *bufs[3] = { src, src + stride, src + 2 * stride };
	struct zk_qtensor q;
	int r;

	if (t->busy)
		return -EBUSY;
	if (offset > t->numel || count > t->numel - offset)
		return -ERANGE;
	if (!t->param_resident)
		return -EAGAIN;
	if (stride < count)
		return -EINVAL;
	if (t->on_nvme)
		return ze_nvme_write_all(t, offset, count, stride, buf, false, lane, id);
	ze_tensor_state_view(t, &q);
	r = ze_state_rw(&q, true, 7u, offset, count, bufs);
	if (r < 0)
		return r;
	ze_tensor_param_from_master(t, offset, count, &q, offset);
	ze_tensor_mark_init(t, offset, count);
	return 1;
}

int
ze_tensor_read_raw(struct ze_tensor *t, uint64_t offset, uint64_t count, void *buf,
    uint32_t lane, uint64_t id)
{
	struct zk_qtensor q;
	int r;

	if (t->format == ZK_STATE_FP32)
		return ze_tensor_read_all(t, offset, count, count, buf, lane, id);
	if (t->busy)
		return -EBUSY;
	if (offset > t->numel || count > t->numel - offset)
		return -ERANGE;
	r = ze_raw_check(t->format, t->numel, offset, count);
	if (r < 0)
		return r;
	if (t->on_nvme)
		return ze_nvme_read_all(t, offset, count, count, buf, true, lane, id);
	ze_tensor_state_view(t, &q);
	r = ze_state_raw(&q, false, offset, count, buf, count, 0);
	return r < 0 ? r : 1;
}

int
ze_tensor_write_raw(struct ze_tensor *t, uint64_t offset, uint64_t count, const void *buf,
    uint32_t lane, uint64_t id)
{
	struct zk_qtensor q;
	int r;

	if (t->format == ZK_STATE_FP32)
		return ze_tensor_write_all(t, offset, count, count, buf, lane, id);
	if (t->busy)
		return -EBUSY;
	if (offset > t->numel || count > t->numel - offset)
		return -ERANGE;
	if (!t->param_resident)
		return -EAGAIN;
	r = ze_raw_check(t->format, t->numel, offset, count);
	if (r < 0)
		return r;
	if (t->on_nvme)
		return ze_nvme_write_all(t, offset, count, count, buf, true, lane, id);
	ze_tensor_state_view(t, &q);
	/* Only read from: a write's source. */
	r = ze_state_raw(&q, true, offset, count, (void *)(uintptr_t)buf, count, 0);
	if (r < 0)
		return r;
	ze_tensor_param_from_master(t, offset, count, &q, offset);
	ze_tensor_mark_init(t, offset, count);
	return 1;
}

bool
ze_tensor_step_partial(const struct ze_tensor *t)
{
	return t->partial_step != 0;
}
