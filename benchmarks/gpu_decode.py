"""Decode speed on the GPU with the full and with compressed caches: kvpress_c (CUDA backend) and
kvpress 0.5.x on HF transformers in the same run, Llama-3.1-8B shapes, random bf16 weights.

    python benchmarks/gpu_decode.py [--contexts 8192 32768] [--presses full snapkv adakv chunkkv]
                                    [--ratio 0.5] [--steps 64] [--systems kvpress_c hf]

ms per generated token (greedy steps after the compressed prefill, batch 1) against the bandwidth
floor: (weight bytes + bytes of the KV rows kept) / the device copy rate measured in this run. Writes
benchmarks/results/gpu_decode.json and .md. Needs a GPU: exits with the reason otherwise.
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


def run_kvpress_c(args, path, rows):
    _, info, model = G.load_kvc(path)
    for n in args.contexts:
        ids = G.random_ids(n).astype(np.int32)
        for name in args.presses:
            row = {"system": G.kvc_system_name(), "context": n, "press": name}
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
                row.update(ms_per_token=dt * 1e3, kv_rows_per_head=kept)
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
    G.add_system_args(ap)
    args, path = G.start(ap, argv)
    copy = G.copy_rate_tbs()
    meta = {"model": "Llama-3.1-8B shapes, random bf16 weights", "copy_tb_s": copy, "weight_gb": G.weight_bytes() / 1e9,
            "compression_ratio": args.ratio, "steps": args.steps}
    rows = G.run_systems(args, path, meta, run_kvpress_c, run_hf)
    for r in rows:
        if copy and r.get("ms_per_token") and r.get("kv_rows_per_head") is not None:
            floor_ms = (G.weight_bytes() + G.kv_bytes(r["kv_rows_per_head"])) / (copy * 1e12) * 1e3
            r["floor_ms"] = floor_ms
            r["x_floor"] = r["ms_per_token"] / floor_ms
    G.write_results("gpu_decode", meta, rows,
                    [("system", "system"), ("context", "context"), ("press", "press"),
                     ("ms_per_token", "ms/token"), ("peer_x", "kvpress / ours"), ("floor_ms", "floor ms"),
                     ("x_floor", "x floor"), ("kv_rows_per_head", "KV rows/head"), ("error", "note")],
                    "Decode on the GPU, Llama-3.1-8B shapes, batch 1", ratios=("ms_per_token", "context"))


if __name__ == "__main__":
    main()
