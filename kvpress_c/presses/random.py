from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress


@dataclass
class RandomPress(ScorerPress):
    """Random eviction (baseline): seeded uniform scores."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    seed: int = 0

    scorer = "random"

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg["seed"] = self.seed
        return cfg
