/* Daemon log lines: a UTC timestamp unless stderr is the journal's stream ($JOURNAL_STREAM). */
#include <criterion/criterion.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"

static char path[] = "/tmp/zoff-log-XXXXXX";
static char text[4096];

/* stderr into a temp file (each test runs in its own process). */
static void
capture(void)
{
	int fd = mkstemp(path);

	cr_assert_geq(fd, 0);
	cr_assert_geq(dup2(fd, STDERR_FILENO), 0);
	close(fd);
}

static const char *
captured(void)
{
	FILE *f = fopen(path, "r");
	size_t n;

	fflush(stderr);
	cr_assert_not_null(f);
	n = fread(text, 1, sizeof(text) - 1, f);
	text[n] = '\0';
	fclose(f);
	unlink(path);
	return text;
}

static bool
matches(const char *s, const char *pattern)
{
	regex_t re;
	bool m;

	cr_assert_eq(regcomp(&re, pattern, REG_EXTENDED | REG_NOSUB), 0);
	m = regexec(&re, s, 0, NULL, 0) == 0;
	regfree(&re);
	return m;
}

Test(log, timestamp_off_the_journal)
{
	unsetenv("JOURNAL_STREAM");
	capture();
	log_info("hello %d", 42);
	log_warnx("careful");
	captured();
	cr_assert(matches(text, "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z "
	    "zoffloadd: info: hello 42\n[0-9-]{10}T[0-9:.]{12}Z zoffloadd: warn: careful\n$"),
	    "'%s'", text);
}

Test(log, priority_prefix_on_the_journal)
{
	struct stat st;
	char env[64];

	capture();
	cr_assert_eq(fstat(STDERR_FILENO, &st), 0);
	snprintf(env, sizeof(env), "%llu:%llu", (unsigned long long)st.st_dev,
	    (unsigned long long)st.st_ino);
	setenv("JOURNAL_STREAM", env, 1);
	log_info("hello");
	log_errorx("broken");
	captured();
	cr_assert_str_eq(text, "<6>hello\n<3>broken\n");
}

/* $JOURNAL_STREAM inherited, but stderr redirected elsewhere: the journal will not stamp it. */
Test(log, journal_stream_of_another_file)
{
	setenv("JOURNAL_STREAM", "1:1", 1);
	capture();
	log_info("hello");
	captured();
	cr_assert(matches(text, "^[0-9-]{10}T[0-9:.]{12}Z zoffloadd: info: hello\n$"), "'%s'", text);
}
