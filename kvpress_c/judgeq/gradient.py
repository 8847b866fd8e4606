"""The loss and gradient of soft embeddings, computed in C (kvc_judgeq_loss_grad, csrc/train/judgeq_grad.c):
pairs, and soft tokens to start from."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from .. import _core


# -- the C core ------------------------------------------------------------------------------------

def _core_model(model):
    core = getattr(model, "_core", model)
    if not isinstance(core, _core.Model):
        raise TypeError(f"model must be a kvpress_c.Model (kvpress_c.load_model(...)), not {type(model).__name__}")
    return core


def _ids(x, what: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D sequence of token ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integer token ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _soft(E, hidden: int) -> np.ndarray:
    E = np.asarray(E)
    if E.ndim != 2 or E.shape[0] < 1 or E.shape[1] != hidden:
        raise ValueError(f"soft embeddings must have shape (n_soft >= 1, {hidden}), got {E.shape}")
    if not np.issubdtype(E.dtype, np.floating):
        raise ValueError(f"soft embeddings must be floats, got dtype {E.dtype}")
    return np.ascontiguousarray(E, dtype=np.float32)


class Pair:
    """One (prompt, response) pair prepared in C: one forward of prompt + response, after which the
    prompt's K/V cache and the response's attention maps are kept, so that each loss / gradient costs
    only the soft rows' forward and backward. `nbytes` is what it holds (about
    n_layers * n_kv_heads * head_dim * 2 * (len(prompt) + max(len(response), max_soft)) floats)."""

    def __init__(self, model, prompt_ids, response_ids, max_soft: int = 32):
        self._core_model = _core_model(model)
        self.hidden = self._core_model.config["hidden"]
        self.prompt_len = len(_ids(prompt_ids, "prompt_ids"))
        self._pair, self.nbytes = _core.judgeq_pair(self._core_model, _ids(prompt_ids, "prompt_ids"),
                                                    _ids(response_ids, "response_ids"), int(max_soft))

    def loss_and_grad(self, E) -> tuple[float, np.ndarray]:
        loss, grad, _, _ = _core.judgeq_loss_grad(self._pair, _soft(E, self.hidden), grad=True)
        return loss, grad

    def loss(self, E) -> float:
        return _core.judgeq_loss_grad(self._pair, _soft(E, self.hidden), grad=False)[0]

    def attention_maps(self, E) -> tuple[np.ndarray, np.ndarray]:
        _, _, a_soft, a_resp = _core.judgeq_loss_grad(self._pair, _soft(E, self.hidden), grad=False, maps=True)
        return a_soft, a_resp


def loss_and_grad(model, prompt_ids, response_ids, E) -> tuple[float, np.ndarray]:
    """Judge Q loss of soft embeddings E [n_soft, hidden] for one (prompt, response) pair, and dL/dE
    (float32, same shape). Computed in C (CPU backend); the GIL is released meanwhile."""
    E = _soft(E, _core_model(model).config["hidden"])
    return Pair(model, prompt_ids, response_ids, max_soft=E.shape[0]).loss_and_grad(E)


def loss_only(model, prompt_ids, response_ids, E) -> float:
    """The loss without the backward pass (validation)."""
    E = _soft(E, _core_model(model).config["hidden"])
    return Pair(model, prompt_ids, response_ids, max_soft=E.shape[0]).loss(E)


def attention_maps(model, prompt_ids, response_ids, E) -> tuple[np.ndarray, np.ndarray]:
    """(A_soft, A_resp), each [n_layers, n_heads, len(prompt)]: the two attention maps the loss compares."""
    E = _soft(E, _core_model(model).config["hidden"])
    return Pair(model, prompt_ids, response_ids, max_soft=E.shape[0]).attention_maps(E)


def token_embeddings(model, ids) -> np.ndarray:
    """Input embedding rows [len(ids), hidden] of the model (float32)."""
    return _core.token_embeddings(_core_model(model), _ids(ids, "ids"))


def init_soft(model, n_soft: int, init: Union[str, Sequence[int]] = "random",
              rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """Initial soft embeddings [n_soft, hidden]:
    "random": N(0, s^2) with s the standard deviation of the token embedding matrix;
    "mean": every row the mean token embedding;
    token ids (a sequence of n_soft ids, or fewer, repeated): those tokens' embeddings."""
    core = _core_model(model)
    if isinstance(n_soft, bool) or not isinstance(n_soft, (int, np.integer)) or n_soft < 1:
        raise ValueError(f"n_soft must be a positive integer, got {n_soft!r}")
    vocab, hidden = core.config["vocab"], core.config["hidden"]
    if isinstance(init, str):
        if init not in ("random", "mean"):
            raise ValueError(f"init must be 'random', 'mean' or a sequence of token ids, got {init!r}")
        table = _core.token_embeddings(core, np.arange(vocab, dtype=np.int64))
        if init == "mean":
            return np.repeat(table.mean(axis=0, dtype=np.float64)[None], n_soft, axis=0).astype(np.float32)
        rng = rng if rng is not None else np.random.default_rng(0)
        return (rng.standard_normal((n_soft, hidden)) * float(table.std())).astype(np.float32)
    ids = _ids(list(init), "init token ids")
    ids = np.resize(ids, n_soft)
    return token_embeddings(core, ids)


# -- data ------------------------------------------------------------------------------------------
