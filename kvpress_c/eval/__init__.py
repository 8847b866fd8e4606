"""Evaluation harness: Needle-in-a-Haystack, RULER and LongBench, from Python or the command line.

    from kvpress_c import eval as kve
    res = kve.run("niah", presses=["full", "snapkv", "ada_snapkv"], budgets=[64, 128], out="runs/niah",
                  lengths=[1000, 2000], depths=[0.0, 0.5, 1.0])
    print(res); res.to_csv("niah.csv")

The same runner backs `python -m kvpress_c eval ...`; see runner.py for the output layout.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .presets import NAMES as PRESS_NAMES, label, make_press
from ..pipeline import Pipeline
from .runner import EvalResult, aggregate, check_context, evaluate, finalize, merge, read_predictions

BENCHMARKS = ("niah", "ruler", "longbench")


def build_samples(benchmark: str, model, *, lengths: Sequence[int] = (1000, 2000, 4000),
                  depths: Optional[Sequence[float]] = None, haystack: str = "pydoc",
                  tasks: Optional[Sequence[str]] = None, length: int = 4096, n_samples: int = 20, seed: int = 42,
                  squad: Optional[str] = None, hotpotqa: Optional[str] = None, data: Optional[str] = None,
                  max_length: int = 8192, limit: Optional[int] = None, longbench_e: bool = False) -> list[dict]:
    pipe = Pipeline(model)
    if benchmark == "niah":
        from . import niah
        depths = [round(i / 9, 4) for i in range(10)] if depths is None else depths
        return niah.samples(pipe, lengths, depths, haystack=haystack)
    if benchmark == "ruler":
        from . import ruler
        tasks = [t for t in ruler.TASKS if t.startswith("niah")] if not tasks else list(tasks)
        return ruler.samples(pipe, tasks, length, n_samples, seed=seed, essay=haystack, squad=squad, hotpotqa=hotpotqa)
    if benchmark == "longbench":
        from . import longbench
        if not data:
            raise ValueError("LongBench reads the official jsonl files: pass data=FOLDER (CLI: --data FOLDER)")
        tasks = list(tasks) if tasks else (longbench.TASKS_E if longbench_e else longbench.TASKS)
        return longbench.load(data, tasks, max_length, model.tokenizer, limit=limit, longbench_e=longbench_e)
    raise ValueError(f"unknown benchmark {benchmark!r}; choose one of {', '.join(BENCHMARKS)}")


def press_specs(presses: Sequence[str], budgets: Optional[Sequence[int]] = None,
                compression_ratios: Optional[Sequence[float]] = None, press_options: Optional[dict] = None) -> dict:
    """{label: {"name", "size", "options", "info"}}: every press x budget of a run, before any is built
    (a Ray worker builds its own from these)."""
    if budgets and compression_ratios:
        raise ValueError("give budgets or compression ratios, not both")
    sizes = [{"budget": b} for b in budgets or []] + [{"compression_ratio": r} for r in compression_ratios or []]
    specs = {}
    for name in presses:
        if name not in PRESS_NAMES:
            raise ValueError(f"unknown press {name!r}; choose one of: {', '.join(PRESS_NAMES)}")
        if name == "full":
            specs["full"] = {"name": "full", "size": {}, "options": {},
                             "info": {"press": "full", "budget": None, "compression_ratio": None}}
            continue
        if not sizes:
            raise ValueError(f"press {name!r} needs budgets=[...] (CLI: --budget N) or compression_ratios=[...] (CLI: --compression-ratio R)")
        for kw in sizes:
            specs[label(name, **kw)] = {"name": name, "size": kw, "options": dict(press_options or {}),
                                        "info": {"press": name, "budget": kw.get("budget"),
                                                 "compression_ratio": kw.get("compression_ratio"),
                                                 "press_options": press_options or {}}}
    return specs


def run(benchmark: str, model=None, presses: Sequence[str] = ("full",), budgets: Optional[Sequence[int]] = None,
        compression_ratios: Optional[Sequence[float]] = None, out: str = "kvpress_c_runs",
        query_aware: bool = False, shard: tuple[int, int] = (0, 1), progress: bool = True,
        press_options: Optional[dict] = None, max_new_tokens: Optional[int] = None, device: str = "cpu",
        threads: Optional[int] = None, allow_long_context: bool = False, ray=None, workers: Optional[int] = None,
        max_attempts: int = 3, **benchmark_options) -> EvalResult:
    """Evaluate presses (names from PRESS_NAMES) at each budget or compression ratio on a benchmark.

    `model` is a kvpress_c.Model or a path (default: the embedded SmolLM2-135M), loaded on `device`
    ("cpu", "cuda", "emulated") with `threads` CPU threads. Samples whose prompt and answer do not fit
    the model's context (max_position_embeddings) are refused unless allow_long_context.

    `ray`: run on a Ray cluster (`pip install 'kvpress_c[ray]'`): True or "local" starts one on this
    machine, "auto" joins the running one, "HOST:PORT" a remote head. `workers` actors (default: one per
    GPU with device="cuda", else the cluster's CPUs // threads) each load the model once; a failed task
    is retried elsewhere, up to `max_attempts` tries in all (see ray_runner.py). The results land
    in the same folders as a serial run."""
    from ..model import Model, load_model
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}; choose one of {', '.join(BENCHMARKS)}")
    specs = press_specs(presses, budgets, compression_ratios, press_options)
    config = {"benchmark_options": {k: v for k, v in benchmark_options.items()}}
    if ray not in (None, False):
        if shard != (0, 1):
            raise ValueError("--ray places the samples itself: drop --shard")
        from .ray_runner import evaluate_on_ray
        if isinstance(model, Model):
            model, device = model.path, model.device
        return evaluate_on_ray(ray, benchmark, specs, out, model_path=model, device=device,
                               sample_options=benchmark_options, query_aware=query_aware,
                               max_new_tokens=max_new_tokens, config=config, workers=workers, threads=threads,
                               max_attempts=max_attempts, allow_long_context=allow_long_context, progress=progress)
    if threads is not None:
        from .. import set_num_threads
        set_num_threads(threads)
    if not isinstance(model, Model):
        model = load_model(model, device=device)
    table = {lab: (make_press(sp["name"], model=model, **sp["size"], **sp["options"]), sp["info"])
             for lab, sp in specs.items()}
    samples = build_samples(benchmark, model, **benchmark_options)
    check_context(Pipeline(model), samples, max_new_tokens, allow_long_context)
    return evaluate(model, benchmark, samples, table, out, query_aware=query_aware, shard=shard, progress=progress,
                    config=config, max_new_tokens=max_new_tokens)


__all__ = ["run", "press_specs", "build_samples", "check_context", "evaluate", "merge", "finalize", "aggregate", "read_predictions", "EvalResult",
           "make_press", "label", "PRESS_NAMES", "BENCHMARKS"]
