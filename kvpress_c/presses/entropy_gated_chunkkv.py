from __future__ import annotations

from dataclasses import dataclass

from .base import c_check, check_int
from .chunkkv import ChunkKVPress


@dataclass
class EntropyGatedChunkKVPress(ChunkKVPress):
    """kvpress EntropyGatedChunkKVPress, an extension of ChunkKV (Liu et al., 2025, "ChunkKV: Semantic-Preserving
    KV Cache Compression for Efficient Long-Context LLM Inference"): chunks of `chunk_length` tokens ranked by their
    mean score (the inner press's scores summed over the layer's KV heads) fill a budget of
    max(1, int(n * (1 - compression_ratio))) tokens; a chunk scoring at or above the median chunk but whose token
    scores have below-median normalised entropy (one token carries it) keeps only its top
    `low_entropy_chunk_length` tokens, and what that saves goes to further chunks, then to the best remaining
    tokens. One selection shared by the layer's heads. Exact rule: docs/METHODS.md."""
    chunk_length: int = 10
    low_entropy_chunk_length: int = 4

    def __post_init__(self):
        check_int("low_entropy_chunk_length", self.low_entropy_chunk_length, minimum=1)
        super().__post_init__()

    def c_config(self) -> dict:
        cfg = super().c_config()
        cfg.update(low_entropy_chunk=self.low_entropy_chunk_length)
        return cfg
