"""ExpectedAttentionStatsPress with statistics folders this test writes (kvpress's ExpectedAttentionStats format:
config.json + model.safetensors with query_mean [L, H, d] and query_cov [L, H, d, d]): clear errors when missing or
wrong, kvpress parity (kvpress's press reads the same folder), a float64 NumPy reference of the scores, and the
producer collect_query_stats against the same statistics computed with HF transformers (kvpress's capture of the
pre-RoPE queries). Fresh random statistics each run (the rng fixture prints its seed)."""
import os

import numpy as np
import pytest

import kvpress_c
from hub_files import (assert_head_near_ties, full_cache_keys, jaccards, kvpress_run, random_stats,  # noqa: E402
                       write_stats)
from press_runs import prefill_and_greedy  # noqa: E402

from kvpress_c.presses.expected_attention_stats import collect_query_stats  # noqa: E402

N_NEW = 8


def tiny_side(tmp_path_factory, arch, seed=37):
    """(path, HF model, our model, prompt ids, HF full-cache keys) of a tiny random model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hf_models import write_tiny_model
    path = write_tiny_model(str(tmp_path_factory.mktemp(arch) / "tiny"), arch=arch, seed=seed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = np.random.default_rng(seed).integers(3, 256, 200).tolist()
    return path, hf, kvpress_c.load_model(path), ids, full_cache_keys(hf, ids)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request):
    return request.getfixturevalue("tiny_" + request.param)


@pytest.fixture(scope="module")
def default_side(default_gguf, default_model):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kvpress_c.demo import needle_prompt
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32,
        attn_implementation="sdpa").eval()
    context, question, _ = needle_prompt(default_model, n_tokens=350)
    ids = default_model.encode(default_model.apply_chat_template(context + "\n\n" + question))
    return None, hf, default_model, ids, full_cache_keys(hf, ids)


def test_missing_or_wrong_stats_are_clear_errors(tmp_path, rng):
    with pytest.raises(ValueError, match="stats_folder"):
        kvpress_c.ExpectedAttentionStatsPress(compression_ratio=0.5)
    with pytest.raises(FileNotFoundError, match="config.json.*model.safetensors"):
        kvpress_c.ExpectedAttentionStatsPress(compression_ratio=0.5, stats_folder=str(tmp_path))
    mu, cov = random_stats(rng, 2, 4, 8)
    from kvpress_c.presses._tensor_files import write_safetensors
    bad = write_stats(tmp_path / "bad", mu, cov)
    write_safetensors(os.path.join(bad, "model.safetensors"), {"query_mean": mu, "query_cov": cov[..., :4]})
    with pytest.raises(ValueError, match="query_cov"):
        kvpress_c.ExpectedAttentionStatsPress(compression_ratio=0.5, stats_folder=bad)
    write_safetensors(os.path.join(bad, "model.safetensors"), {"mean": mu})
    with pytest.raises(ValueError, match="no tensor 'query_mean'"):
        kvpress_c.ExpectedAttentionStatsPress(compression_ratio=0.5, stats_folder=bad)
    with pytest.raises(ValueError, match="sample_seq_len"):
        kvpress_c.ExpectedAttentionStatsPress(compression_ratio=0.5, stats_folder=str(tmp_path), sample_seq_len=0)
    # statistics of another model: refused when the press meets this one
    press = kvpress_c.ExpectedAttentionStatsPress(compression_ratio=0.5, stats_folder=write_stats(tmp_path / "ok", mu, cov))
    model = kvpress_c.load_model()
    # the same check when a decoding press hands them to its session (DecodingPress.before_decoding)
    dec = kvpress_c.DecodingPress(press, compression_interval=8, target_size=64)
    s = model.new_session()
    s.set_decoding_press(**dec.decoding_config())
    with pytest.raises(ValueError, match="2 layers x 4 heads x head dim 8; this model has 30 x 9 x 64"):
        dec.before_decoding(s, model.config)
    s = model.new_session()
    s.set_press(**press.c_config())
    with pytest.raises(ValueError, match="2 layers x 4 heads x head dim 8; this model has 30 x 9 x 64"):
        press.before_prefill(s, 10, model.config)
    with pytest.raises(ValueError, match="ExpectedAttention"):  # the C core: statistics belong to that scorer
        s.set_press(**kvpress_c.KnormPress(compression_ratio=0.5).c_config())
        s.set_press_array("query_mean", np.zeros((30, 9, 64), np.float32))


@pytest.fixture(scope="module", params=["llama", "qwen3", "default"])
def side(request):
    """Each model the parity test runs on: tiny llama, tiny qwen3 (q/k norms), the default GGUF model."""
    return request.getfixturevalue("default_side" if request.param == "default" else "tiny_" + request.param)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_side(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return tiny_side(tmp_path_factory, "qwen3")


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_eastats_matches_kvpress(side, tmp_path, rng, ratio):
    kvpress = pytest.importorskip("kvpress")
    _, hf, model, ids, keys = side
    which = "tiny" if side[0] else "default"
    c = model.config
    folder = write_stats(tmp_path / "stats", *random_stats(rng, c["n_layers"], c["n_heads"], c["head_dim"]))
    kept, out, _, _ = prefill_and_greedy(model, kvpress_c.ExpectedAttentionStatsPress(compression_ratio=ratio,
                                                                                       stats_folder=folder), ids, N_NEW)
    press = kvpress.ExpectedAttentionStatsPress(compression_ratio=ratio, stats_folder=folder)
    theirs, scores, their_out = kvpress_run(hf, press, ids, keys, N_NEW, scorer=press)
    jac = jaccards(kept, theirs)
    print(f"EAStats {which} {c['arch']} ratio {ratio}: mean Jaccard {np.mean(jac):.4f}, min {np.min(jac):.4f}, "
          f"greedy equal {out == their_out}")
    # a difference may only be a near-tie of kvpress's fp32 scores at the cut (ours: float64 statistics)
    assert_head_near_ties(kept, theirs, scores, rtol=1e-4)
    assert np.mean(jac) >= 0.99
    assert out == their_out


def test_eastats_scores_equal_float64_reference(tiny, tmp_path, rng):
    from hub_presses_reference import expected_attention_given
    from np_llama import NpLlama
    path, _, model, ids, _ = tiny
    if model.config["arch"] != "llama":
        pytest.skip("the NumPy reference model is Llama's (no q/k norms); qwen3 is held to kvpress above")
    ref = NpLlama(path)
    mu, cov = random_stats(rng, ref.L, ref.H, ref.d)
    press = kvpress_c.ExpectedAttentionStatsPress(compression_ratio=0.6, stats_folder=write_stats(tmp_path / "s", mu, cov),
                                                  n_future_positions=64, epsilon=0.01)
    s = model.new_session()
    s.set_press(record_scores=True, **press.c_config())
    press.before_prefill(s, len(ids), model.config)
    s.forward(np.asarray(ids, np.int32), logits="none")
    worst = []

    def check(l, q, attn, o, resid, past, cache):
        K = np.stack([cache[l][h]["k"] for h in range(ref.Hkv)])
        V = np.stack([cache[l][h]["v"] for h in range(ref.Hkv)])
        want = expected_attention_given(K, V, mu[l].astype(np.float64), cov[l].astype(np.float64), ref.inv_freq,
                                        n_future=64, epsilon=0.01)
        got = np.stack([s.press_scores(l, h) for h in range(ref.Hkv)])
        worst.append(np.abs(got - want).max() / np.abs(want).max())

    ref.forward(ref.embed(ids), np.arange(len(ids)), ref.empty_cache(), hook=check)
    print(f"EAStats scores vs float64: max relative error {max(worst):.2e}")
    assert max(worst) < 1e-6  # fp32 keys and statistics against float64: measured 3.9e-8


def _hf_query_stats(hf, ids_list, n_sink):
    """kvpress's collect_queries on token ids: the pre-RoPE queries captured at apply_rotary_pos_emb."""
    import torch
    from kvpress.presses.expected_attention_with_stats import patch_rotary_embedding
    qs = []
    with torch.no_grad():
        for ids in ids_list:
            with patch_rotary_embedding(hf) as captured:
                hf(torch.tensor([ids]))
            qs.append(torch.cat(captured, dim=0)[:, :, n_sink:, :].double())
    q = torch.cat(qs, dim=-2)
    mean = q.mean(dim=-2)
    cen = q - mean.unsqueeze(-2)
    return mean.numpy(), (cen.transpose(-2, -1) @ cen / (q.shape[-2] - 1)).numpy()


def test_collect_query_stats_equals_hf_transformers(tiny, tmp_path):
    pytest.importorskip("kvpress")
    kvpress = pytest.importorskip("kvpress.presses.expected_attention_with_stats")
    path, hf, model, _, _ = tiny
    texts = ["The quick brown fox jumps over the lazy dog. " * 6, "A second, shorter text of a few words.",
             "Statistics over every query after the sinks, " * 5]
    mean, cov = collect_query_stats(model, texts, n_sink=4, sample_seq_len=120, out=str(tmp_path / "st"))
    want_mean, want_cov = _hf_query_stats(hf, [model.encode(t[:120]) for t in texts], 4)
    em = np.abs(mean - want_mean).max() / np.abs(want_mean).max()
    ec = np.abs(cov - want_cov).max() / np.abs(want_cov).max()
    print(f"{model.config['arch']}: mean rel err {em:.2e}, cov rel err {ec:.2e}")
    assert em < 3e-6 and ec < 3e-6  # fp32 queries of two engines, float64 sums: measured <= 3.1e-7
    # kvpress reads the folder, and gets the same tensors
    stats = kvpress.ExpectedAttentionStats.from_pretrained(str(tmp_path / "st"))
    np.testing.assert_allclose(stats.query_mean.detach().numpy(), mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(stats.query_cov.detach().numpy(), cov, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="list of strings"):
        collect_query_stats(model, "one text")


def test_collect_query_stats_on_a_gguf_model_equals_hf_transformers(default_side):
    """GGUF llama weights pair RoPE's channels side by side: the statistics go back to Hugging Face's order."""
    pytest.importorskip("kvpress")
    _, hf, model, _, _ = default_side
    texts = ["Expected attention needs the statistics of the queries of many prompts."]
    mean, cov = collect_query_stats(model, texts, n_sink=4, progress=False)
    want_mean, want_cov = _hf_query_stats(hf, [model.encode(texts[0])], 4)
    em = np.abs(mean - want_mean).max() / np.abs(want_mean).max()
    ec = np.abs(cov - want_cov).max() / np.abs(want_cov).max()
    print(f"default model: mean rel err {em:.2e}, cov rel err {ec:.2e}")
    assert em < 1e-5 and ec < 1e-5  # dequantised GGUF weights in two engines, 30 layers: measured 2.9e-7, 1.1e-6


def test_a_folder_kvpress_saved_in_bf16_loads(tmp_path, rng):
    """kvpress's own producer keeps the model's dtype (bf16 on GPUs): its save_pretrained folder reads here, widened."""
    torch = pytest.importorskip("torch")
    stats_mod = pytest.importorskip("kvpress.presses.expected_attention_with_stats")
    mu, cov = random_stats(rng, 2, 4, 8)
    st = stats_mod.ExpectedAttentionStats(num_layers=2, num_heads=4, head_dim=8, dataset_name="d", model_name="m",
                                          num_samples=1, sample_seq_len=1, n_sink=4)
    st.query_mean.data = torch.tensor(mu).to(torch.bfloat16)
    st.query_cov.data = torch.tensor(cov).to(torch.bfloat16)
    st.save_pretrained(str(tmp_path / "bf16"))
    press = kvpress_c.ExpectedAttentionStatsPress(compression_ratio=0.5, stats_folder=str(tmp_path / "bf16"))
    np.testing.assert_array_equal(press.mu, torch.tensor(mu).to(torch.bfloat16).float().numpy())
    np.testing.assert_array_equal(press.cov, torch.tensor(cov).to(torch.bfloat16).float().numpy())
