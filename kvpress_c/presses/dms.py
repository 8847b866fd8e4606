from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .base import BasePress, ScorerPress, c_check, check_int, check_number


@dataclass
class DMSPress(BasePress):
    """Threshold eviction behind a sliding window, as kvpress's DMSPress (after Dynamic Memory Sparsification,
    Lancucki et al., 2025, "Inference-Time Hyper-Scaling with KV Cache Compression", arXiv 2506.05345; the dense-
    prefill inference rule, without the paper's trained evictors). Each forward call scores its own rows with
    `press` (the scorer sees only those rows); the last `sliding_window_size` rows are never judged; a row that
    leaves the window is evicted for real if it scored below `threshold` (each KV head on its own, so heads end
    up with different lengths). The prefill into an empty session is judged; with `decoding=True` every later
    call too (generated tokens, a question), continuing the prefill's window.

    There is no compression_ratio to set: `compression_ratio` is what the last prefill evicted (the mean over
    layers of the evicted share of the layer's rows, as kvpress reports it), read after the run."""
    press: ScorerPress = None
    threshold: Optional[float] = None
    sliding_window_size: int = 128
    decoding: bool = False
    measured_ratio: Optional[float] = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.press, ScorerPress):
            raise ValueError(f"DMSPress wraps a ScorerPress, e.g. DMSPress(KnormPress(), threshold=-5.0), got {self.press!r}")
        if self.threshold is None:
            raise ValueError("DMSPress needs a threshold: tokens whose score is below it are evicted (its scale is the "
                             "wrapped press's scores)")
        if self.press.compression_ratio or self.press.budget:
            raise ValueError("DMSPress evicts by its threshold: the wrapped press's compression_ratio or budget would be "
                             "ignored (kvpress ignores it too); leave them unset")
        check_number("threshold", self.threshold)
        check_int("sliding_window_size", self.sliding_window_size, minimum=0)
        c_check(self.c_config())

    @property
    def compression_ratio(self) -> float:
        if self.measured_ratio is None:
            raise ValueError("DMSPress's compression ratio depends on the input: run a forward pass first")
        return self.measured_ratio

    @property
    def is_noop(self) -> bool:
        return False

    def c_config(self) -> dict:
        cfg = self.press.c_config()
        cfg.update(compression_ratio=0.0, budget=0, dms=True, dms_threshold=float(self.threshold),
                   dms_window=int(self.sliding_window_size))
        return cfg

    def decoding_config(self) -> Optional[dict]:
        return self.c_config() if self.decoding else None

    def before_prefill(self, session, n: int, config: dict) -> None:
        self.press.before_prefill(session, n, config)

    def after_prefill(self, session, n: int, config: dict) -> None:
        lengths = session.cache_lengths()
        self.measured_ratio = float(1.0 - lengths.sum() / (lengths.size * session.position))
