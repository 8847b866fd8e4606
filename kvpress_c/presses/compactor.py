from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress, check_int, check_number

DEFAULT_BLENDING = 0.35  # with budget= (no compression_ratio to blend by); kvpress's fallback value


@dataclass
class CompactorPress(ScorerPress):
    """Compactor (Chari & Van Durme, 2025, "Compactor: Calibrated Query-Agnostic KV Cache Compression with
    Approximate Leverage Scores"; kvpress's CompactorPress): between the first `sink_size_start` and the last
    `sink_size_end` rows (kept: they score the layer's maximum), `blending` x LeverageScorePress's z-scores plus
    NonCausalAttnPress's, both computed over those middle rows only. `blending` None: the compression_ratio
    (kvpress's default; with budget=, 0.35). A prefill only. `seed` (ours): LeverageScore's sketch seed."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    sink_size_start: int = 8
    sink_size_end: int = 4
    chunk_size: int = 256
    sketch_dimension: int = 48
    blending: Optional[float] = None
    seed: int = 0

    scorer = "compactor"

    def check_types(self) -> None:
        super().check_types()
        for name in ("sink_size_start", "sink_size_end", "chunk_size", "sketch_dimension"):
            check_int(name, getattr(self, name))
        check_int("seed", self.seed, 0)
        if self.blending is not None:
            check_number("blending", self.blending)

    def c_config(self) -> dict:
        cfg = super().c_config()
        blend = self.blending if self.blending is not None else \
            (self.compression_ratio if self.budget is None else DEFAULT_BLENDING)
        cfg.update(cmp_sink_start=self.sink_size_start, cmp_sink_end=self.sink_size_end, attn_chunk=self.chunk_size,
                   sketch_dim=self.sketch_dimension, cmp_blend=float(blend), seed=self.seed)
        return cfg
