"""Float64 NumPy references for the baseline scorers and the allocations (METHODS.md, "Common ground",
"Baseline scorers", "PyramidKV", "Ada-KV"). One layer; every KV head holds `length` rows, the last n
of which belong to this call's queries q [n, H, d]."""
from __future__ import annotations

import numpy as np

from method_reference import softmax, topk_rows


def n_kept_ratio(n, cr):
    return max(1, int(n * (1 - cr)))


def pool(x, k, kind):
    half = k // 2
    if kind == "avg":
        pad = np.concatenate([np.zeros(half), x, np.zeros(half)])
        return np.array([pad[i:i + k].sum() / k for i in range(len(x))])
    return np.array([x[max(0, i - half):i + half + 1].max() for i in range(len(x))])


def window_attention(q, K, w, past):
    """[H, length - w]: mean over the last w queries of their softmax over the visible rows."""
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
    n, H, d = q.shape
    Hkv, length, _ = K.shape
    att = window_attention(q, K, 1, length - n)  # [H, length - 1]
    s = att.mean(axis=0)
    out = np.zeros((Hkv, length))
    out[:, :-1] = s
    out[:, -1] = s.max() + 1
    return out


def observed_scores(q, K):
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


def streaming_keep(length, n_kept, n_sink):
    return np.array(sorted(set(range(min(n_sink, length))) | set(range(length - (n_kept - n_sink), length))))


def pyramid_budget(n, layer, n_layers, w, beta, cr=None, budget=None):
    """kvpress PyramidKVPress.get_layer_budget (budget form: B in place of n (1 - cr))."""
    avg = budget if budget is not None else n * (1 - cr)
    if budget is not None and n <= budget:
        return n
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


def adakv_protect(scores, n_kept, alpha):
    """kvpress AdaKVPress: each head's top int(n_kept * alpha) protected, then the best layer-wide."""
    Hkv, length = scores.shape
    n_safe = int(n_kept * alpha)
    if alpha > 0 and n_kept > 0:
        n_safe = max(1, n_safe)
    chosen = np.zeros((Hkv, length), dtype=bool)
    for h in range(Hkv):
        chosen[h, topk_rows(scores[h], n_safe)] = True
    rest = Hkv * n_kept - chosen.sum()
    cands = sorted(((-scores[h, r], r, h) for h in range(Hkv) for r in range(length) if not chosen[h, r]))
    for _, r, h in cands[:rest]:
        chosen[h, r] = True
    return [np.nonzero(chosen[h])[0] for h in range(Hkv)]


def adakv_floor(scores, n_kept, w, alpha):
    """Official Ada-KV: global top Hkv * Bp over past rows -> f_h; cap_h = round(f_h (1-a) + floor(Bp a))."""
    Hkv, length = scores.shape
    Bp = max(0, n_kept - w)
    n_past = length - w
    cands = sorted(((-scores[h, r], r, h) for h in range(Hkv) for r in range(n_past)))
    f = np.zeros(Hkv, dtype=int)
    for _, r, h in cands[:Hkv * Bp]:
        f[h] += 1
    keep = []
    for h in range(Hkv):
        cap = int(min(n_past, max(0, np.floor(f[h] * (1 - alpha) + np.floor(Bp * alpha) + 0.5))))
        rows = set(topk_rows(scores[h, :n_past], cap).tolist()) | set(range(n_past, length))
        keep.append(np.array(sorted(rows)))
    return keep
