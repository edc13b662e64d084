/* Kernel front end: names, ISA selection, hyperparameter checks, per-step constants, dispatch. */
#include <cpuid.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "optim.h"
#include "optim_impl.h"

static const char *const dtype_names[ZK_DTYPE_COUNT] = {
	[ZK_DTYPE_F32] = "f32",
	[ZK_DTYPE_BF16] = "bf16",
	[ZK_DTYPE_F16] = "f16",
};

static const char *const optim_names[ZK_OPTIM_COUNT] = {
	[ZK_OPTIM_ADAMW] = "adamw",
	[ZK_OPTIM_ADAM] = "adam",
	[ZK_OPTIM_ADAGRAD] = "adagrad",
	[ZK_OPTIM_LION] = "lion",
};

static const char *const isa_names[ZK_ISA_COUNT] = {
	[ZK_ISA_SCALAR] = "scalar",
	[ZK_ISA_AVX2] = "avx2",
	[ZK_ISA_AVX512] = "avx512",
};

static zk_step_fn *const step_fns[ZK_ISA_COUNT] = {
	zk_step_scalar, zk_step_avx2, zk_step_avx512,
};

static zk_grad_fn *const grad_fns[ZK_ISA_COUNT] = {
	zk_grad_scalar, zk_grad_avx2, zk_grad_avx512,
};

static zk_memonly_fn *const memonly_fns[ZK_ISA_COUNT] = {
	zk_memonly_scalar, zk_memonly_avx2, zk_memonly_avx512,
};

static int parse_name(const char *const *names, unsigned count, const char *name)
{
	if (!name)
		return -EINVAL;
	for (unsigned i = 0; i < count; i++)
		if (strcasecmp(name, names[i]) == 0)
			return (int)i;
	return -EINVAL;
}

size_t zk_dtype_size(enum zk_dtype dtype)
{
	switch (dtype) {
	case ZK_DTYPE_F32:
		return 4;
	case ZK_DTYPE_BF16:
	case ZK_DTYPE_F16:
		return 2;
	case ZK_DTYPE_COUNT:
		break;
	}
	return 0;
}

const char *zk_dtype_name(enum zk_dtype dtype)
{
	return (unsigned)dtype < ZK_DTYPE_COUNT ? dtype_names[dtype] : "unknown";
}

int zk_dtype_parse(const char *name, enum zk_dtype *ret)
{
	int r = parse_name(dtype_names, ZK_DTYPE_COUNT, name);

	/* PyTorch spellings, since clients pass str(tensor.dtype) around. */
	if (r < 0 && name) {
		if (!strcasecmp(name, "float32") || !strcasecmp(name, "float"))
			r = ZK_DTYPE_F32;
		else if (!strcasecmp(name, "bfloat16"))
			r = ZK_DTYPE_BF16;
		else if (!strcasecmp(name, "float16") || !strcasecmp(name, "half"))
			r = ZK_DTYPE_F16;
	}
	if (r < 0)
		return r;
	*ret = (enum zk_dtype)r;
	return 0;
}

const char *zk_optim_name(enum zk_optim optim)
{
	return (unsigned)optim < ZK_OPTIM_COUNT ? optim_names[optim] : "unknown";
}

int zk_optim_parse(const char *name, enum zk_optim *ret)
{
	int r = parse_name(optim_names, ZK_OPTIM_COUNT, name);

	if (r < 0)
		return r;
	*ret = (enum zk_optim)r;
	return 0;
}

/* By cpuid: clang before 15 does not know "f16c" in __builtin_cpu_supports. */
/*
 * cpuid traps to the hypervisor in a VM (17-43% of a short zk_step measured), and the answer
 * never changes: asked once.  Threads racing here compute the same value.
 */
static bool cpu_has_f16c(void)
{
	static int known = -1;
	int v = __atomic_load_n(&known, __ATOMIC_RELAXED);
	unsigned a, b, c, d;

	if (v < 0) {
		v = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
		__atomic_store_n(&known, v, __ATOMIC_RELAXED);
	}
	return v;
}

bool zk_isa_supported(enum zk_isa isa)
{
	__builtin_cpu_init();
	switch (isa) {
	case ZK_ISA_SCALAR:
		return true;
	case ZK_ISA_AVX2:
		return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
		    cpu_has_f16c();
	case ZK_ISA_AVX512:
		return zk_isa_supported(ZK_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
		    __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
		    __builtin_cpu_supports("avx512dq");
	case ZK_ISA_COUNT:
		break;
	}
	return false;
}

enum zk_isa zk_isa_best(void)
{
	for (int i = ZK_ISA_COUNT - 1; i > 0; i--)
		if (zk_isa_supported((enum zk_isa)i))
			return (enum zk_isa)i;
	return ZK_ISA_SCALAR;
}

const char *zk_isa_name(enum zk_isa isa)
{
	return (unsigned)isa < ZK_ISA_COUNT ? isa_names[isa] : "unknown";
}

int zk_isa_parse(const char *name, enum zk_isa *ret)
{
	int r;

	if (name && !strcasecmp(name, "auto")) {
		*ret = zk_isa_best();
		return 0;
	}
	r = parse_name(isa_names, ZK_ISA_COUNT, name);
	if (r < 0)
		return r;
	*ret = (enum zk_isa)r;
	return 0;
}

int zk_isa_select(const char *configured, enum zk_isa *ret)
{
	const char *env = getenv("ZOFFLOAD_ISA");
	const char *name = env && *env ? env : configured;
	enum zk_isa isa;
	int r;

	if (!name || !*name)
		name = "auto";
	r = zk_isa_parse(name, &isa);
	if (r < 0)
		return r;
	if (!zk_isa_supported(isa))
		return -ENOTSUP;
	*ret = isa;
	return 0;
}

static bool finite_ge0(double x)
{
	return isfinite(x) && x >= 0;
}

static bool beta_ok(double b)
{
	return isfinite(b) && b >= 0 && b < 1;
}

/* Fills *c; -EINVAL when a derived float constant is not finite (e.g. lr/bc1 overflows float). */
int zk_consts_init(const struct zk_hparams *hp, struct zk_consts *c)
{
	double bc1 = 1, bc2 = 1, lr_eff;
	float w;

	memset(c, 0, sizeof(*c));
	c->inv_scale = (float)(1.0 / hp->grad_scale);
	c->clip = (float)hp->clip_coef;
	c->decay = (float)(1.0 - hp->lr * hp->weight_decay);
	c->wd = (float)hp->weight_decay;
	c->l2 = hp->weight_decay != 0;
	w = (float)(1.0 - hp->beta1);
	c->lerp_w = w;
	c->lerp_small = fabsf(w) < 0.5f;
	c->lerp_omw = 1.0f - w;
	c->beta1 = (float)hp->beta1;
	c->omb1 = (float)(1.0 - hp->beta1);
	c->beta2 = (float)hp->beta2;
	c->omb2 = (float)(1.0 - hp->beta2);
	c->eps = (float)hp->eps;

	switch (hp->optim) {
	case ZK_OPTIM_ADAMW:
	case ZK_OPTIM_ADAM:
		if (hp->bias_correction) {
			bc1 = 1.0 - pow(hp->beta1, (double)hp->step);
			bc2 = 1.0 - pow(hp->beta2, (double)hp->step);
		}
		lr_eff = hp->lr / bc1;
		break;
	case ZK_OPTIM_ADAGRAD:
		lr_eff = hp->lr / (1.0 + ((double)hp->step - 1.0) * hp->lr_decay);
		break;
	default:
		lr_eff = hp->lr;
		break;
	}
	c->bc2_sqrt = (float)sqrt(bc2);
	c->bc2_one = c->bc2_sqrt == 1.0f;
	c->neg_step = (float)-lr_eff;

	if (!isfinite(c->inv_scale) || !isfinite(c->neg_step) || !isfinite(c->decay) ||
	    !isfinite(c->wd) || !(c->bc2_sqrt > 0) || !isfinite(c->bc2_sqrt))
		return -EINVAL;
	return 0;
}

int zk_hparams_validate(const struct zk_hparams *hp)
{
	struct zk_consts c;

	if (!hp || (unsigned)hp->optim >= ZK_OPTIM_COUNT)
		return -EINVAL;
	/* The step is 1-based; 0 would divide by a zero bias correction. */
	if (hp->step == 0)
		return -EINVAL;
	if (!finite_ge0(hp->lr) || !finite_ge0(hp->weight_decay) || !finite_ge0(hp->eps) ||
	    !finite_ge0(hp->lr_decay))
		return -EINVAL;
	if (!isfinite(hp->grad_scale) || !(hp->grad_scale > 0))
		return -EINVAL;
	if (!isfinite(hp->clip_coef) || !(hp->clip_coef > 0))
		return -EINVAL;
	/* Adagrad has no betas; whatever the client left there is ignored. */
	if (hp->optim != ZK_OPTIM_ADAGRAD && (!beta_ok(hp->beta1) || !beta_ok(hp->beta2)))
		return -EINVAL;
	return zk_consts_init(hp, &c);
}

static int check_tensor(enum zk_isa isa, enum zk_optim optim, const struct zk_tensor *t,
    size_t begin, size_t end)
{
	if ((unsigned)isa >= ZK_ISA_COUNT || !t || !t->master || !t->grad)
		return -EINVAL;
	if ((unsigned)t->grad_dtype >= ZK_DTYPE_COUNT)
		return -EINVAL;
	if (t->param && (unsigned)t->param_dtype >= ZK_DTYPE_COUNT)
		return -EINVAL;
	if (begin > end || end > t->n)
		return -EINVAL;
	if (!t->m && optim != ZK_OPTIM_COUNT)
		return -EINVAL;
	if (!t->v && (optim == ZK_OPTIM_ADAMW || optim == ZK_OPTIM_ADAM))
		return -EINVAL;
	if (!zk_isa_supported(isa))
		return -ENOTSUP;
	return 0;
}

int zk_step(enum zk_isa isa, const struct zk_hparams *hp, const struct zk_tensor *t,
    size_t begin, size_t end)
{
	return zk_step_undo(isa, hp, t, begin, end, NULL);
}

int zk_step_undo(enum zk_isa isa, const struct zk_hparams *hp, const struct zk_tensor *t,
    size_t begin, size_t end, struct zk_undo *u)
{
	struct zk_consts c;
	int r;

	r = zk_hparams_validate(hp);
	if (r < 0)
		return r;
	r = check_tensor(isa, hp->optim, t, begin, end);
	if (r < 0)
		return r;
	r = zk_consts_init(hp, &c);
	if (r < 0)
		return r;
	if (begin < end)
		step_fns[isa](&c, hp->optim, t, begin, end, u);
	return 0;
}

int zk_undo_restore(enum zk_optim optim, const struct zk_tensor *t, const struct zk_undo *u,
    uint64_t record)
{
	uint64_t at = zk_undo_at(record), n = zk_undo_count(record);
	const char *slot = (const char *)u->ring + (size_t)zk_undo_slot(record) * ZK_UNDO_SLOT;
	bool adam = optim == ZK_OPTIM_ADAMW || optim == ZK_OPTIM_ADAM;

	if (record == 0 || n == 0 || n > ZK_UNDO_M / sizeof(float) || at > t->n || n > t->n - at ||
	    !t->master || !t->m || (adam && !t->v))
		return -EINVAL;
	memcpy(t->master + at, slot, n * sizeof(float));
	memcpy(t->m + at, slot + ZK_UNDO_M, n * sizeof(float));
	if (adam)
		memcpy(t->v + at, slot + ZK_UNDO_V, n * sizeof(float));
	return 0;
}

int zk_step_memonly(enum zk_isa isa, const struct zk_tensor *t, size_t begin, size_t end)
{
	/* ZK_OPTIM_COUNT: "no optimizer", so m and v may both be absent. */
	int r = check_tensor(isa, ZK_OPTIM_COUNT, t, begin, end);

	if (r < 0)
		return r;
	if (begin < end)
		memonly_fns[isa](t, begin, end);
	return 0;
}

int zk_grad_check(enum zk_isa isa, const void *grad, enum zk_dtype dtype, double grad_scale,
    size_t begin, size_t end, struct zk_grad_stats *stats)
{
	float inv_scale;

	if ((unsigned)isa >= ZK_ISA_COUNT || !grad || !stats || (unsigned)dtype >= ZK_DTYPE_COUNT)
		return -EINVAL;
	if (begin > end || !isfinite(grad_scale) || !(grad_scale > 0))
		return -EINVAL;
	inv_scale = (float)(1.0 / grad_scale);
	if (!isfinite(inv_scale))
		return -EINVAL;
	if (!zk_isa_supported(isa))
		return -ENOTSUP;
	if (begin < end)
		grad_fns[isa](grad, dtype, inv_scale, begin, end, stats);
	return 0;
}

float zk_bf16_to_f32(uint16_t h)
{
	return zk__bf16_to_f32(h);
}

uint16_t zk_f32_to_bf16(float f)
{
	return zk__f32_to_bf16(f);
}

float zk_f16_to_f32(uint16_t h)
{
	return zk__f16_to_f32(h);
}

uint16_t zk_f32_to_f16(float f)
{
	return zk__f32_to_f16(f);
}
