"""Evaluation throughput: the serial harness against `--ray` with 2 worker actors x 1 thread on a
local cluster, on one RULER-4k sample set (the niah tasks), same presses, one run each.

    python benchmarks/eval_ray.py [--samples 2] [--length 4096] [--press full snapkv] [--budget 128]
                                  [--workers 2] [--out benchmarks/results/eval_ray.json]

Reports samples/s of each (model loads and sample building excluded: the serial run is timed around
evaluate(), the Ray run from its first loaded worker to the end, the second worker's load included),
their ratio, the serial run on 1 thread (what one worker has), the Ray driver's own time per sample
(dispatch, bookkeeping, writing rows) and the time per sample the workers sat idle (driver and Ray
round trips as the workers see them), and whether both runs wrote the same metrics.json files.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # pools on two cores spin briefly, then sleep (tests/conftest.py)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2, help="samples per RULER niah task (8 tasks)")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--press", nargs="+", default=["full", "snapkv"])
    ap.add_argument("--budget", type=int, nargs="+", default=[128])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "eval_ray.json"))
    args = ap.parse_args()

    import kvpress_c
    from kvpress_c import eval as kve
    from kvpress_c.eval import ray_runner, ruler

    model = kvpress_c.load_model()
    tasks = [t for t in ruler.TASKS if t.startswith("niah")]
    samples = kve.build_samples("ruler", model, tasks=tasks, length=args.length, n_samples=args.samples)
    specs = kve.press_specs(args.press, args.budget)
    table = {lab: (kve.make_press(s["name"], model=model, **s["size"]), s["info"]) for lab, s in specs.items()}
    work = tempfile.mkdtemp(prefix="kvpress_c_eval_ray_")
    result = {"samples": len(samples), "tasks": tasks, "length": args.length, "labels": list(specs),
              "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
              "load_avg_1min_start": os.getloadavg()[0]}  # the machine is shared: say how busy it was
    try:
        serial = {}
        for threads in (os.cpu_count(), 1):
            kvpress_c.set_num_threads(threads)
            t0 = time.perf_counter()
            kve.evaluate(model, "ruler", samples, table, os.path.join(work, f"serial{threads}"), progress=False)
            serial[threads] = time.perf_counter() - t0
            print(f"serial, {threads} threads: {len(samples)} samples in {serial[threads]:.1f} s", flush=True)
        kvpress_c.set_num_threads(os.cpu_count())
        res = ray_runner.evaluate_on_ray("local", "ruler", specs, os.path.join(work, "ray"), samples=samples,
                                         workers=args.workers, threads=1, num_cpus=args.workers, progress=False)
        s = res.summary
        print(ray_runner.summary_line(s), flush=True)
        run_s = s["wall_s"] - s["startup_s"]
        same = all(open(os.path.join(work, "ray", lab, "metrics.json")).read()
                   == open(os.path.join(work, f"serial{os.cpu_count()}", lab, "metrics.json")).read() for lab in specs)
        result.update({
            "serial_threads": os.cpu_count(), "serial_s": serial[os.cpu_count()],
            "serial_samples_per_s": len(samples) / serial[os.cpu_count()],
            "serial_1thread_s": serial[1], "serial_1thread_samples_per_s": len(samples) / serial[1],
            "ray_workers": args.workers, "ray_threads_per_worker": 1, "ray_s": run_s, "ray_startup_s": s["startup_s"],
            "ray_samples_per_s": s["samples_per_s"],
            "ray_over_serial": s["samples_per_s"] / (len(samples) / serial[os.cpu_count()]),
            "ray_over_serial_1thread": s["samples_per_s"] / (len(samples) / serial[1]),
            "driver_ms_per_sample": s["driver_ms_per_sample"],
            "worker_s_per_sample": s["worker_s_per_sample"],
            # per sample, the time a worker was not computing: driver and Ray round trips, the second load
            "worker_idle_ms_per_sample": 1000.0 * (run_s * args.workers - s["worker_s_per_sample"] * s["done"]) / s["done"],
            "same_metrics": same, "load_avg_1min_end": os.getloadavg()[0]})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
