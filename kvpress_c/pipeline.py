"""Pipeline: context + question(s) -> answers with a compressed KV cache, like kvpress's pipeline.

The context is prefilled once with the press attached (each layer compressed right after its
attention, evicted for real); each question is then prefilled after the compressed context and
answered greedily, and the cache is cut back to the compressed context before the next question.
Question-aware mode puts the question inside the compressed prompt instead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from .model import Model, greedy
from .presses.base import BasePress


@dataclass
class PipelineResult:
    answers: list[str]
    stats: dict
    kept_indices: list[list[np.ndarray]] = field(repr=False, default_factory=list)
    press_errors: Optional[list[float]] = field(repr=False, default=None)

    @property
    def answer(self) -> str:
        return self.answers[0]


class Pipeline:
    """`Pipeline(model)(context, question=..., press=..., max_new_tokens=...)`."""

    def __init__(self, model: Model):
        if not isinstance(model, Model):
            raise TypeError("Pipeline(model): model must be a kvpress_c.Model (kvpress_c.load_model(...))")
        self.model = model

    # -- prompt construction (kvpress semantics) --------------------------------------------------
    def split_prompt(self, context: str, question: str, answer_prefix: str = "") -> tuple[list[int], list[int]]:
        """Token ids of the context part and of the question part (question + rest of the chat
        template + answer_prefix), split where kvpress splits them."""
        from .chat import split_context_question
        tok = self.model.tokenizer
        ctx_text, suffix = split_context_question(
            tok.chat_template, context,
            bos_token=tok.id_to_token(tok.bos_id) if tok.bos_id is not None and tok.bos_id >= 0 else "",
            eos_token=tok.id_to_token(tok.eos_id) if tok.eos_id is not None and tok.eos_id >= 0 else "")
        ctx_ids = tok.encode(ctx_text)
        q_ids = tok.encode(question + suffix + answer_prefix)
        return ctx_ids, q_ids

    # -- run ----------------------------------------------------------------------------------------
    def __call__(self, context: str, question: str = "", questions: Optional[Sequence[str]] = None,
                 press: Optional[BasePress] = None, max_new_tokens: int = 50, answer_prefix: str = "",
                 query_aware: bool = False, record_scores: bool = False) -> PipelineResult:
        if questions is None:
            questions = [question]
        elif question:
            raise ValueError("give question= or questions=, not both")
        if not questions:
            raise ValueError("questions is empty")
        if press is not None and not isinstance(press, BasePress):
            raise TypeError(f"press must be a kvpress_c press (e.g. SnapKVPress(compression_ratio=0.5)), got {press!r}")
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        stop_ids = set(self.model.tokenizer.stop_ids)
        parts = [self.split_prompt(context, q, answer_prefix) for q in questions]
        if query_aware:
            return self._run_aware(parts, press, max_new_tokens, stop_ids, record_scores)
        return self._run_agnostic(parts, press, max_new_tokens, stop_ids, record_scores)

    def _session(self, n_tokens: int, press, record_scores: bool):
        session = self.model.new_session(0)
        if press is not None and not press.is_noop and press.attach_to_session:
            session.set_press(record_scores=record_scores, **press.c_config())
        return session

    def _compressed_prefill(self, session, ids, press, question_ids=None) -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        if press is None or press.is_noop:
            logits = session.forward(np.asarray(ids, dtype=np.int32), logits="last")
        else:
            logits = press.prefill(session, ids, self.model.config, question_ids=question_ids)
        return logits, time.perf_counter() - t0

    def _collect(self, session, n_prompt: int, prefill_s: float, decode_s: float, record: bool) -> tuple:
        cfg = self.model.config
        L, Hkv = cfg["n_layers"], cfg["n_kv_heads"]
        kept = [[session.cache_positions(l, h) for h in range(Hkv)] for l in range(L)]
        kept_total = sum(len(k) for row in kept for k in row)
        errors = None
        if record:
            try:
                errors = [session.press_error(l) for l in range(L)]
            except ValueError:  # no press attached (full cache, or a press with its own prefill)
                errors = None
        stats = {
            "prompt_tokens": n_prompt,
            "kept_tokens": kept_total / (L * Hkv),
            "kept_tokens_total": kept_total,
            "compression_ratio": 1.0 - kept_total / (n_prompt * L * Hkv),
            "cache_bytes": session.cache_bytes,
            "peak_kv_bytes": session.peak_cache_bytes,
            "prefill_s": prefill_s,
            "decode_s": decode_s,
        }
        return kept, stats, errors

    def _run_agnostic(self, parts, press, max_new_tokens, stop_ids, record):
        ctx_ids = parts[0][0]
        session = self._session(len(ctx_ids), press, record)
        _, prefill_s = self._compressed_prefill(session, ctx_ids, press)
        kept, stats, errors = self._collect(session, len(ctx_ids), prefill_s, 0.0, record)
        session.set_press(None)
        lengths, position = session.cache_lengths(), session.position
        answers, decode_s = [], 0.0
        for _, q_ids in parts:
            t0 = time.perf_counter()
            logits = session.forward(np.asarray(q_ids, dtype=np.int32), logits="last")
            gen = greedy(session, q_ids, max_new_tokens, stop_ids, first_logits=logits)
            decode_s += time.perf_counter() - t0
            answers.append(self.model.decode(gen.ids))
            session.truncate(lengths, position)
        stats["decode_s"] = decode_s
        stats["peak_kv_bytes"] = session.peak_cache_bytes
        return PipelineResult(answers, stats, kept, errors)

    def _run_aware(self, parts, press, max_new_tokens, stop_ids, record):
        answers, first = [], None
        for ctx_ids, q_ids in parts:
            ids = list(ctx_ids) + list(q_ids)
            session = self._session(len(ids), press, record)
            logits, prefill_s = self._compressed_prefill(session, ids, press, question_ids=q_ids)
            if first is None:
                first = self._collect(session, len(ids), prefill_s, 0.0, record)
            session.set_press(None)
            t0 = time.perf_counter()
            gen = greedy(session, ids, max_new_tokens, stop_ids, first_logits=logits)
            first[1]["decode_s"] += time.perf_counter() - t0
            first[1]["peak_kv_bytes"] = max(first[1]["peak_kv_bytes"], session.peak_cache_bytes)
            answers.append(self.model.decode(gen.ids))
        kept, stats, errors = first
        return PipelineResult(answers, stats, kept, errors)
