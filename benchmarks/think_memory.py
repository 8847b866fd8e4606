"""KV-cache bytes of ThinK with its memory really freed against kvpress's zeroing (issue 16).

    python benchmarks/think_memory.py [--prompt 2048] [--new 32] [--device cpu|emulated|cuda]

The embedded default model (SmolLM2-135M-Instruct Q4_1: 30 layers, 3 KV heads of 64 channels) reads a
random prompt of --prompt tokens with each press, then generates --new tokens greedily. Per press, in the
zeroing layout (free_channels=False: kvpress's ThinK, the K store keeps its head dim) and the freed one
(the pruned key rows stored with their kept channels only): the session's cache bytes after the prefill
(Session.cache_bytes: the arenas and the row positions), the device's cache bytes (Model.memory()), the
peak during the prefill, the bytes at the end, the median decode step time (the two layouts' sessions
decode in turns; wall clock on a shared machine: indicative), and whether their greedy tokens agree.
Writes benchmarks/results/think_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def presses(K, free: bool):
    think = lambda r: K.ThinKPress(key_channel_compression_ratio=r, free_channels=free)  # noqa: E731
    return {"ThinK 0.5": think(0.5), "ThinK 0.25": think(0.25),
            "SnapKV 0.5 + ThinK 0.5": K.ComposedPress([K.SnapKVPress(compression_ratio=0.5), think(0.5)])}


def prefill(model, press, ids):
    s = model.new_session()
    if press is not None:
        s.set_press(**press.c_config())
        press.before_prefill(s, len(ids), model.config)
    base = model.memory()["cache"]
    t0 = time.perf_counter()
    logits = s.forward(np.asarray(ids, np.int32), logits="last")
    res = {"cache_bytes": s.cache_bytes, "device_cache_bytes": model.memory()["cache"] - base,
           "peak_cache_bytes": s.peak_cache_bytes, "rows_per_head": float(s.cache_lengths().mean()),
           "prefill_s": time.perf_counter() - t0}
    s.set_press(None)
    return s, logits, res


def run(model, presses_, ids, n_new: int) -> list:
    """Prefill each press's session, then decode them in turns, one step each (a shared machine's load
    then weighs on both alike); the median step time per session."""
    runs = [prefill(model, p, ids) for p in presses_]
    toks = [[] for _ in runs]
    times = [[] for _ in runs]
    logits = [r[1] for r in runs]
    for _ in range(n_new):
        for i, (s, _, _) in enumerate(runs):
            toks[i].append(int(np.argmax(logits[i])))
            t0 = time.perf_counter()
            logits[i] = s.forward(np.array([toks[i][-1]], np.int32), logits="last")
            times[i].append(time.perf_counter() - t0)
    out = []
    for i, (s, _, res) in enumerate(runs):
        res.update(end_cache_bytes=s.cache_bytes, tokens=toks[i],
                   decode_ms_per_token=1e3 * float(np.median(times[i])) if times[i] else None)
        out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "think_memory.json"))
    a = ap.parse_args()
    import kvpress_c as K
    from tqdm import tqdm
    model = K.load_model(K.default_model_path(), device=a.device)
    ids = np.random.default_rng(a.seed).integers(3, model.config["vocab"], size=a.prompt)
    rows = {"none": run(model, [None], ids, a.new)[0]}
    zero, free = presses(K, False), presses(K, True)
    for name in tqdm(list(zero), desc="presses"):
        z, f = run(model, [zero[name], free[name]], ids, a.new)
        rows[name] = {"zeroing": z, "freed": f, "freed_over_zeroing": f["cache_bytes"] / z["cache_bytes"],
                      "same_tokens": z["tokens"] == f["tokens"]}
    print(f"{a.prompt}-token prompt, {model.config['n_layers']} layers x {model.config['n_kv_heads']} KV heads "
          f"x head_dim {model.config['head_dim']}, device {a.device}")
    print(f"{'press':<26} {'zeroing MiB':>12} {'freed MiB':>10} {'freed/zero':>10} {'K+V rows/head':>14} {'same tokens':>12}"
          f" {'decode ms/tok zero|freed':>25}")
    print(f"{'none':<26} {rows['none']['cache_bytes'] / 2**20:>12.2f} {'':>10} {'':>10} "
          f"{rows['none']['rows_per_head']:>14.0f}")
    for name in zero:
        r = rows[name]
        print(f"{name:<26} {r['zeroing']['cache_bytes'] / 2**20:>12.2f} {r['freed']['cache_bytes'] / 2**20:>10.2f} "
              f"{r['freed_over_zeroing']:>10.3f} {r['freed']['rows_per_head']:>14.0f} {str(r['same_tokens']):>12}"
              f" {r['zeroing']['decode_ms_per_token']:>12.1f}|{r['freed']['decode_ms_per_token']:<12.1f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"args": vars(a), "machine": platform.platform(), "model": K.default_model_path(),
                   "results": rows}, fh, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
