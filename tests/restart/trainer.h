/* A trainer that survives its daemon: two jobs (pinned, NVMe, param offload), reconnecting by hand. */
#ifndef ZRT_TRAINER_H
#define ZRT_TRAINER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "standin.h"
#include "zclient.h"

#define ZRT_JOBS 2
#define ZRT_TENSORS 2

/*
 * What the daemon is told to do while the trainer steps, from a thread of its own.
 * ZRT_GATE: SIGKILL once the daemon holds at its step gate (zrt_options.gate_fifo).
 */
enum zrt_disturb { ZRT_NONE, ZRT_SIGKILL, ZRT_SIGTERM, ZRT_UPGRADE, ZRT_GATE };

/* How zrt_setup_with sets the daemon up; zeros are zrt_setup's defaults. */
struct zrt_options {
	bool journal_off;		/* recovery.journal false */
	/*
	 * A FIFO the daemon's step gate opens ($ZOFFLOADD_TEST_STEP_GATE, with
	 * $ZOFFLOADD_TEST_STEP_GATE_AT naming the step, slice and block; the
	 * caller sets both in the environment the daemon inherits).
	 */
	const char *gate_fifo;
};

struct zrt_job {
	struct zc_conn *c;
	struct zc_tensor *t[ZRT_TENSORS];
};

struct zrt {
	struct zst st;
	char swap[160];			/* a directory (unnamed swap file) or a file */
	char config[160];
	char socket[160];
	char exe[160];			/* the binary the service runs */
	const char *argv[10];
	struct zrt_job j[ZRT_JOBS];
	unsigned steps;
	/*
	 * libzclient reconnects on its own (the trainer sees no error; reconnects
	 * counts them, the fewest of any connection), else by hand: reconnects
	 * off, the trainer attaches again after each failure.
	 */
	bool auto_reconnect;
	const char *state_format;	/* both jobs' (NULL: the daemon's default) */
	enum zc_optim optim;		/* every step's (zero: AdamW) */
	/*
	 * The pinned job's 'w' (the gated tensor) with fp32 params, not bf16:
	 * where its format keeps an fp32 master, its param slot is the master.
	 */
	bool w_fp32_params;
	/* The NVMe job's 'x' with bf16 params: its slot is then bf16-master+q8's bf16 master. */
	bool x_bf16_params;
	struct zrt_options opts;
	/* zrt_train returns once the trainer reattached after its first restart. */
	bool stop_after_restart;
	/* Called between a kill's exit and the next start (NULL: none), to change what is kept. */
	void (*before_restart)(struct zrt *r);
	uint64_t reconnects;
	unsigned restarts;		/* daemon deaths the trainer went through */
	unsigned resumed;		/* tensors taken back resumed after one */
	unsigned resubmits;		/* steps submitted again after one */
	uint64_t final_ns;
};

/*
 * swap_file: a named swap file (else a directory).  Starts the daemon under
 * the stand-in, with the binary copied to exe so an upgrade can replace it.
 * 0 or an error with why in err.
 */
int zrt_setup(struct zrt *r, bool swap_file, char *err, size_t errlen);
int zrt_setup_with(struct zrt *r, bool swap_file, const struct zrt_options *o, char *err,
    size_t errlen);
/* Connects, opens both jobs and registers their tensors with initial values. */
int zrt_attach(struct zrt *r, bool expect_resumed, char *err, size_t errlen);
/*
 * Steps 1..steps, with `disturbances` of kind done at random moments (seed);
 * $ZRT_DEBUG set: each failure the trainer goes through is printed;
 * after each the trainer reconnects, registers its tensors again (they must
 * come back resumed) and submits again what had not landed.
 */
int zrt_train(struct zrt *r, enum zrt_disturb kind, unsigned disturbances, uint64_t seed,
    char *err, size_t errlen);
/*
 * One step of both jobs and the wait for it; submitted[j]: job j's gradients
 * for it are in the slots already (a resubmission), else they are written.
 */
int zrt_step(struct zrt *r, unsigned step, bool submitted[ZRT_JOBS]);
/* Master, m and v of every tensor, then its param slot: into buf (NULL: the size). */
size_t zrt_snapshot(struct zrt *r, void *buf);
/* Every tensor's master, m and v written back from a zrt_snapshot, then its step set (a checkpoint's restore). */
int zrt_restore(struct zrt *r, const void *buf, uint64_t step);
void zrt_detach(struct zrt *r);
void zrt_teardown(struct zrt *r);

#endif
