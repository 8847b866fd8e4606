"""Prefill time with and without each press, kvpress_c against kvpress on Hugging Face transformers
(torch CPU), same model and prompt, one run.

    python benchmarks/press_overhead.py [--lengths 2048 8192] [--ratio 0.5] [--presses NAME ...] [--out FILE]

For every press: prefill seconds (compression included) and the overhead over the full-cache prefill
of the same engine; kvpress masks (AdaKV) or gathers on top of a full prefill, kvpress_c evicts in C.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The Python presses' NumPy matmuls run on OpenBLAS's own pool: give it the engines' thread count (a second pool
# of threads on the same cores made the Python SnapKV 5x slower on the 2-core machine, measured)
if "--threads" in sys.argv[:-1] and sys.argv[sys.argv.index("--threads") + 1] != "0":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", sys.argv[sys.argv.index("--threads") + 1])

import numpy as np  # noqa: E402

# run from a checkout without installing: the package is one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def presses_ours(ratio):
    import kvpress_c as k
    return {
        "SnapKV": k.SnapKVPress(compression_ratio=ratio),
        "PyramidKV": k.PyramidKVPress(compression_ratio=ratio),
        "StreamingLLM": k.StreamingLLMPress(compression_ratio=ratio),
        "Knorm": k.KnormPress(compression_ratio=ratio),
        "TOVA": k.TOVAPress(compression_ratio=ratio),
        "ObservedAttention": k.ObservedAttentionPress(compression_ratio=ratio),
        "AdaKV(SnapKV)": k.AdaKVPress(k.SnapKVPress(compression_ratio=ratio)),
        "ChunkKV(SnapKV)": k.ChunkKVPress(k.SnapKVPress(compression_ratio=ratio), chunk_length=20),
        # issue 16: kvpress's scorers
        "KeyDiff": k.KeyDiffPress(compression_ratio=ratio),
        "LagKV": k.LagKVPress(compression_ratio=ratio),
        "ExpectedAttention": k.ExpectedAttentionPress(compression_ratio=ratio),
        "AdaKV(ExpectedAttention)": k.AdaKVPress(k.ExpectedAttentionPress(compression_ratio=ratio)),
        "CriticalKV(ExpectedAttention)": k.CriticalKVPress(k.ExpectedAttentionPress(compression_ratio=ratio, use_vnorm=False)),
        "CriticalAdaKV(ExpectedAttention)": k.CriticalAdaKVPress(
            k.ExpectedAttentionPress(compression_ratio=ratio, use_vnorm=False)),
        "NonCausalAttn": k.NonCausalAttnPress(compression_ratio=ratio),
        "LeverageScore": k.LeverageScorePress(compression_ratio=ratio),
        "CUR": k.CURPress(compression_ratio=ratio),
        "Compactor": k.CompactorPress(compression_ratio=ratio),
        # its own prefill: the full one, then the reconstruction forwards (kvpress: 2-3x the prefill)
        "KVzip": k.KVzipPress(compression_ratio=ratio),
        # KVzip's reconstruction with a backward per chunk (host fp32; kvpress: 3-4x the prefill)
        "KVgrad": k.KVgradPress(compression_ratio=ratio),
        # issue 16p (DMS: a fixed threshold on Knorm's -||k||, no ratio; KVCompose: its own replay forward)
        "Merging(SnapKV)": k.MergingPress(k.SnapKVPress(compression_ratio=ratio)),
        "Cap": k.CapPress(compression_ratio=ratio),
        "DMS(Knorm)": k.DMSPress(k.KnormPress(), threshold=-9.0),
        "KVCompose": k.KVComposePress(compression_ratio=ratio),
        # issue 16w (FinchPress needs the question or a delimiter in the prompt: not timed here)
        "Chunk(KeyDiff)": k.ChunkPress(k.KeyDiffPress(compression_ratio=ratio)),
        "SimLayerKV": k.SimLayerKVPress(lazy_threshold=0.5),
        "EntropyGatedChunkKV(SnapKV)": k.EntropyGatedChunkKVPress(k.SnapKVPress(compression_ratio=ratio)),
        # issue 26: the same scorers written in Python (tests/press/python_presses.py, NumPy), run by the engine
        **python_presses(ratio),
    }


def python_presses(ratio):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "press"))
    from python_presses import PyKnorm, PySnapKV
    return {"Python Knorm": PyKnorm(compression_ratio=ratio), "Python SnapKV": PySnapKV(compression_ratio=ratio, window_size=64)}


def hub_files(folder, model, seed=0):
    """Random files in the hub formats the presses read (kvpress_c from the paths, kvpress handed the same data):
    query statistics, a LU-KV budget curve, Fast KVzip gates, a RestoreKV adapter; the default model's shapes."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support"))
    from hub_files import random_curve, random_gates, random_stats, write_gates, write_stats
    from restorekv_files import write_restorekv
    c, rng = model.config, np.random.default_rng(seed)
    L, H, Hkv, d, D = c["n_layers"], c["n_heads"], c["n_kv_heads"], c["head_dim"], c["hidden"]
    mu, cov = random_stats(rng, L, H, d)
    files = {"stats": write_stats(os.path.join(folder, "stats"), mu, cov), "curve": os.path.join(folder, "curve.npy"),
             "gates_data": random_gates(rng, L, Hkv, D, H // Hkv), "restore": os.path.join(folder, "restorekv")}
    np.save(files["curve"], random_curve(rng, L, Hkv))
    files["gates"] = write_gates(os.path.join(folder, "gates.npz"), files["gates_data"])
    write_restorekv(files["restore"], c, rng)
    return files


HUB_PRESSES = ("ExpectedAttentionStats", "LUKV", "FastKVzip", "RestoreKV")


def hub_presses_ours(ratio, files):
    import kvpress_c as k
    return {"ExpectedAttentionStats": k.ExpectedAttentionStatsPress(compression_ratio=ratio, stats_folder=files["stats"]),
            "LUKV": k.LUKVPress(compression_ratio=ratio, curve_path=files["curve"]),
            "FastKVzip": k.FastKVzipPress(compression_ratio=ratio, gates_path=files["gates"]),
            "RestoreKV": k.RestoreKVPress(compression_ratio=ratio, adapter_path=files["restore"])}


def hub_presses_kvpress(ratio, files, hf):
    """kvpress's presses holding the same data (they would download it); RestoreKV's adapter loaded onto `hf`."""
    import kvpress as kp
    from hub_files import kvpress_gates
    from kvpress_c.presses._tensor_files import read_tensors
    out = {"ExpectedAttentionStats": kp.ExpectedAttentionStatsPress(compression_ratio=ratio, stats_folder=files["stats"]),
           "LUKV": kp.LUKVPress(compression_ratio=ratio), "FastKVzip": kp.FastKVzipPress(compression_ratio=ratio),
           "RestoreKV": kp.RestoreKVPress(compression_ratio=ratio)}
    out["LUKV"]._budget_curves = np.load(files["curve"])
    out["FastKVzip"].gates = kvpress_gates(files["gates_data"])
    r = out["RestoreKV"]
    import torch
    r.restore_model_name = f"higokri/RestoreKV-{hf.config.name_or_path.split('/')[-1]}"
    r.restore_embeddings = torch.tensor(read_tensors(os.path.join(files["restore"], "restore_embeddings.safetensors"))[
        "restore_embeddings"])
    hf.load_adapter(files["restore"], adapter_name=r.adapter_name)
    hf.disable_adapters()
    return out


def presses_kvpress(ratio):
    import kvpress as kp
    return {
        "SnapKV": kp.SnapKVPress(compression_ratio=ratio),
        "PyramidKV": kp.PyramidKVPress(compression_ratio=ratio),
        "StreamingLLM": kp.StreamingLLMPress(compression_ratio=ratio),
        "Knorm": kp.KnormPress(compression_ratio=ratio),
        "TOVA": kp.TOVAPress(compression_ratio=ratio),
        "ObservedAttention": kp.ObservedAttentionPress(compression_ratio=ratio),
        "AdaKV(SnapKV)": kp.AdaKVPress(kp.SnapKVPress(compression_ratio=ratio)),
        "ChunkKV(SnapKV)": kp.ChunkKVPress(kp.SnapKVPress(compression_ratio=ratio), chunk_length=20),
        # issue 16: kvpress's scorers
        "KeyDiff": kp.KeyDiffPress(compression_ratio=ratio),
        "LagKV": kp.LagKVPress(compression_ratio=ratio),
        "ExpectedAttention": kp.ExpectedAttentionPress(compression_ratio=ratio),
        "AdaKV(ExpectedAttention)": kp.AdaKVPress(kp.ExpectedAttentionPress(compression_ratio=ratio)),
        "CriticalKV(ExpectedAttention)": kp.CriticalKVPress(kp.ExpectedAttentionPress(compression_ratio=ratio,
                                                                                       use_vnorm=False)),
        "CriticalAdaKV(ExpectedAttention)": kp.CriticalAdaKVPress(
            kp.ExpectedAttentionPress(compression_ratio=ratio, use_vnorm=False)),
        "NonCausalAttn": kp.NonCausalAttnPress(compression_ratio=ratio),
        "LeverageScore": kp.LeverageScorePress(compression_ratio=ratio),
        "CUR": kp.CURPress(compression_ratio=ratio),
        "Compactor": kp.CompactorPress(compression_ratio=ratio),
        "KVzip": kp.KVzipPress(compression_ratio=ratio),
        "KVgrad": kp.KVgradPress(compression_ratio=ratio),
        "Merging(SnapKV)": kp.MergingPress(kp.SnapKVPress(compression_ratio=ratio)),
        "Cap": kp.CapPress(compression_ratio=ratio),
        "DMS(Knorm)": kp.DMSPress(kp.KnormPress(), threshold=-9.0),
        "KVCompose": kp.KVComposePress(compression_ratio=ratio),
        "Chunk(KeyDiff)": kp.ChunkPress(kp.KeyDiffPress(compression_ratio=ratio)),
        "SimLayerKV": kp.SimLayerKVPress(lazy_threshold=0.5),
        "EntropyGatedChunkKV(SnapKV)": kp.EntropyGatedChunkKVPress(kp.SnapKVPress(compression_ratio=ratio)),
        "Python Knorm": kp.KnormPress(compression_ratio=ratio),  # kvpress's own, for the row of our Python one
        "Python SnapKV": kp.SnapKVPress(compression_ratio=ratio),
    }


def time_ours(model, ids, press, repeat):
    """Best prefill seconds, cache bytes after it, and the seconds of that prefill spent in the press."""
    best, in_press = float("inf"), 0.0
    for _ in range(repeat):
        s = model.new_session(0)
        own = press is not None and not press.attach_to_session  # a press with its own prefill (KVzip, KVgrad)
        if press is not None and not own:
            s.set_press(**press.c_config())
            press.before_prefill(s, len(ids), model.config)  # files the press sets on its session (statistics, gates)
        t0 = time.perf_counter()
        if own:
            press.prefill(s, ids, {})
        else:
            s.forward(ids, logits="last")
        t = time.perf_counter() - t0
        if t < best:
            best, in_press = t, s.press_seconds
    return best, s.cache_bytes, in_press


def time_kvpress(hf, ids, press, repeat, eager, tokenizer=None):
    import contextlib
    from types import SimpleNamespace
    from unittest import mock

    import torch
    from transformers import DynamicCache
    # kvpress's KVzipPress reads AutoTokenizer.from_pretrained(name_or_path), which a GGUF folder lacks: it is
    # handed the model's tokenizer (its compression runs when its context manager exits, inside the timing)
    patch = contextlib.nullcontext()
    if tokenizer is not None:
        from kvpress.presses import kvzip_press
        patch = mock.patch.object(kvzip_press, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda *a, **k: tokenizer))
    best = float("inf")
    for _ in range(repeat):
        cache = DynamicCache()
        t0 = time.perf_counter()
        with torch.no_grad():
            if press is None:
                hf(ids, past_key_values=cache, logits_to_keep=1)
            else:
                with patch, press(hf):
                    hf(ids, past_key_values=cache, logits_to_keep=1)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--skip-kvpress", action="store_true")
    ap.add_argument("--presses", nargs="+", default=None, help="only these presses (names as printed)")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads for both engines (0: every core); 1 on a machine shared with other jobs")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "press_overhead.json"))
    args = ap.parse_args(argv)
    import kvpress_c
    threads = args.threads if args.threads > 0 else os.cpu_count()
    kvpress_c.set_num_threads(threads)
    path = args.model or kvpress_c.default_model_path()
    model = kvpress_c.load_model(path)
    vocab = model.config["vocab"]
    ours_p = presses_ours(args.ratio)
    import tempfile
    tmp = tempfile.TemporaryDirectory()
    files = hub_files(tmp.name, model)
    ours_p.update(hub_presses_ours(args.ratio, files))
    if args.presses:
        unknown = set(args.presses) - set(ours_p)
        if unknown:
            ap.error(f"unknown presses {sorted(unknown)}; choose from {sorted(ours_p)}")
        ours_p = {k: v for k, v in ours_p.items() if k in args.presses}
    hf_sdpa = hf_eager = None
    if not args.skip_kvpress:
        import torch
        import transformers
        torch.set_num_threads(threads)
        load = lambda impl: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, attn_implementation=impl).eval()
        hf_sdpa, hf_eager = load("sdpa"), load("eager")
        theirs_p = presses_kvpress(args.ratio)
        if any(name in ours_p for name in HUB_PRESSES):
            theirs_p.update(hub_presses_kvpress(args.ratio, files, hf_sdpa))
    rows = []
    for n in args.lengths:
        ids = np.random.default_rng(n).integers(100, vocab - 100, size=n).astype(np.int32)
        base, full_bytes, _ = time_ours(model, ids, None, args.repeat)
        kv_base = None
        if hf_sdpa is not None:
            import torch
            tids = torch.tensor([ids.tolist()])
            kv_base = time_kvpress(hf_sdpa, tids, None, args.repeat, False)
        rows.append({"n": n, "press": "none (full cache)", "ours_s": base, "ours_cache_bytes": full_bytes,
                     "kvpress_s": kv_base})
        print(f"n={n}: full prefill ours {base:.2f} s" + (f", HF {kv_base:.2f} s" if kv_base else ""), file=sys.stderr)
        for name, press in ours_p.items():
            t, nbytes, in_press = time_ours(model, ids, press, args.repeat)
            row = {"n": n, "press": name, "ours_s": t, "ours_overhead": t / base - 1, "ours_cache_bytes": nbytes,
                   "ours_press_s": in_press}
            if hf_sdpa is not None:
                eager = name == "ObservedAttention"
                hf = hf_eager if eager else hf_sdpa
                hf_base = time_kvpress(hf, tids, None, args.repeat, eager) if eager else kv_base
                tok = None
                if name in ("KVzip", "KVgrad", "RestoreKV"):
                    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
                tk = time_kvpress(hf, tids, theirs_p[name], args.repeat, eager, tok)
                row.update(kvpress_s=tk, kvpress_overhead=tk / hf_base - 1, speedup=tk / t)
            rows.append(row)
            print(f"  {name}: ours {t:.2f} s" + (f", kvpress {row['kvpress_s']:.2f} s" if "kvpress_s" in row else ""),
                  file=sys.stderr)
    print(f"\n{'n':>6} {'press':<32} {'ours s':>8} {'overhead':>9} {'in press':>9} {'kvpress s':>10} {'overhead':>9} "
          f"{'speedup':>8}")
    for r in rows:
        f = lambda k, fmt: (fmt.format(r[k]) if r.get(k) is not None else "-")  # noqa: E731
        print(f"{r['n']:>6} {r['press']:<32} {f('ours_s', '{:.2f}'):>8} {f('ours_overhead', '{:+.1%}'):>9} "
              f"{f('ours_press_s', '{:.2f}'):>9} "
              f"{f('kvpress_s', '{:.2f}'):>10} {f('kvpress_overhead', '{:+.1%}'):>9} {f('speedup', '{:.1f}x'):>8}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"model": path, "ratio": args.ratio, "threads": threads, "rows": rows}, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
