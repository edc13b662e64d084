/*
 * A checkpoint directory's index: every rank file's safetensors header parsed and
 * checked.  Shared by libzclient (restore) and zoffctl (inspect); no connection needed.
 *
 * Layout of one rank file, `rank-RRRRR-of-WWWWW.safetensors`: u64 header length (LE),
 * the JSON header (padded with spaces), then for each tensor NAME of the rank its
 * arrays NAME/master, NAME/exp_avg, NAME/exp_avg_sq, fp32, back to back.  The header's
 * __metadata__ (strings only, as safetensors wants) holds format, optimizer,
 * hyperparameters (JSON text), rank, world_size and, per tensor, NAME/global_name,
 * NAME/global_offset, NAME/global_numel, NAME/step, NAME/STATE/crc32c (8 hex digits)
 * and NAME/state_format: how the daemon kept the tensor's state ("fp32",
 * "bf16-moments", "q8-moments"; absent in files of before formats: fp32).  The arrays
 * are fp32 whatever the format: a compressed format's moments as it decoded them,
 * which a restore into the same format encodes back.
 */
#ifndef ZCK_INDEX_H
#define ZCK_INDEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define ZCK_FORMAT "zoffload.checkpoint.1"
#define ZCK_STATES 3
#define ZCK_HEADER_MAX (256u << 20)

extern const char *const zck_state_names[ZCK_STATES];	/* "master", "exp_avg", "exp_avg_sq" */
extern const char *const zck_optim_names[4];		/* by enum zc_optim */

struct zck_entry {
	char *name;			/* the rank's tensor name */
	char *global_name;
	uint64_t global_offset;
	uint64_t global_numel;
	uint64_t numel;
	uint64_t step;
	char state_format[32];		/* "fp32" when the file does not say */
	uint64_t begin[ZCK_STATES];	/* byte offsets in the file */
	uint32_t crc[ZCK_STATES];
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

/*
 * Reads one array whole, a block at a time, checking its CRC-32C: fn (may be NULL) gets
 * each block, with the index of its first element.  -EBADMSG on a mismatch, -errno, or
 * fn's own negative result; err names file and tensor.
 */
typedef int zck_block_fn(void *arg, uint64_t first, const float *data, uint64_t count);
int zck_read_array(const struct zck_file *f, const struct zck_entry *e, unsigned state,
    zck_block_fn *fn, void *arg, char *err, size_t errlen);

/* CRC-32C of elements [from, to) of one array continued from *crc; err names file and tensor. */
int zck_crc_range(const struct zck_file *f, const struct zck_entry *e, unsigned state,
    uint64_t from, uint64_t to, uint32_t *crc, char *err, size_t errlen);

#endif
