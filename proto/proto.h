/* The zoffload wire format: versioned header, typed payloads, full validation. */
#ifndef ZP_PROTO_H
#define ZP_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/*
 * Every message on the SOCK_SEQPACKET control socket is one datagram:
 *
 *	u32 magic	ZP_MAGIC
 *	u16 version	ZP_VERSION
 *	u16 type	enum zp_type
 *	u64 request_id	echoed by the reply; events carry the id of what caused them
 *	u32 payload_len	bytes after the header, must equal the datagram's rest
 *	u32 reserved	zero
 *
 * All integers little-endian, doubles as their IEEE-754 bits.  Strings are a
 * u16 length and that many bytes, no NUL, no control characters.
 */
#define ZP_MAGIC		0x46464f5au	/* "ZOFF" */
#define ZP_VERSION		3
#define ZP_HEADER_SIZE		24
#define ZP_MAX_PAYLOAD		(64u * 1024)
#define ZP_MAX_MESSAGE		(ZP_HEADER_SIZE + ZP_MAX_PAYLOAD)
#define ZP_MAX_FDS		2
#define ZP_NAME_MAX		127	/* tensor, job and client names */
#define ZP_ERRMSG_MAX		255
#define ZP_MAX_STEP_TENSORS	4096
#define ZP_MAX_XFER		(256ull << 20)

/* Requests 1-63 (client to daemon), replies 64-127, events 128-191. */
#define ZP_TYPES(X)							\
	X(HELLO, 1)							\
	X(PING, 2)							\
	X(JOB_OPEN, 3)							\
	X(JOB_CLOSE, 4)							\
	X(TENSOR_REGISTER, 5)						\
	X(TENSOR_UNREGISTER, 6)						\
	X(XFER_OPEN, 7)							\
	X(TENSOR_WRITE, 8)						\
	X(TENSOR_READ, 9)						\
	X(STEP_SUBMIT, 10)						\
	X(STATS, 11)							\
	X(JOBS, 12)							\
	X(JOB_DROP, 13)							\
	X(PARAM_FETCH, 14)						\
	X(PARAM_RELEASE, 15)						\
	X(TENSOR_SET_STEP, 16)						\
	X(GRAD_PASS, 17)						\
	X(CKPT_WRITE, 18)						\
	X(CKPT_READ, 19)						\
	X(CKPT_RELEASE, 20)						\
	X(OK, 64)							\
	X(ERROR, 65)							\
	X(HELLO_OK, 66)							\
	X(PONG, 67)							\
	X(JOB_OK, 68)							\
	X(TENSOR_OK, 69)						\
	X(XFER_OK, 70)							\
	X(JSON, 71)							\
	X(GRAD_PARTIAL, 72)						\
	X(CKPT_DONE, 73)						\
	X(JSON_FD, 74)							\
	X(TENSOR_DONE, 128)						\
	X(STEP_DONE, 129)						\
	X(PARAM_READY, 130)

enum zp_type {
#define ZP_TYPE_ENUM(name, value) ZP_##name = value,
	ZP_TYPES(ZP_TYPE_ENUM)
#undef ZP_TYPE_ENUM
};

#define ZP_STATUSES(X)							\
	X(OK, "ok")							\
	X(SHORT, "message shorter than its header")			\
	X(LONG, "message longer than the protocol allows")		\
	X(MAGIC, "bad magic")						\
	X(VERSION, "unsupported protocol version")			\
	X(TYPE, "unknown message type")					\
	X(LENGTH, "payload length does not match the message")		\
	X(RESERVED, "reserved header field is not zero")		\
	X(TRUNCATED, "payload ends inside a field")			\
	X(TRAILING, "payload has bytes left over")			\
	X(STRING, "bad string")						\
	X(VALUE, "field out of range")					\
	X(NOSPACE, "encode buffer too small")

enum zp_status {
#define ZP_STATUS_ENUM(name, text) ZP_S_##name,
	ZP_STATUSES(ZP_STATUS_ENUM)
#undef ZP_STATUS_ENUM
	ZP_S_COUNT
};

enum zp_dtype { ZP_DTYPE_F32 = 0, ZP_DTYPE_BF16 = 1, ZP_DTYPE_F16 = 2, ZP_DTYPE_COUNT };
enum zp_optim { ZP_OPTIM_ADAMW = 0, ZP_OPTIM_ADAM = 1, ZP_OPTIM_ADAGRAD = 2, ZP_OPTIM_LION = 3, ZP_OPTIM_COUNT };
enum zp_state { ZP_STATE_MASTER = 0, ZP_STATE_EXP_AVG = 1, ZP_STATE_EXP_AVG_SQ = 2, ZP_STATE_COUNT };
/* Where a job's optimizer state lives. */
enum zp_policy { ZP_POLICY_DEFAULT = 0, ZP_POLICY_CPU = 1, ZP_POLICY_NVME = 2, ZP_POLICY_AUTO = 3, ZP_POLICY_COUNT };
enum zp_step_status { ZP_STEP_APPLIED = 0, ZP_STEP_SKIPPED_NONFINITE = 1, ZP_STEP_FAILED = 2, ZP_STEP_STATUS_COUNT };

/* STEP_SUBMIT flags */
#define ZP_STEP_NO_BIAS_CORRECTION	(1u << 0)
#define ZP_STEP_CHECK_FINITE		(1u << 1)
/* max_grad_norm carries the clip coefficient itself, in (0, 1]: the client's, from GRAD_PASS */
#define ZP_STEP_CLIP_COEF		(1u << 2)
#define ZP_STEP_FLAGS_ALL		(ZP_STEP_NO_BIAS_CORRECTION | ZP_STEP_CHECK_FINITE | \
					 ZP_STEP_CLIP_COEF)

struct zp_header {
	uint16_t version;
	uint16_t type;
	uint64_t request_id;
	uint32_t payload_len;
};

/* HELLO: str client_name */
struct zp_hello { char client_name[ZP_NAME_MAX + 1]; };
/* JOB_DROP: str job_name (a job of this uid, or any for root) */
struct zp_job_drop { char job_name[ZP_NAME_MAX + 1]; };
/* Longest optimizer state format name ("q8-moments"); the daemon knows the list. */
#define ZP_FORMAT_MAX 31
/*
 * JOB_OPEN: str job_name, u32 rank, u32 world_size (rank < world_size <= 65536),
 * u8 policy (enum zp_policy), u64 pinned_budget (0: the daemon's default),
 * str state_format (0..ZP_FORMAT_MAX bytes; empty: the daemon's memory.state_format)
 */
struct zp_job_open {
	char job_name[ZP_NAME_MAX + 1];
	uint32_t rank;
	uint32_t world_size;
	uint8_t policy;
	uint64_t pinned_budget;
	char state_format[ZP_FORMAT_MAX + 1];
};
/* TENSOR_REGISTER flags */
#define ZP_TENSOR_PARAM_OFFLOAD		(1u << 0)	/* params live on the tiers; slot staged on request */
#define ZP_TENSOR_FLAGS_ALL		ZP_TENSOR_PARAM_OFFLOAD

/* TENSOR_REGISTER: str name, u64 numel (> 0), u8 grad_dtype, u8 param_dtype, u8 flags */
struct zp_tensor_register {
	char name[ZP_NAME_MAX + 1];
	uint64_t numel;
	uint8_t grad_dtype;
	uint8_t param_dtype;
	uint8_t flags;
};
/* PARAM_FETCH, PARAM_RELEASE: u32 count (1..ZP_MAX_STEP_TENSORS), then count u32 handles */
struct zp_handles { uint32_t count; uint32_t handles[ZP_MAX_STEP_TENSORS]; };
/* PARAM_READY: u32 handle, i32 error (0: the param slot holds the parameters) */
struct zp_param_ready { uint32_t handle; int32_t error; };
/* TENSOR_UNREGISTER: u32 handle */
struct zp_tensor_handle { uint32_t handle; };
/*
 * TENSOR_SET_STEP: u32 handle, u64 step: the step the tensor's state is at, after a client
 * wrote state it saved (load of a checkpoint); the next step submitted must be above it.
 */
struct zp_tensor_step { uint32_t handle; uint64_t step; };
/* TENSOR_WRITE / TENSOR_READ: u32 handle, u8 state, u64 offset, u64 count (fp32 elements via the xfer window) */
struct zp_tensor_io { uint32_t handle; uint8_t state; uint64_t offset; uint64_t count; };
/*
 * STEP_SUBMIT: u64 step, u8 optim, u8 flags, f64 lr, beta1, beta2, eps,
 * weight_decay, lr_decay, grad_scale, max_grad_norm, u32 count, then count u32 handles.
 */
struct zp_step_submit {
	uint64_t step;
	uint8_t optim;
	uint8_t flags;
	double lr, beta1, beta2, eps, weight_decay, lr_decay, grad_scale, max_grad_norm;
	uint32_t count;
	uint32_t handles[ZP_MAX_STEP_TENSORS];
};
/*
 * GRAD_PASS: f64 grad_scale, u32 count, then count u32 handles.  The first
 * phase of a step clipped by a norm over more than one set (ranks, nodes):
 * answered by GRAD_PARTIAL with this set's share.
 */
struct zp_grad_pass {
	double grad_scale;
	uint32_t count;
	uint32_t handles[ZP_MAX_STEP_TENSORS];
};
/* GRAD_PARTIAL: f64 sumsq (of the unscaled gradients, in double), u64 nonfinite, u64 elements */
struct zp_grad_partial { double sumsq; uint64_t nonfinite; uint64_t elements; };
/*
 * A checkpoint's arrays per tensor: master, exp_avg, exp_avg_sq and, for q8-moments state,
 * exp_avg_scale and exp_avg_sq_scale (one fp32 per 256-element block).
 */
#define ZP_CKPT_ARRAYS 5
/*
 * CKPT_WRITE: u32 handle, u64 offset, u64 count (elements, 1..2^40), u8 format, then
 * per array (ZP_CKPT_ARRAYS: master, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale)
 * u64 file_offset and u32 crc; fd: a regular file the client opened for writing.
 * format 0: the arrays as fp32 (a compressed state's moments decoded; the scale arrays
 * unused); 1 (bf16-moments) or 2 (q8-moments): the arrays as the tensor keeps them, raw
 * (exp_avg and exp_avg_sq bf16 or 8-bit codes, the scales for q8 only), which must be the
 * tensor's format; for q8, offset a multiple of 256 and count too unless it runs to the
 * tensor's end.  The daemon writes elements [offset, offset + count) of each array there
 * at its file_offset (the bytes of element `offset` onwards; pwrite: it never opens a
 * path itself), all from one read of the state, and answers CKPT_DONE with the CRC-32C
 * of each array's bytes continued from its crc (0 to start one), so that a client can
 * checksum an array written in several pieces.
 */
/*
 * CKPT_READ: the same fields and fd (open for reading), the other way: the daemon reads
 * the arrays' pieces from the file (pread) into elements [offset, offset + count) of
 * the tensor (format 0: encoding them into its format; else copied as they are), and
 * answers CKPT_DONE with their CRC-32C continued from crc: a restore.
 */
/*
 * CKPT_RELEASE: no payload; fd: a regular file the client has just replaced or removed (the
 * checkpoint a save renamed its new file over).  The daemon answers OK and holds it until
 * the connection's next message (or its end), then closes it on its checkpoint I/O
 * threads; it counts against the uid's descriptors until then.  Whoever drops the last
 * reference to an unlinked file pays for freeing its blocks (a third of a millisecond per
 * MiB, measured on ext4 with discard): the client closes its own copy before it sends
 * that next message (libzclient: a PING), so the daemon pays, not the rank that saved.
 */
struct zp_ckpt_write {
	uint32_t handle;
	uint64_t offset;
	uint64_t count;
	uint8_t format;
	uint64_t file_offset[ZP_CKPT_ARRAYS];
	uint32_t crc[ZP_CKPT_ARRAYS];
};
/* CKPT_DONE: u32 crc per array (continued), u64 last_step (of the tensor whose state was written) */
struct zp_ckpt_done { uint32_t crc[ZP_CKPT_ARRAYS]; uint64_t last_step; };
/* ERROR: i32 code (negative errno), str message */
struct zp_error { int32_t code; char message[ZP_ERRMSG_MAX + 1]; };
/* HELLO_OK: u32 session_id, u32 uid the daemon sees, str daemon_version */
struct zp_hello_ok { uint32_t session_id; uint32_t uid; char daemon_version[ZP_NAME_MAX + 1]; };
/* JOB_OK: u64 job_id, u64 last_step (0 for a new job), str state_format (the job's) */
struct zp_job_ok { uint64_t job_id; uint64_t last_step; char state_format[ZP_FORMAT_MAX + 1]; };
/*
 * TENSOR_OK: u32 handle, u64 grad_bytes, u64 param_bytes, u8 resumed, u64 last_step;
 * fds: grad slot, param slot.  resumed: the tensor was kept from a rank that died and
 * holds its state as of last_step; the client sends no initial values then.
 */
struct zp_tensor_ok {
	uint32_t handle;
	uint64_t grad_bytes;
	uint64_t param_bytes;
	uint8_t resumed;
	uint64_t last_step;
};
/* XFER_OK: u64 bytes; fd: the window */
struct zp_xfer_ok { uint64_t bytes; };
/* JSON: the rest of the payload is UTF-8 JSON text (not NUL-terminated on the wire) */
struct zp_json { const char *text; uint32_t len; };
/* JSON_FD: u64 bytes; fd: a sealed memfd whose first `bytes` bytes are the JSON text (a reply too large for JSON) */
struct zp_json_fd { uint64_t bytes; };
/* TENSOR_DONE: u32 handle, u64 step, u8 status, i32 error */
struct zp_tensor_done { uint32_t handle; uint64_t step; uint8_t status; int32_t error; };
/* STEP_DONE: u64 step, u8 status, i32 error, f64 grad_norm, u64 latency_ns, u32 count */
struct zp_step_done {
	uint64_t step;
	uint8_t status;
	int32_t error;
	double grad_norm;
	uint64_t latency_ns;
	uint32_t count;
};

struct zp_msg {
	struct zp_header hdr;
	union {
		struct zp_hello hello;
		struct zp_job_open job_open;
		struct zp_job_drop job_drop;
		struct zp_tensor_register tensor_register;
		struct zp_tensor_handle tensor_handle;
		struct zp_handles handles;
		struct zp_param_ready param_ready;
		struct zp_tensor_io tensor_io;
		struct zp_tensor_step tensor_step;
		struct zp_step_submit step_submit;
		struct zp_grad_pass grad_pass;
		struct zp_error error;
		struct zp_hello_ok hello_ok;
		struct zp_job_ok job_ok;
		struct zp_tensor_ok tensor_ok;
		struct zp_xfer_ok xfer_ok;
		struct zp_json json;
		struct zp_json_fd json_fd;
		struct zp_grad_partial grad_partial;
		struct zp_tensor_done tensor_done;
		struct zp_step_done step_done;
		struct zp_ckpt_write ckpt_write;
		struct zp_ckpt_done ckpt_done;
	} u;
};

const char *zp_type_name(uint16_t type);	/* NULL for an unknown type */
const char *zp_status_str(enum zp_status status);
/* Number of fds a message of this type carries. */
unsigned zp_type_fds(uint16_t type);
bool zp_type_is_request(uint16_t type);

/*
 * Encode msg (hdr.version and hdr.payload_len are filled in) into buf.
 * Sets *ret_len on success.
 */
enum zp_status zp_encode(const struct zp_msg *msg, void *buf, size_t cap, size_t *ret_len);

/*
 * Decode and validate one datagram.  On failure why (nullable) gets a line
 * naming the message type and the field.  A JSON payload points into buf.
 */
enum zp_status zp_decode(const void *buf, size_t len, struct zp_msg *msg, char *why,
    size_t why_len);

#endif
