"""One layer's press call, C against Python, for one checkout of kvpress_c: the press on a layer's arrays
(kvc_press_spec_compute: a K/V store of the rows, the scoring, the selection) with SmolLM2-135M's shapes, the
built-in Knorm and SnapKV beside tests/press/python_presses.py's Python ones, in CPU seconds of the one thread that
runs it (the engine and NumPy's BLAS on one thread), so a machine loaded by other jobs changes little. Run it for
two checkouts in turn to compare them (the Python presses' overhead before and after a change):

    python benchmarks/python_press_layer.py CHECKOUT [--lengths 2048 8192] [--repeat 15] [--out FILE]

Run it under MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967295 to take glibc's mmap and
trimming (page faults whose count depends on what ran before) out of the figures.
"""
import argparse
import json
import os
import sys

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before NumPy loads its BLAS

import numpy as np  # noqa: E402

H, HKV, D = 9, 3, 64  # SmolLM2-135M's heads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkout")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path[:0] = [args.checkout] + [os.path.join(args.checkout, "tests", d) for d in ("press", "support")]
    import time

    import kvpress_c as k
    from capi import PressSpec, press_compute
    from python_presses import PyKnorm, PySnapKV
    k.set_num_threads(1)
    presses = {"Knorm": k.KnormPress(compression_ratio=0.5), "Python Knorm": PyKnorm(compression_ratio=0.5),
               "SnapKV": k.SnapKVPress(compression_ratio=0.5, window_size=64),
               "Python SnapKV": PySnapKV(compression_ratio=0.5, window_size=64)}
    res = {}
    for n in args.lengths:
        rng = np.random.default_rng(n)
        q = rng.standard_normal((n, H, D)).astype(np.float32)
        keys, values = (rng.standard_normal((HKV, n, D)).astype(np.float32) for _ in range(2))
        specs = {name: PressSpec(**p.c_config()) for name, p in presses.items()}
        for spec in specs.values():
            press_compute(spec, q, keys, values)  # warm-up
        times = {name: [] for name in specs}
        for _ in range(args.repeat):
            for name, spec in specs.items():
                t0 = time.thread_time()
                press_compute(spec, q, keys, values)
                times[name].append(time.thread_time() - t0)
        res[n] = {name: {"min_s": min(t), "median_s": float(np.median(t))} for name, t in times.items()}
        print(f"n={n}: " + ", ".join(f"{name} {v['min_s'] * 1e3:.2f} ms" for name, v in res[n].items()) +
              f" (min of {args.repeat}); Python - C: Knorm "
              f"{(res[n]['Python Knorm']['min_s'] - res[n]['Knorm']['min_s']) * 1e3:.2f} ms, SnapKV "
              f"{(res[n]['Python SnapKV']['min_s'] - res[n]['SnapKV']['min_s']) * 1e3:.2f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"checkout": os.path.abspath(args.checkout), "repeat": args.repeat, "layer": res}, f, indent=1)


if __name__ == "__main__":
    main()
