/* CPU optimizer kernels: one step over a tensor shard, reference and SIMD variants. */
#ifndef ZK_OPTIM_H
#define ZK_OPTIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum zk_dtype {
	ZK_DTYPE_F32 = 0,
	ZK_DTYPE_BF16 = 1,
	ZK_DTYPE_F16 = 2,
	ZK_DTYPE_COUNT
};

enum zk_optim {
	ZK_OPTIM_ADAMW = 0,	/* decoupled weight decay (torch.optim.AdamW) */
	ZK_OPTIM_ADAM = 1,	/* L2 weight decay folded into the gradient (torch.optim.Adam) */
	ZK_OPTIM_ADAGRAD = 2,	/* torch.optim.Adagrad; m holds the squared-gradient sum, v unused */
	ZK_OPTIM_LION = 3,	/* Lion (Chen et al. 2023); m holds the momentum, v unused */
	ZK_OPTIM_COUNT
};

enum zk_isa {
	ZK_ISA_SCALAR = 0,
	ZK_ISA_AVX2 = 1,	/* AVX2 + FMA + F16C */
	ZK_ISA_AVX512 = 2,	/* AVX-512 F/BW/VL/DQ */
	ZK_ISA_COUNT
};

/*
 * Hyperparameters as the client sends them (Python floats are doubles).
 * step is the 1-based number of the step being taken, i.e. PyTorch's
 * state['step'] after its increment.
 */
struct zk_hparams {
	enum zk_optim optim;
	double lr;
	double beta1;
	double beta2;
	double eps;
	double weight_decay;
	double lr_decay;	/* Adagrad only */
	uint64_t step;
	bool bias_correction;	/* Adam/AdamW; PyTorch always applies it */
	double grad_scale;	/* gradients are divided by this (fp16 loss scale); 1.0 = none */
	double clip_coef;	/* multiplies the unscaled gradient (global-norm clipping); 1.0 = none */
};

/*
 * One tensor's arrays.  master/m/v are fp32 and n elements long; m and v
 * may be NULL where the optimizer does not use them.  param may be NULL
 * (nobody reads the low-precision copy); it is written with streaming
 * stores otherwise.
 */
struct zk_tensor {
	float *master;
	float *m;
	float *v;
	const void *grad;
	enum zk_dtype grad_dtype;
	void *param;
	enum zk_dtype param_dtype;
	size_t n;
};

/* Result of the gradient pass: squared L2 norm of the unscaled gradient, non-finite count. */
struct zk_grad_stats {
	double sumsq;
	uint64_t nonfinite;
};

size_t zk_dtype_size(enum zk_dtype dtype);
const char *zk_dtype_name(enum zk_dtype dtype);
int zk_dtype_parse(const char *name, enum zk_dtype *ret);
const char *zk_optim_name(enum zk_optim optim);
int zk_optim_parse(const char *name, enum zk_optim *ret);

/* Best ISA the running CPU has; ZK_ISA_SCALAR always works. */
enum zk_isa zk_isa_best(void);
bool zk_isa_supported(enum zk_isa isa);
const char *zk_isa_name(enum zk_isa isa);
/* Accepts "scalar", "avx2", "avx512" and "auto" (= zk_isa_best()). */
int zk_isa_parse(const char *name, enum zk_isa *ret);
/*
 * The ISA to use: the one named by $ZOFFLOAD_ISA when set, else `configured`
 * (may be "auto" or NULL).  -EINVAL for an unknown name, -ENOTSUP when the CPU
 * lacks it.
 */
int zk_isa_select(const char *configured, enum zk_isa *ret);

/* -EINVAL when the hyperparameters are out of range (negative lr, beta outside [0,1), ...). */
int zk_hparams_validate(const struct zk_hparams *hp);

/*
 * Elements [begin, end) of one step.  Any split of [0, n) into ranges gives
 * bit-identical results.  -EINVAL on bad arguments, -ENOTSUP for an ISA the
 * CPU lacks.
 */
int zk_step(enum zk_isa isa, const struct zk_hparams *hp, const struct zk_tensor *t,
    size_t begin, size_t end);

/*
 * A way back for a step in place (the engine's step journal).  Before the
 * kernel stores a unit's new values (one vector, or a padded head or
 * tail), it copies the unit's old master, m and v (v for Adam and AdamW
 * only) into ring slot `slot`, sets *record to zk_undo_pack(its first
 * element, its count, slot) and flips slot for the next unit; units go in
 * ascending order.  So at whatever instruction the process dies, every
 * element before the unit *record names is stepped, every one after it is
 * untouched, and the unit's old values are whole in the slot the record
 * names (the next unit's go to the other one).  The extra stores come from
 * registers the step loaded anyway: no extra memory traffic.  slot is left
 * where the next call should go on from.  The param output is not kept:
 * stepping the unit again writes it.
 */
struct zk_undo {
	void *ring;		/* 2 * ZK_UNDO_SLOT bytes */
	uint64_t *record;	/* 0: no unit yet */
	unsigned slot;
};

/*
 * A slot: master at 0, m at ZK_UNDO_M, v at ZK_UNDO_V (bytes), up to 256
 * elements each as the state keeps them; a q8 unit (a whole q8 block, the
 * compressed formats' zk_qstep_undo) adds its two scales at ZK_UNDO_SCALES.
 */
#define ZK_UNDO_SLOT 4096u
#define ZK_UNDO_M 1024u
#define ZK_UNDO_V 2048u
#define ZK_UNDO_SCALES 3072u
/*
 * The fp32 vector kernels' unit (optim_simd.c says why this size): whole
 * vectors of either width, within a slot.
 */
#define ZK_UNDO_UNIT 32u

static inline uint64_t zk_undo_pack(uint64_t at, uint64_t count, unsigned slot)
{
	return 1ull << 63 | (uint64_t)(slot & 1) << 62 | count << 40 | at;
}
static inline uint64_t zk_undo_at(uint64_t rec) { return rec & ((1ull << 40) - 1); }
static inline uint64_t zk_undo_count(uint64_t rec) { return (rec >> 40) & ((1ull << 22) - 1); }
static inline unsigned zk_undo_slot(uint64_t rec) { return (unsigned)(rec >> 62) & 1; }

/* zk_step keeping a way back in u (NULL: none, zk_step itself); the same bits. */
int zk_step_undo(enum zk_isa isa, const struct zk_hparams *hp, const struct zk_tensor *t,
    size_t begin, size_t end, struct zk_undo *u);
/*
 * Puts back into t the old values of the unit record names, from u's ring
 * (a step of optim).  -EINVAL: the record does not fit t.
 */
int zk_undo_restore(enum zk_optim optim, const struct zk_tensor *t, const struct zk_undo *u,
    uint64_t record);

/* Gradient pass over [begin, end): adds into *stats.  grad_scale as in hparams. */
int zk_grad_check(enum zk_isa isa, const void *grad, enum zk_dtype dtype, double grad_scale,
    size_t begin, size_t end, struct zk_grad_stats *stats);

/* Conversions used by the kernels, exposed for tests and the client. */
float zk_bf16_to_f32(uint16_t h);
uint16_t zk_f32_to_bf16(float f);	/* round to nearest even; NaN stays NaN */
float zk_f16_to_f32(uint16_t h);
uint16_t zk_f32_to_f16(float f);	/* round to nearest even; overflow to inf */

/*
 * Bandwidth probe for benchmarks (an addition to the original interface):
 * moves exactly the bytes zk_step moves for the same tensor, the same way
 * (master/m/v read and written in place, grad read, param streamed out),
 * with no arithmetic.  Contents of master/m/v are left unchanged; param gets
 * garbage.
 */
int zk_step_memonly(enum zk_isa isa, const struct zk_tensor *t, size_t begin, size_t end);

#endif
