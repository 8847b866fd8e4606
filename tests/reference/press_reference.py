"""Float64 NumPy references for the baseline scorers and the allocations, written from docs/METHODS.md
("Common ground", "Baseline scorers", "PyramidKV", "Ada-KV") and kvpress 0.5.5's semantics.

One layer at a time; every KV head holds `length` rows, the last n of which belong to this call's
queries q [n, H, d] (so `length - n` rows are a past). K [Hkv, length, d]. Scores are [Hkv, length],
higher means keep. Selections are lists (one per KV head) of kept rows, sorted increasingly.
Ties: higher score first, then lower row, then (across heads) lower head.
"""
from __future__ import annotations

import numpy as np

from method_reference import softmax, topk_rows

# -- budgets --------------------------------------------------------------------------------------


def n_kept_ratio(n, cr):
    """kvpress compute_n_kept: int(n (1 - cr)), at least 1."""
    return max(1, int(n * (1 - cr)))


def n_kept(n, cr=None, budget=None):
    """Tokens kept per KV head: min(n, B) in budget form (n <= B keeps all), else kvpress's ratio."""
    if budget:
        return min(n, int(budget))
    return n_kept_ratio(n, cr)


def pyramid_budget(n, layer, n_layers, w, beta, cr=None, budget=None):
    """kvpress PyramidKVPress.get_layer_budget, integer schedule (Python round = half to even); the
    budget form puts B where kvpress has n (1 - cr). Falls back to the uniform round(avg) when the
    linear schedule does not fit the prompt."""
    if budget is not None and n <= budget:
        return n
    avg = budget if budget is not None else n * (1 - cr)
    max_cap = w + avg
    min_num = (max_cap - w) / beta
    max_num = (max_cap - w) * 2 - min_num
    if max_num >= n - w:
        max_num = n - w
        min_num = (max_cap - w) * 2 - max_num
    if not (n >= max_num >= min_num >= w):
        return min(n, max(1, round(avg)))
    steps = (max_num - min_num) / (n_layers - 1) if n_layers > 1 else 0.0
    return min(n, max(1, round(max_num - layer * steps)))


# -- scorers --------------------------------------------------------------------------------------


def pool(x, k, kind):
    """1-D pooling, stride 1, padding k // 2: "avg" counts the zero padding (torch avg_pool1d),
    "max" ignores it (torch max_pool1d pads with -inf)."""
    half = k // 2
    if kind == "avg":
        pad = np.concatenate([np.zeros(half), x, np.zeros(half)])
        return np.array([pad[i:i + k].sum() / k for i in range(len(x))])
    return np.array([x[max(0, i - half):i + half + 1].max() for i in range(len(x))])


def window_attention(q, K, w, past):
    """[H, length - w]: mean over the last w queries of their softmax over every row they can see
    (all past rows, causal inside this call), restricted to the rows before the window."""
    n, H, d = q.shape
    Hkv, length, _ = K.shape
    g = H // Hkv
    out = np.zeros((H, length - w))
    for hq in range(H):
        h = hq // g
        acc = np.zeros(length)
        for j in range(n - w, n):
            vis = past + j + 1
            acc[:vis] += softmax(K[h, :vis] @ q[j, hq] / np.sqrt(d))
        out[hq] = acc[:length - w] / w
    return out


def snapkv_scores(q, K, w, k, pooling="avg", gqa="mean", pool_then_reduce=True):
    """SnapKV: window attention, pooling, GQA reduction (either order); the window rows get the
    layer's max + 1 (kvpress pads with scores.max() + 1 over all heads)."""
    n, H, d = q.shape
    Hkv, length, _ = K.shape
    g = H // Hkv
    att = window_attention(q, K, w, length - n)
    red = np.mean if gqa == "mean" else np.max
    out = np.zeros((Hkv, length))
    for h in range(Hkv):
        grp = att[h * g:(h + 1) * g]
        if pool_then_reduce:
            out[h, :length - w] = red(np.stack([pool(a, k, pooling) for a in grp]), axis=0)
        else:
            out[h, :length - w] = pool(red(grp, axis=0), k, pooling)
    out[:, length - w:] = out[:, :length - w].max() + 1
    return out


def tova_scores(q, K):
    """TOVA: the last query's attention over the rows before it, mean over all heads of the layer,
    the same for every KV head; the last row gets max + 1."""
    n, H, d = q.shape
    Hkv, length, _ = K.shape
    att = window_attention(q, K, 1, length - n)  # [H, length - 1]
    s = att.mean(axis=0)
    out = np.zeros((Hkv, length))
    out[:, :-1] = s
    out[:, -1] = s.max() + 1
    return out


def observed_scores(q, K):
    """H2O one-shot: attention summed over this call's queries (causal), divided by how many of them
    see the row (every query sees the past), mean over the group."""
    n, H, d = q.shape
    Hkv, length, _ = K.shape
    g, past = H // Hkv, length - n
    out = np.zeros((Hkv, length))
    for hq in range(H):
        h = hq // g
        acc = np.zeros(length)
        for i in range(n):
            vis = past + i + 1
            acc[:vis] += softmax(K[h, :vis] @ q[i, hq] / np.sqrt(d))
        seen = np.where(np.arange(length) < past, n, n - (np.arange(length) - past))
        out[h] += acc / seen / g
    return out


def knorm_scores(K):
    return -np.linalg.norm(K, axis=-1)


def streaming_scores(Hkv, length, n_sink):
    """An order-equivalent encoding of StreamingLLM (sinks first, then recency)."""
    s = np.arange(length, dtype=np.float64)
    s[:n_sink] = length + 1
    return np.tile(s, (Hkv, 1))


def streaming_keep(length, n_kept, n_sink):
    """The first n_sink rows and the most recent n_kept - n_sink."""
    return np.array(sorted(set(range(min(n_sink, length))) | set(range(length - (n_kept - n_sink), length))))


# -- allocations ----------------------------------------------------------------------------------


def _ranked(scores, rows_of_head):
    """(score, row, head) candidates, best first: higher score, then lower row, then lower head."""
    return sorted(((-scores[h, r], r, h) for h, rows in enumerate(rows_of_head) for r in rows))


def uniform_keep(scores, k):
    return [topk_rows(s, k) for s in scores]


def adakv_protect(scores, n_kept, alpha):
    """kvpress AdaKVPress: each head's top n_safe = int(n_kept alpha) (at least 1 when alpha > 0)
    protected, then the best remaining rows layer-wide up to Hkv * n_kept in total."""
    Hkv, length = scores.shape
    if n_kept >= length:
        return [np.arange(length) for _ in range(Hkv)]
    n_safe = int(n_kept * alpha)
    if alpha > 0 and n_kept > 0:
        n_safe = max(1, n_safe)
    chosen = np.zeros((Hkv, length), dtype=bool)
    for h in range(Hkv):
        chosen[h, topk_rows(scores[h], n_safe)] = True
    rest = Hkv * n_kept - chosen.sum()
    cands = _ranked(scores, [np.nonzero(~chosen[h])[0] for h in range(Hkv)])
    for _, r, h in cands[:rest]:
        chosen[h, r] = True
    return [np.nonzero(chosen[h])[0] for h in range(Hkv)]


def adakv_floor_caps(scores, n_kept, w, alpha):
    """Official Ada-KV code: the global top Hkv * Bp past rows (Bp = n_kept - w) give f_h rows per
    head; cap_h = round(f_h (1 - alpha) + floor(Bp alpha)), clipped to [0, n_past]. Returns (f, caps)."""
    Hkv, length = scores.shape
    Bp = max(0, n_kept - w)
    n_past = length - w
    f = np.zeros(Hkv, dtype=np.int64)
    for _, r, h in _ranked(scores, [range(n_past)] * Hkv)[:Hkv * Bp]:
        f[h] += 1
    caps = np.array([int(min(n_past, max(0, np.floor(f[h] * (1 - alpha) + np.floor(Bp * alpha) + 0.5))))
                     for h in range(Hkv)])
    return f, caps


def adakv_floor(scores, n_kept, w, alpha):
    """Each head keeps its own top cap_h past rows plus the window."""
    Hkv, length = scores.shape
    if n_kept >= length:
        return [np.arange(length) for _ in range(Hkv)]
    _, caps = adakv_floor_caps(scores, n_kept, w, alpha)
    n_past = length - w
    return [np.array(sorted(set(topk_rows(scores[h, :n_past], caps[h]).tolist()) | set(range(n_past, length))),
                     dtype=np.int64) for h in range(Hkv)]
