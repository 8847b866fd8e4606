"""Float64 NumPy references (tests/reference/np_llama.py) for ThinK, KeyRerotation and the decoding presses, on a tiny random llama
with fresh random prompts: ThinK's channel scores and pruning, KeyRerotation's re-rotation, and the decode
over a cache that a decoding press compacted. Ours runs in fp32: logits agree to 1e-4 x their scale (the
existing ragged-decode reference holds the same bound; measured ~1e-6)."""
import numpy as np
import pytest

import kvpress_c

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hf_models import write_tiny_model
    return write_tiny_model(str(tmp_path_factory.mktemp("ref16b") / "llama"), arch="llama", seed=23)


def close(ours, theirs):
    for a, b in zip(ours, theirs):
        assert np.abs(a - b).max() <= TOL * np.abs(b).max(), np.abs(a - b).max() / np.abs(b).max()


def decode_both(s, ref, cache, first_ours, first_ref, n, steps=4):
    ours, theirs = [first_ours], [first_ref]
    tok = int(np.argmax(first_ref))
    for step in range(steps):
        ours.append(s.forward(np.array([tok], np.int32)))
        theirs.append(ref.logits(ref.forward(ref.embed([tok]), [n + step], cache))[0])
        tok = int(np.argmax(theirs[-1]))
    close(ours, theirs)


@pytest.mark.parametrize("ratio,window", [(0.25, 8), (0.5, 16), (0.75, 4)])
def test_think_equals_float64_reference(tiny, rng, ratio, window):
    from np_llama import NpLlama
    ref, model = NpLlama(tiny), kvpress_c.load_model(tiny)
    ids = rng.integers(3, 256, size=90)
    press = kvpress_c.ThinKPress(key_channel_compression_ratio=ratio, window_size=window)
    s = model.new_session()
    s.set_press(**press.c_config())
    press.before_prefill(s, len(ids), model.config)
    first = s.forward(ids.astype(np.int32), logits="last")
    s.set_press(None)
    g, n_pruned = ref.H // ref.Hkv, int(ref.d * ratio)

    def think(l, q, attn, o, resid, past, cache):  # the spec: mean_q(q_c^2) (GQA mean) x mean_rows(k_c^2)
        qn = (q[-window:] ** 2).mean(axis=0)  # [H, d]
        for h in range(ref.Hkv):
            ch = cache[l][h]
            score = qn[h * g:(h + 1) * g].mean(axis=0) * (ch["k"] ** 2).mean(axis=0)
            k = ch["k"].copy()
            k[:, np.argsort(score, kind="stable")[:n_pruned]] = 0.0
            ch["k"] = k

    cache = ref.empty_cache()
    hidden = ref.forward(ref.embed(ids), np.arange(len(ids)), cache, hook=think)
    decode_both(s, ref, cache, first, ref.logits(hidden[-1:])[0], len(ids))


@pytest.mark.parametrize("ratio", [0.3, 0.7])
def test_key_rerotation_equals_float64_reference(tiny, rng, ratio):
    """The kept rows (ours, by position) re-rotated by (i - position) in float64: the same decode."""
    from np_llama import NpLlama
    ref, model = NpLlama(tiny), kvpress_c.load_model(tiny)
    ids = rng.integers(3, 256, size=100)
    press = kvpress_c.KeyRerotationPress(kvpress_c.SnapKVPress(compression_ratio=ratio, window_size=8))
    s = model.new_session()
    s.set_press(**press.c_config())
    press.before_prefill(s, len(ids), model.config)
    first = s.forward(ids.astype(np.int32), logits="last")
    s.set_press(None)
    kept = [[s.cache_positions(l, h) for h in range(ref.Hkv)] for l in range(ref.L)]

    def rerotate(l, q, attn, o, resid, past, cache):
        for h in range(ref.Hkv):
            ch = cache[l][h]
            sel = np.searchsorted(ch["pos"], kept[l][h])
            k = ref.rope(ch["k"][sel][:, None, :], np.arange(len(sel)) - ch["pos"][sel])[:, 0]
            cache[l][h] = dict(k=k, v=ch["v"][sel], pos=ch["pos"][sel])

    cache = ref.empty_cache()
    hidden = ref.forward(ref.embed(ids), np.arange(len(ids)), cache, hook=rerotate)
    decode_both(s, ref, cache, first, ref.logits(hidden[-1:])[0], len(ids))


def test_decoding_press_compaction_equals_float64_reference(tiny, rng):
    """StreamingLLM while decoding (target 40, every 5 steps): the reference cache keeps the sinks and the
    most recent rows at each compression (the definition); logits and lengths must follow."""
    from np_llama import NpLlama
    ref, model = NpLlama(tiny), kvpress_c.load_model(tiny)
    ids = rng.integers(3, 256, size=60)
    press = kvpress_c.DecodingPress(kvpress_c.StreamingLLMPress(), compression_interval=5, target_size=40)
    s = model.new_session()
    s.set_decoding_press(**press.decoding_config())
    ours = [s.forward(ids.astype(np.int32), logits="last")]
    cache = ref.empty_cache()
    theirs = [ref.logits(ref.forward(ref.embed(ids), np.arange(len(ids)), cache)[-1:])[0]]
    steps = {"n": 0}

    def compress(l, q, attn, o, resid, past, cache):
        if steps["n"] % 5 == 0:
            for h in range(ref.Hkv):
                ch = cache[l][h]
                if len(ch["pos"]) > 40:
                    sel = np.r_[np.arange(4), np.arange(len(ch["pos"]) - 36, len(ch["pos"]))]
                    cache[l][h] = dict(k=ch["k"][sel], v=ch["v"][sel], pos=ch["pos"][sel])

    tok = int(np.argmax(theirs[0]))
    for step in range(17):
        steps["n"] = step + 1
        ours.append(s.forward(np.array([tok], np.int32)))
        theirs.append(ref.logits(ref.forward(ref.embed([tok]), [len(ids) + step], cache, hook=compress))[0])
        assert (s.cache_lengths() == len(cache[0][0]["pos"])).all()
        tok = int(np.argmax(theirs[-1]))
    close(ours, theirs)
    assert s.decoding_compressions == 3 * ref.L
