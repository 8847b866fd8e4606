"""The evaluation on a Ray cluster: one driver, one worker actor per GPU (or per few CPU cores).

Each worker loads the model once, then takes tasks of one sample x every configuration still to do
(one shared prefill, Pipeline.run_many) and sends back the prediction rows. The driver is the one
writer: rows go into the same label folders as a serial run (runner.RunFolders), so resume, report
and merge work unchanged and a restarted driver skips what is done.

Faults: a task whose worker died (killed, out of memory, node lost) is given to the next free worker;
the dead actor is restarted by Ray (up to RESTARTS times) and used again once its model is loaded. A
sample that fails on every one of `max_attempts` tries is written to OUT/<label>/errors.jsonl (a
rerun tries it again) and the run goes on. A row is written only for a sample its label has not
done yet, so no sample is written twice.
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
import time
import traceback
import uuid
from typing import Optional, Sequence

from .._progress import progress_bar
from .runner import RunFolders, _digest, _write_json, finalize_all

INSTALL_HINT = "pip install 'kvpress_c[ray]' (or: pip install ray)"
RESTARTS = 3        # Ray restarts of one worker actor before it is given up
IN_FLIGHT = 2       # tasks queued per worker: the next sample waits there while one runs
ACTOR_PREFIX = "kvpress_c_eval:"  # named actors: `ray list actors` shows whose they are


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


@contextlib.contextmanager
def connect(address, num_cpus: Optional[int] = None):
    """Yield the `ray` module connected to a cluster: `address` None/True/"local" starts one on this
    machine (stopped at the end), "auto" joins the running one, "HOST:PORT" a remote head. A process
    already connected (ray.init done by the caller) keeps its connection."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    local = address in (None, True, "", "local")
    kw = dict(include_dashboard=False, num_cpus=num_cpus) if local else dict(address=address)
    try:
        ray.init(**kw, log_to_driver=True, configure_logging=False)
    except ConnectionError as e:
        raise ConnectionError(f"cannot join the Ray cluster at {address!r} ({e}); start one with `ray start --head` "
                              "or use --ray alone for a local cluster") from None
    try:
        yield ray
    finally:
        ray.shutdown()


class EvalWorker:
    """A Ray actor's state: the model loaded once, the run's presses built from their specs."""

    def __init__(self, model_path, device: str, threads: Optional[int], benchmark: str, specs: dict,
                 query_aware: bool, max_new_tokens: Optional[int]):
        import kvpress_c
        from ..pipeline import Pipeline
        from .presets import make_press
        from .runner import _score_fn, label_kv_cache
        if threads:
            kvpress_c.set_num_threads(threads)
        self.model = kvpress_c.load_model(model_path, device=device)
        self.pipe = Pipeline(self.model)
        self.presses = {lab: make_press(spec["name"], model=self.model, **spec["size"], **spec["options"])
                        for lab, spec in specs.items()}
        self.kv_caches = {lab: label_kv_cache(spec) for lab, spec in specs.items()}
        self.benchmark, self.score = benchmark, _score_fn(benchmark)
        self.query_aware, self.max_new_tokens = query_aware, max_new_tokens

    def describe(self) -> dict:
        import socket
        return {"model": self.model.path, "model_digest": _digest(self.model),
                "press_repr": {lab: repr(p) for lab, p in self.presses.items()},
                "host": socket.gethostname(), "pid": os.getpid()}

    def samples(self, options: dict, allow_long_context: bool):
        """The benchmark's samples, built here (the driver needs no model); bad options come back as
        (exception class name, message) so the driver raises them as the serial run would."""
        from . import build_samples
        from .runner import check_context
        try:
            samples = build_samples(self.benchmark, self.model, **options)
            check_context(self.pipe, samples, self.max_new_tokens, allow_long_context)
            return samples
        except (ValueError, FileNotFoundError) as e:
            return (type(e).__name__, str(e))

    def run(self, sample: dict, labels: Sequence[str]) -> dict:
        from .runner import sample_rows
        t0 = time.perf_counter()
        try:
            rows = sample_rows(self.pipe, sample, [self.presses[lab] for lab in labels], self.score,
                               self.query_aware, self.max_new_tokens, [self.kv_caches[lab] for lab in labels])
            return {"rows": rows, "worker_s": time.perf_counter() - t0, "pid": os.getpid()}
        except Exception as e:  # reported to the driver, which retries and at last records it
            return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                    "worker_s": time.perf_counter() - t0}


def evaluate_on_ray(address, benchmark: str, specs: dict, out: str, *, model_path=None, device: str = "cpu",
                    samples: Optional[Sequence[dict]] = None, sample_options: Optional[dict] = None,
                    query_aware: bool = False, max_new_tokens: Optional[int] = None, config: Optional[dict] = None,
                    workers: Optional[int] = None, threads: Optional[int] = None, max_attempts: int = 3,
                    allow_long_context: bool = False, progress: bool = True, num_cpus: Optional[int] = None):
    """Evaluate on a Ray cluster (see the module docstring). specs: {label: {"name", "size", "options",
    "kv_cache", "info"}} (press name, {"budget": b} or {"compression_ratio": r}, press options, the K/V type's
    name or None for the model's own, config.json info).
    samples: given, or built on a worker from sample_options. Returns the EvalResult with `.summary`."""
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    from .._paths import default_model_path
    model_path = os.fspath(model_path) if model_path is not None else default_model_path()
    with connect(address, num_cpus) as ray:
        if device == "cuda":
            n_gpu = int(ray.cluster_resources().get("GPU", 0))
            if n_gpu < 1:
                raise ValueError("--device cuda on Ray needs GPUs in the cluster, and it has none "
                                 "(start the nodes with `ray start ... --num-gpus N` where GPUs are)")
            workers = workers or n_gpu
            resources = dict(num_gpus=1, num_cpus=threads or 1)
        else:
            threads = threads or 1
            node_cpus = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")), default=0)
            if threads > node_cpus:  # such an actor could never be placed: the run would wait forever
                raise ValueError(f"--threads {threads} per worker, but the largest node of the cluster has "
                                 f"{node_cpus:g} CPUs: lower --threads")
            workers = workers or max(1, int(ray.cluster_resources().get("CPU", 1)) // threads)
            resources = dict(num_cpus=threads)
        remote = ray.remote(EvalWorker)
        run_id = uuid.uuid4().hex[:8]
        lab_specs = {lab: {k: spec.get(k) for k in ("name", "size", "options", "kv_cache")} for lab, spec in specs.items()}
        actors = [remote.options(name=f"{ACTOR_PREFIX}{run_id}:{k}", max_restarts=RESTARTS, max_task_retries=0,
                                 **resources).remote(
            model_path, device, threads, benchmark, lab_specs, query_aware, max_new_tokens) for k in range(workers)]
        try:
            return _drive(ray, actors, benchmark, specs, out, samples, sample_options, query_aware, config,
                          max_attempts, allow_long_context, progress, threads, device)
        finally:
            for a in actors:  # also when the caller's cluster lives on: no worker outlives its run
                ray.kill(a, no_restart=True)


def _drive(ray, actors, benchmark, specs, out, samples, sample_options, query_aware, config, max_attempts,
           allow_long_context, progress, threads, device):
    from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
    t_start = time.perf_counter()
    ready_refs = [_probe(a) for a in actors]
    try:  # the first worker's model load: a wrong path or device fails here, once, with its own error
        info = ray.get(ready_refs[0])
    except RayTaskError as e:
        raise _cause(e) from None
    if samples is None:
        samples = ray.get(actors[0].samples.remote(sample_options or {}, allow_long_context))
        if isinstance(samples, tuple):
            cls, msg = samples
            raise {"FileNotFoundError": FileNotFoundError}.get(cls, ValueError)(msg)
    samples = list(samples)
    labels = {lab: (info["press_repr"][lab], spec["info"]) for lab, spec in specs.items()}
    folders = RunFolders(out, benchmark, len(samples), labels, info["model"], query_aware, (0, 1), config, device,
                         info.get("model_digest"))
    queue = collections.deque((s, 0) for s in samples if folders.todo(s))  # (sample, tries so far)
    startup_s = time.perf_counter() - t_start  # the first model load and the samples
    skipped = len(samples) - len(queue)
    stats = collections.Counter()
    usable: set = set()                    # actors whose model is loaded and that are not known dead
    probing = {ref: k for k, ref in enumerate(ready_refs)}  # readiness: one per new or restarted actor
    load = collections.Counter()           # tasks in flight per actor
    inflight = {}                          # ref -> (actor index, sample, labels, tries so far)
    bar = progress_bar(total=len(samples), initial=skipped, unit="sample", disable=not progress,
                       desc=f"{benchmark} x {len(specs)} presses, {len(actors)} Ray workers")
    busy_s, worker_s = 0.0, 0.0
    pids: dict = {}                        # actor index -> its process now (a restart changes it)
    retried: dict = {}                     # sample id -> the processes it failed on, and where it was done
    try:
        while queue or inflight:
            t0 = time.perf_counter()
            for k in sorted(usable, key=lambda k: load[k]):
                while queue and load[k] < IN_FLIGHT:
                    s, tries = queue.popleft()
                    todo = folders.todo(s)
                    if not todo:
                        continue
                    inflight[actors[k].run.remote(s, todo)] = (k, s, todo, tries)
                    load[k] += 1
            if not inflight and not probing:
                raise RuntimeError(f"every Ray worker died ({stats['worker_deaths']} deaths); {len(queue)} samples "
                                   "left undone: rerun the same command to resume")
            busy_s += time.perf_counter() - t0
            ready, _ = ray.wait(list(inflight) + list(probing), num_returns=1)
            t0 = time.perf_counter()
            ref = ready[0]
            if ref in probing:
                k = probing.pop(ref)
                try:
                    pids[k] = ray.get(ref)["pid"]
                    usable.add(k)
                except ActorUnavailableError:  # still restarting: ask again
                    probing[_probe(actors[k])] = k
                except RayActorError:  # its restarts are spent: the others go on
                    stats["workers_lost"] += 1
                except RayTaskError as e:
                    raise _cause(e) from None
                busy_s += time.perf_counter() - t0
                continue
            k, s, todo, tries = inflight.pop(ref)
            load[k] -= 1
            try:
                res = ray.get(ref)
            except RayActorError as e:
                stats["worker_deaths"] += k in usable
                if k in usable:  # use it again once Ray has restarted it and its model is loaded
                    usable.discard(k)
                    probing[_probe(actors[k])] = k
                res = {"error": f"worker died: {type(e).__name__}: {str(e).splitlines()[0]}"}
            worker_s += res.get("worker_s", 0.0)
            if "error" in res:
                retried.setdefault(s["id"], {"failed_on": [], "done_on": None})["failed_on"].append(pids.get(k))
                if tries + 1 < max_attempts:
                    stats["retried"] += 1
                    queue.appendleft((s, tries + 1))
                else:
                    stats["failed"] += 1
                    for lab in todo:
                        folders.write_error(lab, s, res["error"], tries + 1)
                    bar.update(1)
            else:
                for lab, row in zip(todo, res["rows"]):
                    stats["written"] += folders.write(lab, row)
                stats["done"] += 1
                if s["id"] in retried:
                    retried[s["id"]]["done_on"] = res["pid"]
                bar.update(1)
            bar.set_postfix(workers=len(usable), retried=stats["retried"], failed=stats["failed"], refresh=False)
            busy_s += time.perf_counter() - t0
    finally:
        folders.close()
        bar.close()
    wall = time.perf_counter() - t_start
    result = finalize_all(out, list(specs))
    n = stats["done"] + stats["failed"]
    result.summary = {
        "workers": len(actors), "threads_per_worker": threads, "device": device, "samples": len(samples),
        "skipped": skipped, "done": stats["done"], "failed": stats["failed"], "retried": stats["retried"],
        "worker_deaths": stats["worker_deaths"], "workers_lost": stats["workers_lost"], "wall_s": wall,
        "startup_s": startup_s,
        "samples_per_s": n / (wall - startup_s) if n else 0.0,  # after the first model load
        # the driver's own work per sample (dispatch, bookkeeping, writing rows), waiting excluded
        "driver_ms_per_sample": 1000.0 * busy_s / max(1, n),
        "worker_s_per_sample": worker_s / max(1, n),
        "retried_samples": retried}  # id -> {"failed_on": [worker pids], "done_on": pid or None}
    _write_json(os.path.join(out, "ray_summary.json"), result.summary)
    if progress:
        print(summary_line(result.summary), file=sys.stderr)
    return result


def summary_line(s: dict) -> str:
    text = (f"Ray: {s['done']} samples in {s['wall_s']:.1f} s ({s['samples_per_s']:.2f} samples/s after a "
            f"{s['startup_s']:.1f} s start) on "
            f"{s['workers']} workers; {s['skipped']} already done, {s['retried']} retried, "
            f"{s['worker_deaths']} worker deaths, {s['failed']} failed")
    if s["failed"]:
        text += " (their errors: OUT/<label>/errors.jsonl; a rerun tries them again)"
    return text


def _probe(actor):
    """A readiness check: answers once the actor's model is loaded, waiting through Ray's restarts."""
    return actor.describe.options(max_task_retries=-1).remote()


def _cause(err):
    """The exception a worker raised, as itself (a RayTaskError wraps it)."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


__all__ = ["evaluate_on_ray", "connect", "import_ray", "EvalWorker", "summary_line", "INSTALL_HINT"]
