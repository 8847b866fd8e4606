from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress, check_int, check_number


@dataclass
class ExpectedAttentionPress(ScorerPress):
    """Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by Estimating
    Attention from Future Queries Distribution"): the prompt's queries (after the first `n_sink`, RoPE
    undone) give a mean and covariance; RoPE averaged over the next `n_future_positions` positions rotates
    them; a key's score is the softmax over the rows of k.mu / sqrt(d) (+ k^T Cov k / 2d with
    `use_covariance`), averaged over the GQA group, then (score + `epsilon`) * ||v|| with `use_vnorm`.
    The first `n_sink` rows are always kept."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    scorer = "expected_attention"

    def check_types(self) -> None:
        super().check_types()
        check_int("n_future_positions", self.n_future_positions)
        check_int("n_sink", self.n_sink)
        check_number("epsilon", self.epsilon)

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg.update(n_sink=self.n_sink, n_future=self.n_future_positions, use_covariance=int(bool(self.use_covariance)),
                   use_vnorm=int(bool(self.use_vnorm)), epsilon=float(self.epsilon))
        return cfg
