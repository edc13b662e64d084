/* Checkpoint transfers: state to and from files whose descriptors clients pass. */
#ifndef ZD_CHECKPOINT_H
#define ZD_CHECKPOINT_H

#include <stdbool.h>
#include <stdint.h>

#include "proto.h"

struct cJSON;
struct zd_daemon;
struct zd_session;

/* A request that came with a descriptor (CKPT_WRITE, CKPT_READ); the handler owns it. */
void zd_handle_request_fd(struct zd_session *s, const struct zp_msg *msg, int fd);
/* An engine io_done that belongs to a checkpoint transfer: handled, true. */
bool zd_ckpt_io_done(struct zd_daemon *d, uint32_t lane, uint64_t id, void *user, int result);
/* "checkpoint" in the stats: bytes saved and restored, transfers in flight. */
void zd_ckpt_stats_json(struct cJSON *root, const struct zd_daemon *d);

#endif
