from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import SCORERS, ScorerPress


@dataclass
class StreamingLLMPress(ScorerPress):
    """StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks"):
    keep the first `n_sink` tokens and the most recent ones."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    n_sink: int = 4

    scorer = "streaming"

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise ValueError(f"n_sink must be an integer >= 0, got {self.n_sink!r}")

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg["n_sink"] = self.n_sink
        return cfg
