/* Shared helpers for the kernels tests: the ISA under test, random data, NaN-aware comparison. */
#ifndef ZK_TEST_HELPERS_H
#define ZK_TEST_HELPERS_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "optim.h"

/*
 * ZK_TEST_ISA names the variant one meson test() entry checks; unset, every
 * variant the CPU has is checked.  main() exits 77 (skipped) when the named
 * one is missing.
 */
bool test_isa_enabled(enum zk_isa isa);
/* The general (ISA-independent) tests run once: in the scalar entry or when unset. */
bool test_general_enabled(void);

struct rng {
	uint64_t s;
};

static inline uint64_t rng_next(struct rng *r)
{
	/* splitmix64: tiny, good enough, and the same on every machine */
	uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform in [lo, hi). */
static inline float rng_float(struct rng *r, float lo, float hi)
{
	return lo + (hi - lo) * (float)((rng_next(r) >> 40) * 0x1p-24);
}

static inline uint32_t f32_bits(float f)
{
	uint32_t u;

	memcpy(&u, &f, sizeof(u));
	return u;
}

static inline float bits_f32(uint32_t u)
{
	float f;

	memcpy(&f, &u, sizeof(f));
	return f;
}

static inline bool f32_nan(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }
static inline bool bf16_nan(uint16_t h) { return (h & 0x7fffu) > 0x7f80u; }
static inline bool f16_nan(uint16_t h) { return (h & 0x7fffu) > 0x7c00u; }

/*
 * Index of the first element that differs, or -1.  Equal means the same
 * bits, or NaN on both sides: IEEE 754 leaves NaN payload propagation open
 * and the compiler may swap the operands of a commutative op, so payloads
 * are not part of the contract; NaN-ness is.
 */
long first_mismatch(const void *a, const void *b, enum zk_dtype dtype, size_t n);

#endif
