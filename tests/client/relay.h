/* A relay between one libzclient connection and a real zoffloadd, which can cut the client's sending side. */
#ifndef RELAY_H
#define RELAY_H

#include <pthread.h>
#include <stdbool.h>

/*
 * Listens on `path`, takes one client, connects it to the daemon at
 * `upstream` and copies datagrams (and their descriptors) both ways in a
 * thread of its own.  relay_cut_requests() makes the client's sends fail
 * (EPIPE) while the daemon's messages still reach it: a connection that is
 * half gone, as a send that fails on a live connection.
 */
struct relay {
	char path[128];
	char upstream[128];
	int listen_fd;
	int client_fd;		/* -1 until the client is taken */
	int daemon_fd;
	int stop[2];		/* a byte on stop[1] ends the thread */
	pthread_t thread;
	bool running;
};

void relay_start(struct relay *r, const char *path, const char *upstream);
/* Waits (bounded) for the client, then shuts the relay's reading side of it. */
void relay_cut_requests(struct relay *r);
void relay_stop(struct relay *r);

#endif
