/* Benchmark: H2D/D2H bandwidth through zoffloadd's registered slots beside a cudaMallocHost buffer of the same size. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zclient_cuda.h"

/*
 * The limit is the same copy from memory CUDA allocated pinned itself,
 * measured in the same run on the same device: slots are shared memory the
 * daemon created (memfd) and this process registered, so anything below that
 * is the cost of the slot path (registration flags, a pageable fallback).
 */

#define CK(call) do {							\
	cudaError_t e_ = (call);					\
	if (e_ != cudaSuccess) {					\
		fprintf(stderr, "bench_slots: %s: %s\n", #call, cudaGetErrorString(e_)); \
		exit(1);						\
	}								\
} while (0)

enum dir { D2H, H2D };

struct run {
	struct zcc_slots *slots;
	void *dev, *pinned;
	size_t bytes;
	uint64_t numel;
	cudaStream_t s;
};

static void
copy_once(struct run *r, enum dir d, bool via_slot)
{
	int rc = 0;

	if (via_slot && d == D2H)
		rc = zcc_grad_d2h(r->slots, 0, r->numel, r->dev, r->s);
	else if (via_slot)
		rc = zcc_param_h2d(r->slots, 0, r->numel, r->dev, r->s);
	else if (d == D2H)
		CK(cudaMemcpyAsync(r->pinned, r->dev, r->bytes, cudaMemcpyDeviceToHost, r->s));
	else
		CK(cudaMemcpyAsync(r->dev, r->pinned, r->bytes, cudaMemcpyHostToDevice, r->s));
	if (rc < 0) {
		fprintf(stderr, "bench_slots: copy: %s\n", zcc_errmsg());
		exit(1);
	}
}

/* GB/s of iters back-to-back copies, timed on the stream with events. */
static double
measure(struct run *r, enum dir d, bool via_slot, int iters)
{
	cudaEvent_t a, b;
	float ms;

	CK(cudaEventCreate(&a));
	CK(cudaEventCreate(&b));
	copy_once(r, d, via_slot);	/* warm: first-touch and TLB costs stay out */
	CK(cudaEventRecord(a, r->s));
	for (int i = 0; i < iters; i++)
		copy_once(r, d, via_slot);
	CK(cudaEventRecord(b, r->s));
	CK(cudaEventSynchronize(b));
	CK(cudaEventElapsedTime(&ms, a, b));
	CK(cudaEventDestroy(a));
	CK(cudaEventDestroy(b));
	return (double)r->bytes * iters / (ms / 1e3) / 1e9;
}

static size_t
parse_size(const char *s)
{
	char *end;
	double v = strtod(s, &end);

	switch (*end) {
	case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
	case 'M': case 'm': v *= 1024.0 * 1024; break;
	case 'K': case 'k': v *= 1024.0; break;
	default: break;
	}
	return v > 0 ? (size_t)v : 0;
}

int
main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "size", required_argument, NULL, 'z' },
		{ "iters", required_argument, NULL, 'i' },
		{ "min-ratio", required_argument, NULL, 'm' },
		{ NULL, 0, NULL, 0 },
	};
	const char *socket_path = NULL;
	size_t bytes = 256u << 20;
	int iters = 20, ndev = 0, opt, rc, failed = 0;
	double min_ratio = 0.9;
	struct run r = { 0 };
	struct zc_conn *c;
	struct zc_tensor *t;
	struct zc_tensor_desc desc = { .name = "bench-slots", .grad_dtype = ZC_F32,
		.param_dtype = ZC_F32 };
	float *init;

	while ((opt = getopt_long(argc, argv, "s:z:i:m:", opts, NULL)) != -1) {
		switch (opt) {
		case 's': socket_path = optarg; break;
		case 'z': bytes = parse_size(optarg); break;
		case 'i': iters = atoi(optarg); break;
		case 'm': min_ratio = atof(optarg); break;
		default:
			fprintf(stderr, "usage: bench_slots [--socket PATH] [--size 256M] "
			    "[--iters 20] [--min-ratio 0.9]\n");
			return 2;
		}
	}
	if (bytes < 4096 || iters < 1) {
		fprintf(stderr, "bench_slots: --size >= 4K, --iters >= 1\n");
		return 2;
	}
	if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
		printf("bench_slots: no usable CUDA device: skipped\n");
		return 77;
	}
	/* Slots exist only in a daemon: without one there is nothing to measure. */
	rc = zc_connect(socket_path, &c);
	if (rc < 0) {
		printf("bench_slots: no zoffloadd (--socket or $ZOFFLOAD_SOCKET): %s: skipped\n",
		    strerror(-rc));
		return 77;
	}
	desc.numel = bytes / 4;
	r.numel = desc.numel;
	r.bytes = r.numel * 4;
	init = calloc(r.numel, sizeof(float));
	if (init == NULL || zc_job_open(c, "bench-slots", 0, 1) < 0 ||
	    zc_tensor_register(c, &desc, init, &t) < 0) {
		fprintf(stderr, "bench_slots: %s\n", init ? zc_errmsg(c) : "out of memory");
		return 1;
	}
	free(init);
	if (zcc_slots_attach(t, &r.slots) < 0) {
		fprintf(stderr, "bench_slots: %s\n", zcc_errmsg());
		return 1;
	}
	CK(cudaMalloc(&r.dev, r.bytes));
	CK(cudaMallocHost(&r.pinned, r.bytes));
	memset(r.pinned, 0, r.bytes);
	CK(cudaStreamCreateWithFlags(&r.s, cudaStreamNonBlocking));
	/* On r.s: a cudaMemset would go to the legacy stream, which r.s is not ordered with. */
	CK(cudaMemsetAsync(r.dev, 0, r.bytes, r.s));

	printf("bench_slots: %zu MiB per copy, %d copies per figure, best of 3; param slot %s\n",
	    r.bytes >> 20, iters, zcc_slots_param_pinned(r.slots) ? "registered read-only" :
	    "pageable (device cannot register read-only memory)");
	for (int d = D2H; d <= H2D; d++) {
		double slot = 0, pin = 0, ratio;

		/* Alternating, best of three: both see the same clocks and the same neighbours. */
		for (int round = 0; round < 3; round++) {
			double x = measure(&r, (enum dir)d, true, iters);
			double y = measure(&r, (enum dir)d, false, iters);

			slot = x > slot ? x : slot;
			pin = y > pin ? y : pin;
		}
		ratio = slot / pin;
		printf("%s  slot %6.2f GB/s   cudaMallocHost %6.2f GB/s   ratio %.3f "
		    "(limit >= %.2f) %s\n", d == D2H ? "D2H (grad slot) " : "H2D (param slot)",
		    slot, pin, ratio, min_ratio, ratio >= min_ratio ? "ok" : "BELOW");
		failed += ratio < min_ratio;
	}
	(void)zcc_slots_detach(r.slots);
	CK(cudaFreeHost(r.pinned));
	CK(cudaFree(r.dev));
	zc_disconnect(c);
	return failed ? 1 : 0;
}
