/* zoffctl's commands that do not talk to the daemon: import-deepspeed and tune. */
#ifndef ZOFFCTL_H
#define ZOFFCTL_H

#include <stdbool.h>
#include <stdio.h>

/*
 * Reads a DeepSpeed config (zero_optimization's offload_optimizer and
 * offload_param, aio, optimizer, gradient_clipping, fp16/bf16) and prints
 * the equivalent zoffload.conf block, job and step options, and what has no
 * equivalent.  ZOFFCTL_JSON: one JSON object instead of text; ZOFFCTL_PYTHON:
 * the training script's zoffload.deepspeed call and the optimizer it builds.
 * Returns the exit code (0, 1 unreadable input).
 */
enum zoffctl_format { ZOFFCTL_TEXT, ZOFFCTL_JSON, ZOFFCTL_PYTHON };

int zoffctl_import_deepspeed(const char *path, enum zoffctl_format fmt, FILE *out);

struct zoffctl_tune_opts {
	double seconds;		/* per measured point */
	unsigned long long size;	/* bytes of the test file per path */
	bool quick;		/* a small sweep, for tests */
	bool json;
};

/*
 * Measures swap paths with the daemon's swap engine over block size, queue
 * depth and staging buffers, and the CPU step rate, and prints a recommended
 * config block.  Returns the exit code.
 */
int zoffctl_tune(const char *const *paths, unsigned npaths, const struct zoffctl_tune_opts *o,
    FILE *out);

#endif
