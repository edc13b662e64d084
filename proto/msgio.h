/* Sending and receiving whole protocol messages, with descriptors, on a SOCK_SEQPACKET socket. */
#ifndef ZP_MSGIO_H
#define ZP_MSGIO_H

#include <stddef.h>
#include <sys/types.h>

#include "proto.h"

/*
 * Sends one datagram with nfds descriptors.  Returns 0, -EAGAIN on a full
 * non-blocking socket, or another -errno.
 */
int zp_send_raw(int sock, const void *buf, size_t len, const int *fds, unsigned nfds);

/* Encodes and sends; -EPROTO when the message does not encode. */
int zp_send(int sock, const struct zp_msg *msg, const int *fds, unsigned nfds);

/*
 * Receives one datagram into buf (at least ZP_MAX_MESSAGE bytes).  Up to
 * max_fds descriptors are returned in fds; any beyond are closed and the call
 * fails with -ETOOMANYREFS.  Returns the length, 0 on orderly shutdown,
 * -EMSGSIZE for a datagram larger than ZP_MAX_MESSAGE, or another -errno.
 * flags as for recvmsg (MSG_DONTWAIT).
 */
ssize_t zp_recv_raw(int sock, void *buf, size_t cap, int *fds, unsigned max_fds,
    unsigned *ret_nfds, int flags);

/* The most descriptors one datagram carries on Linux (SCM_MAX_FD). */
#define ZP_RECV_ALL_FDS 253

/*
 * As zp_recv_raw, but closes nothing: every descriptor that came with the datagram is in
 * fds (room for ZP_RECV_ALL_FDS) and *ret_nfds, whatever the result (0, -EMSGSIZE, ...),
 * so that the caller decides where they are closed: the last close of a file can take
 * seconds.  The room is the kernel's limit, so it never drops any itself.
 */
ssize_t zp_recv_all(int sock, void *buf, size_t cap, int *fds, unsigned *ret_nfds,
    int flags);

#endif
