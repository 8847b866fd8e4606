"""Conversation: a chat over a compressed KV cache that lasts across turns.

    conv = kvpress_c.Conversation(model, press=kvpress_c.SnapKVPress(compression_ratio=0.5))
    conv("My name is Ann and I keep bees.")         # each turn: template, compress, generate
    conv("What do I keep?")
    conv.save("chat.kvc")                            # between turns; Conversation.load(model, "chat.kvc", ...)

Each turn appends the user's message with the model's chat template (the text the template adds after what
the cache holds: the end of the last answer, the user's turn, the assistant's header), runs it through the
session with the press (BasePress.prefill_turn: attached for the forward, or the press's own prefill: TAKE's
chunks with probes, KVzip's reconstruction of the text being compressed), and generates greedily. `compress`
chooses what the press compresses: "new" (the default) this turn's rows only, the cache of earlier turns kept
as it is (the session's press scope 'call', csrc/engine/press_scope.c); "all" every row the cache holds,
earlier turns' included, again at each turn (scope 'cache': a ratio then compounds over the turns; a budget
keeps the cache at its size).
A decoding press is attached at the start of each turn with fresh counters (as at each question of a
Pipeline) and compresses while the answer is generated. A turn too short for the press (shorter than its
observation window, say) is kept whole: `last_turn["compressed"]` is False and `last_turn["why"]` says why.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

import numpy as np

from .model import Model, greedy_many
from .presses.base import BasePress


class Conversation:
    def __init__(self, model: Model, press: Optional[BasePress] = None, compress: str = "new",
                 system: Optional[str] = None, max_new_tokens: int = 256):
        if not isinstance(model, Model):
            raise TypeError("Conversation(model): model must be a kvpress_c.Model (kvpress_c.load_model(...))")
        if press is not None and not isinstance(press, BasePress):
            raise TypeError(f"press must be a kvpress_c press, got {press!r}")
        if compress not in ("new", "all"):
            raise ValueError(f"compress must be 'new' (each turn's rows) or 'all' (the whole cache), got {compress!r}")
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if model.tokenizer.chat_template is None:
            raise ValueError("Conversation needs a model with a chat template")
        self.model, self.press, self.compress, self.max_new_tokens = model, press, compress, max_new_tokens
        self.messages: list[dict] = [{"role": "system", "content": system}] if system is not None else []
        self._prefill = press.prefill_part if press is not None else None
        if self._prefill is not None and (self._prefill.is_noop and type(self._prefill).before_prefill is BasePress.before_prefill):
            self._prefill = None
        why = self._prefill.turn_refusal() if self._prefill is not None else None
        if why is not None:
            raise NotImplementedError(why)
        self._decoding = press.decoding_config() if press is not None else None
        self.session = model.new_session(0)
        self.session.set_press_scope("call" if compress == "new" else "cache")
        self._rendered = ""   # the text the cache holds (the template's, turn after turn)
        self._pending: list[int] = []  # generated tokens not yet in the cache (a turn cut by max_new_tokens)
        self._ids: list[int] = []  # every token id run through the session, in order
        self._context: Optional[str] = None  # a compressed context the first message follows (from_cache)
        self.last_turn: dict = {}

    def __call__(self, message: str, max_new_tokens: Optional[int] = None) -> str:
        return self.say(message, max_new_tokens)

    def say(self, message: str, max_new_tokens: Optional[int] = None) -> str:
        """One turn: the user's message in, the assistant's answer (text) out."""
        if not isinstance(message, str):
            raise TypeError("message must be a string")
        max_new = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        model, session = self.model, self.session
        content = message if self._context is None else self._context + message  # kvpress's context + question
        messages = self.messages + [{"role": "user", "content": content}]
        full = model.apply_chat_template(messages)
        if not full.startswith(self._rendered):
            raise RuntimeError("the chat template renders earlier turns differently once a new one is added: the "
                               "cache cannot be extended by the new text alone")
        ids = self._pending + self._encode(full[len(self._rendered):], first=not self._rendered)
        cfg = model.config
        t0 = time.perf_counter()
        if self._decoding:  # fresh counters at each turn, as at each question of a Pipeline
            session.set_decoding_press(**self._decoding)
            self.press.before_decoding(session, cfg)
        arr = np.asarray(ids, dtype=np.int32)
        compressed, why = self._prefill is not None, ""
        logits = None
        if compressed:
            pos0, lens0 = session.position, session.cache_lengths().copy()
            try:  # the press's turn: in the forward, or its own prefill (TAKE, KVzip); the press scope says which rows
                logits = self._prefill.prefill_turn(session, self._ids + [int(i) for i in ids], len(self._ids), cfg)
            except ValueError as e:
                # the first turn is the press's prefill: its refusal is the caller's to see; a later one's goes in whole
                # where the call was rolled back (a press that refused before anything went into the cache)
                if not self._rendered or session.position != pos0 or not np.array_equal(session.cache_lengths(), lens0):
                    raise
                compressed, why = False, str(e)
        if logits is None:
            logits = session.forward(arr, logits="last")
        prefill_s = time.perf_counter() - t0
        pos0 = session.position
        out = greedy_many([session], [logits], max_new, set(model.tokenizer.stop_ids))[0]
        cached = session.position - pos0
        self._ids += list(ids) + out[:cached]
        self._pending = out[cached:]
        answer = model.decode(out)
        self._rendered = full + answer
        self.messages = messages + [{"role": "assistant", "content": answer}]
        self._context = None
        self.last_turn = {"prompt_tokens": len(ids), "new_tokens": len(out), "compressed": compressed, "why": why,
                          "prefill_s": prefill_s, "decode_s": time.perf_counter() - t0 - prefill_s,
                          "cache_rows": int(session.cache_lengths().sum()), "cache_bytes": session.cache_bytes,
                          "position": session.position}
        return answer

    def _encode(self, text: str, first: bool) -> list[int]:
        tok = self.model.tokenizer
        ids = self.model.encode(text, add_bos=False)
        if first and tok.add_bos and tok.bos_id is not None and tok.bos_id >= 0 and not text.startswith(
                tok.id_to_token(tok.bos_id)):
            ids = [tok.bos_id] + ids
        return ids

    # -- saving -------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the conversation between turns: its cache (exactly), the messages, the text the cache holds,
        the tokens generated but not yet cached, and the press's settings."""
        from .saved import save_session
        state = {"messages": self.messages, "rendered": self._rendered, "pending": self._pending,
                 "compress": self.compress, "max_new_tokens": self.max_new_tokens}
        decoding = (self.press, self._decoding) if self._decoding else None
        # the decoding press goes in by its settings and state (load_session re-attaches it; each turn starts it afresh)
        save_session(self.session, path, prompt_ids=self._ids, press=self.press, decoding=decoding,
                     chat=True, metadata={"conversation": json.dumps(state)})

    @classmethod
    def load(cls, model: Model, path: str | os.PathLike, press: Optional[BasePress] = None,
             compress: Optional[str] = None, max_new_tokens: Optional[int] = None) -> "Conversation":
        """A conversation saved with save(), ready for its next turn; or one that starts from a compressed
        chat context (PipelineResult.save_cache, `python -m kvpress_c compress`): its first message is then
        the question after that context. `press`: the press to go on with (the
        file records the press's settings, not the press object: give it again to keep compressing; None
        goes on uncompressed, apart from a decoding press the file re-attaches)."""
        from .saved import load_session_info
        session, info = load_session_info(model, path, press)
        if "conversation" in info:
            state = json.loads(info["conversation"])
        elif "context" in info and info.get("chat", True) and info.get("prompt_ids") is not None:
            # a compressed context (PipelineResult.save_cache): the first message is its question
            from .chat import split_context_question
            tok = model.tokenizer
            ctx_text = split_context_question(
                tok.chat_template, info["context"],
                bos_token=tok.id_to_token(tok.bos_id) if tok.bos_id is not None and tok.bos_id >= 0 else "",
                eos_token=tok.id_to_token(tok.eos_id) if tok.eos_id is not None and tok.eos_id >= 0 else "")[0]
            if tok.encode(ctx_text) != list(info["prompt_ids"]):
                raise ValueError(f"'{os.fspath(path)}': its context does not encode to the tokens its cache holds")
            state = {"messages": [], "rendered": ctx_text, "pending": [], "compress": "new",
                     "max_new_tokens": 256, "context": info["context"]}
        else:
            raise ValueError(f"'{os.fspath(path)}' holds neither a conversation (Conversation.save) nor a compressed "
                             "chat context (PipelineResult.save_cache)")
        conv = cls(model, press=press, compress=compress or state["compress"],
                   max_new_tokens=state["max_new_tokens"] if max_new_tokens is None else max_new_tokens)
        if press is None and info.get("decoding_press"):
            conv._decoding = info["decoding_press"]["config"]
            conv.press = _SavedDecoding()
        session.set_press_scope(conv.session.press_scope())
        conv.session = session
        conv.messages, conv._rendered, conv._pending = state["messages"], state["rendered"], state["pending"]
        conv._ids = list(info.get("prompt_ids") or [])
        conv._context = state.get("context")
        return conv


class _SavedDecoding(BasePress):
    """A decoding press re-attached from a file by its settings alone (nothing else to hand the session)."""

    def c_config(self) -> dict:
        return {}
