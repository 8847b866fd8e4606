"""A decoding press's state mid-answer in a saved cache (the presses' save_state / load_state: csrc/press/decoding.c,
dms.c; the file's state.* tensors, csrc/persist/press_state.c): saved between two decode steps and reloaded, the
answer goes on with the logits of the session that never saved, bit for bit on the CPU, for every decoding press
family, while the same cache under a fresh press does not (the state is what goes on); saved on the CPU, it goes on
on the emulated device within the device tolerance; a state the press attached does not keep, damaged values and
older or newer format versions are refused with a ValueError saying which, the session left empty."""
import hashlib
import json
import struct

import numpy as np
import pytest

import kvpress_c
from kvpress_c.saved import save_session
from random_llama import write_random_llama

VOCAB, INTERVAL = 300, 5
# the device tests' bound on CPU vs emulated logits: 1.5 x the largest measured (tests/device/test_device.py)
MODEL_TOL = 1.5 * 0.0638


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("dec")), layers=2, hidden=128, heads=4, kv_heads=2, ffn=256,
                              vocab=VOCAB, seed=11)


def _presses(threshold):
    K, kw = kvpress_c, dict(compression_interval=INTERVAL, hidden_states_buffer_size=8)
    return {
        "knorm": K.DecodingPress(K.KnormPress(), target_size=40, **kw),
        "snapkv": K.DecodingPress(K.SnapKVPress(window_size=4, kernel_size=3), target_size=40, **kw),
        "tova": K.DecodingPress(K.TOVAPress(), target_size=40, **kw),
        "expected_attention": K.DecodingPress(K.ExpectedAttentionPress(), target_size=40, **kw),
        "ratio": K.CompressionRatioDecodingPress(K.KnormPress(), target_compression_ratio=0.6, **kw),
        "cam": K.CAMPress(K.KnormPress(), target_size=40, merge_budget=4, seed=3, **kw),
        "dms": K.DMSPress(K.KnormPress(), threshold=threshold, sliding_window_size=6, decoding=True),
    }


def _threshold(model, prompt):
    """DMSPress's threshold at the median of the prompt's Knorm scores (-||k||): about half the rows go."""
    s = model.new_session(0)
    s.forward(prompt, logits="last")
    return float(np.median([-np.linalg.norm(s.cache_rows(0, h)[0], axis=1) for h in range(2)]))


def _decode(s, logits, steps):
    for _ in range(steps):
        logits = s.forward(np.array([int(np.argmax(logits))], np.int32), logits="last")
    return logits


@pytest.mark.parametrize("name", ["knorm", "snapkv", "tova", "expected_attention", "ratio", "cam", "dms"])
def test_saved_mid_answer_goes_on_bit_for_bit(folder, tmp_path, rng, name):
    model = kvpress_c.load_model(folder, weights="fp32")
    prompt = rng.integers(3, VOCAB, 90).astype(np.int32)
    press = _presses(_threshold(model, prompt))[name]
    cfg = press.decoding_config()
    s = model.new_session(0)
    s.set_decoding_press(**cfg)
    logits = _decode(s, s.forward(prompt, logits="last"), INTERVAL + 2)  # mid-interval: buffers and counters held
    save_session(s, tmp_path / "mid.kvc", decoding=(press, cfg))
    names = json.loads(kvpress_c._core.cache_file_metadata(str(tmp_path / "mid.kvc")))
    assert kvpress_c.cache_info(tmp_path / "mid.kvc")["version"] == 3 and names["kvc.presses"] == "decoding"
    r = kvpress_c.load_session(model, tmp_path / "mid.kvc")
    fresh = model.new_session(0)  # the same cache under a fresh press: what a file without the state gives
    fresh.copy_cache_from(s)
    fresh.set_decoding_press(**cfg)
    differs = False
    for _ in range(3 * INTERVAL):
        t = np.array([int(np.argmax(logits))], np.int32)
        logits, lr, lf = s.forward(t, logits="last"), r.forward(t, logits="last"), fresh.forward(t, logits="last")
        assert np.array_equal(logits, lr) and np.array_equal(s.cache_lengths(), r.cache_lengths())
        differs |= not np.array_equal(logits, lf) or not np.array_equal(s.cache_lengths(), fresh.cache_lengths())
    assert s.decoding_compressions == r.decoding_compressions
    assert differs, "a fresh press went on as the saved state did: the test saves no state that matters"
    if name != "dms":
        assert s.decoding_compressions > 0
    else:  # DMSPress evicted behind its window while decoding
        assert s.cache_lengths().sum() < s.position * s.cache_lengths().size


def test_dms_prefill_window_saved_before_the_first_step(folder, tmp_path, rng):
    """DMSPress(decoding=True) with its prefill part attached: the window a prefill leaves unjudged is the prefill
    part's state; saved right after the prefill, the decoding part's first steps judge it as without the save."""
    model = kvpress_c.load_model(folder, weights="fp32")
    prompt = rng.integers(3, VOCAB, 90).astype(np.int32)
    press = kvpress_c.DMSPress(kvpress_c.KnormPress(), threshold=_threshold(model, prompt), sliding_window_size=6,
                               decoding=True)
    s = model.new_session(0)
    s.set_press(**press.c_config())
    s.set_decoding_press(**press.decoding_config())
    logits = s.forward(prompt, logits="last")
    save_session(s, tmp_path / "p.kvc", press=press, decoding=(press, press.decoding_config()))
    assert kvpress_c.cache_info(tmp_path / "p.kvc")["attached"] == ["press", "decoding"]
    r = kvpress_c.load_session(model, tmp_path / "p.kvc", press=press)
    fresh = model.new_session(0)  # the decoding part starts with an empty queue: the window is never judged
    fresh.copy_cache_from(s)
    fresh.set_decoding_press(**press.decoding_config())
    differs = False
    for _ in range(8):
        t = np.array([int(np.argmax(logits))], np.int32)
        logits, lr, lf = s.forward(t, logits="last"), r.forward(t, logits="last"), fresh.forward(t, logits="last")
        assert np.array_equal(logits, lr) and np.array_equal(s.cache_lengths(), r.cache_lengths())
        differs |= not np.array_equal(s.cache_lengths(), fresh.cache_lengths())
    assert differs


@pytest.mark.parametrize("name", ["snapkv", "cam"])
def test_saved_on_the_cpu_goes_on_on_the_emulated_device(folder, tmp_path, rng, name):
    """The CPU's file on the emulated device (rows rounded to its bf16 store, the state's f32 queries as saved):
    teacher-forced steps compress at the same steps as the CPU session (the counters came along) and the logits stay
    within the device tolerance of the CPU's."""
    cpu, dev = kvpress_c.load_model(folder, weights="fp32"), kvpress_c.load_model(folder, device="emulated")
    prompt = rng.integers(3, VOCAB, 90).astype(np.int32)
    press = _presses(0.0)[name]
    cfg = press.decoding_config()
    s = cpu.new_session(0)
    s.set_decoding_press(**cfg)
    logits = _decode(s, s.forward(prompt, logits="last"), INTERVAL + 2)
    save_session(s, tmp_path / "cpu.kvc", decoding=(press, cfg))
    d = kvpress_c.load_session(dev, tmp_path / "cpu.kvc")
    L, Hkv = cpu.config["n_layers"], cpu.config["n_kv_heads"]

    def kept(x):
        return [x.cache_positions(layer, h).tolist() for layer in range(L) for h in range(Hkv)]

    def values_apart(x, y):  # per head: its stored values' largest difference, of its largest |value|
        return np.array([float(np.abs(x.cache_rows(layer, h)[1] - y.cache_rows(layer, h)[1]).max()
                               / np.abs(y.cache_rows(layer, h)[1]).max()) for layer in range(L) for h in range(Hkv)])

    worst, compared = 0.0, 0
    for _ in range(INTERVAL + 1):  # through the next compression
        t = np.array([int(np.argmax(logits))], np.int32)
        before = s.decoding_compressions
        logits, ld = s.forward(t, logits="last"), d.forward(t, logits="last")
        assert np.array_equal(s.cache_lengths(), d.cache_lengths())
        assert d.decoding_compressions - before == s.decoding_compressions - before
        if kept(s) != kept(d):
            # only a compression may choose other rows: a bf16-rounded score crossing a near-tie of the f32 one (2 seeds
            # in 30 for CAM over Knorm moved the logits by 0.38 and 0.49 so); the logits compare up to here
            assert s.decoding_compressions > before, "the kept rows differ without a compression"
            print(f"{name}: the emulated device kept other rows at the compression after {compared} steps (a near-tie)")
            break
        apart = values_apart(d, s) > 0.05 if s.decoding_compressions > before else np.zeros(1, bool)
        if apart.any():
            # the same rows kept but other values merged into them in a head (CAM's merge draws against a
            # bf16-rounded score: a near-tie as above; seed 3077056944 moved a value of one head by 0.20 of its
            # largest and the logits by 0.12 so): the logits compare up to here. A near-tie moves one head's merge,
            # not most heads'. The stored values otherwise differ by their bf16 rounding, 0.006-0.011 over 4 seeds
            assert apart.sum() <= 2, f"{apart.sum()} of {apart.size} heads merged other values: more than a near-tie"
            print(f"{name}: the emulated device merged other values at the compression after {compared} steps (a near-tie)")
            break
        compared += 1
        worst = max(worst, float(np.abs(ld - logits).max() / np.abs(logits).max()))
    print(f"{name}: CPU file on the emulated device, max relative logit difference {worst:.3g} over {compared} steps")
    assert worst < MODEL_TOL


# -- refusals ---------------------------------------------------------------------------------------------------

def _rewrite(path, out, meta=None, tensor=None):
    """The file with metadata changed or one tensor's values replaced (tensor = (name, new bytes)), its digest
    recomputed: a well-formed file that says something else."""
    raw = open(path, "rb").read()
    hlen = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + hlen])
    data = bytearray(raw[8 + hlen:])
    if tensor is not None:
        a, b = hdr[tensor[0]]["data_offsets"]
        assert len(tensor[1]) == b - a
        data[a:b] = tensor[1]
    hdr["__metadata__"].update(meta or {})
    hdr["__metadata__"]["kvc.digest"] = "sha256:" + "0" * 64
    body = json.dumps(hdr).encode()
    body += b" " * (-len(body) % 8)
    blob = struct.pack("<Q", len(body)) + body + bytes(data)
    open(out, "wb").write(blob.replace(b"0" * 64, hashlib.sha256(blob).hexdigest().encode(), 1))


def _tensor(path, name):
    raw = open(path, "rb").read()
    hlen = struct.unpack("<Q", raw[:8])[0]
    t = json.loads(raw[8:8 + hlen])[name]
    a, b = t["data_offsets"]
    return np.frombuffer(raw[8 + hlen + a:8 + hlen + b], dtype={"I64": np.int64, "F32": np.float32}[t["dtype"]]).copy()


def test_bad_states_and_versions_are_refused(folder, tmp_path, rng):
    model = kvpress_c.load_model(folder, weights="fp32")
    press = _presses(0.0)["snapkv"]
    cfg = press.decoding_config()
    s = model.new_session(0)
    s.set_decoding_press(**cfg)
    _decode(s, s.forward(rng.integers(3, VOCAB, 60).astype(np.int32), logits="last"), INTERVAL + 2)
    path = tmp_path / "s.kvc"
    save_session(s, path, decoding=(press, cfg))

    def refused(p, match, attach=cfg):
        t = model.new_session(0)
        if attach:
            t.set_decoding_press(**attach)
        with pytest.raises(ValueError, match=match):
            t.load(str(p))
        assert t.position == 0 and int(t.cache_lengths().sum()) == 0  # nothing half-loaded

    for version, why in (("2", "version 2, older than this kvpress_c reads"),
                         ("4", "version 4, newer than this kvpress_c reads")):
        _rewrite(path, tmp_path / f"v{version}.kvc", meta={"kvc.version": version})
        refused(tmp_path / f"v{version}.kvc", why)
        with pytest.raises(ValueError, match=why):
            kvpress_c.cache_info(tmp_path / f"v{version}.kvc")
    # another press's settings: its buffers do not fit the state
    other = kvpress_c.DecodingPress(kvpress_c.SnapKVPress(window_size=2, kernel_size=3), target_size=40,
                                    compression_interval=INTERVAL, hidden_states_buffer_size=3).decoding_config()
    refused(path, "buffers 4 query rows and 9 calls per layer; the press attached buffers 2 and 4", attach=other)
    # refused after the rows were stored in another type (the state is read last): the session keeps its own
    t = model.new_session(0, kv_cache="f16")
    t.set_decoding_press(**other)
    with pytest.raises(ValueError, match="the press attached buffers 2 and 4"):
        t.load(str(path), kv_format=kvpress_c.kv_cache.kv_format("q8_0"))
    assert t.kv_format() == kvpress_c.kv_cache.kv_format("f16") and int(t.cache_lengths().sum()) == 0
    with pytest.raises(ValueError, match="other settings"):
        kvpress_c.load_session(model, path, press=kvpress_c.DecodingPress(kvpress_c.KnormPress(), target_size=40))
    # values a well-formed file may hold but a press cannot continue from
    steps = _tensor(path, "state.decoding.steps")
    _rewrite(path, tmp_path / "steps.kvc", tensor=("state.decoding.steps", np.full_like(steps, -3).tobytes()))
    refused(tmp_path / "steps.kvc", "counts -3 steps")
    q = _tensor(path, "state.decoding.queries")
    q[len(q) // 2] = np.nan
    _rewrite(path, tmp_path / "nan.kvc", tensor=("state.decoding.queries", q.tobytes()))
    refused(tmp_path / "nan.kvc", "queries are not finite")
    n = _tensor(path, "state.decoding.n_entries")
    n[0] = 100
    _rewrite(path, tmp_path / "ne.kvc", tensor=("state.decoding.n_entries", n.tobytes()))
    refused(tmp_path / "ne.kvc", "buffers 100 calls")
    # the cache alone loads into a session without the press (the file names it: load_session re-attaches it)
    t = model.new_session(0)
    t.load(str(path))
    assert t.position == s.position
