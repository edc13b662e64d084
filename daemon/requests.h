/* The request dispatcher and the engine's reports: the only code that builds or reads requests and replies. */
#ifndef ZD_REQUESTS_H
#define ZD_REQUESTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine.h"
#include "proto.h"
#include "session.h"

/*
 * One row per request type: the descriptors it carries (exactly), whether a drain refuses
 * it, whether it ends the session's burst of reads, and its handler: handle_fd, given the
 * descriptor, where fds is 1 (no request carries more), else handle.
 */
struct zd_request_row {
	uint16_t type;
	unsigned fds;
	bool refused_draining;
	bool ends_burst;
	void (*handle)(struct zd_session *s, const struct zp_msg *msg);
	void (*handle_fd)(struct zd_session *s, const struct zp_msg *msg, int fd);
};

extern const struct zd_request_row zd_requests[];
extern const size_t zd_nrequests;
/* type's row, or NULL: not a request. */
const struct zd_request_row *zd_request_row(uint16_t type);

/* The session hooks (session.h): every message checked against its row, then handled. */
bool zd_request_message(struct zd_session *s, const struct zp_msg *msg, const int *fds,
    unsigned nfds);
void zd_request_close(struct zd_session *s);
extern const struct zd_session_hooks zd_request_hooks;

/* The engine's callbacks; their arg is the daemon. */
extern const struct ze_callbacks zd_engine_callbacks;

#endif
