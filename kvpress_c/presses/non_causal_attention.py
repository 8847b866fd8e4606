from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import ScorerPress, check_int


@dataclass
class NonCausalAttnPress(ScorerPress):
    """Non-causal chunked attention, the attention term of Compactor (Chari & Van Durme, 2025,
    "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores"): inside
    chunks of `chunk_size` rows every query attends to every key (no causal mask, logits unscaled); a
    key's attention summed over its chunk's queries, averaged over the GQA group, times ||v||, averaged
    over 3 neighbouring rows and z-normalised over the layer. A prefill only (no past in the cache)."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    chunk_size: int = 256

    scorer = "non_causal_attn"

    def check_types(self) -> None:
        super().check_types()
        check_int("chunk_size", self.chunk_size)

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg["attn_chunk"] = self.chunk_size
        return cfg
