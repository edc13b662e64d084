/* libzclient_cuda through a reconnect whose daemon hands the tensor back in other slot files: ZeRO-3's copies, poll and detach go on. */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fake.h"
#include "msgio.h"
#include "proto.h"
#include "zclient_cuda.h"

#ifndef ZS_CUDA_STANDIN
#define ZS_CUDA_STANDIN 0	/* the real runtime: how soon a copy lands is its own */
#endif

/*
 * A fake daemon (a child process) that keeps one bf16 tensor's slots and
 * "steps" it by writing param = 2 * grad + step into the param slot, so the
 * test sees which file each copy went through.  Its first life hangs up on a
 * PING; its second takes the tensor back (resumed) in new files, as a daemon
 * does that lost its slot files but not the state.  zcc_slots then has to
 * let go of the old pages and keep working.
 */

#define N 1024			/* a multiple of 128: one rank's shard is the whole tensor */

#define CUDA_OK(call) do {						\
	cudaError_t e_ = (call);					\
	cr_assert_eq(e_, cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_)); \
} while (0)
#define ZCC_OK(call) do {						\
	int r_ = (call);						\
	cr_assert_geq(r_, 0, "%s: %d: %s", #call, r_, zcc_errmsg());	\
} while (0)

TestSuite(reconnect, .fini = fake_teardown, .timeout = 60);

/* What the daemon's first param slot holds, and what its step makes of a gradient. */
static uint16_t
first_param(uint64_t i)
{
	return zc_f32_to_bf16((float)(i % 97) * 0.125f);
}

static uint16_t
stepped(uint16_t grad, uint64_t step)
{
	return zc_f32_to_bf16(zc_bf16_to_f32(grad) * 2.0f + (float)step);
}

static uint16_t
grad_of(uint64_t i, uint64_t step)
{
	return zc_f32_to_bf16((float)((i * 7 + step * 13) % 251) * 0.03125f - 3.0f);
}

/* ---- the fake daemon (child side: exits with a code, never asserts) ---- */

struct fake_slots {
	uint16_t *grad, *param;
	uint16_t cur[N];		/* the params, carried into the next life's file */
};

/* New slot files, the fake's own mappings of them, the params written in. */
static void
tensor_ok(int sock, const struct zp_msg *req, struct fake_slots *fs, int life)
{
	struct zp_msg m = { .u.tensor_ok = { .handle = 1, .grad_bytes = N * 2,
		.param_bytes = N * 2, .resumed = life > 0, .last_step = life > 0 ? 1 : 0 } };
	int fds[2] = { memfd_of(N * 2), memfd_of(N * 2) };

	if (req->u.tensor_register.numel != N)
		_exit(8);
	if (fs->grad != NULL) {
		munmap(fs->grad, N * 2);
		munmap(fs->param, N * 2);
	}
	fs->grad = mmap(NULL, N * 2, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
	fs->param = mmap(NULL, N * 2, PROT_READ | PROT_WRITE, MAP_SHARED, fds[1], 0);
	if (fs->grad == MAP_FAILED || fs->param == MAP_FAILED)
		_exit(4);
	memcpy(fs->param, fs->cur, sizeof(fs->cur));
	send_or_die(sock, ZP_TENSOR_OK, req->hdr.request_id, &m, fds, 2);
	close(fds[0]);
	close(fds[1]);
}

static void
step(int sock, const struct zp_msg *req, struct fake_slots *fs)
{
	struct zp_msg m = { .u.step_done = { .step = req->u.step_submit.step, .count = 1 } };

	if (req->u.step_submit.count != 1 || req->u.step_submit.handles[0] != 1)
		_exit(9);
	for (uint64_t i = 0; i < N; i++)
		fs->cur[i] = fs->param[i] = stepped(fs->grad[i], req->u.step_submit.step);
	send_or_die(sock, ZP_STEP_DONE, req->hdr.request_id, &m, NULL, 0);
}

static void
reply(int sock, const struct zp_msg *req, struct fake_slots *fs, int life)
{
	struct zp_msg m = { 0 };

	switch (req->hdr.type) {
	case ZP_HELLO:
		strcpy(m.u.hello_ok.daemon_version, "fake");
		m.u.hello_ok.session_id = (uint64_t)life + 1;
		send_or_die(sock, ZP_HELLO_OK, req->hdr.request_id, &m, NULL, 0);
		break;
	case ZP_JOB_OPEN:
		m.u.job_ok.job_id = 1;
		m.u.job_ok.last_step = life > 0 ? 1 : 0;
		send_or_die(sock, ZP_JOB_OK, req->hdr.request_id, &m, NULL, 0);
		break;
	case ZP_TENSOR_REGISTER:
		tensor_ok(sock, req, fs, life);
		break;
	case ZP_STEP_SUBMIT:
		step(sock, req, fs);
		break;
	default:
		/* XFER_OPEN, PING and the rest: as the client suite's fake answers them. */
		default_reply(sock, req);
		break;
	}
}

/* Two lives: the first hangs up on a PING, the second serves until the client hangs up. */
static void
serve(int lfd)
{
	static uint8_t buf[ZP_MAX_MESSAGE];
	static struct zp_msg req;
	static struct fake_slots fs;
	int fds[ZP_MAX_FDS];
	unsigned nfds;

	for (uint64_t i = 0; i < N; i++)
		fs.cur[i] = first_param(i);
	for (int life = 0; life < 2; life++) {
		int sock = accept(lfd, NULL, NULL);

		if (sock < 0)
			_exit(5);
		for (;;) {
			ssize_t n = zp_recv_raw(sock, buf, sizeof(buf), fds, ZP_MAX_FDS, &nfds, 0);

			if (n <= 0)
				_exit(life == 1 ? 0 : 6);
			for (unsigned i = 0; i < nfds; i++)
				close(fds[i]);
			if (zp_decode(buf, (size_t)n, &req, NULL, 0) != ZP_S_OK)
				_exit(2);
			if (life == 0 && req.hdr.type == ZP_PING) {
				close(sock);
				break;
			}
			reply(sock, &req, &fs, life);
		}
	}
	_exit(7);
}

static const char *
start_fake(void)
{
	static char path[FAKE_PATH_MAX];
	int lfd = fake_listen(path);

	fflush(NULL);
	fake_child = fork();
	cr_assert_geq(fake_child, 0);
	if (fake_child == 0) {
		signal(SIGPIPE, SIG_IGN);
		serve(lfd);
	}
	close(lfd);
	return path;
}

/* ---- the trainer's side ---- */

/* The device shard, brought back and compared with want(i) element by element. */
static void
expect_shard(struct zcc_flat *f, cudaStream_t s, uint16_t (*want)(uint64_t, uint64_t),
    uint64_t step, const char *when)
{
	static uint16_t got[N];

	CUDA_OK(cudaMemcpyAsync(got, zcc_flat_param_shard(f), sizeof(got), cudaMemcpyDeviceToHost,
	    s));
	CUDA_OK(cudaStreamSynchronize(s));
	for (uint64_t i = 0; i < N; i++)
		cr_assert_eq(got[i], want(i, step), "%s: element %llu is 0x%04x, not 0x%04x", when,
		    (unsigned long long)i, got[i], want(i, step));
}

static uint16_t
first_param_at(uint64_t i, uint64_t step)
{
	(void)step;
	return first_param(i);
}

static uint16_t
stepped_at(uint64_t i, uint64_t step)
{
	return stepped(grad_of(i, step), step);
}

/* One ZeRO-3 step: gradients in, their shard to the daemon by poll, the new params back. */
static void
one_step(struct zcc_zero3 *z, struct zcc_flat *f, uint16_t *dgrad, cudaStream_t s,
    uint64_t step)
{
	static uint16_t g[N];
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = step, .lr = 1e-3,
		.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8 };
	struct zcc_step_summary sum;
	int n;

	for (uint64_t i = 0; i < N; i++)
		g[i] = grad_of(i, step);
	CUDA_OK(cudaMemcpyAsync(dgrad, g, sizeof(g), cudaMemcpyHostToDevice, s));
	/* No check_finite, no clipping: poll hands each shard over as its copy lands. */
	ZCC_OK(zcc_zero3_begin_step(z, &sp));
	ZCC_OK(zcc_flat_reduce_scatter(f, dgrad, s));
	n = zcc_zero3_poll(z);
	cr_assert_geq(n, 0, "%s", zcc_errmsg());
#if ZS_CUDA_STANDIN
	/* The stand-in says "not ready" to a record's first query (in reduce_scatter), not again. */
	cr_assert_eq(n, 1, "step %llu: the shard was not submitted by poll",
	    (unsigned long long)step);
#endif
	/* On a GPU the copy may have landed by reduce_scatter's own poll, or not yet at this one. */
	cr_assert_leq((uint32_t)n, zcc_zero3_submitted(z));
	cr_assert_leq(zcc_zero3_submitted(z), 1);
	ZCC_OK(zcc_zero3_end_step(z, s, &sum));
	cr_assert_eq(sum.submitted, 1);
	cr_assert_eq(sum.applied, 1);
	expect_shard(f, s, stepped_at, step, step == 1 ? "step 1" : "step 2, after the remap");
}

Test(reconnect, zero3_goes_on_through_slots_in_other_files)
{
	struct zc_conn_stats cs;
	struct zc_conn *c = NULL;
	struct zcc_zero3 *z = NULL;
	struct zcc_flat *f = NULL;
	static float init[N];
	ncclUniqueId id;
	ncclComm_t comm;
	cudaStream_t s;
	uint16_t *dgrad = NULL;
	const char *path = start_fake();
	int status;

	CUDA_OK(cudaSetDevice(0));
	CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	CUDA_OK(cudaMalloc((void **)&dgrad, N * 2));
	cr_assert_eq(ncclGetUniqueId(&id), ncclSuccess);
	cr_assert_eq(ncclCommInitRank(&comm, 1, id, 0), ncclSuccess);
	cr_assert_eq(zc_connect(path, &c), 0, "%s", zc_connect_errmsg());
	cr_assert_eq(zc_set_reconnect(c, 20000), 0);
	cr_assert_eq(zc_job_open(c, "fake", 0, 1), 0, "%s", zc_errmsg(c));
	ZCC_OK(zcc_zero3_create(c, comm, &z));
	ZCC_OK(zcc_flat_create(z, "w", N, ZC_BF16, init, &f));
	expect_shard(f, s, first_param_at, 0, "the first copy from the param slot");
	cr_assert(zcc_slots_param_pinned(zcc_flat_slots(f)));

	one_step(z, f, dgrad, s, 1);
	/* The fake hangs up on this; its second life hands the tensor back in new files. */
	cr_assert_eq(zc_ping(c, NULL), 0, "%s", zc_errmsg(c));
	zc_conn_stats(c, &cs);
	cr_assert_eq(cs.reconnects, 1);
	cr_assert_eq(cs.slots_remapped, 2);
	/* The driver let go of the old pages: both slots pageable, the zcc_slots still there. */
	cr_assert(!zcc_slots_param_pinned(zcc_flat_slots(f)));
	cr_assert_eq(zcc_slots_tensor(zcc_flat_slots(f)), zcc_flat_tensor(f));

	one_step(z, f, dgrad, s, 2);
	zcc_zero3_destroy(z);
	zc_disconnect(c);
	cr_assert_eq(waitpid(fake_child, &status, 0), fake_child);
	fake_child = 0;
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
	    "the fake daemon failed (status 0x%x)", status);
	cr_assert_eq(ncclCommDestroy(comm), ncclSuccess);
	CUDA_OK(cudaFree(dgrad));
	CUDA_OK(cudaStreamDestroy(s));
}
