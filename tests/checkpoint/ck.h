/* Checkpoint-test helpers: a logical model sharded over ranks, stepped, saved, restored. */
#ifndef CK_H
#define CK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "itd.h"

#define CK_MAX_RANKS 4
#define CK_PARAMS 2

/* The logical model: parameters of odd sizes, split into contiguous shards per rank. */
extern const uint64_t ck_param_numel[CK_PARAMS];
extern const char *const ck_param_name[CK_PARAMS];

/* One rank of a job: its connection and its shard of each parameter. */
struct ck_rank {
	struct zc_conn *c;
	struct zc_tensor *t[CK_PARAMS];
	uint64_t off[CK_PARAMS];
	uint64_t numel[CK_PARAMS];
};

struct ck_job {
	unsigned world;
	enum zc_optim optim;
	struct ck_rank r[CK_MAX_RANKS];
};

/* Every parameter's whole master, m and v, gathered from the ranks. */
struct ck_state {
	float *a[CK_PARAMS][3];
};

/*
 * What the next jobs started or restored use: the state format (NULL: the daemon's
 * default, fp32 here), shard boundaries rounded up to multiples of align (0: none), and
 * whether a restore may convert (zc_checkpoint_allow_convert).
 */
struct ck_opts {
	const char *format;
	uint64_t align;
	bool convert;
};
extern struct ck_opts ck_opts;

/* The daemon's configuration: a swap directory, small chunks so tensors span several. */
void ck_config(char *buf, size_t len, const char *swapdir);
/* ... with NVMe chunks of chunk_elements (ck_config's: 16 Ki). */
void ck_config_chunks(char *buf, size_t len, const char *swapdir, uint64_t chunk_elements);
/* Opens job name with world ranks (policy for all) and registers the shards (fresh values). */
void ck_job_start(struct ck_job *j, const struct itd *d, const char *name, unsigned world,
    enum zc_optim optim, enum zc_policy policy);
/* Opens the job and registers every shard from the checkpoint in dir; asserts step. */
void ck_job_restore(struct ck_job *j, const struct itd *d, const char *name, unsigned world,
    enum zc_optim optim, enum zc_policy policy, const char *dir, uint64_t step);
/* Steps from..to (inclusive) on every rank: gradients depend on (param, element, step) only. */
void ck_job_steps(struct ck_job *j, uint64_t from, uint64_t to);
/* Every rank saves into dir; asserts success. */
void ck_job_save(struct ck_job *j, const char *dir, uint64_t step);
/* Reads back every rank's state into s (ck_state_free). */
void ck_job_gather(struct ck_job *j, struct ck_state *s);
void ck_job_close(struct ck_job *j);
void ck_assert_same(const struct ck_state *a, const struct ck_state *b, const char *what);
void ck_state_free(struct ck_state *s);
struct zc_step_params ck_params(enum zc_optim optim, uint64_t step);
/* Element i of parameter p at step (0: its initial value), in [-scale, scale). */
float ck_value(unsigned p, uint64_t i, uint64_t step, float scale);
/*
 * A daemon whose checkpoint I/O threads open gate (a FIFO, ZOFFLOADD_TEST_CKPT_GATE) for
 * reading before each job: one waits there until a writer holds the gate open (fd: the
 * test's, -1 when shut).  Its swap, a checkpoint directory and the gate's are fresh.
 * ck_gated_cleanup opens the gate for good, so that the daemon's threads can stop, stops
 * the daemon and removes them.  closes: the daemon's closer threads wait at the same gate
 * before each close of a client's descriptor (ZOFFLOADD_TEST_CLOSE_GATE).
 */
struct ck_gated {
	char swapdir[64], ckdir[64], gatedir[64], gate[96];
	int fd;
	bool closes;
};
void ck_gated_start(struct itd *d, struct ck_gated *g);
void ck_gated_cleanup(struct itd *d, struct ck_gated *g);
/* A fresh directory under /tmp, and its removal with every file in it. */
void ck_tmpdir(char *dir, size_t len, const char *what);
void ck_rmdir(const char *dir);

#endif
