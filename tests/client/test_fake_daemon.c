/* libzclient's own checks on what the daemon sends: a fake daemon in a child process answers wrongly; the client must fail clearly and leak no descriptor. */
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

TestSuite(fake_daemon, .fini = fake_teardown, .timeout = 30);

/* ---- descriptors where none are expected, or the wrong number ---- */

static void
pong_with_fd(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { 0 };
	int fd = memfd_of(4096);

	send_or_die(sock, ZP_PONG, req->hdr.request_id, &m, &fd, 1);
	close(fd);
}

Test(fake_daemon, fd_where_none_is_expected)
{
	const struct fake f = { ZP_PING, pong_with_fd };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, zc_ping(c, NULL), -EBADMSG, "PONG from zoffloadd carries 1 descriptors");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void
hello_with_fd(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { 0 };
	int fd = memfd_of(4096);

	strcpy(m.u.hello_ok.daemon_version, "fake");
	send_or_die(sock, ZP_HELLO_OK, req->hdr.request_id, &m, &fd, 1);
	close(fd);
}

/* zc_connect has no connection left to hold a message: the code says it. */
Test(fake_daemon, fd_with_hello)
{
	const struct fake f = { ZP_HELLO, hello_with_fd };
	unsigned before = fd_count();
	struct zc_conn *c = NULL;
	int r = zc_connect(fake_start(&f), &c);

	cr_assert_eq(r, -EBADMSG, "HELLO_OK with a descriptor: %d", r);
	cr_assert_null(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void tensor_ok_one_fd(int sock, const struct zp_msg *req) { tensor_ok_fds(sock, req, 1); }
static void tensor_ok_no_fd(int sock, const struct zp_msg *req) { tensor_ok_fds(sock, req, 0); }
static void tensor_ok_three_fds(int sock, const struct zp_msg *req) { tensor_ok_fds(sock, req, 3); }

Test(fake_daemon, tensor_ok_with_one_descriptor)
{
	const struct fake f = { ZP_TENSOR_REGISTER, tensor_ok_one_fd };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, try_register(c, 1000), -EBADMSG,
	    "TENSOR_OK from zoffloadd carries 1 descriptors");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

Test(fake_daemon, tensor_ok_without_descriptors)
{
	const struct fake f = { ZP_TENSOR_REGISTER, tensor_ok_no_fd };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, try_register(c, 1000), -EBADMSG,
	    "TENSOR_OK from zoffloadd carries 0 descriptors");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

/* More than ZP_MAX_FDS: the kernel hands them over, msgio closes them all. */
Test(fake_daemon, tensor_ok_with_three_descriptors)
{
	const struct fake f = { ZP_TENSOR_REGISTER, tensor_ok_three_fds };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);
	int r = try_register(c, 1000);

	cr_assert_eq(r, -ETOOMANYREFS, "%d: %s", r, zc_errmsg(c));
	cr_assert_not_null(strstr(zc_errmsg(c), "receive from zoffloadd"), "%s", zc_errmsg(c));
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void
xfer_ok_no_fd(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { .u.xfer_ok.bytes = 64 << 10 };

	send_or_die(sock, ZP_XFER_OK, req->hdr.request_id, &m, NULL, 0);
}

/* The window is opened by the first register, after the slots are mapped. */
Test(fake_daemon, xfer_ok_without_descriptor)
{
	const struct fake f = { ZP_XFER_OPEN, xfer_ok_no_fd };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, try_register(c, 1000), -EBADMSG,
	    "XFER_OK from zoffloadd carries 0 descriptors");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

/* ---- truncated, garbage and wrong replies ---- */

static void
truncated_pong(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { .hdr = { .type = ZP_JOB_OK, .request_id = req->hdr.request_id } };
	uint8_t buf[ZP_MAX_MESSAGE];
	size_t len;

	(void)sock;
	if (zp_encode(&m, buf, sizeof(buf), &len) != ZP_S_OK)
		_exit(6);
	/* The header promises 16 bytes of payload; 5 arrive (payload_len patched to match). */
	buf[16] = 5;
	if (sendmsg_fds(sock, buf, ZP_HEADER_SIZE + 5, NULL, 0) != 0)
		_exit(3);
}

Test(fake_daemon, truncated_reply)
{
	const struct fake f = { ZP_PING, truncated_pong };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, zc_ping(c, NULL), -EBADMSG, "bad message from zoffloadd");
	cr_assert_not_null(strstr(zc_errmsg(c), "JOB_OK"), "'%s' does not name the message",
	    zc_errmsg(c));
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void
garbage(int sock, const struct zp_msg *req)
{
	uint8_t buf[100];
	int fd = memfd_of(4096);

	(void)req;
	for (size_t i = 0; i < sizeof(buf); i++)
		buf[i] = (uint8_t)(i * 37 + 11);
	/* With a descriptor: the decode fails first, and the descriptor must still be closed. */
	if (sendmsg_fds(sock, buf, sizeof(buf), &fd, 1) != 0)
		_exit(3);
	close(fd);
}

Test(fake_daemon, garbage_reply_with_descriptor)
{
	const struct fake f = { ZP_PING, garbage };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, zc_ping(c, NULL), -EBADMSG, "bad message from zoffloadd: bad magic");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void
wrong_type(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { .u.job_ok = { .job_id = 9 } };

	send_or_die(sock, ZP_JOB_OK, req->hdr.request_id, &m, NULL, 0);
}

Test(fake_daemon, reply_of_the_wrong_type)
{
	const struct fake f = { ZP_PING, wrong_type };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, zc_ping(c, NULL), -EBADMSG, "answered PING with JOB_OK");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void
hang_up(int sock, const struct zp_msg *req)
{
	(void)req;
	close(sock);
	_exit(0);
}

Test(fake_daemon, hang_up_mid_request)
{
	const struct fake f = { ZP_TENSOR_REGISTER, hang_up };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, try_register(c, 1000), -ECONNRESET, "zoffloadd closed the connection");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

/* ---- replies that decode but do not hold together ---- */

static void
xfer_ok_tiny(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { .u.xfer_ok.bytes = 2 };
	int fd = memfd_of(4096);

	send_or_die(sock, ZP_XFER_OK, req->hdr.request_id, &m, &fd, 1);
	close(fd);
}

/* A window smaller than one element would move nothing, forever. */
Test(fake_daemon, xfer_window_below_one_element)
{
	const struct fake f = { ZP_XFER_OPEN, xfer_ok_tiny };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, try_register(c, 1000), -EBADMSG, "transfer window of 2 bytes");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static void
xfer_ok_short_file(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { .u.xfer_ok.bytes = 64 << 10 };
	int fd = memfd_of(4096);

	send_or_die(sock, ZP_XFER_OK, req->hdr.request_id, &m, &fd, 1);
	close(fd);
}

/* Mapped past the file's end, the window would SIGBUS on the first copy beyond 4 KiB. */
Test(fake_daemon, xfer_window_larger_than_its_file)
{
	const struct fake f = { ZP_XFER_OPEN, xfer_ok_short_file };
	unsigned before = fd_count();
	struct zc_conn *c = fake_connect(&f);

	expect_error(c, try_register(c, 4096), -EBADMSG, "transfer window of 65536 bytes");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

static uint32_t scripted_handle;
static size_t scripted_grad_file;

/* TENSOR_OK with scripted_handle and a grad slot file of scripted_grad_file bytes. */
static void
tensor_ok_scripted(int sock, const struct zp_msg *req)
{
	uint64_t bytes = req->u.tensor_register.numel * 4;
	struct zp_msg m = { .u.tensor_ok = { .handle = scripted_handle, .grad_bytes = bytes,
		.param_bytes = bytes } };
	int fds[2] = { memfd_of(scripted_grad_file ? scripted_grad_file : bytes), memfd_of(bytes) };

	send_or_die(sock, ZP_TENSOR_OK, req->hdr.request_id, &m, fds, 2);
	close(fds[0]);
	close(fds[1]);
}

Test(fake_daemon, tensor_handle_zero)
{
	const struct fake f = { ZP_TENSOR_REGISTER, tensor_ok_scripted };
	unsigned before = fd_count();
	struct zc_conn *c;

	scripted_handle = 0;
	c = fake_connect(&f);
	expect_error(c, try_register(c, 1000), -EBADMSG, "handle 0");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

/* A second tensor given the first one's handle would take its place. */
Test(fake_daemon, tensor_handle_in_use)
{
	const struct fake f = { ZP_TENSOR_REGISTER, tensor_ok_scripted };
	unsigned before = fd_count();
	struct zc_tensor_desc desc = { .name = "first", .numel = 1000, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	static float init[1000];
	struct zc_tensor *first;
	struct zc_conn *c;

	scripted_handle = 3;
	c = fake_connect(&f);
	cr_assert_eq(zc_tensor_register(c, &desc, init, &first), 0, "%s", zc_errmsg(c));
	expect_error(c, try_register(c, 1000), -EBADMSG, "handle 3");
	cr_assert_eq(zc_tensor_numel(first), 1000, "the first tensor was replaced");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}

/* A slot file shorter than the slot: the training process would SIGBUS writing gradients. */
Test(fake_daemon, slot_larger_than_its_file)
{
	const struct fake f = { ZP_TENSOR_REGISTER, tensor_ok_scripted };
	unsigned before = fd_count();
	struct zc_conn *c;

	scripted_handle = 1;
	scripted_grad_file = 4096;
	c = fake_connect(&f);
	expect_error(c, try_register(c, 4096), -EBADMSG, "slots of 'w'");
	zc_disconnect(c);
	fake_finish();
	cr_assert_eq(fd_count(), before, "descriptors leaked");
}


/* ---- a save over an earlier checkpoint ---- */

/* Whether process pid has a descriptor open on the file fd is open on. */
static bool
holds_file_of(pid_t pid, int fd)
{
	char dirpath[64], path[400];
	struct stat want, st;
	struct dirent *de;
	bool found = false;
	DIR *d;

	snprintf(dirpath, sizeof(dirpath), "/proc/%d/fd", (int)pid);
	d = opendir(dirpath);
	if (d == NULL || fstat(fd, &want) != 0)
		_exit(7);
	while (!found && (de = readdir(d)) != NULL) {
		snprintf(path, sizeof(path), "%s/%s", dirpath, de->d_name);
		found = de->d_name[0] != '.' && stat(path, &st) == 0 && st.st_dev == want.st_dev &&
		    st.st_ino == want.st_ino;
	}
	closedir(d);
	return found;
}

/*
 * CKPT_RELEASE: answered only once the client has closed its own descriptor of the file,
 * so that the daemon's close is the last.  A client that waits for the answer first never
 * does: after 10 s (a bound for that hang, not a timing) the fake answers and fails.
 */
static void
release_after_the_client_let_go(int sock, const struct zp_msg *req)
{
	struct zp_msg m = { 0 };
	int waited_ms = 0;

	if (req_nfds != 1)
		_exit(8);
	while (holds_file_of(getppid(), req_fds[0]) && waited_ms < 10000) {
		usleep(1000);
		waited_ms++;
	}
	if (holds_file_of(getppid(), req_fds[0]))
		script_status = 6;
	send_or_die(sock, ZP_OK, req->hdr.request_id, &m, NULL, 0);
}

Test(fake_daemon, a_save_hands_over_the_replaced_file_after_closing_its_own)
{
	const struct fake f = { ZP_CKPT_RELEASE, release_after_the_client_let_go };
	struct zc_tensor_desc desc = { .name = "w", .numel = 1024, .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	struct zc_step_params sp = { .optim = ZC_ADAMW, .step = 1, .lr = 1e-3f, .beta1 = 0.9f,
		.beta2 = 0.999f, .eps = 1e-8f };
	static float init[1024];
	char ckdir[64], path[128];
	struct zc_checkpoint_entry e = { 0 };
	struct zc_conn *c = fake_connect(&f);
	int fd;

	snprintf(ckdir, sizeof(ckdir), "/tmp/zoff-fake-ckpt-XXXXXX");
	cr_assert_not_null(mkdtemp(ckdir));
	snprintf(path, sizeof(path), "%s/rank-00000-of-00001.safetensors", ckdir);
	fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
	cr_assert_eq(write(fd, "earlier", 7), 7);
	close(fd);
	cr_assert_eq(zc_tensor_register(c, &desc, init, &e.tensor), 0, "%s", zc_errmsg(c));
	cr_assert_eq(zc_checkpoint_save(c, ckdir, &e, 1, &sp), 0, "%s", zc_errmsg(c));
	zc_disconnect(c);
	unlink(path);
	rmdir(ckdir);
	fake_finish();
}
