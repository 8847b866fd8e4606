"""Time to first token on the GPU: kvpress_c (CUDA backend) and kvpress 0.5.x on HF transformers in
the same run, on a Llama-3.1-8B-shaped model with random bf16 weights.

    python benchmarks/gpu_prefill.py [--lengths 8192 32768 131072] [--presses full snapkv adakv chunkkv take edie_tada]
                                     [--ratio 0.5] [--systems kvpress_c hf] [--model-dir DIR]

For each length and press: prefill seconds (TTFT: the forward of the prompt, compression included,
logits of the last token), peak GPU memory of the run, and the prefill as a multiple of the FLOP
floor (model FLOPs, causal attention counted once, divided by the cuBLAS bf16 GEMM rate measured in
this run through torch). The two systems run one after the other in one process (both 8B models do
not fit beside a 128k prefill); kvpress_c's model is freed before HF's is loaded. Writes
benchmarks/results/gpu_prefill.json and .md. Needs a GPU: exits with the reason otherwise.

The run also times kvpress_c's own GEMM and every prefill attention kernel of its table (WMMA, the
register-tile mma kernel and cuDNN's SDPA where cuDNN loads: None otherwise) at 32k on device buffers,
beside torch's cuBLAS GEMM and sdpa. KVC_ATTN_KERNEL=mma|cudnn (or KVC_ATTN_MMA=1) makes the model use
that kernel. kvpress 0.5.x needs transformers < 5.3: put a
5.2 install first on PYTHONPATH (pip install --no-deps --target DIR transformers==5.2.0 kvpress==0.5.5).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_common as G  # noqa: E402


def run_kvpress_c(args, path, rows):
    core, info, model = G.load_kvc(path)
    warm = np.arange(1000, 1000 + 2048, dtype=np.int32)
    why = G.use_attention_kernel(G.env_attention_kernel())
    if why:
        raise SystemExit(f"KVC_ATTN_KERNEL={G.env_attention_kernel()}: {why}")
    G.kvc_prefill(model, None, warm)  # first-call costs (cuBLAS heuristics, kernel loading)
    for n in args.lengths:
        ids = G.random_ids(n).astype(np.int32)
        for name in args.presses:
            press = G.kvc_press(name, args.ratio, args.take_budget)
            row = {"system": G.kvc_system_name(), "tokens": n, "press": name}
            try:
                times = []
                for _ in range(args.repeats if n < 65536 else 1):
                    gc.collect()
                    core.memory_stats("cuda", reset_peak=True)
                    t, s = G.kvc_prefill(model, press, ids)
                    times.append(t)
                    kept = int(s.cache_lengths().sum())
                    del s
                mem = core.memory_stats("cuda")
                row.update(ttft_s=min(times), peak_gb=mem["peak"] / 1e9, kv_tokens_kept=kept)
            except G.KVC_ERRORS as e:
                G.note_error(row, e)
            G.emit(rows, row)
    del model
    gc.collect()
    return info


def run_hf(args, path, rows):
    import torch
    hf, attn, system = G.load_hf_system(path)
    ids = torch.arange(1000, 1000 + 2048, device="cuda")[None]
    G.hf_prefill(hf, None, ids)
    for n in args.lengths:
        ids = torch.tensor(G.random_ids(n), device="cuda")[None]
        for name in args.presses:
            row = {"system": system, "tokens": n, "press": name}
            press = G.hf_press(name, args.ratio)
            if G.skip_missing_hf_press(name, press, row, rows):
                continue
            try:
                times = []
                for _ in range(args.repeats if n < 65536 else 1):
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    t, cache = G.hf_prefill(hf, press, ids)
                    times.append(t)
                    kept = int(sum(layer.keys.shape[-2] for layer in cache.layers)) * G.LLAMA8B["kv_heads"] \
                        if hasattr(cache, "layers") else None
                    del cache
                row.update(ttft_s=min(times), peak_gb=torch.cuda.max_memory_allocated() / 1e9, kv_tokens_kept=kept)
            except Exception as e:  # kvpress / transformers version mismatches end up here: recorded, not fatal
                G.note_error(row, e)
                torch.cuda.empty_cache()
            G.emit(rows, row)
    del hf
    G.free_cuda_memory()
    return attn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--presses", nargs="+", default=["full", "snapkv", "adakv", "chunkkv", "take", "edie_tada"])
    ap.add_argument("--ratio", type=float, default=0.5, help="compression ratio of the scorer presses")
    ap.add_argument("--take-budget", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2, help="runs per point below 64k tokens (the minimum is kept)")
    G.add_system_args(ap)
    args, path = G.start(ap, argv)
    gemm = G.gemm_rate_tflops()
    meta = {"model": "Llama-3.1-8B shapes, random bf16 weights", "gemm_tflops_cublas_bf16": gemm,
            "sdpa_causal_gqa_tflops_32k": G.sdpa_rate_tflops(), "kvpress_c_gemm_tflops": G.kvc_gemm_tflops(),
            **{f"kvpress_c_attention_tflops_32k_{k}": G.kvc_attention_tflops(kernel=k) for k in G.ATTENTION_KERNELS},
            "kvpress_c_attention_kernel": G.env_attention_kernel(),
            "compression_ratio": args.ratio,
            "take_budget": args.take_budget}
    rows = G.run_systems(args, path, meta, run_kvpress_c, run_hf)
    for r in rows:
        if gemm and r.get("ttft_s"):
            floor = G.prefill_flops(r["tokens"]) / (gemm * 1e12)
            r["flop_floor_s"] = floor
            r["x_floor"] = r["ttft_s"] / floor
        if r.get("peak_gb") is not None:
            r["over_weights_gb"] = r["peak_gb"] - G.weight_bytes() / 1e9
    G.write_results("gpu_prefill", meta, rows,
                    [("system", "system"), ("tokens", "tokens"), ("press", "press"), ("ttft_s", "TTFT s"),
                     ("vs_full", "/ full"), ("peer_x", "kvpress / ours"), ("x_floor", "x FLOP floor"),
                     ("peak_gb", "peak GB"), ("over_weights_gb", "peak - weights GB"),
                     ("kv_tokens_kept", "KV rows kept"), ("error", "note")],
                    "Prefill (time to first token) on the GPU, Llama-3.1-8B shapes", ratios=("ttft_s", "tokens"))


if __name__ == "__main__":
    main()
