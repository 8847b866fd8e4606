"""FastKVzipPress with gate files this test writes (the Fast-KVzip repository's .pt layout, and the same tensors
in .npz / .safetensors prefixed by the layer index): clear errors when missing or wrong, kvpress parity (kvpress's
press given FastKVzipGate modules holding the same weights; it masks, we evict), a float64 NumPy reference of the
gates and of the global and layer-wise eviction. Fresh random gates each run (the rng fixture prints its seed)."""
import os

import numpy as np
import pytest

import kvpress_c
from hub_files import assert_global_near_ties, jaccards, kvpress_gates, kvpress_run, random_gates, write_gates  # noqa: E402
from hub_presses_reference import fastkvzip_scores, lowest_evicted  # noqa: E402
from press_runs import prefill_and_greedy  # noqa: E402
from test_expected_attention_stats import default_side, tiny_side  # noqa: E402,F401

N_NEW = 8


def distinct_ids(seed, n=200):
    # a repeated token has the same layer-0 hidden state, so exactly tied gate scores: distinct tokens
    return np.random.default_rng(seed).permutation(np.arange(3, 256))[:n].tolist()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path, hf, model, _, _ = tiny_side(tmp_path_factory, "llama", seed=41)
    from hub_files import full_cache_keys
    ids = distinct_ids(41)
    return path, hf, model, ids, full_cache_keys(hf, ids)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    path, hf, model, _, _ = tiny_side(tmp_path_factory, "qwen3", seed=43)
    from hub_files import full_cache_keys
    ids = distinct_ids(43)
    return path, hf, model, ids, full_cache_keys(hf, ids)


@pytest.fixture(scope="module", params=["llama", "qwen3", "default"])
def side(request):
    return request.getfixturevalue("default_side" if request.param == "default" else "tiny_" + request.param)


def gates_for(model, rng, groups=None):
    c = model.config
    return random_gates(rng, c["n_layers"], c["n_kv_heads"], c["hidden"], groups or c["n_heads"] // c["n_kv_heads"])


def test_missing_or_wrong_gates_are_clear_errors(tmp_path, rng):
    with pytest.raises(ValueError, match="gates_path"):
        kvpress_c.FastKVzipPress(compression_ratio=0.5)
    with pytest.raises(FileNotFoundError, match="q2_dim16_sink16.pt"):
        kvpress_c.FastKVzipPress(compression_ratio=0.5, gates_path=str(tmp_path / "q2_dim16_sink16.pt"))
    layers = random_gates(rng, 2, 2, 64, 2)
    ok = write_gates(tmp_path / "q2_dim16_sink16.npz", layers)
    for bad, match in ((dict(compression_ratio=1.0), "compression_ratio"), (dict(window_size=0), "window_size"),
                       (dict(window_ratio=1.5), "window_ratio"), (dict(n_sink=-1), "n_sink"),
                       (dict(layerwise=1), "layerwise")):
        with pytest.raises(ValueError, match=match):
            kvpress_c.FastKVzipPress(**dict(dict(compression_ratio=0.5, gates_path=ok), **bad))
    with pytest.raises(ValueError, match="sink8 but k_base holds 16"):
        kvpress_c.FastKVzipPress(compression_ratio=0.5, gates_path=write_gates(tmp_path / "q2_dim16_sink8.npz", layers))
    wrong = [dict(layers[0]), dict(layers[1], b=layers[1]["b"][..., :1])]
    with pytest.raises(ValueError, match=r"layer 1 b has shape \(2, 1, 1\), expected \(2, 1, 2\)"):
        kvpress_c.FastKVzipPress(compression_ratio=0.5, gates_path=write_gates(tmp_path / "w.npz", wrong))
    del wrong[1]["k_base"]
    with pytest.raises(ValueError, match="layer 1 lacks k_base"):
        kvpress_c.FastKVzipPress(compression_ratio=0.5, gates_path=write_gates(tmp_path / "w2.npz", wrong))
    np.savez(tmp_path / "x.npz", **{"0.q_proj.weight": layers[0]["q_proj.weight"], "zzz": np.zeros(1)})
    with pytest.raises(ValueError, match="unexpected tensor 'zzz'"):
        kvpress_c.FastKVzipPress(compression_ratio=0.5, gates_path=str(tmp_path / "x.npz"))
    press = kvpress_c.FastKVzipPress(compression_ratio=0.5, gates_path=ok)  # 2 layers x 2 heads meet 30 x 3
    model = kvpress_c.load_model()
    s = model.new_session()
    s.set_press(**press.c_config())
    with pytest.raises(ValueError, match="2 layers, 2 KV heads and hidden size 64; this model has 30, 3 and 576"):
        press.before_prefill(s, 10, model.config)


def test_the_three_file_formats_give_the_same_gates(tmp_path, rng):
    """The repository's .pt (torch.load; the layout kvpress reads: {'module': [state dicts]}), .npz and .safetensors,
    and convert_gates from the first to the others."""
    torch = pytest.importorskip("torch")
    from kvpress_c.presses.fastkvzip import convert_gates, load_gates
    layers = random_gates(rng, 3, 2, 32, 4, nb=8)
    pt = str(tmp_path / "q4_dim16_sink8.pt")
    torch.save({"module": [{k: torch.tensor(v) for k, v in layer.items()} for layer in layers]}, pt)
    want = load_gates(write_gates(tmp_path / "q4_dim16_sink8.npz", layers))
    for path in (pt, write_gates(tmp_path / "q4_dim16_sink8.safetensors", layers),
                 convert_gates(pt, str(tmp_path / "c_sink8.npz")), convert_gates(pt, str(tmp_path / "c_sink8.safetensors"))):
        got = load_gates(path)
        assert {k: v for k, v in got.items() if not isinstance(v, np.ndarray)} == \
            {"n_layers": 3, "n_heads": 2, "n_groups": 4, "out_dim": 16, "n_base": 8, "input_dim": 32}, path
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=f"{path}: {k}")


@pytest.mark.parametrize("layerwise", [False, True], ids=["global", "layerwise"])
@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_fastkvzip_matches_kvpress(side, tmp_path, rng, ratio, layerwise):
    kvpress = pytest.importorskip("kvpress")
    _, hf, model, ids, keys = side
    c = model.config
    layers = gates_for(model, rng)
    mine = kvpress_c.FastKVzipPress(compression_ratio=ratio, layerwise=layerwise,
                                    gates_path=write_gates(tmp_path / "q_dim16_sink16.npz", layers))
    kept, out, _, _ = prefill_and_greedy(model, mine, ids, N_NEW)
    press = kvpress.FastKVzipPress(compression_ratio=ratio, layerwise=layerwise)
    press.gates = kvpress_gates(layers)
    theirs, scores, their_out = kvpress_run(hf, press, ids, keys, N_NEW)
    n = len(ids)
    total = sum(len(k) for row in theirs for k in row)
    assert sum(len(k) for row in kept for k in row) == total  # the same number evicted
    jac = jaccards(kept, theirs)
    print(f"FastKVzip {'tiny' if side[0] else 'default'} {c['arch']} ratio {ratio} {'layerwise' if layerwise else 'global'}: "
          f"mean Jaccard {np.mean(jac):.4f}, min {np.min(jac):.4f}, greedy equal {out == their_out}")
    per = c["n_kv_heads"] * n
    n_pruned = int(per * ratio) if layerwise else int(c["n_layers"] * per * ratio)
    # a difference may only be a near-tie of kvpress's fp32 gate scores at the cut (ours: float64 gates)
    assert_global_near_ties(kept, theirs, scores, n_pruned, rtol=1e-5, layerwise=layerwise)
    assert np.mean(jac) >= 0.99
    assert out == their_out


@pytest.mark.parametrize("layerwise", [False, True], ids=["global", "layerwise"])
def test_fastkvzip_equals_float64_reference(tiny_llama, tmp_path, rng, layerwise):
    from np_llama import NpLlama
    path, _, model, ids, _ = tiny_llama
    ref = NpLlama(path)
    layers = random_gates(rng, ref.L, ref.Hkv, ref.D, 3, od=8, nb=5)  # other shapes than the default ones
    press = kvpress_c.FastKVzipPress(compression_ratio=0.7, layerwise=layerwise, n_sink=2, window_ratio=0.05,
                                     gates_path=write_gates(tmp_path / "g_sink5.safetensors", layers))
    s = model.new_session()
    s.set_press(record_scores=True, **press.c_config())
    press.before_prefill(s, len(ids), model.config)
    s.forward(np.asarray(ids, np.int32), logits="none")
    want = []

    def grab(l, q, attn, o, resid, past, cache):
        xn = ref.rmsnorm(resid, ref.W(f"model.layers.{l}.input_layernorm.weight"))
        want.append(fastkvzip_scores(xn, layers[l], n_sink=2, window_ratio=0.05))

    ref.forward(ref.embed(ids), np.arange(len(ids)), ref.empty_cache(), hook=grab)
    want = np.stack(want)
    got = np.stack([[s.press_scores(l, h) for h in range(ref.Hkv)] for l in range(ref.L)])
    err = np.abs(got - want).max()
    print(f"FastKVzip gate scores vs float64: max abs error {err:.2e}")
    assert err < 1e-5  # scores in [0, 1]; fp32 projections against float64: measured 3.1e-7 .. 5.2e-7 over 5 runs
    kept = [[set(s.cache_positions(l, h).tolist()) for h in range(ref.Hkv)] for l in range(ref.L)]
    assert kept == lowest_evicted(want, 0.7, layerwise)  # no near-tie at the cut on this model


def test_fastkvzip_needs_an_empty_session(tiny_llama, tmp_path, rng):
    _, _, model, ids, _ = tiny_llama
    press = kvpress_c.FastKVzipPress(compression_ratio=0.5, gates_path=write_gates(tmp_path / "g.npz", gates_for(model, rng)))
    s = model.new_session()
    s.forward(np.asarray(ids[:10], np.int32), logits="none")
    s.set_press(**press.c_config())
    press.before_prefill(s, len(ids), model.config)
    with pytest.raises(NotImplementedError, match="session must be empty"):
        s.forward(np.asarray(ids, np.int32), logits="none")
    with pytest.raises(ValueError, match="alone"):  # its eviction ranks every layer at once: no chain
        s2 = model.new_session()
        s2.set_press(**press.c_config())
        s2.add_press(**kvpress_c.KnormPress(compression_ratio=0.2).c_config())
        press.before_prefill(s2, len(ids), model.config)


def test_a_pt_file_without_torch_says_how_to_convert(tmp_path, rng, monkeypatch):
    import sys
    pt = tmp_path / "q2_dim16_sink16.pt"
    pt.write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails as where it is not installed
    with pytest.raises(ValueError, match=r"torch is not installed: convert it once .*convert_gates"):
        kvpress_c.FastKVzipPress(compression_ratio=0.5, gates_path=str(pt))
