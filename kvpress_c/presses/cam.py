from __future__ import annotations

from dataclasses import dataclass

from .base import check_int
from .decoding import DecodingPress


@dataclass
class CAMPress(DecodingPress):
    """CaM (Zhang et al., ICML 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference"), as kvpress's
    CAMPress: a DecodingPress that merges before it prunes. Each decoding step adds its last query's attention
    (averaged over the group's query heads) to a running sum per cached row. Every `compression_interval` steps,
    once a layer holds more than `target_size` rows, the base press's scores averaged over the KV heads rank the
    rows (one selection for the layer); of the evicted rows, the best-scored (as many as steps since the last
    compression) each spread value / m over the next m <= `merge_budget` kept rows, with probability
    clamp(A_e / mean(A over those rows), 0, 1) per KV head; then the evicted rows are freed for real.

    The Bernoulli draws come from `seed` (ours; kvpress uses torch's global generator): u < p merges, with u
    from splitmix64 of (seed, layer, the layer's merging compression count, KV head, candidate) (docs/METHODS.md).
    """
    merge_budget: int = 32
    seed: int = 0

    def check_types(self) -> None:
        super().check_types()
        check_int("merge_budget", self.merge_budget, minimum=1)
        check_int("seed", self.seed, minimum=0)

    def decoding_config(self) -> dict:
        return dict(super().decoding_config(), cam_merge_budget=self.merge_budget, cam_seed=self.seed)
