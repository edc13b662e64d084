/* The client suite's fake daemon (fake.c), shared by test_fake_daemon.c and test_fake_reattach.c. */
#ifndef FAKE_H
#define FAKE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "proto.h"
#include "zclient.h"

/*
 * The fake daemon answers HELLO, JOB_OPEN, TENSOR_REGISTER (f32 slots) and
 * XFER_OPEN (a 64 KiB window) as the real one does, STATS with "{}", CKPT_WRITE
 * with CKPT_DONE (writing nothing), PING with PONG, every other request with OK,
 * except the one
 * request type a test scripts: that gets the test's reply.  It runs until
 * the client hangs up, so the client's clean-up requests (an UNREGISTER
 * after a failed register) are answered too.
 */
struct fake {
	uint16_t on;			/* request type whose reply is scripted */
	void (*reply)(int sock, const struct zp_msg *req);
};

/* The fake's directory (its socket inside) and process; fake_teardown kills and removes them. */
extern char fake_dir[64];
extern pid_t fake_child;
void fake_teardown(void);

#define FAKE_PATH_MAX 96
/* A listening socket in a new fake_dir; its path into path (the caller forks the server). */
int fake_listen(char path[FAKE_PATH_MAX]);
unsigned fd_count(void);
/* Like zp_send_raw, but any number of descriptors (up to 8): msgio refuses to send more than it takes. */
int sendmsg_fds(int sock, const void *buf, size_t len, const int *fds, unsigned nfds);
/* Child side: never asserts (Criterion's asserts belong to the test's process). */
void send_or_die(int sock, uint16_t type, uint64_t id, struct zp_msg *m, const int *fds,
    unsigned nfds);
int memfd_of(size_t bytes);
void tensor_ok_fds(int sock, const struct zp_msg *req, unsigned nfds);
void default_reply(int sock, const struct zp_msg *req);

/* The descriptors that came with the request being answered (closed after the answer). */
extern int req_fds[ZP_MAX_FDS];
extern unsigned req_nfds;
/* A script's verdict, given when the client hangs up: the fake exits with it. */
extern int script_status;

/* Starts the fake daemon; returns its socket path. */
const char *fake_start(const struct fake *f);
/* The fake daemon ran its script to the end (the client hung up). */
void fake_finish(void);
void expect_error(struct zc_conn *c, int r, int code, const char *text);
/* Connects and opens a job against the fake daemon. */
struct zc_conn *fake_connect(const struct fake *f);
int try_register(struct zc_conn *c, uint64_t n);

#endif
