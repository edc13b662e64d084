/* The restart tests' trainer: deterministic steps on two jobs, going on across daemon restarts. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "trainer.h"

static const struct {
	const char *name;
	enum zc_policy policy;
	struct { const char *name; uint64_t numel; enum zc_dtype pd; bool offload; } t[ZRT_TENSORS];
} jobs[ZRT_JOBS] = {
	/* Two slices of the stepper's quantum (the second short), and offloaded params. */
	{ "pinned", ZC_POLICY_CPU, { { "w", (4u << 20) + 1001, ZC_BF16, false },
		{ "p", 70001, ZC_F32, true } } },
	/* Several chunks of 64 Ki elements through two staging buffers. */
	{ "nvme", ZC_POLICY_NVME, { { "x", 300007, ZC_F32, false },
		{ "q", 50021, ZC_BF16, true } } },
};

/*
 * Tensor k of job j's param dtype: 'w''s fp32, or 'x''s bf16, where the test asks (the slot
 * is then the master of more formats).
 */
static enum zc_dtype
param_dtype(const struct zrt *r, int j, int k)
{
	if (j == 1 && k == 0 && r->x_bf16_params)
		return ZC_BF16;
	return j == 0 && k == 0 && r->w_fp32_params ? ZC_F32 : jobs[j].t[k].pd;
}

static uint64_t
now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static float
value(uint64_t seed, uint64_t i)
{
	uint64_t x = (seed * 0x9e3779b97f4a7c15ull) ^ (i * 0xbf58476d1ce4e5b9ull);

	x ^= x >> 31;
	x *= 0x94d049bb133111ebull;
	x ^= x >> 29;
	return (float)((double)(x >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

static int
copy_file(const char *from, const char *to)
{
	char buf[65536];
	int in = open(from, O_RDONLY | O_CLOEXEC), out;
	ssize_t n;

	if (in < 0)
		return -errno;
	out = open(to, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0755);
	if (out < 0) {
		close(in);
		return -errno;
	}
	while ((n = read(in, buf, sizeof(buf))) > 0)
		if (write(out, buf, (size_t)n) != n)
			n = -1;
	close(in);
	close(out);
	return n < 0 ? -EIO : 0;
}

int
zrt_setup(struct zrt *r, bool swap_file, char *err, size_t errlen)
{
	return zrt_setup_with(r, swap_file, &(struct zrt_options){ 0 }, err, errlen);
}

int
zrt_setup_with(struct zrt *r, bool swap_file, const struct zrt_options *o, char *err,
    size_t errlen)
{
	const char *daemon = getenv("ZOFFLOADD");
	FILE *f;
	int rc;

	memset(r, 0, sizeof(*r));
	r->opts = *o;
	rc = zst_init(&r->st);
	if (rc < 0 || daemon == NULL) {
		snprintf(err, errlen, "stand-in: %s", daemon == NULL ? "$ZOFFLOADD is not set" :
		    strerror(-rc));
		return rc < 0 ? rc : -EINVAL;
	}
	snprintf(r->socket, sizeof(r->socket), "%s/sock", r->st.dir);
	snprintf(r->config, sizeof(r->config), "%s/zoffload.conf", r->st.dir);
	snprintf(r->exe, sizeof(r->exe), "%s/zoffloadd", r->st.dir);
	snprintf(r->swap, sizeof(r->swap), "%s/swap%s", r->st.dir, swap_file ? ".img" : "");
	if (!swap_file)
		mkdir(r->swap, 0700);
	rc = copy_file(daemon, r->exe);
	if (rc < 0) {
		snprintf(err, errlen, "copying %s: %s", daemon, strerror(-rc));
		return rc;
	}
	f = fopen(r->config, "w");
	if (f == NULL)
		return -errno;
	fprintf(f, "{ \"compute\": { \"worker_threads\": 2 }, \"log\": { \"level\": \"info\" },\n"
	    "  \"recovery\": { \"journal\": %s },\n"
	    "  \"swap\": { \"paths\": [ { \"path\": \"%s\", \"capacity\": \"64M\" } ],\n"
	    "    \"chunk_elements\": 65536, \"staging_buffers\": 2 } }\n",
	    o->journal_off ? "false" : "true", r->swap);
	fclose(f);
	r->argv[0] = r->exe;
	r->argv[1] = "--config";
	r->argv[2] = r->config;
	r->argv[3] = "--socket";
	r->argv[4] = r->socket;
	r->argv[5] = NULL;
	rc = zst_start(&r->st, r->argv);
	if (rc == 0)
		rc = zst_wait_ready(&r->st, 1, 20);
	if (rc < 0)
		snprintf(err, errlen, "zoffloadd did not start: %s\n%s", strerror(-rc),
		    zst_log(&r->st));
	return rc;
}

void
zrt_detach(struct zrt *r)
{
	for (int j = 0; j < ZRT_JOBS; j++) {
		if (r->j[j].c != NULL)
			zc_disconnect(r->j[j].c);
		memset(&r->j[j], 0, sizeof(r->j[j]));
	}
}

void
zrt_teardown(struct zrt *r)
{
	zrt_detach(r);
	zst_fini(&r->st);
}

/* Connects (retrying while a daemon comes back), opens both jobs, registers every tensor. */
int
zrt_attach(struct zrt *r, bool again, char *err, size_t errlen)
{
	uint64_t deadline = now_ns() + 30000000000ull;
	int rc = 0;

	zrt_detach(r);
	for (int j = 0; j < ZRT_JOBS; j++) {
		struct zc_job_options o = { .policy = jobs[j].policy,
			.state_format = r->state_format };
		struct zc_conn *c = NULL;

		while ((rc = zc_connect(r->socket, &c)) < 0 && now_ns() < deadline)
			usleep(10000);
		if (rc < 0) {
			snprintf(err, errlen, "connect: %s\n%s", strerror(-rc), zst_log(&r->st));
			return rc;
		}
		r->j[j].c = c;
		if (!r->auto_reconnect)
			zc_set_reconnect(c, 0);
		rc = zc_job_open_opts(c, jobs[j].name, 0, 1, &o);
		if (rc < 0) {
			snprintf(err, errlen, "job_open %s: %s", jobs[j].name, zc_errmsg(c));
			return rc;
		}
		for (int k = 0; k < ZRT_TENSORS; k++) {
			struct zc_tensor_desc d = { .name = jobs[j].t[k].name,
				.numel = jobs[j].t[k].numel, .grad_dtype = ZC_F32,
				.param_dtype = param_dtype(r, j, k), .param_offload = jobs[j].t[k].offload };
			float *init = malloc(d.numel * sizeof(float));

			if (init == NULL)
				return -ENOMEM;
			for (uint64_t i = 0; i < d.numel; i++)
				init[i] = value(1000 + (uint64_t)(j * 10 + k), i);
			/* A step its previous process submitted may be finishing: -EAGAIN, again. */
			while ((rc = zc_tensor_register(c, &d, init, &r->j[j].t[k])) == -EAGAIN &&
			    now_ns() < deadline)
				usleep(5000);
			free(init);
			if (rc < 0) {
				snprintf(err, errlen, "register %s: %s", d.name, zc_errmsg(c));
				return rc;
			}
			if (again)
				r->resumed++;
		}
	}
	return 0;
}

static void
write_grads(struct zrt *r, int j, int k, unsigned step)
{
	float *g = zc_tensor_grad_slot(r->j[j].t[k], NULL);

	for (uint64_t i = 0; i < jobs[j].t[k].numel; i++)
		g[i] = value(step * 100 + (uint64_t)(j * 10 + k), i) * 0.01f;
}

struct disturber {
	struct zrt *r;
	int gate;			/* ZRT_GATE: the FIFO's reading end */
	enum zrt_disturb kind;
	unsigned count;
	uint64_t seed;
	volatile unsigned progress;	/* steps the trainer finished */
	volatile unsigned generation;	/* disturbances done */
	volatile bool stop;
	int error;
	char err[512];
};

static int
disturb_once(struct disturber *ds)
{
	struct zrt *r = ds->r;
	unsigned readies = r->st.readies;
	pid_t pid = r->st.pid;
	char next[200];
	int status, rc;

	switch (ds->kind) {
	case ZRT_GATE: {
		struct pollfd p = { .fd = ds->gate, .events = POLLIN };
		char c;

		/* The gate writes a byte once a worker holds there, half way through its block. */
		if (poll(&p, 1, 60000) != 1 || read(ds->gate, &c, 1) != 1) {
			snprintf(ds->err, sizeof(ds->err), "the daemon never reached its step gate\n%s",
			    zst_log(&r->st));
			return -ETIMEDOUT;
		}
	}
		/* fall through */
	case ZRT_SIGKILL:
	case ZRT_SIGTERM:
		kill(pid, ds->kind == ZRT_SIGTERM ? SIGTERM : SIGKILL);
		status = zst_wait_exit(&r->st, 60);
		if (ds->kind == ZRT_SIGTERM && (status < 0 || !WIFEXITED(status) ||
		    WEXITSTATUS(status) != 0)) {
			snprintf(ds->err, sizeof(ds->err), "SIGTERM: exit status 0x%x\n%s", status,
			    zst_log(&r->st));
			return -EIO;
		}
		if (r->before_restart != NULL)
			r->before_restart(r);
		rc = zst_start(&r->st, r->argv);
		break;
	default:
		/* A package upgrade: a new file at the binary's path, then the signal. */
		snprintf(next, sizeof(next), "%s.new", r->exe);
		rc = copy_file(getenv("ZOFFLOADD"), next);
		if (rc == 0 && rename(next, r->exe) != 0)
			rc = -errno;
		if (rc == 0)
			kill(pid, SIGUSR2);
		break;
	}
	if (rc == 0)
		rc = zst_wait_ready(&r->st, readies + 1, 60);
	if (rc < 0)
		snprintf(ds->err, sizeof(ds->err), "the daemon did not come back: %s\n%s",
		    strerror(-rc), zst_log(&r->st));
	return rc;
}

static void *
disturber_main(void *arg)
{
	struct disturber *ds = arg;
	uint64_t x = ds->seed * 2654435761u + 1;

	for (unsigned n = 0; n < ds->count && !ds->stop; n++) {
		unsigned seen = ds->progress;

		/* At least one step between two: a restart, then some training, at random moments. */
		while (ds->progress == seen && !ds->stop)
			usleep(1000);
		x = x * 6364136223846793005ull + 1442695040888963407ull;
		usleep((useconds_t)(1000 + (x >> 33) % 60000));
		if (ds->stop)
			break;
		ds->error = disturb_once(ds);
		__atomic_add_fetch(&ds->generation, 1, __ATOMIC_SEQ_CST);
		if (ds->error < 0)
			break;
	}
	return NULL;
}

/* One step of one job: the tensors not yet at it, with the clip coefficient of the whole set. */
static int
submit(struct zrt *r, int j, unsigned step, bool grads_in)
{
	static const struct zc_step_params base = { .optim = ZC_ADAMW, .lr = 1e-3, .beta1 = 0.9,
		.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 };
	struct zc_tensor *todo[ZRT_TENSORS];
	struct zc_step_params p = base;
	struct zc_grad_partial part;
	size_t n = 0;
	int rc;

	for (int k = 0; k < ZRT_TENSORS; k++) {
		if (zc_tensor_last_step(r->j[j].t[k]) >= step)
			continue;
		/* After a restart the gradients of a submitted step are still in the slot. */
		if (!grads_in)
			write_grads(r, j, k, step);
		todo[n++] = r->j[j].t[k];
	}
	if (n == 0)
		return 0;
	rc = zc_grad_pass(r->j[j].c, r->j[j].t, ZRT_TENSORS, 1.0, &part);
	if (rc < 0)
		return rc;
	p.step = step;
	p.optim = r->optim;
	p.clip_coef = zc_clip_coef(0.5, part.sumsq);
	return zc_step_submit(r->j[j].c, &p, todo, n);
}

int
zrt_step(struct zrt *r, unsigned step, bool submitted[ZRT_JOBS])
{
	struct zc_step_result res;
	int rc;

	for (int j = 0; j < ZRT_JOBS; j++) {
		rc = submit(r, j, step, submitted[j]);
		if (rc < 0)
			return rc;
		submitted[j] = true;
	}
	for (int j = 0; j < ZRT_JOBS; j++) {
		rc = zc_wait_all(r->j[j].c, &res);
		if (rc < 0)
			return rc;
		if (res.status != ZC_STEP_APPLIED)
			return -EIO;
	}
	for (int j = 0; j < ZRT_JOBS; j++) {
		struct zc_tensor *off = r->j[j].t[1];

		/* The offloaded params go back to the tiers and come again, as around a forward. */
		rc = zc_param_release(r->j[j].c, &off, 1);
		if (rc == 0)
			rc = zc_param_prefetch(r->j[j].c, &off, 1);
		if (rc == 0)
			rc = zc_param_wait(off);
		if (rc < 0)
			return rc;
	}
	return 0;
}

int
zrt_train(struct zrt *r, enum zrt_disturb kind, unsigned count, uint64_t seed, char *err,
    size_t errlen)
{
	struct disturber ds = { .r = r, .kind = kind, .count = count, .seed = seed, .gate = -1 };
	bool submitted[ZRT_JOBS] = { false };
	unsigned step = 1, gen = 0;
	pthread_t th;
	int rc = 0;

	/* Not blocking: open before the daemon's end is, and read with a timeout. */
	if (kind == ZRT_GATE && (r->opts.gate_fifo == NULL ||
	    (ds.gate = open(r->opts.gate_fifo, O_RDONLY | O_NONBLOCK | O_CLOEXEC)) < 0))
		return -errno;
	if (kind != ZRT_NONE && pthread_create(&th, NULL, disturber_main, &ds) != 0) {
		if (ds.gate >= 0)
			close(ds.gate);
		return -EAGAIN;
	}
	while (step <= r->steps) {
		/*
		 * Where the steps left are no more than the disturbances left, the step waits for
		 * the next one (bounded): a fast machine's steps must not run out before the
		 * disturber's random delays do.  The step before let it go, so it comes.
		 */
		if (kind != ZRT_NONE && kind != ZRT_GATE && ds.generation < count &&
		    r->steps - step + 1 <= count - ds.generation) {
			unsigned before = ds.generation;

			for (int i = 0; i < 6000 && ds.generation == before && ds.error == 0; i++)
				usleep(10000);
		}
		rc = zrt_step(r, step, submitted);
		if (rc == 0) {
			memset(submitted, 0, sizeof(submitted));
			ds.progress = step++;
			continue;
		}
		/* The daemon went away (or is going): wait for it, reattach, go on. */
		if (kind == ZRT_NONE)
			break;
		if (getenv("ZRT_DEBUG"))
			fprintf(stderr, "step %u: %s (generation %u)\n", step, strerror(-rc),
			    ds.generation);
		for (int i = 0; i < 3000 && ds.generation == gen && ds.error == 0; i++)
			usleep(10000);
		if (ds.error < 0 || ds.generation == gen) {
			snprintf(err, errlen, "step %u failed (%s) %s", step, strerror(-rc),
			    ds.error < 0 ? ds.err : "with no restart to explain it");
			rc = ds.error < 0 ? ds.error : rc;
			break;
		}
		gen = ds.generation;
		r->restarts++;
		rc = zrt_attach(r, true, err, errlen);
		if (rc < 0)
			break;
		/* Every tensor kept its state: none is behind what had landed before. */
		for (int j = 0; j < ZRT_JOBS; j++)
			for (int k = 0; k < ZRT_TENSORS; k++)
				if (zc_tensor_last_step(r->j[j].t[k]) + 1 < step) {
					snprintf(err, errlen, "tensor %s came back at step %llu, the trainer "
					    "was at step %u: its state was lost", jobs[j].t[k].name,
					    (unsigned long long)zc_tensor_last_step(r->j[j].t[k]), step);
					rc = -ESTALE;
				}
		if (rc < 0)
			break;
		for (int j = 0; j < ZRT_JOBS; j++)
			r->resubmits += submitted[j];
		if (r->stop_after_restart)
			break;
	}
	ds.stop = true;
	if (kind != ZRT_NONE)
		pthread_join(th, NULL);
	if (ds.gate >= 0)
		close(ds.gate);
	r->reconnects = UINT64_MAX;
	for (int j = 0; j < ZRT_JOBS; j++) {
		struct zc_conn_stats cs;

		zc_conn_stats(r->j[j].c, &cs);
		r->reconnects = cs.reconnects < r->reconnects ? cs.reconnects : r->reconnects;
	}
	if (rc == 0 && ds.error < 0) {
		snprintf(err, errlen, "%s", ds.err);
		rc = ds.error;
	}
	if (rc == 0 && kind != ZRT_NONE && ds.generation < count) {
		snprintf(err, errlen, "only %u of %u disturbances happened in %u steps",
		    ds.generation, count, r->steps);
		rc = -EAGAIN;
	}
	if (rc < 0 && err[0] == '\0')
		snprintf(err, errlen, "step %u: %s", step, strerror(-rc));
	return rc;
}

int
zrt_restore(struct zrt *r, const void *buf, uint64_t step)
{
	size_t off = 0;
	int rc;

	for (int j = 0; j < ZRT_JOBS; j++) {
		for (int k = 0; k < ZRT_TENSORS; k++) {
			uint64_t n = jobs[j].t[k].numel;

			for (int s = 0; s < 3; s++) {
				rc = zc_tensor_write(r->j[j].t[k], (enum zc_state)s, 0, n,
				    (const float *)((const char *)buf + off));
				if (rc < 0)
					return rc;
				off += n * sizeof(float);
			}
			off += n * (param_dtype(r, j, k) == ZC_F32 ? 4 : 2);
			rc = zc_tensor_set_step(r->j[j].t[k], step);
			if (rc < 0)
				return rc;
		}
	}
	return 0;
}

size_t
zrt_snapshot(struct zrt *r, void *buf)
{
	size_t off = 0;

	for (int j = 0; j < ZRT_JOBS; j++) {
		for (int k = 0; k < ZRT_TENSORS; k++) {
			uint64_t n = jobs[j].t[k].numel;
			size_t pbytes = n * (param_dtype(r, j, k) == ZC_F32 ? 4 : 2);

			for (int s = 0; s < 3; s++) {
				if (buf != NULL && zc_tensor_read(r->j[j].t[k], (enum zc_state)s, 0, n,
				    (float *)((char *)buf + off)) < 0)
					memset((char *)buf + off, 0xff, n * sizeof(float));
				off += n * sizeof(float);
			}
			if (buf != NULL)
				memcpy((char *)buf + off, zc_tensor_param_slot(r->j[j].t[k], NULL), pbytes);
			off += pbytes;
		}
	}
	return off;
}
