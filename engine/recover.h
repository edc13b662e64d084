/* Rebuilding the engine's tensors from descriptors kept across a restart (systemd's fd store). */
#ifndef ZE_RECOVER_H
#define ZE_RECOVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine.h"

/*
 * Everything a tensor's state is made of is a memfd (its record, its
 * pinned state, its grad and param slots) or an extent of a swap file, and
 * its record names them all: a process that keeps the descriptors (systemd,
 * or the daemon's own successor) can rebuild the tensor, stamps and all.
 */
#define ZE_RECORD_MAGIC 0x31636572666f7a7aull	/* "zzofrec1" */
#define ZE_JOURNAL_MAGIC 0x316c726a666f7a7aull	/* "zzofjrl1" */
/* 2: master_in_slot (1 is still read: a version 1 record keeps its master in the state). */
#define ZE_RECORD_VERSION 2u
/*
 * 1: an undo copy of the whole slice; 2: roll forward (journal.c); 3: the same, each
 * worker's ring at a stride of its own (2 is still taken back, with its rings packed).
 */
#define ZE_JOURNAL_VERSION 3u
#define ZE_OWNER_WORDS 4
/* Staging buffers whose computed chunks the journal can name. */
#define ZE_MAX_STAGING 256
/* Worker threads with a before-image of their own in the journal (compute.worker_threads' most). */
#define ZE_JOURNAL_WORKERS 1024

/*
 * The layout of a journal of `version` (2 or ZE_JOURNAL_VERSION): its header's bytes, then
 * worker w's ring at header + w * ring_stride, bytes in all.  -EINVAL: not a version this
 * engine takes back.  For tests that make an earlier daemon's journal.
 */
int ze_journal_layout(unsigned version, size_t *header, size_t *ring_stride, size_t *bytes);

struct ze_tensor_fds {
	int record;
	int state;		/* pinned state; -1 on NVMe */
	int grad;
	int param;
};

/* The engine's own id for t: unique in this engine and its successors. */
uint64_t ze_tensor_id(const struct ze_tensor *t);
/* t's descriptors, still t's (the caller dups what it keeps). */
void ze_tensor_fds(const struct ze_tensor *t, struct ze_tensor_fds *ret);
/* Words the owner (the daemon: job, rank, uid) keeps in t's record, for its own rebuilding. */
void ze_tensor_set_owner(struct ze_tensor *t, const uint64_t owner[ZE_OWNER_WORDS]);
/* The engine's step journal (-1 when off) and staging buffer i's memfd (-1: none). */
int ze_engine_journal_fd(const struct ze_engine *e);
int ze_engine_staging_fd(const struct ze_engine *e, unsigned i);
unsigned ze_engine_staging_count(const struct ze_engine *e);

/* What a kept record says, read without rebuilding anything. */
struct ze_record_info {
	uint64_t id;
	uint64_t owner[ZE_OWNER_WORDS];
	char name[ZE_NAME_MAX + 1];
	uint64_t numel;
	bool on_nvme;
	enum zk_dtype grad_dtype;
	enum zk_dtype param_dtype;
};
/* 0, or -EPROTO / -EPROTONOSUPPORT / -EBADMSG (checksum) with err saying what was wrong. */
int ze_record_peek(int fd, struct ze_record_info *ret, char *err, size_t errlen);

/* How a rebuilt tensor came back. */
struct ze_adopt_report {
	uint64_t last_step;		/* every element is at least here */
	uint64_t partial_step;		/* a step that landed on part of it: resubmit to finish */
	uint64_t torn_step;		/* a step a crash left half applied: refused until set */
	unsigned finished;		/* slices whose step the engine finished from the journal */
	int finish_error;		/* -errno: the journal's slice could not be finished (torn) */
	unsigned rewritten;		/* NVMe chunks written again from a kept staging buffer */
	/*
	 * The param slot is a new memfd with the kept one's contents (which was
	 * closed): only for a slot an older daemon sealed against writable
	 * mappings, which cannot be mapped writable again.  Otherwise both
	 * slots are the kept memfds, the very inodes the client has mapped.
	 */
	bool param_replaced;
};

/*
 * Rebuilds a tensor from kept descriptors (taken over on success: the
 * tensor closes them), charged again to job and uid, as the owner left it.
 * A slice caught mid-step is finished from the journal (its half-stepped
 * blocks put back, the rest stepped from the grad slot) and a computed chunk
 * not known to have landed is written again, so every element is at a step
 * it reached whole; what cannot be made so is reported torn.  Call before
 * any new work, for every kept tensor, then ze_engine_recovered().
 */
int ze_tensor_adopt(struct ze_engine *e, const struct ze_tensor_fds *fds,
    struct ze_account *job, struct ze_account *uid, void *user, struct ze_tensor **ret,
    struct ze_adopt_report *rep, char *err, size_t errlen);
/*
 * What ze_tensor_adopt would refuse in fds (a record that does not add up, a slot or the
 * state missing or of another size), found without writing anything: 0, or -errno with
 * err saying what.  A restart checks every kept tensor so before it adopts any, since
 * adopting one finishes the journal's slice and settles its record's stamps, and a
 * refused state must be left as it was.  The descriptors stay the caller's.
 */
int ze_tensor_adopt_check(struct ze_engine *e, const struct ze_tensor_fds *fds, char *err,
    size_t errlen);
/*
 * The checks are over: the swap space the checked tensors claim is free again, for
 * ze_tensor_adopt to take.  Until then each check holds its tensor's extent, so one that
 * overlaps another checked tensor's is refused (-EEXIST) with nothing adopted yet.
 */
void ze_adopt_checks_done(struct ze_engine *e);
/* Every kept tensor is back: the journal's entries for tensors that were not are void. */
void ze_engine_recovered(struct ze_engine *e);

#endif
