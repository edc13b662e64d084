/*
 * A relay between a libzclient connection and a real zoffloadd, which can cut
 * the connection: the client's sending side only, or all of it at a chosen
 * message, after which it takes the next client (a reconnect).
 */
#ifndef RELAY_H
#define RELAY_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

/*
 * Listens on `path`, takes a client, connects it to the daemon at
 * `upstream` and copies datagrams (and their descriptors) both ways in a
 * thread of its own.  When either side closes, or a cut is made, both are
 * closed and the next client is taken, connected anew.
 * relay_cut_requests() makes the client's sends fail (EPIPE) while the
 * daemon's messages still reach it: a connection that is half gone, as a
 * send that fails on a live connection.
 */
struct relay {
	char path[128];
	char upstream[128];
	int listen_fd;
	int client_fd;		/* -1 until the client is taken */
	int daemon_fd;
	int stop[2];		/* a byte on stop[1] ends the thread, 'c' cuts now */
	pthread_t thread;
	bool running;
	/* The armed cut (relay_cut_at), read and cleared by the thread. */
	uint16_t cut_type;
	bool cut_to_daemon;	/* on a request the client sends, else on the daemon's message */
	bool cut_deliver;	/* pass that message on before cutting */
	unsigned cuts;		/* connections cut so far */
	unsigned clients;	/* clients taken so far */
	bool half_cut;		/* relay_cut_requests: the client's end reads as closed, it is not */
};

void relay_start(struct relay *r, const char *path, const char *upstream);
/* Waits (bounded) for the client, then shuts the relay's reading side of it. */
void relay_cut_requests(struct relay *r);
/*
 * Arms a cut at the next message of `type`: one the client sends
 * (to_daemon) or one the daemon sends.  deliver: the message goes through
 * first (the daemon got the request, or the client got the reply), else it
 * is dropped with the connection.
 */
void relay_cut_at(struct relay *r, uint16_t type, bool to_daemon, bool deliver);
/* Cuts the current connection now (idle, between calls); waits (bounded) until it is cut. */
void relay_cut_now(struct relay *r);
/* Cuts made so far. */
unsigned relay_cuts(struct relay *r);
void relay_stop(struct relay *r);

#endif
