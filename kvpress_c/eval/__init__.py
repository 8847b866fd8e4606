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


def kv_cache_names(kv_cache) -> Optional[list[str]]:
    """The K/V types of a run as names (kvpress_c.kv_cache.kv_cache_name): None (the model's own), one
    value or a list of values and names ("f16", kvpress_c.QuantizedCache(4), "kivi2"...)."""
    if kv_cache is None:
        return None
    from ..kv_cache import kv_cache_from_name, kv_cache_name
    values = list(kv_cache) if isinstance(kv_cache, (list, tuple)) else [kv_cache]
    if not values:
        raise ValueError("kv_cache is empty: give one K/V type or more, or None for the model's own")
    names = [kv_cache_name(kv_cache_from_name(v) if isinstance(v, str) else v) for v in values]
    if len(set(names)) != len(names):
        raise ValueError(f"kv_cache lists a K/V type twice: {names}")
    return names


def press_specs(presses: Sequence[str], budgets: Optional[Sequence[int]] = None,
                compression_ratios: Optional[Sequence[float]] = None, press_options: Optional[dict] = None,
                kv_cache=None) -> dict:
    """{label: {"name", "size", "options", "kv_cache", "info"}}: every press x budget (x K/V type when
    kv_cache names any: labels then end in the type, "snapkv-b128-kivi4") of a run, before any is built (a
    Ray worker builds its own from these). "kv_cache": the type's name, None for the model's own."""
    if budgets and compression_ratios:
        raise ValueError("give budgets or compression ratios, not both")
    sizes = [{"budget": b} for b in budgets or []] + [{"compression_ratio": r} for r in compression_ratios or []]
    specs = {}
    for kv in kv_cache_names(kv_cache) or [None]:
        typed = {} if kv is None else {"kv_cache": kv}
        for name in presses:
            if name not in PRESS_NAMES:
                raise ValueError(f"unknown press {name!r}; choose one of: {', '.join(PRESS_NAMES)}")
            if name == "full":
                specs[label("full", kv_cache=kv)] = {"name": "full", "size": {}, "options": {}, "kv_cache": kv,
                                                     "info": {"press": "full", "budget": None,
                                                              "compression_ratio": None, **typed}}
                continue
            if not sizes:
                raise ValueError(f"press {name!r} needs budgets=[...] (CLI: --budget N) or compression_ratios=[...] (CLI: --compression-ratio R)")
            for kw in sizes:
                specs[label(name, **kw, kv_cache=kv)] = {
                    "name": name, "size": kw, "options": dict(press_options or {}), "kv_cache": kv,
                    "info": {"press": name, "budget": kw.get("budget"), "compression_ratio": kw.get("compression_ratio"),
                             "press_options": press_options or {}, **typed}}
    return specs


def run(benchmark: str, model=None, presses: Sequence[str] = ("full",), budgets: Optional[Sequence[int]] = None,
        compression_ratios: Optional[Sequence[float]] = None, out: str = "kvpress_c_runs",
        query_aware: bool = False, shard: tuple[int, int] = (0, 1), progress: bool = True,
        press_options: Optional[dict] = None, max_new_tokens: Optional[int] = None, device: str = "cpu",
        threads: Optional[int] = None, allow_long_context: bool = False, ray=None, workers: Optional[int] = None,
        max_attempts: int = 3, kv_cache=None, **benchmark_options) -> EvalResult:
    """Evaluate presses (names from PRESS_NAMES) at each budget or compression ratio on a benchmark.

    `model` is a kvpress_c.Model or a path (default: the embedded SmolLM2-135M), loaded on `device`
    ("cpu", "cuda", "emulated") with `threads` CPU threads. Samples whose prompt and answer do not fit
    the model's context (max_position_embeddings) are refused unless allow_long_context.

    `kv_cache`: the K/V storage type(s) (kvpress_c.kv_cache): None, the model's own; one value or a list
    ("f32", "f16", "q8_0", kvpress_c.QuantizedCache(4), or their names "kivi4", "kivi2"): every press x budget
    runs in every type, each label ending in its type ("snapkv-b128-kivi4", "full-f16"); all of them share
    one prefill per sample. Each label's config.json records its type ("kv_cache"), so a run resumes per
    (press, budget, K/V type).

    `ray`: run on a Ray cluster (`pip install 'kvpress_c[ray]'`): True or "local" starts one on this
    machine, "auto" joins the running one, "HOST:PORT" a remote head. `workers` actors (default: one per
    GPU with device="cuda", else the cluster's CPUs // threads) each load the model once; a failed task
    is retried elsewhere, up to `max_attempts` tries in all (see ray_runner.py). The results land
    in the same folders as a serial run."""
    from ..model import Model, load_model
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}; choose one of {', '.join(BENCHMARKS)}")
    specs = press_specs(presses, budgets, compression_ratios, press_options, kv_cache)
    config = {"benchmark_options": {k: v for k, v in benchmark_options.items()}}
    if ray not in (None, False):
        if shard != (0, 1):
            raise ValueError("--ray places the samples itself: drop --shard")
        from .ray_runner import evaluate_on_ray
        if isinstance(model, Model):
            model, device = model.path, model.device
        _record_kv_cache(specs, None)  # the workers load the model with its own type
        return evaluate_on_ray(ray, benchmark, specs, out, model_path=model, device=device,
                               sample_options=benchmark_options, query_aware=query_aware,
                               max_new_tokens=max_new_tokens, config=config, workers=workers, threads=threads,
                               max_attempts=max_attempts, allow_long_context=allow_long_context, progress=progress)
    if threads is not None:
        from .. import set_num_threads
        set_num_threads(threads)
    if not isinstance(model, Model):
        model = load_model(model, device=device)
    _record_kv_cache(specs, model.kv_cache)
    table = {lab: (make_press(sp["name"], model=model, **sp["size"], **sp["options"]), sp["info"])
             for lab, sp in specs.items()}
    samples = build_samples(benchmark, model, **benchmark_options)
    check_context(Pipeline(model), samples, max_new_tokens, allow_long_context)
    return evaluate(model, benchmark, samples, table, out, query_aware=query_aware, shard=shard, progress=progress,
                    config=config, max_new_tokens=max_new_tokens)


def _record_kv_cache(specs: dict, model_kv) -> None:
    """The labels that run in the model's own K/V type record its name (config.json's "kv_cache")."""
    from ..kv_cache import kv_cache_name
    for spec in specs.values():
        spec["info"].setdefault("kv_cache", kv_cache_name(model_kv))


__all__ = ["run", "press_specs", "build_samples", "check_context", "evaluate", "merge", "finalize", "aggregate", "read_predictions", "EvalResult",
           "make_press", "label", "PRESS_NAMES", "BENCHMARKS"]
