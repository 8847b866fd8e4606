"""Base classes of the presses: a press is a dataclass that turns into a C press config.

One source of truth for the settings: the C table of press settings (csrc/press/params.c). A press's
c_config() is a dict of settings by name (choices such as the scorer by their names); the dataclasses
check types, and the values are checked by the C core (kvc_press_config_check, through
_core.press_config_check), with the messages every other caller gets; the budget arithmetic is C's too
(_core.press_kept). press_params() lists every setting with its type, default, range and doc."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import _core

# The names of the choice settings, read from the C table
SCORERS = tuple(_core.SCORERS)
ALLOCATIONS = tuple(_core.ALLOCATIONS)
SAFEGUARDS = tuple(_core.SAFEGUARDS)


def press_params() -> dict:
    """Every press setting of the C core: name -> {type, default, lo, hi, doc, choices}. The range is
    what the C check accepts where a single range says it; the check itself is the rule."""
    return {name: dict(row) for name, row in _core.PRESS_PARAMS.items()}


def check_int(name: str, value, minimum: Optional[int] = None) -> None:
    """A Python int (not a bool); values are the C core's to judge, except where Python maps them."""
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise ValueError(f"{name} must be an integer{'' if minimum is None else f' >= {minimum}'}, got {value!r}")


def check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")


def check_budget(compression_ratio: float, budget: Optional[int]) -> None:
    """The types of the budget fields; None means "no budget" (0 in C), so a budget given is >= 1."""
    if isinstance(compression_ratio, bool) or not isinstance(compression_ratio, (int, float)):
        raise ValueError(f"compression_ratio must be in [0, 1) (fraction of tokens removed), got {compression_ratio!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be a positive integer (tokens kept per KV head per layer), got {budget!r}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")


def c_check(config: dict) -> None:
    """The C core's validation of a press config (ValueError with its message)."""
    _core.press_config_check(**config)


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

    def turn_refusal(self) -> Optional[str]:
        """Why this press cannot compress a conversation's turns (prefill_turn), or None."""
        if type(self).prefill_turn is not BasePress.prefill_turn or (self.attach_to_session and
                                                                     type(self).prefill is BasePress.prefill):
            return None
        return (f"{type(self).__name__} runs its own prefill and has no conversation turn (prefill_turn); a Conversation "
                "compresses each turn with presses that act after each layer (scorer presses, Ada-KV, ChunkKV, ThinK, "
                "merging ...), TAKE, KVzip and decoding presses")

    def prefill_turn(self, session, ids, first: int, config: dict):
        """A conversation's turn (kvpress_c.Conversation): the turn's tokens ids[first:] prefilled after the ids[:first]
        the session holds (at positions 0 .. first - 1) and compressed, the session's press scope saying which rows:
        'call' the turn's only, 'cache' every row held; returns the turn's last logits. A press that acts after each
        layer does it in the forward (this default); a press that runs its own prefill overrides it (TAKE, KVzip)."""
        import numpy as np
        why = self.turn_refusal()
        if why is not None:
            raise NotImplementedError(why)
        new = np.asarray(ids[first:], dtype=np.int32)
        session.set_press(**self.c_config())
        try:
            self.before_prefill(session, len(new), config)
            logits = session.forward(new, logits="last")
            self.after_prefill(session, len(new), config)
        finally:
            session.set_press(None)
        return logits

    @property
    def prefill_part(self) -> Optional["BasePress"]:
        """The press that acts on the prefill: itself (None for a DecodingPress, a PrefillDecodingPress's
        prefilling_press)."""
        return self

    def decoding_config(self) -> Optional[dict]:
        """Settings of the press that compresses while decoding (Session.set_decoding_press), or None."""
        return None

    def before_decoding(self, session, config: dict) -> None:
        """Called after the decoding press is set on the session (Session.set_decoding_press), before the prefill."""

    @property
    def is_noop(self) -> bool:
        cfg = self.c_config()
        return cfg.get("budget", 0) == 0 and cfg.get("compression_ratio", 0.0) == 0


class WrapperPress(BasePress):
    """A press around another (`self.press`) whose compression ratio and budget are the inner press's."""

    @property
    def compression_ratio(self) -> float:
        return self.press.compression_ratio

    @property
    def budget(self):
        return self.press.budget

    def before_prefill(self, session, n: int, config: dict) -> None:
        """The wrapped press's own settings (e.g. ExpectedAttentionStatsPress's statistics) reach the session."""
        self.press.before_prefill(session, n, config)


@dataclass
class ScorerPress(BasePress):
    """A press that scores every cached token and keeps the top ones per KV head.

    compression_ratio: fraction removed (kvpress); budget: tokens kept per KV head per layer instead.
    """
    compression_ratio: float = 0.0
    budget: Optional[int] = None

    scorer = "snapkv"

    def __post_init__(self):
        self.check_types()
        c_check(self.c_config())

    def check_types(self) -> None:
        """Type checks of this press's fields (subclasses add theirs); values are checked in C."""
        check_budget(self.compression_ratio, self.budget)

    @property
    def is_noop(self) -> bool:
        if callable(getattr(self, "compress", None)):  # a Python press choosing its rows: no ratio to say
            return False
        return super().is_noop

    def c_config(self) -> dict:
        from . import python_press  # a subclass defining score() or compress() runs in Python
        if python_press.is_python_press(self):
            return python_press.c_config(self)
        return {"scorer": self.scorer, "allocation": "uniform",
                "compression_ratio": float(self.compression_ratio), "budget": int(self.budget or 0),
                "window": 0, "kernel": 1}


def kept_per_head(n: int, config: dict, layer: int = 0, n_layers: int = 1) -> int:
    """Tokens a KV head of n rows keeps under a press config (c_config()): min(n, budget), or kvpress's
    max(1, int(n * (1 - ratio))), or a PyramidKV layer's share (the C rule, kvc_press_kept)."""
    return int(_core.press_kept(int(n), int(layer), int(n_layers), **config))
