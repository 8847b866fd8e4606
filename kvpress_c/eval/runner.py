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
import math
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


def read_errors(run_dir: str, done: set = frozenset()) -> dict[str, dict]:
    """errors.jsonl of a label folder (samples that failed on every try), less the ids since done."""
    path = os.path.join(run_dir, "errors.jsonl")
    errors: dict[str, dict] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row["id"] not in done:
                    errors[row["id"]] = row
    return errors


def _mean(values) -> float:
    # exact sums: the order rows were written in (a Ray run writes them as they finish) changes nothing
    values = list(values)
    return math.fsum(values) / len(values)


def aggregate(benchmark: str, rows: Sequence[dict]) -> dict:
    """metrics.json content: mean score (0-100) overall, per task, and the benchmark's breakdowns."""
    from .longbench import length_bucket
    by_task: dict[str, list[float]] = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r["score"])
    per_task = {t: 100.0 * _mean(v) for t, v in sorted(by_task.items())}
    out = {"benchmark": benchmark, "n_samples": len(rows), "per_task": per_task,
           # RULER and LongBench report the mean over tasks; NIAH has one task
           "score": _mean(per_task.values()) if per_task else float("nan")}
    if benchmark == "niah":
        for key in ("length", "depth"):
            groups: dict = {}
            for r in rows:
                groups.setdefault(r["meta"][key], []).append(r["score"])
            out[f"per_{key}"] = {str(k): 100.0 * _mean(v) for k, v in sorted(groups.items())}
        out["rouge1_f"] = 100.0 * _mean(r.get("rouge1_f", 0.0) for r in rows) if rows else 0.0
    if benchmark == "longbench" and any(r["task"].endswith("_e") for r in rows):
        buckets: dict = {}
        for r in rows:
            buckets.setdefault(r["task"], {}).setdefault(length_bucket(r), []).append(r["score"])
        out["per_length"] = {t: {b: 100.0 * _mean(v) for b, v in sorted(d.items())} for t, d in sorted(buckets.items())}
    stats = [r.get("stats", {}) for r in rows]
    if stats:
        out["mean_kept_tokens"] = _mean(s.get("kept_tokens", 0) for s in stats)
        out["mean_peak_kv_bytes"] = _mean(s.get("peak_kv_bytes", 0) for s in stats)
    return out


@dataclass
class EvalResult:
    """What `evaluate` returns: one row per label with its metrics, and the output folder (a Ray run
    adds `summary`: samples/s, retries, worker deaths, failures; also in OUT/ray_summary.json)."""
    out: str
    rows: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    def to_dicts(self) -> list[dict]:
        return [dict(r) for r in self.rows]

    def to_csv(self, path: Optional[str] = None) -> str:
        keys = ["label", "press", "budget", "compression_ratio", "kv_cache", "query_aware", "benchmark", "score",
                "n_samples"]
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


class RunFolders:
    """The label folders of one run, opened for appending: config.json checked (a different experiment
    in the same folder is refused) and written, the ids already done read back, one append handle per
    label. The one writer of predictions (serial runs and the Ray driver alike), so a row is never
    written twice."""

    def __init__(self, out: str, benchmark: str, n_samples: int, labels: dict, model_path: str,
                 query_aware: bool = False, shard: tuple[int, int] = (0, 1), config: Optional[dict] = None,
                 device: str = "cpu", model_digest: Optional[str] = None):
        """labels: {label: (press repr, info dict)}; info goes into config.json (press name, budget...);
        model_digest (kvpress_c._core.model_digest: the weights' SHA-256) identifies the model wherever it lies."""
        os.makedirs(out, exist_ok=True)
        self.out = out
        self.done: dict[str, set] = {}
        self._handles = {}
        try:
            for lab, (press_repr, info) in labels.items():
                run_dir = os.path.join(out, lab)
                os.makedirs(run_dir, exist_ok=True)
                cfg = {"benchmark": benchmark, "label": lab, "query_aware": bool(query_aware), "model": model_path,
                       **({"model_digest": model_digest} if model_digest else {}),
                       "device": device, "press_repr": press_repr, "n_samples_total": n_samples, **(info or {}), **(config or {})}
                _check_config(run_dir, cfg)
                self.done[lab] = {r["id"] for r in read_predictions(run_dir)}
                h = open(_pred_file(run_dir, shard), "a+", encoding="utf-8")
                self._handles[lab] = h
                if h.tell() > 0:  # a run cut mid-line leaves a partial line: close it off
                    h.seek(h.tell() - 1)
                    if h.read(1) != "\n":
                        h.write("\n")
        except BaseException:
            self.close()
            raise

    def todo(self, sample: dict) -> list[str]:
        """The labels that still need this sample."""
        return [lab for lab in self._handles if sample["id"] not in self.done[lab]]

    def write(self, lab: str, row: dict) -> bool:
        """Append one prediction line; False (and nothing written) when that sample is already done."""
        if row["id"] in self.done[lab]:
            return False
        self._handles[lab].write(json.dumps(row) + "\n")
        self._handles[lab].flush()
        self.done[lab].add(row["id"])
        return True

    def write_error(self, lab: str, sample: dict, error: str, attempts: int) -> None:
        """A sample that failed on every try: OUT/<label>/errors.jsonl (not a prediction: a rerun retries it)."""
        with open(os.path.join(self.out, lab, "errors.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"id": sample["id"], "task": sample["task"], "attempts": attempts,
                                "error": error}) + "\n")

    def close(self) -> None:
        for h in self._handles.values():
            h.close()


def _same_model(old: dict, new: dict) -> bool:
    """Two configs' models are one: the same weights' digest where both recorded it; else (folders written before
    the digest was) the same file or folder name and, where both paths exist, the same size (a run resumed from
    another checkout, whose embedded model lives in another virtualenv)."""
    if old.get("model_digest") and new.get("model_digest"):
        return old["model_digest"] == new["model_digest"]
    a, b = old.get("model"), new.get("model")
    if not (isinstance(a, str) and isinstance(b, str)):
        return a == b
    name = lambda p: os.path.basename(os.path.normpath(p))
    if name(a) != name(b):
        return False
    size = lambda p: os.path.getsize(p) if os.path.isfile(p) else sum(
        os.path.getsize(os.path.join(p, f)) for f in sorted(os.listdir(p)) if os.path.isfile(os.path.join(p, f)))
    return not (os.path.exists(a) and os.path.exists(b)) or size(a) == size(b)


def _check_config(run_dir: str, cfg: dict) -> None:
    cfg = json.loads(json.dumps(cfg, default=str))  # tuples -> lists, as they read back
    cfg_path = os.path.join(run_dir, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            old = json.load(f)
        # more samples (RULER --samples) extend a run; anything else is another experiment
        # (folders written before the device was recorded ran on the CPU)
        # (and before the K/V type was, in the device's own type)
        strip = lambda c: {**c, "n_samples_total": None, "device": c.get("device", "cpu"),
                           "kv_cache": c.get("kv_cache", "native"), "benchmark_options":
                           {k: v for k, v in (c.get("benchmark_options") or {}).items() if k != "n_samples"}}
        a, b = strip(old), strip(cfg)
        same = _same_model(a, b)  # the same weights, wherever they lie now
        for c in (a, b):
            c.pop("model", None), c.pop("model_digest", None)
        diff = {k for k in set(a) | set(b) if a.get(k) != b.get(k)} | (set() if same else {"model"})
        if diff:
            raise ValueError(f"{run_dir} holds results of a different configuration (differs in "
                             f"{', '.join(sorted(diff))}); pass another --out or delete that folder")
    _write_json(cfg_path, cfg)


def sample_rows(pipe: Pipeline, sample: dict, presses: Sequence, score: Callable[[str, dict], dict],
                query_aware: bool = False, max_new_tokens: Optional[int] = None,
                kv_caches: Optional[Sequence] = None) -> list[dict]:
    """One sample under several presses (one shared prefill), each in its K/V type (kv_caches: one per press,
    default the pipeline's): one prediction row per press."""
    s = sample
    results = pipe.run_many(s["context"], s["question"], presses=list(presses),
                            max_new_tokens=max_new_tokens or s["max_new_tokens"],
                            answer_prefix=s.get("answer_prefix", ""), query_aware=query_aware,
                            chat=s.get("chat", True), kv_caches=kv_caches)
    rows = []
    for res in results:
        pred = res.answers[0]
        rows.append({"id": s["id"], "task": s["task"], "prediction": pred, "answers": s["answers"],
                     **score(pred, s), "meta": s.get("meta", {}), "stats": dict(res.stats)})
    return rows


def check_context(pipe: Pipeline, samples: Sequence[dict], max_new_tokens: Optional[int] = None,
                  allow_long_context: bool = False) -> None:
    """Refuse samples whose prompt plus answer runs past the model's trained context (RoPE positions it
    never saw: the scores would measure that, not the press) unless allow_long_context."""
    limit = pipe.model.config.get("max_context") or 0
    if allow_long_context or limit <= 0:
        return
    over = []
    for s in samples:
        ctx, q = pipe.split_prompt(s["context"], s["question"], s.get("answer_prefix", ""), s.get("chat", True))
        n = len(ctx) + len(q) + (max_new_tokens or s["max_new_tokens"])
        if n > limit:
            over.append(n)
    if over:
        raise ValueError(f"{len(over)} of {len(samples)} samples need more tokens than the model's context of {limit} "
                         f"(the longest: {max(over)} with its answer): shorten them (--length, --lengths, --max-length) "
                         "or pass --allow-long-context (allow_long_context=True) to run past the trained length anyway")


def _digest(model) -> Optional[str]:
    """The model's weights' SHA-256 (computed once per model), None for a model without one (a test's stand-in)."""
    core = getattr(model, "_core", None)
    if core is None:
        return None
    from .. import _core
    return _core.model_digest(core)


def evaluate(model, benchmark: str, samples: Sequence[dict], presses: dict, out: str,
             query_aware: bool = False, shard: tuple[int, int] = (0, 1), progress: bool = True,
             config: Optional[dict] = None, max_new_tokens: Optional[int] = None) -> EvalResult:
    """Run every press of `presses` ({label: (press or None, info dict)}) on `samples`.

    info holds what goes into config.json besides the benchmark settings (press name, budget...); its
    "kv_cache" (a kvpress_c.kv_cache.kv_cache_name) is the K/V type the label's sessions store, the model's
    own where it names none.
    Returns the metrics of every label (None for a sharded run, whose metrics come from merge())."""
    i, n = _check_shard(shard)
    if not presses:
        raise ValueError("no press to evaluate")
    score = _score_fn(benchmark)
    pipe = Pipeline(model)
    kv = {lab: label_kv_cache(info) for lab, (_, info) in presses.items()}
    mine = [s for k, s in enumerate(samples) if k % n == i]
    folders = RunFolders(out, benchmark, len(samples), {lab: (repr(p), info) for lab, (p, info) in presses.items()},
                         model.path, query_aware, shard, config, getattr(model, "device", "cpu"), _digest(model))
    todo = [s for s in mine if folders.todo(s)]
    bar = progress_bar(total=len(mine), initial=len(mine) - len(todo), desc=f"{benchmark} x {len(presses)} presses",
                       unit="sample", disable=not progress)
    tokens, t_start = 0, time.perf_counter()
    try:
        for s in todo:
            labels = folders.todo(s)
            rows = sample_rows(pipe, s, [presses[lab][0] for lab in labels], score, query_aware, max_new_tokens,
                               [kv[lab] for lab in labels])
            for lab, row in zip(labels, rows):
                folders.write(lab, row)
            tokens += rows[0]["stats"]["prompt_tokens"] if rows else 0
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t_start):.0f}")
    finally:
        folders.close()
        bar.close()
    return finalize_all(out, list(presses), shard)


def label_kv_cache(info: Optional[dict]):
    """The kv_cache value a label's info names ("pipeline": none named, the model's own)."""
    from ..kv_cache import kv_cache_from_name
    name = (info or {}).get("kv_cache")
    return "pipeline" if name is None else kv_cache_from_name(name)


def _check_shard(shard) -> tuple[int, int]:
    i, n = shard
    if not (isinstance(i, int) and isinstance(n, int) and n >= 1 and 0 <= i < n):
        raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard!r}")
    return i, n


def finalize_all(out: str, labels: Sequence[str], shard: tuple[int, int] = (0, 1)) -> EvalResult:
    """The metrics of every label of a run (none for one shard of a sharded run: merge() writes them)."""
    result = EvalResult(out)
    if shard[1] > 1:
        return result
    for lab in labels:
        result.rows.append(finalize(os.path.join(out, lab)))
    return result


def finalize(run_dir: str) -> dict:
    """Write metrics.json (and the NIAH heatmap) of a label folder from its predictions."""
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    rows = read_predictions(run_dir)
    metrics = aggregate(cfg["benchmark"], rows)
    metrics["complete"] = len(rows) >= cfg.get("n_samples_total", len(rows))
    failed = read_errors(run_dir, {r["id"] for r in rows})
    if failed:  # samples that failed on every try of a Ray run and have no prediction yet
        metrics["n_failed"] = len(failed)
    for k in ("label", "press", "budget", "compression_ratio", "query_aware"):
        metrics[k] = cfg.get(k)
    metrics["kv_cache"] = cfg.get("kv_cache", "native")
    _write_json(os.path.join(run_dir, "metrics.json"), metrics)
    from .report import plot_hint
    if cfg["benchmark"] == "niah" and rows and not plot_hint():  # matplotlib is an extra
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
