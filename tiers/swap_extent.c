/* Swap space: per-path free lists and extents striped over all paths. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "swap_impl.h"

/*
 * A sorted array of free ranges, first fit.  Extents are tensors' state,
 * allocated when a job registers them, not per I/O, so O(ranges) is fine and
 * coalescing on release keeps the array short.
 */
int
zs_space_init(struct zs_space *s, uint64_t capacity)
{
	memset(s, 0, sizeof(*s));
	s->capacity = capacity;
	if (capacity == 0)
		return 0;
	s->cap = 16;
	s->free = calloc(s->cap, sizeof(*s->free));
	if (s->free == NULL)
		return -ENOMEM;
	s->free[0] = (struct zs_range){ .off = 0, .len = capacity };
	s->nfree = 1;
	return 0;
}

void
zs_space_fini(struct zs_space *s)
{
	free(s->free);
	s->free = NULL;
	s->nfree = s->cap = 0;
}

int
zs_space_alloc(struct zs_space *s, uint64_t len, uint64_t *ret)
{
	unsigned i;

	for (i = 0; i < s->nfree; i++) {
		struct zs_range *r = &s->free[i];

		if (r->len < len)
			continue;
		*ret = r->off;
		r->off += len;
		r->len -= len;
		if (r->len == 0) {
			memmove(r, r + 1, (s->nfree - i - 1) * sizeof(*r));
			s->nfree--;
		}
		s->used += len;
		return 0;
	}
	return -ENOSPC;
}

static int
space_grow(struct zs_space *s)
{
	struct zs_range *n;
	unsigned cap = s->cap ? s->cap * 2 : 16;

	n = realloc(s->free, cap * sizeof(*n));
	if (n == NULL)
		return -ENOMEM;
	s->free = n;
	s->cap = cap;
	return 0;
}

void
zs_space_release(struct zs_space *s, uint64_t off, uint64_t len)
{
	unsigned lo = 0, hi = s->nfree, i;
	bool join_prev, join_next;

	/* First free range after off. */
	while (lo < hi) {
		unsigned mid = (lo + hi) / 2;

		if (s->free[mid].off < off)
			lo = mid + 1;
		else
			hi = mid;
	}
	i = lo;
	join_prev = i > 0 && s->free[i - 1].off + s->free[i - 1].len == off;
	join_next = i < s->nfree && off + len == s->free[i].off;
	s->used -= len;
	if (join_prev && join_next) {
		s->free[i - 1].len += len + s->free[i].len;
		memmove(&s->free[i], &s->free[i + 1], (s->nfree - i - 1) * sizeof(s->free[0]));
		s->nfree--;
	} else if (join_prev) {
		s->free[i - 1].len += len;
	} else if (join_next) {
		s->free[i].off = off;
		s->free[i].len += len;
	} else {
		/*
		 * Out of memory for the range array leaks the range (counted as
		 * used) rather than failing a release the caller cannot retry.
		 */
		if (s->nfree == s->cap && space_grow(s) < 0) {
			s->used += len;
			return;
		}
		memmove(&s->free[i + 1], &s->free[i], (s->nfree - i) * sizeof(s->free[0]));
		s->free[i] = (struct zs_range){ .off = off, .len = len };
		s->nfree++;
	}
}

/* Bytes of an extent of size bytes over n slots, starting on slot first, that land on slot p. */
static uint64_t
extent_share(const struct zs_swap *e, uint64_t size, unsigned n, unsigned first, unsigned p)
{
	uint64_t nunits = (size + e->unit - 1) / e->unit;
	uint64_t i = (p + n - first) % n;
	uint64_t units, last = nunits - 1, bytes;

	if (i >= nunits)
		return 0;
	units = (nunits - 1 - i) / n + 1;
	bytes = units * e->unit;
	/* The extent's last unit may be short. */
	if (last % n == i)
		bytes -= nunits * e->unit - size;
	return bytes;
}

int
zs_extent_alloc(struct zs_swap *e, uint64_t size, struct zs_extent *ret)
{
	struct zs_extent x;
	uint64_t best = 0;
	unsigned p, s, n = 0, first = 0;
	int r;

	if (size == 0)
		return -EINVAL;
	if (size > UINT64_MAX - e->granule)
		return -ENOSPC;
	size = (size + e->granule - 1) / e->granule * e->granule;

	memset(&x, 0, sizeof(x));
	/* Only good paths take new extents. */
	for (p = 0; p < e->npaths; p++)
		if (e->files[p].bad == 0)
			x.paths[n++] = (uint8_t)p;
	if (n == 0)
		return -EIO;
	/* Start where most room is left, so that small extents spread over paths. */
	for (s = 0; s < n; s++) {
		unsigned q = (unsigned)((e->rr + s) % n);
		const struct zs_space *sp = &e->files[x.paths[q]].space;
		uint64_t room = sp->capacity - sp->used;

		if (s == 0 || room > best) {
			best = room;
			first = q;
		}
	}
	x.size = size;
	x.nslots = n;
	x.first_slot = first;
	x.first_path = x.paths[first];
	x.npaths = e->npaths;
	for (p = 0; p < e->npaths; p++)
		x.offset[p] = UINT64_MAX;
	for (s = 0; s < n; s++) {
		uint64_t share = extent_share(e, size, n, first, s);

		if (share == 0)
			continue;
		r = zs_space_alloc(&e->files[x.paths[s]].space, share, &x.offset[x.paths[s]]);
		if (r < 0)
			goto fail;
	}
	e->rr++;
	*ret = x;
	return 0;

fail:
	while (s-- > 0) {
		uint64_t share = extent_share(e, size, n, first, s);

		if (share != 0)
			zs_space_release(&e->files[x.paths[s]].space, x.offset[x.paths[s]], share);
	}
	return r;
}

void
zs_extent_free(struct zs_swap *e, const struct zs_extent *x)
{
	unsigned s;

	if (x == NULL || x->size == 0 || x->npaths != e->npaths || x->nslots == 0 ||
	    x->nslots > e->npaths)
		return;
	for (s = 0; s < x->nslots; s++) {
		uint64_t share = extent_share(e, x->size, x->nslots, x->first_slot, s);

		if (share != 0)
			zs_space_release(&e->files[x->paths[s]].space, x->offset[x->paths[s]],
			    share);
	}
}

/* Takes [off, off + len) out of the free ranges: it must lie within one of them. */
static int
space_take(struct zs_space *s, uint64_t off, uint64_t len)
{
	for (unsigned i = 0; i < s->nfree; i++) {
		struct zs_range *r = &s->free[i];
		uint64_t end = r->off + r->len;

		if (off < r->off || off + len > end)
			continue;
		if (off == r->off) {
			r->off += len;
			r->len -= len;
			if (r->len == 0) {
				memmove(r, r + 1, (s->nfree - i - 1) * sizeof(*r));
				s->nfree--;
			}
		} else if (off + len == end) {
			r->len -= len;
		} else {
			if (s->nfree == s->cap && space_grow(s) < 0)
				return -ENOMEM;
			r = &s->free[i];
			memmove(r + 2, r + 1, (s->nfree - i - 1) * sizeof(*r));
			s->free[i + 1] = (struct zs_range){ .off = off + len, .len = end - off - len };
			r->len = off - r->off;
			s->nfree++;
		}
		s->used += len;
		return 0;
	}
	return -EEXIST;
}

int
zs_extent_reserve(struct zs_swap *e, const struct zs_extent *x)
{
	unsigned s;
	int r = 0;

	if (x->size == 0 || x->size % e->granule != 0 || x->npaths != e->npaths ||
	    x->nslots == 0 || x->nslots > e->npaths || x->first_slot >= x->nslots)
		return -EINVAL;
	for (s = 0; s < x->nslots; s++)
		if (x->paths[s] >= e->npaths)
			return -EINVAL;
	for (s = 0; s < x->nslots; s++) {
		uint64_t share = extent_share(e, x->size, x->nslots, x->first_slot, s);

		if (share == 0)
			continue;
		r = space_take(&e->files[x->paths[s]].space, x->offset[x->paths[s]], share);
		if (r < 0)
			break;
	}
	if (r == 0)
		return 0;
	while (s-- > 0) {
		uint64_t share = extent_share(e, x->size, x->nslots, x->first_slot, s);

		if (share != 0)
			zs_space_release(&e->files[x->paths[s]].space, x->offset[x->paths[s]], share);
	}
	return r;
}
