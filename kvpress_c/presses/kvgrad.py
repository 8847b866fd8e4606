from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kvzip import KVzipPress


@dataclass
class KVgradPress(KVzipPress):
    """KVgrad (https://openreview.net/forum?id=cg1wTCJjjk): KVzip's context reconstruction scored by input x gradient
    attribution (kvpress's KVgradPress).

    After the context's full prefill, each chunk's reconstruction prompt (KVzip's, `chunk_size` tokens of context per
    chunk) runs through the whole model on the full cache, read-only, with a backward pass: Phi = sum over the prompt
    rows p of ||h_p^L||^2 (the last layer's output before the final norm). Context row c of layer l, KV head h scores

        max over p and the query heads of h's group of  A[p, c] * ||v_c W_O||_2 * ||dPhi / da_p^l||_2,

    A KVzip's attention of row p restricted to the sinks, the chunk and the causal prompt rows, a_p^l the residual
    stream right after layer l's attention (the gradient flows through the prompt rows' own K/V, not the cached
    context's). The lowest scores are then evicted as KVzip evicts them (`layerwise`, `n_sink`). The forward and
    backward run on the host in fp32 (csrc/train/rows_grad.c; a device model reads an fp32 copy of its file), about
    3x a forward of the context's length (kvpress warns 3-4x its prefill). `kvzip_plus_normalization` does not apply
    (KVgrad always weights by ||v W_O||). Sliding-window models are refused when the window is shorter than the
    context plus a prompt (NotImplementedError).
    """
    compression_ratio: float = 0.0
    layerwise: bool = False
    n_sink: int = 4
    chunk_size: int = 512
    kvzip_plus_normalization: bool = field(init=False, default=False, repr=False)

    def _chunk_scores(self, session, rep, start: int, end: int) -> np.ndarray:
        """KVgrad's scores of a chunk (KVzipPress.scores gathers them: the session's cache full or compressed)."""
        return session.kvgrad_score(rep, start, end, n_sink=self.n_sink)
