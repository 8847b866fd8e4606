"""Float64 NumPy reference of KVCompose (kvpress 0.5.5 kvcompose_press.py; docs/METHODS.md, "KVCompose")."""
import numpy as np


def kvcompose_profile(q, K, n_ctx, total=False):
    """q [m, H, d]: the prompt's queries (after RoPE), appended after the n_ctx context rows of K [Hkv, n_ctx + m, d].
    -> [H, n_ctx]: the max (or sum) over the queries of their softmax attention (causal) to each context row."""
    m, H, d = q.shape
    g = H // K.shape[0]
    out = np.zeros((H, n_ctx)) if total else np.full((H, n_ctx), -np.inf)
    for hq in range(H):
        for i in range(m):
            logits = K[hq // g, :n_ctx + i + 1] @ q[i, hq] / np.sqrt(d)
            p = np.exp(logits - logits.max())
            p /= p.sum()
            out[hq] = out[hq] + p[:n_ctx] if total else np.maximum(out[hq], p[:n_ctx])
    return out


def _top_counts(comp, n_kept):
    """Counts per row of comp [bins, n] among its top n_kept entries (higher first, then lower flat index)."""
    flat = comp.ravel()
    order = np.lexsort((np.arange(flat.size), -flat))[:n_kept]
    return np.bincount(order // comp.shape[1], minlength=comp.shape[0])


def kvcompose_kept(task, Hkv, ratio, structured=True, group_max=False, head_max=False, add_mean=True, lower_bound=0,
                   vnorm=None):
    """task [L, H, n] -> kept rows [L][Hkv] (increasing): kvpress's group aggregation, ||v|| (vnorm [L, Hkv, n] or
    None), mean over heads, composite scores, counts and per-head top rows (ties: the lower row)."""
    L, H, n = task.shape
    g = H // Hkv
    t = task.reshape(L, Hkv, g, n)
    scores = t.max(axis=2) if group_max else t.mean(axis=2)
    if vnorm is not None:
        scores = scores * vnorm
    if add_mean:
        scores = scores + scores.mean(axis=1, keepdims=True)
    lb = min(lower_bound, n)
    sorted_ = -np.sort(-scores, axis=-1)
    per_head = sorted_.copy()
    per_head[..., :lb] += 1e9
    per_layer = sorted_.max(axis=1) if head_max else sorted_.mean(axis=1)
    per_layer[..., :lb] += 1e9
    per_layer[0] = per_layer.max(axis=0)
    if structured:
        counts = np.maximum(_top_counts(per_layer, max(1, int(L * n * (1 - ratio)))), max(1, lb))
        counts = np.repeat(counts[:, None], Hkv, axis=1)
    else:
        counts = _top_counts(per_head.reshape(L * Hkv, n), max(1, int(L * Hkv * n * (1 - ratio)))).reshape(L, Hkv)
    return [[np.sort(np.lexsort((np.arange(n), -scores[l, h]))[:counts[l, h]]) for h in range(Hkv)] for l in range(L)]
