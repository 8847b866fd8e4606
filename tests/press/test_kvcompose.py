"""KVComposePress (csrc/press/kvcompose.c): its statistics and allocation against a float64 NumPy reference on a
tiny random model, then side by side with kvpress 0.5.5's KVComposePress (CPU fp32, eager attention) on the tiny
llama and the default model at compression ratios 0.5 and 0.9: the kept positions per (layer, KV head), the
per-layer counts, and the greedy continuation (structured; kvpress's unstructured variant masks the context
rows but leaves the replayed prompt's rows in its cache, so only its kept sets are compared)."""
import numpy as np
import pytest

import kvpress_c

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

from test_kvpress_parity import full_cache_keys, match_rows  # noqa: E402

N_NEW = 12
RATIOS = [0.5, 0.9]
TIE_TOL = 1e-5  # relative: scores this close to a cut may fall either side (fp32 attention on both sides)


def run_kvpress(hf, press, ids, full_keys, decode=True):
    cache = transformers.DynamicCache()
    hf.set_attn_implementation("eager")  # the press reads attention weights (it switches to eager itself too)
    try:
        with torch.no_grad(), press(hf):
            res = hf(torch.tensor([ids]), past_key_values=cache)
    finally:  # layers now hold different row counts: decode with sdpa (no mask built from layer 0's length)
        hf.set_attn_implementation("sdpa")
    L, n = hf.config.num_hidden_layers, len(ids)
    if press.structured:
        kept = [match_rows(cache.layers[l].keys[0], full_keys[l]) for l in range(L)]
    else:
        kept = []
        for layer in hf.model.layers:
            _, heads, seq = layer.self_attn.masked_key_indices
            masked = [set() for _ in range(hf.config.num_key_value_heads)]
            for h, r in zip(heads.tolist(), seq.tolist()):
                masked[h].add(r)
            kept.append([set(range(n)) - m for m in masked])
    out = []
    with torch.no_grad():
        if press.structured:  # a mask an unstructured run left on the modules must not apply here
            for layer in hf.model.layers:
                layer.self_attn.masked_key_indices = None
        for step in range(N_NEW if decode else 0):
            out.append(int(torch.argmax(res.logits[0, -1])))
            p = n + step
            res = hf(torch.tensor([[out[-1]]]), past_key_values=cache, cache_position=torch.tensor([p]),
                     position_ids=torch.tensor([[p]]))
    return kept, out


def run_ours(model, press, ids):
    s = model.new_session()
    logits = press.prefill(s, np.asarray(ids, np.int32), model.config)
    L, Hkv = model.config["n_layers"], model.config["n_kv_heads"]
    kept = [[set(s.cache_positions(l, h).tolist()) for h in range(Hkv)] for l in range(L)]
    out = []
    for _ in range(N_NEW):
        out.append(int(np.argmax(logits)))
        logits = s.forward(np.array([out[-1]], np.int32))
    return kept, out


def parity(hf, model, ids, keys, ratio, structured):
    theirs_press = kvpress.KVComposePress(structured=structured, compression_ratio=ratio)
    captured = {}
    orig = theirs_press.compute_important_per_layer

    def capture():  # kvpress's enhanced per-head scores, before it allocates
        captured["scores"] = theirs_press.scores.double().numpy().copy()
        return orig()

    theirs_press.compute_important_per_layer = capture
    theirs, their_ids = run_kvpress(hf, theirs_press, ids, keys, decode=structured)
    ours, our_ids = run_ours(model, kvpress_c.KVComposePress(structured=structured, compression_ratio=ratio), ids)
    sc = captured["scores"]
    jac = []
    for l, (la, lb) in enumerate(zip(ours, theirs)):
        if structured:
            assert len({len(a) for a in la}) == 1, "structured: every head of a layer keeps the same count"
        for h, (a, b) in enumerate(zip(la, lb)):
            jac.append(len(a & b) / len(a | b))
            if len(a) == len(b):  # the same count: a difference must be a near-tie of kvpress's own scores
                cut = np.sort(sc[l, h])[::-1][len(b) - 1:len(b) + 1]
                for r in a ^ b:
                    assert np.abs(cut - sc[l, h, r]).min() <= TIE_TOL * np.abs(sc[l]).max(), (l, h, r)
    counts_equal = [len(a) for la in ours for a in la] == [len(b) for lb in theirs for b in lb]
    same = our_ids == their_ids
    print(f"KVCompose(structured={structured}) @ {ratio}: mean Jaccard {np.mean(jac):.4f}, counts equal {counts_equal}, "
          f"greedy equal {same if structured else 'not compared'}")
    assert np.mean(jac) >= 0.99, f"mean Jaccard {np.mean(jac):.4f}"
    if structured:
        assert same, f"greedy continuation differs: {our_ids} vs {their_ids}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hf_models import write_tiny_model
    path = write_tiny_model(str(tmp_path_factory.mktemp("kvcompose") / "tiny"), arch="llama", seed=23)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = np.random.default_rng(23).integers(3, hf.config.vocab_size, 200).tolist()
    return hf, kvpress_c.load_model(path), ids, full_cache_keys(hf, ids)


@pytest.mark.parametrize("structured", [True, False])
@pytest.mark.parametrize("ratio", RATIOS)
def test_tiny_model_kvcompose_matches_kvpress(tiny, ratio, structured):
    parity(*tiny, ratio, structured)


@pytest.fixture(scope="module")
def default_side(default_gguf, default_model):
    import os
    from kvpress_c.demo import needle_prompt
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32,
        attn_implementation="sdpa").eval()
    context, question, _ = needle_prompt(default_model, n_tokens=300)
    ids = default_model.encode(default_model.apply_chat_template(context + "\n\n" + question))
    return hf, default_model, ids, full_cache_keys(hf, ids)


@pytest.mark.parametrize("structured", [True, False])
@pytest.mark.parametrize("ratio", RATIOS)
def test_default_model_kvcompose_matches_kvpress(default_side, ratio, structured):
    parity(*default_side, ratio, structured)
