/* zk_step_undo and zk_qstep_undo: the same bits as the plain step, and a record that always names a unit they can put back. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "quant.h"

#define N 1000
#define PAD 32

struct arrays {
	float master[N + PAD], m[N + PAD], v[N + PAD], grad[N + PAD];
	uint16_t param[N + PAD];
};

static void fill(struct arrays *a, struct rng *r)
{
	for (size_t i = 0; i < N + PAD; i++) {
		a->master[i] = rng_float(r, -1, 1);
		a->m[i] = rng_float(r, -0.1f, 0.1f);
		a->v[i] = rng_float(r, 0, 0.01f);
		a->grad[i] = rng_float(r, -2, 2);
		a->param[i] = 0;
	}
}

static struct zk_tensor view(struct arrays *a, size_t shift, enum zk_optim o)
{
	return (struct zk_tensor){ .master = a->master + shift, .m = a->m + shift,
		.v = o <= ZK_OPTIM_ADAM ? a->v + shift : NULL, .grad = a->grad + shift,
		.grad_dtype = ZK_DTYPE_F32, .param = a->param + shift, .param_dtype = ZK_DTYPE_BF16,
		.n = N };
}

static void same(const struct arrays *a, const struct arrays *b, const char *what, size_t k)
{
	cr_assert_eq(first_mismatch(a->master, b->master, ZK_DTYPE_F32, N + PAD), -1,
	    "%s (%zu): master", what, k);
	cr_assert_eq(first_mismatch(a->m, b->m, ZK_DTYPE_F32, N + PAD), -1, "%s (%zu): m", what, k);
	cr_assert_eq(first_mismatch(a->v, b->v, ZK_DTYPE_F32, N + PAD), -1, "%s (%zu): v", what, k);
	cr_assert_eq(first_mismatch(a->param, b->param, ZK_DTYPE_BF16, N + PAD), -1,
	    "%s (%zu): param", what, k);
}

/*
 * Stepped up to k, its last unit made garbage (a death half way through its
 * stores), put back from the ring and stepped on from the record: the bits
 * of one uninterrupted step, for every k (so every unit boundary the heads,
 * vectors and tails make).
 */
static void undo_for(enum zk_isa isa)
{
	static struct arrays init, want, got;
	static uint8_t ring[2 * ZK_UNDO_SLOT];
	struct rng r = { 7 };

	if (!test_isa_enabled(isa))
		cr_skip_test("%s not under test here", zk_isa_name(isa));
	for (int o = 0; o < ZK_OPTIM_COUNT; o++) {
		struct zk_hparams h = { .optim = (enum zk_optim)o, .lr = 1e-3, .beta1 = 0.9,
			.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .step = 3,
			.bias_correction = true, .grad_scale = 1.0, .clip_coef = 0.7 };
		size_t shift = (size_t)o * 3 + 1;	/* misaligned param: heads and tails run */
		struct zk_tensor tw, tg;

		fill(&init, &r);
		want = init;
		tw = view(&want, shift, h.optim);
		cr_assert_eq(zk_step(isa, &h, &tw, 0, N), 0);
		got = init;
		tg = view(&got, shift, h.optim);
		{
			uint64_t rec = 0;
			struct zk_undo u = { .ring = ring, .record = &rec };

			cr_assert_eq(zk_step_undo(isa, &h, &tg, 0, N, &u), 0);
			same(&got, &want, "zk_step_undo against zk_step", 0);
		}
		for (size_t k = 1; k <= N; k += 1 + k / 8) {
			uint64_t rec = 0, at, cnt;
			struct zk_undo u = { .ring = ring, .record = &rec };

			got = init;
			cr_assert_eq(zk_step_undo(isa, &h, &tg, 0, k, &u), 0);
			at = zk_undo_at(rec);
			cnt = zk_undo_count(rec);
			cr_assert(rec != 0 && cnt > 0 && at + cnt == k, "k %zu: record at %llu count %llu",
			    k, (unsigned long long)at, (unsigned long long)cnt);
			cr_assert_eq(zk_undo_slot(rec), u.slot ^ 1);
			for (uint64_t i = at; i < at + cnt; i++)
				tg.master[i] = tg.m[i] = 12345.0f;
			if (tg.v != NULL)
				for (uint64_t i = at; i < at + cnt; i++)
					tg.v[i] = -1.0f;
			cr_assert_eq(zk_undo_restore(h.optim, &tg, &u, rec), 0);
			u.slot = zk_undo_slot(rec) ^ 1;
			cr_assert_eq(zk_step_undo(isa, &h, &tg, at, N, &u), 0);
			same(&got, &want, "stepped, put back and stepped on", k);
		}
	}
}

/* The compressed formats' state, as kept: fp32 or bf16 master, bf16 or 8-bit moments, q8 scales. */
struct qarrays {
	float master[N];
	uint16_t master16[N], m16[N], v16[N];
	uint8_t m8[N], v8[N];
	float ms[(N + ZK_Q8_BLOCK - 1) / ZK_Q8_BLOCK], vs[(N + ZK_Q8_BLOCK - 1) / ZK_Q8_BLOCK];
	float grad[N];
	uint16_t param[N];
};

static void qfill(struct qarrays *a, struct rng *r)
{
	for (size_t i = 0; i < N; i++) {
		a->master[i] = rng_float(r, -1, 1);
		a->master16[i] = zk_f32_to_bf16(rng_float(r, -1, 1));
		a->m16[i] = zk_f32_to_bf16(rng_float(r, -0.1f, 0.1f));
		a->v16[i] = zk_f32_to_bf16(rng_float(r, 0, 0.01f));
		a->m8[i] = (uint8_t)rng_next(r);
		a->v8[i] = (uint8_t)rng_next(r);
		a->grad[i] = rng_float(r, -2, 2);
		a->param[i] = 0;
	}
	for (size_t k = 0; k < sizeof(a->ms) / sizeof(a->ms[0]); k++) {
		a->ms[k] = rng_float(r, 1e-4f, 0.1f);
		a->vs[k] = rng_float(r, 1e-4f, 0.1f);
	}
}

static struct zk_qtensor qview(struct qarrays *a, enum zk_state_format f)
{
	bool q8 = f != ZK_STATE_BF16;
	struct zk_qtensor t = { .format = f, .master = a->master,
		.m = q8 ? (void *)a->m8 : (void *)a->m16, .v = q8 ? (void *)a->v8 : (void *)a->v16,
		.m_scale = q8 ? a->ms : NULL, .v_scale = q8 ? a->vs : NULL, .grad = a->grad,
		.grad_dtype = ZK_DTYPE_F32, .param = a->param, .param_dtype = ZK_DTYPE_BF16, .n = N };

	if (f == ZK_STATE_BF16_Q8)
		t.master_bf16 = a->master16;
	return t;
}

/* As undo_for, for zk_qstep_undo: units are vectors (bf16-moments) or whole q8 blocks. */
static void qundo_for(enum zk_isa isa)
{
	static struct qarrays init, want, got;
	static uint8_t ring[2 * ZK_UNDO_SLOT];
	struct rng r = { 11 };

	if (!test_isa_enabled(isa))
		cr_skip_test("%s not under test here", zk_isa_name(isa));
	for (int f = ZK_STATE_BF16; f < ZK_STATE_COUNT; f++)
	for (int o = ZK_OPTIM_ADAMW; o <= ZK_OPTIM_ADAM; o++) {
		struct zk_hparams h = { .optim = (enum zk_optim)o, .lr = 1e-3, .beta1 = 0.9,
			.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .step = 3,
			.bias_correction = true, .grad_scale = 1.0, .clip_coef = 0.7 };
		size_t every = f == ZK_STATE_BF16 ? 1 : ZK_Q8_BLOCK;
		struct zk_qtensor tw, tg;

		qfill(&init, &r);
		want = init;
		tw = qview(&want, (enum zk_state_format)f);
		cr_assert_eq(zk_qstep(isa, &h, &tw, 0, N), 0);
		got = init;
		tg = qview(&got, (enum zk_state_format)f);
		for (size_t k = every; k <= N + every - 1; k += every * (1 + k / 97 / every)) {
			size_t end = k < N ? k : N;
			uint64_t rec = 0, at, cnt;
			struct zk_undo u = { .ring = ring, .record = &rec };
			size_t mb = zk_state_master_bytes(tg.format, 1);
			size_t ms = zk_state_moment_bytes(tg.format, 1);

			got = init;
			cr_assert_eq(zk_qstep_undo(isa, &h, &tg, 0, end, &u), 0);
			at = zk_undo_at(rec);
			cnt = zk_undo_count(rec);
			cr_assert(rec != 0 && cnt > 0 && at + cnt == end, "%s k %zu: record at %llu "
			    "count %llu", zk_state_format_name(tg.format), end, (unsigned long long)at,
			    (unsigned long long)cnt);
			memset((char *)tg.master + at * mb, 0x5a, cnt * mb);
			memset((char *)tg.m + at * ms, 0x5a, cnt * ms);
			memset((char *)tg.v + at * ms, 0xa5, cnt * ms);
			if (tg.m_scale != NULL)
				tg.m_scale[at / ZK_Q8_BLOCK] = tg.v_scale[at / ZK_Q8_BLOCK] = -1.0f;
			cr_assert_eq(zk_qundo_restore(&tg, &u, rec), 0);
			u.slot = zk_undo_slot(rec) ^ 1;
			cr_assert_eq(zk_qstep_undo(isa, &h, &tg, at, N, &u), 0);
			cr_assert(memcmp(&got, &want, sizeof(got)) == 0, "%s %s k %zu: not the bits of "
			    "one step", zk_state_format_name(tg.format), zk_optim_name(h.optim), end);
		}
	}
}

Test(undo, scalar) { undo_for(ZK_ISA_SCALAR); }
Test(qundo, scalar) { qundo_for(ZK_ISA_SCALAR); }
Test(qundo, avx2) { qundo_for(ZK_ISA_AVX2); }
Test(qundo, avx512) { qundo_for(ZK_ISA_AVX512); }
Test(undo, avx2) { undo_for(ZK_ISA_AVX2); }
Test(undo, avx512) { undo_for(ZK_ISA_AVX512); }

Test(undo, restore_refuses_a_record_that_does_not_fit)
{
	static struct arrays a;
	static uint8_t ring[2 * ZK_UNDO_SLOT];
	struct zk_tensor t = view(&a, 0, ZK_OPTIM_ADAMW);
	struct zk_undo u = { .ring = ring };

	cr_assert_eq(zk_undo_restore(ZK_OPTIM_ADAMW, &t, &u, 0), -EINVAL);
	cr_assert_eq(zk_undo_restore(ZK_OPTIM_ADAMW, &t, &u, zk_undo_pack(N - 4, 8, 0)), -EINVAL);
	cr_assert_eq(zk_undo_restore(ZK_OPTIM_ADAMW, &t, &u, zk_undo_pack(0, 300, 1)), -EINVAL);
	cr_assert_eq(zk_undo_restore(ZK_OPTIM_ADAMW, &t, &u, zk_undo_pack(N - 8, 8, 1)), 0);
}
