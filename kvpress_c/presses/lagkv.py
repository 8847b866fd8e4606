from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress, check_int


@dataclass
class LagKVPress(ScorerPress):
    """LagKV (Liang et al., 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are
    Important"): after `n_sink` sinks the rows go in partitions of `lag_size`; each partition's keys and
    values are min-max normalised by the next partition's range, their std over dimensions softmaxed over
    the partition, and ranked inside it (`cross_scoring` keeps the raw scores, comparable across
    partitions, e.g. under AdaKVPress). Sinks and the last partition (a reference only) are kept."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False

    scorer = "lagkv"

    def check_types(self) -> None:
        super().check_types()
        check_int("n_sink", self.n_sink)
        check_int("lag_size", self.lag_size)

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg.update(n_sink=self.n_sink, lag_size=self.lag_size, cross_scoring=int(bool(self.cross_scoring)))
        return cfg
