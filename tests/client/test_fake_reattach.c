/* libzclient through a reconnect whose daemon hands the state back in other slot files: mapped in place, the driver told first. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "msgio.h"
#include "proto.h"
#include "zclient.h"
#include "fake.h"

TestSuite(fake_reattach, .fini = fake_teardown, .timeout = 30);

/* ---- a reconnect that gets the state back in other slot files ---- */

#define REMAP_N 1000

/* The second connection's TENSOR_REGISTER: taken back (resumed), in new files, params 7. */
static void
tensor_ok_resumed_elsewhere(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { .u.tensor_ok = { .handle = 1, .resumed = 1, .last_step = 5,
		.grad_bytes = req->u.tensor_register.numel * 4,
		.param_bytes = req->u.tensor_register.numel * 4 } };
	int fds[2] = { memfd_of(req->u.tensor_register.numel * 4),
		memfd_of(req->u.tensor_register.numel * 4) };
	float *p = mmap(NULL, req->u.tensor_register.numel * 4, PROT_READ | PROT_WRITE, MAP_SHARED,
	    fds[1], 0);

	if (p == MAP_FAILED)
		_exit(4);
	for (uint64_t i = 0; i < req->u.tensor_register.numel; i++)
		p[i] = 7.0f;
	munmap(p, req->u.tensor_register.numel * 4);
	send_or_die(sock, ZP_TENSOR_OK, req->hdr.request_id, &m, fds, 2);
	close(fds[0]);
	close(fds[1]);
}

/*
 * Serves until the client's TENSOR_SET_STEP, then hangs up (or refuses it as
 * a daemon shutting down, and waits for the client to hang up), then serves a
 * second connection as a daemon that kept the state.
 */
static void
serve_two_lives(int lfd, bool shutting_down)
{
	static uint8_t buf[ZP_MAX_MESSAGE];
	static struct zp_msg req;
	int fds[ZP_MAX_FDS];
	unsigned nfds;

	for (int life = 0; life < 2; life++) {
		int sock = accept(lfd, NULL, NULL);

		if (sock < 0)
			_exit(5);
		for (;;) {
			ssize_t n = zp_recv_raw(sock, buf, sizeof(buf), fds, ZP_MAX_FDS, &nfds, 0);

			if (n <= 0 && life == 0 && shutting_down) {
				close(sock);
				break;
			}
			if (n <= 0)
				_exit(life == 1 ? 0 : 6);
			for (unsigned i = 0; i < nfds; i++)
				close(fds[i]);
			if (zp_decode(buf, (size_t)n, &req, NULL, 0) != ZP_S_OK)
				_exit(2);
			if (life == 0 && req.hdr.type == ZP_TENSOR_SET_STEP && shutting_down) {
				struct zp_msg m = { .u.error = { .code = -ESHUTDOWN } };

				strcpy(m.u.error.message, "zoffloadd is shutting down");
				send_or_die(sock, ZP_ERROR, req.hdr.request_id, &m, NULL, 0);
				continue;
			}
			if (life == 0 && req.hdr.type == ZP_TENSOR_SET_STEP) {
				close(sock);
				break;
			}
			if (life == 1 && req.hdr.type == ZP_TENSOR_REGISTER)
				tensor_ok_resumed_elsewhere(sock, &req);
			else
				default_reply(sock, &req);
		}
	}
	_exit(7);
}

/*
 * The daemon hands the tensor back with its state but in other files: the
 * new files are mapped at the old addresses (pointers the trainer holds stay
 * good), the grads written before are carried over, the params are the new
 * file's.
 */
/* A driver's registration of the slots, counted: it must let go before the pages change. */
static unsigned released, unpinned, remapped, unmapped;

static void
count_release(struct zc_tensor *t, void *arg)
{
	(void)t;
	(void)arg;
	released++;
}

/* The slots hook is told which: the remap keeps it, the unmap is its last call. */
static void
count_slots(struct zc_tensor *t, enum zc_slots_event why, void *arg)
{
	(void)t;
	(void)arg;
	if (why == ZC_SLOTS_REMAP)
		remapped++;
	else
		unmapped++;
}

static int
count_unpin(struct zc_tensor *t, void *arg)
{
	(void)t;
	(void)arg;
	unpinned++;
	return 0;
}

static void
reattach_in_other_files(bool shutting_down, bool slots_hook)
{
	struct zc_tensor_desc desc = { .name = "w", .numel = REMAP_N, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	static float init[REMAP_N];
	struct zc_conn_stats cs;
	struct zc_conn *c = NULL;
	struct zc_tensor *t = NULL;
	char path[FAKE_PATH_MAX];
	float *grad, out[4];
	const float *param;
	int lfd = fake_listen(path);

	fake_child = fork();
	cr_assert_geq(fake_child, 0);
	if (fake_child == 0) {
		signal(SIGPIPE, SIG_IGN);
		serve_two_lives(lfd, shutting_down);
	}
	close(lfd);

	cr_assert_eq(zc_connect(path, &c), 0);
	cr_assert_eq(zc_set_reconnect(c, 10000), 0);
	cr_assert_eq(zc_job_open(c, "fake", 0, 1), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_tensor_register(c, &desc, init, &t), 0, "%s", zc_errmsg(c));
	grad = zc_tensor_grad_slot(t, NULL);
	param = zc_tensor_param_slot(t, NULL);
	for (int i = 0; i < REMAP_N; i++)
		grad[i] = (float)i;
	released = unpinned = remapped = unmapped = 0;
	if (slots_hook)
		zc_tensor_set_slots_hook(t, count_slots, NULL);
	else
		zc_tensor_set_release_hook(t, count_release, NULL);
	zc_tensor_set_param_pin(t, count_unpin, NULL);
	/* The fake hangs up on this request; its second life answers it. */
	cr_assert_eq(zc_tensor_set_step(t, 6), 0, "%s", zc_errmsg(c));
	zc_conn_stats(c, &cs);
	cr_assert_eq(cs.reconnects, 1);
	cr_assert_eq(cs.slots_remapped, 2);
	cr_assert_eq(zc_tensor_grad_slot(t, NULL), grad, "the grad slot moved");
	cr_assert_eq(zc_tensor_param_slot(t, NULL), param, "the param slot moved");
	cr_assert_eq(zc_tensor_last_step(t), 6);
	/* The driver let go of the old pages, once, and holds none now. */
	cr_assert_eq(released + remapped, 1);
	cr_assert_eq(unmapped, 0);
	cr_assert_eq(unpinned, 1);
	cr_assert(!zc_tensor_param_pinned(t));
	for (int i = 0; i < REMAP_N; i++) {
		cr_assert_eq(grad[i], (float)i, "grad %d was not carried over", i);
		cr_assert_eq(param[i], 7.0f, "param %d is not the new file's", i);
	}
	/* The transfer window is the new session's too. */
	cr_assert_eq(zc_tensor_read(t, ZC_STATE_MASTER, 0, 4, out), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
	if (slots_hook)
		cr_assert_eq(unmapped, 1, "the slots hook was not told of the unmap");
	else
		cr_assert_eq(released, 1, "the release hook ran again at the unmap");
	fake_finish();
}

Test(fake_reattach, reattach_in_other_files_maps_in_place)
{
	reattach_in_other_files(false, false);
}

Test(fake_reattach, reattach_in_other_files_tells_the_slots_hook_remap_then_unmap)
{
	reattach_in_other_files(false, true);
}

/* "zoffloadd is shutting down" is a connection going away too: the request goes to its successor. */
Test(fake_reattach, shutting_down_is_a_reconnect)
{
	reattach_in_other_files(true, false);
}
