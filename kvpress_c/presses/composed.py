from __future__ import annotations

from dataclasses import dataclass, field

from .base import BasePress


@dataclass
class ComposedPress(BasePress):
    """kvpress ComposedPress: the presses compress each layer one after the other, each on what the
    previous one kept (the same queries; evicted for real after each). Kept fraction: the product of
    theirs. Members are presses that act after each layer's attention (scorer presses, Ada-KV, ChunkKV,
    PyramidKV, BlockPress, PerLayerCompressionPress, ThinKPress, DuoAttentionPress); ObservedAttention only
    first; not KeyRerotationPress (its keys must sit at their original positions)."""
    presses: list = field(default_factory=list)

    def __post_init__(self):
        from .decoding import DecodingPress
        from .key_rerotation import KeyRerotationPress
        if not isinstance(self.presses, (list, tuple)) or not self.presses:
            raise ValueError("ComposedPress takes a non-empty list of presses")
        for p in self.presses:
            if not isinstance(p, BasePress) or isinstance(p, (DecodingPress, ComposedPress, KeyRerotationPress)) or p.prefill_part is not p \
                    or not p.attach_to_session or type(p).prefill is not BasePress.prefill:
                raise ValueError(f"ComposedPress members act after each layer's attention (scorer presses, AdaKVPress, "
                                 f"ChunkKVPress...); {type(p).__name__} cannot be one")
        if any(p.c_config().get("scorer") == "observed" and not p.is_noop for p in self.presses[1:]):
            raise ValueError("ObservedAttentionPress can only be the first press of a ComposedPress")

    @property
    def compression_ratio(self) -> float:
        kept = 1.0
        for p in self.presses:
            kept *= 1 - getattr(p, "compression_ratio", 0.0)
        return 1 - kept

    @property
    def is_noop(self) -> bool:
        return all(p.is_noop for p in self.presses)

    def c_config(self) -> dict:
        return self.presses[0].c_config()

    def before_prefill(self, session, n: int, config: dict) -> None:
        self.presses[0].before_prefill(session, n, config)
        for p in self.presses[1:]:  # each member's own settings apply to it, the chain's last press
            session.add_press(**p.c_config())
            p.before_prefill(session, n, config)
