"""Seconds inside the press (the session's press clock: scoring, selection, eviction) of a prefill of the
default model, for one checkout of kvpress_c: run it for two checkouts in turn to compare them (the press's
cost without the forward's noise).

    python benchmarks/ab_in_press.py CHECKOUT [--length 2048] [--repeat 5]
"""
import argparse
import statistics
import sys

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkout")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, args.checkout)
    import kvpress_c as k
    k.set_num_threads(1)
    m = k.load_model()
    ids = np.random.default_rng(args.length).integers(100, m.config["vocab"] - 100, size=args.length).astype(np.int32)
    out = []
    for name, p in [("Knorm", k.KnormPress(compression_ratio=0.5)), ("TOVA", k.TOVAPress(compression_ratio=0.5)),
                    ("KeyDiff", k.KeyDiffPress(compression_ratio=0.5)), ("SnapKV", k.SnapKVPress(compression_ratio=0.5))]:
        t = []
        for _ in range(args.repeat):
            s = m.new_session(args.length)
            s.set_press(**p.c_config())
            s.forward(ids, logits="last")
            t.append(s.press_seconds)
        out.append(f"{name} {min(t) * 1e3:.1f} {statistics.median(t) * 1e3:.1f}")
    print(" | ".join(out))


if __name__ == "__main__":
    main()
