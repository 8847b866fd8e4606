"""Peak KV-cache bytes over a long generation, with and without a press that compresses while decoding.

    python benchmarks/decoding_memory.py [--prompt 512] [--new 2048] [--device cpu|emulated|cuda]

A model with the KV-cache shape of the embedded default model (SmolLM2-135M: 30 layers, 3 KV heads of 64)
and random weights, small elsewhere (hidden 192, MLP 256, vocabulary 1000) so that 2k decode steps per run
fit a shared 2-core machine: KV bytes depend only on the cache shape and the rows kept, not on the
weights (--default-model runs the real model instead). It reads a random prompt of --prompt tokens, then
generates --new tokens greedily (no stop token, so every run generates the same count). Measured per run: the session's cache high-water mark
(Session.peak_cache_bytes: the allocator's bytes, transient copies of a compaction included), the bytes
held at the end, the cache rows per head at the end, and the decode time per token. Ratios are against
the run without a decoding press in the same process. Writes benchmarks/results/decoding_memory.json.
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


def presses(kvpress_c, interval: int, target: int):
    K = kvpress_c
    return {
        "none": None,
        f"DecodingPress(Knorm, interval={interval}, target={target})":
            K.DecodingPress(K.KnormPress(), compression_interval=interval, target_size=target),
        f"DecodingPress(SnapKV w=32, interval={interval}, target={target})":
            K.DecodingPress(K.SnapKVPress(window_size=32), compression_interval=interval, target_size=target),
        f"CompressionRatioDecodingPress(Knorm, interval={interval}, ratio=0.5)":
            K.CompressionRatioDecodingPress(K.KnormPress(), compression_interval=interval, target_compression_ratio=0.5),
        f"PrefillDecodingPress(SnapKV 0.5, DecodingPress(Knorm, interval={interval}, target={target}))":
            K.PrefillDecodingPress(K.SnapKVPress(compression_ratio=0.5), K.DecodingPress(
                K.KnormPress(), compression_interval=interval, target_size=target)),
    }


def run(model, press, ids, n_new: int) -> dict:
    from tqdm import tqdm
    s = model.new_session()
    if press is not None and press.prefill_part is not None:
        s.set_press(**press.prefill_part.c_config())
    if press is not None and press.decoding_config():
        s.set_decoding_press(**press.decoding_config())
    logits = s.forward(np.asarray(ids, np.int32), logits="last")
    s.set_press(None)
    after_prefill = s.cache_bytes
    t0 = time.perf_counter()
    out = []
    for _ in tqdm(range(n_new), desc="decode", leave=False):
        out.append(int(np.argmax(logits)))
        logits = s.forward(np.array([out[-1]], np.int32), logits="last")
    dt = time.perf_counter() - t0
    lens = s.cache_lengths()
    return {"peak_kv_bytes": int(s.peak_cache_bytes), "kv_bytes_after_prefill": int(after_prefill),
            "kv_bytes_at_end": int(s.cache_bytes), "rows_per_head_at_end": [int(lens.min()), int(lens.max())],
            "layer_compressions": int(s.decoding_compressions), "decode_ms_per_token": 1e3 * dt / n_new,
            "first_new_ids": out[:16]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=2048)
    ap.add_argument("--interval", type=int, default=128)
    ap.add_argument("--target", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--default-model", action="store_true", help="the embedded SmolLM2-135M instead of the random one")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "decoding_memory.json"))
    a = ap.parse_args()
    import kvpress_c
    if a.default_model:
        from kvpress_c.demo import needle_prompt
        model = kvpress_c.load_model(device=a.device)
        context, question, _ = needle_prompt(model, n_tokens=a.prompt)
        ids = model.encode(model.apply_chat_template(context + "\n\n" + question))
        model_name = "SmolLM2-135M-Instruct Q4_1 (embedded default)"
    else:
        import tempfile
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support"))
        from random_llama import write_random_llama
        path = write_random_llama(os.path.join(tempfile.gettempdir(), "kvc_decoding_memory_model"), layers=30, hidden=192,
                                  heads=3, kv_heads=3, ffn=256, vocab=1000)
        model = kvpress_c.load_model(path, device=a.device)
        ids = np.random.default_rng(0).integers(3, 1000, a.prompt).tolist()
        model_name = "random llama with SmolLM2-135M's KV shape (30 layers, 3 KV heads x 64; hidden 192, MLP 256, vocab 1000)"
    # results are written after every run; a later run with the same settings resumes where this one stopped
    settings = {"prompt": len(ids), "new": a.new, "interval": a.interval, "target": a.target, "device": a.device,
                "model": model_name}
    results = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            old = json.load(f)
        if old.get("settings") == settings:
            results = old["results"]
    for name, press in presses(kvpress_c, a.interval, a.target).items():
        if name in results:
            continue
        results[name] = run(model, press, ids, a.new)
        save(a.out, settings, results, a)
        print(f"{name}: peak {results[name]['peak_kv_bytes'] / 2**20:.2f} MiB, "
              f"end {results[name]['kv_bytes_at_end'] / 2**20:.2f} MiB, rows/head {results[name]['rows_per_head_at_end']}, "
              f"{results[name]['decode_ms_per_token']:.1f} ms/token", flush=True)
    print(f"wrote {a.out}")


def save(out: str, settings: dict, results: dict, a) -> None:
    base = results.get("none")
    for r in results.values():
        if base:
            r["peak_vs_none"] = r["peak_kv_bytes"] / base["peak_kv_bytes"]
    doc = {"settings": settings, "machine": platform.processor() or platform.machine(),
           "note": "decode_ms_per_token was taken on a machine shared with other jobs: compare peaks, not times",
           "command": "python benchmarks/decoding_memory.py " + " ".join(sys.argv[1:]), "results": results}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
