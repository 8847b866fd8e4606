"""The CUDA backend's quantised K/V stores (backend/cuda/kv_typed.cu) against the emulated device, whose host
store (backend/cpu/kv_store.c) is the reference of the types' rules. CUDA only: skipped with the reason where
no GPU is (this project's CI); written with the store and never run there yet.

One f32 cache, saved from the CPU, is loaded into a session of each type on both devices: both encode the same
f32 values with core/kv_type.h's functions (writes, the staging rows, kv_commit; ThinK's narrow rows), so they
store the same codes. Read back, f32, f16 and q8_0 rows are then equal bit for bit (their decode is one
conversion or one product), KIVI's within one rounding (min + scale q: a GPU fuses it into one fma, the host
rounds the product first; the difference is at most 2^-22 of the rows' largest magnitude). What the devices
compute over those rows (a call over a past through the prefill kernels, decode steps through split-K and the
decode graph, with commits inside the replays) then differs as the two bf16 devices always do: MODEL_TOL, the
bound measured for the emulated device against the CPU (test_device.py), which test_device's CUDA check holds
CUDA to as well. A cut back to the lengths before a call (the engine's roll-back of a failed call) gives a KIVI
store's rows back bit for bit, the residual rows the call's commit quantised included (core/kv_undo.h).
"""
import numpy as np
import pytest

import kvpress_c
from kvpress_c.kv_cache import kv_format
from capi import why_no_cuda
from random_llama import write_random_llama
from test_device import MODEL_TOL, rel

pytestmark = pytest.mark.skipif(not kvpress_c.cuda_available(), reason=why_no_cuda() or "no CUDA backend")

# head_dim 64 (write_random_llama's default shape): KIVI groups of 16 rows / channels, 24 rows of residual, so a
# 150-row cache holds whole key blocks, rows staged in f32, and decode steps cross the commit threshold
TYPES = {"f32": "f32", "f16": "f16", "q8_0": "q8_0",
         "kivi4": kvpress_c.QuantizedCache(nbits=4, q_group_size=16, residual_length=24),
         "kivi2": kvpress_c.QuantizedCache(nbits=2, q_group_size=16, residual_length=24)}
KIVI_ROUNDING = 2.0 ** -22  # one fma against a product then a sum (docstring)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    seed = int.from_bytes(np.random.default_rng().bytes(4), "little")
    print("model seed", seed)
    folder = write_random_llama(str(tmp_path_factory.mktemp("m")), layers=2, seed=seed)
    return {dev: kvpress_c.load_model(folder, **({"weights": "fp32"} if dev == "cpu" else {"device": dev}))
            for dev in ("cpu", "emulated", "cuda")}


def saved_cache(models, tmp_path, rng, think):
    """A CPU session's cache over 150 random tokens (ThinK-pruned: a prefix of narrow key rows), saved in f32."""
    cpu = models["cpu"]
    ids = rng.integers(3, cpu.config["vocab"], 150).astype(np.int32)
    s = cpu.new_session(0)
    if think:
        press = kvpress_c.ThinKPress(key_channel_compression_ratio=0.25, window_size=8)
        s.forward(ids[:-16], logits="none")
        s.set_press(**press.c_config())
        press.before_prefill(s, 16, cpu.config)
        s.forward(ids[-16:], logits="none")
        s.set_press(None)
    else:
        s.forward(ids, logits="none")
    path = str(tmp_path / "cache.kvc")
    s.save(path)
    return path


def loaded_one(model, path, kv_cache):
    """A session of the type holding the saved f32 rows in it (a load keeps the file's type unless told)."""
    s = model.new_session(0, kv_cache=kv_cache)
    s.load(path, kv_format=kv_format(kv_cache))
    return s


def loaded(models, path, kv_cache):
    return {dev: loaded_one(models[dev], path, kv_cache) for dev in ("emulated", "cuda")}


def assert_rows_agree(emu, cuda, L, Hkv, kivi):
    for l in range(L):
        for h in range(Hkv):
            ke, ve = emu.cache_rows(l, h)
            kc, vc = cuda.cache_rows(l, h)
            assert kc.shape == ke.shape and vc.shape == ve.shape, (l, h)
            if kivi:
                big = max(np.abs(ke).max(initial=0), np.abs(ve).max(initial=0))
                assert np.abs(kc - ke).max(initial=0) <= KIVI_ROUNDING * big, (l, h)
                assert np.abs(vc - ve).max(initial=0) <= KIVI_ROUNDING * big, (l, h)
            else:
                assert np.array_equal(kc, ke) and np.array_equal(vc, ve), (l, h)


@pytest.mark.parametrize("think", [False, True], ids=["full", "think"])
@pytest.mark.parametrize("name", list(TYPES))
def test_loaded_rows_match_the_emulated_device(models, tmp_path, rng, name, think):
    path = saved_cache(models, tmp_path, rng, think)
    s = loaded(models, path, TYPES[name])
    cfg = models["cpu"].config
    assert np.array_equal(s["cuda"].cache_lengths(), s["emulated"].cache_lengths())
    assert_rows_agree(s["emulated"], s["cuda"], cfg["n_layers"], cfg["n_kv_heads"], name.startswith("kivi"))
    # a cut into the typed rows (KIVI: blocks back to staging rows) keeps the two together
    lens = s["cuda"].cache_lengths() - 37
    for dev in s.values():
        dev.truncate(lens, int(dev.position) - 37)
    assert_rows_agree(s["emulated"], s["cuda"], cfg["n_layers"], cfg["n_kv_heads"], name.startswith("kivi"))


@pytest.mark.parametrize("name", list(TYPES))
def test_attention_over_typed_rows_matches_the_emulated_device(models, tmp_path, rng, name):
    """A call of 6 queries over the loaded past (the prefill kernels, the call's own rows staged), then decode
    steps (split-K over the typed rows, each step's row committed after it). KIVI: the 12 steps before a row
    each device computed itself goes into a key block; after that its codes may differ by a whole step (at 2
    bits a third of a channel's range, from a bf16 summation-order difference), which no bf16 bound covers."""
    path = saved_cache(models, tmp_path, rng, think=False)
    s = loaded(models, path, TYPES[name])
    V = models["cpu"].config["vocab"]
    q = rng.integers(3, V, 6).astype(np.int32)
    assert rel(s["cuda"].forward(q, logits="all"), s["emulated"].forward(q, logits="all")) < MODEL_TOL
    for t in rng.integers(3, V, 12 if name.startswith("kivi") else 30).astype(np.int32):
        le = s["emulated"].forward(np.array([t], np.int32), logits="last")
        lc = s["cuda"].forward(np.array([t], np.int32), logits="last")
        assert rel(lc, le) < MODEL_TOL
    assert np.array_equal(s["cuda"].cache_lengths(), s["emulated"].cache_lengths())


@pytest.mark.parametrize("name", list(TYPES))
def test_decode_graph_replays_the_eager_typed_steps(models, tmp_path, rng, name):
    """40 decode steps over the loaded cache replayed as a graph equal the eager steps (as test_device's graph
    test: rel < 1e-5): the staging rows, kv_commit's kernels (KIVI: blocks quantised inside the replays, the rows
    left moved, nq moved on the device) and the typed split-K run from the device's lengths."""
    path = saved_cache(models, tmp_path, rng, think=False)
    ids = rng.integers(3, models["cpu"].config["vocab"], 40).astype(np.int32)
    out, rows = [], []
    for graphs in (True, False):
        s = loaded_one(models["cuda"], path, TYPES[name])
        s.set_decode_graphs(graphs)
        out.append(np.stack([s.forward(ids[i:i + 1], logits="last") for i in range(len(ids))]))
        info = s.graph_info
        assert info["error"] == "" and info["graph_steps"] == (len(ids) - 1 if graphs else 0), info  # the first eager
        rows.append(np.concatenate([np.concatenate(s.cache_rows(l, h)) for l in range(2) for h in range(2)]))
    assert rel(out[0], out[1]) < 1e-5
    assert rel(rows[0], rows[1]) < 1e-5


@pytest.mark.parametrize("name", list(TYPES))
def test_compaction_keeps_the_rows_and_frees_their_bytes(models, rng, name):
    """SnapKV on a CUDA session of the type: the kept rows are the full session's rows at the kept positions
    (rows stored alone are copied as stored: equal; KIVI stages and quantises the kept rows again: within its
    own step, checked against the emulated device's rule by the loaded-rows test), and the bytes drop."""
    cuda = models["cuda"]
    cfg = cuda.config
    ids = rng.integers(3, cfg["vocab"], 200).astype(np.int32)
    full, pressed = cuda.new_session(0, kv_cache=TYPES[name]), cuda.new_session(0, kv_cache=TYPES[name])
    full.forward(ids, logits="none")
    pressed.set_press(**kvpress_c.SnapKVPress(compression_ratio=0.5, window_size=8).c_config())
    pressed.forward(ids, logits="none")
    kept = pressed.cache_lengths()
    assert (kept < full.cache_lengths()).all()
    assert pressed.cache_bytes < full.cache_bytes
    if name.startswith("kivi"):
        return
    for l in range(cfg["n_layers"]):
        for h in range(cfg["n_kv_heads"]):
            pos = pressed.cache_positions(l, h)
            kf, vf = full.cache_rows(l, h)
            kp, vp = pressed.cache_rows(l, h)
            assert np.array_equal(kp, kf[pos]) and np.array_equal(vp, vf[pos]), (l, h)



@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("name", ["kivi4", "kivi2"])
def test_a_cut_back_to_before_a_call_gives_its_rows_back(models, tmp_path, rng, name, graphs):
    """A failed call on a KIVI store loses nothing (core/kv_undo.h): the engine rolls it back by cutting every
    layer to its lengths before the call (kv_set_lens; a truncate to them is the same cut), and the rows of earlier
    calls that the call's commit quantised come back in f32 as they were, bit for bit. test_faults.py fails every
    call on the emulated device (the host store); CUDA has no injected faults, so the cut is made after each call
    here: eager calls, and decode steps replayed as a graph (the append kernel sets the mark, the commit kernels
    keep the undo rows on the device)."""
    path = saved_cache(models, tmp_path, rng, think=False)
    cfg = models["cpu"].config
    s = loaded_one(models["cuda"], path, TYPES[name])
    s.set_decode_graphs(graphs)
    # groups of 16, residual 24: calls of 4, 5, 20, 3, 30 rows fill the residual twice; 40 decode steps, twice too
    sizes = [1] * 40 if graphs else [4, 5, 20, 3, 30]
    calls = [rng.integers(3, cfg["vocab"], n).astype(np.int32) for n in sizes]
    took = cut_back_after_each_call(s, calls, cfg["n_layers"], cfg["n_kv_heads"])
    assert took >= 2, took  # the rule was exercised: commits quantised rows of earlier calls
    info = s.graph_info
    assert info["error"] == "" and (info["graph_steps"] > 0) == graphs, info


def rows_of(s, L, Hkv):
    return [[s.cache_rows(l, h) for h in range(Hkv)] for l in range(L)]


def held_rows(s, L, Hkv):
    """Position, lengths and every row as read back (bytes: exact)."""
    return (int(s.position), s.cache_lengths().tolist(),
            [[b"".join(x.tobytes() for x in kv) for kv in heads] for heads in rows_of(s, L, Hkv)])


def cut_back_after_each_call(s, calls, L, Hkv):
    """Each call (token ids) made, cut back to the lengths and position before it (what the engine's roll-back of a
    failed call does), the rows checked against those before it, bit for bit, and made again. Returns how many
    calls changed rows of earlier calls as read back (KIVI's commit quantised residual rows with the call's)."""
    took = 0
    for ids in calls:
        pos, lens, rows, before = int(s.position), s.cache_lengths(), rows_of(s, L, Hkv), held_rows(s, L, Hkv)
        s.forward(ids, logits="none")
        after = rows_of(s, L, Hkv)
        took += any(not np.array_equal(a[:len(b)], b) for l in range(L) for h in range(Hkv) for a, b in zip(after[l][h], rows[l][h]))
        s.truncate(lens, pos)
        assert held_rows(s, L, Hkv) == before
        s.forward(ids, logits="none")
    return took
