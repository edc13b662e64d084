/* libzclient: a tensor registered from a checkpoint, from whichever rank files hold its range. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ckpt_decode.h"
#include "ckpt_index.h"
#include "zclient.h"
#include "zclient_impl.h"

/* Opaque in zclient.h; the same layout as in zclient_checkpoint.c. */
/*
 * A saved array's part that goes into a tensor: of range [lo, hi) of the parameter, whose
 * element lo is the tensor's element at.  e NULL: elements [at, at + hi - lo) of the
 * tensor that no range covers, zeroed.
 */
struct piece {
	const struct zck_file *f;
	const struct zck_entry *e;
	uint64_t lo, hi, at;
};

static int
by_offset(const void *a, const void *b)
{
	const struct piece *x = a, *y = b;

	return x->e->global_offset < y->e->global_offset ? -1 :
	    x->e->global_offset > y->e->global_offset;
}

/* The saved arrays that overlap [lo, hi) of name, checked to cover it and to agree. */
/*
 * Appended to *ret (*ret_n of them so far; *have_step: *ret_step is set) for the range
 * going into the tensor at t_at.
 */
static int
find_pieces(struct zc_checkpoint *ck, const char *name, uint64_t lo, uint64_t hi,
    uint64_t gnumel, uint64_t t_at, const char *optim, struct piece **ret, size_t *ret_n,
    uint64_t *ret_step, bool *have_step)
{
	struct zc_conn *c = ck->conn;
	struct piece *ps = *ret, *bigger;
	size_t first = *ret_n, n = *ret_n;
	uint64_t at = lo;
	int r = 0;

	for (size_t i = 0; i < ck->ix->nfiles; i++) {
		const struct zck_file *f = &ck->ix->files[i];

		for (size_t j = 0; j < f->nentries; j++) {
			const struct zck_entry *e = &f->entries[j];

			if (strcmp(e->global_name, name) != 0 || e->numel == 0 ||
			    e->global_offset >= hi || e->global_offset + e->numel <= lo)
				continue;
			if (strcmp(f->optimizer, optim) != 0) {
				r = zci_seterr(c, -EBADMSG, "%s: tensor '%s' was saved by %s, not %s",
				    f->path, e->name, f->optimizer, optim);
				goto fail;
			}
			if (e->global_numel != gnumel) {
				r = zci_seterr(c, -EBADMSG, "%s: tensor '%s': parameter '%s' has %"
				    PRIu64 " elements there, not %" PRIu64, f->path, e->name, name,
				    e->global_numel, gnumel);
				goto fail;
			}
			if (*have_step && e->step != *ret_step) {
				r = zci_seterr(c, -EBADMSG, "%s: tensor '%s' is at step %" PRIu64 ", %s "
				    "holds '%s' at step %" PRIu64 ": the directory mixes checkpoints",
				    f->path, e->name, e->step, ps[0].f->path, ps[0].e->name, *ret_step);
				goto fail;
			}
			*ret_step = e->step;
			*have_step = true;
			bigger = realloc(ps, (n + 1) * sizeof(*ps));
			if (bigger == NULL) {
				r = zci_seterr(c, -ENOMEM, "out of memory");
				goto fail;
			}
			ps = bigger;
			ps[n++] = (struct piece){ f, e, lo, hi, t_at };
		}
	}
	if (n > first)
		qsort(ps + first, n - first, sizeof(*ps), by_offset);
	for (size_t i = first; i <= n && at < hi; i++) {
		/* A gap before piece i (or after the last): the first range nobody holds. */
		if (i == n || ps[i].e->global_offset > at) {
			uint64_t end = i < n && ps[i].e->global_offset < hi ? ps[i].e->global_offset :
			    hi;

			r = zci_seterr(c, -ENOENT, "checkpoint %s: elements %" PRIu64 "..%" PRIu64
			    " of '%s' are in none of its %zu rank files", ck->ix->dir, at, end, name,
			    ck->ix->nfiles);
			goto fail;
		}
		if (ps[i].e->global_offset + ps[i].e->numel > at)
			at = ps[i].e->global_offset + ps[i].e->numel;
	}
	*ret = ps;
	*ret_n = n;
	return 0;
fail:
	*ret = ps;		/* the caller frees it */
	*ret_n = n;
	return r;
}

/*
 * Elements per CKPT_READ: the daemon streams a request's range through two buffers of its
 * own, reading the file while it writes into the tiers; a request is bounded so that it
 * ends within a reasonable request timeout.
 */
#define RESTORE_PIECE (64u << 20)
/* A converted request's elements: decoded into a memory file of 12 bytes each first. */
#define CONVERT_PIECE (4u << 20)

/*
 * Tensors restored at once: one CKPT_READ of each in flight, so that the daemon reads one
 * tensor's file (its I/O threads, two) while it stores another's into the tiers; one
 * after another, each tensor's first piece was read with nothing else to do.
 */
#define RESTORE_AHEAD 3

/*
 * One tensor's restore: its saved pieces in turn, each read by the daemon (through the
 * descriptor this process opened) straight into the tensor's tier, a CKPT_READ of up to
 * RESTORE_PIECE elements at a time.  The CRC of each whole array is checked: the parts
 * outside the range are read here.  At most one request of a tensor is in flight (the
 * daemon refuses a transfer into a tensor that is in one).
 */
struct restore {
	const char *name;		/* the parameter's */
	struct zc_tensor *t;
	struct piece *ps;
	size_t n;
	uint64_t numel;			/* t's */
	uint64_t step;
	size_t i;			/* the piece under way */
	uint64_t x, b;			/* its elements [x, b) still to come */
	/*
	 * How the piece goes: F32 arrays as they are (the daemon encodes them into the job's
	 * format), compressed arrays raw into a job of their format, or decoded here first
	 * (convert: another format, or a split 256-element block).
	 */
	enum { MODE_F32, MODE_RAW, MODE_CONVERT, MODE_ZERO } mode;
	uint32_t crc[ZCK_ARRAYS];
	uint64_t req;			/* the request in flight */
	uint64_t req_n;
	bool started, done;
};

/* The job's state format as checkpoint arrays. */
static enum zck_arrays
job_arrays(const struct zc_conn *c)
{
	for (unsigned a = 1; a < 3; a++)
		if (strcmp(c->state_format, zck_arrays_name((enum zck_arrays)a)) == 0)
			return (enum zck_arrays)a;
	return ZCK_ARRAYS_F32;
}

/*
 * How piece r->i's elements [x, b) go into the tensor at t0: raw when the arrays are the
 * job's format and, for q8-moments, no 256-element block is split, in the file or in the
 * tensor (a short last block only where both end); else decoded and re-encoded, which
 * only a restore allowed to convert does.
 */
static int
piece_mode(struct zc_conn *c, const struct zc_checkpoint *ck, struct restore *r)
{
	const struct piece *p = &r->ps[r->i];
	const struct zck_entry *e = p->e;
	uint64_t t0 = p->at + e->global_offset + r->x - p->lo, n = r->b - r->x, tn = r->numel;
	bool aligned = e->arrays != ZCK_ARRAYS_Q8 || (r->x % ZK_Q8_BLOCK == 0 &&
	    t0 % ZK_Q8_BLOCK == 0 && (n % ZK_Q8_BLOCK == 0 || (r->b == e->numel && t0 + n == tn)));

	if (e->arrays == ZCK_ARRAYS_F32)
		r->mode = MODE_F32;
	else if (e->arrays == job_arrays(c) && aligned)
		r->mode = MODE_RAW;
	else if (ck->convert)
		r->mode = MODE_CONVERT;
	else if (e->arrays == job_arrays(c))
		return zci_seterr(c, -EINVAL, "%s: tensor '%s': its elements %" PRIu64 "..%" PRIu64
		    " (of '%s' at %" PRIu64 ") go to elements %" PRIu64 "..%" PRIu64 " of tensor "
		    "'%s': that splits a 256-element block of q8-moments state; shard on multiples "
		    "of 256 elements, or zc_checkpoint_allow_convert decodes and re-encodes the "
		    "blocks (lossy)", p->f->path, e->name, r->x, r->b, r->name, e->global_offset,
		    t0, t0 + n, r->t->name);
	else
		return zci_seterr(c, -EBADMSG, "%s: tensor '%s' holds %s arrays, and this job "
		    "keeps %s state (zc_checkpoint_allow_convert converts it)", p->f->path, e->name,
		    zck_arrays_name(e->arrays), c->state_format[0] ? c->state_format : "fp32");
	return 0;
}

/* Piece r->i from its first element in the range, its arrays' CRCs up to there. */
static int
piece_start(struct zc_conn *c, const struct zc_checkpoint *ck, struct restore *r)
{
	const struct piece *p = &r->ps[r->i];
	const struct zck_entry *e = p->e;
	char err[512];
	int rc;

	if (e == NULL) {
		r->mode = MODE_ZERO;
		r->x = 0;
		r->b = p->hi - p->lo;
		return 0;
	}
	r->x = p->lo > e->global_offset ? p->lo - e->global_offset : 0;
	r->b = p->hi < e->global_offset + e->numel ? p->hi - e->global_offset : e->numel;
	if (e->bad != NULL)
		return zci_seterr(c, -EBADMSG, "%s: tensor '%s': an array %s", p->f->path, e->name,
		    e->bad);
	rc = piece_mode(c, ck, r);
	if (rc < 0)
		return rc;
	for (unsigned k = 0; k < ZCK_ARRAYS; k++) {
		uint64_t bytes = zck_array_bytes(e->arrays, k, e->numel);

		r->crc[k] = 0;
		if (bytes == 0 && k >= ZCK_STATES)
			continue;
		if (e->begin[k] + bytes > p->f->size)
			return zci_seterr(c, -EBADMSG, "%s: tensor '%s/%s': the file is truncated (%"
			    PRIu64 " bytes, its header needs %" PRIu64 ")", p->f->path, e->name,
			    zck_state_names[k], p->f->size, p->f->data_end);
		/* Converted here: each array checked whole before any of it is used. */
		if (r->mode == MODE_CONVERT)
			rc = zck_check_array(p->f, e, k, err, sizeof(err));
		else
			rc = zck_crc_range(p->f, e, k, 0, r->x, &r->crc[k], err, sizeof(err));
		if (rc < 0)
			return zci_seterr(c, rc, "%s", err);
	}
	return 0;
}

/*
 * State saved in one format goes into a job of another only when the caller asked:
 * the moments would be re-encoded (quantized, or widened with the error they carry).
 */
static int
check_formats(struct zc_conn *c, const struct zc_checkpoint *ck, const struct piece *ps,
    size_t n)
{
	const char *want = c->state_format[0] != '\0' ? c->state_format : "fp32";

	for (size_t i = 0; i < n && !ck->convert; i++)
		if (ps[i].e != NULL && strcmp(ps[i].e->state_format, want) != 0)
			return zci_seterr(c, -EBADMSG, "%s: tensor '%s' was saved as %s state, and this "
			    "job keeps %s (zc_checkpoint_allow_convert converts it)", ps[i].f->path,
			    ps[i].e->name, ps[i].e->state_format, want);
	return 0;
}

void
zc_checkpoint_allow_convert(struct zc_checkpoint *ck, bool allow)
{
	ck->convert = allow;
}

/* The end of piece r->i: the rest of its arrays checked, their CRCs against the header's. */
static int
piece_finish(struct zc_conn *c, struct restore *r)
{
	const struct piece *p = &r->ps[r->i];
	const struct zck_entry *e = p->e;
	char err[512];
	int rc;

	for (unsigned k = 0; k < ZCK_ARRAYS && r->mode != MODE_CONVERT && r->mode != MODE_ZERO;
	    k++) {
		if (zck_array_bytes(e->arrays, k, e->numel) == 0 && k >= ZCK_STATES)
			continue;
		rc = zck_crc_range(p->f, e, k, r->b, e->numel, &r->crc[k], err, sizeof(err));
		if (rc < 0)
			return zci_seterr(c, rc, "%s", err);
		if (r->crc[k] != e->crc[k])
			return zci_seterr(c, -EBADMSG, "%s: tensor '%s/%s': CRC-32C %08x, the header "
			    "says %08x: the file is damaged", p->f->path, e->name, zck_state_names[k],
			    r->crc[k], e->crc[k]);
	}
	return 0;
}

/*
 * Sends r's next request: the next part of its piece, or the next piece's first (its
 * checks first); r->done when none is left.
 */
static int
restore_next(struct zc_conn *c, const struct zc_checkpoint *ck, struct restore *r)
{
	const struct piece *p;
	struct zp_msg m = { .hdr = { .type = ZP_CKPT_READ } };
	uint64_t n;
	int rc;

	if (!r->started) {
		r->started = true;
		rc = piece_start(c, ck, r);
		if (rc < 0)
			return rc;
	}
	while (r->x >= r->b) {
		rc = piece_finish(c, r);
		if (rc < 0)
			return rc;
		if (++r->i == r->n) {
			r->done = true;
			return 0;
		}
		rc = piece_start(c, ck, r);
		if (rc < 0)
			return rc;
	}
	p = &r->ps[r->i];
	n = r->b - r->x < RESTORE_PIECE ? r->b - r->x : RESTORE_PIECE;
	if (r->mode == MODE_CONVERT && n > CONVERT_PIECE)
		n = CONVERT_PIECE;
	if (r->mode == MODE_ZERO) {
		int fd = memfd_create("zoffload-ckpt-zeros", MFD_CLOEXEC);

		/* A hole of 12 bytes an element reads as zeros, and takes no memory. */
		if (fd < 0 || ftruncate(fd, (off_t)(12 * n)) < 0) {
			rc = -errno;
			if (fd >= 0)
				close(fd);
			return zci_seterr(c, rc, "tensor '%s': no memory file for its %" PRIu64
			    " elements in no range: %s", r->t->name, n, strerror(-rc));
		}
		m.u.ckpt_write = (struct zp_ckpt_write){ .handle = r->t->handle,
			.offset = p->at + r->x, .count = n, .format = 0 };
		for (unsigned k = 0; k < ZCK_STATES; k++)
			m.u.ckpt_write.file_offset[k] = 4 * k * n;
		rc = zci_send_async(c, &m, zci_deadline_after(c->timeout_ms), fd);
		close(fd);
		if (rc < 0)
			return rc;
		r->req = m.hdr.request_id;
		r->req_n = n;
		return 0;
	}
	m.u.ckpt_write = (struct zp_ckpt_write){ .handle = r->t->handle,
		.offset = p->at + p->e->global_offset + r->x - p->lo, .count = n,
		.format = r->mode == MODE_RAW ? (uint8_t)p->e->arrays : 0 };
	if (r->mode == MODE_CONVERT) {
		char err[512];
		int fd = zck_decode_fd(p->f, p->e, r->x, n, err, sizeof(err));

		if (fd < 0)
			return zci_seterr(c, fd, "%s: %s", p->f->path, err);
		for (unsigned k = 0; k < ZCK_STATES; k++)
			m.u.ckpt_write.file_offset[k] = 4 * k * n;
		rc = zci_send_async(c, &m, zci_deadline_after(c->timeout_ms), fd);
		close(fd);
	} else {
		for (unsigned k = 0; k < ZCK_ARRAYS; k++) {
			m.u.ckpt_write.file_offset[k] = p->e->begin[k] +
			    zck_array_bytes(p->e->arrays, k, r->x);
			m.u.ckpt_write.crc[k] = r->crc[k];
		}
		rc = zci_send_async(c, &m, zci_deadline_after(c->timeout_ms), p->f->fd);
	}
	if (rc < 0)
		return rc;
	r->req = m.hdr.request_id;
	r->req_n = n;
	return 0;
}

/* The answer to r's request: on to its next, or the error named by file. */
static int
restore_answer(struct zc_conn *c, const struct zc_checkpoint *ck, struct restore *r,
    const struct zp_msg *m)
{
	char err[sizeof(c->err)];

	if (m->hdr.type == ZP_ERROR) {
		snprintf(err, sizeof(err), "%s", m->u.error.message);
		return zci_seterr(c, m->u.error.code < 0 ? m->u.error.code : -EIO, "%s: %s",
		    r->ps[r->i].f != NULL ? r->ps[r->i].f->path : r->t->name, err);
	}
	if (m->hdr.type != ZP_CKPT_DONE)
		return zci_seterr(c, -EBADMSG, "zoffloadd answered CKPT_READ with %s",
		    zp_type_name(m->hdr.type));
	/* A converted piece's CRCs are of the decoded copy: its file's were checked whole. */
	if (r->mode != MODE_CONVERT && r->mode != MODE_ZERO)
		memcpy(r->crc, m->u.ckpt_done.crc, sizeof(r->crc));
	r->x += r->req_n;
	return restore_next(c, ck, r);
}

struct restore_set {
	struct zc_conn *c;
	const struct zc_checkpoint *ck;
	struct restore *rs;
};

/* zci_chain_fn of a restore: tensor i's next request. */
static int64_t
restore_advance(void *arg, size_t i, const struct zp_msg *reply)
{
	struct restore_set *set = arg;
	struct restore *r = &set->rs[i];
	int rc = reply == NULL ? restore_next(set->c, set->ck, r) :
	    restore_answer(set->c, set->ck, r, reply);

	if (rc < 0)
		return rc;
	return r->done ? 0 : (int64_t)r->req;
}

static int
by_range_offset(const void *a, const void *b)
{
	const struct zc_checkpoint_range *x = *(const struct zc_checkpoint_range *const *)a;
	const struct zc_checkpoint_range *y = *(const struct zc_checkpoint_range *const *)b;

	return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/*
 * Tensor r's pieces from its ranges rg[0..nr): each range's saved pieces, then a zeroed
 * piece for every part of the tensor in no range.
 */
static int
plan_restore(struct zc_checkpoint *ck, const struct zc_tensor_desc *desc,
    const struct zc_checkpoint_range *rg, size_t nr, enum zc_optim optim, struct restore *r)
{
	struct zc_conn *c = ck->conn;
	const struct zc_checkpoint_range **sorted;
	bool have_step = false;
	uint64_t at = 0;
	int rc = 0;

	r->name = desc->name;
	r->numel = desc->numel;
	if (desc->numel == 0)
		return zci_seterr(c, -EINVAL, "tensor '%s': numel > 0 is needed", desc->name);
	sorted = calloc(nr > 0 ? nr : 1, sizeof(*sorted));
	if (sorted == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	for (size_t k = 0; k < nr; k++)
		sorted[k] = &rg[k];
	qsort(sorted, nr, sizeof(*sorted), by_range_offset);
	for (size_t k = 0; k < nr && rc == 0; k++) {
		const struct zc_checkpoint_range *g = sorted[k];
		const char *name = g->global_name != NULL ? g->global_name : desc->name;
		uint64_t gnumel = g->global_numel != 0 ? g->global_numel : desc->numel;

		if (g->count == 0 || g->offset > desc->numel || g->count > desc->numel - g->offset)
			rc = zci_seterr(c, -EINVAL, "tensor '%s' of %" PRIu64 " elements has no "
			    "elements %" PRIu64 "..%" PRIu64 " to restore", desc->name, desc->numel,
			    g->offset, g->offset + g->count);
		else if (g->offset < at)
			rc = zci_seterr(c, -EINVAL, "tensor '%s': two of its ranges restore elements %"
			    PRIu64 "..%" PRIu64, desc->name, g->offset, at < g->offset + g->count ?
			    at : g->offset + g->count);
		else if (g->global_offset > gnumel || g->count > gnumel - g->global_offset)
			rc = zci_seterr(c, -EINVAL, "tensor '%s' of %" PRIu64 " elements does not fit "
			    "at %" PRIu64 " in '%s' of %" PRIu64, desc->name, g->count,
			    g->global_offset, name, gnumel);
		else
			rc = find_pieces(ck, name, g->global_offset, g->global_offset + g->count,
			    gnumel, g->offset, zck_optim_names[optim], &r->ps, &r->n, &r->step,
			    &have_step);
		if (rc == 0)
			at = g->offset + g->count;
	}
	/* The gaps: before each range, and after the last. */
	at = 0;
	for (size_t k = 0; k <= nr && rc == 0; k++) {
		uint64_t end = k < nr ? sorted[k]->offset : desc->numel;
		struct piece *bigger;

		if (end > at) {
			bigger = realloc(r->ps, (r->n + 1) * sizeof(*r->ps));
			if (bigger == NULL) {
				rc = zci_seterr(c, -ENOMEM, "out of memory");
				break;
			}
			r->ps = bigger;
			r->ps[r->n++] = (struct piece){ NULL, NULL, 0, end - at, at };
		}
		if (k < nr)
			at = sorted[k]->offset + sorted[k]->count;
	}
	free(sorted);
	if (rc == 0)
		rc = check_formats(c, ck, r->ps, r->n);
	return rc;
}

int
zc_tensors_register_checkpoint_ranges(struct zc_conn *c, size_t n,
    const struct zc_tensor_desc *descs, struct zc_checkpoint *ck,
    const struct zc_checkpoint_range *ranges, const size_t *nranges, enum zc_optim optim,
    struct zc_tensor **ret)
{
	struct restore *rs;
	char saved[sizeof(c->err)];
	size_t i, first = 0;
	int r = 0;

	if (ck == NULL || ck->conn != c || (unsigned)optim > ZC_LION || descs == NULL ||
	    ret == NULL || (n > 0 && (ranges == NULL || nranges == NULL)))
		return zci_seterr(c, -EINVAL, "restore: a checkpoint opened on this connection, a "
		    "known optimizer, tensors, their ranges and room for them are needed");
	rs = calloc(n > 0 ? n : 1, sizeof(*rs));
	if (rs == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	/* Every tensor's pieces found and checked before any is registered. */
	for (i = 0; i < n && r == 0; i++) {
		r = plan_restore(ck, &descs[i], ranges + first, nranges[i], optim, &rs[i]);
		first += nranges[i];
	}
	/* No initial values: the pieces write every element (plan_restore saw to it). */
	for (i = 0; i < n && r == 0; i++)
		r = zci_tensor_register(c, &descs[i], NULL, &rs[i].t);
	if (r == 0) {
		struct restore_set set = { c, ck, rs };

		r = zci_chains_run(c, n, RESTORE_AHEAD, ZP_CKPT_READ, restore_advance, &set);
	}
	for (i = 0; i < n && r == 0; i++)
		if (rs[i].step > 0)
			r = zc_tensor_set_step(rs[i].t, rs[i].step);
	if (r < 0) {
		/* Keep the first error, not the clean-up's. */
		snprintf(saved, sizeof(saved), "%s", zc_errmsg(c));
		for (i = 0; i < n; i++)
			if (rs[i].t != NULL)
				(void)zc_tensor_unregister(rs[i].t);
		zci_seterr(c, r, "%s", saved);
	}
	for (i = 0; i < n; i++) {
		if (r == 0) {
			/* Every element is in: from now on a reattach must find the state kept. */
			rs[i].t->fresh = false;
			ret[i] = rs[i].t;
		}
		free(rs[i].ps);
	}
	free(rs);
	return r;
}

int
zc_tensors_register_checkpoint(struct zc_conn *c, size_t n, const struct zc_tensor_desc *descs,
    struct zc_checkpoint *ck, const struct zc_checkpoint_place *places, enum zc_optim optim,
    struct zc_tensor **ret)
{
	struct zc_checkpoint_range *rg;
	size_t *ones;
	int r;

	if (descs == NULL && n > 0)
		return zc_tensors_register_checkpoint_ranges(c, n, descs, ck, NULL, NULL, optim,
		    ret);
	rg = calloc(n > 0 ? n : 1, sizeof(*rg));
	ones = calloc(n > 0 ? n : 1, sizeof(*ones));
	if (rg == NULL || ones == NULL) {
		free(rg);
		free(ones);
		return zci_seterr(c, -ENOMEM, "out of memory");
	}
	/* A place is one range: the whole tensor. */
	for (size_t i = 0; i < n; i++) {
		const struct zc_checkpoint_place *place = places != NULL ? &places[i] : NULL;

		ones[i] = 1;
		rg[i] = (struct zc_checkpoint_range){ .offset = 0, .count = descs[i].numel,
			.global_name = place != NULL ? place->global_name : NULL,
			.global_offset = place != NULL ? place->global_offset : 0,
			.global_numel = place != NULL ? place->global_numel : 0 };
	}
	r = zc_tensors_register_checkpoint_ranges(c, n, descs, ck, rg, ones, optim, ret);
	free(ones);
	free(rg);
	return r;
}

int
zc_tensor_register_checkpoint(struct zc_conn *c, const struct zc_tensor_desc *desc,
    struct zc_checkpoint *ck, const struct zc_checkpoint_place *place, enum zc_optim optim,
    struct zc_tensor **ret)
{
	return zc_tensors_register_checkpoint(c, 1, desc, ck, place, optim, ret);
}
