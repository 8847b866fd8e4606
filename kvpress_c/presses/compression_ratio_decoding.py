from __future__ import annotations

from dataclasses import dataclass, field

from .base import check_number
from .decoding import DecodingPress, base_config


@dataclass
class CompressionRatioDecodingPress(DecodingPress):
    """kvpress CompressionRatioDecodingPress: a DecodingPress whose target is a fraction of all tokens seen
    so far (prompt and generated, evicted ones included): max(1, int(seen * (1 - target_compression_ratio)))
    tokens per KV head after each compression."""
    target_compression_ratio: float = 0.5
    target_size: int = field(default=1, init=False)

    def check_types(self) -> None:
        super().check_types()
        check_number("target_compression_ratio", self.target_compression_ratio)

    def decoding_config(self) -> dict:
        return dict(base_config(self.base_press), compression_interval=self.compression_interval,
                    ratio_target=True, target_compression_ratio=float(self.target_compression_ratio),
                    hidden_states_buffer_size=self.hidden_states_buffer_size)
