/* libzclient: saving a rank's optimizer state into a checkpoint, and restoring it, resharded. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_index.h"
#include "ckpt_tmpfile.h"
#include "zclient.h"
#include "zclient_impl.h"

/*
 * Elements per CKPT_WRITE: the daemon streams a request's range through two buffers of
 * its own, overlapping the reads from the tiers with the writes to the file; a request
 * is bounded so that it ends within a reasonable request timeout.
 */
#define SAVE_PIECE (64u << 20)

/* The saved hyperparameters, JSON text (free it). */
static char *
hparams_json(const struct zc_step_params *p)
{
	cJSON *o = cJSON_CreateObject();
	char *text;

	cJSON_AddStringToObject(o, "optimizer", zck_optim_names[p->optim]);
	cJSON_AddNumberToObject(o, "lr", p->lr);
	cJSON_AddNumberToObject(o, "beta1", p->beta1);
	cJSON_AddNumberToObject(o, "beta2", p->beta2);
	cJSON_AddNumberToObject(o, "eps", p->eps);
	cJSON_AddNumberToObject(o, "weight_decay", p->weight_decay);
	cJSON_AddNumberToObject(o, "lr_decay", p->lr_decay);
	cJSON_AddNumberToObject(o, "grad_scale", p->grad_scale);
	cJSON_AddNumberToObject(o, "max_grad_norm", p->max_grad_norm);
	cJSON_AddBoolToObject(o, "no_bias_correction", p->no_bias_correction);
	cJSON_AddBoolToObject(o, "check_finite", p->check_finite);
	cJSON_AddNumberToObject(o, "step", (double)p->step);
	text = cJSON_PrintUnformatted(o);
	cJSON_Delete(o);
	return text;
}

/* One piece of a save: a range of a tensor, a tensor of the file. */
struct save_tensor {
	const char *name;		/* in the file: the tensor's, or owned TENSOR@OFFSET */
	char *owned_name;
	struct zc_tensor *t;
	uint64_t t_offset;		/* of the range in t */
	const char *global_name;
	uint64_t global_offset;
	uint64_t global_numel;
	uint64_t numel;
	uint64_t begin[ZCK_ARRAYS];	/* from the start of the data */
	uint32_t crc[ZCK_ARRAYS];	/* of the elements done */
	uint64_t step;			/* the daemon's answer */
	const char *state_format;	/* the job's: every tensor of a job has its format */
	enum zck_arrays arrays;		/* its arrays, raw as the daemon keeps them */
	uint64_t done;			/* elements written */
	uint64_t req_n;			/* in the request in flight */
	size_t next;			/* the tensor's next piece, or SIZE_MAX */
};

static void
add_meta_u64(cJSON *meta, const char *name, const char *what, uint64_t v)
{
	char key[1024], val[32];

	snprintf(key, sizeof(key), "%s/%s", name, what);
	snprintf(val, sizeof(val), "%" PRIu64, v);
	cJSON_AddStringToObject(meta, key, val);
}

/*
 * The header's JSON.  Until the data is written its CRCs and steps are not known: the
 * first header is made with the widest values they can take, and its length reserved.
 */
static char *
header_json(const struct save_tensor *ts, size_t n, const char *optim, const char *hparams,
    uint32_t rank, uint32_t world, bool final)
{
	cJSON *hdr = cJSON_CreateObject(), *meta = cJSON_CreateObject();
	char key[1024], val[32];
	char *text;

	cJSON_AddItemToObject(hdr, "__metadata__", meta);
	cJSON_AddStringToObject(meta, "format", ZCK_FORMAT);
	cJSON_AddStringToObject(meta, "optimizer", optim);
	cJSON_AddStringToObject(meta, "hyperparameters", hparams);
	snprintf(val, sizeof(val), "%u", rank);
	cJSON_AddStringToObject(meta, "rank", val);
	snprintf(val, sizeof(val), "%u", world);
	cJSON_AddStringToObject(meta, "world_size", val);
	for (size_t i = 0; i < n; i++) {
		const struct save_tensor *t = &ts[i];

		snprintf(key, sizeof(key), "%s/global_name", t->name);
		cJSON_AddStringToObject(meta, key, t->global_name);
		add_meta_u64(meta, t->name, "global_offset", t->global_offset);
		add_meta_u64(meta, t->name, "global_numel", t->global_numel);
		add_meta_u64(meta, t->name, "step", final ? t->step : UINT64_MAX);
		snprintf(key, sizeof(key), "%s/state_format", t->name);
		cJSON_AddStringToObject(meta, key, t->state_format);
		for (unsigned st = 0; st < ZCK_ARRAYS; st++) {
			static const char *const dtypes[3] = { "F32", "BF16", "U8" };
			uint64_t bytes = zck_array_bytes(t->arrays, st, t->numel);
			cJSON *a;
			double offs[2] = { (double)t->begin[st], (double)(t->begin[st] + bytes) };
			double shape = (double)(st < ZCK_STATES ? t->numel :
			    (t->numel + ZK_Q8_BLOCK - 1) / ZK_Q8_BLOCK);

			if (bytes == 0 && st >= ZCK_STATES)
				continue;
			a = cJSON_CreateObject();
			snprintf(key, sizeof(key), "%s/%s/crc32c", t->name, zck_state_names[st]);
			snprintf(val, sizeof(val), "%08x", final ? t->crc[st] : 0xffffffffu);
			cJSON_AddStringToObject(meta, key, val);
			cJSON_AddStringToObject(a, "dtype", st == 1 || st == 2 ? dtypes[t->arrays] :
			    "F32");
			cJSON_AddItemToObject(a, "shape", cJSON_CreateDoubleArray(&shape, 1));
			cJSON_AddItemToObject(a, "data_offsets", cJSON_CreateDoubleArray(offs, 2));
			snprintf(key, sizeof(key), "%s/%s", t->name, zck_state_names[st]);
			cJSON_AddItemToObject(hdr, key, a);
		}
	}
	text = cJSON_PrintUnformatted(hdr);
	cJSON_Delete(hdr);
	return text;
}

static int
pwrite_all(int fd, const void *buf, size_t len, uint64_t off)
{
	const char *p = buf;

	while (len > 0) {
		ssize_t n = pwrite(fd, p, len, (off_t)off);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return n < 0 ? -errno : -EIO;
		p += n;
		len -= (size_t)n;
		off += (uint64_t)n;
	}
	return 0;
}

/*
 * Tensors saved at once: one CKPT_WRITE of each in flight, so that the daemon writes one
 * tensor into the file (its I/O threads) while it reads another from the tiers.
 */
#define SAVE_AHEAD 3

/* A save's tensors, each a chain of CKPT_WRITEs: their three arrays, a piece of each at a time. */
struct save_set {
	struct zc_conn *c;
	struct save_tensor *ts;
	/*
	 * Chain i: a tensor's pieces in turn, its piece under way cur[i] (the daemon refuses a
	 * transfer into a tensor that is in one).
	 */
	size_t *cur;
	int fd;
	uint64_t data_start;
	const char *path;
};

/* zci_chain_fn of a save: tensor i's next piece, after the answer about its last. */
static int64_t
save_advance(void *arg, size_t i, const struct zp_msg *reply)
{
	struct save_set *set = arg;
	struct zc_conn *c = set->c;
	struct save_tensor *st = &set->ts[set->cur[i]];
	struct zp_msg m = { .hdr = { .type = ZP_CKPT_WRITE } };
	uint64_t n;
	int r;

	if (reply != NULL && reply->hdr.type == ZP_ERROR) {
		char why[sizeof(reply->u.error.message) + 1];

		snprintf(why, sizeof(why), "%s", reply->u.error.message);
		return zci_seterr(c, reply->u.error.code < 0 ? reply->u.error.code : -EIO,
		    "checkpoint %s: %s", set->path, why);
	}
	if (reply != NULL && reply->hdr.type != ZP_CKPT_DONE)
		return zci_seterr(c, -EBADMSG, "zoffloadd answered CKPT_WRITE with %s",
		    zp_type_name(reply->hdr.type));
	if (reply != NULL) {
		if (st->done > 0 && reply->u.ckpt_done.last_step != st->step)
			return zci_seterr(c, -EIO, "checkpoint %s: tensor '%s' moved from step %"
			    PRIu64 " to %" PRIu64 " while it was saved", set->path, st->name, st->step,
			    reply->u.ckpt_done.last_step);
		st->step = reply->u.ckpt_done.last_step;
		memcpy(st->crc, reply->u.ckpt_done.crc, sizeof(st->crc));
		st->done += st->req_n;
	}
	if (st->done == st->numel) {
		if (st->next == SIZE_MAX)
			return 0;
		set->cur[i] = st->next;
		st = &set->ts[st->next];
	}
	n = st->numel - st->done < SAVE_PIECE ? st->numel - st->done : SAVE_PIECE;
	m.u.ckpt_write = (struct zp_ckpt_write){
		.handle = st->t->handle, .offset = st->t_offset + st->done, .count = n,
		.format = (uint8_t)st->arrays,
	};
	for (unsigned k = 0; k < ZCK_ARRAYS; k++) {
		m.u.ckpt_write.file_offset[k] = set->data_start + st->begin[k] +
		    zck_array_bytes(st->arrays, k, st->done);
		m.u.ckpt_write.crc[k] = st->crc[k];
	}
	r = zci_send_async(c, &m, zci_deadline_after(c->timeout_ms), set->fd);
	if (r < 0)
		return r;
	st->req_n = n;
	return (int64_t)m.hdr.request_id;
}

/*
 * The checkpoint a save replaces, opened before the rename over it, so that the rename
 * does not drop its last reference: -1 when there is none (or it is no regular file).
 */
static int
open_replaced(const char *path)
{
	struct stat st;
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);

	if (fd >= 0 && (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))) {
		close(fd);
		fd = -1;
	}
	return fd;
}

/*
 * The replaced checkpoint's descriptor goes to the daemon, which closes it on an I/O
 * thread once our next message comes: ours is closed before that PING is sent, so the
 * daemon's close is the last and frees the file's blocks (a third of a millisecond per
 * MiB on ext4 with discard), not this rank.  (Closed after the answer instead, ours came
 * last whenever the daemon was quick.)  The save is done whatever the answers: an error
 * does not make it fail.
 */
static void
release_replaced(struct zc_conn *c, int fd)
{
	struct zp_msg m = { .hdr = { .type = ZP_CKPT_RELEASE } };
	struct zp_msg ping = { .hdr = { .type = ZP_PING } };
	uint64_t deadline = zci_deadline_after(c->timeout_ms);
	int r = zci_send_async(c, &m, deadline, fd);

	close(fd);
	if (r < 0)
		return;
	r = zci_send_async(c, &ping, deadline, -1);
	if (zci_recv_reply(c, ZP_OK, deadline) == 0 && r == 0)
		(void)zci_recv_reply(c, ZP_PONG, deadline);
}

/* Piece i against piece j of the same tensor: apart, or the error. */
static int
check_apart(struct zc_conn *c, const struct zc_checkpoint_piece *pi,
    const struct zc_checkpoint_piece *pj)
{
	uint64_t n = zc_tensor_numel(pi->tensor);
	uint64_t lo = pi->range.offset > pj->range.offset ? pi->range.offset : pj->range.offset;
	uint64_t hi = pi->range.offset + pi->range.count < pj->range.offset + pj->range.count ?
	    pi->range.offset + pi->range.count : pj->range.offset + pj->range.count;

	if (lo >= hi)
		return 0;
	if (pi->range.count == n && pj->range.count == n)
		return zci_seterr(c, -EINVAL, "checkpoint: tensor '%s' is listed twice",
		    pi->tensor->name);
	return zci_seterr(c, -EINVAL, "checkpoint: elements %" PRIu64 "..%" PRIu64 " of tensor "
	    "'%s' are in two pieces", lo, hi, pi->tensor->name);
}

static int
check_pieces(struct zc_conn *c, const struct zc_checkpoint_piece *ps, size_t n,
    struct save_tensor *ts)
{
	for (size_t i = 0; i < n; i++) {
		struct zc_tensor *t = ps[i].tensor;
		const struct zc_checkpoint_range *rg = &ps[i].range;
		uint64_t numel;
		int r;

		if (t == NULL || t->conn != c)
			return zci_seterr(c, -EINVAL, "checkpoint entry %zu: not a tensor of this "
			    "connection", i);
		numel = zc_tensor_numel(t);
		for (size_t j = 0; j < i; j++)
			if (ps[j].tensor == t && (r = check_apart(c, &ps[i], &ps[j])) < 0)
				return r;
		if (t->pending)
			return zci_seterr(c, -EBUSY, "checkpoint: tensor '%s' is in a step; wait for "
			    "it first", t->name);
		ts[i].t = t;
		ts[i].state_format = c->state_format[0] != '\0' ? c->state_format : "fp32";
		for (unsigned a = 0; a < 3; a++)
			if (strcmp(ts[i].state_format, zck_arrays_name((enum zck_arrays)a)) == 0)
				ts[i].arrays = (enum zck_arrays)a;
		if (rg->count == 0 || rg->offset > numel || rg->count > numel - rg->offset)
			return zci_seterr(c, -EINVAL, "checkpoint: tensor '%s' of %" PRIu64 " elements "
			    "has no elements %" PRIu64 "..%" PRIu64 " to save", t->name, numel,
			    rg->offset, rg->offset + rg->count);
		if (ts[i].arrays == ZCK_ARRAYS_Q8 && (rg->offset % ZK_Q8_BLOCK != 0 ||
		    (rg->count % ZK_Q8_BLOCK != 0 && rg->offset + rg->count != numel)))
			return zci_seterr(c, -EINVAL, "checkpoint: tensor '%s': its piece %" PRIu64
			    "..%" PRIu64 " splits a 256-element block of q8-moments state", t->name,
			    rg->offset, rg->offset + rg->count);
		ts[i].t_offset = rg->offset;
		ts[i].numel = rg->count;
		if (rg->count == numel) {
			ts[i].name = t->name;
		} else {
			if (asprintf(&ts[i].owned_name, "%s@%" PRIu64, t->name, rg->offset) < 0) {
				ts[i].owned_name = NULL;
				return zci_seterr(c, -ENOMEM, "out of memory");
			}
			ts[i].name = ts[i].owned_name;
		}
		ts[i].global_name = rg->global_name != NULL ? rg->global_name : t->name;
		ts[i].global_offset = rg->global_offset;
		ts[i].global_numel = rg->global_numel != 0 ? rg->global_numel : ts[i].numel;
		if (strlen(ts[i].global_name) == 0 || strlen(ts[i].global_name) > 255)
			return zci_seterr(c, -EINVAL, "checkpoint: tensor '%s': global name must be 1 "
			    "to 255 bytes", ts[i].name);
		if (ts[i].global_offset > ts[i].global_numel ||
		    ts[i].numel > ts[i].global_numel - ts[i].global_offset)
			return zci_seterr(c, -EINVAL, "checkpoint: tensor '%s' of %" PRIu64 " elements "
			    "does not fit at %" PRIu64 " in '%s' of %" PRIu64, ts[i].name, ts[i].numel,
			    ts[i].global_offset, ts[i].global_name, ts[i].global_numel);
	}
	return 0;
}

int
zc_checkpoint_save(struct zc_conn *c, const char *dir, const struct zc_checkpoint_entry *es,
    size_t n, const struct zc_step_params *last)
{
	struct zc_checkpoint_piece *ps;
	int r;

	if (es == NULL || n == 0)
		return zc_checkpoint_save_pieces(c, dir, NULL, 0, last);
	ps = calloc(n, sizeof(*ps));
	if (ps == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	for (size_t i = 0; i < n; i++) {
		struct zc_tensor *t = es[i].tensor;
		bool ours = t != NULL && t->conn == c;

		/* A whole tensor; check_pieces refuses what is not one of this connection. */
		ps[i] = (struct zc_checkpoint_piece){ .tensor = t, .range = {
			.count = ours ? zc_tensor_numel(t) : 1,
			.global_name = es[i].global_name,
			.global_offset = es[i].global_offset, .global_numel = es[i].global_numel } };
	}
	r = zc_checkpoint_save_pieces(c, dir, ps, n, last);
	free(ps);
	return r;
}

int
zc_checkpoint_save_pieces(struct zc_conn *c, const char *dir,
    const struct zc_checkpoint_piece *es, size_t n, const struct zc_step_params *last)
{
	char *path = NULL, *tmp = NULL, *hp = NULL, *head = NULL;
	struct save_tensor *ts = NULL;
	uint64_t data = 0, reserved;
	uint32_t rank = c->rank, world = c->world_size;
	int fd = -1, dfd = -1, old = -1, r;
	size_t hlen;
	uint8_t *hbuf = NULL;

	if (!c->job_open)
		return zci_seterr(c, -ENOTCONN, "checkpoint: open a job first");
	if (dir == NULL || n == 0 || es == NULL || last == NULL || (unsigned)last->optim > ZC_LION)
		return zci_seterr(c, -EINVAL, "checkpoint: a directory, at least one tensor and "
		    "the last step's parameters are needed");
	ts = calloc(n, sizeof(*ts));
	if (ts == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	r = check_pieces(c, es, n, ts);
	if (r < 0)
		goto out;
	/*
	 * The F32 arrays first, then BF16, then U8: each array starts aligned to its element
	 * size (SAVE_PIECE is a multiple of 256, so the daemon writes whole blocks).
	 */
	for (unsigned size = 4; size >= 1; size /= 2)
		for (size_t i = 0; i < n; i++)
			for (unsigned st = 0; st < ZCK_ARRAYS; st++) {
				uint64_t bytes = zck_array_bytes(ts[i].arrays, st, ts[i].numel);
				unsigned esz = st == 1 || st == 2 ? 4u >> ts[i].arrays : 4;

				if (esz != size)
					continue;
				ts[i].begin[st] = data;
				data += bytes;
			}
	hp = hparams_json(last);
	head = hp != NULL ? header_json(ts, n, zck_optim_names[last->optim], hp, rank, world,
	    false) : NULL;
	if (head == NULL || asprintf(&path, "%s/rank-%05u-of-%05u.safetensors", dir, rank,
	    world) < 0 || asprintf(&tmp, "%s/.rank-%05u-of-%05u.safetensors.%d.tmp", dir, rank,
	    world, (int)getpid()) < 0) {
		path = tmp = NULL;
		r = zci_seterr(c, -ENOMEM, "out of memory");
		goto out;
	}
	/* Data 8-byte aligned, as safetensors readers like it; the pad is spaces. */
	reserved = (8 + strlen(head) + 7) / 8 * 8 - 8;
	free(head);
	head = NULL;
	/* A save killed before left its temporary: gone now unless its writer lives. */
	(void)zck_tmp_remove_stale(dir);
	fd = zck_tmp_create(tmp);
	if (fd < 0) {
		r = zci_seterr(c, fd, "checkpoint: cannot create %s: %s", tmp, strerror(-fd));
		goto out;
	}
	{
		struct save_set set = { c, ts, NULL, fd, 8 + reserved, path };
		size_t nchains = 0;

		set.cur = calloc(n, sizeof(*set.cur));
		if (set.cur == NULL) {
			r = zci_seterr(c, -ENOMEM, "out of memory");
			goto out;
		}
		/* A tensor's first piece heads its chain; each later one follows the one before. */
		for (size_t i = 0; i < n; i++) {
			size_t k;

			ts[i].next = SIZE_MAX;
			for (k = 0; k < nchains && ts[set.cur[k]].t != ts[i].t; k++)
				;
			if (k == nchains) {
				set.cur[nchains++] = i;
				continue;
			}
			for (k = set.cur[k]; ts[k].next != SIZE_MAX; k = ts[k].next)
				;
			ts[k].next = i;
		}
		r = zci_chains_run(c, nchains, SAVE_AHEAD, ZP_CKPT_WRITE, save_advance, &set);
		free(set.cur);
	}
	if (r < 0)
		goto out;
	head = header_json(ts, n, zck_optim_names[last->optim], hp, rank, world, true);
	hlen = head != NULL ? strlen(head) : 0;
	hbuf = head != NULL && hlen <= reserved ? malloc(8 + reserved) : NULL;
	if (hbuf == NULL) {
		r = zci_seterr(c, -ENOMEM, "checkpoint: out of memory for the header");
		goto out;
	}
	for (int i = 0; i < 8; i++)
		hbuf[i] = (uint8_t)(reserved >> (8 * i));
	memcpy(hbuf + 8, head, hlen);
	memset(hbuf + 8 + hlen, ' ', reserved - hlen);
	r = pwrite_all(fd, hbuf, 8 + reserved, 0);
	if (r == 0 && fsync(fd) < 0)
		r = -errno;
	if (r < 0) {
		r = zci_seterr(c, r, "checkpoint %s: %s", tmp, strerror(-r));
		goto out;
	}
	/*
	 * Whole on disk before its name says so; the name on disk before we say it is saved.
	 * Renamed while still locked: unlocked, a cleaner would take it for a dead writer's.
	 */
	old = open_replaced(path);
	r = rename(tmp, path) < 0 ? -errno : 0;
	if (r == 0) {
		free(tmp);
		tmp = NULL;
		r = close(fd) < 0 ? -errno : 0;
		fd = -1;
	}
	if (r < 0) {
		r = zci_seterr(c, r, "checkpoint %s: %s", path, strerror(-r));
		goto out;
	}
	dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0 || fsync(dfd) < 0)
		r = zci_seterr(c, -errno, "checkpoint: fsync of %s: %s", dir, strerror(errno));
	if (r == 0 && old >= 0) {
		release_replaced(c, old);
		old = -1;
	}
out:
	/* Removed while locked, so that it is still ours. */
	if (fd >= 0 && tmp != NULL)
		unlink(tmp);
	if (fd >= 0)
		close(fd);
	if (dfd >= 0)
		close(dfd);
	if (old >= 0)
		close(old);
	free(hbuf);
	free(head);
	free(hp);
	free(tmp);
	free(path);
	for (size_t i = 0; ts != NULL && i < n; i++)
		free(ts[i].owned_name);
	free(ts);
	return r;
}

int
zc_checkpoint_open(struct zc_conn *c, const char *dir, struct zc_checkpoint **ret)
{
	struct zc_checkpoint *ck;
	char err[512];
	int r;

	if (dir == NULL)
		return zci_seterr(c, -EINVAL, "checkpoint: no directory");
	ck = calloc(1, sizeof(*ck));
	if (ck == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	(void)zck_tmp_remove_stale(dir);
	r = zck_open(dir, &ck->ix, err, sizeof(err));
	if (r < 0) {
		free(ck);
		return zci_seterr(c, r, "%s", err);
	}
	ck->conn = c;
	*ret = ck;
	return 0;
}

void
zc_checkpoint_close(struct zc_checkpoint *ck)
{
	if (ck == NULL)
		return;
	zck_close(ck->ix);
	free(ck);
}

static double
num(const cJSON *o, const char *key)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);

	return cJSON_IsNumber(v) ? v->valuedouble : 0;
}

int
zc_checkpoint_step_params(struct zc_checkpoint *ck, struct zc_step_params *p)
{
	const struct zck_file *f = &ck->ix->files[0];
	cJSON *o = cJSON_Parse(f->hparams);
	unsigned optim;

	if (!cJSON_IsObject(o)) {
		cJSON_Delete(o);
		return zci_seterr(ck->conn, -EBADMSG, "%s: the saved hyperparameters are not JSON",
		    f->path);
	}
	for (optim = 0; optim < 4; optim++)
		if (strcmp(zck_optim_names[optim], f->optimizer) == 0)
			break;
	if (optim == 4) {
		cJSON_Delete(o);
		return zci_seterr(ck->conn, -EBADMSG, "%s: unknown optimizer '%s'", f->path,
		    f->optimizer);
	}
	*p = (struct zc_step_params){
		.optim = (enum zc_optim)optim,
		.lr = num(o, "lr"), .beta1 = num(o, "beta1"), .beta2 = num(o, "beta2"),
		.eps = num(o, "eps"), .weight_decay = num(o, "weight_decay"),
		.lr_decay = num(o, "lr_decay"), .grad_scale = num(o, "grad_scale"),
		.max_grad_norm = num(o, "max_grad_norm"),
		.no_bias_correction = cJSON_IsTrue(cJSON_GetObjectItem(o, "no_bias_correction")),
		.check_finite = cJSON_IsTrue(cJSON_GetObjectItem(o, "check_finite")),
	};
	for (size_t i = 0; i < ck->ix->nfiles; i++)
		for (size_t j = 0; j < ck->ix->files[i].nentries; j++)
			if (ck->ix->files[i].entries[j].step > p->step)
				p->step = ck->ix->files[i].entries[j].step;
	cJSON_Delete(o);
	return 0;
}
