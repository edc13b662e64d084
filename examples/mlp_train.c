/* Example training process: an MLP on synthetic data, every optimizer step done by zoffloadd. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "zclient.h"

#define NCLASSES 10

struct layer {
	int in, out;
	float *w, *b;		/* fp32 copies of the bf16 parameters the daemon hands back */
	float *gw, *gb;		/* gradients, fp32 here, bf16 in the grad slots */
	struct zc_tensor *tw, *tb;
};

struct model {
	bool offload_params;	/* params live in zoffloadd between uses (ZeRO-Infinity offload_param) */
	int nlayers;
	struct layer *layers;
	float **act;		/* act[0] = input, act[i+1] = output of layer i */
	float **dact;
};

/* xorshift: reproducible data without libc's rand() state. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static float
uniform(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return (float)((rng_state >> 40) * (1.0 / 16777216.0));
}

static float
normal(void)
{
	float u1 = uniform() + 1e-7f, u2 = uniform();

	return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

static void *
xcalloc(size_t n, size_t size)
{
	void *p = calloc(n, size);

	if (p == NULL) {
		fprintf(stderr, "mlp_train: out of memory\n");
		exit(1);
	}
	return p;
}

static void
load_params(struct layer *l)
{
	const uint16_t *pw = zc_tensor_param_slot(l->tw, NULL);
	const uint16_t *pb = zc_tensor_param_slot(l->tb, NULL);

	for (int i = 0; i < l->in * l->out; i++)
		l->w[i] = zc_bf16_to_f32(pw[i]);
	for (int i = 0; i < l->out; i++)
		l->b[i] = zc_bf16_to_f32(pb[i]);
}

static void
store_grads(struct layer *l)
{
	uint16_t *gw = zc_tensor_grad_slot(l->tw, NULL);
	uint16_t *gb = zc_tensor_grad_slot(l->tb, NULL);

	for (int i = 0; i < l->in * l->out; i++)
		gw[i] = zc_f32_to_bf16(l->gw[i]);
	for (int i = 0; i < l->out; i++)
		gb[i] = zc_f32_to_bf16(l->gb[i]);
}

/* y[n][out] = x[n][in] * W[in][out] + b, ReLU unless last. */
static void
forward(struct model *m, int batch)
{
	for (int li = 0; li < m->nlayers; li++) {
		struct layer *l = &m->layers[li];
		const float *x = m->act[li];
		float *y = m->act[li + 1];

		for (int n = 0; n < batch; n++) {
			float *yr = y + (size_t)n * l->out;

			memcpy(yr, l->b, sizeof(float) * l->out);
			for (int k = 0; k < l->in; k++) {
				float xv = x[(size_t)n * l->in + k];
				const float *wr = l->w + (size_t)k * l->out;

				for (int j = 0; j < l->out; j++)
					yr[j] += xv * wr[j];
			}
			if (li != m->nlayers - 1)
				for (int j = 0; j < l->out; j++)
					yr[j] = yr[j] > 0 ? yr[j] : 0;
		}
	}
}

/* Softmax cross-entropy; leaves dL/dlogits in dact[nlayers]. */
static double
loss_and_grad(struct model *m, const int *labels, int batch)
{
	const float *logits = m->act[m->nlayers];
	float *d = m->dact[m->nlayers];
	double loss = 0;

	for (int n = 0; n < batch; n++) {
		const float *z = logits + n * NCLASSES;
		float mx = z[0], sum = 0;

		for (int j = 1; j < NCLASSES; j++)
			mx = z[j] > mx ? z[j] : mx;
		for (int j = 0; j < NCLASSES; j++)
			sum += expf(z[j] - mx);
		loss += log(sum) + mx - z[labels[n]];
		for (int j = 0; j < NCLASSES; j++)
			d[n * NCLASSES + j] = (expf(z[j] - mx) / sum - (j == labels[n])) / batch;
	}
	return loss / batch;
}

/* Backward one layer: its weight gradients, and dL/dx for the layer below. */
static void
backward_layer(struct model *m, int li, int batch)
{
	struct layer *l = &m->layers[li];
	const float *x = m->act[li], *dy = m->dact[li + 1];
	float *dx = m->dact[li];

	memset(l->gw, 0, sizeof(float) * l->in * l->out);
	memset(l->gb, 0, sizeof(float) * l->out);
	for (int n = 0; n < batch; n++) {
		const float *dyr = dy + (size_t)n * l->out;

		for (int k = 0; k < l->in; k++) {
			float xv = x[(size_t)n * l->in + k];
			float *gr = l->gw + (size_t)k * l->out;

			if (xv != 0)
				for (int j = 0; j < l->out; j++)
					gr[j] += xv * dyr[j];
		}
		for (int j = 0; j < l->out; j++)
			l->gb[j] += dyr[j];
	}
	if (li == 0)
		return;
	for (int n = 0; n < batch; n++) {
		const float *dyr = dy + (size_t)n * l->out;

		for (int k = 0; k < l->in; k++) {
			const float *wr = l->w + (size_t)k * l->out;
			float s = 0;

			/* ReLU of the layer below: no gradient where it was clamped. */
			if (x[(size_t)n * l->in + k] <= 0) {
				dx[(size_t)n * l->in + k] = 0;
				continue;
			}
			for (int j = 0; j < l->out; j++)
				s += wr[j] * dyr[j];
			dx[(size_t)n * l->in + k] = s;
		}
	}
}

static int
register_layer(struct zc_conn *c, struct layer *l, int index, bool offload)
{
	struct zc_tensor_desc d = { .grad_dtype = ZC_BF16, .param_dtype = ZC_BF16,
		.param_offload = offload };
	float scale = sqrtf(2.0f / (float)l->in);	/* He initialisation for ReLU */
	char name[64];
	int r;

	for (int i = 0; i < l->in * l->out; i++)
		l->w[i] = normal() * scale;
	snprintf(name, sizeof(name), "layer%d.weight", index);
	d.name = name;
	d.numel = (uint64_t)l->in * l->out;
	r = zc_tensor_register(c, &d, l->w, &l->tw);
	if (r < 0)
		return r;
	snprintf(name, sizeof(name), "layer%d.bias", index);
	d.numel = (uint64_t)l->out;
	return zc_tensor_register(c, &d, l->b, &l->tb);
}

static void
model_free(struct model *m)
{
	if (m->layers != NULL) {
		for (int i = 0; i < m->nlayers; i++) {
			free(m->layers[i].w);
			free(m->layers[i].gw);
			free(m->layers[i].b);
			free(m->layers[i].gb);
		}
	}
	for (int i = 0; m->act != NULL && i <= m->nlayers; i++) {
		free(m->act[i]);
		free(m->dact[i]);
	}
	free(m->layers);
	free(m->act);
	free(m->dact);
}

static double
now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int
main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "steps", required_argument, NULL, 'n' },
		{ "hidden", required_argument, NULL, 'H' },
		{ "batch", required_argument, NULL, 'b' },
		{ "job", required_argument, NULL, 'j' },
		{ "offload-params", no_argument, NULL, 'P' },
		{ "state-format", required_argument, NULL, 'F' },
		{ NULL, 0, NULL, 0 },
	};
	const char *socket_path = NULL, *job = "mlp-example";
	struct zc_job_options jo = { 0 };
	double tail_loss = 0;
	int tail = 0;
	int steps = 100, hidden = 1536, batch = 32, input = 256, ndata = 2048;
	struct zc_step_params sp = {
		.optim = ZC_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
		.weight_decay = 0.01, .check_finite = true, .max_grad_norm = 1.0,
	};
	struct model m = { .nlayers = 3 };
	struct zc_tensor **set = NULL;
	struct zc_conn *c;
	struct zc_step_result res;
	float *data, teacher[256 * NCLASSES];
	int *labels, opt, r, first;
	uint64_t nparams = 0;
	double t0;

	/* Progress lines must reach a pipe as they happen. */
	setvbuf(stdout, NULL, _IOLBF, 0);
	while ((opt = getopt_long(argc, argv, "s:n:H:b:j:PF:", opts, NULL)) != -1) {
		switch (opt) {
		case 's': socket_path = optarg; break;
		case 'n': steps = atoi(optarg); break;
		case 'H': hidden = atoi(optarg); break;
		case 'b': batch = atoi(optarg); break;
		case 'j': job = optarg; break;
		case 'P': m.offload_params = true; break;
		case 'F': jo.state_format = optarg; break;
		default:
			fprintf(stderr, "usage: mlp_train [--socket PATH] [--steps N] [--hidden N] "
			    "[--batch N] [--job NAME] [--offload-params] [--state-format NAME]\n");
			return 2;
		}
	}
	if (steps < 1 || hidden < 16 || batch < 1 || batch > ndata) {
		fprintf(stderr, "mlp_train: --steps >= 1, --hidden >= 16, 1 <= --batch <= %d\n",
		    ndata);
		return 2;
	}

	/* Labels come from a random linear teacher, so there is something to learn. */
	data = xcalloc((size_t)ndata * input, sizeof(float));
	labels = xcalloc((size_t)ndata, sizeof(int));
	for (int i = 0; i < input * NCLASSES; i++)
		teacher[i] = normal();
	for (int n = 0; n < ndata; n++) {
		float best = -INFINITY;

		for (int k = 0; k < input; k++)
			data[(size_t)n * input + k] = normal();
		for (int j = 0; j < NCLASSES; j++) {
			float s = 0;

			for (int k = 0; k < input; k++)
				s += data[(size_t)n * input + k] * teacher[k * NCLASSES + j];
			if (s > best) {
				best = s;
				labels[n] = j;
			}
		}
	}

	r = zc_connect(socket_path, &c);
	if (r < 0) {
		fprintf(stderr, "mlp_train: %s\n", zc_connect_errmsg());
		free(data);
		free(labels);
		return 1;
	}
	/* --state-format: how zoffloadd keeps the optimizer state (default: its configuration). */
	r = zc_job_open_opts(c, job, 0, 1, &jo);
	if (r < 0)
		goto fail;

	int dims[] = { input, hidden, hidden, NCLASSES };

	m.layers = xcalloc((size_t)m.nlayers, sizeof(*m.layers));
	m.act = xcalloc((size_t)m.nlayers + 1, sizeof(float *));
	m.dact = xcalloc((size_t)m.nlayers + 1, sizeof(float *));
	for (int i = 0; i <= m.nlayers; i++) {
		m.act[i] = xcalloc((size_t)batch * dims[i], sizeof(float));
		m.dact[i] = xcalloc((size_t)batch * dims[i], sizeof(float));
	}
	for (int i = 0; i < m.nlayers; i++) {
		struct layer *l = &m.layers[i];

		l->in = dims[i];
		l->out = dims[i + 1];
		l->w = xcalloc((size_t)l->in * l->out, sizeof(float));
		l->gw = xcalloc((size_t)l->in * l->out, sizeof(float));
		l->b = xcalloc((size_t)l->out, sizeof(float));
		l->gb = xcalloc((size_t)l->out, sizeof(float));
		r = register_layer(c, l, i, m.offload_params);
		if (r < 0)
			goto fail;
		nparams += (uint64_t)l->in * l->out + l->out;
	}
	printf("mlp_train: %d-%d-%d-%d MLP, %.2f M parameters, bf16 gradients and parameters, "
	    "AdamW in zoffloadd, %s state\n", dims[0], dims[1], dims[2], dims[3],
	    (double)nparams / 1e6, zc_job_state_format(c));

	set = xcalloc((size_t)m.nlayers * 2, sizeof(*set));
	for (int i = 0; i < m.nlayers; i++) {
		set[2 * i] = m.layers[i].tw;
		set[2 * i + 1] = m.layers[i].tb;
	}
	/* A rank that died and came back carries on from the daemon's state. */
	first = (int)zc_tensor_last_step(m.layers[0].tw) + 1;
	if (first > 1)
		printf("mlp_train: resumed job '%s' after step %d\n", job, first - 1);
	t0 = now_s();
	for (int step = first; step <= steps; step++) {
		int start = ((step - 1) * batch) % (ndata - batch + 1);
		double loss;

		/* Offloaded params: ask for every layer up front, wait for each as it is used. */
		if (m.offload_params && (r = zc_param_prefetch(c, set, (size_t)m.nlayers * 2)) < 0)
			goto fail;
		for (int i = 0; i < m.nlayers; i++) {
			if (m.offload_params && ((r = zc_param_wait(m.layers[i].tw)) < 0 ||
			    (r = zc_param_wait(m.layers[i].tb)) < 0))
				goto fail;
			load_params(&m.layers[i]);
		}
		memcpy(m.act[0], data + (size_t)start * input, sizeof(float) * batch * input);
		forward(&m, batch);
		loss = loss_and_grad(&m, labels + start, batch);
		/* Backward runs last layer first; all layers go to the daemon as one set so
		 * the global-norm clip and the inf/NaN check see every gradient. */
		for (int i = m.nlayers - 1; i >= 0; i--) {
			backward_layer(&m, i, batch);
			store_grads(&m.layers[i]);
		}
		sp.step = (uint64_t)step;
		r = zc_step_submit(c, &sp, set, (size_t)m.nlayers * 2);
		if (r < 0)
			goto fail;
		r = zc_wait_all(c, &res);
		if (r < 0)
			goto fail;
		/* Our copies are taken: the daemon may move the params out of memory. */
		if (m.offload_params && (r = zc_param_release(c, set, (size_t)m.nlayers * 2)) < 0)
			goto fail;
		/* The last ten steps' mean: one batch's loss alone is noisy to compare runs by. */
		if (step > steps - 10) {
			tail_loss += loss;
			tail++;
		}
		if (step == 1 || step % 10 == 0 || step == steps)
			printf("step %4d  loss %.4f  grad norm %.3f  daemon step %.2f ms%s\n", step,
			    loss, res.grad_norm, (double)res.latency_ns / 1e6,
			    res.status == ZC_STEP_SKIPPED_NONFINITE ? "  (skipped: inf/NaN)" : "");
	}
	printf("mlp_train: steps %d to %d in %.1f s\n", first, steps, now_s() - t0);
	if (tail > 0)
		printf("mlp_train: final loss %.6f (mean of the last %d steps)\n", tail_loss / tail,
		    tail);
	if (m.offload_params) {
		struct zc_param_stats ps;

		zc_param_stats(c, &ps);
		printf("mlp_train: offloaded params: %llu waits ready, %llu waited, %.1f ms "
		    "waiting\n", (unsigned long long)ps.ready, (unsigned long long)ps.waited,
		    (double)ps.wait_ns / 1e6);
	}
	/* Done: nothing to keep for a reattach. */
	r = zc_job_close(c);
	if (r < 0)
		goto fail;
	goto out;
fail:
	fprintf(stderr, "mlp_train: %s\n", zc_errmsg(c));
	r = 1;
out:
	zc_disconnect(c);
	model_free(&m);
	free(set);
	free(data);
	free(labels);
	return r;
}
