from __future__ import annotations

from dataclasses import dataclass

from .base import ScorerPress


@dataclass
class KeyDiffPress(ScorerPress):
    """KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
    Inference in Resource-Constrained Environments"): keep the keys least similar to the anchor, the mean
    of the head's normalised keys (score -cos(k, anchor)). As in kvpress, one shot over the prompt; the
    paper's block-wise iteration is BlockPress's."""
    scorer = "keydiff"
