from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress, check_int, check_number


@dataclass
class CapPress(ScorerPress):
    """CAPKV (arXiv 2604.25975), as kvpress's CapPress: a capacity (leverage) score of each value under query-key
    alignment weights. The anchor is the mean of the prompt's queries after the first `n_sink` (RoPE undone),
    rotated by RoPE averaged over the next `n_future_positions` positions (as ExpectedAttentionPress); per query
    head, w_i = exp(tau cos(k_i, anchor)) (shifted by its maximum), A = I + sum_i (w_i + epsilon) v_i v_i^T, and
    row i scores w_i v_i^T A^-1 v_i, averaged over the GQA group. The first `n_sink` rows are always kept.
    Computed on the host in float64 (kvpress: float32)."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    tau: float = 5.0
    n_future_positions: int = 512
    n_sink: int = 4
    epsilon: float = 1e-6

    scorer = "cap"

    def check_types(self) -> None:
        super().check_types()
        check_number("tau", self.tau)
        check_int("n_future_positions", self.n_future_positions)
        check_int("n_sink", self.n_sink)
        check_number("epsilon", self.epsilon)

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg.update(n_sink=self.n_sink, n_future=self.n_future_positions, epsilon=float(self.epsilon),
                   cap_tau=float(self.tau))
        return cfg
