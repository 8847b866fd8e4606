from __future__ import annotations

from dataclasses import dataclass, field

from .base import BasePress, ScorerPress, c_check, check_number


@dataclass
class PerLayerCompressionPress(BasePress):
    """kvpress PerLayerCompressionPress: `press` (a scorer press) with its own compression ratio at each
    layer, `compression_ratios[l]` (one per layer; 0 leaves a layer whole)."""
    press: ScorerPress = None
    compression_ratios: list = field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.press, ScorerPress):
            raise ValueError("PerLayerCompressionPress wraps a scorer press, e.g. "
                             "PerLayerCompressionPress(SnapKVPress(), compression_ratios=[0.5, 0.3, ...])")
        if self.press.budget is not None:
            raise ValueError("PerLayerCompressionPress sets compression ratios: the wrapped press must not have a budget")
        if not isinstance(self.compression_ratios, (list, tuple)) or not self.compression_ratios:
            raise ValueError("compression_ratios must be a non-empty list (one ratio per layer)")
        for r in self.compression_ratios:
            check_number("compression_ratios[...]", r)
            if not 0 <= r < 1:
                raise ValueError(f"every compression ratio must be in [0, 1), got {r!r}")
        c_check(self.c_config())

    @property
    def compression_ratio(self) -> float:
        return sum(self.compression_ratios) / len(self.compression_ratios)

    @property
    def budget(self):
        return None

    @property
    def is_noop(self) -> bool:
        return not any(self.compression_ratios)

    def c_config(self) -> dict:
        return dict(self.press.c_config(), compression_ratio=float(self.compression_ratio))

    def before_prefill(self, session, n: int, config: dict) -> None:
        if len(self.compression_ratios) != config["n_layers"]:
            raise ValueError(f"compression_ratios has {len(self.compression_ratios)} values; the model has "
                             f"{config['n_layers']} layers")
        session.set_press_array("layer_ratios", [float(r) for r in self.compression_ratios])
        self.press.before_prefill(session, n, config)
