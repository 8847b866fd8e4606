"""Float64 NumPy references of KVgrad (docs/METHODS.md "KVgrad") on NpLlama: the reconstruction rows' forward on
a copy of the context's cache, Phi = sum ||h^L||^2, its gradient with respect to the residual after a layer's
attention by central finite differences, and the scores from given gradient norms."""
from __future__ import annotations

import copy

import numpy as np


def context_cache(ref, ids):
    cache = ref.empty_cache()
    ref.forward(ref.embed(ids), np.arange(len(ids)), cache)
    return cache


def phi(ref, cache, rep_ids, perturb=None, position=None):
    """Phi of the reconstruction rows after the context (cache untouched; `position` where they start: the context's
    length, or the session's position over a compressed cache); perturb = (layer, row, delta [D]) is added to that
    row's residual right after that layer's attention."""
    n_ctx = cache[0][0]["k"].shape[0] if position is None else position

    def hook(l, q, attn, o, resid, past, cache_):
        if perturb is not None and l == perturb[0]:
            o[perturb[1]] += perturb[2]

    h = ref.forward(ref.embed(rep_ids), n_ctx + np.arange(len(rep_ids)), copy.deepcopy(cache), hook)
    return float(np.sum(h * h))


def fd_residual_gradient(ref, cache, rep_ids, layer, row, step=1e-4, position=None):
    """dPhi / da_row^layer [D] by central differences."""
    g = np.zeros(ref.D)
    for j in range(ref.D):
        e = np.zeros(ref.D)
        e[j] = step
        g[j] = (phi(ref, cache, rep_ids, (layer, row, e), position) -
                phi(ref, cache, rep_ids, (layer, row, -e), position)) / (2 * step)
    return g


def kvgrad_scores(ref, cache, rep_ids, start, end, n_sink, grad_norms, position=None):
    """[L, Hkv, end - start]: max over the rows p and the group's query heads of A[p, c] ||v_c W_o[hq]|| g[l, p],
    A the rows' softmax over the sinks, the chunk and the causal rows; grad_norms [L, m]. The cache may hold any rows
    (compressed: heads ragged, `position` the next one): a head's sinks are its rows at positions < min(n_sink,
    start), its chunk its rows at positions in [start, end) (scores by position - start, 0 where it holds none)."""
    n_ctx = cache[0][0]["k"].shape[0] if position is None else position
    m = len(rep_ids)
    g, sink = ref.H // ref.Hkv, min(n_sink, start)
    out = np.zeros((ref.L, ref.Hkv, end - start))

    def hook(l, q, attn, o, resid, past, cache_):
        wo = ref.W(f"model.layers.{l}.self_attn.o_proj.weight")
        for hq in range(ref.H):
            K, V, pos = cache_[l][hq // g]["k"], cache_[l][hq // g]["v"], cache_[l][hq // g]["pos"]
            held = pos[:len(pos) - m]
            sinks, chunk = np.flatnonzero(held < sink), np.flatnonzero((held >= start) & (held < end))
            keys = np.concatenate([K[sinks], K[chunk], K[len(held):]])
            s = q[:, hq] @ keys.T / np.sqrt(ref.d)
            cols = np.arange(keys.shape[0])[None, :]
            s = np.where(cols < len(sinks) + len(chunk) + np.arange(m)[:, None] + 1, s, -np.inf)
            a = np.exp(s - s.max(axis=1, keepdims=True))
            a = (a / a.sum(axis=1, keepdims=True))[:, len(sinks):len(sinks) + len(chunk)]
            wov = np.linalg.norm(V[chunk] @ wo[:, hq * ref.d:(hq + 1) * ref.d].T, axis=1)
            sc = (a * wov[None, :] * grad_norms[l][:, None]).max(axis=0)
            at = held[chunk] - start
            out[l, hq // g, at] = np.maximum(out[l, hq // g, at], sc)

    ref.forward(ref.embed(rep_ids), n_ctx + np.arange(m), copy.deepcopy(cache), hook)
    return out
