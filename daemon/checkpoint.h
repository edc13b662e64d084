/* Checkpoint transfers: state to and from files whose descriptors clients pass. */
#ifndef ZD_CHECKPOINT_H
#define ZD_CHECKPOINT_H

#include <stdbool.h>
#include <stdint.h>

#include "proto.h"

struct zd_uid;
struct cJSON;
struct zd_daemon;
struct zd_session;
struct ze_tensor;

/*
 * The handlers of the requests that come with a descriptor (requests.c's table): CKPT_WRITE
 * and CKPT_READ (a transfer), CKPT_RELEASE.  Each owns fd.
 */
void zd_ckpt_handle_transfer(struct zd_session *s, const struct zp_msg *msg, int fd);
void zd_ckpt_handle_release(struct zd_session *s, const struct zp_msg *msg, int fd);
/*
 * The session's held replaced file (CKPT_RELEASE), if any, to the closer: at the
 * session's next message; and at its end (zd_ckpt_session_end, which frees its slot too).
 */
void zd_ckpt_release_held(struct zd_session *s);
void zd_ckpt_session_end(struct zd_session *s);
/* The closer closed a CKPT_RELEASE file of uid's: counted, and its charge given back. */
void zd_ckpt_release_closed(struct zd_daemon *d, struct zd_uid *uid);
/* An engine io_done that belongs to a checkpoint transfer: handled, true. */
bool zd_ckpt_io_done(struct zd_daemon *d, uint32_t lane, uint64_t id, void *user, int result);
/* The I/O threads; 0 or -errno. */
int zd_ckpt_start(struct zd_daemon *d);
/* Their eventfd, readable when pieces are done: the loop then calls zd_ckpt_process. */
int zd_ckpt_fd(const struct zd_daemon *d);
void zd_ckpt_process(struct zd_daemon *d);
/* No transfer is in flight: what a drain waits for, with the engine's work. */
bool zd_ckpt_idle(const struct zd_daemon *d);
/* Joins the I/O threads and ends the transfers they had; before the engine goes. */
void zd_ckpt_stop(struct zd_daemon *d);
/*
 * A save or restore of et is in flight: between its pieces the tensor is not busy, and a
 * step, write, set_step, release or unregister then would tear what the file gets.
 */
bool zd_ckpt_in_transfer(const struct zd_daemon *d, const struct ze_tensor *et);
/* A tensor is freed: transfers of it end when what they have in flight comes back. */
void zd_ckpt_tensor_gone(struct zd_daemon *d, struct ze_tensor *et);
/*
 * limits.uid_ckpt_buffer_budget was reloaded: transfers waiting for room a raised budget
 * now gives begin (else they would wait for one of their uid's to end).
 */
void zd_ckpt_budget_reloaded(struct zd_daemon *d);
/* "checkpoint" in the stats: bytes saved and restored, transfers in flight. */
void zd_ckpt_stats_json(struct cJSON *root, const struct zd_daemon *d);

#endif
