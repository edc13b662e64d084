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
	/* Every descriptor arrives (the kernel's limit), so that the extra ones get closed. */
	int all[ZP_RECV_ALL_FDS];
	unsigned nfds;
	ssize_t n = zp_recv_all(sock, buf, cap, all, &nfds, flags);
	bool too_many = nfds > max_fds || n == -ETOOMANYREFS;

	*ret_nfds = 0;
	if (too_many || n < 0) {
		for (unsigned i = 0; i < nfds; i++)
			close(all[i]);
		return too_many ? -ETOOMANYREFS : n;
	}
	memcpy(fds, all, sizeof(int) * nfds);
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
