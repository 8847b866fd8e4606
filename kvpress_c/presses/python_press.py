"""Presses written in Python, run by the engine (docs/METHODS.md, "Presses written in Python").

A subclass of ScorerPress that defines `score(self, layer)` (scores [n_kv_heads, n], float32 or float64,
higher keeps) or `compress(self, layer)` (the kept row indices of every KV head) is a Python press: its
c_config() names the C core's callback scorer, whose function is the module's (python/presses/pyscorer.c)
and whose user value is a token of this registry. The engine calls it for every layer it compresses, so
every wrapper (AdaKVPress, ChunkKVPress, PyramidKV, ComposedPress, BlockPress, DecodingPress, TAKEPress)
takes it. What the press reads beyond the keys it declares as class attributes:

    window_size = 0       the call's last queries it reads (queries, attentions)
    protect_window = False  the last window_size rows of every head are kept whatever their scores (SnapKV)
    reads = ()            any of "values", "queries", "hidden_states", "attentions", and "all_queries" (the
                          queries are every query of the call, not the window's: TAKE's window is its probes)
"""
from __future__ import annotations

import itertools
import threading

import numpy as np

from .. import _core

_NEEDS = {"values": 1, "queries": 2, "hidden_states": 4, "attentions": 8, "all_queries": 16}  # KVC_VIEW_* (kvpress_c.h)
_IN_PLACE = 32  # KVC_VIEW_IN_PLACE: the store's own rows where it lends them (no copy of f32 host rows)
_registry: dict = {}
_tokens = itertools.count(1)
_lock = threading.Lock()


def is_python_press(press) -> bool:
    return callable(getattr(press, "score", None)) or callable(getattr(press, "compress", None))


def _token(press) -> int:
    """The press's number in the registry. The registry holds the press (a strong reference, one per press
    object, not per call): C copies configs freely (TAKE's inner press, a chain, a decoding press), so no
    binding can tell when the last config naming it is gone, and `session.set_press(**MyPress().c_config())`
    must not leave the session with a dangling press."""
    tok = press.__dict__.get("_kvc_token")
    if tok is None:
        with _lock:
            tok = next(_tokens)
            _registry[tok] = press
        press.__dict__["_kvc_token"] = tok
    return tok


def release(press) -> None:
    """Let the registry drop a press no session will run again (a session that still names it raises
    ReferenceError at its next compression)."""
    tok = press.__dict__.pop("_kvc_token", None)
    with _lock:
        _registry.pop(tok, None)


def c_config(press) -> dict:
    """The settings of a Python press: the callback scorer with this press's token and needs."""
    select = callable(getattr(press, "compress", None))
    if select and callable(getattr(press, "score", None)):
        raise ValueError(f"{type(press).__name__} defines both score() and compress(): define one")
    reads = tuple(getattr(press, "reads", ()))
    unknown = [r for r in reads if r not in _NEEDS]
    if unknown:
        raise ValueError(f"{type(press).__name__}.reads: unknown {unknown}; known: {sorted(_NEEDS)}")
    window = int(getattr(press, "window_size", 0) or 0)
    protect = bool(getattr(press, "protect_window", False))
    if protect and select:
        raise ValueError("a press defining compress() chooses every kept row itself: protect_window does not apply")
    stats = "all_queries" in reads and not protect  # every query: a decoding press buffers them all for it
    scorer = "callback_select" if select else ("callback_window" if protect else "callback_stats" if stats else "callback")
    cfg = {"scorer": scorer, "allocation": "uniform", "window": window, "kernel": 1,
           "callback": _core.scorer_callback_address(), "callback_user": _token(press),
           "callback_needs": sum(_NEEDS[r] for r in set(reads)) | _IN_PLACE}
    if not select:
        cfg.update(compression_ratio=float(press.compression_ratio), budget=int(press.budget or 0))
    return cfg


class Layer:
    """What a Python press sees of a layer. Its arrays are read-only views of the engine's memory, no copy where the
    memory allows: on the CPU `keys` and `values` are the K/V store's own rows. They stay valid after the call (an
    array still held when the call ends makes the engine keep its memory: the store moves to a copy), so keeping
    one is safe, and costs that copy.

    Heads may hold different row counts (Ada-KV, a decoding press): `keys` and `values` are [n_kv_heads, n, head_dim]
    with n = max(lengths), the rows past a head's length zeros (a padded copy, made when the press first reads the
    array, only where the heads differ or do not lie at one stride in the store); `key_rows[h]` and `value_rows[h]` are
    each head's own rows [lengths[h], head_dim] as the store keeps them (DLPack: float32 on the CPU, bfloat16 on a
    device, on the device's memory), never padded. The scores are [n_kv_heads, n], the rows past a head's length
    ignored."""

    def __init__(self, d: dict, press):
        d["_keys"], d["_values"] = d.pop("keys"), d.pop("values")
        self.__dict__.update(d)
        self._press = press

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        if value is None and name in ("value_rows", "queries", "hidden_states", "attentions"):
            name = "values" if name == "value_rows" else name
            raise AttributeError(f"{type(object.__getattribute__(self, '_press')).__name__} reads layer.{name}: "
                                 f"add {name!r} to its `reads` (and a window_size for queries and attentions)")
        return value

    @property
    def keys(self):
        if self._keys is None:
            self._keys = self._stacked(self.key_rows)
        return self._keys

    @property
    def values(self):
        if self._values is None:
            self._values = self._stacked(self.value_rows)
        return self._values

    def _stacked(self, rows):
        """[n_kv_heads, n, head_dim] float32 from the heads' host views, zeros past each head's rows."""
        out = np.zeros((self.n_kv_heads, self.max_len, self.head_dim), np.float32)
        for h, r in enumerate(rows):
            out[h, :self.lengths[h]] = np.from_dlpack(r)
        out.flags.writeable = False
        return out

    @property
    def n(self) -> int:
        return int(self.max_len)

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def config(self) -> dict:
        return {"n_layers": self.n_layers, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                "head_dim": self.head_dim}

    def __repr__(self):
        return (f"Layer(index={self.index}, n_kv_heads={self.n_kv_heads}, n={self.n}, "
                f"lengths={self.lengths.tolist()})")


def _as_numpy(x):
    """A press's result as a NumPy array: NumPy as it is; a torch tensor or any DLPack object through DLPack (one on
    a GPU copied down by torch first), 16-bit floats widened to float32."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):  # torch: out of autograd
        x = x.detach()
    if not hasattr(x, "__dlpack__"):
        return np.asarray(x)
    if x.__dlpack_device__()[0] != 1:  # not host memory (kDLCPU)
        import torch
        x = torch.from_dlpack(x).cpu()
    try:
        a = np.from_dlpack(x)
    except RuntimeError:  # a type NumPy lacks (bfloat16)
        import torch
        return torch.from_dlpack(x).float().numpy()
    return a.astype(np.float32) if a.dtype == np.float16 else a


def _dispatch(token: int, select: bool, d: dict):
    press = _registry.get(token)
    if press is None:
        raise ReferenceError("the Python press attached to this session was released (python_press.release)")
    layer = Layer(d, press)
    if select:
        return [_as_numpy(k) for k in press.compress(layer)]
    return _as_numpy(press.score(layer))


_core.set_press_dispatcher(_dispatch)
