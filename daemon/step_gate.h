/* A test's hold on the daemon mid-block ($ZOFFLOADD_TEST_STEP_GATE), so it can kill it there. */
#ifndef ZD_STEP_GATE_H
#define ZD_STEP_GATE_H

#include "engine.h"

/*
 * $ZOFFLOADD_TEST_STEP_GATE=FIFO and $ZOFFLOADD_TEST_STEP_GATE_AT=STEP,UNIT,BLOCK:
 * the worker that has stepped half of that block of a pinned slice opens
 * FIFO for writing (which waits for the test to open it for reading),
 * removes it, writes a byte and waits for ever, the rest of its block
 * unstepped.  BLOCK 18446744073709551615 (ZE_GATE_LANDED) holds the loop
 * instead where UNIT, an NVMe chunk whose slot is its master, has landed
 * and its slot has not taken the new master.  Once: without the FIFO the
 * gate lets every step through.
 * Unset: no gate ({ NULL }), and steps go as usual.
 */
struct ze_block_gate zd_step_gate(void);

#endif
