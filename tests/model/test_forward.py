"""The forward pass against Hugging Face transformers (torch CPU, fp32): logits and greedy generations."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colours:",
    "The quick brown fox",
    "Water boils at",
    "1, 2, 3, 4,",
    "In machine learning, attention is",
    "My favourite food is",
    "Translate to French: Good morning ->",
]


def rel_err(ours, ref):
    return float(np.max(np.abs(ours.astype(np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def hf_default(default_gguf):
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(default_gguf):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf))


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().numpy()


def test_default_model_logits_match_hf(default_model, hf_default, rng):
    ids = rng.integers(0, default_model.config["vocab"], size=96).tolist()
    ours = default_model.logits(ids)
    ref = hf_logits(hf_default, ids)
    assert ours.shape == ref.shape
    err = rel_err(ours, ref)
    print(f"default model: max relative logit error {err:.2e}")
    assert err < 1e-4


def test_default_model_text_logits_and_last_mode(default_model, hf_default, hf_tokenizer):
    ids = hf_tokenizer(PROMPTS[2])["input_ids"]
    ref = hf_logits(hf_default, ids)
    assert rel_err(default_model.logits(ids), ref) < 1e-4
    s = default_model.new_session()
    last = s.forward(np.array(ids, dtype=np.int32), logits="last")
    assert rel_err(last[None], ref[-1:]) < 1e-4


def test_default_model_greedy_generations_match_hf(default_model, hf_default, hf_tokenizer):
    for prompt in PROMPTS:
        ids = hf_tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = hf_default.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
        ref = out[0, len(ids):].tolist()
        ours = default_model.generate(ids, max_new_tokens=16, stop_ids=[])
        assert ours == ref, f"prompt {prompt!r}: ours {ours} vs HF {ref}"


def test_prefill_then_decode_equals_one_prefill(default_model, rng):
    """Decode steps over the cache give the same logits as a batched prefill of the same tokens."""
    ids = rng.integers(0, default_model.config["vocab"], size=40).astype(np.int32)
    full = default_model.logits(ids)
    s = default_model.new_session()
    s.forward(ids[:30], logits="none")
    for i in range(30, 40):
        step = s.forward(ids[i:i + 1], logits="last")
        assert rel_err(step[None], full[i:i + 1].astype(np.float64)) < 1e-4
    assert s.position == 40
    assert (s.cache_lengths() == 40).all()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "llama31"])
def test_tiny_random_models_match_hf(arch, tmp_path, rng):
    from hf_models import write_tiny_model
    import kvpress_c

    path = write_tiny_model(str(tmp_path / arch), arch=arch, seed=int(rng.integers(1 << 31)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = kvpress_c.load_model(path)
    ids = rng.integers(0, model.config["vocab"], size=300).tolist()  # long enough for llama3 scaling to matter
    err = rel_err(model.logits(ids), hf_logits(hf, ids))
    print(f"{arch}: max relative logit error {err:.2e}")
    assert err < 1e-4
    # greedy: every token we pick is HF's argmax on the same prefix (teacher-forced), up to fp32 ties
    # (random tiny models have near-equal top logits often enough that comparing whole runs is flaky)
    ours = model.generate(ids[:20], max_new_tokens=12, stop_ids=[])
    ref = hf_logits(hf, ids[:20] + ours)
    for step, tok in enumerate(ours):
        row = ref[19 + step]
        assert row[tok] >= row.max() - 1e-4 * np.abs(row).max(), f"step {step}: picked {tok}, HF argmax {row.argmax()}"
