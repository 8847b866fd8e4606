"""CPU forward speed of kvpress_c against llama.cpp (llama-cpp-python, same GGUF file) and Hugging Face
transformers (torch CPU, the same GGUF dequantised to fp32), side by side in one run.

    python benchmarks/cpu_forward.py [--model PATH] [--lengths 512 2048 8192] [--decode 32] [--out FILE]

Prefill: tokens/s of one batched prefill of n random tokens (logits of the last token only; best of
`--repeat`). Decode: tokens/s of greedy single-token steps after a 512-token prompt. Threads: every
engine uses all cores. Writes a JSON file and prints a table with ratios (kvpress_c / peer).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

# run from a checkout without installing: the package is one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def best_of(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_kvpress_c(path, lengths, n_decode, repeat, vocab_ids):
    import kvpress_c
    model = kvpress_c.load_model(path)
    out = {"engine": "kvpress_c", "gemm": kvpress_c._core.blas_name(), "threads": kvpress_c._core.get_num_threads()}
    for n in lengths:
        ids = vocab_ids[:n]

        def run():
            s = model.new_session(n)
            s.forward(ids, logits="last")
        out[f"prefill_{n}"] = n / best_of(run, repeat)
    s = model.new_session(512 + n_decode)
    s.forward(vocab_ids[:512], logits="last")
    t0 = time.perf_counter()
    for i in range(n_decode):
        s.forward(vocab_ids[512 + i:513 + i], logits="last")
    out["decode"] = n_decode / (time.perf_counter() - t0)
    return out


def bench_llama_cpp(path, lengths, n_decode, repeat, vocab_ids):
    try:
        from llama_cpp import Llama
    except ImportError:
        return {"engine": "llama.cpp", "error": "llama-cpp-python is not installed (pip install llama-cpp-python)"}
    threads = os.cpu_count()
    out = {"engine": "llama.cpp", "threads": threads}
    for n in lengths:
        llm = Llama(model_path=path, n_ctx=max(n + 16, 1024), n_batch=min(n, 2048), n_ubatch=min(n, 512),
                    n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
        ids = [int(t) for t in vocab_ids[:n]]

        def run():
            llm.reset()
            llm.eval(ids)
        out[f"prefill_{n}"] = n / best_of(run, repeat)
        del llm
    llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.reset()
    llm.eval([int(t) for t in vocab_ids[:512]])
    t0 = time.perf_counter()
    for i in range(n_decode):
        llm.eval([int(vocab_ids[512 + i])])
    out["decode"] = n_decode / (time.perf_counter() - t0)
    return out


def bench_hf(path, lengths, n_decode, repeat, vocab_ids):
    try:
        import torch
        import transformers
    except ImportError:
        return {"engine": "transformers", "error": "torch/transformers are not installed"}
    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    out = {"engine": f"transformers {transformers.__version__} (torch {torch.__version__}, fp32, sdpa)",
           "threads": torch.get_num_threads()}
    with torch.no_grad():
        for n in lengths:
            ids = torch.tensor([vocab_ids[:n].tolist()])

            def run():
                model(ids, logits_to_keep=1)
            out[f"prefill_{n}"] = n / best_of(run, repeat)
        cache = transformers.DynamicCache()
        res = model(torch.tensor([vocab_ids[:512].tolist()]), past_key_values=cache, logits_to_keep=1)
        t0 = time.perf_counter()
        for i in range(n_decode):
            res = model(torch.tensor([[int(vocab_ids[512 + i])]]), past_key_values=res.past_key_values, logits_to_keep=1)
        out["decode"] = n_decode / (time.perf_counter() - t0)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--engines", nargs="+", default=["kvpress_c", "llama.cpp", "transformers"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_forward.json"))
    args = ap.parse_args(argv)
    import kvpress_c
    path = args.model or kvpress_c.default_model_path()
    vocab = kvpress_c.load_model(path).config["vocab"]
    ids = np.random.default_rng(0).integers(100, vocab - 100, size=max(args.lengths) + 512 + args.decode).astype(np.int32)
    runners = {"kvpress_c": bench_kvpress_c, "llama.cpp": bench_llama_cpp, "transformers": bench_hf}
    results = []
    for name in args.engines:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results.append(runners[name](path, args.lengths, args.decode, args.repeat, ids))
    cols = [f"prefill_{n}" for n in args.lengths] + ["decode"]
    ours = results[0]
    print(f"\nmodel: {os.path.basename(path)}; machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"{'engine':<28}" + "".join(f"{c + ' tok/s':>20}" for c in cols))
    for r in results:
        if "error" in r:
            print(f"{r['engine']:<28}  {r['error']}")
            continue
        cells = []
        for c in cols:
            ratio = "" if r is ours or ours.get(c) is None else f" ({ours[c] / r[c]:.2f}x)"
            cells.append(f"{r[c]:>12.1f}{ratio:>8}")
        print(f"{r['engine'][:28]:<28}" + "".join(f"{x:>20}" for x in cells))
    print("(ratio = kvpress_c / that engine)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": path, "cores": os.cpu_count(), "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
