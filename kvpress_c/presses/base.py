"""Base classes of the presses: a press is a dataclass that turns into a C press config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Codes of the C enums (csrc/include/kvpress_c.h)
SCORERS = {"streaming": 0, "knorm": 1, "random": 2, "tova": 3, "observed": 4, "snapkv": 5, "edie": 6}
ALLOCATIONS = {"uniform": 0, "pyramid": 1, "adakv": 2, "layer": 3}
SAFEGUARDS = {"floor": 0, "protect": 1}


def check_budget(compression_ratio: float, budget: Optional[int]) -> None:
    if not isinstance(compression_ratio, (int, float)) or not (0 <= compression_ratio < 1):
        raise ValueError(f"compression_ratio must be in [0, 1) (fraction of tokens removed), got {compression_ratio!r}")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be a positive integer (tokens kept per KV head per layer), got {budget!r}")
        if compression_ratio != 0:
            raise ValueError("give either compression_ratio or budget, not both")


@dataclass
class BasePress:
    """A press compresses the KV cache during prefill. Subclasses define `c_config()`."""

    def c_config(self) -> dict:
        raise NotImplementedError

    def prefill(self, session, ids, config: dict, question_ids=None):
        """Compressed prefill of `ids` on a session that has this press attached; returns the logits
        of the last token. Presses that change the prefill itself (TAKE, Judge Q) override this."""
        import numpy as np
        self.before_prefill(session, len(ids), config)
        logits = session.forward(np.asarray(ids, dtype=np.int32), logits="last")
        self.after_prefill(session, len(ids), config)
        return logits

    #: the pipeline attaches c_config() to the session before prefill()
    attach_to_session = True

    def before_prefill(self, session, n: int, config: dict) -> None:
        """Called after the press is attached, before the compressed prefill of n tokens."""

    def after_prefill(self, session, n: int, config: dict) -> None:
        """Called after the compressed prefill (e.g. to update running statistics)."""

    def compresses_full_cache(self, ids, question_ids=None) -> bool:
        """True when this press, which changes the prefill, can instead compress a full-cache copy of
        a shared prefill of `ids` afterwards (compress_full_cache) with the same result (exactly on
        the CPU; on the GPU the GEMMs of other row counts round bf16 differently): the pipeline then
        runs one forward for it and the other presses."""
        return False

    def compress_full_cache(self, session, ids, config: dict, question_ids=None) -> None:
        """Compress a session that holds the full cache of the prompt `ids`, as prefill() would have."""
        raise NotImplementedError

    @property
    def is_noop(self) -> bool:
        cfg = self.c_config()
        return cfg.get("budget", 0) == 0 and cfg.get("compression_ratio", 0.0) == 0


@dataclass
class ScorerPress(BasePress):
    """A press that scores every cached token and keeps the top ones per KV head.

    compression_ratio: fraction removed (kvpress); budget: tokens kept per KV head per layer instead.
    """
    compression_ratio: float = 0.0
    budget: Optional[int] = None

    scorer = "snapkv"

    def __post_init__(self):
        check_budget(self.compression_ratio, self.budget)

    def c_config(self) -> dict:
        return {"scorer": SCORERS[self.scorer], "allocation": ALLOCATIONS["uniform"],
                "compression_ratio": float(self.compression_ratio), "budget": int(self.budget or 0),
                "window": 0, "kernel": 1}


def kept_per_head(n: int, compression_ratio: float, budget: Optional[int]) -> int:
    """Tokens kept per KV head: min(n, budget), or kvpress's max(1, int(n * (1 - ratio)))."""
    if budget:
        return min(n, int(budget))
    return max(1, int(n * (1.0 - compression_ratio)))
