"""The K/V cache's storage types (csrc/core/kv_type.h) against float64 NumPy references written from its spec
(tests/reference/kv_type_reference.py): rows through a K/V store of each type on the CPU, the emulated device and
CUDA where there is one (kvc_device_kernel_kv_store: written, held and committed a call at a time, as a session's
layer fills it) and read back in f32, compared exactly; the host store's bytes (kv_store.c's layout: the CPU and the
emulated device) against kv_type.h's sizes.

Fresh random inputs each run (the `rng` fixture prints its seed)."""
import numpy as np
import pytest

import capi
import kvpress_c
from kv_type_reference import (BF16, F16, F32, KIVI2, KIVI4, NAMES, Q8_0, align64, arena_bytes, bf16_round,
                               f16_decode, f16_round, kivi_bits, quantised_rows, store_rows)

# CUDA where this build and machine have it (its store's formats are kv_type.h's too)
HOST = ("cpu", "emulated")  # kv_store.c's 64-byte aligned slices: the bytes checked; CUDA lays its arena out its own way
DEVICES = [*HOST, pytest.param("cuda", marks=pytest.mark.skipif(
    not kvpress_c.cuda_available(), reason=capi.why_no_cuda() or "no CUDA backend"))]
ROWS_ALONE = [F32, F16, BF16, Q8_0]


def through_store(k, v, t, group=0, residual=0, step=None, device="cpu"):
    """k, v [Hkv, n, d] float64 -> what a store of type t holds, float64, and its bytes."""
    ko, vo, nb = capi.kv_store(k, v, t, group, residual, step, device)
    return ko.astype(np.float64), vo.astype(np.float64), nb


def assert_same(got, want, what):
    """Exact, NaN where NaN (the reference rounds where the format rounds)."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN where the reference has none (or none where it has)"
    bad = np.flatnonzero((got != want) & ~nan)
    assert bad.size == 0, f"{what}: {bad.size} values differ, first at {bad[0]}: {got.flat[bad[0]]!r} vs {want.flat[bad[0]]!r}"


def f32_values(rng, n, lo=-30, hi=17):
    """f32 values over many binades (subnormal f16 to past f16's largest), both signs, mantissas random."""
    x = rng.uniform(1, 2, n) * 2.0 ** rng.integers(lo, hi, n) * rng.choice([-1, 1], n)
    return x.astype(np.float32).astype(np.float64)


# ---- 16-bit floats -------------------------------------------------------------------------------------------

def test_f16_reference_is_binary16():
    """The reference's decoding of every 16-bit pattern is IEEE binary16 as NumPy reads it (a peer)."""
    bits = np.arange(65536, dtype=np.uint16)
    ref, peer = f16_decode(bits), bits.view(np.float16).astype(np.float64)
    assert np.array_equal(np.isnan(ref), np.isnan(peer))
    assert np.array_equal(ref[~np.isnan(ref)], peer[~np.isnan(peer)])


@pytest.mark.parametrize("device", DEVICES)
def test_every_f16_value_round_trips(device):
    """All 65536 binary16 patterns, as f32 rows into an f16 store: each comes back as the same binary16 (NaNs as
    NaN, -0 as -0, subnormals and infinities kept)."""
    bits = np.arange(65536, dtype=np.uint16)
    x = f16_decode(bits).reshape(2, 512, 64)
    ko, vo, _ = through_store(x, x[::-1].copy(), F16, device=device)
    for got, want in ((ko, x), (vo, x[::-1])):
        assert_same(got, want, "f16 round trip")
        assert np.array_equal(np.signbit(got[~np.isnan(want)]), np.signbit(want[~np.isnan(want)]))
        back = got.astype(np.float16).view(np.uint16)  # the stored pattern, read through NumPy's binary16
        keep = ~np.isnan(want)
        assert np.array_equal(back[keep], want.astype(np.float16).view(np.uint16)[keep])


def edge_values(max16):
    """Ties, the overflow boundary, zeros, infinities, NaN, f32 subnormals."""
    ties = [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -24 * 1.5]  # halfway for f16
    bties = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 2.0 ** -133, 3 * 2.0 ** -134]  # halfway for bf16
    edges = [max16, max16 + 15.99, max16 + 16, max16 + 16.01, 1e5, 3.4e38, 0.0, -0.0, np.inf, -np.inf, np.nan,
             1e-45, 1.2e-38, 2.0 ** -24, 2.0 ** -14, 2.0 ** -14 * (1 - 2.0 ** -11)]
    v = np.array(ties + bties + edges, np.float64)
    return np.r_[v, -v].astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t", [F16, BF16])
def test_16_bit_floats_round_to_nearest_even(rng, device, t):
    d = 64
    x = np.r_[f32_values(rng, 2 * 200 * d - 64), edge_values(65504.0)]
    x = np.r_[x, np.zeros(2 * 200 * d - x.size)]
    k = x.reshape(2, 200, d)
    v = rng.permutation(x).reshape(2, 200, d)
    ko, vo, nb = through_store(k, v, t, device=device)
    ref = f16_round if t == F16 else bf16_round
    assert_same(ko, ref(k), f"{NAMES[t]} keys")
    assert_same(vo, ref(v), f"{NAMES[t]} values")
    if t == F16:  # NumPy's f32 -> binary16 conversion (round to nearest even) as a peer of the reference
        with np.errstate(over="ignore"):  # past 65504: inf, as the format says
            peer = k.astype(np.float32).astype(np.float16).astype(np.float64)
        assert_same(ref(k), peer, "the f16 reference against NumPy")
    assert nb == arena_bytes(t, d, [200, 200]) or device not in HOST


# ---- q8_0 ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 80, 40])
def test_q8_0_rows(rng, device, d):
    """GGUF's Q8_0 per row: blocks of 32 (80 and 40: a last block of 16 and 8), an f16 d = max|x| / 127 and
    codes round(x / d) (ties to even); a zero block, one value per block (max |code| 127), a constant block,
    a block of ties."""
    n = 150
    k = rng.standard_normal((2, n, d)) * rng.uniform(0.01, 50, (2, n, 1))
    v = rng.standard_normal((2, n, d)) * np.exp(rng.uniform(-6, 6, (2, n, d)))  # wide dynamic range inside a block
    k[0, 3] = 0.0
    k[1, 5] = 0.0
    k[1, 5, 7] = -3.25
    v[0, 9] = 0.75
    k[0, 10] = np.resize([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5], d)  # d = 1 exactly: codes at ties (to even)
    ko, vo, nb = through_store(k, v, Q8_0, device=device)
    want_k, want_v = store_rows(Q8_0, k, v)
    assert_same(ko, want_k, "q8_0 keys")
    assert_same(vo, want_v, "q8_0 values")
    assert nb == arena_bytes(Q8_0, d, [n, n]) or device not in HOST


# ---- KIVI ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t", [KIVI4, KIVI2])
@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_kivi_blocks_and_groups(rng, device, t, group):
    """Residual 0, one call of n rows: every whole block of `group` rows in the type (keys per channel over the
    block, values per row over min(group, 64) channels), the n mod group rows after it in f32 exactly."""
    d, n = 64, 3 * group + 5
    k = rng.standard_normal((2, n, d)) * rng.uniform(0.1, 4, (1, 1, d)) + rng.uniform(-3, 3, (1, 1, d))
    v = rng.standard_normal((2, n, d))
    k[0, :, 5] = 1.5  # a constant channel: scale 0, every code 0, read back as its minimum exactly
    v[1, 7] = -0.5   # a constant row
    ko, vo, nb = through_store(k, v, t, group, 0, device=device)
    nq = n // group * group
    for h in range(2):
        want_k, want_v = store_rows(t, k[h], v[h], group, nq)
        assert_same(ko[h], want_k, f"{NAMES[t]} keys, head {h}")
        assert_same(vo[h], want_v, f"{NAMES[t]} values, head {h}")
    assert np.array_equal(ko[0, :nq, 5], np.full(nq, 1.5))
    staged = nb - arena_bytes(t, d, [n, n], group)  # the rows waiting in f32 (and the room the store keeps for them)
    assert (staged % (2 * 2 * d * 4) == 0 and staged >= 2 * (n - nq) * 2 * d * 4) or device not in HOST, staged


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t", [KIVI4, KIVI2])
@pytest.mark.parametrize("group,residual,step,n", [(16, 40, 1, 100), (32, 64, 1, 150), (32, 32, 7, 140), (16, 8, 3, 61),
                                                    (64, 128, 100, 250), (16, 0, 5, 77)])
def test_kivi_residual_rule(rng, device, t, group, residual, step, n):
    """Rows appended `step` at a time (a decode: 1): they wait in f32 until `residual` of them (and a whole block)
    wait, then every whole block of them goes into the type and what is left (fewer than a block) stays.
    (Uneven calls: tests/model/test_kv_cache_types.py, through a session.)"""
    d = 64
    k, v = rng.standard_normal((2, n, d)), rng.standard_normal((2, n, d))
    ko, vo, _ = through_store(k, v, t, group, residual, step, device=device)
    steps = [step] * (n // step) + ([n % step] if n % step else [])
    nq = quantised_rows(steps, group, residual)
    assert 0 < nq < n or residual >= n
    for h in range(2):
        want_k, want_v = store_rows(t, k[h], v[h], group, nq)
        assert_same(ko[h], want_k, f"{NAMES[t]} keys, head {h}")
        assert_same(vo[h], want_v, f"{NAMES[t]} values, head {h}")


@pytest.mark.parametrize("t", [KIVI4, KIVI2])
def test_kivi_quantisation_error_is_within_half_a_step(rng, t):
    """A property of the format on its own: each value within half a code step of its group's (f16) grid, plus the
    f16 rounding of the minimum and the scale."""
    d, G = 64, 32
    k, v = rng.standard_normal((1, 4 * G, d)), rng.standard_normal((1, 4 * G, d))
    ko, vo, _ = through_store(k, v, t, G, 0)
    top = (1 << kivi_bits(t)) - 1
    kb = k[0].reshape(4, G, d)
    step = (kb.max(1) - kb.min(1)) / top  # per block and channel
    err = np.abs(ko[0] - k[0]).reshape(4, G, d)
    assert (err <= step[:, None, :] * (0.5 + 2e-3) + 1e-3 * np.abs(kb).max(1)[:, None, :]).all()
    vstep = (v[0].max(1) - v[0].min(1)) / top
    assert (np.abs(vo[0] - v[0]) <= vstep[:, None] * (0.5 + 2e-3) + 1e-3 * np.abs(v[0]).max(1)[:, None]).all()


# ---- every type: bytes, bad formats ----------------------------------------------------------------------------

@pytest.mark.parametrize("device", HOST)
@pytest.mark.parametrize("t", ROWS_ALONE)
@pytest.mark.parametrize("d", [64, 128])
def test_rows_stored_alone_cost_their_bytes(rng, device, t, d):
    """kv_bytes of a store holding n rows per head: per head align64(n row(d)) for keys and for values, nothing
    waiting (rows stored alone are written in the type)."""
    n = int(rng.integers(1, 300))
    k, v = rng.standard_normal((3, n, d)), rng.standard_normal((3, n, d))
    _, _, nb = through_store(k, v, t, step=int(rng.integers(1, n + 1)), device=device)
    per_row = {F32: 4 * d, F16: 2 * d, BF16: 2 * d, Q8_0: d // 32 * 34}[t]
    assert nb == 3 * 2 * align64(n * per_row)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,match", [((7, 0, 0), "not one of"), ((KIVI4, 48, 0), "divisors of 64"),
                                       ((KIVI2, 0, 128), "q_group_size must be"), ((KIVI4, 32, -1), "residual_length"),
                                       ((KIVI2, 2, 0), "multiple of 4")])
def test_bad_formats_are_refused(device, fmt, match):
    x = np.zeros((1, 4, 64))
    with pytest.raises(capi.CError, match=match) as e:
        capi.kv_store(x, x, *fmt, device=device)
    assert e.value.status == capi.ERR_ARG
