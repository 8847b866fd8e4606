from __future__ import annotations

from dataclasses import dataclass

from .base import ScorerPress, c_check, check_int, WrapperPress


@dataclass
class BlockPress(WrapperPress):
    """kvpress BlockPress (block-wise prompt processing of the KeyDiff paper, Park et al., 2025, "KeyDiff:
    Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained
    Environments"), simulated after the forward as in kvpress: each head starts from its first n_kept
    tokens; block after block of `block_size`, the kept tokens and the block are scored alone and the top
    n_kept are kept. The wrapped press must score from keys alone (Knorm, StreamingLLM, Random)."""
    press: ScorerPress = None
    block_size: int = 128

    def __post_init__(self):
        if not isinstance(self.press, ScorerPress):
            raise ValueError("BlockPress wraps a scorer press, e.g. BlockPress(KnormPress(compression_ratio=0.5))")
        inner = self.press.c_config()  # a Python press reading keys (and values) alone may be wrapped too
        rows_only = ~(1 | 32)  # KVC_VIEW_VALUES, KVC_VIEW_IN_PLACE: the block's rows and nothing of the call
        if inner["scorer"] not in ("knorm", "streaming", "random", "callback") or inner.get("callback_needs", 0) & rows_only:
            raise ValueError("BlockPress scores each block from its keys alone: wrap KnormPress, StreamingLLMPress, "
                             f"RandomPress or a Python press reading keys and values, not {type(self.press).__name__}")
        check_int("block_size", self.block_size, minimum=1)
        c_check(self.c_config())

    def c_config(self) -> dict:
        return self.press.c_config()

    def before_prefill(self, session, n: int, config: dict) -> None:
        session.set_press_array("block_size", self.block_size)
