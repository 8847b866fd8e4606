"""Float64 NumPy references of the presses whose data comes from a model hub (docs/METHODS.md, "Presses with hub
files"): ExpectedAttention from given query statistics, LU-KV's head counts and selection, Fast KVzip's gates
and its global eviction. Written from kvpress 0.5.5's semantics as METHODS.md states them. RoPE: half-split
pairs (Hugging Face) with the model's inverse frequencies inv_freq [d/2]."""
from __future__ import annotations

import numpy as np


def avg_rope(inv_freq, first, count):
    """RoPE's rotation averaged over positions first .. first + count - 1 (half-split pairs): [d, d]."""
    h = len(inv_freq)
    ang = np.arange(first, first + count, dtype=np.float64)[:, None] * inv_freq[None, :]
    c, s = np.cos(ang).mean(0), np.sin(ang).mean(0)
    R = np.zeros((2 * h, 2 * h))
    i = np.arange(h)
    R[i, i], R[i + h, i + h], R[i, i + h], R[i + h, i] = c, c, -s, s
    return R


def expected_attention_given(K, V, mu, cov, inv_freq, n_future=512, n_sink=4, use_covariance=True, use_vnorm=True,
                             epsilon=0.0):
    """ExpectedAttention's scores [Hkv, n] of one layer's cache K, V [Hkv, n, d] (after RoPE) from a given pre-RoPE
    query mean mu [H, d] and covariance cov [H, d, d]: both rotated by RoPE averaged over the n_future positions
    after the n rows; softmax over the rows after the sinks of k.mu/sqrt(d) + k^T cov k / 2d, group mean, times
    ||v|| (+ epsilon first); sinks the layer's maximum + 1."""
    Hkv, n, d = K.shape
    H = mu.shape[0]
    g = H // Hkv
    R = avg_rope(inv_freq, n, n_future)
    m, C = mu @ R.T, R @ cov @ R.T
    out = np.zeros((Hkv, n))
    for h in range(Hkv):
        k = K[h, n_sink:]
        acc = np.zeros(n - n_sink)
        for hq in range(h * g, (h + 1) * g):
            logit = k @ m[hq] / np.sqrt(d)
            if use_covariance:
                logit = logit + np.einsum("ri,ij,rj->r", k, C[hq], k) / d / 2
            e = np.exp(logit - logit.max())
            acc += e / e.sum() / g
        if use_vnorm:
            acc = (acc + epsilon) * np.linalg.norm(V[h, n_sink:], axis=-1)
        out[h, n_sink:] = acc
    out[:, :n_sink] = out[:, n_sink:].max() + 1
    return out


def lukv_counts(prune, n):
    """LU-KV's rows kept per head of n rows from the heads' prune fractions (kvpress's float32 arithmetic):
    floors of the ideal counts, the rounded total's rest to the largest fractions (ties: the lower head), in [1, n]."""
    prune = np.asarray(prune, np.float32)
    Hkv = len(prune)
    ideal = np.clip(np.float32(1) - prune, 0, 1).astype(np.float32) * np.float32(n)
    total = int(np.round(np.float32(ideal.sum(dtype=np.float32))))
    total = max(Hkv, min(Hkv * n, total))
    base = np.floor(ideal).astype(np.int64)
    rest = total - int(base.sum())
    if rest > 0:
        frac = ideal - np.floor(ideal)
        base[np.argsort(-frac, kind="stable")[:min(rest, Hkv)]] += 1
    return np.clip(base, 1, n)


def lukv_protect(scores, sink, window):
    """The first sink and last window rows of every head set to the layer's maximum + 1 (in float32)."""
    s = np.array(scores, dtype=np.float64)
    n = s.shape[1]
    top = float(np.float32(s.max() + 1))
    s[:, :min(sink, n)] = top
    if window > 0:
        s[:, max(0, n - window):] = top
    return s


def lukv_keep(scores, prune, sink, window):
    """Kept rows per head: each head's top counts[h] (stable, descending) of the protected scores."""
    s = lukv_protect(scores, sink, window)
    counts = lukv_counts(prune, s.shape[1])
    return [set(np.argsort(-s[h], kind="stable")[:counts[h]].tolist()) for h in range(s.shape[0])], s


def rms_norm(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def fastkvzip_scores(xn, gate, n_sink=4, window_size=4096, window_ratio=0.02):
    """Fast KVzip's scores [Hkv, n] of one layer from its normed input xn [n, D] and the layer's gate tensors."""
    n = xn.shape[0]
    od = gate["q_norm.weight"].shape[0]
    Hkv, _, nb, _ = gate["k_base"].shape
    G = gate["b"].shape[-1]
    W = {k: np.asarray(v, np.float64) for k, v in gate.items()}
    q = (xn @ W["q_proj.weight"].T + W["q_proj.bias"]).reshape(n, Hkv, G, od)
    k = (xn @ W["k_proj.weight"].T).reshape(n, Hkv, 1, od)
    q, k = rms_norm(q, W["q_norm.weight"]), rms_norm(k, W["k_norm.weight"])
    logit = (k * q).sum(-1) / np.sqrt(od) + W["b"][:, 0][None]                # [n, Hkv, G]
    base = np.einsum("hsi,nhgi->nhsg", W["k_base"][:, 0], q) / np.sqrt(od)     # [n, Hkv, nb, G]
    score = (1 / (1 + np.exp(base - logit[:, :, None, :]).sum(2))).mean(-1).T  # [Hkv, n]
    w = max(1, int(n * window_ratio)) if n < 32000 else window_size
    score[:, :n_sink] = 1.0
    score[:, max(0, n - w):] = 1.0
    return score


def lowest_evicted(scores, ratio, layerwise=False):
    """Kept rows [L][Hkv] after the int(numel ratio) lowest of scores [L, Hkv, n] go (ties: the lower index
    first), over everything or, with layerwise, int(Hkv n ratio) in each layer."""
    s = np.asarray(scores, np.float64)
    L, Hkv, n = s.shape
    gone = np.zeros(s.shape, dtype=bool)
    parts = [(slice(l, l + 1),) for l in range(L)] if layerwise else [(slice(None),)]
    for part in parts:
        blk = s[part]
        k = int(blk.size * ratio)
        flat = np.zeros(blk.size, dtype=bool)
        flat[np.argsort(blk, axis=None, kind="stable")[:k]] = True
        gone[part] = flat.reshape(blk.shape)
    return [[set(np.flatnonzero(~gone[l, h]).tolist()) for h in range(Hkv)] for l in range(L)]
