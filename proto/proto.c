/* Encoding and validating decoding of zoffload messages; no I/O, no state. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "proto.h"

struct wbuf {
	uint8_t *p;
	size_t len;
	size_t cap;
	bool overflow;
};

struct rbuf {
	const uint8_t *p;
	size_t len;
	size_t off;
	enum zp_status status;
	const char *field;	/* the first field that failed */
};

const char *
zp_type_name(uint16_t type)
{
	switch (type) {
#define ZP_TYPE_CASE(name, value) case value: return #name;
	ZP_TYPES(ZP_TYPE_CASE)
#undef ZP_TYPE_CASE
	}
	return NULL;
}

const char *
zp_status_str(enum zp_status status)
{
	static const char *const text[] = {
#define ZP_STATUS_TEXT(name, t) [ZP_S_##name] = t,
		ZP_STATUSES(ZP_STATUS_TEXT)
#undef ZP_STATUS_TEXT
	};

	if ((unsigned)status >= ZP_S_COUNT)
		return "unknown status";
	return text[status];
}

unsigned
zp_type_fds(uint16_t type)
{
	switch (type) {
	case ZP_TENSOR_OK:
		return 2;
	case ZP_XFER_OK:
	case ZP_JSON_FD:
	case ZP_CKPT_WRITE:
	case ZP_CKPT_READ:
	case ZP_CKPT_RELEASE:
		return 1;
	default:
		return 0;
	}
}

bool
zp_type_is_request(uint16_t type)
{
	return type >= 1 && type < 64 && zp_type_name(type) != NULL;
}

static void
put_bytes(struct wbuf *w, const void *src, size_t n)
{
	if (w->overflow || w->cap - w->len < n) {
		w->overflow = true;
		return;
	}
	memcpy(w->p + w->len, src, n);
	w->len += n;
}

static void
put_u8(struct wbuf *w, uint8_t v)
{
	put_bytes(w, &v, 1);
}

static void
put_u16(struct wbuf *w, uint16_t v)
{
	uint8_t b[2] = { (uint8_t)v, (uint8_t)(v >> 8) };

	put_bytes(w, b, sizeof(b));
}

static void
put_u32(struct wbuf *w, uint32_t v)
{
	uint8_t b[4];

	for (int i = 0; i < 4; i++)
		b[i] = (uint8_t)(v >> (8 * i));
	put_bytes(w, b, sizeof(b));
}

static void
put_u64(struct wbuf *w, uint64_t v)
{
	uint8_t b[8];

	for (int i = 0; i < 8; i++)
		b[i] = (uint8_t)(v >> (8 * i));
	put_bytes(w, b, sizeof(b));
}

static void
put_f64(struct wbuf *w, double v)
{
	uint64_t bits;

	memcpy(&bits, &v, sizeof(bits));
	put_u64(w, bits);
}

static void
put_str(struct wbuf *w, const char *s)
{
	size_t n = strlen(s);

	if (n > UINT16_MAX) {
		w->overflow = true;
		return;
	}
	put_u16(w, (uint16_t)n);
	put_bytes(w, s, n);
}

static bool
need(struct rbuf *r, size_t n, const char *field)
{
	if (r->status != ZP_S_OK)
		return false;
	if (r->len - r->off < n) {
		r->status = ZP_S_TRUNCATED;
		r->field = field;
		return false;
	}
	return true;
}

static uint8_t
get_u8(struct rbuf *r, const char *field)
{
	if (!need(r, 1, field))
		return 0;
	return r->p[r->off++];
}

static uint64_t
get_le(struct rbuf *r, unsigned bytes, const char *field)
{
	uint64_t v = 0;

	if (!need(r, bytes, field))
		return 0;
	for (unsigned i = 0; i < bytes; i++)
		v |= (uint64_t)r->p[r->off + i] << (8 * i);
	r->off += bytes;
	return v;
}

static uint16_t
get_u16(struct rbuf *r, const char *field)
{
	return (uint16_t)get_le(r, 2, field);
}

static uint32_t
get_u32(struct rbuf *r, const char *field)
{
	return (uint32_t)get_le(r, 4, field);
}

static uint64_t
get_u64(struct rbuf *r, const char *field)
{
	return get_le(r, 8, field);
}

static double
get_f64(struct rbuf *r, const char *field)
{
	uint64_t bits = get_le(r, 8, field);
	double v;

	memcpy(&v, &bits, sizeof(v));
	return v;
}

static void
fail(struct rbuf *r, enum zp_status status, const char *field)
{
	if (r->status == ZP_S_OK) {
		r->status = status;
		r->field = field;
	}
}

/* Names are printable ASCII without NUL; an empty name is refused where min_len > 0. */
static void
get_str(struct rbuf *r, char *dst, size_t max_len, size_t min_len, const char *field)
{
	uint16_t n = get_u16(r, field);

	dst[0] = '\0';
	if (!need(r, n, field))
		return;
	if (n > max_len || n < min_len) {
		fail(r, ZP_S_STRING, field);
		return;
	}
	for (uint16_t i = 0; i < n; i++) {
		uint8_t c = r->p[r->off + i];

		if (c < 0x20 || c == 0x7f) {
			fail(r, ZP_S_STRING, field);
			return;
		}
	}
	memcpy(dst, r->p + r->off, n);
	dst[n] = '\0';
	r->off += n;
}

static void
check(struct rbuf *r, bool ok, const char *field)
{
	if (!ok)
		fail(r, ZP_S_VALUE, field);
}

static double
get_finite(struct rbuf *r, const char *field)
{
	double v = get_f64(r, field);

	check(r, isfinite(v), field);
	return v;
}

static void
encode_payload(const struct zp_msg *m, struct wbuf *w)
{
	switch (m->hdr.type) {
	case ZP_HELLO:
		put_str(w, m->u.hello.client_name);
		break;
	case ZP_JOB_OPEN:
		put_str(w, m->u.job_open.job_name);
		put_u32(w, m->u.job_open.rank);
		put_u32(w, m->u.job_open.world_size);
		put_u8(w, m->u.job_open.policy);
		put_u64(w, m->u.job_open.pinned_budget);
		put_str(w, m->u.job_open.state_format);
		break;
	case ZP_JOB_DROP:
		put_str(w, m->u.job_drop.job_name);
		break;
	case ZP_TENSOR_REGISTER:
		put_str(w, m->u.tensor_register.name);
		put_u64(w, m->u.tensor_register.numel);
		put_u8(w, m->u.tensor_register.grad_dtype);
		put_u8(w, m->u.tensor_register.param_dtype);
		put_u8(w, m->u.tensor_register.flags);
		break;
	case ZP_PARAM_FETCH:
	case ZP_PARAM_RELEASE:
		put_u32(w, m->u.handles.count);
		if (m->u.handles.count > ZP_MAX_STEP_TENSORS) {
			w->overflow = true;
			break;
		}
		for (uint32_t i = 0; i < m->u.handles.count; i++)
			put_u32(w, m->u.handles.handles[i]);
		break;
	case ZP_PARAM_READY:
		put_u32(w, m->u.param_ready.handle);
		put_u32(w, (uint32_t)m->u.param_ready.error);
		break;
	case ZP_TENSOR_UNREGISTER:
		put_u32(w, m->u.tensor_handle.handle);
		break;
	case ZP_TENSOR_SET_STEP:
		put_u32(w, m->u.tensor_step.handle);
		put_u64(w, m->u.tensor_step.step);
		break;
	case ZP_TENSOR_WRITE:
	case ZP_TENSOR_READ:
		put_u32(w, m->u.tensor_io.handle);
		put_u8(w, m->u.tensor_io.state);
		put_u64(w, m->u.tensor_io.offset);
		put_u64(w, m->u.tensor_io.count);
		break;
	case ZP_CKPT_WRITE:
	case ZP_CKPT_READ:
		put_u32(w, m->u.ckpt_write.handle);
		put_u64(w, m->u.ckpt_write.offset);
		put_u64(w, m->u.ckpt_write.count);
		put_u8(w, m->u.ckpt_write.format);
		for (unsigned i = 0; i < ZP_CKPT_ARRAYS; i++) {
			put_u64(w, m->u.ckpt_write.file_offset[i]);
			put_u32(w, m->u.ckpt_write.crc[i]);
		}
		break;
	case ZP_CKPT_DONE:
		for (unsigned i = 0; i < ZP_CKPT_ARRAYS; i++)
			put_u32(w, m->u.ckpt_done.crc[i]);
		put_u64(w, m->u.ckpt_done.last_step);
		break;
	case ZP_STEP_SUBMIT: {
		const struct zp_step_submit *s = &m->u.step_submit;

		put_u64(w, s->step);
		put_u8(w, s->optim);
		put_u8(w, s->flags);
		put_f64(w, s->lr);
		put_f64(w, s->beta1);
		put_f64(w, s->beta2);
		put_f64(w, s->eps);
		put_f64(w, s->weight_decay);
		put_f64(w, s->lr_decay);
		put_f64(w, s->grad_scale);
		put_f64(w, s->max_grad_norm);
		put_u32(w, s->count);
		if (s->count > ZP_MAX_STEP_TENSORS) {
			w->overflow = true;
			break;
		}
		for (uint32_t i = 0; i < s->count; i++)
			put_u32(w, s->handles[i]);
		break;
	}
	case ZP_GRAD_PASS:
		put_f64(w, m->u.grad_pass.grad_scale);
		put_u32(w, m->u.grad_pass.count);
		if (m->u.grad_pass.count > ZP_MAX_STEP_TENSORS) {
			w->overflow = true;
			break;
		}
		for (uint32_t i = 0; i < m->u.grad_pass.count; i++)
			put_u32(w, m->u.grad_pass.handles[i]);
		break;
	case ZP_GRAD_PARTIAL:
		put_f64(w, m->u.grad_partial.sumsq);
		put_u64(w, m->u.grad_partial.nonfinite);
		put_u64(w, m->u.grad_partial.elements);
		break;
	case ZP_ERROR:
		put_u32(w, (uint32_t)m->u.error.code);
		put_str(w, m->u.error.message);
		break;
	case ZP_HELLO_OK:
		put_u32(w, m->u.hello_ok.session_id);
		put_u32(w, m->u.hello_ok.uid);
		put_str(w, m->u.hello_ok.daemon_version);
		break;
	case ZP_JOB_OK:
		put_u64(w, m->u.job_ok.job_id);
		put_u64(w, m->u.job_ok.last_step);
		put_str(w, m->u.job_ok.state_format);
		break;
	case ZP_TENSOR_OK:
		put_u32(w, m->u.tensor_ok.handle);
		put_u64(w, m->u.tensor_ok.grad_bytes);
		put_u64(w, m->u.tensor_ok.param_bytes);
		put_u8(w, m->u.tensor_ok.resumed);
		put_u64(w, m->u.tensor_ok.last_step);
		break;
	case ZP_XFER_OK:
		put_u64(w, m->u.xfer_ok.bytes);
		break;
	case ZP_JSON:
		put_bytes(w, m->u.json.text, m->u.json.len);
		break;
	case ZP_JSON_FD:
		put_u64(w, m->u.json_fd.bytes);
		break;
	case ZP_TENSOR_DONE:
		put_u32(w, m->u.tensor_done.handle);
		put_u64(w, m->u.tensor_done.step);
		put_u8(w, m->u.tensor_done.status);
		put_u32(w, (uint32_t)m->u.tensor_done.error);
		break;
	case ZP_STEP_DONE:
		put_u64(w, m->u.step_done.step);
		put_u8(w, m->u.step_done.status);
		put_u32(w, (uint32_t)m->u.step_done.error);
		put_f64(w, m->u.step_done.grad_norm);
		put_u64(w, m->u.step_done.latency_ns);
		put_u32(w, m->u.step_done.count);
		break;
	default:
		/* PING, JOB_CLOSE, XFER_OPEN, STATS, JOBS, CKPT_RELEASE, OK, PONG: no payload */
		break;
	}
}

enum zp_status
zp_encode(const struct zp_msg *m, void *buf, size_t cap, size_t *ret_len)
{
	struct wbuf w = { .p = buf, .cap = cap };
	size_t payload;

	if (zp_type_name(m->hdr.type) == NULL)
		return ZP_S_TYPE;
	put_u32(&w, ZP_MAGIC);
	put_u16(&w, ZP_VERSION);
	put_u16(&w, m->hdr.type);
	put_u64(&w, m->hdr.request_id);
	put_u32(&w, 0);		/* payload_len, patched below */
	put_u32(&w, 0);
	encode_payload(m, &w);
	if (w.overflow)
		return ZP_S_NOSPACE;
	payload = w.len - ZP_HEADER_SIZE;
	if (payload > ZP_MAX_PAYLOAD)
		return ZP_S_LONG;
	for (int i = 0; i < 4; i++)
		w.p[16 + i] = (uint8_t)(payload >> (8 * i));
	*ret_len = w.len;
	return ZP_S_OK;
}

static void
decode_payload(struct rbuf *r, struct zp_msg *m)
{
	switch (m->hdr.type) {
	case ZP_HELLO:
		get_str(r, m->u.hello.client_name, ZP_NAME_MAX, 0, "client_name");
		break;
	case ZP_JOB_OPEN: {
		struct zp_job_open *j = &m->u.job_open;

		get_str(r, j->job_name, ZP_NAME_MAX, 1, "job_name");
		j->rank = get_u32(r, "rank");
		j->world_size = get_u32(r, "world_size");
		check(r, j->world_size >= 1 && j->world_size <= 65536, "world_size");
		check(r, j->rank < j->world_size, "rank");
		j->policy = get_u8(r, "policy");
		check(r, j->policy < ZP_POLICY_COUNT, "policy");
		j->pinned_budget = get_u64(r, "pinned_budget");
		get_str(r, j->state_format, ZP_FORMAT_MAX, 0, "state_format");
		break;
	}
	case ZP_JOB_DROP:
		get_str(r, m->u.job_drop.job_name, ZP_NAME_MAX, 1, "job_name");
		break;
	case ZP_TENSOR_REGISTER: {
		struct zp_tensor_register *t = &m->u.tensor_register;

		get_str(r, t->name, ZP_NAME_MAX, 1, "name");
		t->numel = get_u64(r, "numel");
		check(r, t->numel > 0 && t->numel <= (1ull << 40), "numel");
		t->grad_dtype = get_u8(r, "grad_dtype");
		check(r, t->grad_dtype < ZP_DTYPE_COUNT, "grad_dtype");
		t->param_dtype = get_u8(r, "param_dtype");
		check(r, t->param_dtype < ZP_DTYPE_COUNT, "param_dtype");
		t->flags = get_u8(r, "flags");
		check(r, (t->flags & ~ZP_TENSOR_FLAGS_ALL) == 0, "flags");
		break;
	}
	case ZP_PARAM_FETCH:
	case ZP_PARAM_RELEASE:
		m->u.handles.count = get_u32(r, "count");
		check(r, m->u.handles.count >= 1 && m->u.handles.count <= ZP_MAX_STEP_TENSORS,
		    "count");
		if (r->status != ZP_S_OK || !need(r, (size_t)m->u.handles.count * 4, "handles"))
			break;
		for (uint32_t i = 0; i < m->u.handles.count; i++)
			m->u.handles.handles[i] = get_u32(r, "handles");
		break;
	case ZP_PARAM_READY:
		m->u.param_ready.handle = get_u32(r, "handle");
		m->u.param_ready.error = (int32_t)get_u32(r, "error");
		break;
	case ZP_TENSOR_UNREGISTER:
		m->u.tensor_handle.handle = get_u32(r, "handle");
		break;
	case ZP_TENSOR_SET_STEP:
		m->u.tensor_step.handle = get_u32(r, "handle");
		m->u.tensor_step.step = get_u64(r, "step");
		break;
	case ZP_TENSOR_WRITE:
	case ZP_TENSOR_READ: {
		struct zp_tensor_io *io = &m->u.tensor_io;

		io->handle = get_u32(r, "handle");
		io->state = get_u8(r, "state");
		check(r, io->state < ZP_STATE_COUNT, "state");
		io->offset = get_u64(r, "offset");
		io->count = get_u64(r, "count");
		check(r, io->count > 0 && io->count <= ZP_MAX_XFER / sizeof(float), "count");
		break;
	}
	case ZP_STEP_SUBMIT: {
		struct zp_step_submit *s = &m->u.step_submit;

		s->step = get_u64(r, "step");
		check(r, s->step >= 1, "step");
		s->optim = get_u8(r, "optim");
		check(r, s->optim < ZP_OPTIM_COUNT, "optim");
		s->flags = get_u8(r, "flags");
		check(r, (s->flags & ~ZP_STEP_FLAGS_ALL) == 0, "flags");
		s->lr = get_finite(r, "lr");
		s->beta1 = get_finite(r, "beta1");
		s->beta2 = get_finite(r, "beta2");
		s->eps = get_finite(r, "eps");
		s->weight_decay = get_finite(r, "weight_decay");
		s->lr_decay = get_finite(r, "lr_decay");
		s->grad_scale = get_finite(r, "grad_scale");
		check(r, s->grad_scale > 0, "grad_scale");
		s->max_grad_norm = get_finite(r, "max_grad_norm");
		check(r, s->max_grad_norm >= 0, "max_grad_norm");
		/* A coefficient clips (or leaves alone); 0 would wipe the step out. */
		check(r, (s->flags & ZP_STEP_CLIP_COEF) == 0 ||
		    (s->max_grad_norm > 0 && s->max_grad_norm <= 1), "max_grad_norm");
		s->count = get_u32(r, "count");
		check(r, s->count >= 1 && s->count <= ZP_MAX_STEP_TENSORS, "count");
		if (r->status != ZP_S_OK)
			break;
		if (!need(r, (size_t)s->count * 4, "handles"))
			break;
		for (uint32_t i = 0; i < s->count; i++)
			s->handles[i] = get_u32(r, "handles");
		break;
	}
	case ZP_GRAD_PASS: {
		struct zp_grad_pass *g = &m->u.grad_pass;

		g->grad_scale = get_finite(r, "grad_scale");
		check(r, g->grad_scale > 0, "grad_scale");
		g->count = get_u32(r, "count");
		check(r, g->count >= 1 && g->count <= ZP_MAX_STEP_TENSORS, "count");
		if (r->status != ZP_S_OK)
			break;
		if (!need(r, (size_t)g->count * 4, "handles"))
			break;
		for (uint32_t i = 0; i < g->count; i++)
			g->handles[i] = get_u32(r, "handles");
		break;
	}
	case ZP_GRAD_PARTIAL:
		/* inf is a real answer (a gradient overflowed); NaN too, with nonfinite > 0. */
		m->u.grad_partial.sumsq = get_f64(r, "sumsq");
		check(r, !(m->u.grad_partial.sumsq < 0), "sumsq");
		m->u.grad_partial.nonfinite = get_u64(r, "nonfinite");
		m->u.grad_partial.elements = get_u64(r, "elements");
		break;
	case ZP_ERROR:
		m->u.error.code = (int32_t)get_u32(r, "code");
		get_str(r, m->u.error.message, ZP_ERRMSG_MAX, 0, "message");
		break;
	case ZP_HELLO_OK:
		m->u.hello_ok.session_id = get_u32(r, "session_id");
		m->u.hello_ok.uid = get_u32(r, "uid");
		get_str(r, m->u.hello_ok.daemon_version, ZP_NAME_MAX, 0, "daemon_version");
		break;
	case ZP_JOB_OK:
		m->u.job_ok.job_id = get_u64(r, "job_id");
		m->u.job_ok.last_step = get_u64(r, "last_step");
		get_str(r, m->u.job_ok.state_format, ZP_FORMAT_MAX, 0, "state_format");
		break;
	case ZP_TENSOR_OK:
		m->u.tensor_ok.handle = get_u32(r, "handle");
		m->u.tensor_ok.grad_bytes = get_u64(r, "grad_bytes");
		m->u.tensor_ok.param_bytes = get_u64(r, "param_bytes");
		m->u.tensor_ok.resumed = get_u8(r, "resumed");
		check(r, m->u.tensor_ok.resumed <= 1, "resumed");
		m->u.tensor_ok.last_step = get_u64(r, "last_step");
		break;
	case ZP_CKPT_WRITE:
	case ZP_CKPT_READ: {
		struct zp_ckpt_write *cw = &m->u.ckpt_write;

		cw->handle = get_u32(r, "handle");
		cw->offset = get_u64(r, "offset");
		cw->count = get_u64(r, "count");
		check(r, cw->count > 0 && cw->count <= 1ull << 40, "count");
		cw->format = get_u8(r, "format");
		check(r, cw->format <= 2, "format");
		for (unsigned i = 0; i < ZP_CKPT_ARRAYS; i++) {
			cw->file_offset[i] = get_u64(r, "file_offset");
			check(r, cw->file_offset[i] <= INT64_MAX - ZP_MAX_XFER, "file_offset");
			cw->crc[i] = get_u32(r, "crc");
		}
		break;
	}
	case ZP_CKPT_DONE:
		for (unsigned i = 0; i < ZP_CKPT_ARRAYS; i++)
			m->u.ckpt_done.crc[i] = get_u32(r, "crc");
		m->u.ckpt_done.last_step = get_u64(r, "last_step");
		break;
	case ZP_XFER_OK:
		m->u.xfer_ok.bytes = get_u64(r, "bytes");
		check(r, m->u.xfer_ok.bytes > 0 && m->u.xfer_ok.bytes <= ZP_MAX_XFER, "bytes");
		break;
	case ZP_JSON:
		m->u.json.text = (const char *)r->p + r->off;
		m->u.json.len = (uint32_t)(r->len - r->off);
		r->off = r->len;
		break;
	case ZP_JSON_FD:
		m->u.json_fd.bytes = get_u64(r, "bytes");
		check(r, m->u.json_fd.bytes > 0 && m->u.json_fd.bytes <= ZP_MAX_XFER, "bytes");
		break;
	case ZP_TENSOR_DONE:
		m->u.tensor_done.handle = get_u32(r, "handle");
		m->u.tensor_done.step = get_u64(r, "step");
		m->u.tensor_done.status = get_u8(r, "status");
		check(r, m->u.tensor_done.status < ZP_STEP_STATUS_COUNT, "status");
		m->u.tensor_done.error = (int32_t)get_u32(r, "error");
		break;
	case ZP_STEP_DONE:
		m->u.step_done.step = get_u64(r, "step");
		m->u.step_done.status = get_u8(r, "status");
		check(r, m->u.step_done.status < ZP_STEP_STATUS_COUNT, "status");
		m->u.step_done.error = (int32_t)get_u32(r, "error");
		m->u.step_done.grad_norm = get_f64(r, "grad_norm");
		m->u.step_done.latency_ns = get_u64(r, "latency_ns");
		m->u.step_done.count = get_u32(r, "count");
		break;
	default:
		break;
	}
	if (r->status == ZP_S_OK && r->off != r->len) {
		r->status = ZP_S_TRAILING;
		r->field = "payload";
	}
}

static enum zp_status
explain(enum zp_status status, char *why, size_t why_len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static enum zp_status
explain(enum zp_status status, char *why, size_t why_len, const char *fmt, ...)
{
	va_list ap;

	if (why != NULL && why_len > 0) {
		va_start(ap, fmt);
		vsnprintf(why, why_len, fmt, ap);
		va_end(ap);
	}
	return status;
}

enum zp_status
zp_decode(const void *buf, size_t len, struct zp_msg *m, char *why, size_t why_len)
{
	struct rbuf r = { .p = buf, .len = len };
	uint32_t magic, reserved;
	const char *name;

	if (len < ZP_HEADER_SIZE)
		return explain(ZP_S_SHORT, why, why_len,
		    "message of %zu bytes is shorter than the %d-byte header", len, ZP_HEADER_SIZE);
	if (len > ZP_MAX_MESSAGE)
		return explain(ZP_S_LONG, why, why_len,
		    "message of %zu bytes exceeds the %u-byte limit", len, ZP_MAX_MESSAGE);
	memset(&m->hdr, 0, sizeof(m->hdr));
	magic = get_u32(&r, "magic");
	m->hdr.version = get_u16(&r, "version");
	m->hdr.type = get_u16(&r, "type");
	m->hdr.request_id = get_u64(&r, "request_id");
	m->hdr.payload_len = get_u32(&r, "payload_len");
	reserved = get_u32(&r, "reserved");
	if (magic != ZP_MAGIC)
		return explain(ZP_S_MAGIC, why, why_len, "bad magic 0x%08x", magic);
	if (m->hdr.version != ZP_VERSION)
		return explain(ZP_S_VERSION, why, why_len,
		    "protocol version %u is not supported (this side speaks %u)",
		    m->hdr.version, ZP_VERSION);
	name = zp_type_name(m->hdr.type);
	if (name == NULL)
		return explain(ZP_S_TYPE, why, why_len, "unknown message type %u", m->hdr.type);
	if (reserved != 0)
		return explain(ZP_S_RESERVED, why, why_len, "%s: reserved header field is 0x%x",
		    name, reserved);
	if (m->hdr.payload_len != len - ZP_HEADER_SIZE)
		return explain(ZP_S_LENGTH, why, why_len,
		    "%s: header says %u payload bytes, message has %zu", name,
		    m->hdr.payload_len, len - ZP_HEADER_SIZE);
	decode_payload(&r, m);
	if (r.status != ZP_S_OK)
		return explain(r.status, why, why_len, "%s: %s: %s", name, r.field,
		    zp_status_str(r.status));
	return explain(ZP_S_OK, why, why_len, "ok");
}
