from __future__ import annotations

from dataclasses import dataclass

from .base import BasePress, c_check, check_int, check_number


@dataclass
class SimLayerKVPress(BasePress):
    """kvpress SimLayerKVPress (Zhang et al., 2024, "SimLayerKV: A Simple Framework for Layer-Level KV Cache
    Reduction"): a layer is lazy when its last `n_last` queries put more than `lazy_threshold` of their attention
    (averaged over the query heads and those queries) on the first `n_initial` and the `n_recent` most recent
    tokens; a lazy layer keeps its first `n_initial` and its last `n_recent - n_last` tokens, every other layer
    keeps all. A prompt of at most n_initial + n_recent + n_last tokens, or lazy_threshold 1, is not compressed.
    Recommended thresholds (the paper's): Llama3 0.9, Llama2 0.65, Mistral 0.8, Qwen 0.85. The compression
    ratio is an outcome: the pipeline's stats["compression_ratio"]."""
    lazy_threshold: float = 1.0
    n_last: int = 1
    n_recent: int = 1024
    n_initial: int = 4

    def __post_init__(self):
        check_number("lazy_threshold", self.lazy_threshold)
        check_int("n_last", self.n_last, minimum=1)
        check_int("n_recent", self.n_recent, minimum=1)
        check_int("n_initial", self.n_initial, minimum=0)
        c_check(self.c_config())

    def c_config(self) -> dict:
        return {"scorer": "simlayerkv", "allocation": "uniform", "compression_ratio": 0.0,
                "budget": 0, "window": self.n_last, "kernel": 1, "n_sink": self.n_initial,
                "lazy_threshold": float(self.lazy_threshold), "n_recent": self.n_recent}

    @property
    def is_noop(self) -> bool:
        return self.lazy_threshold == 1.0
