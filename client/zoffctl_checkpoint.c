/* zoffctl checkpoint inspect DIR: ranks, tensors, steps and sizes, every checksum verified. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_index.h"
#include "ckpt_tmpfile.h"
#include "zoffctl_checkpoint.h"

static const char *
human(uint64_t bytes, char *buf, size_t len)
{
	static const char *const units[] = { "B", "KiB", "MiB", "GiB", "TiB" };
	double v = (double)bytes;
	unsigned u = 0;

	while (v >= 1024 && u < 4) {
		v /= 1024;
		u++;
	}
	snprintf(buf, len, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
	return buf;
}

struct param {
	const char *name;
	uint64_t numel;
	uint64_t covered;		/* elements held by some rank file, overlaps counted once */
	uint64_t step;
	bool mixed_steps;
};

static int
by_offset(const void *a, const void *b)
{
	const struct zck_entry *x = *(const struct zck_entry *const *)a;
	const struct zck_entry *y = *(const struct zck_entry *const *)b;

	return x->global_offset < y->global_offset ? -1 : x->global_offset > y->global_offset;
}

/* Per logical parameter: whether the rank files together hold all of it, at one step. */
static int
report_params(const struct zck_index *ix)
{
	const struct zck_entry **es = NULL;
	size_t n = 0, cap = 0;
	int bad = 0;

	for (size_t i = 0; i < ix->nfiles; i++)
		for (size_t j = 0; j < ix->files[i].nentries; j++) {
			if (n == cap) {
				cap = cap ? 2 * cap : 64;
				es = realloc(es, cap * sizeof(*es));
				if (es == NULL)
					return 1;
			}
			es[n++] = &ix->files[i].entries[j];
		}
	if (n > 0)
		qsort(es, n, sizeof(*es), by_offset);
	printf("parameters:\n");
	for (size_t i = 0; i < n; i++) {
		struct param p = { es[i]->global_name, es[i]->global_numel, 0, es[i]->step, false };
		uint64_t at = 0;
		bool first = true;

		/* Each parameter once: at its first entry in offset order. */
		for (size_t k = 0; k < i && first; k++)
			if (strcmp(es[k]->global_name, p.name) == 0)
				first = false;
		if (!first)
			continue;
		for (size_t k = i; k < n; k++) {
			const struct zck_entry *e = es[k];

			if (strcmp(e->global_name, p.name) != 0)
				continue;
			if (e->step != p.step)
				p.mixed_steps = true;
			if (e->global_offset + e->numel > at) {
				p.covered += e->global_offset + e->numel -
				    (e->global_offset > at ? e->global_offset : at);
				at = e->global_offset + e->numel;
			}
		}
		printf("  %-40s %12" PRIu64 " elements  step %" PRIu64 "  %s state%s%s\n", p.name,
		    p.numel, p.step, es[i]->state_format,
		    p.covered == p.numel ? "" : "  INCOMPLETE: elements missing",
		    p.mixed_steps ? "  MIXED STEPS" : "");
		if (p.covered != p.numel || p.mixed_steps)
			bad = 1;
	}
	free(es);
	return bad;
}

static int
inspect(const char *dir)
{
	struct zck_index *ix;
	char err[512], b1[32];
	unsigned arrays = 0, damaged = 0;
	int r, bad;

	(void)zck_tmp_remove_stale(dir);	/* a dead save's leftovers */
	r = zck_open(dir, &ix, err, sizeof(err));
	if (r < 0) {
		fprintf(stderr, "zoffctl: %s\n", err);
		return 1;
	}
	printf("checkpoint %s: %zu rank file%s of world size %u, optimizer %s\n", dir,
	    ix->nfiles, ix->nfiles == 1 ? "" : "s", ix->files[0].world_size,
	    ix->files[0].optimizer);
	printf("hyperparameters: %s\n", ix->files[0].hparams);
	bad = ix->nfiles != ix->files[0].world_size;
	if (bad)
		printf("MISSING RANKS: %zu of %u rank files\n", ix->nfiles, ix->files[0].world_size);
	for (size_t i = 0; i < ix->nfiles; i++) {
		const struct zck_file *f = &ix->files[i];

		printf("rank %u: %s, %zu tensor%s, %s\n", f->rank, f->path, f->nentries,
		    f->nentries == 1 ? "" : "s", human(f->size, b1, sizeof(b1)));
		if (strcmp(f->optimizer, ix->files[0].optimizer) != 0) {
			printf("  OTHER OPTIMIZER: %s\n", f->optimizer);
			bad = 1;
		}
		for (size_t j = 0; j < f->nentries; j++) {
			const struct zck_entry *e = &f->entries[j];
			const char *state = "ok";
			uint64_t bytes = 0;

			for (unsigned st = 0; st < ZCK_ARRAYS; st++) {
				if (zck_array_bytes(e->arrays, st, e->numel) == 0 && st >= ZCK_STATES)
					continue;
				arrays++;
				bytes += zck_array_bytes(e->arrays, st, e->numel);
				if (zck_check_array(f, e, st, err, sizeof(err)) < 0) {
					damaged++;
					state = "DAMAGED";
					printf("  %s\n", err);
				}
			}
			printf("  %-32s %s [%" PRIu64 ", %" PRIu64 ") of %" PRIu64 "  step %" PRIu64
			    "  %s  %s arrays  checksums %s\n", e->name, e->global_name,
			    e->global_offset, e->global_offset + e->numel, e->global_numel, e->step,
			    human(bytes, b1, sizeof(b1)), e->arrays == ZCK_ARRAYS_Q8 ?
			    "U8+scales" : e->arrays == ZCK_ARRAYS_BF16 ? "BF16" : "F32", state);
		}
	}
	bad |= report_params(ix);
	printf("checksums: %u arrays verified, %u damaged\n", arrays, damaged);
	zck_close(ix);
	return bad || damaged > 0 ? 1 : 0;
}

int
zoffctl_checkpoint(int argc, char **argv)
{
	if (argc == 2 && strcmp(argv[0], "inspect") == 0)
		return inspect(argv[1]);
	fprintf(stderr, "usage: zoffctl checkpoint inspect DIR\n");
	return 2;
}
