/* CUDA stand-in: device memory, host registration, streams that defer their work, events. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "standin_impl.h"

/*
 * When work runs.  Every copy, memset, kernel, collective and event record
 * is queued on its stream and runs only when the program waits for it, as
 * late as CUDA allows, so a missing wait shows up as stale data instead of
 * passing by luck:
 *   - cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize,
 *     cudaFree and cudaFreeHost (implicit device syncs) run what they wait for;
 *   - cudaEventQuery / cudaStreamQuery answer cudaErrorNotReady once per
 *     record while work is pending, and run it at the next query (a poll
 *     loop makes progress, a single peek sees nothing done);
 *   - cudaMemcpy to the host, and cudaMemcpyAsync to pageable host memory,
 *     return once their copy is done (and so whatever it depends on);
 *   - cudaMemcpy and cudaMemcpyAsync from pageable host memory copy the
 *     source into a staging buffer at the call and write the device later;
 *     from registered (pinned) memory they read it when the copy runs;
 *   - cudaMemset and device-to-device copies are queued on the legacy stream.
 * Ordering: the legacy stream (0) waits for all earlier work of the device's
 * blocking streams, and their later work waits for it; cudaStreamNonBlocking
 * streams are ordered with neither.  cudaStreamWaitEvent orders a stream
 * after an event's record.
 *
 * Misuse that CUDA would let corrupt memory silently is reported on stderr
 * and aborts: unmapping or unregistering host memory that is still
 * registered or that a queued copy uses.  Bad arguments (a range outside a
 * device allocation, a copy direction that does not match the pointers)
 * fail with cudaErrorInvalidValue and a line on stderr.
 *
 * One lock serialises the whole runtime, and queued work runs under it:
 * ranks of a multi-rank test are processes, one thread each.
 */

#define MAX_DEVICES 8

struct dep {
	struct CUstream_st *s;
	uint64_t seq;
};

/* One queued piece of work; owned by its stream until it has run. */
struct op {
	struct op *next;
	uint64_t seq;
	void (*fn)(void *arg);
	void (*drop)(void *arg);
	void *arg;
	/* Host memory the op touches when it runs (pinned copies): must stay mapped and registered. */
	const char *host;
	size_t host_len;
	int ndeps;
	struct dep deps[];
};

struct CUstream_st {
	struct CUstream_st *all_next;	/* every stream ever made; destroyed ones stay, emptied */
	int device;
	bool legacy, nonblocking, destroyed;
	struct op *head, *tail;
	uint64_t enq_seq, done_seq;	/* last queued, last run */
	int queries;
};

struct CUevent_st {
	struct CUstream_st *s;		/* of the last record, NULL before */
	uint64_t seq;
	unsigned flags;
	int queries;
	struct timespec when;		/* when the record ran */
};

struct devmem {
	struct devmem *next;
	char *base;
	size_t len;
	int device;
};

struct hostreg {
	struct hostreg *next;
	char *base;
	size_t len;
	unsigned flags;
	bool owned;			/* cudaMallocHost: freed by cudaFreeHost */
};

static pthread_mutex_t lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static struct CUstream_st legacy[MAX_DEVICES];
static struct CUstream_st *streams;
static struct devmem *devmems;
static struct hostreg *hostregs;
static __thread int cur_device;
static __thread cudaError_t last_error;

void
zs__die(const char *fmt, ...)
{
	va_list ap;

	fputs("cuda-standin: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	abort();
}

static cudaError_t
fail(cudaError_t e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static cudaError_t
fail(cudaError_t e, const char *fmt, ...)
{
	va_list ap;

	fputs("cuda-standin: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	last_error = e;
	return e;
}

cudaError_t
zs_set_error(cudaError_t err)
{
	if (err != cudaSuccess)
		last_error = err;
	return err;
}

static int
device_count(void)
{
	const char *s = getenv("ZS_CUDA_DEVICES");
	int n = s != NULL ? atoi(s) : 2;

	return n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

static void
init_legacy(void)
{
	static bool done;

	if (done)
		return;
	done = true;
	for (int d = 0; d < MAX_DEVICES; d++) {
		legacy[d].device = d;
		legacy[d].legacy = true;
		legacy[d].all_next = streams;
		streams = &legacy[d];
	}
}

static struct CUstream_st *
resolve(cudaStream_t s)
{
	init_legacy();
	return s != NULL ? s : &legacy[cur_device];
}

int
zs__current_device(void)
{
	return cur_device;
}

int
zs__stream_device(cudaStream_t s)
{
	int d;

	pthread_mutex_lock(&lock);
	d = resolve(s)->device;
	pthread_mutex_unlock(&lock);
	return d;
}

/* ---- Running queued work ---- */

static void
run_to(struct CUstream_st *s, uint64_t seq)
{
	while (s->done_seq < seq) {
		struct op *op = s->head;

		if (op == NULL)
			zs__die("internal: stream %p has no work up to %" PRIu64, (void *)s, seq);
		for (int i = 0; i < op->ndeps; i++)
			run_to(op->deps[i].s, op->deps[i].seq);
		s->head = op->next;
		if (s->head == NULL)
			s->tail = NULL;
		op->fn(op->arg);
		s->done_seq = op->seq;
		if (op->drop != NULL)
			op->drop(op->arg);
		free(op);
	}
}

static void
run_stream(struct CUstream_st *s)
{
	run_to(s, s->enq_seq);
}

/* Everything the legacy stream would wait for if work were queued on it now. */
static void
run_legacy_point(int device)
{
	for (struct CUstream_st *t = streams; t != NULL; t = t->all_next)
		if (t->device == device && !t->nonblocking)
			run_stream(t);
}

void
zs__run_all(void)
{
	pthread_mutex_lock(&lock);
	init_legacy();
	for (struct CUstream_st *t = streams; t != NULL; t = t->all_next)
		run_stream(t);
	pthread_mutex_unlock(&lock);
}

size_t
zs_pending(void)
{
	size_t n = 0;

	pthread_mutex_lock(&lock);
	init_legacy();
	for (struct CUstream_st *t = streams; t != NULL; t = t->all_next)
		n += (size_t)(t->enq_seq - t->done_seq);
	pthread_mutex_unlock(&lock);
	return n;
}

/* Queues op on s with the ordering CUDA gives s; returns its sequence number. */
static uint64_t
enqueue_after(struct CUstream_st *s, void (*fn)(void *), void (*drop)(void *), void *arg,
    const void *host, size_t host_len, const struct dep *extra)
{
	int nstreams = 0;
	struct op *op;

	for (struct CUstream_st *t = streams; t != NULL; t = t->all_next)
		nstreams++;
	op = calloc(1, sizeof(*op) + (size_t)(nstreams + 1) * sizeof(struct dep));
	if (op == NULL)
		zs__die("out of memory");
	op->fn = fn;
	op->drop = drop;
	op->arg = arg;
	op->host = host;
	op->host_len = host_len;
	if (s->legacy) {
		for (struct CUstream_st *t = streams; t != NULL; t = t->all_next)
			if (t != s && t->device == s->device && !t->nonblocking &&
			    t->enq_seq > t->done_seq)
				op->deps[op->ndeps++] = (struct dep){ t, t->enq_seq };
	} else if (!s->nonblocking) {
		struct CUstream_st *l = &legacy[s->device];

		if (l->enq_seq > l->done_seq)
			op->deps[op->ndeps++] = (struct dep){ l, l->enq_seq };
	}
	if (extra != NULL)
		op->deps[op->ndeps++] = *extra;
	op->seq = ++s->enq_seq;
	if (s->tail != NULL)
		s->tail->next = op;
	else
		s->head = op;
	s->tail = op;
	s->queries = 0;
	return op->seq;
}

static uint64_t
enqueue(struct CUstream_st *s, void (*fn)(void *), void (*drop)(void *), void *arg,
    const void *host, size_t host_len)
{
	return enqueue_after(s, fn, drop, arg, host, host_len, NULL);
}

cudaError_t
zs_enqueue(cudaStream_t stream, void (*fn)(void *), void (*drop)(void *), void *arg)
{
	struct CUstream_st *s;

	pthread_mutex_lock(&lock);
	s = resolve(stream);
	if (s->destroyed || s->device != cur_device) {
		pthread_mutex_unlock(&lock);
		if (drop != NULL)
			drop(arg);
		return fail(cudaErrorInvalidResourceHandle, "launch on %s",
		    s->destroyed ? "a destroyed stream" : "a stream of another device");
	}
	enqueue(s, fn, drop, arg, NULL, 0);
	pthread_mutex_unlock(&lock);
	return cudaSuccess;
}

static bool
overlaps(const char *a, size_t alen, const char *b, size_t blen)
{
	return a < b + blen && b < a + alen;
}

/* Dies when a queued op still uses [p, p + len) of host memory. */
static void
check_no_pending_use(const void *p, size_t len, const char *what)
{
	for (struct CUstream_st *t = streams; t != NULL; t = t->all_next)
		for (struct op *op = t->head; op != NULL; op = op->next)
			if (op->host_len > 0 && overlaps(op->host, op->host_len, p, len))
				zs__die("%s of host memory %p (+%zu) that a queued copy (stream %p) "
				    "still uses: wait for it first", what, p, len, (void *)t);
}

/* ---- Errors and devices ---- */

const char *
cudaGetErrorName(cudaError_t err)
{
	static const char *const names[] = {
#define N(x) [x] = #x
		N(cudaSuccess), N(cudaErrorInvalidValue), N(cudaErrorMemoryAllocation),
		N(cudaErrorInitializationError), N(cudaErrorLaunchFailure),
		N(cudaErrorLaunchTimeout), N(cudaErrorInvalidConfiguration),
		N(cudaErrorInvalidPitchValue), N(cudaErrorInvalidDevicePointer),
		N(cudaErrorInvalidMemcpyDirection), N(cudaErrorInsufficientDriver),
		N(cudaErrorNoDevice), N(cudaErrorInvalidDevice), N(cudaErrorDevicesUnavailable),
		N(cudaErrorNoKernelImageForDevice), N(cudaErrorInvalidResourceHandle),
		N(cudaErrorNotReady), N(cudaErrorHostMemoryAlreadyRegistered),
		N(cudaErrorHostMemoryNotRegistered), N(cudaErrorNotPermitted),
		N(cudaErrorNotSupported), N(cudaErrorUnknown),
#undef N
	};

	if ((unsigned)err < sizeof(names) / sizeof(names[0]) && names[err] != NULL)
		return names[err];
	return "cudaErrorUnknown";
}

const char *
cudaGetErrorString(cudaError_t err)
{
	return err == cudaSuccess ? "no error" : cudaGetErrorName(err);
}

cudaError_t
cudaGetLastError(void)
{
	cudaError_t e = last_error;

	last_error = cudaSuccess;
	return e;
}

cudaError_t
cudaPeekAtLastError(void)
{
	return last_error;
}

cudaError_t
cudaGetDeviceCount(int *count)
{
	if (count == NULL)
		return fail(cudaErrorInvalidValue, "cudaGetDeviceCount: NULL");
	*count = device_count();
	return *count > 0 ? cudaSuccess : fail(cudaErrorNoDevice, "ZS_CUDA_DEVICES=0");
}

cudaError_t
cudaGetDevice(int *device)
{
	if (device == NULL)
		return fail(cudaErrorInvalidValue, "cudaGetDevice: NULL");
	*device = cur_device;
	return cudaSuccess;
}

cudaError_t
cudaSetDevice(int device)
{
	if (device < 0 || device >= device_count())
		return fail(cudaErrorInvalidDevice, "cudaSetDevice(%d) of %d", device,
		    device_count());
	cur_device = device;
	return cudaSuccess;
}

cudaError_t
cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device)
{
	const char *no_ro = getenv("ZS_CUDA_NO_READONLY_REGISTER");

	if (value == NULL || device < 0 || device >= device_count())
		return fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: bad argument");
	if (attr != cudaDevAttrHostRegisterReadOnlySupported)
		return fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute %d",
		    (int)attr);
	*value = no_ro != NULL && no_ro[0] == '1' ? 0 : 1;
	return cudaSuccess;
}

cudaError_t
cudaDeviceSynchronize(void)
{
	pthread_mutex_lock(&lock);
	init_legacy();
	for (struct CUstream_st *t = streams; t != NULL; t = t->all_next)
		if (t->device == cur_device)
			run_stream(t);
	pthread_mutex_unlock(&lock);
	return cudaSuccess;
}

/* ---- Device memory ---- */

/* The allocation that holds p, or NULL. */
static struct devmem *
find_dev(const void *p)
{
	for (struct devmem *m = devmems; m != NULL; m = m->next)
		if ((const char *)p >= m->base && (const char *)p < m->base + m->len)
			return m;
	return NULL;
}

bool
zs__is_device_range(const void *p, size_t len)
{
	struct devmem *m;
	bool ok;

	pthread_mutex_lock(&lock);
	m = find_dev(p);
	ok = m != NULL && len <= (size_t)(m->base + m->len - (const char *)p);
	pthread_mutex_unlock(&lock);
	return ok;
}

cudaError_t
cudaMalloc(void **ptr, size_t size)
{
	struct devmem *m;

	if (ptr == NULL)
		return fail(cudaErrorInvalidValue, "cudaMalloc: NULL");
	if (size == 0) {
		*ptr = NULL;
		return cudaSuccess;
	}
	m = calloc(1, sizeof(*m));
	/* 256-byte aligned as cudaMalloc's; never zeroed: all-ones bytes read as NaN. */
	if (m == NULL || size > SIZE_MAX - 255 ||
	    (m->base = aligned_alloc(256, (size + 255) / 256 * 256)) == NULL) {
		free(m);
		return fail(cudaErrorMemoryAllocation, "cudaMalloc(%zu): out of memory", size);
	}
	memset(m->base, 0xff, size);
	m->len = size;
	m->device = cur_device;
	pthread_mutex_lock(&lock);
	m->next = devmems;
	devmems = m;
	pthread_mutex_unlock(&lock);
	*ptr = m->base;
	return cudaSuccess;
}

cudaError_t
cudaFree(void *ptr)
{
	struct devmem **pp, *m;

	if (ptr == NULL)
		return cudaSuccess;
	/* An implicit device synchronisation, as CUDA's. */
	zs__run_all();
	pthread_mutex_lock(&lock);
	for (pp = &devmems; *pp != NULL && (*pp)->base != ptr; pp = &(*pp)->next)
		;
	m = *pp;
	if (m == NULL) {
		pthread_mutex_unlock(&lock);
		return fail(cudaErrorInvalidDevicePointer, "cudaFree(%p): not a cudaMalloc "
		    "pointer (or freed twice)", ptr);
	}
	*pp = m->next;
	pthread_mutex_unlock(&lock);
	free(m->base);
	free(m);
	return cudaSuccess;
}

/* ---- Host memory: cudaMallocHost and registration ---- */

static struct hostreg *
find_reg_overlap(const void *p, size_t len)
{
	for (struct hostreg *h = hostregs; h != NULL; h = h->next)
		if (overlaps(h->base, h->len, p, len))
			return h;
	return NULL;
}

/* true when [p, p + len) lies inside one registered or cudaMallocHost range. */
static bool
is_pinned(const void *p, size_t len)
{
	for (struct hostreg *h = hostregs; h != NULL; h = h->next)
		if ((const char *)p >= h->base && (const char *)p < h->base + h->len &&
		    len <= (size_t)(h->base + h->len - (const char *)p))
			return true;
	return false;
}

cudaError_t
cudaMallocHost(void **ptr, size_t size)
{
	struct hostreg *h;

	if (ptr == NULL || size == 0)
		return fail(cudaErrorInvalidValue, "cudaMallocHost: bad argument");
	h = calloc(1, sizeof(*h));
	if (h == NULL || size > SIZE_MAX - 4095 ||
	    (h->base = aligned_alloc(4096, (size + 4095) / 4096 * 4096)) == NULL) {
		free(h);
		return fail(cudaErrorMemoryAllocation, "cudaMallocHost(%zu): out of memory", size);
	}
	h->len = size;
	h->owned = true;
	h->flags = cudaHostRegisterPortable;
	pthread_mutex_lock(&lock);
	h->next = hostregs;
	hostregs = h;
	pthread_mutex_unlock(&lock);
	*ptr = h->base;
	return cudaSuccess;
}

/* Removes the registration that starts at ptr and is (not) owned; NULL when there is none. */
static struct hostreg *
take_reg(void *ptr, bool owned)
{
	for (struct hostreg **pp = &hostregs; *pp != NULL; pp = &(*pp)->next) {
		struct hostreg *h = *pp;

		if (h->base == ptr && h->owned == owned) {
			*pp = h->next;
			return h;
		}
	}
	return NULL;
}

cudaError_t
cudaFreeHost(void *ptr)
{
	struct hostreg *h;

	if (ptr == NULL)
		return cudaSuccess;
	zs__run_all();
	pthread_mutex_lock(&lock);
	h = take_reg(ptr, true);
	pthread_mutex_unlock(&lock);
	if (h == NULL)
		return fail(cudaErrorInvalidValue, "cudaFreeHost(%p): not a cudaMallocHost pointer",
		    ptr);
	free(h->base);
	free(h);
	return cudaSuccess;
}

/*
 * Whether every page of [p, p + len) is mapped, and whether all of it is
 * writable, from /proc/self/maps: registration pins pages that exist, and
 * pages mapped read-only can only be registered with cudaHostRegisterReadOnly.
 */
static cudaError_t
check_mapping(const void *p, size_t len, bool *writable)
{
	uintptr_t want = (uintptr_t)p, end = (uintptr_t)p + len;
	char line[512];
	FILE *f = fopen("/proc/self/maps", "re");

	*writable = true;
	if (f == NULL)
		return cudaErrorUnknown;
	while (want < end && fgets(line, sizeof(line), f) != NULL) {
		uintptr_t lo, hi;
		char perms[8];

		if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %7s", &lo, &hi, perms) != 3)
			continue;
		if (hi <= want)
			continue;
		if (lo > want)
			break;
		if (perms[0] != 'r')
			break;
		if (perms[1] != 'w')
			*writable = false;
		want = hi;
	}
	fclose(f);
	return want >= end ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t
cudaHostRegister(void *ptr, size_t size, unsigned int flags)
{
	const unsigned known = cudaHostRegisterPortable | cudaHostRegisterMapped |
	    cudaHostRegisterIoMemory | cudaHostRegisterReadOnly;
	struct hostreg *h;
	bool writable;
	int ro = 0;

	if (ptr == NULL || size == 0 || (flags & ~known) != 0)
		return fail(cudaErrorInvalidValue, "cudaHostRegister(%p, %zu, 0x%x): bad argument",
		    ptr, size, flags);
	if (find_dev(ptr) != NULL)
		return fail(cudaErrorInvalidValue, "cudaHostRegister(%p): device memory", ptr);
	if (flags & cudaHostRegisterReadOnly) {
		(void)cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported,
		    cur_device);
		if (!ro)
			return fail(cudaErrorNotSupported, "cudaHostRegisterReadOnly: the device "
			    "cannot (ZS_CUDA_NO_READONLY_REGISTER)");
	}
	if (check_mapping(ptr, size, &writable) != cudaSuccess)
		return fail(cudaErrorInvalidValue, "cudaHostRegister(%p, %zu): not all mapped "
		    "and readable", ptr, size);
	if (!writable && !(flags & cudaHostRegisterReadOnly))
		return fail(cudaErrorInvalidValue, "cudaHostRegister(%p, %zu): read-only pages "
		    "need cudaHostRegisterReadOnly", ptr, size);
	pthread_mutex_lock(&lock);
	if (find_reg_overlap(ptr, size) != NULL) {
		pthread_mutex_unlock(&lock);
		return fail(cudaErrorHostMemoryAlreadyRegistered, "cudaHostRegister(%p, %zu): "
		    "overlaps a registered range", ptr, size);
	}
	h = calloc(1, sizeof(*h));
	if (h == NULL) {
		pthread_mutex_unlock(&lock);
		return fail(cudaErrorMemoryAllocation, "out of memory");
	}
	h->base = ptr;
	h->len = size;
	h->flags = flags;
	h->next = hostregs;
	hostregs = h;
	pthread_mutex_unlock(&lock);
	return cudaSuccess;
}

cudaError_t
cudaHostUnregister(void *ptr)
{
	struct hostreg *h;

	pthread_mutex_lock(&lock);
	h = take_reg(ptr, false);
	if (h != NULL)
		check_no_pending_use(h->base, h->len, "cudaHostUnregister");
	pthread_mutex_unlock(&lock);
	if (h == NULL)
		return fail(cudaErrorHostMemoryNotRegistered, "cudaHostUnregister(%p): not the "
		    "start of a registered range", ptr);
	free(h);
	return cudaSuccess;
}

/*
 * Interposes libc's munmap for the whole process (the stand-in is a shared
 * library loaded before libc): a registered range must be unregistered, and
 * no queued copy may use it, before its pages go.
 */
__attribute__((visibility("default"))) int munmap(void *addr, size_t len);

int
munmap(void *addr, size_t len)
{
	struct hostreg *h;

	pthread_mutex_lock(&lock);
	h = find_reg_overlap(addr, len);
	if (h != NULL)
		zs__die("munmap(%p, %zu) of memory still registered with cudaHostRegister "
		    "(%p, %zu): cudaHostUnregister first", addr, len, (void *)h->base, h->len);
	init_legacy();
	check_no_pending_use(addr, len, "munmap");
	pthread_mutex_unlock(&lock);
	return (int)syscall(SYS_munmap, addr, len);
}

/* ---- Copies and memsets ---- */

struct copy {
	void *dst;
	const void *src;
	size_t n;
	void *staging;		/* pageable source copied at the call */
	int value;		/* memset */
};

static void
copy_run(void *arg)
{
	struct copy *c = arg;

	memcpy(c->dst, c->staging != NULL ? c->staging : c->src, c->n);
}

static void
memset_run(void *arg)
{
	struct copy *c = arg;

	memset(c->dst, c->value, c->n);
}

static void
copy_drop(void *arg)
{
	struct copy *c = arg;

	free(c->staging);
	free(c);
}

static const char *const kind_names[] = {
	"HostToHost", "HostToDevice", "DeviceToHost", "DeviceToDevice", "Default",
};

/* -1 outside any allocation, 0 inside one but running past its end, 1 inside. */
static int
dev_range(const void *p, size_t n)
{
	struct devmem *m = find_dev(p);

	if (m == NULL)
		return -1;
	return n <= (size_t)(m->base + m->len - (const char *)p) ? 1 : 0;
}

static cudaError_t
do_copy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t stream,
    bool async, const char *what)
{
	struct CUstream_st *s;
	struct copy *c;
	int dd, sd;
	bool pinned;
	uint64_t seq;

	if ((unsigned)kind > cudaMemcpyDefault)
		return fail(cudaErrorInvalidMemcpyDirection, "%s: kind %d", what, (int)kind);
	if (n == 0)
		return cudaSuccess;
	if (dst == NULL || src == NULL)
		return fail(cudaErrorInvalidValue, "%s: NULL pointer", what);
	pthread_mutex_lock(&lock);
	s = resolve(stream);
	dd = dev_range(dst, n);
	sd = dev_range(src, n);
	if (dd == 0 || sd == 0) {
		pthread_mutex_unlock(&lock);
		return fail(cudaErrorInvalidValue, "%s of %zu bytes: the %s runs past the end of "
		    "its device allocation", what, n, dd == 0 ? "destination" : "source");
	}
	if (kind == cudaMemcpyDefault)
		kind = sd > 0 && dd > 0 ? cudaMemcpyDeviceToDevice : sd > 0 ?
		    cudaMemcpyDeviceToHost : dd > 0 ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost;
	if ((dd > 0) != (kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice) ||
	    (sd > 0) != (kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice)) {
		pthread_mutex_unlock(&lock);
		return fail(cudaErrorInvalidValue, "%s(%p <- %p, %zu, cudaMemcpy%s): the pointers "
		    "are %s to %s memory", what, dst, src, n, kind_names[kind],
		    sd > 0 ? "device" : "host", dd > 0 ? "device" : "host");
	}
	c = calloc(1, sizeof(*c));
	if (c == NULL)
		zs__die("out of memory");
	c->dst = dst;
	c->src = src;
	c->n = n;
	const void *host = kind == cudaMemcpyHostToDevice ? src :
	    kind == cudaMemcpyDeviceToHost ? dst : NULL;
	pinned = host != NULL && is_pinned(host, n);
	if (kind == cudaMemcpyHostToDevice && !pinned) {
		/* Staged at the call: the caller may reuse its buffer at once. */
		if (!async)
			run_legacy_point(s->device);
		c->staging = malloc(n);
		if (c->staging == NULL)
			zs__die("out of memory");
		memcpy(c->staging, src, n);
		host = NULL;
	}
	seq = enqueue(s, copy_run, copy_drop, c, pinned ? host : NULL, pinned ? n : 0);
	/* To the host: done before return, except async into pinned memory. */
	if (kind == cudaMemcpyHostToHost || (kind == cudaMemcpyDeviceToHost && (!async || !pinned)) ||
	    (kind == cudaMemcpyHostToDevice && pinned && !async))
		run_to(s, seq);
	pthread_mutex_unlock(&lock);
	return cudaSuccess;
}

cudaError_t
cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
	return do_copy(dst, src, count, kind, NULL, false, "cudaMemcpy");
}

cudaError_t
cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
    cudaStream_t stream)
{
	return do_copy(dst, src, count, kind, stream, true, "cudaMemcpyAsync");
}

static cudaError_t
do_memset(void *dev, int value, size_t count, cudaStream_t stream, const char *what)
{
	struct copy *c;
	int r;

	if (count == 0)
		return cudaSuccess;
	pthread_mutex_lock(&lock);
	r = dev_range(dev, count);
	if (r <= 0) {
		pthread_mutex_unlock(&lock);
		return fail(cudaErrorInvalidValue, "%s(%p, %zu): %s", what, dev, count,
		    r < 0 ? "not device memory" : "runs past the end of its allocation");
	}
	c = calloc(1, sizeof(*c));
	if (c == NULL)
		zs__die("out of memory");
	c->dst = dev;
	c->n = count;
	c->value = value;
	enqueue(resolve(stream), memset_run, copy_drop, c, NULL, 0);
	pthread_mutex_unlock(&lock);
	return cudaSuccess;
}

cudaError_t
cudaMemset(void *dev, int value, size_t count)
{
	return do_memset(dev, value, count, NULL, "cudaMemset");
}

cudaError_t
cudaMemsetAsync(void *dev, int value, size_t count, cudaStream_t stream)
{
	return do_memset(dev, value, count, stream, "cudaMemsetAsync");
}

/* ---- Streams ---- */

cudaError_t
cudaStreamCreate(cudaStream_t *stream)
{
	return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t
cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags)
{
	struct CUstream_st *s;

	if (stream == NULL || (flags & ~cudaStreamNonBlocking) != 0)
		return fail(cudaErrorInvalidValue, "cudaStreamCreateWithFlags: bad argument");
	s = calloc(1, sizeof(*s));
	if (s == NULL)
		return fail(cudaErrorMemoryAllocation, "out of memory");
	s->device = cur_device;
	s->nonblocking = flags & cudaStreamNonBlocking;
	pthread_mutex_lock(&lock);
	init_legacy();
	s->all_next = streams;
	streams = s;
	pthread_mutex_unlock(&lock);
	*stream = s;
	return cudaSuccess;
}

cudaError_t
cudaStreamDestroy(cudaStream_t stream)
{
	if (stream == NULL)
		return fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy(0)");
	/* Queued work still completes; the stream itself stays (emptied) for older dependencies. */
	pthread_mutex_lock(&lock);
	if (stream->destroyed) {
		pthread_mutex_unlock(&lock);
		return fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: destroyed twice");
	}
	run_stream(stream);
	stream->destroyed = true;
	pthread_mutex_unlock(&lock);
	return cudaSuccess;
}

cudaError_t
cudaStreamSynchronize(cudaStream_t stream)
{
	struct CUstream_st *s;

	pthread_mutex_lock(&lock);
	s = resolve(stream);
	if (s->legacy)
		run_legacy_point(s->device);
	run_stream(s);
	pthread_mutex_unlock(&lock);
	return cudaSuccess;
}

cudaError_t
cudaStreamQuery(cudaStream_t stream)
{
	struct CUstream_st *s;
	cudaError_t e = cudaSuccess;

	pthread_mutex_lock(&lock);
	s = resolve(stream);
	if (s->done_seq < s->enq_seq) {
		if (s->queries++ == 0)
			e = cudaErrorNotReady;
		else
			run_stream(s);
	}
	pthread_mutex_unlock(&lock);
	return e;
}

static void
noop(void *arg)
{
	(void)arg;
}

cudaError_t
cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags)
{
	struct CUstream_st *s;

	if (event == NULL || flags != 0)
		return fail(cudaErrorInvalidValue, "cudaStreamWaitEvent: bad argument");
	pthread_mutex_lock(&lock);
	s = resolve(stream);
	/* A no-op that every later piece of work on s queues behind. */
	if (event->s != NULL && event->s->done_seq < event->seq) {
		struct dep d = { event->s, event->seq };

		enqueue_after(s, noop, NULL, NULL, NULL, 0, &d);
	}
	pthread_mutex_unlock(&lock);
	return cudaSuccess;
}

/* ---- Events ---- */

cudaError_t
cudaEventCreate(cudaEvent_t *event)
{
	return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t
cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags)
{
	if (event == NULL || (flags & ~(cudaEventBlockingSync | cudaEventDisableTiming)) != 0)
		return fail(cudaErrorInvalidValue, "cudaEventCreateWithFlags: bad argument");
	*event = calloc(1, sizeof(**event));
	if (*event == NULL)
		return fail(cudaErrorMemoryAllocation, "out of memory");
	(*event)->flags = flags;
	return cudaSuccess;
}

cudaError_t
cudaEventDestroy(cudaEvent_t event)
{
	if (event == NULL)
		return fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy(NULL)");
	/* Its record may still be queued: let it run now rather than into freed memory. */
	pthread_mutex_lock(&lock);
	if (event->s != NULL)
		run_to(event->s, event->seq);
	pthread_mutex_unlock(&lock);
	free(event);
	return cudaSuccess;
}

struct record {
	cudaEvent_t ev;
	uint64_t seq;
};

static void
record_run(void *arg)
{
	struct record *r = arg;

	/* A later record replaced this one: its time is the one that counts. */
	if (r->ev->seq == r->seq)
		clock_gettime(CLOCK_MONOTONIC, &r->ev->when);
}

cudaError_t
cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
{
	struct CUstream_st *s;
	struct record *r;

	if (event == NULL)
		return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord(NULL)");
	r = calloc(1, sizeof(*r));
	if (r == NULL)
		return fail(cudaErrorMemoryAllocation, "out of memory");
	pthread_mutex_lock(&lock);
	s = resolve(stream);
	/* The old record, if still queued, must not outlive the event: run it first. */
	if (event->s != NULL && event->s != s)
		run_to(event->s, event->seq);
	r->ev = event;
	r->seq = s->enq_seq + 1;
	event->s = s;
	event->seq = enqueue(s, record_run, free, r, NULL, 0);
	event->queries = 0;
	pthread_mutex_unlock(&lock);
	return cudaSuccess;
}

cudaError_t
cudaEventQuery(cudaEvent_t event)
{
	cudaError_t e = cudaSuccess;

	if (event == NULL)
		return fail(cudaErrorInvalidResourceHandle, "cudaEventQuery(NULL)");
	pthread_mutex_lock(&lock);
	if (event->s != NULL && event->s->done_seq < event->seq) {
		if (event->queries++ == 0)
			e = cudaErrorNotReady;
		else
			run_to(event->s, event->seq);
	}
	pthread_mutex_unlock(&lock);
	return e;
}

cudaError_t
cudaEventSynchronize(cudaEvent_t event)
{
	if (event == NULL)
		return fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize(NULL)");
	pthread_mutex_lock(&lock);
	if (event->s != NULL)
		run_to(event->s, event->seq);
	pthread_mutex_unlock(&lock);
	return cudaSuccess;
}

cudaError_t
cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
	if (ms == NULL || start == NULL || end == NULL)
		return fail(cudaErrorInvalidValue, "cudaEventElapsedTime: NULL");
	if ((start->flags | end->flags) & cudaEventDisableTiming)
		return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: an event made "
		    "with cudaEventDisableTiming");
	if (start->s == NULL || end->s == NULL)
		return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: never recorded");
	pthread_mutex_lock(&lock);
	bool done = start->s->done_seq >= start->seq && end->s->done_seq >= end->seq;
	pthread_mutex_unlock(&lock);
	if (!done)
		return cudaErrorNotReady;
	*ms = (float)((double)(end->when.tv_sec - start->when.tv_sec) * 1e3 +
	    (double)(end->when.tv_nsec - start->when.tv_nsec) / 1e6);
	return cudaSuccess;
}
