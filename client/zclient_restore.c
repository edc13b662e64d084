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
struct zc_checkpoint {
	struct zc_conn *conn;
	struct zck_index *ix;
};

struct piece {
	const struct zck_file *f;
	const struct zck_entry *e;
};

/* Where a block of a saved array goes: the part inside [lo, hi) of the parameter. */
struct sink {
	const struct piece *p;
	uint64_t lo, hi;		/* the tensor's range in its parameter */
	float *master;			/* restoring master: the tensor's own buffer */
	struct zc_tensor *t;		/* restoring a moment: written through the daemon */
	enum zc_state state;
};

static int
take_block(void *arg, uint64_t first, const float *data, uint64_t count)
{
	struct sink *s = arg;
	uint64_t from = s->p->e->global_offset + first, to = from + count;

	if (from < s->lo)
		from = s->lo;
	if (to > s->hi)
		to = s->hi;
	if (from >= to)
		return 0;
	data += from - (s->p->e->global_offset + first);
	if (s->master != NULL) {
		memcpy(s->master + (from - s->lo), data, (to - from) * sizeof(float));
		return 0;
	}
	return zc_tensor_write(s->t, s->state, from - s->lo, to - from, data);
}

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

/* Reads state from every piece (whole arrays, for their checksums), keeping [lo, hi). */
static int
restore_state(struct zc_checkpoint *ck, const struct piece *ps, size_t n, struct sink *s,
    unsigned state)
{
	char err[512];

	for (size_t i = 0; i < n; i++) {
		int r;

		s->p = &ps[i];
		r = zck_read_array(ps[i].f, ps[i].e, state, take_block, s, err, sizeof(err));
		if (r < 0)
			/* An error of zc_tensor_write is already the connection's message. */
			return err[0] != '\0' ? zci_seterr(ck->conn, r, "%s", err) : r;
	}
	return 0;
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
	struct sink s = { .lo = lo, .hi = lo + desc->numel };
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
	/* Master first, checked, in memory: it is what registering writes. */
	s.master = malloc(desc->numel * sizeof(float));
	if (s.master == NULL) {
		r = zci_seterr(c, -ENOMEM, "out of memory");
		goto out;
	}
	r = restore_state(ck, ps, n, &s, ZCK_STATES - 3);
	if (r == 0)
		r = zc_tensor_register(c, desc, s.master, &t);
	if (r < 0)
		goto out;
	free(s.master);
	s.master = NULL;
	s.t = t;
	for (unsigned st = 1; st < ZCK_STATES && r == 0; st++) {
		s.state = (enum zc_state)st;
		r = restore_state(ck, ps, n, &s, st);
	}
	if (r == 0 && step > 0)
		r = zc_tensor_set_step(t, step);
	if (r < 0) {
		/* Keep the first error, not the clean-up's. */
		snprintf(saved, sizeof(saved), "%s", zc_errmsg(c));
		(void)zc_tensor_unregister(t);
		zci_seterr(c, r, "%s", saved);
		goto out;
	}
	*ret = t;
out:
	free(s.master);
	free(ps);
	return r;
}
