from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from .base import BasePress, c_check, check_budget, check_choice, check_int


def load_soft_embeddings(source) -> np.ndarray:
    """Soft-token embeddings [n_soft, hidden] from an array, a .npy file or a .safetensors file
    (first tensor, or the one named 'soft_embeddings')."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise FileNotFoundError(f"soft embeddings file '{path}' does not exist")
        if path.endswith(".npy"):
            arr = np.load(path, allow_pickle=False)
        elif path.endswith(".safetensors"):
            from ._tensor_files import read_tensors
            tensors = read_tensors(path)
            if not tensors:
                raise ValueError(f"{path} holds no tensor")
            arr = tensors.get("soft_embeddings", next(iter(tensors.values())))
        else:
            raise ValueError(f"soft embeddings must be a .npy or .safetensors file, got '{path}'")
    else:
        arr = source
    arr = np.asarray(arr)
    if arr.ndim != 2 or arr.shape[0] < 1:
        raise ValueError(f"soft embeddings must be a 2-D array [n_soft, hidden], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating) or not np.all(np.isfinite(arr)):
        raise ValueError("soft embeddings must be finite floats")
    return np.ascontiguousarray(arr, dtype=np.float32)


@dataclass
class _QueryRowsPress(BasePress):
    """Score the prompt with the queries of extra rows appended after it (soft tokens or a response),
    keep the top tokens, then drop the extra rows' K/V and continue at position len(prompt)."""
    compression_ratio: float = 0.0
    budget: Optional[int] = None
    kernel_size: int = 5
    pooling: str = "avg"
    gqa_reduce: str = "mean"

    attach_to_session = False

    def _validate(self):
        check_budget(self.compression_ratio, self.budget)
        check_int("kernel_size", self.kernel_size)
        check_choice("pooling", self.pooling, ("avg", "max"))
        check_choice("gqa_reduce", self.gqa_reduce, ("mean", "max"))
        c_check({**self.c_config(), "window": 1})  # the window is the extra rows, known at prefill

    def c_config(self) -> dict:
        return {"scorer": "snapkv", "compression_ratio": float(self.compression_ratio),
                "budget": int(self.budget or 0), "kernel": self.kernel_size, "pool_max": int(self.pooling == "max"),
                "gqa_max": int(self.gqa_reduce == "max"), "drop_window": 1}

    def _prefill_with_rows(self, session, ids, n_extra: int, ids_extra=None, embeddings=None, n_prompt=None):
        """Forward `ids` then the n_extra rows with the press attached (its window = the extra rows),
        detach it and continue at position n_prompt: len(ids), or given when `ids` is empty because the
        session already holds the prompt. Returns the logits of the last prompt token (None then)."""
        ids = np.asarray(ids, dtype=np.int32)
        n_prompt = len(ids) if n_prompt is None else n_prompt
        all_ids = ids if ids_extra is None else np.concatenate([ids, np.asarray(ids_extra, dtype=np.int32)])
        session.set_press(window=n_extra, **self.c_config())
        try:
            logits = session.forward(all_ids if len(all_ids) else None, embeddings=embeddings,
                                     logits=len(ids) - 1 if len(ids) else "none")
        finally:
            session.set_press(None)
        session.set_position(n_prompt)
        return logits


@dataclass
class JudgeQPress(_QueryRowsPress):
    """Judge Q (JudgeQ-trainable-queries.txt): trainable soft tokens appended after the prompt; their
    queries score the prompt keys (attention restricted to prompt positions, not renormalised, mean over
    the soft tokens, SnapKV pooling and GQA settings); the top tokens are kept, the soft tokens' K/V are
    dropped and decoding continues at position len(prompt).

    soft_embeddings: array [n_soft, hidden], or a .npy / .safetensors path.
    """
    soft_embeddings: Union[np.ndarray, str, None] = field(default=None, repr=False)

    def __post_init__(self):
        self._validate()
        if self.soft_embeddings is None:
            raise ValueError("JudgeQPress needs soft_embeddings (an array or a .npy/.safetensors file); "
                             "JudgeQPress.default_for(model) loads the trained file for a known model")
        self.soft_embeddings = load_soft_embeddings(self.soft_embeddings)

    @property
    def n_soft(self) -> int:
        return self.soft_embeddings.shape[0]

    @classmethod
    def default_for(cls, model, **kwargs) -> "JudgeQPress":
        """The soft tokens trained for `model` and shipped with kvpress_c (kvpress_c/data/)."""
        from .._paths import PACKAGE_DIR
        name = os.path.basename(model.path).rsplit(".", 1)[0]
        path = os.path.join(PACKAGE_DIR, "data", f"judgeq_{name}.npy")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no trained Judge Q soft tokens ship for '{name}' ({path}); train them with "
                                    "`python -m kvpress_c judgeq train` and pass soft_embeddings=")
        return cls(soft_embeddings=path, **kwargs)

    def _check_width(self, config: dict) -> None:
        if self.soft_embeddings.shape[1] != config["hidden"]:
            raise ValueError(f"soft embeddings have width {self.soft_embeddings.shape[1]}, the model's hidden size is "
                             f"{config['hidden']}")

    def prefill(self, session, ids, config: dict, question_ids=None):
        self._check_width(config)
        return self._prefill_with_rows(session, ids, self.n_soft, embeddings=self.soft_embeddings)

    def compresses_full_cache(self, ids, question_ids=None) -> bool:
        # the prompt's K/V do not depend on the soft tokens, so the soft rows can run after a shared
        # prefill, on a copy of its full cache (the press hook treats a 1-row call as decoding)
        return self.n_soft >= 2

    def compress_full_cache(self, session, ids, config: dict, question_ids=None) -> None:
        """The soft rows run after the prompt's full cache; the press scores with their queries and
        keeps the top prompt tokens; the soft rows go. Same cache as prefill()."""
        self._check_width(config)
        self._prefill_with_rows(session, [], self.n_soft, embeddings=self.soft_embeddings, n_prompt=len(ids))


@dataclass
class ResponseGuidedPress(_QueryRowsPress):
    """Oracle from the Judge Q paper: the prompt is scored by the queries of the response the model
    gives with the full cache (`response_ids`, or a greedy continuation of `max_response_tokens`
    computed here), then those rows are dropped. An upper reference for query-agnostic presses."""
    response_ids: Optional[Sequence[int]] = None
    max_response_tokens: int = 32

    def __post_init__(self):
        self._validate()
        if isinstance(self.max_response_tokens, bool) or not isinstance(self.max_response_tokens, int) \
                or self.max_response_tokens < 1:
            raise ValueError("max_response_tokens must be a positive integer")

    def response_for(self, session, ids) -> np.ndarray:
        if self.response_ids is not None:
            return np.asarray(self.response_ids, dtype=np.int32)
        from .. import _core
        full = _core.Session(session.model, len(ids) + self.max_response_tokens)
        logits = full.forward(np.asarray(ids, dtype=np.int32), logits="last")
        out = []
        for _ in range(self.max_response_tokens):
            out.append(int(np.argmax(logits)))
            logits = full.forward(np.array(out[-1:], dtype=np.int32), logits="last")
        return np.asarray(out, dtype=np.int32)

    def prefill(self, session, ids, config: dict, question_ids=None):
        resp = self.response_for(session, ids)
        return self._prefill_with_rows(session, ids, len(resp), ids_extra=resp)
