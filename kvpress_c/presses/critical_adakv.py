from __future__ import annotations

from dataclasses import dataclass

from .base import ScorerPress, check_number
from .criticalkv import CriticalKVPress


@dataclass
class CriticalAdaKVPress(CriticalKVPress):
    """CriticalAdaKV (Feng et al., 2025, "Identify Critical KV Cache in LLM Inference from an Output
    Perturbation Perspective", with Ada-KV's head-wise budgets): Ada-KV (kvpress's AdaKVPress rule,
    `alpha_safeguard`) chooses each head's budget on the wrapped press's scores; then CriticalKV's two
    stages choose the rows inside each head's budget. The heads end ragged and are really evicted."""
    press: ScorerPress = None
    alpha_safeguard: float = 0.20
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    allocation = "adakv"

    def __post_init__(self):
        check_number("alpha_safeguard", self.alpha_safeguard)
        super().__post_init__()

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg.update(alpha_safeguard=float(self.alpha_safeguard), safeguard="protect")
        return cfg
