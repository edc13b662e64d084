/* zoffloadd: the per-node optimizer-offload daemon. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "build_config.h"
#include "config_check.h"
#include "daemon.h"
#include "log.h"
#include "server.h"

static void
usage(FILE *f)
{
	fprintf(f,
	    "usage: zoffloadd [--config PATH] [--socket PATH] [--log-level LEVEL] [--start-empty]\n"
	    "                 [--check-config]\n"
	    "\n"
	    "  -c, --config PATH     configuration file (default %s; built-in defaults if absent)\n"
	    "  -D, --no-config       ignore any configuration file: built-in defaults only\n"
	    "  -s, --socket PATH     listen here instead of the configured socket path\n"
	    "  -l, --log-level L     error, warn, info or debug\n"
	    "  -E, --start-empty     when the state a restart handed back cannot be used,\n"
	    "                        set it aside and start empty instead of refusing\n"
	    "  -n, --check-config    validate the configuration and what it names on this\n"
	    "                        machine (swap paths, free space, socket group), and exit\n"
	    "  -V, --version         print the version and exit\n",
	    ZOFFLOAD_DEFAULT_CONFIG);
}

int
main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "config", required_argument, NULL, 'c' },
		{ "no-config", no_argument, NULL, 'D' },
		{ "socket", required_argument, NULL, 's' },
		{ "log-level", required_argument, NULL, 'l' },
		{ "check-config", no_argument, NULL, 'n' },
		{ "start-empty", no_argument, NULL, 'E' },
		{ "version", no_argument, NULL, 'V' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	struct zd_daemon d = { 0 };
	const char *config_path = NULL, *socket_path = NULL, *level = NULL;
	bool check_only = false, no_config = false, start_empty = false;
	ssize_t n;
	char err[512];
	int c, r;

	while ((c = getopt_long(argc, argv, "c:Ds:l:nEVh", opts, NULL)) != -1) {
		switch (c) {
		case 'c': config_path = optarg; break;
		case 'D': no_config = true; break;
		case 's': socket_path = optarg; break;
		case 'l': level = optarg; break;
		case 'n': check_only = true; break;
		case 'E': start_empty = true; break;
		case 'V': printf("zoffloadd %s\n", ZOFFLOAD_VERSION); return 0;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (optind != argc) {
		fprintf(stderr, "zoffloadd: unexpected argument '%s'\n", argv[optind]);
		usage(stderr);
		return 2;
	}

	if (zd_config_defaults(&d.cfg) != 0) {
		fprintf(stderr, "zoffloadd: out of memory\n");
		return 1;
	}
	/* An explicit --config must exist; the default path may be absent. */
	d.config_path = config_path != NULL ? config_path : ZOFFLOAD_DEFAULT_CONFIG;
	if (no_config && config_path != NULL) {
		fprintf(stderr, "zoffloadd: --config and --no-config exclude each other\n");
		zd_config_clear(&d.cfg);
		return 2;
	}
	r = no_config ? 0 : zd_config_load(d.config_path, config_path == NULL, &d.cfg, err,
	    sizeof(err));
	if (r < 0) {
		fprintf(stderr, "zoffloadd: %s\n", err);
		zd_config_clear(&d.cfg);
		return 1;
	}
	d.config_from_file = strcmp(d.cfg.source, "built-in defaults") != 0;
	if (check_only) {
		unsigned problems = zd_config_check_host(&d.cfg, stdout);

		if (problems > 0)
			fprintf(stderr, "zoffloadd: configuration %s: %u problem(s) on this machine\n",
			    d.cfg.source, problems);
		else
			printf("zoffloadd: configuration OK (%s)\n", d.cfg.source);
		zd_config_clear(&d.cfg);
		return problems > 0 ? 1 : 0;
	}
	if (socket_path != NULL) {
		free(d.cfg.socket_path);
		d.cfg.socket_path = strdup(socket_path);
	}
	if (level != NULL && log_level_parse(level, &d.cfg.log_level) != 0) {
		fprintf(stderr, "zoffloadd: --log-level: '%s' is not error, warn, info or debug\n",
		    level);
		zd_config_clear(&d.cfg);
		return 2;
	}
	log_set_level(d.cfg.log_level);
	d.start_empty = start_empty || d.cfg.recovery_start_empty;
	/* SIGUSR2 runs whatever is at this path then: the new binary after an upgrade. */
	d.argv = argv;
	n = readlink("/proc/self/exe", d.exe, sizeof(d.exe) - 1);
	d.exe[n > 0 ? n : 0] = '\0';
	r = zd_server_run(&d);
	zd_config_clear(&d.cfg);
	return r == 0 ? 0 : 1;
}
