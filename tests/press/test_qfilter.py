"""QFilterPress with filter files this test writes (the layout of the Q-filters repositories: model.safetensors
holding "q_filters" [layers, KV heads, head dim] in Hugging Face channel order): clear errors when missing,
kvpress parity (its loader pointed at the same filters), a float64 NumPy reference of the scores and the
decode, and the emulated device against the CPU. Fresh random filters each run (seed printed)."""
import numpy as np
import pytest

import kvpress_c

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

from test_wrapper_parity import full_cache_keys, match_rows  # noqa: E402
from press_runs import prefill_and_greedy  # noqa: E402


def write_filters(path, shape, rng):
    from safetensors.numpy import save_file
    f = rng.standard_normal(shape).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file({"q_filters": f}, str(path / "model.safetensors"))
    return f


ours = prefill_and_greedy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hf_models import write_tiny_model
    path = write_tiny_model(str(tmp_path_factory.mktemp("qf") / "tiny"), arch="llama", seed=29)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = np.random.default_rng(29).integers(3, 256, 160).tolist()
    return path, hf, kvpress_c.load_model(path), ids, full_cache_keys(hf, ids)


@pytest.fixture(scope="module")
def default_side(default_gguf, default_model):
    import os
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32,
        attn_implementation="sdpa").eval()
    ids = default_model.encode("The quick brown fox jumps over the lazy dog. " * 30)
    return None, hf, default_model, ids, full_cache_keys(hf, ids)


def test_missing_filters_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="filters_path"):
        kvpress_c.QFilterPress(compression_ratio=0.5)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        kvpress_c.QFilterPress(compression_ratio=0.5, filters_path=str(tmp_path))


@pytest.mark.parametrize("which", ["tiny", "default"])
@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_qfilter_matches_kvpress(tiny, default_side, tmp_path, rng, which, ratio):
    _, hf, model, ids, keys = tiny if which == "tiny" else default_side
    c = model.config
    f = write_filters(tmp_path / "qf", (c["n_layers"], c["n_kv_heads"], c["head_dim"]), rng)
    mine = ours(model, kvpress_c.QFilterPress(compression_ratio=ratio, filters_path=str(tmp_path / "qf")), ids)
    saved = kvpress.QFilterPress.load_q_filters
    kvpress.QFilterPress.load_q_filters = staticmethod(lambda name: torch.tensor(f))
    try:
        press = kvpress.QFilterPress(compression_ratio=ratio)
        cache, their_ids = transformers.DynamicCache(), []
        with torch.no_grad(), press(hf):
            res = hf(torch.tensor([ids]), past_key_values=cache)
        theirs = [match_rows(cache.layers[l].keys[0], keys[l]) for l in range(c["n_layers"])]
        with torch.no_grad():
            for step in range(8):
                their_ids.append(int(torch.argmax(res.logits[0, -1])))
                p = len(ids) + step
                res = hf(torch.tensor([[their_ids[-1]]]), past_key_values=cache, cache_position=torch.tensor([p]),
                         position_ids=torch.tensor([[p]]))
    finally:
        kvpress.QFilterPress.load_q_filters = saved
    jac = [len(a & b) / len(a | b) for la, lb in zip(mine[0], theirs) for a, b in zip(la, lb)]
    print(f"QFilter {which} ratio {ratio}: mean Jaccard {np.mean(jac):.4f}, min {np.min(jac):.4f}, "
          f"greedy equal {mine[1] == their_ids}")
    assert np.mean(jac) >= 0.99
    assert mine[1] == their_ids


def test_qfilter_equals_float64_reference(tiny, tmp_path, rng):
    from np_llama import NpLlama
    path, _, model, ids, _ = tiny
    ref = NpLlama(path)
    f = write_filters(tmp_path / "qf", (ref.L, ref.Hkv, ref.d), rng)
    kept, out, logits, _ = ours(model, kvpress_c.QFilterPress(compression_ratio=0.6, filters_path=str(tmp_path / "qf")), ids)
    n_kept = int(len(ids) * 0.4)

    def qfilter(l, q, attn, o, resid, past, cache):
        for h in range(ref.Hkv):
            ch = cache[l][h]
            score = -(ch["k"] @ f[l, h].astype(np.float64))
            sel = np.sort(np.argsort(-score, kind="stable")[:n_kept])
            assert set(ch["pos"][sel].tolist()) == kept[l][h], (l, h)  # float64 scores pick our rows
            cache[l][h] = dict(k=ch["k"][sel], v=ch["v"][sel], pos=ch["pos"][sel])

    cache = ref.empty_cache()
    theirs = [ref.logits(ref.forward(ref.embed(ids), np.arange(len(ids)), cache, hook=qfilter)[-1:])[0]]
    for step, tok in enumerate(out[:-1]):
        theirs.append(ref.logits(ref.forward(ref.embed([tok]), [len(ids) + step], cache))[0])
    for a, b in zip(logits, theirs):
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()  # fp32 vs float64, measured ~1e-6


def test_qfilter_on_the_emulated_device_matches_cpu(tiny, tmp_path, rng):
    path, _, cpu, ids, _ = tiny
    c = cpu.config
    write_filters(tmp_path / "qf", (c["n_layers"], c["n_kv_heads"], c["head_dim"]), rng)
    press = kvpress_c.QFilterPress(compression_ratio=0.5, filters_path=str(tmp_path / "qf"))
    a = ours(cpu, press, ids)[0]
    b = ours(kvpress_c.load_model(path, device="emulated"), press, ids)[0]
    jac = [len(x & y) / len(x | y) for la, lb in zip(a, b) for x, y in zip(la, lb)]
    assert np.mean(jac) > 0.9, jac  # bf16 keys swap near-ties at the cut
