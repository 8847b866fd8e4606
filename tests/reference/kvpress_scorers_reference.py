"""Float64 NumPy references for the kvpress scorers of issue 16 (docs/METHODS.md, "kvpress scorers"),
written from the papers' definitions as kvpress 0.5.5 states them. Shapes as press_reference.py: one layer,
K, V [Hkv, length, d], q [n, H, d] the last n rows' queries after RoPE (positions length - n + i, half
pairing, theta 10000: what kvc_press_compute assumes). Scores [Hkv, length], higher means keep."""
from __future__ import annotations

import numpy as np

from hub_presses_reference import expected_attention_given


def keydiff_scores(K):
    """-cos(k, anchor), anchor = mean of the head's unit keys."""
    unit = K / np.linalg.norm(K, axis=-1, keepdims=True)
    anchor = unit.mean(axis=1, keepdims=True)
    return -(unit * anchor).sum(-1) / np.linalg.norm(anchor, axis=-1)


def _lag_states(x, ref):
    """Softmax over the partition's rows of the std over dimensions of x min-max normalised by ref's range."""
    lo, hi = ref.min(axis=0), ref.max(axis=0)
    sd = ((x - lo) / (hi - lo)).std(axis=-1, ddof=1)
    e = np.exp(sd - sd.max())
    return e / e.sum()


def lagkv_scores(K, V, n_sink=4, lag=128, cross=False):
    Hkv, n, _ = K.shape
    out = np.ones((Hkv, n))
    if n < n_sink + 2 * lag:  # too short: a ramp after the sinks
        out[:, n_sink:] = np.arange(n - n_sink) / (n - n_sink)
        return out
    parts = (n - n_sink) // lag
    for h in range(Hkv):
        for p in range(parts - 1):
            rows = slice(n_sink + p * lag, n_sink + (p + 1) * lag)
            ref = slice(n_sink + (p + 1) * lag, n_sink + (p + 2) * lag)
            s = (_lag_states(K[h, rows], K[h, ref]) + _lag_states(V[h, rows], V[h, ref])) / 2
            if not cross:  # the rank inside the partition, 0 lowest, equal scores by row
                s = np.argsort(np.argsort(s, kind="stable"), kind="stable") / lag
            out[h, rows] = s
    return out


def rope_matrix(pos, d, theta=10000.0):
    """The dense RoPE rotation of position pos (half pairing): x -> R x."""
    f = theta ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(pos * f), np.sin(pos * f)
    h = d // 2
    R = np.zeros((d, d))
    R[np.arange(h), np.arange(h)] = c
    R[np.arange(h) + h, np.arange(h) + h] = c
    R[np.arange(h), np.arange(h) + h] = -s
    R[np.arange(h) + h, np.arange(h)] = s
    return R


def expected_attention_scores(q, K, V, n_sink=4, n_future=512, use_covariance=True, use_vnorm=True, epsilon=0.0,
                              theta=10000.0):
    n, _, d = q.shape
    length = K.shape[1]
    past = length - n
    # the queries before RoPE (rows after the first n_sink of the call)
    u = np.stack([np.einsum("ij,hj->hi", rope_matrix(past + i, d, theta).T, q[i]) for i in range(n_sink, n)])
    mu = u.mean(0)                                                   # [H, d]
    cen = u - mu
    cov = np.einsum("nhi,nhj->hij", cen, cen) / (n - n_sink)         # [H, d, d]
    # then as from given statistics: averaged RoPE over the n_future positions after the cache, the softmax
    return expected_attention_given(K, V, mu, cov, theta ** (-np.arange(0, d, 2) / d), n_future, n_sink,
                                    use_covariance, use_vnorm, epsilon)


def wov_norms(V, Wo, H):
    """||W_o^{hq} v||_1 averaged over each KV head's query heads: V [Hkv, len, d], Wo [D, H d] -> [Hkv, len]."""
    Hkv, length, d = V.shape
    g = H // Hkv
    out = np.zeros((Hkv, length))
    for hq in range(H):
        out[hq // g] += np.abs(V[hq // g] @ Wo[:, hq * d:(hq + 1) * d].T).sum(-1) / g
    return out


def critical_select(scores, norms, budgets, firsts, eps=1e-4):
    """CriticalKV's two stages per head: the top firsts[h] rows by the plain scores, then the rest by
    (score + eps) * norm, budgets[h] in all. Returns (the two-stage scores, stage-one rows at +inf; kept rows)."""
    out, kept = (scores + eps) * norms, []
    for h in range(scores.shape[0]):
        first = np.argsort(-scores[h], kind="stable")[:firsts[h]]
        out[h, first] = np.inf
        kept.append(np.sort(np.argsort(-out[h], kind="stable")[:budgets[h]]))
    return out, kept


def non_causal_attn_scores(q, K, V, chunk=256):
    """A prefill (length == n): block-diagonal attention without a causal mask inside chunks of `chunk`
    rows, logits q.k unscaled; the last chunk padded with zero rows whose keys get logit -1e-9 (kvpress's
    mask value) and whose queries see 0 on the real keys; column sums, group mean, times ||v||, a
    3-row average (zeros outside), z-normalised over the layer (unbiased std)."""
    n, H, d = q.shape
    Hkv = K.shape[0]
    g = H // Hkv
    A = np.zeros((Hkv, n))
    for c0 in range(0, n, chunk):
        m = min(chunk, n - c0)
        for hq in range(H):
            h = hq // g
            Q = np.zeros((chunk, d))
            Q[:m] = q[c0:c0 + m, hq]
            Kc = np.zeros((chunk, d))
            Kc[:m] = K[h, c0:c0 + m]
            logits = Q @ Kc.T
            logits[m:, :] = 0.0
            logits[:, m:] = -1e-9
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            A[h, c0:c0 + m] += (e / e.sum(axis=1, keepdims=True)).sum(0)[:m] / g
    s = A * np.linalg.norm(V, axis=-1)
    p = np.pad(s, ((0, 0), (1, 1)))
    s = (p[:, :-2] + p[:, 1:-1] + p[:, 2:]) / 3
    return (s - s.mean()) / max(s.std(ddof=1), 1e-6)


def kvzip_scores(q, K, V, n_ctx, start, end, n_sink=4, h=None, Wo=None):
    """KVzip's scores of the context rows [start, end) from the reconstruction queries q [m, H, d] (after
    RoPE) of the m rows appended after the n_ctx context rows; K, V [Hkv, n_ctx + m, d]. Each query's
    softmax runs over the min(n_sink, start) sinks, the chunk and the reconstruction rows up to itself;
    a row's score is its largest weight over the queries and the query heads of its group [Hkv, end - start].
    KVzip+ (h [m, D] the normed hidden states, Wo [D, H d]): each weight divided by ||h_i|| and multiplied
    by ||v W_o[:, head]||_2 of its query head."""
    m, H, d = q.shape
    Hkv, g = K.shape[0], H // K.shape[0]
    sink = min(n_sink, start)
    cols = np.r_[np.arange(sink), np.arange(start, end), n_ctx + np.arange(m)]
    out = np.zeros((Hkv, end - start))
    for hq in range(H):
        kh = hq // g
        s = q[:, hq] @ K[kh, cols].T / np.sqrt(d)
        causal = np.arange(len(cols))[None, :] < (sink + end - start + np.arange(m) + 1)[:, None]
        s = np.where(causal, s, -np.inf)
        a = np.exp(s - s.max(axis=1, keepdims=True))
        a = (a / a.sum(axis=1, keepdims=True))[:, sink:sink + end - start]
        if h is not None:
            wov = np.linalg.norm(V[kh, start:end] @ Wo[:, hq * d:(hq + 1) * d].T, axis=-1)
            a = a / np.linalg.norm(h, axis=-1)[:, None] * wov[None, :]
        out[kh] = np.maximum(out[kh], a.max(axis=0))
    return out


def kvzip_scores_held(q, heads, start, end, n_sink=4, h=None, Wo=None):
    """KVzip's scores on a cache that holds any rows (compressed: heads ragged), by position: heads[kh] = (K, V,
    pos) of one layer's KV head after the m reconstruction rows were appended (its last m rows). A head's columns
    are the rows it holds at positions < min(n_sink, start), then at positions in [start, end), then the
    reconstruction rows; [Hkv, end - start] by position - start, 0 where a head holds no row."""
    m, H, d = q.shape
    Hkv, g = len(heads), H // len(heads)
    sink = min(n_sink, start)
    out = np.zeros((Hkv, end - start))
    for hq in range(H):
        kh = hq // g
        K, V, pos = heads[kh]
        held = pos[:len(pos) - m]
        sinks, chunk = np.flatnonzero(held < sink), np.flatnonzero((held >= start) & (held < end))
        cols = np.r_[sinks, chunk, len(held) + np.arange(m)]
        s = q[:, hq] @ K[cols].T / np.sqrt(d)
        causal = np.arange(len(cols))[None, :] < (len(sinks) + len(chunk) + np.arange(m) + 1)[:, None]
        s = np.where(causal, s, -np.inf)
        a = np.exp(s - s.max(axis=1, keepdims=True))
        a = (a / a.sum(axis=1, keepdims=True))[:, len(sinks):len(sinks) + len(chunk)]
        if h is not None:
            wov = np.linalg.norm(V[chunk] @ Wo[:, hq * d:(hq + 1) * d].T, axis=-1)
            a = a / np.linalg.norm(h, axis=-1)[:, None] * wov[None, :]
        at = held[chunk] - start
        out[kh, at] = np.maximum(out[kh, at], a.max(axis=0))
    return out


def kvzip_kept_held(positions, scores, first, ratio, n_sink=4, layerwise=False):
    """KVzip's eviction of the rows a cache holds at positions [first, first + n) (scores [L, Hkv, n] by position -
    first), positions[l][h] the rows each head holds: of the C such rows, the int(C ratio) lowest over everything
    (layerwise: of each layer's) go, ties the lower (layer, head, position) first, positions < n_sink ranked above
    all; the other rows stay. Returns the kept positions [l][h]."""
    L, Hkv, n = scores.shape
    top = scores.max() + 1
    cand = [(l, h, p) for l in range(L) for h in range(Hkv) for p in positions[l][h] if first <= p < first + n]
    gone = set()
    for part in (range(L) if layerwise else [None]):
        rows = [c for c in cand if part is None or c[0] == part]
        key = [(top if p < n_sink else scores[l, h, p - first], (l, h, p)) for l, h, p in rows]
        key.sort()
        gone |= {c for _, c in key[:int(len(rows) * ratio)]}
    return [[np.array([p for p in positions[l][h] if (l, h, p) not in gone], dtype=np.int64) for h in range(Hkv)]
            for l in range(L)]


def kvzip_kept(scores, ratio, n_sink=4, layerwise=False):
    """KVzip's eviction of scores [L, Hkv, n]: the int(numel ratio) lowest over everything (layerwise: of
    each layer) go, the first n_sink rows of every head ranked above all; kept[l][h] sorted rows."""
    s = scores.copy()
    s[..., :n_sink] = s.max() + 1
    L, Hkv, n = s.shape
    pruned = np.zeros(s.shape, dtype=bool)
    for part in (range(L) if layerwise else [None]):
        flat = (s[part] if layerwise else s).ravel()
        idx = np.argsort(flat, kind="stable")[:int(flat.size * ratio)]
        (pruned[part] if layerwise else pruned).ravel()[idx] = True
    return [[np.flatnonzero(~pruned[l, h]) for h in range(Hkv)] for l in range(L)]


def gaussian_sketch(seed, layer, count):
    """LeverageScore's sketch of a layer (docs/METHODS.md): splitmix64 from seed + (layer + 1) 0x9E37..15,
    Box-Muller pairs; float32 [count]."""
    M = (1 << 64) - 1
    s = (seed + (layer + 1) * 0x9E3779B97F4A7C15) & M

    def nxt():
        nonlocal s
        s = (s + 0x9E3779B97F4A7C15) & M
        z = s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        return z ^ (z >> 31)

    out = np.empty(count, dtype=np.float32)
    for i in range(0, count, 2):
        u1 = ((nxt() >> 11) + 1) * 2.0 ** -53
        u2 = (nxt() >> 11) * 2.0 ** -53
        r = np.sqrt(-2.0 * np.log(u1))
        out[i] = r * np.cos(2 * np.pi * u2)
        if i + 1 < count:
            out[i + 1] = r * np.sin(2 * np.pi * u2)
    return out


def leverage_scores(K_pre, phi):
    """LeverageScore: K_pre [Hkv, n, d] pre-RoPE keys, phi [Hkv, d, k] the sketch (already / sqrt(k)):
    X = (K - mean) phi; score = X_r (X^T X + j I)^-1 X_r^T >= 0 (j = 1e-2, x10 until positive definite);
    z-scored over every head and row (unbiased std, at least 1e-6). [Hkv, n]"""
    out = []
    for h in range(K_pre.shape[0]):
        X = (K_pre[h] - K_pre[h].mean(axis=0)) @ phi[h].astype(np.float64)
        G = X.T @ X
        for t in range(5):
            A = G + 1e-2 * 10 ** t * np.eye(G.shape[0])
            if np.all(np.linalg.eigvalsh(A) > 0):
                break
        out.append(np.maximum((X * np.linalg.solve(A, X.T).T).sum(-1), 0))
    s = np.stack(out)
    return (s - s.mean()) / max(s.std(ddof=1), 1e-6)


def cur_scores(K, V, n_sink=4, kind="kv_product", G=None, window=16):
    """CurDKV (kvpress's CURPress) on K, V [Hkv, n, d] (post-RoPE keys as cached): squared row norms (of K G
    and V G with a sketch G [d, r]); with a window, each divided by its block's sum (blocks of `window` rows
    from row 0); combined per kind, normalised over the rows; the first n_sink rows score 1. [Hkv, n]"""
    if G is not None:
        K, V = K @ G, V @ G
    k2, v2 = (K ** 2).sum(-1), (V ** 2).sum(-1)
    if window:
        n = k2.shape[1]
        for x in (k2, v2):
            for b in range(0, n, window):
                x[:, b:b + window] /= x[:, b:b + window].sum(axis=1, keepdims=True)
    s = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[kind]
    s = s / s.sum(axis=1, keepdims=True)
    s[:, :n_sink] = 1.0
    return s


def compactor_scores(q, K_pre, K, V, phi, blending, start=8, end=4, chunk=256):
    """Compactor: between the first `start` and last `end` rows, blending x leverage_scores(K_pre, phi) +
    non_causal_attn_scores, both over those rows only; the sink rows get the maximum. q [n, H, d], K_pre, K, V
    [Hkv, n, d]. [Hkv, n]"""
    n = K.shape[1]
    a = min(start, n)
    b = n - min(end, max(0, n - a))
    mid = blending * leverage_scores(K_pre[:, a:b], phi) + non_causal_attn_scores(q[a:b], K[:, a:b], V[:, a:b], chunk)
    out = np.full((K.shape[0], n), mid.max())
    out[:, a:b] = mid
    return out


def chunk_press(score, K, V, chunk, ratio):
    """kvpress ChunkPress: score(K_c, V_c) [Hkv, rows] on each chunk of `chunk` rows alone; each chunk keeps its
    top max(1, int(rows (1 - ratio))) (higher score, then lower row). -> scores [Hkv, n], kept rows per head."""
    Hkv, n, _ = K.shape
    scores = np.zeros((Hkv, n))
    kept = [[] for _ in range(Hkv)]
    for i in range(0, n, chunk):
        s = score(K[:, i:i + chunk], V[:, i:i + chunk])
        rows = s.shape[1]
        k = max(1, int(rows * (1 - ratio)))
        scores[:, i:i + rows] = s
        for h in range(Hkv):
            order = sorted(range(rows), key=lambda r: (-s[h, r], r))[:k]
            kept[h].extend(i + r for r in sorted(order))
    return scores, [np.array(k, np.int64) for k in kept]


def finch_scores(q, K, w, normalize=True):
    """FinchPress: window query j (row n - w + j, the last w of q) takes its softmax over rows <= n - w + j, times
    n - w + j when normalize; mean over the window, then over the KV head's query heads; window rows max + 1."""
    Hkv, n, d = K.shape
    H = q.shape[1]
    g, past = H // Hkv, n - w
    out = np.zeros((Hkv, n))
    for h in range(Hkv):
        for hq in range(h * g, (h + 1) * g):
            for j in range(w):
                logits = K[h, :past + j + 1] @ q[q.shape[0] - w + j, hq] / np.sqrt(d)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[h, :past] += p[:past] * ((past + j) if normalize else 1.0)
    out[:, :past] /= w * g
    out[:, past:] = out[:, :past].max() + 1
    return out


def simlayerkv_keep(q, K, threshold, n_last=1, n_recent=1024, n_initial=4):
    """SimLayerKV on one layer: -> (the layer's attention mass on sinks + recent rows, kept rows [0, n) per head).
    Mass = mean over query heads and the last n_last queries of their softmax weights on rows [0, n_initial) and
    [n - n_last - n_recent, n - n_last); lazy when above threshold: keep [0, n_initial) and the last n_recent - n_last."""
    Hkv, n, _ = K.shape
    if threshold == 1.0 or n <= n_initial + n_recent + n_last:
        return None, [np.arange(n)] * Hkv
    att = finch_scores(q, K, n_last, normalize=False)[:, :n - n_last]
    mass = (att[:, :n_initial].sum(1) + att[:, -n_recent:].sum(1)).mean()
    rows = np.arange(n)
    if mass > threshold:
        rows = rows[(rows < n_initial) | (rows >= n - (n_recent - n_last))]
    return mass, [rows] * Hkv


def entropy_gated_chunk_keep(scores, chunk, low, budget):
    """EntropyGatedChunkKV's kept rows (one set for every head) from per-head scores [Hkv, n], in float64."""
    s = np.asarray(scores, np.float64).sum(0)
    n = len(s)
    bounds = [(i, min(i + chunk, n)) for i in range(0, n, chunk)]

    def entropy(x):
        if len(x) == 1:
            return 0.0
        x = x - min(x.min(), 0.0)
        p = x / (x.sum() + 1e-8)
        return float(np.clip(-(p * np.log(p + 1e-8)).sum() / np.log(len(x)), 0.0, 1.0))
    cs = np.array([s[a:b].mean() for a, b in bounds])
    ce = np.array([entropy(s[a:b]) for a, b in bounds])
    smed, emed = np.sort(cs)[(len(cs) - 1) // 2], np.sort(ce)[(len(ce) - 1) // 2]  # torch.median: the lower middle
    keep = np.zeros(n, bool)
    for i in sorted(range(len(bounds)), key=lambda i: (-cs[i], i)):
        if budget <= 0:
            break
        a, b = bounds[i]
        k = min(b - a, budget)
        if cs[i] >= smed and ce[i] < emed:
            k = min(k, low)
        top = sorted(range(a, b), key=lambda r: (-s[r], r))[:k]
        keep[top] = True
        budget -= k
    if budget > 0:
        rest = [r for r in range(n) if not keep[r]]
        keep[sorted(rest, key=lambda r: (-s[r], r))[:budget]] = True
    return np.flatnonzero(keep)


def cap_scores(q, K, V, n_sink=4, n_future=512, tau=5.0, epsilon=1e-6, theta=10000.0):
    """CapPress (CAPKV): q [n, H, d] this call's queries (post-RoPE, the last n rows of K), K, V [Hkv, length, d]."""
    n, H, d = q.shape
    Hkv, length, _ = K.shape
    g, past = H // Hkv, length - n
    u = np.stack([np.einsum("ij,hj->hi", rope_matrix(past + i, d, theta).T, q[i]) for i in range(n_sink, n)])
    Rbar = np.mean([rope_matrix(t, d, theta) for t in range(length, length + n_future)], axis=0)
    anchor = u.mean(0) @ Rbar.T                                      # [H, d]
    out = np.zeros((Hkv, length))
    for h in range(Hkv):
        k, v = K[h, n_sink:], V[h, n_sink:]
        kn = k / np.maximum(np.linalg.norm(k, axis=1, keepdims=True), 1e-12)
        for hq in range(h * g, (h + 1) * g):
            a = anchor[hq] / max(np.linalg.norm(anchor[hq]), 1e-12)
            logit = tau * np.clip(kn @ a, -1, 1)
            w = np.exp(logit - logit.max())
            A = np.eye(d) + np.einsum("t,ti,tj->ij", w + epsilon, v, v)
            lev = np.einsum("ti,ti->t", v, np.linalg.solve(A, v.T).T)
            out[h, n_sink:] += w * lev / g
    out[:, :n_sink] = out[:, n_sink:].max() + 1
    return out
