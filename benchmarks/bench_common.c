/* What the benchmarks share: a sequential swap engine pass, and the --json figure. */
#include <errno.h>
#include <stdio.h>

#include "bench_common.h"
#include "swap.h"

struct bench_stream {
	struct zs_swap *e;
	struct zs_extent *x;
	size_t bs;
	uint64_t size;
	uint64_t next;		/* offset of the next request */
	unsigned pending;
	int error;
	bool write;
};

static void stream_done(int result, void *arg);

static void
stream_issue(struct bench_slot *sl)
{
	struct bench_stream *s = sl->s;
	uint64_t off = s->next;
	int r;

	s->next += s->bs;
	s->pending++;
	r = s->write ? zs_write(s->e, s->x, off, sl->buf, s->bs, stream_done, sl) :
	    zs_read(s->e, s->x, off, sl->buf, s->bs, stream_done, sl);
	if (r < 0) {
		s->pending--;
		s->error = r;
	}
}

/* With size a multiple of bs, "a whole request fits" and "bytes are left" are the same test. */
static void
stream_done(int result, void *arg)
{
	struct bench_slot *sl = arg;
	struct bench_stream *s = sl->s;

	s->pending--;
	if (result < 0 && s->error == 0)
		s->error = result;
	if (s->error == 0 && s->next + s->bs <= s->size)
		stream_issue(sl);
}

int
bench_stream_pass(struct zs_swap *e, struct zs_extent *x, struct bench_slot *slots,
    unsigned depth, size_t bs, uint64_t size, bool write, double *ret_seconds)
{
	struct bench_stream s = { .e = e, .x = x, .bs = bs, .size = size, .write = write };
	double t0, t;
	int r;

	if (bs == 0 || size % bs != 0)
		return -EINVAL;
	t0 = bench_now();
	for (unsigned i = 0; i < depth && s.next + s.bs <= s.size; i++) {
		slots[i].s = &s;
		stream_issue(&slots[i]);
	}
	while (s.pending > 0) {
		r = zs_swap_wait(e, 5000);
		if (r < 0 && s.error == 0)
			s.error = r;
	}
	t = bench_now() - t0;
	if (s.error != 0)
		return s.error;
	*ret_seconds = t;
	return 0;
}

void
bench_json_figure(unsigned index, const char *name, double value, const char *unit,
    double limit, int decimals)
{
	printf("%s\n  {\"name\": \"%s\", \"value\": %.*f, \"unit\": \"%s\", \"limit\": %.*f, "
	    "\"ratio\": %.3f}", index > 0 ? "," : "", name, decimals, value, unit, decimals, limit,
	    value / limit);
}
