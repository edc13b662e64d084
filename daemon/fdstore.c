/* systemd's file descriptor store without libsystemd, and handing it to our own successor. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fdstore.h"
#include "server.h"

#define LISTEN_FDS_START 3

static int
name_check(const char *name)
{
	size_t n = strlen(name);

	if (n == 0 || n >= ZD_FDNAME_MAX)
		return -EINVAL;
	for (size_t i = 0; i < n; i++)
		if (name[i] <= ' ' || name[i] > '~' || name[i] == ':')
			return -EINVAL;
	return 0;
}

int
zd_fdstore_init(struct zd_fdstore *st, char *err, size_t errlen)
{
	const char *fds = getenv("LISTEN_FDS"), *pid = getenv("LISTEN_PID");
	const char *names = getenv("LISTEN_FDNAMES");
	unsigned long n;
	char *end, *copy = NULL, *save = NULL, *tok;
	int r = 0;

	*st = (struct zd_fdstore){ 0 };
	if (fds == NULL)
		goto out;
	/* Meant for another process (a wrapper that did not clear them): not ours. */
	if (pid != NULL && strtol(pid, NULL, 10) != (long)getpid())
		goto out;
	errno = 0;
	n = strtoul(fds, &end, 10);
	if (errno != 0 || *end != '\0' || n > 65536) {
		snprintf(err, errlen, "LISTEN_FDS=%s is not a count of descriptors", fds);
		r = -EINVAL;
		goto out;
	}
	if (n == 0)
		goto out;
	st->kept = calloc(n, sizeof(*st->kept));
	copy = strdup(names != NULL ? names : "");
	if (st->kept == NULL || copy == NULL) {
		r = -ENOMEM;
		snprintf(err, errlen, "out of memory");
		goto out;
	}
	tok = strtok_r(copy, ":", &save);
	for (unsigned long i = 0; i < n; i++) {
		int fd = LISTEN_FDS_START + (int)i;

		(void)fcntl(fd, F_SETFD, FD_CLOEXEC);
		st->kept[i].fd = fd;
		snprintf(st->kept[i].name, sizeof(st->kept[i].name), "%s",
		    tok != NULL ? tok : "unknown");
		tok = tok != NULL ? strtok_r(NULL, ":", &save) : NULL;
	}
	st->nkept = n;
out:
	free(copy);
	unsetenv("LISTEN_FDS");
	unsetenv("LISTEN_PID");
	unsetenv("LISTEN_FDNAMES");
	unsetenv("LISTEN_FDPID");
	return r;
}

void
zd_fdstore_fini(struct zd_fdstore *st)
{
	zd_fdstore_drop_kept(st, false);
	free(st->kept);
	free(st->live);
	*st = (struct zd_fdstore){ 0 };
}

int
zd_fdstore_take(struct zd_fdstore *st, const char *name)
{
	for (size_t i = 0; i < st->nkept; i++) {
		if (st->kept[i].fd >= 0 && strcmp(st->kept[i].name, name) == 0) {
			int fd = st->kept[i].fd;

			st->kept[i].fd = -1;
			return fd;
		}
	}
	return -1;
}

void
zd_fdstore_forget(struct zd_fdstore *st, const char *name)
{
	char msg[ZD_FDNAME_MAX + 40];

	snprintf(msg, sizeof(msg), "FDSTOREREMOVE=1\nFDNAME=%s", name);
	if (zd_notify(msg) < 0)
		st->send_errors++;
}

static void
send_remove(struct zd_fdstore *st, const char *name)
{
	zd_fdstore_forget(st, name);
}

void
zd_fdstore_drop_kept(struct zd_fdstore *st, bool forget)
{
	for (size_t i = 0; i < st->nkept; i++) {
		if (st->kept[i].fd < 0)
			continue;
		close(st->kept[i].fd);
		st->kept[i].fd = -1;
		if (forget)
			send_remove(st, st->kept[i].name);
	}
}

void
zd_fdstore_forget_kept(struct zd_fdstore *st)
{
	for (size_t i = 0; i < st->nkept; i++)
		if (st->kept[i].fd < 0)
			send_remove(st, st->kept[i].name);
	zd_fdstore_drop_kept(st, true);
	st->nkept = 0;
}

int
zd_fdstore_send(struct zd_fdstore *st, const char *name, int fd)
{
	char msg[ZD_FDNAME_MAX + 40];
	int r;

	snprintf(msg, sizeof(msg), "FDSTORE=1\nFDNAME=%s", name);
	r = zd_notify_fd(msg, fd);
	if (r < 0)
		st->send_errors++;
	return r < 0 ? r : 0;
}

void
zd_fdstore_rename(struct zd_fdstore *st, const char *from, const char *to)
{
	for (size_t i = 0; i < st->nlive; i++)
		if (strcmp(st->live[i].name, from) == 0)
			snprintf(st->live[i].name, sizeof(st->live[i].name), "%s", to);
}

int
zd_fdstore_add(struct zd_fdstore *st, const char *name, int fd, bool send)
{
	if (fd < 0 || name_check(name) < 0)
		return -EINVAL;
	if (st->nlive == st->live_cap) {
		size_t cap = st->live_cap ? st->live_cap * 2 : 64;
		struct zd_fdstore_entry *bigger = realloc(st->live, cap * sizeof(*bigger));

		if (bigger == NULL)
			return -ENOMEM;
		st->live = bigger;
		st->live_cap = cap;
	}
	snprintf(st->live[st->nlive].name, sizeof(st->live[0].name), "%s", name);
	st->live[st->nlive++].fd = fd;
	return send ? zd_fdstore_send(st, name, fd) : 0;
}

void
zd_fdstore_remove(struct zd_fdstore *st, const char *name)
{
	for (size_t i = 0; i < st->nlive; i++) {
		if (strcmp(st->live[i].name, name) != 0)
			continue;
		st->live[i] = st->live[--st->nlive];
		if (!st->quiet)
			send_remove(st, name);
		return;
	}
}

int
zd_fdstore_handoff(struct zd_fdstore *st, const char *path, char *const argv[])
{
	size_t n = st->nlive, len = 1;
	char count[24], pid[24], *names, *p;
	int *high;

	high = calloc(n ? n : 1, sizeof(*high));
	for (size_t i = 0; i < n; i++)
		len += strlen(st->live[i].name) + 1;
	names = malloc(len);
	if (high == NULL || names == NULL) {
		free(high);
		free(names);
		return -ENOMEM;
	}
	/* Out of the way of 3 .. 3 + n first (close-on-exec), then down into place. */
	for (size_t i = 0; i < n; i++) {
		high[i] = fcntl(st->live[i].fd, F_DUPFD_CLOEXEC, LISTEN_FDS_START + (int)n);
		if (high[i] < 0) {
			int r = -errno;

			while (i-- > 0)
				close(high[i]);
			free(high);
			free(names);
			return r;
		}
	}
	p = names;
	*p = '\0';
	for (size_t i = 0; i < n; i++) {
		/* dup2 leaves the copy open across exec: it is the successor's. */
		if (dup2(high[i], LISTEN_FDS_START + (int)i) < 0)
			return -errno;
		p += sprintf(p, "%s%s", i > 0 ? ":" : "", st->live[i].name);
	}
	snprintf(count, sizeof(count), "%zu", n);
	snprintf(pid, sizeof(pid), "%ld", (long)getpid());
	setenv("LISTEN_FDS", count, 1);
	setenv("LISTEN_PID", pid, 1);
	setenv("LISTEN_FDNAMES", names, 1);
	execv(path, argv);
	return -errno;
}
