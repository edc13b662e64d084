/* Small helpers shared by the daemon and the engine: the clock, sizes in messages. */
#ifndef ZU_UTIL_H
#define ZU_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <time.h>

/* Monotonic nanoseconds, for intervals only. */
static inline uint64_t
zu_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* "1.5 GiB": sizes in messages. */
static inline const char *
zu_fmt_bytes(unsigned long long bytes, char *buf, unsigned long len)
{
	static const char *const units[] = { "B", "KiB", "MiB", "GiB", "TiB" };
	double v = (double)bytes;
	unsigned u = 0;

	while (v >= 1024 && u < 4) {
		v /= 1024;
		u++;
	}
	snprintf(buf, len, "%.1f %s", v, units[u]);
	return buf;
}

#endif
