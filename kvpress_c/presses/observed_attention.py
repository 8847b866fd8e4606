from __future__ import annotations

from dataclasses import dataclass

from .base import ScorerPress


@dataclass
class ObservedAttentionPress(ScorerPress):
    """ObservedAttention / H2O one-shot (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle"): each key's
    attention summed over all prompt queries, divided by the number of queries that can see it.
    Computed in tiles in C (no n x n attention matrix)."""
    scorer = "observed"
