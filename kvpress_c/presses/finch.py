from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .base import BasePress, c_check, check_budget, check_int


@dataclass
class FinchPress(BasePress):
    """kvpress FinchPress (Corallo & Papotti, 2024, "FINCH: Prompt-guided Key-Value Cache Compression for Large
    Language Models", TACL): SnapKV-style scores whose window is the question that follows the context. Each
    window query's attention is multiplied by the number of rows before it (`normalize_scores`), averaged over
    the window and the KV head's query heads, unpooled; the top `int(n * (1 - compression_ratio))` rows are
    kept, per chunk of `chunk_length` when given; the kept keys are re-rotated to positions 0 .. n_kept - 1
    (`rerotate_keys`, KeyRerotationPress's) and, as in kvpress's pipeline, the tokens after the prefill continue
    from position n_kept.

    The window: kvpress puts a new delimiter token between context and question (update_model_and_tokenizer
    adds it to the vocabulary) and drops it from the embeddings. Our vocabularies are fixed, so the delimiter
    is any token id of the vocabulary (`delimiter_token_id`, or update_model_and_tokenizer with a token text
    that encodes to one id) found exactly once in the prompt; it is dropped before the forward, as in kvpress.
    Without one, the pipeline's question (query_aware=True) is the window."""
    compression_ratio: float = 0.0
    chunk_length: Optional[int] = None
    normalize_scores: bool = True
    rerotate_keys: bool = True
    delimiter_token: Optional[str] = field(default=None, init=False)
    delimiter_token_id: Optional[int] = field(default=None, init=False)
    window_size: Optional[int] = field(default=None, init=False)

    def __post_init__(self):
        check_budget(self.compression_ratio, None)
        if self.chunk_length is not None:
            check_int("chunk_length", self.chunk_length, minimum=1)
        c_check(self.c_config())

    def c_config(self) -> dict:
        # before a prompt sets the window, a one-row window stands in (the prefill sets the press again)
        return {"scorer": "finch", "allocation": "uniform",
                "compression_ratio": float(self.compression_ratio), "budget": 0, "window": int(self.window_size or 1),
                "kernel": 1, "finch_normalize": int(bool(self.normalize_scores)),
                "finch_chunk": int(self.chunk_length or 0)}

    def update_model_and_tokenizer(self, model, tokenizer=None, delimiter_token: str = "<|finch_sep|>"):
        """Use `delimiter_token` (a text the model's tokenizer encodes to exactly one id) as the delimiter."""
        ids = model.encode(delimiter_token, add_bos=False)
        if len(ids) != 1:
            raise ValueError(f"the delimiter {delimiter_token!r} encodes to {len(ids)} tokens: kvpress_c cannot add a "
                             "token to the vocabulary, so pick a text that is one token, or set delimiter_token_id")
        self.delimiter_token, self.delimiter_token_id = delimiter_token, int(ids[0])
        return tokenizer

    def split(self, ids, question_ids=None) -> list:
        """The prompt without its delimiter; sets window_size to the tokens after it (or the question's)."""
        ids = [int(t) for t in ids]
        n_delim = ids.count(self.delimiter_token_id) if self.delimiter_token_id is not None else 0
        if n_delim > 1:
            raise ValueError(f"FinchPress: the delimiter token {self.delimiter_token_id} appears {n_delim} times in the "
                             "prompt; only one should be present")
        if n_delim == 1:
            at = ids.index(self.delimiter_token_id)
            ids = ids[:at] + ids[at + 1:]
            self.window_size = len(ids) - at
        elif question_ids is not None and len(question_ids) > 0:
            self.window_size = len(question_ids)
        else:
            raise ValueError("FinchPress needs the question in the prompt: run the pipeline with query_aware=True, or put "
                             "delimiter_token_id between the context and the question")
        if self.window_size < 1:
            raise ValueError("FinchPress: no window detected (nothing follows the delimiter)")
        return ids

    def prefill(self, session, ids, config: dict, question_ids=None):
        ids = self.split(ids, question_ids)
        session.set_press(**self.c_config())
        if self.rerotate_keys:
            session.set_press_array("key_rerotation", 1)
        logits = session.forward(np.asarray(ids, dtype=np.int32), logits="last")
        if self.rerotate_keys:  # as kvpress's pipeline: what follows the re-rotated cache continues from its length
            session.set_position(int(session.cache_lengths().max()))
        return logits
