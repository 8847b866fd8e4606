from __future__ import annotations

from dataclasses import dataclass

from .base import ScorerPress, c_check, check_int, WrapperPress


@dataclass
class ChunkKVPress(WrapperPress):
    """ChunkKV (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
    Long-Context LLM Inference"): the inner press's scores summed over the layer's KV heads, averaged
    per chunk of `chunk_length` tokens; whole chunks are kept (one selection shared by the heads).
    Layer-wise index reuse: in groups of `reuse_layers` consecutive layers, the first scores and
    selects and the others reuse its indices without scoring (1 = off).

    Budget: with compression_ratio, max(1, int(n_chunks * (1 - cr))) chunks over the whole prompt
    (kvpress ChunkKVPress); with budget B, floor((B - w) / c) chunks of the past plus the window.
    """
    press: ScorerPress = None
    chunk_length: int = 20  # kvpress's default; the ChunkKV paper's experiments (and our eval presets) use 10
    reuse_layers: int = 1

    def __post_init__(self):
        from .adakv import AdaKVPress
        if isinstance(self.press, AdaKVPress):
            raise ValueError("ChunkKVPress(AdaKVPress(...)) does not combine: ChunkKV shares one chunk selection across "
                             "a layer's heads while Ada-KV gives each head its own budget. Use ChunkKVPress(SnapKVPress(...)).")
        if not isinstance(self.press, ScorerPress):
            raise ValueError("ChunkKVPress wraps a scorer press, e.g. ChunkKVPress(SnapKVPress(compression_ratio=0.5))")
        check_int("chunk_length", self.chunk_length, minimum=1)  # 0 would mean "no chunks" in C
        check_int("reuse_layers", self.reuse_layers, minimum=1)
        c_check(self.c_config())

    def c_config(self) -> dict:
        cfg = self.press.c_config()
        cfg.update(chunk_length=self.chunk_length, reuse_layers=self.reuse_layers)
        return cfg
