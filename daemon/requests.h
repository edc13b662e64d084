/* The request dispatcher and the engine's reports: the only code that builds or reads requests and replies. */
#ifndef ZD_REQUESTS_H
#define ZD_REQUESTS_H

#include "engine.h"
#include "proto.h"

struct zd_session;

void zd_handle_request(struct zd_session *s, const struct zp_msg *msg);
/* The engine's callbacks; their arg is the daemon. */
extern const struct ze_callbacks zd_engine_callbacks;

#endif
