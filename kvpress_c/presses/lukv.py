from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .base import BasePress, ScorerPress, c_check, check_int, check_number
from .expected_attention import ExpectedAttentionPress

CURVES_URL = "https://github.com/baidu-baige/LU-KV/tree/main/evaluation/curve_data"
LLAMA_3_1_8B_EA_CURVE = "llama-3.1-8b/ea_0.02_sink4_win1_llama_avg_ratio.npy"


@dataclass
class LUKVPress(BasePress):
    """LU-KV (arXiv 2602.08585, "Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic
    KV Cache Eviction"), as kvpress's LUKVPress: a precomputed budget curve gives each (layer, KV head) the share
    of its rows it prunes at a target compression ratio; the wrapped scorer `press` ranks the rows and each
    head keeps its own top ones. The first `sink` and the last `window` rows are always kept. kvpress masks the
    pruned rows; here they are evicted (ragged heads).

    The curve comes from a local .npy file (`curve_path`), an array [99, layers, KV heads] whose row
    round(100 compression_ratio) - 1 holds each head's prune fraction, made for this model and scorer by the
    LU-KV repository ({url}; the default press's curve for Llama-3.1-8B-Instruct is
    {default}). Nothing is downloaded.
    """
    press: ScorerPress = field(default_factory=lambda: ExpectedAttentionPress(epsilon=2e-2))
    compression_ratio: float = 0.0
    sink: int = 4
    window: int = 1
    curve_path: Optional[str] = None
    budget_curves: np.ndarray = field(init=False, default=None, repr=False)

    def __post_init__(self):
        if not isinstance(self.press, ScorerPress):
            raise ValueError("LUKVPress wraps a scorer press, e.g. LUKVPress(ExpectedAttentionPress(epsilon=2e-2))")
        if type(self.press).__name__ in ("QFilterPress", "KVzapPress") or getattr(self.press, "beta", None) is not None:
            raise ValueError(f"LUKVPress allocates the heads' budgets itself from the press's scores: wrap a scorer such "
                             f"as ExpectedAttentionPress or SnapKVPress, not {type(self.press).__name__}")
        check_number("compression_ratio", self.compression_ratio)
        if not 0 <= self.compression_ratio < 1:
            raise ValueError(f"compression_ratio must be in [0, 1), got {self.compression_ratio!r}")
        check_int("sink", self.sink, minimum=0)
        check_int("window", self.window, minimum=0)
        c_check(self.c_config())
        self.budget_curves = load_budget_curve(self.curve_path)

    @property
    def budget(self):
        return None

    @property
    def is_noop(self) -> bool:
        return self.compression_ratio <= 0

    @property
    def target_index(self) -> int:
        """The curve's row for this compression ratio (kvpress: round(100 ratio) - 1 in [0, 98])."""
        return max(0, min(98, int(round(self.compression_ratio * 100)) - 1))

    def c_config(self) -> dict:
        return dict(self.press.c_config(), compression_ratio=float(self.compression_ratio), budget=0)

    def head_prune_ratios(self, n_layers: int, n_kv_heads: int) -> np.ndarray:
        """[layers, KV heads] fraction of its rows each head prunes at this compression ratio."""
        want = (99, n_layers, n_kv_heads)
        if self.budget_curves.shape != want:
            raise ValueError(f"the LU-KV budget curve in {self.curve_path} has shape {self.budget_curves.shape}; this "
                             f"model needs {want}: use the curve made for this model")
        return np.ascontiguousarray(self.budget_curves[self.target_index], dtype=np.float32)

    def before_prefill(self, session, n: int, config: dict) -> None:
        prune = self.head_prune_ratios(config["n_layers"], config["n_kv_heads"])
        self.press.before_prefill(session, n, config)  # e.g. ExpectedAttentionStatsPress's statistics
        session.set_press_array("head_prune", prune)
        session.set_press_array("lukv_sink", self.sink)
        session.set_press_array("lukv_window", self.window)


LUKVPress.__doc__ = LUKVPress.__doc__.format(url=CURVES_URL, default=f"{CURVES_URL}/{LLAMA_3_1_8B_EA_CURVE}")


def load_budget_curve(path) -> np.ndarray:
    """The [99, layers, KV heads] budget curve of a .npy file."""
    if path is None:
        raise ValueError(f"LUKVPress needs the budget curve of your model and scorer from a local .npy file: download it "
                         f"from {CURVES_URL} (Llama-3.1-8B-Instruct with ExpectedAttentionPress(epsilon=2e-2): "
                         f"{LLAMA_3_1_8B_EA_CURVE}) or make one with the LU-KV repository, and pass curve_path='that.npy' "
                         "(kvpress_c never downloads)")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"LU-KV budget curve missing: {path} (get it from {CURVES_URL})")
    try:
        curve = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise ValueError(f"{path} is not a .npy array ({e})") from None
    if not isinstance(curve, np.ndarray) or curve.ndim != 3 or curve.shape[0] != 99:
        raise ValueError(f"{path}: an LU-KV budget curve is an array [99, layers, KV heads], got shape "
                         f"{getattr(curve, 'shape', None)}")
    curve = np.asarray(curve, dtype=np.float64)
    if not np.isfinite(curve).all():
        raise ValueError(f"{path}: the budget curve must hold finite numbers")
    return curve
