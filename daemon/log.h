/* Daemon logging: stderr (the journal under systemd), with and without errno. */
#ifndef ZD_LOG_H
#define ZD_LOG_H

#include <stdarg.h>
#include <stdbool.h>

enum zd_log_level { ZD_LOG_ERROR = 0, ZD_LOG_WARN = 1, ZD_LOG_INFO = 2, ZD_LOG_DEBUG = 3 };

#define ZD_PRINTF(a, b) __attribute__((format(printf, a, b)))

void log_set_level(enum zd_log_level level);
enum zd_log_level log_get_level(void);
int log_level_parse(const char *name, enum zd_log_level *ret);
const char *log_level_name(enum zd_log_level level);

/* _warn appends strerror(-err) / errno; _warnx does not. */
void log_warn(int err, const char *fmt, ...) ZD_PRINTF(2, 3);
void log_warnx(const char *fmt, ...) ZD_PRINTF(1, 2);
void log_error(int err, const char *fmt, ...) ZD_PRINTF(2, 3);
void log_errorx(const char *fmt, ...) ZD_PRINTF(1, 2);
void log_info(const char *fmt, ...) ZD_PRINTF(1, 2);
void log_debug(const char *fmt, ...) ZD_PRINTF(1, 2);
/* stderr is the journal's stream ($JOURNAL_STREAM matches it): no timestamps of our own. */
bool log_stderr_is_journal(void);
/* "1.5 GiB": sizes in messages. */
const char *zd_fmt_bytes(unsigned long long bytes, char *buf, unsigned long len);

__attribute__((noreturn)) void fatalx(const char *fmt, ...) ZD_PRINTF(1, 2);

#endif
