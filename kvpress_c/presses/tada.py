from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import _core
from .base import ScorerPress, c_check, kept_per_head, WrapperPress
from .edie import EDIEPress


@dataclass
class TADAPress(WrapperPress):
    """TADA (task-aware layer budgets; EDIE-TADA-error-driven-eviction.txt): per layer,
    E_layer = (1 - cos(R, R + O)) * E_internal, with E_internal the inner scorer's scores summed over
    heads and past tokens (EDIE's error bound when the inner press is EDIEPress). Running means over
    the contexts this press has seen give layer capacities N_l = Ebar_l / sum(Ebar) * L * Hkv * B,
    clamped to [Hkv * w, Hkv * n] and renormalised to the same total (kvc_tada_allocate in C); the first
    context is uniform.
    Inside a layer the top N_l tokens are chosen across heads (window kept). `reset()` forgets.
    """
    press: ScorerPress = field(default_factory=EDIEPress)
    _sum: np.ndarray = field(default=None, repr=False)
    _count: int = field(default=0, repr=False)

    def __post_init__(self):
        if not isinstance(self.press, ScorerPress):
            raise ValueError("TADAPress wraps a scorer press, e.g. TADAPress(EDIEPress(budget=128))")
        c_check(self.c_config())

    def reset(self) -> None:
        """Forget the error statistics (the next context is allocated uniformly)."""
        self._sum, self._count = None, 0

    @property
    def contexts_seen(self) -> int:
        return self._count

    def c_config(self) -> dict:
        cfg = self.press.c_config()
        cfg["allocation"] = "layer"
        return cfg

    def layer_budgets(self, n: int, n_layers: int, n_kv: int) -> np.ndarray:
        """Tokens kept per layer (summed over KV heads) for a prompt of n tokens."""
        w = getattr(self.press, "window_size", 0)
        B = kept_per_head(n, self.press.c_config())
        total = n_layers * n_kv * B
        if self._count == 0 or self._sum is None or not np.all(np.isfinite(self._sum)) or self._sum.sum() <= 0:
            return np.full(n_layers, n_kv * B, dtype=np.int64)
        return _core.tada_allocate(self._sum / self._count, total, n_kv * w, n_kv * n)

    def before_prefill(self, session, n: int, config: dict) -> None:
        session.set_layer_budgets(self.layer_budgets(n, config["n_layers"], config["n_kv_heads"]))

    def after_prefill(self, session, n: int, config: dict) -> None:
        e = np.array([np.prod(session.press_layer_stats(l)) for l in range(config["n_layers"])], dtype=np.float64)
        if not np.all(np.isfinite(e)):
            return  # a layer did not compress (prompt within budget): no statistics from this context
        self._sum = e if self._sum is None else self._sum + e
        self._count += 1
