from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .base import BasePress, check_choice, check_int

AGGREGATORS = ("max", "mean")


@dataclass
class KVComposePress(BasePress):
    """KVCompose (Akulov et al., 2025, "KVCompose: Efficient Structured KV Cache Compression with Composite
    Tokens", arXiv 2509.05165), as kvpress's KVComposePress. After the context's full prefill, the context runs
    again as queries on its own full cache (or the prompts given to `register_prompt_ids`); per layer,
    attention head and context row, their attention is aggregated over the queries (`agg_task`), then over the
    heads of a KV group (`agg_group`), optionally times ||v|| (`add_v_norm`) and plus the mean over the layer's
    KV heads (`add_mean_across_heads`). Each head's scores sorted in descending order form its composite token
    profile; `structured=True`: the layer's heads' profiles aggregated (`agg_head`), the first layer given the
    maximum over layers, and the top `(1 - compression_ratio)` share of all (layer, rank) entries sets each
    layer's count (every head of a layer keeps that many: the cache stays rectangular per layer), at least
    max(1, `keep_token_lower_bound`); `structured=False`: the top share over every (layer, head, rank) sets each
    head's count. Each head then keeps its own best rows. The prompt's rows are dropped, the evicted rows freed
    for real (kvpress masks them in the unstructured variant). Costs a second forward of the context's length.
    """
    structured: bool = True
    compression_ratio: float = 0.0
    agg_task: str = "max"
    agg_group: str = "mean"
    agg_head: str = "mean"
    add_v_norm: bool = False
    add_mean_across_heads: bool = True
    keep_token_lower_bound: int = 0
    prompt_ids: Optional[list] = field(default=None, init=False, repr=False)

    attach_to_session = False

    def __post_init__(self):
        r = self.compression_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise ValueError(f"compression_ratio must be in [0, 1), got {r!r}")
        for name in ("agg_task", "agg_group", "agg_head"):
            check_choice(name, getattr(self, name), AGGREGATORS)
        check_int("keep_token_lower_bound", self.keep_token_lower_bound, minimum=0)

    def register_prompt_ids(self, prompt_ids) -> None:
        """Prompts (token id lists) whose attention scores the context instead of the context itself."""
        self.prompt_ids = [np.asarray(p, dtype=np.int32).ravel() for p in prompt_ids]

    def c_config(self) -> dict:
        return {}

    @property
    def is_noop(self) -> bool:
        return self.compression_ratio == 0

    def statistics(self, session, ids) -> np.ndarray:
        """float32 [L, H, n]: agg_task over the prompts' queries of their attention to each context row."""
        prompts = self.prompt_ids or [np.asarray(ids, dtype=np.int32)]
        total, count = None, 0
        for p in prompts:
            s = session.kvcompose_profile(p, sum=self.agg_task == "mean")
            total = s if total is None else (total + s if self.agg_task == "mean" else np.maximum(total, s))
            count += len(p)
        return total / count if self.agg_task == "mean" else total

    def compresses_full_cache(self, ids, question_ids=None) -> bool:
        return True  # it always scores the full cache after the prefill

    def compress_full_cache(self, session, ids, config: dict, question_ids=None) -> None:
        if self.compression_ratio == 0:
            return
        session.kvcompose_evict(self.statistics(session, ids), float(self.compression_ratio),
                                structured=self.structured, group_max=self.agg_group == "max",
                                head_max=self.agg_head == "max", add_v_norm=self.add_v_norm,
                                add_mean=self.add_mean_across_heads, lower_bound=self.keep_token_lower_bound)

    def prefill(self, session, ids, config: dict, question_ids=None):
        ids = np.asarray(ids, dtype=np.int32)
        logits = session.forward(ids, logits="last")
        self.compress_full_cache(session, ids, config, question_ids)
        return logits
