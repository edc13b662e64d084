/* Fuzz target: zd_config_parse on arbitrary text; a refusal names the file, an acceptance leaves a configuration within its documented bounds. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond) do {						\
	if (!(cond)) {							\
		fprintf(stderr, "fuzz_config: %s:%d: %s\n", __FILE__, __LINE__, #cond);	\
		abort();						\
	}								\
} while (0)

static void
check_bounds(const struct zd_config *c)
{
	CHECK(c->source != NULL && strcmp(c->source, "fuzz.conf") == 0);
	CHECK(c->socket_path != NULL && c->socket_path[0] != '\0');
	CHECK(c->socket_mode <= 0777);
	CHECK(c->socket_group == NULL || c->socket_group[0] != '\0');
	CHECK(c->pinned_budget >= (1u << 20) && c->shm_budget >= (1u << 20));
	CHECK(c->xfer_window >= (64u << 10) && c->xfer_window <= (256ull << 20));
	CHECK(c->numa_node >= -1 && c->numa_node <= 1023);
	CHECK(c->policy >= 1 && c->policy <= 3);
	CHECK(c->worker_threads <= 1024 && c->ncpus <= ZD_MAX_CPUS);
	for (unsigned i = 0; i < c->ncpus; i++)
		CHECK(c->cpus[i] >= 0 && c->cpus[i] < ZD_MAX_CPUS);
	CHECK(c->isa != NULL && c->swap_engine != NULL);
	CHECK(c->nswap_paths <= ZD_MAX_SWAP_PATHS);
	for (unsigned i = 0; i < c->nswap_paths; i++)
		CHECK(c->swap_paths[i].path != NULL && c->swap_paths[i].capacity >= (1u << 20));
	CHECK(c->swap_block_size >= 4096 && (c->swap_block_size & (c->swap_block_size - 1)) == 0);
	CHECK(c->swap_queue_depth >= 1 && c->swap_queue_depth <= 4096);
	CHECK(c->staging_buffers >= 2 && c->staging_buffers <= 256);
	CHECK(c->chunk_elements % 1024 == 0 && c->chunk_elements <= (256u << 20));
	CHECK(c->max_clients >= 1 && c->max_queued_messages >= 16);
	CHECK(c->detach_grace_s <= 7 * 24 * 3600);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct zd_config cfg;
	char err[512];
	char *text;
	int r;

	/* The parser takes a C string, as zd_config_load hands it one. */
	text = malloc(size + 1);
	CHECK(text != NULL);
	memcpy(text, data, size);
	text[size] = '\0';
	CHECK(zd_config_defaults(&cfg) == 0);
	memset(err, 0x55, sizeof(err));
	r = zd_config_parse(text, "fuzz.conf", &cfg, err, sizeof(err));
	if (r < 0) {
		CHECK(r == -EINVAL || r == -ENOMEM);
		CHECK(memchr(err, '\0', sizeof(err)) != NULL);
		if (r == -EINVAL)
			CHECK(strncmp(err, "fuzz.conf: ", 11) == 0 && err[11] != '\0');
	} else {
		CHECK(r == 0);
		check_bounds(&cfg);
	}
	/* Whatever state a refusal left, clearing it frees everything (ASan's leak check). */
	zd_config_clear(&cfg);
	free(text);
	return 0;
}
