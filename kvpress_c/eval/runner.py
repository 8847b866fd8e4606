"""The evaluation runner: model x presses x budgets x samples -> predictions and metrics on disk.

Layout of an output folder (one per benchmark run):
    OUT/<label>/config.json        what produced it (benchmark, press, budget, mode, model)
    OUT/<label>/predictions.jsonl  one line per sample: prediction, answers, score, stats
    OUT/<label>/metrics.json       mean score overall, per task (and per length bucket, per depth)
    OUT/<label>/heatmap.png        NIAH only
with <label> e.g. "snapkv-b128" or "full". Lines are appended as samples finish, so a run that
stops resumes where it stopped; a finished label is skipped. `shard=(i, n)` takes every n-th sample
from the i-th and writes predictions.shard-i-of-n.jsonl; `merge(OUT)` joins the shards.

All labels of a run are evaluated sample by sample together: presses that act after each layer
share one prefill (Pipeline.run_many), so evaluating 10 presses costs little more than one.
"""
from __future__ import annotations

import csv
import glob
import io
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .._progress import progress_bar
from ..pipeline import Pipeline


def _score_fn(benchmark: str) -> Callable[[str, dict], dict]:
    from . import longbench, niah, ruler
    return {"niah": niah.score, "ruler": ruler.score, "longbench": longbench.score}[benchmark]


def _pred_file(run_dir: str, shard: tuple[int, int]) -> str:
    i, n = shard
    return os.path.join(run_dir, "predictions.jsonl" if n == 1 else f"predictions.shard-{i}-of-{n}.jsonl")


def read_predictions(run_dir: str) -> list[dict]:
    """Every prediction line of a label folder (all shards), last write wins per sample id."""
    rows: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "predictions*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut by an interrupted run: redone on resume
                    continue
                rows[row["id"]] = row
    return list(rows.values())


def aggregate(benchmark: str, rows: Sequence[dict]) -> dict:
    """metrics.json content: mean score (0-100) overall, per task, and the benchmark's breakdowns."""
    from .longbench import length_bucket
    by_task: dict[str, list[float]] = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r["score"])
    per_task = {t: 100.0 * sum(v) / len(v) for t, v in sorted(by_task.items())}
    out = {"benchmark": benchmark, "n_samples": len(rows), "per_task": per_task,
           # RULER and LongBench report the mean over tasks; NIAH has one task
           "score": sum(per_task.values()) / len(per_task) if per_task else float("nan")}
    if benchmark == "niah":
        for key in ("length", "depth"):
            groups: dict = {}
            for r in rows:
                groups.setdefault(r["meta"][key], []).append(r["score"])
            out[f"per_{key}"] = {str(k): 100.0 * sum(v) / len(v) for k, v in sorted(groups.items())}
        out["rouge1_f"] = 100.0 * sum(r.get("rouge1_f", 0.0) for r in rows) / max(1, len(rows))
    if benchmark == "longbench" and any(r["task"].endswith("_e") for r in rows):
        buckets: dict = {}
        for r in rows:
            buckets.setdefault(r["task"], {}).setdefault(length_bucket(r), []).append(r["score"])
        out["per_length"] = {t: {b: 100.0 * sum(v) / len(v) for b, v in sorted(d.items())} for t, d in buckets.items()}
    stats = [r.get("stats", {}) for r in rows]
    if stats:
        out["mean_kept_tokens"] = sum(s.get("kept_tokens", 0) for s in stats) / len(stats)
        out["mean_peak_kv_bytes"] = sum(s.get("peak_kv_bytes", 0) for s in stats) / len(stats)
    return out


@dataclass
class EvalResult:
    """What `evaluate` returns: one row per label with its metrics, and the output folder."""
    out: str
    rows: list[dict] = field(default_factory=list)

    def to_dicts(self) -> list[dict]:
        return [dict(r) for r in self.rows]

    def to_csv(self, path: Optional[str] = None) -> str:
        keys = ["label", "press", "budget", "compression_ratio", "query_aware", "benchmark", "score", "n_samples"]
        tasks = sorted({t for r in self.rows for t in r.get("per_task", {})})
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(keys + tasks)
        for r in self.rows:
            w.writerow([r.get(k) for k in keys] + [r.get("per_task", {}).get(t) for t in tasks])
        text = buf.getvalue()
        if path:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def __repr__(self) -> str:
        lines = [f"EvalResult({self.out})"]
        lines += [f"  {r['label']:<24} {r['score']:6.2f}  ({r['n_samples']} samples)" for r in self.rows]
        return "\n".join(lines)


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def evaluate(model, benchmark: str, samples: Sequence[dict], presses: dict, out: str,
             query_aware: bool = False, shard: tuple[int, int] = (0, 1), progress: bool = True,
             config: Optional[dict] = None, max_new_tokens: Optional[int] = None) -> EvalResult:
    """Run every press of `presses` ({label: (press or None, info dict)}) on `samples`.

    info holds what goes into config.json besides the benchmark settings (press name, budget...).
    Returns the metrics of every label (None for a sharded run, whose metrics come from merge())."""
    i, n = shard
    if not (isinstance(i, int) and isinstance(n, int) and n >= 1 and 0 <= i < n):
        raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard!r}")
    if not presses:
        raise ValueError("no press to evaluate")
    score = _score_fn(benchmark)
    pipe = Pipeline(model)
    os.makedirs(out, exist_ok=True)
    mine = [s for k, s in enumerate(samples) if k % n == i]
    done: dict[str, set] = {}
    handles = {}
    for lab, (press, info) in presses.items():
        run_dir = os.path.join(out, lab)
        os.makedirs(run_dir, exist_ok=True)
        cfg = {"benchmark": benchmark, "label": lab, "query_aware": bool(query_aware), "model": model.path,
               "press_repr": repr(press), "n_samples_total": len(samples), **(info or {}), **(config or {})}
        cfg = json.loads(json.dumps(cfg, default=str))  # tuples -> lists, as they read back
        cfg_path = os.path.join(run_dir, "config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                old = json.load(f)
            # more samples (RULER --samples) extend a run; anything else is another experiment
            strip = lambda c: {**c, "n_samples_total": None, "benchmark_options":
                               {k: v for k, v in (c.get("benchmark_options") or {}).items() if k != "n_samples"}}
            a, b = strip(old), strip(cfg)
            diff = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
            if diff:
                raise ValueError(f"{run_dir} holds results of a different configuration (differs in "
                                 f"{', '.join(sorted(diff))}); pass another --out or delete that folder")
        _write_json(cfg_path, cfg)
        done[lab] = {r["id"] for r in read_predictions(run_dir)}
        pred_path = _pred_file(run_dir, shard)
        handles[lab] = open(pred_path, "a+", encoding="utf-8")
        if handles[lab].tell() > 0:  # a run cut mid-line leaves a partial line: close it off
            handles[lab].seek(handles[lab].tell() - 1)
            if handles[lab].read(1) != "\n":
                handles[lab].write("\n")
    todo = [s for s in mine if any(s["id"] not in done[lab] for lab in presses)]
    bar = progress_bar(total=len(mine), initial=len(mine) - len(todo), desc=f"{benchmark} x {len(presses)} presses",
                       unit="sample", disable=not progress)
    tokens, t_start = 0, time.perf_counter()
    try:
        for s in todo:
            labels = [lab for lab in presses if s["id"] not in done[lab]]
            results = pipe.run_many(s["context"], s["question"], presses=[presses[lab][0] for lab in labels],
                                    max_new_tokens=max_new_tokens or s["max_new_tokens"],
                                    answer_prefix=s.get("answer_prefix", ""), query_aware=query_aware,
                                    chat=s.get("chat", True))
            for lab, res in zip(labels, results):
                pred = res.answers[0]
                row = {"id": s["id"], "task": s["task"], "prediction": pred, "answers": s["answers"],
                       **score(pred, s), "meta": s.get("meta", {}),
                       "stats": {k: v for k, v in res.stats.items()}}
                handles[lab].write(json.dumps(row) + "\n")
                handles[lab].flush()
            tokens += results[0].stats["prompt_tokens"] if results else 0
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t_start):.0f}")
    finally:
        for h in handles.values():
            h.close()
        bar.close()
    result = EvalResult(out)
    if n > 1:
        return result
    for lab in presses:
        result.rows.append(finalize(os.path.join(out, lab)))
    return result


def finalize(run_dir: str) -> dict:
    """Write metrics.json (and the NIAH heatmap) of a label folder from its predictions."""
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    rows = read_predictions(run_dir)
    metrics = aggregate(cfg["benchmark"], rows)
    metrics["complete"] = len(rows) >= cfg.get("n_samples_total", len(rows))
    for k in ("label", "press", "budget", "compression_ratio", "query_aware"):
        metrics[k] = cfg.get(k)
    _write_json(os.path.join(run_dir, "metrics.json"), metrics)
    if cfg["benchmark"] == "niah" and rows:
        from .niah import heatmap
        mode = "question-aware" if cfg.get("query_aware") else "question-agnostic"
        heatmap(rows, os.path.join(run_dir, "heatmap.png"), title=f"{cfg['label']} ({mode})")
    return metrics


def merge(out: str) -> EvalResult:
    """Join the shards of every label folder under `out` into predictions.jsonl + metrics.json."""
    result = EvalResult(out)
    dirs = sorted(d for d in glob.glob(os.path.join(out, "*")) if os.path.exists(os.path.join(d, "config.json")))
    if not dirs:
        raise FileNotFoundError(f"no run folders (with config.json) under {out}")
    for d in dirs:
        rows = read_predictions(d)
        tmp = os.path.join(d, "predictions.jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, os.path.join(d, "predictions.jsonl"))
        for p in glob.glob(os.path.join(d, "predictions.shard-*.jsonl")):
            os.remove(p)
        result.rows.append(finalize(d))
    return result
