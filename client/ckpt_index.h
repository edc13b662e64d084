/*
 * A checkpoint directory's index: every rank file's safetensors header parsed and
 * checked.  Shared by libzclient (restore) and zoffctl (inspect); no connection needed.
 *
 * Layout of one rank file, `rank-RRRRR-of-WWWWW.safetensors`: u64 header length (LE),
 * the JSON header (padded with spaces), then the arrays, for each tensor NAME of the rank
 * NAME/master (F32), NAME/exp_avg and NAME/exp_avg_sq (as the daemon keeps them: F32 for
 * fp32 state, BF16 for bf16-moments, U8 codes for q8-moments) and, for q8-moments only,
 * NAME/exp_avg_scale and NAME/exp_avg_sq_scale (F32, one per 256-element block, the
 * last block possibly short).  Every F32 array comes first, then the BF16 ones, then the
 * U8 ones, so that each array starts aligned to its element size.  The header's
 * __metadata__ (strings only, as safetensors wants) holds format, optimizer,
 * hyperparameters (JSON text), rank, world_size and, per tensor, NAME/global_name,
 * NAME/global_offset, NAME/global_numel, NAME/step, NAME/ARRAY/crc32c (8 hex digits, of
 * each array's bytes) and NAME/state_format: how the daemon kept the tensor's state
 * ("fp32", "bf16-moments", "q8-moments"; absent in files of before formats: fp32).  Files
 * written before compressed arrays hold F32 moments (decoded) whatever the format: their
 * exp_avg's dtype tells them apart, and they restore as before.
 */
#ifndef ZCK_INDEX_H
#define ZCK_INDEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant.h"	/* the arrays' sizes and ZK_Q8_BLOCK: one definition with the daemon's */

#define ZCK_FORMAT "zoffload.checkpoint.1"
#define ZCK_STATES 3			/* master, exp_avg, exp_avg_sq */
#define ZCK_ARRAYS 5			/* and exp_avg_scale, exp_avg_sq_scale */
#define ZCK_HEADER_MAX (256u << 20)

/*
 * What a tensor's arrays hold: the values of CKPT_WRITE's format (proto.h), which are
 * enum zk_state_format's FP32, BF16 and Q8.
 */
enum zck_arrays { ZCK_ARRAYS_F32 = 0, ZCK_ARRAYS_BF16 = 1, ZCK_ARRAYS_Q8 = 2 };

/* "master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale" */
extern const char *const zck_state_names[ZCK_ARRAYS];
extern const char *const zck_optim_names[4];		/* by enum zc_optim */

struct zck_entry {
	char *name;			/* the rank's tensor name */
	char *global_name;
	uint64_t global_offset;
	uint64_t global_numel;
	uint64_t numel;
	uint64_t step;
	char state_format[32];		/* "fp32" when the file does not say */
	enum zck_arrays arrays;		/* F32 when exp_avg is F32, whatever state_format says */
	uint64_t begin[ZCK_ARRAYS];	/* byte offsets in the file */
	uint32_t crc[ZCK_ARRAYS];	/* of those present: zck_array_bytes > 0 */
	const char *bad;		/* NULL, or why this tensor cannot be used (dtype, shape) */
};

struct zck_file {
	char *path;
	int fd;				/* open for reading */
	uint32_t rank;
	uint32_t world_size;
	char optimizer[16];
	char *hparams;			/* JSON text */
	uint64_t size;			/* of the file */
	uint64_t data_end;		/* what its header says it holds */
	size_t nentries;
	struct zck_entry *entries;
};

struct zck_index {
	char *dir;
	size_t nfiles;
	struct zck_file *files;		/* by rank */
};

/* -errno; err names the file and what is wrong with it. */
int zck_open(const char *dir, struct zck_index **ret, char *err, size_t errlen);
void zck_close(struct zck_index *ix);

/* Bytes of array k (0..4) of count elements in a tensor of arrays a (0: not present). */
uint64_t zck_array_bytes(enum zck_arrays a, unsigned k, uint64_t count);
/* The name of a (the state format whose raw arrays they are; "fp32" for F32). */
const char *zck_arrays_name(enum zck_arrays a);

/* Reads one array whole checking its CRC-32C: -EBADMSG on a mismatch, -errno; err says. */
int zck_check_array(const struct zck_file *f, const struct zck_entry *e, unsigned k, char *err,
    size_t errlen);

/*
 * CRC-32C of the bytes of elements [from, to) of array k continued from *crc (for a scale
 * array: of the blocks they start, from a multiple of 256); err names file and tensor.
 */
int zck_crc_range(const struct zck_file *f, const struct zck_entry *e, unsigned k,
    uint64_t from, uint64_t to, uint32_t *crc, char *err, size_t errlen);

/* Reads bytes [at, at + len) of array k into buf; -EBADMSG if the file ends first. */
int zck_pread_array(const struct zck_file *f, const struct zck_entry *e, unsigned k, void *buf,
    uint64_t len, uint64_t at, char *err, size_t errlen);

#endif
