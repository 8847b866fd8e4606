"""Gemma 2 (Gemma2ForCausalLM) against HF transformers in fp32 on tiny random models the test writes: every other
layer sliding (from layer 0) on the one RoPE base, the four layer norms with Gemma's 1 + w, GeGLU (tanh GELU), the
embedding scale, query_pre_attn_scalar, tied embeddings, and logit soft-capping of the attention scores
(attn_logit_softcapping) and of the final logits (final_logit_softcapping) at values that act on these weights;
decode over the cache, greedy continuations, the same model as a GGUF 'gemma2' file."""
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvpress_c  # noqa: E402
from gemma2_models import ATTN_CAP, FINAL_CAP, LAYERS, WINDOW, write_tiny_gemma2  # noqa: E402
from gemma3_models import write_gemma_gguf  # noqa: E402
from hf_models import decode_err, greedy_pair, hf_logits, hf_model, rel_err  # noqa: E402

TOL = 1e-5  # the bound; measured figures printed by each test


@pytest.fixture
def gemma2(tmp_path_factory, rng):
    seed = int(rng.integers(1 << 31))
    print(f"seed {seed}")
    return write_tiny_gemma2(str(tmp_path_factory.mktemp("gemma2")), seed=seed), seed


def edit_config(path, **set_):
    f = os.path.join(path, "config.json")
    cfg = json.load(open(f))
    for k, v in set_.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(f, "w"))
    return path


def test_config(gemma2):
    c = kvpress_c.load_model(gemma2[0]).config
    assert c["arch"] == "gemma2" and c["head_dim"] == 16 and c["n_layers"] == LAYERS
    assert c["sliding_window"] == WINDOW and c["window_period"] == 2 and c["window_first_layer"] == 0
    assert c["rope_theta"] == 10000.0 and c["rope_local_theta"] == 0 and not c["qk_norm"]
    assert c["attn_scale"] == pytest.approx(24 ** -0.5, rel=1e-7) and c["embed_scale"] == pytest.approx(8.0)
    assert c["mlp_act"] == "gelu_tanh" and c["post_norms"] and c["tied_embeddings"]
    assert c["attn_softcap"] == ATTN_CAP and c["logit_softcap"] == FINAL_CAP


@pytest.mark.parametrize("n", [10, 70])  # inside the window (16) and well past it
def test_logits_match_hf(gemma2, rng, n):
    path, seed = gemma2
    hf, model = hf_model(path), kvpress_c.load_model(path, weights="fp32")
    ids = rng.integers(3, 256, size=n).tolist()
    ref = hf_logits(hf, ids)
    err = rel_err(model.logits(ids), ref)
    print(f"n {n} (seed {seed}): max relative logit error {err:.2e}")
    assert err < TOL


def test_soft_capping_acts_and_follows_the_config(gemma2, rng):
    """Each cap moves the logits far beyond the tolerance (so the parity above checks it); null turns a cap off,
    an absent key takes Gemma2Config's default (attention 50, final 30), as transformers reads them."""
    path, seed = gemma2
    ids = rng.integers(3, 256, size=70).tolist()
    with_caps = hf_logits(hf_model(path), ids)
    for edit, want in [(dict(attn_logit_softcapping=None), (0.0, FINAL_CAP)),
                       (dict(final_logit_softcapping=None), (ATTN_CAP, 0.0)),
                       (dict(attn_logit_softcapping=..., final_logit_softcapping=...), (50.0, 30.0))]:
        edit_config(path, attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP)
        edit_config(path, **edit)
        model = kvpress_c.load_model(path, weights="fp32")
        assert (model.config["attn_softcap"], model.config["logit_softcap"]) == want
        ours, ref = model.logits(ids), hf_logits(hf_model(path), ids)
        moved, err = rel_err(ref, with_caps), rel_err(ours, ref)
        print(f"{edit} (seed {seed}): the logits move by {moved:.3f}; ours against HF {err:.2e}")
        assert moved > 1e-3 and err < TOL


def test_decode_over_the_cache_matches_hf(gemma2, rng):
    """A prefill of 30, then one token at a time to 60: the sliding layers' window moves over the cache."""
    path, seed = gemma2
    hf, model = hf_model(path), kvpress_c.load_model(path, weights="fp32")
    err = decode_err(hf, model, rng.integers(3, 256, size=60).tolist(), 30)
    print(f"(seed {seed}): prefill 30 + 30 decode steps {err:.2e}")
    assert err < TOL


def test_greedy_matches_hf(gemma2, rng):
    path, seed = gemma2
    hf, model = hf_model(path), kvpress_c.load_model(path, weights="fp32")
    prompt = rng.integers(3, 256, size=40).tolist()
    ours, ref, near_tie = greedy_pair(hf, model, prompt)  # equal unless HF's own rows had a near tie
    print(f"(seed {seed}): ours {ours}, HF {ref}")
    assert ours == ref or near_tie, f"ours {ours} vs HF {ref} (seed {seed})"


@pytest.mark.parametrize("weight_type", ["F32", "F16"])
def test_gguf_matches_hf(tmp_path, rng, weight_type):
    """The same weights as a GGUF 'gemma2' file (llama.cpp's names and metadata, its soft-capping keys; it fixes
    every other layer sliding and the attention scale at 1/sqrt(head_dim), so the model is made that way): the
    same logits in F32; F16 matrices held natively within F16's rounding."""
    pytest.importorskip("gguf")
    seed = int(rng.integers(1 << 31))
    path = write_tiny_gemma2(str(tmp_path / "hf"), seed=seed, scalar=16)
    g = kvpress_c.load_model(write_gemma_gguf(path, str(tmp_path / "model.gguf"), weight_type=weight_type))
    c = g.config
    assert c["arch"] == "gemma2" and c["window_period"] == 2 and c["sliding_window"] == WINDOW and not c["qk_norm"]
    assert (c["attn_softcap"], c["logit_softcap"]) == (ATTN_CAP, FINAL_CAP)
    ids = rng.integers(3, 256, size=70).tolist()
    ref = hf_logits(hf_model(path), ids)
    err = rel_err(g.logits(ids), ref)
    print(f"{weight_type} (seed {seed}): GGUF {err:.2e}")
    # measured: F16 weights (int8 activations in the decode GEMV) against HF's fp32 ones ~1e-3
    assert err < (TOL if weight_type == "F32" else 1e-2)


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_presses_act_on_full_layers_only(gemma2, rng, ratio):
    """Gemma 2 follows Gemma 3's rule (kvpress's for Gemma 3; kvpress does not list Gemma 2): the presses act on
    the full layers; the sliding ones keep every row. KnormPress's kept set on a full layer is the float64
    reference's from HF's cached keys."""
    path, seed = gemma2
    hf, model = hf_model(path), kvpress_c.load_model(path, weights="fp32")
    n = 60
    ids = rng.integers(3, 256, size=n).tolist()
    cache = transformers.DynamicCache()
    with torch.no_grad():
        hf(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    s = model.new_session()
    s.set_press(**kvpress_c.KnormPress(compression_ratio=ratio).c_config())
    s.forward(np.array(ids, dtype=np.int32), logits="last")
    n_kept = int(n * (1 - ratio))
    for l in range(LAYERS):
        keys = cache.layers[l].keys[0].double().numpy()
        for h in range(keys.shape[0]):
            kept = set(s.cache_positions(l, h).tolist())
            if l % 2 == 0:
                assert kept == set(range(n)), f"sliding layer {l} head {h} was compressed"
                continue
            ref = set(np.argsort(np.linalg.norm(keys[h], axis=-1), kind="stable")[:n_kept].tolist())
            assert kept == ref, f"full layer {l} head {h} (seed {seed})"


def test_observed_attention_is_the_capped_attention(gemma2, rng):
    """ObservedAttention reproduces the model's own attention: on Gemma 2 its soft-capped scores. Our scores on a
    full layer against the float64 reference made from HF eager's attention weights (each row's weight summed
    over the queries that see it, divided by their count, mean over the group); the uncapped ones are far from it."""
    path, seed = gemma2
    hf, model = hf_model(path), kvpress_c.load_model(path, weights="fp32")
    n = 50
    ids = rng.integers(3, 256, size=n).tolist()
    with torch.no_grad():
        att = hf(torch.tensor([ids]), output_attentions=True).attentions
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = hf(torch.tensor([ids]), output_attentions=True).attentions
    s = model.new_session()
    s.set_press(record_scores=True, **kvpress_c.ObservedAttentionPress(compression_ratio=0.5).c_config())
    s.forward(np.array(ids, dtype=np.int32), logits="none")
    c = model.config
    g = c["n_heads"] // c["n_kv_heads"]
    seen = n - np.arange(n)  # queries that see row r

    def reference(attentions, l, h):
        a = attentions[l][0].double().numpy()[h * g:(h + 1) * g]  # [g, n, n]
        return (a.sum(1) / seen).mean(0)

    apart = []
    for l in range(1, LAYERS, 2):  # the full layers
        for h in range(c["n_kv_heads"]):
            ref, ours = reference(att, l, h), s.press_scores(l, h).astype(np.float64)
            err = np.abs(ours - ref).max() / np.abs(ref).max()
            apart.append(np.abs(reference(uncapped, l, h) - ref).max() / np.abs(ref).max())
            print(f"layer {l} head {h} (seed {seed}): {err:.2e}; the uncapped scores {apart[-1]:.3f} away")
            assert err < 1e-5
    assert max(apart) > 1e-2  # the cap matters here: scores without it would fail above
