"""The hub files of ExpectedAttentionStatsPress, LUKVPress and FastKVzipPress as the tests write them (kvpress's
formats: a statistics folder, a [99, L, Hkv] curve, Fast KVzip gates), the same data handed to kvpress's presses,
and one kvpress run (prefill under the press, kept positions, greedy decode) with the scores kvpress ranked."""
from __future__ import annotations

import os

import numpy as np


def random_stats(rng, L, H, d):
    """A query mean [L, H, d] and a positive definite covariance [L, H, d, d] (float32, Hugging Face order)."""
    mu = rng.normal(0, 1, (L, H, d))
    a = rng.normal(0, 1, (L, H, d, d)) / np.sqrt(d)
    return mu.astype(np.float32), (a @ np.swapaxes(a, -1, -2) + 0.1 * np.eye(d)).astype(np.float32)


def write_stats(folder, mu, cov):
    from kvpress_c.presses.expected_attention_stats import write_query_stats
    return write_query_stats(str(folder), mu, cov, model_name="tiny", num_samples=1, sample_seq_len=1)


def random_curve(rng, L, Hkv):
    """[99, L, Hkv] prune fractions around each row's target ratio (t + 1) / 100, clipped to [0, 1]."""
    target = (np.arange(99) + 1)[:, None, None] / 100
    return np.clip(target + rng.normal(0, 0.1, (99, L, Hkv)), 0, 1)


def random_gates(rng, L, Hkv, D, G, od=16, nb=16):
    """Per layer the gate tensors of the Fast-KVzip repository's state dicts (float32)."""
    layers = []
    for _ in range(L):
        layers.append({
            "q_proj.weight": rng.normal(0, 0.3, (Hkv * G * od, D)), "q_proj.bias": rng.normal(0, 0.3, Hkv * G * od),
            "k_proj.weight": rng.normal(0, 0.3, (Hkv * od, D)), "q_norm.weight": rng.normal(1, 0.2, od),
            "k_norm.weight": rng.normal(1, 0.2, od), "k_base": rng.normal(0, 1, (Hkv, 1, nb, od)),
            "b": rng.normal(0, 1, (Hkv, 1, G))})
    return [{k: v.astype(np.float32) for k, v in layer.items()} for layer in layers]


def write_gates(path, layers):
    """A .npz (or .safetensors) gate file: '<layer>.<name>' tensors."""
    flat = {f"{i}.{k}": v for i, layer in enumerate(layers) for k, v in layer.items()}
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        from kvpress_c.presses._tensor_files import write_safetensors
        write_safetensors(path, flat)
    else:
        np.savez(path, **flat)
    return path


def kvpress_gates(layers):
    """kvpress's FastKVzipGate modules holding these weights."""
    import torch
    from kvpress.presses.fastkvzip_press import FastKVzipGate
    out = []
    for i, layer in enumerate(layers):
        od = layer["q_norm.weight"].shape[0]
        Hkv, _, nb, _ = layer["k_base"].shape
        G = layer["b"].shape[-1]
        gate = FastKVzipGate(i, layer["q_proj.weight"].shape[1], Hkv, G, torch.float32, od, nb)
        gate.load_state_dict({k: torch.tensor(v) for k, v in layer.items()})
        out.append(gate.eval())
    return out


def kvpress_run(hf, press, ids, full_keys, n_new=8, scorer=None):
    """kvpress's prefill of ids under `press`, then greedy decoding. Returns (kept [L][Hkv] sets of positions,
    the scores kvpress ranked per layer (float64 [Hkv, n], from `scorer`.score, or FastKVzip's score_val),
    greedy ids). Masked presses (LU-KV, Fast KVzip) read their masks, the others their compressed cache rows."""
    import torch
    import transformers
    L, n = hf.config.num_hidden_layers, len(ids)
    scores = [None] * L
    orig = scorer.score if scorer is not None else None

    def score(module, *args, **kw):
        s = orig(module, *args, **kw)
        scores[module.layer_idx] = s[0].detach().double().numpy().copy()
        return s

    if scorer is not None:
        scorer.score = score
    cache = transformers.DynamicCache()
    try:
        with torch.no_grad(), press(hf):
            res = hf(torch.tensor([ids]), past_key_values=cache)
    finally:
        if scorer is not None:
            scorer.score = orig
    if getattr(press, "score_val", None) is not None and not isinstance(press.score_val, list):
        scores = [press.score_val[l, 0].double().numpy() for l in range(L)]
    kept = []
    for l, layer in enumerate(hf.model.layers):
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            gone = [set() for _ in range(full_keys[l].shape[0])]
            for h, r in zip(masked[1].tolist(), masked[2].tolist()):
                gone[h].add(r)
            kept.append([set(range(n)) - g for g in gone])
        else:
            kept.append(match_rows(cache.layers[l].keys[0], full_keys[l]))
    out = []
    with torch.no_grad():
        for step in range(n_new):
            out.append(int(torch.argmax(res.logits[0, -1])))
            p = n + step
            res = hf(torch.tensor([[out[-1]]]), past_key_values=cache, cache_position=torch.tensor([p]),
                     position_ids=torch.tensor([[p]]))
    for layer in hf.model.layers:  # the masks must not reach the next run on this model
        layer.self_attn.masked_key_indices = None
    return kept, scores, out


def match_rows(comp_keys, full_keys):
    """Positions of a compressed cache's rows in the full cache: [Hkv, kept, d] vs [Hkv, n, d] (torch)."""
    import torch
    out = []
    for h in range(full_keys.shape[0]):
        dist = torch.cdist(comp_keys[h], full_keys[h], compute_mode="donot_use_mm_for_euclid_dist")
        best = dist.min(dim=1)
        assert float(best.values.max()) <= 1e-5 * float(full_keys[h].abs().max()), "compressed rows must be full-cache rows"
        out.append(set(best.indices.tolist()))
    return out


def full_cache_keys(hf, ids):
    """Every layer's keys [Hkv, n, d] of an uncompressed prefill of ids."""
    import torch
    import transformers
    with torch.no_grad():
        cache = transformers.DynamicCache()
        hf(torch.tensor([ids]), past_key_values=cache)
    return [cache.layers[l].keys[0].clone() for l in range(hf.config.num_hidden_layers)]


def jaccards(ours, theirs):
    return [len(a & b) / len(a | b) for la, lb in zip(ours, theirs) for a, b in zip(la, lb)]


def assert_head_near_ties(ours, theirs, scores, rtol):
    """Every row kept by one side only is within rtol (of the layer's largest |score|) of its head's cut in
    kvpress's scores (the cut: the kept count's last and first-dropped values)."""
    for l, (la, lb) in enumerate(zip(ours, theirs)):
        s = scores[l]
        tol = rtol * np.abs(s[np.isfinite(s)]).max()
        for h, (a, b) in enumerate(zip(la, lb)):
            srt = np.sort(s[h])[::-1]
            k = len(b)
            cut = srt[max(k - 1, 0):k + 1]
            for r in a ^ b:
                assert np.abs(cut - s[h, r]).min() <= tol, (l, h, r, s[h, r], cut)


def assert_global_near_ties(ours, theirs, scores, n_pruned, rtol, layerwise=False):
    """The same for a ranking over every layer and head (or each layer with layerwise)."""
    blocks = [np.stack(scores)] if not layerwise else [s[None] for s in scores]
    offs = [0] if not layerwise else list(range(len(scores)))
    for blk, l0 in zip(blocks, offs):
        srt = np.sort(blk, axis=None)
        cut = srt[max(n_pruned - 1, 0):n_pruned + 1]
        tol = rtol * np.abs(srt).max()
        for dl in range(blk.shape[0]):
            l = l0 + dl
            for h, (a, b) in enumerate(zip(ours[l], theirs[l])):
                for r in a ^ b:
                    assert np.abs(cut - blk[dl, h, r]).min() <= tol, (l, h, r, blk[dl, h, r], cut)
