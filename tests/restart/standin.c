/* The systemd stand-in: notify socket, fd store, and starting the service with LISTEN_FDS. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "standin.h"

static double
now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The value of KEY= among the datagram's lines, copied; false when absent. */
static bool
field(const char *msg, const char *key, char *out, size_t outlen)
{
	size_t n = strlen(key);

	for (const char *p = msg; p != NULL && *p != '\0'; ) {
		const char *end = strchr(p, '\n');
		size_t len = end != NULL ? (size_t)(end - p) : strlen(p);

		if (len > n && strncmp(p, key, n) == 0 && p[n] == '=') {
			snprintf(out, outlen, "%.*s", (int)(len - n - 1), p + n + 1);
			return true;
		}
		p = end != NULL ? end + 1 : NULL;
	}
	return false;
}

static void
store_remove(struct zst *s, const char *name)
{
	for (size_t i = 0; i < s->nfds; ) {
		if (strcmp(s->fds[i].name, name) == 0) {
			close(s->fds[i].fd);
			s->fds[i] = s->fds[--s->nfds];
		} else {
			i++;
		}
	}
}

static void
count_store(struct zst *s, const char *name)
{
	size_t i;

	for (i = 0; i < s->nnames; i++)
		if (strcmp(s->names[i].name, name) == 0)
			break;
	if (i == s->nnames) {
		if (s->nnames == ZST_MAX_FDS)
			return;
		snprintf(s->names[i].name, sizeof(s->names[0].name), "%s", name);
		s->names[s->nnames++].stores = 0;
	}
	s->names[i].stores++;
}

static void
handle(struct zst *s, const char *msg, int fd)
{
	char name[64] = "stored", v[16];

	field(msg, "FDNAME", name, sizeof(name));
	if (field(msg, "READY", v, sizeof(v)) && strcmp(v, "1") == 0) {
		s->readies++;
		pthread_cond_broadcast(&s->cond);
	}
	if (field(msg, "FDSTOREREMOVE", v, sizeof(v)) && strcmp(v, "1") == 0) {
		store_remove(s, name);
		s->removes++;
	}
	if (fd >= 0 && field(msg, "FDSTORE", v, sizeof(v)) && strcmp(v, "1") == 0 &&
	    s->nfds < ZST_MAX_FDS) {
		/* systemd keeps one descriptor per name as far as we are concerned. */
		store_remove(s, name);
		snprintf(s->fds[s->nfds].name, sizeof(s->fds[0].name), "%s", name);
		s->fds[s->nfds++].fd = fd;
		s->stores++;
		count_store(s, name);
		fd = -1;
	}
	if (fd >= 0)
		close(fd);
}

static void *
reader(void *arg)
{
	struct zst *s = arg;

	for (;;) {
		char buf[4096], control[CMSG_SPACE(sizeof(int) * 8)];
		struct iovec iov = { buf, sizeof(buf) - 1 };
		struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
			.msg_controllen = sizeof(control) };
		struct pollfd p = { .fd = s->notify_fd, .events = POLLIN };
		struct cmsghdr *cm;
		ssize_t n;
		int fd = -1;

		pthread_mutex_lock(&s->lock);
		if (s->stopping) {
			pthread_mutex_unlock(&s->lock);
			return NULL;
		}
		pthread_mutex_unlock(&s->lock);
		if (poll(&p, 1, 50) != 1)
			continue;
		/* Received and handled under the lock: zst_drain sees both or neither. */
		pthread_mutex_lock(&s->lock);
		n = recvmsg(s->notify_fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
		if (n >= 0) {
			buf[n] = '\0';
			for (cm = CMSG_FIRSTHDR(&mh); cm != NULL; cm = CMSG_NXTHDR(&mh, cm))
				if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
					memcpy(&fd, CMSG_DATA(cm), sizeof(int));
			handle(s, buf, fd);
		}
		pthread_mutex_unlock(&s->lock);
	}
}

int
zst_init(struct zst *s)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int r;

	memset(s, 0, sizeof(*s));
	snprintf(s->dir, sizeof(s->dir), "/tmp/zoff-standin-XXXXXX");
	if (mkdtemp(s->dir) == NULL)
		return -errno;
	snprintf(s->notify_path, sizeof(s->notify_path), "%s/notify", s->dir);
	snprintf(s->log_path, sizeof(s->log_path), "%s/service.log", s->dir);
	s->notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (s->notify_fd < 0)
		return -errno;
	/* Room for a burst of FDSTORE=1 datagrams between two reads. */
	(void)setsockopt(s->notify_fd, SOL_SOCKET, SO_RCVBUF, &(int){ 8 << 20 }, sizeof(int));
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", s->notify_path);
	if (bind(s->notify_fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
		return -errno;
	pthread_mutex_init(&s->lock, NULL);
	pthread_cond_init(&s->cond, NULL);
	r = -pthread_create(&s->thread, NULL, reader, s);
	if (r == 0)
		s->thread_running = true;
	return r;
}

void
zst_fini(struct zst *s)
{
	char cmd[128];

	if (s->pid > 0) {
		kill(s->pid, SIGKILL);
		waitpid(s->pid, NULL, 0);
		s->pid = 0;
	}
	if (s->thread_running) {
		pthread_mutex_lock(&s->lock);
		s->stopping = true;
		pthread_mutex_unlock(&s->lock);
		pthread_join(s->thread, NULL);
		s->thread_running = false;
		pthread_mutex_destroy(&s->lock);
		pthread_cond_destroy(&s->cond);
	}
	for (size_t i = 0; i < s->nfds; i++)
		close(s->fds[i].fd);
	s->nfds = 0;
	if (s->notify_fd > 0)
		close(s->notify_fd);
	s->notify_fd = -1;
	if (s->dir[0] != '\0' && getenv("ZRT_KEEP") == NULL) {
		snprintf(cmd, sizeof(cmd), "rm -rf '%s'", s->dir);
		(void)!system(cmd);
		s->dir[0] = '\0';
	}
}

int
zst_start(struct zst *s, const char *const *argv)
{
	pid_t parent = getpid(), pid;
	size_t n, len = 1;
	char *names, *p;
	int log_fd, *high;

	pthread_mutex_lock(&s->lock);
	n = s->nfds;
	for (size_t i = 0; i < n; i++)
		len += strlen(s->fds[i].name) + 1;
	names = malloc(len);
	high = calloc(n + 1, sizeof(*high));
	if (names == NULL || high == NULL) {
		pthread_mutex_unlock(&s->lock);
		free(names);
		free(high);
		return -ENOMEM;
	}
	p = names;
	*p = '\0';
	for (size_t i = 0; i < n; i++) {
		p += sprintf(p, "%s%s", i > 0 ? ":" : "", s->fds[i].name);
		/* Above where they go, so that placing one cannot close another. */
		high[i] = fcntl(s->fds[i].fd, F_DUPFD_CLOEXEC, 3 + (int)n + 16);
	}
	pthread_mutex_unlock(&s->lock);
	log_fd = open(s->log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
	pid = fork();
	if (pid < 0) {
		free(names);
		free(high);
		return -errno;
	}
	if (pid == 0) {
		char buf[32];

		/*
		 * No PR_SET_PDEATHSIG: the parent it means is the forking thread, and a
		 * test's restarting thread ends before the service does.
		 */
		(void)parent;
		dup2(log_fd, STDOUT_FILENO);
		dup2(log_fd, STDERR_FILENO);
		for (size_t i = 0; i < n; i++)
			dup2(high[i], 3 + (int)i);
		setenv("NOTIFY_SOCKET", s->notify_path, 1);
		if (n > 0) {
			snprintf(buf, sizeof(buf), "%zu", n);
			setenv("LISTEN_FDS", buf, 1);
			snprintf(buf, sizeof(buf), "%ld", (long)getpid());
			setenv("LISTEN_PID", buf, 1);
			setenv("LISTEN_FDNAMES", names, 1);
		} else {
			unsetenv("LISTEN_FDS");
		}
		execv(argv[0], (char *const *)argv);
		_exit(127);
	}
	for (size_t i = 0; i < n; i++)
		close(high[i]);
	close(log_fd);
	free(names);
	free(high);
	s->pid = pid;
	return 0;
}

int
zst_wait_ready(struct zst *s, unsigned readies, double timeout_s)
{
	double deadline = now() + timeout_s;
	int r = 0, status;

	pthread_mutex_lock(&s->lock);
	while (s->readies < readies) {
		struct timespec ts = { 0, 20 * 1000 * 1000 };

		pthread_mutex_unlock(&s->lock);
		if (s->pid > 0 && waitpid(s->pid, &status, WNOHANG) == s->pid) {
			s->pid = 0;
			return -ECHILD;
		}
		if (now() > deadline)
			return -ETIMEDOUT;
		nanosleep(&ts, NULL);
		pthread_mutex_lock(&s->lock);
	}
	pthread_mutex_unlock(&s->lock);
	return r;
}

void
zst_drain(struct zst *s)
{
	for (;;) {
		struct pollfd p = { .fd = s->notify_fd, .events = POLLIN };
		int pending;

		pthread_mutex_lock(&s->lock);
		pending = poll(&p, 1, 0);
		pthread_mutex_unlock(&s->lock);
		if (pending <= 0)
			return;
		usleep(1000);
	}
}

int
zst_wait_exit(struct zst *s, double timeout_s)
{
	double deadline = now() + timeout_s;
	int status;

	while (s->pid > 0) {
		pid_t r = waitpid(s->pid, &status, WNOHANG);

		if (r == s->pid) {
			s->pid = 0;
			/* What it sent before it died is read before anything restarts it. */
			zst_drain(s);
			return status;
		}
		if (now() > deadline)
			return -1;
		usleep(2000);
	}
	return -1;
}

int
zst_fd(struct zst *s, const char *name)
{
	int fd = -1;

	pthread_mutex_lock(&s->lock);
	for (size_t i = 0; i < s->nfds && fd < 0; i++)
		if (strcmp(s->fds[i].name, name) == 0)
			fd = s->fds[i].fd;
	pthread_mutex_unlock(&s->lock);
	return fd;
}

unsigned
zst_times_stored(struct zst *s, const char *name)
{
	unsigned n = 0;

	pthread_mutex_lock(&s->lock);
	for (size_t i = 0; i < s->nnames; i++)
		if (strcmp(s->names[i].name, name) == 0)
			n = s->names[i].stores;
	pthread_mutex_unlock(&s->lock);
	return n;
}

const char *
zst_log(const struct zst *s)
{
	static char buf[16384];
	FILE *f = fopen(s->log_path, "r");
	size_t n = 0;
	long size;

	buf[0] = '\0';
	if (f == NULL)
		return buf;
	/* The end: where what went wrong is. */
	fseek(f, 0, SEEK_END);
	size = ftell(f);
	if (size > (long)sizeof(buf) - 1)
		fseek(f, size - (long)sizeof(buf) + 1, SEEK_SET);
	else
		fseek(f, 0, SEEK_SET);
	n = fread(buf, 1, sizeof(buf) - 1, f);
	buf[n] = '\0';
	fclose(f);
	return buf;
}

uint64_t
zst_digest(int fd)
{
	static uint64_t buf[1 << 13];
	uint64_t h = 1469598103934665603ull;
	off_t off = 0;
	ssize_t n;

	while ((n = pread(fd, buf, sizeof(buf), off)) > 0) {
		if (n % 8 != 0)
			memset((char *)buf + n, 0, (size_t)(8 - n % 8));
		for (ssize_t i = 0; i < (n + 7) / 8; i++)
			h = (h ^ buf[i]) * 1099511628211ull;
		off += n;
	}
	return (h ^ (uint64_t)off) * 1099511628211ull;
}
