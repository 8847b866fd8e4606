"""Saved caches: a session's (compressed) KV cache in a file, loaded back without a prefill.

    session.save("ctx.kvc")                                   # _core.Session.save: the cache, exactly
    session = kvpress_c.load_session(model, "ctx.kvc")        # a new session holding it
    kvpress_c.cache_info("ctx.kvc")                           # what the file says (checked)

The file is safetensors (csrc/persist/cache_file.h has the layout): per layer and KV head the rows, their
positions, K/V as read back from the store (F32, F16 or BF16: the store's own float type, F32 for q8_0 and
KIVI's decoded values), ThinK's freed key channels; the position; the K/V storage type (a load gives the session
that type: f16 and bf16 come back exactly, q8_0 and KIVI quantise the decoded rows again); the attached presses'
state between calls (a decoding press's counters, buffered queries and score queues: a cache saved mid-answer goes
on as the session that saved it); the model's identity (its configuration and a SHA-256 of its weight files); a
SHA-256 of the whole file; and what the Python side adds: the prompt's token ids, the press's settings and a
decoding press's settings (re-attached on load, then given its saved state). A file of another model, of an
older or newer format version, truncated or corrupt: ValueError saying which.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from . import _core

FORMAT_VERSION = 3  # KVC_CACHE_FILE_VERSION (3: the K/V storage type, kvc.kv_cache; 2: the presses' state)


def cache_info(path: str | os.PathLike) -> dict:
    """The metadata of a saved cache, checked as a load checks it (digest, format version): `version`,
    `position`, `dtype` (of the K/V tensors: F32, F16 or BF16), `kv_cache` (the storage type it was saved in and
    a load restores: None for the device's own, "f32", "f16", "bf16", "q8_0" or a QuantizedCache; None in a
    version 1 file, which loads in the session's type), `device` it was saved on,
    `model_config`, `model_digest`, `attached` (presses attached when it was saved), and where the Python
    side saved them `prompt_ids`, `press`, `decoding_press`, `chat`; other keys as saved (strings: a
    pipeline's `context`, a conversation's `conversation`)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no saved cache at '{path}'")
    raw = json.loads(_core.cache_file_metadata(path))
    info = {"version": int(raw.pop("kvc.version")), "position": int(raw.pop("kvc.position")),
            "dtype": raw.pop("kvc.dtype"), "device": raw.pop("kvc.device"),
            "model_config": json.loads(raw.pop("kvc.model_config")), "model_digest": raw.pop("kvc.model_digest"),
            "attached": [a for a in raw.pop("kvc.presses", "").split(",") if a],
            "kv_cache": _kv_cache(raw.pop("kvc.kv_cache", "native"))}
    for key in ("kvc.format", "kvc.digest"):
        raw.pop(key, None)
    for key in ("prompt_ids", "press", "decoding_press", "chat"):
        if key in raw:
            info[key] = json.loads(raw.pop(key))
    info.update(raw)
    return info


def _kv_cache(name: str):
    """kvc.kv_cache ("native", "q8_0", "kivi4,64,128", ...) as a kv_cache value."""
    from .kv_cache import QuantizedCache
    kind, *rest = name.split(",")
    if kind in ("kivi4", "kivi2"):
        return QuantizedCache(int(kind[-1]), int(rest[0]), int(rest[1]))
    return None if kind == "native" else kind


def _hands_more_than_settings(owner, config: dict) -> bool:
    """Whether a decoding press gives the session more than its settings (before_decoding calls a session
    method: given statistics): then the file cannot re-attach it alone and load_session needs the press."""
    calls = []

    class _Recorder:
        def __getattr__(self, name):
            calls.append(name)
            return lambda *a, **k: None

    owner.before_decoding(_Recorder(), config)
    return bool(calls)


def save_session(session, path: str | os.PathLike, prompt_ids: Optional[Sequence[int]] = None, press=None,
                 decoding: Optional[tuple] = None, chat: Optional[bool] = None, metadata: Optional[dict] = None) -> None:
    """session.save(path) with what the Python side knows: the prompt's token ids, the press (its class and
    settings, for the record), the decoding press attached as (press, its decoding_config()) so that a load
    re-attaches it, whether the prompt used the chat template, and any other str -> str metadata."""
    meta = dict(metadata or {})
    if prompt_ids is not None:
        meta["prompt_ids"] = json.dumps([int(i) for i in prompt_ids])
    if press is not None:
        meta["press"] = json.dumps({"class": type(press).__name__, "repr": repr(press)})
    if decoding:
        owner, config = decoding
        # owner None: a decoding press re-attached from a file by its settings alone
        meta["decoding_press"] = json.dumps({"class": type(owner).__name__ if owner is not None else "DecodingPress",
                                             "config": config,
                                             "needs_press": owner is not None and _hands_more_than_settings(owner, config)})
    if chat is not None:
        meta["chat"] = json.dumps(bool(chat))
    session.save(os.fspath(path), meta)


def load_session(model, path: str | os.PathLike, press=None, kv_cache="saved"):
    """A new session of `model` holding the cache saved at `path`, at its saved position, with the decoding
    press it was saved with re-attached in the state it had (a cache saved mid-answer goes on with the logits of
    the session that saved it; one saved between questions holds a fresh state). `press`: the decoding press (or a
    press with a decoding part) to attach instead, with the same settings, needed where the file says the press
    hands the session more than its settings (ExpectedAttentionStats' statistics), and the prefill press where one
    was left attached at the save (the file names the presses attached and holds their state, not their settings).
    kv_cache: the K/V storage type of the session ("saved": the file's; else a kvpress_c.kv_cache value: each row is
    stored as an append stores it, so a cache saved in f32 can be studied in every type)."""
    return load_session_info(model, path, press, kv_cache)[0]


def load_session_info(model, path: str | os.PathLike, press=None, kv_cache="saved"):
    """(session, cache_info(path)) of load_session: the presses are attached first, then the file fills the cache
    and gives each its saved state."""
    as_format = None
    if not (isinstance(kv_cache, str) and kv_cache == "saved"):
        from .kv_cache import kv_format
        as_format = kv_format(kv_cache)  # ValueError naming the choices, before the file is read
    info = cache_info(path)
    session = model.new_session(0)
    saved = info.get("decoding_press")
    given = press.decoding_config() if press is not None else None
    if given:
        if saved and saved["config"] != json.loads(json.dumps(given)):
            raise ValueError(f"'{os.fspath(path)}' was saved with decoding press {saved['class']} {saved['config']}; "
                             f"the press given has other settings: {given}")
        session.set_decoding_press(**given)
        press.before_decoding(session, model.config)
    elif saved:
        if saved["needs_press"]:
            raise ValueError(f"'{os.fspath(path)}' was saved with a {saved['class']} that hands the session more than "
                             "its settings: pass that press as load_session(..., press=...)")
        session.set_decoding_press(**saved["config"])
    elif "decoding" in info["attached"]:
        raise ValueError(f"'{os.fspath(path)}' was saved with a decoding press attached but not its settings "
                         "(Session.save): pass the press as load_session(..., press=...)")
    if "press" in info["attached"]:  # a prefill press left attached acts on the next multi-token call
        prefill = press.prefill_part if press is not None else None
        if prefill is None:
            raise ValueError(f"'{os.fspath(path)}' was saved with a prefill press attached, which the file does not "
                             "hold: pass it as load_session(..., press=...), or detach it (set_press(None)) before saving")
        session.set_press(**prefill.c_config())
    session.load(os.fspath(path), kv_format=as_format)
    return session, info
