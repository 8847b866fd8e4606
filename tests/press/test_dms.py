"""DMSPress (threshold eviction behind a sliding window, csrc/press/dms.c): the kept rows against a float64
NumPy reference of its schedule on fresh random inputs, then side by side with kvpress 0.5.5's DMSPress
(CPU fp32) on the tiny llama and the default model: kept positions per (layer, KV head) after the prefill and
after decoding (kvpress masks, from module.masked_key_indices; we evict), the greedy continuation, and the
achieved compression ratio. Thresholds are the 0.5 and 0.9 quantiles of the prompt's Knorm scores, so about
half and nine tenths of the judged rows go (no compression_ratio exists for DMS)."""
import numpy as np
import pytest

import kvpress_c
from dms_reference import dms_reference, knorm

THRESHOLD_TOL = 1e-5  # a row whose score is within this (x the largest |score|) of the threshold may go either way


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from random_llama import write_random_llama
    path = write_random_llama(str(tmp_path_factory.mktemp("dms")), layers=2, hidden=128, heads=4, kv_heads=2,
                              ffn=256, vocab=300)
    return kvpress_c.load_model(path)


@pytest.mark.parametrize("window,decoding", [(16, False), (16, True), (1, True), (200, True)])
def test_dms_matches_reference(tiny_model, rng, window, decoding):
    """Knorm's scores of each row (its own key, float64) through the reference queue give our kept rows. A row's
    key does not change once written, so the keys read back from the cache are the ones that were scored: the
    prompt's from a plain prefill (eviction only follows a layer's attention), each decoded row's right after its
    call (it sits in the window: window >= 1 here; with 0 a row can go in its own call, before it can be read)."""
    cfg = tiny_model.config
    ids = rng.integers(3, 300, 90).astype(np.int32)
    steps = rng.integers(3, 300, 25).astype(np.int32)
    full = tiny_model.new_session()
    full.forward(ids, logits="last")
    prompt = [[knorm(full.cache_rows(l, h)[0]) for h in range(cfg["n_kv_heads"])] for l in range(cfg["n_layers"])]
    threshold = float(np.quantile(np.concatenate([s for row in prompt for s in row]), 0.5))
    press = kvpress_c.DMSPress(kvpress_c.KnormPress(), threshold=threshold, sliding_window_size=window, decoding=decoding)
    s = tiny_model.new_session()
    s.set_press(**press.c_config())
    if decoding:
        s.set_decoding_press(**press.decoding_config())
    s.forward(ids, logits="last")
    calls = [[[p] for p in row] for row in prompt]
    for t in steps:
        s.forward(np.array([t], np.int32), logits="last")
        for l in range(cfg["n_layers"]):
            for h in range(cfg["n_kv_heads"]):
                calls[l][h].append(knorm(s.cache_rows(l, h)[0][-1:]))
    scale = max(np.abs(x).max() for row in prompt for x in row)
    evicted = 0
    for l in range(cfg["n_layers"]):
        for h in range(cfg["n_kv_heads"]):
            # without decoding the calls after the prompt are never judged: they stay
            want = dms_reference(calls[l][h] if decoding else calls[l][h][:1], window, threshold)
            if not decoding:
                want += list(range(len(ids), len(ids) + len(steps)))
            got = s.cache_positions(l, h).tolist()
            every = np.concatenate(calls[l][h])
            for r in set(got) ^ set(want):
                assert abs(every[r] - threshold) <= THRESHOLD_TOL * scale, (l, h, r, every[r], threshold)
            evicted += len(ids) + len(steps) - len(got)
    if window < len(ids):
        assert evicted > 0


def test_dms_reset_forgets_the_prefill_window(tiny_model, rng):
    """A session reset resets the press's parts (the part table's reset hook): the decoding part does not take up
    the unjudged window of a prefill from before the reset. After a reset, a one-token first call (no prefill
    press acts on it) and decode steps keep exactly what a fresh session keeps."""
    ids = rng.integers(3, 300, 60).astype(np.int32)
    steps = rng.integers(3, 300, 30).astype(np.int32)
    full = tiny_model.new_session()
    full.forward(ids, logits="none")
    scores = np.concatenate([np.linalg.norm(full.cache_rows(0, h)[0], axis=1) for h in range(2)])
    press = kvpress_c.DMSPress(kvpress_c.KnormPress(), threshold=float(np.quantile(-scores, 0.5)),
                               sliding_window_size=8, decoding=True)

    def decode(s):
        for t in steps:
            s.forward(np.array([t], np.int32), logits="none")
        return [[s.cache_positions(l, h).tolist() for h in range(2)] for l in range(2)]

    s = tiny_model.new_session()
    s.set_press(**press.c_config())
    s.set_decoding_press(**press.decoding_config())
    s.forward(ids, logits="none")  # leaves each layer's last 8 rows unjudged for the decoding part
    s.reset()
    fresh = tiny_model.new_session()
    fresh.set_press(**press.c_config())
    fresh.set_decoding_press(**press.decoding_config())
    assert decode(s) == decode(fresh)


def test_dms_errors(tiny_model):
    with pytest.raises(ValueError, match="threshold"):
        kvpress_c.DMSPress(kvpress_c.KnormPress())
    with pytest.raises(ValueError, match="ScorerPress"):
        kvpress_c.DMSPress(kvpress_c.AdaKVPress(kvpress_c.KnormPress()), threshold=0.0)
    with pytest.raises(ValueError, match="sliding_window_size"):
        kvpress_c.DMSPress(kvpress_c.KnormPress(), threshold=0.0, sliding_window_size=-1)
    with pytest.raises(ValueError, match="compression_ratio or budget"):
        kvpress_c.DMSPress(kvpress_c.KnormPress(compression_ratio=0.5), threshold=0.0)
    p = kvpress_c.DMSPress(kvpress_c.KnormPress(), threshold=0.0)
    with pytest.raises(ValueError, match="forward"):
        p.compression_ratio


# -- kvpress ---------------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

N_NEW = 12
QUANTILES = [0.5, 0.9]


def run_kvpress(hf, press, ids):
    cache = transformers.DynamicCache()
    out = []
    n = len(ids)
    with torch.no_grad(), press(hf):
        res = hf(torch.tensor([ids]), past_key_values=cache)
        ratio = press.compression_ratio
        for step in range(N_NEW):
            out.append(int(torch.argmax(res.logits[0, -1])))
            if step == N_NEW - 1:
                break
            p = n + step
            res = hf(torch.tensor([[out[-1]]]), past_key_values=cache, cache_position=torch.tensor([p]),
                     position_ids=torch.tensor([[p]]))
    Hkv, total = hf.config.num_key_value_heads, n + N_NEW - 1
    kept = []
    for layer in hf.model.layers:
        masked = [set() for _ in range(Hkv)]
        if layer.self_attn.masked_key_indices is not None:
            _, heads, seq = layer.self_attn.masked_key_indices
            for h, r in zip(heads.tolist(), seq.tolist()):
                masked[h].add(r)
        kept.append([set(range(total)) - m for m in masked])
    return kept, out, ratio


def run_ours(model, press, ids):
    s = model.new_session()
    s.set_press(**press.c_config())
    if press.decoding_config():
        s.set_decoding_press(**press.decoding_config())
    logits = s.forward(np.asarray(ids, np.int32), logits="last")
    press.after_prefill(s, len(ids), model.config)
    out = []
    for step in range(N_NEW):
        out.append(int(np.argmax(logits)))
        if step == N_NEW - 1:
            break
        logits = s.forward(np.array([out[-1]], np.int32))
    L, Hkv = model.config["n_layers"], model.config["n_kv_heads"]
    return [[set(s.cache_positions(l, h).tolist()) for h in range(Hkv)] for l in range(L)], out, press.compression_ratio


def knorm_scores(hf, ids):
    with torch.no_grad():
        cache = transformers.DynamicCache()
        hf(torch.tensor([ids]), past_key_values=cache)
    return [-cache.layers[l].keys[0].double().norm(dim=-1).numpy() for l in range(hf.config.num_hidden_layers)]


def parity(hf, model, ids, q, decoding, window):
    scores = knorm_scores(hf, ids)
    every = np.concatenate([s.ravel() for s in scores])
    threshold = float(np.quantile(every, q))
    make = lambda lib: lib.DMSPress(lib.KnormPress(), threshold=threshold, sliding_window_size=window, decoding=decoding)
    theirs, their_ids, their_ratio = run_kvpress(hf, make(kvpress), ids)
    ours, our_ids, our_ratio = run_ours(model, make(kvpress_c), ids)
    jac = []
    scale = np.abs(every).max()
    for l, (la, lb) in enumerate(zip(ours, theirs)):
        for h, (a, b) in enumerate(zip(la, lb)):
            jac.append(len(a & b) / len(a | b))
            for r in a ^ b:  # prompt rows: their score is known here; a decoded row must not differ
                assert r < len(ids) and abs(scores[l][h, r] - threshold) <= THRESHOLD_TOL * scale, \
                    f"layer {l} head {h}: position {r} differs and is not at the threshold"
    print(f"DMSPress(Knorm, q{q}, window {window}, decoding {decoding}): prefill compression ratio ours "
          f"{our_ratio:.4f} kvpress {their_ratio:.4f}, mean Jaccard {np.mean(jac):.4f}, greedy equal {our_ids == their_ids}")
    assert abs(our_ratio - their_ratio) < 0.01
    assert np.mean(jac) >= 0.99, f"mean Jaccard {np.mean(jac):.4f}"
    assert our_ids == their_ids, f"greedy continuation differs: {our_ids} vs {their_ids}"


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from hf_models import write_tiny_model
    path = write_tiny_model(str(tmp_path_factory.mktemp("dms_hf") / "tiny"), arch="llama", seed=19)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = np.random.default_rng(19).integers(3, hf.config.vocab_size, 200).tolist()
    return hf, kvpress_c.load_model(path), ids


@pytest.mark.parametrize("decoding", [False, True])
@pytest.mark.parametrize("q", QUANTILES)
def test_tiny_model_dms_matches_kvpress(tiny_hf, q, decoding):
    parity(*tiny_hf, q, decoding, window=8)  # 8 < N_NEW: decoded rows are judged too


@pytest.fixture(scope="module")
def default_side(default_gguf, default_model):
    import os
    from kvpress_c.demo import needle_prompt
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32,
        attn_implementation="sdpa").eval()
    context, question, _ = needle_prompt(default_model, n_tokens=300)
    ids = default_model.encode(default_model.apply_chat_template(context + "\n\n" + question))
    return hf, default_model, ids


@pytest.mark.parametrize("decoding", [False, True])
@pytest.mark.parametrize("q", QUANTILES)
def test_default_model_dms_matches_kvpress(default_side, q, decoding):
    parity(*default_side, q, decoding, window=32)
