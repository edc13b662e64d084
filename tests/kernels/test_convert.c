/* Tests of the small pieces: conversions, name parsing, ISA selection, hyperparameter checks. */
#include <criterion/criterion.h>
#include <errno.h>
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "helpers.h"

static void general_only(void)
{
	if (!test_general_enabled())
		cr_skip_test("ISA-independent; runs in the scalar entry");
}

/* Independent decoder: the half's value from its fields with ldexp. */
static double f16_value(uint16_t h)
{
	int e = (h >> 10) & 0x1f, m = h & 0x3ff;
	double v = e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);

	return (h & 0x8000) ? -v : v;
}

Test(convert, f16_every_value)
{
	general_only();
	for (uint32_t h = 0; h < 0x10000; h++) {
		float f = zk_f16_to_f32((uint16_t)h);

		if (f16_nan((uint16_t)h)) {
			cr_assert(isnan(f), "half %#x must decode to NaN", h);
			cr_assert_eq(zk_f32_to_f16(f) & 0x7c00, 0x7c00);
			cr_assert(f16_nan(zk_f32_to_f16(f)));
			continue;
		}
		if (((h >> 10) & 0x1f) == 0x1f) {
			cr_assert(isinf(f) && !!signbit(f) == !!(h & 0x8000));
		} else {
			cr_assert_eq((double)f, f16_value((uint16_t)h), "half %#x", h);
		}
		cr_assert_eq(zk_f32_to_f16(f), h, "round trip of half %#x", h);
	}
}

/* Midpoints between neighbouring halves round to the even one; a float ulp either side to the nearer. */
Test(convert, f16_rounding)
{
	general_only();
	for (uint32_t h = 0; h < 0x7bff; h++) {
		float a = zk_f16_to_f32((uint16_t)h), b = zk_f16_to_f32((uint16_t)(h + 1));
		float mid = (float)(((double)a + (double)b) / 2);	/* exact: 12 significant bits */
		uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;

		cr_assert_eq(zk_f32_to_f16(mid), even, "tie between %#x and %#x", h, h + 1);
		cr_assert_eq(zk_f32_to_f16(-mid), even | 0x8000);
		cr_assert_eq(zk_f32_to_f16(nextafterf(mid, 0)), h);
		cr_assert_eq(zk_f32_to_f16(nextafterf(mid, INFINITY)), h + 1);
	}
	cr_assert_eq(zk_f32_to_f16(65519.99f), 0x7bff);
	cr_assert_eq(zk_f32_to_f16(65520.0f), 0x7c00, "overflow goes to inf");
	cr_assert_eq(zk_f32_to_f16(-1e30f), 0xfc00);
	cr_assert_eq(zk_f32_to_f16(0x1p-25f), 0, "tie with zero rounds to even zero");
	cr_assert_eq(zk_f32_to_f16(nextafterf(0x1p-25f, 1)), 1);
	cr_assert_eq(zk_f32_to_f16(1e-45f), 0);
	cr_assert_eq(zk_f32_to_f16(-0.0f), 0x8000);
}

Test(convert, bf16_every_value)
{
	general_only();
	for (uint32_t h = 0; h < 0x10000; h++) {
		float f = zk_bf16_to_f32((uint16_t)h);

		cr_assert_eq(f32_bits(f), h << 16);
		if (bf16_nan((uint16_t)h))
			cr_assert(bf16_nan(zk_f32_to_bf16(f)));
		else
			cr_assert_eq(zk_f32_to_bf16(f), h, "round trip of bf16 %#x", h);
	}
}

Test(convert, bf16_rounding)
{
	general_only();
	for (uint32_t h = 0; h < 0x7f7f; h++) {
		uint32_t lo = h << 16;
		float mid = bits_f32(lo | 0x8000);	/* exactly halfway to h + 1 */
		uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;

		cr_assert_eq(zk_f32_to_bf16(mid), even, "tie above bf16 %#x", h);
		cr_assert_eq(zk_f32_to_bf16(bits_f32(lo | 0x7fff)), h);
		cr_assert_eq(zk_f32_to_bf16(bits_f32(lo | 0x8001)), h + 1);
	}
	cr_assert_eq(zk_f32_to_bf16(3.4028235e38f), 0x7f80, "FLT_MAX rounds to inf");
	/* Payload only in the bits that are cut off: must stay NaN, not become inf. */
	cr_assert(bf16_nan(zk_f32_to_bf16(bits_f32(0x7f800001))));
	cr_assert(bf16_nan(zk_f32_to_bf16(bits_f32(0xff800001))));
	cr_assert_eq(zk_f32_to_bf16(bits_f32(0x00000001)), 0, "subnormals round, not flush, and this one is tiny");
	cr_assert_eq(zk_f32_to_bf16(bits_f32(0x00018000)), 0x0002, "subnormal tie to even");
}

/* The SIMD variants use F16C; the scalar functions must agree with it on every input the tests feed. */
__attribute__((target("f16c"))) static uint16_t hw_f32_to_f16(float f)
{
	return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

__attribute__((target("f16c"))) static float hw_f16_to_f32(uint16_t h)
{
	return _cvtsh_ss(h);
}

Test(convert, f16_matches_f16c)
{
	struct rng r = { 7 };

	if (!test_isa_enabled(ZK_ISA_AVX2) && !test_isa_enabled(ZK_ISA_AVX512))
		cr_skip_test("no F16C variant under test");
	for (uint32_t h = 0; h < 0x10000; h++)
		cr_assert_eq(f32_bits(zk_f16_to_f32((uint16_t)h)), f32_bits(hw_f16_to_f32((uint16_t)h)),
		    "half %#x", h);
	for (int i = 0; i < 2000000; i++) {
		/* Random bits hit NaNs, infs and subnormals; the narrow band exercises the half range. */
		uint32_t u = (i & 1) ? (uint32_t)rng_next(&r)
				     : (uint32_t)((rng_next(&r) % 0x0f800000u) + 0x33000000u);
		u |= (uint32_t)(i & 2) << 30;
		cr_assert_eq(zk_f32_to_f16(bits_f32(u)), hw_f32_to_f16(bits_f32(u)), "float %#x", u);
	}
}

Test(names, parse_and_format)
{
	enum zk_dtype d;
	enum zk_optim o;
	enum zk_isa isa;

	general_only();
	for (int i = 0; i < ZK_DTYPE_COUNT; i++) {
		cr_assert_eq(zk_dtype_parse(zk_dtype_name((enum zk_dtype)i), &d), 0);
		cr_assert_eq((int)d, i);
	}
	cr_assert_eq(zk_dtype_parse("bfloat16", &d), 0);
	cr_assert_eq(d, ZK_DTYPE_BF16);
	cr_assert_eq(zk_dtype_parse("float16", &d), 0);
	cr_assert_eq(d, ZK_DTYPE_F16);
	cr_assert_eq(zk_dtype_parse("f64", &d), -EINVAL);
	cr_assert_eq(zk_dtype_parse(NULL, &d), -EINVAL);
	cr_assert_eq(zk_dtype_size(ZK_DTYPE_F32), 4);
	cr_assert_eq(zk_dtype_size(ZK_DTYPE_BF16), 2);
	cr_assert_eq(zk_dtype_size(ZK_DTYPE_F16), 2);
	cr_assert_eq(zk_dtype_size(ZK_DTYPE_COUNT), 0);
	cr_assert_str_eq(zk_dtype_name(ZK_DTYPE_COUNT), "unknown");
	for (int i = 0; i < ZK_OPTIM_COUNT; i++) {
		cr_assert_eq(zk_optim_parse(zk_optim_name((enum zk_optim)i), &o), 0);
		cr_assert_eq((int)o, i);
	}
	cr_assert_eq(zk_optim_parse("AdamW", &o), 0);
	cr_assert_eq(o, ZK_OPTIM_ADAMW);
	cr_assert_eq(zk_optim_parse("sgd", &o), -EINVAL);
	for (int i = 0; i < ZK_ISA_COUNT; i++) {
		cr_assert_eq(zk_isa_parse(zk_isa_name((enum zk_isa)i), &isa), 0);
		cr_assert_eq((int)isa, i);
	}
	cr_assert_eq(zk_isa_parse("auto", &isa), 0);
	cr_assert_eq(isa, zk_isa_best());
	cr_assert_eq(zk_isa_parse("neon", &isa), -EINVAL);
	cr_assert(zk_isa_supported(ZK_ISA_SCALAR));
	cr_assert(zk_isa_supported(zk_isa_best()));
	cr_assert(!zk_isa_supported(ZK_ISA_COUNT));
}

Test(names, isa_select)
{
	enum zk_isa isa = ZK_ISA_COUNT;

	general_only();
	unsetenv("ZOFFLOAD_ISA");
	cr_assert_eq(zk_isa_select(NULL, &isa), 0);
	cr_assert_eq(isa, zk_isa_best());
	cr_assert_eq(zk_isa_select("scalar", &isa), 0);
	cr_assert_eq(isa, ZK_ISA_SCALAR);
	cr_assert_eq(zk_isa_select("bogus", &isa), -EINVAL);
	setenv("ZOFFLOAD_ISA", "scalar", 1);
	cr_assert_eq(zk_isa_select("auto", &isa), 0);
	cr_assert_eq(isa, ZK_ISA_SCALAR, "the environment wins over the configuration");
	setenv("ZOFFLOAD_ISA", "bogus", 1);
	cr_assert_eq(zk_isa_select("scalar", &isa), -EINVAL);
	setenv("ZOFFLOAD_ISA", "", 1);
	cr_assert_eq(zk_isa_select("scalar", &isa), 0, "empty means unset");
	unsetenv("ZOFFLOAD_ISA");
	if (!zk_isa_supported(ZK_ISA_AVX512))
		cr_assert_eq(zk_isa_select("avx512", &isa), -ENOTSUP);
}

static struct zk_hparams good(enum zk_optim optim)
{
	return (struct zk_hparams){
		.optim = optim, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
		.weight_decay = 0.01, .step = 1, .bias_correction = true,
		.grad_scale = 1.0, .clip_coef = 1.0,
	};
}

Test(hparams, validate)
{
	struct zk_hparams h;

	general_only();
	for (int o = 0; o < ZK_OPTIM_COUNT; o++) {
		h = good((enum zk_optim)o);
		cr_assert_eq(zk_hparams_validate(&h), 0, "%s", zk_optim_name((enum zk_optim)o));
#define BAD(field, val) do { h = good((enum zk_optim)o); h.field = (val); \
	cr_assert_eq(zk_hparams_validate(&h), -EINVAL, "%s " #field "=" #val, \
	    zk_optim_name((enum zk_optim)o)); } while (0)
		BAD(lr, -1e-3);
		BAD(lr, NAN);
		BAD(lr, INFINITY);
		BAD(eps, -1e-8);
		BAD(weight_decay, -0.1);
		BAD(grad_scale, 0);
		BAD(grad_scale, -1);
		BAD(grad_scale, INFINITY);
		BAD(clip_coef, NAN);
		BAD(step, 0);
		BAD(optim, ZK_OPTIM_COUNT);
		BAD(lr_decay, -1);
		if (o != ZK_OPTIM_ADAGRAD) {
			BAD(beta1, 1.0);
			BAD(beta1, -0.1);
			BAD(beta2, 1.0);
			BAD(beta2, NAN);
		}
#undef BAD
	}
	/* beta1 = 0 is legal and bc1 = 1 then. */
	h = good(ZK_OPTIM_ADAM);
	h.beta1 = 0;
	cr_assert_eq(zk_hparams_validate(&h), 0);
	cr_assert_eq(zk_hparams_validate(NULL), -EINVAL);
}

Test(hparams, step_rejects_bad_arguments)
{
	float master[4] = { 0 }, m[4] = { 0 }, v[4] = { 0 }, g[4] = { 0 };
	struct zk_tensor t = { master, m, v, g, ZK_DTYPE_F32, NULL, ZK_DTYPE_F32, 4 };
	struct zk_hparams h = good(ZK_OPTIM_ADAMW);
	struct zk_grad_stats st = { 0 };

	general_only();
	cr_assert_eq(zk_step(ZK_ISA_SCALAR, &h, &t, 0, 4), 0);
	cr_assert_eq(zk_step(ZK_ISA_SCALAR, &h, &t, 0, 5), -EINVAL);
	cr_assert_eq(zk_step(ZK_ISA_SCALAR, &h, &t, 3, 2), -EINVAL);
	cr_assert_eq(zk_step(ZK_ISA_COUNT, &h, &t, 0, 4), -EINVAL);
	t.v = NULL;
	cr_assert_eq(zk_step(ZK_ISA_SCALAR, &h, &t, 0, 4), -EINVAL, "AdamW needs v");
	h.optim = ZK_OPTIM_LION;
	cr_assert_eq(zk_step(ZK_ISA_SCALAR, &h, &t, 0, 4), 0, "Lion does not");
	t.grad_dtype = ZK_DTYPE_COUNT;
	cr_assert_eq(zk_step(ZK_ISA_SCALAR, &h, &t, 0, 4), -EINVAL);
	cr_assert_eq(zk_grad_check(ZK_ISA_SCALAR, g, ZK_DTYPE_F32, 0, 0, 4, &st), -EINVAL);
	cr_assert_eq(zk_grad_check(ZK_ISA_SCALAR, g, ZK_DTYPE_F32, 1, 0, 4, &st), 0);
	if (!zk_isa_supported(ZK_ISA_AVX512)) {
		t.grad_dtype = ZK_DTYPE_F32;
		cr_assert_eq(zk_step(ZK_ISA_AVX512, &h, &t, 0, 4), -ENOTSUP);
	}
}
