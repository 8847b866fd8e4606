from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import check_int
from .snapkv import SnapKVPress


@dataclass
class PyramidKVPress(SnapKVPress):
    """PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
    Information Funneling"): SnapKV scores, layer budgets falling linearly with depth (`beta` = 20)
    around the uniform mean (kvpress's integer schedule; uniform when the schedule does not fit)."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    window_size: int = 64
    kernel_size: int = 5
    beta: int = 20

    def check_types(self) -> None:
        super().check_types()
        check_int("beta", self.beta)

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg.update(allocation="pyramid", pyramid_beta=self.beta)
        return cfg
