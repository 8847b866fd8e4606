from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress, check_int

LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")


@dataclass
class CURPress(ScorerPress):
    """CurDKV (arXiv 2509.15038; kvpress's CURPress): approximate leverage of keys and values by their squared
    norms. k2 = ||k||^2 and v2 = ||v||^2 (with `use_random_leverage`, of k G and v G for a [d, 20] Gaussian
    sketch G / sqrt(20)); with `use_local_approximation`, each divided by its sum over blocks of
    `local_window_size` rows; then k2, v2, their mean or (default) product per `leverage_type`, normalised over
    the head's rows; the first `num_sinks` rows score 1.

    `seed` (ours): the sketch comes from `seed` with the generator of docs/METHODS.md (LeverageScore's), not
    torch's global generator."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    num_sinks: int = 4
    leverage_type: str = "kv_product"
    use_random_leverage: bool = False
    use_local_approximation: bool = True
    local_window_size: int = 16
    seed: int = 0

    scorer = "cur"

    def check_types(self) -> None:
        super().check_types()
        check_int("num_sinks", self.num_sinks, 0)
        check_int("local_window_size", self.local_window_size, 1)
        check_int("seed", self.seed, 0)
        if self.leverage_type not in LEVERAGE_TYPES:
            raise ValueError(f"leverage_type must be one of {', '.join(map(repr, LEVERAGE_TYPES))}, "
                             f"got {self.leverage_type!r}")

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg.update(n_sink=self.num_sinks, cur_type=LEVERAGE_TYPES.index(self.leverage_type),
                   cur_random=bool(self.use_random_leverage),
                   cur_window=self.local_window_size if self.use_local_approximation else 0, seed=self.seed)
        return cfg
