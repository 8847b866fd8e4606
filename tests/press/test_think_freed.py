"""ThinK with its memory really freed (issue 16): the pruned key rows are stored with their kept channels
only (core/backend.h, kv_prune_keys). Checked here:
- the pruned-channel attention kernel against a float64 NumPy reference on fresh random inputs (rows of a
  pruned prefix whose dropped channels hold random values the kernel must ignore, later rows full), on the
  CPU and on the emulated device;
- a model run: the freed layout gives the logits and greedy continuation of the zeroing layout (kvpress's
  ThinK), alone and composed with SnapKV, through decode steps that append full rows, a cache growth and
  a second compressed prefill (a second ThinK re-prunes the pruned rows), on the CPU and the emulated device;
- the KV bytes after compression equal the layout's formula (pruned K rows take dk / d of a row);
- truncation into the pruned rows, a copied session, and decode graphs (emulated) over pruned rows;
- the emulated device's freed layout against the CPU's.
Every test that runs on the emulated device runs on `cuda` too where this build and machine have it (skipped
with the build's reason otherwise); the CUDA backend stores q, K, V in bf16 like the emulated device, so it
is held to the emulated device's bounds.
"""
import ctypes as C

import numpy as np
import pytest

import kvpress_c
from capi import DEVICES, check, lib, why_no_cuda
from press_runs import rotations
from random_llama import write_random_llama

SHAPE = dict(layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=512)  # head_dim 64

_NO_CUDA = None if kvpress_c.cuda_available() else (why_no_cuda() or "no CUDA backend")
# "cuda" after "cpu" and "emulated" in every device parametrisation; skipped where CUDA is absent
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(_NO_CUDA is not None, reason=_NO_CUDA or ""))
DEVICES_ALL = ["cpu", "emulated", CUDA]


def rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


# ---- the kernel against float64 ------------------------------------------------------------------- #

def attention_ref(q, ks, vs, past, pruned, kidx, scale):
    """float64: query i of head hq sees rows < past + i + 1 of KV head hq // g; a pruned row's key has only
    its kept channels (the others zero)."""
    n, H, d = q.shape
    Hkv = len(ks)
    g = H // Hkv
    out = np.zeros((n, H, d))
    for h in range(Hkv):
        k = ks[h].astype(np.float64).copy()
        mask = np.ones(d, bool)
        mask[kidx[h]] = False
        k[:pruned[h], mask] = 0.0
        v = vs[h].astype(np.float64)
        for j in range(g):
            hq = h * g + j
            s = q[:, hq].astype(np.float64) @ k.T * scale  # [n, rows]
            for i in range(n):
                vis = past[h] + i + 1
                p = np.exp(s[i, :vis] - s[i, :vis].max())
                out[i, hq] = p @ v[:vis] / p.sum()
    return out


def run_pruned(device, q, ks, vs, past, pruned, kidx, scale, force_prefill=0):
    n, H, d = q.shape
    Hkv, dk = len(ks), kidx.shape[1]
    kp = (C.c_void_p * Hkv)(*[k.ctypes.data for k in ks])
    vp = (C.c_void_p * Hkv)(*[v.ctypes.data for v in vs])
    out = np.zeros((n, H, d), np.float32)
    check(lib.kvc_device_kernel_attention_pruned(DEVICES[device], q, n, H, Hkv, d, C.cast(kp, C.c_void_p),
                                                 C.cast(vp, C.c_void_p), past, pruned, dk,
                                                 np.ascontiguousarray(kidx, np.int32), scale, out, force_prefill))
    return out


def bf16(x):
    x = np.ascontiguousarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)


# CPU (fp32): measured max |ours - ref| / max |ref| up to 1.05e-6 over 8 seeds x these shapes; bound 1e-5.
# Emulated (bf16 storage of q, K, V and the output; inputs already bf16 here, so only the output rounds):
# measured up to 3.3e-3, below the 2^-8 of one bf16 rounding; bound 1e-2 as the device attention tests.
# CUDA: the emulated device's bound (the same bf16 storage; not yet measured on a GPU).
TOL = {"cpu": 1e-5, "emulated": 1e-2, "cuda": 1e-2}


@pytest.mark.parametrize("device", DEVICES_ALL)
@pytest.mark.parametrize("n,H,Hkv,d,ratio", [(1, 8, 2, 64, 0.5), (3, 4, 4, 32, 0.25), (70, 6, 2, 64, 0.75),
                                              (150, 4, 1, 128, 0.5)])
@pytest.mark.parametrize("force_prefill", [0, 1])
def test_pruned_attention_equals_float64(rng, device, n, H, Hkv, d, ratio, force_prefill):
    past = rng.integers(0, 400, size=Hkv).astype(np.int64)
    past[0] = 0
    q = bf16(rng.standard_normal((n, H, d)) * 2)
    ks = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    vs = [bf16(rng.standard_normal((int(p) + n, d))) for p in past]
    pruned = np.array([rng.integers(0, p + n + 1) for p in past], np.int64)  # a prefix of each head, maybe all
    dk = d - int(d * ratio)
    kidx = np.stack([np.sort(rng.choice(d, dk, replace=False)) for _ in range(Hkv)]).astype(np.int32)
    scale = 1 / np.sqrt(d)
    ours = run_pruned(device, q, ks, vs, past, pruned, kidx, scale, force_prefill)
    ref = attention_ref(q, ks, vs, past, pruned, kidx, scale)
    assert rel(ours, ref) < TOL[device]


def test_pruned_attention_bad_channels_are_clear_errors(rng):
    q = np.zeros((1, 2, 8), np.float32)
    ks = vs = [np.zeros((4, 8), np.float32)]
    past, pruned = np.array([3], np.int64), np.array([2], np.int64)
    with pytest.raises(Exception, match="channels must increase"):
        run_pruned("cpu", q, ks, vs, past, pruned, np.array([[3, 1, 5, 6]], np.int32), 1.0)
    with pytest.raises(Exception, match="prunes 9 rows"):
        run_pruned("cpu", q, ks, vs, past, np.array([9], np.int64), np.array([[1, 2, 5, 6]], np.int32), 1.0)


# ---- the model: freed equals zeroed ---------------------------------------------------------------- #

@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("thinkfree")), seed=5, **SHAPE)


_models = {}


def model_on(path, device):
    if (path, device) not in _models:
        _models[(path, device)] = kvpress_c.load_model(path, device=device)
    return _models[(path, device)]


def think(ratio, free, snap=None):
    t = kvpress_c.ThinKPress(key_channel_compression_ratio=ratio, window_size=16, free_channels=free)
    return t if snap is None else kvpress_c.ComposedPress([kvpress_c.SnapKVPress(compression_ratio=snap, window_size=16), t])


def run(model, press, ids, more, n_new=24, force=None):
    """Prefill with the press, 24 greedy steps (the cache grows past its prefill capacity), then a second
    prompt prefilled with the press again (ThinK re-prunes every row, the first turn's pruned ones too) and
    a few steps: logits of every step, the tokens fed (`force`'s when given, else greedy), and the cache
    bytes after the first compression."""
    s = model.new_session()
    s.set_press(**press.c_config())
    press.before_prefill(s, len(ids), model.config)
    logits = [s.forward(np.asarray(ids, np.int32), logits="last")]
    compressed = s.cache_bytes
    s.set_press(None)
    toks = []

    def step():
        toks.append(force[len(toks)] if force else int(np.argmax(logits[-1])))
        logits.append(s.forward(np.array([toks[-1]], np.int32)))

    for _ in range(n_new):
        step()
    s.set_press(**press.c_config())
    press.before_prefill(s, len(more), model.config)
    logits.append(s.forward(np.asarray(more, np.int32), logits="last"))
    s.set_press(None)
    for _ in range(4):
        step()
    return np.stack(logits), toks, compressed, s


# Freed against zeroed, same device: the same values, only the order of the dot products differs (the
# zeros are skipped). The freed run is fed the zeroed run's tokens, so every step compares. Measured max
# |freed - zeroed| / max |zeroed| over the logits of every step (30 seeds x these 4 presses): CPU 1.5e-6,
# emulated 8.1e-3 (a bf16 rounding of an activation flipped by the last fp32 bit propagates). Bounds
# 1e-4 and 3e-2. Greedy tokens: equal on the CPU; on the emulated device equal wherever the zeroed run's
# top two logits are further apart than the bound (a near tie, 2.4e-4 apart, did flip there).
SAME = {"cpu": 1e-4, "emulated": 3e-2, "cuda": 3e-2}  # cuda: the emulated bound (bf16 storage; unmeasured)


def selection(s):
    """What the presses chose, per (layer, kv head): the kept positions and each row's dropped channels
    (cache_rows gives a pruned row's dropped channels as zeros, in both layouts)."""
    return [(s.cache_positions(l, h), s.cache_rows(l, h)[0] == 0)
            for l in range(SHAPE["layers"]) for h in range(SHAPE["kv_heads"])]


def selection_flips(a, b):
    """Over every head: the most rows one run kept and the other did not, and, on heads that kept the same
    rows, the most channels in which one row's kept set differs (a swapped channel counts 2)."""
    rows = chans = 0
    for (pa, ma), (pb, mb) in zip(a, b):
        if np.array_equal(pa, pb):
            chans = max(chans, int((ma != mb).sum(1).max(initial=0)))
        else:
            rows = max(rows, len(np.setdiff1d(pa, pb)))
    return rows, chans


@pytest.mark.parametrize("device", DEVICES_ALL)
@pytest.mark.parametrize("ratio,snap", [(0.5, None), (0.25, None), (0.75, 0.5), (0.5, 0.5)])
def test_freed_layout_equals_zeroing_layout(model_path, rng, device, ratio, snap):
    """On a bf16 device the second turn's selection may flip at a near tie: after the decode steps the two
    runs' activations differ by bf16 roundings (above), and SnapKV's row scores or ThinK's channel scores
    of the second prefill can swap one row or one channel of a head. Measured (emulated, 150 seeds): 4 flips
    changed the later steps by more than 1e-2, all at (0.5, SnapKV 0.5): one kept row swapped (seed 79), one
    channel of one head swapped (102, 103, 146; the steps after then differ by up to 0.081); counting the
    flips that change less, 9 of 251 seeds (2000-2250) flip. Such a prompt is rotated (up to 3 times) so
    that every step still compares (all 9 chose alike after one rotation); if every rotation flips, the flip
    must be that small and the steps up to the second prefill's (before its compression acts) are compared.
    The CPU always chooses alike."""
    model = model_on(model_path, device)
    n_new = 24
    ids0 = rng.integers(3, SHAPE["vocab"], size=150)
    more = rng.integers(3, SHAPE["vocab"], size=40)
    for attempt, ids in enumerate(rotations(ids0)):
        lz, tz, bz, sz = run(model, think(ratio, False, snap), ids, more, n_new=n_new)
        lf, tf, bf, sf = run(model, think(ratio, True, snap), ids, more, n_new=n_new, force=tz)
        np.testing.assert_array_equal(sf.cache_lengths(), sz.cache_lengths())
        rows, chans = selection_flips(selection(sf), selection(sz))
        if not (rows or chans):
            break
        assert device != "cpu", f"the CPU's freed and zeroed runs chose differently: {rows} rows, {chans} channels"
        print(f"attempt {attempt}: the second turn's selection flipped ({rows} rows, {chans // 2} channels)")
    steps = len(lz)
    if rows or chans:  # every rotation flipped: a near tie swaps one row or one channel, no more
        assert (rows, chans) in ((1, 0), (0, 2)), f"more than a near-tie flip: {rows} rows, {chans} channels"
        steps = n_new + 2  # the prefill, n_new steps and the second prefill's logits (before it compresses)
    lf, lz = lf[:steps], lz[:steps]
    assert rel(lf, lz) < SAME[device]
    top2 = np.sort(lz, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > SAME[device] * np.abs(lz).max()
    if device == "cpu":
        assert clear.mean() > 0.9  # the comparison below is not vacuous
        clear[:] = True
    np.testing.assert_array_equal(lf.argmax(-1)[clear], lz.argmax(-1)[clear])
    assert bf < bz


def slice_bytes(rows, width, es):
    return (rows * width * es + 63) // 64 * 64


@pytest.mark.parametrize("device,es", [("cpu", 4), ("emulated", 2),
                                       pytest.param("cuda", 2, marks=CUDA.marks, id="cuda-2")])
@pytest.mark.parametrize("ratio,snap", [(0.5, None), (0.75, None), (0.5, 0.5)])
def test_kv_bytes_after_compression_follow_the_layout(model_path, rng, device, es, ratio, snap):
    """Per layer and KV head after the compressed prefill: Kp [np, dk] + K [cap - np, d] + V [cap, d]
    (64-byte aligned slices) + 8 bytes of position per row, with cap = np = the rows kept (the prefill
    arena is exactly the prompt; compaction leaves no spare row). Model.memory()["cache"] agrees."""
    model = model_on(model_path, device)
    L, Hkv, d = SHAPE["layers"], SHAPE["kv_heads"], SHAPE["hidden"] // SHAPE["heads"]
    n = 160
    ids = rng.integers(3, SHAPE["vocab"], size=n)
    dk = d - int(d * ratio)
    before = model.memory()["cache"]
    s = model.new_session()
    press = think(ratio, True, snap)
    s.set_press(**press.c_config())
    press.before_prefill(s, n, model.config)
    s.forward(ids.astype(np.int32), logits="none")
    freed = s.cache_bytes
    kept = n if snap is None else n - int(n * snap)
    expect = L * Hkv * (slice_bytes(kept, dk, es) + slice_bytes(kept, d, es) + 8 * kept)
    assert freed == expect
    assert model.memory()["cache"] - before == expect - L * Hkv * 8 * kept  # the device's arenas (no positions)
    del s
    _, _, zeroed, _ = run(model, think(ratio, False, snap), ids, ids[:20], n_new=0)
    assert zeroed == L * Hkv * (2 * slice_bytes(kept, d, es) + 8 * kept)
    # the pruned K rows take dk / d of their full bytes
    assert zeroed - freed == L * Hkv * (slice_bytes(kept, d, es) - slice_bytes(kept, dk, es))


@pytest.mark.parametrize("device", ["emulated", CUDA])
def test_emulated_freed_layout_against_cpu(model_path, rng, device):
    """The emulated device (bf16 storage) against the CPU (fp32), fed the CPU's tokens (and CUDA, held to the same bounds). After ThinK the
    devices may keep different channels (near ties of the channel scores from bf16 and fp32 queries), so
    their decode logits differ, as much in kvpress's zeroing layout: measured max step difference 0.794
    in both layouts over 12 seeds, identical to 6 digits. Held here: the freed layout adds nothing to the
    device difference (within the same-device bound SAME["emulated"]), the prefill logits (computed before
    the pruning) agree within the device bound of tests/device/test_device.py (MODEL_TOL 0.0957; measured
    0.042), and the bf16 store holds half the bytes."""
    ids = rng.integers(3, SHAPE["vocab"], size=150)
    more = rng.integers(3, SHAPE["vocab"], size=40)
    diff, nbytes = {}, {}
    for free in (True, False):
        lc, tc, bc, _ = run(model_on(model_path, "cpu"), think(0.5, free), ids, more, n_new=8)
        le, _, be, _ = run(model_on(model_path, device), think(0.5, free), ids, more, n_new=8, force=tc)
        assert rel(le[0], lc[0]) < 0.0957
        diff[free] = np.array([rel(a, b) for a, b in zip(le, lc)])
        nbytes[free] = (bc, be)
    assert np.abs(diff[True] - diff[False]).max() < SAME[device]
    bc, be = nbytes[True]
    assert be < bc and nbytes[True][1] < nbytes[False][1]


@pytest.mark.parametrize("device", DEVICES_ALL)
def test_truncate_into_the_pruned_rows_and_fork(model_path, rng, device):
    """Truncating into the pruned prefix (the store rebuilds: the rows appended after it are full again)
    and forking a session (the copy carries the prefix) give the zeroing layout's logits, bytes following."""
    model = model_on(model_path, device)
    ids = rng.integers(3, SHAPE["vocab"], size=120)
    steps = rng.integers(3, SHAPE["vocab"], size=12)
    out, nbytes = {}, {}
    for free in (False, True):
        press = think(0.5, free)
        s = model.new_session()
        s.set_press(**press.c_config())
        press.before_prefill(s, len(ids), model.config)
        s.forward(ids.astype(np.int32), logits="none")
        s.set_press(None)
        lens = s.cache_lengths().copy()
        lens[:, 0] = 100  # head 0 of every layer cut inside its pruned rows, head 1 kept whole
        s.truncate(lens, 120)
        nbytes[free] = s.cache_bytes
        fork = model.new_session()
        fork.copy_cache_from(s)
        assert fork.cache_bytes <= s.cache_bytes  # the copy is sized to the rows held
        out[free] = [s.forward(np.array([t], np.int32)) for t in steps]
        out[free] += [fork.forward(np.array([t], np.int32)) for t in steps[::-1]]
    assert rel(np.stack(out[True]), np.stack(out[False])) < SAME[device]
    assert nbytes[True] < nbytes[False]


@pytest.mark.parametrize("device", ["emulated", CUDA])
def test_decode_graph_over_pruned_rows(model_path, rng, device):
    """Emulated (and CUDA) decode steps replayed from a graph over a cache with pruned rows equal the eager steps
    (bound of tests/device/test_device.py's graph test, 1e-5), growth of the arenas included."""
    model = model_on(model_path, device)
    ids = rng.integers(3, SHAPE["vocab"], size=100)
    steps = rng.integers(3, SHAPE["vocab"], size=40)
    out = []
    for graphs in (True, False):
        press = think(0.5, True, 0.5)
        s = model.new_session()
        s.set_press(**press.c_config())
        press.before_prefill(s, len(ids), model.config)
        s.forward(ids.astype(np.int32), logits="none")
        s.set_press(None)
        s.set_decode_graphs(graphs)
        out.append(np.stack([s.forward(np.array([t], np.int32), logits="last") for t in steps]))
        assert s.graph_info["error"] == "" and s.graph_info["graph_steps"] == (39 if graphs else 0)
    assert rel(out[0], out[1]) < 1e-5


@pytest.mark.parametrize("device", DEVICES_ALL)
def test_decoding_press_over_pruned_rows(model_path, rng, device):
    """A decoding press (Knorm every 8 steps down to 60 rows) after ThinK: its scorer reads the pruned rows
    as kv_read gives them (dropped channels zero) and its compactions keep kept pruned rows pruned; the
    freed layout gives the zeroing layout's logits (fed the same tokens) and kept positions."""
    model = model_on(model_path, device)
    ids = rng.integers(3, SHAPE["vocab"], size=120)
    dec = kvpress_c.DecodingPress(kvpress_c.KnormPress(), compression_interval=8, target_size=60)
    res = {}
    for free in (False, True):
        press = think(0.5, free)
        s = model.new_session()
        s.set_press(**press.c_config())
        press.before_prefill(s, len(ids), model.config)
        logits = [s.forward(ids.astype(np.int32), logits="last")]
        s.set_press(None)
        s.set_decoding_press(**dec.decoding_config())
        toks = res[False][1] if free else []
        for i in range(30):
            if not free:
                toks.append(int(np.argmax(logits[-1])))
            logits.append(s.forward(np.array([toks[i]], np.int32), logits="last"))
        assert s.cache_lengths().max() < 120  # the decoding press compressed
        pos = [s.cache_positions(l, h) for l in range(SHAPE["layers"]) for h in range(SHAPE["kv_heads"])]
        res[free] = (np.stack(logits), toks, pos, s.cache_bytes)
    assert rel(res[True][0], res[False][0]) < SAME[device]
    for a, b in zip(res[True][2], res[False][2]):
        np.testing.assert_array_equal(a, b)
    assert res[True][3] < res[False][3]
