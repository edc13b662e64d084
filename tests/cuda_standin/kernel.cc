/* CUDA stand-in: runs kernel launches on the CPU, blocks over host threads, barriers on fibers. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

#include "standin_impl.h"
#include "zs_kernel.h"

#if defined(__SANITIZE_ADDRESS__)
#define ZS_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ZS_ASAN 1
#endif
#endif
#ifdef ZS_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#error "the CUDA stand-in's fibers switch stacks with x86-64 code"
#endif

__thread struct zs_tls zs_tls;

/*
 * Fibers: a block of a cooperative kernel runs its threads as fibers on one
 * host thread, each on its own stack, switched only where a thread waits
 * (__syncthreads for the block, a shuffle for its warp).  The switch saves
 * the callee-saved registers on the old stack and pops them off the new one.
 */
extern "C" void zs_ctx_switch(void **save_sp, void *new_sp);
asm(".text\n"
    ".p2align 4\n"
    ".globl zs_ctx_switch\n"
    ".hidden zs_ctx_switch\n"
    ".type zs_ctx_switch,@function\n"
    "zs_ctx_switch:\n"
    "\tpushq %rbp\n\tpushq %rbx\n\tpushq %r12\n\tpushq %r13\n\tpushq %r14\n\tpushq %r15\n"
    "\tmovq %rsp, (%rdi)\n"
    "\tmovq %rsi, %rsp\n"
    "\tpopq %r15\n\tpopq %r14\n\tpopq %r13\n\tpopq %r12\n\tpopq %rbx\n\tpopq %rbp\n"
    "\tret\n"
    ".size zs_ctx_switch, .-zs_ctx_switch\n");

namespace {

constexpr size_t STACK = 64 * 1024;
constexpr unsigned MAX_THREADS = 1024;

enum fstate { RUN, WAIT_BLOCK, WAIT_WARP, DONE };

struct fiber {
	void *sp;
	fstate state;
	void *fake;		/* ASan's fake stack while switched out */
};

struct job {
	zs_dim grid, block;
	int coop;
	void (*fn)(void *);
	void *ctx;
	void (*drop)(void *);
};

/* One host thread's block in progress (cooperative kernels). */
struct sched {
	const job *j;
	unsigned n;
	unsigned cur;
	fiber *f;
	char *stacks;
	void *sp;		/* the scheduler's own stack while a fiber runs */
	void *fake;
	const void *sched_bottom;
	size_t sched_size;
	uint64_t xchg[MAX_THREADS];
};

thread_local sched *cur_sched;

void
set_thread_idx(const job *j, unsigned tid)
{
	zs_tls.thread_idx = zs_dim{ tid % j->block.x, tid / j->block.x % j->block.y,
	    tid / j->block.x / j->block.y };
}

void
switch_to_sched(sched *b, fiber *f, bool exiting)
{
#ifdef ZS_ASAN
	__sanitizer_start_switch_fiber(exiting ? nullptr : &f->fake, b->sched_bottom,
	    b->sched_size);
#else
	(void)exiting;
#endif
	zs_ctx_switch(&f->sp, b->sp);
#ifdef ZS_ASAN
	__sanitizer_finish_switch_fiber(f->fake, nullptr, nullptr);
#endif
}

[[noreturn]] void
fiber_main()
{
	sched *b = cur_sched;
	fiber *f = &b->f[b->cur];

#ifdef ZS_ASAN
	__sanitizer_finish_switch_fiber(nullptr, &b->sched_bottom, &b->sched_size);
#endif
	b->j->fn(b->j->ctx);
	f->state = DONE;
	switch_to_sched(b, f, true);
	zs__die("internal: a finished fiber was resumed");
}

void
resume(sched *b, unsigned i)
{
	b->cur = i;
	set_thread_idx(b->j, i);
#ifdef ZS_ASAN
	__sanitizer_start_switch_fiber(&b->fake, b->stacks + (size_t)i * STACK, STACK);
#endif
	zs_ctx_switch(&b->sp, b->f[i].sp);
#ifdef ZS_ASAN
	__sanitizer_finish_switch_fiber(b->fake, nullptr, nullptr);
#endif
}

/* Makes every waiter of a complete barrier runnable; false when none is complete. */
bool
release(sched *b)
{
	unsigned alive = 0, at_block = 0;
	bool any = false;

	for (unsigned i = 0; i < b->n; i++) {
		alive += b->f[i].state != DONE;
		at_block += b->f[i].state == WAIT_BLOCK;
	}
	if (at_block > 0 && at_block == alive) {
		for (unsigned i = 0; i < b->n; i++)
			if (b->f[i].state == WAIT_BLOCK)
				b->f[i].state = RUN;
		return true;
	}
	for (unsigned w = 0; w * 32 < b->n; w++) {
		unsigned lanes = 0, waiting = 0, done = 0;

		for (unsigned i = w * 32; i < b->n && i < w * 32 + 32; i++) {
			lanes++;
			waiting += b->f[i].state == WAIT_WARP;
			done += b->f[i].state == DONE;
		}
		if (waiting == 0 || waiting + done < lanes)
			continue;
		if (done > 0)
			zs__die("a full-mask warp shuffle in warp %u of block (%u,%u,%u) while %u of "
			    "its lanes have exited", w, zs_tls.block_idx.x, zs_tls.block_idx.y,
			    zs_tls.block_idx.z, done);
		for (unsigned i = w * 32; i < w * 32 + lanes; i++)
			b->f[i].state = RUN;
		any = true;
	}
	return any;
}

void
run_block_fibers(sched *b)
{
	for (unsigned i = 0; i < b->n; i++) {
		uintptr_t *sp = (uintptr_t *)(b->stacks + (size_t)(i + 1) * STACK);

		*--sp = 0;				/* fiber_main's return address: never used */
		*--sp = (uintptr_t)fiber_main;
		for (int r = 0; r < 6; r++)
			*--sp = 0;			/* rbp rbx r12-r15 */
		b->f[i] = fiber{ sp, RUN, nullptr };
	}
	for (;;) {
		bool ran = false;

		for (unsigned i = 0; i < b->n; i++)
			if (b->f[i].state == RUN) {
				resume(b, i);
				ran = true;
			}
		if (release(b))
			continue;
		bool all_done = true;

		for (unsigned i = 0; i < b->n; i++)
			all_done = all_done && b->f[i].state == DONE;
		if (all_done)
			return;
		if (!ran)
			zs__die("block (%u,%u,%u): its threads wait at different barriers "
			    "(__syncthreads or a shuffle under divergent control flow)",
			    zs_tls.block_idx.x, zs_tls.block_idx.y, zs_tls.block_idx.z);
	}
}

void
worker(const job *j, std::atomic<uint64_t> *next, uint64_t nblocks)
{
	unsigned n = j->block.x * j->block.y * j->block.z;
	sched *b = nullptr;

	zs_tls.block_dim = j->block;
	zs_tls.grid_dim = j->grid;
	if (j->coop) {
		b = new sched();
		b->j = j;
		b->n = n;
		b->f = new fiber[n];
		b->stacks = static_cast<char *>(aligned_alloc(64, (size_t)n * STACK));
		if (b->stacks == nullptr)
			zs__die("out of memory for %u fiber stacks", n);
		cur_sched = b;
	}
	for (uint64_t k; (k = next->fetch_add(1)) < nblocks;) {
		zs_tls.block_idx = zs_dim{ (unsigned)(k % j->grid.x),
		    (unsigned)(k / j->grid.x % j->grid.y), (unsigned)(k / j->grid.x / j->grid.y) };
		if (b != nullptr) {
			run_block_fibers(b);
			continue;
		}
		for (unsigned t = 0; t < n; t++) {
			set_thread_idx(j, t);
			j->fn(j->ctx);
		}
	}
	if (b != nullptr) {
		cur_sched = nullptr;
		free(b->stacks);
		delete[] b->f;
		delete b;
	}
}

unsigned
host_threads()
{
	const char *s = getenv("ZS_CUDA_THREADS");
	long n = s != nullptr ? atol(s) : sysconf(_SC_NPROCESSORS_ONLN);

	return n < 1 ? 1 : n > 16 ? 16 : (unsigned)n;
}

void
job_run(void *arg)
{
	const job *j = static_cast<const job *>(arg);
	uint64_t nblocks = (uint64_t)j->grid.x * j->grid.y * j->grid.z;
	/* A thread per few blocks at most: small launches stay on this one. */
	uint64_t want = nblocks / 4 + 1;
	unsigned nt = host_threads() < want ? host_threads() : (unsigned)want;
	std::atomic<uint64_t> next{ 0 };
	std::vector<std::thread> pool;

	for (unsigned i = 1; i < nt; i++)
		pool.emplace_back(worker, j, &next, nblocks);
	worker(j, &next, nblocks);
	for (auto &t : pool)
		t.join();
}

void
job_drop(void *arg)
{
	job *j = static_cast<job *>(arg);

	if (j->drop != nullptr)
		j->drop(j->ctx);
	delete j;
}

}

extern "C" cudaError_t
zs_launch(zs_dim grid, zs_dim block, size_t shmem, cudaStream_t stream, int coop,
    void (*thread_fn)(void *), void *ctx, void (*drop)(void *))
{
	uint64_t threads = (uint64_t)block.x * block.y * block.z;

	/* The limits of every GPU the project builds for. */
	if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535 ||
	    threads == 0 || threads > MAX_THREADS || block.z > 64 || shmem > 48 * 1024) {
		fprintf(stderr, "cuda-standin: launch of grid (%u,%u,%u) block (%u,%u,%u): "
		    "invalid configuration\n", grid.x, grid.y, grid.z, block.x, block.y, block.z);
		if (drop != nullptr)
			drop(ctx);
		return zs_set_error(cudaErrorInvalidConfiguration);
	}
	job *j = new job{ grid, block, coop, thread_fn, ctx, drop };

	return zs_set_error(zs_enqueue(stream, job_run, job_drop, j));
}

extern "C" void
zs_syncthreads(void)
{
	sched *b = cur_sched;

	if (b == nullptr)
		zs__die("__syncthreads in a kernel cu2cc.py did not mark cooperative");
	b->f[b->cur].state = WAIT_BLOCK;
	switch_to_sched(b, &b->f[b->cur], false);
}

static void
wait_warp(sched *b)
{
	b->f[b->cur].state = WAIT_WARP;
	switch_to_sched(b, &b->f[b->cur], false);
}

extern "C" uint64_t
zs_shfl_down(unsigned mask, uint64_t bits, unsigned delta)
{
	sched *b = cur_sched;

	if (b == nullptr)
		zs__die("a warp shuffle in a kernel cu2cc.py did not mark cooperative");
	if (mask != 0xffffffffu || b->n % 32 != 0)
		zs__die("__shfl_down_sync: only full warps and the full mask are emulated "
		    "(mask 0x%x, %u threads)", mask, b->n);
	unsigned tid = b->cur, lane = tid % 32;

	b->xchg[tid] = bits;
	wait_warp(b);
	/* Read, then wait again so that nobody's next shuffle overwrites a value not yet read. */
	uint64_t got = lane + delta < 32 ? b->xchg[tid + delta] : bits;
	wait_warp(b);
	return got;
}
