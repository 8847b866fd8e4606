"""Judge Q training: the C loss and gradient (kvc_judgeq_loss_grad) against central finite differences of
a float64 NumPy reference and against torch autograd on Hugging Face transformers; the trainer (AdamW,
validation, checkpoints that resume exactly), the data builder, the CLI, and bad inputs."""
import copy
import json
import os

import numpy as np
import pytest

import kvpress_c
from kvpress_c import judgeq, judgeq_cli


# -- float64 NumPy reference of the whole loss ----------------------------------------------------------

def np_maps(ref, x, positions, P, cache):
    """Run rows x at positions on top of `cache` (modified); return their attention maps [L, H, P]:
    mean over the rows of each row's causal softmax over everything it sees, read at prompt positions."""
    maps = []
    g = ref.H // ref.Hkv

    def hook(l, q, attn, o, resid, past, cache_):
        A = np.zeros((ref.H, P))
        for hq in range(ref.H):
            K = cache_[l][hq // g]["k"]
            for i in range(q.shape[0]):
                s = K[:past[hq // g] + i + 1] @ q[i, hq] / np.sqrt(ref.d)
                p = np.exp(s - s.max())
                A[hq] += (p / p.sum())[:P]
        maps.append(A / q.shape[0])

    ref.forward(x, positions, cache, hook)
    return np.array(maps)


class NpJudgeQ:
    """The loss of docs/METHODS.md / the paper, float64: the prompt's cache and the target are computed once."""

    def __init__(self, ref, prompt, response):
        self.ref, self.P = ref, len(prompt)
        self.cache = ref.empty_cache()
        ref.forward(ref.embed(prompt), np.arange(self.P), self.cache)
        self.a_resp = np_maps(ref, ref.embed(response), self.P + np.arange(len(response)), self.P,
                              copy.deepcopy(self.cache))

    def maps(self, E):
        return np_maps(self.ref, np.asarray(E, dtype=np.float64), self.P + np.arange(len(E)), self.P,
                       copy.deepcopy(self.cache))

    def loss(self, E):
        return float(np.mean((self.maps(E) - self.a_resp) ** 2))


def rel_err(ours, ref):
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref)), float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    from hf_models import write_tiny_model
    from np_llama import NpLlama
    path = write_tiny_model(str(tmp_path_factory.mktemp("jq") / request.param), arch=request.param, seed=11)
    return kvpress_c.load_model(path), NpLlama(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from hf_models import write_tiny_model
    path = write_tiny_model(str(tmp_path_factory.mktemp("jq") / "llama"), arch="llama", seed=5)
    return kvpress_c.load_model(path)


def test_loss_maps_and_gradient_match_float64_finite_differences(tiny, rng):
    model, ref = tiny
    V, D = model.config["vocab"], model.config["hidden"]
    P, nr, m = int(rng.integers(20, 40)), int(rng.integers(3, 9)), 3
    prompt, response = rng.integers(0, V, P), rng.integers(0, V, nr)
    E = (rng.standard_normal((m, D)) * 0.5).astype(np.float32)
    npj = NpJudgeQ(ref, prompt, response)
    E64 = E.astype(np.float64)

    loss, grad = judgeq.loss_and_grad(model, prompt, response, E)
    a_soft, a_resp = judgeq.attention_maps(model, prompt, response, E)
    assert a_soft.shape == a_resp.shape == (model.config["n_layers"], model.config["n_heads"], P)
    np.testing.assert_allclose(a_resp, npj.a_resp, atol=1e-6)
    np.testing.assert_allclose(a_soft, npj.maps(E64), atol=1e-6)
    assert abs(loss - npj.loss(E64)) <= 1e-4 * npj.loss(E64)

    h = 1e-4
    fd = np.zeros_like(E64)
    for idx in np.ndindex(E64.shape):
        e = np.zeros_like(E64)
        e[idx] = h
        fd[idx] = (npj.loss(E64 + e) - npj.loss(E64 - e)) / (2 * h)
    norm_err, max_err = rel_err(grad.astype(np.float64), fd)
    print(f"{model.config['arch']}: gradient vs float64 central differences: relative error {norm_err:.2e} (norm), "
          f"{max_err:.2e} (max)")
    assert norm_err < 1e-4 and max_err < 1e-4


def test_gradient_matches_torch_autograd_on_default_model(default_model, default_gguf, rng):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32,
        attn_implementation="eager").eval().double()
    V = default_model.config["vocab"]
    P, nr, m = int(rng.integers(48, 80)), int(rng.integers(6, 16)), 8
    prompt, response = rng.integers(0, V, P), rng.integers(0, V, nr)
    table = hf.get_input_embeddings().weight.detach()
    E = (table[torch.tensor(rng.integers(0, V, m))].numpy()
         + 0.05 * rng.standard_normal((m, table.shape[1]))).astype(np.float32)
    loss, grad = judgeq.loss_and_grad(default_model, prompt, response, E)

    def maps(attentions):
        return torch.stack([a[0, :, P:, :P].mean(dim=1) for a in attentions])

    with torch.no_grad():
        a_resp = maps(hf(input_ids=torch.tensor([np.concatenate([prompt, response])]), output_attentions=True).attentions)
    Et = torch.tensor(E, dtype=torch.float64, requires_grad=True)
    x = torch.cat([hf.get_input_embeddings()(torch.tensor(prompt)), Et])[None]
    ref_loss = ((maps(hf(inputs_embeds=x, output_attentions=True).attentions) - a_resp) ** 2).mean()
    ref_loss.backward()
    norm_err, max_err = rel_err(grad.astype(np.float64), Et.grad.numpy())
    print(f"default model: loss {loss:.6e} vs torch {ref_loss.item():.6e}; dL/dE relative error {norm_err:.2e} (norm), "
          f"{max_err:.2e} (max)")
    assert abs(loss - ref_loss.item()) < 1e-4 * ref_loss.item()
    assert norm_err < 1e-3 and max_err < 1e-3


# -- data builder and trainer on the tiny model ------------------------------------------------------------

TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.",
    "A journey of a thousand miles begins with a single step, said the old man to the young traveller.",
    "In the beginning the universe was created, which made a lot of people angry and was widely regarded.",
    "It was the best of times, it was the worst of times, it was the age of wisdom and of foolishness.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little money in my purse.",
    "All happy families are alike; each unhappy family is unhappy in its own way, wrote the novelist.",
    "Whether I shall turn out to be the hero of my own life, or whether that station will be held by anybody.",
    "The sky above the port was the colour of television, tuned to a dead channel, on a cold evening.",
    "Far out in the uncharted backwaters of the unfashionable end of the western spiral arm of the galaxy.",
    "Many years later, as he faced the firing squad, the colonel was to remember that distant afternoon.",
    "Happy is the man who finds wisdom, and the man who gets understanding, for the gain is better than silver.",
    "Stately, plump Buck Mulligan came from the stairhead, bearing a bowl of lather on which a mirror lay.",
]


@pytest.fixture(scope="module")
def tiny_data(tiny_llama):
    return judgeq.build_dataset(tiny_llama, TEXTS, max_text_tokens=80, min_text_tokens=40, max_response_tokens=16,
                                min_response_tokens=4, seed=3, progress=False)


def test_build_dataset_prompt_is_90_percent_and_response_is_greedy(tiny_llama, tiny_data):
    assert len(tiny_data) == len(TEXTS)
    for text, s in zip(TEXTS, tiny_data):
        ids = tiny_llama.encode(text)[:80]
        assert s.prompt_ids.tolist() == ids[:round(0.9 * len(ids))]
        full = tiny_llama.generate(s.prompt_ids.tolist(), max_new_tokens=16, stop_ids=tiny_llama.tokenizer.stop_ids)
        assert 1 <= len(s.response_ids) <= len(full) and s.response_ids.tolist() == full[:len(s.response_ids)]
    # ShareGPT conversations go through the chat template
    conv = {"conversations": [{"from": "human", "value": TEXTS[0]}, {"from": "gpt", "value": TEXTS[1]}]}
    (s,) = judgeq.build_dataset(tiny_llama, [conv], min_text_tokens=10, max_text_tokens=400, progress=False)
    ids = tiny_llama.encode(tiny_llama.apply_chat_template(
        [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": TEXTS[1]}],
        add_generation_prompt=False), add_bos=False)
    assert s.prompt_ids.tolist() == ids[:round(0.9 * len(ids))]


def test_training_lowers_validation_loss(tiny_llama, tiny_data, tmp_path):
    res = judgeq.train(tiny_llama, tiny_data, n_soft=4, lr=3e-2, epochs=4, batch_size=3, seed=1, val_fraction=0.25,
                       out=str(tmp_path), progress=False)
    v = res.val_loss
    print(f"validation loss {v[0]:.4e} -> {v[-1]:.4e} ({len(res.history['steps'])} steps)")
    assert len(v) == 5 and v[-1] < 0.8 * v[0], v
    assert min(v) == pytest.approx(judgeq.evaluate(tiny_llama, res.best_soft_embeddings,
                                                   [tiny_data[i] for i in _val_indices(len(tiny_data), 1, 0.25)]))
    for f in (judgeq.CHECKPOINT, judgeq.FINAL, judgeq.BEST, judgeq.HISTORY, judgeq.CURVE):
        assert (tmp_path / f).exists(), f
    assert np.array_equal(np.load(tmp_path / judgeq.FINAL), res.soft_embeddings)


def _val_indices(n, seed, frac):
    return np.random.default_rng(seed).permutation(n)[:max(1, int(round(n * frac)))]


def test_checkpoint_resume_gives_the_same_trajectory(tiny_llama, tiny_data, tmp_path):
    kw = dict(n_soft=3, lr=2e-2, epochs=2, batch_size=4, seed=7, val_fraction=0.2, val_every=2, init="mean",
              weight_decay=0.01, progress=False, plot=False)
    full = judgeq.train(tiny_llama, tiny_data, out=str(tmp_path / "a"), **kw)
    # 10 training samples, batch 4: 3 steps per epoch; stop mid-epoch, at the epoch boundary, then finish
    for stop in (1, 3, 4):
        part = judgeq.train(tiny_llama, tiny_data, out=str(tmp_path / "b"), max_steps=stop, **kw)
        assert part.history["steps"][-1] == stop
    resumed = judgeq.train(tiny_llama, tiny_data, out=str(tmp_path / "b"), **kw)
    assert resumed.resumed_from_step == 4
    np.testing.assert_array_equal(resumed.soft_embeddings, full.soft_embeddings)
    for key in ("steps", "train_loss", "val_steps", "val_loss"):
        assert resumed.history[key] == full.history[key], key
    # other settings on the same folder: refused, not silently mixed
    with pytest.raises(ValueError, match="other settings"):
        judgeq.train(tiny_llama, tiny_data, out=str(tmp_path / "b"), **dict(kw, lr=1e-3))


def test_cli_train_and_eval(tiny_llama, tmp_path, capsys):
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:8]))
    out = tmp_path / "run"
    argv = ["train", "--model", tiny_llama.path, "--data", str(data), "--out", str(out), "--n-soft", "2",
            "--lr", "1e-2", "--epochs", "1", "--batch-size", "4", "--max-text-tokens", "60", "--max-response-tokens",
            "8", "--save-to", str(tmp_path / "soft.npy"), "--init", "ids:5,6"]
    assert judgeq_cli.main(argv) == 0
    assert (out / "dataset.jsonl").exists() and (out / judgeq.CURVE).exists()
    soft = np.load(tmp_path / "soft.npy")
    assert soft.shape == (2, tiny_llama.config["hidden"])
    assert judgeq_cli.main(["eval", "--model", tiny_llama.path, "--data", str(out / "dataset.jsonl"), "--soft",
                            str(tmp_path / "soft.npy"), "--budgets", "16", "--window", "4",
                            "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["samples"] == 8 and 0 <= report["hit_rate"]["16"]["judgeq"]["mean"] <= 1
    assert judgeq_cli.main(["train", "--model", tiny_llama.path, "--data", str(tmp_path / "missing.jsonl"),
                            "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- bad inputs --------------------------------------------------------------------------------------------

def test_bad_inputs_raise_clear_errors(tiny_llama, tmp_path):
    V, D = tiny_llama.config["vocab"], tiny_llama.config["hidden"]
    E = np.zeros((2, D), dtype=np.float32)
    p, r = [1, 5, 9, 12], [3, 4]
    with pytest.raises(ValueError, match="shape"):
        judgeq.loss_and_grad(tiny_llama, p, r, np.zeros((2, D + 1), dtype=np.float32))
    with pytest.raises(ValueError, match="vocabulary"):
        judgeq.loss_and_grad(tiny_llama, [1, V], r, E)
    with pytest.raises(ValueError, match="vocabulary"):
        judgeq.loss_and_grad(tiny_llama, p, [-1], E)
    with pytest.raises(ValueError, match="non-empty"):
        judgeq.loss_and_grad(tiny_llama, [], r, E)
    with pytest.raises(ValueError, match="not finite"):
        judgeq.loss_and_grad(tiny_llama, p, r, np.full((2, D), np.nan, dtype=np.float32))
    with pytest.raises(TypeError):
        judgeq.loss_and_grad("model", p, r, E)
    # the C entry points themselves check everything (no crash on direct use)
    core = tiny_llama._core
    with pytest.raises(ValueError):
        kvpress_c._core.judgeq_pair(core, np.array(p), np.zeros(0, dtype=np.int64), 2)
    with pytest.raises(ValueError):
        kvpress_c._core.judgeq_pair(core, np.array([[1, 2]]), np.array(r), 2)
    with pytest.raises(TypeError):
        kvpress_c._core.judgeq_pair("model", np.array(p), np.array(r), 2)
    pair, nbytes = kvpress_c._core.judgeq_pair(core, np.array(p), np.array(r), 2)
    assert nbytes > 0
    with pytest.raises(ValueError, match="shape"):
        kvpress_c._core.judgeq_loss_grad(pair, np.zeros((0, D), dtype=np.float32))
    # more soft rows than max_soft pre-sized for: the cache grows, the pair stays usable
    loss3 = kvpress_c._core.judgeq_loss_grad(pair, np.zeros((3, D), dtype=np.float32), grad=False)[0]
    assert np.isfinite(loss3) and loss3 == kvpress_c._core.judgeq_loss_grad(pair, np.zeros((3, D), np.float32))[0]
    with pytest.raises(TypeError):
        kvpress_c._core.judgeq_loss_grad(object(), E)
    with pytest.raises(ValueError, match="vocabulary"):
        kvpress_c._core.token_embeddings(core, [V + 3])
    samples = [(p, r)] * 4
    with pytest.raises(ValueError, match="lr"):
        judgeq.train(tiny_llama, samples, n_soft=2, lr=-1.0, progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        judgeq.train(tiny_llama, samples, n_soft=2, batch_size=0, progress=False)
    with pytest.raises(ValueError, match="init"):
        judgeq.train(tiny_llama, samples, n_soft=2, init="zeros", progress=False)
    with pytest.raises(ValueError, match="sample 0"):
        judgeq.train(tiny_llama, [{"prompt": p}], n_soft=2, progress=False)
    (tmp_path / judgeq.CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="checkpoint"):
        judgeq.train(tiny_llama, samples, n_soft=2, out=str(tmp_path), progress=False)
    with pytest.raises(FileNotFoundError):
        judgeq.build_dataset(tiny_llama, str(tmp_path / "nope.jsonl"), progress=False)
    with pytest.raises(ValueError, match="corpus item"):
        judgeq.build_dataset(tiny_llama, [42], progress=False)
