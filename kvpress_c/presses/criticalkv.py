from __future__ import annotations

from dataclasses import dataclass

from .base import ScorerPress, c_check, check_number, WrapperPress


@dataclass
class CriticalKVPress(WrapperPress):
    """CriticalKV (Feng et al., 2025, "Identify Critical KV Cache in LLM Inference from an Output
    Perturbation Perspective"): a two-stage selection over the wrapped press's scores. Each head first
    keeps its top `first_stage_ratio` share of the budget by those scores, then the rest by
    (score + `epsilon`) * ||W_o v||_1 (the row's value through each query head's output projection,
    averaged over the GQA group). As kvpress advises, wrap ExpectedAttentionPress with use_vnorm=False.
    Needs a model (a session), not press_compute."""
    press: ScorerPress = None
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    allocation = "uniform"

    def __post_init__(self):
        if not isinstance(self.press, ScorerPress):
            raise ValueError(f"{type(self).__name__} wraps a scorer press, e.g. "
                             f"{type(self).__name__}(ExpectedAttentionPress(compression_ratio=0.5, use_vnorm=False))")
        check_number("epsilon", self.epsilon)
        check_number("first_stage_ratio", self.first_stage_ratio)
        c_check(self.c_config())

    def c_config(self) -> dict:
        cfg = self.press.c_config()
        cfg.update(allocation=self.allocation, critical=1, critical_eps=float(self.epsilon),
                   first_stage_ratio=float(self.first_stage_ratio))
        return cfg
