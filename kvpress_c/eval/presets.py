"""Press names for the command line and the runner: name + budget (tokens per KV head) or
compression ratio + options -> a press object. `full` is the uncompressed cache."""
from __future__ import annotations

from typing import Optional

from .. import presses as P

NAMES = ["full", "streaming_llm", "snapkv", "pyramidkv", "ada_snapkv", "chunkkv", "edie", "edie_tada",
         "tada_snapkv", "take", "knorm", "tova", "h2o", "random", "judgeq"]


def make_press(name: str, budget: Optional[int] = None, compression_ratio: Optional[float] = None,
               window_size: Optional[int] = None, kernel_size: Optional[int] = None, chunk_length: int = 10,
               reuse_layers: int = 1, chunk_size: int = 4096, take_alpha: float = 0.2,
               warmup_budget: Optional[int] = None, soft_tokens: Optional[str] = None, model=None):
    """A press by name (see NAMES)."""
    if name not in NAMES:
        raise ValueError(f"unknown press {name!r}; choose one of: {', '.join(NAMES)}")
    if name == "full":
        return None
    if budget is not None and compression_ratio is not None:
        raise ValueError("give a budget (tokens per KV head) or a compression ratio, not both")
    if budget is None and compression_ratio is None:
        raise ValueError(f"press {name!r} needs --budget N (tokens kept per KV head) or --compression-ratio R")
    size = {"budget": int(budget)} if budget is not None else {"compression_ratio": float(compression_ratio)}
    win = {} if window_size is None else {"window_size": window_size}
    ker = {} if kernel_size is None else {"kernel_size": kernel_size}
    if name == "take":
        if budget is None:
            raise ValueError("TAKE keeps a token budget per layer: give --budget, not --compression-ratio")
        return P.TAKEPress(budget=int(budget), chunk_size=chunk_size, alpha=take_alpha, warmup_budget=warmup_budget,
                           **ker)
    if name == "judgeq":
        if soft_tokens:
            return P.JudgeQPress(soft_tokens, **size)
        if model is None:
            raise ValueError("judgeq needs --soft-tokens PATH, or a model with a trained default file")
        return P.JudgeQPress.default_for(model, **size)
    snap = lambda: P.SnapKVPress(**size, **_fit_window(win, budget), **ker)
    if name == "streaming_llm":
        return P.StreamingLLMPress(**size)
    if name == "snapkv":
        return snap()
    if name == "pyramidkv":
        return P.PyramidKVPress(**size, **_fit_window(win, budget), **ker)
    if name == "ada_snapkv":
        return P.AdaKVPress(snap())
    if name == "chunkkv":
        return P.ChunkKVPress(snap(), chunk_length=chunk_length, reuse_layers=reuse_layers)
    if name == "edie":
        return P.EDIEPress(**size, **_fit_window(win, budget, default=32), **ker)
    if name == "edie_tada":
        return P.TADAPress(P.EDIEPress(**size, **_fit_window(win, budget, default=32), **ker))
    if name == "tada_snapkv":
        return P.TADAPress(snap())
    if name == "knorm":
        return P.KnormPress(**size)
    if name == "tova":
        return P.TOVAPress(**size)
    if name == "h2o":
        return P.ObservedAttentionPress(**size)
    return P.RandomPress(**size)


def _fit_window(win: dict, budget: Optional[int], default: int = 64) -> dict:
    """SnapKV keeps its observation window inside the budget: below a budget of 64 the default
    window shrinks to half the budget (the papers' small-budget setting) unless one is given."""
    if win or budget is None or budget >= default:
        return win
    return {"window_size": max(1, int(budget) // 2)}


def label(name: str, budget: Optional[int] = None, compression_ratio: Optional[float] = None,
          kv_cache: Optional[str] = None) -> str:
    """e.g. "snapkv-b128", "full"; with a K/V type named (kvpress_c.kv_cache.kv_cache_name) "snapkv-b128-kivi4"."""
    base = "full" if name == "full" else f"{name}-b{budget}" if budget is not None else f"{name}-r{compression_ratio:g}"
    return base if kv_cache is None else f"{base}-{kv_cache}"
