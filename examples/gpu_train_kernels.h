/* The GPU example's own kernels: a naive fp32 MLP and the reference AdamW that the daemon is compared with. */
#ifndef GPU_TRAIN_KERNELS_H
#define GPU_TRAIN_KERNELS_H

#include <stdbool.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * AdamW constants, derived on the host in double and rounded to float exactly
 * as the daemon's reference kernel derives them (kernels/optim.c), so that
 * the two optimizers see the same numbers.
 */
struct gt_adamw {
	float inv_scale, clip, decay, lerp_w, lerp_omw, beta2, omb2, bc2_sqrt, eps, neg_step;
	bool lerp_small;
};

/* Each returns cudaGetLastError() of its launch. */

/* y[n][out] = x[n][in] * w[in][out] + b[out], then ReLU when relu. */
cudaError_t gt_linear_forward(const float *x, const float *w, const float *b, float *y, int n,
    int in, int out, bool relu, cudaStream_t s);
/* dw[in][out] = x^T dy, db[out] = column sums of dy. */
cudaError_t gt_linear_backward_params(const float *x, const float *dy, float *dw, float *db,
    int n, int in, int out, cudaStream_t s);
/* dx[n][in] = dy w^T where x > 0 (the ReLU below), else 0. */
cudaError_t gt_linear_backward_input(const float *dy, const float *w, const float *x, float *dx,
    int n, int in, int out, cudaStream_t s);
/* Softmax cross-entropy of the mean over n samples: per-sample loss, d(mean loss)/d(logits). */
cudaError_t gt_softmax_xent(const float *logits, const int *labels, float *loss, float *dlogits,
    int n, int classes, cudaStream_t s);
/* One AdamW step over n elements: fp32 master/m/v, bf16 gradient in, bf16 parameter out. */
cudaError_t gt_adamw_step(float *master, float *m, float *v, const uint16_t *grad,
    uint16_t *param, uint64_t n, const struct gt_adamw *c, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
