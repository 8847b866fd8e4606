from __future__ import annotations

from dataclasses import dataclass

from .base import ScorerPress


@dataclass
class KnormPress(ScorerPress):
    """Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression"): keep the keys of smallest L2 norm (score -||k||)."""
    scorer = "knorm"
