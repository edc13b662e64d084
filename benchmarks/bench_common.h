/* What the benchmarks share: a clock, a timed sequential swap engine pass, a --json figure. */
#ifndef BENCH_COMMON_H
#define BENCH_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

struct zs_swap;
struct zs_extent;

/* Seconds on CLOCK_MONOTONIC.  Inline: bench_optimizer links no swap engine. */
static inline double
bench_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct bench_stream;

/* One buffer (the caller's, bs bytes) per request in flight; a completion reuses its own. */
struct bench_slot {
	struct bench_stream *s;	/* set by bench_stream_pass */
	char *buf;
};

/*
 * One sequential pass over [0, size) of the extent, bs bytes a request and
 * up to depth requests in flight, one per slot.  size must be a multiple of
 * bs (-EINVAL otherwise), so every byte moves and none past size.  0 and the
 * seconds taken in *ret_seconds, or the first error (-errno or -ZS_E_*).
 */
int bench_stream_pass(struct zs_swap *e, struct zs_extent *x, struct bench_slot *slots,
    unsigned depth, size_t bs, uint64_t size, bool write, double *ret_seconds);

/*
 * One {name, value, unit, limit, ratio} of a --json list, value and limit with
 * `decimals` places; index 0 is the first.  The caller prints "[" before the
 * first and "\n]\n" after the last.
 */
void bench_json_figure(unsigned index, const char *name, double value, const char *unit,
    double limit, int decimals);

#endif
