"""Float64 NumPy references of the K/V cache's storage types, written from the spec in csrc/core/kv_type.h's
comment (f32, f16, bf16, q8_0, KIVI 4/2-bit), and of what a store holds and what it costs.

Where the format computes in f32 (q8_0's d = amax / 127 and codes round(x * (1 / d)); KIVI's scale
(max - min) / (2^bits - 1), codes round((x - min) / scale) and values min + scale * q), the reference
computes in float64 and rounds to f32 at the same points (`_f32`): float64 carries more than twice f32's
precision, so each of those rounded results is the correctly rounded f32 operation and the comparison with
the store is exact. Rounding to an integer code is to nearest, ties to even (rint).

Rows are [n, d] arrays; a store's rows per head come from store_rows."""
from __future__ import annotations

import numpy as np

F32, BF16, F16, Q8_0, KIVI4, KIVI2 = 0, 1, 2, 3, 4, 5  # kvpress_c.kv_cache's codes (kvc_kv_format.type)
NAMES = {F32: "f32", BF16: "bf16", F16: "f16", Q8_0: "q8_0", KIVI4: "kivi4", KIVI2: "kivi2"}
F16_MAX = 65504.0
BF16_MAX = (2 - 2.0 ** -7) * 2.0 ** 127


def _f32(x):
    """float64 rounded to the nearest f32 (ties to even), back as float64."""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def _round_to_grid(x, mant_bits, min_exp, max_value):
    """Nearest float with `mant_bits` stored mantissa bits and least normal exponent min_exp (subnormals below),
    ties to even; past max_value (after rounding): inf; NaN stays NaN; signed zeros kept."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    finite = np.isfinite(a) & (a > 0)
    _, ex = np.frexp(np.where(finite, a, 1.0))  # a = m 2^ex, m in [0.5, 1): the binade's exponent is ex - 1
    ulp = np.ldexp(1.0, np.maximum(ex - 1, min_exp) - mant_bits)
    q = np.where(finite, np.rint(a / ulp) * ulp, a)  # a / ulp is exact (a power of two apart)
    q = np.where(q > max_value, np.inf, q)
    return np.copysign(q, x)


def f16_round(x):
    """IEEE binary16 of f32 values: 10 mantissa bits, normal exponents from -14, largest 65504."""
    return _round_to_grid(x, 10, -14, F16_MAX)


def bf16_round(x):
    """bfloat16 of f32 values: f32's exponents, 7 mantissa bits."""
    return _round_to_grid(x, 7, -126, BF16_MAX)


def f16_decode(bits):
    """The value of each 16-bit binary16 pattern (uint16 array), from its sign, exponent and mantissa."""
    b = np.asarray(bits, np.int64)
    sign = np.where(b & 0x8000, -1.0, 1.0)
    e, m = (b >> 10) & 0x1F, (b & 0x3FF).astype(np.float64)
    v = np.where(e == 0, m * 2.0 ** -24, np.ldexp(1024.0 + m, np.maximum(e, 1) - 25))
    v = np.where(e == 31, np.where(m == 0, np.inf, np.nan), v)
    return sign * v


# ---- q8_0: blocks of 32 values of a row, f16 d = max|x| / 127, int8 codes ----

def q8_0_row(x):
    """Decoded q8_0 row(s) [..., w] (the last block of a row shorter when w is not a multiple of 32)."""
    x = _f32(x)
    out = np.empty_like(x)
    for b0 in range(0, x.shape[-1], 32):
        blk = x[..., b0:b0 + 32]
        d = _f32(np.max(np.abs(blk), axis=-1, keepdims=True) / 127.0)
        inv = np.where(d > 0, _f32(1.0 / np.where(d > 0, d, 1.0)), 0.0)
        q = np.rint(_f32(blk * inv))
        out[..., b0:b0 + 32] = _f32(f16_round(d) * q)
    return out


# ---- KIVI: asymmetric min-max codes, f16 scale and min ----

def kivi_group(x, bits, axis):
    """x decoded from codes of `bits` over `axis` (every other index its own group)."""
    x = _f32(x)
    lo, hi = np.min(x, axis=axis, keepdims=True), np.max(x, axis=axis, keepdims=True)
    m = f16_round(lo)
    s = f16_round(_f32(_f32(hi - lo) / float((1 << bits) - 1)))
    ok = s > 0
    q = np.rint(_f32(_f32(x - m) / np.where(ok, s, 1.0)))
    q = np.where(ok, np.clip(q, 0, (1 << bits) - 1), 0)
    return _f32(m + s * q)


def kivi_values(x, bits, group):
    """Value rows [n, d]: each row quantised over groups of min(group, d) channels."""
    n, d = x.shape
    g = min(group, d)
    return kivi_group(np.asarray(x).reshape(n, d // g, g), bits, axis=2).reshape(n, d)


def kivi_keys(x, bits, group):
    """Key rows [n, d], n a multiple of group: each channel quantised over blocks of `group` rows."""
    n, d = x.shape
    return kivi_group(np.asarray(x).reshape(n // group, group, d), bits, axis=1).reshape(n, d)


def kivi_bits(t):
    return 4 if t == KIVI4 else 2


def quantised_rows(steps, group, residual):
    """KIVI's residual rule: rows held in the type after calls appending steps[0], steps[1], ... rows, each
    committed after it (rows wait in f32 until `residual` of them (and a whole group) wait; then every whole
    group of them goes into the type)."""
    nq = held = 0
    for s in steps:
        held += s
        if held - nq >= max(residual, group):
            nq += (held - nq) // group * group
    return nq


def store_rows(t, k, v, group=0, nq=None):
    """(keys, values) a store of type t holds for rows k, v [n, d] appended in order; KIVI: rows [0, nq) in
    the type (nq a multiple of group), the rest in f32."""
    k, v = _f32(k), _f32(v)
    if t == F32:
        return k, v
    if t == F16:
        return f16_round(k), f16_round(v)
    if t == BF16:
        return bf16_round(k), bf16_round(v)
    if t == Q8_0:
        return q8_0_row(k), q8_0_row(v)
    bits = kivi_bits(t)
    ko, vo = k.copy(), v.copy()
    if nq:
        ko[:nq] = kivi_keys(k[:nq], bits, group)
        vo[:nq] = kivi_values(v[:nq], bits, group)
    return ko, vo


# ---- bytes (kv_type.h's sizes; a store's slices 64-byte aligned) ----

def row_bytes(t, w, group=0):
    """Bytes of one row of w values stored alone (every type's values; keys unless KIVI)."""
    if t == F32:
        return 4 * w
    if t in (F16, BF16):
        return 2 * w
    if t == Q8_0:
        return -(-w // 32) * 34
    g = min(group, w)
    return (w // g) * (4 + g * kivi_bits(t) // 8)


def key_bytes(t, w, rows, group=0):
    """Bytes of `rows` key rows: KIVI in whole blocks of `group` rows (f16 scale and min per channel, then codes)."""
    if t in (KIVI4, KIVI2):
        return -(-rows // group) * (4 * w + group * w * kivi_bits(t) // 8)
    return rows * row_bytes(t, w)


def align64(b):
    return (b + 63) // 64 * 64


def arena_bytes(t, d, cap, group=0):
    """A store's arena for cap[h] rows per head: per head its key slice, then its value slice, each 64-aligned."""
    return sum(align64(key_bytes(t, d, c, group)) + align64(c * row_bytes(t, d, group)) for c in cap)


def compacted_bytes(t, d, lens, group=0, residual=0):
    """cache_bytes of a session whose stores were just compacted, lens[l][h] rows per (layer, head): per layer the
    arena sized to the rows kept, the positions (8 bytes a row), and the rows waiting in f32 (a K and a V row each):
    none for rows stored alone; KIVI's rows not in whole blocks (all of them below max(residual, group)), the store
    keeping room for max(residual, group) + 8 of them once a commit quantised (kv_store.c)."""
    total = 0
    for row in lens:
        total += arena_bytes(t, d, row, group) + 8 * sum(row)
        if t in (KIVI4, KIVI2):
            for n in row:
                nq = n // group * group if n >= max(residual, group) else 0
                room = max(residual, group) + 8
                total += (n if nq == 0 or n <= room else max(n - nq, room)) * 2 * d * 4
    return total
