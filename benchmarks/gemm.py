"""GEMM throughput of the CPU backend: C[m,n] = A[m,k] B[n,k]^T in fp32, through the C ABI (ctypes).

Columns (GFLOP/s = 2 m n k / time; time = the fastest of several calls, the median is in the JSON):
  builtin      the built-in blocked kernel (kvc_set_blas(NULL))
  openblas     OpenBLAS from scipy-openblas32 as kvpress_c calls it: single-threaded, our OpenMP
               threads each doing a slice of the columns (KVC_BLAS_MIN_M=1 forces it for every m)
  ob-native    the same library called directly with its own thread pool (reference only)
  default      kvc_kernel_matmul with OpenBLAS loaded, as `import kvpress_c` sets it up: the
               per-regime choice of kvc_cpu_matmul

Shapes: the default model (SmolLM2-135M: hidden 576, kv 192, ffn 1536, vocab 49152) at m = 1 (decode),
64, 512, 2048 (prefill chunks). Writes benchmarks/results/gemm.json.

    python benchmarks/gemm.py [--threads N] [--quick]
"""
import argparse
import ctypes as C
import json
import os
import platform
import statistics
import sys
import time

# numpy's own OpenBLAS must not keep a spinning thread pool next to ours
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from kvpress_c._paths import core_library_path, openblas_path  # noqa: E402

M_VALUES = [1, 64, 512, 2048]
NK = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


def load_core():
    lib = C.CDLL(os.environ.get("KVC_KERNELS_LIB") or core_library_path())
    F32P = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
    lib.kvc_kernel_matmul.argtypes = [F32P, F32P, F32P, C.c_int64, C.c_int64, C.c_int64]
    lib.kvc_set_blas.argtypes = [C.c_char_p, C.c_char_p]
    lib.kvc_blas_name.restype = C.c_char_p
    lib.kvc_last_error.restype = C.c_char_p
    lib.kvc_set_num_threads.argtypes = [C.c_int]
    return lib


def time_call(fn, flops, min_time=0.25, max_reps=50):
    fn()  # warm-up (page faults, thread pool start)
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return {"gflops": flops / min(times) / 1e9, "gflops_median": flops / statistics.median(times) / 1e9,
            "best_ms": min(times) * 1e3, "reps": len(times)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="threads (default: all cores)")
    ap.add_argument("--quick", action="store_true", help="m in {1, 64} only")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gemm.json"))
    args = ap.parse_args()

    lib = load_core()
    lib.kvc_set_num_threads(args.threads)
    threads = lib.kvc_get_num_threads()
    ob_path = openblas_path()
    ob = None
    if ob_path:
        ob = C.CDLL(ob_path)
        ob.scipy_cblas_sgemm.argtypes = [C.c_int] * 6 + [C.c_float, C.c_void_p, C.c_int, C.c_void_p, C.c_int,
                                                          C.c_float, C.c_void_p, C.c_int]
        ob.scipy_cblas_sgemm.restype = None
    else:
        print("scipy-openblas32 not installed: builtin only", file=sys.stderr)

    def use(mode):
        """Select an implementation; returns False if unavailable."""
        if mode == "builtin":
            return lib.kvc_set_blas(None, None) == 0
        if ob is None:
            return False
        if mode == "openblas":
            os.environ["KVC_BLAS_MIN_M"] = "1"  # read by kvc_set_blas
        else:
            os.environ.pop("KVC_BLAS_MIN_M", None)
        ok = lib.kvc_set_blas(ob_path.encode(), b"scipy_cblas_sgemm") == 0
        if mode == "ob-native":  # kvc_set_blas made it single-threaded: give it our thread count back
            ob.scipy_openblas_set_num_threads(threads)
        return ok

    rng = np.random.default_rng()
    modes = ["builtin", "openblas", "ob-native", "default"]
    results = []
    m_values = [1, 64] if args.quick else M_VALUES
    load_before = os.getloadavg()
    print(f"threads={threads}  GFLOP/s (best of several calls)")
    print(f"{'m':>5} {'n':>6} {'k':>5}" + "".join(f"{md:>11}" for md in modes))
    for m in m_values:
        for n, k in NK:
            a = rng.standard_normal((m, k), dtype=np.float32)
            b = rng.standard_normal((n, k), dtype=np.float32)
            c = np.zeros((m, n), dtype=np.float32)
            ref_row = a[-1].astype(np.float64) @ b.T.astype(np.float64)
            row = {"m": m, "n": n, "k": k}
            for mode in modes:
                if not use(mode):
                    continue
                if mode == "ob-native":
                    fn = lambda: ob.scipy_cblas_sgemm(101, 111, 112, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data,
                                                      k, 0.0, c.ctypes.data, n)
                else:
                    fn = lambda: lib.kvc_kernel_matmul(a, b, c, m, n, k)
                c[:] = np.nan
                row[mode] = time_call(fn, 2.0 * m * n * k)
                err = np.abs(c[-1] - ref_row).max() / np.abs(ref_row).max()
                if not err < 1e-5:
                    raise SystemExit(f"{mode} m={m} n={n} k={k}: wrong result (rel err {err:.2e})")
            os.environ.pop("KVC_BLAS_MIN_M", None)
            results.append(row)
            cells = "".join(f"{row[md]['gflops']:>11.1f}" if md in row else f"{'-':>11}" for md in modes)
            print(f"{m:>5} {n:>6} {k:>5}{cells}", flush=True)
    use("default")  # leave the library as kvpress_c would

    # the faster of builtin / openblas per m (geometric mean over the (n, k) shapes)
    choice = {}
    for m in m_values:
        rows = [r for r in results if r["m"] == m]
        gm = {md: float(np.exp(np.mean([np.log(r[md]["gflops"]) for r in rows]))) for md in ("builtin", "openblas")
              if all(md in r for r in rows)}
        choice[m] = {"geomean_gflops": gm, "faster": max(gm, key=gm.get)}
        print(f"m={m}: " + ", ".join(f"{md} {v:.1f}" for md, v in gm.items()) + f" -> {choice[m]['faster']}")
    out = {
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "threads": threads, "platform": platform.platform(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "openblas": ob_path, "modes": modes, "results": results, "choice": choice,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
