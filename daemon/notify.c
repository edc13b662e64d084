/* The sd_notify(3) datagram protocol, without linking libsystemd. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"
#include "server.h"

int
zd_notify(const char *state)
{
	const char *path = getenv("NOTIFY_SOCKET");
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	socklen_t len;
	ssize_t n;
	int fd;

	if (path == NULL || path[0] == '\0')
		return 0;
	if ((path[0] != '/' && path[0] != '@') || strlen(path) >= sizeof(sa.sun_path))
		return -EINVAL;
	memcpy(sa.sun_path, path, strlen(path));
	/* A leading '@' names the abstract namespace. */
	if (path[0] == '@')
		sa.sun_path[0] = '\0';
	len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(path));
	fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	n = sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sa, len);
	close(fd);
	return n < 0 ? -errno : 1;
}

void
zd_notify_ready(struct zd_daemon *d)
{
	char msg[256];
	int r;

	snprintf(msg, sizeof(msg), "READY=1\nSTATUS=listening on %s, kernels %s",
	    d->cfg.socket_path, zk_isa_name(d->isa));
	r = zd_notify(msg);
	if (r < 0)
		log_warn(r, "cannot notify systemd at $NOTIFY_SOCKET");
}
