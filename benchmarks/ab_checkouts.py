"""Two checkouts of kvpress_c side by side in one run: CPU forward speed (cpu_forward.py, kvpress_c only) and
press overhead (press_overhead.py, kvpress_c only), each checkout's own scripts on its own build, run in
turn A B A B ... so that the machine's drift falls on both; medians and new/base ratios per figure.

    python benchmarks/ab_checkouts.py --base ../kvpress_c-base --new . [--rounds 3] [--out FILE]

Both checkouts must be built (`python setup.py build_ext --inplace` in each); the Python running this
script runs both (its NumPy and reference packages).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_json(checkout: str, script: str, args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, os.path.join(checkout, "benchmarks", script), *args, "--out", out]
        subprocess.run(cmd, cwd=checkout, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def forward_figures(res: dict) -> dict:
    """{'prefill_N tok/s': ..., 'decode tok/s': ...} of the kvpress_c engine."""
    row = next(r for r in res["results"] if r.get("engine") == "kvpress_c")
    return {f"{k} tok/s": v for k, v in row.items() if k.startswith("prefill_") or k == "decode"}


def overhead_figures(res: dict) -> dict:
    """{'<press> n=<length> s': seconds of the prefill with that press, '... in press s': of them, the seconds
    inside the press (scoring, selection, eviction: the session's press clock, less noisy than the prefill)}."""
    out = {}
    for row in res["rows"]:
        out[f"{row['press']} n={row['n']} s"] = row["ours_s"]
        if row.get("ours_press_s") is not None:
            out[f"{row['press']} n={row['n']} in press s"] = row["ours_press_s"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--new", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--press-length", type=int, default=2048)
    ap.add_argument("--presses", nargs="+", default=["SnapKV", "Knorm", "AdaKV(SnapKV)", "ChunkKV(SnapKV)",
                                                    "ExpectedAttention", "KeyDiff", "TOVA", "ObservedAttention"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ab_checkouts.json"))
    args = ap.parse_args()
    fwd_args = ["--engines", "kvpress_c", "--lengths", *map(str, args.lengths), "--decode", "32", "--repeat", "1"]
    ovh_args = ["--lengths", str(args.press_length), "--skip-kvpress", "--threads", "1", "--presses", *args.presses]
    figures = {"base": [], "new": []}
    for r in range(args.rounds):
        for side in ("base", "new"):
            checkout = getattr(args, side)
            fig = forward_figures(run_json(checkout, "cpu_forward.py", fwd_args))
            fig.update(overhead_figures(run_json(checkout, "press_overhead.py", ovh_args)))
            figures[side].append(fig)
            print(f"round {r} {side}: " + ", ".join(f"{k} {v:.3g}" for k, v in fig.items()), flush=True)
    summary = {}
    for key in figures["new"][0]:
        b = statistics.median(f[key] for f in figures["base"])
        n = statistics.median(f[key] for f in figures["new"])
        summary[key] = {"base": b, "new": n, "new/base": n / b}
    with open(args.out, "w") as f:
        json.dump({"base": os.path.abspath(args.base), "new": os.path.abspath(args.new), "rounds": args.rounds,
                   "runs": figures, "median": summary}, f, indent=1)
    print(f"{'figure':40s} {'base':>10s} {'new':>10s} {'new/base':>9s}")
    for key, v in summary.items():
        print(f"{key:40s} {v['base']:10.4g} {v['new']:10.4g} {v['new/base']:9.3f}")


if __name__ == "__main__":
    main()
