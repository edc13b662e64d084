/* The CUDA stand-in itself: when queued work runs, ordering between streams, memory checks, NCCL. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "convert.h"

/*
 * These pin down the semantics the other CUDA tests rely on to catch missing
 * synchronisation: if the stand-in ran work early, a forgotten wait would
 * pass here as it may pass on a GPU by luck.
 */

#define CUDA_OK(call) do {						\
	cudaError_t e_ = (call);					\
	cr_assert_eq(e_, cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_)); \
} while (0)

static void *
dev_alloc(size_t bytes)
{
	void *p = NULL;

	CUDA_OK(cudaMalloc(&p, bytes));
	return p;
}

Test(streams, work_waits_for_a_synchronisation)
{
	cudaStream_t s;
	uint32_t *pinned, *d = dev_alloc(64);

	CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	CUDA_OK(cudaMallocHost((void **)&pinned, 64));
	memset(pinned, 0x11, 64);
	CUDA_OK(cudaMemsetAsync(d, 0, 64, s));
	CUDA_OK(cudaMemcpyAsync(pinned, d, 64, cudaMemcpyDeviceToHost, s));
	cr_assert_eq(zs_pending(), 2, "queued work ran before anything waited for it");
	cr_assert_eq(pinned[0], 0x11111111u);
	CUDA_OK(cudaStreamSynchronize(s));
	cr_assert_eq(zs_pending(), 0);
	cr_assert_eq(pinned[0], 0);
	CUDA_OK(cudaStreamDestroy(s));
	CUDA_OK(cudaFree(d));
	CUDA_OK(cudaFreeHost(pinned));
}

Test(streams, pinned_copies_read_the_host_when_they_run_pageable_at_the_call)
{
	cudaStream_t s;
	uint32_t *pinned, pageable = 1, got = 0, *d = dev_alloc(8);

	CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	CUDA_OK(cudaMallocHost((void **)&pinned, 4));
	*pinned = 1;
	CUDA_OK(cudaMemcpyAsync(d, pinned, 4, cudaMemcpyHostToDevice, s));
	CUDA_OK(cudaMemcpyAsync(d + 1, &pageable, 4, cudaMemcpyHostToDevice, s));
	*pinned = 2;
	pageable = 2;
	CUDA_OK(cudaStreamSynchronize(s));
	CUDA_OK(cudaMemcpy(&got, d, 4, cudaMemcpyDeviceToHost));
	cr_assert_eq(got, 2, "a pinned source is read when the copy runs");
	CUDA_OK(cudaMemcpy(&got, d + 1, 4, cudaMemcpyDeviceToHost));
	cr_assert_eq(got, 1, "a pageable source is staged at the call (%u)", got);
	CUDA_OK(cudaStreamDestroy(s));
	CUDA_OK(cudaFree(d));
	CUDA_OK(cudaFreeHost(pinned));
}

/* A legacy-stream memset, then a device-to-host copy on a stream of the given flags. */
static uint32_t
after_legacy_memset(unsigned flags)
{
	cudaStream_t s;
	uint32_t *pinned, v, *d = dev_alloc(4);

	CUDA_OK(cudaStreamCreateWithFlags(&s, flags));
	CUDA_OK(cudaMallocHost((void **)&pinned, 4));
	CUDA_OK(cudaMemset(d, 0, 4));
	CUDA_OK(cudaMemcpyAsync(pinned, d, 4, cudaMemcpyDeviceToHost, s));
	CUDA_OK(cudaStreamSynchronize(s));
	v = *pinned;
	CUDA_OK(cudaStreamDestroy(s));
	CUDA_OK(cudaFree(d));
	CUDA_OK(cudaFreeHost(pinned));
	return v;
}

Test(streams, blocking_streams_wait_for_the_legacy_stream)
{
	cr_assert_eq(after_legacy_memset(cudaStreamDefault), 0);
}

Test(streams, non_blocking_streams_do_not)
{
	/* cudaMalloc'd memory starts as all-ones bytes; the memset has not run. */
	cr_assert_eq(after_legacy_memset(cudaStreamNonBlocking), 0xffffffffu);
}

Test(streams, the_legacy_stream_waits_for_blocking_streams)
{
	cudaStream_t s;
	uint32_t got = 7, *d = dev_alloc(4);

	CUDA_OK(cudaStreamCreate(&s));
	CUDA_OK(cudaMemsetAsync(d, 0, 4, s));
	/* cudaMemcpy is on the legacy stream: it runs the blocking stream's memset first. */
	CUDA_OK(cudaMemcpy(&got, d, 4, cudaMemcpyDeviceToHost));
	cr_assert_eq(got, 0);
	CUDA_OK(cudaStreamDestroy(s));
	CUDA_OK(cudaFree(d));
}

Test(events, query_says_not_ready_then_runs_the_work)
{
	cudaStream_t s;
	cudaEvent_t e;
	uint32_t *d = dev_alloc(4);

	CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
	cr_assert_eq(cudaEventQuery(e), cudaSuccess, "never recorded: complete");
	CUDA_OK(cudaMemsetAsync(d, 0, 4, s));
	CUDA_OK(cudaEventRecord(e, s));
	cr_assert_eq(cudaEventQuery(e), cudaErrorNotReady);
	cr_assert_eq(cudaGetLastError(), cudaSuccess, "not ready is not an error");
	cr_assert_eq(cudaEventQuery(e), cudaSuccess);
	cr_assert_eq(zs_pending(), 0);
	CUDA_OK(cudaEventDestroy(e));
	CUDA_OK(cudaStreamDestroy(s));
	CUDA_OK(cudaFree(d));
}

Test(events, stream_wait_event_orders_two_streams)
{
	cudaStream_t a, b;
	cudaEvent_t e;
	uint32_t *pinned, *d = dev_alloc(4);

	CUDA_OK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
	CUDA_OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
	CUDA_OK(cudaEventCreate(&e));
	CUDA_OK(cudaMallocHost((void **)&pinned, 4));
	CUDA_OK(cudaMemsetAsync(d, 0x22, 4, a));
	CUDA_OK(cudaEventRecord(e, a));
	CUDA_OK(cudaStreamWaitEvent(b, e, 0));
	CUDA_OK(cudaMemcpyAsync(pinned, d, 4, cudaMemcpyDeviceToHost, b));
	CUDA_OK(cudaStreamSynchronize(b));
	cr_assert_eq(*pinned, 0x22222222u);
	CUDA_OK(cudaEventDestroy(e));
	CUDA_OK(cudaStreamDestroy(a));
	CUDA_OK(cudaStreamDestroy(b));
	CUDA_OK(cudaFree(d));
	CUDA_OK(cudaFreeHost(pinned));
}

Test(memory, bounds_and_directions_are_checked)
{
	char host[64] = { 0 };
	char *d = dev_alloc(32), *d2 = dev_alloc(32);

	cr_assert_eq(cudaMemcpy(d, host, 33, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
	cr_assert_eq(cudaMemcpy(host, d + 16, 17, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
	cr_assert_eq(cudaMemset(d + 1, 0, 32), cudaErrorInvalidValue);
	cr_assert_eq(cudaMemcpy(host, d, 8, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
	cr_assert_eq(cudaMemcpy(d, host, 8, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
	cr_assert_eq(cudaMemcpy(d, host, 8, cudaMemcpyDeviceToDevice), cudaErrorInvalidValue);
	cr_assert_eq(cudaMemset(host, 0, 8), cudaErrorInvalidValue);
	cr_assert_eq(cudaGetLastError(), cudaErrorInvalidValue);
	cr_assert_eq(cudaGetLastError(), cudaSuccess);
	CUDA_OK(cudaMemcpy(d, host, 32, cudaMemcpyDefault));
	CUDA_OK(cudaMemcpy(d2, d, 32, cudaMemcpyDefault));
	CUDA_OK(cudaFree(d));
	cr_assert_eq(cudaFree(d), cudaErrorInvalidDevicePointer);
	cr_assert_eq(cudaMemcpy(host, d, 8, cudaMemcpyDeviceToHost), cudaErrorInvalidValue,
	    "freed memory is host memory again");
	CUDA_OK(cudaFree(d2));
}

Test(memory, host_register_flags_and_overlaps)
{
	size_t pg = (size_t)sysconf(_SC_PAGESIZE);
	char *rw = mmap(NULL, 4 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	char *ro = mmap(NULL, pg, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	cr_assert(rw != MAP_FAILED && ro != MAP_FAILED);
	cr_assert_eq(cudaHostRegister(rw, 2 * pg, 0x100), cudaErrorInvalidValue);
	CUDA_OK(cudaHostRegister(rw, 2 * pg, cudaHostRegisterPortable));
	cr_assert_eq(cudaHostRegister(rw + pg, 2 * pg, 0), cudaErrorHostMemoryAlreadyRegistered);
	CUDA_OK(cudaHostRegister(rw + 2 * pg, 2 * pg, cudaHostRegisterPortable));
	cr_assert_eq(cudaHostUnregister(rw + pg), cudaErrorHostMemoryNotRegistered);
	/* Read-only pages: only as read-only, and only where the device can. */
	cr_assert_eq(cudaHostRegister(ro, pg, cudaHostRegisterPortable), cudaErrorInvalidValue);
	CUDA_OK(cudaHostRegister(ro, pg, cudaHostRegisterPortable | cudaHostRegisterReadOnly));
	CUDA_OK(cudaHostUnregister(ro));
	setenv("ZS_CUDA_NO_READONLY_REGISTER", "1", 1);
	cr_assert_eq(cudaHostRegister(ro, pg, cudaHostRegisterReadOnly), cudaErrorNotSupported);
	unsetenv("ZS_CUDA_NO_READONLY_REGISTER");
	/* Pages that are not mapped cannot be pinned. */
	CUDA_OK(cudaHostUnregister(rw + 2 * pg));
	cr_assert_eq(munmap(rw + 3 * pg, pg), 0);
	cr_assert_eq(cudaHostRegister(rw + 2 * pg, 2 * pg, 0), cudaErrorInvalidValue);
	CUDA_OK(cudaHostUnregister(rw));
	cr_assert_eq(munmap(rw, 3 * pg), 0);
	cr_assert_eq(munmap(ro, pg), 0);
}

/* Runs fn in a child; returns the signal that ended it, 0 for a normal exit. */
static int
child_signal(void (*fn)(void))
{
	int status;
	pid_t pid;

	fflush(NULL);
	pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		/* The abort is the expected outcome: no core file. */
		signal(SIGABRT, SIG_DFL);
		fn();
		_exit(0);
	}
	cr_assert_eq(waitpid(pid, &status, 0), pid);
	return WIFSIGNALED(status) ? WTERMSIG(status) : 0;
}

static void
unmap_registered(void)
{
	char *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);

	if (cudaHostRegister(p, 4096, 0) != cudaSuccess)
		_exit(3);
	munmap(p, 4096);
}

static void
unregister_with_copy_queued(void)
{
	char *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	void *d = NULL;
	cudaStream_t s;

	if (cudaHostRegister(p, 4096, 0) != cudaSuccess || cudaMalloc(&d, 4096) != cudaSuccess ||
	    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
	    cudaMemcpyAsync(p, d, 4096, cudaMemcpyDeviceToHost, s) != cudaSuccess)
		_exit(3);
	cudaHostUnregister(p);
}

Test(memory, unmapping_or_unregistering_too_early_aborts)
{
	cr_assert_eq(child_signal(unmap_registered), SIGABRT);
	cr_assert_eq(child_signal(unregister_with_copy_queued), SIGABRT);
}

static void
nothing(void *arg)
{
	(void)arg;
}

Test(kernels, launch_on_a_stream_of_another_device_fails)
{
	cudaStream_t s;

	/* A stream belongs to the device current at its creation. */
	CUDA_OK(cudaSetDevice(1));
	CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	CUDA_OK(cudaSetDevice(0));
	/* Refused work is dropped (freed) at once. */
	cr_assert_eq(zs_enqueue(s, nothing, free, malloc(1)), cudaErrorInvalidResourceHandle);
	CUDA_OK(cudaSetDevice(1));
	CUDA_OK(cudaStreamDestroy(s));
	CUDA_OK(cudaSetDevice(0));
}

/* ---- NCCL across processes ---- */

#define NRANKS 3

static int
rank_body(ncclUniqueId id, int rank)
{
	ncclComm_t comm;
	cudaStream_t s;
	const size_t n = 1000;
	float *f_send, *f_recv, host[NRANKS * 1000];
	uint16_t *b_send, *b_recv, bhost[1000];
	int nr = 0, me = -1;

	if (cudaSetDevice(rank) != cudaSuccess || ncclCommInitRank(&comm, NRANKS, id, rank) !=
	    ncclSuccess || ncclCommCount(comm, &nr) != ncclSuccess || nr != NRANKS ||
	    ncclCommUserRank(comm, &me) != ncclSuccess || me != rank)
		return 10;
	cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
	cudaMalloc((void **)&f_send, NRANKS * n * 4);
	cudaMalloc((void **)&f_recv, NRANKS * n * 4);
	cudaMalloc((void **)&b_send, NRANKS * n * 2);
	cudaMalloc((void **)&b_recv, n * 2);
	for (size_t i = 0; i < NRANKS * n; i++)
		host[i] = (float)(rank * 100000 + (int)i);
	cudaMemcpyAsync(f_send, host, n * 4, cudaMemcpyHostToDevice, s);
	/* All-gather: rank r's n elements land at r * n everywhere. */
	if (ncclAllGather(f_send, f_recv, n, ncclFloat32, comm, s) != ncclSuccess)
		return 11;
	cudaMemcpyAsync(host, f_recv, NRANKS * n * 4, cudaMemcpyDeviceToHost, s);
	cudaStreamSynchronize(s);
	for (int r = 0; r < NRANKS; r++)
		for (size_t i = 0; i < n; i++)
			if (host[r * n + i] != (float)(r * 100000 + (int)i))
				return 12;
	/* Reduce-scatter, average in bf16: element k of rank r's piece is (r*n + k) * (rank + 1). */
	uint16_t bsrc[NRANKS * 1000];

	for (size_t i = 0; i < NRANKS * n; i++)
		bsrc[i] = zk__f32_to_bf16((float)((int)(i % 64) * (rank + 1)));
	cudaMemcpyAsync(b_send, bsrc, sizeof(bsrc), cudaMemcpyHostToDevice, s);
	if (ncclReduceScatter(b_send, b_recv, n, ncclBfloat16, ncclAvg, comm, s) != ncclSuccess)
		return 13;
	cudaMemcpyAsync(bhost, b_recv, n * 2, cudaMemcpyDeviceToHost, s);
	cudaStreamSynchronize(s);
	for (size_t k = 0; k < n; k++) {
		float v = (float)(int)((rank * n + k) % 64);

		/* mean of v * 1, v * 2, v * 3 = 2v, exact in bf16 for these small integers */
		if (bhost[k] != zk__f32_to_bf16(2 * v))
			return 14;
	}
	/* Bad arguments fail at the call, as NCCL's checks do. */
	if (ncclAllGather(f_send, f_recv, n, (ncclDataType_t)42, comm, s) != ncclInvalidArgument ||
	    ncclReduceScatter(b_send, b_recv, n, ncclBfloat16, (ncclRedOp_t)9, comm, s) !=
	    ncclInvalidArgument ||
	    ncclAllGather(host, f_recv, n, ncclFloat32, comm, s) != ncclInvalidArgument ||
	    ncclAllGather(f_send, f_recv, n + 1, ncclFloat32, comm, s) != ncclInvalidArgument ||
	    ncclReduceScatter(f_send, f_send + 1, n, ncclFloat32, ncclSum, comm, s) !=
	    ncclInvalidArgument)
		return 15;
	/* In place is allowed: this rank's piece of the receive buffer. */
	if (ncclAllGather(f_recv + rank * n, f_recv, n, ncclFloat32, comm, s) != ncclSuccess)
		return 16;
	cudaStreamSynchronize(s);
	if (ncclCommDestroy(comm) != ncclSuccess)
		return 17;
	return 0;
}

/* Forks NRANKS ranks running body; returns each one's exit status (or 128 + signal). */
static void
run_ranks(int (*body)(ncclUniqueId, int), int *status)
{
	ncclUniqueId id;
	pid_t pids[NRANKS];

	cr_assert_eq(ncclGetUniqueId(&id), ncclSuccess);
	fflush(NULL);
	for (int r = 0; r < NRANKS; r++) {
		pids[r] = fork();
		cr_assert_geq(pids[r], 0);
		if (pids[r] == 0)
			_exit(body(id, r));
	}
	for (int r = 0; r < NRANKS; r++) {
		int st;

		cr_assert_eq(waitpid(pids[r], &st, 0), pids[r]);
		status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
	}
	/* The stand-in's id names its shared file, gone once all joined; not if a rank failed first. */
	(void)unlink(id.internal);
}

Test(nccl, collectives_across_processes)
{
	int status[NRANKS];

	run_ranks(rank_body, status);
	for (int r = 0; r < NRANKS; r++)
		cr_assert_eq(status[r], 0, "rank %d exited %d", r, status[r]);
}

static int
mismatch_body(ncclUniqueId id, int rank)
{
	ncclComm_t comm;
	cudaStream_t s;
	float *buf;

	signal(SIGABRT, SIG_DFL);
	if (cudaSetDevice(rank) != cudaSuccess || ncclCommInitRank(&comm, NRANKS, id, rank) !=
	    ncclSuccess)
		return 10;
	cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
	cudaMalloc((void **)&buf, 4096 * 4);
	/* Rank 2 sends one element more: NCCL would hang or corrupt, the stand-in aborts. */
	ncclAllGather(buf, buf + 1024, rank == 2 ? 2 : 1, ncclFloat32, comm, s);
	cudaStreamSynchronize(s);
	return 0;
}

Test(nccl, ranks_that_disagree_abort)
{
	int status[NRANKS];

	run_ranks(mismatch_body, status);
	for (int r = 0; r < NRANKS; r++)
		cr_assert_eq(status[r], 128 + SIGABRT, "rank %d exited %d", r, status[r]);
}
