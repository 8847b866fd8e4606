"""Baseline scorers and allocations against float64 NumPy references (fresh random inputs), their
invariants, argument validation, and the pipeline end to end on the default model."""
import numpy as np
import pytest

import kvpress_c
from capi import CError, press_compute, press_config
from method_reference import topk_rows
from press_reference import (adakv_floor, adakv_protect, knorm_scores, n_kept_ratio, observed_scores, pyramid_budget,
                             snapkv_scores, streaming_keep, tova_scores)
from test_methods import assert_same_selection

STREAMING, KNORM, RANDOM, TOVA, OBSERVED, SNAPKV = range(6)
UNIFORM, PYRAMID, ADAKV = range(3)
SHAPES = [(4, 2, 16, 90, 90), (6, 3, 32, 70, 100), (4, 4, 16, 40, 40), (8, 2, 64, 129, 129), (3, 1, 16, 50, 60)]


def layer(rng, H, Hkv, d, n, length):
    return (rng.standard_normal((n, H, d)), rng.standard_normal((Hkv, length, d)) * 1.5,
            rng.standard_normal((Hkv, length, d)))


def check_kept(kept, ref_keep, scores_ref, what):
    for h, rows in enumerate(kept):
        assert np.all(np.diff(rows) > 0), f"{what}: kept rows must be increasing and unique"
        assert_same_selection(rows, np.asarray(ref_keep[h]), scores_ref[h] if scores_ref.ndim == 2 else scores_ref, f"{what} head {h}")


@pytest.mark.parametrize("H,Hkv,d,n,length", SHAPES)
@pytest.mark.parametrize("pooling,gqa,ptr", [("avg", "mean", True), ("max", "max", False), ("max", "mean", True), ("avg", "max", False)])
def test_snapkv(rng, H, Hkv, d, n, length, pooling, gqa, ptr):
    w, k, cr = 8, 5, 0.6
    q, K, V = layer(rng, H, Hkv, d, n, length)
    cfg = press_config(scorer=SNAPKV, window=w, kernel=k, pool_max=int(pooling == "max"), gqa_max=int(gqa == "max"),
                       pool_then_reduce=int(ptr), compression_ratio=cr)
    scores, kept = press_compute(cfg, q, K, V)
    ref = snapkv_scores(q, K, w, k, pooling, gqa, ptr)
    np.testing.assert_allclose(scores, ref, rtol=2e-5, atol=2e-6)
    nk = n_kept_ratio(length, cr)
    check_kept(kept, [topk_rows(ref[h], nk) for h in range(Hkv)], ref, "snapkv")
    for rows in kept:
        assert len(rows) == nk and set(range(length - w, length)) <= set(rows.tolist())


@pytest.mark.parametrize("H,Hkv,d,n,length", SHAPES)
def test_tova_observed_knorm(rng, H, Hkv, d, n, length):
    q, K, V = layer(rng, H, Hkv, d, n, length)
    for scorer, ref in ((TOVA, tova_scores(q, K)), (OBSERVED, observed_scores(q, K)), (KNORM, knorm_scores(K))):
        scores, kept = press_compute(press_config(scorer=scorer, window=0, kernel=1, budget=25), q, K, V)
        np.testing.assert_allclose(scores, ref, rtol=2e-5, atol=1e-6, err_msg=f"scorer {scorer}")
        check_kept(kept, [topk_rows(ref[h], 25) for h in range(Hkv)], ref, f"scorer {scorer}")
    # TOVA protects the last token
    assert all(length - 1 in rows for rows in press_compute(press_config(scorer=TOVA, window=0, kernel=1, budget=5), q, K, V)[1])


def test_streaming_and_random(rng):
    q, K, V = layer(rng, 4, 2, 16, 100, 100)
    _, kept = press_compute(press_config(scorer=STREAMING, window=0, kernel=1, n_sink=4, compression_ratio=0.7), q, K, V)
    for rows in kept:
        np.testing.assert_array_equal(rows, streaming_keep(100, n_kept_ratio(100, 0.7), 4))
    a = press_compute(press_config(scorer=RANDOM, window=0, kernel=1, seed=5, budget=30), q, K, V)[1]
    b = press_compute(press_config(scorer=RANDOM, window=0, kernel=1, seed=5, budget=30), q, K, V)[1]
    c = press_compute(press_config(scorer=RANDOM, window=0, kernel=1, seed=6, budget=30), q, K, V)[1]
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_ties_broken_by_position(rng):
    q, K, V = layer(rng, 2, 1, 16, 20, 20)
    K[0] = K[0, :1]  # every key identical: every Knorm score ties
    _, kept = press_compute(press_config(scorer=KNORM, window=0, kernel=1, budget=7), q, K, V)
    np.testing.assert_array_equal(kept[0], np.arange(7))


@pytest.mark.parametrize("budget", [None, 240])
def test_pyramid_schedule(rng, budget):
    L, w, n = 12, 8, 400  # long enough that the schedule fits (min_num >= window)
    q, K, V = layer(rng, 4, 2, 16, 40, n)
    cr = None if budget else 0.5
    sizes = []
    for l in range(L):
        kw = dict(budget=budget) if budget else dict(compression_ratio=cr)
        _, kept = press_compute(press_config(scorer=SNAPKV, allocation=PYRAMID, window=w, kernel=5, pyramid_beta=20, **kw),
                                q, K, V, layer=l, n_layers=L)
        want = pyramid_budget(n, l, L, w, 20, cr=cr, budget=budget)
        assert all(len(r) == want for r in kept), (l, want)
        sizes.append(want)
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    uniform = budget or n * (1 - cr)
    # the integer schedule keeps the uniform mean up to its rounding (at most 1 token per layer)
    assert abs(np.mean(sizes) - uniform) <= 1.0


@pytest.mark.parametrize("H,Hkv,d,n,length", SHAPES)
@pytest.mark.parametrize("mode", ["protect", "floor"])
def test_adakv(rng, H, Hkv, d, n, length, mode):
    w, alpha = 8, 0.2
    q, K, V = layer(rng, H, Hkv, d, n, length)
    cfg = press_config(scorer=SNAPKV, allocation=ADAKV, window=w, kernel=5, budget=30, alpha_safeguard=alpha,
                       safeguard=int(mode == "protect"))
    scores, kept = press_compute(cfg, q, K, V)
    ref = snapkv_scores(q, K, w, 5)
    ref_keep = adakv_protect(ref, 30, alpha) if mode == "protect" else adakv_floor(ref, 30, w, alpha)
    for h in range(Hkv):
        assert set(range(length - w, length)) <= set(kept[h].tolist()), "window kept"
        if not np.array_equal(kept[h], ref_keep[h]):  # only near-ties may differ
            diff = set(kept[h].tolist()) ^ set(ref_keep[h].tolist())
            vals = np.sort(ref.reshape(-1))[::-1]
            assert all(np.min(np.abs(vals - ref[h, r])) < 1e-5 for r in diff)
    total = sum(len(r) for r in kept)
    if mode == "protect":
        assert total == Hkv * 30
    else:  # rounding of each head's cap: within one token per head of the budget
        assert abs(total - Hkv * 30) <= Hkv
    if Hkv > 1:
        assert len({len(r) for r in kept}) >= 1


def test_window_longer_than_prompt_is_an_error(rng):
    q, K, V = layer(rng, 4, 2, 16, 20, 20)
    with pytest.raises(CError, match="window"):
        press_compute(press_config(scorer=SNAPKV, window=32, kernel=5, compression_ratio=0.5), q, K, V)


@pytest.mark.parametrize("make", [
    lambda: kvpress_c.SnapKVPress(compression_ratio=1.0), lambda: kvpress_c.SnapKVPress(compression_ratio=-0.1),
    lambda: kvpress_c.SnapKVPress(budget=0), lambda: kvpress_c.SnapKVPress(compression_ratio=0.5, budget=10),
    lambda: kvpress_c.SnapKVPress(window_size=0), lambda: kvpress_c.SnapKVPress(kernel_size=4),
    lambda: kvpress_c.SnapKVPress(kernel_size=0), lambda: kvpress_c.SnapKVPress(pooling="median"),
    lambda: kvpress_c.SnapKVPress(budget=16, window_size=64), lambda: kvpress_c.StreamingLLMPress(n_sink=-1),
    lambda: kvpress_c.AdaKVPress(kvpress_c.TOVAPress(), alpha_safeguard=2.0),
    lambda: kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(), safeguard="ceil"), lambda: kvpress_c.AdaKVPress("snapkv"),
    lambda: kvpress_c.PyramidKVPress(beta=0), lambda: kvpress_c.RandomPress(seed=-3),
    lambda: kvpress_c.ChunkKVPress(kvpress_c.SnapKVPress(), chunk_length=0), lambda: kvpress_c.TAKEPress(budget=0),
    lambda: kvpress_c.EDIEPress(kernel_size=2),
])
def test_press_argument_validation(make):
    with pytest.raises(ValueError):
        make()


# -- end to end on the default model -------------------------------------------------------------------

def row_bytes(d):
    return 2 * d * 4 + 8


def expected_layer_bytes(lens, d):
    """csrc/cache/kv_cache.c: each kept row holds K and V (d floats each) and its position (int64);
    each head adds 3 x 64 bytes of alignment slack for its three slices."""
    return sum(int(n) * row_bytes(d) + 3 * 64 for n in lens)


PRESSES = {
    "snapkv": lambda: kvpress_c.SnapKVPress(compression_ratio=0.5),
    "pyramid": lambda: kvpress_c.PyramidKVPress(compression_ratio=0.5),
    "streaming": lambda: kvpress_c.StreamingLLMPress(budget=128),
    "knorm": lambda: kvpress_c.KnormPress(budget=128),
    "tova": lambda: kvpress_c.TOVAPress(compression_ratio=0.5),
    "observed": lambda: kvpress_c.ObservedAttentionPress(budget=128),
    "random": lambda: kvpress_c.RandomPress(budget=128, seed=1),
    "adakv": lambda: kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(budget=128)),
    "adakv-floor": lambda: kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(budget=128, window_size=32), safeguard="floor"),
}


@pytest.fixture(scope="module")
def needle(default_model):
    from kvpress_c.demo import needle_prompt
    return needle_prompt(default_model, n_tokens=600)


@pytest.mark.parametrize("name", list(PRESSES))
def test_pipeline_end_to_end(default_model, needle, name):
    press = PRESSES[name]()
    context, question, _ = needle
    res = kvpress_c.Pipeline(default_model)(context, question=question, press=press, max_new_tokens=8, record_scores=True)
    c = default_model.config
    n = res.stats["prompt_tokens"]
    L, Hkv, d = c["n_layers"], c["n_kv_heads"], c["head_dim"]
    assert len(res.kept_indices) == L and all(len(row) == Hkv for row in res.kept_indices)
    for l in range(L):
        for h in range(Hkv):
            k = res.kept_indices[l][h]
            assert k.dtype == np.int64 and np.all(np.diff(k) > 0) and k.min() >= 0 and k.max() < n
    kept = np.array([[len(k) for k in row] for row in res.kept_indices])
    budget = press.budget or n_kept_ratio(n, press.compression_ratio)
    if name != "pyramid":
        assert abs(kept.mean() - budget) <= 1.0
    assert res.stats["kept_tokens"] == pytest.approx(kept.mean())
    assert res.stats["compression_ratio"] == pytest.approx(1 - kept.mean() / n)
    w = getattr(press, "window_size", 0) or getattr(getattr(press, "press", None), "window_size", 0)
    if w:
        assert all(set(range(n - w, n)) <= set(k.tolist()) for row in res.kept_indices for k in row)
    assert isinstance(res.answer, str) and len(res.answers) == 1
    assert all(np.isfinite(e) for e in res.press_errors)


def test_cache_bytes_are_what_the_kept_tokens_need(default_model, needle):
    context, question, _ = needle
    d = default_model.config["head_dim"]
    ids = default_model.tokenizer.encode(context)
    s = default_model.new_session()
    s.set_press(**kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(budget=100)).c_config())
    s.forward(np.array(ids, dtype=np.int32), logits="none")
    lens = s.cache_lengths()
    expected = sum(expected_layer_bytes(row, d) for row in lens)
    assert s.cache_bytes == expected
    full = default_model.new_session()
    full.forward(np.array(ids, dtype=np.int32), logits="none")
    print(f"cache bytes: full {full.cache_bytes}, compressed {s.cache_bytes} ({s.cache_bytes / full.cache_bytes:.1%})")
    assert s.cache_bytes < 0.25 * full.cache_bytes


def test_several_questions_reuse_one_compressed_context(default_model, needle):
    context, question, answer = needle
    press = kvpress_c.SnapKVPress(budget=128)
    pipe = kvpress_c.Pipeline(default_model)
    many = pipe(context, questions=[question, "What color is the sky in the text?", question], press=press, max_new_tokens=12)
    one = pipe(context, question=question, press=press, max_new_tokens=12)
    assert many.answers[0] == many.answers[2] == one.answer
    for l in range(default_model.config["n_layers"]):
        for h in range(default_model.config["n_kv_heads"]):
            np.testing.assert_array_equal(many.kept_indices[l][h], one.kept_indices[l][h])


def test_query_aware_mode_keeps_question(default_model, needle):
    context, question, _ = needle
    res = kvpress_c.Pipeline(default_model)(context, question=question, press=kvpress_c.SnapKVPress(budget=128),
                                            query_aware=True, max_new_tokens=4)
    n = res.stats["prompt_tokens"]
    ctx_len = len(kvpress_c.Pipeline(default_model).split_prompt(context, question)[0])
    assert n > ctx_len  # the question is inside the compressed prompt


def test_decode_after_ragged_compression_equals_reference(default_model, rng):
    """Decoding over a ragged (Ada-KV) cache equals attention over the same kept rows computed densely:
    a session whose cache is truncated to exactly the kept rows of a reference layer-by-layer check."""
    ids = rng.integers(0, 49152, size=200).astype(np.int32)
    s = default_model.new_session()
    s.set_press(**kvpress_c.AdaKVPress(kvpress_c.KnormPress(budget=60)).c_config())
    s.forward(ids, logits="none")
    s.set_press(None)
    lens = s.cache_lengths()
    assert len(set(lens.reshape(-1).tolist())) > 1, "Ada-KV should leave heads of different lengths"
    step = s.forward(np.array([5], dtype=np.int32))
    assert np.all(np.isfinite(step)) and s.position == 201
    assert (s.cache_lengths() == lens + 1).all()
