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


def _row(m: dict) -> str:
    """A table row: the press, and its K/V type where that is not the device's own ("snapkv kivi4")."""
    press, kv = m.get("press") or "full", m.get("kv_cache")
    return press if kv in (None, "native") else f"{press} {kv}"


def table(rows: Sequence[dict]) -> str:
    """One block per (benchmark, mode): presses (x K/V types) as rows, budgets as columns, mean scores."""
    out = []
    groups: dict = {}
    for m in rows:
        groups.setdefault((m["benchmark"], bool(m.get("query_aware"))), []).append(m)
    for (bench, aware), ms in sorted(groups.items()):
        sizes = sorted({_size(m) for m in ms if _size(m) != "full"}, key=lambda s: (s[0] == "r", float(s.lstrip("r"))))
        names = sorted({_row(m) for m in ms}, key=lambda r: (not r.startswith("full"), r))
        cell = {(_row(m), _size(m)): m for m in ms}
        out.append(f"\n{bench} ({'question-aware' if aware else 'question-agnostic'}), mean score (0-100)")
        width = max([16] + [len(r) + 2 for r in names])
        head = f"{'press':<{width}}" + "".join(f"{s:>9}" for s in (sizes or ["full"]))
        out.append(head)
        out.append("-" * len(head))
        for r in names:
            full = cell.get((r, "full"))
            if full:  # the uncompressed cache: one score, shown under every budget
                out.append(f"{r:<{width}}" + "".join(f"{full['score']:>9.1f}" for _ in (sizes or ["full"])))
                continue
            vals = [cell.get((r, s)) for s in sizes]
            out.append(f"{r:<{width}}" + "".join(f"{v['score']:>9.1f}" if v else f"{'-':>9}" for v in vals))
    return "\n".join(out).lstrip("\n")


def kv_cache_table(rows: Sequence[dict], minus: Optional[tuple[str, str]] = None) -> str:
    """Markdown, one table per (benchmark, mode): press x budget as rows, K/V types as columns (mean scores),
    and with minus=(a, b) the column a - b (e.g. ("kivi4", "f16")). Rows of runs without a type are left out."""
    out = []
    groups: dict = {}
    for m in rows:
        if m.get("kv_cache") not in (None, "native"):
            groups.setdefault((m["benchmark"], bool(m.get("query_aware"))), []).append(m)
    for (bench, aware), ms in sorted(groups.items()):
        kvs = sorted({m["kv_cache"] for m in ms}, key=_kv_order)
        cell = {(m.get("press") or "full", _size(m), m["kv_cache"]): m for m in ms}
        keys = sorted({(p, s) for p, s, _ in cell}, key=lambda k: (k[0] != "full", k[0], _size_order(k[1])))
        n = sorted({m["n_samples"] for m in ms})
        out.append(f"**{bench}** ({'question-aware' if aware else 'question-agnostic'}; mean score 0-100, "
                   f"{'/'.join(map(str, n))} samples per cell)\n")
        head = ["press", "budget"] + kvs + ([f"{minus[0]} - {minus[1]}"] if minus else [])
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * 2 + "---:|" * (len(head) - 2))
        for p, size in keys:
            vals = [cell.get((p, size, kv)) for kv in kvs]
            line = [p, "-" if size == "full" else size] + [f"{v['score']:.1f}" if v else "" for v in vals]
            if minus:
                a, b = cell.get((p, size, minus[0])), cell.get((p, size, minus[1]))
                line.append(f"{a['score'] - b['score']:+.1f}" if a and b else "")
            out.append("| " + " | ".join(line) + " |")
        whole = [k for k in keys if all((k[0], k[1], kv) in cell for kv in kvs)]
        if len(whole) > 1:  # the mean over the rows every type has
            means = {kv: sum(cell[p, s, kv]["score"] for p, s in whole) / len(whole) for kv in kvs}
            line = ["mean", f"{len(whole)} rows"] + [f"{means[kv]:.1f}" for kv in kvs]
            if minus and all(kv in means for kv in minus):
                line.append(f"{means[minus[0]] - means[minus[1]]:+.1f}")
            elif minus:
                line.append("")
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    return "\n".join(out)


def _kv_order(name: str) -> tuple:
    order = ["f32", "bf16", "f16", "q8_0", "kivi4", "kivi2"]
    return (order.index(name) if name in order else len(order), name)


def _size_order(size: str) -> tuple:
    return (size != "full", size[:1] == "r", float(size.lstrip("r")) if size != "full" else 0.0)


def write_csv(rows: Sequence[dict], path: str) -> str:
    tasks = sorted({t for m in rows for t in m.get("per_task", {})})
    keys = ["benchmark", "query_aware", "press", "budget", "compression_ratio", "kv_cache", "label", "score", "n_samples",
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
                by_press.setdefault(_row(m), []).append((m["budget"], m["score"]))
        for p, pts in sorted(by_press.items()):
            pts.sort()
            ax.plot([b for b, _ in pts], [s for _, s in pts], marker="o", label=p)
        for m in sorted((m for m in ms if m.get("press") in (None, "full")), key=_row):
            ax.axhline(m["score"], color="k", ls="--", lw=1, label=_row(m).replace("full", "full cache"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens per KV head)")
        ax.set_ylabel("score")
        ax.set_title(f"{bench} ({'question-aware' if aware else 'question-agnostic'})", fontsize=10)
        ax.grid(alpha=0.3)
        many = len(ax.get_legend_handles_labels()[1]) > 8  # presses x K/V types: the legend goes beside the panel
        ax.legend(fontsize=7, **({"loc": "upper left", "bbox_to_anchor": (1.02, 1.0)} if many else {}))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
