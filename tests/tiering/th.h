/* Tiering-test helpers on itd: a swap directory per test, tensors and snapshots. */
#ifndef TH_H
#define TH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "itd.h"

/* Sizes for one set of tensors: odd, so chunks and vectors rarely line up. */
struct th_layout {
	const size_t *sizes;
	size_t count;
	enum zc_dtype grad_dtype;
	enum zc_dtype param_dtype;
	bool param_offload;
};

/* One job on its own connection, with the layout's tensors. */
struct th_job {
	struct zc_conn *c;
	const struct th_layout *layout;
	struct zc_tensor **t;
};

/* Everything a step can change: master, m, v as the daemon reads them back, param slot bytes. */
struct th_snap {
	size_t count;
	size_t *n;		/* elements of each tensor */
	float **master, **m, **v;
	void **param;
	size_t *param_bytes;
};

/* mkdtemp under /tmp (ext4: O_DIRECT and io_uring work there); th_swapdir_remove at the end. */
void th_swapdir(char *dir, size_t len);
void th_swapdir_remove(const char *dir);

/* Connects and opens a job with a policy and a pinned budget (0: the daemon's). */
void th_job_open(struct th_job *j, const struct itd *d, const char *name,
    enum zc_policy policy, uint64_t pinned_budget);
/* Registers the layout's tensors, initial values from th_init (the same in every job). */
void th_register(struct th_job *j, const struct th_layout *layout);
void th_job_close(struct th_job *j);

/* Deterministic initial master values of tensor k. */
void th_init(size_t k, float *out, size_t n);
/* Writes step `step`'s gradients of tensor k (the same in every job) into its grad slot. */
void th_fill_grads(struct th_job *j, size_t k, uint64_t step);

/* A step's hyperparameters (AdamW or Adam, realistic values). */
struct zc_step_params th_params(enum zc_optim optim, uint64_t step);

void th_snapshot(struct th_job *j, struct th_snap *s);
/* Asserts bit equality of every array and every param slot, naming the first difference. */
void th_assert_same(const struct th_snap *a, const struct th_snap *b, const char *what);
void th_snap_free(struct th_snap *s);

#endif
