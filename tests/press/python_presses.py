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


PRESSES = {"knorm": PyKnorm, "keydiff": PyKeyDiff, "tova": PyTOVA, "snapkv": PySnapKV}
