from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .base import BasePress, ScorerPress


@dataclass
class TAKEPress(BasePress):
    """TAKE (TAKE-chunked-prefill-eviction.txt): chunked prefill with probe tokens and delayed eviction.

    The prompt is prefilled in chunks of `chunk_size` tokens, each followed by the probe tokens (the
    question when the pipeline is question-aware, else the last 32 prompt tokens, or `probe` ids you
    give) whose K/V are never kept. The probes' queries, accumulated over chunks with an EMA (`alpha`),
    score the cache after every chunk; each layer keeps `warmup_budget` tokens per head before the last
    chunk in the first `warmup_layers` layers (default half) and `budget` otherwise. Delayed eviction:
    layer W-1's choice prunes layers 0..W-1. Later chunks attend only to the pruned past, so KV memory
    per layer is bounded by chunk_size + probes + budget whatever the prompt length. `press` (any
    scorer press) replaces the probe attention as the scorer, with the probes as its window.
    """
    budget: int = 512
    chunk_size: int = 4096
    probe: Optional[Sequence[int]] = None
    alpha: float = 0.2
    warmup_layers: Optional[int] = None
    warmup_budget: Optional[int] = None
    kernel_size: int = 7
    delayed: bool = True
    n_probe_default: int = 32
    press: Optional[ScorerPress] = None

    attach_to_session = False

    def __post_init__(self):
        for name in ("budget", "chunk_size", "kernel_size", "n_probe_default"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd, got {self.kernel_size}")
        if not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha!r}")
        if self.warmup_layers is not None and (not isinstance(self.warmup_layers, int) or self.warmup_layers < 0):
            raise ValueError(f"warmup_layers must be an integer >= 0, got {self.warmup_layers!r}")
        if self.warmup_budget is not None and (not isinstance(self.warmup_budget, int) or self.warmup_budget < self.budget):
            raise ValueError(f"warmup_budget must be an integer >= budget ({self.budget}), got {self.warmup_budget!r}")
        if self.press is not None and not isinstance(self.press, ScorerPress):
            raise ValueError("TAKEPress(press=...) takes a scorer press (SnapKVPress, EDIEPress, ...)")

    @property
    def compression_ratio(self) -> float:
        return 0.0

    @property
    def is_noop(self) -> bool:
        return False

    def c_config(self) -> dict:
        return {}

    def default_warmup_budget(self, n: int) -> int:
        """docs/METHODS.md default: min(n, max(4 B, n // 12))."""
        return min(n, max(4 * self.budget, n // 12))

    def probe_ids(self, ids, question_ids=None) -> np.ndarray:
        if self.probe is not None:
            return np.asarray(self.probe, dtype=np.int32)
        if question_ids is not None and len(question_ids) > 0:
            return np.asarray(question_ids, dtype=np.int32)
        return np.asarray(ids[-self.n_probe_default:], dtype=np.int32)

    def _c_kwargs(self, n: int) -> dict:
        kwargs = dict(chunk_size=self.chunk_size, kernel=self.kernel_size, alpha=float(self.alpha),
                      delayed=bool(self.delayed),
                      warmup_budget=self.warmup_budget if self.warmup_budget is not None else self.default_warmup_budget(n),
                      warmup_layers=-1 if self.warmup_layers is None else self.warmup_layers)
        if self.press is not None:
            kwargs["inner"] = self.press.c_config()
        return kwargs

    def prefill(self, session, ids, config: dict, question_ids=None):
        ids = np.asarray(ids, dtype=np.int32)
        return session.prefill_take(ids, self.probe_ids(ids, question_ids), self.budget, **self._c_kwargs(len(ids)))

    def prefill_turn(self, session, ids, first: int, config: dict):
        """A conversation's turn: the turn's tokens in chunks, each followed by the probes (the turn's last
        n_probe_default tokens, or `probe`), on the session's cache: the session's press scope 'cache' scores every
        row held (the conversation goes on as one long prompt: the cache stays at the budget), 'call' only the turn's
        rows (each turn kept at the budget, the earlier turns as they were)."""
        new = np.asarray(ids[first:], dtype=np.int32)
        return session.prefill_take(new, self.probe_ids(new), self.budget, **self._c_kwargs(len(new)))

    def compresses_full_cache(self, ids, question_ids=None) -> bool:
        # a prompt of one chunk: its K/V do not depend on the probes that follow it, so the probes can
        # run after a shared prefill on a copy of its full cache (2 or more: one row is a decode step),
        # unless the inner scorer reads every query of the forward call (observed attention)
        observed = self.press is not None and self.press.c_config().get("scorer") == "observed"
        return len(ids) <= self.chunk_size and len(self.probe_ids(ids, question_ids)) >= 2 and not observed

    def compress_full_cache(self, session, ids, config: dict, question_ids=None) -> None:
        """The probes run after the prompt's full cache, score it and evict: the cache prefill() gives."""
        ids = np.asarray(ids, dtype=np.int32)
        session.prefill_take(ids, self.probe_ids(ids, question_ids), self.budget, prompt_cached=True,
                             **self._c_kwargs(len(ids)))
