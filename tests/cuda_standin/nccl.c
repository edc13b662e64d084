/* NCCL stand-in: communicators and collectives across the processes of one test, in shared memory. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "convert.h"
#include "nccl.h"
#include "standin_impl.h"

/*
 * ncclGetUniqueId makes a sparse file in $TMPDIR and puts its path in the id;
 * every rank maps it.  The file holds a header (a process-shared lock and
 * condition, who joined, the collective in progress) and one slot per rank
 * into which that rank copies its contribution.  A collective queued on a
 * stream runs when a synchronisation reaches it: it waits until the previous
 * collective is finished everywhere, deposits its input, waits for every
 * rank's, checks that all ranks called the same collective with the same
 * count, datatype and reduction (or aborts, naming the difference), and
 * computes its own output from the slots: reductions in rank order in
 * double (int64/uint64 for integers), rounded once to the datatype.
 */

#define MAX_RANKS 8
#define HDR_BYTES 4096

enum coll_kind { ALL_GATHER = 1, REDUCE_SCATTER, ALL_REDUCE };

static const char *const kind_names[] = { "", "ncclAllGather", "ncclReduceScatter",
	"ncclAllReduce" };

struct coll_desc {
	int kind;
	size_t count;
	int dtype;
	int op;
};

struct shared {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int nranks;
	int joined;
	unsigned joined_mask;
	int device[MAX_RANKS];
	uint64_t done;		/* collectives every rank has finished */
	int arrived, departed;
	struct coll_desc desc[MAX_RANKS];
	size_t slot_bytes;
};

struct ncclComm {
	struct shared *sh;
	size_t map_bytes;
	int rank, nranks, device;
	uint64_t mine;		/* collectives this rank has run */
};

struct coll {
	ncclComm_t comm;
	struct coll_desc d;
	const void *send;
	void *recv;
	size_t send_bytes;
};

static __thread char lasterr[512];

static ncclResult_t
nfail(ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static ncclResult_t
nfail(ncclResult_t r, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(lasterr, sizeof(lasterr), fmt, ap);
	va_end(ap);
	fprintf(stderr, "nccl-standin: %s\n", lasterr);
	return r;
}

const char *
ncclGetErrorString(ncclResult_t result)
{
	switch (result) {
	case ncclSuccess: return "no error";
	case ncclUnhandledCudaError: return "unhandled cuda error";
	case ncclSystemError: return "unhandled system error";
	case ncclInternalError: return "internal error";
	case ncclInvalidArgument: return "invalid argument";
	case ncclInvalidUsage: return "invalid usage";
	case ncclRemoteError: return "remote process exited or there was a network error";
	case ncclInProgress: return "NCCL operation in progress";
	default: return "unknown result code";
	}
}

const char *
ncclGetLastError(ncclComm_t comm)
{
	(void)comm;
	return lasterr;
}

static size_t
dtype_size(int dt)
{
	switch (dt) {
	case ncclInt8: case ncclUint8: return 1;
	case ncclFloat16: case ncclBfloat16: return 2;
	case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
	case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
	default: return 0;
	}
}

static size_t
slot_bytes(void)
{
	const char *s = getenv("ZS_NCCL_SLOT_MB");
	long mb = s != NULL ? atol(s) : 64;

	return (size_t)(mb < 1 ? 1 : mb) << 20;
}

ncclResult_t
ncclGetUniqueId(ncclUniqueId *id)
{
	const char *dir = getenv("TMPDIR");
	pthread_mutexattr_t ma;
	pthread_condattr_t ca;
	struct shared *sh;
	size_t slot = slot_bytes();
	int fd;

	if (id == NULL)
		return nfail(ncclInvalidArgument, "ncclGetUniqueId: NULL");
	memset(id, 0, sizeof(*id));
	if (snprintf(id->internal, sizeof(id->internal), "%s/zs-nccl-XXXXXX",
	    dir != NULL && dir[0] != '\0' ? dir : "/tmp") >= (int)sizeof(id->internal))
		return nfail(ncclSystemError, "ncclGetUniqueId: $TMPDIR is too long");
	fd = mkstemp(id->internal);
	if (fd < 0)
		return nfail(ncclSystemError, "ncclGetUniqueId: %s: %s", id->internal,
		    strerror(errno));
	if (ftruncate(fd, (off_t)(HDR_BYTES + MAX_RANKS * slot)) != 0 ||
	    (sh = mmap(NULL, HDR_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) ==
	    MAP_FAILED) {
		int e = errno;

		close(fd);
		unlink(id->internal);
		return nfail(ncclSystemError, "ncclGetUniqueId: %s", strerror(e));
	}
	close(fd);
	pthread_mutexattr_init(&ma);
	pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
	pthread_mutex_init(&sh->mu, &ma);
	pthread_condattr_init(&ca);
	pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&sh->cv, &ca);
	sh->slot_bytes = slot;
	munmap(sh, HDR_BYTES);
	return ncclSuccess;
}

/*
 * Waits on the shared condition; dies after $ZS_NCCL_TIMEOUT_S (default 120)
 * without news: a rank died or never made the matching call.
 */
static void
shared_wait(struct ncclComm *c, const char *what)
{
	const char *env = getenv("ZS_NCCL_TIMEOUT_S");
	long limit = env != NULL && atol(env) > 0 ? atol(env) : 120;
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	t.tv_sec += limit;
	if (pthread_cond_timedwait(&c->sh->cv, &c->sh->mu, &t) != ETIMEDOUT)
		return;
	pthread_mutex_unlock(&c->sh->mu);
	zs__die("rank %d of %d waited %ld s in %s for the other ranks", c->rank, c->nranks,
	    limit, what);
}

ncclResult_t
ncclCommInitRank(ncclComm_t *ret, int nranks, ncclUniqueId id, int rank)
{
	struct ncclComm *c;
	struct shared *sh;
	size_t bytes;
	int fd;

	if (ret == NULL || nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks)
		return nfail(ncclInvalidArgument, "ncclCommInitRank: rank %d of %d (the stand-in "
		    "has at most %d)", rank, nranks, MAX_RANKS);
	id.internal[sizeof(id.internal) - 1] = '\0';
	fd = open(id.internal, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return nfail(ncclInvalidArgument, "ncclCommInitRank: id %s: %s (used after every "
		    "rank joined?)", id.internal, strerror(errno));
	bytes = HDR_BYTES + MAX_RANKS * slot_bytes();
	sh = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (sh == MAP_FAILED)
		return nfail(ncclSystemError, "ncclCommInitRank: mmap: %s", strerror(errno));
	if (sh->slot_bytes != slot_bytes()) {
		munmap(sh, bytes);
		return nfail(ncclInvalidUsage, "ncclCommInitRank: ZS_NCCL_SLOT_MB differs between "
		    "ranks");
	}
	c = calloc(1, sizeof(*c));
	if (c == NULL) {
		munmap(sh, bytes);
		return nfail(ncclSystemError, "out of memory");
	}
	*c = (struct ncclComm){ .sh = sh, .map_bytes = bytes, .rank = rank, .nranks = nranks,
		.device = zs__current_device() };
	pthread_mutex_lock(&sh->mu);
	if (sh->nranks == 0)
		sh->nranks = nranks;
	const char *bad = sh->nranks != nranks ? "ranks disagree on nranks" :
	    sh->joined_mask & 1u << rank ? "rank joined twice" : NULL;
	for (int r = 0; bad == NULL && r < nranks; r++)
		if (sh->joined_mask & 1u << r && sh->device[r] == c->device)
			bad = "Duplicate GPU detected: two ranks on one device";
	if (bad != NULL) {
		int device = c->device;

		pthread_mutex_unlock(&sh->mu);
		munmap(sh, bytes);
		free(c);
		return nfail(ncclInvalidUsage, "ncclCommInitRank(rank %d of %d, device %d): %s",
		    rank, nranks, device, bad);
	}
	sh->joined_mask |= 1u << rank;
	sh->device[rank] = c->device;
	if (++sh->joined == nranks) {
		/* Everyone has the mapping: the name can go. */
		unlink(id.internal);
		pthread_cond_broadcast(&sh->cv);
	}
	while (sh->joined < nranks)
		shared_wait(c, "ncclCommInitRank");
	pthread_mutex_unlock(&sh->mu);
	*ret = c;
	return ncclSuccess;
}

ncclResult_t
ncclCommDestroy(ncclComm_t c)
{
	if (c == NULL)
		return nfail(ncclInvalidArgument, "ncclCommDestroy(NULL)");
	/* Collectives still queued finish first, as NCCL's do. */
	zs__run_all();
	munmap(c->sh, c->map_bytes);
	free(c);
	return ncclSuccess;
}

ncclResult_t
ncclCommCount(const ncclComm_t c, int *count)
{
	if (c == NULL || count == NULL)
		return nfail(ncclInvalidArgument, "ncclCommCount: NULL");
	*count = c->nranks;
	return ncclSuccess;
}

ncclResult_t
ncclCommUserRank(const ncclComm_t c, int *rank)
{
	if (c == NULL || rank == NULL)
		return nfail(ncclInvalidArgument, "ncclCommUserRank: NULL");
	*rank = c->rank;
	return ncclSuccess;
}

/* ---- Arithmetic ---- */

union val {
	double f;
	int64_t i;
	uint64_t u;
};

static bool
is_float(int dt)
{
	return dt == ncclFloat16 || dt == ncclBfloat16 || dt == ncclFloat32 || dt == ncclFloat64;
}

static union val
load(int dt, const char *p, size_t i)
{
	union val v = { 0 };

	switch (dt) {
	case ncclInt8: v.i = ((const int8_t *)p)[i]; break;
	case ncclUint8: v.u = ((const uint8_t *)p)[i]; break;
	case ncclInt32: v.i = ((const int32_t *)p)[i]; break;
	case ncclUint32: v.u = ((const uint32_t *)p)[i]; break;
	case ncclInt64: v.i = ((const int64_t *)p)[i]; break;
	case ncclUint64: v.u = ((const uint64_t *)p)[i]; break;
	case ncclFloat16: v.f = zk__f16_to_f32(((const uint16_t *)p)[i]); break;
	case ncclBfloat16: v.f = zk__bf16_to_f32(((const uint16_t *)p)[i]); break;
	case ncclFloat32: v.f = ((const float *)p)[i]; break;
	default: v.f = ((const double *)p)[i]; break;
	}
	return v;
}

static void
store(int dt, char *p, size_t i, union val v)
{
	switch (dt) {
	case ncclInt8: ((int8_t *)p)[i] = (int8_t)v.i; break;
	case ncclUint8: ((uint8_t *)p)[i] = (uint8_t)v.u; break;
	case ncclInt32: ((int32_t *)p)[i] = (int32_t)v.i; break;
	case ncclUint32: ((uint32_t *)p)[i] = (uint32_t)v.u; break;
	case ncclInt64: ((int64_t *)p)[i] = v.i; break;
	case ncclUint64: ((uint64_t *)p)[i] = v.u; break;
	case ncclFloat16: ((uint16_t *)p)[i] = zk__f32_to_f16((float)v.f); break;
	case ncclBfloat16: ((uint16_t *)p)[i] = zk__f32_to_bf16((float)v.f); break;
	case ncclFloat32: ((float *)p)[i] = (float)v.f; break;
	default: ((double *)p)[i] = v.f; break;
	}
}

static bool
is_signed(int dt)
{
	return dt == ncclInt8 || dt == ncclInt32 || dt == ncclInt64;
}

static union val
combine(int dt, int op, union val a, union val b)
{
	if (is_float(dt)) {
		switch (op) {
		case ncclProd: a.f *= b.f; break;
		case ncclMax: a.f = b.f > a.f || a.f != a.f ? b.f : a.f; break;
		case ncclMin: a.f = b.f < a.f || a.f != a.f ? b.f : a.f; break;
		default: a.f += b.f; break;
		}
	} else if (is_signed(dt)) {
		switch (op) {
		case ncclProd: a.i = (int64_t)((uint64_t)a.i * (uint64_t)b.i); break;
		case ncclMax: a.i = b.i > a.i ? b.i : a.i; break;
		case ncclMin: a.i = b.i < a.i ? b.i : a.i; break;
		default: a.i = (int64_t)((uint64_t)a.i + (uint64_t)b.i); break;
		}
	} else {
		switch (op) {
		case ncclProd: a.u *= b.u; break;
		case ncclMax: a.u = b.u > a.u ? b.u : a.u; break;
		case ncclMin: a.u = b.u < a.u ? b.u : a.u; break;
		default: a.u += b.u; break;
		}
	}
	return a;
}

/* out[i] = the reduction over ranks of slot_r[first + i], i < count. */
static void
reduce(struct ncclComm *c, const struct coll_desc *d, size_t first, char *out)
{
	const char *base = (const char *)c->sh + HDR_BYTES;

	for (size_t i = 0; i < d->count; i++) {
		union val acc = load(d->dtype, base, first + i);

		for (int r = 1; r < c->nranks; r++)
			acc = combine(d->dtype, d->op, acc,
			    load(d->dtype, base + (size_t)r * c->sh->slot_bytes, first + i));
		if (d->op == ncclAvg) {
			if (is_float(d->dtype))
				acc.f /= c->nranks;
			else if (is_signed(d->dtype))
				acc.i /= c->nranks;
			else
				acc.u /= (uint64_t)c->nranks;
		}
		store(d->dtype, out, i, acc);
	}
}

static void
coll_run(void *arg)
{
	struct coll *x = arg;
	struct ncclComm *c = x->comm;
	struct shared *sh = c->sh;
	const char *what = kind_names[x->d.kind];
	char *base = (char *)sh + HDR_BYTES;

	pthread_mutex_lock(&sh->mu);
	while (sh->done != c->mine)
		shared_wait(c, what);
	memcpy(base + (size_t)c->rank * sh->slot_bytes, x->send, x->send_bytes);
	sh->desc[c->rank] = x->d;
	if (++sh->arrived == c->nranks)
		pthread_cond_broadcast(&sh->cv);
	while (sh->arrived < c->nranks)
		shared_wait(c, what);
	for (int r = 0; r < c->nranks; r++) {
		const struct coll_desc *o = &sh->desc[r];

		if (o->kind == x->d.kind && o->count == x->d.count && o->dtype == x->d.dtype &&
		    o->op == x->d.op)
			continue;
		/* Unlocked first: the other ranks find the same and abort too. */
		pthread_mutex_unlock(&sh->mu);
		zs__die("collective %llu: rank %d called %s(count %zu, datatype %d, op %d), "
		    "rank %d %s(count %zu, datatype %d, op %d)",
		    (unsigned long long)c->mine, c->rank, what, x->d.count, x->d.dtype,
		    x->d.op, r, kind_names[o->kind], o->count, o->dtype, o->op);
	}
	pthread_mutex_unlock(&sh->mu);

	switch (x->d.kind) {
	case ALL_GATHER:
		for (int r = 0; r < c->nranks; r++)
			memcpy((char *)x->recv + (size_t)r * x->send_bytes,
			    base + (size_t)r * sh->slot_bytes, x->send_bytes);
		break;
	case REDUCE_SCATTER:
		reduce(c, &x->d, (size_t)c->rank * x->d.count, x->recv);
		break;
	default:
		reduce(c, &x->d, 0, x->recv);
		break;
	}

	pthread_mutex_lock(&sh->mu);
	if (++sh->departed == c->nranks) {
		sh->arrived = 0;
		sh->departed = 0;
		sh->done++;
		pthread_cond_broadcast(&sh->cv);
	}
	c->mine++;
	pthread_mutex_unlock(&sh->mu);
}

static ncclResult_t
enqueue_coll(int kind, const void *send, void *recv, size_t count, ncclDataType_t dt,
    ncclRedOp_t op, ncclComm_t c, cudaStream_t stream)
{
	const char *what = kind_names[kind];
	size_t es = dtype_size(dt), send_n, recv_n;
	struct coll *x;

	if (c == NULL)
		return nfail(ncclInvalidArgument, "%s: comm is NULL", what);
	if (es == 0 || (unsigned)dt >= ncclNumTypes)
		return nfail(ncclInvalidArgument, "%s: invalid datatype %d", what, (int)dt);
	if ((unsigned)op >= ncclNumOps)
		return nfail(ncclInvalidArgument, "%s: invalid reduction %d", what, (int)op);
	send_n = kind == REDUCE_SCATTER ? count * (size_t)c->nranks : count;
	recv_n = kind == ALL_GATHER ? count * (size_t)c->nranks : count;
	if (count == 0)
		return ncclSuccess;
	if (send == NULL || recv == NULL)
		return nfail(ncclInvalidArgument, "%s: %s is NULL", what,
		    send == NULL ? "sendbuff" : "recvbuff");
	if (!zs__is_device_range(send, send_n * es))
		return nfail(ncclInvalidArgument, "%s: sendbuff %p is not device memory of %zu "
		    "bytes", what, send, send_n * es);
	if (!zs__is_device_range(recv, recv_n * es))
		return nfail(ncclInvalidArgument, "%s: recvbuff %p is not device memory of %zu "
		    "bytes", what, recv, recv_n * es);
	/* In place means exactly this rank's piece of the larger buffer; any other overlap is wrong. */
	const char *s = send, *r = recv;
	bool in_place = (kind == ALL_GATHER && s == r + (size_t)c->rank * count * es) ||
	    (kind == REDUCE_SCATTER && r == s + (size_t)c->rank * count * es) ||
	    (kind == ALL_REDUCE && s == r);
	if (!in_place && s < r + recv_n * es && r < s + send_n * es)
		return nfail(ncclInvalidArgument, "%s: sendbuff and recvbuff overlap without "
		    "being in place", what);
	if (send_n * es > c->sh->slot_bytes)
		return nfail(ncclInvalidUsage, "%s: %zu bytes per rank exceed the stand-in's slot "
		    "(ZS_NCCL_SLOT_MB)", what, send_n * es);
	if (zs__stream_device(stream) != c->device)
		return nfail(ncclInvalidUsage, "%s: stream of device %d, communicator of device %d",
		    what, zs__stream_device(stream), c->device);
	x = calloc(1, sizeof(*x));
	if (x == NULL)
		return nfail(ncclSystemError, "out of memory");
	*x = (struct coll){ .comm = c, .d = { kind, count, dt, op }, .send = send, .recv = recv,
		.send_bytes = send_n * es };
	if (zs_enqueue(stream, coll_run, free, x) != cudaSuccess)
		return nfail(ncclUnhandledCudaError, "%s: cannot queue on the stream", what);
	return ncclSuccess;
}

ncclResult_t
ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
    ncclComm_t comm, cudaStream_t stream)
{
	return enqueue_coll(ALL_GATHER, sendbuff, recvbuff, sendcount, datatype, ncclSum, comm,
	    stream);
}

ncclResult_t
ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
    ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
	return enqueue_coll(REDUCE_SCATTER, sendbuff, recvbuff, recvcount, datatype, op, comm,
	    stream);
}

ncclResult_t
ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
    ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
	return enqueue_coll(ALL_REDUCE, sendbuff, recvbuff, count, datatype, op, comm, stream);
}
