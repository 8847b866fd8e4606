"""TAKE's peak KV-cache memory against a full prefill, at 2k, 8k, 32k and 128k tokens.

    python benchmarks/take_memory.py [--lengths 2048 8192 32768 131072] [--budget 512] [--chunk 4096]

The model has the embedded default model's shapes (SmolLM2-135M: 30 layers, 3 KV heads of 64) with
random fp16 weights (memory does not depend on weight values), written once as a Hugging Face folder.
For TAKE the peak is measured (the cache allocator's high-water mark, transient copies included);
full prefill is measured up to --full-max tokens and computed from the cache layout beyond (its cache
holds every token: n x layers x KV heads x (K + V + position) bytes). Writes JSON and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

# run from a checkout without installing: the package is one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = dict(layers=30, hidden=576, heads=9, kv_heads=3, ffn=1536, vocab=49152)


def write_random_model(path: str, seed: int = 0) -> str:
    from safetensors.numpy import save_file
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    s, rng = SHAPES, np.random.default_rng(seed)
    D, F, hd = s["hidden"], s["ffn"], s["hidden"] // s["heads"]
    t = {"model.embed_tokens.weight": (s["vocab"], D), "model.norm.weight": (D,)}
    for l in range(s["layers"]):
        p = f"model.layers.{l}."
        t.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                  p + "self_attn.q_proj.weight": (s["heads"] * hd, D), p + "self_attn.k_proj.weight": (s["kv_heads"] * hd, D),
                  p + "self_attn.v_proj.weight": (s["kv_heads"] * hd, D), p + "self_attn.o_proj.weight": (D, s["heads"] * hd),
                  p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D), p + "mlp.down_proj.weight": (D, F)})
    tensors = {k: (np.ones(v, np.float16) if len(v) == 1 else (rng.standard_normal(v) * 0.05).astype(np.float16))
               for k, v in t.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    cfg = {"model_type": "llama", "num_hidden_layers": s["layers"], "hidden_size": D, "num_attention_heads": s["heads"],
           "num_key_value_heads": s["kv_heads"], "intermediate_size": F, "vocab_size": s["vocab"],
           "max_position_embeddings": 1 << 20, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def full_cache_bytes(n: int) -> int:
    """What a full cache of n tokens holds in kvpress_c's layout (see csrc/cache/kv_cache.c)."""
    s = SHAPES
    d = s["hidden"] // s["heads"]
    return s["layers"] * s["kv_heads"] * (n * (2 * d * 4 + 8) + 3 * 64)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--full-max", type=int, default=8192, help="measure full prefill up to this length")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "kvpress_c_random_smollm2"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "take_memory.json"))
    args = ap.parse_args(argv)
    import kvpress_c
    model = kvpress_c.load_model(write_random_model(args.model_dir))
    rows = []
    for n in args.lengths:
        ids = np.random.default_rng(n).integers(100, SHAPES["vocab"] - 100, size=n).astype(np.int32)
        press = kvpress_c.TAKEPress(budget=args.budget, chunk_size=args.chunk)
        s = model.new_session()
        t0 = time.perf_counter()
        press.prefill(s, ids, model.config)
        take_s = time.perf_counter() - t0
        row = {"n": n, "take_peak_bytes": s.peak_cache_bytes, "take_final_bytes": s.cache_bytes, "take_s": take_s,
               "bound_bytes": full_cache_bytes(args.chunk + press.n_probe_default + press.default_warmup_budget(n)),
               "full_bytes_computed": full_cache_bytes(n)}
        if n <= args.full_max:
            f = model.new_session()
            t0 = time.perf_counter()
            f.forward(ids, logits="last")
            row.update(full_peak_bytes=f.peak_cache_bytes, full_s=time.perf_counter() - t0)
        rows.append(row)
        print(f"n={n}: TAKE peak {row['take_peak_bytes'] / 2**20:.1f} MiB in {take_s:.1f} s; full "
              f"{row.get('full_peak_bytes', row['full_bytes_computed']) / 2**20:.1f} MiB", file=sys.stderr, flush=True)
    print(f"\nTAKE (B={args.budget}, Z={args.chunk}, default warm-up budget) vs full prefill, KV cache bytes, "
          f"model shapes of SmolLM2-135M")
    print(f"{'tokens':>8} {'TAKE peak MiB':>14} {'TAKE final MiB':>15} {'full MiB':>10} {'ratio':>7} {'TAKE s':>8}")
    for r in rows:
        full = r.get("full_peak_bytes", r["full_bytes_computed"])
        tag = "" if "full_peak_bytes" in r else "*"
        print(f"{r['n']:>8} {r['take_peak_bytes'] / 2**20:>14.1f} {r['take_final_bytes'] / 2**20:>15.1f} "
              f"{full / 2**20:>9.1f}{tag} {full / r['take_peak_bytes']:>6.1f}x {r['take_s']:>8.1f}")
    print("* full-cache size computed from the cache layout (a full prefill at that length was not run)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    # merge with earlier runs of the same configuration (one length per run is a long job at 128k)
    if os.path.exists(args.out):
        with open(args.out) as fh:
            old = json.load(fh)
        if old.get("budget") == args.budget and old.get("chunk") == args.chunk:
            new_n = {r["n"] for r in rows}
            rows = sorted([r for r in old["rows"] if r["n"] not in new_n] + rows, key=lambda r: r["n"])
    with open(args.out, "w") as fh:
        json.dump({"budget": args.budget, "chunk": args.chunk, "rows": rows}, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
