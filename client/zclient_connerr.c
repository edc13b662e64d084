/*
 * libzclient: why zc_connect failed.  A failed connect returns no connection
 * to hold its message, so the message is kept per thread: each thread's
 * last zc_connect is the one it asks about, whatever other threads do.
 */
#include <errno.h>
#include <grp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "zclient.h"
#include "zclient_connerr.h"

/* Room for a socket path (108), a group name and the advice around them. */
static __thread char connect_err[512];

const char *
zc_connect_errmsg(void)
{
	return connect_err[0] != '\0' ? connect_err : "no error";
}

int
zcl_connect_fail(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(connect_err, sizeof(connect_err), fmt, ap);
	va_end(ap);
	return err;
}

void
zcl_connect_ok(void)
{
	connect_err[0] = '\0';
}

/* The group's name into buf, or its number when it has none (a gid from a container, say). */
static void
group_name(gid_t gid, char *buf, size_t len)
{
	struct group gr, *found = NULL;
	size_t size = 4096;
	char *mem = NULL;
	int r = 0;

	/* Groups with many members need more than any fixed buffer: grow on ERANGE. */
	do {
		char *bigger = realloc(mem, size);

		if (bigger == NULL)
			break;
		mem = bigger;
		r = getgrgid_r(gid, &gr, mem, size, &found);
		size *= 2;
	} while (r == ERANGE && size <= (1u << 20));
	if (found != NULL)
		snprintf(buf, len, "%s", found->gr_name);
	else
		snprintf(buf, len, "%u", (unsigned)gid);
	free(mem);
}

static bool
in_group(gid_t gid)
{
	gid_t groups[256];
	int n;

	if (getegid() == gid)
		return true;
	n = getgroups((int)(sizeof(groups) / sizeof(groups[0])), groups);
	for (int i = 0; i < n; i++)
		if (groups[i] == gid)
			return true;
	return false;
}

/*
 * What a user refused by the socket's permissions can do about it.  The
 * socket's own group and mode say which group admits users (socket.group,
 * zoffload with the shipped configuration), so the advice fits this daemon
 * rather than the packaged default.
 */
static int
denied(int err, const char *path)
{
	struct stat st;
	char group[64];

	if (stat(path, &st) != 0)
		return zcl_connect_fail(err, "permission denied on %s: a directory above it is "
		    "closed to you; users of zoffloadd need to be in its group (zoffload with the "
		    "shipped configuration)", path);
	if ((st.st_mode & S_IWGRP) == 0)
		return zcl_connect_fail(err, "permission denied on %s: its mode %04o admits its "
		    "owner only; zoffloadd's socket.mode must let its group in (0660, the default) "
		    "and socket.group name the users' group (zoffload with the shipped "
		    "configuration)", path, (unsigned)(st.st_mode & 07777));
	group_name(st.st_gid, group, sizeof(group));
	if (in_group(st.st_gid))
		return zcl_connect_fail(err, "permission denied on %s although you are in its "
		    "group %s: a security module (AppArmor, SELinux) or a directory above it "
		    "refuses you", path, group);
	return zcl_connect_fail(err, "permission denied on %s: add your user to group %s "
	    "(sudo usermod -aG %s $USER, then log in again)", path, group, group);
}

int
zcl_connect_refused(int err, const char *path)
{
	switch (err) {
	case -EACCES:
	case -EPERM:
		return denied(err, path);
	case -ENOENT:
	case -ECONNREFUSED:
		return zcl_connect_fail(err, "cannot connect to zoffloadd at %s: %s (is zoffloadd "
		    "running, and is that its socket?)", path, strerror(-err));
	case -ETIMEDOUT:
		return zcl_connect_fail(err, "cannot connect to zoffloadd at %s: its queue of "
		    "connections stayed full until the timeout", path);
	default:
		return zcl_connect_fail(err, "cannot connect to zoffloadd at %s: %s", path,
		    strerror(-err));
	}
}
