"""The views a Python press reads (kvpress_c/presses/python_press.py; python/presses/pyscorer.c and dlview.c;
csrc/press/scorers/callback.c): on the CPU `keys` and `values` are the K/V store's own rows, no copy; every head's
rows are DLPack tensors as the store keeps them (float32 on the CPU, bfloat16 on the emulated device), bit for bit
the rows the engine's copies and a full-cache session hold; heads of different lengths are padded when read; scores
may come back as torch tensors; and an array kept past its call (by the press, by an exception's frames, by a DLPack
consumer) stays valid, the session's results unchanged. The references are a full-cache session's rows (kv_read
copies) and copies taken inside the call; "stays valid" is checked after the session is freed and its memory
reused (without the engine keeping it, these reads return other data or crash: checked by hand, 2026-11-26)."""
import gc
from dataclasses import dataclass, field

import numpy as np
import pytest

import kvpress_c as K
from kvpress_c import ScorerPress
from random_llama import write_random_llama

N = 120
L, HKV, D = 2, 2, 32  # layers, KV heads, head dim of the model below


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("pyviews")), layers=L, hidden=128, heads=4, kv_heads=HKV,
                              vocab=256, seed=11)


@pytest.fixture(scope="module", params=["cpu", "emulated"])
def model(request, model_dir):
    return K.load_model(model_dir, device=request.param)


@pytest.fixture
def ids():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print("prompt seed", seed)
    return np.random.default_rng(seed).integers(3, 256, size=N).astype(np.int32)


def run(model, press, ids, decode=0):
    s = model.new_session()
    if press.decoding_config() is not None:
        s.set_decoding_press(**press.decoding_config())
    else:
        s.set_press(**press.c_config())
    logits = s.forward(ids, logits="last")
    for _ in range(decode):
        logits = s.forward([int(np.argmax(logits))], logits="last")
    return s, logits


def full_rows(model, ids):
    s, _ = run(model, K.KnormPress(compression_ratio=0.0), ids)
    return [[s.cache_rows(l, h) for h in range(HKV)] for l in range(L)]


def churn():
    """Free what is unreferenced and write over memory the allocator hands out again."""
    gc.collect()
    return [np.full(1 << 16, 7.0, np.float32) for _ in range(64)]


@dataclass
class Record(ScorerPress):
    """-||k||, keeping what `keep(layer)` returns for each call."""
    keep: object = None
    seen: list = field(default_factory=list)
    reads = ("values", "queries")
    window_size = 8

    def score(self, layer):
        if self.keep is not None:
            self.seen.append(self.keep(layer))
        return -np.linalg.norm(layer.keys.astype(np.float64), axis=-1)


def test_cpu_keys_are_the_store_rows(model_dir, ids):
    model = K.load_model(model_dir, device="cpu")

    def look(layer):
        k, v, n = layer.keys, layer.values, layer.n
        return (type(k.base).__name__, k.strides, v.strides, k.flags.writeable,
                [np.shares_memory(k[h], np.from_dlpack(layer.key_rows[h])) for h in range(HKV)], k.copy(), v.copy(), n)

    press = Record(compression_ratio=0.5, keep=look)
    run(model, press, ids)
    ref = full_rows(model, ids)
    assert len(press.seen) == L
    for l, (base, ks, vs, writeable, shared, k, v, n) in enumerate(press.seen):
        assert base == "ViewMemory" and not writeable and all(shared)
        # the store's layout, not a padded copy's ([n, d] per head): each head's arena slice holds its K then its V
        assert ks == vs and ks[0] >= 2 * n * D * 4 and ks[1:] == (D * 4, 4), ks
        for h in range(HKV):
            np.testing.assert_array_equal(k[h], ref[l][h][0])
            np.testing.assert_array_equal(v[h], ref[l][h][1])


def test_ragged_heads_are_padded_when_read(model_dir, ids):
    """DecodingPress over AdaKV leaves heads of different lengths: keys and values are padded copies (zeros past each
    head), key_rows each head's own rows."""
    model = K.load_model(model_dir, device="cpu")

    def look(layer):
        rows = [np.from_dlpack(r).copy() for r in layer.key_rows]
        return layer.lengths.copy(), layer.keys.copy(), layer.values.copy(), rows, [np.from_dlpack(r).copy() for r in
                                                                                    layer.value_rows]

    inner = Record(keep=look)
    press = K.DecodingPress(K.AdaKVPress(inner), compression_interval=16, target_size=48, hidden_states_buffer_size=16)
    run(model, press, ids, decode=40)
    ragged = [x for x in inner.seen if len(set(x[0].tolist())) > 1]
    assert ragged, [x[0].tolist() for x in inner.seen]
    for lens, keys, values, krows, vrows in ragged:
        assert keys.shape == values.shape == (HKV, lens.max(), D)
        for h, n in enumerate(lens):
            assert krows[h].shape == vrows[h].shape == (n, D)
            np.testing.assert_array_equal(keys[h, :n], krows[h])
            np.testing.assert_array_equal(values[h, :n], vrows[h])
            assert not keys[h, n:].any() and not values[h, n:].any()


def test_views_through_dlpack(model, ids):
    """torch.from_dlpack of each head's rows: the store's dtype, bit for bit the engine's float32 copies (layer.keys
    on the emulated device, the store itself on the CPU) and a full-cache session's rows; kept past the call, still
    those rows; scores returned as torch tensors keep the rows NumPy scores keep."""
    torch = pytest.importorskip("torch")
    bf16 = model.device == "emulated"

    def look(layer):
        ts = [(torch.from_dlpack(layer.key_rows[h]), torch.from_dlpack(layer.value_rows[h])) for h in range(HKV)]
        v = layer.key_rows[0]
        assert v.__dlpack_device__() == (1, 0) and v.device == "cpu" and v.shape == (layer.lengths[0], D)
        assert v.dtype == ("bfloat16" if bf16 else "float32")
        with pytest.raises(BufferError):
            v.__dlpack__(copy=True)
        with pytest.raises(BufferError):
            v.__dlpack__(dl_device=(2, 0))
        return ts, [(k.clone(), vv.clone()) for k, vv in ts], layer.keys.copy(), layer.values.copy()

    press = Record(compression_ratio=0.5, keep=look)
    s, _ = run(model, press, ids)
    ref = full_rows(model, ids)
    del s
    junk = churn()  # noqa: F841
    for l, (held, copies, keys, values) in enumerate(press.seen):
        for h in range(HKV):
            for t, c, engine_copy, full in ((held[h][0], copies[h][0], keys[h], ref[l][h][0]),
                                            (held[h][1], copies[h][1], values[h], ref[l][h][1])):
                assert t.dtype == (torch.bfloat16 if bf16 else torch.float32) and t.shape == (N, D)
                assert torch.equal(t, c)  # held past the call and the session: unchanged
                np.testing.assert_array_equal(t.float().numpy(), engine_copy)
                np.testing.assert_array_equal(t.float().numpy(), full)

    @dataclass
    class Scores(ScorerPress):
        """-||k|| in float64 NumPy, rounded to `dtype`, returned as a torch tensor or (the reference) as NumPy."""
        dtype: object = None
        as_torch: bool = True

        def score(self, layer):
            s = torch.from_numpy(-np.linalg.norm(layer.keys.astype(np.float64), axis=-1)).to(self.dtype)
            return s if self.as_torch else s.float().numpy() if self.dtype == torch.bfloat16 else s.numpy()

    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        got = run(model, Scores(compression_ratio=0.5, dtype=dtype), ids)[0]
        want = run(model, Scores(compression_ratio=0.5, dtype=dtype, as_torch=False), ids)[0]
        for l in range(L):
            for h in range(HKV):
                np.testing.assert_array_equal(got.cache_positions(l, h), want.cache_positions(l, h))


def test_kept_arrays_stay_valid(model, ids):
    """A press that keeps its views (the arrays, a slice of them, the queries, the positions, a DLView) reads the
    same values after the session is gone, and its session answers as one whose press keeps nothing."""

    def keep(layer):
        kept = (layer.keys, layer.keys[1, 3:9], layer.values, layer.queries, layer.positions, layer.key_rows[1])
        return kept, tuple(np.array(x) for x in kept[:5])

    press = Record(compression_ratio=0.5, keep=keep)
    s, logits = run(model, press, ids, decode=3)
    s2, logits2 = run(model, Record(compression_ratio=0.5), ids, decode=3)
    np.testing.assert_array_equal(logits, logits2)  # the store moved to a copy of its rows: nothing else changed
    for l in range(L):
        for h in range(HKV):
            np.testing.assert_array_equal(s.cache_positions(l, h), s2.cache_positions(l, h))
            for a, b in zip(s.cache_rows(l, h), s2.cache_rows(l, h)):
                np.testing.assert_array_equal(a, b)
    del s, s2
    junk = churn()  # noqa: F841
    assert len(press.seen) == L
    for kept, copies in press.seen:
        for a, c in zip(kept[:5], copies):
            np.testing.assert_array_equal(a, c)
        if kept[5].dtype == "float32":
            np.testing.assert_array_equal(np.from_dlpack(kept[5]), copies[0][1, :kept[5].shape[0]])


class Boom(Exception):
    pass


@dataclass
class FailsHolding(ScorerPress):
    seen: list = field(default_factory=list)

    def score(self, layer):
        k = layer.keys[:, : layer.n // 2]  # a local of this frame, held by the traceback
        self.seen.append(k.copy())
        raise Boom("no scores")


def test_an_exception_keeps_its_frames_readable(model, ids):
    press = FailsHolding(compression_ratio=0.5)
    s = model.new_session()
    s.set_press(**press.c_config())
    with pytest.raises(Boom) as e:
        s.forward(ids, logits="none")
    s.reset()
    s.set_press(**K.KnormPress(compression_ratio=0.5).c_config())
    s.forward(ids, logits="none")
    del s
    junk = churn()  # noqa: F841
    tb, held = e.value.__traceback__, None
    while tb is not None:
        held = tb.tb_frame.f_locals.get("k", held) if tb.tb_frame.f_code.co_name == "score" else held
        tb = tb.tb_next
    assert held is not None
    np.testing.assert_array_equal(held, press.seen[0])
