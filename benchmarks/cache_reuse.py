"""Reuse measured (issue 29): each context compressed once without its question, saved, and every question
answered from the file, against compressing per question with the question in view; scores and seconds per
question, on the embedded default model. Writes a markdown table and the rows as JSON.

    python benchmarks/cache_reuse.py --length 2000 --contexts 3 --needles 4 --ratio 0.75 \
        --out docs/results/cache_reuse
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRESSES = ("snapkv", "ada_snapkv", "kvzip", "expected_attention", "chunkkv", "take", "full")


def make(name: str, ratio: float, length: int):
    import kvpress_c as K
    snap = lambda: K.SnapKVPress(compression_ratio=ratio)
    return {"snapkv": snap, "ada_snapkv": lambda: K.AdaKVPress(snap()),
            "kvzip": lambda: K.KVzipPress(compression_ratio=ratio),
            "expected_attention": lambda: K.ExpectedAttentionPress(compression_ratio=ratio),
            "chunkkv": lambda: K.ChunkKVPress(snap(), chunk_length=10),
            # TAKE keeps a token budget: the same share of the context
            "take": lambda: K.TAKEPress(budget=int(round((1 - ratio) * length))),
            "full": lambda: None}[name]()  # the uncompressed cache: the model's own score


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=2000, help="prompt tokens of a context")
    ap.add_argument("--contexts", type=int, default=3, help="contexts per task")
    ap.add_argument("--needles", type=int, default=4, help="needles (and questions) per context")
    ap.add_argument("--ratio", type=float, default=0.75, help="compression ratio (fraction of the context removed)")
    ap.add_argument("--kinds", nargs="+", default=None)
    ap.add_argument("--presses", nargs="+", default=list(PRESSES[:-1]), choices=PRESSES)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="folder for table.md and rows.json")
    args = ap.parse_args(argv)
    import kvpress_c
    from kvpress_c.eval import reuse
    if args.threads:
        kvpress_c.set_num_threads(args.threads)
    model = kvpress_c.load_model()
    pipe = kvpress_c.Pipeline(model)
    contexts = [g for kind in (args.kinds or reuse.KINDS)
                for g in reuse.groups(pipe, kind, args.length, args.contexts, args.needles)]
    presses = {name: make(name, args.ratio, args.length) for name in args.presses}
    t0 = time.perf_counter()
    rows = reuse.run(model, contexts, presses)
    table = reuse.table(rows)
    took = time.perf_counter() - t0
    print(table)
    print(f"{len(contexts)} contexts x {len(presses)} presses in {took / 60:.1f} min")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "rows.json"), "w") as f:
            json.dump({"args": vars(args), "seconds": took, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
