/* Integration-test helpers: run a real zoffloadd in a temp dir, talk to it raw or through libzclient. */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "itd.h"
#include "msgio.h"

double
itd_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static const char *
daemon_path(void)
{
	const char *p = getenv("ZOFFLOADD");

	cr_assert(p != NULL && p[0] != '\0', "$ZOFFLOADD (the built daemon) is not set");
	return p;
}

void
itd_prepare(struct itd *d, const char *config_text)
{
	FILE *f;

	memset(d, 0, sizeof(*d));
	snprintf(d->dir, sizeof(d->dir), "/tmp/zoff-it-XXXXXX");
	cr_assert_not_null(mkdtemp(d->dir), "mkdtemp: %s", strerror(errno));
	snprintf(d->socket, sizeof(d->socket), "%s/sock", d->dir);
	snprintf(d->config, sizeof(d->config), "%s/zoffload.conf", d->dir);
	snprintf(d->log, sizeof(d->log), "%s/daemon.log", d->dir);
	f = fopen(d->config, "w");
	cr_assert_not_null(f);
	fputs(config_text != NULL ? config_text : ITD_DEFAULT_CONFIG, f);
	cr_assert_eq(fclose(f), 0);
}

/* fork + exec with stdout/stderr into log_fd; the child dies with us so a failed test leaks nothing. */
static pid_t
spawn(const char *const *argv, int log_fd)
{
	const char *args[16];
	size_t n = 0;
	pid_t parent = getpid(), pid;

	args[n++] = daemon_path();
	for (; *argv != NULL && n < 15; argv++)
		args[n++] = *argv;
	args[n] = NULL;
	pid = fork();
	cr_assert_geq(pid, 0, "fork: %s", strerror(errno));
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(127);
		dup2(log_fd, STDOUT_FILENO);
		dup2(log_fd, STDERR_FILENO);
		execv(args[0], (char *const *)args);
		_exit(127);
	}
	return pid;
}

static bool
socket_answers(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	bool ok;

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	ok = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
	if (fd >= 0)
		close(fd);
	return ok;
}

const char *
itd_log_text(const struct itd *d)
{
	static char text[8192];
	FILE *f = fopen(d->log, "r");
	size_t n = 0;

	text[0] = '\0';
	if (f != NULL) {
		n = fread(text, 1, sizeof(text) - 1, f);
		text[n] = '\0';
		fclose(f);
	}
	return text;
}

void
itd_start(struct itd *d, const char *config_text)
{
	const char *argv[] = { "--config", NULL, "--socket", NULL, NULL };
	int log_fd, status;
	double deadline;

	itd_prepare(d, config_text);
	argv[1] = d->config;
	argv[3] = d->socket;
	log_fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	cr_assert_geq(log_fd, 0);
	d->pid = spawn(argv, log_fd);
	close(log_fd);
	/* Start-up is a few milliseconds; 10 s covers a loaded two-core machine. */
	deadline = itd_now() + 10;
	while (!socket_answers(d->socket)) {
		if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
			d->pid = 0;
			cr_assert_fail("zoffloadd exited at start (status 0x%x): %s", status,
			    itd_log_text(d));
		}
		cr_assert_lt(itd_now(), deadline, "zoffloadd did not listen within 10 s: %s",
		    itd_log_text(d));
		usleep(5000);
	}
}

static int
wait_bounded(pid_t pid, double timeout_s)
{
	double deadline = itd_now() + timeout_s;
	int status;

	for (;;) {
		pid_t r = waitpid(pid, &status, WNOHANG);

		if (r == pid)
			return status;
		if (r < 0 && errno != EINTR)
			return -1;
		if (itd_now() > deadline) {
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
			return -1;
		}
		usleep(2000);
	}
}

int
itd_wait(struct itd *d, double timeout_s)
{
	int status;

	cr_assert_gt(d->pid, 0, "no daemon running");
	status = wait_bounded(d->pid, timeout_s);
	d->pid = 0;
	return status;
}

int
itd_stop(struct itd *d, double timeout_s)
{
	cr_assert_gt(d->pid, 0, "no daemon running");
	kill(d->pid, SIGTERM);
	return itd_wait(d, timeout_s);
}

void
itd_cleanup(struct itd *d)
{
	(void)itd_kill_client(d, NULL);
	if (d->pid > 0) {
		kill(d->pid, SIGKILL);
		waitpid(d->pid, NULL, 0);
		d->pid = 0;
	}
	if (d->dir[0] == '\0')
		return;
	/* Kept for a post-mortem when asked to. */
	if (getenv("ZOFFLOAD_TEST_KEEP") == NULL) {
		unlink(d->socket);
		unlink(d->config);
		unlink(d->log);
		rmdir(d->dir);
	}
	d->dir[0] = '\0';
}

int
itd_run(const char *const *argv, char *out, size_t outlen, double timeout_s)
{
	char path[] = "/tmp/zoff-it-run-XXXXXX";
	int fd, status;
	ssize_t n;

	fd = mkstemp(path);
	cr_assert_geq(fd, 0);
	unlink(path);
	status = wait_bounded(spawn(argv, fd), timeout_s);
	n = pread(fd, out, outlen - 1, 0);
	out[n > 0 ? n : 0] = '\0';
	close(fd);
	return status;
}

struct zc_conn *
itd_connect(const struct itd *d)
{
	struct zc_conn *c = NULL;
	int r = zc_connect(d->socket, &c);

	cr_assert_eq(r, 0, "zc_connect %s: %s", d->socket, strerror(-r));
	return c;
}

double
itd_stat(struct zc_conn *c, const char *path)
{
	char *json = NULL, key[160], *save = NULL, *end;
	const cJSON *cur;
	cJSON *root;
	double v;
	int r;

	r = zc_stats_json(c, &json);
	cr_assert_eq(r, 0, "zc_stats_json: %s", zc_errmsg(c));
	root = cJSON_Parse(json);
	cr_assert_not_null(root, "stats are not JSON: %s", json);
	snprintf(key, sizeof(key), "%s", path);
	cur = root;
	for (char *k = strtok_r(key, ".", &save); k != NULL && cur != NULL;
	    k = strtok_r(NULL, ".", &save)) {
		long i = strtol(k, &end, 10);

		if (*end == '\0' && cJSON_IsArray(cur))
			cur = cJSON_GetArrayItem(cur, (int)i);
		else
			cur = cJSON_GetObjectItemCaseSensitive(cur, k);
	}
	cr_assert(cJSON_IsNumber(cur), "stats have no number at %s: %s", path, json);
	v = cur->valuedouble;
	cJSON_Delete(root);
	free(json);
	return v;
}

int
itd_raw_connect(const struct itd *d)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

	cr_assert_geq(fd, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", d->socket);
	cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "connect: %s",
	    strerror(errno));
	return fd;
}

void
itd_raw_send(int fd, uint16_t type, uint64_t request_id, const struct zp_msg *body)
{
	static struct zp_msg m;
	int r;

	if (body != NULL)
		m = *body;
	else
		memset(&m, 0, sizeof(m));
	m.hdr.type = type;
	m.hdr.request_id = request_id;
	r = zp_send(fd, &m, NULL, 0);
	cr_assert_eq(r, 0, "send %s: %s", zp_type_name(type), strerror(-r));
}

bool
itd_raw_recv(int fd, struct zp_msg *m, double timeout_s)
{
	static uint8_t buf[ZP_MAX_MESSAGE];
	struct pollfd p = { .fd = fd, .events = POLLIN };
	int fds[ZP_MAX_FDS];
	unsigned nfds = 0;
	char why[256];
	ssize_t n;

	cr_assert_eq(poll(&p, 1, (int)(timeout_s * 1000)), 1, "no reply within %.0f s", timeout_s);
	n = zp_recv_raw(fd, buf, sizeof(buf), fds, ZP_MAX_FDS, &nfds, 0);
	if (n == 0 || n == -ECONNRESET)
		return false;
	cr_assert_gt(n, 0, "recv: %s", strerror((int)-n));
	for (unsigned i = 0; i < nfds; i++)
		close(fds[i]);
	cr_assert_eq(zp_decode(buf, (size_t)n, m, why, sizeof(why)), ZP_S_OK,
	    "the daemon sent a bad message: %s", why);
	return true;
}

void
itd_raw_hello(int fd)
{
	static struct zp_msg m;

	strcpy(m.u.hello.client_name, "raw test client");
	itd_raw_send(fd, ZP_HELLO, 1, &m);
	cr_assert(itd_raw_recv(fd, &m, 5));
	cr_assert_eq(m.hdr.type, ZP_HELLO_OK, "HELLO answered with %s", zp_type_name(m.hdr.type));
}

void
itd_raw_expect_refusal(int fd, int code, const char *text)
{
	static struct zp_msg m;

	cr_assert(itd_raw_recv(fd, &m, 5), "closed without an ERROR for '%s'", text);
	cr_assert_eq(m.hdr.type, ZP_ERROR, "answered %s", zp_type_name(m.hdr.type));
	cr_assert_eq(m.u.error.code, code, "code %d for '%s' (%s)", m.u.error.code, text,
	    m.u.error.message);
	cr_assert(strstr(m.u.error.message, text) != NULL, "'%s' does not say '%s'",
	    m.u.error.message, text);
	cr_assert_not(itd_raw_recv(fd, &m, 5), "connection still open after '%s'", text);
	close(fd);
}

void
itd_fork_client(struct itd *d, void (*fn)(int report), double timeout_s, const char *who,
    const char *what)
{
	struct pollfd pfd;
	int p[2];
	char byte;

	cr_assert_eq(d->client, 0, "a client is still running");
	cr_assert_eq(pipe(p), 0);
	d->client = fork();
	cr_assert_geq(d->client, 0);
	if (d->client == 0) {
		close(p[0]);
		fn(p[1]);
		_exit(1);
	}
	close(p[1]);
	pfd = (struct pollfd){ .fd = p[0], .events = POLLIN };
	cr_assert_eq(poll(&pfd, 1, (int)(timeout_s * 1000)), 1, "%s did not get to %s", who, what);
	cr_assert_eq(read(p[0], &byte, 1), 1, "%s failed before it got to %s: %s", who, what,
	    itd_log_text(d));
	close(p[0]);
}

int
itd_kill_client(struct itd *d, int *ret_status)
{
	pid_t pid = d->client;
	int status;

	if (pid <= 0)
		return -ECHILD;
	d->client = 0;
	kill(pid, SIGKILL);
	if (waitpid(pid, &status, 0) != pid)
		return -errno;
	if (ret_status != NULL)
		*ret_status = status;
	return 0;
}

uint64_t
itd_rand(struct itd_rng *r)
{
	r->s ^= r->s >> 12;
	r->s ^= r->s << 25;
	r->s ^= r->s >> 27;
	return r->s * 0x2545f4914f6cdd1dull;
}

double
itd_uniform(struct itd_rng *r)
{
	return (double)(itd_rand(r) >> 11) / (double)(1ull << 52) - 1.0;
}

float
itd_bf16_to_f32(uint16_t h)
{
	uint32_t bits = (uint32_t)h << 16;
	float f;

	memcpy(&f, &bits, sizeof(f));
	return f;
}

uint16_t
itd_f32_to_bf16_rne(float f)
{
	uint32_t bits;

	memcpy(&bits, &f, sizeof(bits));
	/* Round to nearest, ties to even: add 0x7fff plus the bit that would become the lsb. */
	bits += 0x7fffu + ((bits >> 16) & 1u);
	return (uint16_t)(bits >> 16);
}

float
itd_f16_to_f32(uint16_t h)
{
	unsigned exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
	double v;

	if (exp == 0)
		v = ldexp(mant, -24);		/* subnormal */
	else if (exp == 31)
		v = mant != 0 ? NAN : INFINITY;
	else
		v = ldexp(1024 + mant, (int)exp - 25);
	return (float)((h & 0x8000) ? -v : v);
}

void
itd_ref_adam(double *p, double *m, double *v, const double *g, size_t n,
    const struct zc_step_params *sp)
{
	double t = (double)sp->step;
	double bc1 = 1 - pow(sp->beta1, t), bc2 = 1 - pow(sp->beta2, t);

	for (size_t i = 0; i < n; i++) {
		double gi = g[i], pi = p[i];

		if (sp->optim == ZC_ADAMW)
			pi *= 1 - sp->lr * sp->weight_decay;
		else
			gi += sp->weight_decay * pi;
		m[i] = m[i] + (1 - sp->beta1) * (gi - m[i]);
		v[i] = sp->beta2 * v[i] + (1 - sp->beta2) * gi * gi;
		pi -= (sp->lr / bc1) * m[i] / (sqrt(v[i]) / sqrt(bc2) + sp->eps);
		p[i] = pi;
	}
}

size_t
itd_ref_lion(double *p, double *m, const double *g, size_t n, const struct zc_step_params *sp,
    bool *ambiguous)
{
	size_t count = 0;

	for (size_t i = 0; i < n; i++) {
		double c = sp->beta1 * m[i] + (1 - sp->beta1) * g[i];
		double mag = fabs(sp->beta1 * m[i]) + fabs((1 - sp->beta1) * g[i]);
		bool coin = c != 0 && fabs(c) <= 1e-5 * mag;

		if (ambiguous != NULL)
			ambiguous[i] = coin;
		count += coin;
		p[i] *= 1 - sp->lr * sp->weight_decay;
		p[i] -= sp->lr * (double)((c > 0) - (c < 0));
		m[i] = sp->beta2 * m[i] + (1 - sp->beta2) * g[i];
	}
	return count;
}

void
itd_ref_adagrad(double *p, double *sum, const double *g, size_t n,
    const struct zc_step_params *sp)
{
	double clr = sp->lr / (1 + ((double)sp->step - 1) * sp->lr_decay);

	for (size_t i = 0; i < n; i++) {
		double gi = g[i];

		if (sp->weight_decay != 0)
			gi += sp->weight_decay * p[i];
		sum[i] += gi * gi;
		p[i] -= clr * gi / (sqrt(sum[i]) + sp->eps);
	}
}

double
itd_max_rel_err(const float *got, const double *want, size_t n)
{
	double max_err = 0, max_mag = 0;

	for (size_t i = 0; i < n; i++) {
		double err = fabs((double)got[i] - want[i]);

		if (isnan(err))
			return INFINITY;
		if (err > max_err)
			max_err = err;
		if (fabs(want[i]) > max_mag)
			max_mag = fabs(want[i]);
	}
	return max_mag > 0 ? max_err / max_mag : max_err;
}
