"""Decode speed on the GPU with the full and with compressed caches: kvpress_c (CUDA backend) and
kvpress 0.5.x on HF transformers in the same run, Llama-3.1-8B shapes, random bf16 weights.

    python benchmarks/gpu_decode.py [--contexts 8192 32768] [--presses full snapkv adakv chunkkv]
                                    [--ratio 0.5] [--steps 64] [--systems kvpress_c hf]
                                    [--kv-caches native f16 q8_0 kivi4 kivi2]

ms per generated token (greedy steps after the compressed prefill, batch 1) against the bandwidth
floor: (weight bytes + bytes of the KV rows kept) / the device copy rate measured in this run. Writes
benchmarks/results/gpu_decode.json and .md. Needs a GPU: exits with the reason otherwise.

--kv-caches: kvpress_c's sessions in each K/V storage type side by side (issue 27; "native" is the device's
bf16, kivi4 / kivi2 QuantizedCache with transformers' defaults: groups of 64, 128 rows of residual), each row
with the cache's bytes per token per layer and vs_native (the native row's ms / this row's: > 1 faster), the
floor from the bytes the cache holds; kvpress on HF runs its bf16 cache only. Written to gpu_decode_kv.json.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_common as G  # noqa: E402


def kv_cache_of(name: str):
    """A --kv-caches name as load_model's kv_cache value."""
    import kvpress_c
    if name.startswith("kivi"):
        return kvpress_c.QuantizedCache(nbits=int(name[4:]))
    return None if name == "native" else name


def run_kvpress_c(args, path, rows):
    _, info, model = G.load_kvc(path)
    for kv in args.kv_caches:
        model.kv_cache = kv_cache_of(kv)
        system = G.kvc_system_name() + ("" if kv == "native" else f" kv={kv}")
        for n in args.contexts:
            ids = G.random_ids(n).astype(np.int32)
            for name in args.presses:
                row = {"system": system, "context": n, "press": name, "kv_cache": kv}
                try:
                    _, s = G.kvc_prefill(model, G.kvc_press(name, args.ratio), ids)
                    tok = np.array([1234], np.int32)
                    for _ in range(4):  # warm-up
                        s.forward(tok, logits="last")
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        tok = np.array([int(np.argmax(s.forward(tok, logits="last")))], np.int32)
                    dt = (time.perf_counter() - t0) / args.steps
                    kept = float(s.cache_lengths().mean())
                    row.update(ms_per_token=dt * 1e3, kv_rows_per_head=kept, cache_bytes=int(s.cache_bytes),
                               kv_bytes_per_token_layer=s.cache_bytes / (model.config["n_layers"] * kept))
                    del s
                except G.KVC_ERRORS as e:
                    G.note_error(row, e)
                G.emit(rows, row)
    del model
    gc.collect()
    return info


def run_hf(args, path, rows):
    import torch
    hf, attn, system = G.load_hf_system(path)
    for n in args.contexts:
        ids = torch.tensor(G.random_ids(n), device="cuda")[None]
        for name in args.presses:
            row = {"system": system, "context": n, "press": name}
            press = G.hf_press(name, args.ratio)
            if G.skip_missing_hf_press(name, press, row, rows):
                continue
            try:
                _, cache = G.hf_prefill(hf, press, ids)
                pos = n
                tok = torch.tensor([[1234]], device="cuda")
                with torch.no_grad():
                    for i in range(4 + args.steps):
                        if i == 4:
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                        out = hf(tok, past_key_values=cache, use_cache=True,
                                 cache_position=torch.tensor([pos], device="cuda"))
                        tok = out.logits[:, -1:].argmax(-1)
                        pos += 1
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / args.steps
                kept = float(np.mean([layer.keys.shape[-2] for layer in cache.layers])) if hasattr(cache, "layers") else None
                row.update(ms_per_token=dt * 1e3, kv_rows_per_head=kept)
                del cache
            except Exception as e:  # version mismatches are recorded, not fatal
                G.note_error(row, e)
            torch.cuda.empty_cache()
            G.emit(rows, row)
    del hf
    G.free_cuda_memory()
    return attn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--presses", nargs="+", default=["full", "snapkv", "adakv", "chunkkv"])
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--kv-caches", nargs="+", default=["native"],
                    choices=["native", "f32", "f16", "bf16", "q8_0", "kivi4", "kivi2"])
    G.add_system_args(ap)
    args, path = G.start(ap, argv)
    copy = G.copy_rate_tbs()
    meta = {"model": "Llama-3.1-8B shapes, random bf16 weights", "copy_tb_s": copy, "weight_gb": G.weight_bytes() / 1e9,
            "compression_ratio": args.ratio, "steps": args.steps}
    rows = G.run_systems(args, path, meta, run_kvpress_c, run_hf)
    native = {(r["context"], r["press"]): r.get("ms_per_token") for r in rows if r.get("kv_cache") == "native"}
    for r in rows:
        if copy and r.get("ms_per_token") and r.get("kv_rows_per_head") is not None:
            typed_row = r.get("kv_cache") not in (None, "native")  # the bytes it holds; bf16 rows: as before
            kv = r["cache_bytes"] if typed_row else G.kv_bytes(r["kv_rows_per_head"])
            floor_ms = (G.weight_bytes() + kv) / (copy * 1e12) * 1e3
            r["floor_ms"] = floor_ms
            r["x_floor"] = r["ms_per_token"] / floor_ms
        base = native.get((r.get("context"), r.get("press"))) if r.get("kv_cache") else None
        r["vs_native"] = base / r["ms_per_token"] if base and r.get("ms_per_token") else None
    typed = args.kv_caches != ["native"]
    columns = [("system", "system"), ("context", "context"), ("press", "press"), ("ms_per_token", "ms/token"),
               ("peer_x", "kvpress / ours"), ("floor_ms", "floor ms"), ("x_floor", "x floor"),
               ("kv_rows_per_head", "KV rows/head")]
    if typed:
        columns += [("kv_bytes_per_token_layer", "KV bytes/token/layer"), ("vs_native", "native / this")]
    G.write_results("gpu_decode_kv" if typed else "gpu_decode", meta, rows, columns + [("error", "note")],
                    "Decode on the GPU, Llama-3.1-8B shapes, batch 1" + (", by K/V cache type" if typed else ""),
                    ratios=("ms_per_token", "context"))


if __name__ == "__main__":
    main()
