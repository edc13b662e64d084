/* libzclient: a tensor registered from a checkpoint, from whichever rank files hold its range. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_index.h"
#include "zclient.h"
#include "zclient_impl.h"

/* Opaque in zclient.h; the same layout as in zclient_checkpoint.c. */
struct piece {
	const struct zck_file *f;
	const struct zck_entry *e;
};

static int
by_offset(const void *a, const void *b)
{
	const struct piece *x = a, *y = b;

	return x->e->global_offset < y->e->global_offset ? -1 :
	    x->e->global_offset > y->e->global_offset;
}

/* The saved arrays that overlap [lo, hi) of name, checked to cover it and to agree. */
static int
find_pieces(struct zc_checkpoint *ck, const char *name, uint64_t lo, uint64_t hi,
    uint64_t gnumel, const char *optim, struct piece **ret, size_t *ret_n, uint64_t *ret_step)
{
	struct zc_conn *c = ck->conn;
	struct piece *ps = NULL, *bigger;
	size_t n = 0;
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
			if (n > 0 && e->step != *ret_step) {
				r = zci_seterr(c, -EBADMSG, "%s: tensor '%s' is at step %" PRIu64 ", %s "
				    "holds '%s' at step %" PRIu64 ": the directory mixes checkpoints",
				    f->path, e->name, e->step, ps[0].f->path, ps[0].e->name, *ret_step);
				goto fail;
			}
			*ret_step = e->step;
			bigger = realloc(ps, (n + 1) * sizeof(*ps));
			if (bigger == NULL) {
				r = zci_seterr(c, -ENOMEM, "out of memory");
				goto fail;
			}
			ps = bigger;
			ps[n++] = (struct piece){ f, e };
		}
	}
	if (n > 0)
		qsort(ps, n, sizeof(*ps), by_offset);
	for (size_t i = 0; i <= n && at < hi; i++) {
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
	free(ps);
	return r;
}

/*
 * Elements per CKPT_READ: the daemon streams a request's range through two buffers of its
 * own, reading the file while it writes into the tiers; a request is bounded so that it
 * ends within a reasonable request timeout.
 */
#define RESTORE_PIECE (64u << 20)

/*
 * One saved tensor's part in [lo, hi) of the parameter into t, read from the file by the
 * daemon (through the descriptor this process opened) straight into the tensor's tier.
 * The CRC of each whole array is checked: the parts outside the range are read here.
 */
static int
restore_piece(struct zc_conn *c, struct zc_tensor *t, const struct piece *p, uint64_t lo,
    uint64_t hi)
{
	const struct zck_entry *e = p->e;
	uint64_t a = lo > e->global_offset ? lo - e->global_offset : 0;
	uint64_t b = hi < e->global_offset + e->numel ? hi - e->global_offset : e->numel;
	uint32_t crc[ZCK_STATES] = { 0 };
	char err[512];
	int r;

	if (e->bad != NULL)
		return zci_seterr(c, -EBADMSG, "%s: tensor '%s': an array %s", p->f->path, e->name,
		    e->bad);
	for (unsigned k = 0; k < ZCK_STATES; k++) {
		if (e->begin[k] + 4 * e->numel > p->f->size)
			return zci_seterr(c, -EBADMSG, "%s: tensor '%s/%s': the file is truncated (%"
			    PRIu64 " bytes, its header needs %" PRIu64 ")", p->f->path, e->name,
			    zck_state_names[k], p->f->size, p->f->data_end);
		r = zck_crc_range(p->f, e, k, 0, a, &crc[k], err, sizeof(err));
		if (r < 0)
			return zci_seterr(c, r, "%s", err);
	}
	for (uint64_t x = a; x < b;) {
		uint64_t n = b - x < RESTORE_PIECE ? b - x : RESTORE_PIECE;
		struct zp_msg m = { .hdr = { .type = ZP_CKPT_READ } };
		const struct zp_msg *reply;

		m.u.ckpt_write = (struct zp_ckpt_write){ .handle = t->handle,
			.offset = e->global_offset + x - lo, .count = n };
		for (unsigned k = 0; k < ZCK_STATES; k++) {
			m.u.ckpt_write.file_offset[k] = e->begin[k] + 4 * x;
			m.u.ckpt_write.crc[k] = crc[k];
		}
		r = zci_rpc_fd(c, &m, ZP_CKPT_DONE, p->f->fd, &reply);
		if (r < 0) {
			snprintf(err, sizeof(err), "%s", zc_errmsg(c));
			return zci_seterr(c, r, "%s: %s", p->f->path, err);
		}
		memcpy(crc, reply->u.ckpt_done.crc, sizeof(crc));
		x += n;
	}
	for (unsigned k = 0; k < ZCK_STATES; k++) {
		r = zck_crc_range(p->f, e, k, b, e->numel, &crc[k], err, sizeof(err));
		if (r < 0)
			return zci_seterr(c, r, "%s", err);
		if (crc[k] != e->crc[k])
			return zci_seterr(c, -EBADMSG, "%s: tensor '%s/%s': CRC-32C %08x, the header "
			    "says %08x: the file is damaged", p->f->path, e->name, zck_state_names[k],
			    crc[k], e->crc[k]);
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
		if (strcmp(ps[i].e->state_format, want) != 0)
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

int
zc_tensor_register_checkpoint(struct zc_conn *c, const struct zc_tensor_desc *desc,
    struct zc_checkpoint *ck, const struct zc_checkpoint_place *place, enum zc_optim optim,
    struct zc_tensor **ret)
{
	const char *name = place != NULL && place->global_name != NULL ? place->global_name :
	    desc->name;
	uint64_t lo = place != NULL ? place->global_offset : 0;
	uint64_t gnumel = place != NULL && place->global_numel != 0 ? place->global_numel :
	    desc->numel;
	struct piece *ps = NULL;
	struct zc_tensor *t = NULL;
	uint64_t step = 0;
	size_t n = 0;
	char saved[512];
	int r;

	if (ck == NULL || ck->conn != c || (unsigned)optim > ZC_LION || desc->numel == 0)
		return zci_seterr(c, -EINVAL, "tensor '%s': a checkpoint opened on this connection, "
		    "a known optimizer and numel > 0 are needed", desc->name);
	if (lo > gnumel || desc->numel > gnumel - lo)
		return zci_seterr(c, -EINVAL, "tensor '%s' of %" PRIu64 " elements does not fit at %"
		    PRIu64 " in '%s' of %" PRIu64, desc->name, desc->numel, lo, name, gnumel);
	r = find_pieces(ck, name, lo, lo + desc->numel, gnumel, zck_optim_names[optim], &ps, &n,
	    &step);
	if (r < 0)
		return r;
	r = check_formats(c, ck, ps, n);
	if (r < 0)
		goto out;
	/* No initial values: the pieces below write every element (find_pieces checked). */
	r = zci_tensor_register(c, desc, NULL, &t);
	if (r < 0)
		goto out;
	for (size_t i = 0; i < n && r == 0; i++)
		r = restore_piece(c, t, &ps[i], lo, lo + desc->numel);
	if (r == 0 && step > 0)
		r = zc_tensor_set_step(t, step);
	if (r < 0) {
		/* Keep the first error, not the clean-up's. */
		snprintf(saved, sizeof(saved), "%s", zc_errmsg(c));
		(void)zc_tensor_unregister(t);
		zci_seterr(c, r, "%s", saved);
		goto out;
	}
	/* Every element is in: from now on a reattach must find the state kept. */
	t->fresh = false;
	*ret = t;
out:
	free(ps);
	return r;
}
