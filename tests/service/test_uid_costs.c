/*
 * What one uid's connections cost the others: pipelined STATS are handled one per
 * connection per wakeup, not a burst of 32 each; connections per uid have a default cap.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "msgio.h"
#include "svc.h"

static struct itd daemon_;

static void
teardown(void)
{
	if (daemon_.pid > 0)
		kill(daemon_.pid, SIGCONT);
	itd_cleanup(&daemon_);
}

TestSuite(uid_costs, .fini = teardown, .timeout = 120);

/* Replies waiting on fd now, read and dropped. */
static unsigned
drain(int fd)
{
	static uint8_t buf[ZP_MAX_MESSAGE];
	int fds[ZP_MAX_FDS];
	unsigned n = 0, nfds;

	while (zp_recv_raw(fd, buf, sizeof(buf), fds, ZP_MAX_FDS, &nfds, MSG_DONTWAIT) > 0) {
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
		n++;
	}
	return n;
}

/*
 * Eight connections with 32 STATS each queued, and a victim's PING queued after them, all
 * while the daemon is stopped: when the victim has its answer, the daemon has answered
 * about one STATS per connection, not all 256 (each costs the loop a whole stats tree).
 */
Test(uid_costs, pipelined_stats_wait_their_turn)
{
	enum { ATTACKERS = 8, PIPELINED = 32 };
	static struct zp_msg m;
	int att[ATTACKERS], victim;
	unsigned answered = 0;

	itd_start(&daemon_, NULL);
	victim = itd_raw_connect(&daemon_);
	itd_raw_hello(victim);
	for (int i = 0; i < ATTACKERS; i++) {
		att[i] = itd_raw_connect(&daemon_);
		itd_raw_hello(att[i]);
	}
	cr_assert_eq(kill(daemon_.pid, SIGSTOP), 0);
	for (int i = 0; i < ATTACKERS; i++)
		for (int k = 0; k < PIPELINED; k++)
			itd_raw_send(att[i], ZP_STATS, 100 + (uint64_t)k, NULL);
	itd_raw_send(victim, ZP_PING, 7, NULL);
	cr_assert_eq(kill(daemon_.pid, SIGCONT), 0);
	cr_assert(itd_raw_recv(victim, &m, 30), "no answer to the victim's PING");
	/* Stopped again to count: what it answers meanwhile is not what came first. */
	cr_assert_eq(kill(daemon_.pid, SIGSTOP), 0);
	cr_assert_eq(m.hdr.type, ZP_PONG, "PING answered %s", zp_type_name(m.hdr.type));
	for (int i = 0; i < ATTACKERS; i++)
		answered += drain(att[i]);
	cr_assert_eq(kill(daemon_.pid, SIGCONT), 0);
	cr_log_info("%u of %d pipelined STATS answered before the victim's PONG", answered,
	    ATTACKERS * PIPELINED);
	/*
	 * One per connection a wakeup, and a few wakeups between the PONG and the stop: well
	 * under half.  A burst of 32 each answered all 256 before the PING.
	 */
	cr_assert_lt(answered, ATTACKERS * PIPELINED / 2, "%u of %d pipelined STATS were "
	    "answered before the victim's PING", answered, ATTACKERS * PIPELINED);
	for (int i = 0; i < ATTACKERS; i++)
		close(att[i]);
	close(victim);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}

/* limits.max_clients_per_uid is 64 unless set: one uid cannot take max_clients alone. */
Test(uid_costs, connections_per_uid_have_a_default)
{
	struct zc_conn *c[64], *extra = NULL;
	int r;

	itd_start(&daemon_, NULL);
	for (int i = 0; i < 64; i++)
		cr_assert_eq(zc_connect(daemon_.socket, &c[i]), 0, "connection %d: %s", i + 1,
		    zc_connect_errmsg());
	r = zc_connect(daemon_.socket, &extra);
	cr_assert_eq(r, -EUSERS, "a 65th connection of one uid gave %d", r);
	cr_assert(strstr(zc_connect_errmsg(), "limits.max_clients_per_uid") != NULL, "%s",
	    zc_connect_errmsg());
	cr_assert_eq(itd_stat(c[0], "limits.max_clients_per_uid"), 64);
	for (int i = 0; i < 64; i++)
		zc_disconnect(c[i]);
	cr_assert_eq(itd_stop(&daemon_, 10), 0, "%s", itd_log_text(&daemon_));
}
