/* Internal to libzclient: what its files share of the connection and its tensors. */
#ifndef ZCLIENT_IMPL_H
#define ZCLIENT_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto.h"
#include "zclient.h"

/* Names start with zci_, not zc_: the version script exports zc_* only. */

/* A registered tensor: its two mapped slots and what the client knows of its step and params. */
struct zc_tensor {
	struct zc_conn *conn;
	uint32_t handle;
	char name[ZP_NAME_MAX + 1];
	uint64_t numel;
	enum zc_dtype grad_dtype;	/* the descriptor, for a reattach (zclient_reconnect.c) */
	enum zc_dtype param_dtype;
	/*
	 * The slots' files (st_dev, st_ino): a reattach that hands back the same
	 * files keeps the mappings; other files are mapped over them in place.
	 */
	uint64_t grad_dev, grad_ino, param_dev, param_ino;
	/*
	 * True until the daemon holds every initial value (the init write, or a
	 * restore, is under way): only such a tensor may come back new from a
	 * reattach.  Any other that does means the daemon lost its state.
	 */
	bool fresh;
	void *grad;
	size_t grad_bytes;
	void *param;
	size_t param_bytes;
	/*
	 * A second, private and writable mapping of the param slot (zclient_view.c),
	 * or NULL: asked for by zc_conn_set_param_views before the registration.
	 * The caller's tensors may point into it; it is unmapped with the slots.
	 */
	void *param_view;
	/*
	 * view_wp: its writes are tracked by userfaultfd's asynchronous write
	 * protection (a written page's marker clears; see zclient_view.c), not
	 * found by reading pagemap.  view_carried: pages a remap carried over,
	 * written but no longer marked.
	 */
	bool view_wp;
	uint64_t view_carried;
	bool pending;
	uint64_t pending_set;		/* request id of the set it waits on, while pending */
	uint64_t last_step;
	struct zc_step_result result;
	bool param_offload;
	enum { PARAM_RESIDENT, PARAM_RELEASED, PARAM_FETCHING } param_state;
	int param_error;
	bool param_waited;		/* counted in `waited` by a wait that has not ended */
	/* At most one of the two is set (zc_tensor_set_slots_hook, _release_hook); one arg. */
	zc_slots_fn *slots_hook;
	zc_release_fn *release;
	void *release_arg;
	/*
	 * Non-NULL while a driver has the param slot pinned (see
	 * zc_tensor_set_param_pin).  Invariant: no PARAM_RELEASE names this
	 * tensor while it is set, since the daemon's hole punch would leave
	 * the driver with stale pages.
	 */
	zc_unpin_fn *unpin;
	void *unpin_arg;
	/* Set: the slots stay mapped when the tensor goes, handed to the caller here. */
	struct zc_kept_slots *kept;
};

/*
 * The socket is non-blocking: every wait is a poll() bounded by a deadline,
 * so that each blocking call can have a timeout (zc_set_timeout, the
 * *_timeout waits) and the descriptor can be polled by the caller.
 */
struct zc_conn {
	const struct zci_hooks *hooks;	/* set at connect (zclient_session.c), never NULL after */
	/*
	 * The socket.  Its number never changes: a reconnect puts the new
	 * socket in its place (dup3), so a caller polling zc_conn_fd goes on.
	 */
	int fd;
	char path[108];			/* what zc_connect connected to, for a reconnect */
	/* Reconnects (zclient_reconnect.c): 0 off, < 0 without bound, else ms to keep trying. */
	int reconnect_ms;
	/*
	 * The connection went away (EOF, ECONNRESET, EPIPE, a daemon shutting
	 * down) and reconnects are on: the socket is shut, and the next call
	 * reconnects first.  lost_ns: when it was found gone.
	 */
	bool lost;
	uint64_t lost_ns;
	unsigned losses;		/* times found gone: a reattach step compares it */
	/*
	 * Non-zero: a reconnect failed for good (timed out, the daemon lost the
	 * job's state); every call returns this with dead_msg.
	 */
	int dead;
	char dead_msg[ZP_ERRMSG_MAX + 128];
	struct zc_conn_stats conn_stats;
	int timeout_ms;			/* per request and reply; < 0: none */
	/*
	 * Non-zero: a request of this type got no answer in time and may still
	 * be carried out; what the daemon holds for this connection is unknown,
	 * so no more requests go out.  Waits for steps and params still work.
	 */
	uint16_t broken_by;
	uint64_t next_id;
	char err[ZP_ERRMSG_MAX + 128];
	uint8_t *buf;
	struct zp_msg *msg;
	bool job_open;
	char job_name[ZP_NAME_MAX + 1];	/* the open job's, for a reattach */
	struct zc_job_options job_opts;
	uint32_t rank;
	uint32_t world_size;
	uint64_t job_last_step;
	char state_format[ZP_FORMAT_MAX + 1];	/* the open job's, as the daemon names it */
	uint32_t session_id;
	struct zc_tensor **tensors;	/* by handle - 1 */
	uint32_t tensor_cap;
	void *xfer;
	size_t xfer_bytes;
	/*
	 * A read or write used the window since its pages were last given back; the next
	 * step submit gives them back (zci_xfer_release).  The client, not the daemon, does
	 * it: only the client knows when it is between two uses (it fills the window for a
	 * TENSOR_WRITE while a step it sent may still be unread by the daemon).
	 */
	bool xfer_touched;
	struct pending_set *sets;	/* submitted steps not done yet (zclient_step.c) */
	struct zc_step_result last;
	struct zc_param_stats param_stats;
	bool param_views;		/* tensors registered now get a param view */
	int pagemap_fd;			/* /proc/self/pagemap once a view was checked, else -1 */
	/* userfaultfd for the views' write tracking: -1 untried, -2 unavailable here. */
	int uffd;
};

/*
 * What the layers below hand upward, one entry per message type or event:
 * the transport (zclient.c) its events (TENSOR_DONE, STEP_DONE, PARAM_READY,
 * an ERROR for a pending step, the connection going), the reconnect
 * (zclient_reconnect.c) its remaps and resubmits.  zclient_session.c fills it,
 * so that no file of libzclient calls into one that calls it back.
 */
struct zci_hooks {
	void (*tensor_done)(struct zc_conn *c, const struct zp_msg *m);
	void (*step_done)(struct zc_conn *c, const struct zp_msg *m);
	void (*param_ready)(struct zc_conn *c, const struct zp_msg *m);
	bool (*set_pending)(const struct zc_conn *c, uint64_t request_id);
	int (*lost)(struct zc_conn *c, const char *why);
	int (*closed_by_daemon)(struct zc_conn *c, int code, const char *why);
	void (*slots_event)(struct zc_tensor *t, enum zc_slots_event why);
	void (*sets_rehandle)(struct zc_conn *c, struct zc_tensor *const *old, uint32_t cap);
	int (*sets_resubmit)(struct zc_conn *c, uint64_t deadline);
};

/* zclient.c: the transport, one message at a time, with no reconnect. */

/* Deadlines are CLOCK_MONOTONIC nanoseconds; these two are special. */
#define ZCI_NO_WAIT		0		/* take what has arrived, never block */
#define ZCI_NO_DEADLINE	UINT64_MAX

uint64_t zci_now_ns(void);
/* timeout_ms < 0: none, 0: no waiting. */
uint64_t zci_deadline_after(int timeout_ms);
int zci_seterr(struct zc_conn *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/*
 * Requests in flight together (a restore's): zci_send_async sends m with a new request id
 * without applying what arrived first (zci_send_msg would drop a reply nobody waits
 * for); zci_recv_reply applies events until the next reply, left in c->msg (an ERROR
 * too: the caller matches request ids), until the deadline: then the connection is
 * marked broken by `awaited`, since the daemon may still carry out what was asked.
 */
int zci_send_async(struct zc_conn *c, struct zp_msg *m, uint64_t deadline, int sendfd);
int zci_recv_reply(struct zc_conn *c, uint16_t awaited, uint64_t deadline);
/*
 * zclient_chains.c: n chains of requests run `ahead` at a time, one request of each in
 * flight (a save's or a restore's tensors).  advance(arg, i, reply) sends chain i's next
 * request (reply NULL: its first; else the answer to its last, an ERROR too) and returns
 * its request id, 0 when chain i is done, or -errno with the message set.  After the
 * first error no chain starts or goes on, those in flight are waited for, and that error
 * is returned (its message kept).  No other request may go out meanwhile.
 */
typedef int64_t zci_chain_fn(void *arg, size_t i, const struct zp_msg *reply);
int zci_chains_run(struct zc_conn *c, size_t n, unsigned ahead, uint16_t type,
    zci_chain_fn *advance, void *arg);
/* Applies whatever events have already arrived, without blocking. */
int zci_drain(struct zc_conn *c);
/*
 * One request and its reply, with no reconnect: the reply is in c->msg, its
 * descriptors in fds (NULL: closed).  Used by the reconnect itself.
 */
int zci_rpc_once(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, int *fds,
    uint64_t deadline);
/* Sends m once, with no reconnect. */
int zci_send_once(struct zc_conn *c, struct zp_msg *m, uint64_t deadline, int sendfd);
/*
 * Request (with sendfd unless -1) and reply of type reply_type or alt_type, once: the
 * reply is in c->msg, its descriptors in fds (NULL: closed).
 */
int zci_exchange(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, uint16_t alt_type,
    int *fds, int sendfd, uint64_t deadline);
/*
 * Reads one message until the deadline (-ETIMEDOUT, no message set).  Events go
 * to c->hooks and 0 is returned; a reply is left in c->msg and 1 returned, its
 * descriptors in fds.
 */
int zci_recv_one(struct zc_conn *c, int *fds, unsigned *nfds, uint64_t deadline);

/* zclient_reconnect.c: the retrying requests (below), the connection going away and coming back. */

/* Sends m with a new request id (and sendfd unless -1), applying the events that arrived first. */
int zci_send_msg(struct zc_conn *c, struct zp_msg *m, uint64_t deadline, int sendfd);
/* Request and reply; the reply is in c->msg, its descriptors in fds. */
int zci_rpc(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, int *fds);
/* zci_rpc, where a reply of type alt_type does too. */
int zci_rpc_either(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, uint16_t alt_type,
    int *fds);
/*
 * zci_rpc_fd sends req with sendfd (-1: none), waits for reply_type; the
 * reply stays valid until the next request on the connection.
 */
int zci_rpc_fd(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, int sendfd,
    const struct zp_msg **reply);
/* Applies events until done(arg) or the deadline (-ETIMEDOUT, with no message set). */
int zci_wait_until(struct zc_conn *c, bool (*done)(void *), void *arg, uint64_t deadline);


/*
 * The connection is gone (why: what found it so).  With reconnects off,
 * returns -ECONNRESET with why (the old behaviour); else marks it lost,
 * shuts the socket so the daemon lets go of the session, and returns
 * -ECONNRESET for the caller to reconnect.
 */
int zci_lost(struct zc_conn *c, const char *why);
/*
 * The daemon said why it closes the connection (its job was dropped, a
 * limit): that is no connection going away by accident, so with reconnects
 * on it is dead from now on with that reason.  Returns code.
 */
int zci_closed_by_daemon(struct zc_conn *c, int code, const char *why);
/*
 * Before a call goes to the daemon: the error of a dead connection, or, on a
 * lost one, the reconnect (zci_reconnect) first.  0 when connected.
 */
int zci_ready(struct zc_conn *c, struct zp_msg *inflight, uint64_t deadline);
/*
 * Connects again, reattaches the job and tensors, remaps their slots,
 * resubmits the steps and fetches in flight, and rewrites the handles in
 * inflight (a request not yet answered, to be sent again; NULL: none).
 * Connecting gives up at deadline (-ETIMEDOUT, still lost: a later call goes
 * on) or at the reconnect timeout (dead).  0 once reattached.
 */
int zci_reconnect(struct zc_conn *c, struct zp_msg *inflight, uint64_t deadline);
/* $ZOFFLOAD_RECONNECT_MS or the default; -EINVAL (connect message set) when malformed. */
int zci_reconnect_default(int *ret_ms);
/* zclient_slots.c: slot mappings. */

/*
 * Asks for 2 MiB pages behind a slot mapping: where shmem hugepages are
 * enabled on advice, the pages this process faults in first (the grad slot's)
 * are huge, and the daemon's mappings of them cheap to tear down.
 */
void zci_advise_huge(void *map, size_t bytes);
/* mmap(NULL, bytes, prot, MAP_SHARED, fd, 0) of a slot, large ones on a 2 MiB boundary. */
void *zci_map_slot(size_t bytes, int prot, int fd);
/* st_dev and st_ino of the file behind fd (0 when fstat fails). */
void zci_file_id(int fd, uint64_t *dev, uint64_t *ino);

/* zclient_view.c: param views. */

/* Maps t's param view from the param slot's file. */
int zci_view_map(struct zc_tensor *t, int fd);
void zci_view_unmap(struct zc_tensor *t);
void zci_view_keep(struct zc_tensor *t, void **ret_addr, size_t *ret_bytes);
/* A reattach brought the param slot back in another file: the view moves onto it in place. */
int zci_view_remap(struct zc_tensor *t, int fd);
/* Closes the connection's pagemap and userfaultfd descriptors (after its tensors went). */
void zci_view_close(struct zc_conn *c);

/* zclient_tensor.c: tensors. */

/* The transfer window's pages back, once a read or write used them. */
void zci_xfer_release(struct zc_conn *c);
/* A TENSOR_DONE, a PARAM_READY (c->hooks): the tensor's step, its fetch ended. */
void zci_tensor_done(struct zc_conn *c, const struct zp_msg *m);
void zci_tensor_param_ready(struct zc_conn *c, const struct zp_msg *m);

/* NULL for a handle no tensor of this connection has. */
struct zc_tensor *zci_tensor_by_handle(struct zc_conn *c, uint32_t handle);
/* Runs the slots hook (ZC_SLOTS_UNMAP), unmaps the slots and frees t; the daemon is not told. */
void zci_tensor_unmap(struct zc_tensor *t);
/* Tells the driver layer the slots are about to go or change (see zc_slots_event). */
void zci_tensor_slots_event(struct zc_tensor *t, enum zc_slots_event why);
/* zc_tensor_register, where init NULL means the caller writes master itself next. */
int zci_tensor_register(struct zc_conn *c, const struct zc_tensor_desc *desc, const float *init,
    struct zc_tensor **ret);

/* zclient_step.c: the sets of tensors in submitted steps. */

/* Applies a STEP_DONE: c->last, and the end of its set's tensors still pending. */
void zci_sets_finish(struct zc_conn *c, const struct zp_step_done *done, uint64_t request_id);
/* True while the step of that request id is not done. */
bool zci_sets_pending(const struct zc_conn *c, uint64_t request_id);
/* A STEP_DONE (c->hooks): zci_sets_finish of its set. */
void zci_sets_step_done(struct zc_conn *c, const struct zp_msg *m);
void zci_sets_free(struct zc_conn *c);
/*
 * After a reattach: each set's tensors that the daemon already stepped (their
 * last_step) end as applied, the rest are submitted again (new request ids).
 * 0, -ECONNRESET when the connection went again, or a failure for good.
 */
int zci_sets_resubmit(struct zc_conn *c, uint64_t deadline);
/* The sets' handles, of the tensors in old (by old handle), to their new ones. */
void zci_sets_rehandle(struct zc_conn *c, struct zc_tensor *const *old, uint32_t cap);

/* An open checkpoint directory (zclient_checkpoint.c opens it, zclient_restore.c reads it). */
struct zck_index;
struct zc_checkpoint {
	struct zc_conn *conn;
	struct zck_index *ix;
	bool convert;		/* zc_checkpoint_allow_convert */
};

#endif
