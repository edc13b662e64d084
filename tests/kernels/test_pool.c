/* Pool tests: 1, 2, 3 and 4 threads give bit-identical tensors and norms, for each ISA under test. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "helpers.h"
#include "pool.h"

/* Three tensors; the middle one has an odd start, so its slices never align. */
static const size_t sizes[] = { 300001, 77777, 1 << 18 };
#define NT (sizeof(sizes) / sizeof(sizes[0]))

struct state {
	float *master[NT], *m[NT], *v[NT];
	uint16_t *param[NT];
	uint16_t *grad[NT];
	struct zk_tensor t[NT];
};

/* aligned_alloc wants a size that is a multiple of the alignment (ASan enforces it). */
static void *alloc64(size_t bytes)
{
	return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

static void state_init(struct state *s, uint64_t seed)
{
	struct rng r = { seed };

	for (size_t k = 0; k < NT; k++) {
		size_t n = sizes[k], off = k == 1 ? 3 : 0;

		s->master[k] = alloc64((n + 64) * 4);
		s->m[k] = alloc64((n + 64) * 4);
		s->v[k] = alloc64((n + 64) * 4);
		s->param[k] = alloc64((n + 64) * 2);
		s->grad[k] = alloc64((n + 64) * 2);
		cr_assert(s->master[k] && s->m[k] && s->v[k] && s->param[k] && s->grad[k]);
		for (size_t i = 0; i < n + off; i++) {
			s->master[k][i] = rng_float(&r, -1, 1);
			s->m[k][i] = rng_float(&r, -0.01f, 0.01f);
			s->v[k][i] = rng_float(&r, 0, 1e-4f);
			s->grad[k][i] = zk_f32_to_bf16(rng_float(&r, -1, 1));
			s->param[k][i] = 0;
		}
		s->t[k] = (struct zk_tensor){ s->master[k] + off, s->m[k] + off, s->v[k] + off,
			s->grad[k] + off, ZK_DTYPE_BF16, s->param[k] + off, ZK_DTYPE_BF16, n };
	}
}

static void state_free(struct state *s)
{
	for (size_t k = 0; k < NT; k++) {
		free(s->master[k]);
		free(s->m[k]);
		free(s->v[k]);
		free(s->param[k]);
		free(s->grad[k]);
	}
}

static void same_state(const struct state *a, const struct state *b, unsigned threads)
{
	for (size_t k = 0; k < NT; k++) {
		size_t n = sizes[k] + (k == 1 ? 3 : 0);

		cr_assert(!memcmp(a->master[k], b->master[k], n * 4), "%u threads: master %zu", threads, k);
		cr_assert(!memcmp(a->m[k], b->m[k], n * 4), "%u threads: m %zu", threads, k);
		cr_assert(!memcmp(a->v[k], b->v[k], n * 4), "%u threads: v %zu", threads, k);
		cr_assert(!memcmp(a->param[k], b->param[k], n * 2), "%u threads: param %zu", threads, k);
	}
}

static void thread_invariance(enum zk_isa isa)
{
	struct zk_hparams h = {
		.optim = ZK_OPTIM_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
		.weight_decay = 0.01, .step = 3, .bias_correction = true, .grad_scale = 8,
		.clip_coef = 0.5,
	};
	struct state ref, s;
	struct zk_grad_stats ref_st = { 0 };

	if (!test_isa_enabled(isa))
		cr_skip_test("%s not under test here", zk_isa_name(isa));
	state_init(&ref, 1);
	/* The single-call scalar result is what every pool run must reproduce. */
	for (size_t k = 0; k < NT; k++) {
		cr_assert_eq(zk_grad_check(ZK_ISA_SCALAR, ref.t[k].grad, ZK_DTYPE_BF16, 8, 0, sizes[k], &ref_st), 0);
		cr_assert_eq(zk_step(ZK_ISA_SCALAR, &h, &ref.t[k], 0, sizes[k]), 0);
	}
	for (unsigned threads = 1; threads <= 4; threads++) {
		static const int cpus[] = { 0 };
		struct zk_pool *pool;
		struct zk_grad_stats st = { 0 }, sc = { 0 };

		cr_assert_eq(zk_pool_new(threads, threads == 3 ? cpus : NULL, threads == 3 ? 1 : 0, &pool), 0);
		cr_assert_eq(zk_pool_threads(pool), threads);
		state_init(&s, 1);
		cr_assert_eq(zk_pool_grad_check(pool, isa, s.t, NT, 8, &st), 0);
		cr_assert_eq(zk_pool_step(pool, isa, &h, s.t, NT), 0);
		same_state(&ref, &s, threads);
		/*
		 * Chunked norm: bit-identical to the scalar pool's (same chunks, same
		 * lanes), hence for every thread count and ISA; close to the one-pass sum.
		 */
		cr_assert_eq(st.nonfinite, ref_st.nonfinite);
		cr_assert(fabs(st.sumsq - ref_st.sumsq) <= 1e-12 * ref_st.sumsq);
		state_free(&s);
		state_init(&s, 1);
		cr_assert_eq(zk_pool_grad_check(pool, ZK_ISA_SCALAR, s.t, NT, 8, &sc), 0);
		cr_assert(!memcmp(&sc.sumsq, &st.sumsq, sizeof(double)),
		    "%u threads: %a vs scalar %a", threads, st.sumsq, sc.sumsq);
		/* Memory-only probe leaves the state as it was. */
		cr_assert_eq(zk_pool_memonly(pool, isa, s.t, NT), 0);
		cr_assert_eq(zk_pool_step(pool, isa, &h, s.t, NT), 0);
		same_state(&ref, &s, threads);
		state_free(&s);
		zk_pool_free(pool);
	}
	state_free(&ref);
}

Test(pool, scalar_thread_invariance) { thread_invariance(ZK_ISA_SCALAR); }
Test(pool, avx2_thread_invariance) { thread_invariance(ZK_ISA_AVX2); }
Test(pool, avx512_thread_invariance) { thread_invariance(ZK_ISA_AVX512); }

Test(pool, bad_arguments)
{
	struct zk_pool *pool = NULL;
	struct zk_hparams h = { .optim = ZK_OPTIM_ADAMW, .lr = -1, .step = 1, .grad_scale = 1,
				.clip_coef = 1 };
	struct zk_grad_stats st = { 0 };

	if (!test_general_enabled())
		cr_skip_test("ISA-independent");
	cr_assert_eq(zk_pool_new(0, NULL, 0, &pool), -EINVAL);
	cr_assert_eq(zk_pool_new(2, (const int[]){ -1 }, 1, &pool), -EINVAL);
	cr_assert_eq(zk_pool_new(2, NULL, 0, &pool), 0);
	cr_assert_eq(zk_pool_step(pool, ZK_ISA_SCALAR, &h, NULL, 0), -EINVAL);
	cr_assert_eq(zk_pool_grad_check(pool, ZK_ISA_SCALAR, NULL, 0, 0, &st), -EINVAL);
	cr_assert_eq(zk_pool_grad_check(pool, ZK_ISA_SCALAR, NULL, 0, 1, &st), 0);
	zk_pool_free(pool);
	zk_pool_free(NULL);
}
