"""Baseline scorers and allocations against the float64 NumPy references (fresh random inputs), their
invariants, argument validation, and the pipeline end to end on the default model.

How kept sets are compared. Our scores are fp32, the reference's float64; they agree to ~1e-7 relative.
Two checks follow:
  1. the reference *selection* run on our own fp32 scores must give exactly our kept rows (this tests
     the allocation and the tie-breaking without any rounding question: fp32 -> float64 is exact);
  2. the reference selection on the float64 reference scores must give exactly our kept rows whenever
     the reference's score margin at every cut of the ranking (the gap between the last kept and the
     first dropped candidate) exceeds the fp32 noise (1e-5 x the largest score). Below that margin two
     rows are a tie as far as fp32 can tell, and either choice is right. Gaps that are exactly zero in
     the reference are ties by construction (e.g. the window rows, all max + 1): both sides break them
     by position, so they do not count as near-ties.
"""
import ctypes as C
import math

import numpy as np
import pytest

import kvpress_c
from capi import ALLOCATIONS, SAFEGUARDS, SCORERS as CODES, CError, lib, press_compute, press_config
from method_reference import topk_rows
from press_reference import (adakv_floor, adakv_floor_caps, adakv_protect, knorm_scores, n_kept, n_kept_ratio,
                             observed_scores, pyramid_budget, snapkv_scores, streaming_keep, streaming_scores,
                             tova_scores, uniform_keep)

STREAMING, KNORM, RANDOM, TOVA, OBSERVED, SNAPKV = (CODES[n] for n in ("streaming", "knorm", "random", "tova",
                                                                      "observed", "snapkv"))
UNIFORM, PYRAMID, ADAKV = ALLOCATIONS["uniform"], ALLOCATIONS["pyramid"], ALLOCATIONS["adakv"]
FLOOR, PROTECT = SAFEGUARDS["floor"], SAFEGUARDS["protect"]
SCORERS = {"snapkv": SNAPKV, "tova": TOVA, "observed": OBSERVED, "knorm": KNORM, "streaming": STREAMING}
# (H, Hkv, d, n, length): GQA groups 1, 2, 3, 4; length > n means a past before this call's queries
SHAPES = [(4, 2, 16, 90, 90), (6, 3, 32, 70, 100), (4, 4, 16, 40, 40), (8, 2, 64, 129, 129), (3, 1, 16, 50, 60)]
W, KERNEL, N_SINK = 8, 5, 4


def test_press_settings_by_name(tmp_path):
    """The press settings reach C by name (kvc_press_spec; no struct mirrored in Python): kvpress's defaults
    read back through the ABI, every setting of the table listed with its type and default, and capi.Config
    still mirrors kvc_config field by field (offsets and size from a C compiler)."""
    import os
    import shutil
    import subprocess
    from capi import Config
    cfg = press_config()
    want = dict(scorer=SNAPKV, allocation=UNIFORM, compression_ratio=0.0, budget=0, window=64, kernel=5, pool_max=0,
                gqa_max=0, pool_then_reduce=1, n_sink=4, seed=0, safeguard=PROTECT, pyramid_beta=20, record_scores=0,
                chunk_length=0, reuse_layers=1, drop_window=0)
    for k, v in want.items():
        assert getattr(cfg, k) == v, k
    assert cfg.alpha_safeguard == pytest.approx(0.2) and cfg.edie_alpha == pytest.approx(0.1)
    params = kvpress_c.press_params()
    assert len(params) == lib.kvc_press_param_count()
    assert params["window"]["type"] == "int" and params["window"]["default"] == 64
    assert params["scorer"]["choices"] == tuple(CODES) and params["allocation"]["choices"][ADAKV] == "adakv"
    for name, row in params.items():  # every default passes its own documented range
        if row["type"] != "choice":
            assert row["lo"] <= row["default"] <= row["hi"], name
    with pytest.raises(CError, match="unknown press setting 'windw'"):
        press_config(windw=3)
    cc = shutil.which("cc") or shutil.which("gcc")
    include = os.path.join(os.path.dirname(__file__), "..", "..", "csrc", "include")
    if not cc or not os.path.exists(os.path.join(include, "kvpress_c.h")):
        pytest.skip("no C compiler or no source tree")
    for struct, c_name in ((Config, "kvc_config"),):
        names = [f[0] for f in struct._fields_]
        src = tmp_path / f"{c_name}.c"
        src.write_text("#include <stdio.h>\n#include <stddef.h>\n#include \"kvpress_c.h\"\nint main(void) {\n"
                       + "".join(f'    printf("%zu\\n", offsetof({c_name}, {n}));\n' for n in names)
                       + f'    printf("%zu\\n", sizeof({c_name}));\n    return 0;\n}}\n')
        exe = tmp_path / c_name
        subprocess.run([cc, "-std=c11", "-I", include, str(src), "-o", str(exe)], check=True)
        out = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
        assert out[:-1] == [getattr(struct, n).offset for n in names], c_name
        assert out[-1] == C.sizeof(struct), c_name


def layer(rng, H, Hkv, d, n, length):
    return (rng.standard_normal((n, H, d)), rng.standard_normal((Hkv, length, d)) * 1.5,
            rng.standard_normal((Hkv, length, d)))


def ref_scores(name, q, K, w=W, kernel=KERNEL, pooling="avg", gqa="mean", ptr=True):
    if name == "snapkv":
        return snapkv_scores(q, K, w, kernel, pooling, gqa, ptr)
    if name == "tova":
        return tova_scores(q, K)
    if name == "observed":
        return observed_scores(q, K)
    if name == "knorm":
        return knorm_scores(K)
    return streaming_scores(K.shape[0], K.shape[1], N_SINK)


def protected_rows(name, length, w=W):
    return {"snapkv": set(range(length - w, length)), "tova": {length - 1},
            "streaming": set(range(N_SINK))}.get(name, set())


def ref_select(scores, alloc, nk, w, alpha):
    if alloc == "uniform":
        return uniform_keep(scores, nk)
    if alloc == "protect":
        return adakv_protect(scores, nk, alpha)
    return adakv_floor(scores, nk, w, alpha)


def _gap_at(sorted_desc, k):
    """Gap between the k-th and (k+1)-th best values (inf when the cut is at an end or on an exact tie)."""
    if k <= 0 or k >= len(sorted_desc):
        return math.inf
    gap = sorted_desc[k - 1] - sorted_desc[k]
    return math.inf if gap == 0 else gap


def selection_margin(scores, alloc, nk, w, alpha):
    """Smallest non-zero score gap at any cut the selection makes (see the module docstring)."""
    Hkv, length = scores.shape
    if nk >= length:
        return math.inf
    if alloc == "uniform":
        return min(_gap_at(np.sort(s)[::-1], nk) for s in scores)
    if alloc == "protect":
        n_safe = max(1, int(nk * alpha)) if alpha > 0 else 0
        m = min(_gap_at(np.sort(s)[::-1], n_safe) for s in scores)
        chosen = np.zeros_like(scores, dtype=bool)
        for h in range(Hkv):
            chosen[h, topk_rows(scores[h], n_safe)] = True
        rest = np.sort(scores[~chosen])[::-1]
        return min(m, _gap_at(rest, Hkv * nk - chosen.sum()))
    n_past, Bp = length - w, max(0, nk - w)
    _, caps = adakv_floor_caps(scores, nk, w, alpha)
    m = _gap_at(np.sort(scores[:, :n_past].reshape(-1))[::-1], Hkv * Bp)
    return min([m] + [_gap_at(np.sort(scores[h, :n_past])[::-1], caps[h]) for h in range(Hkv)])


def noise(name, ref, length):
    """fp32 noise on a score gap: twice check_scores' tolerance, on the scale of the unprotected scores."""
    free = np.setdiff1d(np.arange(length), sorted(protected_rows(name, length)))
    return 2 * (2e-6 + 1e-5) * np.abs(ref[:, free]).max()


def check_rows_valid(kept, length, what):
    for h, rows in enumerate(kept):
        assert rows.dtype == np.int64, what
        assert np.all(np.diff(rows) > 0), f"{what} head {h}: kept rows must be strictly increasing (sorted, no duplicates)"
        assert len(rows) == 0 or (rows[0] >= 0 and rows[-1] < length), f"{what} head {h}: row out of range"


def check_scores(name, scores, ref, length, what):
    """Unprotected rows within fp32 noise of the reference (rtol 1e-5, atol 2e-6 x the largest of them);
    protected rows exactly our own max + 1, as kvpress pads them. (StreamingLLM's scores are only an
    encoding of its order; its selection is what the spec fixes, checked by the callers.)"""
    if name == "streaming":
        return
    prot = sorted(protected_rows(name, length))
    free = np.setdiff1d(np.arange(length), prot)
    scale = np.abs(ref[:, free]).max()
    np.testing.assert_allclose(scores[:, free], ref[:, free], rtol=1e-5, atol=2e-6 * scale, err_msg=what)
    if prot:
        np.testing.assert_array_equal(scores[:, prot], np.float32(scores[:, free].max()) + np.float32(1), err_msg=what)


@pytest.mark.parametrize("H,Hkv,d,n,length", SHAPES)
@pytest.mark.parametrize("name", list(SCORERS))
def test_scorer_x_allocation(rng, H, Hkv, d, n, length, name):
    """Every scorer under every allocation that kvpress allows with it (uniform top-k; Ada-KV wraps
    any scorer press), in ratio and budget form. PyramidKV (SnapKV only) is tested below."""
    q, K, V = layer(rng, H, Hkv, d, n, length)
    ref = ref_scores(name, q, K)
    for alloc in ("uniform", "protect", "floor"):
        for form in ("ratio", "budget"):
            check_scorer_allocation(q, K, V, ref, name, alloc, form, f"{name}/{alloc}/{form}")


def check_scorer_allocation(q, K, V, ref, name, alloc, form, what):
    Hkv, length = K.shape[:2]
    w = W if name == "snapkv" else 0
    alpha = 0.2
    kw = dict(compression_ratio=0.6) if form == "ratio" else dict(budget=max(w + 6, length // 3))
    nk = n_kept(length, cr=kw.get("compression_ratio"), budget=kw.get("budget"))
    cfg = press_config(scorer=SCORERS[name], allocation=UNIFORM if alloc == "uniform" else ADAKV,
                       safeguard=PROTECT if alloc == "protect" else FLOOR, alpha_safeguard=alpha, window=w,
                       kernel=KERNEL if name == "snapkv" else 1, n_sink=N_SINK, **kw)
    scores, kept = press_compute(cfg, q, K, V)
    check_scores(name, scores, ref, length, what)
    check_rows_valid(kept, length, what)
    # 1. the allocation itself, on our fp32 scores: exact
    mine = ref_select(scores.astype(np.float64), alloc, nk, w, alpha)
    for h in range(Hkv):
        np.testing.assert_array_equal(kept[h], mine[h], err_msg=f"{what} head {h}")
    # 2. against the float64 reference's own selection, exact unless its margin is inside fp32 noise
    want = ref_select(ref, alloc, nk, w, alpha)
    margin = selection_margin(ref, alloc, nk, w, alpha)
    if margin > noise(name, ref, length):
        for h in range(Hkv):
            np.testing.assert_array_equal(kept[h], want[h], err_msg=f"{what} head {h} (reference margin {margin:.3g})")
    else:
        print(f"{what}: reference margin {margin:.3g} is within fp32 noise; exact comparison skipped")
    # protected rows (window, last token, sinks) are always kept
    for h in range(Hkv):
        assert protected_rows(name, length, w) <= set(kept[h].tolist()), f"{what}: protected rows evicted"
    if name == "streaming" and alloc == "uniform":
        for rows in kept:
            np.testing.assert_array_equal(rows, streaming_keep(length, nk, N_SINK))
    # counts
    counts = np.array([len(r) for r in kept])
    if alloc == "uniform":
        assert (counts == nk).all(), what
    elif alloc == "protect":
        assert counts.sum() == Hkv * nk, what  # exactly the uniform total, split unevenly
    else:
        # exact rule: the window plus cap_h past rows per head (caps from the global top-k counts f_h)
        f, caps = adakv_floor_caps(scores.astype(np.float64), nk, w, alpha)
        assert f.sum() == Hkv * (nk - w), what
        np.testing.assert_array_equal(counts, caps + w, err_msg=what)
        # hence, without clipping: Hkv nk - Hkv (frac(Bp a) + 1/2) <= total <= Hkv nk + Hkv / 2
        Bp = nk - w
        frac = Bp * alpha - math.floor(Bp * alpha)
        if (caps < length - w).all():
            assert -Hkv * (frac + 0.5) <= counts.sum() - Hkv * nk <= Hkv * 0.5, what


@pytest.mark.parametrize("H,Hkv,d,n,length", [SHAPES[1], SHAPES[3]])
@pytest.mark.parametrize("pooling,gqa,ptr", [("avg", "mean", True), ("max", "max", False), ("max", "mean", True),
                                             ("avg", "max", False), ("avg", "mean", False), ("max", "max", True)])
@pytest.mark.parametrize("kernel", [1, 7])
def test_snapkv_pooling_and_gqa_orders(rng, H, Hkv, d, n, length, pooling, gqa, ptr, kernel):
    """Both pooling kinds, both GQA reductions, both orders (kvpress pools then reduces; the Ada-KV code
    reduces first), with and without a past."""
    q, K, V = layer(rng, H, Hkv, d, n, length)
    cfg = press_config(scorer=SNAPKV, window=W, kernel=kernel, pool_max=int(pooling == "max"), gqa_max=int(gqa == "max"),
                       pool_then_reduce=int(ptr), compression_ratio=0.5)
    scores, kept = press_compute(cfg, q, K, V)
    ref = snapkv_scores(q, K, W, kernel, pooling, gqa, ptr)
    check_scores("snapkv", scores, ref, length, "")
    nk = n_kept_ratio(length, 0.5)
    for h in range(Hkv):
        np.testing.assert_array_equal(kept[h], topk_rows(scores[h].astype(np.float64), nk))
    if selection_margin(ref, "uniform", nk, W, 0.2) > noise("snapkv", ref, length):
        for h in range(Hkv):
            np.testing.assert_array_equal(kept[h], topk_rows(ref[h], nk))


def test_random_scorer_is_seeded_and_respects_the_budget(rng):
    q, K, V = layer(rng, 4, 2, 16, 100, 100)

    def run(seed, **kw):
        return press_compute(press_config(scorer=RANDOM, window=0, kernel=1, seed=seed, **kw), q, K, V)

    a, b, c = run(5, budget=30), run(5, budget=30), run(6, budget=30)
    assert all(np.array_equal(x, y) for x, y in zip(a[1], b[1])) and not all(np.array_equal(x, y) for x, y in zip(a[1], c[1]))
    assert all(len(r) == 30 for r in a[1]) and ((a[0] >= 0) & (a[0] < 1)).all()
    assert not np.array_equal(a[0][0], a[0][1]), "heads should get independent draws"
    ada = run(5, budget=30, allocation=ADAKV)
    assert sum(len(r) for r in ada[1]) == 60


# -- ties ---------------------------------------------------------------------------------------------

def test_ties_broken_by_position_knorm(rng):
    q, K, V = layer(rng, 2, 1, 16, 20, 20)
    K[0] = K[0, :1]  # every key identical: every Knorm score ties exactly
    _, kept = press_compute(press_config(scorer=KNORM, window=0, kernel=1, budget=7), q, K, V)
    np.testing.assert_array_equal(kept[0], np.arange(7))


def test_ties_broken_by_position_snapkv(rng):
    """Identical past keys get identical window attention (exactly, in fp32 too): the earliest past rows
    win, and the window is kept."""
    q, K, V = layer(rng, 4, 2, 16, 60, 60)
    K[:, :60 - W] = K[:, :1]
    scores, kept = press_compute(press_config(scorer=SNAPKV, window=W, kernel=1, budget=20), q, K, V)
    for h in range(2):
        assert len(set(scores[h, :60 - W].tolist())) == 1, "identical keys should tie exactly"
        np.testing.assert_array_equal(kept[h], np.r_[np.arange(20 - W), np.arange(60 - W, 60)])


@pytest.mark.parametrize("mode", ["protect", "floor"])
def test_ties_across_heads_broken_by_position_then_head(rng, mode):
    """Every key of every head identical: the layer-wide ranking breaks ties by row, then head."""
    Hkv, length, nk, alpha = 3, 40, 10, 0.2
    q, K, V = layer(rng, 6, Hkv, 16, length, length)
    K[:] = K[0, 0]
    _, kept = press_compute(press_config(scorer=KNORM, window=0, kernel=1, budget=nk, allocation=ADAKV,
                                         safeguard=PROTECT if mode == "protect" else FLOOR, alpha_safeguard=alpha), q, K, V)
    s = knorm_scores(K)
    want = adakv_protect(s, nk, alpha) if mode == "protect" else adakv_floor(s, nk, 0, alpha)
    cap = nk if mode == "protect" else int(np.floor(nk * (1 - alpha) + np.floor(nk * alpha) + 0.5))
    for h in range(Hkv):
        np.testing.assert_array_equal(want[h], np.arange(cap))
        np.testing.assert_array_equal(kept[h], np.arange(cap))


# -- PyramidKV ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", [dict(compression_ratio=0.5), dict(budget=240), dict(compression_ratio=0.8), dict(budget=390)])
def test_pyramid_schedule(rng, form):
    """Per-layer budgets = kvpress's integer schedule, kept rows = each layer's top-k of the SnapKV scores.
    Mean bound: the schedule runs linearly from max_num to min_num with max_num + min_num = 2 (avg - 0)
    (window excluded on both ends, added back), so the unrounded layer budgets average exactly `avg`;
    each layer is then rounded to the nearest integer, so the mean is within 1/2 of the uniform budget.
    (cr 0.8 here does not fit the pyramid, min_num < w: kvpress then falls back to uniform round(avg).)"""
    L, w, n = 12, 8, 400
    q, K, V = layer(rng, 4, 2, 16, 40, n)
    cr, budget = form.get("compression_ratio"), form.get("budget")
    sizes = []
    for l in range(L):
        scores, kept = press_compute(press_config(scorer=SNAPKV, allocation=PYRAMID, window=w, kernel=5, pyramid_beta=20, **form),
                                     q, K, V, layer=l, n_layers=L)
        want = pyramid_budget(n, l, L, w, 20, cr=cr, budget=budget)
        for h, rows in enumerate(kept):
            assert len(rows) == want, (l, want)
            np.testing.assert_array_equal(rows, topk_rows(scores[h].astype(np.float64), want))
            assert set(range(n - w, n)) <= set(rows.tolist())
        sizes.append(want)
    avg = budget if budget else n * (1 - cr)
    assert abs(np.mean(sizes) - avg) <= 0.5
    if cr == 0.8:
        assert sizes == [round(avg)] * L  # fallback: uniform
    else:
        assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_pyramid_on_the_default_model_depth(rng):
    """30 layers, kvpress defaults (w = 64), ratio 0.5 on 600 tokens: the schedule's mean is the budget."""
    sizes = [pyramid_budget(600, l, 30, 64, 20, cr=0.5) for l in range(30)]
    assert abs(np.mean(sizes) - 300) <= 0.5 and sizes[0] > sizes[-1]


# -- Ada-KV float safeguards -------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.7, 0.9])
@pytest.mark.parametrize("mode", ["protect", "floor"])
def test_adakv_alpha_is_read_as_the_decimal_the_user_wrote(rng, alpha, mode):
    """alpha travels as a C float (0.7f = 0.69999998...): int(n_kept * alpha) and floor(Bp * alpha) must
    still be what Python computes for the decimal value (kvpress semantics), e.g. int(10 * 0.7) = 7."""
    Hkv, length, nk = 2, 60, 20  # n_kept and Bp multiples of 10: the products are whole numbers
    q, K, V = layer(rng, 4, Hkv, 16, length, length)
    K[1] *= 10  # head 1 loses every layer-wide comparison: it keeps exactly its protected rows
    _, kept = press_compute(press_config(scorer=KNORM, window=0, kernel=1, budget=nk, allocation=ADAKV,
                                         safeguard=PROTECT if mode == "protect" else FLOOR, alpha_safeguard=alpha), q, K, V)
    s = press_compute(press_config(scorer=KNORM, window=0, kernel=1, budget=nk), q, K, V)[0].astype(np.float64)
    want = adakv_protect(s, nk, alpha) if mode == "protect" else adakv_floor(s, nk, 0, alpha)
    for h in range(Hkv):
        np.testing.assert_array_equal(kept[h], want[h])


# -- errors -------------------------------------------------------------------------------------------

def test_window_longer_than_prompt_is_an_error(rng):
    q, K, V = layer(rng, 4, 2, 16, 20, 20)
    with pytest.raises(CError, match="longer than the press window"):
        press_compute(press_config(scorer=SNAPKV, window=32, kernel=5, compression_ratio=0.5), q, K, V)


@pytest.mark.parametrize("make,message", [
    (lambda: kvpress_c.SnapKVPress(compression_ratio=1.0), "compression_ratio"),
    (lambda: kvpress_c.SnapKVPress(compression_ratio=-0.1), "compression_ratio"),
    (lambda: kvpress_c.KnormPress(compression_ratio=float("nan")), "compression_ratio"),
    (lambda: kvpress_c.TOVAPress(compression_ratio="0.5"), "compression_ratio"),
    (lambda: kvpress_c.SnapKVPress(budget=0), "budget"),
    (lambda: kvpress_c.KnormPress(budget=-5), "budget"),
    (lambda: kvpress_c.KnormPress(budget=12.5), "budget"),
    (lambda: kvpress_c.ObservedAttentionPress(budget=True), "budget"),
    (lambda: kvpress_c.SnapKVPress(compression_ratio=0.5, budget=100), "not both"),
    (lambda: kvpress_c.StreamingLLMPress(compression_ratio=0.5, budget=100), "not both"),
    (lambda: kvpress_c.SnapKVPress(window_size=0), "window_size"),
    (lambda: kvpress_c.SnapKVPress(window_size=-3), "window_size"),
    (lambda: kvpress_c.PyramidKVPress(window_size=0), "window_size"),
    (lambda: kvpress_c.SnapKVPress(kernel_size=4), "kernel_size"),
    (lambda: kvpress_c.SnapKVPress(kernel_size=0), "kernel_size"),
    (lambda: kvpress_c.SnapKVPress(pooling="median"), "pooling"),
    (lambda: kvpress_c.SnapKVPress(gqa_reduce="sum"), "gqa_reduce"),
    (lambda: kvpress_c.SnapKVPress(budget=16, window_size=64), "window"),
    (lambda: kvpress_c.StreamingLLMPress(n_sink=-1), "n_sink"),
    (lambda: kvpress_c.RandomPress(seed=-3), "seed"),
    (lambda: kvpress_c.PyramidKVPress(beta=0), "beta"),
    (lambda: kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(), alpha_safeguard=2.0), "alpha_safeguard"),
    (lambda: kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(), alpha_safeguard=-0.1), "alpha_safeguard"),
    (lambda: kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(), safeguard="ceil"), "safeguard"),
    (lambda: kvpress_c.AdaKVPress("snapkv"), "scorer press"),
    (lambda: kvpress_c.AdaKVPress(kvpress_c.AdaKVPress(kvpress_c.SnapKVPress())), "scorer press"),
    (lambda: kvpress_c.AdaKVPress(kvpress_c.PyramidKVPress(compression_ratio=0.5)), "PyramidKV"),
])
def test_press_argument_validation(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_prompt_shorter_than_the_window_fails_at_prefill(default_model):
    """The press is valid on its own; a prompt not longer than its window is a ValueError when the
    prefill reaches the press (as kvpress asserts), and the same for StreamingLLM's sinks."""
    ids = np.array(default_model.encode("A short prompt of a few tokens only."), dtype=np.int32)
    s = default_model.new_session()
    s.set_press(**kvpress_c.SnapKVPress(compression_ratio=0.5, window_size=64).c_config())
    with pytest.raises(ValueError, match="longer than the press window"):
        s.forward(ids, logits="none")
    with pytest.raises(ValueError, match="longer than the press window"):
        kvpress_c.Pipeline(default_model)("Tiny.", question="Why?", press=kvpress_c.SnapKVPress(compression_ratio=0.5),
                                          max_new_tokens=1)
    s = default_model.new_session()
    s.set_press(**kvpress_c.StreamingLLMPress(compression_ratio=0.5, n_sink=40).c_config())
    with pytest.raises(ValueError, match="n_sink"):
        s.forward(ids, logits="none")


# -- end to end on the default model -------------------------------------------------------------------

def expected_cache_bytes(lengths, d):
    """csrc/cache/kv_cache.c over backend/cpu/buffer.c: per layer, one arena in which each head has a K
    slice and a V slice [n, d] of floats, each rounded up to 64 bytes, plus each row's position (int64,
    on the host). After a compaction with no spare rows, n = the kept tokens, so a layer holds
    sum_h (2 ceil64(4 n d) + 8 n) bytes."""
    return int(sum(2 * ((int(n) * d * 4 + 63) // 64 * 64) + 8 * int(n) for n in np.asarray(lengths).reshape(-1)))


PRESSES = {
    "SnapKV": lambda **b: kvpress_c.SnapKVPress(**b),
    "PyramidKV": lambda **b: kvpress_c.PyramidKVPress(**b),
    "StreamingLLM": lambda **b: kvpress_c.StreamingLLMPress(**b),
    "Knorm": lambda **b: kvpress_c.KnormPress(**b),
    "TOVA": lambda **b: kvpress_c.TOVAPress(**b),
    "ObservedAttention": lambda **b: kvpress_c.ObservedAttentionPress(**b),
    "Random": lambda **b: kvpress_c.RandomPress(seed=1, **b),
    "AdaKV": lambda **b: kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(**b)),
    "AdaKV-floor": lambda **b: kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(window_size=32, kernel_size=7, pooling="max", **b),
                                                    safeguard="floor"),
}
FORMS = {"ratio0.5": dict(compression_ratio=0.5), "budget128": dict(budget=128)}


@pytest.fixture(scope="module")
def needle(default_model):
    from kvpress_c.demo import needle_prompt
    return needle_prompt(default_model, n_tokens=600)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", list(PRESSES))
def test_pipeline_end_to_end(default_model, needle, name, form):
    press = PRESSES[name](**FORMS[form])
    context, question, _ = needle
    res = kvpress_c.Pipeline(default_model)(context, question=question, press=press, max_new_tokens=2)
    c = default_model.config
    n = res.stats["prompt_tokens"]
    L, Hkv, d = c["n_layers"], c["n_kv_heads"], c["head_dim"]
    assert 550 <= n <= 750
    assert len(res.kept_indices) == L and all(len(row) == Hkv for row in res.kept_indices)
    for l in range(L):
        for h in range(Hkv):
            k = res.kept_indices[l][h]
            assert k.dtype == np.int64 and np.all(np.diff(k) > 0), f"{name} layer {l} head {h}: sorted, unique"
            assert k[0] >= 0 and k[-1] < n
    counts = np.array([[len(k) for k in row] for row in res.kept_indices])
    nk = n_kept(n, cr=FORMS[form].get("compression_ratio"), budget=FORMS[form].get("budget"))
    if name == "PyramidKV":
        want = [pyramid_budget(n, l, L, press.window_size, press.beta, cr=FORMS[form].get("compression_ratio"),
                               budget=FORMS[form].get("budget")) for l in range(L)]
        assert (counts == np.array(want)[:, None]).all()
        assert abs(counts.mean() - (FORMS[form].get("budget") or n * 0.5)) <= 0.5
    elif name == "AdaKV":
        assert (counts.sum(axis=1) == Hkv * nk).all(), "Ada-KV (protect) keeps Hkv x n_kept per layer"
    elif name == "AdaKV-floor":
        Bp = nk - press.press.window_size
        frac = Bp * 0.2 - math.floor(Bp * 0.2)
        assert ((counts.sum(axis=1) - Hkv * nk >= -Hkv * (frac + 0.5)) & (counts.sum(axis=1) - Hkv * nk <= Hkv * 0.5)).all()
    else:
        assert (counts == nk).all()
    assert res.stats["kept_tokens"] == pytest.approx(counts.mean())
    assert res.stats["kept_tokens_total"] == counts.sum()
    assert res.stats["compression_ratio"] == pytest.approx(1 - counts.mean() / n)
    # the memory the compressed context holds is exactly what its kept rows need
    assert res.stats["cache_bytes"] == expected_cache_bytes(counts, d)
    inner = getattr(press, "press", press)
    w = getattr(inner, "window_size", 0)
    protected = set(range(n - w, n)) if w else set(range(press.n_sink)) if name == "StreamingLLM" else \
        {n - 1} if name == "TOVA" else set()
    for row in res.kept_indices:
        for k in row:
            assert protected <= set(k.tolist()), f"{name}: protected tokens evicted"
    if name == "StreamingLLM":
        assert all(np.array_equal(k, streaming_keep(n, nk, 4)) for row in res.kept_indices for k in row)
    if name in ("AdaKV", "AdaKV-floor"):
        assert len(set(counts.reshape(-1).tolist())) > 1, "Ada-KV heads should end with different lengths"
    assert isinstance(res.answer, str) and len(res.answers) == 1


def test_session_cache_bytes_after_compression(default_model, needle):
    """A ragged (Ada-KV) compression frees memory for real: the session holds exactly the bytes its kept
    rows need, a fraction of what the full context needs at the same layout."""
    context, _, _ = needle
    d, L, Hkv = (default_model.config[k] for k in ("head_dim", "n_layers", "n_kv_heads"))
    ids = np.array(default_model.tokenizer.encode(context), dtype=np.int32)
    s = default_model.new_session()
    s.set_press(**kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(budget=100)).c_config())
    s.forward(ids, logits="none")
    lens = s.cache_lengths()
    assert lens.shape == (L, Hkv) and lens.sum() == L * Hkv * 100 and len(set(lens.reshape(-1).tolist())) > 1
    assert s.cache_bytes == expected_cache_bytes(lens, d)
    full = expected_cache_bytes(np.full((L, Hkv), len(ids)), d)
    # each layer is compressed right after its attention: the prefill never holds more than the
    # compressed layers plus one full layer (and its compacted copy while re-packing)
    one_layer = full // L
    assert one_layer <= s.peak_cache_bytes <= s.cache_bytes + 2 * one_layer
    print(f"cache bytes: full {full}, compressed {s.cache_bytes} ({s.cache_bytes / full:.1%})")
    assert s.cache_bytes < 0.2 * full


def test_several_questions_reuse_one_compressed_context(default_model, needle, monkeypatch):
    """One compressed prefill, three questions: before each answer the cache holds the compressed
    context plus that question only (it was cut back after the previous one); the kept indices equal a
    single-question run's; a repeated question gets the same answer."""
    import kvpress_c.pipeline as pl
    context, question, _ = needle
    seen = []
    real_greedy_many = pl.greedy_many

    def spy(sessions, first_logits, *a, **k):
        # called once per question, after the question's rows were appended to the compressed context
        assert len(sessions) == 1
        seen.append((sessions[0].cache_lengths().copy(), sessions[0].position))
        return real_greedy_many(sessions, first_logits, *a, **k)

    monkeypatch.setattr(pl, "greedy_many", spy)
    press = kvpress_c.SnapKVPress(budget=128)
    pipe = kvpress_c.Pipeline(default_model)
    qs = [question, "What color is the sky in the text?", question]
    many = pipe(context, questions=qs, press=press, max_new_tokens=6)
    ctx_ids = pipe.split_prompt(context, question)[0]
    lens0 = np.array([[len(k) for k in row] for row in many.kept_indices])
    assert len(seen) == 3
    for (lens, pos), q in zip(seen, qs):
        nq = len(pipe.split_prompt(context, q)[1])
        np.testing.assert_array_equal(lens, lens0 + nq)
        assert pos == len(ctx_ids) + nq  # positions continue after the evicted context
    one = pipe(context, question=question, press=press, max_new_tokens=6)
    assert many.answers[0] == many.answers[2] == one.answer
    for l in range(default_model.config["n_layers"]):
        for h in range(default_model.config["n_kv_heads"]):
            np.testing.assert_array_equal(many.kept_indices[l][h], one.kept_indices[l][h])


def test_query_aware_mode_keeps_question(default_model, needle):
    context, question, _ = needle
    res = kvpress_c.Pipeline(default_model)(context, question=question, press=kvpress_c.SnapKVPress(budget=128),
                                            query_aware=True, max_new_tokens=2)
    n = res.stats["prompt_tokens"]
    ctx_len = len(kvpress_c.Pipeline(default_model).split_prompt(context, question)[0])
    assert n > ctx_len  # the question is inside the compressed prompt
    assert all(set(range(n - 64, n)) <= set(k.tolist()) for row in res.kept_indices for k in row)


# -- ragged decode against a float64 reference ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from hf_models import write_tiny_model
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny_press") / "llama"), arch="llama", seed=3)


@pytest.mark.parametrize("press", [
    lambda: kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(budget=40, window_size=8)),
    lambda: kvpress_c.AdaKVPress(kvpress_c.KnormPress(budget=30), safeguard="floor"),
    lambda: kvpress_c.PyramidKVPress(compression_ratio=0.6, window_size=8),
])
def test_ragged_decode_equals_float64_reference(tiny_llama, rng, press):
    """Decode over our ragged (evicted) cache = a float64 NumPy model whose cache holds exactly the kept
    rows of every (layer, head), with their original positions: prefill logits, then 4 decode steps."""
    from np_llama import NpLlama
    model = kvpress_c.load_model(tiny_llama)
    ref = NpLlama(tiny_llama)
    ids = rng.integers(3, 256, size=120)
    s = model.new_session()
    s.set_press(**press().c_config())
    ours = [s.forward(ids.astype(np.int32), logits="last")]
    s.set_press(None)
    lens = s.cache_lengths()
    if "AdaKV" in type(press()).__name__:
        assert len(set(lens.reshape(-1).tolist())) > 1, "heads should be ragged"
    kept = [[s.cache_positions(l, h) for h in range(ref.Hkv)] for l in range(ref.L)]

    def evict(l, q, attn, o, resid, past, cache):
        for h in range(ref.Hkv):
            ch = cache[l][h]
            sel = np.searchsorted(ch["pos"], kept[l][h])
            cache[l][h] = dict(k=ch["k"][sel], v=ch["v"][sel], pos=ch["pos"][sel])

    cache = ref.empty_cache()
    hidden = ref.forward(ref.embed(ids), np.arange(len(ids)), cache, hook=evict)
    theirs = [ref.logits(hidden[-1:])[0]]
    tok = [int(np.argmax(theirs[0]))]
    for step in range(4):
        ours.append(s.forward(np.array([tok[-1]], dtype=np.int32)))
        hidden = ref.forward(ref.embed([tok[-1]]), [len(ids) + step], cache)
        theirs.append(ref.logits(hidden)[0])
        tok.append(int(np.argmax(theirs[-1])))
    for a, b in zip(ours, theirs):
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    assert (s.cache_lengths() == lens + 4).all() and s.position == len(ids) + 4
