/* zoffctl checkpoint: what a checkpoint directory holds, checked; no daemon needed. */
#ifndef ZOFFCTL_CHECKPOINT_H
#define ZOFFCTL_CHECKPOINT_H

/* argv: what follows "checkpoint".  The exit status: 0 whole, 1 damaged or incomplete, 2 usage. */
int zoffctl_checkpoint(int argc, char **argv);

#endif
