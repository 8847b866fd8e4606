from __future__ import annotations

from dataclasses import dataclass

from .base import ALLOCATIONS, SAFEGUARDS, BasePress, ScorerPress


@dataclass
class AdaKVPress(BasePress):
    """Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
    Allocation"): head-wise budgets from one layer-wide top-k over the inner press's scores. Heads
    end with different lengths; the cache is ragged, so memory is really freed.

    safeguard "protect" = kvpress AdaKVPress (each head's top int(n_kept * alpha) protected, the rest
    chosen layer-wide); "floor" = the official Ada-KV code (cap_h = round(f_h (1 - a) + floor(Bp a))).
    """
    press: ScorerPress = None
    alpha_safeguard: float = 0.20
    safeguard: str = "protect"

    def __post_init__(self):
        if not isinstance(self.press, ScorerPress):
            raise ValueError("AdaKVPress wraps a scorer press, e.g. AdaKVPress(SnapKVPress(compression_ratio=0.5))")
        if getattr(self.press, "beta", None) is not None:
            raise ValueError("AdaKVPress allocates budgets itself: wrap SnapKVPress, not PyramidKVPress")
        if not isinstance(self.alpha_safeguard, (int, float)) or not 0 <= self.alpha_safeguard <= 1:
            raise ValueError(f"alpha_safeguard must be in [0, 1], got {self.alpha_safeguard!r}")
        if self.safeguard not in SAFEGUARDS:
            raise ValueError(f"safeguard must be 'protect' (kvpress) or 'floor' (Ada-KV code), got {self.safeguard!r}")

    @property
    def compression_ratio(self) -> float:
        return self.press.compression_ratio

    @property
    def budget(self):
        return self.press.budget

    def c_config(self) -> dict:
        cfg = self.press.c_config()
        cfg.update(allocation=ALLOCATIONS["adakv"], alpha_safeguard=float(self.alpha_safeguard),
                   safeguard=SAFEGUARDS[self.safeguard])
        return cfg
