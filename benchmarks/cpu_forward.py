"""CPU forward speed of kvpress_c against llama.cpp (llama-cpp-python, same GGUF file) and Hugging Face
transformers (torch CPU, the same GGUF dequantised to fp32), side by side in one run.

    python benchmarks/cpu_forward.py [--model PATH] [--lengths 512 2048 8192] [--decode 32] [--out FILE]
                                     [--engines kvpress_c kvpress_c-fp32 llama.cpp transformers] [--llama8b]

Prefill: tokens/s of one batched prefill of n random tokens (logits of the last token only; best of
`--repeat`). Decode: tokens/s of greedy single-token steps after a 512-token prompt (median and best of
`--repeat` runs of `--decode` steps). Threads: every engine uses all cores. kvpress_c runs with native
weights (the file's types), kvpress_c-fp32 with weights converted to fp32 (the reference mode).
Memory: resident memory after loading, measured in a fresh process (tests/support/run_probe.py),
against the issue's target (<= 1.3x the file plus the KV cache of a 512-token prompt).
--llama8b: a Llama-3.1-8B-shaped Q4_0 GGUF (random weights, 4.5 GB, written to --llama8b-dir and
deleted after) through kvpress_c and llama.cpp in fresh processes: peak resident memory, prefill and
decode tok/s. --moe8b: the same for a mixture-of-experts model, a Qwen3-30B-A3B scaled down to ~8.3B parameters
(tests/support/moe_models.py QWEN3_MOE_8B: hidden 2048, 24 layers of 64 experts of 768, top 8, 32 query / 4 KV
heads of 128; ~1.7B active per token), random Q4_K weights (4.7 GB; router and norms F32), arch 'qwen3moe'.
Writes a JSON file and prints tables with ratios (kvpress_c / peer).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

# run from a checkout without installing: the package is one folder up; the probes and writers in tests/support
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests", "support")]


def best_of(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def decode_rate(prepare, step, n_decode, repeat):
    """(median, best) tok/s of `repeat` runs of n_decode steps, each after prepare() (untimed: the prompt)."""
    rates = []
    for _ in range(repeat):
        prepare()
        t0 = time.perf_counter()
        for i in range(n_decode):
            step(i)
        rates.append(n_decode / (time.perf_counter() - t0))
    return float(np.median(rates)), max(rates)


def bench_kvpress_c(path, lengths, n_decode, repeat, vocab_ids, weights="native"):
    import kvpress_c
    model = kvpress_c.load_model(path, weights=weights)
    out = {"engine": "kvpress_c" if weights == "native" else "kvpress_c-fp32", "gemm": kvpress_c._core.blas_name(),
           "threads": kvpress_c._core.get_num_threads(), "weight_bytes": model.config["weight_bytes"]}
    for n in lengths:
        ids = vocab_ids[:n]

        def run():
            s = model.new_session(n)
            s.forward(ids, logits="last")
        out[f"prefill_{n}"] = n / best_of(run, repeat)
    s = model.new_session(512 + n_decode)

    def prepare():
        s.reset()
        s.forward(vocab_ids[:512], logits="last")
    out["decode"], out["decode_best"] = decode_rate(prepare, lambda i: s.forward(vocab_ids[512 + i:513 + i], logits="last"),
                                                    n_decode, repeat)
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

    def prepare():
        llm.reset()
        llm.eval([int(t) for t in vocab_ids[:512]])
    out["decode"], out["decode_best"] = decode_rate(prepare, lambda i: llm.eval([int(vocab_ids[512 + i])]), n_decode, repeat)
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
    ap.add_argument("--engines", nargs="+", default=["kvpress_c", "kvpress_c-fp32", "llama.cpp", "transformers"])
    ap.add_argument("--llama8b", action="store_true", help="also the 8B-shaped Q4_0 model (writes 4.5 GB)")
    ap.add_argument("--llama8b-dir", default=None, help="where to write it (default: the temp folder)")
    ap.add_argument("--llama8b-prefill", type=int, default=256)
    ap.add_argument("--moe8b", action="store_true", help="also the 8B-shaped Qwen3-MoE Q4_K model (writes 4.7 GB)")
    ap.add_argument("--moe8b-dir", default=None, help="where to write it (default: the temp folder)")
    ap.add_argument("--moe8b-prefill", type=int, default=256)
    ap.add_argument("--moe8b-decode", type=int, default=16)
    ap.add_argument("--moe8b-threads", type=int, default=None, help="threads of each engine (default: all cores)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_forward.json"))
    args = ap.parse_args(argv)
    import kvpress_c
    path = args.model or kvpress_c.default_model_path()
    vocab = kvpress_c.load_model(path).config["vocab"]
    ids = np.random.default_rng(0).integers(100, vocab - 100, size=max(args.lengths) + 512 + args.decode).astype(np.int32)
    runners = {"kvpress_c": bench_kvpress_c, "llama.cpp": bench_llama_cpp, "transformers": bench_hf,
               "kvpress_c-fp32": lambda *a: bench_kvpress_c(*a, weights="fp32")}
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
    print("(ratio = kvpress_c / that engine; decode: median of the runs)")
    memory = memory_table(path, args.engines)
    llama8b = run_llama8b(args) if args.llama8b else None
    moe8b = run_moe8b(args) if args.moe8b else None
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": path, "cores": os.cpu_count(), "load_average": os.getloadavg(), "results": results,
                   "memory": memory, "llama8b": llama8b, "moe8b": moe8b}, f, indent=2)
    print(f"wrote {args.out}")


def memory_table(path, engines):
    """Resident memory after loading (fresh processes) against the target: <= 1.3x the file plus the KV cache."""
    from run_probe import measure
    size = os.path.getsize(path)
    rows = [measure(e, path, 512, 0) for e in ("kvpress_c", "llama.cpp") if e in engines]
    print(f"\nmemory (file {size / 1e6:.1f} MB; fresh process, beyond what the process held before loading):")
    print(f"{'engine':<12}{'after load MB':>16}{'(anon':>8}{'file)':>8}{'peak MB':>10}{'KV cache 512 MB':>18}{'target MB':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:<12}  {r['error']}")
            continue
        cache = r.get("cache_bytes", 0)
        r["target_bytes"] = 1.3 * size + cache
        print(f"{r['engine']:<12}{r['rss_after_load'] / 1e6:>16.1f}{r['rss_anon_after_load'] / 1e6:>8.1f}"
              f"{r['rss_file_after_load'] / 1e6:>8.1f}{r['rss_peak'] / 1e6:>10.1f}{cache / 1e6:>18.1f}"
              f"{r['target_bytes'] / 1e6 if r['engine'] == 'kvpress_c' else float('nan'):>12.1f}")
    return rows


def run_llama8b(args):
    """The 8B-shaped Q4_0 model through kvpress_c and llama.cpp (fresh processes); the file is deleted after."""
    import tempfile
    from random_llama import write_llama31_gguf
    from run_probe import measure
    path = os.path.join(args.llama8b_dir or tempfile.gettempdir(), "kvc_llama31_8b_q4_0.gguf")
    print(f"\nwriting {path} ...", file=sys.stderr, flush=True)
    write_llama31_gguf(path, "Q4_0")
    try:
        rows = [measure(e, path, args.llama8b_prefill, 8) for e in ("kvpress_c", "llama.cpp")]
    finally:
        os.remove(path)
    print(f"\nLlama-3.1-8B-shaped Q4_0 ({4.52:.2f} GB file), prefill {args.llama8b_prefill} tokens, 8 decode steps:")
    print(f"{'engine':<12}{'load s':>8}{'after load GB':>15}{'peak GB':>9}{'prefill tok/s':>15}{'decode tok/s':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:<12}  {r['error']}")
            continue
        print(f"{r['engine']:<12}{r['load_s']:>8.1f}{r['rss_after_load'] / 1e9:>15.2f}{r['rss_peak'] / 1e9:>9.2f}"
              f"{r['prefill_tok_s']:>15.2f}{r['decode_tok_s_median']:>14.2f}")
    return rows


def run_moe8b(args):
    """The 8B-shaped Qwen3-MoE (Q4_K) through kvpress_c and llama.cpp (fresh processes); the file is deleted after."""
    import tempfile
    from moe_models import QWEN3_MOE_8B, moe_param_count, write_random_moe_gguf
    from run_probe import measure
    path = os.path.join(args.moe8b_dir or tempfile.gettempdir(), "kvc_qwen3moe_8b_q4_k.gguf")
    print(f"\nwriting {path} ...", file=sys.stderr, flush=True)
    write_random_moe_gguf(path, QWEN3_MOE_8B)
    size = os.path.getsize(path)
    try:
        # llama.cpp (0.3.36 here) crashes on MoE batches with its repacked/AMX CPU buffers on some machines: it is also
        # run without them (llama.cpp-no-repack), and a crash is reported as such
        rows = [measure(e, path, args.moe8b_prefill, args.moe8b_decode, args.moe8b_threads)
                for e in ("kvpress_c", "llama.cpp", "llama.cpp-no-repack")]
    finally:
        os.remove(path)
    s = QWEN3_MOE_8B
    print(f"\nQwen3-MoE-shaped Q4_K ({moe_param_count(s) / 1e9:.2f}B parameters, {s['experts']} experts of {s['moe_ffn']}, "
          f"top {s['used']}, {s['layers']} layers, hidden {s['hidden']}; {size / 1e9:.2f} GB file), prefill "
          f"{args.moe8b_prefill} tokens, {args.moe8b_decode} decode steps, {rows[0].get('threads', '?')} threads:")
    print("(tok/s: wall time; tok/cpu-s: per second of the process's CPU time, what a shared machine's load leaves alone)")
    print(f"{'engine':<20}{'load s':>8}{'after load GB':>15}{'peak GB':>9}{'prefill tok/s':>15}{'tok/cpu-s':>11}"
          f"{'decode tok/s':>14}{'tok/cpu-s':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:<20}  {r['error']}")
            continue
        print(f"{r['engine']:<20}{r['load_s']:>8.1f}{r['rss_after_load'] / 1e9:>15.2f}{r['rss_peak'] / 1e9:>9.2f}"
              f"{r['prefill_tok_s']:>15.2f}{r['prefill_tok_per_cpu_s']:>11.2f}{r['decode_tok_s_median']:>14.2f}"
              f"{r['decode_tok_per_cpu_s_median']:>11.2f}")
    ours = rows[0]
    for theirs in rows[1:]:
        if "error" not in ours and "error" not in theirs:
            ratio = {k: ours[k] / theirs[k] for k in ("prefill_tok_s", "prefill_tok_per_cpu_s", "decode_tok_s_median",
                                                    "decode_tok_per_cpu_s_median", "rss_peak")}
            print(f"kvpress_c / {theirs['engine']}: prefill {ratio['prefill_tok_s']:.2f}x (per CPU second "
                  f"{ratio['prefill_tok_per_cpu_s']:.2f}x), decode {ratio['decode_tok_s_median']:.2f}x (per CPU second "
                  f"{ratio['decode_tok_per_cpu_s_median']:.2f}x), peak memory {ratio['rss_peak']:.2f}x")
    return {"shape": s, "parameters": moe_param_count(s), "file_bytes": size, "rows": rows}


if __name__ == "__main__":
    main()
