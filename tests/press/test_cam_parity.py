"""CAMPress side by side with kvpress 0.5.5 (CPU fp32) on the same token ids: the cache length after every
decoding step, the kept positions after every compression (one set per layer: CaM's selection is shared by the
KV heads), the merged values of the final cache, and the greedy continuation.

CaM draws Bernoulli merge masks; kvpress calls torch.bernoulli(p), ours compares p with a uniform from
splitmix64 of (seed, layer, the layer's merging compression, KV head, candidate) (docs/METHODS.md). While kvpress
runs, torch.bernoulli is replaced by the same comparison on the same uniforms (tests/reference/merge_reference.py
cam_uniforms; the calls come one per merging compression of a layer, the shape [1, Hkv, candidates] asserted).
kvpress's kept positions are tracked from its own choice: the base press's score is wrapped and the rows CAMPress
keeps (the top target_size of the scores' mean over heads, in position order) map row -> position.

Base press: TOVA. Knorm ties exactly at layer 0 for a repeated token (RoPE keeps the key's norm), and kvpress's
topk breaks such ties its own way: one swapped row there changes where values merge and the continuation
(measured on the tiny model: positions 49 / 108 swapped at the first compression, greedy ids apart 7 steps later)."""
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

import kvpress_c  # noqa: E402
from merge_reference import cam_uniforms  # noqa: E402

INTERVAL = 8
N_STEPS = 3 * INTERVAL + 2
SEED = 2024
MERGE_BUDGET = 8
# Measured max |ours - kvpress| / max |kvpress| of the final cache's values (every row, kept sets equal):
# tiny llama 5.3e-7 (0.5), 3.8e-7 (0.9); default model 5.1e-6 (0.5), 3.8e-6 (0.9) (the HF and GGUF forwards
# agree to ~1e-6 before any merge). Bound 5e-5.
VALUE_RTOL = 5e-5


def make(lib, n, ratio):
    kw = {"seed": SEED} if lib is kvpress_c else {}
    return lib.CAMPress(lib.TOVAPress(), compression_interval=INTERVAL, target_size=max(1, int(n * (1 - ratio))),
                        merge_budget=MERGE_BUDGET, **kw)


def run_kvpress(hf, press, ids):
    L, n, Hkv = hf.config.num_hidden_layers, len(ids), hf.config.num_key_value_heads
    pos = [np.arange(n) for _ in range(L)]
    snaps, state, events = {}, {"step": -1, "layer": None}, [0] * L
    orig = press.base_press.score

    def score(module, *a, **kw):
        s = orig(module, *a, **kw)
        l = module.layer_idx
        state["layer"] = l
        kept = np.sort(s[0].mean(dim=0).topk(press.target_size).indices.numpy())
        pos[l] = pos[l][kept]
        snaps[(state["step"], l)] = set(pos[l].tolist())
        return s

    def bernoulli(p):
        l = state["layer"]
        assert p.dim() == 3 and p.shape[:2] == (1, Hkv), p.shape
        u = cam_uniforms(SEED, l, events[l], Hkv, p.shape[-1])
        events[l] += 1
        return torch.from_numpy(u < p[0].double().numpy()).to(p.dtype)[None]

    press.base_press.score = score
    cache = transformers.DynamicCache()
    out, lengths = [], []
    try:
        with torch.no_grad(), press(hf), mock.patch.object(torch, "bernoulli", bernoulli):
            res = hf(torch.tensor([ids]), past_key_values=cache)
            for step in range(N_STEPS):
                out.append(int(torch.argmax(res.logits[0, -1])))
                p = n + step
                for l in range(L):
                    pos[l] = np.r_[pos[l], p]
                state["step"] = step
                res = hf(torch.tensor([[out[-1]]]), past_key_values=cache, cache_position=torch.tensor([p]),
                         position_ids=torch.tensor([[p]]))
                lengths.append([cache.layers[l].keys.shape[2] for l in range(L)])
            out.append(int(torch.argmax(res.logits[0, -1])))
    finally:
        press.base_press.score = orig
    values = [cache.layers[l].values[0].double().numpy() for l in range(L)]
    return out, lengths, snaps, values, pos, sum(events)


def run_ours(model, press, ids):
    s = model.new_session()
    s.set_decoding_press(**press.decoding_config())
    logits = s.forward(np.asarray(ids, np.int32), logits="last")
    L, Hkv = model.config["n_layers"], model.config["n_kv_heads"]
    out, lengths, snaps = [], [], {}
    for step in range(N_STEPS):
        out.append(int(np.argmax(logits)))
        before = s.decoding_compressions
        logits = s.forward(np.array([out[-1]], np.int32))
        lens = s.cache_lengths()
        lengths.append(lens[:, 0].tolist())
        if s.decoding_compressions > before:
            for l in range(L):
                heads = [set(s.cache_positions(l, h).tolist()) for h in range(Hkv)]
                assert all(h == heads[0] for h in heads), "one selection for every KV head"
                snaps[(step, l)] = heads[0]
    out.append(int(np.argmax(logits)))
    return out, lengths, snaps, s


def parity(hf, model, ids, ratio):
    t_out, t_len, t_snaps, t_vals, t_pos, n_events = run_kvpress(hf, make(kvpress, len(ids), ratio), ids)
    o_out, o_len, o_snaps, s = run_ours(model, make(kvpress_c, len(ids), ratio), ids)
    assert o_len == t_len, f"cache lengths per step differ:\nours    {o_len}\nkvpress {t_len}"
    assert sorted(o_snaps) == sorted(t_snaps), "compressions at other steps or layers"
    jac = [len(o_snaps[k] & t_snaps[k]) / len(o_snaps[k] | t_snaps[k]) for k in t_snaps]
    err, compared = 0.0, 0
    for l in range(len(t_vals)):
        for h in range(t_vals[l].shape[0]):
            pos = s.cache_positions(l, h)
            if not np.array_equal(pos, t_pos[l]):
                continue
            compared += 1
            v = s.cache_rows(l, h)[1].astype(np.float64)
            err = max(err, np.abs(v - t_vals[l][h]).max() / np.abs(t_vals[l][h]).max())
    full = model.new_session()  # the merge changed values: the final cache is not the plain prefill's rows
    full.forward(np.asarray(ids, np.int32), logits="last")
    pos = s.cache_positions(0, 0)
    old = pos < len(ids)
    merged = not np.array_equal(s.cache_rows(0, 0)[1][old], full.cache_rows(0, 0)[1][pos[old]])
    print(f"CAMPress ratio {ratio}: {len(t_snaps)} layer compressions ({n_events} with merges), mean Jaccard "
          f"{np.mean(jac):.4f}, min {np.min(jac):.4f}, final values rel err {err:.1e} over {compared} heads, "
          f"lengths {o_len[INTERVAL - 1][0]}..{o_len[-1][0]}, greedy equal {o_out == t_out}")
    assert len(t_snaps) > 0 and n_events > 0 and merged
    assert np.mean(jac) >= 0.99, f"mean Jaccard {np.mean(jac):.4f}"
    assert compared > 0 and err < VALUE_RTOL, f"merged values differ by {err:.3g} (relative) over {compared} heads"
    assert o_out == t_out, f"greedy continuation differs: ours {o_out} vs kvpress {t_out}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hf_models import write_tiny_model
    path = write_tiny_model(str(tmp_path_factory.mktemp("cam") / "tiny"), arch="llama", seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = np.random.default_rng(5).integers(3, hf.config.vocab_size, 120).tolist()
    return hf, kvpress_c.load_model(path), ids


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_tiny_model_cam_matches_kvpress(tiny, ratio):
    parity(*tiny, ratio)


@pytest.fixture(scope="module")
def hf_default(default_gguf):
    import os
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32,
        attn_implementation="sdpa").eval()


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_default_model_cam_matches_kvpress(hf_default, default_model, ratio):
    from kvpress_c.demo import needle_prompt
    context, question, _ = needle_prompt(default_model, n_tokens=200)
    ids = default_model.encode(default_model.apply_chat_template(context + "\n\n" + question))
    parity(hf_default, default_model, ids, ratio)
