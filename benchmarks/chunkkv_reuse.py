"""ChunkKV: adjacent-layer Jaccard similarity of the kept indices (tokens vs chunks vs layer reuse)
and the press time that layer-wise index reuse saves, on the embedded default model.

    python benchmarks/chunkkv_reuse.py [--tokens 4096] [--budget 256] [--copies 6] [--reps 3]

Timing: a press costs ~1-2% of a prefill, below the run-to-run noise of a whole prefill on a busy
machine, so a difference of prefill times cannot show it. The core times the press hook itself
(scoring, selection, compaction: Session.press_seconds); one shared forward feeds `copies` follower
sessions per configuration (Session.forward_shared), each timing its own press. Configurations are
interleaved over `reps` forwards; medians over all copies and reps are reported.
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
        leader = model.new_session()
        followers = []
        for name, press in configs.items():
            for _ in range(args.copies):
                f = model.new_session()
                f.set_press(**press.c_config())
                followers.append((name, f))
        t0 = time.perf_counter()
        leader.forward_shared(ids, [f for _, f in followers], logits="none")
        base_times.append(time.perf_counter() - t0)
        for name, f in followers:
            rows[name]["times"].append(f.press_seconds)
    base = statistics.median(base_times)
    print(f"shared prefill of {len(ids)} tokens feeding {len(configs) * args.copies} presses: {base:.3f} s "
          f"(median of {args.reps})")
    print(f"{'press':<18} {'adj. Jaccard':>12} {'press ms':>9} {'saved vs reuse=1':>17}")
    ref = None
    for name, r in rows.items():
        r["press_s"] = statistics.median(r["times"])
        if name == "chunkkv reuse=1":
            ref = r["press_s"]
    for name, r in rows.items():
        saved = "" if ref is None or not name.startswith("chunkkv") else f"{100 * (1 - r['press_s'] / ref):.0f}%"
        print(f"{name:<18} {r['adjacent_layer_jaccard']:>12.3f} {1000 * r['press_s']:>9.1f} {saved:>17}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"tokens": int(len(ids)), "budget": args.budget, "copies": args.copies, "reps": args.reps,
                   "shared_prefill_s": base, "shared_prefill_times": base_times, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
