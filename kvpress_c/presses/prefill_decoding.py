from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import BasePress
from .decoding import DecodingPress


@dataclass
class PrefillDecodingPress(BasePress):
    """kvpress PrefillDecodingPress: `prefilling_press` compresses the prefill, `decoding_press` (a
    DecodingPress or CompressionRatioDecodingPress) keeps compressing while the answer is generated.
    Either may be None."""
    prefilling_press: Optional[BasePress] = None
    decoding_press: Optional[DecodingPress] = None

    def __post_init__(self):
        if self.prefilling_press is not None and not isinstance(self.prefilling_press, BasePress):
            raise ValueError(f"prefilling_press must be a kvpress_c press, got {self.prefilling_press!r}")
        if isinstance(self.prefilling_press, DecodingPress) or isinstance(self.prefilling_press, PrefillDecodingPress):
            raise ValueError("prefilling_press compresses the prefill: give the DecodingPress as decoding_press")
        if self.decoding_press is not None and not isinstance(self.decoding_press, DecodingPress):
            raise ValueError(f"decoding_press must be a DecodingPress, got {self.decoding_press!r}")

    @property
    def prefill_part(self) -> Optional[BasePress]:
        return self.prefilling_press

    def c_config(self) -> dict:
        return self.prefilling_press.c_config() if self.prefilling_press is not None else {}

    def decoding_config(self):
        return self.decoding_press.decoding_config() if self.decoding_press is not None else None

    def before_decoding(self, session, config: dict) -> None:
        if self.decoding_press is not None:
            self.decoding_press.before_decoding(session, config)
