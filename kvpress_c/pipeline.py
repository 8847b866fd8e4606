"""Pipeline: context + question(s) -> answers with a compressed KV cache, like kvpress's pipeline.

The context is prefilled once with the press attached (each layer compressed right after its
attention, evicted for real); each question is then prefilled after the compressed context and
answered greedily, and the cache is cut back to the compressed context before the next question.
Question-aware mode puts the question inside the compressed prompt instead.
A result keeps its compressed context's cache (`PipelineResult.save_cache(path)` writes it to a file) and
`Pipeline(model)(question=..., cache=path)` answers from such a file without a prefill (kvpress_c/saved.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from .model import Model, greedy_many, warn_past_context
from .presses.base import BasePress


@dataclass
class PipelineResult:
    answers: list[str]
    stats: dict
    kept_indices: list[list[np.ndarray]] = field(repr=False, default_factory=list)
    press_errors: Optional[list[float]] = field(repr=False, default=None)
    # the compressed context's cache: (session, prompt ids, press, (decoding press, its config) or None, chat,
    # the context's text)
    _context: Optional[tuple] = field(repr=False, default=None, compare=False)

    @property
    def answer(self) -> str:
        return self.answers[0]

    def save_cache(self, path) -> None:
        """Write the compressed context's cache (before any question: the same cache every question of the
        run started from) to `path`, with the prompt's token ids, the press and a decoding press's settings;
        `Pipeline(model)(question=..., cache=path)` or `kvpress_c.load_session(model, path)` read it back."""
        if self._context is None:
            raise ValueError("this result holds no question-free cache to save: query_aware=True compresses each "
                             "question with the context, or the cache was released")
        from .saved import save_session
        session, prompt_ids, press, decoding, chat, context = self._context
        save_session(session, path, prompt_ids=prompt_ids, press=press, decoding=decoding, chat=chat,
                     metadata={"context": context})

    def release_cache(self) -> None:
        """Free the compressed context's cache this result keeps (save_cache is then unavailable)."""
        self._context = None


def question_list(question: str, questions) -> list:
    """The questions of a call: question= or questions=, not both, and at least one."""
    if questions is None:
        return [question]
    if question:
        raise ValueError("give question= or questions=, not both")
    if not questions:
        raise ValueError("questions is empty")
    return list(questions)


class Pipeline:
    """`Pipeline(model)(context, question=..., press=..., max_new_tokens=...)`.

    kv_cache: the K/V storage type of the pipeline's sessions ("model": the model's; None, "f32", "f16",
    "bf16", "q8_0" or kvpress_c.QuantizedCache(...): kvpress_c.kv_cache)."""

    def __init__(self, model: Model, kv_cache="model"):
        if not isinstance(model, Model):
            raise TypeError("Pipeline(model): model must be a kvpress_c.Model (kvpress_c.load_model(...))")
        self.model = model
        if not (isinstance(kv_cache, str) and kv_cache == "model"):
            from .kv_cache import kv_format
            kv_format(kv_cache)  # refused here, not at the first call
        self.kv_cache = kv_cache

    def new_session(self, kv_cache="pipeline"):
        """An empty session of the pipeline's model in the pipeline's K/V type (or the kv_cache given)."""
        return self.model.new_session(0, kv_cache=self.kv_cache if isinstance(kv_cache, str) and kv_cache == "pipeline"
                                      else kv_cache)

    # -- prompt construction (kvpress semantics) --------------------------------------------------
    def split_prompt(self, context: str, question: str, answer_prefix: str = "",
                     chat: bool = True) -> tuple[list[int], list[int]]:
        """Token ids of the context part and of the question part (question + rest of the chat
        template + answer_prefix), split where kvpress splits them. chat=False: the raw text (BOS if
        the model adds one), for benchmarks that do not wrap some tasks in the chat template."""
        from .chat import split_context_question
        tok = self.model.tokenizer
        if not chat:
            ctx_ids = ([tok.bos_id] if getattr(tok, "add_bos", False) and tok.bos_id is not None and tok.bos_id >= 0
                       else []) + tok.encode(context)
            q_ids = tok.encode(question + answer_prefix)
            if not q_ids:  # nothing after the context: the last context token starts the answer
                ctx_ids, q_ids = ctx_ids[:-1], ctx_ids[-1:]
            return ctx_ids, q_ids
        ctx_text, suffix = split_context_question(
            tok.chat_template, context,
            bos_token=tok.id_to_token(tok.bos_id) if tok.bos_id is not None and tok.bos_id >= 0 else "",
            eos_token=tok.id_to_token(tok.eos_id) if tok.eos_id is not None and tok.eos_id >= 0 else "")
        ctx_ids = tok.encode(ctx_text)
        q_ids = tok.encode(question + suffix + answer_prefix)
        return ctx_ids, q_ids

    # -- run ----------------------------------------------------------------------------------------
    def compress(self, context: str, press: Optional[BasePress] = None, chat: bool = True) -> PipelineResult:
        """Compress a context alone, without a question (query-agnostic): a result whose save_cache(path)
        writes the cache that questions are answered from later (Pipeline(model)(question=..., cache=path))."""
        return self.run_many(context, "", None, [press], 0, chat=chat)[0]

    def __call__(self, context: str = "", question: str = "", questions: Optional[Sequence[str]] = None,
                 press: Optional[BasePress] = None, max_new_tokens: int = 50, answer_prefix: str = "",
                 query_aware: bool = False, record_scores: bool = False, cache=None) -> PipelineResult:
        """cache=path: answer from a saved cache (PipelineResult.save_cache, Session.save) without a prefill;
        `context` may then be left out (given, it must be the saved prompt's), `press` only where the file
        asks for its decoding press (kvpress_c.load_session)."""
        if cache is not None:
            return self._from_cache(cache, context, question, questions, press, max_new_tokens, answer_prefix,
                                    query_aware, record_scores)
        return self.run_many(context, question, questions, [press], max_new_tokens, answer_prefix,
                             query_aware, record_scores)[0]

    def _from_cache(self, path, context, question, questions, press, max_new_tokens, answer_prefix, query_aware,
                    record_scores) -> PipelineResult:
        from .saved import load_session_info
        if query_aware:
            raise ValueError("query_aware=True compresses the question with the context: a saved cache answers "
                             "questions after its context (query_aware=False)")
        questions = question_list(question, questions)
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        t0 = time.perf_counter()
        session, info = load_session_info(self.model, path, press)
        load_s = time.perf_counter() - t0
        chat = info.get("chat", True)
        prompt = info.get("prompt_ids")
        if context:
            ctx_ids = self.split_prompt(context, questions[0], answer_prefix, chat)[0]
            if prompt is not None and list(ctx_ids) != list(prompt):
                raise ValueError(f"the context given is not the one the cache at '{path}' was saved from "
                                 f"({len(ctx_ids)} tokens here, {len(prompt)} in the file)")
        parts = [(prompt or [], self.split_prompt(context or "", q, answer_prefix, chat)[1]) for q in questions]
        n_prompt = len(prompt) if prompt is not None else session.position
        warn_past_context(self.model, session.position + max(len(q) for _, q in parts) + max_new_tokens)
        decoding = None
        if info.get("decoding_press"):
            saved = info["decoding_press"]
            decoding = (press, saved["config"]) if press is not None else (None, saved["config"])
        results = self._answer_all([[(session, None, 0.0, n_prompt, False)]], parts, False, max_new_tokens,
                                   set(self.model.tokenizer.stop_ids), record_scores, [decoding], chat, None,
                                   info.get("context", context or ""))
        results[0].stats["load_s"] = load_s
        results[0].stats["cache_file"] = str(path)
        return results[0]

    def run_many(self, context: str, question: str = "", questions: Optional[Sequence[str]] = None,
                 presses: Sequence[Optional[BasePress]] = (None,), max_new_tokens: int = 50,
                 answer_prefix: str = "", query_aware: bool = False,
                 record_scores: bool = False, chat: bool = True, kv_caches: Optional[Sequence] = None
                 ) -> list[PipelineResult]:
        """Answer the same prompt under several presses (None = full cache), one result per press.

        kv_caches: one K/V storage type per press (kvpress_c.kv_cache; "pipeline": the pipeline's), default the
        pipeline's for all. The prompt's forward does not depend on the type (a call's own rows are read exact),
        so presses in different types still share it, each session storing the rows in its own type.

        Presses that act after each layer (every scorer press, Ada-KV, ChunkKV, EDIE/TADA...) share
        a single prefill: the forward runs once and each press compresses its own copy of every
        layer's K/V (Session.forward_shared), which gives the same caches as separate runs at the
        cost of one. Judge Q, and TAKE on a prompt of one chunk, then take a copy of the full cache, one
        press at a time, and run only their soft rows or probes on it. TAKE on a longer prompt changes
        the forward itself and runs its own prefill."""
        questions = question_list(question, questions)
        presses = list(presses)
        if not presses:
            raise ValueError("presses is empty")
        for press in presses:
            if press is not None and not isinstance(press, BasePress):
                raise TypeError(f"press must be a kvpress_c press (e.g. SnapKVPress(compression_ratio=0.5)), got {press!r}")
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        kv_caches = self._kv_caches(kv_caches, len(presses))
        stop_ids = set(self.model.tokenizer.stop_ids)
        device = getattr(self.model, "device", "cpu")
        if device != "cpu":  # device peaks are per run
            from . import _core
            _core.reset_peak(device)
        parts = [self.split_prompt(context, q, answer_prefix, chat) for q in questions]
        warn_past_context(self.model, len(parts[0][0]) + max(len(q) for _, q in parts) + max_new_tokens)
        per_press = [[] for _ in presses]  # per press: one (session, logits, prefill_s, n, shared) per prompt
        prompts = [list(parts[0][0])] if not query_aware else [list(c) + list(q) for c, q in parts]
        # a press acts on the prefill (prefill_part) and/or while decoding (decoding_config)
        # (the press, its settings): the press also hands the session what its settings cannot carry (before_decoding)
        decoding = [(p, p.decoding_config()) if p is not None and p.decoding_config() else None for p in presses]
        originals = list(presses)
        presses = [p.prefill_part if p is not None else None for p in presses]
        for pi, ids in enumerate(prompts):
            q_ids = parts[pi][1] if query_aware else None
            for k, entry in self._prefill_all(ids, presses, record_scores, q_ids, decoding, kv_caches):
                per_press[k].append(entry)
        return self._answer_all(per_press, parts, query_aware, max_new_tokens, stop_ids, record_scores, decoding, chat,
                                originals, context, kv_caches)

    def _kv_caches(self, kv_caches, n: int) -> list:
        """One K/V type per press ("pipeline" where none is given), each checked before any prefill."""
        if kv_caches is None:
            return ["pipeline"] * n
        kv_caches = list(kv_caches)
        if len(kv_caches) != n:
            raise ValueError(f"kv_caches gives {len(kv_caches)} K/V types for {n} presses: one per press")
        from .kv_cache import kv_format
        for kv in kv_caches:
            if not (isinstance(kv, str) and kv == "pipeline"):
                kv_format(kv)
        return kv_caches

    @staticmethod
    def _shares_prefill(press, ids, question_ids=None) -> bool:
        return press is None or press.is_noop or press.compresses_full_cache(ids, question_ids) or (
            press.attach_to_session and type(press).prefill is BasePress.prefill)

    def _session(self, press, record_scores: bool, decoding: Optional[tuple] = None, kv_cache="pipeline"):
        session = self.new_session(kv_cache)
        if press is not None and not press.is_noop and press.attach_to_session:
            session.set_press(record_scores=record_scores, **press.c_config())
        if decoding:
            owner, config = decoding
            session.set_decoding_press(**config)
            owner.before_decoding(session, self.model.config)
        return session

    def _prefill_all(self, ids, presses, record, question_ids, decoding, kv_caches):
        """Yield (press index, (session, logits, prefill_s, n_prompt, shared)) for every press."""
        arr = np.asarray(ids, dtype=np.int32)
        cfg = self.model.config
        shared = [k for k, p in enumerate(presses) if self._shares_prefill(p, arr, question_ids)]
        full = [k for k in shared if presses[k] is None or presses[k].is_noop]
        copies = [k for k in shared if k not in full and presses[k].compresses_full_cache(arr, question_ids)]
        if shared == copies and len(copies) == 1:
            shared = []  # alone, its own prefill is as fast and holds one full cache, not two
        if shared:
            sessions = {k: self._session(presses[k], record, decoding[k], kv_caches[k]) for k in shared}
            followers = [k for k in shared if k not in full and k not in copies]
            leader = sessions[full[0]] if full else self.new_session(kv_caches[copies[0]] if copies else "pipeline")
            # the full caches a copying press starts from, one per K/V type (a copy keeps its source's type):
            # other types than the leader's are filled as followers without a press
            fmt = lambda session: tuple(session.kv_format())
            sources = {fmt(leader): leader}
            for k in full[1:] + copies:
                f = fmt(sessions[k])
                if f not in sources:
                    sources[f] = sessions[k] if k in full else self.new_session(kv_caches[k])
            stores = [s for s in sources.values() if s is not leader]
            filled = {id(s) for s in stores}
            for k in followers:
                presses[k].before_prefill(sessions[k], len(arr), cfg)
            t0 = time.perf_counter()
            if followers or stores:
                logits = leader.forward_shared(arr, [sessions[k] for k in followers] + stores)
            else:
                logits = leader.forward(arr, logits="last")
            prefill_s = time.perf_counter() - t0
            for k in followers:
                presses[k].after_prefill(sessions[k], len(arr), cfg)
            extra = {}
            for k in copies:  # one full copy at a time, compressed before the next is made
                t1 = time.perf_counter()
                sessions[k].copy_cache_from(sources[fmt(sessions[k])])
                presses[k].compress_full_cache(sessions[k], arr, cfg, question_ids)
                extra[k] = time.perf_counter() - t1
            for k in full[1:]:  # several full-cache entries: give each its own copy
                if id(sessions[k]) not in filled:
                    sessions[k].copy_cache_from(sources[fmt(sessions[k])])
            del sources, stores  # the extra full caches go once the copies are made
            for k in shared:
                yield k, (sessions[k], logits, prefill_s + extra.get(k, 0.0), len(arr), True)
        for k, press in enumerate(presses):
            if k in shared:
                continue
            session = self._session(press, record, decoding[k], kv_caches[k])
            t0 = time.perf_counter()
            logits = press.prefill(session, arr, cfg, question_ids=question_ids)
            yield k, (session, logits, time.perf_counter() - t0, len(arr), False)

    def _collect(self, session, n_prompt: int, prefill_s: float, shared: bool, record: bool) -> tuple:
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
            # True: this press's cache came from the sample's one shared forward (prefill_s is that
            # forward's, plus the press's own pass for Judge Q and one-chunk TAKE, whose copies held the
            # full cache: run such a press alone for its own peak)
            "shared_prefill": shared,
            "prefill_s": prefill_s,
            "decode_s": 0.0,
            "new_tokens": 0,
        }
        device = getattr(self.model, "device", "cpu")
        if device != "cpu":
            # device bytes of the run so far (weights, KV caches, activations; peaks since the run began)
            from . import _core
            stats["gpu_memory"] = _core.memory_stats(device)
        return kept, stats, errors

    def _answer_all(self, per_press, parts, query_aware, max_new_tokens, stop_ids, record, decoding, chat=True,
                    presses=None, context="", kv_caches=None):
        """Decode every press's answers together (batched decode across the presses' sessions)."""
        collected = [self._collect(s, n, t, shared, record) for s, _, t, n, shared in (e[0] for e in per_press)]
        answers = [[] for _ in per_press]
        for entries in per_press:
            for session, *_ in entries:
                session.set_press(None)
        saved = [(e[0][0].cache_lengths(), e[0][0].position) for e in per_press] if not query_aware else None
        # a decoding press evicts context rows too: the next question starts from a copy of the context (kept
        # after the last question too, for PipelineResult.save_cache)
        contexts = [None] * len(per_press)
        if not query_aware:
            for k, entries in enumerate(per_press):
                if decoding[k]:
                    contexts[k] = self.new_session(kv_caches[k] if kv_caches else "pipeline")
                    contexts[k].copy_cache_from(entries[0][0])
        for qi, (_, q_ids) in enumerate(parts):
            t0 = time.perf_counter()
            if query_aware:
                sessions = [entries[qi][0] for entries in per_press]
                first = [entries[qi][1] for entries in per_press]
            else:
                sessions = [entries[0][0] for entries in per_press]
                first = [s.forward(np.asarray(q_ids, dtype=np.int32), logits="last") for s in sessions]
            outs = greedy_many(sessions, first, max_new_tokens, stop_ids)
            dt = time.perf_counter() - t0
            for k, (out, session) in enumerate(zip(outs, sessions)):
                answers[k].append(self.model.decode(out))
                stats = collected[k][1]
                stats["decode_s"] += dt  # wall time of the batched decode these presses shared
                stats["new_tokens"] += len(out)
                stats["peak_kv_bytes"] = max(stats["peak_kv_bytes"], session.peak_cache_bytes)
                if decoding[k]:  # its rows were evicted while decoding: the next question starts from the copy
                    if contexts[k] is not None and qi + 1 < len(parts):
                        session.reset()  # the decoding press stays attached, its counters cleared
                        session.copy_cache_from(contexts[k])
                elif not query_aware:
                    session.truncate(*saved[k])
        device = getattr(self.model, "device", "cpu")
        if device != "cpu":
            from . import _core
            mem = _core.memory_stats(device)
            for c in collected:
                c[1]["gpu_memory"] = mem
        memory = self.model.memory()  # resident bytes now: weights, cache, scratch, rss
        for c in collected:
            c[1]["memory"] = memory
        kept = [None] * len(per_press)
        if not query_aware:  # the compressed context every question started from
            for k, entries in enumerate(per_press):
                press = presses[k] if presses is not None else None
                kept[k] = (contexts[k] if decoding[k] else entries[0][0], list(parts[0][0]), press, decoding[k], chat,
                           context)
        return [PipelineResult(answers[k], c[1], c[0], c[2], kept[k]) for k, c in enumerate(collected)]
