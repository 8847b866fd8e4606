from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress, check_int


@dataclass
class RandomPress(ScorerPress):
    """Random eviction (baseline): seeded uniform scores."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    seed: int = 0

    scorer = "random"

    def check_types(self) -> None:
        super().check_types()
        check_int("seed", self.seed, minimum=0)  # a C uint64

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg["seed"] = self.seed
        return cfg
