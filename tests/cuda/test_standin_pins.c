/* The CUDA stand-in's checks on pinned pages replaced behind its back, and its query knobs. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#define CUDA_OK(call) do {						\
	cudaError_t e_ = (call);					\
	cr_assert_eq(e_, cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_)); \
} while (0)

#define PG 4096

/*
 * Runs fn in a child with its stderr captured: the child must die of SIGABRT
 * (died) or exit 0 (!died), and its stderr must contain text (when not NULL).
 */
static void
child_ends(void (*fn)(void), bool died, const char *text)
{
	static char out[4096];
	size_t got = 0;
	int p[2], status;
	ssize_t n;
	pid_t pid;

	cr_assert_eq(pipe(p), 0);
	fflush(NULL);
	pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		signal(SIGABRT, SIG_DFL);
		dup2(p[1], 2);
		close(p[0]);
		close(p[1]);
		fn();
		_exit(0);
	}
	close(p[1]);
	while (got < sizeof(out) - 1 && (n = read(p[0], out + got, sizeof(out) - 1 - got)) > 0)
		got += (size_t)n;
	out[got] = '\0';
	close(p[0]);
	cr_assert_eq(waitpid(pid, &status, 0), pid);
	if (died)
		cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT,
		    "the stand-in did not abort (status 0x%x); stderr: %s", status, out);
	else
		cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		    "status 0x%x; stderr: %s", status, out);
	if (text != NULL)
		cr_assert_not_null(strstr(out, text), "stderr does not say '%s': %s", text, out);
}

/* A page of a memfd, shared, as libzclient maps a slot; *ret_fd its file. */
static char *
slot_page(int *ret_fd)
{
	int fd = memfd_create("standin-slot", MFD_CLOEXEC);
	char *p;

	if (fd < 0 || ftruncate(fd, PG) != 0)
		_exit(3);
	p = mmap(NULL, PG, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		_exit(3);
	memset(p, 0x5a, PG);
	*ret_fd = fd;
	return p;
}

static void
map_fixed_over_registered(void)
{
	int fd, fd2 = memfd_create("other", MFD_CLOEXEC);
	char *p = slot_page(&fd);

	if (fd2 < 0 || ftruncate(fd2, PG) != 0 || cudaHostRegister(p, PG, 0) != cudaSuccess)
		_exit(3);
	(void)mmap(p, PG, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd2, 0);
}

static void
map_fixed_after_unregister(void)
{
	int fd, fd2 = memfd_create("other", MFD_CLOEXEC);
	char *p = slot_page(&fd);

	if (fd2 < 0 || ftruncate(fd2, PG) != 0 || cudaHostRegister(p, PG, 0) != cudaSuccess ||
	    cudaHostUnregister(p) != cudaSuccess)
		_exit(3);
	if (mmap(p, PG, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd2, 0) != p)
		_exit(4);
}

Test(pins, map_fixed_over_registered_memory_aborts)
{
	child_ends(map_fixed_over_registered, true, "MAP_FIXED) over memory still registered");
	child_ends(map_fixed_after_unregister, false, NULL);
}

static void
punch_registered(void)
{
	int fd;
	char *p = slot_page(&fd);

	if (cudaHostRegister(p, PG, 0) != cudaSuccess)
		_exit(3);
	(void)fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, PG);
}

static void
punch_unregistered(void)
{
	int fd;
	char *p = slot_page(&fd);

	if (cudaHostRegister(p, PG, 0) != cudaSuccess || cudaHostUnregister(p) != cudaSuccess ||
	    fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, PG) != 0)
		_exit(4);
	/* The punch took effect: the next touch sees a new zero page. */
	if (p[0] != 0)
		_exit(5);
}

Test(pins, a_hole_punched_in_registered_memory_aborts)
{
	child_ends(punch_registered, true, "fallocate(PUNCH_HOLE, 0, 4096) of pages still "
	    "registered");
	child_ends(punch_unregistered, false, NULL);
}

/*
 * Another process punches (zoffloadd releasing a param slot): it forks before
 * the registration, so only the record in $ZS_CUDA_PINS can tell it.  The
 * registering process dies at its next copy through the range.
 */
static void
punched_elsewhere(bool unregister_first)
{
	char dir[] = "/tmp/zs-pins-XXXXXX", go;
	int fd, gate[2], status;
	char *p = slot_page(&fd);
	void *d = NULL;
	pid_t pid;

	if (mkdtemp(dir) == NULL || setenv("ZS_CUDA_PINS", dir, 1) != 0 || pipe(gate) != 0)
		_exit(3);
	fflush(NULL);
	pid = fork();
	if (pid == 0) {
		if (read(gate[0], &go, 1) != 1 ||
		    fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, PG) != 0)
			_exit(3);
		_exit(0);
	}
	if (pid < 0 || cudaMalloc(&d, PG) != cudaSuccess || cudaHostRegister(p, PG, 0) != cudaSuccess)
		_exit(3);
	if (unregister_first && cudaHostUnregister(p) != cudaSuccess)
		_exit(3);
	if (write(gate[1], "x", 1) != 1 || waitpid(pid, &status, 0) != pid || status != 0)
		_exit(4);
	/* Dies here when the pages were still registered. */
	(void)cudaMemcpy(d, p, PG, cudaMemcpyHostToDevice);
	if (!unregister_first)
		(void)cudaHostUnregister(p);
	(void)rmdir(dir);
}

static void punched_while_registered(void) { punched_elsewhere(false); }
static void punched_after_unregister(void) { punched_elsewhere(true); }

Test(pins, a_hole_punched_by_another_process_aborts_at_the_next_copy)
{
	child_ends(punched_while_registered, true, "had a hole punched in its file "
	    "(fallocate(PUNCH_HOLE) of bytes 0..4096 by pid");
	child_ends(punched_after_unregister, false, NULL);
}

/* ---- cudaEventQuery / cudaStreamQuery at both extremes ---- */

struct pending {
	cudaStream_t s;
	cudaEvent_t e;
	uint32_t *d, *host;
};

/* A memset and a copy to pinned memory queued, then an event: all pending. */
static void
queue_work(struct pending *w)
{
	CUDA_OK(cudaStreamCreateWithFlags(&w->s, cudaStreamNonBlocking));
	CUDA_OK(cudaEventCreateWithFlags(&w->e, cudaEventDisableTiming));
	CUDA_OK(cudaMalloc((void **)&w->d, 4));
	CUDA_OK(cudaMallocHost((void **)&w->host, 4));
	*w->host = 1;
	CUDA_OK(cudaMemsetAsync(w->d, 0, 4, w->s));
	CUDA_OK(cudaMemcpyAsync(w->host, w->d, 4, cudaMemcpyDeviceToHost, w->s));
	CUDA_OK(cudaEventRecord(w->e, w->s));
}

static void
drop_work(struct pending *w)
{
	CUDA_OK(cudaEventDestroy(w->e));
	CUDA_OK(cudaStreamDestroy(w->s));
	CUDA_OK(cudaFree(w->d));
	CUDA_OK(cudaFreeHost(w->host));
}

Test(queries, pending_0_completes_at_the_first_query)
{
	struct pending w;

	setenv("ZS_CUDA_QUERY_PENDING", "0", 1);
	queue_work(&w);
	cr_assert_eq(zs_pending(), 3);
	cr_assert_eq(cudaEventQuery(w.e), cudaSuccess);
	cr_assert_eq(*w.host, 0, "the copy ran at the query");
	cr_assert_eq(zs_pending(), 0);
	CUDA_OK(cudaMemsetAsync(w.d, 0, 4, w.s));
	cr_assert_eq(cudaStreamQuery(w.s), cudaSuccess);
	drop_work(&w);
	unsetenv("ZS_CUDA_QUERY_PENDING");
}

Test(queries, pending_never_leaves_the_work_to_a_wait)
{
	struct pending w;

	setenv("ZS_CUDA_QUERY_PENDING", "never", 1);
	queue_work(&w);
	for (int i = 0; i < 1000; i++) {
		cr_assert_eq(cudaEventQuery(w.e), cudaErrorNotReady, "query %d", i);
		cr_assert_eq(cudaStreamQuery(w.s), cudaErrorNotReady, "query %d", i);
	}
	cr_assert_eq(*w.host, 1, "a query ran the copy");
	cr_assert_eq(cudaGetLastError(), cudaSuccess, "not ready is not an error");
	CUDA_OK(cudaEventSynchronize(w.e));
	cr_assert_eq(*w.host, 0);
	cr_assert_eq(cudaEventQuery(w.e), cudaSuccess);
	drop_work(&w);
	unsetenv("ZS_CUDA_QUERY_PENDING");
}

static void
busy_wait(void)
{
	struct pending w;

	setenv("ZS_CUDA_QUERY_PENDING", "never", 1);
	setenv("ZS_CUDA_QUERY_SPIN", "500", 1);
	queue_work(&w);
	while (cudaEventQuery(w.e) == cudaErrorNotReady)
		;
}

static void
a_thousand_queries_of_a_thousand_records(void)
{
	struct pending w;

	setenv("ZS_CUDA_QUERY_PENDING", "never", 1);
	setenv("ZS_CUDA_QUERY_SPIN", "1000", 1);
	queue_work(&w);
	/* The count is per record: a new record starts again. */
	for (int r = 0; r < 1000; r++) {
		for (int i = 0; i < 1000; i++)
			if (cudaEventQuery(w.e) != cudaErrorNotReady)
				_exit(3);
		CUDA_OK(cudaEventRecord(w.e, w.s));
	}
	CUDA_OK(cudaStreamSynchronize(w.s));
	drop_work(&w);
}

Test(queries, a_busy_wait_aborts)
{
	child_ends(busy_wait, true, "cudaEventQuery answered cudaErrorNotReady 500 times for one "
	    "record: a busy-wait");
	child_ends(a_thousand_queries_of_a_thousand_records, false, NULL);
}
