"""Float64 NumPy references for the paper methods (docs/METHODS.md): TAKE's chunked prefill, EDIE scores,
ChunkKV chunk selection. Written from the spec, independent of the C code."""
from __future__ import annotations

import numpy as np


def topk_rows(scores, k):
    """Top-k rows: higher score first, then lower row; returned sorted."""
    order = sorted(range(len(scores)), key=lambda r: (-scores[r], r))
    return np.sort(np.array(order[:k], dtype=np.int64))


def avg_pool(x, k):
    half = k // 2
    pad = np.concatenate([np.zeros(half), x, np.zeros(half)])
    return np.array([pad[i:i + k].sum() / k for i in range(len(x))])


def softmax(s):
    e = np.exp(s - s.max())
    return e / e.sum()


def take_probe_scores(qa, K, group, kernel, d):
    """qa [p, H, d] accumulated probe queries; K [real, d] of one KV head; group = its query heads."""
    out = np.zeros(K.shape[0])
    for hq in group:
        mean = np.mean([softmax(K @ qa[j, hq] / np.sqrt(d)) for j in range(qa.shape[0])], axis=0)
        out += avg_pool(mean, kernel)
    return out / len(group)


def take_prefill(model, ids, probe, budget, chunk_size, warmup_budget, warmup_layers, kernel=7, alpha=0.2,
                 delayed=True, cache=None, pos0=0, scope="cache"):
    """TAKE on the NumPy model: returns (cache, logits of the last prompt token). `cache` (at position pos0): a
    cache the prompt follows (a conversation's earlier turns); scope "cache" scores every row it holds with the
    chunks, "call" only the rows this prompt appends (the rows held before stay, in front)."""
    ids, probe = list(ids), list(probe)
    p, n, W = len(probe), len(ids), warmup_layers
    g = model.H // model.Hkv
    cache = model.empty_cache() if cache is None else cache
    mark = [[cache[l][h]["k"].shape[0] if scope == "call" else 0 for h in range(model.Hkv)] for l in range(model.L)]
    qa = [None] * model.L
    pos, logits = pos0, None
    for start in range(0, n, chunk_size):
        chunk = ids[start:start + chunk_size]
        last = start + len(chunk) >= n

        def hook(l, q, attn, o, resid, past, cache):
            qp = q[-p:]
            qa[l] = qp.copy() if qa[l] is None else alpha * qa[l] + (1 - alpha) * qp
            k = warmup_budget if (not last and l < W) else budget
            defer = delayed and l < W - 1
            keeps = []
            for h in range(model.Hkv):
                ch, a = cache[l][h], mark[l][h]
                real = ch["k"].shape[0] - p - a  # the rows in scope: after the mark, before the probes
                if defer or real <= k:
                    keep = np.arange(real)
                else:
                    sc = take_probe_scores(qa[l], ch["k"][a:a + real], range(h * g, (h + 1) * g), kernel, model.d)
                    keep = topk_rows(sc, k)
                keeps.append(keep)
                cache[l][h] = {key: val[np.r_[np.arange(a), a + keep]] for key, val in ch.items()}
            if delayed and l == W - 1:
                for m in range(W - 1):
                    for h in range(model.Hkv):
                        a = mark[m][h]
                        cache[m][h] = {key: val[np.r_[np.arange(a), a + keeps[h]]] for key, val in cache[m][h].items()}

        x = model.embed(chunk + probe)
        hidden = model.forward(x, np.arange(pos, pos + len(chunk) + p), cache, hook)
        if last:
            logits = model.logits(hidden[len(chunk) - 1])
        pos += len(chunk)
    return cache, logits


def edie_scores(q, attn, K, V, past, w, kernel=7, alpha=0.1, H=None, Hkv=None):
    """EDIE for one layer. q, attn [n, H, d] (this call's queries and attention outputs); K, V
    [Hkv, len, d]; past = len - n. Returns scores [Hkv, len] with the window at max + 1."""
    n, H, d = q.shape
    Hkv, length = K.shape[0], K.shape[1]
    g = H // Hkv
    n_past = length - w
    lo, hi = w + 1, min(length - 2 * w, n_past - 1)
    if lo > hi:
        lo, hi = 0, n_past - 1
    out = np.zeros((Hkv, length))
    for h in range(Hkv):
        vn = np.abs(V[h]).sum(axis=1)
        acc = np.zeros(n_past)
        for hq in range(h * g, (h + 1) * g):
            for j in range(n - w, n):
                vis = past + j + 1
                a = softmax(K[h, :vis] @ q[j, hq] / np.sqrt(d))
                on = np.abs(attn[j, hq]).sum()
                cj = a[lo:hi + 1].max()
                acc += cj * a[:n_past] / (1 + alpha - a[:n_past]) * (vn[:n_past] + on)
        out[h, :n_past] = avg_pool(acc, kernel)
    out[:, n_past:] = out[:, :n_past].max() + 1
    return out


def chunk_select(scores, chunk, n_kept_chunks=None, compression_ratio=None, window=0, budget=None):
    """ChunkKV selection from per-head scores [Hkv, len] (one set shared by every head)."""
    Hkv, length = scores.shape
    if budget is not None:
        span = length - window
        k_chunks = max(0, (budget - window) // chunk)
    else:
        span = length
    summed = scores[:, :span].sum(axis=0)
    starts = list(range(0, span, chunk))
    cs = np.array([summed[s:s + chunk].mean() for s in starts])
    if budget is None:
        k_chunks = max(1, int(len(starts) * (1 - compression_ratio)))
    top = topk_rows(cs, min(k_chunks, len(starts)))
    rows = [r for c in top for r in range(starts[c], min(starts[c] + chunk, span))]
    rows += list(range(span, length))
    return np.array(sorted(rows), dtype=np.int64)
