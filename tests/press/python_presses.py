"""Python re-implementations of C presses, written from docs/METHODS.md in float64 NumPy as a user would write
them (ScorerPress subclasses defining score(layer)): the tests run them inside the engine and compare the rows
they keep with the C presses'. Each records the scores it returned per layer (the last call) for tie checks."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpress_c import ScorerPress


def _softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


@dataclass
class Recording(ScorerPress):
    recorded: dict = field(default_factory=dict, repr=False, compare=False)

    def score(self, layer):
        s = self.scores(layer)
        self.recorded[layer.index] = (layer.lengths.copy(), s.copy())
        return s


@dataclass
class PyKnorm(Recording):
    def scores(self, layer):
        return -np.linalg.norm(layer.keys.astype(np.float64), axis=-1)


@dataclass
class PyKeyDiff(Recording):
    def scores(self, layer):
        out = np.zeros(layer.keys.shape[:2])
        for h, n in enumerate(layer.lengths):
            k = layer.keys[h, :n].astype(np.float64)
            norms = np.linalg.norm(k, axis=-1)
            anchor = (k / np.maximum(norms, 1e-12)[:, None]).mean(0)
            out[h, :n] = -(k @ anchor) / np.maximum(norms * np.linalg.norm(anchor), 1e-8)
        return out


@dataclass
class PyTOVA(Recording):
    """The last query's attention, averaged over every query head of the layer (heads hold the same rows); the
    last row kept (a window of 1)."""
    window_size = 1
    protect_window = True
    reads = ("queries",)

    def scores(self, layer):
        q = layer.queries[:, -1].astype(np.float64)                       # [H, d]
        k = np.repeat(layer.keys.astype(np.float64), layer.group_size, 0)  # [H, n, d]
        p = _softmax(np.einsum("hd,hnd->hn", q, k) / np.sqrt(layer.head_dim))
        return np.tile(p.mean(0), (layer.n_kv_heads, 1))


@dataclass
class PySnapKV(Recording):
    """The window's queries over every row (causal inside the window), mean over the window, average pooling
    (kernel 5, padding counted), mean over the group; the window protected (it scores, it is kept)."""
    window_size: int = 16
    protect_window = True
    reads = ("queries",)

    def scores(self, layer):
        w, g, kernel = layer.window, layer.group_size, 5
        out = np.zeros(layer.keys.shape[:2])
        for h, n in enumerate(layer.lengths):
            q = layer.queries[h * g:(h + 1) * g].astype(np.float64)      # [g, w, d]
            logits = q @ layer.keys[h, :n].astype(np.float64).T / np.sqrt(layer.head_dim)
            logits[:, np.arange(w)[:, None] < np.arange(n)[None, :] - (n - w)] = -np.inf
            a = _softmax(logits).mean(1)[:, :n - w]                       # [g, n - w]
            padded = np.pad(a, ((0, 0), (kernel // 2, kernel // 2)))
            pooled = np.stack([padded[:, i:i + n - w] for i in range(kernel)]).sum(0) / kernel
            out[h, :n - w] = pooled.mean(0)
        return out


def _rope_pairs(d, pairing):
    j = np.arange(d // 2)
    return (j, j + d // 2) if pairing == "half" else (2 * j, 2 * j + 1)


@dataclass
class PyExpectedAttention(Recording):
    """The call's queries after the first n_sink, RoPE undone: mean mu and biased covariance S per query head;
    R = RoPE averaged over the n_future positions after the call; rows r >= n_sink score the softmax over them
    of k.R mu / sqrt(d) + k^T R S R^T k / 2d, mean over the group, times ||v||; the sinks the layer's max + 1."""
    rope_theta: float = 500000.0
    rope_pairing: str = "half"
    n_sink: int = 4
    n_future: int = 512
    reads = ("all_queries", "values")

    def scores(self, layer):
        d, g, ns = layer.head_dim, layer.group_size, self.n_sink
        a, b = _rope_pairs(d, self.rope_pairing)
        freq = self.rope_theta ** (-2.0 * np.arange(d // 2) / d)
        q = layer.queries.astype(np.float64)                             # [H, n, d] after RoPE, the call's
        if q.shape[1] <= ns:
            raise ValueError(f"ExpectedAttention needs more queries in the call ({q.shape[1]}) than n_sink ({ns})")
        ang = layer.positions[:, None] * freq                            # [n, d/2]
        pre = q.copy()                                                   # RoPE undone: rotate by -angle
        pre[..., a] = np.cos(ang) * q[..., a] + np.sin(ang) * q[..., b]
        pre[..., b] = -np.sin(ang) * q[..., a] + np.cos(ang) * q[..., b]
        pre = pre[:, ns:]
        mu = pre.mean(1)                                                 # [H, d]
        cov = np.einsum("hni,hnj->hij", pre - mu[:, None], pre - mu[:, None]) / pre.shape[1]
        fut = (layer.future_from + np.arange(self.n_future))[:, None] * freq
        R = np.zeros((d, d))
        R[a, a], R[a, b], R[b, a], R[b, b] = np.cos(fut).mean(0), -np.sin(fut).mean(0), np.sin(fut).mean(0), np.cos(fut).mean(0)
        mu, cov = mu @ R.T, R @ cov @ R.T
        out = np.zeros(layer.keys.shape[:2])
        for h, n in enumerate(layer.lengths):
            k = layer.keys[h, ns:n].astype(np.float64)
            acc = 0
            for hq in range(h * g, (h + 1) * g):
                acc = acc + _softmax(k @ mu[hq] / np.sqrt(d) + np.einsum("ri,ij,rj->r", k, cov[hq], k) / (2 * d)) / g
            out[h, ns:n] = acc * np.linalg.norm(layer.values[h, ns:n].astype(np.float64), axis=-1)
        out[:, :ns] = max(out[h, ns:n].max() for h, n in enumerate(layer.lengths)) + 1
        return out


PRESSES = {"knorm": PyKnorm, "keydiff": PyKeyDiff, "tova": PyTOVA, "snapkv": PySnapKV,
           "expected_attention": PyExpectedAttention}
