/* A checkpoint's arrays decoded to fp32 (a restore that converts formats or splits blocks). */
#ifndef ZCK_DECODE_H
#define ZCK_DECODE_H

#include <stddef.h>
#include <stdint.h>

#include "ckpt_index.h"

/*
 * Elements [x, x + n) of e's state decoded to fp32 into a new memory file (memfd): master,
 * exp_avg and exp_avg_sq of n elements each, back to back, for a CKPT_READ of format 0.
 * The blocks covering the range are read whole.  The arrays' CRCs are not checked here
 * (zck_check_array).  The descriptor, or -errno with err saying why.
 */
int zck_decode_fd(const struct zck_file *f, const struct zck_entry *e, uint64_t x, uint64_t n,
    char *err, size_t errlen);

#endif
