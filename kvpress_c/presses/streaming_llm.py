from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress, check_int


@dataclass
class StreamingLLMPress(ScorerPress):
    """StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks"):
    keep the first `n_sink` tokens and the most recent ones."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    n_sink: int = 4

    scorer = "streaming"

    def check_types(self) -> None:
        super().check_types()
        check_int("n_sink", self.n_sink)

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg["n_sink"] = self.n_sink
        return cfg
