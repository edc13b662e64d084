/* A benchmark's own zoffloadd on a temporary socket, and reading numbers out of its stats. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_common.h"
#include "bench_daemon.h"
#include "zclient.h"

int
bench_daemon_prepare(struct bench_daemon *bd, const char *parent, const char *prefix)
{
	memset(bd, 0, sizeof(*bd));
	bd->pid = -1;
	if ((size_t)snprintf(bd->dir, sizeof(bd->dir), "%s/%s-XXXXXX", parent, prefix) >=
	    sizeof(bd->dir))
		return -ENAMETOOLONG;
	if (mkdtemp(bd->dir) == NULL)
		return -errno;
	snprintf(bd->socket, sizeof(bd->socket), "%s/sock", bd->dir);
	snprintf(bd->config, sizeof(bd->config), "%s/zoffload.conf", bd->dir);
	snprintf(bd->log, sizeof(bd->log), "%s/daemon.log", bd->dir);
	return 0;
}

int
bench_daemon_start(struct bench_daemon *bd, const char *exe, const cpu_set_t *cpus,
    double timeout_s)
{
	pid_t parent = getpid();
	struct zc_conn *c = NULL;
	double deadline;
	int fd;

	fd = open(bd->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return -errno;
	bd->pid = fork();
	if (bd->pid < 0) {
		close(fd);
		return -errno;
	}
	if (bd->pid == 0) {
		/* Killed with us: a benchmark that dies leaves no daemon behind. */
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(127);
		if (cpus != NULL && sched_setaffinity(0, sizeof(*cpus), cpus) != 0)
			_exit(126);
		dup2(fd, STDOUT_FILENO);
		dup2(fd, STDERR_FILENO);
		execl(exe, exe, "--config", bd->config, "--socket", bd->socket, (char *)NULL);
		_exit(127);
	}
	close(fd);
	deadline = bench_now() + timeout_s;
	while (zc_connect(bd->socket, &c) < 0) {
		if (waitpid(bd->pid, NULL, WNOHANG) == bd->pid) {
			bd->pid = -1;
			return -ECHILD;
		}
		if (bench_now() > deadline)
			return -ETIMEDOUT;
		usleep(20000);
	}
	zc_disconnect(c);
	return 0;
}

int
bench_daemon_stop(struct bench_daemon *bd)
{
	int status = 0;

	if (bd->pid > 0) {
		kill(bd->pid, SIGTERM);
		if (waitpid(bd->pid, &status, 0) != bd->pid)
			status = -1;
		else if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
			status = 0;
		bd->pid = -1;
	}
	unlink(bd->socket);
	unlink(bd->config);
	if (status == 0)
		unlink(bd->log);
	rmdir(bd->dir);
	return status;
}

/* The stats' node at a dotted path; numeric parts index arrays.  NULL when absent. */
static const cJSON *
stat_node(const cJSON *root, const char *path)
{
	char key[128], *save = NULL, *end;
	const cJSON *cur = root;

	snprintf(key, sizeof(key), "%s", path);
	for (char *k = strtok_r(key, ".", &save); k != NULL && cur != NULL;
	    k = strtok_r(NULL, ".", &save)) {
		long i = strtol(k, &end, 10);

		cur = *end == '\0' && cJSON_IsArray(cur) ? cJSON_GetArrayItem(cur, (int)i) :
		    cJSON_GetObjectItemCaseSensitive(cur, k);
	}
	return cur;
}

int
bench_stat_number(struct zc_conn *c, const char *path, double *ret)
{
	char *json = NULL;
	const cJSON *node;
	cJSON *root;
	int r;

	r = zc_stats_json(c, &json);
	if (r < 0)
		return r;
	root = cJSON_Parse(json);
	free(json);
	if (root == NULL)
		return -EBADMSG;
	node = stat_node(root, path);
	r = cJSON_IsNumber(node) ? 0 : -ENOENT;
	if (r == 0)
		*ret = node->valuedouble;
	cJSON_Delete(root);
	return r;
}

void
bench_stat_string(struct zc_conn *c, const char *path, char *out, size_t len)
{
	char *json = NULL;
	const cJSON *node;
	cJSON *root;

	snprintf(out, len, "?");
	if (zc_stats_json(c, &json) < 0)
		return;
	root = cJSON_Parse(json);
	free(json);
	node = stat_node(root, path);
	if (cJSON_IsString(node))
		snprintf(out, len, "%s", node->valuestring);
	cJSON_Delete(root);
}
