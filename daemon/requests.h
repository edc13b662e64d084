/* The request dispatcher and the engine's reports: the only code that builds or reads requests and replies. */
#ifndef ZD_REQUESTS_H
#define ZD_REQUESTS_H

#include "engine.h"
#include "proto.h"

struct zd_daemon;

struct zd_session;

void zd_handle_request(struct zd_session *s, const struct zp_msg *msg);
/* checkpoint.c: a request that came with a descriptor, which the handler then owns. */
void zd_handle_request_fd(struct zd_session *s, const struct zp_msg *msg, int fd);
/* An engine io_done that belongs to a checkpoint write: handled, true. */
bool zd_ckpt_io_done(struct zd_daemon *d, uint32_t lane, uint64_t id, void *user, int result);
/* The engine's callbacks; their arg is the daemon. */
extern const struct ze_callbacks zd_engine_callbacks;

#endif
