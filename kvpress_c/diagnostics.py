"""Diagnostics every method exposes (docs/METHODS.md): kept-set similarity and hit rates."""
from __future__ import annotations

import numpy as np


def jaccard(a, b) -> float:
    a, b = set(np.asarray(a).tolist()), set(np.asarray(b).tolist())
    return 1.0 if not a and not b else len(a & b) / len(a | b)


def adjacent_layer_jaccard(kept_indices) -> list[float]:
    """Mean over KV heads of the Jaccard similarity of kept sets of layers l and l + 1."""
    out = []
    for l in range(len(kept_indices) - 1):
        heads = range(len(kept_indices[l]))
        out.append(float(np.mean([jaccard(kept_indices[l][h], kept_indices[l + 1][h]) for h in heads])))
    return out


def critical_kv_hit_rate(kept_indices, oracle_indices) -> float:
    """Judge Q's metric: |kept ∩ oracle| / |oracle|, averaged over layers and KV heads."""
    rates = []
    for kl, ol in zip(kept_indices, oracle_indices):
        for k, o in zip(kl, ol):
            o = set(np.asarray(o).tolist())
            if o:
                rates.append(len(o & set(np.asarray(k).tolist())) / len(o))
    return float(np.mean(rates)) if rates else float("nan")
