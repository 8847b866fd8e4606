/* The host forward and backward of m rows through the whole model over a cached prefix (train/rows_grad.c):
 * fp32, the model's host weights (kvc_model_host_weights). The rows attend to the P prefix rows and causally to
 * themselves, at the positions the caller gives; the prefix's K/V are constants (no gradient flows into them),
 * the rows' own K/V are not. What is differentiated is pluggable (kvc_rows_objective):
 *   Judge Q (judgeq_grad.c): the soft rows' attention maps over the prompt, the gradient w.r.t. the input rows;
 *   KVgrad (press/kvgrad.c): Phi = sum ||h^L||^2, the gradient of the residual after each layer's attention;
 *   RestoreKV (press/restorekv.c): a forward only, with LoRA adapters, for the rows' own K/V.
 * Memory: the prefix comes one layer at a time from the caller; the pass keeps O(m) activations per layer and
 * recomputes the attention probabilities in the backward (per-thread scratch of m x (P + m)). */
#ifndef KVC_ROWS_GRAD_H
#define KVC_ROWS_GRAD_H

#include "../core/common.h"
#include "../model/model.h"

/* Backward of y = x * rsqrt(mean(x^2) + eps) * w over rows: dx (+)= J^T dy, with
 * dx_i = r w_i dy_i - x_i r^3 / dim * sum_j dy_j w_j x_j,  r = rsqrt(mean(x^2) + eps). */
void kvc_rmsnorm_backward(const float *x, const float *w, const float *dy, float *dx, int64_t rows, int64_t dim,
                          float eps, int accumulate);

/* Backward of out = silu(gate) * up: dgate = dout * up * silu'(gate), dup = dout * silu(gate). */
void kvc_swiglu_backward(const float *gate, const float *up, const float *dout, float *dgate, float *dup, int64_t n);

/* Causal softmax rows of m queries q [m, d] over len keys k [len, d], row i seeing keys 0 .. past + i: p [m, len]. */
void kvc_rows_causal_probs(const float *q, int64_t m, const float *k, int64_t len, int32_t d, float scale, int64_t past,
                           float *p);
/* Rows [0, m) of query head hq from x [m, H d] into dst [m, d]. */
void kvc_rows_gather_head(const float *x, int32_t H, int32_t d, int32_t hq, int64_t m, float *dst);

/* LoRA adapters for a forward (PEFT's: y = x W^T + scale (x A^T) B^T), per layer and projection
 * (kvc_lora_target); built with kvc_lora_new / kvc_lora_set (train/lora.c). */
typedef struct kvc_lora_mat {
    int32_t r;   /* 0: no adapter on this projection */
    float scale; /* lora_alpha / r (rslora: lora_alpha / sqrt(r)) */
    float *a;    /* [r, in] */
    float *b;    /* [out, r] */
} kvc_lora_mat;
struct kvc_lora {
    int32_t n_layers;
    int64_t in[KVC_LORA_N], out[KVC_LORA_N]; /* each projection's shape */
    kvc_lora_mat *mats;                       /* [n_layers * KVC_LORA_N] */
};

/* The prefix, one layer at a time. layer(user, l, k, v, held) points k[h], v[h] (h < Hkv) at [P + m, d] rows: rows
 * [0, held[h]) hold layer l's prefix K (after RoPE) and V of head h, the next m rows are the pass's to write its own
 * rows into. held[h] comes in as P (a full prefix leaves it); a ragged prefix (a compressed cache: heads holding
 * different rows) lowers it. The pointers stay valid until the next call. */
typedef struct kvc_rows_prefix {
    int64_t P; /* the rows a head holds at most */
    kvc_status (*layer)(void *user, int32_t l, float **k, float **v, int64_t *held);
    void *user;
} kvc_rows_prefix;

/* What an objective's backward hook sees of layer l. */
typedef struct kvc_rows_layer {
    int32_t layer;
    const int64_t *held; /* [Hkv] the prefix rows of each head (kvc_rows_prefix) */
    int64_t m;
    const float *q;    /* [m, H d] the rows' queries after q-norm and RoPE */
    float *const *k;   /* [Hkv] -> [held[h] + m, d]: the prefix's keys, then the rows' own */
    float *const *v;
} kvc_rows_layer;

/* The objective: every hook may be NULL. The value of a forward is the sum of the head terms (per layer, in
 * head order: the same for any thread count) and the output term. */
typedef struct kvc_rows_objective {
    void *user;
    int32_t last_mlp; /* 1: the last layer's MLP runs and the output is the model's last hidden state (before the
                         final norm); 0: the pass stops after the last attention (its output: that residual) */
    /* forward, layer l, query head hq (called in parallel over heads): p [m, P + m] the rows' causal softmax;
     * returns the head's term of the value */
    double (*head_probs)(void *user, int32_t l, int32_t hq, const float *p, int64_t len);
    /* forward, once: the output's term of the value and, when dx is not NULL, its gradient dx [m, D] */
    double (*output)(void *user, const float *x, int64_t m, int64_t D, float *dx);
    /* backward, layer l, head hq (in parallel over heads): adds d(value)/d(p) to dp [m, P + m] */
    void (*head_dprobs)(void *user, int32_t l, int32_t hq, float *dp, int64_t len);
    /* backward, layer l: dxm [m, D] is the gradient of the residual stream right after the layer's attention */
    kvc_status (*resid_grad)(void *user, const kvc_rows_layer *view, const float *dxm);
} kvc_rows_objective;

typedef struct kvc_rows kvc_rows;

/* The NotImplementedError of a model the pass cannot run (`who` names the caller): a sliding window that
 * reaches inside the span of positions [0, last_pos]. */
kvc_status kvc_rows_check_model(const kvc_config *c, int64_t last_pos, const char *who);
/* A workspace for m rows over P prefix rows (with_grad: room for the backward). */
kvc_status kvc_rows_new(const kvc_config *c, const kvc_host_weights *M, int64_t P, int64_t m, int with_grad,
                        kvc_rows **out);
void kvc_rows_free(kvc_rows *r);
/* The forward of the m input rows x0 [m, D] at positions pos [m]; *value receives the objective's value (obj
 * may be NULL); lora (may be NULL) is active on this pass only (a backward after it is refused). */
kvc_status kvc_rows_forward(kvc_rows *r, const kvc_rows_prefix *pre, const kvc_rows_objective *obj,
                            const struct kvc_lora *lora, const float *x0, const int64_t *pos, double *value);
/* The backward after a forward with the same prefix and objective; grad [m, D] (may be NULL) receives the
 * gradient with respect to x0. */
kvc_status kvc_rows_backward(kvc_rows *r, const kvc_rows_prefix *pre, const kvc_rows_objective *obj, float *grad);
/* After a forward: layer l's own K (after q/k-norm and RoPE) and V of the rows, [m, Hkv d] each. */
void kvc_rows_own_kv(const kvc_rows *r, int32_t l, const float **k, const float **v);

/* A prefix read from a session's cache through its backend (layer by layer, kv_read): every row each head holds
 * (at most P: the cache full or compressed). Host memory: 2 Hkv (P + m) d floats. */
typedef struct kvc_session_prefix {
    kvc_rows_prefix pre;
    struct kvc_session *s;
    int64_t m;
    float *block;
} kvc_session_prefix;
kvc_status kvc_session_prefix_init(kvc_session_prefix *p, struct kvc_session *s, int64_t P, int64_t m);
void kvc_session_prefix_free(kvc_session_prefix *p);

#endif
