/* Integration-test helpers: run a real zoffloadd in a temp dir, talk to it raw or through libzclient. */
#ifndef ITD_H
#define ITD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "proto.h"
#include "zclient.h"

/* Enough for the tests and the machine's two cores; info-level logs go to dir/daemon.log. */
#define ITD_DEFAULT_CONFIG \
	"{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"info\" } }\n"

struct itd {
	pid_t pid;		/* 0 when not running */
	pid_t client;		/* from itd_fork_client; 0 when none */
	char dir[64];
	char socket[96];
	char config[96];
	char log[96];
};

/* Fresh temp dir with config_text (NULL: ITD_DEFAULT_CONFIG) written to dir/zoffload.conf. */
void itd_prepare(struct itd *d, const char *config_text);
/* itd_prepare, then start zoffloadd and wait (bounded) until its socket accepts. */
void itd_start(struct itd *d, const char *config_text);
/* SIGTERM and wait up to timeout_s; returns the waitpid status, or -1 if it had to be killed. */
int itd_stop(struct itd *d, double timeout_s);
/* Waits (bounded) for a daemon that was told to exit; status as itd_stop. */
int itd_wait(struct itd *d, double timeout_s);
/* Kills a client and a daemon still running, removes the temp dir.  Safe twice; for .fini. */
void itd_cleanup(struct itd *d);
/* The daemon's log so far (static buffer), for failure messages. */
const char *itd_log_text(const struct itd *d);

/*
 * Runs zoffloadd with argv (NULL-terminated, without the program) to exit,
 * at most timeout_s.  stderr (and stdout) captured into out.  Returns the
 * waitpid status, -1 on timeout.
 */
int itd_run(const char *const *argv, char *out, size_t outlen, double timeout_s);

/* libzclient connection; asserts it works. */
struct zc_conn *itd_connect(const struct itd *d);
/*
 * A number from zc_stats_json by dotted path ("tiers.pinned.used_bytes"); a
 * numeric part indexes an array ("tiers.nvme.paths.0.used_bytes",
 * "jobs.1.nvme_bytes").  Asserts it exists.
 */
double itd_stat(struct zc_conn *c, const char *path);

/* Raw SEQPACKET connection to the daemon, and synchronous raw messages over it. */
int itd_raw_connect(const struct itd *d);
void itd_raw_send(int fd, uint16_t type, uint64_t request_id, const struct zp_msg *body);
/* Receives and decodes one message (bounded wait); false if the connection was closed. */
bool itd_raw_recv(int fd, struct zp_msg *m, double timeout_s);
/* HELLO and the HELLO_OK reply. */
void itd_raw_hello(int fd);
/* Expects ERROR(code) whose message says `text`, then the daemon closing; closes fd. */
void itd_raw_expect_refusal(int fd, int code, const char *text);

/*
 * Forks a client process (d->client, one at a time) that runs fn(report),
 * then _exit(1) should fn return.  fn writes one byte to report once it got
 * where the test wants it; the parent waits for that at most timeout_s and
 * asserts it came: "<who> did not get to <what>" on the timeout, "<who>
 * failed before it got to <what>" with the daemon's log when the child
 * closed the pipe.  itd_cleanup kills a client left running.
 */
void itd_fork_client(struct itd *d, void (*fn)(int report), double timeout_s, const char *who,
    const char *what);
/*
 * SIGKILLs d->client and reaps it; d->client is 0 afterwards.  0 with the
 * wait status in *ret_status (when not NULL); -ECHILD when there was none,
 * -errno when waitpid failed.
 */
int itd_kill_client(struct itd *d, int *ret_status);

double itd_now(void);

/* Deterministic random numbers (xorshift64*), so a failure reproduces. */
struct itd_rng { uint64_t s; };
uint64_t itd_rand(struct itd_rng *r);
/* Uniform in [-1, 1). */
double itd_uniform(struct itd_rng *r);

/*
 * torch.optim.AdamW / Adam (L2 decay folded into g) in double, PyTorch's
 * formula and order; g is the unscaled gradient the daemon consumed.
 */
void itd_ref_adam(double *p, double *m, double *v, const double *g, size_t n,
    const struct zc_step_params *sp);
/*
 * Lion (Chen et al. 2023) with torch-style decoupled weight decay, in double:
 * p *= 1 - lr*wd; c = b1*m + (1-b1)*g; p -= lr*sign(c); m = b2*m + (1-b2)*g.
 * Where c is within rounding of zero (|c| <= 1e-5 (|b1 m| + |(1-b1) g|), c
 * not exactly 0) the fp32 daemon's sign is a coin toss: such elements are
 * marked in ambiguous (n entries, nullable) for the caller to take the
 * daemon's value.  Returns how many were marked.
 */
size_t itd_ref_lion(double *p, double *m, const double *g, size_t n,
    const struct zc_step_params *sp, bool *ambiguous);
/*
 * torch.optim.Adagrad (1.13) in double: g += wd*p (wd != 0),
 * clr = lr / (1 + (step-1)*lr_decay), sum += g*g, p -= clr*g/(sqrt(sum)+eps).
 * sum starts at initial_accumulator_value.
 */
void itd_ref_adagrad(double *p, double *sum, const double *g, size_t n,
    const struct zc_step_params *sp);
/* max |got - want| / max |want|; a NaN anywhere gives inf. */
double itd_max_rel_err(const float *got, const double *want, size_t n);

/* Independent of the daemon's conversions. */
float itd_bf16_to_f32(uint16_t h);
uint16_t itd_f32_to_bf16_rne(float f);	/* finite inputs */
float itd_f16_to_f32(uint16_t h);

#endif
