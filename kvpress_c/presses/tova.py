from __future__ import annotations

from dataclasses import dataclass

from .base import ScorerPress


@dataclass
class TOVAPress(ScorerPress):
    """TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): the last query's attention,
    averaged over all heads of the layer; the last token is kept."""
    scorer = "tova"
