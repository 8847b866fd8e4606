"""Gemma 3 text (Gemma3ForCausalLM) against HF transformers in fp32 on tiny random models the test writes:
sliding and full layers interleaved, each on its own RoPE (linear scaling on the full ones), prompts longer
than the window, q/k norms, the four layer norms with Gemma's 1 + w, GeGLU (tanh GELU), the embedding scale,
query_pre_attn_scalar, tied embeddings; greedy continuations."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvpress_c  # noqa: E402
from gemma3_models import GGUF_SHAPE, LAYERS, PERIOD, WINDOW, write_gemma_gguf, write_tiny_gemma3  # noqa: E402
from hf_models import decode_err, greedy_pair, hf_logits, hf_model, rel_err  # noqa: E402

TOL = 1e-5  # the bound; measured figures printed by each test


@pytest.fixture(params=[4.0, 0.0], ids=["linear4", "plain"])
def gemma3(request, tmp_path_factory, rng):
    seed = int(rng.integers(1 << 31))
    print(f"seed {seed}")
    return write_tiny_gemma3(str(tmp_path_factory.mktemp("gemma3")), seed=seed, linear=request.param), seed


def test_config(gemma3):
    c = kvpress_c.load_model(gemma3[0]).config
    assert c["arch"] == "gemma3" and c["head_dim"] == 16 and c["n_layers"] == LAYERS
    assert c["sliding_window"] == WINDOW and c["window_period"] == PERIOD and c["window_first_layer"] == 0
    assert c["rope_theta"] == 1e6 and c["rope_local_theta"] == 10000.0
    assert c["attn_scale"] == pytest.approx(24 ** -0.5, rel=1e-7) and c["embed_scale"] == pytest.approx(8.0)
    assert c["mlp_act"] == "gelu_tanh" and c["post_norms"] and c["tied_embeddings"]


@pytest.mark.parametrize("n", [10, 70])  # inside the window (16) and well past it
def test_logits_match_hf(gemma3, rng, n):
    path, seed = gemma3
    hf, model = hf_model(path), kvpress_c.load_model(path, weights="fp32")
    ids = rng.integers(3, 256, size=n).tolist()
    err = rel_err(model.logits(ids), hf_logits(hf, ids))
    print(f"n {n} (seed {seed}): max relative logit error {err:.2e}")
    assert err < TOL


def test_decode_over_the_cache_matches_hf(gemma3, rng):
    """A prefill of 30, then one token at a time to 60: the sliding layers' window moves over the cache."""
    path, seed = gemma3
    hf, model = hf_model(path), kvpress_c.load_model(path, weights="fp32")
    err = decode_err(hf, model, rng.integers(3, 256, size=60).tolist(), 30)
    print(f"(seed {seed}): prefill 30 + 30 decode steps {err:.2e}")
    assert err < TOL


def test_greedy_matches_hf(gemma3, rng):
    path, seed = gemma3
    hf, model = hf_model(path), kvpress_c.load_model(path, weights="fp32")
    prompt = rng.integers(3, 256, size=40).tolist()
    ours, ref, near_tie = greedy_pair(hf, model, prompt)  # equal unless HF's own rows had a near tie
    assert ours == ref or near_tie, f"ours {ours} vs HF {ref} (seed {seed})"


def hf_full_cache_keys(hf, ids):
    """HF's cached keys [Hkv, n, d] of each layer after a prefill (the full layers hold every row; transformers'
    sliding layers keep only their last window - 1)."""
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return [lay.keys[0].double().numpy() for lay in cache.layers]


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_presses_act_on_full_layers_only(gemma3, rng, ratio):
    """kvpress compresses Gemma 3 on its full-attention layers only (its hooks skip the layers with is_sliding):
    so do we. KnormPress's kept set on the full layers is the float64 reference's from HF's cached keys (the
    top n_kept of -||k|| per head); the sliding layers keep every row."""
    path, seed = gemma3
    hf, model = hf_model(path), kvpress_c.load_model(path, weights="fp32")
    n = 60
    ids = rng.integers(3, 256, size=n).tolist()
    keys = hf_full_cache_keys(hf, ids)
    s = model.new_session()
    s.set_press(**kvpress_c.KnormPress(compression_ratio=ratio).c_config())
    s.forward(np.array(ids, dtype=np.int32), logits="last")
    n_kept = int(n * (1 - ratio))
    for l in range(LAYERS):
        full = (l + 1) % PERIOD == 0
        for h in range(keys[l].shape[0]):
            kept = set(s.cache_positions(l, h).tolist())
            if not full:
                assert kept == set(range(n)), f"sliding layer {l} head {h} was compressed"
                continue
            score = -np.linalg.norm(keys[l][h], axis=-1)
            ref = set(np.argsort(-score, kind="stable")[:n_kept].tolist())
            assert kept == ref, f"full layer {l} head {h} (seed {seed})"


@pytest.mark.parametrize("linear", [8.0, 0.0])
def test_gguf_matches_hf(tmp_path, rng, linear):
    """The same weights as a GGUF 'gemma3' file (llama.cpp's names and metadata; it fixes every 6th layer full
    and the attention scale at 1/sqrt(head_dim), so the model is made that way): the same logits."""
    pytest.importorskip("gguf")
    seed = int(rng.integers(1 << 31))
    path = write_tiny_gemma3(str(tmp_path / "hf"), seed=seed, linear=linear, **GGUF_SHAPE)
    g = kvpress_c.load_model(write_gemma_gguf(path, str(tmp_path / "model.gguf")), weights="fp32")
    c = g.config
    assert c["arch"] == "gemma3" and c["window_period"] == 6 and c["sliding_window"] == WINDOW
    ids = rng.integers(3, 256, size=70).tolist()
    ref = hf_logits(hf_model(path), ids)
    err = rel_err(g.logits(ids), ref)
    err_hf = rel_err(kvpress_c.load_model(path, weights="fp32").logits(ids), ref)
    print(f"linear {linear} (seed {seed}): GGUF {err:.2e}, HF folder {err_hf:.2e}")
    assert err < TOL and err_hf < TOL


def edit_config(path, drop=(), **set_):
    import json
    import os
    f = os.path.join(path, "config.json")
    cfg = json.load(open(f))
    for k in drop:
        cfg.pop(k, None)
    cfg.update(set_)
    json.dump(cfg, open(f, "w"))
    return path


def test_older_config_form_reads_the_same(tmp_path, rng):
    """Configs on the Hub before transformers 5: rope_theta, rope_local_base_freq, rope_scaling {linear} and
    sliding_window_pattern instead of layer_types and rope_parameters. transformers reads both forms the same;
    so do we."""
    seed = int(rng.integers(1 << 31))
    path = write_tiny_gemma3(str(tmp_path / "g3"), seed=seed, linear=4.0)
    ids = rng.integers(3, 256, size=50).tolist()
    new = kvpress_c.load_model(path, weights="fp32")
    ours_new, cfg_new = new.logits(ids), new.config
    edit_config(path, drop=("layer_types", "rope_parameters"), rope_theta=1e6, rope_local_base_freq=10000.0,
                rope_scaling={"rope_type": "linear", "factor": 4.0}, sliding_window_pattern=PERIOD)
    old = kvpress_c.load_model(path, weights="fp32")
    assert old.config == cfg_new
    np.testing.assert_array_equal(old.logits(ids), ours_new)
    err = rel_err(old.logits(ids), hf_logits(hf_model(path), ids))
    print(f"older config form (seed {seed}): {err:.2e}")
    assert err < TOL


def test_soft_capping_as_transformers_runs_it(tmp_path, rng):
    """Gemma3TextConfig carries Gemma 2's two caps; transformers' Gemma 3 applies final_logit_softcapping and reads
    attn_logit_softcapping without applying it (its attention call passes no softcap): so do we, HF folder and GGUF
    (llama.cpp's gemma3 reads only the final cap). The final cap moves the logits far beyond the tolerance."""
    pytest.importorskip("gguf")
    seed = int(rng.integers(1 << 31))
    path = write_tiny_gemma3(str(tmp_path / "hf"), seed=seed, **GGUF_SHAPE)
    ids = rng.integers(3, 256, size=70).tolist()
    plain = hf_logits(hf_model(path), ids)
    edit_config(path, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)
    ref = hf_logits(hf_model(path), ids)
    model = kvpress_c.load_model(path, weights="fp32")
    assert (model.config["attn_softcap"], model.config["logit_softcap"]) == (0.0, 2.0)
    g = kvpress_c.load_model(write_gemma_gguf(path, str(tmp_path / "model.gguf")), weights="fp32")
    assert (g.config["attn_softcap"], g.config["logit_softcap"]) == (0.0, 2.0)
    moved, err, err_g = rel_err(ref, plain), rel_err(model.logits(ids), ref), rel_err(g.logits(ids), ref)
    print(f"(seed {seed}): the caps move HF's logits by {moved:.3f}; ours {err:.2e}, GGUF {err_g:.2e}")
    assert moved > 1e-2 and err < TOL and err_g < TOL


@pytest.mark.parametrize("edit,exc,match", [
    (dict(final_logit_softcapping=-1.0), ValueError, "final_logit_softcapping"),
    (dict(hidden_activation="gelu"), NotImplementedError, "hidden_activation 'gelu'"),
    (dict(use_bidirectional_attention=True), NotImplementedError, "use_bidirectional_attention"),
    (dict(layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention", "sliding_attention"]),
     NotImplementedError, "every P-th layer full"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     ValueError, "sliding_attention.rope_type"),
])
def test_what_gemma3_refuses(tmp_path, edit, exc, match):
    path = edit_config(write_tiny_gemma3(str(tmp_path / "g3")), **edit)
    with pytest.raises(exc, match=match):
        kvpress_c.load_model(path)


def test_whole_cache_methods_refused(gemma3, rng):
    """KVzip, KVCompose and TAKE select over every layer's cache at once; with presses on the full layers only
    they are not defined on Gemma 3 yet (kvpress's KVzip refuses Gemma 3): a clear error, not scores of layers
    never measured."""
    model = kvpress_c.load_model(gemma3[0])
    ids = rng.integers(3, 256, size=40).astype(np.int32)
    s = model.new_session()
    s.forward(ids, logits="none")
    with pytest.raises(NotImplementedError, match="KVzip selects over every layer"):
        kvpress_c.KVzipPress(compression_ratio=0.5).scores(s, ids)
    with pytest.raises(NotImplementedError, match="KVzip selects over every layer"):
        s.kvzip_evict(np.zeros((LAYERS, 2, 40), np.float32), 0.5)
    with pytest.raises(NotImplementedError, match="TAKE selects over every layer"):
        model.new_session().prefill_take(ids, ids[-8:], 16, chunk_size=16)


GEMMA3_KEYS = ['layer_types', 'sliding_window', 'sliding_window_pattern', 'rope_parameters', 'rope_scaling', 'rope_theta',
               'rope_local_base_freq', 'query_pre_attn_scalar', 'hidden_activation', 'hidden_act', 'attn_logit_softcapping',
               'final_logit_softcapping', 'use_bidirectional_attention', 'head_dim', 'tie_word_embeddings', 'num_hidden_layers']
GEMMA3_VALUES = [['sliding_attention'] * 5, ['full_attention'] * 5, ['sliding_attention', 7, None, 'x', 'full_attention'],
                 {'full_attention': {'rope_type': 'linear'}}, {'sliding_attention': {'rope_type': 'yarn', 'factor': 2}},
                 {'full_attention': {'rope_type': 'linear', 'factor': -1}, 'sliding_attention': 3}, 'gelu_pytorch_tanh']


def test_fuzz_gemma3_configs_never_crash(tmp_path, rng):
    """Random values in Gemma 3's own config keys: every one loads or is refused with a message (support/fuzz.py, a
    subprocess, so a crash fails the test)."""
    from fuzz import CONFIG_VALUES, run_config_fuzz
    seed = int(rng.integers(1 << 30))
    folder = write_tiny_gemma3(str(tmp_path / "g3"), seed=seed)
    print(run_config_fuzz(tmp_path, folder, GEMMA3_KEYS, CONFIG_VALUES + GEMMA3_VALUES, seed))


def test_fuzz_gemma3_gguf_never_crashes(tmp_path, rng):
    """Corruptions of a 'gemma3' GGUF (the four layer norms, q/k norms, rope.freq_base_swa, linear scaling), lies in its
    own gemma3.* values included."""
    pytest.importorskip("gguf")
    from fuzz import run_gguf_fuzz
    from gguf_writer import gguf_layout
    seed = int(rng.integers(1 << 30))
    path = write_tiny_gemma3(str(tmp_path / "hf"), seed=seed, **GGUF_SHAPE)
    base = write_gemma_gguf(path, str(tmp_path / "base.gguf"))
    print(run_gguf_fuzz(tmp_path, base, gguf_layout(base), seed, n=600, arch="gemma3"))


def test_embedding_scale_in_the_embeddings_dtype(tmp_path, rng):
    """transformers multiplies the embeddings by sqrt(hidden) cast to the embedding's dtype: sqrt(80) = 8.944 is
    8.9375 in bf16. A bf16 folder held natively (bf16 embedding) uses the bf16 value, as transformers running it
    in bf16; converted to fp32, the fp32 value, as transformers running it in fp32 (logits checked there)."""
    path = write_tiny_gemma3(str(tmp_path / "g3"), seed=int(rng.integers(1 << 31)), dtype=torch.bfloat16, hidden=80)
    want_bf16 = float(torch.tensor(80 ** 0.5).to(torch.bfloat16))
    assert want_bf16 == 8.9375
    native, fp32 = kvpress_c.load_model(path), kvpress_c.load_model(path, weights="fp32")
    assert native.config["embed_scale"] == want_bf16
    assert fp32.config["embed_scale"] == pytest.approx(80 ** 0.5, rel=1e-7)
    ids = rng.integers(3, 256, size=30).tolist()
    err = rel_err(fp32.logits(ids), hf_logits(hf_model(path), ids))
    print(f"bf16 folder, fp32 on both sides: {err:.2e}")
    assert err < TOL


def test_native_f16_gguf(tmp_path, rng):
    """F16 matrices in their file's type (GGUF 'gemma3'): the native load and the fp32-converted one agree with
    each other and with HF to F16's rounding."""
    pytest.importorskip("gguf")
    path = write_tiny_gemma3(str(tmp_path / "hf"), seed=int(rng.integers(1 << 31)), **GGUF_SHAPE)
    g = write_gemma_gguf(path, str(tmp_path / "f16.gguf"), weight_type="F16")
    native, fp32 = kvpress_c.load_model(g), kvpress_c.load_model(g, weights="fp32")
    assert native.config["native_matrices"] > 0
    ids = rng.integers(3, 256, size=60).tolist()
    ref = hf_logits(hf_model(path), ids)
    a, b = native.logits(ids), fp32.logits(ids)
    ea, eb = rel_err(a, b.astype(np.float64)), rel_err(b, ref)
    print(f"F16 GGUF: fp32-converted vs HF {eb:.2e}, native vs fp32-converted {ea:.2e}")
    # measured: F16 weights against HF's fp32 1.3e-3; native against fp32-converted 0 here (F16 decodes exactly to
    # fp32); the bounds are test_phi3.py's for the same file types
    assert eb < 1e-2 and ea < 2e-2


@pytest.mark.parametrize("old_names", [False, True], ids=["transformers5-names", "older-names"])
def test_multimodal_folder_runs_its_text_model(gemma3, tmp_path, rng, old_names):
    """Gemma 3 4B/12B/27B come as Gemma3ForConditionalGeneration folders (model_type 'gemma3', a text_config,
    the language model's tensors under model.language_model. or, before transformers 4.52, language_model.model.):
    we run the text model, the same logits as the text-only folder's."""
    from gemma3_models import write_tiny_gemma3_multimodal
    text_dir, seed = gemma3
    mm_dir = write_tiny_gemma3_multimodal(text_dir, str(tmp_path / "mm"), old_names=old_names)
    ids = rng.integers(3, 256, size=50).tolist()
    a = kvpress_c.load_model(mm_dir, weights="fp32")
    b = kvpress_c.load_model(text_dir, weights="fp32")
    assert a.config == b.config
    np.testing.assert_array_equal(a.logits(ids), b.logits(ids))
    err = rel_err(a.logits(ids), hf_logits(hf_model(text_dir), ids))
    print(f"multimodal folder (seed {seed}): {err:.2e}")
    assert err < TOL


def test_linear_rope_scaling_on_llama(tmp_path, rng):
    """'linear' RoPE scaling, read for Gemma 3's full layers, is transformers' generic one: on a llama folder too."""
    import json
    import os

    from hf_models import write_tiny_model
    seed = int(rng.integers(1 << 31))
    path = write_tiny_model(str(tmp_path / "llama"), arch="llama", seed=seed)
    f = os.path.join(path, "config.json")
    cfg = json.load(open(f))
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    json.dump(cfg, open(f, "w"))
    ids = rng.integers(3, 256, size=80).tolist()
    err = rel_err(kvpress_c.load_model(path, weights="fp32").logits(ids), hf_logits(hf_model(path), ids))
    print(f"llama, linear 4 (seed {seed}): {err:.2e}")
    assert err < TOL
