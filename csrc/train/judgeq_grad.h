/* Judge Q training (train/judgeq_grad.c): the loss of soft-token embeddings for one (prompt, response)
 * pair and its gradient. The public entry point is kvc_judgeq_loss_grad (kvpress_c.h, "Judge Q
 * training"); the pieces below are the backward kernels it is made of, internal to the core. */
#ifndef KVC_JUDGEQ_GRAD_H
#define KVC_JUDGEQ_GRAD_H

#include "../core/common.h"

/* Backward of y = x * rsqrt(mean(x^2) + eps) * w over rows: dx (+)= J^T dy, with
 * dx_i = r w_i dy_i - x_i r^3 / dim * sum_j dy_j w_j x_j,  r = rsqrt(mean(x^2) + eps). */
void kvc_rmsnorm_backward(const float *x, const float *w, const float *dy, float *dx, int64_t rows, int64_t dim,
                          float eps, int accumulate);

/* Backward of out = silu(gate) * up: dgate = dout * up * silu'(gate), dup = dout * silu(gate). */
void kvc_swiglu_backward(const float *gate, const float *up, const float *dout, float *dgate, float *dup, int64_t n);

#endif
