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


def phi(ref, cache, rep_ids, perturb=None):
    """Phi of the reconstruction rows after the context (cache untouched); perturb = (layer, row, delta [D]) is
    added to that row's residual right after that layer's attention."""
    n_ctx = cache[0][0]["k"].shape[0]

    def hook(l, q, attn, o, resid, past, cache_):
        if perturb is not None and l == perturb[0]:
            o[perturb[1]] += perturb[2]

    h = ref.forward(ref.embed(rep_ids), n_ctx + np.arange(len(rep_ids)), copy.deepcopy(cache), hook)
    return float(np.sum(h * h))


def fd_residual_gradient(ref, cache, rep_ids, layer, row, step=1e-4):
    """dPhi / da_row^layer [D] by central differences."""
    g = np.zeros(ref.D)
    for j in range(ref.D):
        e = np.zeros(ref.D)
        e[j] = step
        g[j] = (phi(ref, cache, rep_ids, (layer, row, e)) - phi(ref, cache, rep_ids, (layer, row, -e))) / (2 * step)
    return g


def kvgrad_scores(ref, cache, rep_ids, start, end, n_sink, grad_norms):
    """[L, Hkv, end - start]: max over the rows p and the group's query heads of A[p, c] ||v_c W_o[hq]|| g[l, p],
    A the rows' softmax over the min(n_sink, start) sinks, the chunk and the causal rows; grad_norms [L, m]."""
    n_ctx, m = cache[0][0]["k"].shape[0], len(rep_ids)
    g, sink = ref.H // ref.Hkv, min(n_sink, start)
    out = np.zeros((ref.L, ref.Hkv, end - start))

    def hook(l, q, attn, o, resid, past, cache_):
        wo = ref.W(f"model.layers.{l}.self_attn.o_proj.weight")
        for hq in range(ref.H):
            K, V = cache_[l][hq // g]["k"], cache_[l][hq // g]["v"]
            keys = np.concatenate([K[:sink], K[start:end], K[n_ctx:n_ctx + m]])
            s = q[:, hq] @ keys.T / np.sqrt(ref.d)
            cols = np.arange(keys.shape[0])[None, :]
            s = np.where(cols < sink + (end - start) + np.arange(m)[:, None] + 1, s, -np.inf)
            a = np.exp(s - s.max(axis=1, keepdims=True))
            a = (a / a.sum(axis=1, keepdims=True))[:, sink:sink + end - start]
            wov = np.linalg.norm(V[start:end] @ wo[:, hq * ref.d:(hq + 1) * ref.d].T, axis=1)
            sc = (a * wov[None, :] * grad_norms[l][:, None]).max(axis=0)
            out[l, hq // g] = np.maximum(out[l, hq // g], sc)

    ref.forward(ref.embed(rep_ids), n_ctx + np.arange(m), copy.deepcopy(cache), hook)
    return out
