/* Internal to libzclient: why zc_connect failed, kept per thread (there is no connection to hold it). */
#ifndef ZCLIENT_CONNERR_H
#define ZCLIENT_CONNERR_H

/* Sets this thread's connect message and returns err (a negative errno). */
int zcl_connect_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/*
 * connect(2) on path failed with err: the message says what the user can do,
 * and for a permission denied names the group the socket admits.  Returns err.
 */
int zcl_connect_refused(int err, const char *path);
/* A connection was made: this thread's connect message is cleared. */
void zcl_connect_ok(void);

#endif
