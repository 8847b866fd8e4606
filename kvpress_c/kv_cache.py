"""The K/V cache's storage type: what each kept row costs (docs/METHODS.md, "Quantised K/V cache").

`load_model(..., kv_cache=...)` sets a model's default, `Pipeline(model, kv_cache=...)`,
`Conversation(..., kv_cache=...)` and `Model.new_session(kv_cache=...)` override it. Values:

- ``None`` or ``"native"``: the device's own (f32 on the CPU, bf16 on devices);
- ``"f32"``, ``"f16"``, ``"bf16"``: each value as a float of that width;
- ``"q8_0"``: GGUF's Q8_0 per row (blocks of 32 values with an f16 scale; 8.5 bits a value);
- ``QuantizedCache(nbits=4 | 2, q_group_size=64, residual_length=128)``: KIVI (Liu et al., 2024) with
  transformers' names: keys quantised per channel over groups of ``q_group_size`` rows, values per row
  over groups of ``min(q_group_size, head_dim)`` channels, asymmetric min-max codes with f16 scale and
  minimum; the newest rows stay in f32 until ``residual_length`` of them wait, then every whole group
  of them is quantised.

Every type: a call's own rows are read exact by its own queries and go into the type after the layer's
attention (as transformers' QuantizedCache returns the new states unquantised); the presses score rows
read back in f32; eviction frees the evicted rows' bytes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from . import _core  # noqa: F401  (the codes below are the C header's kvc_kv_format types)

NATIVE, F32, BF16, F16, Q8_0, KIVI4, KIVI2 = -1, 0, 1, 2, 3, 4, 5
_NAMES = {"native": NATIVE, "f32": F32, "bf16": BF16, "f16": F16, "q8_0": Q8_0}
_TYPE_NAMES = {F32: "f32", BF16: "bf16", F16: "f16", Q8_0: "q8_0", KIVI4: "kivi4", KIVI2: "kivi2", NATIVE: "native"}


@dataclass(frozen=True)
class QuantizedCache:
    """KIVI's quantised K/V cache (arXiv 2402.02750), with transformers' `QuantizedCache` names.

    nbits: 4 or 2 bits a value; q_group_size: rows of a key group (keys per channel) and channels of a
    value group (values per row, at most head_dim); residual_length: rows that wait in f32 before their
    whole groups are quantised (transformers' default 128)."""
    nbits: int = 4
    q_group_size: int = 64
    residual_length: int = 128

    def __post_init__(self):
        if self.nbits not in (2, 4):
            raise ValueError(f"QuantizedCache: nbits must be 4 or 2, got {self.nbits!r}")
        for name in ("q_group_size", "residual_length"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise TypeError(f"QuantizedCache: {name} must be an int, got {getattr(self, name)!r}")
        if self.q_group_size < 1:
            raise ValueError(f"QuantizedCache: q_group_size must be >= 1, got {self.q_group_size}")
        if self.residual_length < 0:
            raise ValueError(f"QuantizedCache: residual_length must be >= 0, got {self.residual_length}")

    @property
    def name(self) -> str:
        return f"kivi{self.nbits}"


KVCache = Union[None, str, QuantizedCache]


def kv_format(kv_cache: KVCache) -> tuple[int, int, int]:
    """The C core's (type, group, residual) for a kv_cache value (ValueError naming the choices)."""
    if kv_cache is None:
        return (NATIVE, 0, 0)
    if isinstance(kv_cache, QuantizedCache):
        return (KIVI4 if kv_cache.nbits == 4 else KIVI2, kv_cache.q_group_size, kv_cache.residual_length)
    if isinstance(kv_cache, str) and kv_cache.lower() in _NAMES:
        return (_NAMES[kv_cache.lower()], 0, 0)
    raise ValueError(f"kv_cache must be one of {sorted(_NAMES)} or kvpress_c.QuantizedCache(nbits=4 | 2, ...), "
                     f"got {kv_cache!r}")


def kv_cache_of(fmt: tuple[int, int, int]) -> KVCache:
    """The kv_cache value of a (type, group, residual) triple (the inverse of kv_format)."""
    t, group, residual = (int(x) for x in fmt)
    if t in (KIVI4, KIVI2):
        return QuantizedCache(4 if t == KIVI4 else 2, group, residual)
    return _TYPE_NAMES.get(t, "native")


def kv_cache_name(kv_cache: KVCache) -> str:
    """A short name for tables, file names and the command line: native, f32, f16, bf16, q8_0, kivi4, kivi2
    (a QuantizedCache with other settings than the defaults: kivi4-g32-r64); kv_cache_from_name reads it back."""
    if isinstance(kv_cache, QuantizedCache):
        d = QuantizedCache(kv_cache.nbits)
        if (kv_cache.q_group_size, kv_cache.residual_length) == (d.q_group_size, d.residual_length):
            return kv_cache.name
        return f"{kv_cache.name}-g{kv_cache.q_group_size}-r{kv_cache.residual_length}"
    return _TYPE_NAMES[kv_format(kv_cache)[0]]


def kv_cache_from_name(name: str) -> KVCache:
    """The kv_cache value a kv_cache_name names (None for "native"; ValueError naming the choices)."""
    text = str(name).strip().lower()
    if text == "native":
        return None
    if text in _NAMES:
        return text
    m = re.fullmatch(r"kivi([24])(?:-g(\d+)-r(\d+))?", text)
    if m is None:
        raise ValueError(f"unknown K/V cache type {name!r}; choose one of {', '.join(sorted(_NAMES))}, kivi4, kivi2 "
                         "(QuantizedCache's defaults) or kivi4-g<q_group_size>-r<residual_length>")
    if m.group(2) is None:
        return QuantizedCache(int(m.group(1)))
    return QuantizedCache(int(m.group(1)), int(m.group(2)), int(m.group(3)))
