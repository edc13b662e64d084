/* Checkpoint-test helpers. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ck.h"

/* Odd sizes: shards never line up with vectors or chunks (16 Ki elements below). */
const uint64_t ck_param_numel[CK_PARAMS] = { 70001, 4099 };
const char *const ck_param_name[CK_PARAMS] = { "layers.0.w", "layers.0.b" };
struct ck_opts ck_opts;

void
ck_config_chunks(char *buf, size_t len, const char *swapdir, uint64_t chunk_elements)
{
	snprintf(buf, len, "{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": "
	    "\"info\" }, \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"256M\" } ],"
	    " \"chunk_elements\": %llu, \"staging_buffers\": 3 } }\n", swapdir,
	    (unsigned long long)chunk_elements);
}

void
ck_config(char *buf, size_t len, const char *swapdir)
{
	ck_config_chunks(buf, len, swapdir, 16384);
}

struct zc_step_params
ck_params(enum zc_optim optim, uint64_t step)
{
	switch (optim) {
	case ZC_ADAGRAD:
		return (struct zc_step_params){ .optim = optim, .step = step, .lr = 1e-2,
			.eps = 1e-10, .weight_decay = 1e-3, .lr_decay = 1e-3 };
	case ZC_LION:
		return (struct zc_step_params){ .optim = optim, .step = step, .lr = 1e-4,
			.beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.1 };
	default:
		return (struct zc_step_params){ .optim = optim, .step = step, .lr = 1e-3,
			.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 };
	}
}

static uint64_t
mix(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	return x ^ (x >> 33);
}

/* In [-scale, scale): the same for an element whichever rank holds it. */
float
ck_value(unsigned p, uint64_t i, uint64_t step, float scale)
{
	uint64_t h = mix(((uint64_t)p << 56) ^ (step << 40) ^ i);

	return scale * ((float)(h >> 40) / (float)(1u << 23) - 1.0f);
}

static void
shard(struct ck_job *j, unsigned rank, unsigned p)
{
	uint64_t g = ck_param_numel[p], per = (g + j->world - 1) / j->world;

	if (ck_opts.align > 1)
		per = (per + ck_opts.align - 1) / ck_opts.align * ck_opts.align;
	uint64_t lo = per * rank < g ? per * rank : g, hi = lo + per < g ? lo + per : g;

	j->r[rank].off[p] = lo;
	j->r[rank].numel[p] = hi - lo;
}

static void
open_rank(struct ck_job *j, const struct itd *d, const char *name, unsigned rank,
    enum zc_policy policy)
{
	struct zc_job_options o = { .policy = policy, .state_format = ck_opts.format };

	j->r[rank].c = itd_connect(d);
	cr_assert_eq(zc_job_open_opts(j->r[rank].c, name, rank, j->world, &o), 0, "%s rank %u: %s",
	    name, rank, zc_errmsg(j->r[rank].c));
}

static void
desc_of(struct ck_job *j, unsigned rank, unsigned p, char *name, size_t len,
    struct zc_tensor_desc *desc)
{
	snprintf(name, len, "%s#%u", ck_param_name[p], rank);
	*desc = (struct zc_tensor_desc){ name, j->r[rank].numel[p], ZC_F32, ZC_F32, false };
}

void
ck_job_start(struct ck_job *j, const struct itd *d, const char *name, unsigned world,
    enum zc_optim optim, enum zc_policy policy)
{
	memset(j, 0, sizeof(*j));
	j->world = world;
	j->optim = optim;
	for (unsigned r = 0; r < world; r++) {
		open_rank(j, d, name, r, policy);
		for (unsigned p = 0; p < CK_PARAMS; p++) {
			struct zc_tensor_desc desc;
			char tname[64];
			float *init;

			shard(j, r, p);
			if (j->r[r].numel[p] == 0)
				continue;
			desc_of(j, r, p, tname, sizeof(tname), &desc);
			init = malloc(desc.numel * sizeof(float));
			for (uint64_t i = 0; i < desc.numel; i++)
				init[i] = ck_value(p, j->r[r].off[p] + i, 0, 0.5f);
			cr_assert_eq(zc_tensor_register(j->r[r].c, &desc, init, &j->r[r].t[p]), 0,
			    "%s: %s", tname, zc_errmsg(j->r[r].c));
			free(init);
		}
	}
}

void
ck_job_restore(struct ck_job *j, const struct itd *d, const char *name, unsigned world,
    enum zc_optim optim, enum zc_policy policy, const char *dir, uint64_t step)
{
	memset(j, 0, sizeof(*j));
	j->world = world;
	j->optim = optim;
	for (unsigned r = 0; r < world; r++) {
		struct zc_checkpoint *ck;

		open_rank(j, d, name, r, policy);
		struct zc_tensor_desc descs[CK_PARAMS];
		struct zc_checkpoint_place places[CK_PARAMS];
		struct zc_tensor *ts[CK_PARAMS];
		char tnames[CK_PARAMS][64];
		unsigned ps[CK_PARAMS], n = 0;

		cr_assert_eq(zc_checkpoint_open(j->r[r].c, dir, &ck), 0, "%s", zc_errmsg(j->r[r].c));
		zc_checkpoint_allow_convert(ck, ck_opts.convert);
		/* The rank's shards in one call: their restores overlap. */
		for (unsigned p = 0; p < CK_PARAMS; p++) {
			shard(j, r, p);
			if (j->r[r].numel[p] == 0)
				continue;
			desc_of(j, r, p, tnames[n], sizeof(tnames[n]), &descs[n]);
			places[n] = (struct zc_checkpoint_place){ ck_param_name[p], j->r[r].off[p],
				ck_param_numel[p] };
			ps[n++] = p;
		}
		cr_assert_eq(zc_tensors_register_checkpoint(j->r[r].c, n, descs, ck, places, optim,
		    ts), 0, "rank %u: %s", r, zc_errmsg(j->r[r].c));
		for (unsigned i = 0; i < n; i++) {
			j->r[r].t[ps[i]] = ts[i];
			cr_assert_eq(zc_tensor_last_step(ts[i]), step, "%s", tnames[i]);
		}
		zc_checkpoint_close(ck);
	}
}

void
ck_job_steps(struct ck_job *j, uint64_t from, uint64_t to)
{
	for (uint64_t step = from; step <= to; step++) {
		struct zc_step_params sp = ck_params(j->optim, step);

		for (unsigned r = 0; r < j->world; r++) {
			struct zc_tensor *ts[CK_PARAMS];
			size_t n = 0;

			for (unsigned p = 0; p < CK_PARAMS; p++) {
				float *g;

				if (j->r[r].t[p] == NULL)
					continue;
				g = zc_tensor_grad_slot(j->r[r].t[p], NULL);
				for (uint64_t i = 0; i < j->r[r].numel[p]; i++)
					g[i] = ck_value(p, j->r[r].off[p] + i, step, 0.01f);
				ts[n++] = j->r[r].t[p];
			}
			cr_assert_eq(zc_step_submit(j->r[r].c, &sp, ts, n), 0, "%s",
			    zc_errmsg(j->r[r].c));
		}
		for (unsigned r = 0; r < j->world; r++) {
			struct zc_step_result res;

			cr_assert_eq(zc_wait_all(j->r[r].c, &res), 0, "%s", zc_errmsg(j->r[r].c));
			cr_assert_eq(res.status, ZC_STEP_APPLIED, "rank %u step %llu: %d", r,
			    (unsigned long long)step, res.error);
		}
	}
}

void
ck_job_save(struct ck_job *j, const char *dir, uint64_t step)
{
	struct zc_step_params sp = ck_params(j->optim, step);

	for (unsigned r = 0; r < j->world; r++) {
		struct zc_checkpoint_entry es[CK_PARAMS];
		size_t n = 0;

		for (unsigned p = 0; p < CK_PARAMS; p++)
			if (j->r[r].t[p] != NULL)
				es[n++] = (struct zc_checkpoint_entry){ j->r[r].t[p], ck_param_name[p],
					j->r[r].off[p], ck_param_numel[p] };
		cr_assert_eq(zc_checkpoint_save(j->r[r].c, dir, es, n, &sp), 0, "rank %u: %s", r,
		    zc_errmsg(j->r[r].c));
	}
}

void
ck_job_gather(struct ck_job *j, struct ck_state *s)
{
	for (unsigned p = 0; p < CK_PARAMS; p++)
		for (unsigned st = 0; st < 3; st++) {
			s->a[p][st] = calloc(ck_param_numel[p], sizeof(float));
			for (unsigned r = 0; r < j->world; r++) {
				if (j->r[r].t[p] == NULL)
					continue;
				cr_assert_eq(zc_tensor_read(j->r[r].t[p], (enum zc_state)st, 0,
				    j->r[r].numel[p], s->a[p][st] + j->r[r].off[p]), 0, "%s",
				    zc_errmsg(j->r[r].c));
			}
		}
}

void
ck_job_close(struct ck_job *j)
{
	for (unsigned r = 0; r < CK_MAX_RANKS; r++) {
		if (j->r[r].c == NULL)
			continue;
		(void)zc_job_close(j->r[r].c);
		zc_disconnect(j->r[r].c);
		j->r[r].c = NULL;
	}
}

void
ck_assert_same(const struct ck_state *a, const struct ck_state *b, const char *what)
{
	static const char *const sn[3] = { "master", "exp_avg", "exp_avg_sq" };

	for (unsigned p = 0; p < CK_PARAMS; p++)
		for (unsigned st = 0; st < 3; st++)
			for (uint64_t i = 0; i < ck_param_numel[p]; i++)
				if (memcmp(&a->a[p][st][i], &b->a[p][st][i], sizeof(float)) != 0)
					cr_assert_fail("%s: %s %s[%llu]: %a, not %a", what, ck_param_name[p],
					    sn[st], (unsigned long long)i, (double)b->a[p][st][i],
					    (double)a->a[p][st][i]);
}

void
ck_state_free(struct ck_state *s)
{
	for (unsigned p = 0; p < CK_PARAMS; p++)
		for (unsigned st = 0; st < 3; st++)
			free(s->a[p][st]);
}

void
ck_tmpdir(char *dir, size_t len, const char *what)
{
	snprintf(dir, len, "/tmp/zoff-%s-XXXXXX", what);
	cr_assert_not_null(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
}

void
ck_rmdir(const char *dir)
{
	struct dirent *de;
	char path[512];
	DIR *d;

	if (dir[0] == '\0' || (d = opendir(dir)) == NULL)
		return;
	while ((de = readdir(d)) != NULL) {
		if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
		(void)unlink(path);
	}
	closedir(d);
	(void)rmdir(dir);
}

void
ck_gated_start(struct itd *d, struct ck_gated *g)
{
	char config[512];

	g->fd = -1;
	ck_tmpdir(g->swapdir, sizeof(g->swapdir), "swap");
	ck_tmpdir(g->ckdir, sizeof(g->ckdir), "ckpt");
	ck_tmpdir(g->gatedir, sizeof(g->gatedir), "gate");
	snprintf(g->gate, sizeof(g->gate), "%s/gate", g->gatedir);
	cr_assert_eq(mkfifo(g->gate, 0600), 0, "mkfifo %s: %s", g->gate, strerror(errno));
	ck_config(config, sizeof(config), g->swapdir);
	cr_assert_eq(setenv("ZOFFLOADD_TEST_CKPT_GATE", g->gate, 1), 0);
	if (g->closes)
		cr_assert_eq(setenv("ZOFFLOADD_TEST_CLOSE_GATE", g->gate, 1), 0);
	itd_start(d, config);
	cr_assert_eq(unsetenv("ZOFFLOADD_TEST_CKPT_GATE"), 0);
	cr_assert_eq(unsetenv("ZOFFLOADD_TEST_CLOSE_GATE"), 0);
}

void
ck_gated_cleanup(struct itd *d, struct ck_gated *g)
{
	bool started = g->gate[0] != '\0';

	/* Not started: nothing of it exists (and fd is not yet -1). */
	if (started && g->fd < 0)
		g->fd = open(g->gate, O_RDWR);
	itd_cleanup(d);
	if (started && g->fd >= 0)
		close(g->fd);
	g->fd = -1;
	ck_rmdir(g->ckdir);
	ck_rmdir(g->swapdir);
	ck_rmdir(g->gatedir);
}
