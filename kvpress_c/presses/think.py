from __future__ import annotations

from dataclasses import dataclass

from .base import BasePress, check_int, check_number


@dataclass
class ThinKPress(BasePress):
    """ThinK (Xu et al., 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning"), as kvpress's ThinKPress:
    per KV head, the `key_channel_compression_ratio` fraction of key channels with the lowest score
    (mean over the last `window_size` queries of q^2, averaged over the GQA group, times the mean over the
    cached rows of k^2) is dropped from every row cached at compression (later rows keep every channel).
    kvpress zeroes those channels (the cache does not shrink); here, with `free_channels` (the default),
    the pruned keys are stored with the kept channels only and the memory is freed, with the same
    attention (the query is gathered to the kept channels); `free_channels=False` zeroes them as kvpress
    does. Combine with a token press: ComposedPress([SnapKVPress(0.5), ThinKPress(0.5)])."""
    key_channel_compression_ratio: float = 0.0
    window_size: int = 32
    free_channels: bool = True  # kvpress_c: store the kept channels only (False: zero them, as kvpress)

    def __post_init__(self):
        check_number("key_channel_compression_ratio", self.key_channel_compression_ratio)
        if not 0 <= self.key_channel_compression_ratio < 1:
            raise ValueError(f"key_channel_compression_ratio must be in [0, 1), got {self.key_channel_compression_ratio!r}")
        check_int("window_size", self.window_size, minimum=1)
        if not isinstance(self.free_channels, bool):
            raise TypeError(f"free_channels must be a bool, got {self.free_channels!r}")

    @property
    def compression_ratio(self) -> float:
        return self.key_channel_compression_ratio / 2  # kvpress: half of the cache is keys

    @property
    def is_noop(self) -> bool:
        return self.key_channel_compression_ratio == 0

    def c_config(self) -> dict:  # no token eviction of its own
        return {"scorer": "knorm", "allocation": "uniform", "compression_ratio": 0.0, "budget": 0,
                "window": 0, "kernel": 1}

    def before_prefill(self, session, n: int, config: dict) -> None:
        session.set_press_array("key_channel_ratio", float(self.key_channel_compression_ratio))
        session.set_press_array("channel_window", int(self.window_size))
        session.set_press_array("channel_free", int(bool(self.free_channels)))
