"""Tables across runs: methods x budgets, as text, CSV and a score-vs-budget plot."""
from __future__ import annotations

import csv
import glob
import json
import os
from typing import Optional, Sequence


def plot_hint() -> Optional[str]:
    """None when matplotlib (the `eval` extra) is installed, else what to do to get the plots."""
    try:
        import matplotlib  # noqa: F401
        return None
    except ImportError:
        return "matplotlib is not installed (pip install 'kvpress_c[eval]' or pip install matplotlib)"


def collect(dirs: Sequence[str]) -> list[dict]:
    """metrics.json of every label folder under the given folders (searched recursively)."""
    rows = []
    for d in dirs:
        if not os.path.exists(d):
            raise FileNotFoundError(f"{d} does not exist")
        for path in sorted(glob.glob(os.path.join(d, "**", "metrics.json"), recursive=True)):
            with open(path, encoding="utf-8") as f:
                m = json.load(f)
            m["path"] = os.path.dirname(path)
            rows.append(m)
    if not rows:
        raise FileNotFoundError(f"no metrics.json under {', '.join(dirs)}: run `python -m kvpress_c eval ...` first "
                                "(a sharded run needs `python -m kvpress_c merge OUT`)")
    return rows


def _size(m: dict) -> str:
    if m.get("press") in (None, "full"):
        return "full"
    return str(m["budget"]) if m.get("budget") is not None else f"r{m.get('compression_ratio'):g}"


def table(rows: Sequence[dict]) -> str:
    """One block per (benchmark, mode): presses as rows, budgets as columns, mean scores."""
    out = []
    groups: dict = {}
    for m in rows:
        groups.setdefault((m["benchmark"], bool(m.get("query_aware"))), []).append(m)
    for (bench, aware), ms in sorted(groups.items()):
        sizes = sorted({_size(m) for m in ms if _size(m) != "full"}, key=lambda s: (s[0] == "r", float(s.lstrip("r"))))
        presses = sorted({m.get("press") or "full" for m in ms}, key=lambda p: (p != "full", p))
        cell = {(m.get("press") or "full", _size(m)): m for m in ms}
        out.append(f"\n{bench} ({'question-aware' if aware else 'question-agnostic'}), mean score (0-100)")
        head = f"{'press':<16}" + "".join(f"{s:>9}" for s in (sizes or ["full"]))
        out.append(head)
        out.append("-" * len(head))
        for p in presses:
            if p == "full":
                m = cell.get(("full", "full"))
                out.append(f"{'full':<16}" + "".join(f"{m['score']:>9.1f}" if m else f"{'':>9}" for _ in (sizes or ["full"])))
                continue
            vals = [cell.get((p, s)) for s in sizes]
            out.append(f"{p:<16}" + "".join(f"{v['score']:>9.1f}" if v else f"{'-':>9}" for v in vals))
    return "\n".join(out).lstrip("\n")


def write_csv(rows: Sequence[dict], path: str) -> str:
    tasks = sorted({t for m in rows for t in m.get("per_task", {})})
    keys = ["benchmark", "query_aware", "press", "budget", "compression_ratio", "label", "score", "n_samples",
            "complete", "mean_kept_tokens", "mean_peak_kv_bytes", "path"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(keys + tasks)
        for m in rows:
            w.writerow([m.get(k) for k in keys] + [m.get("per_task", {}).get(t) for t in tasks])
    return path


def plot(rows: Sequence[dict], path: str) -> Optional[str]:
    """Score vs budget, one line per press, one panel per (benchmark, mode); full cache dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups: dict = {}
    for m in rows:
        groups.setdefault((m["benchmark"], bool(m.get("query_aware"))), []).append(m)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 3.8), squeeze=False)
    for ax, ((bench, aware), ms) in zip(axes[0], sorted(groups.items())):
        by_press: dict = {}
        for m in ms:
            if m.get("budget") is not None and m.get("press") not in (None, "full"):
                by_press.setdefault(m["press"], []).append((m["budget"], m["score"]))
        for p, pts in sorted(by_press.items()):
            pts.sort()
            ax.plot([b for b, _ in pts], [s for _, s in pts], marker="o", label=p)
        full = [m["score"] for m in ms if m.get("press") in (None, "full")]
        if full:
            ax.axhline(full[0], color="k", ls="--", lw=1, label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens per KV head)")
        ax.set_ylabel("score")
        ax.set_title(f"{bench} ({'question-aware' if aware else 'question-agnostic'})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
