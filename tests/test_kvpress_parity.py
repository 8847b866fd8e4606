"""Side by side with NVIDIA kvpress 0.5.x (PyTorch, HF transformers, CPU fp32) on the same model and
ids: the kept index sets per layer and KV head, and the greedy answers (kvpress masks for AdaKV, we
evict: the answers must still agree)."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

import kvpress_c  # noqa: E402

RATIO = 0.5


def our_press(name):
    k = kvpress_c
    return {"SnapKV": k.SnapKVPress(compression_ratio=RATIO, window_size=32), "PyramidKV": k.PyramidKVPress(compression_ratio=RATIO, window_size=32),
            "StreamingLLM": k.StreamingLLMPress(compression_ratio=RATIO), "Knorm": k.KnormPress(compression_ratio=RATIO),
            "TOVA": k.TOVAPress(compression_ratio=RATIO), "ObservedAttention": k.ObservedAttentionPress(compression_ratio=RATIO),
            "AdaKV": k.AdaKVPress(k.SnapKVPress(compression_ratio=RATIO, window_size=32)),
            "ChunkKV": k.ChunkKVPress(k.SnapKVPress(compression_ratio=RATIO, window_size=32), chunk_length=20)}[name]


def their_press(name):
    p = kvpress
    return {"SnapKV": p.SnapKVPress(compression_ratio=RATIO, window_size=32), "PyramidKV": p.PyramidKVPress(compression_ratio=RATIO, window_size=32),
            "StreamingLLM": p.StreamingLLMPress(compression_ratio=RATIO), "Knorm": p.KnormPress(compression_ratio=RATIO),
            "TOVA": p.TOVAPress(compression_ratio=RATIO), "ObservedAttention": p.ObservedAttentionPress(compression_ratio=RATIO),
            "AdaKV": p.AdaKVPress(p.SnapKVPress(compression_ratio=RATIO, window_size=32)),
            "ChunkKV": p.ChunkKVPress(p.SnapKVPress(compression_ratio=RATIO, window_size=32), chunk_length=20)}[name]


def kvpress_kept(hf, press, ids, n_new=12):
    """Run kvpress's press on a prefill of `ids`; return kept sets [L][Hkv] and greedy continuation ids."""
    from kvpress.utils import compute_n_kept
    L = hf.config.num_hidden_layers
    kept = [None] * L
    inner = press.press if hasattr(press, "press") else press

    orig_score = inner.score

    def score(module, hidden_states, keys, values, attentions, kwargs):
        s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
        k_len = keys.shape[2]
        if hasattr(press, "get_layer_budget"):
            n_kept = press.get_layer_budget(module, k_len)
        else:
            n_kept = compute_n_kept(k_len, inner.compression_ratio)
        if not isinstance(press, (kvpress.AdaKVPress, kvpress.ChunkKVPress)):
            idx = s.topk(n_kept, dim=-1).indices[0]
            kept[module.layer_idx] = [set(idx[h].tolist()) for h in range(idx.shape[0])]
        elif isinstance(press, kvpress.ChunkKVPress):
            kept[module.layer_idx] = ("chunk", s.clone())
        return s

    inner.score = score
    cache = transformers.DynamicCache()
    out_ids = []
    with torch.no_grad(), press(hf):
        res = hf(torch.tensor([ids]), past_key_values=cache)
        n = len(ids)
        for l, layer in enumerate(hf.model.layers):
            attn = layer.self_attn
            if isinstance(press, kvpress.AdaKVPress):
                _, heads, seq = attn.masked_key_indices
                masked = [set() for _ in range(hf.config.num_key_value_heads)]
                for h, sidx in zip(heads.tolist(), seq.tolist()):
                    masked[h].add(sidx)
                kept[l] = [set(range(n)) - m for m in masked]
            elif isinstance(press, kvpress.ChunkKVPress):
                # the gathered keys are whole chunks in order: recover their positions from the cache length
                pass
        logits = res.logits[0, -1]
        pos = n
        for _ in range(n_new):
            nxt = int(torch.argmax(logits))
            out_ids.append(nxt)
            res = hf(torch.tensor([[nxt]]), past_key_values=res.past_key_values,
                     cache_position=torch.tensor([pos]), position_ids=torch.tensor([[pos]]))
            logits = res.logits[0, -1]
            pos += 1
    inner.score = orig_score
    return kept, out_ids


def our_kept(model, press, ids, n_new=12):
    s = model.new_session()
    s.set_press(**press.c_config())
    logits = s.forward(np.array(ids, dtype=np.int32), logits="last")
    s.set_press(None)
    c = model.config
    kept = [[set(s.cache_positions(l, h).tolist()) for h in range(c["n_kv_heads"])] for l in range(c["n_layers"])]
    out = []
    for _ in range(n_new):
        nxt = int(np.argmax(logits))
        out.append(nxt)
        logits = s.forward(np.array([nxt], dtype=np.int32))
    return kept, out


@pytest.fixture(scope="module")
def models(default_gguf):
    load = lambda impl: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32,
        attn_implementation=impl).eval()
    return {"sdpa": load("sdpa"), "eager": load("eager")}


@pytest.fixture(scope="module")
def prompt_ids(default_model):
    from kvpress_c.demo import needle_prompt
    context, question, _ = needle_prompt(default_model, n_tokens=350)
    return default_model.encode(default_model.apply_chat_template(context + "\n\n" + question))


@pytest.mark.parametrize("name", ["SnapKV", "PyramidKV", "StreamingLLM", "Knorm", "TOVA", "ObservedAttention", "AdaKV"])
def test_kept_sets_and_answers_match_kvpress(name, models, default_model, prompt_ids):
    hf = models["eager" if name == "ObservedAttention" else "sdpa"]
    theirs, their_out = kvpress_kept(hf, their_press(name), prompt_ids)
    ours, our_out = our_kept(default_model, our_press(name), prompt_ids)
    jac = []
    exact = 0
    for l, (a_l, b_l) in enumerate(zip(ours, theirs)):
        assert b_l is not None, f"kvpress did not compress layer {l}"
        for a, b in zip(a_l, b_l):
            jac.append(len(a & b) / len(a | b))
            exact += a == b
    mean = float(np.mean(jac))
    print(f"{name}: mean Jaccard {mean:.4f}, exact heads {exact}/{len(jac)}, answers equal: {our_out == their_out}")
    assert mean >= 0.99, f"{name}: mean Jaccard {mean:.4f}"
    assert our_out == their_out, f"{name}: greedy continuation differs: ours {our_out} vs kvpress {their_out}"


def test_chunkkv_matches_kvpress(models, default_model, prompt_ids):
    """kvpress ChunkKVPress gathers whole chunks into the cache; the kept positions are recovered by
    matching the cached keys against the full-cache keys (identical computations give identical rows)."""
    hf = models["sdpa"]
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        full = transformers.DynamicCache()
        hf(ids, past_key_values=full)
        comp = transformers.DynamicCache()
        with their_press("ChunkKV")(hf):
            hf(ids, past_key_values=comp)
    ours, _ = our_kept(default_model, our_press("ChunkKV"), prompt_ids, n_new=0)
    jac = []
    for l in range(hf.config.num_hidden_layers):
        fk, ck = full.layers[l].keys[0], comp.layers[l].keys[0]  # [Hkv, n, d], [Hkv, kept, d]
        for h in range(fk.shape[0]):
            dist = torch.cdist(ck[h], fk[h])
            theirs = set(dist.argmin(dim=1).tolist())
            jac.append(len(ours[l][h] & theirs) / len(ours[l][h] | theirs))
    mean = float(np.mean(jac))
    print(f"ChunkKV: mean Jaccard {mean:.4f}")
    assert mean >= 0.99
