/* Tiering-test helpers on itd: a swap directory per test, tensors and snapshots. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "th.h"

void
th_swapdir(char *dir, size_t len)
{
	snprintf(dir, len, "/tmp/zoff-tier-XXXXXX");
	cr_assert_not_null(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
}

void
th_swapdir_remove(const char *dir)
{
	/* The engine's files there are O_TMPFILE: gone with the daemon, so the dir is empty. */
	if (dir[0] != '\0')
		(void)rmdir(dir);
}

void
th_job_open(struct th_job *j, const struct itd *d, const char *name, enum zc_policy policy,
    uint64_t pinned_budget)
{
	struct zc_job_options o = { .policy = policy, .pinned_budget = pinned_budget };

	memset(j, 0, sizeof(*j));
	j->c = itd_connect(d);
	cr_assert_eq(zc_job_open_opts(j->c, name, 0, 1, &o), 0, "job %s: %s", name,
	    zc_errmsg(j->c));
}

void
th_init(size_t k, float *out, size_t n)
{
	struct itd_rng rng = { 0x9e3779b97f4a7c15ull ^ (k + 1) };

	for (size_t i = 0; i < n; i++)
		out[i] = (float)itd_uniform(&rng);
}

void
th_register(struct th_job *j, const struct th_layout *layout)
{
	char name[48];

	j->layout = layout;
	j->t = calloc(layout->count, sizeof(*j->t));
	cr_assert_not_null(j->t);
	for (size_t k = 0; k < layout->count; k++) {
		struct zc_tensor_desc desc = { .name = name, .numel = layout->sizes[k],
			.grad_dtype = layout->grad_dtype, .param_dtype = layout->param_dtype,
			.param_offload = layout->param_offload };
		float *init = malloc(layout->sizes[k] * sizeof(float));
		int r;

		cr_assert_not_null(init);
		th_init(k, init, layout->sizes[k]);
		snprintf(name, sizeof(name), "layer%zu.weight", k);
		r = zc_tensor_register(j->c, &desc, init, &j->t[k]);
		cr_assert_eq(r, 0, "register %s (%zu elements): %s", name, layout->sizes[k],
		    zc_errmsg(j->c));
		free(init);
	}
}

void
th_job_close(struct th_job *j)
{
	if (j->c != NULL)
		zc_disconnect(j->c);
	free(j->t);
	memset(j, 0, sizeof(*j));
}

void
th_fill_grads(struct th_job *j, size_t k, uint64_t step)
{
	struct itd_rng rng = { 0x2545f4914f6cdd1dull ^ ((k + 1) << 32) ^ step };
	size_t n = j->layout->sizes[k];
	void *slot = zc_tensor_grad_slot(j->t[k], NULL);

	for (size_t i = 0; i < n; i++) {
		float g = (float)(itd_uniform(&rng) * 0.05);

		switch (j->layout->grad_dtype) {
		case ZC_F32:
			((float *)slot)[i] = g;
			break;
		case ZC_BF16:
			((uint16_t *)slot)[i] = itd_f32_to_bf16_rne(g);
			break;
		default:
			((uint16_t *)slot)[i] = zc_f32_to_f16(g);
			break;
		}
	}
}

struct zc_step_params
th_params(enum zc_optim optim, uint64_t step)
{
	/* A warm-up-like schedule, so the lr differs per step as it does in training. */
	return (struct zc_step_params){ .optim = optim, .step = step,
		.lr = 1e-3 * (double)(step < 5 ? step : 5) / 5, .beta1 = 0.9, .beta2 = 0.999,
		.eps = 1e-8, .weight_decay = 0.01 };
}

void
th_snapshot(struct th_job *j, struct th_snap *s)
{
	size_t count = j->layout->count;

	s->count = count;
	s->master = calloc(count, sizeof(float *));
	s->m = calloc(count, sizeof(float *));
	s->v = calloc(count, sizeof(float *));
	s->param = calloc(count, sizeof(void *));
	s->param_bytes = calloc(count, sizeof(size_t));
	s->n = calloc(count, sizeof(size_t));
	cr_assert(s->master && s->m && s->v && s->param && s->param_bytes && s->n);
	for (size_t k = 0; k < count; k++) {
		size_t n = j->layout->sizes[k];
		float **dst[3] = { &s->master[k], &s->m[k], &s->v[k] };
		const void *slot = zc_tensor_param_slot(j->t[k], &s->param_bytes[k]);

		s->n[k] = n;

		for (int w = 0; w < 3; w++) {
			*dst[w] = malloc(n * sizeof(float));
			cr_assert_not_null(*dst[w]);
			cr_assert_eq(zc_tensor_read(j->t[k], (enum zc_state)w, 0, n, *dst[w]), 0,
			    "read state %d of tensor %zu: %s", w, k, zc_errmsg(j->c));
		}
		s->param[k] = malloc(s->param_bytes[k]);
		cr_assert_not_null(s->param[k]);
		memcpy(s->param[k], slot, s->param_bytes[k]);
	}
}

/* Names the first element that differs, with both values' bits. */
static void
assert_floats(const float *a, const float *b, size_t n, const char *what, size_t k,
    const char *array)
{
	uint32_t x, y;

	if (memcmp(a, b, n * sizeof(float)) == 0)
		return;
	for (size_t i = 0; i < n; i++) {
		memcpy(&x, &a[i], 4);
		memcpy(&y, &b[i], 4);
		cr_assert_eq(x, y, "%s: tensor %zu %s[%zu] is %.9g (0x%08x) against %.9g (0x%08x)",
		    what, k, array, i, a[i], x, b[i], y);
	}
}

void
th_assert_same(const struct th_snap *a, const struct th_snap *b, const char *what)
{
	cr_assert_eq(a->count, b->count);
	for (size_t k = 0; k < a->count; k++) {
		const uint8_t *pa = a->param[k], *pb = b->param[k];

		cr_assert_eq(a->n[k], b->n[k]);
		assert_floats(a->master[k], b->master[k], a->n[k], what, k, "master");
		assert_floats(a->m[k], b->m[k], a->n[k], what, k, "exp_avg");
		assert_floats(a->v[k], b->v[k], a->n[k], what, k, "exp_avg_sq");
		cr_assert_eq(a->param_bytes[k], b->param_bytes[k]);
		if (memcmp(pa, pb, a->param_bytes[k]) == 0)
			continue;
		for (size_t i = 0; i < a->param_bytes[k]; i++)
			cr_assert_eq(pa[i], pb[i], "%s: tensor %zu param slot byte %zu is 0x%02x "
			    "against 0x%02x", what, k, i, pa[i], pb[i]);
	}
}

void
th_snap_free(struct th_snap *s)
{
	for (size_t k = 0; k < s->count; k++) {
		free(s->master[k]);
		free(s->m[k]);
		free(s->v[k]);
		free(s->param[k]);
	}
	free(s->master);
	free(s->m);
	free(s->v);
	free(s->param);
	free(s->param_bytes);
	free(s->n);
	memset(s, 0, sizeof(*s));
}
