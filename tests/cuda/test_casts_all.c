/* zkc_cast over every fp32 bit pattern, to bf16 and to f16, against the CPU conversions. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "optim.h"
#include "zk_cuda.h"

#define CUDA_OK(call) do {						\
	cudaError_t e_ = (call);					\
	cr_assert_eq(e_, cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_)); \
} while (0)

/* 2^24 inputs per round, 256 rounds; the CPU side checks in as many threads as there are cores. */
#define CHUNK (1u << 24)

/*
 * Under AddressSanitizer (scripts/test.sh --sanitize) every 8th round only:
 * the same code paths, minutes less; the plain build checks all 2^32.
 */
#if defined(__SANITIZE_ADDRESS__)
#define ROUND_STEP 8
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ROUND_STEP 8
#endif
#endif
#ifndef ROUND_STEP
#define ROUND_STEP 1
#endif

struct check {
	const uint32_t *in;
	const uint16_t *bf, *hf;
	size_t lo, hi;
	size_t bad;
	uint32_t first_bad;
};

static void *
check_range(void *arg)
{
	struct check *c = arg;

	for (size_t i = c->lo; i < c->hi; i++) {
		float f;

		memcpy(&f, &c->in[i], sizeof(f));
		if (c->bf[i] != zk_f32_to_bf16(f) || c->hf[i] != zk_f32_to_f16(f)) {
			if (c->bad++ == 0)
				c->first_bad = c->in[i];
		}
	}
	return NULL;
}

Test(cast, every_f32_input_to_bf16_and_f16, .timeout = 900)
{
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	int nt = ncpu < 1 ? 1 : ncpu > 8 ? 8 : (int)ncpu;
	uint32_t *in;
	uint16_t *bf, *hf;
	void *din, *dbf, *dhf;
	cudaStream_t s;

	/* Pinned: the copies read and write them in place, without staging. */
	CUDA_OK(cudaMallocHost((void **)&in, CHUNK * 4));
	CUDA_OK(cudaMallocHost((void **)&bf, CHUNK * 2));
	CUDA_OK(cudaMallocHost((void **)&hf, CHUNK * 2));
	CUDA_OK(cudaMalloc(&din, CHUNK * 4));
	CUDA_OK(cudaMalloc(&dbf, CHUNK * 2));
	CUDA_OK(cudaMalloc(&dhf, CHUNK * 2));
	CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	for (uint64_t base = 0; base < (1ull << 32); base += (uint64_t)CHUNK * ROUND_STEP) {
		struct check c[8];
		pthread_t th[8];
		size_t bad = 0;

		for (uint32_t i = 0; i < CHUNK; i++)
			in[i] = (uint32_t)base + i;
		CUDA_OK(cudaMemcpyAsync(din, in, CHUNK * 4, cudaMemcpyHostToDevice, s));
		cr_assert_eq(zkc_cast(din, ZK_DTYPE_F32, dbf, ZK_DTYPE_BF16, CHUNK, s), 0);
		cr_assert_eq(zkc_cast(din, ZK_DTYPE_F32, dhf, ZK_DTYPE_F16, CHUNK, s), 0);
		CUDA_OK(cudaMemcpyAsync(bf, dbf, CHUNK * 2, cudaMemcpyDeviceToHost, s));
		CUDA_OK(cudaMemcpyAsync(hf, dhf, CHUNK * 2, cudaMemcpyDeviceToHost, s));
		CUDA_OK(cudaStreamSynchronize(s));
		for (int t = 0; t < nt; t++) {
			c[t] = (struct check){ .in = in, .bf = bf, .hf = hf,
				.lo = (size_t)CHUNK * t / nt, .hi = (size_t)CHUNK * (t + 1) / nt };
			cr_assert_eq(pthread_create(&th[t], NULL, check_range, &c[t]), 0);
		}
		for (int t = 0; t < nt; t++) {
			pthread_join(th[t], NULL);
			bad += c[t].bad;
		}
		for (int t = 0; t < nt && bad > 0; t++)
			cr_assert_eq(c[t].bad, 0, "%zu of inputs %08llx..%08llx differ, first %08x",
			    bad, (unsigned long long)base, (unsigned long long)(base + CHUNK - 1),
			    c[t].first_bad);
	}
	CUDA_OK(cudaStreamDestroy(s));
	CUDA_OK(cudaFree(din));
	CUDA_OK(cudaFree(dbf));
	CUDA_OK(cudaFree(dhf));
	CUDA_OK(cudaFreeHost(in));
	CUDA_OK(cudaFreeHost(bf));
	CUDA_OK(cudaFreeHost(hf));
}
