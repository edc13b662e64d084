/* CUDA stand-in: streams that defer their work, events, errors and devices (memory.c: memory). */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
 *     loop makes progress, a single peek sees nothing done).  Both extremes
 *     are a knob away, counted in queries, never in time:
 *     ZS_CUDA_QUERY_PENDING=N answers N times (0: the first query runs the
 *     work and succeeds), =never leaves the work to a wait; and a record
 *     answered cudaErrorNotReady more than ZS_CUDA_QUERY_SPIN times (default
 *     10000) aborts as a busy-wait;
 *   - cudaMemcpy to the host, and cudaMemcpyAsync to pageable host memory,
 *     return once their copy is done (and so whatever it depends on);
 *   - cudaMemcpy and cudaMemcpyAsync from pageable host memory copy the
 *     source into a staging buffer at the call and write the device later;
 *     from registered (pinned) memory they read it when the copy runs (a
 *     synchronous cudaMemcpy from pageable memory first runs what the legacy
 *     stream waits for, as CUDA's "stream sync before the copy");
 *   - cudaMemset, and cudaMemcpy between device buffers, return at once:
 *     queued on the legacy stream.
 * Ordering: the legacy stream (0) waits for all earlier work of the device's
 * blocking streams, and their later work waits for it; cudaStreamNonBlocking
 * streams are ordered with neither.  cudaStreamWaitEvent orders a stream
 * after an event's record.
 *
 * Misuse that CUDA would let corrupt memory silently is reported on stderr
 * and aborts (memory.c): unmapping or unregistering host memory that is
 * still registered or that a queued copy uses.  Bad arguments (a range outside a
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

pthread_mutex_t zs__lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static struct CUstream_st legacy[MAX_DEVICES];
static struct CUstream_st *streams;
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

cudaError_t
zs__fail(cudaError_t e, const char *fmt, ...)
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

int
zs__device_count(void)
{
	const char *s = getenv("ZS_CUDA_DEVICES");
	int n = s != NULL ? atoi(s) : 2;

	return n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

void
zs__init_legacy(void)
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

struct CUstream_st *
zs__resolve(cudaStream_t s)
{
	zs__init_legacy();
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

	pthread_mutex_lock(&zs__lock);
	d = zs__resolve(s)->device;
	pthread_mutex_unlock(&zs__lock);
	return d;
}

/* ---- Running queued work ---- */

void
zs__run_to(struct CUstream_st *s, uint64_t seq)
{
	while (s->done_seq < seq) {
		struct op *op = s->head;

		if (op == NULL)
			zs__die("internal: stream %p has no work up to %" PRIu64, (void *)s, seq);
		for (int i = 0; i < op->ndeps; i++)
			zs__run_to(op->deps[i].s, op->deps[i].seq);
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
	zs__run_to(s, s->enq_seq);
}

/* Everything the legacy stream would wait for if work were queued on it now. */
void
zs__run_legacy_point(int device)
{
	for (struct CUstream_st *t = streams; t != NULL; t = t->all_next)
		if (t->device == device && !t->nonblocking)
			run_stream(t);
}

void
zs__run_all(void)
{
	pthread_mutex_lock(&zs__lock);
	zs__init_legacy();
	for (struct CUstream_st *t = streams; t != NULL; t = t->all_next)
		run_stream(t);
	pthread_mutex_unlock(&zs__lock);
}

size_t
zs_pending(void)
{
	size_t n = 0;

	pthread_mutex_lock(&zs__lock);
	zs__init_legacy();
	for (struct CUstream_st *t = streams; t != NULL; t = t->all_next)
		n += (size_t)(t->enq_seq - t->done_seq);
	pthread_mutex_unlock(&zs__lock);
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

uint64_t
zs__enqueue(struct CUstream_st *s, void (*fn)(void *), void (*drop)(void *), void *arg,
    const void *host, size_t host_len)
{
	return enqueue_after(s, fn, drop, arg, host, host_len, NULL);
}

cudaError_t
zs_enqueue(cudaStream_t stream, void (*fn)(void *), void (*drop)(void *), void *arg)
{
	struct CUstream_st *s;

	pthread_mutex_lock(&zs__lock);
	s = zs__resolve(stream);
	if (s->destroyed || s->device != cur_device) {
		pthread_mutex_unlock(&zs__lock);
		if (drop != NULL)
			drop(arg);
		return zs__fail(cudaErrorInvalidResourceHandle, "launch on %s",
		    s->destroyed ? "a destroyed stream" : "a stream of another device");
	}
	zs__enqueue(s, fn, drop, arg, NULL, 0);
	pthread_mutex_unlock(&zs__lock);
	return cudaSuccess;
}

bool
zs__overlaps(const char *a, size_t alen, const char *b, size_t blen)
{
	return a < b + blen && b < a + alen;
}

/* Dies when a queued op still uses [p, p + len) of host memory. */
void
zs__check_no_pending_use(const void *p, size_t len, const char *what)
{
	for (struct CUstream_st *t = streams; t != NULL; t = t->all_next)
		for (struct op *op = t->head; op != NULL; op = op->next)
			if (op->host_len > 0 && zs__overlaps(op->host, op->host_len, p, len))
				zs__die("%s of host memory %p (+%zu) that a queued copy (stream %p) "
				    "still uses: wait for it first", what, p, len, (void *)t);
}

/*
 * Whether a query of pending work answers cudaErrorNotReady (*queries counts
 * the answers since the record) or runs it; see "When work runs".
 */
static bool
query_not_ready(int *queries, const char *what)
{
	const char *knob = getenv("ZS_CUDA_QUERY_PENDING"), *spin = getenv("ZS_CUDA_QUERY_SPIN");
	long pending = 1, limit = 10000;

	if (knob != NULL && strcmp(knob, "never") == 0)
		pending = -1;
	else if (knob != NULL && knob[0] != '\0')
		pending = atol(knob);
	if (spin != NULL && spin[0] != '\0')
		limit = atol(spin);
	if (pending >= 0 && *queries >= pending)
		return false;
	if (++*queries > limit)
		zs__die("%s answered cudaErrorNotReady %d times for one record: a busy-wait (wait "
		    "with cudaEventSynchronize or cudaStreamSynchronize; ZS_CUDA_QUERY_SPIN)", what,
		    *queries - 1);
	return true;
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
		return zs__fail(cudaErrorInvalidValue, "cudaGetDeviceCount: NULL");
	*count = zs__device_count();
	return *count > 0 ? cudaSuccess : zs__fail(cudaErrorNoDevice, "ZS_CUDA_DEVICES=0");
}

cudaError_t
cudaGetDevice(int *device)
{
	if (device == NULL)
		return zs__fail(cudaErrorInvalidValue, "cudaGetDevice: NULL");
	*device = cur_device;
	return cudaSuccess;
}

cudaError_t
cudaSetDevice(int device)
{
	if (device < 0 || device >= zs__device_count())
		return zs__fail(cudaErrorInvalidDevice, "cudaSetDevice(%d) of %d", device,
		    zs__device_count());
	cur_device = device;
	return cudaSuccess;
}

cudaError_t
cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device)
{
	const char *no_ro = getenv("ZS_CUDA_NO_READONLY_REGISTER");

	if (value == NULL || device < 0 || device >= zs__device_count())
		return zs__fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: bad argument");
	if (attr != cudaDevAttrHostRegisterReadOnlySupported)
		return zs__fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute %d",
		    (int)attr);
	*value = no_ro != NULL && no_ro[0] == '1' ? 0 : 1;
	return cudaSuccess;
}

cudaError_t
cudaDeviceSynchronize(void)
{
	pthread_mutex_lock(&zs__lock);
	zs__init_legacy();
	for (struct CUstream_st *t = streams; t != NULL; t = t->all_next)
		if (t->device == cur_device)
			run_stream(t);
	pthread_mutex_unlock(&zs__lock);
	return cudaSuccess;
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
		return zs__fail(cudaErrorInvalidValue, "cudaStreamCreateWithFlags: bad argument");
	s = calloc(1, sizeof(*s));
	if (s == NULL)
		return zs__fail(cudaErrorMemoryAllocation, "out of memory");
	s->device = cur_device;
	s->nonblocking = flags & cudaStreamNonBlocking;
	pthread_mutex_lock(&zs__lock);
	zs__init_legacy();
	s->all_next = streams;
	streams = s;
	pthread_mutex_unlock(&zs__lock);
	*stream = s;
	return cudaSuccess;
}

cudaError_t
cudaStreamDestroy(cudaStream_t stream)
{
	if (stream == NULL)
		return zs__fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy(0)");
	/* Queued work still completes; the stream itself stays (emptied) for older dependencies. */
	pthread_mutex_lock(&zs__lock);
	if (stream->destroyed) {
		pthread_mutex_unlock(&zs__lock);
		return zs__fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: destroyed twice");
	}
	run_stream(stream);
	stream->destroyed = true;
	pthread_mutex_unlock(&zs__lock);
	return cudaSuccess;
}

cudaError_t
cudaStreamSynchronize(cudaStream_t stream)
{
	struct CUstream_st *s;

	pthread_mutex_lock(&zs__lock);
	s = zs__resolve(stream);
	if (s->legacy)
		zs__run_legacy_point(s->device);
	run_stream(s);
	pthread_mutex_unlock(&zs__lock);
	return cudaSuccess;
}

cudaError_t
cudaStreamQuery(cudaStream_t stream)
{
	struct CUstream_st *s;
	cudaError_t e = cudaSuccess;

	pthread_mutex_lock(&zs__lock);
	s = zs__resolve(stream);
	if (s->done_seq < s->enq_seq) {
		if (query_not_ready(&s->queries, "cudaStreamQuery"))
			e = cudaErrorNotReady;
		else
			run_stream(s);
	}
	pthread_mutex_unlock(&zs__lock);
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
		return zs__fail(cudaErrorInvalidValue, "cudaStreamWaitEvent: bad argument");
	pthread_mutex_lock(&zs__lock);
	s = zs__resolve(stream);
	/* A no-op that every later piece of work on s queues behind. */
	if (event->s != NULL && event->s->done_seq < event->seq) {
		struct dep d = { event->s, event->seq };

		enqueue_after(s, noop, NULL, NULL, NULL, 0, &d);
	}
	pthread_mutex_unlock(&zs__lock);
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
		return zs__fail(cudaErrorInvalidValue, "cudaEventCreateWithFlags: bad argument");
	*event = calloc(1, sizeof(**event));
	if (*event == NULL)
		return zs__fail(cudaErrorMemoryAllocation, "out of memory");
	(*event)->flags = flags;
	return cudaSuccess;
}

cudaError_t
cudaEventDestroy(cudaEvent_t event)
{
	if (event == NULL)
		return zs__fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy(NULL)");
	/* Its record may still be queued: let it run now rather than into freed memory. */
	pthread_mutex_lock(&zs__lock);
	if (event->s != NULL)
		zs__run_to(event->s, event->seq);
	pthread_mutex_unlock(&zs__lock);
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
		return zs__fail(cudaErrorInvalidResourceHandle, "cudaEventRecord(NULL)");
	r = calloc(1, sizeof(*r));
	if (r == NULL)
		return zs__fail(cudaErrorMemoryAllocation, "out of memory");
	pthread_mutex_lock(&zs__lock);
	s = zs__resolve(stream);
	/* The old record, if still queued, must not outlive the event: run it first. */
	if (event->s != NULL && event->s != s)
		zs__run_to(event->s, event->seq);
	r->ev = event;
	r->seq = s->enq_seq + 1;
	event->s = s;
	event->seq = zs__enqueue(s, record_run, free, r, NULL, 0);
	event->queries = 0;
	pthread_mutex_unlock(&zs__lock);
	return cudaSuccess;
}

cudaError_t
cudaEventQuery(cudaEvent_t event)
{
	cudaError_t e = cudaSuccess;

	if (event == NULL)
		return zs__fail(cudaErrorInvalidResourceHandle, "cudaEventQuery(NULL)");
	pthread_mutex_lock(&zs__lock);
	if (event->s != NULL && event->s->done_seq < event->seq) {
		if (query_not_ready(&event->queries, "cudaEventQuery"))
			e = cudaErrorNotReady;
		else
			zs__run_to(event->s, event->seq);
	}
	pthread_mutex_unlock(&zs__lock);
	return e;
}

cudaError_t
cudaEventSynchronize(cudaEvent_t event)
{
	if (event == NULL)
		return zs__fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize(NULL)");
	pthread_mutex_lock(&zs__lock);
	if (event->s != NULL)
		zs__run_to(event->s, event->seq);
	pthread_mutex_unlock(&zs__lock);
	return cudaSuccess;
}

cudaError_t
cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
	if (ms == NULL || start == NULL || end == NULL)
		return zs__fail(cudaErrorInvalidValue, "cudaEventElapsedTime: NULL");
	if ((start->flags | end->flags) & cudaEventDisableTiming)
		return zs__fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: an event made "
		    "with cudaEventDisableTiming");
	if (start->s == NULL || end->s == NULL)
		return zs__fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: never recorded");
	pthread_mutex_lock(&zs__lock);
	bool done = start->s->done_seq >= start->seq && end->s->done_seq >= end->seq;
	pthread_mutex_unlock(&zs__lock);
	if (!done)
		return cudaErrorNotReady;
	*ms = (float)((double)(end->when.tv_sec - start->when.tv_sec) * 1e3 +
	    (double)(end->when.tv_nsec - start->when.tv_nsec) / 1e6);
	return cudaSuccess;
}
