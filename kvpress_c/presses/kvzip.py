from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import BasePress

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
PREV_POSTFIX = 8  # tokens of the previous chunk that start a later chunk's prompt


@dataclass
class KVzipPress(BasePress):
    """KVzip (arXiv 2505.23416): query-agnostic KV eviction by context reconstruction (kvpress's KVzipPress).

    After the context's full prefill, the model is asked to repeat it: "Repeat the previous context
    exactly." + the chat template's generation prompt + the context, in chunks of `chunk_size` tokens
    (a later chunk's prompt asks to continue from the previous chunk's last 8 tokens). Each context row
    scores the most attention any reconstruction query of its KV head gives it (softmax over the sinks,
    the chunk and the reconstruction rows); the reconstruction rows are then dropped and the lowest
    scores evicted: over all layers and heads at once (`layerwise=False`, per-layer ratios differ) or
    `compression_ratio` of every layer. The first `n_sink` rows are kept. `kvzip_plus_normalization`:
    KVzip+, each query's attention divided by its normed hidden state's norm and each row's multiplied by
    ||v W_o|| of that query head. Costs a second forward of about the context's length (kvpress warns the
    same). The chat template (prefix and generation prompt) comes from the model's tokenizer.
    """
    compression_ratio: float = 0.0
    layerwise: bool = False
    n_sink: int = 4
    kvzip_plus_normalization: bool = False
    chunk_size: int = 2048

    attach_to_session = False

    def __post_init__(self):
        r = self.compression_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise ValueError(f"compression_ratio must be in [0, 1), got {r!r}")
        for name, low in (("chunk_size", 1), ("n_sink", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")

    def c_config(self) -> dict:
        return {}

    @property
    def is_noop(self) -> bool:
        return self.compression_ratio == 0

    # -- the reconstruction prompts ---------------------------------------------------------------
    @staticmethod
    def template_parts(tokenizer) -> tuple[list[int], list[int]]:
        """(prefix ids, generation-prompt suffix ids) of the chat template around a user message
        (kvpress: a dummy message split at a separator); no template: no prefix and "\\n"."""
        if tokenizer.chat_template is None:
            return [], tokenizer.encode("\n")
        from ..chat import render_chat
        dummy = "dummy context"
        sep = "\n" + "#" * len(dummy)
        bos = tokenizer.id_to_token(tokenizer.bos_id) if tokenizer.bos_id is not None and tokenizer.bos_id >= 0 else ""
        eos = tokenizer.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None and tokenizer.eos_id >= 0 else ""
        text = render_chat(tokenizer.chat_template, [{"role": "user", "content": dummy + sep}],
                           add_generation_prompt=True, bos_token=bos, eos_token=eos, enable_thinking=False)
        head, suffix = text.split(sep)
        return tokenizer.encode(head.split(dummy)[0]), tokenizer.encode(suffix)

    def chunks(self, tokenizer, ids, first: int = 0) -> list[tuple[int, int, np.ndarray]]:
        """(start, end, reconstruction ids) per chunk of the context's positions after the template's prefix, from
        position `first` on (a conversation's turn: its own text). The context's first chunk asks to repeat the
        context; a later one (a later turn's first included) to repeat the part starting with the 8 tokens before."""
        prefix, suffix = self.template_parts(tokenizer)
        ids = [int(i) for i in ids]
        out = []
        for start in range(max(first, len(prefix)), len(ids), self.chunk_size):
            end = min(start + self.chunk_size, len(ids))
            if start <= len(prefix):
                q = tokenizer.encode(FIRST_PROMPT)
            else:
                q = tokenizer.encode(NEXT_PROMPT) + ids[max(0, start - min(PREV_POSTFIX, self.chunk_size)):start]
            out.append((start, end, np.asarray(q + suffix + ids[start:end], dtype=np.int32)))
        return out

    # -- scoring and eviction on a full cache ---------------------------------------------------------
    def scores(self, session, ids, first: int = 0) -> np.ndarray:
        """float32 [L, Hkv, n - first]: KVzip's score of the rows the session holds at positions [first, n) of the
        context `ids` (its cache full or compressed), by position - first (0 for the template's prefix, as in
        kvpress, and where a head holds no row)."""
        from ..model import tokenizer_of
        c = session.model.config
        out = np.zeros((c["n_layers"], c["n_kv_heads"], len(ids) - first), dtype=np.float32)
        for start, end, rep in self.chunks(tokenizer_of(session.model), ids, first):
            out[:, :, start - first:end - first] = self._chunk_scores(session, rep, start, end)
        return out

    def _chunk_scores(self, session, rep, start: int, end: int) -> np.ndarray:
        return session.kvzip_score(rep, start, end, n_sink=self.n_sink, plus=self.kvzip_plus_normalization)

    def compresses_full_cache(self, ids, question_ids=None) -> bool:
        return True  # KVzip always scores the full cache after the prefill

    def compress_full_cache(self, session, ids, config: dict, question_ids=None) -> None:
        if self.compression_ratio > 0:
            session.kvzip_evict(self.scores(session, ids), float(self.compression_ratio), layerwise=self.layerwise,
                                n_sink=self.n_sink)

    def prefill_turn(self, session, ids, first: int, config: dict):
        """A conversation's turn: the turn's tokens prefilled, then KVzip on the session's cache: the session's press
        scope 'call' reconstructs the turn's text and evicts among its rows (the earlier turns' stay), 'cache' the
        whole conversation's text over every row held (a ratio compounds over the turns)."""
        ids = np.asarray(ids, dtype=np.int32)
        if session.position != first:
            raise NotImplementedError(f"{type(self).__name__}: the session holds {session.position} positions, the conversation's "
                             f"text {first} tokens (rows without text, RestoreKV's restore rows?): KVzip reconstructs the text at its "
                                      "positions")
        logits = session.forward(ids[first:], logits="last")
        lo = first if session.press_scope() == "call" else 0
        if self.compression_ratio > 0:
            session.kvzip_evict(self.scores(session, ids, lo), float(self.compression_ratio), layerwise=self.layerwise,
                                n_sink=self.n_sink, first=lo)
        return logits

    def prefill(self, session, ids, config: dict, question_ids=None):
        ids = np.asarray(ids, dtype=np.int32)
        logits = session.forward(ids, logits="last")
        self.compress_full_cache(session, ids, config, question_ids)
        return logits
