from __future__ import annotations

from dataclasses import dataclass

from .base import SAFEGUARDS, ScorerPress, c_check, check_number, WrapperPress


@dataclass
class AdaKVPress(WrapperPress):
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
        check_number("alpha_safeguard", self.alpha_safeguard)
        if self.safeguard not in SAFEGUARDS:
            raise ValueError(f"safeguard must be 'protect' (kvpress) or 'floor' (Ada-KV code), got {self.safeguard!r}")
        c_check(self.c_config())

    def c_config(self) -> dict:
        cfg = self.press.c_config()
        cfg.update(allocation="adakv", alpha_safeguard=float(self.alpha_safeguard),
                   safeguard=self.safeguard)
        return cfg
