from __future__ import annotations

from dataclasses import dataclass

from .base import ScorerPress, c_check, check_int, WrapperPress


@dataclass
class ChunkPress(WrapperPress):
    """kvpress ChunkPress, the per-chunk selection of FINCH (Corallo & Papotti, 2024, "FINCH: Prompt-guided
    Key-Value Cache Compression for Large Language Models", TACL): the prompt's rows are cut into chunks of
    `chunk_length`; each chunk is scored alone by the inner press and keeps its own
    max(1, int(rows * (1 - compression_ratio))) rows, so the compression is spread evenly over the prompt.
    Inner presses: SnapKV and TOVA (each chunk scored by its last queries at the prompt's last positions, as
    kvpress does), Knorm, KeyDiff, LagKV, StreamingLLM, Random; the C core refuses the others
    (docs/METHODS.md, "ChunkPress")."""
    press: ScorerPress = None
    chunk_length: int = 1024

    def __post_init__(self):
        if not isinstance(self.press, ScorerPress):
            raise ValueError("ChunkPress wraps a scorer press, e.g. ChunkPress(KnormPress(compression_ratio=0.5))")
        check_int("chunk_length", self.chunk_length, minimum=1)
        c_check(self.c_config())

    def c_config(self) -> dict:
        cfg = self.press.c_config()
        cfg.update(chunk_press=self.chunk_length)
        return cfg
