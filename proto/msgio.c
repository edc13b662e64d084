/* Sending and receiving whole protocol messages, with descriptors, on a SOCK_SEQPACKET socket. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "msgio.h"

int
zp_send_raw(int sock, const void *buf, size_t len, const int *fds, unsigned nfds)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * ZP_MAX_FDS)];
	} control;
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	ssize_t n;

	if (nfds > ZP_MAX_FDS)
		return -EINVAL;
	if (nfds > 0) {
		struct cmsghdr *c;

		memset(&control, 0, sizeof(control));
		mh.msg_control = control.buf;
		mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
		c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
		memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
	}
	do
		n = sendmsg(sock, &mh, MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return errno == EWOULDBLOCK ? -EAGAIN : -errno;
	return (size_t)n == len ? 0 : -EMSGSIZE;
}

int
zp_send(int sock, const struct zp_msg *msg, const int *fds, unsigned nfds)
{
	uint8_t *buf;
	size_t len;
	int r;

	buf = malloc(ZP_MAX_MESSAGE);
	if (buf == NULL)
		return -ENOMEM;
	if (zp_encode(msg, buf, ZP_MAX_MESSAGE, &len) != ZP_S_OK)
		r = -EPROTO;
	else
		r = zp_send_raw(sock, buf, len, fds, nfds);
	free(buf);
	return r;
}

ssize_t
zp_recv_raw(int sock, void *buf, size_t cap, int *fds, unsigned max_fds, unsigned *ret_nfds,
    int flags)
{
	/* Room for more than we accept, so that extra descriptors arrive and get closed. */
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * 16)];
	} control;
	struct iovec iov = { .iov_base = buf, .iov_len = cap };
	struct msghdr mh = {
		.msg_iov = &iov,
		.msg_iovlen = 1,
		.msg_control = control.buf,
		.msg_controllen = sizeof(control.buf),
	};
	unsigned nfds = 0;
	bool too_many = false;
	ssize_t n;

	do
		n = recvmsg(sock, &mh, flags | MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return errno == EWOULDBLOCK ? -EAGAIN : -errno;

	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c)) {
		size_t count;
		int fd;

		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < count; i++) {
			memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
			if (nfds < max_fds)
				fds[nfds++] = fd;
			else {
				close(fd);
				too_many = true;
			}
		}
	}
	if ((mh.msg_flags & MSG_CTRUNC) != 0)
		too_many = true;
	if (too_many || (mh.msg_flags & MSG_TRUNC) != 0) {
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
		*ret_nfds = 0;
		return too_many ? -ETOOMANYREFS : -EMSGSIZE;
	}
	*ret_nfds = nfds;
	return n;
}

ssize_t
zp_recv_all(int sock, void *buf, size_t cap, int *fds, unsigned *ret_nfds, int flags)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * ZP_RECV_ALL_FDS)];
	} control;
	struct iovec iov = { .iov_base = buf, .iov_len = cap };
	struct msghdr mh = {
		.msg_iov = &iov,
		.msg_iovlen = 1,
		.msg_control = control.buf,
		.msg_controllen = sizeof(control.buf),
	};
	unsigned nfds = 0;
	ssize_t n;

	*ret_nfds = 0;
	do
		n = recvmsg(sock, &mh, flags | MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return errno == EWOULDBLOCK ? -EAGAIN : -errno;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c)) {
		size_t count;

		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < count && nfds < ZP_RECV_ALL_FDS; i++)
			memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
	}
	*ret_nfds = nfds;
	if ((mh.msg_flags & MSG_CTRUNC) != 0)
		return -ETOOMANYREFS;
	if ((mh.msg_flags & MSG_TRUNC) != 0)
		return -EMSGSIZE;
	return n;
}
