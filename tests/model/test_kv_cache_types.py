"""The K/V cache's storage types in a session (issue 27), on the CPU and the emulated device: what each layer's
store holds after appends and their commits, KIVI's residual rule, growth, truncation, compaction, ThinK's
pruning, merged values, copies, shared prefills, reset, and the bytes each costs, against a model of the store
written from csrc/core/kv_type.h's spec (tests/reference/kv_type_reference.py) and checked exactly.

The reference rows: layer 0's K/V depend only on the tokens and their positions, so an f32 session fed the same
calls gives every row layer 0 of a typed session receives, exactly; a fresh prefill's rows of every layer too
(the call's own rows are read exact by its own queries, so the hidden states are the f32 session's)."""
import numpy as np
import pytest

import kvpress_c
from kvpress_c import QuantizedCache
from kvpress_c.kv_cache import kv_format
from kv_type_reference import (KIVI2, KIVI4, align64, compacted_bytes, row_bytes, kivi_bits, kivi_keys, kivi_values, q8_0_row, store_rows)
from random_llama import write_random_llama

SHAPE = dict(layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=512)  # head_dim 64
D = 64
# small KIVI groups so that short prompts fill blocks, a residual shorter and longer than a block
TYPES = ["f16", "bf16", "q8_0", QuantizedCache(4, 16, 40), QuantizedCache(2, 32, 24)]
IDS = [str(t) if isinstance(t, str) else f"kivi{t.nbits}-g{t.q_group_size}-r{t.residual_length}" for t in TYPES]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("kv_types")), **SHAPE)


@pytest.fixture(scope="module", params=["cpu", "emulated"])
def model(request, path):
    return kvpress_c.load_model(path, device=request.param)


class Head:
    """What one (layer, KV head) store holds, by the spec: values as float64 and, for KIVI, the rows in the type
    (a multiple of the group); rows stored alone are in the type once committed."""

    def __init__(self, kv_cache):
        self.t, self.group, self.residual = kv_format(kv_cache)
        self.k, self.v = np.zeros((0, D)), np.zeros((0, D))
        self.nq, self.before = 0, None

    @property
    def kivi(self):
        return self.t in (KIVI4, KIVI2)

    def append(self, k, v):
        """One call's rows, committed after its attention."""
        self.before = (self.k.copy(), self.v.copy(), self.nq)
        self.k, self.v = np.r_[self.k, k], np.r_[self.v, v]
        if not self.kivi:
            self.k[self.nq:], self.v[self.nq:] = store_rows(self.t, self.k[self.nq:], self.v[self.nq:])
            self.nq = len(self.k)
        self.commit()

    def commit(self):
        G, c = self.group, len(self.k) - self.nq
        if self.kivi and c >= max(self.residual, G):
            a, b = self.nq, self.nq + c // G * G
            self.k[a:b], self.v[a:b] = kivi_keys(self.k[a:b], kivi_bits(self.t), G), kivi_values(self.v[a:b], kivi_bits(self.t), G)
            self.nq = b

    def truncate(self, n):
        """Cut to n rows; cut back to the length before the last call: the rows as they were then."""
        if self.before is not None and n == len(self.before[0]):
            self.k, self.v, self.nq = self.before
        else:
            self.k, self.v = self.k[:n], self.v[:n]
            if n < self.nq:  # KIVI: the cut block back in f32, as read
                self.nq = n // self.group * self.group if self.kivi else n
        self.before = None

    def gather(self, keep):
        """Compaction: rows stored alone are copied as stored; KIVI's kept rows go back to f32 and are quantised
        again by the residual rule (as kvpress quantises again what a press keeps)."""
        self.k, self.v = self.k[keep], self.v[keep]
        self.before = None
        if self.kivi:
            self.nq = 0
            self.commit()
        else:
            self.nq = len(self.k)


def rows_f64(s, l, h):
    k, v = s.cache_rows(l, h)
    return k.astype(np.float64), v.astype(np.float64)


def check(s, heads, layer=0, what=""):
    for h, ref in enumerate(heads):
        k, v = rows_f64(s, layer, h)
        assert k.shape == ref.k.shape, f"{what}: head {h} holds {k.shape[0]} rows, the model {ref.k.shape[0]}"
        for name, got, want in (("keys", k, ref.k), ("values", v, ref.v)):
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, (f"{what}: layer {layer} head {h} {name}: {bad.size} values differ, first row "
                                   f"{bad[0] // D}: {got.flat[bad[0]]} vs {want.flat[bad[0]]} (rows in the type: {ref.nq})")


def new_rows(ref_session, l, h, since):
    k, v = rows_f64(ref_session, l, h)
    return k[since:], v[since:]


@pytest.mark.parametrize("kv_cache", TYPES, ids=IDS)
def test_appends_commits_growth_and_truncation(model, rng, kv_cache):
    """Calls of uneven lengths (a prefill, decode steps, another chunk, more steps: the store grows several
    times), then truncations (to inside a KIVI block, to the length before the last call) and more calls."""
    Hkv, V = model.config["n_kv_heads"], model.config["vocab"]
    ref, s = model.new_session(kv_cache="f32"), model.new_session(kv_cache=kv_cache)
    assert s.kv_format() == kv_format(kv_cache)
    heads = [Head(kv_cache) for _ in range(Hkv)]
    first = rng.integers(3, V, 37).astype(np.int32)
    lr, ls = ref.forward(first, logits="all"), s.forward(first, logits="all")
    assert np.array_equal(ls, lr), "a fresh prefill's logits are the f32 cache's (its own rows are exact)"
    for l in range(model.config["n_layers"]):  # every layer's rows: the hidden states are the f32 session's
        layer_heads = [Head(kv_cache) for _ in range(Hkv)]
        for h in range(Hkv):
            layer_heads[h].append(*new_rows(ref, l, h, 0))
        check(s, layer_heads, l, "the prefill")
    for h in range(Hkv):
        heads[h].append(*new_rows(ref, 0, h, 0))

    def call(n, what):
        """n new tokens into both sessions; the reference heads take the f32 session's new rows of layer 0"""
        ids = rng.integers(3, V, n).astype(np.int32)
        held = ref.cache_lengths()[0, 0]
        ref.forward(ids, logits="none")
        s.forward(ids, logits="none")
        for h in range(Hkv):
            heads[h].append(*new_rows(ref, 0, h, held))
        check(s, heads, 0, what)

    for i, n in enumerate([1] * 30 + [25] + [1] * 12 + [70] + [1] * 5):
        call(n, f"call {i} ({n} rows)")
    for cut in (ref.position - 1, ref.position - 9, ref.position - 40, ref.position - 41):
        lens = np.full((model.config["n_layers"], Hkv), cut, np.int64)
        ref.truncate(lens, cut)
        s.truncate(lens, cut)
        for h in range(Hkv):
            heads[h].truncate(cut)
        check(s, heads, 0, f"truncated to {cut}")
        for n in (1, 1, 30):
            call(n, f"after the cut to {cut}, a call of {n}")


def store_bytes(model, s):
    """kv_type_reference.compacted_bytes of the session's kept rows, in its type."""
    t, G, R = s.kv_format()
    return compacted_bytes(t, D, s.cache_lengths().tolist(), G, R)


@pytest.mark.parametrize("kv_cache", ["f32"] + TYPES, ids=["f32"] + IDS)
def test_compaction_keeps_rows_and_frees_their_bytes(model, rng, kv_cache):
    """StreamingLLM (kept rows by position alone: the same under every type) on a prefill: the kept rows are the
    store's rows at those positions (KIVI: quantised again in blocks of the kept rows), the cache costs exactly the
    kept rows' bytes, and decode steps after it append as before."""
    Hkv, V, L = model.config["n_kv_heads"], model.config["vocab"], model.config["n_layers"]
    ids = rng.integers(3, V, 150).astype(np.int32)
    press = kvpress_c.StreamingLLMPress(compression_ratio=0.6, n_sink=4)
    full, ref, s = (model.new_session(kv_cache=x) for x in ("f32", "f32", kv_cache))
    full.forward(ids, logits="none")
    for x in (ref, s):
        x.set_press(**press.c_config())
        x.forward(ids, logits="none")
        x.set_press(None)
    heads = [[Head(kv_cache) for _ in range(Hkv)] for _ in range(L)]
    for l in range(L):
        for h in range(Hkv):
            keep = s.cache_positions(l, h)
            assert np.array_equal(keep, ref.cache_positions(l, h))
            heads[l][h].append(*new_rows(full, l, h, 0))
            heads[l][h].gather(keep)
        check(s, heads[l], l, "the compaction")
    assert s.cache_bytes == store_bytes(model, s)
    if kv_cache != "f32":
        f32_bytes = store_bytes(model, ref)
        assert ref.cache_bytes == f32_bytes and s.cache_bytes < f32_bytes
    for n in (1, 1, 1, 40, 1):
        more = rng.integers(3, V, n).astype(np.int32)
        held = ref.cache_lengths()[0, 0]
        ref.forward(more, logits="none")
        s.forward(more, logits="none")
        for h in range(Hkv):
            heads[0][h].append(*new_rows(ref, 0, h, held))
        check(s, heads[0], 0, f"a call of {n} after the compaction")


@pytest.mark.parametrize("kv_cache", TYPES, ids=IDS)
def test_think_pruned_rows_read_zeros_in_dropped_channels(model, rng, kv_cache):
    """ThinK (free_channels): the pruned rows' dropped key channels read back exactly zero, their kept channels as
    the type keeps them (rows stored alone: the kept channels stored as a row of their own; KIVI: the block keeps
    its width, the dropped channels' scale and minimum set to 0); values untouched; rows stored alone free the
    dropped channels' bytes; later rows are full."""
    Hkv, V = model.config["n_kv_heads"], model.config["vocab"]
    ids = rng.integers(3, V, 90).astype(np.int32)
    press = kvpress_c.ThinKPress(key_channel_compression_ratio=0.5, window_size=8)
    full, s = model.new_session(kv_cache=kv_cache), model.new_session(kv_cache=kv_cache)
    full.forward(ids, logits="none")
    s.set_press(**press.c_config())
    press.before_prefill(s, len(ids), model.config)
    s.forward(ids, logits="none")
    s.set_press(None)
    t = kv_format(kv_cache)[0]
    for l in range(model.config["n_layers"]):
        for h in range(Hkv):
            k0, v0 = rows_f64(full, l, h)
            k, v = rows_f64(s, l, h)
            assert np.array_equal(v, v0)
            dropped = np.flatnonzero((k == 0).all(axis=0))
            kept = np.setdiff1d(np.arange(D), dropped)
            assert len(dropped) == D // 2, f"layer {l} head {h}: {len(dropped)} channels read zero"
            want = k0[:, kept] if t != kvpress_c.kv_cache.Q8_0 else q8_0_row(k0[:, kept])
            assert np.array_equal(k[:, kept], want)
    before = full.cache_bytes
    if t in (KIVI4, KIVI2):
        assert s.cache_bytes == before  # a block keeps its width
    else:  # per head: the pruned keys [n, dk], the values [n, d] (64-aligned slices), the positions; nothing waits
        L, n = model.config["n_layers"], len(ids)
        assert s.cache_bytes == L * Hkv * (align64(n * row_bytes(t, D // 2)) + align64(n * row_bytes(t, D)) + 8 * n)
        assert s.cache_bytes < before - L * Hkv * (n * row_bytes(t, D // 2) - 64)
    more = rng.integers(3, V, 3).astype(np.int32)
    s.forward(more, logits="none")
    full.forward(more, logits="none")
    k, _ = rows_f64(s, 0, 0)
    assert np.array_equal(k[-3:], rows_f64(full, 0, 0)[0][-3:]), "rows after the pruning keep every channel"


@pytest.mark.parametrize("kv_cache", TYPES, ids=IDS)
def test_merged_values_are_written_in_the_type(model, rng, kv_cache):
    """MergingPress (values of evicted rows merged into the kept ones, written through kv_write_rows): the kept
    values are the reference merge of the session's own rows (read in its type), stored in the type: within the
    type's rounding of the merged value (KIVI: the rows written go back to f32 and are quantised again)."""
    from merge_reference import merge_similar
    Hkv, V = model.config["n_kv_heads"], model.config["vocab"]
    ids = rng.integers(3, V, 120).astype(np.int32)
    press = kvpress_c.MergingPress(kvpress_c.KnormPress(compression_ratio=0.5))
    full, s = model.new_session(kv_cache=kv_cache), model.new_session(kv_cache=kv_cache)
    full.forward(ids, logits="none")
    s.set_press(**press.c_config())
    s.forward(ids, logits="none")
    t, G, _ = kv_format(kv_cache)
    for l in range(model.config["n_layers"]):
        for h in range(Hkv):
            keep = s.cache_positions(l, h)
            k0, v0 = full.cache_rows(l, h)
            want = merge_similar(k0, v0, keep)
            k, v = rows_f64(s, l, h)
            if t in (KIVI4, KIVI2):  # kept keys quantised again, values twice at most: within two code steps
                step = (np.ptp(want, axis=1, keepdims=True) + np.ptp(v0[keep], axis=1, keepdims=True)) / ((1 << kivi_bits(t)) - 1)
                assert (np.abs(v - want) <= 1.01 * step + 1e-6).all()
                assert np.abs(k - k0[keep]).max() <= np.ptp(k0, axis=0).max() / ((1 << kivi_bits(t)) - 1)
            else:
                assert np.array_equal(k, k0[keep].astype(np.float64)), "keys are kept as they are"
                enc = store_rows(t, want, want)[1]
                # the C merge is float32 against a float64 reference (2e-6 relative): the type's rounding of the
                # two may differ by one step of the type
                tol = {"f16": 2.0 ** -10, "bf16": 2.0 ** -7}.get(str(kv_cache), 2 / 127)
                assert (np.abs(v - enc) <= tol * np.abs(want).max(axis=1, keepdims=True) + 1e-7).all()
                assert np.array_equal(store_rows(t, v, v)[1], v), "the values are the type's"


@pytest.mark.parametrize("kv_cache", TYPES, ids=IDS)
def test_copy_shared_prefill_and_reset(model, rng, kv_cache):
    """copy_cache_from: the same rows, bytes and next logits; a shared prefill's followers hold the rows of their
    own prefill (typed from the leader's exact rows); reset empties the cache, keeps the type, and a prefill
    after it is a fresh session's."""
    Hkv, V, L = model.config["n_kv_heads"], model.config["vocab"], model.config["n_layers"]
    ids = rng.integers(3, V, 80).astype(np.int32)
    s = model.new_session(kv_cache=kv_cache)
    s.forward(ids, logits="none")
    for _ in range(5):
        s.forward(rng.integers(3, V, 1).astype(np.int32), logits="none")
    c = model.new_session(kv_cache=kv_cache)
    c.copy_cache_from(s)
    assert c.kv_format() == s.kv_format() and c.position == s.position and c.cache_bytes <= s.cache_bytes
    for l in range(L):
        for h in range(Hkv):
            for a, b in zip(c.cache_rows(l, h), s.cache_rows(l, h)):
                assert np.array_equal(a, b)
    nxt = np.array([9], np.int32)
    assert np.array_equal(c.forward(nxt), s.forward(nxt))
    other = model.new_session(kv_cache="f32")  # a copy takes the source's type
    other.copy_cache_from(s)
    assert other.kv_format() == s.kv_format()
    assert np.array_equal(other.forward(nxt), c.forward(nxt))

    leader = model.new_session(kv_cache="f32")
    followers = [model.new_session(kv_cache=kv_cache), model.new_session(kv_cache="f32")]
    followers[0].set_press(**kvpress_c.KnormPress(compression_ratio=0.0).c_config())
    leader.forward_shared(ids, followers, logits="none")
    for l in range(L):
        heads = [Head(kv_cache) for _ in range(Hkv)]
        for h in range(Hkv):
            heads[h].append(*new_rows(leader, l, h, 0))
            for a, b in zip(followers[1].cache_rows(l, h), leader.cache_rows(l, h)):
                assert np.array_equal(a, b)
        check(followers[0], heads, l, "a follower of a shared prefill")

    s.reset()
    assert s.position == 0 and (s.cache_lengths() == 0).all() and s.cache_bytes == 0
    assert s.kv_format() == kv_format(kv_cache)
    fresh = model.new_session(kv_cache=kv_cache)
    assert np.array_equal(s.forward(ids, logits="all"), fresh.forward(ids, logits="all"))
    for h in range(Hkv):
        assert np.array_equal(s.cache_rows(1, h)[0], fresh.cache_rows(1, h)[0])


def test_types_are_chosen_per_model_and_session(path, model):
    m = kvpress_c.load_model(path, device=model.device, kv_cache="q8_0")
    assert m.kv_cache == "q8_0" and m.new_session().kv_format() == kv_format("q8_0")
    assert m.new_session(kv_cache=None).kv_format()[0] == (0 if model.device == "cpu" else 1)  # the device's own
    kc = QuantizedCache(2, 16, 48)
    p = kvpress_c.Pipeline(m, kv_cache=kc)
    assert p.new_session().kv_format() == (KIVI2, 16, 48)
    m.kv_cache = "f16"
    assert m.new_session().kv_format() == kv_format("f16")
    s = m.new_session()
    s.forward(np.arange(3, 20, dtype=np.int32), logits="none")
    with pytest.raises(ValueError, match="only while the cache is empty"):
        s.set_kv_format(kv_format("bf16"))
    for bad in ("int8", "F 16", 3, QuantizedCache(4, 48, 0)):
        with pytest.raises((ValueError, TypeError)) as e:
            m.new_session(kv_cache=bad)
        if isinstance(bad, str):
            assert "f16" in str(e.value) and "QuantizedCache" in str(e.value), "the message names the choices"
    for bad in (dict(nbits=3), dict(q_group_size=0), dict(residual_length=-1)):
        with pytest.raises(ValueError):
            QuantizedCache(**bad)
