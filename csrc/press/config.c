/* Press settings: the kvpress defaults, the one validation every caller goes through (the C API, the
 * Python dataclasses via kvc_press_config_check, TAKE's inner press), and the budget arithmetic
 * (docs/METHODS.md, "Common ground", "PyramidKV"), exported so Python never repeats it. */
#include <math.h>
#include <string.h>

#include "press.h"

void kvc_press_config_defaults(kvc_press_config *c) {
    memset(c, 0, sizeof *c);
    c->scorer = KVC_SCORE_SNAPKV;
    c->allocation = KVC_ALLOC_UNIFORM;
    c->window = 64;
    c->kernel = 5;
    c->pool_then_reduce = 1;
    c->n_sink = 4;
    c->alpha_safeguard = 0.2f;
    c->safeguard = KVC_SAFEGUARD_PROTECT;
    c->pyramid_beta = 20;
    c->reuse_layers = 1;
    c->edie_alpha = 0.1f;
    /* kvpress's scorers: their defaults */
    c->lag_size = 128;
    c->n_future = 512;
    c->use_covariance = 1;
    c->use_vnorm = 1;
    c->critical_eps = 1e-4f;
    c->first_stage_ratio = 0.5f;
    c->attn_chunk = 256;
    c->sketch_dim = 48;
    c->cur_type = 3;
    c->cur_window = 16;
    c->cmp_sink_start = 8;
    c->cmp_sink_end = 4;
    c->finch_normalize = 1;
    c->lazy_threshold = 1.0f;
    c->n_recent = 1024;
    c->merge_fraction = 1.0f;
    c->cap_tau = 5.0f;
    c->dms_window = 128;
}

kvc_status kvc_press_config_check(const kvc_press_config *c) {
    if (!c) return kvc_fail(KVC_ERR_ARG, "press config is NULL");
    const kvc_scorer_i *sc = kvc_scorer_of(c->scorer);
    if (!sc) return kvc_fail(KVC_ERR_ARG, "unknown scorer %d", c->scorer);
    if (c->allocation < KVC_ALLOC_UNIFORM || c->allocation > KVC_ALLOC_LAYER)
        return kvc_fail(KVC_ERR_ARG, "unknown allocation %d", c->allocation);
    if (!(c->compression_ratio >= 0 && c->compression_ratio < 1))
        return kvc_fail(KVC_ERR_ARG, "compression_ratio must be in [0, 1) (fraction of tokens removed), got %g",
                        c->compression_ratio);
    if (c->budget < 0)
        return kvc_fail(KVC_ERR_ARG, "budget must be a positive integer (tokens kept per KV head per layer), got %lld",
                        (long long)c->budget);
    if (c->budget > 0 && c->compression_ratio != 0)
        return kvc_fail(KVC_ERR_ARG, "give either compression_ratio or budget, not both");
    if (kvc_scorer_has_window(c->scorer) && c->window < 1)
        return kvc_fail(KVC_ERR_ARG, "window_size must be a positive integer, got %d", c->window);
    if (c->window < 0) return kvc_fail(KVC_ERR_ARG, "window_size must be >= 0, got %d", c->window);
    if (c->kernel < 1 || c->kernel % 2 == 0) return kvc_fail(KVC_ERR_ARG, "kernel_size must be an odd integer >= 1, got %d", c->kernel);
    if (c->n_sink < 0) return kvc_fail(KVC_ERR_ARG, "n_sink must be >= 0, got %d", c->n_sink);
    if (!(c->alpha_safeguard >= 0 && c->alpha_safeguard <= 1))
        return kvc_fail(KVC_ERR_ARG, "alpha_safeguard must be in [0, 1], got %g", c->alpha_safeguard);
    if (c->safeguard != KVC_SAFEGUARD_FLOOR && c->safeguard != KVC_SAFEGUARD_PROTECT)
        return kvc_fail(KVC_ERR_ARG, "unknown safeguard %d", c->safeguard);
    /* the scorer's own settings (its row's check: scorers/<name>.c) */
    if (sc->check) KVC_TRY(sc->check(c));
    if (c->dms) {
        if (!isfinite(c->dms_threshold)) return kvc_fail(KVC_ERR_ARG, "DMSPress needs a finite threshold, got %g", c->dms_threshold);
        if (c->dms_window < 0) return kvc_fail(KVC_ERR_ARG, "sliding_window_size must be >= 0, got %d", c->dms_window);
        if (c->compression_ratio != 0 || c->budget != 0)
            return kvc_fail(KVC_ERR_ARG, "DMSPress evicts by its threshold: its press takes no compression_ratio or budget");
        if (c->allocation != KVC_ALLOC_UNIFORM || c->chunk_length > 0 || c->critical || c->merge || c->drop_window)
            return kvc_fail(KVC_ERR_ARG, "DMSPress wraps a plain scorer press (no Ada-KV, chunks, CriticalKV or merging)");
    }
    if (c->merge) {
        if (!(c->merge_threshold >= 0 && c->merge_threshold <= 1))
            return kvc_fail(KVC_ERR_ARG, "similarity_threshold must be in [0, 1], got %g", c->merge_threshold);
        if (!(c->merge_fraction > 0 && c->merge_fraction <= 1))
            return kvc_fail(KVC_ERR_ARG, "merge_fraction must be in (0, 1], got %g", c->merge_fraction);
    }
    if (c->critical) {
        if (!(c->critical_eps >= 0 && isfinite(c->critical_eps)))
            return kvc_fail(KVC_ERR_ARG, "CriticalKV epsilon must be finite and >= 0, got %g", c->critical_eps);
        if (!(c->first_stage_ratio >= 0 && c->first_stage_ratio <= 1))
            return kvc_fail(KVC_ERR_ARG, "first_stage_ratio must be in [0, 1], got %g", c->first_stage_ratio);
        if (c->allocation != KVC_ALLOC_UNIFORM && c->allocation != KVC_ALLOC_ADAKV)
            return kvc_fail(KVC_ERR_ARG, "CriticalKV selects per head (uniform) or with Ada-KV's budgets (CriticalAdaKVPress), "
                            "not with allocation %d", c->allocation);
        if (c->chunk_length > 0 || c->drop_window)
            return kvc_fail(KVC_ERR_ARG, "CriticalKV does not combine with ChunkKV chunks or a dropped window");
    }
    if (c->chunk_length < 0) return kvc_fail(KVC_ERR_ARG, "chunk_length must be >= 0, got %d", c->chunk_length);
    if (c->reuse_layers < 0) return kvc_fail(KVC_ERR_ARG, "reuse_layers must be >= 1, got %d", c->reuse_layers);
    if (c->chunk_length > 0 && c->allocation == KVC_ALLOC_ADAKV)
        return kvc_fail(KVC_ERR_ARG, "ChunkKV shares one chunk selection across a layer's heads; Ada-KV gives each head its own "
                        "budget: the two do not combine (use ChunkKVPress over SnapKVPress, or AdaKVPress alone)");
    if (c->allocation == KVC_ALLOC_PYRAMID && c->pyramid_beta < 1)
        return kvc_fail(KVC_ERR_ARG, "PyramidKV beta must be >= 1, got %d", c->pyramid_beta);
    if (c->chunk_press < 0) return kvc_fail(KVC_ERR_ARG, "ChunkPress chunk_length must be a positive integer, got %d", c->chunk_press);
    if (c->chunk_press > 0) {
        char which[256];
        if (!kvc_chunk_press_scorer(c->scorer))
            return kvc_fail(KVC_ERR_UNSUPPORTED, "ChunkPress scores each chunk alone: wrap a press of %s",
                            kvc_scorer_titles(KVC_SCORER_CHUNKABLE, which, sizeof which));
        if (c->budget > 0 || c->allocation != KVC_ALLOC_UNIFORM || c->chunk_length > 0 || c->critical || c->drop_window)
            return kvc_fail(KVC_ERR_ARG, "ChunkPress keeps the inner press's compression_ratio of every chunk: give it a "
                            "plain scorer press with compression_ratio (no budget, Ada-KV, ChunkKV or CriticalKV)");
    }
    if (c->low_entropy_chunk < 0)
        return kvc_fail(KVC_ERR_ARG, "low_entropy_chunk_length must be >= 1, got %d", c->low_entropy_chunk);
    if (c->low_entropy_chunk > 0 && !(c->chunk_length > c->low_entropy_chunk))
        return kvc_fail(KVC_ERR_ARG, "EntropyGatedChunkKV requires chunk_length > low_entropy_chunk_length >= 1 (got %d and %d)",
                        c->chunk_length, c->low_entropy_chunk);
    if (c->finch_chunk < 0) return kvc_fail(KVC_ERR_ARG, "FinchPress chunk_length must be a positive integer, got %d", c->finch_chunk);
    if (c->finch_chunk > 0) {
        if (c->budget > 0 || c->allocation != KVC_ALLOC_UNIFORM || c->chunk_length > 0 || c->chunk_press > 0 || c->critical)
            return kvc_fail(KVC_ERR_ARG, "FinchPress's chunked selection keeps compression_ratio of every chunk: no budget, "
                            "Ada-KV, ChunkKV or CriticalKV with it");
        if (!((double)c->finch_chunk > (double)kvc_press_window(c) / (1.0 - c->compression_ratio)))
            return kvc_fail(KVC_ERR_ARG, "FinchPress chunk_length (%d) must exceed window_size / (1 - compression_ratio) "
                            "(%d / %g): the last chunk must keep the whole window", c->finch_chunk, kvc_press_window(c),
                            1.0 - c->compression_ratio);
    }
    if (c->budget > 0 && kvc_scorer_has_window(c->scorer) && c->budget < c->window)
        return kvc_fail(KVC_ERR_ARG, "budget (%lld) must be at least window_size (%d): the window is kept inside the budget",
                        (long long)c->budget, c->window);
    return KVC_OK;
}

int64_t kvc_n_kept_ratio(int64_t n, double cr) {
    /* kvpress compute_n_kept: int(n * (1 - cr)), at least 1 */
    int64_t k = (int64_t)((double)n * (1.0 - cr));
    return k < 1 ? 1 : k;
}

/* Python's round(): half to even, as kvpress's PyramidKV schedule uses it. */
static int64_t round_half_even(double x) { return (int64_t)nearbyint(x); }

int64_t kvc_layer_budget(const kvc_press_config *p, int32_t layer, int32_t n_layers, int64_t n) {
    const double avg = p->budget > 0 ? (double)p->budget : (double)n * (1.0 - p->compression_ratio);
    if (p->budget > 0 && n <= p->budget) return n;
    if (p->allocation != KVC_ALLOC_PYRAMID) {
        int64_t k = p->budget > 0 ? p->budget : kvc_n_kept_ratio(n, p->compression_ratio);
        if (kvc_scorer_has(p->scorer, KVC_SCORER_KEEP_WINDOW) && k < p->window) k = p->window;
        return k > n ? n : k;
    }
    /* PyramidKV (kvpress integer schedule): budgets fall linearly with depth from max_num to
     * min_num = (budget - w) / beta with mean budget - w, plus the window; if that schedule does
     * not fit the prompt, uniform. */
    const double w = p->window, beta = p->pyramid_beta;
    const double max_cap = w + avg;
    double min_num = (max_cap - w) / beta;
    double max_num = (max_cap - w) * 2 - min_num;
    if (max_num >= (double)n - w) {
        max_num = (double)n - w;
        min_num = (max_cap - w) * 2 - max_num;
    }
    if (!((double)n >= max_num && max_num >= min_num && min_num >= w)) {
        int64_t k = round_half_even(avg);
        return k < 1 ? 1 : (k > n ? n : k);
    }
    const double steps = n_layers > 1 ? (max_num - min_num) / (n_layers - 1) : 0.0;
    int64_t k = round_half_even(max_num - layer * steps);
    return k < 1 ? 1 : (k > n ? n : k);
}

kvc_status kvc_press_kept(const kvc_press_config *cfg, int32_t layer, int32_t n_layers, int64_t n, int64_t *out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_press_kept: out is NULL");
    KVC_TRY(kvc_press_config_check(cfg));
    if (n < 0) return kvc_fail(KVC_ERR_ARG, "kvc_press_kept: n must be >= 0, got %lld", (long long)n);
    if (n_layers < 1 || layer < 0 || layer >= n_layers)
        return kvc_fail(KVC_ERR_ARG, "kvc_press_kept: layer %d not in [0, %d)", layer, n_layers);
    *out = n == 0 ? 0 : kvc_layer_budget(cfg, layer, n_layers, n);
    return KVC_OK;
}
