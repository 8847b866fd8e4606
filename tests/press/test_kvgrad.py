"""KVgradPress (openreview cg1wTCJjjk; csrc/press/kvgrad.c over train/rows_grad.c): the gradient norms against
central finite differences of a float64 NumPy model and against torch autograd (float64) on HF transformers, the
scores against a float64 reference, the whole press against kvpress 0.5.5's KVgradPress (test_kvzip_parity's
harness: kept sets per (layer, KV head), every difference a near-tie, greedy ids), run_many's shared prefill, and
bad arguments / models it cannot run."""
import numpy as np
import pytest

import kvpress_c

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

from kvgrad_reference import context_cache, fd_residual_gradient, kvgrad_scores  # noqa: E402
from test_kvpress_parity import RATIOS, hf_default, prompt_ids  # noqa: E402,F401
from test_kvzip_parity import hf_tokenizer_default, parity  # noqa: E402,F401

VARIANTS = {"KVgrad": {}, "KVgrad-layerwise": {"layerwise": True},
            # 64: several chunks (a later chunk's prompt carries the previous chunk's last 8 tokens)
            "KVgrad-chunked": {"chunk_size": 64}}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(tmp_path_factory, request):
    from hf_models import write_tiny_model
    from np_llama import NpLlama
    path = write_tiny_model(str(tmp_path_factory.mktemp("kvgrad") / "tiny"), arch=request.param, seed=11)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = np.random.default_rng(11).integers(3, hf.config.vocab_size, 200).tolist()
    return hf, transformers.AutoTokenizer.from_pretrained(path), kvpress_c.load_model(path), ids, NpLlama(path)


def reconstruction(rng, model, n_ctx):
    """A context, a chunk [start, end) of it and a reconstruction prompt (random ids + the chunk)."""
    V = model.config["vocab"]
    ids = rng.integers(3, V, n_ctx).astype(np.int32)
    start, end = int(rng.integers(0, 10)), int(rng.integers(n_ctx - 20, n_ctx))
    rep = np.r_[rng.integers(3, V, 6), ids[start:end]].astype(np.int32)
    return ids, start, end, rep


def torch_grad_norms(hf, ids, rep):
    """||dPhi / da^l|| [L, m] by torch autograd in float64 on HF transformers (the attention outputs' gradients,
    Phi = sum ||h^L||^2 of the last decoder layer's output)."""
    hf = hf.double()
    try:
        with torch.no_grad():
            cache = hf.model(input_ids=torch.tensor([ids.tolist()]), use_cache=True).past_key_values
        outs, last = {}, {}

        def attn_hook(l):
            def hook(module, args, output):
                output[0].retain_grad()
                outs[l] = output[0]
            return hook

        hooks = [layer.self_attn.register_forward_hook(attn_hook(l)) for l, layer in enumerate(hf.model.layers)]
        hooks.append(hf.model.layers[-1].register_forward_hook(
            lambda m, a, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o)))
        try:
            emb = hf.model.embed_tokens(torch.tensor([rep.tolist()])).detach().requires_grad_(True)
            hf.model(inputs_embeds=emb, past_key_values=cache)
            last["h"].square().sum().backward()
        finally:
            for h in hooks:
                h.remove()
        return np.stack([outs[l].grad[0].norm(dim=-1).numpy() for l in range(len(hf.model.layers))])
    finally:
        hf.float()
        hf.zero_grad(set_to_none=True)


def test_gradient_norms_match_float64_finite_differences(tiny, rng):
    """||dPhi/da_p^l|| for a few (layer, row) against the float64 model's central differences (all D directions)."""
    _, _, model, _, ref = tiny
    ids, start, end, rep = reconstruction(rng, model, 60)
    s = model.new_session()
    s.forward(ids, logits="none")
    _, norms = s.kvgrad_score(rep, start, end, n_sink=4, grad_norms=True)
    cache = context_cache(ref, ids)
    worst = 0.0
    for l, p in [(0, 0), (1, len(rep) // 2), (ref.L - 1, len(rep) - 1), (int(rng.integers(ref.L)), int(rng.integers(len(rep))))]:
        fd = np.linalg.norm(fd_residual_gradient(ref, cache, rep, l, p))
        worst = max(worst, abs(norms[l, p] - fd) / fd)
    print(f"{model.config['arch']}: ||dPhi/da|| vs float64 central differences: max relative error {worst:.2e}")
    assert worst < 1e-5  # fp32 forward and backward: measured <= 5.0e-7 (7 seeds x llama, qwen3)


def test_gradient_norms_and_scores_match_torch_autograd(tiny, rng):
    """Every row's gradient norm at every layer against torch autograd (float64), and the scores against the float64
    reference fed those norms."""
    hf, _, model, _, ref = tiny
    ids, start, end, rep = reconstruction(rng, model, 80)
    s = model.new_session()
    s.forward(ids, logits="none")
    scores, norms = s.kvgrad_score(rep, start, end, n_sink=4, grad_norms=True)
    assert s.position == len(ids) and (s.cache_lengths() == len(ids)).all()  # the cache is read, never changed
    ref_norms = torch_grad_norms(hf, ids, rep)
    norm_err = np.abs(norms - ref_norms).max() / np.abs(ref_norms).max()
    ref_scores = kvgrad_scores(ref, context_cache(ref, ids), rep, start, end, 4, ref_norms)
    score_err = np.abs(scores - ref_scores).max() / np.abs(ref_scores).max()
    print(f"{model.config['arch']}: gradient norms vs torch autograd {norm_err:.2e}, scores vs float64 {score_err:.2e}")
    # fp32 against float64 (7 seeds x llama, qwen3): norms <= 1.1e-6, scores <= 8.7e-7
    assert norm_err < 1e-5 and score_err < 1e-5


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_tiny_model_kvgrad_matches_kvpress(name, ratio, tiny):
    hf, tok, model, ids, _ = tiny
    parity(name, hf, tok, model, ids, ratio, variants=VARIANTS, cls="KVgradPress")


@pytest.mark.parametrize("ratio", RATIOS)
def test_default_model_kvgrad_matches_kvpress(ratio, hf_default, hf_tokenizer_default, default_model, prompt_ids):
    parity("KVgrad", hf_default, hf_tokenizer_default, default_model, prompt_ids, ratio, variants=VARIANTS,
           cls="KVgradPress")


def test_run_many_shares_the_prefill(tiny):
    _, _, model, _, _ = tiny
    pipe = kvpress_c.Pipeline(model)
    context, question = "the quick brown fox jumps over the lazy dog " * 6, "what jumps?"
    presses = [None, kvpress_c.KVgradPress(compression_ratio=0.6, chunk_size=100), kvpress_c.SnapKVPress(0.5)]
    many = pipe.run_many(context, question, presses=presses, max_new_tokens=6)
    one = pipe(context, question, press=presses[1], max_new_tokens=6)
    assert many[1].stats["shared_prefill"] and many[1].answers == one.answers
    for a, b in zip(many[1].kept_indices, one.kept_indices):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    assert many[1].stats["kept_tokens_total"] < many[0].stats["kept_tokens_total"]


def test_bad_arguments_and_models(tiny, tmp_path):
    _, _, model, ids, _ = tiny
    for bad in (dict(compression_ratio=1.0), dict(compression_ratio=-0.1), dict(chunk_size=0), dict(n_sink=-1),
                dict(compression_ratio="0.5")):
        with pytest.raises(ValueError):
            kvpress_c.KVgradPress(**bad)
    with pytest.raises(TypeError):
        kvpress_c.KVgradPress(kvzip_plus_normalization=True)  # not an argument of KVgrad (kvpress: init=False)
    s = model.new_session()
    arr = np.asarray(ids, np.int32)
    with pytest.raises(ValueError, match="must hold the cache of the context"):
        s.kvgrad_score(arr[:10], 0, 5)
    s.forward(arr, logits="none")
    with pytest.raises(ValueError, match="outside"):
        s.kvgrad_score(arr[:10], 100, 300)
    with pytest.raises(ValueError, match="vocabulary"):
        s.kvgrad_score(np.array([1, 10 ** 6]), 0, 5)
    t = model.new_session()
    t.set_press(**kvpress_c.SnapKVPress(0.5, window_size=4).c_config())
    t.forward(arr, logits="none")  # a compressed cache is scored by position (tests/press/test_press_turns.py)
    sc = t.kvgrad_score(arr[:10], 0, 5)
    held = np.array([[np.isin(np.arange(5), t.cache_positions(l, h)) for h in range(model.config["n_kv_heads"])]
                     for l in range(model.config["n_layers"])])
    assert np.array_equal(sc > 0, held)
    # a sliding window shorter than the positions spanned: refused, naming what is missing
    from hf_models import write_tiny_model
    win = kvpress_c.load_model(write_tiny_model(str(tmp_path / "mistral"), arch="mistral", window=16, seed=3))
    w = win.new_session()
    w.forward(arr[:40] % win.config["vocab"], logits="none")
    with pytest.raises(NotImplementedError, match="sliding-window"):
        w.kvgrad_score(arr[:10] % win.config["vocab"], 0, 5)
