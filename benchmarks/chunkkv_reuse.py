"""ChunkKV: adjacent-layer Jaccard similarity of the kept indices (tokens vs chunks vs layer reuse)
and the press time that layer-wise index reuse saves, on the embedded default model.

    python benchmarks/chunkkv_reuse.py [--tokens 4096] [--budget 256] [--copies 6] [--reps 3]

Timing: a press costs ~1-2% of a prefill, below the run-to-run noise of a whole prefill on a busy
machine. So the press cost is isolated with the shared prefill: one forward feeds `copies` follower
sessions that each run the press (Session.forward_shared); (time with followers - time without) /
copies = one press's time over the whole prefill. Configurations are interleaved, medians reported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

# run from a checkout without installing: the package is one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "chunkkv_reuse.json"))
    args = ap.parse_args(argv)
    import kvpress_c
    from kvpress_c.demo import needle_prompt
    from kvpress_c.diagnostics import adjacent_layer_jaccard

    model = kvpress_c.load_model()
    context, question, _ = needle_prompt(model, n_tokens=args.tokens)
    ids = np.asarray(model.encode(context + "\n" + question), dtype=np.int32)
    snap = lambda: kvpress_c.SnapKVPress(budget=args.budget, window_size=64)
    configs = {
        "snapkv (tokens)": snap(),
        "chunkkv reuse=1": kvpress_c.ChunkKVPress(snap(), chunk_length=10, reuse_layers=1),
        "chunkkv reuse=2": kvpress_c.ChunkKVPress(snap(), chunk_length=10, reuse_layers=2),
        "chunkkv reuse=3": kvpress_c.ChunkKVPress(snap(), chunk_length=10, reuse_layers=3),
    }
    cfg = model.config
    rows = {}
    for name, press in configs.items():
        s = model.new_session()
        s.set_press(**press.c_config())
        s.forward(ids, logits="none")
        kept = [[s.cache_positions(l, h) for h in range(cfg["n_kv_heads"])] for l in range(cfg["n_layers"])]
        rows[name] = {"adjacent_layer_jaccard": float(np.mean(adjacent_layer_jaccard(kept))), "times": []}
    base_times = []
    for _ in range(args.reps):
        for name, press in [(None, None)] + list(configs.items()):
            leader = model.new_session()
            followers = []
            for _ in range(args.copies if press is not None else 0):
                f = model.new_session()
                f.set_press(**press.c_config())
                followers.append(f)
            t0 = time.perf_counter()
            leader.forward_shared(ids, followers, logits="none")
            dt = time.perf_counter() - t0
            (base_times if name is None else rows[name]["times"]).append(dt)
    base = statistics.median(base_times)
    print(f"prefill of {len(ids)} tokens without a press: {base:.3f} s (median of {args.reps})")
    print(f"{'press':<18} {'adj. Jaccard':>12} {'press ms':>9} {'% of prefill':>12} {'saved vs reuse=1':>17}")
    ref = None
    for name, r in rows.items():
        r["press_s"] = max(0.0, (statistics.median(r["times"]) - base) / args.copies)
        if name == "chunkkv reuse=1":
            ref = r["press_s"]
    for name, r in rows.items():
        saved = "" if ref is None or not name.startswith("chunkkv") else f"{100 * (1 - r['press_s'] / ref):.0f}%"
        print(f"{name:<18} {r['adjacent_layer_jaccard']:>12.3f} {1000 * r['press_s']:>9.1f} "
              f"{100 * r['press_s'] / base:>11.2f}% {saved:>17}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"tokens": int(len(ids)), "budget": args.budget, "copies": args.copies, "reps": args.reps,
                   "prefill_s": base, "base_times": base_times, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
