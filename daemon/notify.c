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

/* The socket address in $NOTIFY_SOCKET; 0 when unset, 1 when set, -EINVAL when malformed. */
static int
notify_address(struct sockaddr_un *sa, socklen_t *len)
{
	const char *path = getenv("NOTIFY_SOCKET");

	if (path == NULL || path[0] == '\0')
		return 0;
	if ((path[0] != '/' && path[0] != '@') || strlen(path) >= sizeof(sa->sun_path))
		return -EINVAL;
	*sa = (struct sockaddr_un){ .sun_family = AF_UNIX };
	memcpy(sa->sun_path, path, strlen(path));
	/* A leading '@' names the abstract namespace. */
	if (path[0] == '@')
		sa->sun_path[0] = '\0';
	*len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(path));
	return 1;
}

int
zd_notify_fd(const char *state, int pass_fd)
{
	char control[CMSG_SPACE(sizeof(int))] = { 0 };
	struct iovec iov = { .iov_base = (void *)state, .iov_len = strlen(state) };
	struct sockaddr_un sa;
	struct msghdr mh = { .msg_name = &sa, .msg_iov = &iov, .msg_iovlen = 1 };
	socklen_t len;
	ssize_t n;
	int fd, r;

	r = notify_address(&sa, &len);
	if (r <= 0)
		return r;
	mh.msg_namelen = len;
	if (pass_fd >= 0) {
		struct cmsghdr *cm;

		mh.msg_control = control;
		mh.msg_controllen = sizeof(control);
		cm = CMSG_FIRSTHDR(&mh);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(cm), &pass_fd, sizeof(int));
	}
	fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	n = sendmsg(fd, &mh, MSG_NOSIGNAL);
	close(fd);
	return n < 0 ? -errno : 1;
}

int
zd_notify(const char *state)
{
	return zd_notify_fd(state, -1);
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
