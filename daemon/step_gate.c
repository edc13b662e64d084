/* A test's hold on the daemon mid-block: a worker stops half way through a block until the test kills it. */
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "step_gate.h"

struct gate {
	const char *fifo;
	uint64_t step, unit, block;
	int fired;
};

static struct gate gate_;

static void
gate_fn(void *arg, uint64_t step, uint64_t unit, uint64_t block)
{
	struct gate *g = arg;
	int fd;

	if (step != g->step || unit != g->unit || block != g->block ||
	    __atomic_exchange_n(&g->fired, 1, __ATOMIC_ACQ_REL))
		return;
	/* Once: the FIFO goes, so the daemon started after the kill steps through. */
	fd = open(g->fifo, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return;
	(void)unlink(g->fifo);
	/* The test reads this byte, and knows a worker holds here. */
	(void)!write(fd, "g", 1);
	for (;;)
		pause();
}

struct ze_block_gate
zd_step_gate(void)
{
	const char *fifo = getenv("ZOFFLOADD_TEST_STEP_GATE");
	const char *at = getenv("ZOFFLOADD_TEST_STEP_GATE_AT");

	if (fifo == NULL || at == NULL || sscanf(at, "%" SCNu64 ",%" SCNu64 ",%" SCNu64,
	    &gate_.step, &gate_.unit, &gate_.block) != 3)
		return (struct ze_block_gate){ NULL, NULL };
	gate_.fifo = fifo;
	return (struct ze_block_gate){ gate_fn, &gate_ };
}
