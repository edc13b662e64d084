/* Daemon logging: stderr (the journal under systemd), with and without errno. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "util.h"
#include "swap.h"

static enum zd_log_level current_level = ZD_LOG_INFO;

static const char *const level_names[] = { "error", "warn", "info", "debug" };
/* sd-daemon(3) priority prefixes, so the journal keeps the level. */
static const char *const level_prefix[] = { "<3>", "<4>", "<6>", "<7>" };

void
log_set_level(enum zd_log_level level)
{
	current_level = level;
}

enum zd_log_level
log_get_level(void)
{
	return current_level;
}

int
log_level_parse(const char *name, enum zd_log_level *ret)
{
	for (unsigned i = 0; i < sizeof(level_names) / sizeof(level_names[0]); i++) {
		if (strcmp(name, level_names[i]) == 0) {
			*ret = (enum zd_log_level)i;
			return 0;
		}
	}
	return -1;
}

const char *
log_level_name(enum zd_log_level level)
{
	return level_names[level];
}

/*
 * Whether stderr is the journal: $JOURNAL_STREAM names the device and inode
 * of the stream systemd connected, and only when stderr is still that stream
 * (not redirected by a wrapper or a shell) does the journal stamp the lines.
 * Decided at the first message and kept.
 */
bool
log_stderr_is_journal(void)
{
	static int cached = -1;
	const char *env;
	unsigned long long dev, ino;
	struct stat st;

	if (cached >= 0)
		return cached;
	env = getenv("JOURNAL_STREAM");
	cached = env != NULL && sscanf(env, "%llu:%llu", &dev, &ino) == 2 &&
	    fstat(STDERR_FILENO, &st) == 0 && (unsigned long long)st.st_dev == dev &&
	    (unsigned long long)st.st_ino == ino;
	return cached;
}

/* "2026-11-30T12:00:00.123Z": UTC, milliseconds, sortable. */
static void
timestamp(char *buf, size_t len)
{
	struct timespec ts;
	struct tm tm;

	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	snprintf(buf, len, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ", tm.tm_year + 1900,
	    tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000);
}

static void vlog(enum zd_log_level level, int err, const char *fmt, va_list ap) ZD_PRINTF(3, 0);

static void
vlog(enum zd_log_level level, int err, const char *fmt, va_list ap)
{
	char line[1024], when[64];
	int n;

	if (level > current_level)
		return;
	n = vsnprintf(line, sizeof(line), fmt, ap);
	if (err != 0 && n >= 0 && (size_t)n < sizeof(line))
		snprintf(line + n, sizeof(line) - (size_t)n, ": %s", zs_strerror(err < 0 ? err : -err));
	/* The journal adds its own timestamps; anything else gets one, and the level name. */
	if (log_stderr_is_journal()) {
		fprintf(stderr, "%s%s\n", level_prefix[level], line);
		return;
	}
	timestamp(when, sizeof(when));
	fprintf(stderr, "%s zoffloadd: %s: %s\n", when, level_names[level], line);
}

#define LOG_FN(name, level, with_err)					\
	void name(int err, const char *fmt, ...)			\
	{								\
		va_list ap;						\
		va_start(ap, fmt);					\
		vlog(level, with_err ? err : 0, fmt, ap);		\
		va_end(ap);						\
	}

LOG_FN(log_warn, ZD_LOG_WARN, 1)
LOG_FN(log_error, ZD_LOG_ERROR, 1)

#define LOGX_FN(name, level)						\
	void name(const char *fmt, ...)					\
	{								\
		va_list ap;						\
		va_start(ap, fmt);					\
		vlog(level, 0, fmt, ap);				\
		va_end(ap);						\
	}

LOGX_FN(log_warnx, ZD_LOG_WARN)
LOGX_FN(log_errorx, ZD_LOG_ERROR)
LOGX_FN(log_info, ZD_LOG_INFO)
LOGX_FN(log_debug, ZD_LOG_DEBUG)

void
fatalx(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vlog(ZD_LOG_ERROR, 0, fmt, ap);
	va_end(ap);
	exit(1);
}

const char *
zd_fmt_bytes(unsigned long long bytes, char *buf, unsigned long len)
{
	return zu_fmt_bytes(bytes, buf, len);
}
