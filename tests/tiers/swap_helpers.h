/* Helpers shared by the tiers and engine tests: temp dirs, engines, synchronous I/O, huge pages. */
#ifndef ZT_TEST_SWAP_HELPERS_H
#define ZT_TEST_SWAP_HELPERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "swap.h"

#define MiB (1024u * 1024u)

/* mkdtemp under $TMPDIR or /tmp; free with th_rmdir(). */
char *th_tmpdir(void);
/* Removes the directory's plain files, then the directory. */
void th_rmdir(char *dir);

/* One engine on dir (an O_TMPFILE there). */
int th_engine(enum zs_swap_kind kind, const char *dir, uint64_t capacity, unsigned qd,
    uint32_t unit, const struct zs_inject *inject, struct zs_swap **ret);

/* Submit, then process until the callback ran; its result. */
int th_io(struct zs_swap *e, bool write, const struct zs_extent *x, uint64_t off,
    void *buf, size_t len);
/* Process until every callback counted by *pending has run (or 10 s pass). */
int th_drain(struct zs_swap *e, const unsigned *pending);

void *th_alloc(size_t len);
void th_fill(void *buf, size_t len, uint64_t seed);

/* NULL when io_uring works here, else why not. */
const char *th_uring_problem(void);
/* NULL when swap files under the temp dir work, else why not (for exit 77). */
const char *th_environment_problem(void);

/* Criterion's runner behind an environment check that can skip (exit 77). */
int th_main(int argc, char **argv, const char *(*problem)(void));

/* KiB of the mapping holding p mapped by 2 MiB shared-memory pages (/proc/self/smaps). */
unsigned long th_shmem_pmd_kib(const void *p);
/* Whether this kernel collapses shared memory at all (Linux 6.1, THP configured). */
bool th_kernel_collapses_shmem(void);

#endif
