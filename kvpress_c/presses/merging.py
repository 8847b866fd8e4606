from __future__ import annotations

from dataclasses import dataclass

from .base import ScorerPress, WrapperPress, c_check, check_number


@dataclass
class MergingPress(WrapperPress):
    """Merge-on-evict (kvpress MergingPress; after Token Merging, Bolya et al., ICLR 2023, "Token Merging: Your ViT
    But Faster", and D2O, Wan et al., 2024, "D2O: Dynamic Discriminative Operations for Efficient Generative
    Inference of Large Language Models"): the wrapped scorer press picks each head's kept rows; before they are
    evicted, each evicted row's value is folded into its most key-similar (cosine) kept row, weighted by
    max(similarity, 0) x ||v_e|| / (||v_e|| + ||v_t|| + 1e-6), and every kept row that received something becomes
    (v_t + sum w v_e) / (1 + sum w). Keys stay as they are. Merges need similarity >= `similarity_threshold`;
    with `merge_fraction` < 1 only the most similar share of the evicted rows (torch.quantile's cut) merges.
    The rows are evicted for real after the merge (csrc/press/merge.c)."""
    press: ScorerPress = None
    similarity_threshold: float = 0.0
    merge_fraction: float = 1.0

    def __post_init__(self):
        if not isinstance(self.press, ScorerPress):
            raise ValueError(f"MergingPress requires a ScorerPress, got {type(self.press).__name__}")
        check_number("similarity_threshold", self.similarity_threshold)
        check_number("merge_fraction", self.merge_fraction)
        c_check(self.c_config())

    def c_config(self) -> dict:
        return dict(self.press.c_config(), merge=True, merge_threshold=float(self.similarity_threshold),
                    merge_fraction=float(self.merge_fraction))

    def before_prefill(self, session, n: int, config: dict) -> None:
        self.press.before_prefill(session, n, config)
