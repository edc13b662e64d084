/*
 * The checkpoint I/O threads take turns between keys (uids): a free thread takes a job of
 * the key with the fewest running, then of the one that started one least recently.  Taken
 * first come, first served, one uid's queued pieces held back another's one (2.78 s for a
 * CKPT_WRITE of 1 ms alone).  The one thread here is held at its gate (a FIFO) until every
 * job is queued, so the order it runs them in is the pick's alone.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint_io.h"

struct job {
	struct zd_ckpt_io_item job;
	char name[8];
};

static char order[64];

static void
run(struct zd_ckpt_io_item *j)
{
	strcat(order, ((struct job *)j)->name);
	strcat(order, " ");
}

Test(ckpt_io, keys_take_turns)
{
	static const char *const names[] = { "A1", "A2", "A3", "B1", "A4", "C1" };
	static const char uid_a = 'a', uid_b = 'b', uid_c = 'c';
	const void *const keys[] = { &uid_a, &uid_a, &uid_a, &uid_b, &uid_a, &uid_c };
	struct job jobs[6];
	char dir[] = "/tmp/zoff-ckio-XXXXXX", gate[64];
	struct zd_ckpt_io *io;
	unsigned taken = 0;
	int g;

	cr_assert_not_null(mkdtemp(dir));
	snprintf(gate, sizeof(gate), "%s/gate", dir);
	cr_assert_eq(mkfifo(gate, 0600), 0);
	cr_assert_eq(zd_ckpt_io_new(1, gate, &io), 0);
	for (unsigned i = 0; i < 6; i++) {
		jobs[i] = (struct job){ .job = { .run = run, .key = keys[i] } };
		snprintf(jobs[i].name, sizeof(jobs[i].name), "%s", names[i]);
		zd_ckpt_io_submit(io, &jobs[i].job);
	}
	g = open(gate, O_RDWR);	/* the gate opens for good */
	cr_assert_geq(g, 0);
	while (taken < 6) {
		struct zd_ckpt_io_item *j = zd_ckpt_io_take(io);

		if (j != NULL)
			taken++;
		else
			usleep(1000);
	}
	zd_ckpt_io_stop(io);
	zd_ckpt_io_free(io);
	close(g);
	unlink(gate);
	rmdir(dir);
	/* A1 was taken before the others came (or first of them); then b, c, and a's in order. */
	cr_assert_str_eq(order, "A1 B1 C1 A2 A3 A4 ", "ran %s", order);
}
