/* The GPU example's own kernels: a naive fp32 MLP and the reference AdamW that the daemon is compared with. */
#include "convert.cuh"
#include "gpu_train_kernels.h"

/*
 * Naive on purpose: one thread per output, a fixed summation order, so that
 * the two models of the example get bit-identical forward and backward passes
 * from identical parameters, and only the optimizers can make them differ.
 */
#define TILE 16

__global__ void linear_forward(const float *x, const float *w, const float *b, float *y, int n,
    int in, int out, bool relu)
{
	int j = blockIdx.x * TILE + threadIdx.x, r = blockIdx.y * TILE + threadIdx.y;

	if (j >= out || r >= n)
		return;
	float acc = b[j];
	for (int k = 0; k < in; k++)
		acc = __fadd_rn(acc, __fmul_rn(x[(size_t)r * in + k], w[(size_t)k * out + j]));
	y[(size_t)r * out + j] = relu && acc < 0 ? 0.0f : acc;
}

__global__ void linear_backward_w(const float *x, const float *dy, float *dw, int n, int in,
    int out)
{
	int j = blockIdx.x * TILE + threadIdx.x, k = blockIdx.y * TILE + threadIdx.y;

	if (j >= out || k >= in)
		return;
	float acc = 0;
	for (int r = 0; r < n; r++)
		acc = __fadd_rn(acc, __fmul_rn(x[(size_t)r * in + k], dy[(size_t)r * out + j]));
	dw[(size_t)k * out + j] = acc;
}

__global__ void linear_backward_b(const float *dy, float *db, int n, int out)
{
	int j = blockIdx.x * blockDim.x + threadIdx.x;

	if (j >= out)
		return;
	float acc = 0;
	for (int r = 0; r < n; r++)
		acc = __fadd_rn(acc, dy[(size_t)r * out + j]);
	db[j] = acc;
}

__global__ void linear_backward_x(const float *dy, const float *w, const float *x, float *dx,
    int n, int in, int out)
{
	int k = blockIdx.x * TILE + threadIdx.x, r = blockIdx.y * TILE + threadIdx.y;

	if (k >= in || r >= n)
		return;
	float acc = 0;
	if (x[(size_t)r * in + k] > 0)
		for (int j = 0; j < out; j++)
			acc = __fadd_rn(acc, __fmul_rn(w[(size_t)k * out + j],
			    dy[(size_t)r * out + j]));
	dx[(size_t)r * in + k] = acc;
}

__global__ void softmax_xent(const float *logits, const int *labels, float *loss, float *d,
    int n, int classes)
{
	int r = blockIdx.x * blockDim.x + threadIdx.x;

	if (r >= n)
		return;
	const float *z = logits + (size_t)r * classes;
	float mx = z[0], sum = 0;
	for (int j = 1; j < classes; j++)
		mx = fmaxf(mx, z[j]);
	for (int j = 0; j < classes; j++)
		sum += expf(z[j] - mx);
	loss[r] = logf(sum) + mx - z[labels[r]];
	for (int j = 0; j < classes; j++)
		d[(size_t)r * classes + j] = (expf(z[j] - mx) / sum - (j == labels[r])) / n;
}

/*
 * zk_step_scalar's AdamW, operation for operation, with the _rn intrinsics so
 * that nvcc contracts nothing into an FMA (the CPU side is built with
 * -ffp-contract=off); sqrt and division are IEEE-rounded in both.
 */
__global__ void adamw(float *master, float *m, float *v, const uint16_t *grad, uint16_t *param,
    uint64_t n, struct gt_adamw c)
{
	uint64_t stride = (uint64_t)gridDim.x * blockDim.x;

	for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
		float g = __fmul_rn(__fmul_rn(zk__bf16_to_f32(grad[i]), c.inv_scale), c.clip);
		float p = __fmul_rn(master[i], c.decay), mi, vi, d;

		if (c.lerp_small)
			mi = __fadd_rn(m[i], __fmul_rn(c.lerp_w, __fsub_rn(g, m[i])));
		else
			mi = __fsub_rn(g, __fmul_rn(__fsub_rn(g, m[i]), c.lerp_omw));
		vi = __fadd_rn(__fmul_rn(v[i], c.beta2), __fmul_rn(__fmul_rn(c.omb2, g), g));
		d = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bc2_sqrt), c.eps);
		p = __fadd_rn(p, __fdiv_rn(__fmul_rn(c.neg_step, mi), d));
		m[i] = mi;
		v[i] = vi;
		master[i] = p;
		param[i] = zk__f32_to_bf16(p);
	}
}

static dim3 tiles(int cols, int rows)
{
	return dim3((unsigned)((cols + TILE - 1) / TILE), (unsigned)((rows + TILE - 1) / TILE));
}

cudaError_t gt_linear_forward(const float *x, const float *w, const float *b, float *y, int n,
    int in, int out, bool relu, cudaStream_t s)
{
	linear_forward<<<tiles(out, n), dim3(TILE, TILE), 0, s>>>(x, w, b, y, n, in, out, relu);
	return cudaGetLastError();
}

cudaError_t gt_linear_backward_params(const float *x, const float *dy, float *dw, float *db,
    int n, int in, int out, cudaStream_t s)
{
	linear_backward_w<<<tiles(out, in), dim3(TILE, TILE), 0, s>>>(x, dy, dw, n, in, out);
	linear_backward_b<<<(out + 255) / 256, 256, 0, s>>>(dy, db, n, out);
	return cudaGetLastError();
}

cudaError_t gt_linear_backward_input(const float *dy, const float *w, const float *x, float *dx,
    int n, int in, int out, cudaStream_t s)
{
	linear_backward_x<<<tiles(in, n), dim3(TILE, TILE), 0, s>>>(dy, w, x, dx, n, in, out);
	return cudaGetLastError();
}

cudaError_t gt_softmax_xent(const float *logits, const int *labels, float *loss, float *dlogits,
    int n, int classes, cudaStream_t s)
{
	softmax_xent<<<(n + 127) / 128, 128, 0, s>>>(logits, labels, loss, dlogits, n, classes);
	return cudaGetLastError();
}

cudaError_t gt_adamw_step(float *master, float *m, float *v, const uint16_t *grad,
    uint16_t *param, uint64_t n, const struct gt_adamw *c, cudaStream_t s)
{
	uint64_t blocks = (n + 255) / 256;

	if (n == 0)
		return cudaSuccess;
	adamw<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, s>>>(master, m, v, grad, param,
	    n, *c);
	return cudaGetLastError();
}
