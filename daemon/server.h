/* zoffloadd's life: start-up, the loop, shutdown; and telling systemd about it. */
#ifndef ZD_SERVER_H
#define ZD_SERVER_H

struct zd_daemon;

/* Runs until SIGTERM/SIGINT and the steps in flight are done.  0 on a clean exit. */
int zd_server_run(struct zd_daemon *d);

/* sd_notify(3) without libsystemd: READY=1 and STATUS= on $NOTIFY_SOCKET, if set. */
void zd_notify_ready(struct zd_daemon *d);
int zd_notify(const char *state);
/* The same with a descriptor attached (SCM_RIGHTS): FDSTORE=1.  0 without $NOTIFY_SOCKET. */
int zd_notify_fd(const char *state, int pass_fd);

#endif
