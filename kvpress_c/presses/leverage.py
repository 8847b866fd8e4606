from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress, check_int


@dataclass
class LeverageScorePress(ScorerPress):
    """Approximate leverage scores of the pre-RoPE keys (Chari & Van Durme, 2025, "Compactor: Calibrated
    Query-Agnostic KV Cache Compression with Approximate Leverage Scores"; kvpress's LeverageScorePress):
    per KV head, the centred keys times a Gaussian sketch [d, sketch_dimension] / sqrt(sketch_dimension)
    give X; a row's score is X_r (X^T X + jI)^-1 X_r^T (Cholesky, jitter 1e-2 raised 10x on failure),
    clamped at 0, z-scored over the layer. A prefill only.

    `seed` (ours): kvpress draws the sketch from torch's global generator; kvpress_c draws each layer's from
    `seed` with the generator documented in docs/METHODS.md (the same seed gives the same sketch anywhere)."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    sketch_dimension: int = 48
    seed: int = 0

    scorer = "leverage"

    def check_types(self) -> None:
        super().check_types()
        check_int("sketch_dimension", self.sketch_dimension)
        check_int("seed", self.seed, 0)

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg["sketch_dim"] = self.sketch_dimension
        cfg["seed"] = self.seed
        return cfg
